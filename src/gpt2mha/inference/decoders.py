"""The routes a model's tokens run on: one :class:`Decoder` interface, three implementations,
and one function (:func:`choose_decoder`) that picks the route for a model and says why.

A decoder prefills one prompt into one row of a :class:`~gpt2mha.core.kv_cache.KVCache` and
runs one decode step over the rows of a cache (each row its newest token, at its own position,
attending to its own keys); both return float32 logits of each row's last token. The engine
(:mod:`~gpt2mha.inference.engine`) drives one decoder for ``generate()`` and for the server
alike, so a route chosen for a model is the route both take.

- :class:`ViewDecoder`: the model's own forward through its decode view
  (:func:`~gpt2mha.inference.fast.for_decoding`): every model, hooks act, batch invariant
  where the view pads its float32 products (``batch_invariant``; on by default for all but
  float32 weights).
- :class:`CompiledDecoder`: the decode step compiled by inductor (``compile=True``,
  :mod:`~gpt2mha.inference.compiled`); prefill eager; gives up batch invariance; no hooks.
- :class:`NativeDecoder`: the forward in one C++ call (:mod:`~gpt2mha.inference.native`) for
  int8 per_row and int4 per_block models; batch invariant (each row's attention and products
  read only that row); no hooks: while a hook is attached the engine takes the view instead.

Source: vLLM's model runner / gpt-fast's ``decode_one_token`` (one step function chosen once).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.kv_cache import KVCache
from .fast import for_decoding, global_hooks, invariant_by_default

VIEW, COMPILED, NATIVE = "decode view", "compiled step", "native forward"


class Decoder:
    """What the engine calls. Subclasses set :attr:`name`, :attr:`batch_invariant` (a row's
    logits are bitwise those of the row alone), :attr:`runs_hooks` (hooks attached to the model
    act), :attr:`fixed_batch` (each step runs every row of the cache: one shape) and
    :attr:`reads_masked_keys` (a step reads keys past a row's length, masked: they must hold
    finite numbers).

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` in eval mode.
    """

    name = ""
    batch_invariant = False
    runs_hooks = False
    fixed_batch = False
    reads_masked_keys = False

    def __init__(self, model: nn.Module):
        self.model = model

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Prompt ``ids [1, T]`` into the one-row ``cache`` (from its length on): logits ``[1, V]``."""
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token a row, ``tokens [n, 1]``, over the ``n`` rows of ``cache``: logits ``[n, V]``."""
        raise NotImplementedError

    def cache_len(self, needed: int) -> int:
        """Cache positions to allocate for ``needed`` (a compiled step rounds them up)."""
        return needed


class ViewDecoder(Decoder):
    """The model's forward through its decode view (``batch_invariant``: None for
    :func:`~gpt2mha.inference.fast.invariant_by_default`)."""

    name = VIEW
    runs_hooks = True

    def __init__(self, model: nn.Module, batch_invariant: bool | None = None):
        super().__init__(model)
        self.batch_invariant = invariant_by_default(model) if batch_invariant is None else batch_invariant
        self.view = for_decoding(model, batch_invariant=self.batch_invariant)

    def prefill(self, ids, cache):
        return self.view(ids, cache=cache, last_only=True, validate=False).logits[:, -1]

    def step(self, tokens, cache):
        return self.view(tokens, cache=cache, last_only=True, validate=False).logits[:, -1]


class CompiledDecoder(Decoder):
    """Steps through :func:`~gpt2mha.inference.compiled.compiled_decoder`; prompts through the
    decode view. Every step runs every row (one compiled shape).

    Raises:
        ValueError: as :func:`~gpt2mha.inference.compiled.compiled_decoder` (hooks, not CPU,
            tensor parallel).
    """

    name = COMPILED
    fixed_batch = True
    reads_masked_keys = True

    def __init__(self, model: nn.Module, batch_invariant: bool | None = None):
        from .compiled import compiled_decoder
        super().__init__(model)
        self.compiled = compiled_decoder(model, batch_invariant)
        self.view = self.compiled.step.view

    def prefill(self, ids, cache):
        return self.view(ids, cache=cache, last_only=True, validate=False).logits[:, -1]

    def step(self, tokens, cache):
        return self.compiled(tokens, cache)

    def cache_len(self, needed: int) -> int:
        from .compiled import cache_len
        return cache_len(needed, self.model.config.n_ctx)


class NativeDecoder(Decoder):
    """Steps and prompts of ``native.prefill_from`` tokens or more in one C++ call each
    (:class:`~gpt2mha.inference.native.NativeStep`); shorter prompts take the model's own
    products through a decode view that swaps nothing but the attention (no weight copied)."""

    name = NATIVE
    batch_invariant = True

    def __init__(self, model: nn.Module, native):
        super().__init__(model)
        self.native = native
        self.view = for_decoding(model, head=False, conv1d=False)     # shares every weight: no copy

    def prefill(self, ids, cache):
        if self.native.prefill is not None and ids.shape[1] >= self.native.prefill_from:
            return self.native(ids, cache)
        return self.view(ids, cache=cache, last_only=True, validate=False).logits[:, -1]

    def step(self, tokens, cache):
        return self.native(tokens, cache)


class Route:
    """The decoder chosen for a model and why the others were not (:func:`choose_decoder`).

    Attributes:
        decoder: the :class:`Decoder` to run.
        why_not: ``{route name: reason}`` for each route not taken.
    """

    def __init__(self, decoder: Decoder, why_not: dict[str, str]):
        self.decoder, self.why_not = decoder, why_not

    def describe(self) -> str:
        """One line a log or ``gpt2mha info`` prints: the route of prefill and of decode, and why
        not the others."""
        d = self.decoder
        prefill = "the native forward" if d.name == NATIVE and d.native.prefill is not None else \
            ("the model's own products (its decode view's attention)" if d.name == NATIVE else "the decode view")
        others = "; ".join(f"not the {name}: {why}" for name, why in self.why_not.items())
        return (f"decode: the {d.name} ({'batch invariant' if d.batch_invariant else 'not batch invariant'}); "
                f"prefill: {prefill}" + (f"; {others}" if others else ""))


def choose_decoder(model: nn.Module, compile: bool = False, batch_invariant: bool | None = None) -> Route:
    """The route for ``model``: the compiled step when ``compile`` (it refuses what it cannot
    run), else the native forward where the model has one
    (:func:`~gpt2mha.inference.native.why_not` says why not), else the decode view.

    Raises:
        ValueError: ``compile`` for a model the compiled step cannot run (hooks, not CPU,
            tensor parallel).
    """
    from .native import native_step, why_not
    if compile:
        return Route(CompiledDecoder(model, batch_invariant), {NATIVE: "compile was asked for"})
    why = {COMPILED: "compile was not asked for (compile=True, --compile)"}
    native = native_step(model)
    if native is not None:
        return Route(NativeDecoder(model, native), {**why, VIEW: "the native forward runs this model"})
    why[NATIVE] = why_not(model) or "hooks are attached"
    return Route(ViewDecoder(model, batch_invariant), why)


def hook_watch(model: nn.Module):
    """A function giving which of ``model``'s modules have hooks attached now: a tuple of their
    positions (``(-1,)`` for hooks registered for every module), empty when none. Its modules
    and their hook dicts (each module keeps the same ``_forward_hooks`` and
    ``_forward_pre_hooks`` objects for its life; registering a hook adds to them) are listed
    once, so the common answer, no hooks, is one ``any`` over those dicts in C: ~4 µs a call
    for an int4 124M of 359 modules (the loop over the modules in Python: ~26 µs)."""
    modules = list(model.modules())
    dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]

    def hooked_now() -> tuple[int, ...]:
        if global_hooks():
            return (-1,)
        if not any(dicts):
            return ()
        return tuple(i for i, m in enumerate(modules) if m._forward_hooks or m._forward_pre_hooks)
    return hooked_now
