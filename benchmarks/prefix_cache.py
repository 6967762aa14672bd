"""Exact prefix caching: does a suffix prefilled against cached keys give the bits of a whole
prompt on each route (``survey``), and how much sooner the second request of a chat with a long
system prompt reaches its first token (``ttft``).

    python benchmarks/prefix_cache.py survey [--threads 1] [--json FILE]
    python benchmarks/prefix_cache.py ttft [--system 500 --turns 6 --threads 2] [--json FILE]
    python benchmarks/prefix_cache.py lmeval [--items 12 --context 400 --threads 2] [--json FILE]

``survey``: a random 2-layer model (n_ctx 512, width 64) per dtype and weight format, on the route
``generate`` takes and on the decode view; for 40 random (prefix, suffix) splits of a 510-token
prompt (suffix 2 … 64 tokens) and every 16-token prefix with a one-token suffix, the prompt
prefilled whole against prefix-then-suffix in one row: the suffix's last logits, 2 decode steps
after and the whole row of keys and values compared with ``torch.equal``.
``ttft``: a live server (``serve_in_thread``, 127.0.0.1) on a random 124M-shaped float32 model
with the byte tokenizer (n_ctx 1024): a chat whose system prompt is ``--system`` bytes (one
token a byte) and turns of a short user message each, streamed; the time from sending each
request to its first content chunk, with the prefix cache (default budget) and without (0),
and the hit rate from ``/metrics``. ``lmeval``: lm-evaluation-harness itself (``local-completions``, its loglikelihood requests: each
choice's context and continuation with ``echo``, ``logprobs=1``, ``max_tokens=1``, one at a time)
on a local multiple-choice task whose 4 choices of each item share a ``--context``-token passage of
Tiny Shakespeare (GPT-2 BPE; the context ends a few words into the next line, the answer is its
next word against 3 words drawn from the text), against ``gpt2mha serve`` (a subprocess on a free
port of 127.0.0.1) on a random 124M-shaped float32 model with GPT-2's tokenizer, with the prefix
cache (``--prefix-cache-mb``) and with ``--no-prefix-cache``: lm_eval's wall time, the time its
requests spent in the server (``e2e_request_latency_seconds_sum``), the server's CPU seconds
while lm_eval ran (``process_cpu_seconds_total``: less sensitive than wall time to what else runs
on the machine), the hit rate from ``/metrics``; the two runs' accuracies and every per-choice loglikelihood must be identical
(exit 1 otherwise). ``--json FILE`` adds the run (date, host, command, figures)
under its subcommand's key to FILE (benchmarks/results/prefix_cache.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from gpt2mha import GPT2, GPT2Config  # noqa: E402
from gpt2mha.inference.decoders import Route, ViewDecoder, choose_decoder  # noqa: E402
from gpt2mha.inference.engine import Engine  # noqa: E402
from gpt2mha.inference.params import SamplingParams  # noqa: E402

ROUTES = [("float32", torch.float32, "float", None), ("bf16", torch.bfloat16, "float", None),
          ("fp16", torch.float16, "float", None), ("int8 exact", torch.float32, "int8", "exact"),
          ("int8 per_row", torch.float32, "int8", "per_row"), ("int4 exact", torch.float32, "int4", "exact"),
          ("int4 per_block", torch.float32, "int4", "per_block"), ("bf16 int8", torch.bfloat16, "int8", None)]


def small(dtype, fmt, activations):
    from conftest import small_model
    m = small_model(3, n_vocab=256, n_ctx=512, n_embd=64, n_head=4, n_layer=2, noise="all", scale=0.05).to(dtype)
    if fmt != "float":
        kw = {"activations": activations} if activations else {}
        m.quantize(fmt, method="rtn", **({"group_size": 32} if fmt == "int4" else {}), **kw)
    return m


def pieces(engine, parts, steps=2):
    """Prefill ``parts`` one after another into slot 0, then greedy steps: the logits of the
    last prefill and of each step, and the row's keys and values."""
    engine.open(0, SamplingParams(max_tokens=steps + 1, temperature=0), 0)
    row, d = engine.cache.row(0), engine.decoder
    with torch.inference_mode():
        out = [d.prefill(torch.tensor([p]), row) for p in parts][-1:]
        engine.last[0] = int(out[-1].argmax())
        for _ in range(steps):
            logits, _ = engine.forward([0])
            out.append(logits[:1].clone())
            engine.last[0] = int(logits[0].argmax())
    n = engine.cache.lengths[0]
    kv = engine.cache.k[:, 0, :, :n].clone(), engine.cache.v[:, 0, :, :n].clone()
    engine.release(0)
    return out, kv


