"""The engine: one KV cache of slots, a decoder, one sampler per slot, driven by one
:class:`~gpt2mha.inference.scheduler.Scheduler`: ``generate()`` runs it to completion over its
prompts, the server runs it continuously, admitting and finishing sequences between steps. Both
therefore take the same route for a model (:func:`~gpt2mha.inference.decoders.choose_decoder`),
sample with the same :class:`~gpt2mha.inference.sampling.RowSampler` and compute the same logits.

:class:`Engine` holds ONE :class:`~gpt2mha.core.kv_cache.KVCache` whose row ``s`` holds the
sequence in slot ``s``, from cache index 0 at its own length, and answers:

- :meth:`Engine.open`: the slot's sampler (its :class:`~gpt2mha.inference.params.SamplingParams`
  and its own generator);
- :meth:`Engine.prefill`: prompts into their slots, each alone, and each one's first token;
- :meth:`Engine.forward` / :meth:`Engine.sample` (together :meth:`Engine.decode`): one step over
  rows ``0 … n-1`` (n = highest slot asked + 1, or every slot for a decoder of one shape),
  each row at its own position over exactly its own keys, then each asked slot's next token;
- :meth:`Engine.release`: the slot's row emptied;
- :meth:`Engine.score`: the model's log-probabilities of a prompt's own tokens (``echo``), on
  the native forward's route from the prefix cache's scored blocks where it has them
  (:mod:`~gpt2mha.inference.scoring`).

Slots and token ids go in and out as Python ints. No row's numbers depend on the others on a
batch-invariant decoder: a prompt is prefilled alone, a step attends each row over its own
keys, and the products give a row the same bits in a batch of any size; a sequence's logits
are then those of its prompt alone, bit for bit. A fault while sampling one row is that row's
result, not raised. When the hooks attached to the model change (a hook added from
``generate``'s ``on_token``, say), the steps after run on a decode view made for them, where
every hook acts, for as long as they stay as they are.

Log-probabilities (``logprobs=k``) come from the model's raw logits (``log_softmax`` before
penalties, bias, temperature and filtering: the model's distribution, as OpenAI reports it).

Sources: continuous batching over a static cache (Orca, Yu et al., OSDI 2022; vLLM; gpt-fast).
"""

from __future__ import annotations

import torch

from ..core import checks
from ..core.kv_cache import KVCache
from .decoders import NATIVE, Route, ViewDecoder, choose_decoder, hook_watch
from .lora import select as select_lora
from .params import SamplingParams
from .prefix_cache import BLOCK, MIN_SUFFIX, why_inexact
from .sampling import RowSampler, sample_rows, token_logprobs

#: One token's log-probability and the most probable ids with theirs: ``(logprob, [(id, logprob), ...])``.
TokenLogprob = tuple[float, list[tuple[int, float]]]


