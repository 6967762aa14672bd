"""``generate()``: the engine run to completion (OpenAI's ``sample_sequence`` in ``src/sample.py``).

Each prompt is prefilled alone into its own row of a :class:`~gpt2mha.core.kv_cache.KVCache`;
each later step feeds every row's newest token and reads the cache. The loop drives the
:class:`~gpt2mha.inference.engine.Engine` the server's scheduler drives too, on the route
:func:`~gpt2mha.inference.decoders.choose_decoder` picks; sampling is :mod:`.sampling`'s
:class:`~gpt2mha.inference.sampling.RowSampler`, one per row.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core import checks
from ..core.kv_cache import KVCache
from ..distributed import shared_seed
from .decoders import NATIVE, choose_decoder
from .engine import Engine
from .parallel import tp_group
from .params import FIELDS, TEXT_FIELDS, SamplingParams
from .prefix_cache import BLOCK, MIN_SUFFIX, PrefixCache, default_budget_mb
from .prompts import (as_prompts, check_fits, decode_rows, left_pad, prompt_batch,  # noqa: F401  (importable from here)
                      strip_padding)
from .sampling import row_seed


def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, sliding_window: bool = False,
             on_token: Callable[[torch.Tensor], None] | None = None,
             vocab_size: int | None = None, min_p: float = 0.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, logit_bias: dict | None = None,
             batch_invariant: bool | None = None, compile: bool = False, **sampling) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx``.

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2`.
        idx: prompt ids ``[B, T]`` (int64), or a list of prompts of different lengths (token
            lists, 1-D or ``[1, T]`` tensors, numpy arrays; :func:`as_prompts`), laid out
            left-padded in the result (:func:`left_pad`, pad id 0; the model never sees the
            pads: each prompt is prefilled alone). A padded tensor needs
            ``attention_mask [B, T]`` marking real tokens 1 and pads 0 (bool or 0/1 values).
        max_new_tokens: number of tokens to add (>= 0).
        temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, logit_bias, seed:
            the :class:`~gpt2mha.inference.params.SamplingParams` of every row (checked there):
            temperature 0 is greedy; min_p in [0, 1] keeps the tokens at least min_p times as
            likely as the most likely one (0: off); OpenAI's penalties in [-2, 2] subtracted
            from the raw logits of the tokens the row has generated so far (the prompt does not
            count; :func:`~gpt2mha.inference.sampling.adjust_logits`); ``logit_bias``
            ``{token id: bias in [-100, 100]}`` added at every step (keys may be decimal
            strings, as in a JSON request). ``seed`` seeds one private generator per row (row i:
            :func:`~gpt2mha.inference.sampling.row_seed` ``(seed, i)``, row 0 ``seed`` itself),
            so row i samples exactly as its prompt alone with that seed; None: torch's global
            generator (for a model sharded over several ranks,
            :func:`gpt2mha.inference.parallel.shard_model`, a seed drawn by the group's first
            rank and shared, :func:`gpt2mha.distributed.shared_seed`).
        **sampling: any other :class:`~gpt2mha.inference.params.SamplingParams` field that
            acts on a row (not the serving scheduler's :data:`~gpt2mha.inference.params.TEXT_FIELDS`),
            by name: ``repetition_penalty`` (> 0, 1: off; a logit of a token of the prompt or
            generated is divided by it when positive, multiplied when negative, as transformers'),
            ``no_repeat_ngram_size`` (n: no n-gram of the prompt plus the new tokens appears
            twice), ``min_tokens`` (``eos_token_id`` and ``stop_token_ids`` banned until that
            many new tokens), ``ignore_eos`` (``eos_token_id`` neither stops a row nor is
            banned by ``min_tokens``), ``stop_token_ids`` (ids that finish a row, as
            ``eos_token_id`` does), ``structured_outputs`` (every row's tokens follow a JSON
            schema, a regex, a choice or a grammar: below). Order of the adjustments:
            :meth:`RowSampler.adjust <gpt2mha.inference.sampling.RowSampler.adjust>`.
        eos_token_id: once a row emits it (or one of ``stop_token_ids``), the row is finished
            and keeps emitting that token; the loop stops early when every row is finished (the
            result is still padded to full length).
        sliding_window: allow ``T + max_new_tokens > n_ctx`` (the prompt itself may be longer)
            by conditioning each step on the last n_ctx tokens only (positions restart at 0 for
            that window; slower once the window slides: no cache).
        on_token: called with each step's new ids ``[B]`` as soon as they are sampled.
        vocab_size: sample only ids below it (for embeddings padded past the tokenizer's
            vocabulary, e.g. nanoGPT's 50304 rows for GPT-2's 50257 ids).
        batch_invariant: run the decode view's float32 matrix products on a multiple of 4 rows
            (:func:`~gpt2mha.inference.fast.for_decoding`), so that every row's logits are
            bitwise those of its prompt alone; None (default): for every model whose block
            weights are not float32 (:func:`~gpt2mha.inference.fast.invariant_by_default`).
        compile: run the decode steps as one compiled step
            (:func:`~gpt2mha.inference.compiled.compiled_decoder`, CPU only): the first call
            compiles for 10–60 s; gives up the batch-invariance guarantee. Prefill stays eager.

    The route (:func:`~gpt2mha.inference.decoders.choose_decoder`): the compiled step with
    ``compile``, else the native forward for int8 per_row and int4 per_block models, else the
    decode view; the same route ``gpt2mha serve`` takes for the model (one engine,
    :mod:`~gpt2mha.inference.engine`). While a hook is attached (from ``on_token`` too) the
    steps take the decode view, where hooks act.

    Batch invariance: each prompt is prefilled alone into its own row of the cache (no left
    padding: its keys from cache index 0), every decode step attends each row over exactly its
    own keys, in a call of its own, and no product rounds a row by the batch's size; so with
    ``batch_invariant`` every row's logits at every step are bitwise those of its prompt
    generated alone (and its greedy or seeded tokens the same), whatever the other prompts,
    their lengths and order.

    Structured outputs: with ``structured_outputs`` (a
    :class:`~gpt2mha.inference.params.StructuredOutputs` or a mapping of its fields:
    ``{"json": schema}``, ``{"regex": r}``, ``{"choice": [...]}``, ``{"grammar": g}``,
    ``{"json_object": True}``) every row's tokens follow the grammar, compiled for the model's
    tokenizer (``model.config.tokenizer``); each row has its own state of it. A row whose grammar
    is complete (nothing can follow, or it took the tokenizer's end-of-text token where the
    grammar may end) is finished: its remaining columns hold ``eos_token_id``, else the
    tokenizer's end-of-text token, else 0 (the byte tokenizer has none).

    Returns:
        ``[B, T + max_new_tokens]`` int64 ids: the prompt followed by the new tokens (an
        ordinary tensor: it may be edited in place or used in training). A batch of prompts
        keeps its left padding; :func:`strip_padding` gives each row without it.

    The model runs in eval mode for the call (dropout off, so a seed fixes the tokens) and is
    put back in the mode it was in.

    Raises:
        TypeError: a keyword that is not a row's SamplingParams field (``stop``: the serving
            scheduler's, :mod:`gpt2mha.inference.scheduler`).
        ValueError: naming the argument, before any work is done: bad sampling arguments
            (:class:`~gpt2mha.inference.params.ParamError`), a negative max_new_tokens, bad
            prompts (:func:`prompt_batch`: also a tensor on another device than the model's),
            an eos_token_id or vocab_size that is not an id / size of this model, an on_token
            that cannot be called, a sliding_window that is not a bool, or a prompt plus new
            tokens longer than n_ctx without ``sliding_window``; ``compile`` for a model with
            forward hooks or not on the CPU.
        NonFiniteLogitsError: the model's logits hold NaN/inf at some step (naming it and the row).
    """
    for name in sampling:
        if name not in FIELDS or name == "max_tokens" or name in TEXT_FIELDS:
            why = (f": {name} is acted on by the serving scheduler (gpt2mha.inference.scheduler.Scheduler, gpt2mha "
                   f"serve), which runs the same engine") if name in TEXT_FIELDS else \
                ": the number of new tokens is max_new_tokens" if name == "max_tokens" else ""
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}{why}")
    max_new_tokens = checks.as_int(max_new_tokens, "max_new_tokens")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            logit_bias=logit_bias, seed=seed, **sampling)
    return generate_with(model, idx, params, eos_token_id=eos_token_id, attention_mask=attention_mask,
                         sliding_window=sliding_window, on_token=on_token, vocab_size=vocab_size,
                         batch_invariant=batch_invariant, compile=compile)


