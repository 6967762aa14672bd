"""``gpt2mha bench``: gpt2mha against Hugging Face transformers, side by side on the same weights.

One process builds a random GPT-2 (124M by default) with transformers, saves it once with
``save_pretrained`` into a temporary directory, loads it into both libraries and measures each
figure: greedy decode tokens/s (batch 1 and 8, same tokens checked), cache vs no
cache, decode step time far into the context vs early, prefill time and peak memory, the
attention sublayer alone, and bf16/fp16 decode with their top-1 agreement with fp32 on real text;
and int8/int4 weight-only decode (section ``quant``) with the checkpoint size, the
resident memory, the fraction of the memory bandwidth a step reaches and the logits' cosine.

How things are measured:

* time: wall clock (``time.perf_counter``), one warm-up run, then the **median** of
  ``repeats`` runs; tokens/s = batch × new tokens / seconds of a whole ``generate`` call
  (prefill of the 4-token prompt included).
* peak memory: PyTorch's CPU allocations are invisible to ``tracemalloc``, so each prefill runs
  in a fresh subprocess that loads the model, warms up on 8 tokens, resets the kernel's
  resident-set high-water mark (``/proc/self/clear_refs`` ← 5), runs the prefill and reports
  ``VmHWM − VmRSS`` before it: the resident memory the prefill added at its peak (activations,
  KV cache, allocator slack), the weights excluded. Linux only; elsewhere the column is empty.
* top-1 agreement: teacher-forced, the argmax of the low-precision model's logits against the
  fp32 model's at every position of real text (``data/tinyshakespeare.txt`` by default).

transformers is a benchmark/test dependency only; it is imported inside the functions here.
Run ``gpt2mha bench --quick`` for scaled-down sizes (:data:`QUICK`: every section's work bounded,
2–3 minutes on 2 idle cores), ``--json`` for one JSON object.

Its code is in modules beside it: ``bench_common.py`` (the random checkpoint and its loaders, the
timing, greedy decoding, real text with the top-1 agreement, the bytes a decode step reads, the
table's rows; the other benchmarks import these from here, ``from bench import ...``),
``bench_float.py`` (the float32 sections: decode, cache, positions, prefill, attention) and
``bench_memory.py`` (the prefill variants and the peak-memory children, ``bench.py
--memory-child``); the low-precision and quantized sections are here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from gpt2mha import DEFAULT_MODEL
from gpt2mha.api import GPT2
from gpt2mha.cli import BENCH_SECTIONS as SECTIONS
from gpt2mha.cli import add_bench_arguments as add_arguments
from gpt2mha.core.model import GPT2Config
from gpt2mha.inference.quant import QuantizationWarning, default_calibration
from gpt2mha.io.checkpoints import builtin_models

# the modules beside this file (also when ``gpt2mha bench`` loads it by its path); some names are
# imported here only for the scripts and tests that take them from bench (``from bench import ...``)
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.append(HERE)
from bench_common import (DECISIVE, REPO_TEXT, _prompt, _ratio_row, _require_transformers, cpu_name,  # noqa: E402, F401
                          greedy_without_cache, hf_greedy, interleaved_medians, load_hf, load_ours, logits_cosine,
                          median_seconds, memory_bandwidth, ours_greedy, random_checkpoint, real_text_tokens, row,
                          step_bytes, top1_agreement, top1_agreements)
from bench_float import (bench_attention, bench_cache, bench_decode, bench_positions, bench_prefill,  # noqa: E402
                         ceiling_row)
from bench_memory import _memory_child, _resident_child, prefill_peak_mb, resident_mb  # noqa: E402, F401


@dataclass
class Sizes:
    """What each figure runs on (``FULL`` by default; ``QUICK`` scales it down)."""

    prompt: int = 4
    new_tokens: int = 200                 # decode, cache vs no cache, low precision
    batches: tuple[int, ...] = (1, 8)
    nocache_tokens: int = 200
    positions: tuple[int, int] = (100, 900)
    position_steps: int = 20
    prefill_tokens: int = 1024
    attn_batch: int = 8
    attn_tokens: int = 1024
    agree_tokens: int = 2048              # real-text tokens scored for top-1 agreement
    builtin_agree_tokens: int = 8192      # held-out tokens the built-in model's agreement rows score
    repeats: int = 3
    attn_repeats: int = 9                 # the sublayer times scatter ±10% run to run: more runs
    quant_batches: tuple[int, ...] | None = None      # the quant section's batch sizes (None: ``batches``)
    cosine_tokens: int = 1024             # real-text tokens of the quantized logits' cosine (at most n_ctx)
    calibration_bytes: int | None = None  # GPTQ of the built-in model on this many bytes of the packaged
    #                                       calibration text (None: all 16 KiB, GPT2.quantize's default)
    memory_variants: tuple[str, ...] = ("gpt2mha fused", "gpt2mha explicit", "transformers sdpa",
                                        "transformers eager")      # prefill peaks measured (a child each)
    bandwidth_repeats: int = 5
    resident_memory: bool = True          # the quant section's resident-memory children (one per model)
    slow_decode_tokens: int | None = None  # new tokens of the bf16/fp16 and int8/int4 decode timings (None:
    #                                        new_tokens); their kernels are the slow ones on CPUs without
    #                                        AVX-512 bf16/VNNI/AMX (bf16 prefill ~100x float32's on AVX2)


FULL = Sizes()
#: ``--quick``: every section's work bounded (tokens, batches, windows, calibration text, memory
#: children, repeats) so the whole run takes 2–3 minutes on 2 idle cores.
QUICK = Sizes(new_tokens=16, nocache_tokens=16, positions=(64, 512), position_steps=8, prefill_tokens=256,
              attn_batch=2, attn_tokens=256, agree_tokens=32, builtin_agree_tokens=512, repeats=2,
              attn_repeats=5, quant_batches=(1,), cosine_tokens=64, calibration_bytes=2048,
              memory_variants=("gpt2mha fused", "gpt2mha explicit"), bandwidth_repeats=3, resident_memory=False,
              slow_decode_tokens=8)


# ---- low precision
def _decisive_note(decisive: float) -> str:
    if decisive != decisive:                                               # nan: no such position
        return f"no position where float32's top-2 probability margin >= {DECISIVE}"
    return f"{decisive:.2%} where float32's top-2 probability margin >= {DECISIVE}"


def bench_low_precision(directory: str, ours32: GPT2, hf, sizes: Sizes, text: str | None = None,
                        log=print) -> list[dict]:
    """bf16 and fp16 decode tokens/s (batch 1) against fp32, with top-1 agreement on real text.
    Each low-precision decode is timed in turn with gpt2mha float32 and transformers float32
    (``hf``), so the three figures of a row come from the same minutes."""
    rows = []
    n_new = sizes.slow_decode_tokens or sizes.new_tokens
    idx = _prompt(1, sizes.prompt, ours32.config.n_vocab, seed=1)
    tokens = real_text_tokens(ours32.config, sizes.agree_tokens, text)
    greedy32 = ours_greedy(ours32, idx, n_new)
    hf_greedy(hf, idx, n_new)                               # warm-up
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        model = load_ours(directory, dtype)
        greedy_lp = ours_greedy(model, idx, n_new)           # also the warm-up
        t = interleaved_medians({"lp": lambda: ours_greedy(model, idx, n_new),
                                 "ours32": lambda: ours_greedy(ours32, idx, n_new),
                                 "hf": lambda: hf_greedy(hf, idx, n_new)}, sizes.repeats, warmup=0)
        tok_s, ours_fp32, hf_fp32 = (n_new / t[k] for k in ("lp", "ours32", "hf"))
        agree, decisive = top1_agreements(ours32, model, tokens) if tokens is not None else (None, None)
        n_same = int((greedy32 == greedy_lp).all(0).long().cumprod(0).sum()) - sizes.prompt
        new = [_ratio_row(f"decode tok/s, batch 1: gpt2mha {name} / transformers float32", tok_s, hf_fp32,
                               "tok/s", target_min=2.5 if dtype == torch.bfloat16 else None,
                               note=f"gpt2mha float32 {ours_fp32:.1f} tok/s ({name} / float32 = {tok_s / ours_fp32:.2f}), "
                                    f"all three timed in turn; greedy tokens equal to float32 "
                                    f"for the first {n_same}/{n_new}")]
        if agree is not None:
            new.append(row(f"top-1 agreement, gpt2mha {name} with float32 (random weights, real text)", agree,
                            None, "fraction", target=">= 0.99" if dtype == torch.bfloat16 else None,
                            met=agree >= 0.99 if dtype == torch.bfloat16 else None,
                            note=f"{len(tokens)} tokens; {_decisive_note(decisive)}; random weights give flat, "
                                 f"easily flipped predictions"))
        if dtype == torch.bfloat16:
            new.append(ceiling_row(model, 1, (tok_s, hf_fp32), sizes, name))
        for r in new:
            log(r)
        rows += new
        del model
    rows += builtin_agreement(text, log=log, n_tokens=sizes.builtin_agree_tokens)
    return rows


def builtin_agreement(text: str | None = None, log=print, n_tokens: int = FULL.builtin_agree_tokens) -> list[dict]:
    """bf16/fp16 top-1 agreement of the built-in (trained) model with its fp32 self on the last
    ``n_tokens`` tokens of real text (held out from its training)."""

    if DEFAULT_MODEL not in builtin_models():
        return []
    ref = GPT2.from_pretrained(DEFAULT_MODEL)
    tokens = real_text_tokens(ref.config, n_tokens, text, tail=True)
    if tokens is None:
        return []
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        low = GPT2.from_pretrained(DEFAULT_MODEL, dtype=dtype)
        agree, decisive = top1_agreements(ref, low, tokens)
        name = str(dtype).removeprefix("torch.")
        rows.append(row(f"top-1 agreement, {name} with float32, built-in {DEFAULT_MODEL} on held-out text", agree,
                        None, "fraction", target=">= 0.99", met=agree >= 0.99,
                        note=f"{len(tokens)} tokens; {_decisive_note(decisive)}"))
        log(rows[-1])
    return rows


# ---- quantized decode
#: Issue 13's targets: decode tok/s vs transformers float32 at (scheme, batch), and checkpoint size.
QUANT_SPEED_TARGETS = {("int8", 1): 2.5, ("int4", 1): 3.5, ("int8", 8): 2.0}
QUANT_SIZE_TARGETS = {"int8": 0.30, "int4": 0.20}


def bench_quantized(directory: str, ours32: GPT2, hf, sizes: Sizes, schemes=("int8", "int4"), text: str | None = None,
                    memory: bool = True, log=print) -> list[dict]:
    """int8/int4 decode tok/s at each batch size against transformers float32 (sdpa), each
    quantized decode timed in turn with transformers and gpt2mha float32; the fraction of the
    memory bandwidth a batch-1 step reaches; checkpoint size and resident memory vs float32;
    logits' cosine similarity to float32 on real text."""
    import warnings


    rows = []
    n_new = sizes.slow_decode_tokens or sizes.new_tokens
    bandwidth = memory_bandwidth(repeats=sizes.bandwidth_repeats)
    tokens = real_text_tokens(ours32.config, min(sizes.cosine_tokens, ours32.config.n_ctx), text)
    float_size = os.path.getsize(os.path.join(directory, "model.safetensors"))
    memory = memory and sizes.resident_memory
    float_mb = resident_mb(directory) if memory else None
    for scheme in schemes:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", QuantizationWarning)
            model = load_ours(directory).quantize(scheme, method="rtn")   # random weights: speed, size, cosine
        abnormal = [r["name"] for r in model.quantization_report if r["abnormal"]]
        for B in sizes.quant_batches or sizes.batches:
            idx = _prompt(B, sizes.prompt, model.config.n_vocab, seed=B)
            greedy32, greedy_q = ours_greedy(ours32, idx, n_new), ours_greedy(model, idx, n_new)
            hf_greedy(hf, idx, n_new)                                # warm-up
            t = interleaved_medians({"q": lambda: ours_greedy(model, idx, n_new),
                                     "ours32": lambda: ours_greedy(ours32, idx, n_new),
                                     "hf": lambda: hf_greedy(hf, idx, n_new)}, sizes.repeats, warmup=0)
            tok_s, ours_fp32, hf_fp32 = (B * n_new / t[k] for k in ("q", "ours32", "hf"))
            n_same = int((greedy32 == greedy_q).all(0).long().cumprod(0).sum()) - sizes.prompt
            note = (f"gpt2mha float32 {ours_fp32:.1f} tok/s ({scheme} / float32 = {tok_s / ours_fp32:.2f}), all three "
                    f"timed in turn; greedy tokens equal to float32 for the first {n_same}/{n_new}")
            if B == 1:
                read = step_bytes(model) * tok_s
                note += (f"; weights read {read / 1e9:.1f} GB/s = {read / bandwidth:.0%} of the measured memory "
                         f"bandwidth {bandwidth / 1e9:.1f} GB/s ({step_bytes(model) / 1e6:.0f} MB/step)")
            rows.append(_ratio_row(f"decode tok/s, batch {B}: gpt2mha {scheme} / transformers float32", tok_s, hf_fp32,
                                   "tok/s", target_min=QUANT_SPEED_TARGETS.get((scheme, B)), note=note))
            log(rows[-1])
        with tempfile.TemporaryDirectory(prefix=f"gpt2mha-{scheme}-") as qdir:
            model.save_pretrained(qdir)
            size = os.path.getsize(os.path.join(qdir, "model.safetensors"))
            q_mb = resident_mb(qdir) if memory else None
        rows.append(_ratio_row(f"checkpoint size: {scheme} / float32 (model.safetensors)", size / 1e6, float_size / 1e6,
                               "MB", target_max=QUANT_SIZE_TARGETS[scheme]))
        log(rows[-1])
        if memory:
            rows.append(_ratio_row(f"resident memory, load + decode 8 tokens: {scheme} / float32", q_mb, float_mb, "MB",
                                   note="peak RSS a fresh process adds (weights, decode-time copies, cache)"))
            log(rows[-1])
        if tokens is not None:
            cos = logits_cosine(ours32, model, tokens)
            rows.append(row(f"logits cosine similarity, gpt2mha {scheme} with float32 (random weights, real text)", cos,
                            None, "cosine", target=">= 0.999" if scheme == "int8" else None,
                            met=cos >= 0.999 if scheme == "int8" else None,
                            note=f"{len(tokens)} tokens; abnormal tensors at quantization: {abnormal or 'none'}"))
            log(rows[-1])
        del model, caught
        gc.collect()
    return rows + builtin_quantized_agreement(schemes, text, log, n_tokens=sizes.builtin_agree_tokens,
                                              calibration_bytes=sizes.calibration_bytes)


