"""The GPT-2 model around the attention: config, MLP, pre-norm block, embeddings, tied head.

Follows ``model`` in openai/gpt-2 ``src/model.py`` (and the GPT-2 paper, section 2.3):
``h = wte[idx] + wpe[positions]``; per block ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``;
``ln_f``; logits ``h @ wteᵀ``. Parameter names are OpenAI's / Hugging Face's, so a checkpoint
loads by copying keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .attention import ATTN_IMPLS, CausalSelfAttention, Conv1D, as_bool_mask, combine_masks
from .attention import attention_mask as causal_mask
from .kv_cache import KVCache
from .quantize import Snapshot, current_copy, stamp, transposed_copy

TOKENIZERS = ("gpt2", "bytes")
_DECODING_LOCK = threading.Lock()                               # guards GPT2.decoding()'s copies

# The LM head always computes and returns float32 logits (float64 for a float64 model): a
# bf16/fp16 model runs ln_f in its own dtype, then ``x.float() @ wte.float()ᵀ``. Rounding the
# logits themselves to bf16's 8 significant bits flips near-ties: on the built-in model over
# 8,192 held-out bytes, bf16 top-1 agreement with fp32 is 98.86% with bf16 logits and 99.08%
# with float32 ones (fp16: 99.83% → 99.88%). On CPU the float32 head over the transposed copy
# that :meth:`GPT2.decoding` takes is also faster than bf16's own kernel (5.3 vs 8.5 ms for one
# row of 50257×768: bf16 matrix-vector kernels stream at half float32's rate on this machine).
def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits a model with parameters in ``dtype`` returns (float32 or float64)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class GPT2Config:
    """GPT-2 hyperparameters with OpenAI's names (``hparams.json``).

    Attributes:
        n_vocab: vocabulary size (50257 for GPT-2 BPE, 256 for bytes).
        n_ctx: context length (positions in wpe).
        n_embd: model width; n_head: heads (must divide n_embd); n_layer: blocks.
        embd_pdrop, attn_pdrop, resid_pdrop: dropout probabilities in [0, 1) (training only).
        layer_norm_epsilon: LayerNorm epsilon (1e-5 in GPT-2).
        tokenizer: ``"gpt2"`` (BPE) or ``"bytes"``; which tokenizer the weights expect.
        tie_word_embeddings: the LM head is ``wte`` itself (GPT-2). False gives the model a
            separate ``lm_head.weight [n_vocab, n_embd]``, as transformers'
            ``tie_word_embeddings=false`` (fine-tunes that untied it).

    Raises:
        ValueError: on non-positive sizes, n_embd not divisible by n_head, dropout outside
            [0, 1) or an unknown tokenizer.
    """

    n_vocab: int = 50257
    n_ctx: int = 1024
    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    tokenizer: str = "gpt2"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for name in ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon={self.layer_norm_epsilon} must be positive")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer={self.tokenizer!r}; expected one of {TOKENIZERS}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings={self.tie_word_embeddings!r} must be True or False")

    @property
    def head_dim(self) -> int:
        """Width of one head, ``n_embd // n_head`` (64 in every released GPT-2)."""
        return self.n_embd // self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPT2Config":
        """One of :data:`PRESETS` (``"124M"``, ``"355M"``, …), with fields overridden.

        Raises:
            ValueError: unknown preset name (the message lists the known ones).
        """
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is unknown; expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


#: GPT-2 paper, Table 2 (n_layer / n_head / n_embd), n_vocab 50257, n_ctx 1024; plus small
#: presets for tests and the built-in model.
PRESETS: dict[str, GPT2Config] = {
    "124M": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "355M": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "774M": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "1558M": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    "tiny": GPT2Config(n_vocab=256, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes"),
    # the built-in model: ~10 epochs on 2 CPU cores; dropout off (it costs ~50% of the step time on CPU
    # and barely regularises a 2.7M-parameter model this short a run)
    "shakespeare": GPT2Config(n_vocab=256, n_ctx=256, n_embd=192, n_head=6, n_layer=6, tokenizer="bytes",
                              embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0),
}
PRESETS["gpt2"], PRESETS["gpt2-medium"] = PRESETS["124M"], PRESETS["355M"]
PRESETS["gpt2-large"], PRESETS["gpt2-xl"] = PRESETS["774M"], PRESETS["1558M"]


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_proj(gelu_tanh(c_fc(x)))``, ``[B, T, n_embd]`` → same.

    ``c_fc.weight [n_embd, 4·n_embd]``, ``c_proj.weight [4·n_embd, n_embd]`` (Conv1D layout).
    Source: ``mlp`` and ``gelu`` in openai/gpt-2 ``src/model.py``.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)
        self.dropout = config.resid_pdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)                                        # [B, T, 4·n_embd]
        if torch.is_grad_enabled() or not _output_is_private(self.c_fc):
            h = F.gelu(h, approximate="tanh")
        else:                                                   # inference: GELU over c_fc's own output,
            h = torch.ops.aten.gelu_(h, approximate="tanh")     # one [B, T, 4·n_embd] buffer fewer at peak
        return F.dropout(self.c_proj(h), self.dropout, self.training)


