"""Load test and throughput/latency benchmark of ``gpt2mha serve``: ``python benchmarks/serve_load.py``.

Two parts, each against a real server started as a subprocess (``gpt2mha serve --port P``):

1. **Load test** (built-in model): ``--clients`` concurrent clients (32) send ``--requests``
   requests (256) in all, with mixed prompt lengths and ``max_tokens``, greedy or seeded,
   some streamed, some with stop strings, some asking for ``logprobs``, some cancelled mid-way
   (a stream closed after a few chunks, a plain request abandoned after a few milliseconds).
   Every request that was not cancelled must come back complete (HTTP 200, finish_reason
   "length" or "stop") with exactly the text offline ``generate`` gives for it alone, and its
   logprobs (when asked) must be the model's own (:func:`logprob_problem`); at the end /health must show no running or
   queued sequence and every slot free. Any failure exits 1.
2. **Throughput and latency** (built-in model and random GPT-2 124M weights): the same streamed
   requests sent one at a time and by 4 and 16 concurrent clients; prints tokens/s (completion
   tokens / wall time), the ratio to one-at-a-time (target >= 4x at 16 clients), and p50/p95
   time to first token and per-token latency (time between first and last chunk / (tokens-1)).
   Then the scheduler alone in this process (no HTTP): decode-step time with 1, 4 and 16 rows,
   the bound the server's figures approach.

The figures depend on the machine and on what else runs on it: the script prints ``uptime``'s
load average before and after. ``--quick`` runs a small version (used in CI through
tests/test_serve.py: 8 clients, 32 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEXT = os.path.join(ROOT, "data", "tinyshakespeare.txt")


def prompts_from_text(n: int, seed: int, lo: int = 3, hi: int = 120) -> list[str]:
    """``n`` prompts: slices of Tiny Shakespeare of ``lo … hi`` characters (mixed lengths)."""
    rng = random.Random(seed)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read(200_000)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(text) - length)
        out.append(text[start:start + length])
    return out


def mixed_requests(n: int, seed: int = 0, max_tokens: tuple[int, int] = (1, 64)) -> list[dict]:
    """The load test's requests: dicts of a completions body plus ``_cancel`` (None, or for a
    stream the number of chunks after which the client hangs up, for a plain request the
    seconds after which it gives up)."""
    rng = random.Random(seed)
    lp_rng = random.Random(seed + 1)                  # its own stream: the other draws stay as they were
    reqs = []
    for i, prompt in enumerate(prompts_from_text(n, seed)):
        body = {"prompt": prompt, "max_tokens": rng.randint(*max_tokens), "stream": rng.random() < 0.4}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2**31), top_k=rng.choice([0, 40]))
        if rng.random() < 0.15:
            body["stop"] = rng.choice(["\n", "e", ["\n\n", "."]])
        cancel = None
        if rng.random() < 0.15:
            cancel = rng.randint(1, 3) if body["stream"] else rng.uniform(0.001, 0.05)
        if lp_rng.random() < 0.3:
            body["logprobs"] = lp_rng.choice([0, 1, 5])
        reqs.append({**body, "_cancel": cancel})
    return reqs


def expected_texts(model, tokenizer, reqs: list[dict]) -> list[str | None]:
    """Offline ``generate`` for each request that will not be cancelled (cut at its stop string)."""
    import torch

    out = []
    for r in reqs:
        if r["_cancel"] is not None:
            out.append(None)
            continue
        ids = tokenizer.encode(r["prompt"])
        toks = model.generate(torch.tensor([ids]), r["max_tokens"], temperature=r.get("temperature", 1.0),
                              top_k=r.get("top_k", 0), seed=r.get("seed"), vocab_size=tokenizer.n_vocab)
        text = tokenizer.decode(toks[0, len(ids):].tolist())
        stops = [r["stop"]] if isinstance(r.get("stop"), str) else r.get("stop") or []
        cuts = [text.find(s) for s in stops if s in text]
        out.append(text[:min(cuts)] if cuts else text)
    return out


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Send one completions request; returns status, text, finish_reason, usage and timings
    (``ttft``: first non-empty text; ``per_token``: (last - first chunk) / (tokens - 1)), or
    ``cancelled`` when the client hung up on purpose before the end."""
    cancel = body.get("_cancel")
    payload = {k: v for k, v in body.items() if not k.startswith("_")}
    t0 = time.perf_counter()
    if not payload.get("stream"):
        try:
            coro = client.post("/v1/completions", json=payload)
            r = await (asyncio.wait_for(coro, cancel) if cancel is not None else coro)
        except asyncio.TimeoutError:
            return {"cancelled": True}
        res = {"status": r.status_code, "body": r.json(), "total": time.perf_counter() - t0}
        if r.status_code == 200:
            c = r.json()["choices"][0]
            res.update(text=c["text"], finish_reason=c["finish_reason"], usage=r.json()["usage"],
                       logprobs=c["logprobs"])
        return res
    payload["stream_options"] = {"include_usage": True}
    texts, finish, usage, chunks, t_first, t_last = [], None, None, 0, None, None
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                return {"status": 500, "body": event}
            for c in event["choices"]:
                if c["text"]:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    texts.append(c["text"])
                finish = c["finish_reason"] or finish
                for key, values in (c.get("logprobs") or {}).items():
                    logprobs[key] += values
            usage = event.get("usage") or usage
            chunks += 1
            if cancel is not None and chunks >= cancel and finish is None:
                return {"cancelled": True}                  # leaving the block closes the connection
    n = usage["completion_tokens"] if usage else 0
    return {"status": 200, "text": "".join(texts), "finish_reason": finish, "usage": usage,
            "logprobs": logprobs if "logprobs" in payload else None,
            "ttft": None if t_first is None else t_first - t0, "total": time.perf_counter() - t0,
            "per_token": (t_last - t_first) / (n - 1) if n > 1 and t_first is not None else None}