def survey(args):
    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, 256, (510,), generator=torch.Generator().manual_seed(0)).tolist()
    rnd = random.Random(1)
    splits = [(rnd.randint(1, 440), rnd.randint(2, 64)) for _ in range(40)]
    ones = [(p, 1) for p in range(16, 480, 16)]
    rows = []
    for name, dtype, fmt, act in ROUTES:
        model = small(dtype, fmt, act)
        for how in ("route", "view"):
            route = choose_decoder(model, batch_invariant=True) if how == "route" else Route(ViewDecoder(model, True), {})
            if how == "view" and route.decoder.name == choose_decoder(model, batch_invariant=True).decoder.name:
                continue
            engine = Engine(model, 1, route=route)
            counts = []
            for cases in (splits, ones):
                same = 0
                for p, s in cases:
                    whole, kv_w = pieces(engine, [prompt[:p + s]])
                    split, kv_s = pieces(engine, [prompt[:p], prompt[p:p + s]])
                    same += all(torch.equal(a, b) for a, b in zip(whole, split)) and \
                        all(torch.equal(a, b) for a, b in zip(kv_w, kv_s))
                counts.append(f"{same}/{len(cases)}")
            print(f"{name:15s} {route.decoder.name:15s} suffix 2-64: {counts[0]:6s} exact; suffix 1: {counts[1]} exact",
                  flush=True)
            rows.append({"model": name, "route": route.decoder.name, "suffix_2_to_64_exact": counts[0],
                         "suffix_1_exact": counts[1]})
    return {"threads": args.threads, "prompt_tokens": 510, "routes": rows}


def ttft(args):
    import httpx

    from gpt2mha.io.tokenizer import get_tokenizer
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import serve_in_thread

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=256, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)).eval()
    tok = get_tokenizer("bytes")
    text = "You are a careful assistant for a theatre company. Answer briefly and cite the act and scene. "
    system = (text * (args.system // len(text) + 1))[:args.system]
    results = {}
    for budget in (None, 0):
        sched = Scheduler(model, tok, max_batch=2, max_queue=4, prefix_cache_mb=budget)
        times = []
        with serve_in_thread(sched, "random-124M") as url:
            for turn in range(args.turns):
                body = {"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {turn}: who speaks first?"}],
                        "max_tokens": 4, "temperature": 0, "stream": True}
                t0 = time.perf_counter()
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                    lines = r.iter_lines()
                    for line in lines:
                        if line.startswith("data: ") and line != "data: [DONE]":
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            if delta.get("content"):
                                times.append(time.perf_counter() - t0)
                                break
                    for _ in lines:                         # the rest of the answer
                        pass
            metrics = httpx.get(url + "/metrics").text
        counters = {line.split("{")[0].removeprefix("gpt2mha:"): float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("gpt2mha:prefix_cache")}
        key = "cache" if budget is None else "no cache"
        results[key] = times
        hit = counters["prefix_cache_hits_total"] / max(1.0, counters["prefix_cache_queries_total"])
        if budget is None:
            hit_rate = hit
        print(f"{key:9s} ttft ms: {' '.join(f'{1000 * t:.1f}' for t in times)}; hit rate {hit:.3f} "
              f"({counters['prefix_cache_hits_total']:.0f} / {counters['prefix_cache_queries_total']:.0f} tokens)",
              flush=True)
    first, later = results["cache"][0], sorted(results["cache"][1:])[len(results["cache"][1:]) // 2]
    print(f"with the cache: first {1000 * first:.1f} ms, later turns' median {1000 * later:.1f} ms: "
          f"{first / later:.1f}x sooner")
    return {"threads": args.threads, "system_tokens": args.system, "model": "random 124M shape, float32, bytes",
            "ttft_ms": {k: [round(1000 * t, 1) for t in v] for k, v in results.items()},
            "second_turn_speedup": round(results["cache"][0] / results["cache"][1], 2),
            "hit_rate": round(hit_rate, 3)}


TASK = "gpt2mha_prefix_cache_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def mc_items(tok, n: int, context: int, seed: int = 0) -> list[dict]:
    """``n`` items over Tiny Shakespeare: a passage of whole lines of at least ``context`` GPT-2
    tokens, then the first words of the next line; the choices are that line's next word and 3
    other words of the text (shuffled)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    words = sorted({w for line in lines[:4000] for w in line.split() if w.isalpha() and len(w) > 2})
    rnd = random.Random(seed)
    items = []
    while len(items) < n:
        start = rnd.randrange(0, len(lines) - 400)
        end = start
        while len(tok.encode("\n".join(lines[start:end]))) < context:
            end += 1
        cue = lines[end].split()
        if len(cue) < 4 or not cue[2].isalpha():
            continue
        answer = cue[2]
        choices = [answer] + rnd.sample([w for w in words if w != answer], 3)
        rnd.shuffle(choices)
        items.append({"context": "\n".join(lines[start:end]) + "\n" + " ".join(cue[:2]), "choices": choices,
                      "label": choices.index(answer)})
    return items


def cpu_seconds(metrics: str) -> float:
    """The server process's CPU seconds (``process_cpu_seconds_total`` of its ``/metrics``)."""
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("process_cpu_seconds_total"))


