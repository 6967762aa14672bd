"""Ray Serve's gain and cost for gpt2mha's server (issue 63): ``gpt2mha serve --ray`` against one
``gpt2mha serve`` on the int8 per_row 124M model (random GPT-2 124M weights, GPTQ: the directory
``benchmarks/serve_peers.py`` writes and reuses). An extra, never run in CI:

    python benchmarks/serve_ray.py [--rounds 3] [--quick]

The contenders, each ``gpt2mha serve`` as a subprocess on a free port of 127.0.0.1 (``--max-batch
16``; the Ray ones start a local Ray of their own), started one at a time so that none shares the
cores with another, and stopped with SIGTERM (the Ray ones drain and stop their Ray):

* ``serve 1x2``: one server, ``--threads 2``;
* ``ray 2x1``: ``--ray --replicas 2 --threads-per-replica 1``: the same two cores as two replicas
  of one thread behind Ray Serve's proxy (throughput at 16 clients against ``serve 1x2``);
* ``serve 1x1`` and ``ray 1x1``: one server of ``--threads 1``, and one replica of one thread
  behind Ray's proxy: at 1 client, their difference is what Ray adds (time to first token,
  inter-token latency); at 16 clients, ``ray 2x1`` against ``serve 1x1`` is what a second
  replica adds. One thread each: on a machine whose cores other work also takes, a team of two
  OpenMP threads waits at every barrier of a step for the one that was descheduled, and its
  figures measure that rather than Ray (``serve 1x2`` against ``serve 1x1`` at 1 client shows how much).

Each round starts every contender in turn (the order rotated each round), warms it up (one
request alone, then 16 short ones at once), and measures streamed greedy completions of
``--tokens`` tokens on prompts of 60-160 characters of Tiny Shakespeare (the same prompts for every
contender within a round) from 1 client (``--requests1`` requests, one after another) and from 16
clients (``--requests16``), with ``serve_peers.py``'s lean client (``sse_client.py``: a thread and a
keep-alive connection per client). Per cell: output tok/s (completion tokens / wall time), TTFT
(request sent to first chunk with text) and inter-token latency (every gap between successive text
chunks, pooled over the rounds); the table gives the median tok/s over rounds and the pooled
percentiles. Ratios and differences are paired within a round (the machine's other load changes
from round to round), then their median taken. The texts at 1 client are compared across
contenders (one engine, one route: they must be equal).

Writes ``benchmarks/results/serve_ray.json`` (``--json`` to change) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serve_load import Server, free_port, percentile, prompts_from_text, uptime  # noqa: E402
from serve_peers import cell_figures, machine, run_cell, summarize  # noqa: E402
from serve_peers_servers import prepare  # noqa: E402

CONTENDERS = {
    "serve 1x2": dict(threads=2, extra=()),
    "ray 2x1": dict(threads=None, extra=("--ray", "--replicas", "2", "--threads-per-replica", "1")),
    "serve 1x1": dict(threads=1, extra=()),
    "ray 1x1": dict(threads=None, extra=("--ray", "--replicas", "1", "--threads-per-replica", "1")),
}
#: Seconds a Ray contender may take from its start to all its replicas running.
RAY_START_S = 300.0


class RayServer(Server):
    """``gpt2mha serve --ray`` as a subprocess on a free port of 127.0.0.1, up once every replica
    runs (the command says so once ``serve.run`` returned); stopped as :class:`serve_load.Server`
    is (SIGTERM: the replicas drain, then the command stops its Ray)."""

    def __init__(self, model: str, log_path: str, extra: tuple[str, ...], timeout: float = RAY_START_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpt2mha", "serve", "--port", str(self.port),
                                      "--max-batch", "16", "--model", model, *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while "gpt2mha on Ray Serve at" not in open(log_path, encoding="utf-8", errors="replace").read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gpt2mha serve --ray did not start (exit {self.proc.poll()}); see {log_path}")
            time.sleep(0.5)


def start(name: str, model_dir: str, log_path: str) -> Server:
    """Contender ``name`` serving ``model_dir``, up."""
    spec = CONTENDERS[name]
    if "--ray" in spec["extra"]:
        return RayServer(model_dir, log_path, spec["extra"])
    return Server(model_dir, max_batch=16, threads=spec["threads"], log_path=log_path, extra=spec["extra"])


def cell(url: str, prompts: list[str], clients: int, tokens: int) -> dict:
    results, wall = asyncio.run(run_cell(url, [{"prompt": p, "max_tokens": tokens, "temperature": 0} for p in prompts],
                                         clients))
    fig = cell_figures(results, wall)
    fig["texts"] = [r["text"] for r in results]
    return fig


def run(args, log=print) -> dict:
    t_start = time.time()
    res = dict(benchmark="serve_ray",
               description="gpt2mha serve --ray (Ray Serve) against one gpt2mha serve on the int8 per_row 124M model "
                           "(random weights, GPTQ), --max-batch 16: throughput at 16 clients of 2 replicas x 1 thread "
                           "against one server of 2 threads (and of 1), and Ray's added latency at 1 client (1 replica "
                           "x 1 thread against one server of 1 thread); streamed greedy "
                           f"{args.tokens}-token requests, {args.rounds} round(s), every contender alone on the "
                           "machine in turn",
               note="measured on a 2-core machine shared with other work (other sessions' builds and tests ran "
                    "meanwhile: see the load averages); the ratios of one round's cells are steadier than the "
                    "absolute figures",
               source="measured by this run of benchmarks/serve_ray.py", date=time.strftime("%Y-%m-%d %H:%M %Z"),
               command=" ".join([os.path.basename(sys.executable), *sys.argv]),
               machine=machine(), uptime_start=uptime(), args=vars(args))
    try:
        import ray
        res["ray"] = ray.__version__
    except ImportError:
        raise SystemExit("Ray Serve is not installed: pip install 'gpt2mha[ray]'") from None
    paths = prepare(args.workdir, None, 2, log)["paths"]
    log_dir = os.path.join(args.workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    names = list(CONTENDERS)
    cells = {(n, c): [] for n in names for c in (1, 16)}
    texts: dict[str, list[list[str]]] = {n: [] for n in names}
    loads = []
    warm = prompts_from_text(17, 99, 60, 160)
    for rnd in range(args.rounds):
        p1 = prompts_from_text(args.requests1, 1000 * rnd + 1, 60, 160)
        p16 = prompts_from_text(args.requests16, 1000 * rnd + 16, 60, 160)
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            t0 = time.monotonic()
            server = start(name, paths["int8"], os.path.join(log_dir, f"ray-{name.replace(' ', '-')}.log"))
            try:
                log(f"round {rnd + 1}: {name} up in {time.monotonic() - t0:.0f} s")
                cell(server.url, warm[:1], 1, args.tokens)
                cell(server.url, warm[1:], 16, 16)
                time.sleep(args.settle)
                one = cell(server.url, p1, 1, args.tokens)
                time.sleep(args.settle)
                many = cell(server.url, p16, 16, args.tokens)
            finally:
                rc = server.stop()
            cells[(name, 1)].append(one)
            cells[(name, 16)].append(many)
            texts[name].append(one["texts"])
            loads.append(os.getloadavg()[0])
            log(f"  1 client: {one['tokens_per_s']:.1f} tok/s, TTFT p50 {1000 * percentile(one['ttft'], .5):.1f} ms, "
                f"ITL p50 {1000 * percentile(one['itl'], .5):.1f} ms; 16 clients: {many['tokens_per_s']:.1f} tok/s "
                f"(exit {rc}; load {loads[-1]:.2f})")
    rows = {f"{n}|{c}": summarize(cells[(n, c)]) for n in names for c in (1, 16)}
    for row in rows.values():
        row.pop("short", None)
    res["rows"] = rows
    res["rounds_tokens_per_s"] = {f"{n}|{c}": [f["tokens_per_s"] for f in cells[(n, c)]] for n in names for c in (1, 16)}
    res["rounds_latency_ms"] = {f"{n}|{c}": [latency_ms(f) for f in cells[(n, c)]] for n in names for c in (1, 16)}
    res["same_texts_at_1_client"] = all(texts[n] == texts[names[0]] for n in names)
    # paired within each round (the machine's other load changes from round to round): the ratio of
    # throughputs at 16 clients, and what Ray's proxy adds at 1 client
    tput = {n: [f["tokens_per_s"] for f in cells[(n, 16)]] for n in names}
    serve1, ray1 = res["rounds_latency_ms"]["serve 1x1|1"], res["rounds_latency_ms"]["ray 1x1|1"]
    added = {k: [r[k] - s[k] for r, s in zip(ray1, serve1)] for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}

    def paired(a, b):
        rounds = [x / y for x, y in zip(tput[a], tput[b])]
        return dict(median=statistics.median(rounds), rounds=rounds)
    res["summary"] = {"throughput_16_clients": {"ray 2x1 / serve 1x2": paired("ray 2x1", "serve 1x2"),
                                                "ray 2x1 / serve 1x1": paired("ray 2x1", "serve 1x1"),
                                                "ray 1x1 / serve 1x1": paired("ray 1x1", "serve 1x1")},
                      "ray_added_latency_1_client_ms": {k: dict(median=statistics.median(v), rounds=v)
                                                        for k, v in added.items()}}
    res["load_averages"] = loads
    res["uptime_end"] = uptime()
    res["seconds"] = time.time() - t_start
    return res


def latency_ms(fig: dict) -> dict:
    """One cell's TTFT and inter-token latency percentiles, in ms."""
    return {f"{name}_{q}": 1000 * percentile(fig[name], p) for name in ("ttft", "itl") for q, p in (("p50", .5), ("p99", .99))}


