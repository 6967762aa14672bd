"""Served speed: ``gpt2mha serve`` against llama.cpp's own server (``llama-server``) on the same
random GPT-2 124M weights (issue 41, item 6). An extra, never run in CI:

    python benchmarks/serve_peers.py --llama-build /path/to/llama.cpp/build [--rounds 3] [--quick]
    python benchmarks/serve_peers.py --llama-server PATH --llama-quantize PATH ...

What runs (every server a subprocess on a free port of 127.0.0.1, ``--threads`` threads each,
default 2; all of them stopped at the end, also on failure or Ctrl-C):

* gpt2mha int4: ``gpt2mha serve --threads 2 --max-batch 16`` on a directory written once by
  ``gpt2mha convert SRC DST --quantize int4 --activations per_block --quantize-head int4
  --group-size 64`` (GPTQ, the default method): W4A8 decode steps on the native forward;
* gpt2mha int8: the same on ``--quantize int8 --activations per_row`` (GPTQ): W7A8, native forward;
* llama.cpp q4_0 and q8_0: ``llama-server -t 2 -tb 2 -np 16 -c 16384`` (16 slots of 1024
  positions, continuous batching, its defaults otherwise) on GGUF files: float32 written by
  ``peers_convert.write_gguf`` (the ``gguf`` package), then ``llama-quantize`` to q8_0 / q4_0 (its
  default recipe: q4_0 keeps the tied embedding/head in q6_K). The GGUF's end-of-text id is set
  to 50256 (``--override-kv tokenizer.ggml.eos_token_id=int:50256``): without it llama.cpp's
  GPT-2 vocabulary defaults to id 11 (",") and would stop at the first comma, where gpt2mha stops
  at ``<|endoftext|>``.

The clients (``sse_client.py``: one thread and one keep-alive HTTP/1.1 connection each, the same
lean client for every server; httpx's streaming cost twice its CPU a token, taken from the server
measured): streamed ``POST /v1/completions`` (``temperature: 0``, ``max_tokens`` 128,
``stream_options.include_usage``), prompts of 60-160 characters of Tiny Shakespeare, different
in every round and level and the same for every engine within one; at 1, 4 and 16 concurrent
clients (each sends its next request when its answer is complete: 3, 8 and 32 requests). Per
cell: output tokens/s (completion tokens / wall time of the cell), time to first token (request
sent to first chunk with text), inter-token latency (every gap between successive text chunks,
pooled) and per-request decode rate ((tokens - 1) / (last chunk - first chunk)).

Round-robin: every server is up for the whole run; each round takes the levels in turn and, at
each level, every engine in turn (the order rotated each round), with ``--settle`` seconds of
sleep before each cell. Every round's tok/s is printed; the table gives their median, and the
latency percentiles pooled over the rounds.

Also measured, in the same rounds:

* offline ``generate`` in a worker process of its own (``torch.set_num_threads(--threads)``, as
  ``gpt2mha generate --threads`` and ``gpt2mha serve --threads`` set it), batch 1, on the same
  saved directories and the level-1 prompts, in its main thread (as ``gpt2mha generate`` runs)
  and again in a thread of its own (as the server's scheduler thread runs the model): end-to-end
  tok/s (new tokens / time of the call) and decode tok/s ((n - 1) / (t(n new) - t(1 new))),
  against the served single-client figures (end to end: tokens / request time; decode: the
  per-request decode rate); the served text is checked equal to offline generate's for each of
  those prompts (same engine, same route);
* the scheduler alone (``gpt2mha.inference.scheduler.Scheduler``, no HTTP), in a thread of that
  worker, on each level's requests (``c`` in flight, the next submitted when one finishes): the
  bound the served figure approaches; served / scheduler-alone is what HTTP, SSE and the event
  loop cost;
* top-1 agreement with float32 on held-out text (the last tokens of ``data/tinyshakespeare.txt``,
  teacher forced): gpt2mha's quantized models offline (its served route is offline generate's),
  llama.cpp's through its server: one ``/completion`` request per prefix (``n_predict`` 1,
  greedy, ``return_tokens``, its prompt cache holding the prefix).

Writes ``benchmarks/results/serve_peers-<date>.json`` (``--json`` to change) and prints the
table with the ratios gpt2mha / llama-server (int4 / q4_0, int8 / q8_0). Needs ``httpx``,
``transformers`` and ``gguf`` (``pip install gguf``), and a llama.cpp build: cmake
``-DGGML_NATIVE=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF``, targets ``llama-server``
and ``llama-quantize``. Without ``--llama-server`` (or with ``--skip-llama``) only gpt2mha's
side runs.

The code beside it: ``serve_peers_servers.py`` (llama-server, the engines, the models and GGUF files
written once) and ``serve_peers_offline.py`` (the worker process: offline generate and the scheduler
alone).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import httpx  # noqa: E402
import sse_client  # noqa: E402

from serve_load import Server as GptServer, percentile, prompts_from_text, uptime  # noqa: E402
# the servers and the files they serve, and the offline worker (beside this file)
from serve_peers_offline import Worker, worker  # noqa: E402
from serve_peers_servers import Engine, LlamaServer, dir_mb, llama_version, prepare  # noqa: E402

LEVELS = (1, 4, 16)
PAIRS = (("gpt2mha int4", "llama.cpp q4_0"), ("gpt2mha int8", "llama.cpp q8_0"))


# ============================================================================ the clients
def stream_one(conn: sse_client.Connection, body: dict) -> dict:
    """One streamed completion: text, completion tokens, the send time and every text chunk's time."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    texts, times, usage, finish, events = [], [], None, None, 0
    t0 = time.perf_counter()
    for now, event in sse_client.stream(conn, "/v1/completions", payload):
        if event == "[DONE]":
            continue                                  # read on to the body's end: the connection is reused
        if "error" in event:
            raise RuntimeError(f"error event: {event}")
        events += 1
        for c in event.get("choices") or []:
            if c.get("text"):
                times.append(now)
                texts.append(c["text"])
            finish = c.get("finish_reason") or finish
        usage = event.get("usage") or usage
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    return dict(t0=t0, t_end=t_end, times=times, text="".join(texts), tokens=n, finish=finish, events=events,
                chunks=len(times))