def lmeval(args):
    import glob
    import subprocess
    import tempfile

    import httpx

    from gpt2mha.io.tokenizer import get_tokenizer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from serve_load import Server

    tok = get_tokenizer("gpt2")
    items = mc_items(tok, args.items, args.context)
    ctx_tokens = [len(tok.encode(item["context"])) for item in items]
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)).eval()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "random-124M")
        model.save_pretrained(model_dir)
        data = os.path.join(tmp, "items.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        with open(os.path.join(tmp, TASK + ".yaml"), "w") as f:
            f.write(TASK_YAML.format(task=TASK, data=data))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": os.path.join(tmp, "datasets"), "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1"}
        for key, extra in (("cache", ("--prefix-cache-mb", str(args.budget))), ("no cache", ("--no-prefix-cache",))):
            out = os.path.join(tmp, key.replace(" ", "-"))
            log = os.path.join(args.logs or tmp, key.replace(" ", "-") + ".log")
            load = os.getloadavg()[0]
            server = Server(model_dir, max_batch=4, log_path=log, threads=args.threads, extra=extra)
            try:
                cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                       f"model={model_dir},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={model_dir},max_length=1024", "--include_path", tmp, "--tasks", TASK,
                       "--output_path", out, "--log_samples"]
                cpu0 = cpu_seconds(httpx.get(server.url + "/metrics").text)
                t0 = time.perf_counter()
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                wall = time.perf_counter() - t0
                metrics = httpx.get(server.url + "/metrics").text
                cpu = cpu_seconds(metrics) - cpu0
            finally:
                rc = server.stop()
            if run.returncode != 0 or rc != 0:
                print(run.stderr[-3000:], open(log).read()[-3000:], file=sys.stderr)
                raise SystemExit(f"lm_eval exited {run.returncode}, the server {rc}")
            values = {}
            for line in metrics.splitlines():
                name = line.split("{")[0].split(" ")[0].removeprefix("gpt2mha:")
                if name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "e2e_request_latency_seconds_sum",
                            "e2e_request_latency_seconds_count"):
                    values[name] = float(line.split()[-1])
            (results,) = glob.glob(os.path.join(out, "*", "results_*.json"))
            (samples,) = glob.glob(os.path.join(out, "*", f"samples_{TASK}_*.jsonl"))
            with open(results) as f:
                res = json.load(f)["results"][TASK]
            with open(samples) as f:
                resps = {s["doc_id"]: s["resps"] for s in map(json.loads, f)}
            runs[key] = {"wall_s": wall, "serve_s": values["e2e_request_latency_seconds_sum"], "cpu_s": cpu,
                         "requests": values["e2e_request_latency_seconds_count"],
                         "queries": values["prefix_cache_queries_total"], "hits": values["prefix_cache_hits_total"],
                         "acc": res["acc,none"], "acc_norm": res["acc_norm,none"], "resps": resps, "load": load}
            print(f"{key:9s} lm_eval {wall:.1f} s, requests in the server {runs[key]['serve_s']:.1f} s, "
                  f"its CPU {cpu:.1f} s "
                  f"({runs[key]['requests']:.0f}); acc {res['acc,none']:.4f} acc_norm {res['acc_norm,none']:.4f}; "
                  f"hits {runs[key]['hits']:.0f} / {runs[key]['queries']:.0f} tokens; load before {load:.2f}", flush=True)
    same = runs["cache"]["resps"] == runs["no cache"]["resps"]
    c, n = runs["cache"], runs["no cache"]
    hit_rate = c["hits"] / c["queries"]
    print(f"with the cache: lm_eval {n['wall_s'] / c['wall_s']:.2f}x sooner end to end, its requests "
          f"{n['serve_s'] / c['serve_s']:.2f}x, the server's CPU {n['cpu_s'] / c['cpu_s']:.2f}x less; hit rate {hit_rate:.3f}; accuracies and every loglikelihood "
          f"{'identical' if same else 'DIFFER'}")
    if not same or c["acc"] != n["acc"] or c["acc_norm"] != n["acc_norm"]:
        raise SystemExit("the runs with and without the prefix cache differ")
    return {"threads": args.threads, "model": "random 124M shape, float32, GPT-2 BPE", "budget_mb": args.budget,
            "items": args.items, "choices": 4, "context_tokens": ctx_tokens,
            "wall_s": {k: round(v["wall_s"], 2) for k, v in runs.items()},
            "serve_s": {k: round(v["serve_s"], 2) for k, v in runs.items()},
            "server_cpu_s": {k: round(v["cpu_s"], 2) for k, v in runs.items()},
            "requests": int(c["requests"]), "queries": int(c["queries"]), "hits": int(c["hits"]),
            "hit_rate": round(hit_rate, 3), "acc": c["acc"], "acc_norm": c["acc_norm"],
            "identical_loglikelihoods": same,
            "load_average_before": {k: round(v["load"], 2) for k, v in runs.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("survey")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--json", help="add the run to this JSON file")
    t = sub.add_parser("ttft")
    t.add_argument("--system", type=int, default=500, help="system prompt tokens (bytes)")
    t.add_argument("--turns", type=int, default=6)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--json", help="add the run to this JSON file")
    e = sub.add_parser("lmeval")
    e.add_argument("--items", type=int, default=12, help="multiple-choice items (4 choices each)")
    e.add_argument("--context", type=int, default=400, help="tokens of each item's shared context (at least)")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--budget", type=float, default=1024, help="--prefix-cache-mb of the run with the cache")
    e.add_argument("--logs", help="keep the servers' logs in this directory (cache.log, no-cache.log)")
    e.add_argument("--json", help="add the run to this JSON file")
    args = p.parse_args()
    out = {"survey": survey, "ttft": ttft, "lmeval": lmeval}[args.cmd](args)
    if args.json:
        old = json.load(open(args.json)) if os.path.exists(args.json) else {}
        run = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "load_average": round(os.getloadavg()[0], 2), "torch": torch.__version__,
               "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:])}
        old.update(benchmark="prefix_cache", source="benchmarks/prefix_cache.py", date=run["date"],
                   command=" ; ".join(sorted({old.get("command", run["command"]), run["command"]})))
        old[args.cmd] = {**run, **out}
        with open(args.json, "w") as f:
            json.dump(old, f, indent=1)


if __name__ == "__main__":
    main()
