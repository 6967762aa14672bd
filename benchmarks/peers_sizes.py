"""Every GPT-2 size against the CPU engines, each alone in its process, with the machine's
streaming bandwidth (issue 65):
``python benchmarks/peers_sizes.py --workdir DIR [--sizes 124M,355M,774M,1558M] [--precisions NAMES]
[--optimum-cli PATH] [--new 32] [--repeats 2] [--clean] [--json FILE]``.

For each size (GPT-2's four shapes: 124M, 355M, 774M, 1558M, random weights, transformers'
``save_pretrained`` with a fixed seed through ``bench_common.random_checkpoint``), every engine's
files are written once under ``DIR/random-<size>-engines`` (each conversion in a process of its
own, so that 1558M's 6.2 GB of float32 is held by one process at a time):

* gpt2mha: float32, bf16 and fp16 (``model.to(dtype)``) from the checkpoint; int8 W7A8
  (``quantize("int8", activations="per_row")``) and int4 W4A8 with the int4 head in groups of 64
  (``quantize("int4", 64, activations="per_block", head="int4")``), both round to nearest: the speed
  of a product does not depend on how its integers were chosen (the 124M table of
  ``peers_isolated.py`` uses GPTQ for the int4 head's agreement; quality is measured there and by
  ``benchmarks/bench.py``, on real weights);
* llama.cpp: the float32 GGUF (``peers_convert.write_gguf``), then f16, q8_0 and q4_0 by its own
  quantizer (``llama_model_quantize``);
* OpenVINO: fp32, fp16, int8 and int4 IRs from ``optimum-cli export openvino`` (``--optimum-cli PATH``
  names one in another environment: optimum-intel pins its own transformers);
* CTranslate2: float32 and int8;
* ONNX Runtime: int8 (``quantize_dynamic``), at 124M and 355M only (a graph over 2 GB needs
  external data files, which the exporter here does not write).

Then, size by size, each engine runs alone in a fresh process (``peers_isolated.run_engines``):
decode tokens/s at batch 1 and 8 (a 4-token random prompt, ``--new`` greedy tokens, best of
``--repeats`` after a warm-up call) and the time to the first token after a random 512-token prompt
(batch 1, ms). Before and after each size the machine's streaming read is measured
(``memory_bandwidth``: ``torch.sum`` over a float32 buffer of 1 GiB, larger than any cache, with
the engines' thread count), and each batch-1 step's weight bytes per second are printed as a
fraction of it (``read_bytes`` × tokens/s / bandwidth: the share of the memory system a decode
step uses; 100% is the ceiling of a step that reads its weights once).

The table groups the engines by precision (float32 with a float32 KV cache, bf16, fp16, int8,
int4) and gives gpt2mha's figure as a ratio to the best other engine of that precision at the same
size (higher is better for gpt2mha; prefill: the other's ms over ours). ``--clean`` deletes a size's
files after it is measured (all four sizes take about 70 GB at once).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from peers_isolated import SIZES, run_engines  # noqa: E402

#: precision -> (gpt2mha's contender, the other engines' contenders of that precision)
PRECISIONS = {
    "float32": ("gpt2mha float32", ("llama.cpp f32", "openvino f32", "ctranslate2 float32")),
    "bf16": ("gpt2mha bf16", ("openvino bf16",)),
    "fp16": ("gpt2mha fp16", ("llama.cpp f16", "openvino fp16")),
    "int8": ("gpt2mha int8 per_row", ("llama.cpp q8_0", "openvino int8", "ctranslate2 int8", "onnxruntime int8")),
    "int4": ("gpt2mha int4 per_block head4 g64", ("llama.cpp q4_0", "openvino int4")),
}
ONNX_SIZES = ("124M", "355M")                     # a float32 graph under protobuf's 2 GB


def prepare_one(what: str, size: str, workdir: str, threads: int, optimum_cli: str | None) -> None:
    """Write one engine's files for ``size`` (skipped when they exist); runs in its own process."""
    import torch

    from bench_common import random_checkpoint
    from peers_convert import export_onnx, gpt2_vocab, llama_quantize, write_gguf, write_tokenizer_files

    from gpt2mha import GPT2, GPT2Config

    torch.set_num_threads(threads)
    hf_dir = os.path.join(workdir, f"random-{size}")
    eng = os.path.join(workdir, f"random-{size}-engines")
    os.makedirs(eng, exist_ok=True)
    if what == "checkpoint":
        if not os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            random_checkpoint(hf_dir, GPT2Config.from_preset(size), seed=0)
        write_tokenizer_files(hf_dir, *gpt2_vocab())
    elif what == "gpt2mha":
        for name, args, kw in (("gpt2mha-int8-per_row", ("int8",), dict(activations="per_row")),
                               ("gpt2mha-int4-per_block-head4-g64", ("int4", 64),
                                dict(activations="per_block", head="int4"))):
            path = os.path.join(eng, name)
            if not os.path.isdir(path):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")                 # random weights: outlier warnings
                    GPT2.from_pretrained(hf_dir).quantize(*args, method="rtn", **kw).save_pretrained(path)
    elif what == "llama.cpp":
        import transformers

        f32 = os.path.join(eng, "model-f32.gguf")
        if not os.path.isfile(f32):
            write_gguf(transformers.GPT2LMHeadModel.from_pretrained(hf_dir), f32, *gpt2_vocab())
        for kind in ("f16", "q8_0", "q4_0"):
            path = os.path.join(eng, f"model-{kind}.gguf")
            if not os.path.isfile(path):
                llama_quantize(f32, path, kind, threads)
    elif what == "ctranslate2":
        import ctranslate2

        for quant in ("float32", "int8"):
            path = os.path.join(eng, f"ct2-{quant}")
            if not os.path.isdir(path):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ctranslate2.converters.TransformersConverter(hf_dir).convert(path, quantization=quant, force=True)
    elif what == "onnxruntime":
        import transformers
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fp32, int8 = os.path.join(eng, "model-fp32.onnx"), os.path.join(eng, "model-int8.onnx")
        if not os.path.isfile(int8):
            if not os.path.isfile(fp32):
                export_onnx(transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval(), fp32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True)
    elif what == "openvino":
        import peers_openvino

        failed = []
        for fmt in sorted({fmt for fmt, _, _ in peers_openvino.VARIANTS.values()}):
            try:                                                        # one format failing leaves the others
                peers_openvino.export(hf_dir, os.path.join(eng, f"ov-{fmt}"), fmt, optimum_cli)
            except RuntimeError as e:
                failed.append(f"{fmt}: {str(e).strip().splitlines()[-1]}")
        if failed:
            raise RuntimeError("; ".join(failed))
    else:
        raise ValueError(f"unknown engine {what!r} to prepare")