def whole_one(conn: sse_client.Connection, body: dict) -> dict:
    """One completion answered whole (not streamed): text, completion tokens, the send and end times."""
    t0 = time.perf_counter()
    t_end, ans = sse_client.answer(conn, "/v1/completions", {**body, "stream": False})
    c = ans["choices"][0]
    return dict(t0=t0, t_end=t_end, times=[], text=c["text"], tokens=ans["usage"]["completion_tokens"],
                finish=c["finish_reason"], events=0, chunks=0)


async def run_cell(url: str, bodies: list[dict], clients: int, timeout: float = 900.0,
                   one=stream_one) -> tuple[list[dict], float]:
    """``clients`` workers take the requests in order (each waits for its answer before the next),
    each a thread with a keep-alive connection of its own (:mod:`sse_client`: the same lean
    client for every server; ``one``: :func:`stream_one`, or :func:`whole_one` for answers
    not streamed). The first failure or the ``timeout`` raises at once; the other
    workers then take no new request."""
    results: list[dict | None] = [None] * len(bodies)
    queue = list(enumerate(bodies))[::-1]
    stop = threading.Event()

    def worker():
        conn = sse_client.Connection(url, timeout)
        try:
            while not stop.is_set():
                try:
                    i, body = queue.pop()
                except IndexError:                    # no request left
                    return
                results[i] = one(conn, body)
        finally:
            conn.close()

    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=clients)             # one thread per client
    try:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(loop.run_in_executor(pool, worker) for _ in range(clients))), timeout)
        return results, time.perf_counter() - t0
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