def builtin_quantized_agreement(schemes, text: str | None = None, log=print,
                                n_tokens: int = FULL.builtin_agree_tokens,
                                calibration_bytes: int | None = None) -> list[dict]:
    """int8/int4 top-1 agreement of the built-in (trained) model with its float32 self on the
    last ``n_tokens`` tokens of the text (held out; the targets README states: 99.5% / 97%), quantized
    by GPTQ on the packaged calibration text, or on its first ``calibration_bytes`` bytes."""

    if DEFAULT_MODEL not in builtin_models():
        return []
    ref = GPT2.from_pretrained(DEFAULT_MODEL)
    tokens = real_text_tokens(ref.config, n_tokens, text, tail=True)
    if tokens is None:
        return []
    calibration = default_calibration()
    how = "the packaged calibration text"
    if calibration_bytes is not None and calibration_bytes < len(calibration.encode("utf-8")):
        calibration = calibration.encode("utf-8")[:calibration_bytes].decode("utf-8", errors="ignore")
        how = f"the first {calibration_bytes} bytes of the packaged calibration text (--quick)"
    rows = []
    for scheme in schemes:
        low = GPT2.from_pretrained(DEFAULT_MODEL).quantize(scheme, calibration=calibration)
        agree, decisive = top1_agreements(ref, low, tokens)
        target = {"int8": 0.995, "int4": 0.97}[scheme]
        rows.append(row(f"top-1 agreement, {scheme} with float32, built-in {DEFAULT_MODEL} on held-out text", agree,
                        None, "fraction", target=f">= {target}", met=agree >= target,
                        note=f"{len(tokens)} tokens; {_decisive_note(decisive)}; quantized as GPT2.quantize's "
                             f"default ({low.quantization['method']}, group {low.quantization['group_size']}) on "
                             f"{how}"))
        log(rows[-1])
    return rows