def engine_of(name: str) -> str:
    """``"llama.cpp q4_0"`` -> ``"llama.cpp"``: the package a contender needs converted files of."""
    return name.split()[0]


def machine_bandwidth(threads: int) -> float:
    """Bytes/s of a streaming read: ``torch.sum`` over 1 GiB of float32 with ``threads`` threads,
    the median of 5 after a warm-up (STREAM's "sum" kernel, as ``bench_common.memory_bandwidth``)."""
    import torch

    from bench_common import memory_bandwidth

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return memory_bandwidth(mb=1074)
    finally:
        torch.set_num_threads(old)


def read_fractions(rows: dict, bandwidth: float) -> None:
    """Add to each engine's figures its batch-1 step's weight reads per second
    (``b1_read_bytes_per_s`` = tok/s × ``read_bytes``) and their share of the streaming read
    (``b1_of_streaming_read``)."""
    for r in rows.values():
        if r and r.get("read_bytes"):
            r["b1_read_bytes_per_s"] = r["b1"] * r["read_bytes"]
            r["b1_of_streaming_read"] = r["b1_read_bytes_per_s"] / bandwidth


def ratios(rows: dict) -> dict:
    """``{precision: {"ours": name, "best": {figure: (name, value)}, "ratio": {figure: x}}}``: gpt2mha
    against the best other engine of each precision, per figure (tok/s: higher is better; ms: lower)."""
    out = {}
    for prec, (ours, others) in PRECISIONS.items():
        mine = rows.get(ours)
        if not mine:
            continue
        best, ratio = {}, {}
        for fig in ("b1", "b8", "p512"):
            vals = [(n, rows[n][fig]) for n in others if rows.get(n) and rows[n].get(fig)]
            if not vals or not mine.get(fig):
                continue
            lower = fig.startswith("p")
            name, v = (min if lower else max)(vals, key=lambda nv: nv[1])
            best[fig] = (name, v)
            ratio[fig] = v / mine[fig] if lower else mine[fig] / v
        if ratio:                                                      # a precision no other engine ran: no row
            out[prec] = {"ours": ours, "best": best, "ratio": ratio}
    return out