def cell_figures(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    decode = [(r["tokens"] - 1) / (r["times"][-1] - r["times"][0]) for r in results
              if r["tokens"] > 1 and len(r["times"]) > 1 and r["times"][-1] > r["times"][0]]
    e2e = [r["tokens"] / (r["t_end"] - r["t0"]) for r in results]
    return dict(tokens=tokens, wall=wall, tokens_per_s=tokens / wall, ttft=ttft, itl=itl, decode_per_request=decode,
                e2e_per_request=e2e, chunks=sum(r["chunks"] for r in results),
                short=[r["tokens"] for r in results if r["finish"] != "length"])


# ============================================================================ quality
def top1_gpt2mha(ref_argmax, model, tokens) -> float:
    import torch

    with torch.inference_mode():
        got = model(tokens[None]).logits[0].argmax(-1)
    return float((got == ref_argmax).float().mean())


def top1_llama(url: str, tokens: list[int], ref_argmax: list[int]) -> float:
    """The server's greedy next token after every prefix (one request each), against float32's."""
    same = 0
    with httpx.Client(base_url=url, timeout=120) as c:
        for j in range(1, len(tokens) + 1):
            r = c.post("/completion", json={"prompt": tokens[:j], "n_predict": 1, "temperature": 0,
                                            "return_tokens": True, "cache_prompt": True})
            r.raise_for_status()
            got = r.json()["tokens"]
            same += bool(got) and got[0] == ref_argmax[j - 1]
    return same / len(tokens)


# ============================================================================ the run
def machine() -> dict:
    cpu = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    import platform

    import torch
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__)


def summarize(cells: list[dict]) -> dict:
    """Rounds of one (engine, level): median tok/s, pooled percentiles."""
    pool = lambda key: [x for c in cells for x in c[key]]  # noqa: E731
    ttft, itl, dec, e2e = pool("ttft"), pool("itl"), pool("decode_per_request"), pool("e2e_per_request")
    return dict(tokens_per_s=statistics.median(c["tokens_per_s"] for c in cells),
                rounds=[c["tokens_per_s"] for c in cells], tokens=[c["tokens"] for c in cells],
                ttft_p50=percentile(ttft, .5), ttft_p99=percentile(ttft, .99),
                itl_p50=percentile(itl, .5), itl_p99=percentile(itl, .99),
                decode_tok_s=statistics.median(dec) if dec else None, e2e_tok_s=statistics.median(e2e),
                chunks=sum(c["chunks"] for c in cells), short=[c["short"] for c in cells if c["short"]])


