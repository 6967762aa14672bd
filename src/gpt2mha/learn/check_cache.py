"""The cached step of ``gpt2mha check``: running a learner's module on the first tokens, then on
the rest with what it cached, whichever common convention its ``forward`` follows.

:func:`cached_step` tries a returned ``present`` fed back (OpenAI's ``past``, transformers'
legacy ``layer_past``/``past_key_values``), a cache object filled in place (the learner's own
``*Cache`` class, transformers' ``Cache`` interface as :class:`HFStyleCache`, a dict, a list)
and a cache kept in the module (``use_cache=True``, ``start_pos``).
"""

from __future__ import annotations

import copy
import inspect as pyinspect
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .check_load import ForwardArgs, forward_args
from .check_stages import Run, run_module


class HFStyleCache:
    """An empty cache with the part of transformers' ``Cache`` interface attention layers call:
    ``update(key_states, value_states, layer_idx, cache_kwargs=None)`` appends ``[b, h, T, hd]``
    keys and values on the token axis (-2) and returns everything stored for that layer;
    ``get_seq_length(layer_idx=0)``, ``get_usable_length``, ``len()`` and ``cache[layer_idx]``
    → ``(keys, values)``. Source: transformers ``cache_utils.DynamicCache``."""

    def __init__(self):
        self.key_cache: dict[int, torch.Tensor] = {}
        self.value_cache: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx=0, cache_kwargs=None):
        if layer_idx in self.key_cache:
            key_states = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        self.key_cache[layer_idx], self.value_cache[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx=0) -> int:
        return self.key_cache[layer_idx].shape[-2] if layer_idx in self.key_cache else 0

    def get_usable_length(self, new_seq_length=0, layer_idx=0) -> int:
        return self.get_seq_length(layer_idx)

    def __len__(self) -> int:
        return len(self.key_cache)

    def __getitem__(self, layer_idx):
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def _fingerprint(obj, depth: int = 3):
    """What identifies the contents of ``obj`` (tensors by identity, shape and version; containers
    and plain objects by their items), so an in-place write into it is noticed."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), tuple(obj.shape), None if obj.is_inference() else obj._version)
    if isinstance(obj, (bool, int, float, str, type(None))):
        return obj
    if depth == 0 or isinstance(obj, nn.Module) or callable(obj) and not hasattr(obj, "__dict__"):
        return ("object", id(obj))
    if isinstance(obj, dict):
        return ("dict", tuple((repr(k), _fingerprint(v, depth - 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("list", tuple(_fingerprint(v, depth - 1) for v in obj))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return ("object", type(obj).__name__, _fingerprint(vars(obj), depth - 1))
    return ("object", id(obj))


def _module_state(module: nn.Module):
    """Fingerprint of what a module keeps between calls: its buffers and plain attributes
    (``self.cache_k``, ``self.ptr_current_pos`` ...), in every submodule."""
    return tuple((name, _fingerprint({k: v for k, v in vars(m).items() if not k.startswith("_") or k == "_buffers"}))
                 for name, m in module.named_modules())


def _fresh(module: nn.Module) -> nn.Module:
    """A deep copy (so a cache kept in the module does not touch the module checked), or the
    module itself when it cannot be copied."""
    try:
        return copy.deepcopy(module)
    except Exception:
        return module


def position_kwargs(fa: ForwardArgs, start: int, T: int, b: int, names=None) -> dict:
    """Values of forward's position arguments for ``T`` tokens starting at position ``start``."""
    out = {}
    for name in (fa.positions if names is None else names):
        pos = torch.arange(start, start + T)
        out[name] = start if fa.positions[name] == "int" else (pos.expand(b, T) if name == "position_ids" else pos)
    return out


def plain_kwargs(module: nn.Module, T: int, b: int) -> dict:
    """Arguments a plain (uncached) forward needs besides x: required positions, at 0."""
    fa = forward_args(module)
    return position_kwargs(fa, 0, T, b, fa.required_positions)


#: Constructor argument names of a cache class, and which size fills them.
CACHE_CLASS_ARGS = {"batch_size": "b", "max_batch_size": "b", "batch": "b", "b": "b", "bsz": "b",
                    "max_seq_len": "S", "max_seq_length": "S", "max_len": "S", "max_length": "S", "seq_len": "S",
                    "context_length": "S", "max_cache_len": "S", "n_heads": "h", "num_heads": "h", "n_head": "h",
                    "n_kv_heads": "h", "num_kv_heads": "h", "head_dim": "hd", "d_head": "hd"}


def _annotation_classes(annotation) -> list[type]:
    import typing
    if isinstance(annotation, type):
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in _annotation_classes(arg)]


