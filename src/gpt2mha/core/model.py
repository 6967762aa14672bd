"""The GPT-2 model around the attention: config, MLP, pre-norm block, embeddings, LM head.

Follows ``model`` in openai/gpt-2 ``src/model.py`` (and the GPT-2 paper, section 2.3):
``h = wte[idx] + wpe[positions]``; per block ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``;
``ln_f``; logits ``h @ wteᵀ``. Parameter names are OpenAI's / Hugging Face's, so a checkpoint
loads by copying keys. One forward serves training, OpenAI's ``past``/``present`` and the
preallocated :class:`~gpt2mha.core.kv_cache.KVCache`; nothing in it depends on how the model
is run fast (weight copies, quantized or sharded layers are swapped in from outside,
:mod:`gpt2mha.inference`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .attention import ATTN_IMPLS, CausalSelfAttention, Conv1D, combine_masks
from .attention import attention_mask as causal_mask
from .hooks import HookPoint, name_hook_points
from .kv_cache import CacheStep, KVCache

TOKENIZERS = ("gpt2", "bytes")


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits a model with parameters in ``dtype`` returns (float32 or float64).

    A bf16/fp16 model runs ``ln_f`` in its own dtype, then its head in float32: rounding the
    logits themselves to bf16's 8 significant bits flips near-ties between the top tokens.
    """
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
        checks.positive_ints(n_vocab=self.n_vocab, n_ctx=self.n_ctx, n_embd=self.n_embd, n_head=self.n_head,
                             n_layer=self.n_layer)
        checks.divisible(self.n_embd, self.n_head)
        checks.dropout_p(embd_pdrop=self.embd_pdrop, attn_pdrop=self.attn_pdrop, resid_pdrop=self.resid_pdrop)
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



class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, ``weight``/``bias [n_embd]``) whose output passes
    through the capture point ``hook_normalized`` ``[B, T, n_embd]`` (after the weight and bias:
    what the next layer reads).

    Two more points, computed only while a hook is attached to one of them (the norm is then
    written out, the same numbers to float rounding): ``hook_scale [B, T, 1]``, the divisor
    ``sqrt(var(x) + eps)``, and ``hook_standardized [B, T, n_embd]``, ``(x - mean(x)) / scale``
    before the weight and bias (TransformerLens 4's ``hook_scale`` and ``hook_normalized``).

    Source: ``norm`` in openai/gpt-2 ``src/model.py`` (biased variance, epsilon 1e-5).
    """

    def __init__(self, n_embd: int, eps: float = 1e-5):
        super().__init__(n_embd, eps=eps)
        self.hook_normalized = HookPoint()
        self.hook_scale, self.hook_standardized = HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hook_scale.has_hooks() or self.hook_standardized.has_hooks():
            acc = torch.promote_types(x.dtype, torch.float32)
            xc = x.to(acc) - x.to(acc).mean(dim=-1, keepdim=True)
            scale = self.hook_scale((xc.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt())
            y = self.hook_standardized(xc / scale) * self.weight + self.bias
            return self.hook_normalized(y.to(x.dtype))
        return self.hook_normalized(super().forward(x))


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_proj(gelu_tanh(c_fc(x)))``, ``[B, T, n_embd]`` → same.

    ``c_fc.weight [n_embd, 4·n_embd]``, ``c_proj.weight [4·n_embd, n_embd]`` (Conv1D layout).
    Capture points: ``hook_pre`` (c_fc's output) and ``hook_post`` (after GELU), ``[B, T, 4·n_embd]``.
    Source: ``mlp`` and ``gelu`` in openai/gpt-2 ``src/model.py``.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)
        self.dropout = config.resid_pdrop
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hook_pre(self.c_fc(x))                         # [B, T, 4·n_embd]
        h = self.hook_post(F.gelu(h, approximate="tanh"))
        return F.dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Capture points on the residual stream ``[B, T, n_embd]``: ``hook_resid_pre``,
    ``hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_out``, ``hook_resid_post``.
    Source: ``block`` in openai/gpt-2 ``src/model.py``.
    """

    def __init__(self, config: GPT2Config, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, config.attn_pdrop, config.resid_pdrop,
                                        layer_idx=layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.hook_resid_pre, self.hook_attn_out, self.hook_resid_mid = HookPoint(), HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    def forward(self, x, past=None, attn_mask=None, *, cache=None, step=None):
        """``x [B, T, n_embd]`` → ``(x, present)``, as :class:`CausalSelfAttention` (same arguments)."""
        x = self.hook_resid_pre(x)
        a, present = self.attn(self.ln_1(x), past, attn_mask, cache=cache, step=step)
        x = self.hook_resid_mid(x + self.hook_attn_out(a))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln_2(x))))
        return x, present


