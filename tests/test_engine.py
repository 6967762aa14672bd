"""One engine: ``generate()``, the CLI and the server take the same route for a model and give the
same tokens and log-probabilities, bit for bit, for the same prompt, SamplingParams and seed.

References: ``generate()`` on the prompt alone (its per-step logits, through
``token_logprobs``), compared with the serving scheduler in this process, the real server through
the official ``openai`` client, and ``gpt2mha generate``'s printed text. Routes: the decode view
(int8 with exact products, batch invariant), the native forward (float32, int8 per_row, int4
per_block) on the built-in model.
"""

import copy

import pytest
import torch

from gpt2mha import DEFAULT_MODEL, GPT2
from gpt2mha.inference.decoders import NATIVE, VIEW, choose_decoder
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.generate import generate_with
from gpt2mha.inference.params import SamplingParams
from gpt2mha.inference.sampling import row_seed, token_logprobs
from gpt2mha.io.tokenizer import tokenizer_for
from gpt2mha.inference.scheduler import Scheduler

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo"]
PARAMS = [SamplingParams(max_tokens=24, temperature=0, logprobs=3),
          SamplingParams(max_tokens=24, temperature=0.8, top_k=40, top_p=0.95, seed=7, logprobs=3,
                         presence_penalty=0.3, logit_bias={"101": -2.0})]
ROUTES = {"float32": (None, None, NATIVE), "view": ("int8", "exact", VIEW), "per_row": ("int8", "per_row", NATIVE),
          "per_block": ("int4", "per_block", NATIVE), "bf16": ("bf16", None, NATIVE), "fp16": ("fp16", None, NATIVE)}


@pytest.fixture(scope="module")
def builtin():
    return GPT2.from_pretrained(DEFAULT_MODEL).eval()


def routed(builtin, name):
    scheme, activations, _ = ROUTES[name]
    if scheme is None:
        return builtin
    if scheme in ("bf16", "fp16"):                                  # the 16-bit native routes
        return copy.deepcopy(builtin).to(torch.bfloat16 if scheme == "bf16" else torch.float16)
    return copy.deepcopy(builtin).quantize(scheme, method="rtn", activations=activations)


def generate_alone(model, ids, params, monkeypatch):
    """``generate()`` of one prompt: its new tokens and each token's (logprob, top) from the
    logits it sampled from (the model's raw distribution)."""
    seen = []
    real = Engine.sample

    def sample(self, slots, logits, rows):
        seen.append(logits[list(rows)].clone())
        return real(self, slots, logits, rows)
    monkeypatch.setattr(Engine, "sample", sample)
    out = generate_with(model, [ids], params, batch_invariant=True)[0, len(ids):].tolist()
    monkeypatch.setattr(Engine, "sample", real)
    logits = torch.cat(seen)[:len(out)]
    chosen, top = token_logprobs(logits, torch.tensor(out), params.logprobs)
    return out, list(zip(chosen, top))


@pytest.mark.parametrize("route", list(ROUTES))
def test_generate_and_the_scheduler_give_the_same_tokens_and_logprobs_on_every_route(builtin, route, monkeypatch,
                                                                                     one_thread):
    """Two prompts in one request to the serving scheduler (greedy, then seeded with penalties and
    a bias): sequence i is bitwise generate() of prompt i alone with ``row_seed(seed, i)`` —
    tokens and log-probabilities — and both took the route choose_decoder names."""
    model = routed(builtin, route)
    tok = tokenizer_for(model.config)
    sched = Scheduler(model, tok, max_batch=4, batch_invariant=True)
    assert sched.engine.route.decoder.name == choose_decoder(model).decoder.name == ROUTES[route][2]
    encoded = [tok.encode(p) for p in PROMPTS]
    for params in PARAMS:
        seqs = sched.submit(encoded, params, lambda *a: None)
        sched.run_until_idle()
        for i, seq in enumerate(seqs):
            alone = params if params.seed is None else SamplingParams(**{**params.__dict__, "seed": row_seed(7, i)})
            tokens, logprobs = generate_alone(model, encoded[i], alone, monkeypatch)
            assert seq.tokens == tokens, (route, i, params.temperature)
            assert seq.logprobs == logprobs