def format_table(res: dict) -> str:
    """The size × precision table (markdown) of a run."""
    lines = [f"{res['machine']}; {res['software']}", f"command: {res['command']}", ""]
    for size, s in res["sizes"].items():
        bw = s["bandwidth"]
        lines += [f"### {size}: streaming read {bw / 1e9:.1f} GB/s (before {s['bandwidth_start'] / 1e9:.1f}, after "
                  f"{s['bandwidth_end'] / 1e9:.1f}); load {s['load_start'][0]:.2f} -> {s['load_end'][0]:.2f}", "",
                  "| precision | engine (KV cache) | b1 tok/s | b8 tok/s | prefill 512 ms | b1 GB/s (of the read) |",
                  "|---|---|---|---|---|---|"]
        for prec, (ours, others) in PRECISIONS.items():
            for name in (ours, *others):
                r = s["engines"].get(name)
                if name not in s["engines"]:
                    continue
                if r is None:
                    lines.append(f"| {prec} | {name} | failed | | | |")
                    continue
                frac = (f"{r['b1_read_bytes_per_s'] / 1e9:.1f} ({100 * r['b1_of_streaming_read']:.0f}%)"
                        if r.get("b1_read_bytes_per_s") else "?")
                lines.append(f"| {prec} | {name} ({r.get('kv_cache', '?')}) | {r['b1']:.1f} | {r['b8']:.1f} | "
                             f"{r['p512']:.0f} | {frac} |")
        lines += ["", "| precision | gpt2mha / best other: b1 | b8 | prefill 512 |", "|---|---|---|---|"]
        for prec, q in s["ratios"].items():
            cell = (lambda f: f"{q['ratio'][f]:.2f}× ({q['best'][f][0]})" if f in q["ratio"] else "–")
            lines.append(f"| {prec} | {cell('b1')} | {cell('b8')} | {cell('p512')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", metavar="DIR", help="where each size's checkpoint and files go (required to run)")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, from: " + ", ".join(PRECISIONS))
    p.add_argument("--skip", default="", metavar="NAMES", help="contenders to leave out, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=32, help="greedy tokens per decode (default 32)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--optimum-cli", default=None, metavar="PATH", help="optimum-cli for the OpenVINO IRs")
    p.add_argument("--clean", action="store_true", help="delete each size's files once it is measured")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="print the tables of a run's JSON (written by --json) and exit")
    p.add_argument("--prepare-one", default=None, help=argparse.SUPPRESS)      # the child: one conversion
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prepare_one:
        prepare_one(args.prepare_one, args.size, args.workdir, args.threads, args.optimum_cli)
        return 0
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            print(format_table(json.load(f)))
        return 0
    if not args.workdir:
        p.error("--workdir DIR is required (or --report FILE)")
    import torch

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    precs = [s.strip() for s in args.precisions.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            p.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    for s in precs:
        if s not in PRECISIONS:
            p.error(f"--precisions: {s!r} is not one of {', '.join(PRECISIONS)}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    from bench_common import cpu_name

    cpu = cpu_name()
    res = {"benchmark": "peers_sizes", "date": time.strftime("%Y-%m-%d"), "source": "written by benchmarks/peers_sizes.py --json",
           "machine": f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}",
           "software": f"torch {torch.__version__}, Python {platform.python_version()}; {args.threads} threads per engine",
           "command": "python benchmarks/peers_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "units": {"b1": "tok/s", "b8": "tok/s", "p512": "ms", "read_bytes": "bytes a batch-1 step reads",
                     "bandwidth": "bytes/s (the streaming read, the larger of before and after)",
                     "b1_read_bytes_per_s": "b1 × read_bytes", "b1_of_streaming_read": "b1_read_bytes_per_s / bandwidth"},
           "precisions": {k: [v[0], *v[1]] for k, v in PRECISIONS.items() if k in precs}, "sizes": {}}
    for size in sizes:
        names = [n for prec in precs for n in (PRECISIONS[prec][0], *PRECISIONS[prec][1])
                 if n not in skip and (n != "onnxruntime int8" or size in ONNX_SIZES)]
        for what in ("checkpoint", *dict.fromkeys(engine_of(n) for n in names)):
            t0 = time.time()
            done = subprocess.run([sys.executable, __file__, "--workdir", args.workdir, "--threads", str(args.threads),
                                   "--prepare-one", what, "--size", size,
                                   *(["--optimum-cli", args.optimum_cli] if args.optimum_cli else [])],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or [str(done.returncode)])[-1]
                print(f"{size}: preparing {what} failed: {last}", flush=True)   # its contenders whose files
                if what == "checkpoint":                                        # are missing fail alone
                    return 1
            else:
                print(f"{size}: {what} ready ({time.time() - t0:.0f} s)", flush=True)
        bw0, load0 = machine_bandwidth(args.threads), os.getloadavg()
        print(f"{size}: streaming read {bw0 / 1e9:.1f} GB/s, load {load0}", flush=True)
        rows = run_engines(names, args.workdir, args.threads, args.new, args.repeats, "512", args.rounds, size)
        bw1, load1 = machine_bandwidth(args.threads), os.getloadavg()
        read_fractions(rows, max(bw0, bw1))
        res["sizes"][size] = {"bandwidth": max(bw0, bw1), "bandwidth_start": bw0, "bandwidth_end": bw1,
                              "load_start": load0, "load_end": load1, "engines": rows, "ratios": ratios(rows)}
        print(format_table({**res, "sizes": {size: res["sizes"][size]}}), flush=True)
        if args.json:                                                  # after every size: a long run keeps its part
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=1)
                f.write("\n")
        if args.clean:
            for d in (f"random-{size}", f"random-{size}-engines"):
                shutil.rmtree(os.path.join(args.workdir, d), ignore_errors=True)
    print(format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
