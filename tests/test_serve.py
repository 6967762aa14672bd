"""The OpenAI-compatible server over HTTP: the official ``openai`` client's answers (plain,
streamed, several prompts and choices, ``best_of``, echoed prompts and logprobs), the raw SSE
stream, requests refused with OpenAI's error objects (400, 404, 413), a failing request that
fails alone, NaN logits, a short load test, and the relay of events to the event loop.

References: offline ``generate`` (the same model, one prompt alone) and ``gpt2mha generate``'s
output for every text; the model's own uncached forward (``log_softmax`` in float64) for every
logprob; Python's UTF-8 codec for streamed text; the official ``openai`` client for the wire
format. Servers bind 127.0.0.1 on a free port and are started and stopped by the tests.
"""

import json
import re
import threading
import time

import httpx
import pytest
import torch

from gpt2mha import DEFAULT_MODEL
from gpt2mha.inference.sampling import RowSampler, row_seed
from gpt2mha.io.tokenizer import ByteTokenizer
from gpt2mha.inference.scheduler import Scheduler
import serve_helpers
from serve_helpers import _serve_load, assert_same_text, draw_in, offline, wait_for

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from gpt2mha.serving.server import serve_in_thread       # noqa: E402

builtin = serve_helpers.builtin          # the fixture (module scope): the built-in model and its tokenizer


# ----------------------------------------------------------------------------- server
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


def test_sliding_window_runs_a_completion_past_the_context_as_generate_does(server, builtin):
    """``sliding_window: true`` (the SamplingParams field, as ``--sliding-window``): a completion
    past the built-in model's 256 positions is neither clipped nor refused, and its greedy text is
    offline ``generate``'s with ``sliding_window`` (the reference: each token past the context
    chosen from the last 256 alone); without it the same request is clipped where the context
    ends, to the same text's first 250 tokens."""
    url, _ = server
    model, tok = builtin
    body = {"prompt": "ROMEO:", "max_tokens": 270, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json={**body, "sliding_window": True}, timeout=120).json()
    ref = model.generate([tok.encode("ROMEO:")], 270, temperature=0, sliding_window=True)[0, 6:].tolist()
    assert r["choices"][0]["text"] == tok.decode(ref) and r["usage"]["completion_tokens"] == 270
    clipped = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert clipped["usage"]["completion_tokens"] == 250 and clipped["choices"][0]["text"] == tok.decode(ref[:250])


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
    character (no U+FFFD) and the chunks join to the text (reference: str.encode); the last
    text chunk carries the finish reason (OpenAI's shape: no chunk of empty text)."""
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
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces) and all(pieces)
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
    ({"prompt": "x" * 256, "max_tokens": 1}, "max_tokens"),             # fills n_ctx = 256: no room (past it, clipped)
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


def test_unknown_model_is_404_and_client_error_types(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="shakespeare-byte"):
        client.completions.create(model="gpt-4", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"


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


def test_a_whole_answer_wakes_the_loop_once_per_sequence_a_stream_at_each_event(server, monkeypatch):
    """A whole (not streamed) answer has only each sequence's last event relayed to the event
    loop (the sequences keep their own text: no wake-up a token), a stream every event; the two
    answers carry the same texts (seeded sampling, n=2)."""
    from gpt2mha.serving.completions import Relay

    url, _ = server
    sent, send = [], Relay.send
    monkeypatch.setattr(Relay, "send", lambda self, queue, item: (sent.append(item[2]), send(self, queue, item))[1])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    body = dict(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=24, temperature=0.9, seed=5, n=2)
    whole = client.completions.create(**body)
    assert sent == [True, True]
    sent.clear()
    streamed = ["", ""]
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert sent.count(True) == 2 and len(sent) >= 24
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == streamed
    assert all(c.finish_reason == "length" for c in whole.choices)