def generate_with(model, idx, params: SamplingParams, *, eos_token_id: int | None = None,
                  attention_mask: torch.Tensor | None = None, sliding_window: bool = False,
                  on_token: Callable[[torch.Tensor], None] | None = None, vocab_size: int | None = None,
                  batch_invariant: bool | None = None, compile: bool = False) -> torch.Tensor:
    """:func:`generate` with its sampling given as one :class:`~gpt2mha.inference.params.SamplingParams`
    (``params.max_tokens`` new tokens; the CLI builds one from its flags). The
    :data:`~gpt2mha.inference.params.TEXT_FIELDS` (``n``, ``best_of``, ``stop``,
    ``include_stop_str_in_output``, ``logprobs``, ``echo``) are the ones the server's scheduler
    acts on; here each prompt is one row. Raises as :func:`generate`."""
    c = model.config
    idx, attention_mask = prompt_batch(idx, attention_mask, c.n_vocab, model.wte.weight.device)
    if vocab_size is not None:
        vocab_size = checks.as_int(vocab_size, "vocab_size", minimum=1)
        if vocab_size > c.n_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, n_vocab={c.n_vocab}]")
    params.check_vocab(vocab_size or c.n_vocab)
    if eos_token_id is not None:
        eos_token_id = checks.as_int(eos_token_id, "eos_token_id")
        if eos_token_id >= c.n_vocab:
            raise ValueError(f"eos_token_id={eos_token_id} must be a token id in [0, n_vocab={c.n_vocab})")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be a function called with each step's ids [B]; got {type(on_token).__name__}")
    checks.flag(sliding_window, "sliding_window")
    checks.flag(compile, "compile")
    if batch_invariant is not None:
        checks.flag(batch_invariant, "batch_invariant")
    B, T = idx.shape
    check_fits(T, params.max_tokens, c.n_ctx, sliding_window)
    if params.max_tokens == 0:
        return idx.clone()
    seed = params.seed
    if seed is None and not params.greedy:
        sharded, group = tp_group(model)
        if sharded:                                            # its ranks must draw the same tokens
            seed = shared_seed(None, group)
    training = [m for m in model.modules() if m.training]     # restored exactly after (eval() walks ~1 ms for 124M)
    if training:
        model.eval()                                           # dropout off: a seed fixes the tokens
    try:
        route = choose_decoder(model, compile=compile, batch_invariant=batch_invariant)
        with torch.inference_mode():
            out = decode_loop(model, route, idx, attention_mask, params, seed, eos_token_id, on_token, vocab_size,
                              batch_invariant)
    finally:
        for m in training:
            m.training = True
    return out.clone()                                         # outside inference mode: an ordinary tensor


