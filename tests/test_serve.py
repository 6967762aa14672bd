"""The OpenAI-compatible server, its continuous-batching scheduler and the runner under it.

References: offline ``generate`` (the same model, one prompt alone) for every text; the model's
own uncached forward over one row for the runner's slotted cache; Python's UTF-8 codec for streamed text; the
official ``openai`` client for the wire format. Servers bind 127.0.0.1 on a free port and are
started and stopped by the tests.
"""

import importlib.util
import json
import logging
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch

from conftest import assert_same_greedy
from gpt2mha import GPT2, DEFAULT_MODEL, GPT2Config
from gpt2mha.inference.sampling import row_seed
from gpt2mha.io.tokenizer import ByteTokenizer, tokenizer_for
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.sampling import RowSampler
from gpt2mha.inference.params import SamplingParams
from gpt2mha.serving.scheduler import ExceedsCapacity, QueueFull, Scheduler
from gpt2mha.serving.text_stream import LENGTH, STOP, TextStream

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from gpt2mha.serving.server import serve_in_thread       # noqa: E402
ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def builtin(one_thread):
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return model, tokenizer_for(model.config)


def assert_same_text(model, tok, prompt, got, ref):
    """A greedy text from the server equals offline generate's, or parts from it only at a
    near-tie of the reference logits (conftest.assert_same_greedy; byte model: one token a byte).
    The built-in model is float32, served and generated without ``batch_invariant`` (its
    default): rows of a batch may round apart by ~1e-6 (tests/test_batch_invariance.py holds
    the invariant path to bitwise equality)."""
    if got != ref:
        a, b = tok.encode(prompt + ref), tok.encode(prompt + got)
        n = len(tok.encode(prompt))
        b = (b + a[len(b):])[:len(a)]
        assert_same_greedy(model, a, b, n)


def offline(model, tok, prompt, max_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=None):
    """What offline ``generate`` (as ``gpt2mha generate``) continues ``prompt`` with: ids and text."""
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, vocab_size=tok.n_vocab)[0, len(ids):].tolist()
    return out, tok.decode(out)


