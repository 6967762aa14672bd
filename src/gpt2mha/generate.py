"""Sampling and the decode loop (OpenAI's ``sample_sequence`` in ``src/sample.py``).

One prefill over the whole prompt fills a :class:`~gpt2mha.kv_cache.KVCache`; each later step
feeds only the newest token and reads the cache. Sampling follows the official code:
``logits / temperature``, then top-k (keep logits >= the k-th largest), then top-p (keep the
largest logits whose cumulative probability stays within p, at least one), then a draw.
"""

from __future__ import annotations

import numbers
import operator
from typing import Callable

import torch

from .attention import as_bool_mask
from .kv_cache import KVCache

#: Temperatures below float32's smallest normal number sample as temperature 0 (greedy): the
#: limit of ``softmax(logits / t)`` as t → 0 puts all the mass on the largest logit.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def as_int(value, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy and 0-d torch integers too), else a ValueError naming it.

    Raises:
        ValueError: a bool, a float (even 3.0) or anything not an integer, or below ``minimum``.
    """
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")
    return value


def check_sampling(temperature: float, top_k: int, top_p: float) -> tuple[float, int, float]:
    """Validate the sampling arguments and return them as ``(float, int, float)``.

    Raises:
        ValueError: naming the argument if temperature < 0 or not a real number, top_k is not an
            integer >= 0, or top_p ∉ (0, 1].
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0 means greedy)")
    top_k = as_int(top_k, "top_k")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")
    return float(temperature), top_k, float(top_p)


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s generator when a batch is sampled with ``seed``.

    Row 0 uses ``seed`` itself, so a one-prompt call samples exactly as before and row i of a
    batch samples as that prompt alone with ``row_seed(seed, i)``; other rows take seeds spread
    by the 64-bit golden-ratio constant, in ``[0, 2**63)``.
    """
    return seed if row == 0 else (seed + row * 0x9E3779B97F4A7C15) % 2**63


def row_generators(seed: int, batch_size: int, device) -> list[torch.Generator]:
    """One private generator per row, row i seeded with :func:`row_seed` ``(seed, i)``."""
    return [torch.Generator(device=device).manual_seed(row_seed(seed, i)) for i in range(batch_size)]


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
                generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from last-position logits ``[B, V]``.

    Temperature 0 (or below :data:`MIN_TEMPERATURE`) is argmax. Logits are shifted by their row
    maximum before dividing by the temperature (softmax does not change), so a tiny temperature
    cannot overflow to inf. ``generator`` is one generator for the whole batch, or a list with
    one per row (row i drawn from ``generator[i]``, as if sampled alone).
    """
    logits = logits.float()
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature      # <= 0: no overflow
    logits = top_p_logits(top_k_logits(logits, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g) for i, g in enumerate(generator)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def as_prompts(idx) -> list[list[int]]:
    """Prompts given as a list of token lists, 1-D tensors, ``[1, T]`` tensors or numpy arrays →
    lists of Python ints.

    Raises:
        ValueError: naming the prompt and the value when an id is not an integer (``1.7``
            would otherwise be truncated to 1 silently) or a prompt is not 1-D.
    """
    prompts = []
    for i, p in enumerate(idx):
        if isinstance(p, torch.Tensor) or hasattr(p, "__array__"):
            t = torch.as_tensor(p)
            if t.dim() == 2 and t.shape[0] == 1:
                t = t[0]
            if t.dim() != 1:
                raise ValueError(f"prompts[{i}] has shape {tuple(t.shape)}; expected a 1-D (or [1, T]) list of token ids")
            if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
                raise ValueError(f"prompts[{i}] holds {t.dtype} values; token ids must be integers")
            prompts.append(t.tolist())
            continue
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise ValueError(f"prompts[{i}]={p!r} is not a list of token ids (encode text with the tokenizer first)")
        ids = []
        for j, v in enumerate(p):
            try:
                ids.append(as_int(v, f"prompts[{i}][{j}]"))
            except ValueError:
                raise ValueError(f"prompts[{i}][{j}]={v!r} is not a token id; ids must be integers >= 0") from None
        prompts.append(ids)
    return prompts


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


def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, sliding_window: bool = False,
             on_token: Callable[[torch.Tensor], None] | None = None,
             vocab_size: int | None = None) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx``.

    Args:
        model: a :class:`~gpt2mha.model.GPT2`.
        idx: prompt ids ``[B, T]`` (int64), or a list of prompts of different lengths (token
            lists, 1-D or ``[1, T]`` tensors, numpy arrays; :func:`as_prompts`), left-padded
            automatically (:func:`left_pad`, pad id 0). A padded tensor needs
            ``attention_mask [B, T]`` marking real tokens 1 and pads 0 (bool or 0/1 values).
        max_new_tokens: number of tokens to add (>= 0).
        temperature, top_k, top_p: sampling (see :func:`sample_next`); temperature 0 is greedy.
        seed: seeds one private generator per row (:func:`row_seed`): the same call gives the
            same tokens, and row i samples exactly as its prompt alone with ``row_seed(seed, i)``
            (row 0: ``seed`` itself). None: torch's global generator; for a model sharded over
            several ranks (:func:`gpt2mha.parallel.shard_model`), a seed drawn by the group's
            first rank and shared (:func:`gpt2mha.parallel.shared_seed`), so that every rank
            draws the same tokens.
        eos_token_id: once a row emits it, the row is finished and keeps emitting it; the loop
            stops early when every row is finished (the result is still padded to full length).
        sliding_window: allow ``T + max_new_tokens > n_ctx`` (the prompt itself may be longer)
            by conditioning each step on the last n_ctx tokens only (positions restart at 0 for
            that window; slower once the window slides: no cache).
        on_token: called with each step's new ids ``[B]`` as soon as they are sampled.
        vocab_size: sample only ids below it (for embeddings padded past the tokenizer's
            vocabulary, e.g. nanoGPT's 50304 rows for GPT-2's 50257 ids).

    Returns:
        ``[B, T + max_new_tokens]`` int64 ids: the prompt followed by the new tokens (an
        ordinary tensor: it may be edited in place or used in training).

    The model runs in eval mode for the call (dropout off, so a seed fixes the tokens) and is
    put back in the mode it was in.

    Raises:
        ValueError: bad sampling arguments, a negative max_new_tokens, a bad seed, ids that are
            not integers or outside the vocabulary, text instead of ids, a mask with values
            other than 0/1, a right-padded row, or a prompt plus new tokens longer than n_ctx
            without ``sliding_window``, before any work is done.
    """
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens")
    device = model.wte.weight.device
    if isinstance(idx, str):
        raise ValueError(f"idx={idx[:40]!r} is text; generate takes token ids: encode it first, e.g. "
                         f"torch.tensor([get_tokenizer(model.config.tokenizer).encode(text)])")
    if isinstance(idx, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask is built from the lists; pass it only with a padded tensor")
        idx, attention_mask = left_pad(as_prompts(idx))
        idx, attention_mask = idx.to(device), attention_mask.to(device)
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"idx must be a [B, T] tensor of token ids or a list of prompts; got {type(idx).__name__}")
    if idx.dim() != 2:
        raise ValueError(f"idx has shape {tuple(idx.shape)}; expected [B, T]"
                         + (" (one prompt: idx[None])" if idx.dim() == 1 else ""))
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"idx has shape {tuple(idx.shape)}; an empty prompt cannot be continued")
    if idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx must hold token ids as int64 (or int32); got dtype {idx.dtype}"
                         + (" (use idx.long())" if not idx.is_floating_point() else ""))
    if int(idx.min()) < 0 or int(idx.max()) >= model.config.n_vocab:
        raise ValueError(f"idx must hold token ids in [0, n_vocab={model.config.n_vocab}); "
                         f"got values {idx.min().item()} … {idx.max().item()}")
    if seed is not None:
        seed = as_int(seed, "seed")
        if seed >= 2**63:
            raise ValueError(f"seed={seed} must be an integer in [0, 2**63)")
    if vocab_size is not None and not 0 < vocab_size <= model.config.n_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, n_vocab={model.config.n_vocab}]")
    n_ctx = model.config.n_ctx
    B, T = idx.shape
    if T + max_new_tokens > n_ctx and not sliding_window:
        raise ValueError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} = {T + max_new_tokens} > "
                         f"n_ctx={n_ctx}; shorten the prompt, lower max_new_tokens, or use sliding_window=True (CLI: --sliding-window)")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask has shape {shape}; expected [B={B}, T={T}]")
        attention_mask = as_bool_mask(attention_mask, "attention_mask").long()   # 0.5 is an error, not a pad
        if not bool(attention_mask[:, -1].bool().all()):
            rows = torch.nonzero(~attention_mask[:, -1].bool()).flatten().tolist()
            raise ValueError(f"attention_mask: rows {rows} end in padding; generation needs left padding "
                             f"(pads first, every row's last token real)")
    if seed is None and temperature > 0 and max_new_tokens > 0:
        from .parallel import shared_seed, tp_group
        sharded, group = tp_group(model)
        if sharded:                                            # its ranks must draw the same tokens
            seed = shared_seed(None, group)
    generator = row_generators(seed, B, idx.device) if seed is not None else None
    if max_new_tokens == 0:
        return idx.clone()

    was_training = model.training
    model.eval()                                               # dropout off: a seed fixes the tokens
    try:
        with torch.inference_mode(), model.decoding():
            out = decode_loop(model, idx, max_new_tokens, attention_mask, generator, temperature, top_k, top_p,
                              eos_token_id, on_token, vocab_size)
    finally:
        model.train(was_training)
    return out.clone()                                         # outside inference mode: an ordinary tensor


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