# ------------------------------------------------------------------------------ the run
def machine() -> dict:
    cpu = cpu_name()
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    return dict(cpu=cpu, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=tv, python=platform.python_version())


def run(preset: str = "124M", quick: bool = False, sections=SECTIONS, text: str | None = None, log=print,
        config: GPT2Config | None = None, memory: bool = True, sizes: Sizes | None = None,
        schemes=("int8", "int4")) -> dict:
    """Run the chosen sections; returns ``{"machine", "preset", "quick", "sizes", "rows",
    "seconds"}`` (``seconds``: the wall time of each section, of the setup and in total;
    ``machine["load_average"]``: the 1-minute load average at the start and at the end).

    ``config`` (default: the preset's) and ``sizes`` (default: FULL or QUICK) override the
    sizes, e.g. for a seconds-long run on a tiny model in the tests.
    """
    _require_transformers()
    sizes = sizes or (QUICK if quick else FULL)
    config = config or GPT2Config.from_preset(preset)
    sizes = dataclasses.replace(sizes, prefill_tokens=min(sizes.prefill_tokens, config.n_ctx),
                                attn_tokens=min(sizes.attn_tokens, config.n_ctx),
                                new_tokens=min(sizes.new_tokens, config.n_ctx - sizes.prompt),
                                nocache_tokens=min(sizes.nocache_tokens, config.n_ctx - sizes.prompt),
                                slow_decode_tokens=sizes.slow_decode_tokens and min(sizes.slow_decode_tokens,
                                                                                    config.n_ctx - sizes.prompt))
    rows, seconds = [], {}

    def timed(name, fn, *args):
        """Run one section, logging and recording its wall time."""
        t0 = time.perf_counter()
        out = fn(*args)
        seconds[name] = round(time.perf_counter() - t0, 1)
        log(f"section {name}: {seconds[name]:.0f} s")
        return out

    t_start, load_start = time.perf_counter(), _load_average()
    if load_start is not None and load_start > (os.cpu_count() or 1):
        log(f"note: load average {load_start:.1f} on {os.cpu_count()} cores: other work shares the CPU, so the times "
            f"(and this run's length) grow with it; each ratio's two sides are timed in turn")
    with tempfile.TemporaryDirectory(prefix="gpt2mha-bench-") as tmp:
        directory = timed("setup", random_checkpoint, os.path.join(tmp, "ckpt"), config)
        if {"decode", "cache", "positions", "lowp"} & set(sections):
            ours = load_ours(directory)
            hf = load_hf(directory) if {"decode", "lowp"} & set(sections) else None
            if "decode" in sections:
                rows += timed("decode", bench_decode, ours, hf, sizes, log)
            if "cache" in sections:
                rows += timed("cache", bench_cache, ours, sizes, log)
            if "positions" in sections:
                rows += timed("positions", bench_positions, ours, sizes, log)
            if "lowp" in sections:
                rows += timed("lowp", bench_low_precision, directory, ours, hf, sizes, text, log)
            del ours, hf
            gc.collect()
        if "quant" in sections:                                  # int8 / int4 decode
            ours, hf = load_ours(directory), load_hf(directory)
            rows += timed("quant", bench_quantized, directory, ours, hf, sizes, schemes, text, memory, log)
            del ours, hf
            gc.collect()
        if "prefill" in sections:
            rows += timed("prefill", bench_prefill, directory, sizes, log, memory)
        if "attention" in sections:
            rows += timed("attention", bench_attention, sizes, config.n_embd, config.n_head, log)
    seconds["total"] = round(time.perf_counter() - t_start, 1)
    m = machine()
    m["load_average"] = [load_start, _load_average()]                    # at the start and at the end
    return dict(machine=m, preset=preset, quick=quick, sizes=dataclasses.asdict(sizes), rows=rows,
                seconds=seconds)