def collect_events():
    texts = {}

    def on_event(seq, text, done):
        texts.setdefault(id(seq), []).append(text)
    return texts, on_event


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- scheduler
def test_engine_rows_of_different_lengths_decode_in_one_step_as_alone(one_thread, monkeypatch):
    """Engine: prompts of 5 and 11 tokens prefilled (each alone, in place) into slots 0
    and 2 of a 3-slot cache, slot 1 free; then one decode step over rows 0-2. Each row's logits,
    at the prefill and at the step, equal the model's own uncached forward over that row's tokens
    alone (reference); the free row keeps length 0, a released row is emptied, and an occupied
    slot cannot be opened again."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny")).eval()
    prompts = {0: torch.randint(0, 256, (5,)).tolist(), 2: torch.randint(0, 256, (11,)).tolist()}
    script = {0: [17, 3], 2: [99, 250]}                           # the "sampled" tokens of each slot
    seen = {0: [], 2: []}

    def draw(self, logits):                                       # records each row's logits [1, n_vocab]
        slot = engine.samplers.index(self)
        seen[slot].append(logits.clone())
        return script[slot][len(seen[slot]) - 1]

    monkeypatch.setattr(RowSampler, "draw", draw)
    engine = Engine(model, 3)
    for slot in prompts:
        engine.open(slot, SamplingParams(temperature=1.0), seed=slot)
    assert engine.prefill([0, 2], [prompts[0], prompts[2]]) == [17, 99]
    assert engine.cache.lengths == [5, 0, 11]
    assert engine.decode([0, 2]) == [3, 250]
    assert engine.cache.lengths == [6, 0, 12]
    for slot, ids in prompts.items():
        with torch.no_grad():
            ref = model(torch.tensor([ids + script[slot][:1]])).logits[0]     # [T + 1, n_vocab], uncached
        torch.testing.assert_close(seen[slot][0][0], ref[-2], rtol=1e-5, atol=1e-5)   # prefill
        torch.testing.assert_close(seen[slot][1][0], ref[-1], rtol=1e-5, atol=1e-5)   # the decode step
    engine.release(2)
    assert engine.cache.lengths == [6, 0, 0]
    with pytest.raises(ValueError, match="slot=0 is in use"):
        engine.open(0, SamplingParams(), seed=1)


def draw_in(sched, script):
    """A :meth:`RowSampler.draw` that, for ``sched``'s sequences, returns ``script(seq, logits)``
    (or draws as usual where that returns None), and draws as usual for every other sampler
    (offline ``generate``'s references)."""
    real = RowSampler.draw

    def draw(self, logits):
        samplers = sched().engine.samplers
        token = script(sched().slots[samplers.index(self)], logits) if self in samplers else None
        return real(self, logits) if token is None else token
    return draw


def test_scheduler_sequences_joining_at_different_steps_equal_offline_generate(builtin):
    """Greedy and seeded (top-k, top-p) sequences of different lengths, each joining while
    others run, give exactly offline generate's tokens for their prompt alone (greedy ones up to
    a near-tie: float32 without batch_invariant); every slot is free at the end."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=3, max_queue=8)
    cases = [("ROMEO:", SamplingParams(max_tokens=30, temperature=0)),
             ("To be, or not", SamplingParams(max_tokens=12, temperature=0.9, seed=3)),
             ("First Citizen:\nBefore we proceed any further", SamplingParams(max_tokens=25, temperature=1.0,
                                                                             top_k=20, seed=7)),
             ("O", SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=11)),
             ("KING RICHARD III:\n", SamplingParams(max_tokens=9, temperature=0))]
    texts, on_event = collect_events()
    seqs = []
    for prompt, params in cases[:2]:                            # admitted at the same step
        seqs += sched.submit([tok.encode(prompt)], params, on_event)
    for prompt, params in cases[2:]:                            # then one at a time; 3 slots: some wait
        sched.step()
        seqs += sched.submit([tok.encode(prompt)], params, on_event)
        for _ in range(3):
            sched.step()
    sched.run_until_idle()
    for seq, (prompt, p) in zip(seqs, cases):
        ids, text = offline(model, tok, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)
        if p.temperature == 0:
            n = len(tok.encode(prompt))
            assert_same_greedy(model, tok.encode(prompt) + ids, tok.encode(prompt) + seq.tokens, n)
        else:
            assert seq.tokens == ids and seq.text == text
        assert "".join(texts[id(seq)]) == seq.text and seq.finish_reason == "length"
    assert sched.slots == [None] * 3 and sched.engine.cache.lengths == [0] * 3 and not sched.waiting
    assert sched.stats()["completed"] == 5 and sched.stats()["generated_tokens"] == sum(p.max_tokens for _, p in cases)


def test_text_stream_never_splits_a_character_or_shows_part_of_a_stop_string():
    """Byte by byte, deltas are whole characters (reference: str.encode/decode), a stop string
    split across tokens is held back and cut, and an unfinished character at the end becomes
    U+FFFD as bytes.decode(errors='replace') gives."""
    tok = ByteTokenizer()
    text = "héllo wörld 😀 ok"
    ts = TextStream(tok)
    deltas = [ts.push([b]) for b in text.encode()]
    assert "".join(deltas) + ts.finish() == text
    assert all("\ufffd" not in d for d in deltas) and "" in deltas        # held while a char was split
    ts = TextStream(tok, stop=("wör", "zz"))
    out = "".join(ts.push([b]) for b in text.encode())
    assert out == "héllo " and ts.stopped and ts.text == "héllo " and ts.finish() == ""
    ts = TextStream(tok, stop=("lo!",))                          # a tail "lo" held, then released at the end
    out = "".join(ts.push([b]) for b in b"hello")
    assert out == "hel" and ts.finish() == "lo" and not ts.stopped
    ts = TextStream(tok)
    assert ts.push(list("é".encode())[:1]) == "" and ts.finish() == b"\xc3".decode("utf-8", errors="replace")
    ts = TextStream(tok, stop=("b",), max_tokens=5)               # add: one token's text and finish reason
    assert ts.add(ord("a")) == ("a", None) and ts.add(ord("b")) == ("", STOP) and ts.text == "a"
    ts = TextStream(tok, max_tokens=2)
    assert ts.add(ord("a")) == ("a", None) and ts.add(ord("b")) == ("b", LENGTH)


def test_text_stream_offsets_and_released_tokens_follow_the_text_sent():
    """Each token's offset is the count of characters before it (a character's later bytes point
    at its start, as the characters of the bytes before it: str.decode on the prefix); the tokens
    released are those whose text starts within what was sent, so a held stop-string prefix and
    the tokens past a cut are not."""
    tok = ByteTokenizer()
    data = "aé😀b".encode()
    ts = TextStream(tok, stop=("bc",))
    sent = [(ts.add(b)[0], ts.released) for b in data]
    assert ts.offsets == [len(data[:j].decode(errors="ignore")) for j in range(len(data))] == [0, 1, 1, 2, 2, 2, 2, 3]
    assert sent == [("a", 1), ("", 1), ("é", 3), ("", 3), ("", 3), ("", 3), ("😀", 7), ("", 7)]   # "b" held: "bc"?
    assert ts.finish() == "b" and ts.released == 8
    ts = TextStream(tok, stop=("é",))
    assert [ts.add(b)[1] for b in "xé".encode()] == [None, None, STOP]
    assert ts.text == "x" and ts.released == 1                      # é's bytes are past the cut


def test_scheduler_cancel_frees_the_slot_and_a_failing_sequence_fails_alone(builtin, monkeypatch):
    """A cancelled sequence leaves its slot at the next step; an exception while sampling one
    sequence (at its prefill, or later) finishes it with 'error' while the others still
    equal offline generate."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=4)
    poison, poison_at_prefill = tok.encode("BOOM"), tok.encode("BANG!")
    def script(seq, logits):
        if seq.prompt_ids == poison and len(seq.tokens) == 5 or seq.prompt_ids == poison_at_prefill:
            raise RuntimeError("injected failure")

    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, script))
    texts, on_event = collect_events()
    good = sched.submit([tok.encode("ROMEO:")], SamplingParams(max_tokens=20, temperature=0.7, seed=1), on_event)[0]
    bad = sched.submit([poison], SamplingParams(max_tokens=20, temperature=0.7, seed=2), on_event)[0]
    early = sched.submit([poison_at_prefill], SamplingParams(max_tokens=20), on_event)[0]   # fails at its prefill
    gone = sched.submit([tok.encode("JULIET:")], SamplingParams(max_tokens=100, temperature=0), on_event)[0]
    for _ in range(2):
        sched.step()
    assert gone.slot is not None and sched.stats()["running"] == 3
    sched.cancel(gone)
    sched.step()
    assert early.finish_reason == "error" and early.tokens == [] and early.slot is None
    assert gone.finish_reason == "cancelled" and gone.slot is None and sched.slots.count(None) == 2
    sched.run_until_idle()
    assert bad.finish_reason == "error" and "injected failure" in bad.error and len(bad.tokens) == 5
    assert good.text == offline(model, tok, "ROMEO:", 20, 0.7, seed=1)[1] and good.finish_reason == "length"
    assert sched.slots == [None] * 4 and sched.stats()["failed"] == 2 and sched.stats()["cancelled"] == 1


