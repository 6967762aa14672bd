"""Exact prefix caching (gpt2mha.inference.prefix_cache): a request served from stored blocks gets
bitwise the tokens and logits of the same request on a cold server, on every route that keeps a
suffix's bits; elsewhere the cache is off.

Reference: the same plan on a cold :class:`Scheduler` (``prefix_cache_mb=0``), whose sequences are
batch invariant (tests/test_batch_invariance.py). The model is a random 2-layer one with n_ctx 512
(the built-in model's 256 cannot hold the 400-token prefix the issue asks for).
"""

import logging
import random

import pytest
import torch

from conftest import record_sampled_logits, small_model
from gpt2mha.inference.decoders import NATIVE, Route, ViewDecoder
from gpt2mha.inference.dense import has_bf16_dot
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.params import SamplingParams
from gpt2mha.inference.prefix_cache import BLOCK, PrefixCache, why_inexact
from gpt2mha.io.tokenizer import get_tokenizer
from gpt2mha.inference.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not __import__("gpt2mha.inference.quant.gemv", fromlist=["x"]).available(),
                                reason="the native forward needs the C++ kernels")

#: the routes the server takes by default: (dtype, weight format, activations); the native forward
#: for float32, bf16, fp16, int8 per_row and int4 per_block, the decode view for the others
ROUTES = [(torch.float32, "float", None), (torch.bfloat16, "float", None), (torch.float16, "float", None),
          (torch.float32, "int8", "per_row"), (torch.float32, "int4", "per_block"),
          (torch.float32, "int8", None), (torch.float32, "int4", None), (torch.bfloat16, "int8", None)]
ROUTE_IDS = ["float32", "bf16", "fp16", "int8-per_row", "int4-per_block", "int8", "int4", "bf16-int8"]
#: where the cache is on: the native forward's exact kinds (bf16 with AVX-512 BF16 only)
EXACT = {"float32", "fp16", "int8-per_row", "int4-per_block"} | ({"bf16"} if has_bf16_dot() else set())


@pytest.fixture(autouse=True)
def threads(one_thread):
    """One intra-op thread (a busy 2-core box)."""


def model_of(dtype, fmt, activations=None):
    model = small_model(3, n_vocab=256, n_ctx=512, n_embd=64, n_head=4, n_layer=2, noise="all", scale=0.05).to(dtype)
    if fmt != "float":
        kw = {"activations": activations} if activations else {}
        model.quantize(fmt, method="rtn", **({"group_size": 32} if fmt == "int4" else {}), **kw)
    return model


def serve(model, plan, prefix_cache_mb, monkeypatch):
    """Drive a Scheduler of 4 slots through ``plan`` (per request: steps to run first, prompt,
    max_tokens, steps after which to cancel it or None); each request's tokens and the logits
    [n, V] its tokens were chosen from, and the scheduler."""
    real = Engine.sample
    seen = record_sampled_logits(monkeypatch, lambda: sched.slots)
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=4, max_queue=64, batch_invariant=True,
                      prefix_cache_mb=prefix_cache_mb)
    seqs, cancels = [], []
    for i, (steps, ids, n, cancel_after) in enumerate(plan):
        for _ in range(steps):
            sched.step()
            for seq, at in [c for c in cancels if c[1] <= sched.counts["steps"]]:
                sched.cancel(seq)
        seq, = sched.submit([ids], SamplingParams(max_tokens=n, temperature=0, logprobs=2), lambda *a: None)
        seqs.append(seq)
        if cancel_after is not None:
            cancels.append((seq, sched.counts["steps"] + cancel_after))
    for _ in range(200):
        if sched.idle():
            break
        sched.step()
        for seq, at in [c for c in cancels if c[1] <= sched.counts["steps"]]:
            sched.cancel(seq)
    assert sched.idle()
    monkeypatch.setattr(Engine, "sample", real)
    return [(s.tokens, torch.stack(seen[id(s)]) if id(s) in seen else None, s) for s in seqs], sched


