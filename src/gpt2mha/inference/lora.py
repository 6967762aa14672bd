"""LoRA adapters applied unmerged, at run time: several over one base model, each row of a batch
with its own (the server's ``--lora name=DIR``, requests picking one by ``model``).

:func:`apply_lora` swaps each targeted layer of the model (``h.{i}.attn.c_attn``, ``c_proj``,
``mlp.c_fc``, ``mlp.c_proj``, ``lm_head``) for a :class:`LoraLinear` holding the original layer
as ``base`` and every adapter's ``A``, ``B`` and scale (:class:`~gpt2mha.io.lora.LoraAdapter`);
its forward is ``base(x)``, plus for the batch rows whose adapter has this layer
``scale · (x @ Aᵀ) @ Bᵀ``, computed in float32 whatever the base (a bf16 or quantized base
gets the adapter in float, its own product unchanged). Which adapter each batch row takes is the
model's :class:`LoraState` (``model.lora_state``): the engine sets it before each prefill and
decode step from the adapter each slot was opened with (:meth:`~gpt2mha.inference.engine.Engine.open`);
:func:`using` sets one adapter for every row (offline ``generate``).

Batch invariance: a row's adapter product never depends on the other rows. On the CPU in
float32 it runs on gpt2mha's fixed-order kernels (:func:`~gpt2mha.inference.dense.conv1d`,
the same bits for a row in a call of any size); elsewhere each row alone. With a
batch-invariant decode view for the base (``batch_invariant=True``), a sequence's tokens are
then bitwise those it gets alone, whatever adapters run beside it. A row of the base model adds
nothing: its numbers are the base model's own.

The decode view (:func:`~gpt2mha.inference.fast.for_decoding`) swaps the ``base`` inside each
wrapper as it swaps a plain layer; the native forward and the compiled step do not run wrapped
models (their checks see the wrapper), so a model with adapters decodes on the view.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..io.lora import LoraAdapter, check_adapter, read_adapter
from .quant import gemv

#: The adapter index of "no adapter": the base model's own numbers.
BASE = -1


class LoraState:
    """Which adapter each batch row of the next forward takes.

    Attributes:
        names: the adapters' names, by index.
        rows: one index per batch row (:data:`BASE` for none), or None: every row ``default``.
        default: the index every row takes when ``rows`` is None (:func:`using` sets it).
    """

    def __init__(self, names: list[str]):
        self.names, self.rows, self.default = list(names), None, BASE

    def index(self, name: str | None) -> int:
        """The index of adapter ``name`` (None: :data:`BASE`).

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        if name is None:
            return BASE
        if name not in self.names:
            raise ValueError(f"adapter={name!r} is not loaded; this model has {self.names}")
        return self.names.index(name)

    def of_rows(self, n: int) -> list[int]:
        """The adapter of each of ``n`` batch rows."""
        if self.rows is None:
            return [self.default] * n
        if len(self.rows) != n:
            raise RuntimeError(f"the LoRA selection names {len(self.rows)} rows for a batch of {n}")
        return self.rows