def test_bpe_end_of_text_stops_with_finish_reason_stop(one_thread, monkeypatch):
    """A GPT-2 BPE model stops a sequence at <|endoftext|> (50256): finish_reason 'stop', the
    text is the tokens before it (reference: the tokenizer's decode), the slot is freed."""
    tok = tokenizer_for(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1))
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1)).eval()
    script = tok.encode(" to be or not") + [tok.eot_token] + tok.encode(" never seen")
    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, lambda seq, logits: script[len(seq.tokens)]))
    sched = Scheduler(model, tok, max_batch=2)
    seq = sched.submit([tok.encode("Hello")], SamplingParams(max_tokens=12, temperature=1.0), lambda *a: None)[0]
    sched.run_until_idle()
    assert seq.finish_reason == "stop" and seq.text == " to be or not" and seq.tokens == script[:5]
    assert sched.slots == [None, None]


def test_scheduler_refuses_work_beyond_free_slots_plus_queue(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2, max_queue=1)
    p = SamplingParams(max_tokens=2, temperature=0)
    sched.submit([[65], [66]], p, lambda *a: None)
    with pytest.raises(QueueFull):
        sched.submit([[67], [68]], p, lambda *a: None)             # all or none
    sched.submit([[67]], p, lambda *a: None)
    with pytest.raises(QueueFull):
        sched.submit([[69]], p, lambda *a: None)
    with pytest.raises(ExceedsCapacity, match=r"at most 3 sequences at once \(max_batch=2 running \+ max_queue=1"):
        sched.submit([[1]] * 4, p, lambda *a: None)                   # more than could ever fit: not "retry later"
    assert sched.stats()["queued"] == 3 and sched.stats()["rejected"] == 3
    sched.run_until_idle()
    assert sched.stats()["completed"] == 3
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(model, tok, max_batch=0)


@pytest.mark.parametrize("prompts,params,match", [
    ([[65, 1.5]], SamplingParams(), r"prompts\[0\]\[1\]=1.5 is not a token id"),       # not truncated to 1
    ([[65], []], SamplingParams(), "prompt 1 is empty"),
    ([[65, 256]], SamplingParams(), r"outside \[0, n_vocab=256\)"),
    ([[65] * 250], SamplingParams(max_tokens=7), "250 tokens \\+ max_tokens=7 > n_ctx=256"),
    ([[65]], SamplingParams(logit_bias=((256, 1.0),)), "logit_bias key 256"),
    ([[65]], dict(max_tokens=3), "params must be a SamplingParams"),
], ids=["float-id", "empty", "vocab", "context", "bias-id", "not-params"])
def test_submit_refuses_bad_prompts_and_params_naming_them_and_queues_nothing(builtin, prompts, params, match):
    """The scheduler's own guard (for callers other than the HTTP app): every bad prompt, and what
    depends on the model (a logit_bias id past the vocabulary; every other field was checked when
    the SamplingParams was made: tests/test_params.py), is a ValueError naming it, raised before
    anything is queued."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2)
    with pytest.raises(ValueError, match=match):
        sched.submit(prompts, params, lambda *a: None)
    assert sched.idle() and sched.stats()["rejected"] == 0


# ------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=4, max_queue=16)
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        yield url, sched


def test_openai_client_plain_and_streamed_equal_offline_generate(server, builtin, capsys):
    """With the official client: a greedy completion equals `gpt2mha generate --temperature 0`'s
    output, streamed or not; a seeded one equals offline generate with that seed; a list of
    prompts gives one choice per prompt; usage counts tokens; /v1/models names the model."""
    from gpt2mha.cli import main

    url, _ = server
    model, tok = builtin
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]

    r = client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=40, temperature=0)
    assert main(["generate", "ROMEO:", "--max-new-tokens", "40", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and printed.endswith("\n")
    assert_same_text(model, tok, "ROMEO:", r.choices[0].text, printed[len("ROMEO:"):-1])
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 40, 46)
    greedy = r.choices[0].text

    chunks = list(client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length" and len(chunks) > 5

    r = client.completions.create(model=DEFAULT_MODEL, prompt=["To be", "HAMLET:"], max_tokens=24,
                                  temperature=0.9, top_p=0.95, seed=5, extra_body={"top_k": 30})
    assert [c.index for c in r.choices] == [0, 1]
    for i, (c, prompt) in enumerate(zip(r.choices, ["To be", "HAMLET:"])):   # row i as in generate(prompts, seed=5)
        assert c.text == offline(model, tok, prompt, 24, 0.9, top_k=30, top_p=0.95, seed=row_seed(5, i))[1]

    r = client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=40, temperature=0, stop=["the"])
    assert "the" in greedy and r.choices[0].text == greedy[:greedy.index("the")] and r.choices[0].finish_reason == "stop"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["free_slots"] == health["slots"] == 4


def byte_token(i: int) -> str:
    """How OpenAI's logprobs name a byte-model token: its character, or ``bytes:\\xNN`` for a byte
    that is not a whole UTF-8 character (first principles: UTF-8 has one-byte characters below 0x80)."""
    return chr(i) if i < 0x80 else f"bytes:\\x{i:02x}"


def test_echo_logprobs_of_a_prompt_equal_the_models_log_softmax(server, builtin):
    """openai client, ``logprobs=5, echo=True, max_tokens=0``: the prompt comes back as the text,
    one entry per token (the first null), each logprob equal to log_softmax of the model's own
    uncached forward of the same ids (float64, to 1e-4), top_logprobs the 5 largest there (plus the
    token itself when outside them), text_offset where each token's character starts. With
    ``max_tokens=1`` (lm-evaluation-harness's request) the same prompt entries, then the token."""
    url, _ = server
    model, tok = builtin
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt = "ROMEO: é\nthe Qz"
    ids = list(prompt.encode())
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)       # [T, 256]
    r = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=5)
    (c,) = r.choices
    lp = c.logprobs
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert lp.tokens == [byte_token(b) for b in ids]
    assert lp.text_offset == [len(bytes(ids[:j]).decode(errors="ignore")) for j in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        top5 = ref[j - 1].topk(5)
        want = {byte_token(i): v for i, v in zip(top5.indices.tolist(), top5.values.tolist())}
        got = lp.top_logprobs[j]
        assert set(want) <= set(got) and len(got) == 5 + (byte_token(ids[j]) not in want)
        assert all(got[k] == pytest.approx(v, abs=1e-4) for k, v in want.items())
    one = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0).choices[0]
    assert one.logprobs.token_logprobs[:-1] == pytest.approx(lp.token_logprobs, abs=1e-6)
    greedy = int(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1).argmax())
    assert one.text == prompt + chr(greedy) and one.logprobs.tokens[-1] == chr(greedy)
    assert one.logprobs.token_logprobs[-1] == max(one.logprobs.top_logprobs[-1].values())   # is_greedy: exact


