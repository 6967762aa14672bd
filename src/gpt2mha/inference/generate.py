"""``generate()``: the server's scheduler run to completion (OpenAI's ``sample_sequence`` in
``src/sample.py``; vLLM's offline ``LLM`` over its server's engine).

Each prompt is prefilled alone into its own row of a :class:`~gpt2mha.core.kv_cache.KVCache`;
each later step feeds every row's newest token and reads the cache. The loop is the
:class:`~gpt2mha.inference.scheduler.Scheduler` the server runs, stepped in the calling thread
until every sequence has finished (:func:`generate_sequences`), over an
:class:`~gpt2mha.inference.engine.Engine` whose cache is sized for the call, on the route
:func:`~gpt2mha.inference.decoders.choose_decoder` picks; sampling is :mod:`.sampling`'s
:class:`~gpt2mha.inference.sampling.RowSampler`, one per row. So every
:class:`~gpt2mha.inference.params.SamplingParams` field, the end-of-text rule and the sliding
window act here as they do served.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

import torch

from ..core import checks
from ..core.kv_cache import KVCache
from ..distributed import shared_seed
from .decoders import NATIVE, choose_decoder
from .engine import Engine
from .parallel import tp_group
from .params import SamplingParams
from .prefix_cache import BLOCK, MIN_SUFFIX, PrefixCache, default_budget_mb
from .prompts import (as_prompts, check_fits, decode_rows, left_pad, prompt_batch,  # noqa: F401  (importable from here)
                      strip_padding)
from .scheduler import Scheduler
from .sequence import Sequence, pick_choices


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
        **sampling: any other :class:`~gpt2mha.inference.params.SamplingParams` field, by name
            (the keywords are the class's fields: a field added there is taken here):
            ``repetition_penalty`` (> 0, 1: off; a logit of a token of the prompt or
            generated is divided by it when positive, multiplied when negative, as transformers'),
            ``no_repeat_ngram_size`` (n: no n-gram of the prompt plus the new tokens appears
            twice), ``min_tokens`` (``eos_token_id`` and ``stop_token_ids`` banned until that
            many new tokens), ``ignore_eos`` (``eos_token_id`` neither stops a row nor is
            banned by ``min_tokens``), ``stop_token_ids`` (ids that finish a row, as
            ``eos_token_id`` does), ``stop`` (strings that finish a row once its text holds one:
            the row keeps the tokens up to the one that completed it; the model's tokenizer
            decodes the text), ``structured_outputs`` (every row's tokens follow a JSON
            schema, a regex, a choice or a grammar: below), ``n`` (rows per prompt: prompt i's
            j-th at row ``i·n + j``, seeded ``row_seed(seed, i·n + j)``), ``best_of`` (that many
            candidates per prompt, the ``n`` of highest mean log-probability returned),
            ``logprobs``, ``echo`` and ``include_stop_str_in_output`` (recorded on the sequences
            :func:`generate_sequences` returns; the ids here are the same). Order of the
            adjustments: :meth:`RowSampler.adjust <gpt2mha.inference.sampling.RowSampler.adjust>`.
        eos_token_id: once a row emits it (or one of ``stop_token_ids``), the row is finished
            and keeps emitting that token; the loop stops early when every row is finished (the
            result is still padded to full length).
        sliding_window: allow ``T + max_new_tokens > n_ctx`` (the prompt itself may be longer)
            by conditioning each step on the last n_ctx tokens only (positions restart at 0 for
            that window; slower once the window slides: no cache); the field of the same name.
        on_token: called with each step's new ids ``[B]`` (``[B·n]``, or every candidate's with
            ``best_of``) as soon as they are sampled; a finished row's id is the one its later
            columns hold.
        vocab_size: sample only ids below it (for embeddings padded past the tokenizer's
            vocabulary, e.g. nanoGPT's 50304 rows for GPT-2's 50257 ids).
        batch_invariant: run the decode view's float32 matrix products on a multiple of 4 rows
            (:func:`~gpt2mha.inference.fast.for_decoding`), so that every row's logits are
            bitwise those of its prompt alone; None (default): for every model whose block
            weights are not float32 (:func:`~gpt2mha.inference.fast.invariant_by_default`).
        compile: run the decode steps as one compiled step
            (:func:`~gpt2mha.inference.compiled.compiled_decoder`, CPU only): the first call
            compiles for 10–60 s; gives up the batch-invariance guarantee. Prefill stays eager.

    The loop is the server's: a :class:`~gpt2mha.inference.scheduler.Scheduler` over one
    :class:`~gpt2mha.inference.engine.Engine`, run to completion in the calling thread
    (:func:`generate_sequences`).

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
    tokenizer's end-of-text token, else 0 (the byte tokenizer has none). So do the remaining
    columns of a row a ``stop`` string finished.

    Returns:
        ``[B, T + max_new_tokens]`` int64 ids (``[B·n, …]`` with ``n``): the prompt followed by
        the new tokens (an ordinary tensor: it may be edited in place or used in training). A
        batch of prompts keeps its left padding; :func:`strip_padding` gives each row without it.

    The model runs in eval mode for the call (dropout off, so a seed fixes the tokens) and is
    put back in the mode it was in.

    Raises:
        TypeError: a keyword that is not a SamplingParams field (``max_tokens``: the number of
            new tokens is ``max_new_tokens``).
        ValueError: naming the argument, before any work is done: bad sampling arguments
            (:class:`~gpt2mha.inference.params.ParamError`), a negative max_new_tokens, bad
            prompts (:func:`prompt_batch`: also a tensor on another device than the model's),
            an eos_token_id or vocab_size that is not an id / size of this model, an on_token
            that cannot be called, a sliding_window that is not a bool, or a prompt plus new
            tokens longer than n_ctx without ``sliding_window``; ``compile`` for a model with
            forward hooks or not on the CPU.
        NonFiniteLogitsError: the model's logits hold NaN/inf at some step (naming it and the row).
    """
    names = {f.name for f in fields(SamplingParams)}
    for name in sampling:
        if name not in names or name == "max_tokens":
            why = ": the number of new tokens is max_new_tokens" if name == "max_tokens" else ""
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}{why}")
    max_new_tokens = checks.as_int(max_new_tokens, "max_new_tokens")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            logit_bias=logit_bias, seed=seed, sliding_window=sliding_window, **sampling)
    return generate_with(model, idx, params, eos_token_id=eos_token_id, attention_mask=attention_mask,
                         on_token=on_token, vocab_size=vocab_size, batch_invariant=batch_invariant, compile=compile)