def shared_prefixes(prompts: list[torch.Tensor], config, weight: torch.Tensor):
    """A :class:`~gpt2mha.inference.prefix_cache.PrefixCache` for one call's ``prompts`` where two
    of them start with the same block of tokens (later rows then take the earlier rows' blocks),
    sized to hold every block of the call (at most the server's default budget,
    :func:`~gpt2mha.inference.prefix_cache.default_budget_mb`); else None. The engine drops it on
    a route that cannot keep a suffix's bits."""
    firsts = [tuple(p[:BLOCK].tolist()) for p in prompts if len(p) >= BLOCK + MIN_SUFFIX]
    if len(firsts) == len(set(firsts)):
        return None
    tokens = sum(len(p) for p in prompts)
    mb = 2 * config.n_layer * config.n_embd * tokens * weight.element_size() / 2**20
    return PrefixCache(min(mb + 1, default_budget_mb()))


def decode_loop(model, route, idx, attention_mask, params: SamplingParams, seed, eos_token_id, on_token,
                vocab_size, batch_invariant=None) -> torch.Tensor:
    """The loop of :func:`generate` after its checks: an :class:`~gpt2mha.inference.engine.Engine`
    of one slot per row, run to completion.

    Each prompt (row ``b``'s real tokens, its padding dropped) is prefilled alone into row ``b``
    of one :class:`KVCache`, from cache index 0; then every step feeds all rows' newest tokens
    at once, each row at its own position, attending to its own keys only, and samples each
    unfinished row with its own :class:`~gpt2mha.inference.sampling.RowSampler`. A row whose
    window is full (``sliding_window``) is recomputed alone over its last n_ctx tokens.
    """
    B, T = idx.shape
    n_ctx, n_new = model.config.n_ctx, params.max_tokens
    keep = None if attention_mask is None else attention_mask.bool()
    prompts = [idx[b] if keep is None else idx[b][keep[b]] for b in range(B)]      # each [T_b]
    out = torch.empty(B, T + n_new, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    decoder = route.decoder
    max_len = decoder.cache_len(min(n_ctx, max(len(ids) for ids in prompts) + n_new))
    c = model.config
    storage, cache = new_cache((c.n_layer, B, c.n_head, max_len, c.head_dim), model.wte.weight.dtype,
                               model.wte.weight.device, zero=decoder.name != NATIVE)   # the native forward reads only
    tok = None
    if params.structured_outputs is not None:                  # the grammar is compiled for its tokens
        from ..io.tokenizer import get_tokenizer
        tok = get_tokenizer(model.config.tokenizer)
    pad = eos_token_id if eos_token_id is not None else tok.eot_token if tok is not None and \
        tok.eot_token is not None else 0                        # after a row's grammar is complete
    try:                                                                              # what it wrote
        engine = Engine(model, cache, route, vocab_size, batch_invariant, zeroed=decoder.name != NATIVE,
                        eos_token_id=eos_token_id, tokenizer=tok,
                        prefix_cache=shared_prefixes(prompts, c, model.wte.weight))
        for b in range(B):
            engine.open(b, params, None if seed is None else row_seed(seed, b), row=b, prompt=prompts[b])
        tokens = engine.prefill(list(range(B)), [ids[-n_ctx:] for ids in prompts])
        ends = set(params.stop_token_ids)                       # the tokens that finish a row
        if eos_token_id is not None and not params.ignore_eos:
            ends.add(eos_token_id)
        finished: list[int | None] = [None] * B                 # the token that finished each row
        sliding: set[int] = set()                               # rows recomputed over their last n_ctx tokens
        chosen: list[list[int]] = []                            # each step's tokens, into ``out`` at the end
        for step in range(n_new):
            pos = T + step                                      # column of the token being chosen
            for b, t in enumerate(tokens):
                if isinstance(t, Exception):
                    raise t
                if finished[b] is not None:
                    tokens[b] = engine.last[b] = finished[b]
                elif t in ends:
                    finished[b] = t
                elif engine.samplers[b].complete:               # its grammar takes nothing more
                    finished[b] = pad
            chosen.append(list(tokens))
            if on_token is not None:
                out[:, pos] = torch.tensor(tokens)
                on_token(out[:, pos])
            if step == n_new - 1:
                break
            if None not in finished:
                out[:, pos + 1:] = torch.tensor(finished, dtype=torch.long, device=out.device)[:, None]
                break
            sliding.update(b for b, n in enumerate(cache.lengths) if n == cache.max_len)
            for b in sliding:                                   # its row of the cache is no longer read
                cache.reset(b)
            logits, rows = engine.forward(list(range(B)))
            for b in sorted(sliding):                           # positions restart at 0 for the window
                new = out[b, T:pos + 1] if on_token is not None else \
                    torch.tensor([c[b] for c in chosen], dtype=torch.long, device=out.device)
                window = torch.cat([prompts[b], new])[-n_ctx:]
                logits[b] = model(window[None], last_only=True, validate=False).logits[0, -1]
            live = [b for b in range(B) if finished[b] is None]
            tokens = list(finished)
            for b, t in zip(live, engine.sample(live, logits, live)):
                tokens[b] = t
        if chosen and on_token is None:                         # (with on_token each step's column was written then)
            out[:, T:T + len(chosen)] = torch.tensor(chosen, dtype=torch.long).T  # one write, not one a step
        return out
    finally:
        keep_for_next_call(storage)                            # its memory, for the next call


#: The KV cache storage of the last finished :func:`generate` on CPU, by dtype: the next call whose
#: cache fits in it reuses it (:func:`new_cache`), as llama.cpp keeps its context's cache and ONNX
#: Runtime its arena. A new 124M cache for a 128-token prompt costs page faults and zeroing, a
#: few percent of its time to the first token.
_SPARE: dict = {}
#: Storage larger than this (bytes) is not kept between calls.
SPARE_BYTES = 128 << 20


def new_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              zero: bool = True) -> tuple[torch.Tensor, KVCache]:
    """A zeroed :class:`KVCache` of ``shape`` ``[n_layer, B, h, T_max, head_dim]`` and the flat
    storage under it: the last call's (:data:`_SPARE`) where it fits (at most 4× the size, made
    in the same inference mode), else new. ``zero=False`` leaves a reused storage's old values
    (for a caller that reads only what it writes: ~1 ms for a 128-token prompt's cache)."""
    n = 1
    for d in shape:
        n *= d
    buf = _SPARE.pop(dtype, None) if torch.device(device).type == "cpu" else None
    if buf is None or not 2 * n <= buf.numel() <= 8 * n or buf.is_inference() != torch.is_inference_mode_enabled():
        if buf is not None:
            keep_for_next_call(buf)                            # not this call's size: kept for another
        buf = torch.empty(2 * n, dtype=dtype, device=device)
    if zero:
        buf[:2 * n].zero_()
    return buf, KVCache.over(buf[:n].view(shape), buf[n:2 * n].view(shape))


def drop_kept_cache() -> None:
    """Let go of the KV cache storage :func:`generate` keeps between calls (:data:`_SPARE`)."""
    _SPARE.clear()


def keep_for_next_call(storage: torch.Tensor) -> None:
    """Keep a finished call's cache storage for the next (:func:`new_cache`): CPU only, up to
    :data:`SPARE_BYTES`, the larger of it and what is kept already."""
    if storage.device.type != "cpu" or storage.numel() * storage.element_size() > SPARE_BYTES:
        return
    held = _SPARE.get(storage.dtype)
    if held is None or held.numel() < storage.numel():
        _SPARE[storage.dtype] = storage

