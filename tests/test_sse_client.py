"""``benchmarks/sse_client.py``, the lean streaming client the serving benchmarks time every
server with: a wrong parse would give a wrong figure rather than an error.

Reference: the official ``openai`` client's streamed answer to the same request from the same
real server (``gpt2mha serve``'s app in a thread, the built-in model, greedy)."""

import pytest

from conftest import load_benchmark
from gpt2mha import DEFAULT_MODEL, GPT2
from gpt2mha.io.tokenizer import tokenizer_for
from gpt2mha.inference.scheduler import Scheduler
from gpt2mha.serving.server import serve_in_thread

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    sched = Scheduler(model, tokenizer_for(model.config), max_batch=2)
    with serve_in_thread(sched, DEFAULT_MODEL) as base:
        yield base, sched


@pytest.fixture
def url(served):
    return served[0]


def test_streamed_events_text_and_usage_equal_the_openai_clients(url):
    """Two streamed completions on ONE keep-alive connection: each gives the openai client's
    chunks (same texts in the same order), its usage, then [DONE], with times that never go
    back; a 400 answer raises HTTPError naming the status, and the connection then works again."""
    sse = load_benchmark("sse_client")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    conn = sse.Connection(url, timeout=60)                # a hung server fails the test in a minute
    for prompt in ("ROMEO:", "JULIET:\nO Romeo, Romeo"):
        body = dict(model=DEFAULT_MODEL, prompt=prompt, max_tokens=30, temperature=0)
        ref = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        got = list(sse.stream(conn, "/v1/completions",
                              {**body, "stream": True, "stream_options": {"include_usage": True}}))
        times = [t for t, _ in got]
        assert times == sorted(times)
        events = [e for _, e in got]
        assert events[-1] == "[DONE]"
        texts = [c["text"] for e in events[:-1] for c in e["choices"]]
        assert texts == [c.text for r in ref for c in r.choices]
        assert events[-2]["usage"]["completion_tokens"] == ref[-1].usage.completion_tokens == 30
    sock = conn.sock
    with pytest.raises(sse.HTTPError, match="HTTP 400"):
        list(sse.stream(conn, "/v1/completions", dict(model=DEFAULT_MODEL, prompt="x", max_tokens=-1, stream=True)))
    assert sock is not None and conn.sock is None          # closed after the error, reopened on next use
    got = list(sse.stream(conn, "/v1/completions", dict(model=DEFAULT_MODEL, prompt="x", max_tokens=3, stream=True)))
    assert got[-1][1] == "[DONE]"


def test_run_cell_answers_every_request_once_with_one_thread_per_client(url):
    """serve_peers.run_cell with 3 clients over 7 requests: every request answered once, in its own
    slot of the results, each with its max_tokens of tokens (length-limited greedy)."""
    import asyncio

    peers = load_benchmark("serve_peers")
    bodies = [dict(prompt=f"LINE {i}:", max_tokens=5 + i, temperature=0) for i in range(7)]
    results, wall = asyncio.run(peers.run_cell(url, bodies, 3, timeout=60))
    assert wall > 0
    assert [r["tokens"] for r in results] == [5 + i for i in range(7)]
    assert all(r["finish"] == "length" and r["chunks"] >= 1 for r in results)


def test_run_cell_stops_at_the_first_failed_request(served):
    """A request the server refuses (400) ends run_cell with that error at once: with one client,
    none of the requests after it reaches the scheduler (reference: its own counts)."""
    import asyncio

    url, sched = served
    peers = load_benchmark("serve_peers")
    sse = load_benchmark("sse_client")
    before = sched.stats()["completed"]
    bodies = [dict(prompt="x", max_tokens=-1, temperature=0)] + [dict(prompt="y", max_tokens=4, temperature=0)] * 5
    with pytest.raises(sse.HTTPError, match="HTTP 400"):
        asyncio.run(peers.run_cell(url, bodies, 1, timeout=60))
    assert sched.stats()["completed"] == before


def test_whole_answers_equal_the_streamed_ones_on_one_connection(url):
    """serve_peers.run_cell with ``one=whole_one`` (answers not streamed, the lean client's
    ``answer``): the same texts and token counts as the streamed requests (greedy), two
    requests on one keep-alive connection, end times after send times; a 400 raises HTTPError."""
    import asyncio

    peers = load_benchmark("serve_peers")
    sse = load_benchmark("sse_client")
    bodies = [dict(prompt=p, max_tokens=12, temperature=0) for p in ("ROMEO:", "JULIET:")]
    whole, _ = asyncio.run(peers.run_cell(url, bodies, 1, timeout=60, one=peers.whole_one))
    streamed, _ = asyncio.run(peers.run_cell(url, bodies, 1, timeout=60))
    assert [r["text"] for r in whole] == [r["text"] for r in streamed] and all(r["text"] for r in whole)
    assert [r["tokens"] for r in whole] == [12, 12] and all(r["t_end"] > r["t0"] for r in whole)
    conn = sse.Connection(url, timeout=60)
    with pytest.raises(sse.HTTPError, match="HTTP 400"):
        sse.answer(conn, "/v1/completions", dict(model=DEFAULT_MODEL, prompt="x", max_tokens=-1))