def generate_with(model, idx, params: SamplingParams, *, eos_token_id: int | None = None,
                  attention_mask: torch.Tensor | None = None, sliding_window: bool = False,
                  on_token: Callable[[torch.Tensor], None] | None = None, vocab_size: int | None = None,
                  batch_invariant: bool | None = None, compile: bool = False, tokenizer=None) -> torch.Tensor:
    """:func:`generate` with its sampling given as one :class:`~gpt2mha.inference.params.SamplingParams`
    (``params.max_tokens`` new tokens; every field acts as :func:`generate` says).
    ``sliding_window=True`` sets the field of that name; ``tokenizer``: the one stop strings and
    structured outputs read (None: ``model.config.tokenizer``'s). Raises as :func:`generate`."""
    c = model.config
    idx, attention_mask = prompt_batch(idx, attention_mask, c.n_vocab, model.wte.weight.device)
    if checks.flag(sliding_window, "sliding_window") and not params.sliding_window:
        params = replace(params, sliding_window=True)
    check_run(model, params, eos_token_id, vocab_size, on_token, batch_invariant, compile)
    B, T = idx.shape
    check_fits(T, params.max_tokens, c.n_ctx, params.sliding_window)
    n = params.n
    if params.max_tokens == 0:
        return idx.repeat_interleave(n, 0) if n > 1 else idx.clone()
    keep = None if attention_mask is None else attention_mask.bool()
    prompts = [(idx[b] if keep is None else idx[b][keep[b]]).tolist() for b in range(B)]    # each T_b ids
    tokenizer = text_tokenizer(model, params, tokenizer)
    seqs = generate_sequences(model, prompts, params, eos_token_id=eos_token_id, on_token=on_token,
                              vocab_size=vocab_size, batch_invariant=batch_invariant, compile=compile,
                              tokenizer=tokenizer)
    chosen = [s for _, s in pick_choices(seqs)] if params.ranked else seqs
    fill = ends_with(params, eos_token_id, tokenizer)
    new = [s.tokens + [fill(s)] * (params.max_tokens - len(s.tokens)) for s in chosen]
    out = torch.empty(len(chosen), T + params.max_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx.repeat_interleave(n, 0) if n > 1 else idx
    out[:, T:] = torch.tensor(new, dtype=torch.long)
    return out


def check_run(model, params: SamplingParams, eos_token_id, vocab_size, on_token, batch_invariant, compile) -> None:
    """:func:`generate_sequences`' checks of its arguments other than the prompts (raises
    ValueError naming the argument)."""
    c = model.config
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
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
    checks.flag(compile, "compile")
    if batch_invariant is not None:
        checks.flag(batch_invariant, "batch_invariant")


def generate_sequences(model, prompts, params: SamplingParams, *, eos_token_id: int | None = None,
                       on_token: Callable[[torch.Tensor], None] | None = None, on_event=None,
                       vocab_size: int | None = None, batch_invariant: bool | None = None, compile: bool = False,
                       tokenizer=None) -> list[Sequence]:
    """The server's scheduler run to completion over ``prompts`` (vLLM's offline ``LLM`` is its
    server's engine the same way): a :class:`~gpt2mha.inference.scheduler.Scheduler` over an
    :class:`~gpt2mha.inference.engine.Engine` whose cache is sized for this call, every
    sequence submitted at once and admitted in order, stepped in the calling thread until
    every one has finished. What :func:`generate` returns as ids, with each sequence's text,
    finish reason, log-probabilities and prompt log-probabilities (``echo``).

    Args:
        prompts: token lists (or 1-D tensors, arrays: :func:`as_prompts`), each non-empty.
        params: ``params.per_prompt`` sequences per prompt (prompt i's candidate j is sequence
            ``i·m + j``, seeded ``row_seed(params.seed, i·m + j)``; no seed: torch's global
            generator, or on a tensor-parallel model one seed its ranks share).
        eos_token_id: the id that ends a sequence (finish reason ``"stop"``; None: none, unless
            ``stop_token_ids``), as :func:`generate`'s.
        on_token: called with each step's ids ``[len(prompts) · per_prompt]``, as :func:`generate`'s.
        on_event: ``on_event(seq, text, done)`` for each piece of a sequence's text (the
            scheduler's :class:`~gpt2mha.inference.sequence.Sequence` events), e.g. to stream it.
        tokenizer: for the text (stop strings, ``on_event``'s pieces) and structured outputs;
            None: ``model.config.tokenizer``'s when ``params`` need one, else no text.
        vocab_size, batch_invariant, compile: as :func:`generate`.

    Returns:
        every sequence, in order (``seq.index``); with ``best_of``,
        :func:`~gpt2mha.inference.sequence.pick_choices` picks the returned ones.

    Raises:
        ValueError: as :func:`generate` (the prompts as
            :meth:`Scheduler.submit <gpt2mha.inference.scheduler.Scheduler.submit>` checks them).
        Exception: the first failure of a sequence (e.g.
            :class:`~gpt2mha.inference.sampling.NonFiniteLogitsError`), raised at the step it
            happens.
    """
    check_run(model, params, eos_token_id, vocab_size, on_token, batch_invariant, compile)
    prompts = as_prompts(prompts)
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    if params.seed is None and not params.greedy:
        sharded, group = tp_group(model)
        if sharded:                                            # its ranks must draw the same tokens
            params = replace(params, seed=shared_seed(None, group))
    tokenizer = text_tokenizer(model, params, tokenizer)
    training = [m for m in model.modules() if m.training]     # restored exactly after (eval() walks ~1 ms for 124M)
    if training:
        model.eval()                                           # dropout off: a seed fixes the tokens
    try:
        with torch.inference_mode():
            return run_to_completion(model, prompts, params, eos_token_id, on_token, on_event, vocab_size,
                                     batch_invariant, compile, tokenizer)
    finally:
        for m in training:
            m.training = True


def run_to_completion(model, prompts: list[list[int]], params: SamplingParams, eos_token_id, on_token, on_event,
                      vocab_size, batch_invariant, compile, tokenizer) -> list[Sequence]:
    """:func:`generate_sequences` after its checks, in inference mode: the engine over a cache of
    one row per sequence (its storage the last call's when it fits: :func:`new_cache`), its
    scheduler stepped until every sequence has finished."""
    c = model.config
    route = choose_decoder(model, compile=compile, batch_invariant=batch_invariant)
    decoder, m = route.decoder, params.per_prompt
    rows = [ids for ids in prompts for _ in range(m)]
    max_len = decoder.cache_len(min(c.n_ctx, max(map(len, prompts)) + params.max_tokens))
    weight = model.wte.weight
    storage, cache = new_cache((c.n_layer, len(rows), c.n_head, max_len, c.head_dim), weight.dtype, weight.device,
                               zero=decoder.name != NATIVE)   # the native forward reads only what it wrote
    try:
        engine = Engine(model, cache, route, vocab_size, batch_invariant, zeroed=decoder.name != NATIVE,
                        eos_token_id=eos_token_id, tokenizer=tokenizer,
                        prefix_cache=shared_prefixes(rows, c, weight))
        sched = Scheduler(model, tokenizer, max_queue=0, engine=engine, draw_seeds=False)
        sched.log_failures = False                             # raised here instead
        left, failed = [len(rows)], []

        def event(seq, text, done):
            if on_event is not None:
                on_event(seq, text, done)
            if done:
                left[0] -= 1
                if seq.exception is not None:
                    failed.append(seq)

        seqs = sched.submit(prompts, params, event)
        if on_token is not None:
            sched.after_tokens = columns(seqs, ends_with(params, eos_token_id, tokenizer), on_token, failed,
                                         weight.device)
        while left[0]:
            sched.step()
            if failed:
                raise failed[0].exception
        return seqs
    finally:
        keep_for_next_call(storage)                            # its memory, for the next call


def text_tokenizer(model, params: SamplingParams, tokenizer=None):
    """``tokenizer``, else the model's (``model.config.tokenizer``) where ``params`` need one
    (stop strings are found in the text, a grammar is compiled for the tokens), else None."""
    if tokenizer is None and (params.stop or params.structured_outputs is not None):
        from ..io.tokenizer import get_tokenizer
        tokenizer = get_tokenizer(model.config.tokenizer)
    return tokenizer


def ends_with(params: SamplingParams, eos_token_id: int | None, tokenizer) -> Callable[[Sequence], int]:
    """What a finished sequence's columns hold after its last token in :func:`generate`'s
    result: the token that ended it (``eos_token_id`` or one of ``stop_token_ids``), else (a
    grammar complete, a stop string) ``eos_token_id``, else the tokenizer's end-of-text token,
    else 0."""
    ends = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        ends.add(eos_token_id)
    eot = getattr(tokenizer, "eot_token", None)
    pad = eos_token_id if eos_token_id is not None else eot if eot is not None else 0
    return lambda s: s.tokens[-1] if s.tokens and s.tokens[-1] in ends else pad


def columns(seqs: list[Sequence], fill: Callable[[Sequence], int], on_token, failed: list,
            device) -> Callable[[], None]:
    """A :attr:`Scheduler.after_tokens <gpt2mha.inference.scheduler.Scheduler.after_tokens>` that
    calls ``on_token`` with each new column of ids ``[len(seqs)]`` (a finished sequence's:
    ``fill(seq)``), once every running sequence has its token there; none once one failed."""
    done = [0]

    def emit():
        if failed:
            return
        k = max(len(s.tokens) for s in seqs)
        while done[0] < k:
            c = done[0]
            on_token(torch.tensor([s.tokens[c] if c < len(s.tokens) else fill(s) for s in seqs], dtype=torch.long,
                                  device=device))
            done[0] += 1
    return emit


def shared_prefixes(prompts: list[list[int]], config, weight: torch.Tensor):
    """A :class:`~gpt2mha.inference.prefix_cache.PrefixCache` for one call's ``prompts`` where two
    of them start with the same block of tokens (later rows then take the earlier rows' blocks),
    sized to hold every block of the call (at most the server's default budget,
    :func:`~gpt2mha.inference.prefix_cache.default_budget_mb`); else None. The engine drops it on
    a route that cannot keep a suffix's bits."""
    firsts = [tuple(p[:BLOCK]) for p in prompts if len(p) >= BLOCK + MIN_SUFFIX]
    if len(firsts) == len(set(firsts)):
        return None
    tokens = sum(len(p) for p in prompts)
    mb = 2 * config.n_layer * config.n_embd * tokens * weight.element_size() / 2**20
    return PrefixCache(min(mb + 1, default_budget_mb()))


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

