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
from gpt2mha.inference.scheduler import Scheduler
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
            "prompt": "ROMEO:", "max_tokens": 200, "temperature": 0})))
        a.start()
        wait_for(lambda: sched.stats()["running"] == 1)

        def gives_up():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={"prompt": "JULIET:", "max_tokens": 5}, timeout=1.0)
        b = threading.Thread(target=gives_up)
        b.start()
        wait_for(lambda: sched.stats()["queued"] == 1)
        busy, _ = scrape(url)
        b.join(10)
        wait_for(lambda: sched.stats()["cancelled"] == 1)       # cancelled while it waited: never prefilled
        a.join(30)
        assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 200

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
    assert 0 < value(busy, "kv_cache_usage_perc") <= (n("ROMEO:") + 200) / (1 * model.config.n_ctx)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(idle, gauge) == 0, gauge

    generated = [200, 7, 3, 3, 3, 3, stop_tokens]       # per sequence that generated: long, stream, n, stop
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
    assert value(idle, "request_queue_time_seconds_bucket", le="0.01") < 8      # the one that waited behind 200 steps


def test_no_metrics_serves_no_metrics(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=1)
    with serve_in_thread(sched, DEFAULT_MODEL, metrics=False) as url:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 404 and r.json()["error"]["code"] == "metrics_off"
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert sched.metrics is None


# ------------------------------------------------------------------------------ probes
def test_probes_answer_get_and_head_and_every_answer_carries_a_request_id(builtin, caplog):
    """/live, /health, /version and /metrics answer GET and HEAD (another method: 405 naming
    GET, HEAD); a client's X-Request-Id comes back and is in the request's log line; without one
    (or with one that is not printable ASCII of at most 128 characters) the server makes one."""
    model, tok = builtin
    caplog.set_level(logging.INFO, logger="gpt2mha.serve")
    with serve_in_thread(Scheduler(model, tok, max_batch=1), DEFAULT_MODEL) as url:
        live, health, version = (httpx.get(url + p) for p in ("/live", "/health", "/version"))
        for path in ("/live", "/health", "/version", "/metrics"):
            head = httpx.head(url + path)
            assert head.status_code == 200 and head.content == b"", path
            r = httpx.post(url + path)
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, OPTIONS" and "GET, HEAD" in r.json()["error"]["message"]
            r = httpx.options(url + path)
            assert r.status_code == 200 and r.content == b"" and r.headers["allow"] == "GET, HEAD, OPTIONS", path
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "job-7/a"})
        bad = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": -1},
                         headers={"X-Request-Id": "x" * 129})
    assert live.status_code == 200 and live.json() == {"status": "ok", "phase": "ready"}
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == DEFAULT_MODEL
    assert version.json() == {"version": __version__, "model": DEFAULT_MODEL}
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-7/a"
    assert bad.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", live.headers["x-request-id"]) and live.headers["x-request-id"] != \
        health.headers["x-request-id"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gpt2mha.serve"]
    assert any(m.startswith("request cmpl-") and "request_id=job-7/a status=200" in m for m in lines), lines
    assert any(f"request {bad.headers['x-request-id']} status=400" in m for m in lines), lines


def test_while_loading_live_is_200_health_503_and_the_api_503(builtin):
    """Before the model is attached (``gpt2mha serve`` loads it behind an open port): /live 200
    "loading", /health 503 "loading" with Retry-After, /v1/* 503 ``model_loading`` in OpenAI's
    error shape, /metrics 200 with its gauges at 0; once attached and warmed up, all ready."""
    model, tok = builtin
    ops = Operations(DEFAULT_MODEL)
    with TestClient(ops) as http:
        assert http.get("/live").json() == {"status": "ok", "phase": "loading"}
        h = http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading" and int(h.headers["retry-after"]) >= 1
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "gpt2mha:num_requests_running{model_name=" in http.get("/metrics").text
        sched = Scheduler(model, tok, max_batch=1)
        ops.attach(sched, create_app(sched, DEFAULT_MODEL))
        assert sched.wait_ready(30)
        assert http.get("/health").json()["status"] == "ok" and http.get("/live").json()["phase"] == "ready"
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert sched.stopping                                          # the lifespan's shutdown stopped it


