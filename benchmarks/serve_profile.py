"""Where a served token's time goes in ``gpt2mha serve``: ``python benchmarks/serve_profile.py MODEL_DIR
[--clients 1] [--seconds 25] [--threads 2]`` (needs ``pip install py-spy``; an extra, never in CI).

Starts ``gpt2mha serve --threads T --max-batch 16`` on MODEL_DIR (a free port of 127.0.0.1),
warms it up, then samples it with py-spy (``--native``, 200 Hz, active threads only, collapsed
stacks) while ``--clients`` clients send streamed greedy 128-token requests
(``serve_peers.stream_one``); stops the server. Prints the samples by what the innermost known
frame is (the native step, prefill, sampling, detokenizing, HTTP/SSE, the event loop, ...) and
by thread, as milliseconds of CPU per generated token, beside the wall milliseconds per token.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serve_load import Server, prompts_from_text  # noqa: E402
from serve_peers import run_cell  # noqa: E402

#: (category, substrings of a frame that put a sample in it): the first category any frame of the
#: stack matches, in this order (so a sample inside the native step counts there, whatever its leaf)
CATEGORIES = (
    ("native step (cached_forward)", ("cached_forward",)),
    ("prefill", ("prefill",)),
    ("sampling", ("sampling.py", "sample_rows")),
    ("detokenize / text stream", ("text_stream.py", "tokenizer")),
    ("scheduler bookkeeping (scheduler.py, engine.py, decoders.py)", ("scheduler.py", "engine.py", "decoders.py")),
    ("HTTP / SSE (uvicorn, starlette, h11, fastapi, completions.py)", ("uvicorn", "starlette", "h11", "fastapi",
                                                                      "completions.py", "protocol.py", "server.py")),
    ("asyncio event loop", ("asyncio",)),
)


def category(stack: str) -> str:
    frames = stack.split(";")
    for name, keys in CATEGORIES:
        if any(k in frame for frame in frames for k in keys):
            if name.startswith("native") and "libgomp" in frames[-1]:
                return "native step: in libgomp (barriers, waiting for the other OpenMP thread)"
            return name
    return "other"


def report(path: str, tokens: int, wall: float, rate: int = 200) -> None:
    by_cat, by_thread, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            n = int(n)
            total += n
            by_cat[category(stack)] += n
            by_thread[stack.split(";")[0][:60]] += n
    ms = lambda n: 1000 * n / rate / tokens  # noqa: E731
    print(f"{tokens} tokens in {wall:.1f} s of requests ({1000 * wall / tokens:.2f} ms wall per token, under py-spy)")
    print(f"CPU samples of the server's Python threads: {total} at {rate} Hz = {ms(total):.2f} ms CPU per token")
    for name, n in by_cat.most_common():
        print(f"  {name:72s} {100 * n / total:5.1f}%  {ms(n):6.2f} ms/token")
    print("by thread:")
    for name, n in by_thread.most_common(6):
        print(f"  {name:60s} {100 * n / total:5.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a gpt2mha model directory (e.g. one serve_peers.py wrote)")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--seconds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)

    server = Server(args.model, max_batch=16, threads=args.threads,
                    log_path=os.path.join(tempfile.gettempdir(), "gpt2mha-serve-profile.log"))
    out = os.path.join(tempfile.gettempdir(), f"gpt2mha-serve-profile-{server.port}.txt")
    try:
        body = lambda p: {"prompt": p, "max_tokens": args.tokens, "temperature": 0}  # noqa: E731
        asyncio.run(run_cell(server.url, [body(p) for p in prompts_from_text(2, 7, 60, 160)], 1))
        spy = subprocess.Popen(["py-spy", "record", "--native", "--threads", "-r", "200", "-d", str(int(args.seconds)),
                                "-f", "raw", "-o", out, "-p", str(server.proc.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        tokens, wall = 0, 0.0
        t_end = time.monotonic() + args.seconds - 2
        seed = 0
        while time.monotonic() < t_end:
            seed += 1
            results, w = asyncio.run(run_cell(server.url, [body(p) for p in prompts_from_text(
                args.clients, 100 + seed, 60, 160)], args.clients))
            tokens += sum(r["tokens"] for r in results)
            wall += w
        spy.wait(args.seconds + 60)
    finally:
        server.stop()
    print(f"{args.model}: {args.clients} client(s); raw stacks in {out}")
    report(out, tokens, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