async def run_clients(base_url: str, reqs: list[dict], clients: int, timeout: float = 600.0) -> tuple[list[dict], float]:
    """``clients`` workers take the requests in order (each waits for its answer before the
    next); returns the results in request order and the wall time."""
    results: list[dict | None] = [None] * len(reqs)
    queue = list(enumerate(reqs))[::-1]
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def worker():
            while queue:
                i, body = queue.pop()
                results[i] = await one_request(client, body)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), timeout)
        return results, time.perf_counter() - t0


def wait_idle(base_url: str, timeout: float = 10.0) -> dict:
    """/health once nothing runs or waits (a cancelled stream frees its slot at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(base_url + "/health").json()
        if (h["running"] == 0 and h["queued"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def near_tie(model, tokenizer, prompt: str, got: str, exp: str, tol: float = 1e-4) -> bool:
    """Whether a greedy text parts from offline generate's only at a near-tie: at the first
    differing token both tokens' logits (the model alone, uncached) are within ``tol`` of the
    maximum, where a batch's summation order may round differently from a batch of one."""
    import torch

    a, b = tokenizer.encode(prompt + exp), tokenizer.encode(prompt + got)
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None or j < len(tokenizer.encode(prompt)):
        return False
    with torch.no_grad():
        logits = model(torch.tensor([a[:j]])).logits[0, -1].double()
    best = logits.max()
    return max((best - logits[a[j]]).item(), (best - logits[b[j]]).item()) <= tol * max(1.0, best.abs().item())


def logprob_problem(model, tokenizer, req: dict, res: dict, tol: float = 1e-4) -> str | None:
    """What is wrong with a completion's ``logprobs`` (None: nothing): one entry per token of
    its text (the tokens' texts joined are the text, the offsets where each starts),
    ``token_logprobs`` equal (``tol``) to ``log_softmax`` of the model's own uncached forward over
    prompt + text, and ``top_logprobs`` the ``logprobs`` largest of those (plus the token itself)."""
    import torch

    lp, text = res.get("logprobs"), res["text"]
    if lp is None:
        return "logprobs missing"
    whole = not any(t.startswith("bytes:") for t in lp["tokens"])         # no part of a character
    if whole and ("".join(lp["tokens"]) != text or lp["text_offset"] != [len("".join(lp["tokens"][:j])) for j in
                                                                          range(len(lp["tokens"]))]):
        return f"logprobs tokens {lp['tokens']!r} / offsets {lp['text_offset']} do not spell the text {text!r}"
    prompt, ids = tokenizer.encode(req["prompt"]), tokenizer.encode(text)
    if len(ids) != len(lp["token_logprobs"]):
        return f"{len(lp['token_logprobs'])} token_logprobs for {len(ids)} tokens"
    if not ids:
        return None
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double(), -1)
    for j, (token, got, top) in enumerate(zip(ids, lp["token_logprobs"], lp["top_logprobs"])):
        want = ref[j, :tokenizer.n_vocab].topk(req["logprobs"])
        if abs(got - ref[j, token].item()) > tol:
            return f"token {j}: logprob {got} != the model's {ref[j, token].item()}"
        largest = sorted(top.values(), reverse=True)[:req["logprobs"]]
        if len(top) > req["logprobs"] + 1 or len(largest) != req["logprobs"] or any(
                abs(a - b) > tol for a, b in zip(largest, want.values.tolist())):
            return f"token {j}: top_logprobs {top} are not the {req['logprobs']} largest {want.values.tolist()}"
    return None