def _load_average() -> float | None:
    """The 1-minute load average (runnable processes; ``uptime``'s first figure), None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if unit == "fraction":
        return f"{v:.2%}"
    if unit == "cosine":
        return f"{v:.5f}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def format_row(r: dict) -> str:
    """One row as a progress line: ``figure: A / B unit = ratio (target: met)``."""
    vs = f" / {_fmt(r['vs'], r['unit'])}" if r["vs"] is not None else ""
    ratio = f" = {_fmt(r['ratio'])}" if r["ratio"] is not None else ""
    target = f" (target {r['target']}: {_fmt(r['met'])})" if r["target"] else ""
    unit = "" if r["unit"] == "fraction" else f" {r['unit']}"
    return f"{r['figure']}: {_fmt(r['value'], r['unit'])}{vs}{unit}{ratio}{target}"


def format_table(result: dict) -> str:
    """A Markdown table of the rows (medians; ratio as the target reads it)."""
    m = result["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, "
             f"transformers {m['transformers']}, Python {m['python']}; preset {result['preset']}"
             f"{' (quick sizes)' if result['quick'] else ''}"
             + (f"; load average {m['load_average'][0]} at the start, {m['load_average'][1]} at the end"
                if m.get("load_average") and None not in m["load_average"] else "")
             + (f"; {result['seconds']['total']:.0f} s in all" if result.get("seconds") else ""), "",
             "| figure (A / B) | A | B | unit | ratio A/B | target | met | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['figure']} | {_fmt(r['value'], r['unit'])} | {_fmt(r['vs'], r['unit'])} | "
                     f"{r['unit']} | {_fmt(r['ratio'])} | {r['target'] or '-'} | {_fmt(r['met'])} | {r['note']} |")
    return "\n".join(lines)


def main_args(args) -> int:
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"--only: unknown section(s) {bad}; expected some of {list(SECTIONS)}")
    def log(*a):                                               # progress on stderr, results on stdout
        print(*(format_row(x) if isinstance(x, dict) else x for x in a), file=sys.stderr, flush=True)
    schemes = tuple(q.strip() for q in args.quantize.split(",") if q.strip())
    bad = [q for q in schemes if q not in ("int8", "int4")]
    if bad or not schemes:
        raise ValueError(f"--quantize={args.quantize!r}: expected int8, int4 or int8,int4")
    result = run(args.preset, args.quick, sections, args.text, log=log, memory=not args.no_memory, schemes=schemes)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child == "resident":
        _resident_child(args.checkpoint)
        return 0
    if args.memory_child:
        _memory_child(args.memory_child, args.checkpoint, args.tokens)
        return 0
    return main_args(args)


if __name__ == "__main__":
    sys.exit(main())
