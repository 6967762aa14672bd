"""Sampling and the decode loop (OpenAI's ``sample_sequence`` in ``src/sample.py``).

One prefill over the whole prompt fills a :class:`~gpt2mha.kv_cache.KVCache`; each later step
feeds only the newest token and reads the cache. Sampling follows the official code:
``logits / temperature``, then top-k (keep logits >= the k-th largest), then top-p (keep the
largest logits whose cumulative probability stays within p, at least one), then a draw.
"""

from __future__ import annotations

from typing import Callable

import torch

from .kv_cache import KVCache


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raises ValueError naming the argument if temperature < 0, top_k < 0 or top_p ∉ (0, 1]."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k} must be an integer >= 0 (0 means no top-k filtering)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


def top_k_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, V]`` → same with every logit below the k-th largest set to -inf (k = 0: unchanged)."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_logits(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering as ``top_p_logits`` in openai/gpt-2: keep the logits at least as large
    as the last one whose (inclusive) cumulative probability is <= p; always keep the top one."""
    if p >= 1.0:
        return logits
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values       # [B, V]
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    last = ((cumulative <= p).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # [B, 1]
    min_values = sorted_logits.gather(-1, last)
    return logits.masked_fill(logits < min_values, float("-inf"))


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from last-position logits ``[B, V]``; temperature 0 is argmax."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = top_p_logits(top_k_logits(logits / temperature, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: list[list[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists of different lengths into a batch.

    Returns:
        ``idx [B, T_max]`` (int64) with ``pad_token_id`` on the left of shorter rows and
        ``attention_mask [B, T_max]`` (1 real, 0 pad), so every row's last token is at the end.

    Raises:
        ValueError: no prompts, or an empty prompt (naming its index).
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = 1
    return idx, mask


@torch.inference_mode()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, sliding_window: bool = False,
             on_token: Callable[[torch.Tensor], None] | None = None,
             vocab_size: int | None = None) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx``.

    Args:
        model: a :class:`~gpt2mha.model.GPT2`.
        idx: prompt ids ``[B, T]`` (int64), or a list of token lists of different lengths,
            which is left-padded automatically (:func:`left_pad`, pad id 0). A padded tensor
            needs ``attention_mask [B, T]`` marking real tokens 1 and pads 0.
        max_new_tokens: number of tokens to add (>= 0).
        temperature, top_k, top_p: sampling (see :func:`sample_next`); temperature 0 is greedy.
        seed: seeds a private generator, so the same call gives the same tokens.
        eos_token_id: once a row emits it, the row is finished and keeps emitting it; the loop
            stops early when every row is finished (the result is still padded to full length).
        sliding_window: allow ``T + max_new_tokens > n_ctx`` (the prompt itself may be longer)
            by conditioning each step on the last n_ctx tokens only (positions restart at 0 for
            that window; slower once the window slides: no cache).
        on_token: called with each step's new ids ``[B]`` as soon as they are sampled.
        vocab_size: sample only ids below it (for embeddings padded past the tokenizer's
            vocabulary, e.g. nanoGPT's 50304 rows for GPT-2's 50257 ids).

    Returns:
        ``[B, T + max_new_tokens]`` int64 ids: the prompt followed by the new tokens.

    Raises:
        ValueError: bad sampling arguments, a negative max_new_tokens, a bad seed, ids outside
            the vocabulary, a right-padded row, or a prompt plus new tokens longer than n_ctx
            without ``sliding_window``, before any work is done.
    """
    check_sampling(temperature, top_k, top_p)
    if isinstance(idx, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask is built from the lists; pass it only with a padded tensor")
        idx, attention_mask = left_pad([list(p) for p in idx])
        idx, attention_mask = idx.to(model.wte.weight.device), attention_mask.to(model.wte.weight.device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be an integer >= 0")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError("idx must be a non-empty [B, T] tensor of token ids (an empty prompt cannot be continued)")
    if idx.dtype not in (torch.int64, torch.int32) or int(idx.min()) < 0 or int(idx.max()) >= model.config.n_vocab:
        raise ValueError(f"idx must hold int64 token ids in [0, n_vocab={model.config.n_vocab}); "
                         f"got dtype {idx.dtype}, values {idx.min().item()} … {idx.max().item()}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**63)")
    if vocab_size is not None and not 0 < vocab_size <= model.config.n_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, n_vocab={model.config.n_vocab}]")
    n_ctx = model.config.n_ctx
    B, T = idx.shape
    if T + max_new_tokens > n_ctx and not sliding_window:
        raise ValueError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} = {T + max_new_tokens} > "
                         f"n_ctx={n_ctx}; shorten the prompt, lower max_new_tokens, or use sliding_window=True (CLI: --sliding-window)")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected [B={B}, T={T}]")
        if not bool(attention_mask[:, -1].bool().all()):
            rows = torch.nonzero(~attention_mask[:, -1].bool()).flatten().tolist()
            raise ValueError(f"attention_mask: rows {rows} end in padding; generation needs left padding "
                             f"(pads first, every row's last token real)")
    generator = torch.Generator(device=idx.device).manual_seed(seed) if seed is not None else None
    if max_new_tokens == 0:
        return idx.clone()

    with model.decoding():
        return decode_loop(model, idx, max_new_tokens, attention_mask, generator, temperature, top_k, top_p,
                           eos_token_id, on_token, vocab_size)


def decode_loop(model, idx, max_new_tokens, attention_mask, generator, temperature, top_k, top_p,
                eos_token_id, on_token, vocab_size) -> torch.Tensor:
    """The loop of :func:`generate` after its checks: one prefill over the prompt into a
    :class:`KVCache`, then one sampled token per step fed back through the cache."""
    B, T = idx.shape
    n_ctx = model.config.n_ctx
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    mask = None
    if attention_mask is not None:
        mask = torch.ones(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
        mask[:, :T] = attention_mask
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    p = next(model.parameters())
    cache = KVCache(model.config.n_layer, B, model.config.n_head, min(n_ctx, T + max_new_tokens),
                    model.config.head_dim, dtype=p.dtype, device=p.device)
    start = max(0, T - n_ctx)                                  # > 0 only for a sliding window
    logits = model(idx[:, start:], attention_mask=None if mask is None else mask[:, start:T], cache=cache,
                   last_only=True).logits
    for step in range(max_new_tokens):
        pos = T + step                                         # index of the token being chosen
        token = sample_next(logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = torch.where(finished, eos_token_id, token)
            finished |= token == eos_token_id
        out[:, pos] = token
        if on_token is not None:
            on_token(token)
        if step == max_new_tokens - 1:
            break
        if eos_token_id is not None and bool(finished.all()):
            out[:, pos + 1:] = eos_token_id
            break
        if cache.length < cache.max_len:
            logits = model.step(token[:, None], cache, None if mask is None else mask[:, :pos + 1])  # unchecked
        else:                                                  # sliding window: recompute the last n_ctx
            start = pos + 1 - n_ctx
            window_mask = None if mask is None else mask[:, start:pos + 1]
            logits = model(out[:, start:pos + 1], attention_mask=window_mask, last_only=True).logits
    return out