def check_load(results: list[dict], expected: list[str | None], health: dict, reqs=None, model=None,
               tokenizer=None) -> list[str]:
    """Problems found (empty: nothing lost, everything correct, all slots free). With ``reqs``,
    ``model`` and ``tokenizer``, a greedy text that parts from offline generate only at a
    near-tie (:func:`near_tie`) is not a problem."""
    problems = []
    for i, (res, exp) in enumerate(zip(results, expected)):
        if res is None:
            problems.append(f"request {i}: no result")
        elif res.get("cancelled"):
            continue
        elif res["status"] != 200:
            problems.append(f"request {i}: HTTP {res['status']} {res.get('body')}")
        elif res["finish_reason"] not in ("length", "stop"):
            problems.append(f"request {i}: finish_reason {res['finish_reason']!r}")
        elif exp is not None and res["text"] != exp and not (
                model is not None and reqs[i].get("temperature") == 0
                and near_tie(model, tokenizer, reqs[i]["prompt"], res["text"], exp)):
            problems.append(f"request {i}: text {res['text']!r} != offline generate {exp!r}")
        elif reqs is not None and model is not None and "logprobs" in reqs[i]:
            bad = logprob_problem(model, tokenizer, reqs[i], res)
            if bad:
                problems.append(f"request {i}: {bad}")
    if health["running"] or health["queued"] or health["free_slots"] != health["slots"]:
        problems.append(f"not idle at the end: {health}")
    return problems