def run(args, log=print) -> dict:
    import torch

    from bench import real_text_tokens
    from gpt2mha import GPT2, GPT2Config
    from gpt2mha import kernels

    torch.set_num_threads(args.threads)
    t_start = time.time()
    if not kernels.available() and not args.allow_fallback:
        raise SystemExit("gpt2mha's C++ kernels are not loaded in this process (offline generate would not take the "
                         "native forward): rebuild them (pip install -e .) or pass --allow-fallback")
    res = dict(benchmark="serve_peers",
               description=f"gpt2mha serve (int4 per_block head4 g64, int8 per_row; GPTQ) against llama-server "
                           f"(q4_0, q8_0) on random GPT-2 124M weights, {args.threads} threads and {args.slots} slots "
                           f"each; streamed greedy {args.tokens}-token requests ({args.prompt_chars[0]}-"
                           f"{args.prompt_chars[1]}-character prompts) from {', '.join(map(str, args.levels))} "
                           f"concurrent clients, round-robin over {args.rounds} round(s); output tok/s, TTFT and "
                           "inter-token latency, offline generate and the scheduler alone, top-1 agreement",
               source="measured by this run of benchmarks/serve_peers.py",
               date=time.strftime("%Y-%m-%d %H:%M %Z"), machine=machine(), uptime_start=uptime(),
               args={k: v for k, v in vars(args).items()}, command=" ".join([os.path.basename(sys.executable)]
                                                                             + sys.argv))
    import gpt2mha
    src = os.path.dirname(os.path.abspath(gpt2mha.__file__))
    commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no", "."],
                           capture_output=True, text=True)
    res["gpt2mha"] = dict(path=src, commit=commit.stdout.strip() or "?", edited=bool(dirty.stdout.strip()))
    log(f"gpt2mha from {src} at {res['gpt2mha']['commit']}{' (edited)' if res['gpt2mha']['edited'] else ''}")
    log(f"load before: {res['uptime_start']}")
    llama = args.llama_server is not None and not args.skip_llama
    prep = prepare(args.workdir, args.llama_quantize if llama else None, args.threads, log)
    paths = prep["paths"]
    res["prepare_s"] = prep["timings"]
    res["sizes_mb"] = {k: dir_mb(v) for k, v in paths.items() if k != "hf"}
    if llama:
        res["llama_version"] = llama_version(args.llama_server)

    cfg = GPT2Config.from_preset("124M")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"gpt2mha int4": GPT2.from_pretrained(paths["int4"]), "gpt2mha int8": GPT2.from_pretrained(paths["int8"])}
    log_dir = os.path.join(args.workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)

    engines: list[Engine] = []
    stack = contextlib.ExitStack()
    with stack:
        for name, key in (("gpt2mha int4", "int4"), ("gpt2mha int8", "int8")):
            s = GptServer(paths[key], max_batch=args.slots, threads=args.threads,
                          log_path=os.path.join(log_dir, f"{key}.log"))
            stack.callback(s.stop)
            engines.append(Engine(name, s, model_dir=paths[key]))
        if llama:
            for kind in ("q4_0", "q8_0"):
                s = LlamaServer(args.llama_server, paths[kind], args.threads, args.slots, 1024,
                                os.path.join(log_dir, f"llama-{kind}.log"), tuple(args.llama_arg))
                stack.callback(s.stop)
                engines.append(Engine(f"llama.cpp {kind}", s))
            res["llama_cmd"] = " ".join(os.path.basename(x) if i == 0 else x for i, x in enumerate(engines[-1].server.cmd))
        log("servers up: " + ", ".join(f"{e.name} ({e.url})" for e in engines))
        res["routes"] = {}
        for e in engines:                              # gpt2mha serve logs its route at start
            if e.model_dir:
                with open(os.path.join(log_dir, f"{e.name.split()[-1]}.log")) as f:
                    route = next((line.split("route:", 1)[1].strip() for line in f if "route:" in line), "?")
                res["routes"][e.name] = route
                log(f"  {e.name} route: {route}")
                if "the native forward" not in route.split(";")[0] and not args.allow_fallback:
                    raise RuntimeError(f"{e.name} does not decode on the native forward ({route}); "
                                       "rebuild the kernels (pip install -e .) or pass --allow-fallback")

        # ---- quality (before the timed rounds; every server idle but the one asked)
        held = real_text_tokens(cfg, args.agree_tokens, os.path.join(HERE, "..", "data", "tinyshakespeare.txt"),
                                tail=True)
        ref = GPT2.from_pretrained(paths["hf"])
        with torch.inference_mode():
            ref_argmax = ref(held[None]).logits[0].argmax(-1)
        del ref
        quality = {name: top1_gpt2mha(ref_argmax, m, held) for name, m in models.items()}
        for e in engines:
            if e.name.startswith("llama"):
                t0 = time.perf_counter()
                quality[e.name] = top1_llama(e.url, held.tolist(), ref_argmax.tolist())
                log(f"  top-1 {e.name}: {time.perf_counter() - t0:.1f} s")
        res["top1"] = quality
        del models
        work = Worker({"gpt2mha int4": paths["int4"], "gpt2mha int8": paths["int8"]}, args.threads,
                      os.path.join(log_dir, "worker.log"))
        stack.callback(work.stop)
        models = ("gpt2mha int4", "gpt2mha int8")
        log("top-1 agreement with float32 (%d held-out tokens): " % len(held)
            + ", ".join(f"{k} {100 * v:.2f}%" for k, v in quality.items()))

        # ---- warm-up: every engine, one request alone and a full batch of short ones
        warm = prompts_from_text(args.slots + 1, 99, 60, 160)
        for e in engines:
            asyncio.run(run_cell(e.url, [{"prompt": warm[0], "max_tokens": args.tokens, "temperature": 0, **e.extra}], 1))
            asyncio.run(run_cell(e.url, [{"prompt": p, "max_tokens": 16, "temperature": 0, **e.extra}
                                         for p in warm[1:]], args.slots))
        for name in models:                            # the worker too: offline and the scheduler alone
            for op in ("offline", "offline_thread"):
                work(op=op, engine=name, prompts=warm[:1], tokens=16)
            if args.breakdown:
                for c in (1, args.slots):
                    work(op="sched", engine=name, prompts=warm[:c], tokens=16, clients=c)
        log(f"warmed up; load {uptime()}")

        # ---- the rounds
        cells = {(e.name, c): [] for e in engines for c in args.levels}
        offline = {name: [] for name in models}
        offline_thread = {name: [] for name in models}
        whole = {name: [] for name in models}           # served, one client, answers not streamed: e2e tok/s
        sched = {(name, c): [] for name in models for c in args.levels}
        text_checks = {name: [0, 0] for name in models}
        for rnd in range(args.rounds):
            order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
            for c in args.levels:
                n_req = args.requests[c]
                prompts = prompts_from_text(n_req, 1000 * rnd + c, *args.prompt_chars)
                line = []
                for e in order:
                    time.sleep(args.settle)
                    results, wall = asyncio.run(run_cell(
                        e.url, [{"prompt": p, "max_tokens": args.tokens, "temperature": 0, **e.extra} for p in prompts], c))
                    fig = cell_figures(results, wall)
                    fig["texts"] = [r["text"] for r in results]
                    cells[(e.name, c)].append(fig)
                    line.append(f"{e.name} {fig['tokens_per_s']:.1f}")
                    if c == 1 and e.name in models:
                        time.sleep(args.settle)
                        off = work(op="offline", engine=e.name, prompts=prompts, tokens=args.tokens)
                        offline[e.name].append(off)
                        same = sum(a == b for a, b in zip(off["texts"], fig["texts"]))
                        text_checks[e.name][0] += same
                        text_checks[e.name][1] += len(prompts)
                        time.sleep(args.settle)
                        off_t = work(op="offline_thread", engine=e.name, prompts=prompts, tokens=args.tokens)
                        offline_thread[e.name].append(off_t)
                        time.sleep(args.settle)
                        got, _ = asyncio.run(run_cell(e.url, [{"prompt": p, "max_tokens": args.tokens, "temperature": 0}
                                                              for p in prompts], 1, one=whole_one))
                        whole[e.name].append([r["tokens"] / (r["t_end"] - r["t0"]) for r in got])
                        text_checks[e.name][0] += sum(a == r["text"] for a, r in zip(off["texts"], got))
                        text_checks[e.name][1] += len(prompts)
                        line.append(f"offline {statistics.median(off['e2e']):.1f} (in a thread "
                                    f"{statistics.median(off_t['e2e']):.1f}); served whole "
                                    f"{statistics.median(whole[e.name][-1]):.1f}")
                    if args.breakdown and e.name in models:
                        time.sleep(args.settle)
                        s = work(op="sched", engine=e.name, prompts=prompts, tokens=args.tokens, clients=c)
                        sched[(e.name, c)].append(s)
                        line.append(f"sched-alone {s['tokens_per_s']:.1f}")
                log(f"round {rnd + 1}, {c} client(s): " + "; ".join(line) + f"  [{os.getloadavg()[0]:.2f}]")

        res["uptime_end"] = uptime()
        log(f"load after: {res['uptime_end']}")
        rows = {}
        for e in engines:
            for c in args.levels:
                rows[f"{e.name}|{c}"] = summarize(cells[(e.name, c)])
        res["rows"] = rows
        res["rounds_raw"] = {f"{k[0]}|{k[1]}": [{kk: vv for kk, vv in f.items() if kk not in ("ttft", "itl", "texts",
                                                                                           "decode_per_request",
                                                                                           "e2e_per_request")}
                                                for f in v] for k, v in cells.items()}
        res["offline"] = {}
        for name, offs in offline.items():
            served = rows[f"{name}|1"]
            off_e2e = statistics.median(x for o in offs for x in o["e2e"])
            off_dec = statistics.median(x for o in offs for x in o["decode"])
            thr = offline_thread[name]
            res["offline"][name] = dict(offline_e2e=off_e2e, offline_decode=off_dec, served_e2e=served["e2e_tok_s"],
                                        thread_e2e=statistics.median(x for o in thr for x in o["e2e"]),
                                        thread_decode=statistics.median(x for o in thr for x in o["decode"]),
                                        rounds_thread_e2e=[statistics.median(o["e2e"]) for o in thr],
                                        served_decode=served["decode_tok_s"],
                                        whole_e2e=statistics.median(x for r in whole[name] for x in r),
                                        rounds_whole_e2e=[statistics.median(r) for r in whole[name]],
                                        rounds_offline_e2e=[statistics.median(o["e2e"]) for o in offs],
                                        rounds_offline_decode=[statistics.median(o["decode"]) for o in offs],
                                        same_text=text_checks[name])
        res["scheduler_alone"] = {f"{k[0]}|{k[1]}": dict(tokens_per_s=statistics.median(x["tokens_per_s"] for x in v),
                                                        rounds=[x["tokens_per_s"] for x in v])
                                  for k, v in sched.items() if v}
    res["seconds"] = time.time() - t_start
    return res