@pytest.mark.slow
def test_the_server_and_the_cli_answer_as_generate_on_the_native_route(builtin, monkeypatch, capsys, one_thread):
    """The native forward through the real server (official client): text and every token's
    log-probability equal generate()'s; `gpt2mha generate` with the same flags prints the same
    text (the route served is the route offline generate takes)."""
    openai = pytest.importorskip("openai")
    from gpt2mha.cli import main
    from gpt2mha.serving.server import serve_in_thread

    model = routed(builtin, "per_row")
    tok = tokenizer_for(model.config)
    sched = Scheduler(model, tok, max_batch=2)
    ids = tok.encode(PROMPTS[1])
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=DEFAULT_MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0.8, seed=7,
                                      top_p=0.95, logprobs=3, extra_body={"top_k": 40})
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, top_p=0.95, seed=7, logprobs=3)
    tokens, logprobs = generate_alone(model, ids, params, monkeypatch)
    assert r.choices[0].text == tok.decode(tokens)
    assert r.choices[0].logprobs.token_logprobs == [lp for lp, _ in logprobs]
    assert main(["generate", PROMPTS[1], "--max-new-tokens", "24", "--temperature", "0.8", "--seed", "7",
                 "--top-p", "0.95", "--top-k", "40", "--quantize", "int8", "--quantize-method", "rtn",
                 "--activations", "per_row", "--quiet"]) == 0
    assert capsys.readouterr().out == PROMPTS[1] + tok.decode(tokens) + "\n"


@pytest.mark.parametrize("route", ["view", "per_row"])
def test_a_hook_attached_during_generate_acts_on_the_steps_after(builtin, route):
    """A hook attached from on_token after step 3 (one that forces token 65 'A' through the head)
    acts on every later step, on the native route too (which then gives way to the decode view)."""
    model = routed(builtin, route)
    handles = []

    def on_token(token):
        if len(handles) == 0 and on_token.steps == 3:
            handles.append(model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([65]),
                                                                                                 1e4)))
        on_token.steps += 1
    on_token.steps = 0
    try:
        out = model.generate(torch.tensor([list(b"ROMEO:")]), 10, temperature=0, on_token=on_token)[0, 6:].tolist()
    finally:
        for h in handles:
            h.remove()
    free = model.generate(torch.tensor([list(b"ROMEO:")]), 10, temperature=0)[0, 6:].tolist()
    assert out[:4] == free[:4] and out[4:] == [65] * 6 and free[4:] != [65] * 6


def test_hook_watch_sees_every_kind_of_hook_attached_after_it_was_made(builtin):
    """hook_watch lists the modules' hook dicts once; hooks registered later (forward, pre,
    with kwargs, on any module) show up at their module's position, and removing them gives ()
    again (reference: the positions of the modules whose hook dicts are non-empty, listed anew)."""
    from gpt2mha.inference.decoders import hook_watch

    model = copy.deepcopy(builtin)
    watch = hook_watch(model)
    modules = list(model.modules())
    assert watch() == ()
    handles = [model.h[1].mlp.register_forward_pre_hook(lambda m, a: None),
               model.h[0].attn.register_forward_hook(lambda m, a, k, out: None, with_kwargs=True),
               model.ln_f.register_forward_hook(lambda m, a, out: None)]
    expected = tuple(i for i, m in enumerate(modules) if m._forward_hooks or m._forward_pre_hooks)
    assert len(expected) == 3 and watch() == expected
    for h in handles:
        h.remove()
    assert watch() == ()


def test_info_names_the_route_and_why_not_the_others(capsys):
    from gpt2mha.cli import main

    assert main(["info", "--quantize", "int8", "--quantize-method", "rtn", "--activations", "per_row"]) == 0
    out = capsys.readouterr().out
    assert "decode       the native forward (batch invariant" in out
    assert "not the compiled step: compile was not asked for" in out
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "decode       the native forward (batch invariant" in out
    assert main(["info", "--quantize", "int8", "--quantize-method", "rtn"]) == 0
    out = capsys.readouterr().out
    assert "decode       the decode view" in out and "not the native forward: not a float32, bf16, fp16, int8 per_row" in out


