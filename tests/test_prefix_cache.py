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

    def load(self, prompt, cache):
        n = real(self, prompt, cache)
        made.append(n)
        return n
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