def _output_is_private(module: nn.Module) -> bool:
    """Whether ``module``'s output is surely a new tensor nobody else holds, so it may be
    overwritten: a plain :class:`Conv1D` (not a subclass, wrapper or patched ``forward``) with
    no forward hook of its own or global, and no torch function or dispatch mode that could
    record it."""
    return (type(module) is Conv1D and "forward" not in module.__dict__ and not module._forward_hooks
            and not nn.modules.module._global_forward_hooks and not torch._C._is_torch_function_mode_enabled()
            and _get_current_dispatch_mode() is None)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Source: ``block`` in openai/gpt-2 ``src/model.py``; ``[B, T, n_embd]`` in and out.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, config.attn_pdrop, config.resid_pdrop)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, past=None, attn_mask=None, need_weights=False):
        """Returns ``(x, present)`` (or ``(x, present, weights)``), as :class:`CausalSelfAttention`."""
        a, present, *w = self.attn(self.ln_1(x), past, attn_mask, need_weights)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return (x, present, *w)

    def forward_cached(self, x, cache: KVCache, layer: int, attn_mask=None):
        """The block over a preallocated cache; returns ``x [B, T, n_embd]``."""
        x = x + self.attn.forward_cached(self.ln_1(x), cache, layer, attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Output(NamedTuple):
    """``logits [B, T, n_vocab]`` (T = 1 with ``last_only``) and ``present
    [B, n_layer, 2, n_head, T, head_dim]`` (None when a :class:`KVCache` was used)."""

    logits: torch.Tensor
    present: torch.Tensor | None


class GPT2(nn.Module):
    """GPT-2 language model (``GPT2LMHeadModel``-compatible weights and outputs).

    Modules: ``wte [n_vocab, n_embd]``, ``wpe [n_ctx, n_embd]``, ``h`` (n_layer :class:`Block`),
    ``ln_f``; the LM head is tied to ``wte`` (GPT-2), or with ``config.tie_word_embeddings=False``
    a separate ``lm_head.weight [n_vocab, n_embd]`` (:meth:`output_weight` returns whichever).

    Args:
        config: a :class:`GPT2Config`.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.n_vocab, config.n_embd)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.n_embd, config.n_vocab, bias=False)   # weight [n_vocab, n_embd]
        self.init_weights()

    def output_weight(self) -> torch.Tensor:
        """The LM head's weight ``[n_vocab, n_embd]``: ``wte.weight`` when tied (GPT-2), else
        ``lm_head.weight``. Logits are ``ln_f(x) @ output_weight()ᵀ``."""
        return self.wte.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2 initialisation: normal(0, 0.02) weights (wpe 0.01), zero biases, unit LayerNorm,
        and the residual projections (``attn.c_proj``, ``mlp.c_proj``) scaled by
        ``1/√(2·n_layer)`` (GPT-2 paper, section 2.3)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name or name.startswith("ln_f"):
                    p.fill_(1.0)
                else:
                    std = std_resid if name.endswith("c_proj.weight") else 0.01 if name == "wpe.weight" else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    @property
    def attn_impl(self) -> str:
        """The attention core every layer uses: ``"sdpa"`` or ``"explicit"`` (settable)."""
        return self.h[0].attn.attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={value!r}; expected one of {ATTN_IMPLS}")
        for block in self.h:
            block.attn.attn_impl = value

    def num_parameters(self) -> int:
        """Number of parameters (wte counted once when the head is tied to it)."""
        return sum(p.numel() for p in self.parameters())

    # ----------------------------------------------------------------------------- checks
    def _check_device(self, name: str, t: torch.Tensor) -> None:
        """A tensor argument must be on the model's device (a ``meta`` tensor, or a CPU tensor for
        a CUDA model, would otherwise fail deep inside torch)."""
        device = self.wte.weight.device
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model is on {device}; move it with "
                             f"{name}.to({str(device)!r})")

    def _check_inputs(self, idx, past_len, attention_mask, position_ids):
        if not isinstance(idx, torch.Tensor):
            raise ValueError(f"idx must be a tensor of token ids [B, T] (int64); got {type(idx).__name__}"
                             + ("; encode text first, e.g. get_tokenizer(model.config.tokenizer).encode(text)"
                                if isinstance(idx, str) else ""))
        if idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx must hold token ids as int64 (or int32); got dtype {idx.dtype}"
                             + (" (uint8 reads as bytes 0-255 but is not accepted as ids: use idx.long())"
                                if idx.dtype == torch.uint8 else ""))
        if idx.dim() != 2:
            raise ValueError(f"idx has shape {tuple(idx.shape)}; expected [B, T]"
                             + (" (one sequence: idx[None])" if idx.dim() == 1 else ""))
        self._check_device("idx", idx)
        B, T = idx.shape
        if T == 0 or B == 0:
            raise ValueError(f"idx has shape {(B, T)}; need at least one sequence and one token")
        if past_len + T > self.config.n_ctx:
            raise ValueError(f"idx has {T} tokens after {past_len} cached ones: {past_len + T} > n_ctx={self.config.n_ctx}")
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.config.n_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"idx contains token id {bad}, outside the vocabulary [0, n_vocab={self.config.n_vocab})")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise ValueError(f"attention_mask must be a tensor [B={B}, past + T={past_len + T}] of 1 (real) / "
                                 f"0 (pad); got {type(attention_mask).__name__}")
            if tuple(attention_mask.shape) != (B, past_len + T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected [B={B}, past + T="
                                 f"{past_len + T}] covering the {past_len} cached and {T} new tokens")
            self._check_device("attention_mask", attention_mask)
            as_bool_mask(attention_mask, "attention_mask")     # bool or 0/1 values, as every mask
        if position_ids is not None:
            if not isinstance(position_ids, torch.Tensor):
                raise ValueError(f"position_ids must be a tensor [B={B}, T={T}] of int64 positions; got "
                                 f"{type(position_ids).__name__}")
            if position_ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"position_ids must hold positions as int64 (or int32); got dtype {position_ids.dtype}"
                                 + (" (use position_ids.long())" if position_ids.dtype != torch.bool else ""))
            if tuple(position_ids.shape) not in ((B, T), (1, T), (T,)):
                raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected [B={B}, T={T}]")
            self._check_device("position_ids", position_ids)
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= self.config.n_ctx:
                raise ValueError(f"position_ids must be in [0, n_ctx={self.config.n_ctx}); got {lo if lo < 0 else hi}")

    def _check_past(self, past, B):
        c = self.config
        if not isinstance(past, torch.Tensor) or not past.is_floating_point():
            raise ValueError(f"past must be a floating-point tensor [B, n_layer, 2, n_head, P, head_dim]; got "
                             f"{past.dtype if isinstance(past, torch.Tensor) else type(past).__name__}")
        expected = (B, c.n_layer, 2, c.n_head, None, c.head_dim)
        names = ("batch", "n_layer", "2 (k, v)", "n_head", "P", "head_dim")
        if past.dim() != 6:
            raise ValueError(f"past has shape {tuple(past.shape)}; expected [B, n_layer, 2, n_head, P, head_dim]")
        for name, e, s in zip(names, expected, past.shape):
            if e is not None and e != s:
                raise ValueError(f"past has shape {tuple(past.shape)}: {name} is {s}, expected {e} "
                                 f"([B={B}, n_layer={c.n_layer}, 2, n_head={c.n_head}, P, head_dim={c.head_dim}])")
        self._check_device("past", past)

    # ---------------------------------------------------------------------------- forward
    def embed(self, idx, past_len, attention_mask=None, position_ids=None):
        """``wte[idx] + wpe[positions]`` → ``[B, T, n_embd]``. Positions start at ``past_len``,
        or come from ``attention_mask`` (``cumsum - 1``, pads clamped to 0) when given.
        No checks here (``forward`` validates explicit ``position_ids``), so no per-step sync."""
        T = idx.shape[1]
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past_len, past_len + T, device=idx.device)
        x = self.wte(idx) + self.wpe(position_ids)
        return F.dropout(x, self.config.embd_pdrop, self.training)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``ln_f`` then the tied LM head: ``[B, T, n_embd]`` → logits ``[B, T, n_vocab]``, float32.

        ``F.linear(ln_f(x), W)`` with ``W = output_weight()`` (wte when tied) computed in float32
        whatever the model's dtype (see :func:`logits_dtype`: bf16/fp16 logits are not rounded to
        the model's precision; under ``torch.autocast`` the autocast dtype wins). Inside
        :meth:`decoding`, when no gradient for W is wanted, it reads the float32
        ``[n_embd, n_vocab]`` copy of W taken on entry (same numbers, faster for a few rows on
        CPU, no upcast per step).
        """
        x = self.ln_f(x)
        quantized = self._modules.get("quantized_head")
        if quantized is not None:                               # after quantize(): the int8 head
            return quantized(x).to(logits_dtype(x.dtype))
        w = self.output_weight()
        head_t = current_copy(self._lm_head, w)                # decoding()'s copy, if still of this wte
        if head_t is not None and not (torch.is_grad_enabled() and w.requires_grad):
            return x.to(head_t.dtype) @ head_t                  # [B, T, n_embd] @ [n_embd, n_vocab]
        acc = logits_dtype(w.dtype)
        return F.linear(x.to(acc), w.to(acc))

    #: Let :meth:`decoding` keep a transposed float32 copy of wte for the head (one more copy of
    #: wte in float32 while decoding, 154 MB for 124M; set False on an instance to keep the memory).
    transpose_lm_head: bool = True
    #: Let :meth:`decoding` give every Conv1D of a bf16/fp16 model on CPU an ``[out, in]`` copy
    #: of its weight (one more copy of the block weights while decoding, 170 MB for 124M in bf16;
    #: set False on an instance to keep the memory).
    transpose_conv1d: bool = True
    _lm_head: Snapshot | None = None
    _decoding: int = 0                                          # decoding() blocks open (nested, threads)

    def lm_head_weight(self) -> torch.Tensor:
        """A new ``[n_embd, n_vocab]`` copy of :meth:`output_weight` in the logits' dtype (no grad):
        contiguous on CPU (``x @ W`` streams it fastest there, built by
        :func:`~gpt2mha.attention.transposed_copy`), a transposed view elsewhere.
        """
        w = self.output_weight().detach()
        acc = logits_dtype(w.dtype)
        if w.device.type != "cpu":
            return w.to(acc).t()
        return transposed_copy(w, acc)

    def __getstate__(self):
        state = dict(super().__getstate__())
        for name in ("_lm_head", "_decoding"):                # decoding()'s copy stays with that block
            state.pop(name, None)
        return state

    @contextlib.contextmanager
    def decoding(self):
        """The block ``generate`` decodes in, with weight copies in the layouts that are fastest
        for ``[B, n_embd]`` inputs (measured on CPU, benchmarks/RESULTS.md):

        - the LM head reads a float32 ``[n_embd, n_vocab]`` copy of wte (:meth:`lm_head_weight`):
          5.3 vs 7.1 ms for one row of 124M in float32, 12.3 vs 23.5 ms for 8, and a bf16/fp16
          model skips upcasting wte at every step (8.5 ms for bf16's own kernel). No copy on
          other devices for a float32 model.
        - for a bf16/fp16 model on CPU, every Conv1D multiplies by an ``[out, in]`` copy of its
          weight (:attr:`~gpt2mha.attention.Conv1D.weight_t`): torch's reduced-precision
          kernels read that layout up to 1.4× faster (a bf16 124M step: 27 vs 33 ms at batch 1,
          40 vs 47 ms at batch 8). A float32 model keeps GPT-2's ``[in, out]``, its fastest.

        The copies live only while a block is open: a nested block, or a block opened by another
        thread meanwhile, reuses them, and the last block to close frees them (so concurrent
        ``generate`` calls on one model each read the same copies from start to end). They are
        taken afresh when no block is open, so they can never be stale across blocks whatever
        changed the weights. A quantized model takes no copies (its layers already hold the
        kernels' layouts, :mod:`gpt2mha.quantize`). Inside
        the block a copy is used only while its weight is the very tensor it was taken from and
        unchanged by version counter, dtype and storage (:class:`~gpt2mha.attention.Snapshot`),
        so in-place updates, ``load_state_dict``, ``.half()``, ``torch.func.functional_call``
        and pruning hooks fall back to the weights themselves. Writes through ``.data`` and fused
        optimizers bump no counter: do not make them inside the block. Where autograd wants a
        weight's gradient, the original is read. The model's parameters are never touched.
        """
        with _DECODING_LOCK:                                    # threads: one set of copies, the last out frees it
            if not self._decoding:
                self._take_copies()
            self._decoding += 1
        try:
            yield self
        finally:
            with _DECODING_LOCK:
                self._decoding -= 1
                if not self._decoding:
                    self._drop_copies()

    def _take_copies(self) -> None:
        """The copies :meth:`decoding` uses; nothing is left behind if taking them fails."""
        try:
            w = None if self._modules.get("quantized_head") is not None else self.output_weight()
            if (self.transpose_lm_head and w is not None
                    and (w.device.type == "cpu" or logits_dtype(w.dtype) != w.dtype)):
                self._lm_head = Snapshot(self.lm_head_weight(), w, stamp(w))
            if self.transpose_conv1d:
                for m in self.modules():
                    if (isinstance(m, Conv1D) and isinstance(m.weight, torch.Tensor) and m.weight.device.type == "cpu"
                            and m.weight.dtype in (torch.bfloat16, torch.float16)):
                        m.keep_transposed()
        except BaseException:
            self._drop_copies()
            raise

    def _drop_copies(self) -> None:
        self._lm_head = None
        for m in self.modules():
            if isinstance(m, Conv1D):
                m.drop_transposed()

    # ------------------------------------------------------------------ quantization
    #: ``{"scheme": "int8" | "int4", "group_size": …}`` once :meth:`quantize` ran (or a quantized
    #: checkpoint was loaded); None for a float model.
    quantization: dict | None = None

    def quantize(self, scheme: str, group_size: int | None = None, method: str = "gptq",
                 calibration=None) -> "GPT2":
        """Weight-only quantize the model in place for fast CPU inference; returns the model.

        ``"int8"``: symmetric, one scale per output channel; ``"int4"``: a scale and a zero per
        group of ``group_size`` inputs (default 32). Every block Conv1D and the LM head (int8 in
        both schemes; a tied head as a separate copy whose dequantized values the embedding
        lookup reads) are quantized; the attention itself is untouched. ``method="gptq"`` (the
        default) rounds the weights by GPTQ on ``calibration`` text or token ids (None: the
        packaged Shakespeare sample), ``"rtn"`` rounds to nearest. int8 products are exact
        integer products of the weights with 16-bit activations; int4 runs PyTorch's int4 CPU
        kernel on bf16 activations. See :func:`gpt2mha.quantize.quantize_model` for the details,
        the per-tensor error report (``model.quantization_report``) and the errors it raises
        (unknown scheme or method, bad group size or calibration, quantizing twice). A quantized
        model is for inference: ``.train()`` raises; ``save_pretrained``/``from_pretrained``
        store and restore it.
        """
        from .quantize import quantize_model
        return quantize_model(self, scheme, group_size, method, calibration)

    def train(self, mode: bool = True) -> "GPT2":
        """As ``nn.Module.train``; raises ValueError for a quantized model (train the float one)."""
        if mode and self.quantization:
            raise ValueError(f"this model is quantized ({self.quantization['scheme']}): its weights are rounded integers "
                             f"and cannot be trained; train the float model, then quantize it")
        return super().train(mode)

    def forward(self, idx: torch.Tensor, past: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                *, cache: KVCache | None = None, last_only: bool = False) -> GPT2Output:
        """Logits for ``idx`` given an optional cache.

        Args:
            idx: token ids ``[B, T]`` (int64), each in ``[0, n_vocab)``.
            past: OpenAI's cache ``[B, n_layer, 2, n_head, P, head_dim]`` or None.
            attention_mask: ``[B, P + T]`` of 1 (real) / 0 (pad), covering cached and new
                tokens; when given without ``position_ids`` positions follow the mask.
            position_ids: ``[B, T]`` explicit positions.
            cache: a :class:`KVCache` to read and write in place instead of ``past``; checked
                against the model and idx first (:meth:`KVCache.check`).
            last_only: compute logits for the last position only (decode).

        Returns:
            :class:`GPT2Output` ``(logits [B, T, n_vocab], present [B, n_layer, 2, n_head, T,
            head_dim])``; logits are float32 for float32/bf16/fp16 models (see
            :func:`logits_dtype`), present is in the model's dtype and None when ``cache`` is used.

        Raises:
            ValueError: naming the argument: bad idx (not a tensor, rank, dtype, ids outside
                the vocab, longer than n_ctx with the past), a past of the wrong shape or not
                floating point, a cache that is not a KVCache or does not fit, a mask that is not
                a tensor, of the wrong length or with values other than 0/1, position_ids that
                are not an integer tensor of the right shape within [0, n_ctx), any tensor on
                another device than the model's, or a last_only that is not a bool.
        """
        B = idx.shape[0] if isinstance(idx, torch.Tensor) and idx.dim() == 2 else None
        if past is not None and cache is not None:
            raise ValueError("pass either past or cache, not both")
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache; got {type(cache).__name__} (a SlotCache is driven "
                             f"through GPT2.step by the serving scheduler)")
        if not isinstance(last_only, bool):
            raise ValueError(f"last_only={last_only!r} must be True or False")
        if past is not None:
            self._check_past(past, B)
        past_len = cache.length if cache is not None else (past.shape[4] if past is not None else 0)
        self._check_inputs(idx, past_len, attention_mask, position_ids)
        if cache is not None:
            c, p = self.config, self.wte.weight
            cache.check(idx.shape[0], idx.shape[1], c.n_layer, c.n_head, c.head_dim, p.dtype, p.device)
            return GPT2Output(self.step(idx, cache, attention_mask, position_ids, last_only=last_only), None)
        T = idx.shape[1]
        x = self.embed(idx, past_len, attention_mask, position_ids)
        mask = None
        if attention_mask is not None:
            mask = combine_masks(causal_mask(T, past_len + T, device=x.device), attention_mask)
        presents = []
        for i, block in enumerate(self.h):
            x, present = block(x, None if past is None else past[:, i], mask)
            presents.append(present)
        presents = torch.stack(presents, dim=1)                 # [B, n_layer, 2, h, T, head_dim]
        if last_only:
            x = x[:, -1:]
        return GPT2Output(self.head(x), presents)

    def step(self, idx: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, *, last_only: bool = True) -> torch.Tensor:
        """The forward over a :class:`KVCache` without :meth:`forward`'s checks (the decode step).

        For loops that already know their inputs are valid (``generate`` feeds back ids it
        sampled from ``n_vocab`` logits, within the length it checked up front): nothing here
        reads a tensor's values on the host, so a step costs only the model's own work.

        Args: as :meth:`forward`; ``idx [B, T]`` continues the ``cache.length`` cached tokens.
            ``attention_mask`` may also be a ready bool mask ``[B, 1, T, S]`` over the keys the
            cache returns, used as is (with ``position_ids``; for a
            :class:`~gpt2mha.kv_cache.SlotCache` whose rows have different lengths).

        Returns:
            logits ``[B, 1, n_vocab]`` (``last_only``, the default) or ``[B, T, n_vocab]``.
        """
        T = idx.shape[1]
        x = self.embed(idx, cache.length, attention_mask, position_ids)   # [B, T, n_embd]
        mask = None
        if attention_mask is not None and attention_mask.dim() == 4:   # a ready key mask [B, 1, T, S]
            mask = attention_mask                                       # (per-row lengths: SlotCache)
        elif attention_mask is not None:
            mask = combine_masks(causal_mask(T, cache.length + T, device=x.device), attention_mask)
        for i, block in enumerate(self.h):
            x = block.forward_cached(x, cache, i, mask)
        cache.advance(T)
        return self.head(x[:, -1:] if last_only else x)          # [B, 1 or T, n_vocab]

    # ------------------------------------------------------------------ loading / generation
    @classmethod
    def from_pretrained(cls, name_or_dir: str, **kwargs) -> "GPT2":
        """Load a built-in model name, a local Hugging Face GPT-2 directory, or a hub id.

        Keyword arguments go to :func:`gpt2mha.checkpoints.load_pretrained`, e.g.
        ``dtype=torch.bfloat16`` for the parameters' dtype; see it for the details and errors.
        """
        from .checkpoints import load_pretrained
        return load_pretrained(name_or_dir, model_cls=cls, **kwargs)

    def save_pretrained(self, directory: str, **kwargs) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``GPT2LMHeadModel`` loads.

        See :func:`gpt2mha.checkpoints.save_pretrained`.
        """
        from .checkpoints import save_pretrained
        save_pretrained(self, directory, **kwargs)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, **kwargs) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx [B, T]``; returns ``[B, T + max_new_tokens]``.

        ``temperature=0`` is greedy. See :func:`gpt2mha.generate.generate` for all options.
        """
        from .generate import generate
        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, **kwargs)