@pytest.mark.parametrize("scheme, activations", [("int4", "exact"), ("int8", "per_row")])
def test_info_prints_the_gptq_models_route_without_running_gptq(scheme, activations, monkeypatch, capsys, one_thread):
    """`info --quantize` (GPTQ by default) prints, without running GPTQ, exactly what `info`
    prints for the built-in model quantized by GPTQ (the reference: quantize_model with GPTQ on
    one row of calibration text, then info on it), the route and why not the others included."""
    import gpt2mha.cli.tools as tools
    from gpt2mha.cli import main
    from gpt2mha.inference.quant import model as qmodel, quantize_model

    real, calls = qmodel._gptq_layers, []
    monkeypatch.setattr(qmodel, "_gptq_layers", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    assert main(["info", "--quantize", scheme, "--activations", activations]) == 0
    printed = capsys.readouterr().out
    assert calls == [] and "decode       the " in printed
    reference = GPT2.from_pretrained("shakespeare-byte")
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 4
    quantize_model(reference, scheme, None, "gptq", text, activations)
    assert len(calls) == 1 and reference.quantization["method"] == "gptq"
    monkeypatch.setattr(tools, "load_model", lambda name, dtype="float32": reference)
    assert main(["info"]) == 0
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("route", ["per_row", "per_block"])
def test_a_pattern_hook_attached_mid_call_on_the_native_route_reads_no_stale_cache(builtin, route):
    """The native forward leaves the kept cache storage as it was (it reads only what it wrote);
    a hook on hook_pattern attached mid-call sends the steps to the decode view, whose hooked
    pattern reads every row's span, masked: the storage past each row is zeroed first. With the
    kept storage full of NaN, two prompts of different lengths give the tokens of the same hook
    attached from the start (reference)."""
    import gpt2mha.inference.generate as G

    model = routed(builtin, route)
    prompts = [list(b"ROMEO:"), list(b"JULIET: O Romeo, Romeo")]
    noop = lambda *a: None                                          # noqa: E731
    model.generate(prompts, 12, temperature=0)                       # leaves its storage for the next call
    with torch.inference_mode():                                    # (the storage was made in it)
        for buf in G._SPARE.values():
            buf.fill_(float("nan"))
    handles = []

    def on_token(token):
        if not handles:
            handles.append(model.h[0].attn.hook_pattern.register_forward_hook(noop))
    try:
        got = model.generate(prompts, 12, temperature=0, on_token=on_token)
    finally:
        handles[0].remove()
    handle = model.h[0].attn.hook_pattern.register_forward_hook(noop)
    try:
        want = model.generate(prompts, 12, temperature=0)
    finally:
        handle.remove()
    assert torch.equal(got, want)


def test_logprobs_of_banned_tokens_are_finite_and_nan_is_named():
    """A token of probability 0 (logit -inf, e.g. banned by a hook) is reported at -9999.0, as
    vLLM does (JSON has no -Infinity); NaN logits have no distribution: a named error."""
    from gpt2mha.inference.sampling import MIN_LOGPROB, NonFiniteLogitsError

    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    chosen, top = token_logprobs(logits, torch.tensor([1]), 3)
    assert chosen == [MIN_LOGPROB] == [-9999.0] and top[0][-1] == (1, -9999.0)
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits"):
        token_logprobs(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]), 1)


@pytest.mark.slow
def test_a_failed_sequence_leaves_no_nan_in_its_compiled_slot(one_thread):
    """The compiled step reads a fixed span of keys, masked: a sequence that wrote NaN keys (its
    prompt reached a NaN position) and failed must not fail the next sequence in that slot."""
    from gpt2mha import GPT2Config
    from gpt2mha.io.tokenizer import get_tokenizer

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=256, n_ctx=32, n_embd=32, n_head=2, n_layer=1, tokenizer="bytes")).eval()
    with torch.no_grad():
        model.wpe.weight[8:] = float("nan")
    route = choose_decoder(model, compile=True)
    params = SamplingParams(max_tokens=2, temperature=0)

    def run(sched, prompt):
        seq = sched.submit([list(prompt)], params, lambda *a: None)[0]
        sched.run_until_idle()
        return seq
    sched = Scheduler(model, get_tokenizer("bytes"), max_batch=1, route=route)
    bad = run(sched, b"a prompt of 20 bytes")
    good = run(sched, b"ROMEO:")
    fresh = run(Scheduler(model, get_tokenizer("bytes"), max_batch=1, route=route), b"ROMEO:")   # reference
    assert bad.finish_reason == "error" and "NonFiniteLogitsError" in bad.error
    assert good.finish_reason == "length", good.error
    assert good.tokens == fresh.tokens