class LMHead(nn.Module):
    """The language-model head: logits ``x @ weightᵀ``, ``[B, T, n_embd]`` → ``[B, T, n_vocab]``,
    computed and returned in float32 whatever the model's dtype (float64 for float64,
    :func:`logits_dtype`; under ``torch.autocast`` the autocast dtype wins).

    Its own ``weight [n_vocab, n_embd]`` (a model with ``tie_word_embeddings=False``); GPT-2's
    tied head is :class:`TiedLMHead`.
    """

    def __init__(self, n_embd: int, n_vocab: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_vocab, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = logits_dtype(self.weight.dtype)
        return F.linear(x.to(acc), self.weight.to(acc))


class TiedLMHead(LMHead):
    """GPT-2's head, tied to the token embedding: ``weight`` *is* ``wte.weight`` (read through a
    reference to the embedding, not a parameter of its own, so the model's state dict holds the
    tensor once, as ``wte.weight``, the way GPT-2 checkpoints store it).

    Source: ``model`` in openai/gpt-2 ``src/model.py`` (``logits = h @ wteᵀ``).
    """

    def __init__(self, wte: nn.Embedding):
        nn.Module.__init__(self)
        self.__dict__["wte"] = wte                              # a reference, not a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self.wte.weight


class GPT2Output(NamedTuple):
    """``logits [B, T, n_vocab]`` (T = 1 with ``last_only``) and ``present
    [B, n_layer, 2, n_head, T, head_dim]`` (None when a :class:`KVCache` was used)."""

    logits: torch.Tensor
    present: torch.Tensor | None


class GPT2(nn.Module):
    """GPT-2 language model (``GPT2LMHeadModel``-compatible weights and outputs).

    Modules: ``wte [n_vocab, n_embd]``, ``wpe [n_ctx, n_embd]``, ``h`` (n_layer :class:`Block`),
    ``ln_f``, ``lm_head`` (:class:`TiedLMHead`, reading ``wte.weight`` as GPT-2 does, or an
    :class:`LMHead` of its own with ``config.tie_word_embeddings=False``). Capture points ``hook_embed`` and
    ``hook_pos_embed`` ``[B, T, n_embd]``, then those of every block and ``ln_f.hook_normalized``.

    Args:
        config: a :class:`GPT2Config`.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.n_vocab, config.n_embd)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = TiedLMHead(self.wte) if config.tie_word_embeddings else LMHead(config.n_embd, config.n_vocab)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.init_weights()
        name_hook_points(self)

    def output_weight(self) -> torch.Tensor:
        """The LM head's weight ``[n_vocab, n_embd]`` (``wte.weight`` when tied)."""
        return self.lm_head.weight

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

    def check_inputs(self, idx, past, attention_mask, position_ids, cache, last_only=False) -> None:
        """Everything :meth:`forward` takes, checked before any work (:mod:`~gpt2mha.core.checks`).

        Raises:
            ValueError: naming the argument (see :meth:`forward`).
        """
        c = self.config
        checks.token_ids(idx, c.n_vocab, on=self.wte.weight.device)
        checks.flag(last_only, "last_only")
        B, T = idx.shape
        if past is not None and cache is not None:
            raise ValueError("pass either past or cache, not both")
        if past is not None:
            checks.past(past, B, c.n_layer, c.n_head, c.head_dim, on=self.wte.weight.device)
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ValueError(f"cache must be a KVCache; got {type(cache).__name__}")
            p = self.wte.weight
            cache.check(B, T, c.n_layer, c.n_head, c.head_dim, p.dtype, p.device)
        past_len = past.shape[4] if past is not None else cache.length if cache is not None else 0
        if past_len + T > c.n_ctx:
            raise ValueError(f"idx has {T} tokens after {past_len} cached ones: {past_len + T} > n_ctx={c.n_ctx}")
        if attention_mask is not None:
            if isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) != (B, past_len + T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected [B={B}, past + T="
                                 f"{past_len + T}] covering the {past_len} cached and {T} new tokens")
            checks.like_idx(attention_mask, "attention_mask", idx, ((B, past_len + T),), integer=False)
        if position_ids is not None:
            checks.like_idx(position_ids, "position_ids", idx, ((B, T), (1, T), (T,)), integer=True)
            if int(position_ids.min()) < 0 or int(position_ids.max()) >= c.n_ctx:
                raise ValueError(f"position_ids must be in [0, n_ctx={c.n_ctx}); got {int(position_ids.min())} … "
                                 f"{int(position_ids.max())}")

    def forward(self, idx: torch.Tensor, past: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                *, cache: KVCache | None = None, step: CacheStep | None = None,
                last_only: bool = False, validate: bool = True) -> GPT2Output:
        """Logits for ``idx`` after the tokens an optional ``past`` or ``cache`` holds.

        Args:
            idx: token ids ``[B, T]`` (int64), each in ``[0, n_vocab)``.
            past: OpenAI's cache ``[B, n_layer, 2, n_head, P, head_dim]`` or None.
            attention_mask: ``[B, P + T]`` of 1 (real) / 0 (pad), covering cached and new
                tokens; when given without ``position_ids`` positions follow the mask.
            position_ids: ``[B, T]`` explicit positions.
            cache: a :class:`KVCache` read and written in place instead of ``past`` (rows may
                hold different lengths: each row's new tokens go after its own).
            step: the cache's plan for this call (default ``cache.plan(T)``); a step planned
                with a fixed ``span`` keeps every decode step's shapes the same (torch.compile).
            last_only: compute logits for the last position only (decode).
            validate: check the arguments first (:meth:`check_inputs`); loops that checked their
                inputs once (``generate``'s decode steps) pass False.

        Returns:
            :class:`GPT2Output` ``(logits [B, T, n_vocab], present [B, n_layer, 2, n_head, T,
            head_dim])``; logits are float32 for float32/bf16/fp16 models (see
            :func:`logits_dtype`), present is in the model's dtype and None when ``cache`` is used.

        Raises:
            ValueError: naming the argument: bad idx (not a tensor, rank, dtype, ids outside
                the vocab, longer than n_ctx with the past), a past of the wrong shape or not
                floating point, a cache that is not a KVCache or does not fit, a mask or
                positions of the wrong type, dtype, shape or values, any tensor on another
                device than the model's, or a last_only that is not a bool.
        """
        if validate and not torch.compiler.is_compiling():
            self.check_inputs(idx, past, attention_mask, position_ids, cache, last_only)
            attention_mask = checks.bool_mask(attention_mask, "attention_mask")
        B, T = idx.shape
        if past is not None:                                    # OpenAI's past: a cache for this call
            cache = KVCache.from_past(past, past.shape[4] + T, dtype=self.wte.weight.dtype)
        if cache is not None and step is None:
            step = cache.plan(T)
        if position_ids is None and attention_mask is not None:  # left padding: count real tokens
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        elif position_ids is None:
            position_ids = step.positions(B, T, idx.device) if step else torch.arange(T, device=idx.device)
        mask = None                                             # the cache's own plan (step), or causal
        if attention_mask is not None:                          # key padding over cached + new tokens
            S = attention_mask.shape[1]
            mask = step.mask if step else None
            mask = combine_masks(causal_mask(T, S, device=idx.device) if mask is None else mask, attention_mask)
        pos = self.wpe(position_ids)                            # [T, n_embd], [1, T, …] or [B, T, …]
        if self.hook_pos_embed.has_hooks():                  # a hook sees [B, T, n_embd], as the docs say
            pos = self.hook_pos_embed(pos.expand(B, T, -1))
        x = self.hook_embed(self.wte(idx)) + pos
        x = F.dropout(x, self.config.embd_pdrop, self.training)   # [B, T, n_embd]
        presents = []
        for block in self.h:
            x, present = block(x, None, mask, cache=cache, step=step)
            presents.append(present)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.ln_f(x))                     # [B, T, n_vocab]
        if past is not None:                                    # present: the new part of the call's cache
            new = slice(past.shape[4], None)
            present = torch.stack([cache.k[:, :, :, new], cache.v[:, :, :, new]], dim=2).transpose(0, 1)
        else:
            present = torch.stack(presents, dim=1) if cache is None else None   # [B, n_layer, 2, h, T, head_dim]
        return GPT2Output(logits, present)
