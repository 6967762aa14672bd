"""Operating the server: ``/metrics`` (Prometheus text, vLLM's families under ``gpt2mha:``), the
probes (``/live``, ``/health`` as readiness, ``HEAD``, ``/version``), the loading phase, draining on
shutdown, API keys and ``X-Request-Id``.

References: ``prometheus_client.parser`` reads the exposition, and every count is derived from the
requests the test sent (their prompts' tokens by the tokenizer, their ``max_tokens``, their finish);
vLLM's metric names and ``finished_reason`` values (``vllm/v1/metrics/loggers.py``); Kubernetes'
probe semantics (liveness stays 200 while loading and draining, readiness does not); OpenAI's 401
error object as the official ``openai`` client reads it. Servers bind 127.0.0.1 on a free port and
are started and stopped by the tests.
"""

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gpt2mha import DEFAULT_MODEL, __version__
from gpt2mha.serving.scheduler import Scheduler
import serve_helpers
from serve_helpers import _serve_load, wait_for

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")
from fastapi.testclient import TestClient       # noqa: E402
from gpt2mha.serving.operate import Operations  # noqa: E402
from gpt2mha.serving.server import create_app, serve_in_thread       # noqa: E402

builtin = serve_helpers.builtin          # the fixture (module scope): the built-in model and its tokenizer

#: vLLM's families (``vllm:`` → ``gpt2mha:``) and their types, as prometheus_client's parser names them.
VLLM_FAMILIES = {"num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
                 "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
                 "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
                 "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram"}


def scrape(url) -> dict:
    """``{(sample name, frozenset of labels): value}`` of ``/metrics``, and the families' types."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    samples, types = {}, {}
    for family in parser.text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return samples, types


def value(samples, name, **labels):
    return samples[f"gpt2mha:{name}", frozenset({"model_name": DEFAULT_MODEL, **labels}.items())]


@pytest.fixture
def slow_steps(monkeypatch):
    """Each decode step takes 10 ms longer, so requests overlap for sure."""
    real = Scheduler._decode
    monkeypatch.setattr(Scheduler, "_decode", lambda self: (time.sleep(0.01), real(self))[1])


def test_metrics_after_a_known_mix_of_requests(builtin, slow_steps):
    """After a known mix (a long greedy request, one cancelled while it waits, a stream, 2 prompts
    x n=2, a stop string, an echo of the prompt alone): every count and token total equals what
    the requests imply, the histograms hold one observation per sequence (per token gap for the
    inter-token latency), the gauges show 1 running, 1 waiting and the cache in use while two
    requests overlap, and 0 once idle. The families are vLLM's names and types."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=1, max_queue=4)
    n = lambda text: len(tok.encode(text))              # noqa: E731
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        samples, types = scrape(url)
        assert {name: types.get("gpt2mha:" + name) for name in VLLM_FAMILIES} == VLLM_FAMILIES
        assert value(samples, "generation_tokens_total") == 0

        long = {}
        a = threading.Thread(target=lambda: long.update(r=httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "ROMEO:", "max_tokens": 150, "temperature": 0})))
        a.start()
        wait_for(lambda: sched.stats()["running"] == 1)

        def gives_up():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={"prompt": "JULIET:", "max_tokens": 5}, timeout=0.5)
        b = threading.Thread(target=gives_up)
        b.start()
        wait_for(lambda: sched.stats()["queued"] == 1)
        busy, _ = scrape(url)
        b.join(10)
        wait_for(lambda: sched.stats()["cancelled"] == 1)       # cancelled while it waited: never prefilled
        a.join(30)
        assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 150

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model=DEFAULT_MODEL, prompt="JULIET:", max_tokens=7, temperature=0.8,
                                                seed=1, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        r = client.completions.create(model=DEFAULT_MODEL, prompt=["a", "bc"], n=2, max_tokens=3, seed=2)
        assert [c.finish_reason for c in r.choices] == ["length"] * 4
        stopped = client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=60, temperature=0,
                                            stop="e").choices[0]
        assert stopped.finish_reason == "stop"
        stop_tokens = n(stopped.text + "e")             # generated up to and with the stop string (one token a byte)
        echo = client.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=0, echo=True, logprobs=1)
        assert echo.choices[0].finish_reason == "length"
        wait_for(lambda: sched.idle())
        idle, _ = scrape(url)

    assert value(busy, "num_requests_running") == 1 and value(busy, "num_requests_waiting") == 1
    assert 0 < value(busy, "kv_cache_usage_perc") <= (n("ROMEO:") + 150) / (1 * model.config.n_ctx)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(idle, gauge) == 0, gauge

    generated = [150, 7, 3, 3, 3, 3, stop_tokens]       # per sequence that generated: long, stream, n, stop
    assert value(idle, "prompt_tokens_total") == (n("ROMEO:") + n("JULIET:") + 2 * n("a") + 2 * n("bc")
                                                  + n("ROMEO:") + n("ROMEO:"))
    assert value(idle, "generation_tokens_total") == sum(generated)
    reasons = {r: value(idle, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 1, "length": 1 + 1 + 4 + 1, "abort": 1, "error": 0}
    counts = {"time_to_first_token_seconds": len(generated), "inter_token_latency_seconds": sum(generated) - len(generated),
              "e2e_request_latency_seconds": 9, "request_queue_time_seconds": 8}
    for family, count in counts.items():
        assert value(idle, family + "_count") == count, family
        assert value(idle, family + "_bucket", le="+Inf") == count and value(idle, family + "_sum") > 0, family
    assert value(idle, "request_queue_time_seconds_bucket", le="0.01") < 8      # the one that waited behind 150 steps


def test_no_metrics_serves_no_metrics(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=1)
    with serve_in_thread(sched, DEFAULT_MODEL, metrics=False) as url:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 404 and r.json()["error"]["code"] == "metrics_off"
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert sched.metrics is None