def _cache_factories(module: nn.Module, fa: ForwardArgs, sizes: dict) -> list[tuple[str, object]]:
    """Empty caches to hand forward's cache argument, each ``(description, factory)``: the class
    its annotation names and the ``*Cache*`` classes defined beside the module (built with no
    arguments, or with the sizes their required arguments name, :data:`CACHE_CLASS_ARGS`), an
    :class:`HFStyleCache`, a dict, a list."""
    classes = [c for c in _annotation_classes(fa.annotation)
               if c.__module__ not in ("builtins", "torch", "typing") and not issubclass(c, (nn.Module, torch.Tensor))]
    home = sys.modules.get(type(module).__module__)
    if home is not None:
        classes += [c for c in vars(home).values() if isinstance(c, type) and "cache" in c.__name__.lower()
                    and c.__module__ == home.__name__ and not issubclass(c, (nn.Module, torch.Tensor))
                    and c not in classes]
    out = []
    for c in classes:
        try:
            params = [p for p in pyinspect.signature(c).parameters.values()
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if all(sizes.get(CACHE_CLASS_ARGS.get(p.name.lower())) is not None for p in params):
            args = {p.name: sizes[CACHE_CLASS_ARGS[p.name.lower()]] for p in params}
            shown = ", ".join(f"{k}={v}" for k, v in args.items())
            out.append((f"a {c.__name__}({shown}) filled in place", lambda c=c, args=args: c(**args)))
    out += [("a cache object with transformers' Cache interface (update(k, v, layer_idx)) filled in place",
             HFStyleCache), ("a dict filled in place", dict), ("a list filled in place", list)]
    return out


@dataclass
class CacheResult:
    """The cached step: ``status`` "tested" (``step`` is the run of the new tokens), "failed"
    (forward raised on it), "untested" (forward takes a cache the check could not use) or
    "none" (forward takes no cache); ``text`` says which and how the cache was passed."""

    status: str
    text: str
    step: Run | None = None


def cached_step(module: nn.Module, x: torch.Tensor, P: int, num_heads: int | None = None,
                head_dim: int | None = None) -> CacheResult:
    """Run ``module`` on the first ``P`` tokens of ``x [b, P + T, d_in]``, then on the last T
    with what it cached, trying each common convention on a fresh copy of the module:

    * returned: ``out, present = m(x1[, flag=True])``, then ``m(x2, cache=present)`` (OpenAI's
      ``past``, transformers' legacy ``layer_past``/``past_key_values`` with ``use_cache``);
    * filled in place: the same cache object passed to both calls (:func:`_cache_factories`:
      a ``*Cache`` class of the user's, transformers' Cache interface, a dict, a list);
    * kept in the module: a flag (``use_cache=True``) or positions (``start_pos``) and no cache
      argument, the module's own state changing between calls (the book's KV-cache chapter,
      llama's ``cache_k``).

    A convention counts when the first call stored something (a present returned, the object
    or the module changed); position arguments get ``0`` then ``P``. ``num_heads``/``head_dim``
    fill a cache class's constructor arguments of those names.
    """
    fa = forward_args(module)
    b, S, _ = x.shape
    T = S - P
    if not fa.takes_cache:
        return CacheResult("none", "not tested (forward takes no cache argument)")
    if P == 0:
        return CacheResult("untested", f"not tested (--past 0), although forward takes {', '.join(fa.names())}")
    flag = {fa.flag: True} if fa.flag else {}
    attempts = []                                               # (description, kind, factory)
    if fa.cache:
        attempts.append((f"{fa.cache}=present", "returned", None))
        sizes = {"b": b, "S": S, "h": num_heads, "hd": head_dim}
        attempts += [(f"{fa.cache} = {d}", "in place", f) for d, f in _cache_factories(module, fa, sizes)]
    else:
        attempts.append(((f"{fa.flag}=True" if fa.flag else ", ".join(fa.positions)) + ", the cache kept in the module",
                         "module", None))
    tried, failed = [], None
    for what, kind, factory in attempts:
        m = _fresh(module)
        container = factory() if factory else None
        first_kw = {**flag, **position_kwargs(fa, 0, P, b)}
        step_kw = {**flag, **position_kwargs(fa, P, T, b)}
        if kind == "in place":
            first_kw[fa.cache] = step_kw[fa.cache] = container
        before = _fingerprint(container) if kind == "in place" else _module_state(m)
        first = run_module(m, x[:, :P], **first_kw)
        if first.error is not None:
            tried.append(f"{what}: forward on the first {P} tokens raised {type(first.error).__name__}: {first.error}")
            continue
        if kind == "returned":
            took = first.present is not None
            step_kw[fa.cache] = first.present
        else:
            took = (_fingerprint(container) if kind == "in place" else _module_state(m)) != before
        if not took:
            tried.append(f"{what}: the first {P} tokens " + ("returned no present" if kind == "returned"
                                                             else "stored nothing"))
            continue
        step = run_module(m, x[:, P:], **step_kw)
        if step.error is None and step.output is not None:
            return CacheResult("tested", f"tested: {P} past tokens, then {T} new ones with {what}", step)
        failed = failed or (what, step.error)
        tried.append(f"{what}: forward on the new tokens raised {type(step.error).__name__}: {step.error}")
    if failed is not None:
        what, error = failed
        return CacheResult("failed", f"failed: forward with {what} raised {type(error).__name__}: {error}")
    return CacheResult("untested", f"not tested: forward takes {', '.join(fa.names())} but no way of passing a cache "
                                   f"worked (tried {'; '.join(tried)})")

