"""Decode and prefill speed of each engine alone in its own process:
``python benchmarks/peers_isolated.py --workdir DIR [--engines NAMES] [--threads 2] [--new 96] [--rounds N]``.

``benchmarks/peers.py`` times every contender in one process, in turns. There the engines'
thread pools (torch's OpenMP, CTranslate2's, ONNX Runtime's spinning workers, llama.cpp's)
compete with each other: on the 2-core AVX2 host transformers float32 decoded 16.0 tok/s in
that process and 21.4 alone, gpt2mha int8 compiled 55.4 and 95.7 (benchmarks/archive/RESULTS-2026-11-29-to-12-02.md,
"Peers, third run"). This script runs each engine in a fresh process of its own, one after
the other, on the files ``peers.py --workdir DIR`` converted (run that first), and prints
decode tokens/s at batch 1 and 8 (a 4-token random prompt, ``--new`` greedy tokens, a warm-up
call on the timed shapes, best of ``--repeats``; with ``--rounds N`` the whole list runs N times in
turn and each engine keeps its best), the time to the first token after a random prompt of
each ``--prefill`` length at batch 1 (ms, best of ``--repeats`` after a warm-up), and each as a
ratio to transformers float32 (higher is faster). ``--json FILE`` also writes the results in the
form ``benchmarks/plots.py`` draws (``benchmarks/results/peers.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = ("124M", "355M", "774M", "1558M")                       # GPT-2's four (GPT2Config.from_preset names)
ENGINES = ("transformers float32", "gpt2mha float32", "gpt2mha int8", "gpt2mha int8 compiled", "gpt2mha int8 per_row",
           "gpt2mha int8 per_row compiled", "gpt2mha int8 auto", "gpt2mha int8 auto compiled", "gpt2mha int4",
           "gpt2mha int4 compiled", "gpt2mha int4 per_block", "gpt2mha int4 per_block compiled",
           "gpt2mha int4 per_block head4", "gpt2mha int4 per_block head4 compiled",
           "gpt2mha int4 per_block head4 g64", "gpt2mha int4 per_block head4 g64 compiled",
           "llama.cpp q8_0", "llama.cpp q4_0", "ctranslate2 int8", "onnxruntime int8",
           "gpt2mha bf16", "gpt2mha fp16", "llama.cpp f32", "llama.cpp f32 kv-f16", "llama.cpp f16", "ctranslate2 float32",
           "openvino f32", "openvino f32 kv-f16", "openvino bf16", "openvino fp16", "openvino int8", "openvino int4")


def one(name: str, workdir: str, threads: int, new: int, repeats: int, prefill: tuple[int, ...] = (),
        size: str = "124M") -> dict:
    """Decode tok/s of engine ``name`` in this process, and its time to the first token after
    a prompt of each ``prefill`` length (batch 1), in ms, the precision of its KV cache and the
    bytes of weights its batch-1 step reads (``read_bytes``, as ``peers.py`` counts them), on the
    random GPT-2 of ``size`` under ``workdir`` (``random-<size>`` and ``random-<size>-engines``):
    ``{"kv_cache": "f32", "read_bytes": ..., "b1": ..., "b8": ..., "p128": ...}``."""
    import torch

    sys.path.insert(0, HERE)
    import peers
    from bench_common import step_bytes
    from peers_engines import dir_bytes, float_read_bytes, gguf_read_bytes, onnx_read_bytes

    from gpt2mha import GPT2

    torch.set_num_threads(threads)
    hf_dir = os.path.join(workdir, f"random-{size}")
    eng = os.path.join(workdir, f"random-{size}-engines")
    cfg = GPT2.from_pretrained(hf_dir).config
    if name.startswith("gpt2mha"):                             # never time the fallback as if it were gpt2mha's route
        from gpt2mha.inference.quant import gemv
        if not gemv.available():
            raise RuntimeError(f"{name}: gpt2mha's C++ kernels are not loaded ({gemv.unavailable_reason()}); "
                               "its figures would be the pure-torch fallback's")
    if name == "transformers float32":
        import transformers
        c = peers.Torch(name, transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="sdpa").eval(),
                        0, float_read_bytes(cfg), hf=True)
    elif name == "gpt2mha float32":
        c = peers.Torch(name, GPT2.from_pretrained(hf_dir), 0, float_read_bytes(cfg), hf=False)
    elif name in ("gpt2mha bf16", "gpt2mha fp16"):
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float16
        c = peers.Torch(name, GPT2.from_pretrained(hf_dir).to(dtype), 0, float_read_bytes(cfg, 2), hf=False)
    elif name.startswith("gpt2mha"):
        variant = "-".join(w for w in name.split() if w != "compiled")          # as peers.py saves it
        model = GPT2.from_pretrained(os.path.join(eng, variant))
        c = peers.Torch(name, model, 0, step_bytes(model), hf=False, compiled=name.endswith("compiled"))
    elif name.startswith("llama.cpp"):
        kind = name.split()[1]
        path = os.path.join(eng, f"model-{kind}.gguf")
        c = peers.LlamaCpp(name, path, cfg.n_ctx, threads, gguf_read_bytes(path),
                           "f16" if name.endswith("kv-f16") else peers.LLAMA_KV_CACHE.get(kind, "f16"))
    elif name.startswith("ctranslate2"):
        kind = name.split()[1]
        path = os.path.join(eng, f"ct2-{kind}")
        c = peers.CT2(name, path, kind, threads, dir_bytes(path) - cfg.n_ctx * cfg.n_embd * 4)
    elif name.startswith("openvino"):
        import peers_openvino
        fmt, hint, kv = peers_openvino.VARIANTS[name]
        path = os.path.join(eng, f"ov-{fmt}")
        c = peers_openvino.OpenVINO(name, path, hint, threads, 0, peers_openvino.ir_read_bytes(path, cfg), kv)
    elif name == "onnxruntime int8":
        path = os.path.join(eng, "model-int8.onnx")
        c = peers.ORT(name, path, cfg, threads, onnx_read_bytes(path))
    else:
        raise ValueError(f"unknown engine {name!r}; expected one of {ENGINES}")
    out = {"kv_cache": c.kv_cache, "read_bytes": c.read_bytes}
    for B in (1, 8):
        prompt = torch.randint(0, cfg.n_vocab, (B, 4), generator=torch.Generator().manual_seed(B)).numpy()
        c.greedy(prompt, new)                                  # warm-up (and a compiled step's compile)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            c.greedy(prompt, new)
            times.append(time.perf_counter() - t0)
        out[f"b{B}"] = B * new / min(times)
    for T in prefill:
        prompt = torch.randint(0, cfg.n_vocab, (1, T), generator=torch.Generator().manual_seed(T)).numpy()
        c.first_token(prompt)                                  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            c.first_token(prompt)
            times.append(time.perf_counter() - t0)
        out[f"p{T}"] = min(times) * 1e3
    return out


DESCRIPTION = ("Decode tokens/s (batch 1 and 8, a 4-token random prompt, greedy) and time to the first token after "
               "each prompt length (batch 1), each engine alone in a fresh process, random GPT-2 124M weights "
               "converted for each engine; each engine's best over the rounds")


def write_json(path: str, res: dict, args, argv) -> None:
    """The run as ``benchmarks/results/peers.json`` holds it: what, where, when, how, and each
    engine's best figures (``b1``/``b8`` tok/s, ``p<T>`` ms)."""
    import torch

    from bench_common import cpu_name

    cpu = cpu_name()
    out = {"benchmark": "peers_isolated", "description": DESCRIPTION,
           "date": time.strftime("%Y-%m-%d"), "host": f"{cpu}, {os.cpu_count()} CPUs",
           "machine": f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}",
           "software": f"torch {torch.__version__}, Python {platform.python_version()}; {args.threads} threads per engine",
           "command": "python benchmarks/peers_isolated.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "source": "written by benchmarks/peers_isolated.py --json", "reference": "transformers float32",
           "units": {"b1": "tok/s", "b8": "tok/s", **{f"p{T}": "ms" for T in args.prefill_lengths}},
           "engines": {name: r for name, r in res.items() if r is not None}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def run_engines(names, workdir: str, threads: int, new: int, repeats: int, prefill: str, rounds: int = 1,
                size: str = "124M", log=None) -> dict:
    """Each engine of ``names`` alone in a fresh process (this script with ``--one``), the list run
    ``rounds`` times in turn; returns ``{name: figures or None}`` with each engine's best figures
    (highest tok/s, lowest ms). An engine that fails is logged with its last error line and left None."""
    log = log or (lambda msg: print(msg, flush=True))
    res = {name: None for name in names}
    for _ in range(rounds):
        for name in names:
            done = subprocess.run([sys.executable, __file__, "--workdir", workdir, "--threads", str(threads),
                                   "--new", str(new), "--repeats", str(repeats), "--prefill", prefill,
                                   "--size", size, "--one", name],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                log(f"{name}: failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            log(f"{size} {name}: {got['b1']:.1f} / {got['b8']:.1f} tok/s")
            best = (lambda k, a, b: a if k in ("kv_cache", "read_bytes") else min(a, b) if k.startswith("p") else max(a, b))
            res[name] = got if res[name] is None else {k: best(k, v, got[k]) for k, v in res[name].items()}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, metavar="DIR", help="what `peers.py --workdir DIR` converted")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=96, help="greedy tokens per decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the list of engines this many times in turn, keeping each one's best (host drift "
                        "then falls on every engine alike)")
    p.add_argument("--prefill", default="128,512", metavar="T,T",
                   help="prompt lengths whose time to the first token is measured (batch 1; '' for none)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE (benchmarks/plots.py draws it)")
    p.add_argument("--size", default="124M", choices=SIZES,
                   help="which random GPT-2 under --workdir: random-<size> (peers.py writes 124M; peers_sizes.py all)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)      # the child: one engine, JSON on stdout
    args = p.parse_args(argv)
    prefill = tuple(int(t) for t in args.prefill.split(",") if t.strip())
    args.prefill_lengths = prefill
    if args.one:
        print(json.dumps(one(args.one, args.workdir, args.threads, args.new, args.repeats, prefill, args.size)))
        return 0
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    if "transformers float32" not in names:
        names.insert(0, "transformers float32")                # the reference of every ratio
    print(f"load average at start: {os.getloadavg()}")
    res = run_engines(names, args.workdir, args.threads, args.new, args.repeats, args.prefill, args.rounds, args.size)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        write_json(args.json, res, args, argv)
    ref = res.get("transformers float32")
    cols = ["b1", "b8", *(f"p{T}" for T in prefill)]
    heads = ["batch 1 tok/s", "batch 8 tok/s", *(f"prefill {T} ms" for T in prefill)]
    print(f"\n| engine (alone in its process, {args.threads} threads, {args.new} new tokens) | " + " | ".join(heads) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in res.items():
        if r is None:
            print(f"| {name} |" + " failed |" * len(cols))
            continue
        ratio = (lambda k: "" if not ref else f" ({(ref[k] / r[k] if k.startswith('p') else r[k] / ref[k]):.2f}x)")
        print(f"| {name} (KV cache {r.get('kv_cache', '?')}) | " + " | ".join(f"{r[k]:.1f}{ratio(k)}" for k in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