# ============================================================================ the report
def fmt_ms(x):
    return "-" if x is None else f"{1000 * x:.1f}"


def format_report(res: dict) -> str:
    m = res["machine"]
    out = [f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, Python {m['python']}; "
           f"{res['args']['threads']} threads per engine; {res.get('llama_version', 'no llama-server')}",
           f"date: {res['date']}; load before: {res['uptime_start']}; after: {res.get('uptime_end')}",
           f"gpt2mha: {res['gpt2mha']['path']} at {res['gpt2mha']['commit']}"
           f"{' with uncommitted edits' if res['gpt2mha']['edited'] else ''}",
           f"command: {res['command']}"]
    if res.get("llama_cmd"):
        out.append(f"llama-server: {res['llama_cmd']}")
    out.append("")
    out.append("| clients | engine | output tok/s (median) | every round | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
               "ITL p99 ms | decode tok/s per request (median) | top-1 = float32 |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    rows = res["rows"]
    names = sorted({k.split("|")[0] for k in rows}, key=lambda n: ("llama" in n, n))
    levels = sorted({int(k.split("|")[1]) for k in rows})
    for c in levels:
        for n in names:
            r = rows[f"{n}|{c}"]
            out.append(f"| {c} | {n} | {r['tokens_per_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['rounds'])} | "
                       f"{fmt_ms(r['ttft_p50'])} | {fmt_ms(r['ttft_p99'])} | {fmt_ms(r['itl_p50'])} | "
                       f"{fmt_ms(r['itl_p99'])} | {r['decode_tok_s']:.1f} | {100 * res['top1'][n]:.2f}% |")
    ratio_lines = []
    for a, b in PAIRS:
        if f"{b}|1" not in rows:
            continue
        for c in levels:
            ra, rb = rows[f"{a}|{c}"], rows[f"{b}|{c}"]
            per_round = [x / y for x, y in zip(ra["rounds"], rb["rounds"])]
            ratio_lines.append(
                f"| {c} | {a} / {b} | {ra['tokens_per_s'] / rb['tokens_per_s']:.2f}x | "
                f"{', '.join(f'{x:.2f}' for x in per_round)} | {ra['ttft_p50'] / rb['ttft_p50']:.2f} | "
                f"{ra['ttft_p99'] / rb['ttft_p99']:.2f} | {ra['itl_p50'] / rb['itl_p50']:.2f} | "
                f"{ra['itl_p99'] / rb['itl_p99']:.2f} | {ra['decode_tok_s'] / rb['decode_tok_s']:.2f}x | "
                f"{100 * (res['top1'][a] - res['top1'][b]):+.2f} pt |")
    if ratio_lines:
        out += ["", "Ratios gpt2mha / llama-server (tok/s: higher is better for gpt2mha; TTFT and ITL: lower is "
                    "better for gpt2mha):", "",
                "| clients | pair | output tok/s | every round | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
                "decode tok/s | top-1 |", "|---|---|---|---|---|---|---|---|---|---|"] + ratio_lines
    out += ["", "Offline generate against served, one client (batch 1, greedy, same saved model, same route; offline "
                "in a process of its own with the same threads, in its main thread as `gpt2mha generate`, and in a "
                "thread of its own as the server's scheduler runs the model):", "",
            "| engine | offline tok/s (end to end) | in a thread | served tok/s (end to end) | served / offline | "
            "served / in a thread | offline decode tok/s | in a thread | served decode tok/s | served / offline | "
            "served / in a thread | served text = offline (streamed and whole) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, o in res["offline"].items():
        out.append(f"| {n} | {o['offline_e2e']:.1f} | {o['thread_e2e']:.1f} | {o['served_e2e']:.1f} | "
                   f"{o['served_e2e'] / o['offline_e2e']:.2f} | {o['served_e2e'] / o['thread_e2e']:.2f} | "
                   f"{o['offline_decode']:.1f} | {o['thread_decode']:.1f} | {o['served_decode']:.1f} | "
                   f"{o['served_decode'] / o['offline_decode']:.2f} | {o['served_decode'] / o['thread_decode']:.2f} | "
                   f"{o['same_text'][0]}/{o['same_text'][1]} |")
        out.append(f"|  | rounds: {', '.join(f'{x:.1f}' for x in o['rounds_offline_e2e'])} | "
                   f"{', '.join(f'{x:.1f}' for x in o['rounds_thread_e2e'])} |  |  |  | "
                   f"{', '.join(f'{x:.1f}' for x in o['rounds_offline_decode'])} |  |  |  |  |  |")
    if any("whole_e2e" in o for o in res["offline"].values()):
        out += ["", "The same requests served as whole answers (not streamed: the event loop wakes once a request, "
                "not once a token), one client, end to end:", "",
                "| engine | served whole tok/s | every round | / offline | / in a thread |", "|---|---|---|---|---|"]
        for n, o in res["offline"].items():
            out.append(f"| {n} | {o['whole_e2e']:.1f} | {', '.join(f'{x:.1f}' for x in o['rounds_whole_e2e'])} | "
                       f"{o['whole_e2e'] / o['offline_e2e']:.2f} | {o['whole_e2e'] / o['thread_e2e']:.2f} |")
    if res.get("scheduler_alone"):
        out += ["", "The scheduler alone in the worker process (no HTTP), the same requests; served / alone:", "",
                "| clients | engine | scheduler alone tok/s (a thread of the worker) | every round | served tok/s | "
                "served / alone |",
                "|---|---|---|---|---|---|"]
        for k, s in res["scheduler_alone"].items():
            served = rows[k]["tokens_per_s"]
            n, c = k.split("|")
            out.append(f"| {c} | {n} | {s['tokens_per_s']:.1f} | {', '.join(f'{x:.1f}' for x in s['rounds'])} | "
                       f"{served:.1f} | {served / s['tokens_per_s']:.2f} |")
    shorts = {k: v["short"] for k, v in rows.items() if v["short"]}
    if shorts:
        out.append(f"\nrequests that ended before max_tokens (tokens): {shorts}")
    out.append("\nsizes (MB): " + ", ".join(f"{k} {v:.1f}" for k, v in res["sizes_mb"].items()))
    if res["prepare_s"]:
        out.append("prepared: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["prepare_s"].items()))
    out.append(f"run: {res['seconds'] / 60:.1f} min")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary")
    ap.add_argument("--llama-quantize", default=None, metavar="PATH", help="llama.cpp's llama-quantize binary")
    ap.add_argument("--llama-build", default=None, metavar="DIR",
                    help="a llama.cpp cmake build directory (its bin/llama-server and bin/llama-quantize)")
    ap.add_argument("--skip-llama", action="store_true", help="gpt2mha's side only")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over levels and engines (default 3)")
    ap.add_argument("--quick", action="store_true", help="1 round, 32 tokens, fewer requests (a smoke test)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine (default 2)")
    ap.add_argument("--slots", type=int, default=16, help="gpt2mha --max-batch and llama-server -np (default 16)")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), metavar="C,C",
                    help="concurrent clients of each cell (default %(default)s; each level sends 2 requests a client, "
                         "3 at one client)")
    ap.add_argument("--prompt-chars", default="60,160", metavar="MIN,MAX",
                    help="prompt lengths in characters of Tiny Shakespeare, drawn uniformly (default 60,160; "
                         "128,2048 gives GPT-2 BPE prompts of about 32 to 512 tokens)")
    ap.add_argument("--agree-tokens", type=int, default=256, help="held-out tokens for top-1 agreement (default 256)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of sleep before each timed cell (default 1)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="one more llama-server argument (repeat the flag for each, e.g. --llama-arg=--poll "
                         "--llama-arg=0)")
    ap.add_argument("--allow-fallback", action="store_true",
                    help="run even when gpt2mha's kernels are not loaded (a slower route: not the figure to report)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the scheduler-alone cells")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpt2mha-serve-peers"),
                    help="where the models are written once and reused, and the servers' logs")
    ap.add_argument("--json", default=None, help="result file (default benchmarks/results/serve_peers-<date>.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker), args.threads)
    if args.llama_build:
        args.llama_server = args.llama_server or os.path.join(args.llama_build, "bin", "llama-server")
        args.llama_quantize = args.llama_quantize or os.path.join(args.llama_build, "bin", "llama-quantize")
    if args.llama_server and not args.skip_llama:
        for p in (args.llama_server, args.llama_quantize):
            if not p or not os.access(p, os.X_OK):
                ap.error(f"not an executable: {p!r} (give --llama-server and --llama-quantize, or --llama-build)")
    try:
        args.levels = tuple(int(c) for c in args.levels.split(","))
        args.prompt_chars = tuple(int(c) for c in args.prompt_chars.split(","))
    except ValueError:
        ap.error(f"--levels {args.levels!r} and --prompt-chars {args.prompt_chars!r} must be comma-separated integers")
    if min(args.levels) < 1 or len(args.prompt_chars) != 2 or not 0 < args.prompt_chars[0] <= args.prompt_chars[1]:
        ap.error(f"--levels {args.levels!r}: clients >= 1; --prompt-chars {args.prompt_chars!r}: MIN,MAX with 0 < MIN <= MAX")
    args.requests = {c: 3 if c == 1 else 2 * c for c in args.levels}
    if args.quick:
        args.rounds, args.tokens, args.agree_tokens = 1, 32, 48
        args.requests = {c: c for c in args.levels}

    def on_signal(signum, frame):                       # SIGTERM: unwind, so every server is stopped
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)

    res = run(args)
    report = format_report(res)
    print("\n" + report)
    path = args.json or os.path.join(HERE, "results", f"serve_peers-{time.strftime('%Y-%m-%d-%H%M')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**res, "report": report}, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