def format_report(res: dict) -> str:
    out = [f"{res['description']}", f"machine: {res['machine']}; ray {res['ray']}; {res['note']}",
           f"{'contender':<10} {'clients':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
           f"{'ITL p99':>8}  tok/s of every round"]
    for key, r in res["rows"].items():
        name, clients = key.split("|")
        out.append(f"{name:<10} {clients:>7} {r['tokens_per_s']:>7.1f} {1000 * r['ttft_p50']:>7.1f}ms "
                   f"{1000 * r['ttft_p99']:>7.1f}ms {1000 * r['itl_p50']:>6.1f}ms {1000 * r['itl_p99']:>6.1f}ms  "
                   f"{', '.join(f'{x:.1f}' for x in res['rounds_tokens_per_s'][key])}")
    s = res["summary"]
    for name, t in s["throughput_16_clients"].items():
        out.append(f"16 clients, {name}, paired by round: median {t['median']:.2f}x "
                   f"(rounds {', '.join(f'{x:.2f}' for x in t['rounds'])})")
    out.append("Ray's added latency at 1 client (ray 1x1 - serve 1x1), paired by round, median (rounds): " + "; ".join(
        f"{k} {v['median']:+.1f} ms ({', '.join(f'{x:+.1f}' for x in v['rounds'])})"
        for k, v in s["ray_added_latency_1_client_ms"].items()))
    out.append(f"texts at 1 client equal across contenders: {res['same_texts_at_1_client']}; "
               f"run: {res['seconds'] / 60:.1f} min; load averages {', '.join(f'{x:.2f}' for x in res['load_averages'])}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the contenders (default 3)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    ap.add_argument("--requests1", type=int, default=8, help="requests of the 1-client cell (default 8)")
    ap.add_argument("--requests16", type=int, default=64, help="requests of the 16-client cell (default 64)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of sleep before each timed cell (default 2)")
    ap.add_argument("--quick", action="store_true", help="1 round, 32 tokens, fewer requests (a smoke test)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpt2mha-serve-peers"),
                    help="where serve_peers.py writes its models (reused) and the servers' logs")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "serve_ray.json"), help="result file")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.requests1, args.requests16 = 1, 32, 2, 16
    res = run(args)
    report = format_report(res)
    print("\n" + report)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({**res, "report": report}, f, indent=1, default=str)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