def load_test(base_url: str, model, tokenizer, n_requests: int, clients: int, seed: int = 0,
              max_tokens: tuple[int, int] = (1, 64)) -> dict:
    """Part 1. Returns counts, wall time and the problems found."""
    reqs = mixed_requests(n_requests, seed, max_tokens)
    expected = expected_texts(model, tokenizer, reqs)
    before = httpx.get(base_url + "/health").json()
    results, wall = asyncio.run(run_clients(base_url, reqs, clients))
    health = wait_idle(base_url)
    problems = check_load(results, expected, health, reqs, model, tokenizer)
    cancelled = sum(bool(r and r.get("cancelled")) for r in results)
    finished = health["completed"] + health["cancelled"] + health["failed"] - (
        before["completed"] + before["cancelled"] + before["failed"])
    return dict(requests=n_requests, clients=clients, cancelled=cancelled, completed=n_requests - cancelled,
                streamed=sum(r["stream"] for r in reqs), wall=wall, problems=problems, health=health,
                finished_sequences=finished)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def throughput(base_url: str, n_requests: int, max_tokens: int, levels=(1, 4, 16), seed: int = 1,
               repeats: int = 3) -> list[dict]:
    """Part 2: the same greedy streamed requests at each concurrency level, the levels taken in
    turn ``repeats`` times (1, 4, 16, 1, 4, 16, ...) so that a slow spell of the shared machine
    hits all of them; each level's figures are from its median-throughput round."""
    reqs = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            for p in prompts_from_text(n_requests, seed, 10, 60)]
    asyncio.run(run_clients(base_url, reqs[:2], 2))            # warm-up
    rounds = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            results, wall = asyncio.run(run_clients(base_url, reqs, c))
            bad = [r for r in results if r.get("status") != 200]
            if bad:
                raise RuntimeError(f"{len(bad)} requests failed at {c} clients: {bad[0]}")
            tokens = sum(r["usage"]["completion_tokens"] for r in results)
            ttft = [r["ttft"] for r in results if r["ttft"] is not None]
            per_token = [r["per_token"] for r in results if r["per_token"] is not None]
            rounds[c].append(dict(clients=c, tokens=tokens, wall=wall, tokens_per_s=tokens / wall,
                                  ttft_p50=percentile(ttft, .5), ttft_p95=percentile(ttft, .95),
                                  tpot_p50=percentile(per_token, .5), tpot_p95=percentile(per_token, .95),
                                  all_tokens_per_s=[]))
    rows = []
    for c in levels:
        ranked = sorted(rounds[c], key=lambda r: r["tokens_per_s"])
        median = ranked[len(ranked) // 2]
        median["all_tokens_per_s"] = [r["tokens_per_s"] for r in rounds[c]]
        rows.append(median)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    return rows


def engine(model, tokenizer, levels=(1, 4, 16), steps: int = 20, max_batch: int = 16) -> list[dict]:
    """The scheduler alone, in this process (no HTTP): decode-step time and tokens/s with
    ``rows`` greedy sequences running, after prefill; the bound the server's figures approach."""
    from gpt2mha.inference.params import SamplingParams
    from gpt2mha.inference.scheduler import Scheduler

    prompts = prompts_from_text(max(levels), 2, 10, 60)
    rows = []
    for n in levels:
        sched = Scheduler(model, tokenizer, max_batch=max_batch)
        sched.submit([tokenizer.encode(p) for p in prompts[:n]], SamplingParams(max_tokens=steps + 3, temperature=0),
                     lambda *a: None)
        sched.step()                                              # prefills + one step
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.step()
        dt = (time.perf_counter() - t0) / steps
        sched.stop()
        rows.append(dict(rows=n, step_ms=1000 * dt, tokens_per_s=n / dt))
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def engine_workload(model, tokenizer, n_requests: int, max_tokens: int, levels=(1, 4, 16), seed: int = 1,
                    repeats: int = 3) -> list[dict]:
    """The throughput part's requests run by the scheduler alone (no HTTP, this process):
    ``c`` sequences in flight, a new one submitted as soon as one finishes, prefill included.
    The ceiling the server's ratio can reach for this workload; median of ``repeats`` rounds."""
    from gpt2mha.inference.params import SamplingParams
    from gpt2mha.inference.scheduler import Scheduler

    prompts = [tokenizer.encode(p) for p in prompts_from_text(n_requests, seed, 10, 60)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    rows = []
    for c in levels:
        rates = []
        for _ in range(repeats):
            sched = Scheduler(model, tokenizer, max_batch=16)
            todo, finished = list(prompts[::-1]), []

            def on_event(seq, text, done):
                if done:
                    finished.append(seq)

            t0 = time.perf_counter()
            for _ in range(min(c, len(todo))):
                sched.submit([todo.pop()], params, on_event)
            while not sched.idle():
                sched.step()
                while todo and len(finished) + c > len(prompts) - len(todo):
                    sched.submit([todo.pop()], params, on_event)
            dt = time.perf_counter() - t0
            sched.stop()
            rates.append(sum(len(s.tokens) for s in finished) / dt)
        rows.append(dict(clients=c, tokens_per_s=sorted(rates)[len(rates) // 2]))
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def print_engine_workload(name: str, rows: list[dict]) -> None:
    print(f"{name}, the same requests through the scheduler alone (prefill included, no HTTP): "
          + "; ".join(f"{r['clients']} in flight {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x)" for r in rows))


def print_engine(name: str, rows: list[dict]) -> None:
    print(f"\n{name}, scheduler alone (no HTTP, this process, {__import__('torch').get_num_threads()} threads): "
          + "; ".join(f"{r['rows']} rows {r['step_ms']:.1f} ms/step {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x)"
                      for r in rows))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gpt2mha serve`` as a subprocess on a free port of 127.0.0.1 (``extra``: more serve
    flags); stopped with SIGTERM (checks that it exits 0)."""

    def __init__(self, model: str | None, max_batch: int = 16, max_queue: int = 256, log_path: str | None = None,
                 threads: int | None = None, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gpt2mha", "serve", "--port", str(self.port),
               "--max-batch", str(max_batch), "--max-queue", str(max_queue)] + (["--model", model] if model else []) + (
                  ["--threads", str(threads)] if threads else []) + list(extra)
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"gpt2mha serve did not start (exit {self.proc.poll()}); see {log_path}")
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def print_rows(name: str, rows: list[dict]) -> None:
    print(f"\n{name}: completion tokens/s, time to first token (TTFT) and per-token latency (TPOT)")
    print(f"{'clients':>7} {'tokens':>7} {'wall s':>7} {'tok/s':>8} {'vs 1':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'TPOT p50':>9} {'TPOT p95':>9}  tok/s of every round")
    for r in rows:
        print(f"{r['clients']:>7} {r['tokens']:>7} {r['wall']:>7.2f} {r['tokens_per_s']:>8.1f} {r['speedup']:>5.2f}x "
              f"{1000 * r['ttft_p50']:>7.1f}ms {1000 * r['ttft_p95']:>7.1f}ms {1000 * r['tpot_p50']:>7.1f}ms "
              f"{1000 * r['tpot_p95']:>7.1f}ms  {', '.join(f'{x:.0f}' for x in r['all_tokens_per_s'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256, help="load test: requests in all")
    ap.add_argument("--clients", type=int, default=32, help="load test: concurrent clients")
    ap.add_argument("--bench-requests", type=int, default=32, help="throughput: requests per concurrency level")
    ap.add_argument("--bench-tokens", type=int, default=32, help="throughput: max_tokens of each request")
    ap.add_argument("--repeats", type=int, default=3, help="throughput: rounds over the levels (median taken)")
    ap.add_argument("--skip-124m", action="store_true", help="throughput on the built-in model only")
    ap.add_argument("--threads", type=int, default=None, help="the servers' --threads (default: torch's choice)")
    ap.add_argument("--skip-load", action="store_true", help="throughput and latency only")
    ap.add_argument("--quick", action="store_true", help="8 clients, 32 requests, built-in model only")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.bench_requests, args.skip_124m, args.repeats = 32, 8, 16, True, 1

    from gpt2mha import GPT2, DEFAULT_MODEL
    from gpt2mha.io.tokenizer import tokenizer_for

    print(f"load before: {uptime()}; servers' --threads: {args.threads or 'default'}")
    failed = False
    model = GPT2.from_pretrained(DEFAULT_MODEL)
    tok = tokenizer_for(model.config)
    server = Server(None, log_path=os.path.join(tempfile.gettempdir(), "gpt2mha-serve-load.log"), threads=args.threads)
    try:
        res = {"problems": []} if args.skip_load else load_test(server.url, model, tok, args.requests, args.clients)
        if not args.skip_load:
            print(f"\nload test ({DEFAULT_MODEL}): {res['requests']} requests from {res['clients']} clients "
                  f"({res['streamed']} streamed, {res['cancelled']} cancelled mid-way) in {res['wall']:.1f} s; "
                  f"{res['completed']} completed; at the end: running {res['health']['running']}, queued "
                  f"{res['health']['queued']}, free slots {res['health']['free_slots']}/{res['health']['slots']}")
            for p in res["problems"][:20]:
                print("  PROBLEM:", p)
            print("  nothing lost, every text equal to offline generate" if not res["problems"]
                  else f"  {len(res['problems'])} problems")
        failed |= bool(res["problems"])
        print_rows(DEFAULT_MODEL, throughput(server.url, args.bench_requests, args.bench_tokens, repeats=args.repeats))
    finally:
        rc = server.stop()
        print(f"SIGTERM: server exited with {rc}")
        failed |= rc != 0
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    print_engine(DEFAULT_MODEL, engine(model, tok))
    print_engine_workload(DEFAULT_MODEL, engine_workload(model, tok, args.bench_requests, args.bench_tokens,
                                                         repeats=args.repeats))
    if not args.skip_124m:
        from gpt2mha import GPT2Config
        with tempfile.TemporaryDirectory() as d:
            m = GPT2(GPT2Config.from_preset("124M"))
            m.init_weights(seed=0)
            m.save_pretrained(d)
            del m
            server = Server(d, log_path=os.path.join(tempfile.gettempdir(), "gpt2mha-serve-124m.log"),
                            threads=args.threads)
            try:
                print_rows("random GPT-2 124M",
                           throughput(server.url, args.bench_requests, args.bench_tokens, repeats=args.repeats))
            finally:
                rc = server.stop()
                print(f"SIGTERM: server exited with {rc}")
                failed |= rc != 0
            m = GPT2.from_pretrained(d)
            print_engine("random GPT-2 124M", engine(m, tokenizer_for(m.config)))
            print_engine_workload("random GPT-2 124M", engine_workload(m, tokenizer_for(m.config), args.bench_requests,
                                                                       args.bench_tokens, repeats=1))
    print(f"\nload after: {uptime()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
