"""The decode step in one C++ call, for int4 models with per_block (W4A8) activations.

:func:`~gpt2mha.inference.generate.generate` decodes such a model (on the CPU, nothing hooked,
the kernels built) one token per row per step through ``torch.ops.gpt2mha.decode_step``
(``quant/step.cpp``): the embedding, every block (LayerNorm, the four W4A8 products, attention
over the row's own cached keys, GELU, the residual adds), ``ln_f`` and the int8 head, in one
call. The prompt's prefill stays the model's own forward.

Why: at batch 1 a 124M int4 step reads ~92 MB of weights, ~2.3 ms at this machine's memory
speed, and the rest of a step in Python or inductor's compiled code cost ~0.8 ms more (48
operator calls, the small ops between them, the wrapper), more than llama.cpp's whole margin
(benchmarks/RESULTS.md, "The decode step in one call"). The arithmetic is the model's: the same
W4A8 and int8 products (the same operators the model's layers call), LayerNorm, GPT-2's GELU
and the softmax in float32 with sums in other orders (logits within float32 rounding of the
model's own step; tests/test_native.py).

Source: the loop of gpt-fast's ``decode_one_token`` and llama.cpp's graph for GPT-2, with the
arithmetic of openai/gpt-2's ``model.py`` (``block``, ``attn``, ``norm``, ``gelu``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..core.kv_cache import KVCache
from .fast import hooked
from .quant import gemv
from .quant.linear import QuantizedLinear


def _why_not(model: nn.Module) -> str:
    """Why ``model`` cannot decode on the native step ("" when it can)."""
    if not gemv.available():
        return f"the C++ kernels are not built ({gemv.unavailable_reason()})"
    if not all(hasattr(model, name) for name in ("wte", "wpe", "h", "ln_f", "lm_head", "config")):
        return "not a GPT2"
    if model.wte.weight.device.type != "cpu" or model.wte.weight.dtype != torch.float32:
        return f"the model is {model.wte.weight.dtype} on {model.wte.weight.device}, not float32 on the CPU"
    if any(hooked(m) for m in model.modules()):
        return "the model has hooks attached"
    groups = set()
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if not (isinstance(layer, QuantizedLinear) and layer.scheme == "int4" and layer.activations == "per_block"
                    and layer.bias is not None):
                return "its blocks are not int4 with per_block activations"
            groups.add(layer.group_size)
        for norm in (block.ln_1, block.ln_2):
            if norm.weight is None or norm.bias is None:
                return "a LayerNorm has no weight or bias"
    head = model.lm_head
    if not (isinstance(head, QuantizedLinear) and head.scheme == "int8" and head.activations == "exact"):
        return "its head is not int8 with exact activations"
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(groups) != 1 or len(eps) != 1:
        return "its layers differ in group size or LayerNorm epsilon"
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    if any(t.dtype == torch.float64 or t.device.type != "cpu" for t in tensors):
        return "a tensor is not on the CPU or is float64"
    return ""


class NativeStep:
    """``model``'s decode step as one call of ``torch.ops.gpt2mha.decode_step`` (see the module's
    docstring). Holds the model's tensors (no copies but the head's float32 scales and the int4
    layers' (scale, zero) pairs in the kernel's layout).

    Call with ``token [B, 1]`` (int64) and a :class:`KVCache` of ``B`` rows with contiguous
    storage (row ``b``'s token goes at its cache index ``lengths[b]``, its position): writes every
    layer's keys and values there, advances the cache, returns float32 logits ``[B, n_vocab]``.

    Raises:
        ValueError: ``model`` cannot decode on it (:func:`native_step` says why).
        RuntimeError: from the operator, for a cache or token that does not fit (a row at
            ``T_max``, a token id past the vocabulary), naming it.
    """

    def __init__(self, model: nn.Module):
        why = _why_not(model)
        if why:
            raise ValueError(f"no native decode step for this model: {why}")
        layers = []
        for block in model.h:
            layers += [block.ln_1.weight, block.ln_1.bias]
            for i, layer in enumerate((block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)):
                if i == 2:
                    layers += [block.ln_2.weight, block.ln_2.bias]
                layers += [layer.weight.contiguous(), layer.gemv_scales(), layer.bias]
        self.layers = [t.detach() for t in layers]
        self.wte, self.wpe = model.wte.weight.detach(), model.wpe.weight.detach()
        self.ln_f = (model.ln_f.weight.detach(), model.ln_f.bias.detach())
        head = model.lm_head
        self.head = (head.weight.detach().contiguous(), head.gemv_scales(),
                     None if head.bias is None else head.bias.detach().float())
        self.group_size = model.h[0].attn.c_attn.group_size
        self.eps = float(model.ln_f.eps)

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = torch.ops.gpt2mha.decode_step(token.reshape(-1), self.wte, self.wpe, self.layers, *self.ln_f,
                                               *self.head, cache.k, cache.v, cache.lengths, self.group_size, self.eps)
        cache.advance(1)
        return logits


_steps: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, NativeStep]]" = weakref.WeakKeyDictionary()


def native_step(model: nn.Module) -> NativeStep | None:
    """``model``'s :class:`NativeStep`, or None where it has none (not an int4 per_block model
    with an int8 head, hooks attached, not float32 on the CPU, the kernels not built). Made on
    first use and kept while the model lives; made again when any parameter or buffer was
    replaced or written in place since."""
    quantization = getattr(model, "quantization", None) or {}
    if quantization.get("scheme") != "int4" or quantization.get("activations") != "per_block" or not gemv.available():
        return None                                            # (asked every generate call: cheap first)
    if any(hooked(m) for m in model.modules()):                # asked every call: hooks come and go
        return None
    from .compiled import _signature
    sig = _signature(model)
    kept = _steps.get(model)
    if kept is not None and kept[0] == sig:
        return kept[1]
    if _why_not(model):
        return None
    step = NativeStep(model)
    _steps[model] = (sig, step)
    return step