def shared_prefix_plan(seed=0, n=30, prefix=405):
    """30 requests on one 405-token prefix (25 blocks and 5 tokens: it ends mid-block) with
    suffixes of 0 … 40 tokens (12 and 28: a prompt of whole blocks and one token) cut from two
    tails (so whole prompts recur too), in a shuffled order: some submitted together
    (concurrent), some steps apart, a few cancelled a step after admission (while their blocks
    are stored)."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (prefix,), generator=gen).tolist()
    tail = torch.randint(0, 256, (40,), generator=gen).tolist()
    others = torch.randint(0, 256, (30,), generator=gen).tolist()
    plan = []
    for i in range(n):
        k = rnd.choice([0, 1, 2, 3, 11, 12, 16, 17, 28, 40])
        suffix = tail[:k] if i % 2 else others[:k]          # prompts recur whole, or part past the prefix
        plan.append((rnd.choice([0, 0, 1, 2]), head + suffix, rnd.randint(2, 5), 1 if i % 7 == 3 else None))
    return plan


@pytest.mark.parametrize("budget", ["small", "ample"])
@pytest.mark.parametrize("dtype,fmt,activations", ROUTES, ids=ROUTE_IDS)
def test_shared_prefix_requests_equal_a_cold_server_bitwise(dtype, fmt, activations, budget, monkeypatch, request):
    """Every request not cancelled: tokens, logits and logprobs bitwise equal to a cold server's.
    Where the cache is on (EXACT) it hit; a small budget (16 blocks of this model) evicted, an
    ample one served whole prefixes (suffixes down to MIN_SUFFIX tokens). Elsewhere it is off."""
    route_id = request.node.callspec.id.rsplit("-", 1)[0]
    model = model_of(dtype, fmt, activations)
    plan = shared_prefix_plan()
    block_mb = 2 * 2 * 64 * BLOCK * model.wte.weight.element_size() / 2**20    # K and V, 2 layers, n_embd 64
    cold, cold_sched = serve(model, plan, 0, monkeypatch)
    warm, sched = serve(model, plan, 16 * block_mb if budget == "small" else 8, monkeypatch)
    assert cold_sched.engine.prefix_cache is None
    stats = sched.prefix_cache_stats()
    if route_id not in EXACT:
        assert "off" in stats, stats
    elif budget == "small":
        assert stats["hits"] >= 20 * 256 and stats["evictions"] > 0, stats
    else:
        assert stats["hits"] >= 25 * 400 and stats["evictions"] == 0, stats
    for i, ((tok_c, log_c, seq_c), (tok_w, log_w, seq_w)) in enumerate(zip(cold, warm)):
        if plan[i][3] is not None:
            continue
        assert tok_w == tok_c, f"request {i}"
        assert torch.equal(log_w, log_c), f"request {i}"
        assert seq_w.logprobs == seq_c.logprobs, f"request {i}"


def echo_plan(seed=1, n=16, prefix=405):
    """lm-evaluation-harness's requests over shared contexts: a 405-token context (it ends
    mid-block) then continuations of 1 … 30 tokens, scored with ``echo`` and ``logprobs`` k of 1
    (lm_eval's), 2 or 5, generating 0 or 1 tokens; one prompt of whole blocks and one token, one
    prompt recurring with another k. Per request: (prompt, k, max_tokens)."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 256, (prefix,), generator=gen).tolist()
    plan = []
    for i in range(n):
        cont = torch.randint(0, 256, (rnd.choice([1, 2, 7, 12, 30]),), generator=gen).tolist()
        plan.append((context + cont, rnd.choice([1, 1, 2, 5]), i % 2))
    plan += [(context[:25 * BLOCK + 1], 1, 0), (plan[3][0], 5 if plan[3][1] != 5 else 2, 0)]
    return plan


def serve_echo(model, plan, prefix_cache_mb):
    """Drive a Scheduler of 4 slots through ``plan`` (echo_plan's), four requests at a time: each
    request's finished Sequence, and the scheduler."""
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=4, max_queue=64, batch_invariant=True,
                      prefix_cache_mb=prefix_cache_mb)
    seqs = []
    for at in range(0, len(plan), 4):
        for ids, k, n in plan[at:at + 4]:
            seqs += sched.submit([ids], SamplingParams(max_tokens=n, temperature=0, logprobs=k, echo=True),
                                 lambda *a: None)
        for _ in range(50):
            if sched.idle():
                break
            sched.step()
        assert sched.idle()
    return seqs, sched