def test_streamed_logprobs_equal_the_whole_answer(server):
    """A stream with ``logprobs`` and ``echo`` carries each chunk's tokens: concatenated they are
    the non-streamed answer's logprobs (and text), for greedy and seeded sampling, with a stop
    string cutting the text (the tokens past the cut are in neither)."""
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for kwargs in (dict(temperature=0, stop=["the"]), dict(temperature=0.9, seed=4, stop=["\n\n"])):
        body = dict(model=DEFAULT_MODEL, prompt="JULIET:", max_tokens=40, logprobs=3, echo=True, **kwargs)
        whole = client.completions.create(**body).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**body, stream=True)]
        assert "".join(c.text for c in chunks) == whole.text
        streamed = {k: sum((getattr(c.logprobs, k) for c in chunks), []) for k in
                    ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert streamed == whole.logprobs.model_dump()
        assert whole.text.startswith("JULIET:") and "".join(whole.logprobs.tokens) == whole.text
        assert len(whole.logprobs.tokens) == len(whole.text.encode())
    assert whole.finish_reason in ("stop", "length") and chunks[-1].finish_reason == whole.finish_reason


def test_n_choices_with_a_seed_equal_the_offline_command_and_best_of_keeps_the_most_likely(server, builtin,
                                                                                          capsys):
    """``n=3`` over two prompts with a seed, penalties and a logit bias: reproducible, and choice
    ``i*n + j`` equals sample j+1 of prompt i+1 of the README's command ``gpt2mha generate P1 P2
    --num-samples 3 --seed S`` with the same flags (the seed rule: ``row_seed(seed, i*n + j)``);
    the banned token never appears. ``best_of=3, n=2``: the 2 of those 3 candidates with the
    highest mean token logprob (reference: the model's own uncached forward, float64)."""
    from gpt2mha.cli import main

    url, _ = server
    model, tok = builtin
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = ["ROMEO:", "First Citizen:\n"]
    body = dict(model=DEFAULT_MODEL, prompt=prompts, max_tokens=24, temperature=0.9, top_p=0.95, seed=11,
                presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"101": -100})
    r = client.completions.create(n=3, **body)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == list(range(6)) and r.usage.prompt_tokens == 6 + 15
    assert texts == [c.text for c in client.completions.create(n=3, **body).choices]
    assert all("e" not in t for t in texts) and len(set(texts)) == 6
    assert main(["generate", *prompts, "--num-samples", "3", "--seed", "11", "--max-new-tokens", "24",
                 "--temperature", "0.9", "--top-p", "0.95", "--presence-penalty", "0.5", "--frequency-penalty",
                 "0.3", "--logit-bias", '{"101": -100}']) == 0
    printed = re.split(r"^={20} prompt (\d) of 2, sample (\d) of 3 ={20}\n", capsys.readouterr().out, flags=re.M)
    rows = {(int(a) - 1, int(b) - 1): t[:-1] for a, b, t in zip(printed[1::3], printed[2::3], printed[3::3])}
    assert texts == [rows[i, j][len(prompts[i]):] for i in range(2) for j in range(3)]

    best = client.completions.create(n=2, best_of=3, **{**body, "prompt": prompts[0]})
    with torch.no_grad():
        def mean_logprob(text):
            ids = tok.encode(prompts[0] + text)
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            n = len(tok.encode(prompts[0]))
            return lp[torch.arange(n - 1, len(ids) - 1), torch.tensor(ids[n:])].mean().item()
        scores = sorted(((mean_logprob(t), t) for t in texts[:3]), reverse=True)
    assert scores[1][0] - scores[2][0] > 1e-4
    assert [c.text for c in best.choices] == [t for _, t in scores[:2]] and [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 3 * 24 and best.usage.prompt_tokens == 6


def test_raw_sse_stream_is_utf8_safe_and_ends_with_done(builtin, monkeypatch):
    """Raw HTTP: `data: {...}` chunks in OpenAI's format, then the usage chunk and `data: [DONE]`;
    a model made to emit the bytes of 'é😀ü…' one per token never has a chunk with half a
    character (no U+FFFD) and the chunks join to the text (reference: str.encode)."""
    model, tok = builtin
    text = "é😀ü ok ß"
    script = list(text.encode())
    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, lambda seq, logits: script[len(seq.tokens)]))
    sched = Scheduler(model, tok, max_batch=2)
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        body = {"prompt": "x", "max_tokens": len(script), "temperature": 0.5, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(script)
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "length"


BAD_REQUESTS = [
    ('{"prompt": "ROMEO:", "max_tokens": 5,', None),                     # malformed JSON
    ('[1, 2]', None),                                                   # not an object
    ({"max_tokens": 5}, "prompt"),                                      # missing prompt
    ({"prompt": "a", "frobnicate": 1}, "frobnicate"),                   # unknown field
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),                 # wrong types
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stop": 7}, "stop"),
    ({"prompt": "a", "seed": 1.5}, "seed"),
    ({"prompt": "ROMEO:", "max_tokens": 251}, "max_tokens"),            # 6 + 251 > n_ctx = 256
    ({"prompt": "x" * 257, "max_tokens": 0}, "prompt"),                 # prompt longer than n_ctx
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),                  # bad sampling values
    ({"prompt": "a", "temperature": -0.5}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -1}, "top_k"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "stop": [f"s{i}" for i in range(65)]}, "stop"),    # past the default limit, 64
    ({"prompt": "a", "n": 0}, "n"),                                     # choices and logprobs: OpenAI's rules
    ({"prompt": "a", "n": 129}, "n"),
    ({"prompt": "a", "n": 21}, "n"),                                    # 21 sequences > max_batch + max_queue = 20
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of"),                 # best_of >= n
    ({"prompt": "a", "best_of": 21}, "best_of"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of"),         # not with stream
    ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"256": 1}}, "logit_bias"),          # the byte model's ids are 0 … 255
    ({"prompt": "a", "logit_bias": {"5": "x"}}, "logit_bias"),
    ({"prompt": "a", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    # strings that are not Unicode text: JSON escapes of lone UTF-16 surrogates (Python's json decodes them)
    ('{"prompt": "\\ud800abc"}', "prompt"),
    ('{"prompt": ["ok", "a\\udfff"]}', "prompt"),
    ('{"prompt": "a", "stop": ["x", "\\ud83d"]}', "stop"),
    ('{"model": "\\udc00", "prompt": "a"}', "model"),
    ('{"prompt": "a", "\\ud800": 1}', "\\ud800"),
    ('[' * 100_000, None),                                              # nested past the JSON parser's depth
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    url, sched = server
    before = sched.stats()["completed"]
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if param is not None:
        assert param.split(".")[-1] in err["message"]
    assert sched.stats()["completed"] == before


def test_a_surrogate_pair_is_one_character_and_served(server):
    """The valid counterpart of the lone surrogates above: the pair \\ud83d\\ude00 is U+1F600,
    4 UTF-8 bytes, i.e. 4 prompt tokens of the byte-level model (first principles)."""
    url, _ = server
    r = httpx.post(url + "/v1/completions", content='{"prompt": "\\ud83d\\ude00", "max_tokens": 0}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("\U0001F600".encode()) == 4


def test_body_size_limit_413_and_prompts_tokenized_off_the_loop_and_only_when_they_can_fit(builtin, monkeypatch):
    """A body over max_body_bytes gets 413 with OpenAI's error object, whether its size is declared
    (Content-Length) or only counted (chunked); the next request on the server still works. A
    prompt whose UTF-8 length alone exceeds n_ctx tokens (byte model: one token per byte) is
    refused without being tokenized, and tokenizing runs in a worker thread, not the event
    loop's (uvicorn's) thread."""
    model, tok = builtin
    seen = []
    real = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: (
        seen.append((len(text), threading.current_thread().name)), real(self, text))[1])
    sched = Scheduler(model, tok, max_batch=2)
    limit = 64 << 10
    with serve_in_thread(sched, DEFAULT_MODEL, max_body_bytes=limit) as url:
        big = json.dumps({"prompt": "x" * limit, "max_tokens": 1}).encode()
        for content in (big, iter([big[i:i + 4096] for i in range(0, len(big), 4096)])):   # declared, chunked
            r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.headers["content-type"] == "application/json", r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
            assert f"at most {limit} bytes" in err["message"]
        long = "y" * (limit // 2)                                   # under the body limit, 128 x n_ctx bytes
        r = httpx.post(url + "/v1/completions", json={"prompt": ["ok", long], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert f"prompt[1] has {len(long)} tokens" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert all(n <= model.config.n_ctx for n, _ in seen)           # the 32 KiB prompt never reached encode
    assert (6, "gpt2mha-uvicorn") not in seen and [n for n, _ in seen].count(6) == 1   # "ROMEO:", in a worker


def test_a_request_that_can_never_be_admitted_is_400_and_the_client_gets_it_at_once(builtin):
    """max_batch 2 + max_queue 1 hold at most 3 sequences: a request of 4 prompts could never be
    admitted, so it is a 400 naming prompt and the limit (a 429 would be retried by the openai
    client). The client sends it once and raises BadRequestError at once; 3 prompts are served."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2, max_queue=1)
    sent = []
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=20,
                               http_client=httpx.Client(event_hooks={"request": [sent.append]}))
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=DEFAULT_MODEL, prompt=["a", "b", "c", "d"], max_tokens=2)
        assert time.monotonic() - t0 < 5 and len(sent) == 1               # no retries
        assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
        assert e.value.body["code"] == "too_many_prompts" and "at most 3" in e.value.body["message"]
        r = client.completions.create(model=DEFAULT_MODEL, prompt=["a", "b", "c"], max_tokens=2, temperature=0)
        assert [c.index for c in r.choices] == [0, 1, 2]
    assert sched.stats()["rejected"] == 0


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("last_resort", [False, True], ids=["scheduler-cancels", "uvicorn-cancels"])
def test_shutdown_past_the_graceful_timeout_answers_503_and_ends_streams_cleanly(builtin, monkeypatch, caplog,
                                                                                 last_resort):
    """Shutdown (what SIGTERM does) while a plain request and a stream run 200 tokens at 20 ms a
    step, with a 0.3 s graceful timeout: the plain request gets a 503 with OpenAI's error object
    (application/json), the stream an error event then `data: [DONE]`; one log line each
    (status=503) and no traceback in uvicorn's log. The same holds when the scheduler does not
    react and uvicorn itself cancels the request tasks (the last resort)."""
    import gpt2mha.serving.server as S

    model, tok = builtin
    real = Scheduler._decode
    monkeypatch.setattr(Scheduler, "_decode", lambda self: (time.sleep(0.02), real(self))[1])
    if last_resort:                                                 # a scheduler that does not cancel in time
        monkeypatch.setattr(Scheduler, "cancel_all", lambda self: setattr(self, "_stopping", True) or 0)
        monkeypatch.setattr(S, "CANCEL_GRACE_S", 0.3)
    caplog.set_level(logging.INFO, logger="gpt2mha.serve")
    sched = Scheduler(model, tok, max_batch=2)
    results = {}

    def plain():
        results["plain"] = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 200}, timeout=30)

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "JULIET:", "max_tokens": 200, "stream": True}) as r:
            results["stream"] = [line for line in r.iter_lines() if line]

    uvicorn_log = LogRecords()
    with serve_in_thread(sched, DEFAULT_MODEL, timeout=10, graceful_timeout=0.3) as url:
        logging.getLogger("uvicorn.error").addHandler(uvicorn_log)
        threads = [threading.Thread(target=f) for f in (plain, stream)]
        for t in threads:
            t.start()
        wait_for(lambda: sched.stats()["running"] == 2)
        t0 = time.monotonic()
    for t in threads:
        t.join(10)
    logging.getLogger("uvicorn.error").removeHandler(uvicorn_log)
    assert time.monotonic() - t0 < 3.5                             # not the 4 s the 200 steps need
    r = results["plain"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["type"] == "server_error" and "shutting down" in r.json()["error"]["message"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
    assert all("choices" in json.loads(line[6:]) for line in lines[:-2])
    done = [rec.getMessage() for rec in caplog.records if rec.name == "gpt2mha.serve" and
            rec.getMessage().startswith("request cmpl-")]
    assert len(done) == 2 and all("status=503" in m for m in done), done
    assert not [rec for rec in uvicorn_log.records if rec.exc_info], [rec.getMessage() for rec in uvicorn_log.records]


def test_shutting_down_scheduler_answers_503_with_retry_after(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=1)
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        sched.stop()                                            # what the app's shutdown does
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "server_error" and "shutting down" in r.json()["error"]["message"]


def test_unknown_model_is_404_and_client_error_types(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="shakespeare-byte"):
        client.completions.create(model="gpt-4", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"


@pytest.fixture
def slow_server(builtin, monkeypatch):
    """One slot, one queue place, and 20 ms per decode step, so requests overlap for sure."""
    model, tok = builtin
    real = Scheduler._decode

    def slow_decode(self):
        time.sleep(0.02)
        real(self)
    monkeypatch.setattr(Scheduler, "_decode", slow_decode)
    sched = Scheduler(model, tok, max_batch=1, max_queue=1)
    with serve_in_thread(sched, DEFAULT_MODEL, timeout=5) as url:
        yield url, sched


def test_queue_full_gets_429_with_retry_after_and_a_disconnect_frees_the_slot(slow_server, builtin):
    """Slot taken by a stream and queue place taken: the next request gets 429 with Retry-After
    (the client raises RateLimitError). Closing the stream mid-way frees the slot at once: the
    queued request starts and finishes long before the stream's 200 tokens would have."""
    url, sched = slow_server
    model, tok = builtin
    stream = httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "stream": True})
    r = stream.__enter__()
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")
    wait_for(lambda: sched.stats()["running"] == 1)
    queued = {}
    t = threading.Thread(target=lambda: queued.update(r=httpx.post(
        url + "/v1/completions", json={"prompt": "JULIET:", "max_tokens": 5, "temperature": 0}, timeout=30)))
    t.start()
    wait_for(lambda: sched.stats()["queued"] == 1)
    full = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 5})
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["type"] == "rate_limit_error"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=5)
    t0 = time.monotonic()
    stream.__exit__(None, None, None)                          # the client hangs up mid-stream
    t.join(10)
    assert time.monotonic() - t0 < 2.0                         # 200 tokens x 20 ms would be 4 s
    assert queued["r"].status_code == 200
    assert_same_text(model, tok, "JULIET:", queued["r"].json()["choices"][0]["text"], offline(model, tok, "JULIET:", 5, 0)[1])
    wait_for(lambda: sched.stats()["running"] == 0)
    s = sched.stats()
    assert s["cancelled"] == 1 and s["free_slots"] == 1 and s["rejected"] == 2
    # a plain (not streamed) request whose client gives up is cancelled as soon as it hangs up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 200}, timeout=0.5)
    wait_for(lambda: sched.stats()["cancelled"] == 2, timeout=2.0)   # long before its 4 s of steps
    assert sched.stats()["running"] == 0


