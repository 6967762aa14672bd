"""Starting, overloading and stopping the server: shutdown past the graceful timeout (503s and
streams ended cleanly, in process and as ``gpt2mha serve`` under SIGTERM), a full queue (429 with
Retry-After) and a client that hangs up, and ``gpt2mha serve``'s own arguments (bad numbers,
its defaults against the library's, a quantized model under its own name).

References: offline ``generate`` (the same model, one prompt alone) for every text; OpenAI's
error objects and the official ``openai`` client's error classes; the server's log and exit
status. Servers bind 127.0.0.1 on a free port (in this process or a subprocess) and are started
and stopped by the tests.
"""

import json
import logging
import signal
import threading
import time

import httpx
import pytest

from gpt2mha import DEFAULT_MODEL
from gpt2mha.inference.scheduler import Scheduler
import serve_helpers
from serve_helpers import _serve_load, assert_same_text, offline, wait_for

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from gpt2mha.serving.server import serve_in_thread       # noqa: E402

builtin = serve_helpers.builtin          # the fixture (module scope): the built-in model and its tokenizer


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
              "from gpt2mha.inference.scheduler import Scheduler\n"
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
    import inspect

    from gpt2mha.serving.protocol import MAX_STOP, MAX_TOKENS_OVERFLOW
    from gpt2mha.serving.server import DEFAULT_MAX_BODY_BYTES, create_app, serve

    with pytest.raises(ValueError, match=r"port=99999 must be an integer in \[0, 65535\]"):
        serve(None, None, "m", port=99999)
    assert cli.DEFAULT_MAX_BODY_BYTES == DEFAULT_MAX_BODY_BYTES
    args = build_parser().parse_args(["serve"])
    assert (args.max_body_bytes, args.max_stop) == (DEFAULT_MAX_BODY_BYTES, MAX_STOP)
    overflow = inspect.signature(create_app).parameters["max_tokens_overflow"].default
    assert args.max_tokens_overflow == overflow == inspect.signature(serve).parameters["max_tokens_overflow"].default
    choices = next(a.choices for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
                   if a.dest == "max_tokens_overflow")
    assert tuple(choices) == MAX_TOKENS_OVERFLOW


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