@pytest.mark.parametrize("dtype,fmt,activations", ROUTES, ids=ROUTE_IDS)
def test_echo_logprobs_of_shared_contexts_equal_a_cold_server_bitwise(dtype, fmt, activations, request):
    """Scored prompts (``echo`` + ``logprobs``: lm_eval's ``loglikelihood``) over a shared
    405-token context: every prompt entry (token logprob and top-k, the prompt's every position)
    and generated token bitwise a cold server's. Where the cache is on (EXACT) the scores took
    the context's blocks: each request after the first scored from its whole blocks (its
    ``cached_tokens``), and a k asked again recomputes its entries from the stored hidden states.
    Independent reference: the model's own forward (log_softmax in float64), to float rounding."""
    route_id = request.node.callspec.id
    model = model_of(dtype, fmt, activations)
    plan = echo_plan()
    cold, cold_sched = serve_echo(model, plan, 0)
    warm, sched = serve_echo(model, plan, 8)
    for i, (c, w) in enumerate(zip(cold, warm)):
        assert c.finish_reason == w.finish_reason == "length" and c.error is None, f"request {i}"
        assert w.prompt_logprobs == c.prompt_logprobs, f"request {i}"
        assert w.tokens == c.tokens and w.logprobs == c.logprobs, f"request {i}"
    stats = sched.prefix_cache_stats()
    if route_id not in EXACT:
        assert "off" in stats, stats
        assert all(w.cached_tokens == 0 for w in warm)
    else:
        assert all(w.cached_tokens >= 25 * BLOCK for w in warm[4:]), [w.cached_tokens for w in warm]
        assert all(c.cached_tokens == 0 for c in cold)
    ids, k, _ = plan[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)            # [T, V]
    tol = 1e-4 if dtype == torch.float32 and fmt == "float" else 0.1
    got = torch.tensor([lp for lp, _ in warm[0].prompt_logprobs], dtype=torch.float64)
    assert torch.allclose(got, ref[torch.arange(len(ids) - 1), ids[1:]], atol=tol)