def test_an_exception_in_one_request_fails_only_that_request(server, builtin, monkeypatch):
    """Sampling raises for one prompt: that request gets 500 (streamed: an error event, which the
    client raises as APIError); a request running beside it and the next ones succeed."""
    url, sched = server
    model, tok = builtin
    poison = tok.encode("BOOM")

    def script(seq, logits):
        if seq.prompt_ids == poison and len(seq.tokens) >= 2:
            raise RuntimeError("injected failure")
    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, script))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    results = {}
    t = threading.Thread(target=lambda: results.update(ok=client.completions.create(
        model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=60, temperature=0.8, seed=4)))
    t.start()
    r = httpx.post(url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 20, "temperature": 0.5}, timeout=30)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client.completions.create(model=DEFAULT_MODEL, prompt="BOOM", max_tokens=20, temperature=0.5,
                                       stream=True))
    t.join(30)
    assert results["ok"].choices[0].text == offline(model, tok, "ROMEO:", 60, 0.8, seed=4)[1]
    r = client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=5, temperature=0)
    assert_same_text(model, tok, "ROMEO:", r.choices[0].text, offline(model, tok, "ROMEO:", 5, 0)[1])
    wait_for(lambda: sched.stats()["running"] == 0)


def _serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(ROOT, "benchmarks", "serve_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_short_load_nothing_lost_and_slots_free(builtin):
    """benchmarks/serve_load.py's load test, short: 8 concurrent clients, 32 mixed requests
    (prompt lengths, max_tokens, greedy/seeded, streamed, stop strings, some cancelled mid-way).
    Every request not cancelled is complete and equal to offline generate; all slots free."""
    model, tok = builtin
    load = _serve_load()
    sched = Scheduler(model, tok, max_batch=4, max_queue=64)
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        res = load.load_test(url, model, tok, n_requests=32, clients=8, seed=3, max_tokens=(1, 24))
    assert res["problems"] == []
    assert res["cancelled"] > 0 and res["completed"] >= 20 and res["streamed"] > 0
    assert res["finished_sequences"] == 32 and sched.engine.cache.lengths == [0] * 4


@pytest.mark.slow
def test_cli_serve_sigterm_finishes_in_flight_stream_and_exits_0(tmp_path):
    """`gpt2mha serve` in a subprocess: SIGTERM during a stream lets it finish (all tokens,
    [DONE]), then the process exits 0."""
    load = _serve_load()
    server = load.Server(None, max_batch=2, log_path=str(tmp_path / "serve.log"))
    try:
        body = {"prompt": "ROMEO:", "max_tokens": 120, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 120
        assert server.proc.wait(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.log.close()
    log = (tmp_path / "serve.log").read_text()
    assert "status=200" in log and "generated_tokens=120" in log


SLOW_SERVE = ("import sys, time\n"
              "from gpt2mha.serving.scheduler import Scheduler\n"
              "real = Scheduler._decode\n"
              "Scheduler._decode = lambda self: (time.sleep(0.02), real(self))[1]   # 20 ms a step\n"
              "from gpt2mha.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow
def test_cli_serve_sigterm_past_the_graceful_timeout_answers_503_without_tracebacks(tmp_path):
    """`gpt2mha serve --graceful-timeout 0.5` (decode slowed to 20 ms a step), SIGTERM while two
    plain requests and two streams of 200 tokens run: the plain ones get 503 with OpenAI's error
    object, the streams an error event then `data: [DONE]`; the log has one status=503 line per
    request and no traceback; the process exits 0."""
    import subprocess
    import sys

    port = _serve_load().free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, "serve", "--port", str(port), "--threads", "1",
                             "--max-batch", "4", "--graceful-timeout", "0.5"], stdout=log, stderr=log)
    url, results = f"http://127.0.0.1:{port}", {}

    def plain(i):
        results[f"plain{i}"] = httpx.post(url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 200},
                                          timeout=60)

    def stream(i):
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 200,
                                                                  "stream": True}, timeout=60) as r:
            results[f"stream{i}"] = [line for line in r.iter_lines() if line]

    try:
        wait_for(lambda: proc.poll() is not None or _up(url), 60)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        threads = [threading.Thread(target=f, args=(i,)) for f in (plain, stream) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: httpx.get(url + "/health").json()["running"] == 4, 30)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    for i in range(2):
        r = results[f"plain{i}"]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["type"] == "server_error"
        lines = results[f"stream{i}"]
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-2:]
    assert text.count("status=503") == 4 and "Traceback" not in text and "Exception in ASGI" not in text, text