def test_readiness_is_503_queue_full_while_a_request_would_get_429(builtin, slow_steps):
    """One slot, no queue: while a request runs, /health says 503 "queue_full" (and a request
    gets 429); once it is done, 200 "ok" again."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=1, max_queue=0)
    with serve_in_thread(sched, DEFAULT_MODEL) as url:
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 60},
                                                       timeout=30))
        t.start()
        wait_for(lambda: sched.stats()["running"] == 1)
        full = httpx.get(url + "/health")
        refused = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        t.join(30)
        after = httpx.get(url + "/health")
    assert full.status_code == 503 and full.json()["status"] == "queue_full" and full.json()["free_slots"] == 0
    assert refused.status_code == 429
    assert after.status_code == 200 and after.json()["status"] == "ok"


def test_shutdown_drains_readiness_503_new_requests_503_in_flight_ones_finish(builtin, slow_steps):
    """Shutting down (what SIGTERM does) while a request runs: the port stays open, /live stays
    200 ("draining"), /health turns 503 "draining", a new request gets 503 with Retry-After, the
    running request finishes whole (80 tokens, "length"), then the port closes, well before the
    graceful timeout (it waits for the requests, not for the timeout)."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2)
    results, seen = {}, []

    def run():
        results["long"] = httpx.post(url + "/v1/completions", timeout=30,
                                     json={"prompt": "ROMEO:", "max_tokens": 80, "temperature": 0})

    def probe():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                live, health = httpx.get(url + "/live", timeout=2), httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                seen.append("closed")
                return
            seen.append((live.status_code, live.json()["phase"], health.status_code, health.json()["status"]))
            if seen[-1][1] == "draining" and "new" not in results:
                results["new"] = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            time.sleep(0.02)

    with serve_in_thread(sched, DEFAULT_MODEL, graceful_timeout=30) as url:
        long, prober = threading.Thread(target=run), threading.Thread(target=probe)
        long.start()
        wait_for(lambda: sched.stats()["running"] == 1)
        prober.start()
        t0 = time.monotonic()
    took = time.monotonic() - t0
    long.join(30)
    prober.join(30)
    r = results["long"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 80
    assert r.json()["choices"][0]["finish_reason"] == "length"
    new = results["new"]
    assert new.status_code == 503 and int(new.headers["retry-after"]) >= 1 and "shutting down" in new.json()["error"]["message"]
    assert seen[-1] == "closed" and all(s[0] == 200 for s in seen[:-1]), seen      # liveness: 200 until the port closes
    live = [s[1] for s in seen[:-1]]
    health = [s[2:] for s in seen[:-1]]                 # (each probe alone: the phase may turn between the two)
    assert changes(live) in (["ready", "draining"], ["draining"]), seen
    assert changes(health) in ([(200, "ok"), (503, "draining")], [(503, "draining")]), seen
    assert took < 15


def changes(states: list) -> list:
    """``states`` without repeats in a row: the sequence of phases a prober saw."""
    return [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]



# ------------------------------------------------------------------------------ API keys
KEY = "s3cret-key_0"


def test_api_key_openai_client_gets_401_without_or_with_a_wrong_key_and_200_with_it(builtin):
    """With an API key: the official client raises AuthenticationError (401, OpenAI's error
    object, code invalid_api_key) without a key or with a wrong one and is answered with the
    right one; the tokenizer routes and unknown routes need it too; the probes, /version and
    /metrics stay open; a CORS preflight (OPTIONS, no credentials) is not refused for the key."""
    model, tok = builtin
    with serve_in_thread(Scheduler(model, tok, max_batch=1), DEFAULT_MODEL, api_key=KEY) as url:
        def client(key):
            return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        for key in ("wrong", KEY + "x", KEY[:-1]):
            with pytest.raises(openai.AuthenticationError) as e:
                client(key).completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=2)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = client(KEY).completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=2)
        assert r.usage.completion_tokens == 2 and [m.id for m in client(KEY).models.list().data] == [DEFAULT_MODEL]
        bare = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert set(bare.json()["error"]) == {"message", "type", "param", "code"}
        assert "Missing API key" in bare.json()["error"]["message"]
        for auth in (f"bearer {KEY}", f"Bearer  {KEY}"):
            assert httpx.post(url + "/tokenize", json={"prompt": "ab"}, headers={"Authorization": auth}).status_code == 200
        for auth in (f"Basic {KEY}", "Bearer", KEY):
            assert httpx.post(url + "/tokenize", json={"prompt": "ab"}, headers={"Authorization": auth}).status_code == 401
        for path in ("/tokenizer_info", "/v1/models", "/no-such-route"):
            assert httpx.get(url + path).status_code == 401, path
        for path in ("/live", "/health", "/version", "/metrics"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.options(url + "/v1/completions").status_code != 401


def test_serve_api_key_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    """--api-key, else --api-key-file's first line, else GPT2MHA_API_KEY; both flags, an empty key
    or an unreadable file are one error line (exit 2) before anything loads; a key with a space
    is refused by the server itself."""
    from gpt2mha.cli import build_parser, main
    from gpt2mha.cli.tools import serve_api_key

    monkeypatch.delenv("GPT2MHA_API_KEY", raising=False)
    key_file, empty = tmp_path / "key", tmp_path / "empty"
    key_file.write_text("from-file\nsecond line\n")
    empty.write_text("\n")
    args = lambda *a: build_parser().parse_args(["serve", *a])           # noqa: E731
    assert serve_api_key(args()) is None
    assert serve_api_key(args("--api-key", "k1")) == "k1"
    assert serve_api_key(args("--api-key-file", str(key_file))) == "from-file"
    monkeypatch.setenv("GPT2MHA_API_KEY", " from-env ")
    assert serve_api_key(args()) == "from-env" and serve_api_key(args("--api-key", "k1")) == "k1"
    for argv, words in ((["--api-key", "a", "--api-key-file", str(key_file)], "not both"),
                        (["--api-key-file", str(empty)], "is empty"),
                        (["--api-key-file", str(tmp_path / "none")], "cannot read")):
        assert main(["serve", "--port", "0", *argv]) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key must be"):
        Operations(DEFAULT_MODEL, api_key="two words")

# ------------------------------------------------------------------------------ the CLI
SLOW_LOAD = ("import sys, time\n"
             "import gpt2mha.cli.tools as tools\n"
             "from gpt2mha.inference.scheduler import Scheduler\n"
             "load, decode = tools.load_model, Scheduler._decode\n"
             "tools.load_model = lambda *a, **k: (time.sleep(3), load(*a, **k))[1]     # a slow checkpoint\n"
             "Scheduler._decode = lambda self: (time.sleep(0.02), decode(self))[1]       # 20 ms a step\n"
             "from gpt2mha.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


def probe_once(url) -> tuple:
    """One round of a Kubernetes-like prober: (liveness status, readiness status and its
    "status"), or "closed" when the port does not answer."""
    try:
        live, health = httpx.get(url + "/live", timeout=2), httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return "closed"
    return live.status_code, health.status_code, health.json()["status"]


@pytest.mark.slow
def test_cli_serve_probes_from_start_to_exit_as_kubernetes_sees_them(tmp_path):
    """`gpt2mha serve` with a load slowed to 3 s and 20 ms decode steps, probed every 50 ms from
    its start: the port opens before the model is loaded (/live 200 while /health says 503
    "loading", and a request then gets 503 model_loading), /health turns 200 "ok"; SIGTERM while a
    request runs: /health 503 "draining" at once while /live stays 200, a new request gets 503,
    the running one finishes whole, the process exits 0. Liveness never fails while the port is
    open (so a livenessProbe never restarts a loading or draining server)."""
    port = _serve_load().free_port()
    url, seen, results = f"http://127.0.0.1:{port}", [], {}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "serve", "--port", str(port), "--threads", "1",
                             "--graceful-timeout", "30"], stdout=log, stderr=log)

    def run():
        results["long"] = httpx.post(url + "/v1/completions", timeout=60,
                                     json={"prompt": "ROMEO:", "max_tokens": 100, "temperature": 0})

    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            seen.append(probe_once(url))
            if seen[-1] != "closed" and seen[-1][2] == "loading" and "loading" not in results:
                results["loading"] = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            if seen[-1] != "closed" and seen[-1][2] == "ok" and "long" not in results:
                results["long"] = None
                threading.Thread(target=run).start()
                wait_for(lambda: httpx.get(url + "/health").json()["running"] == 1, 30)
                proc.send_signal(signal.SIGTERM)
            if seen[-1] != "closed" and seen[-1][2] == "draining" and "new" not in results:
                results["new"] = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
            time.sleep(0.05)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    phases = changes(seen)
    want = ["closed", (200, 503, "loading"), (200, 200, "ok"), (200, 503, "draining"), "closed"]
    assert phases in (want, want[1:]), (phases, text)
    assert results["loading"].status_code == 503 and results["loading"].json()["error"]["code"] == "model_loading"
    assert results["new"].status_code == 503
    wait_for(lambda: results["long"] is not None, 30)
    assert results["long"].status_code == 200 and results["long"].json()["usage"]["completion_tokens"] == 100
    assert "Traceback" not in text and "draining" in text, text


@pytest.mark.slow
def test_cli_serve_a_model_that_does_not_load_exits_2_with_one_error_line(tmp_path):
    """The port opens, the loading fails in its thread: the server stops and the command exits 2
    with the loader's error, as it did when the model loaded before the port opened."""
    port = _serve_load().free_port()
    missing = tmp_path / "no-such-model"
    done = subprocess.run([sys.executable, "-m", "gpt2mha", "serve", "--port", str(port), "--threads", "1",
                           "--model", str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: ") and str(missing) in last, done.stderr
    assert "Traceback" not in done.stderr