def test_a_scored_prompt_served_whole_from_the_store_recomputes_no_block():
    """A prompt scored again takes every whole block but its last token's (a scored suffix of
    one token is exact: row-alone products), and a prompt of 16·m + 1 tokens takes m blocks."""
    model = model_of(torch.float32, "float")
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    cold = Engine(model, 1)
    prompt = torch.randint(0, 256, (8 * BLOCK + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    assert engine.score(prompt, 1) == cold.score(prompt, 1) and engine.score_cached == 0
    assert engine.score(prompt, 1) == cold.score(prompt, 1) and engine.score_cached == 8 * BLOCK
    assert engine.score(prompt[:8 * BLOCK], 1) == cold.score(prompt[:8 * BLOCK], 1) and engine.score_cached == 7 * BLOCK


def test_a_scorer_whose_suffix_would_differ_takes_nothing_from_the_store(monkeypatch):
    """The engine measures the scorer before a scored prompt takes stored blocks: one whose
    suffix rounds otherwise (here 1e-6 added to its hidden states when the row already holds
    keys) is measured so and scores every prompt whole."""
    from gpt2mha.inference.scoring import Scorer

    real = Scorer.hidden
    monkeypatch.setattr(Scorer, "hidden",
                        lambda self, ids, cache: real(self, ids, cache) + (1e-6 if cache.lengths[0] > ids.shape[1] else 0))
    engine = Engine(model_of(torch.float32, "float"), 1, prefix_cache=PrefixCache(8))
    prompt = list(range(3 * BLOCK + 5))
    first = engine.score(prompt, 1)
    assert engine.score(prompt, 1) == first and engine.score_cached == 0
    assert engine.scorer().differs.startswith("measured here") and engine.prefix_cache.queries == 0


def test_completions_echo_requests_as_lm_eval_sends_them_equal_a_cold_server():
    """lm_eval's ``local-completions`` request (``echo``, ``logprobs=1``, ``max_tokens=1``,
    ``temperature=0``, the prompt as token ids) for 4 choices after one 220-byte context, against a
    live server (built-in model, float32) with the prefix cache and one without: the JSON
    ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset) equal; every request after
    the first reports the context's whole blocks as ``cached_tokens``, and the store counts two
    look-ups a request (its scoring and its prefill), both hits after the first request."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from gpt2mha import DEFAULT_MODEL, GPT2
    from gpt2mha.serving.server import serve_in_thread

    model, tok = GPT2.from_pretrained(DEFAULT_MODEL), get_tokenizer("bytes")
    context = ("KING RICHARD III:\nNow is the winter of our discontent made glorious summer by this sun of York; "
               "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. Now are our "
               "brows bound with victorious wreaths, our bruised arms hung up for monuments, our stern alarums "
               "changed to merry meetings, our dreadful marches to delightful measures.")[:220]
    choices = [" crown", " horse", " kingdom", " song"]
    answers, stats = {}, {}
    for budget in (16, 0):
        sched = Scheduler(model, tok, max_batch=2, max_queue=8, prefix_cache_mb=budget)
        with serve_in_thread(sched, DEFAULT_MODEL) as url:
            answers[budget] = [httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": tok.encode(context + c), "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
                "seed": 1234}).json() for c in choices]
        stats[budget] = sched.prefix_cache_stats()
    for warm, cold in zip(answers[16], answers[0]):
        assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers[16]]
    assert cached[0] == 0 and all(n == 13 * BLOCK for n in cached[1:]), cached
    # each request looked up twice (its scoring, then its prefill), and both found the context
    assert stats[16]["queries"] == 2 * sum(len(tok.encode(context + c)) for c in choices)
    assert stats[16]["hits"] == 2 * 3 * 13 * BLOCK


def test_a_one_token_suffix_and_a_prompt_of_whole_blocks_are_prefilled_not_loaded():
    """A prompt of stored blocks and one token still prefills its last MIN_SUFFIX (2) tokens or
    more: a one-token suffix would run the decode step's path (other bits)."""
    model = model_of(torch.float32, "float")
    store = PrefixCache(8)
    engine = Engine(model, 1, prefix_cache=store)
    prompt = torch.randint(0, 256, (8 * BLOCK + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.open(0, SamplingParams(max_tokens=1, temperature=0), 0)
    cold = engine.prefill_logits([0], [prompt])
    engine.release(0)
    assert store.stats()["blocks"] == 8
    engine.open(0, SamplingParams(max_tokens=1, temperature=0), 0)
    warm = engine.prefill_logits([0], [prompt])
    assert store.hits == 7 * BLOCK and torch.equal(warm, cold)


@pytest.mark.parametrize("dtype,fmt,activations", [(torch.float32, "int8", "exact"), (torch.float32, "int4", "exact")])
def test_routes_whose_prompt_products_block_rows_have_no_prefix_cache(dtype, fmt, activations):
    """The decode view (MKL's float32 GEMM, the dequantized int8/int4 products) blocks a prompt's
    rows by its length: measured there, a suffix's logits differ by ~1e-4; the cache is off."""
    model = model_of(dtype, fmt, activations)
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    assert engine.route.decoder.name != NATIVE
    assert engine.prefix_cache is None and "block rows" in engine.prefix_cache_off
    view = Engine(model_of(torch.float32, "float"), 1, Route(ViewDecoder(model, True), {}), prefix_cache=PrefixCache(8))
    assert view.prefix_cache is None


def test_bf16_native_prompts_keep_the_cache_only_with_avx512_bf16():
    """Without AVX-512 BF16 a bf16 prompt of 32 rows or more takes oneDNN's GEMM (rows blocked by
    count: measured 4 of 48 splits differing here); with it every product is row-alone."""
    engine = Engine(model_of(torch.bfloat16, "float"), 1, prefix_cache=PrefixCache(8))
    assert (engine.prefix_cache is not None) == has_bf16_dot()
    assert why_inexact(engine.route.decoder) == ("" if has_bf16_dot() else engine.prefix_cache_off)


def test_hooks_attached_bypass_the_cache():
    model = model_of(torch.float32, "float")
    store = PrefixCache(8)
    engine = Engine(model, 1, prefix_cache=store)
    handle = model.h[0].register_forward_hook(lambda *a: None)
    try:
        engine.open(0, SamplingParams(max_tokens=1, temperature=0), 0)
        engine.prefill_logits([0], [list(range(40))])
    finally:
        handle.remove()
    assert store.queries == 0 and not store.blocks


# ------------------------------------------------------------------------------ invalidation
def prefill_and_score(engine, prompt, k=2):
    """Slot 0's prefill logits and the prompt's score entries on ``engine`` (the slot emptied)."""
    engine.open(0, SamplingParams(max_tokens=1, temperature=0), 0)
    try:
        logits = engine.prefill_logits([0], [prompt])
    finally:
        engine.release(0)
    return logits, engine.score(prompt, k)


def shared_prompts(seed=7, n=3, prefix=5 * BLOCK + 3):
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 256, (prefix,), generator=gen).tolist()
    return [head + torch.randint(0, 256, (5,), generator=gen).tolist() for _ in range(n)]


def assert_same(warm, cold):
    assert torch.equal(warm[0], cold[0]) and warm[1] == cold[1]


def test_a_weight_edited_in_place_empties_the_store():
    """A live server's model edited in place (the native forward reads the float32 weights
    themselves): prompts after the edit get a cold server's answers for the edited model, not
    blocks computed before it (prefill and scoring alike)."""
    model = model_of(torch.float32, "float")
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    first, second, _ = shared_prompts()
    prefill_and_score(engine, first)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(1.5)
    warm = prefill_and_score(engine, second)
    assert_same(warm, prefill_and_score(Engine(model, 1), second))
    assert engine.prefix_cache.flushes == 1 and engine.cached[0] == 0 and engine.score_cached == 0
    assert_same(prefill_and_score(engine, second), warm)             # the edited model's blocks serve again
    assert engine.cached[0] > 0 and engine.score_cached > 0


def test_a_model_quantized_in_place_scores_on_its_new_layers_from_an_empty_store():
    """``model.quantize`` on a live engine's model: the scorer is made again for the quantized
    layers and takes nothing the float32 model stored: its entries are a cold engine's on the
    quantized model."""
    model = model_of(torch.float32, "float")
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    first, second, _ = shared_prompts()
    engine.score(first, 2)
    model.quantize("int8", method="rtn", activations="per_row")
    warm = engine.score(second, 2)
    assert warm == Engine(model, 1).score(second, 2)
    assert engine.prefix_cache.flushes == 1 and engine.score_cached == 0


def test_another_dtype_sharing_a_store_takes_none_of_its_blocks():
    """One store given to a float32 engine and then to an fp16 engine of the same weights: the
    fp16 engine's answers are a cold fp16 engine's (a float32 block copied into its fp16 cache
    would round otherwise)."""
    import copy

    model = model_of(torch.float32, "float")
    half = copy.deepcopy(model).half()
    store = PrefixCache(8)
    first, second, _ = shared_prompts()
    prefill_and_score(Engine(model, 1, prefix_cache=store), first)
    engine = Engine(half, 1, prefix_cache=store)
    assert_same(prefill_and_score(engine, second), prefill_and_score(Engine(half, 1), second))
    assert store.flushes == 1 and engine.cached[0] == 0 and engine.score_cached == 0


def test_steering_hooks_bypass_the_store_for_scoring_too():
    """A steering hook (a vector added to block 0's output) on a live engine's model: prefill and
    scoring run the decode view with the hook acting and touch no stored block (their answers
    are a cold engine's with the same hook); once it is removed, the blocks stored before it serve
    again, with a cold engine's answers."""
    model = model_of(torch.float32, "float")
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    first, second, third = shared_prompts()
    prefill_and_score(engine, first)
    before = dict(engine.prefix_cache.stats())
    steer = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(0))
    handle = model.h[0].register_forward_hook(lambda m, args, out: (out[0] + steer, *out[1:]))
    try:
        hooked = prefill_and_score(engine, second)
        assert engine.prefix_cache.stats() == before
        assert_same(hooked, prefill_and_score(Engine(model, 1), second))
    finally:
        handle.remove()
    assert_same(prefill_and_score(engine, third), prefill_and_score(Engine(model, 1), third))
    assert engine.cached[0] == 5 * BLOCK and engine.score_cached == 5 * BLOCK


def test_lora_adapters_keep_the_store_off_and_score_on_the_decode_view():
    """A model with LoRA adapters runs on the decode view (the native forward does not run
    wrapped layers), where the cache is off; scoring with and without an adapter takes nothing
    from a store, and gives a cold engine's entries."""
    from gpt2mha.inference.lora import apply_lora
    from gpt2mha.io.lora import LoraAdapter, LoraLayer

    model = model_of(torch.float32, "float")
    gen = torch.Generator().manual_seed(1)
    E = model.config.n_embd
    layers = {f"h.{i}.attn.c_attn": LoraLayer(torch.randn(4, E, generator=gen), torch.randn(3 * E, 4, generator=gen), 0.5)
              for i in range(model.config.n_layer)}
    apply_lora(model, {"x": LoraAdapter(layers, "test")})
    engine = Engine(model, 1, prefix_cache=PrefixCache(8))
    assert engine.prefix_cache is None and engine.scorer() is None
    first, second, _ = shared_prompts()
    for adapter in (None, 0):
        engine.score(first, 2, adapter=adapter)
        assert engine.score(second, 2, adapter=adapter) == Engine(model, 1).score(second, 2, adapter=adapter)
        assert engine.score_cached == 0
    assert engine.score(second, 2, adapter=0) != engine.score(second, 2)


def test_budget_is_checked_and_least_recently_used_blocks_go_first():
    with pytest.raises(ValueError, match="budget_mb"):
        PrefixCache(0)
    model = model_of(torch.float32, "float")
    block_mb = 2 * 2 * 64 * BLOCK * 4 / 2**20                  # K and V, 2 layers, n_embd 64, float32
    store = PrefixCache(block_mb * 3)
    engine = Engine(model, 1, prefix_cache=store)
    for prompt in (list(range(2 * BLOCK + 2)), list(range(100, 100 + 2 * BLOCK + 2))):
        engine.open(0, SamplingParams(max_tokens=1, temperature=0), 0)
        engine.prefill_logits([0], [prompt])
        engine.release(0)
    assert store.evictions == 1                                 # the first prompt's leaf went first, its root stays
    assert [tokens[0] for _, tokens in store.blocks] == [0, 100 + BLOCK, 100]


def test_generate_over_prompts_that_share_a_prefix_uses_the_cache_and_equals_each_alone(monkeypatch):
    """Offline generate: the second prompt takes the first's blocks; every row's tokens are its
    prompt's alone."""
    from gpt2mha.inference import prefix_cache
    model = model_of(torch.float32, "int8", "per_row")
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(0, 256, (70,), generator=gen).tolist()
    prompts = [head + [1, 2, 3], head + [9] * 11]
    made = []
    real = prefix_cache.PrefixCache.load

    def load(self, prompt, cache, *args, **kwargs):
        blocks = real(self, prompt, cache, *args, **kwargs)
        made.append(BLOCK * len(blocks))
        return blocks
    monkeypatch.setattr(prefix_cache.PrefixCache, "load", load)
    both = model.generate(prompts, 6, temperature=0)
    assert made == [0, 64]
    for b, p in enumerate(prompts):
        alone = model.generate([p], 6, temperature=0)
        assert both[b, -6:].tolist() == alone[0, -6:].tolist()


# ------------------------------------------------------------------------------ serving
def test_metrics_and_log_count_queries_and_hits_and_the_second_answer_is_the_first(caplog):
    """A live server (built-in model, float32: the native forward) answers one 150-byte prompt
    twice: the same greedy text; ``gpt2mha:prefix_cache_queries_total`` counts both prompts'
    tokens and ``..._hits_total`` the second's whole blocks but its last 2 tokens (one token a
    byte: 150 = 9 blocks and 6); the request log and the answer's
    ``usage.prompt_tokens_details.cached_tokens`` say so. With a budget of 0: off, both counters 0."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    parser = pytest.importorskip("prometheus_client.parser")
    from gpt2mha import DEFAULT_MODEL, GPT2
    from gpt2mha.serving.server import serve_in_thread

    model, tok = GPT2.from_pretrained(DEFAULT_MODEL), get_tokenizer("bytes")
    prompt = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
              "Arise, fair sun, and kill the envious moon, who is already sick.")[:150]
    assert len(tok.encode(prompt)) == 150

    def counters(url):
        families = parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if "prefix_cache" in s.name}

    for budget, hits in ((4, 9 * BLOCK), (0, 0)):
        sched = Scheduler(model, tok, max_batch=2, max_queue=4, prefix_cache_mb=budget)
        with caplog.at_level(logging.INFO, logger="gpt2mha.serve"), serve_in_thread(sched, DEFAULT_MODEL) as url:
            answers = [httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 8, "temperature": 0}).json() for _ in range(2)]
            got = counters(url)
        texts = [a["choices"][0]["text"] for a in answers]
        assert texts[0] == texts[1]
        assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, hits]
        assert got == {"gpt2mha:prefix_cache_queries_total": 300.0 if budget else 0.0,
                       "gpt2mha:prefix_cache_hits_total": float(hits)}
        lines = [r.getMessage() for r in caplog.records if "cached_tokens=" in r.getMessage()]
        assert [int(line.split("cached_tokens=")[1].split()[0]) for line in lines[-2:]] == [0, hits]


def test_cli_serve_prefix_cache_flags_reach_serve(monkeypatch):
    """``--prefix-cache-mb 64`` gives serve 64, ``--no-prefix-cache`` 0, neither None (the default
    sized from free memory); a negative budget is a usage error."""
    import gpt2mha.serving.server as server
    from gpt2mha.cli import build_parser, main

    seen = []
    monkeypatch.setattr(server, "serve", lambda *a, **kw: seen.append(kw["prefix_cache_mb"]))
    for argv in ([], ["--prefix-cache-mb", "64"], ["--no-prefix-cache"]):
        assert main(["serve", "--port", "0", *argv]) == 0
    assert seen == [None, 64.0, 0]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-cache-mb", "-1"])


def test_the_engine_measures_exactness_and_drops_a_cache_a_route_would_change(monkeypatch, caplog):
    """A new engine with a prefix cache prefills a probe prompt whole and split (once per native
    forward): on the float32 native forward they agree and the cache stays; a prefill that rounds
    a suffix otherwise (here one that adds 1e-6 to the logits when the row already holds keys)
    drops it, and the start log says so."""
    from gpt2mha.inference.decoders import NativeDecoder

    model = model_of(torch.float32, "float")
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=2, prefix_cache_mb=4)
    sched.warm_up()
    assert sched.engine.prefix_cache is not None and sched.engine.prefix_cache.queries == 0
    real = NativeDecoder.prefill
    monkeypatch.setattr(NativeDecoder, "prefill",
                        lambda self, ids, cache: real(self, ids, cache) + (1e-6 if cache.lengths[0] > ids.shape[1] else 0))
    model = small_model(4, n_vocab=256, n_ctx=512, n_embd=64, n_head=4, n_layer=2)     # another native forward
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=2, prefix_cache_mb=4)
    with caplog.at_level(logging.INFO, logger="gpt2mha.serve"):
        sched.warm_up()
    assert sched.engine.prefix_cache is None and "measured here" in sched.prefix_cache_stats()["off"]
    assert any("prefix cache: off (measured here" in r.getMessage() for r in caplog.records)


def test_info_says_whether_the_route_keeps_the_prefix_cache(capsys):
    from gpt2mha.cli import main

    assert main(["info"]) == 0                                  # float32: the native forward
    assert "prefix cache exact here" in capsys.readouterr().out
    assert main(["info", "--quantize", "int8", "--quantize-method", "rtn"]) == 0    # the decode view
    assert "prefix cache off: the decode view's prompt products block rows" in capsys.readouterr().out