class Engine:
    """Runs a model over one slotted KV cache.

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` (put in eval mode).
        cache: the cache to run on (``generate`` sizes one per call), or a number of slots for a
            new cache of ``n_ctx`` positions (the server).
        route: the decoder to run (:func:`~gpt2mha.inference.decoders.choose_decoder`); None:
            chosen for ``model`` with ``batch_invariant``.
        vocab_size: sample only ids below it (the tokenizer's vocabulary; default the model's).
        batch_invariant: for the decode view's products (None: its default; see
            :func:`~gpt2mha.inference.fast.for_decoding`).
        zeroed: whether ``cache``'s storage past each row's length holds zeros (False: a
            reused storage the native forward, which reads only what it wrote, left as it was;
            it is zeroed before a decoder that reads masked keys runs on it).
        eos_token_id: the end-of-text id, which a sequence's ``min_tokens`` bans (with its
            ``stop_token_ids``) unless it has ``ignore_eos`` (None: none).
        tokenizer: the model's tokenizer, for sequences with ``structured_outputs`` (their grammar
            is compiled for its tokens: :func:`~gpt2mha.inference.structured.compile_for`); None:
            such sequences are refused.
        prefix_cache: a :class:`~gpt2mha.inference.prefix_cache.PrefixCache` prompts take their
            stored prefixes from and leave their blocks in (None: none); dropped where the route
            cannot keep a suffix's bits (:func:`~gpt2mha.inference.prefix_cache.why_inexact`,
            then kept in :attr:`prefix_cache_off`). A slot with a LoRA adapter neither takes
            nor leaves blocks (its keys are the adapter's).

    Attributes:
        route: the :class:`~gpt2mha.inference.decoders.Route` (decoder and why not the others).
        cache: ``[n_layer, slots, n_head, T_max, head_dim]`` in the model's dtype (a new one:
            ``2 · n_layer · slots · n_ctx · n_embd`` values, 1.2 GB for 124M in float32 with 16
            slots; 38 MB for the built-in model).
        samplers: each slot's :class:`~gpt2mha.inference.sampling.RowSampler` (None: free).
        logprobs: each slot's newest :data:`TokenLogprob` (when opened with ``logprobs``).
        prefix_cache: the prefix cache prefills use (None: none).
        prefix_cache_off: why a prefix cache given was dropped ("" when it was not).
        cached: each slot's prompt tokens its last prefill took from the prefix cache.
        score_cached: the prompt tokens the last :meth:`score` took from the prefix cache.

    Raises:
        ValueError: slots < 1, a vocab_size outside ``[1, n_vocab]``, a batch_invariant that is
            not True, False or None.
    """

    def __init__(self, model, cache: KVCache | int, route: Route | None = None, vocab_size: int | None = None,
                 batch_invariant: bool | None = None, zeroed: bool = True, eos_token_id: int | None = None,
                 tokenizer=None, prefix_cache=None):
        c = model.config
        vocab_size = c.n_vocab if vocab_size is None else checks.as_int(vocab_size, "vocab_size", minimum=1)
        if vocab_size > c.n_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, n_vocab={c.n_vocab}]")
        if batch_invariant is not None:
            checks.flag(batch_invariant, "batch_invariant")
        self.model = model.eval()
        self.route = route or choose_decoder(self.model, batch_invariant=batch_invariant)
        self.batch_invariant = batch_invariant
        p = self.model.wte.weight
        self.device = p.device
        if not isinstance(cache, KVCache):                      # a new cache: zeros
            zeroed = True
            slots = checks.as_int(cache, "slots", minimum=1)
            cache = KVCache(c.n_layer, slots, c.n_head, c.n_ctx, c.head_dim, dtype=p.dtype, device=p.device)
        self.cache = cache
        self._zeroed = zeroed
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        n = cache.batch_size
        self.samplers: list[RowSampler | None] = [None] * n
        self.last: list[int] = [0] * n                          # each slot's newest token: its next input
        self.adapters: list[int | None] = [None] * n            # each slot's LoRA adapter (inference/lora.py)
        self._hooked = hook_watch(self.model)
        self._hooks_at_start = self._hooked()                   # what the route's decoder was made with
        self._view: ViewDecoder | None = None
        self._view_hooks = None
        self._score_view: ViewDecoder | None = None
        self._scorer = None                                     # (model signature, Scorer, its one-row cache)
        self.score_cached = 0                                   # the last score's prompt tokens from the prefix cache
        self._rows: dict[int, KVCache] = {}                     # cache.rows(n) by n (2 · n_layer views each)
        self.cached: list[int] = [0] * n                        # each slot's prompt tokens loaded from the prefix cache
        self.prefix_cache_off = "" if prefix_cache is None else why_inexact(self.route.decoder)
        self.prefix_cache = None if self.prefix_cache_off else prefix_cache
        if self.prefix_cache is not None:
            self.check_prefix_cache(0)

    @property
    def slots(self) -> int:
        """Rows of the cache (the most sequences decoded together)."""
        return self.cache.batch_size

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        """Each slot's newest token's :data:`TokenLogprob` (None unless opened with ``logprobs``)."""
        return [None if s is None else s.last_logprob for s in self.samplers]

    @property
    def decoder(self):
        """The decoder this step runs: the route's while the hooks attached to the model are the
        ones it was made with; else a decode view made for the hooks now attached (the view keeps
        a hooked module itself, where it would swap in a faster copy)."""
        hooks = self._hooked()
        if hooks == self._hooks_at_start:
            return self.route.decoder
        if self._view is None or self._view_hooks != hooks:
            self._view, self._view_hooks = ViewDecoder(self.model, self.batch_invariant), hooks
        if not self._zeroed:                                    # a hooked pattern reads every row's span
            self.cache.clear_unwritten()
            self._zeroed = True
        return self._view

    def open(self, slot: int, params: SamplingParams, seed: int | None, logprobs: int | None = None,
             row: int | None = None, prompt=None, adapter: int | None = None) -> None:
        """Give ``slot`` its sampler: ``params`` (checked; logit_bias and stop ids below
        ``vocab_size``) and a generator seeded with ``seed`` (None: torch's global one). The row
        itself is filled by :meth:`prefill`. ``logprobs``: k to record each token's logprob and
        the k most likely ids (default ``params.logprobs``). ``row``: the row its errors name.
        ``prompt``: the tokens ``repetition_penalty`` and ``no_repeat_ngram_size`` read before
        the generated ones (None: the prompt :meth:`prefill` is given; the scheduler gives the
        whole prompt where a sliding window prefills only its end). ``adapter``: the index of the
        LoRA adapter the slot's rows take (:mod:`~gpt2mha.inference.lora`; None: the model's
        default, the base model unless :func:`~gpt2mha.inference.lora.using` says otherwise). With
        ``params.structured_outputs`` the sampler takes its own state of the grammar compiled for
        the engine's tokenizer (compiled once per constraint and kept).

        Raises:
            ValueError: the slot is out of range or in use (not released since it was opened),
                a logit_bias id is outside the vocabulary, or ``structured_outputs`` on an engine
                without a tokenizer; :class:`~gpt2mha.inference.params.GrammarError` for a grammar
                llguidance refuses for this tokenizer.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot={slot} is out of range [0, {self.slots})")
        if self.samplers[slot] is not None:
            raise ValueError(f"slot={slot} is in use; release it first")
        params.check_vocab(self.vocab_size)
        self.samplers[slot] = RowSampler(params, seed, self.vocab_size, self.device,
                                         params.logprobs if logprobs is None else logprobs, row, self.eos_token_id,
                                         prompt, self.grammar(params))
        self.adapters[slot] = adapter

    def grammar(self, params: SamplingParams):
        """``params.structured_outputs`` compiled for the engine's tokenizer (None without one).

        Raises:
            ValueError: structured outputs on an engine without a tokenizer.
            GrammarError: llguidance refuses the grammar for this tokenizer.
        """
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer: this engine was made without one")
        from .structured import compile_for
        return compile_for(params.structured_outputs, self.tokenizer)

    def release(self, slot: int) -> None:
        """Empty ``slot``: its row's length is 0 again and its sampler is dropped. For a decoder
        that reads masked keys, what the row held is zeroed (a failed sequence's NaN keys would
        reach the next one's results through its mask)."""
        if self.route.decoder.reads_masked_keys:                # what it wrote, [0, length): the rest is zeros
            n = self.cache.lengths[slot]
            self.cache.k[:, slot, :, :n].zero_()
            self.cache.v[:, slot, :, :n].zero_()
        self.cache.reset(slot)
        self.samplers[slot] = None
        self.last[slot] = 0
        self.adapters[slot] = None

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list) -> list[int | Exception]:
        """Prefill ``prompts[i]`` (token ids: a list or a 1-D tensor, non-empty, checked by the
        caller) into slot ``slots[i]`` (each opened and empty), each alone, and sample each
        one's first token from its prefill's logits. A sampler not given its prompt at
        :meth:`open` takes ``prompts[i]``.

        Returns:
            one result per slot: the token id, or the exception its sampling raised.

        Raises:
            Exception: whatever the forward raised (nothing stays written in the slots then).
        """
        logits = self.prefill_logits(slots, prompts)
        for slot, prompt in zip(slots, prompts):
            if not self.samplers[slot].begun:
                self.samplers[slot].begin(prompt)
        return self.sample(slots, logits, range(len(slots)))

    @torch.inference_mode()
    def prefill_logits(self, slots: list[int], prompts: list) -> torch.Tensor:
        """:meth:`prefill`'s forward alone: each prompt into its slot, logits ``[len(slots), V]``.
        With a prefix cache (on the route's own decoder: no hooks attached), a prompt's stored
        prefix is copied into its slot and only the rest is prefilled, then its blocks are kept."""
        logits = []
        decoder = self.decoder
        store = self.prefix_cache if decoder is self.route.decoder else None
        if store is not None:
            store.bind(self.computed_by())
        try:
            for slot, prompt in zip(slots, prompts):
                ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device).view(1, -1)   # [1, T]
                select_lora(self.model, [self.adapters[slot]])
                row = self.cache.row(slot)
                self.cached[slot] = 0
                if store is None or self.adapters[slot] is not None:
                    logits.append(decoder.prefill(ids, row))
                    continue
                tokens = ids[0].tolist()
                n = self.cached[slot] = BLOCK * len(store.load(tokens, row))
                logits.append(decoder.prefill(ids[:, n:], row))
                store.store(tokens, row)
        except Exception:
            for slot in slots:                                  # nothing half-written stays in a slot
                self.cache.reset(slot)
            raise
        return torch.cat(logits)

    @torch.inference_mode()
    def forward(self, slots: list[int], windows: dict[int, list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """One decode step's forward for the sequences in ``slots`` (each prefilled, its last
        token known): rows ``0 … max(slots)`` (every row for a decoder of one shape), each
        with its newest token. Rows in between that were not asked (free: length 0, they read
        only their own key) are computed and keep their length.

        ``windows``: slots whose context is full (a sliding window, ``SamplingParams.sliding_window``),
        each with its last ``n_ctx`` tokens (its newest last): the slot's row of the cache is
        emptied (no longer read) and its logits are the model's over those tokens alone,
        positions restarting at 0 (:meth:`window_logits`; no cache: one forward of the window).

        Returns:
            ``(logits [n, V], rows)``: ``rows[i]`` is ``slots[i]``'s row of the logits.

        Raises:
            Exception: whatever the forward raised (then every asked slot has failed).
        """
        if windows:
            for slot in windows:                                # its row of the cache is no longer read
                self.cache.reset(slot)
        decoder = self.decoder
        n = self.slots if decoder.fixed_batch else max(slots) + 1
        rows = self._rows.get(n)
        if rows is None:                                        # views of rows 0 … n-1, made once for each n
            rows = self._rows[n] = self.cache if n == self.slots else self.cache.rows(n)
        before = rows.lengths
        ids = torch.tensor(self.last[:n], dtype=torch.long, device=self.device)[:, None]    # [n, 1]
        select_lora(self.model, self.adapters[:n])
        logits = decoder.step(ids, rows)                                                     # [n, V]
        if len(slots) < n:
            asked = set(slots)
            rows.trim([m + 1 if row in asked else m for row, m in enumerate(before)])   # the others keep theirs
        if windows:
            for slot in sorted(windows):
                logits[slot] = self.window_logits(slot, windows[slot])
        return logits, slots

    @torch.inference_mode()
    def window_logits(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """The model's next-token logits ``[V]`` after ``tokens`` (at most ``n_ctx``) alone, with
        ``slot``'s LoRA adapter: one forward of ``[1, len(tokens)]`` without the cache, positions
        0 … len-1 (a sliding window's step)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        select_lora(self.model, [self.adapters[slot]])
        return self.model(ids, last_only=True, validate=False).logits[0, -1]

    def sample(self, slots: list[int], logits: torch.Tensor, rows) -> list[int | Exception]:
        """Slot ``slots[i]``'s next token from ``logits[rows[i]]``: the token id, or the
        exception its sampling raised (that slot alone fails)."""
        out = sample_rows([self.samplers[s] for s in slots], logits, rows)
        for slot, token in zip(slots, out):
            if not isinstance(token, Exception):
                self.last[slot] = token
        return out

    def decode(self, slots: list[int], windows: dict[int, list[int]] | None = None) -> list[int | Exception]:
        """:meth:`forward` (``windows``: its sliding windows) then :meth:`sample`: each asked
        slot's next token (or its exception)."""
        logits, rows = self.forward(slots, windows)
        return self.sample(slots, logits, rows)

    def warm_up(self) -> None:
        """One greedy prefill of one token and one decode step in the first free slot, then the
        slot emptied: loads what the route loads and compiles what it compiles (a compiled
        step: 10–60 s), and measures the scorer's exactness with the prefix cache
        (:meth:`score`), so that no request pays for it. Nothing stays in the cache, and the
        prefix cache counts nothing."""
        slot = self.samplers.index(None)
        self.open(slot, SamplingParams(max_tokens=2, temperature=0), None)
        store, self.prefix_cache = self.prefix_cache, None
        try:
            self.prefill([slot], [[0]])
            self.decode([slot])
        finally:
            self.prefix_cache = store
            self.release(slot)
        scorer = self.scorer() if self.prefix_cache is not None else None
        if scorer is not None:
            self._score_store(scorer)                           # measured now, not in a request

    @torch.inference_mode()
    def check_prefix_cache(self, slot: int) -> bool:
        """Measure on this machine what :func:`~gpt2mha.inference.prefix_cache.why_inexact`
        reasons: a random prompt (up to 69 tokens) prefilled whole into the free ``slot``, then
        prefilled as a prefix and the rest, cut at 16, 32 and 37 tokens: the last logits and
        every key and value must be equal. If not, the prefix cache is dropped
        (:attr:`prefix_cache_off` says so). Nothing stays in the slot. Measured once for the
        route's native forward (kept on it: one model's weights); skipped where the cache's rows
        are too short for a cut or the slot holds a sequence. Returns whether the cache is kept."""
        if self.prefix_cache is None:
            return False
        native = getattr(self.route.decoder, "native", None)
        why = getattr(native, "prefix_cache_differs", None)
        if why is None:
            why = self._measure_prefix_cache(slot)
            if why is not None and native is not None:
                native.prefix_cache_differs = why
        if why:
            self.prefix_cache_off, self.prefix_cache = why, None
        return self.prefix_cache is not None

    def _measure_prefix_cache(self, slot: int) -> str | None:
        # check_prefix_cache's measurement: "" (equal), why not, or None (no room for a cut)
        n = min(self.model.config.n_ctx, self.cache.max_len, 3 * BLOCK + 21)
        if n < BLOCK + MIN_SUFFIX or self.cache.lengths[slot]:
            return None
        prompt = torch.randint(0, self.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        decoder, row = self.route.decoder, self.cache.row(slot)

        def fill(parts):
            try:
                for part in parts:
                    logits = decoder.prefill(torch.tensor([part], dtype=torch.long, device=self.device), row)
                m = row.lengths[0]
                return logits, row.k[:, 0, :, :m].clone(), row.v[:, 0, :, :m].clone()
            finally:
                self.cache.reset(slot)
        whole = fill([prompt])
        for cut in (c for c in (BLOCK, 2 * BLOCK, 37) if c <= n - MIN_SUFFIX):
            split = fill([prompt[:cut], prompt[cut:]])
            if not all(torch.equal(a, b) for a, b in zip(whole, split)):
                return (f"measured here: a prompt's last {n - cut} tokens prefilled after its first {cut} differed "
                        "from the whole prompt's")
        return ""

    def computed_by(self, signature: tuple | None = None) -> tuple:
        """What the prefix cache's blocks depend on, as a comparable value: the model's signature
        (which tensors, their writes in place, their storage, each int8 layer's activations,
        each LayerNorm's eps: :func:`~gpt2mha.inference.compiled.model_signature`; ``signature``
        where the caller has it), the route and the cache's dtype. The store is emptied when it
        changes (:meth:`~gpt2mha.inference.prefix_cache.PrefixCache.bind`). A tensor made in
        inference mode counts no writes: an edit in place of such a weight goes unseen."""
        from .compiled import model_signature
        sig = model_signature(self.model) if signature is None else signature
        return (id(self.model), sig, self.route.decoder.name, self.cache.k.dtype)

    def scorer(self):
        """The :class:`~gpt2mha.inference.scoring.Scorer` :meth:`score` runs for the model as it
        is now, or None: only where the route is the native forward and nothing is hooked (the
        decode view scores otherwise). Made again when the model's signature changed."""
        from .compiled import model_signature
        from .scoring import Scorer, why_not
        if self.route.decoder.name != NATIVE or self._hooked() != self._hooks_at_start:
            return None
        sig = model_signature(self.model)
        if self._scorer is None or self._scorer[0] != sig:
            if why_not(self.model):
                return None
            c = self.model.config
            row = KVCache(c.n_layer, 1, c.n_head, c.n_ctx, c.head_dim, dtype=self.model.wte.weight.dtype,
                          device=self.device)
            self._scorer = (sig, Scorer(self.model), row)
        return self._scorer[1]

    @torch.inference_mode()
    def score(self, prompt: list[int], k: int, adapter: int | None = None) -> list[TokenLogprob]:
        """The model's log-probability of each token of ``prompt`` after the ones before it, and
        the ``k`` most probable ids there: ``len(prompt) - 1`` entries, for tokens 1 … T-1
        (token 0 has no context); apart from every slot, so a prompt scores the same whatever
        else is running. With LoRA ``adapter`` (an index, as :meth:`open` takes).

        On the native forward's route (nothing hooked) the prompt runs through the
        :meth:`scorer` (every row's bits its own), and with a prefix cache its stored scored
        blocks are taken: their keys and values, each position's hidden state and their
        entries for this k, so only the rest is computed, with the same bits as the prompt
        scored whole (:attr:`score_cached` says how many tokens came from the store). Elsewhere
        one forward of ``[1, T]`` through the decode view.

        Source: ``log_softmax`` of the logits at position t-1 read at token t, as the loss of
        :class:`~gpt2mha.core.model.GPT2` (and lm-evaluation-harness's ``loglikelihood``).

        Raises:
            NonFiniteLogitsError: a position's logits hold NaN or +inf (nothing is stored).
        """
        self.score_cached = 0
        if len(prompt) < 2:
            return []
        scorer = self.scorer() if adapter is None else None
        if scorer is not None:
            return self._score_rows(scorer, list(prompt), k)
        view = self.decoder
        if not isinstance(view, ViewDecoder):                   # the native or compiled route: its view
            if self._score_view is None:
                self._score_view = ViewDecoder(self.model, self.batch_invariant)
            view = self._score_view
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        select_lora(self.model, [adapter])
        logits = view.view(ids, validate=False).logits[0, :-1, :self.vocab_size]      # [T-1, V]
        chosen, top = token_logprobs(logits, ids[0, 1:], k)
        return list(zip(chosen, top))

    def _score_rows(self, scorer, prompt: list[int], k: int) -> list[TokenLogprob]:
        # score on the scorer: blocks from the store where it may serve, the rest computed, then
        # the prompt's whole blocks kept (keys and values from the scorer's row, hidden states, entries)
        store = self._score_store(scorer)
        root = store.root(("score", self.vocab_size)) if store is not None else 0
        row = self._scorer[2]
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        row.reset(0)
        try:
            blocks = store.load(prompt, row, root, keep=1) if store is not None else []
            n = len(blocks) * BLOCK
            hidden = scorer.hidden(ids[None, n:], row)                       # [T-n, E]
            stored = torch.cat([b.hidden for b in blocks]) if blocks else hidden[:0]   # [n, E]
            # the logits at positions max(n-1, 0) … T-2, read at tokens max(n, 1) … T-1
            logits = scorer.head(torch.cat([stored[-1:], hidden[:-1]]))[:, :self.vocab_size]
            chosen, top = token_logprobs(logits, ids[max(n, 1):], k)
            entries = [None] + self._stored_entries(scorer, blocks, stored, ids, k) + list(zip(chosen, top))
            if store is not None:
                store.store(prompt, row, root, hidden=torch.cat([stored, hidden]), rows=(k, entries))
        finally:
            row.reset(0)
        self.score_cached = n
        return entries[1:]

    def _stored_entries(self, scorer, blocks, stored: torch.Tensor, ids: torch.Tensor, k: int) -> list:
        # the entries of tokens 1 … n-1 (n: the tokens of the blocks loaded): kept for k, or
        # computed again from the stored hidden states (the same rows, the same bits)
        if not blocks:
            return []
        if all(k in b.rows for b in blocks):
            return [e for b in blocks for e in b.rows[k]][1:]
        n = len(blocks) * BLOCK
        chosen, top = token_logprobs(scorer.head(stored[:-1])[:, :self.vocab_size], ids[1:n], k)
        return list(zip(chosen, top))

    def _score_store(self, scorer):
        # the prefix cache where a scored prompt may take blocks from it: the engine holds one,
        # and this scorer's suffixes were measured to have a whole prompt's bits
        store = self.prefix_cache
        if store is None:
            return None
        store.bind(self.computed_by(self._scorer[0]))
        if scorer.differs is None:
            scorer.differs = self._measure_scorer(scorer)
        return store if scorer.differs == "" else None

    @torch.inference_mode()
    def _measure_scorer(self, scorer) -> str:
        # a random prompt (up to 69 tokens) scored whole and as a prefix then the rest, cut at 1,
        # 16, 37 and 68 tokens: every hidden state, key and value must be equal
        row = self._scorer[2]
        n = min(self.model.config.n_ctx, 3 * BLOCK + 21)
        prompt = torch.randint(0, self.vocab_size, (n,), generator=torch.Generator().manual_seed(0),
                               device=self.device)

        def fill(parts):
            row.reset(0)
            try:
                hidden = torch.cat([scorer.hidden(part[None], row) for part in parts])
                return hidden, row.k[:, 0, :, :n].clone(), row.v[:, 0, :, :n].clone()
            finally:
                row.reset(0)
        whole = fill([prompt])
        for cut in (c for c in (1, BLOCK, 37, n - 1) if 0 < c < n):
            split = fill([prompt[:cut], prompt[cut:]])
            if not all(torch.equal(a, b) for a, b in zip(whole, split)):
                return (f"measured here: a prompt's last {n - cut} tokens scored after its first {cut} differed "
                        "from the whole prompt's")
        return ""