class LoraLinear(nn.Module):
    """A layer with LoRA adapters beside it: ``base`` (a Conv1D, a quantized linear, an LM or
    classifier head: ``[..., in]`` → ``[..., out]``), and for adapter ``a`` ``A_t[a] [in, r]``,
    ``B_t[a] [r, out]`` (float32, contiguous: Conv1D's layout of ``Aᵀ``, ``Bᵀ``) and
    ``scale[a]``. The output is ``base(x)``, plus ``scale · (x @ A_t) @ B_t`` on the batch rows
    (dim 0 of ``x``) whose adapter has this layer, in float32, added in float32 and returned in
    ``base(x)``'s dtype. Inference only."""

    def __init__(self, base: nn.Module, state: LoraState):
        super().__init__()
        self.base, self.state = base, state
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (what readers of ``lm_head.weight`` expect)."""
        return self.base.weight

    def add(self, index: int, A: torch.Tensor, B: torch.Tensor, scale: float) -> None:
        """Adapter ``index``'s ``A [r, in]``, ``B [out, r]`` and scale for this layer."""
        self.adapters[index] = (A.t().float().contiguous(), B.t().float().contiguous(), float(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.state.of_rows(x.shape[0])
        if not any(r in self.adapters for r in rows):
            return y
        out = y.float() if y.dtype != torch.float32 else y.clone()
        for index in sorted(set(rows) & set(self.adapters)):
            picked = [b for b, r in enumerate(rows) if r == index]
            A_t, B_t, scale = self.adapters[index]
            xs = x[picked].reshape(-1, x.shape[-1]).float()                 # [m·T, in]
            delta = lora_product(xs, A_t, B_t) * scale                       # [m·T, out]
            out[picked] = out[picked] + delta.view(len(picked), *x.shape[1:-1], -1)
        return out.to(y.dtype)


def lora_product(x: torch.Tensor, A_t: torch.Tensor, B_t: torch.Tensor) -> torch.Tensor:
    """``(x @ A_t) @ B_t`` for ``x [M, in]`` float32 with every row's bits independent of the
    other rows: gpt2mha's fixed-order kernels on the CPU (:func:`~gpt2mha.inference.dense.conv1d`),
    else one row at a time."""
    if x.device.type == "cpu" and gemv.available() and not (torch.is_grad_enabled() and x.requires_grad):
        from .dense import conv1d
        return conv1d(conv1d(x.contiguous(), A_t), B_t)
    return torch.cat([(x[i:i + 1] @ A_t) @ B_t for i in range(x.shape[0])])


def apply_lora(model: nn.Module, adapters: dict, book_config: dict | None = None) -> LoraState:
    """Give ``model`` (a :class:`~gpt2mha.core.model.GPT2`, float or quantized) the adapters
    ``{name: LoraAdapter or path}`` (paths read by :func:`~gpt2mha.io.lora.read_adapter`),
    unmerged: each targeted layer becomes a :class:`LoraLinear`; returns ``model.lora_state``
    (every row the base model until the engine or :func:`using` picks an adapter).

    Raises:
        ValueError: no adapters, names that are empty or already loaded, an adapter that brings
            a head of its own (a PEFT SEQ_CLS ``score``: merge it instead).
        CheckpointError: an adapter that does not fit the model
            (:func:`~gpt2mha.io.lora.check_adapter`).
    """
    if not adapters:
        raise ValueError("adapters is empty; give {name: adapter directory or file}")
    if getattr(model, "lora_state", None) is not None:
        raise ValueError(f"this model already has adapters {model.lora_state.names}; load them all in one call")
    read = {}
    for name, adapter in adapters.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name {name!r} must be a non-empty string")
        adapter = adapter if isinstance(adapter, LoraAdapter) else read_adapter(str(adapter), book_config)
        if adapter.head is not None:
            raise ValueError(f"adapter {name!r} ({adapter.source}) brings its own classifier head (score); it cannot "
                             f"share a base model unmerged: merge it (GPT2.from_pretrained(base, lora=...))")
        head = model.lm_head.weight if "lm_head" in adapter.base_copies else None
        check_adapter(adapter, model.config, head)
        read[name] = adapter
    state = LoraState(list(read))
    for index, adapter in enumerate(read.values()):
        for target, layer in adapter.layers.items():
            wrapper = model.get_submodule(target)
            if not isinstance(wrapper, LoraLinear):
                wrapper = LoraLinear(wrapper, state)
                parent, _, child = target.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, wrapper)
            wrapper.add(index, layer.A, layer.B, layer.scale)
    model.lora_state = state
    return state


@contextlib.contextmanager
def using(model: nn.Module, name: str | None):
    """``with using(model, "name"):`` every row of every forward in the block takes adapter
    ``name`` (None: the base model), unless the engine picks one per slot; restored after.

    Raises:
        ValueError: the model has no adapters, or none of that name.
    """
    state = getattr(model, "lora_state", None)
    if state is None:
        raise ValueError("this model has no LoRA adapters (apply_lora, or serve --lora name=DIR)")
    before = state.default
    state.default = state.index(name)
    try:
        yield state
    finally:
        state.default = before


def merged_model(model: nn.Module) -> nn.Module:
    """A new plain model (``model``'s class, float32, eval mode) with the adapter ``model``'s
    state selects for every row (its ``default``: the one :func:`using` names, else none) merged
    into the weights (:func:`~gpt2mha.io.lora.merge_state_dict`): what a tool that reads weights
    directly (the explainer, ``check-model``) is given for a model with adapters.

    Raises:
        ValueError: a quantized base (merge into the float model instead).
    """
    from ..io.lora import LoraLayer, merge_state_dict
    from ..io.state_dicts import model_from_state_dict

    if getattr(model, "quantization", None):
        raise ValueError("the base model is quantized: adapters merge into float weights; load the float model with "
                         "lora=PATH instead")
    state, wrappers = model.lora_state, {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    sd = {k.replace(".base.", "."): v.detach().float() for k, v in model.state_dict().items()}   # the base's names
    layers = {name: LoraLayer(w.adapters[state.default][0].t(), w.adapters[state.default][1].t(),
                              w.adapters[state.default][2]) for name, w in wrappers.items()
              if state.default in w.adapters}
    sd, config = merge_state_dict(sd, model.config, LoraAdapter(layers, "the model's adapters"))
    return model_from_state_dict(sd, config, "the merged model", model_cls=type(model))


def select(model: nn.Module, adapters: list[int | None]) -> None:
    """Set the adapter of each batch row of the model's next forward (what the engine does):
    ``None`` entries take the state's default; a model without adapters is left alone."""
    state = getattr(model, "lora_state", None)
    if state is not None:
        state.rows = None if all(a is None for a in adapters) else [
            state.default if a is None else a for a in adapters]