@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "-1"), ("--port", "80.5"),
                                        ("--max-batch", "0"), ("--max-queue", "-1"), ("--threads", "0"),
                                        ("--graceful-timeout", "-1"), ("--graceful-timeout", "nan"),
                                        ("--max-body-bytes", "0"), ("--max-stop", "0")])
def test_cli_serve_rejects_bad_numbers_as_usage_errors(capsys, flag, value):
    """Out-of-range numbers are argparse usage errors (exit 2, the flag and value named, no
    traceback): a port is 0..65535 (TCP's 16 bits; 0 = any free port). (The parser alone: a
    regression must not start a server.)"""
    from gpt2mha.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: expected" in err and repr(value) in err
    assert "Traceback" not in err


def test_serve_api_checks_port_and_cli_defaults_match():
    from gpt2mha.cli import build_parser, common as cli
    from gpt2mha.serving.protocol import MAX_STOP
    from gpt2mha.serving.server import DEFAULT_MAX_BODY_BYTES, serve

    with pytest.raises(ValueError, match=r"port=99999 must be an integer in \[0, 65535\]"):
        serve(None, None, "m", port=99999)
    assert cli.DEFAULT_MAX_BODY_BYTES == DEFAULT_MAX_BODY_BYTES
    args = build_parser().parse_args(["serve"])
    assert (args.max_body_bytes, args.max_stop) == (DEFAULT_MAX_BODY_BYTES, MAX_STOP)


