"""Prompt log-probabilities (``echo`` with ``logprobs``: lm-evaluation-harness's
``loglikelihood``) on products that give every prompt row the bits it has alone, so that a
prompt scored after blocks of it taken from the prefix cache gets the bits of the prompt
scored whole.

The native forward, which the prefix cache serves prefills on, computes logits at a prompt's
last token only; scoring needs them at every position. :class:`Scorer` runs the model's own
forward through a view of it (:func:`~gpt2mha.inference.fast.swap_modules`: the same
parameters, nothing copied) in which every piece gives a row the bits it has alone, whatever
the number of rows in the call and the position it starts at:

- float32, bf16 and fp16 Conv1Ds and heads: gpt2mha's fixed-order products
  (:mod:`~gpt2mha.inference.dense`: ``conv1d_f32``/``_bf16``/``_f16`` and ``linear_*``, each
  output summed in one order whatever the rows);
- quantized layers and heads: called with one token per sequence (``[M, 1, n_in]``), so they
  take the kernels a decode step takes, batch invariant by design
  (:meth:`~gpt2mha.inference.quant.linear.QuantizedLinear.dequantize_for` counts tokens per
  sequence, not rows);
- attention: gpt2mha's causal attention kernel for every call (T queries over the S >= T keys
  of the row's cache, each query's keys summed in one order; 16-bit q, k and v widened to
  float32, exactly);
- LayerNorm, GELU and the residual adds: torch's, row by row.

:meth:`Scorer.hidden` writes every layer's keys and values into a one-row KVCache and returns
each new position's final hidden state (``ln_f``'s output); :meth:`Scorer.head` gives the logits
of any rows of those. Measured on a 2-core AVX2 CPU with 1 and 2 threads: a 500-token prompt
scored whole and as a prefix then a suffix of 1 to 499 tokens gave bitwise equal hidden states,
keys and values for float32, bf16, fp16, int8 ``per_row`` and int4 ``per_block`` models
(``tests/test_prefix_cache.py``). The engine measures it again on its machine before it lets a
scored prompt take blocks from the store (:meth:`~gpt2mha.inference.engine.Engine.score`).
Against the model's own forward the logits differ by float rounding (sums in other orders:
~1e-6 relative for float32).

Source: the batch-invariant products of this package (docs/explanation/batch-invariance.md)
applied along the prompt; lm-evaluation-harness's ``loglikelihood`` over OpenAI's ``echo``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.attention import CausalSelfAttention, Conv1D
from ..core.model import LMHead, TiedLMHead
from . import dense
from .fast import retyped, swap_modules
from .quant import gemv
from .quant.linear import QuantizedLinear


class RowAloneConv1D(nn.Module):
    """A float32, bf16 or fp16 :class:`~gpt2mha.core.attention.Conv1D` (its weight and bias,
    shared) on :func:`~gpt2mha.inference.dense.conv1d`: ``[..., n_in]`` → ``[..., n_out]`` in
    the input's dtype, each row's bits its own. Inference only."""

    def __init__(self, conv: Conv1D):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        bias = self.conv.bias
        y = dense.conv1d(x.reshape(-1, x.shape[-1]).float(), self.conv.weight, None if bias is None else bias.float(),
                         gelu)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class RowAloneQuantized(nn.Module):
    """A :class:`~gpt2mha.inference.quant.linear.QuantizedLinear` (layer or head) called with one
    token per sequence, ``[M, 1, n_in]``: the decode step's kernels, whose rows never depend on
    each other. ``[..., n_in]`` → ``[..., n_out]``. Inference only."""

    def __init__(self, layer: QuantizedLinear):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        rows = x.reshape(-1, 1, x.shape[-1])
        y = self.layer(rows, gelu=True) if gelu else self.layer(rows)
        return y.view(*x.shape[:-1], -1)


class RowAloneHead(nn.Module):
    """An :class:`~gpt2mha.core.model.LMHead` (float32, bf16 or fp16 weight, shared) on
    :func:`~gpt2mha.inference.dense.linear`: ``[..., n_embd]`` → float32 ``[..., n_vocab]``."""

    def __init__(self, head: LMHead):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x.reshape(-1, x.shape[-1]).float(), self.head.weight).view(*x.shape[:-1], -1)


class RowAloneAttention(CausalSelfAttention):
    """A :class:`~gpt2mha.core.attention.CausalSelfAttention` (the same parameters) that attends
    every call by ``torch.ops.gpt2mha.causal_attention`` (OpenAI's bottom-right causal mask over
    a row's own cached keys) in float32. Made by :class:`Scorer` for one-row caches without
    hooks; anything else is refused."""

    def attend(self, q, k, v, mask, hooked: bool) -> torch.Tensor:
        if mask is not None or hooked:
            raise ValueError("the scoring forward attends one row over its own keys, unhooked")
        return torch.ops.gpt2mha.causal_attention(q.float(), k.float(), v.float()).to(q.dtype)


class Hidden(nn.Module):
    """Stands in for the head in :class:`Scorer`'s view: the model's "logits" are then ``ln_f``'s
    output, which :meth:`Scorer.head` turns into logits for the rows asked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def why_not(model: nn.Module) -> str:
    """Why :class:`Scorer` cannot run ``model`` ("" where it can): the kernels not built, a
    tensor off the CPU, a head_dim that is not a multiple of 8, LoRA adapters applied, or a
    layer or head that is neither a contiguous float32/bf16/fp16 Conv1D or LMHead nor quantized."""
    if not gemv.available():
        return f"the C++ kernels are not built ({gemv.unavailable_reason()})"
    if getattr(model, "lora_state", None) is not None:
        return "LoRA adapters are applied"
    if any(t.device.type != "cpu" for t in model.parameters()):
        return "a tensor is not on the CPU"
    c = model.config
    if (c.n_embd // c.n_head) % 8:
        return f"head_dim={c.n_embd // c.n_head} is not a multiple of 8 (the attention kernel's vectors)"
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if not isinstance(layer, QuantizedLinear) and not (
                    type(layer) is Conv1D and layer.weight.dtype in dense._OPS and layer.weight.is_contiguous()):
                return f"a layer is a {type(layer).__name__} ({getattr(layer, 'weight', torch.empty(0)).dtype})"
    head = model.lm_head
    if not isinstance(head, QuantizedLinear) and not (
            type(head) in (LMHead, TiedLMHead) and head.weight.dtype in dense._OPS and head.weight.is_contiguous()):
        return f"the head is a {type(head).__name__}"
    return ""


class Scorer:
    """``model``'s forward with every row's bits its own (see the module's docstring): a view
    sharing every parameter, so a weight written in place is read as it is now; made again
    when a module is replaced (the engine compares model signatures).

    Attributes:
        differs: the engine's measurement on this scorer: "" (a prompt scored after stored
            blocks has the bits of the prompt scored whole), why not, or None (not measured).

    Raises:
        ValueError: ``model`` cannot run on it (:func:`why_not` says why).
    """

    def __init__(self, model: nn.Module):
        why = why_not(model)
        if why:
            raise ValueError(f"no scoring forward for this model: {why}")

        def replace(path: str, m: nn.Module) -> nn.Module | None:
            if m is model.lm_head:
                return Hidden()
            if isinstance(m, QuantizedLinear):
                return RowAloneQuantized(m)
            if type(m) is Conv1D:
                return RowAloneConv1D(m)
            return None

        def after(m: nn.Module) -> nn.Module | None:
            return retyped(m, RowAloneAttention) if type(m) is CausalSelfAttention else None
        with torch.no_grad():
            self.view = swap_modules(model, replace, after)
        head = model.lm_head
        self._head = RowAloneQuantized(head) if isinstance(head, QuantizedLinear) else RowAloneHead(head)
        self.differs: str | None = None

    def hidden(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Tokens ``ids [1, T]`` after those the one-row ``cache`` holds: every layer's keys and
        values written there (the cache advanced), and each new position's final hidden state
        ``[T, n_embd]`` in the model's dtype."""
        return self.view(ids, cache=cache, validate=False).logits[0]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[R, n_vocab]`` of hidden states ``[R, n_embd]`` (each row's alone)."""
        return self._head(hidden).float()
