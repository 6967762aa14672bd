"""gpt2mha against the engines people pick for CPU inference (llama.cpp, CTranslate2, ONNX Runtime, OpenVINO):
``python benchmarks/peers.py [--quick] [--threads 2] [--engines NAMES] [--workdir DIR] [--optimum-cli PATH] [--json FILE]``.

One random GPT-2 124M checkpoint (transformers' ``save_pretrained``, fixed seed, through
``bench_common.random_checkpoint``) is converted for every engine that is installed, and the
built-in byte-level model ``shakespeare-byte`` likewise; an engine whose package is missing is
skipped and named. Install them with ``pip install 'gpt2mha[peers]'`` (llama-cpp-python
compiles llama.cpp from source: about 15 minutes on 2 cores).

The contenders:

* gpt2mha float32, int8 and int4 (``GPT2.quantize(scheme, method="rtn")``: round to nearest, as
  every engine below rounds; no calibration text), and int8 with ``generate(compile=True)``
  ("int8 compiled": the decode step compiled by inductor, its products on gpt2mha's int8 GEMV
  kernel with float32 activations, or inductor's bf16-activation template where the kernel does
  not build; compiled before the timed rounds, on the shapes they use; its prefill is int8's,
  and its quality columns score the same products eagerly, ``compiled.decode_view``);
  int8 with ``activations="per_row"`` (W7A8: each activation row rounded to 8 bits with its
  own scale and zero point over 7-bit weights), eager and compiled ("int8 per_row compiled":
  the same W7A8 products inside the compiled step); int8 with ``activations="auto"`` (the
  exact products for decode, W7A8 for prompts of 64+ tokens; compiled, its decode step is
  int8 compiled's); int4 compiled (the block products on gpt2mha's int4 GEMV kernel, float32
  activations; the int8 head on the int8 one); int4 with ``activations="per_block"`` (every
  product W4A8: activations rounded to 8 bits per group of 32, as llama.cpp's q8_0), eager and compiled;
  the same with ``head="int4"`` ("int4 per_block head4": the LM head int4 in groups of 32 too, 24 MB
  a step against the int8 head's 38.6, W4A8 like the blocks), quantized with GPTQ on the packaged
  text (round to nearest put an int4 head below q4_0's agreement), saved once and reused; and
  that in groups of 64 ("int4 per_block head4 g64": 69.5 MB a step against q4_0's 80).
  "Eager" per_row and per_block run on gpt2mha's forward in one C++ call
  (``gpt2mha.inference.native``: their prompts and steps), which
  ``generate`` uses for them without ``compile``;
* transformers float32 (``GPT2LMHeadModel``, sdpa): the reference every ratio divides by;
* llama.cpp (through llama-cpp-python): GGUF f32 written with the ``gguf`` package (llama.cpp's
  own Python library: its ``GGUFWriter`` and its GPT-2 tensor-name map, the steps of its
  ``convert_hf_to_gguf.py`` for GPT-2, which neither package installs; ``--gguf-converter PATH``
  runs that script instead when you have it), then q8_0 and q4_0 by llama.cpp's own quantizer
  (``llama_model_quantize``, its default recipe: q4_0 keeps the tied embedding/head in q6_K);
* CTranslate2: its transformers converter, float32 and int8 weights (int8 on a CPU computes as
  ``int8_float32``: the same thing, so it is not run twice);
* gpt2mha bf16 (``model.to(torch.bfloat16)``: its native forward's bf16 route, vdpbf16ps where the
  CPU has AVX-512 BF16) and fp16 (``model.to(torch.float16)``: float32 sums of the fp16 weights,
  converted by F16C, each product's output rounded to fp16), against llama.cpp f16 (the f32 GGUF
  through ``llama_model_quantize`` to F16);
* OpenVINO (``benchmarks/peers_openvino.py``): GenAI's ``LLMPipeline`` on IRs exported by
  optimum-intel (fp32, and int8 and int4 by NNCF's weight compression), prefix caching off, the
  batch as one ``[B, T]`` input; "openvino f32" with ``INFERENCE_PRECISION_HINT`` forced to f32,
  "openvino bf16" (the fp32 IR), int8 and int4 with the CPU plugin's default hint (bf16 on CPUs with
  AVX-512 BF16), each contender's hint printed beside its name;
* the KV cache of each float contender in its own precision ("KV cache ..." beside each name): "llama.cpp
  f32" and "openvino f32" keep float32 keys and values (both default to f16 whatever the weights), as gpt2mha
  float32 and CTranslate2 float32 do; "llama.cpp f32 kv-f16" and "openvino f32 kv-f16" are the same engines
  with their default f16 cache, so what the precision costs each is measured beside it;
* ONNX Runtime: a float32 ONNX graph of GPT-2 with its KV cache as inputs and outputs (one past
  key and value per layer, the layout of Optimum's decoder-with-past export;
  :class:`peers_convert.OnnxGPT2`, checked against transformers by ``tests/test_peers_bench.py``)
  and that graph after ``onnxruntime.quantization.quantize_dynamic`` (int8 weights, per output channel).

What is printed, every speed as a ratio to transformers float32 timed in the same rounds
(contenders take turns, a, b, c, a, b, c, ...; the median of the rounds, after a short warm-up
call of each shape; a pause of ``--settle`` seconds before each timed call lets the previous
engine's OpenMP threads stop spinning on the 2 cores; a contender whose first call of a figure
takes over ``--slow`` seconds is timed by that call and sits out the later speed figures):

* decode tokens/s, batch 1 and 8: a 4-token random prompt, 96 new greedy tokens, the prefill
  included (batch × new tokens / seconds of the whole call);
* prefill (time to first token) at 128 and 512 tokens, batch 1;
* checkpoint bytes on disk (all files the engine loads);
* greedy tokens equal to transformers float32's over the decode run (the first n steps where
  every row agrees, as ``gpt2mha bench`` counts);
* quality on held-out text (the last 10% of ``data/tinyshakespeare.txt``, as the bench's
  ``real_text_tokens(..., tail=True)``): top-1 agreement with transformers float32, teacher
  forced, windows of n_ctx (the bench's ``top1_agreement``), on the random 124M (GPT-2 BPE of
  the text) and on ``shakespeare-byte`` (its bytes), with bits per byte there (mean next-byte
  cross-entropy in bits over the same windows; a window's first byte is not scored);
* bytes of weights a batch-1 decode step reads (each block matrix and the LM head as stored,
  with biases; the embedding rows a step gathers are left out) and the GB/s that the batch-1
  tokens/s implies, against the machine's memory bandwidth (``bench_common.memory_bandwidth``).

Every engine gets ``--threads`` threads (default 2). The machine (CPU model, cores, versions)
and the load average at start and end are printed with the table.

The code beside it: ``peers_convert.py`` (the tokenizer files, the GGUF, llama.cpp's quantizer, the
ONNX graph) and ``peers_engines.py`` (each engine's contender, and :func:`build_contenders`, which
converts and loads them all).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# gpt2mha: its public API and the bench helpers this benchmark uses, all imported here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # benchmarks/bench.py, also when imported by path
from bench import memory_bandwidth, random_checkpoint, real_text_tokens, top1_agreement  # noqa: E402
from gpt2mha import GPT2, DEFAULT_MODEL, GPT2Config  # noqa: E402
# the conversions and the engines (beside this file); the names other files import from peers are re-exported
from peers_convert import OnnxGPT2, byte_vocab, gpt2_vocab, write_gguf, write_tokenizer_files  # noqa: E402, F401
from peers_engines import (CT2, LLAMA_KV_CACHE, ORT, REFERENCE, Contender, LlamaCpp, Torch,  # noqa: E402, F401
                           build_contenders, engine_versions, missing_engines)

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "tinyshakespeare.txt")
ENGINES = ("gpt2mha", "llama.cpp", "ctranslate2", "onnxruntime", "openvino")
#: Every contender besides the reference and gpt2mha float32 (``--skip`` takes these names; the
#: reference always runs, gpt2mha float32 whenever the gpt2mha engine does).
VARIANTS = ("gpt2mha int8", "gpt2mha int8 compiled", "gpt2mha int8 per_row", "gpt2mha int8 per_row compiled",
            "gpt2mha int8 auto", "gpt2mha int8 auto compiled", "gpt2mha int4", "gpt2mha int4 compiled",
            "gpt2mha int4 per_block", "gpt2mha int4 per_block compiled", "gpt2mha int4 per_block head4",
            "gpt2mha int4 per_block head4 compiled", "gpt2mha int4 per_block head4 g64",
            "gpt2mha int4 per_block head4 g64 compiled", "llama.cpp f32", "llama.cpp f32 kv-f16",
            "llama.cpp q8_0", "llama.cpp q4_0", "ctranslate2 float32", "ctranslate2 int8", "onnxruntime float32",
            "onnxruntime int8", "gpt2mha bf16", "gpt2mha fp16", "llama.cpp f16", "openvino f32", "openvino f32 kv-f16",
            "openvino bf16", "openvino int8", "openvino int4")


@dataclass
class Sizes:
    """What the figures run on (``QUICK`` scales it down)."""

    prompt: int = 4
    new_tokens: int = 96
    batches: tuple[int, ...] = (1, 8)
    prefill: tuple[int, ...] = (128, 512)
    repeats: int = 3
    agree_tokens: int = 512           # random 124M: GPT-2 BPE tokens of held-out text
    byte_tokens: int = 32 * 256       # shakespeare-byte: held-out bytes (as the bench's built-in agreement)
    slow: float = 10.0                # s: a first call longer than this and SLOW_FACTOR x the reference's is
                                      # timed alone, then the contender sits out the later speed figures
    skip: tuple[str, ...] = ()        # contenders left out


FULL = Sizes()
QUICK = Sizes(new_tokens=16, prefill=(128,), repeats=1, agree_tokens=256, byte_tokens=8 * 256, slow=4.0,
              skip=("llama.cpp f32", "llama.cpp f32 kv-f16", "llama.cpp f16", "ctranslate2 float32",
                    "onnxruntime float32", "openvino f32 kv-f16"))


# ============================================================================ measuring
#: A contender is "slow" for a figure when its first call takes over this many times the
#: reference's (and over ``Sizes.slow`` seconds): see :func:`race`.
SLOW_FACTOR = 2.0


def race(fns: dict, repeats: int, settle: float, slow: float) -> tuple[dict, dict]:
    """Median seconds of ``repeats`` calls of each callable, the contenders in turn (a, b, c, a,
    b, c, ...), and the first call's results; the first callable is the reference. ``settle``
    seconds of sleep before each call (not timed) let the previous contender's worker threads
    go idle. The first round counts: the callers have warmed every contender up on the same
    shapes (:func:`measure_speed`). A contender whose first call took over ``SLOW_FACTOR`` times
    the reference's first call and over ``slow`` seconds is not called again: that call's time
    stands as its figure, which keeps the run's length bounded.

    Returns ``({name: seconds, None: names timed once}, {name: first call's result})``."""
    times, outputs = {name: [] for name in fns}, {}
    reference = next(iter(fns))
    too_slow = (lambda name: name != reference and times[name][0] > max(slow, SLOW_FACTOR * times[reference][0]))
    for round_ in range(repeats):
        for name, fn in fns.items():
            if round_ and too_slow(name):
                continue
            time.sleep(settle)
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            outputs.setdefault(name, out)
    medians = {n: statistics.median(t) for n, t in times.items()}
    medians[None] = {n for n in fns if too_slow(n)}
    return medians, outputs


def equal_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading steps at which every row of ``a`` and ``b`` (``[B, n]``) holds the same token."""
    same = (a == b).all(0)
    return int(np.cumprod(same).sum())


class AsModel:
    """A contender seen as a model by :func:`bench_common.top1_agreement`: ``config.n_ctx`` and
    ``__call__(window [1, T]) → .logits [1, T, V]``; the logits of each window are kept (the
    reference's are asked for once per contender, and bits/byte reads them again)."""

    def __init__(self, contender: Contender, n_ctx: int):
        self.contender, self.config, self.cache = contender, types.SimpleNamespace(n_ctx=n_ctx), {}

    def __call__(self, window: torch.Tensor):
        key = window.numpy().tobytes()
        if key not in self.cache:
            self.cache[key] = torch.from_numpy(self.contender.logits(window[0].numpy().astype(np.int64)))[None]
        return types.SimpleNamespace(logits=self.cache[key])


def bits_per_token(model: AsModel, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy (bits) over windows of n_ctx of ``tokens`` (each window's
    first token unscored): bits per byte for a byte-level model."""
    n_ctx, nats, count = model.config.n_ctx, 0.0, 0
    for start in range(0, len(tokens), n_ctx):
        window = tokens[start:start + n_ctx]
        logits = model(window[None]).logits[0, :-1].double()
        nats += float(F.cross_entropy(logits, window[1:], reduction="sum"))
        count += len(window) - 1
    return nats / count / math.log(2)


def measure_speed(contenders, cfg: GPT2Config, sizes: Sizes, settle: float, log) -> dict:
    """Decode tok/s at each batch, prefill seconds at each length, greedy tokens equal to the
    reference's over the warm-up decode; ``{name: {figure: value}}``. ``"once"`` lists the
    figures timed from the warm-up alone (it took over ``sizes.slow`` s, see :func:`race`); the
    contender then sits out the later speed figures (None), so one very slow contender cannot
    stretch the run. The reference always runs."""
    res = {c.name: {"once": []} for c in contenders}
    active = list(contenders)

    def one(figure, fn_of, value_of):
        t, out = race({c.name: fn_of(c) for c in active}, sizes.repeats, settle, sizes.slow)
        for c in contenders:
            res[c.name][figure] = value_of(t[c.name]) if c in active else None
        for c in [c for c in active if c.name in t[None]]:
            res[c.name]["once"].append(figure)
            if c is not contenders[0]:
                active.remove(c)
        log(f"{figure}: " + ", ".join(f"{n} {v[figure]:.3g}" for n, v in res.items() if v[figure] is not None))
        return out

    for c in contenders:                      # first-call work (lazy copies, packing, allocations) out of the way
        for B in sizes.batches:               # (a compiled step: compiled for the very shapes timed)
            t0 = time.perf_counter()
            c.greedy(np.zeros((B, sizes.prompt), dtype=np.int64), sizes.new_tokens if getattr(c, "compiled", False) else 2)
            if getattr(c, "compiled", False):
                log(f"{c.name}: compiled for batch {B} in {time.perf_counter() - t0:.1f} s")
        c.first_token(np.zeros((1, 16), dtype=np.int64))
    for B in sizes.batches:
        prompt = torch.randint(0, cfg.n_vocab, (B, sizes.prompt), generator=torch.Generator().manual_seed(B)).numpy()
        runners = [c for c in active]
        out = one(f"decode b{B}", lambda c: (lambda: c.greedy(prompt, sizes.new_tokens)),
                  lambda sec: B * sizes.new_tokens / sec)
        for c in contenders:
            res[c.name][f"same b{B}"] = equal_prefix(out[REFERENCE], out[c.name]) if c in runners else None
    for T in sizes.prefill:
        T = min(T, cfg.n_ctx)
        prompt = torch.randint(0, cfg.n_vocab, (1, T), generator=torch.Generator().manual_seed(T)).numpy()
        one(f"prefill {T}", lambda c: (lambda: c.first_token(prompt)), lambda sec: sec)
    return res


def measure_quality(contenders, tokens: torch.Tensor, n_ctx: int, bpb: bool, log=print) -> dict:
    """``{name: {"top1": fraction, "bpb": bits/byte}}`` against the first contender, teacher forced."""
    ref = AsModel(contenders[0], n_ctx)
    out = {}
    for c in contenders:
        t0 = time.perf_counter()
        try:
            m = ref if c is contenders[0] else AsModel(c, n_ctx)
            out[c.name] = {"top1": top1_agreement(ref, m, tokens)}
            if bpb:
                out[c.name]["bpb"] = bits_per_token(m, tokens)
        except Exception as e:                                            # an engine that cannot score it
            out[c.name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"  scored {c.name}: {time.perf_counter() - t0:.1f} s")
    return out


def machine(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        fl = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
        flags = " ".join(x for x in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if x in fl)
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), threads=threads, flags=flags, python=platform.python_version(),
                versions=engine_versions())


# ============================================================================ the run
def run(sizes: Sizes, engines, threads: int, work: str, settle: float = 0.2, log=print, gguf_converter=None,
        optimum_cli=None) -> dict:
    """Build, measure, return everything (``format_report`` prints it)."""
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    t_start = time.time()
    skipped = missing_engines()
    engines = [e for e in engines if e not in skipped]
    bandwidth = memory_bandwidth()
    log(f"memory bandwidth (torch.sum over 340 MB): {bandwidth / 1e9:.1f} GB/s")
    log(f"load average at start: {load_start}")
    tokens, merges = gpt2_vocab()
    result = dict(machine=machine(threads), sizes=dataclasses.asdict(sizes), skipped=skipped, bandwidth=bandwidth,
                  load_start=load_start, date=time.strftime("%Y-%m-%d %H:%M %Z"))

    # ---- the random 124M: speed, size, greedy agreement, top-1 on held-out text
    cfg = GPT2Config.from_preset("124M")
    rand_dir = os.path.join(work, "random-124M")
    if not os.path.isdir(rand_dir):
        random_checkpoint(rand_dir, cfg, seed=0)
    write_tokenizer_files(rand_dir, tokens, merges)
    contenders, notes = build_contenders(rand_dir, os.path.join(work, "random-124M-engines"), engines, threads,
                                         tokens, merges, log, gguf_converter, sizes.skip, optimum_cli)
    log("contenders: " + ", ".join(c.name for c in contenders))
    log(f"load average: {os.getloadavg()}")
    speed = measure_speed(contenders, cfg, sizes, settle, log)
    held_out = real_text_tokens(cfg, sizes.agree_tokens, TEXT, tail=True)
    quality = measure_quality(contenders, held_out, cfg.n_ctx, bpb=False, log=log)
    log(f"top-1 on the random 124M done; load average {os.getloadavg()}")
    rows = []
    for c in contenders:
        rows.append(dict(name=c.name, engine=c.engine, checkpoint_bytes=c.checkpoint_bytes, read_bytes=c.read_bytes,
                         types=getattr(c, "types", getattr(c, "compute_type", "")), kv_cache=c.kv_cache, **speed[c.name],
                         top1_random=quality[c.name].get("top1"), error_random=quality[c.name].get("error")))
        c.close()
    del contenders
    gc.collect()

    # ---- shakespeare-byte: top-1 and bits/byte on held-out bytes
    byte_dir = os.path.join(work, DEFAULT_MODEL)
    if not os.path.isdir(byte_dir):
        GPT2.from_pretrained(DEFAULT_MODEL).save_pretrained(byte_dir)
    write_tokenizer_files(byte_dir, byte_vocab(), [])
    byte_notes = {}
    try:
        log(f"{DEFAULT_MODEL}: converting and loading")
        byte_contenders, byte_notes = build_contenders(byte_dir, os.path.join(work, f"{DEFAULT_MODEL}-engines"), engines,
                                                       threads, byte_vocab(), None, log, None, sizes.skip, optimum_cli)
        bcfg = GPT2.from_pretrained(byte_dir).config
        text = real_text_tokens(bcfg, sizes.byte_tokens, TEXT, tail=True)
        bq = measure_quality(byte_contenders, text, bcfg.n_ctx, bpb=True, log=log)
        log(f"{DEFAULT_MODEL} quality done")
        for c in byte_contenders:
            c.close()
    except Exception as e:                                                # keep the 124M figures
        bq = {}
        byte_notes["all"] = f"{type(e).__name__}: {e}"
    for r in rows:
        q = bq.get(r["name"], {})
        r.update(top1_byte=q.get("top1"), bpb_byte=q.get("bpb"),
                 error_byte=q.get("error") or byte_notes.get(r["name"]) or byte_notes.get("all"))
    result.update(rows=rows, notes={**notes, **{f"{k} (shakespeare-byte)": v for k, v in byte_notes.items()}},
                  load_end=os.getloadavg(), seconds=time.time() - t_start, bandwidth_end=memory_bandwidth())
    return result


def _ratio(value, ref, faster_is_larger=True):
    if not value or not ref:
        return "-"
    return f"{(value / ref if faster_is_larger else ref / value):.2f}x"


def format_report(res: dict) -> str:
    """The Markdown report: machine, load, one table, the bandwidth analysis."""
    m, s = res["machine"], res["sizes"]
    v = m["versions"]
    lines = [f"date: {res['date']}; {res['seconds']:.0f} s",
             f"machine: {m['cpu']}, {m['cores']} cores ({m['flags'] or 'no AVX2/AVX-512 flags seen'}), "
             f"{m['threads']} threads for every engine; Python {m['python']}; "
             + ", ".join(f"{k} {x}" for k, x in v.items()),
             f"load average (1, 5, 15 min): start {', '.join(f'{x:.2f}' for x in res['load_start'])}; "
             f"end {', '.join(f'{x:.2f}' for x in res['load_end'])}",
             f"memory bandwidth (bench.memory_bandwidth, torch.sum over 340 MB, {m['threads']} threads): "
             f"{res['bandwidth'] / 1e9:.1f} GB/s at the start, {res['bandwidth_end'] / 1e9:.1f} GB/s at the end",
             ""]
    bandwidth = max(res["bandwidth"], res["bandwidth_end"])
    for engine, why in res["skipped"].items():
        lines.append(f"skipped {engine}: {why}")
    for name, why in res["notes"].items():
        lines.append(f"{name}: {why}")
    ref = next(r for r in res["rows"] if r["name"] == REFERENCE)
    B = s["batches"]
    head = (["contender", "checkpoint MB"] + [f"decode b{b} tok/s (x tf32)" for b in B]
            + [f"prefill {t} ms (x tf32)" for t in s["prefill"]]
            + [f"greedy = tf32 (b{b}, of {s['new_tokens']})" for b in B]
            + [f"top-1 = tf32, random 124M ({s['agree_tokens']} tok)", f"top-1 = tf32, {DEFAULT_MODEL}",
               f"bits/byte, {DEFAULT_MODEL}", "weights read MB/token", "GB/s at b1 (of bandwidth)"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        about = ", ".join(x for x in (r.get("types"), r.get("kv_cache") and f"KV cache {r['kv_cache']}") if x)
        cells = [r["name"] + (f" ({about})" if about else ""), f"{r['checkpoint_bytes'] / 1e6:.0f}"]
        def speed(fig, value_of, faster_is_larger):
            if r[fig] is None:
                return "dropped"
            star = "*" if fig in r["once"] else ""
            return f"{value_of(r[fig])}{star} ({_ratio(r[fig], ref[fig], faster_is_larger)})"

        cells += [speed(f"decode b{b}", lambda v: f"{v:.1f}", True) for b in B]
        cells += [speed(f"prefill {t}", lambda v: f"{v * 1e3:.0f}", False) for t in (min(t, 1024) for t in s["prefill"])]
        cells += ["-" if r[f"same b{b}"] is None else f"{r[f'same b{b}']}" for b in B]
        cells += [f"{r['top1_random']:.2%}" if r["top1_random"] is not None else f"- ({r['error_random']})"]
        cells += [f"{r['top1_byte']:.2%}" if r["top1_byte"] is not None else f"cannot: {r['error_byte']}",
                  f"{r['bpb_byte']:.4f}" if r["bpb_byte"] is not None else "-"]
        if r["read_bytes"] and r["decode b1"]:
            gbs = r["read_bytes"] * r["decode b1"] / 1e9
            cells += [f"{r['read_bytes'] / 1e6:.0f}", f"{gbs:.1f} ({gbs * 1e9 / bandwidth:.0%})"]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Sizes: prompt {s['prompt']} random tokens, {s['new_tokens']} new greedy tokens, batches {B}; prefill "
              f"{s['prefill']} tokens at batch 1 (time to the first token); medians of {s['repeats']} rounds, contenders "
              f"in turn, after a short warm-up call of each shape; ratios: contender / transformers float32 for tok/s, transformers / "
              f"contender for times (above 1 = faster). Top-1 and bits/byte: teacher forced over held-out text (the last "
              f"10% of data/tinyshakespeare.txt), windows of n_ctx. Weights read/token: block matrices, biases, norms "
              f"and the LM head as stored (CTranslate2: its model.bin less the position table); GB/s = that x batch-1 tok/s, "
              f"against the larger bandwidth measured. *: the contender's first call of that figure took over "
              f"{SLOW_FACTOR:g}x the reference's and over {s['slow']:.0f} s, and was timed by that call alone; dropped: it sat out the later speed figures after that."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="scaled-down sizes: 16 new tokens, one round, prefill 128 only, fewer scored "
                        "tokens, the engines' float32 variants left out")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated engines besides transformers float32 (default all: {','.join(ENGINES)})")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="keep the checkpoints and conversions here and reuse them next time (default: a temporary "
                        "directory removed at the end)")
    p.add_argument("--gguf-converter", default=None, metavar="convert_hf_to_gguf.py",
                   help="make the random model's f32 GGUF with llama.cpp's own script from its source tree instead of "
                        "the gguf-package writer")
    p.add_argument("--optimum-cli", default=None, metavar="PATH",
                   help="the optimum-cli that exports the OpenVINO IRs (default: the one on PATH; optimum-intel and "
                        "NNCF may pin another transformers than this environment's: install them elsewhere)")
    p.add_argument("--settle", type=float, default=0.2, help="seconds of pause before each timed call (default 0.2)")
    p.add_argument("--slow", type=float, default=None,
                   help="seconds: a contender whose first call of a speed figure takes longer, and over twice the "
                        "reference's, is timed by that call alone and left out of the later speed figures (default "
                        "10, --quick 4; bounds the run)")
    p.add_argument("--skip", default="", metavar="NAMES",
                   help="comma-separated contenders to leave out, e.g. 'gpt2mha int8,llama.cpp f32'")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; expected some of {list(ENGINES)}")
    if args.threads < 1:
        p.error(f"--threads={args.threads}: expected at least 1")
    if args.json and os.path.exists(args.json):
        p.error(f"--json: {args.json} exists; not overwriting it")
    try:
        import transformers
    except ImportError:
        p.error("transformers float32 is the reference: pip install transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:4.0f} s] {msg}", file=sys.stderr, flush=True)

    sizes = QUICK if args.quick else FULL
    if args.slow is not None:
        sizes = dataclasses.replace(sizes, slow=args.slow)
    skip = tuple(x.strip() for x in args.skip.split(",") if x.strip())
    bad = [x for x in skip if x not in VARIANTS]
    if bad:
        p.error(f"--skip: unknown {bad}; expected some of {list(VARIANTS)} ({REFERENCE!r} always runs, 'gpt2mha "
                f"float32' whenever --engines has gpt2mha)")
    sizes = dataclasses.replace(sizes, skip=sizes.skip + skip)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        res = run(sizes, engines, args.threads, args.workdir, args.settle, log, args.gguf_converter, args.optimum_cli)
    else:
        with tempfile.TemporaryDirectory(prefix="gpt2mha-peers-") as work:
            res = run(sizes, engines, args.threads, work, args.settle, log, args.gguf_converter, args.optimum_cli)
    print(format_report(res))
    if args.json:
        meta = {"benchmark": "peers", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "source": "written by benchmarks/peers.py --json (every contender in one process, in turns)"}
        with open(args.json, "w") as f:
            json.dump({**meta, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