def test_relay_wakes_the_loop_once_per_batch_and_delivers_in_order():
    """Events sent from another thread while the loop is busy arrive in their queues in order,
    with one wake-up (call_soon_threadsafe) for the whole batch instead of one per event."""
    import asyncio

    from gpt2mha.serving.server import Relay

    async def main():
        relay, loop = Relay(), asyncio.get_running_loop()
        relay.loop = loop
        wakes = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(1), original(*a))
        queues = [asyncio.Queue(), asyncio.Queue()]
        sender = threading.Thread(target=lambda: [relay.send(queues[i % 2], i) for i in range(10)])
        sender.start()
        sender.join(10)                          # the loop is not running handlers meanwhile
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(5)] for q in queues]
        relay.send(queues[0], 10)                # a later event wakes the loop again
        got[0].append(await asyncio.wait_for(queues[0].get(), 5))
        return got, len(wakes)

    got, wakes = asyncio.run(main())
    assert got == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]] and wakes == 2


@pytest.mark.slow
def test_cli_serve_quantized_under_its_own_name(tmp_path, builtin):
    """`gpt2mha serve --quantize int8 --quantize-method rtn --served-model-name bard`: the
    served model is the quantized one (greedy text equal to offline generate of the same
    quantized model) and answers to its given name; SIGTERM exits 0."""
    import copy

    model, tok = builtin
    load = _serve_load()
    port = load.free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = __import__("subprocess").Popen(
        [__import__("sys").executable, "-m", "gpt2mha.cli", "serve", "--port", str(port), "--threads", "1",
         "--quantize", "int8", "--quantize-method", "rtn", "--served-model-name", "bard"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _up(url), 60)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "bard"
        body = {"model": "bard", "prompt": "ROMEO:", "max_tokens": 24, "temperature": 0}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        q = copy.deepcopy(model).quantize("int8", method="rtn")
        assert_same_text(q, tok, "ROMEO:", text, offline(q, tok, "ROMEO:", 24, temperature=0)[1])
        assert httpx.post(url + "/v1/completions", json={**body, "model": "shakespeare-byte"}).status_code == 404
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _up(url):
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_nan_logits_fail_only_their_request_with_a_500_that_says_so(builtin):
    """A model whose position 20 embedding holds NaN: a request that reaches position 20 (greedy
    and sampled) fails with HTTP 500 whose message names the step and NaN logits; a request that
    stays before it, sent next on the same server, is answered as offline generate answers it."""
    import copy

    model, tok = builtin
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.wpe.weight[20, 3] = float("nan")
    sched = Scheduler(model, tok, max_batch=2, max_queue=4)
    with serve_in_thread(sched, DEFAULT_MODEL) as url, httpx.Client(base_url=url, timeout=60) as client:
        for temperature in (0, 0.8):                           # "ROMEO:" is 6 bytes: step 15 reads position 20
            r = client.post("/v1/completions", json=dict(prompt="ROMEO:", max_tokens=30, temperature=temperature,
                                                         seed=3))
            assert r.status_code == 500, r.text
            message = r.json()["error"]["message"]
            assert "NaN or infinite logits at step 15" in message and "NonFiniteLogitsError" in message, message
        r = client.post("/v1/completions", json=dict(prompt="ROMEO:", max_tokens=10, temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(model, tok, "ROMEO:", 10, 0)[1]
