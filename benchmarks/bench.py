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
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpt2mha import DEFAULT_MODEL
from gpt2mha.api import GPT2
from gpt2mha.cli import BENCH_SECTIONS as SECTIONS
from gpt2mha.cli import add_bench_arguments as add_arguments
from gpt2mha.core.attention import CausalSelfAttention
from gpt2mha.core.kv_cache import KVCache
from gpt2mha.core.model import GPT2Config, logits_dtype
from gpt2mha.inference.fast import for_decoding
from gpt2mha.inference.quant import QuantizationWarning, QuantizedLinear, default_calibration
from gpt2mha.io.checkpoints import builtin_models
from gpt2mha.io.convert import fused_to_mha
from gpt2mha.io.tokenizer import get_tokenizer

MMAP_THRESHOLD = 1 << 20   # bytes: allocations this large bypass glibc's heap in the memory children
DECISIVE = 0.05          # top-2 probability margin that makes a position "decisive" for agreement
REPO_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare.txt")


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


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: gpt2mha bench compares against Hugging Face transformers, which is not "
                         "installed; pip install -e \".[test]\" in a checkout, or pip install transformers (a "
                         "benchmark/test dependency only)") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()           # no load/save bars among the figures
    return transformers


# ------------------------------------------------------------------------------ the weights
def random_checkpoint(directory: str, config: GPT2Config, seed: int = 0) -> str:
    """Save a random ``GPT2LMHeadModel`` of ``config``'s sizes with transformers; returns the dir.

    No bos/eos token is set, so greedy generation never stops early on either side.
    """
    transformers = _require_transformers()
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(vocab_size=config.n_vocab, n_positions=config.n_ctx, n_embd=config.n_embd,
                                        n_head=config.n_head, n_layer=config.n_layer, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    model.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:      # tell our loader which tokenizer
        cfg = json.load(f)
    cfg["gpt2mha"] = {"tokenizer": config.tokenizer}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def load_ours(directory: str, dtype: torch.dtype = torch.float32) -> GPT2:
    return GPT2.from_pretrained(directory, dtype=dtype)


def load_hf(directory: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    transformers = _require_transformers()
    return transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation=attn, dtype=dtype).eval()


# ------------------------------------------------------------------------------ timing
def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """Median wall time (s) of each callable, run round-robin (a, b, a, b, ...) so that a slow
    spell of the machine hits every contender alike; ``warmup`` untimed rounds first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _prompt(batch: int, length: int, n_vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, n_vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers ``generate``: greedy, KV cache on (``use_cache``), exactly ``new_tokens``."""
    with torch.inference_mode():
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)


def ours_greedy(model: GPT2, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(idx, new_tokens, temperature=0)


@torch.inference_mode()
def greedy_without_cache(model: GPT2, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding that recomputes the whole sequence every step (no cache at all)."""
    seq = idx
    for _ in range(new_tokens):
        logits = model(seq, last_only=True).logits[:, -1]                 # [B, n_vocab]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


# ------------------------------------------------------------------------------ figures
def row(figure, value, vs, unit, ratio=None, target=None, met=None, note=""):
    """One table row: ``figure`` reads "A / B"; ``value`` is A, ``vs`` is B, ``ratio`` A / B."""
    return dict(figure=figure, value=value, vs=vs, unit=unit, ratio=ratio, target=target, met=met, note=note)


def _ratio_row(figure, value, vs, unit, target_min=None, target_max=None, note=""):
    ratio = value / vs if value and vs else None
    target, met = None, None
    if target_min is not None:
        target, met = f">= {target_min}", ratio is not None and ratio >= target_min
    if target_max is not None:
        target, met = f"<= {target_max}", ratio is not None and ratio <= target_max
    return row(figure, value, vs, unit, ratio, target, met, note)


def decode_speeds(ours: GPT2, hf, batch: int, sizes: Sizes) -> tuple[float, float, bool]:
    """(gpt2mha tok/s, transformers tok/s, same greedy tokens) for one batch size. The first
    call of each side (whose tokens are compared) is the warm-up."""
    idx = _prompt(batch, sizes.prompt, ours.config.n_vocab, seed=batch)
    same = torch.equal(ours_greedy(ours, idx, sizes.new_tokens), hf_greedy(hf, idx, sizes.new_tokens))
    t = interleaved_medians({"ours": lambda: ours_greedy(ours, idx, sizes.new_tokens),
                             "hf": lambda: hf_greedy(hf, idx, sizes.new_tokens)}, sizes.repeats, warmup=0)
    return batch * sizes.new_tokens / t["ours"], batch * sizes.new_tokens / t["hf"], same


def bench_decode(ours: GPT2, hf, sizes: Sizes, log=print) -> list[dict]:
    """Decode tokens/s at each batch size, gpt2mha vs transformers ``generate`` (sdpa, use_cache),
    and the ceiling the weight matmuls alone set (:func:`matmul_floor`)."""
    rows = []
    for B in sizes.batches:
        *speeds, same = decode_speeds(ours, hf, B, sizes)
        rows.append(_ratio_row(f"decode tok/s, batch {B}, prompt {sizes.prompt}, {sizes.new_tokens} new: "
                               f"gpt2mha / transformers generate (sdpa, use_cache)", *speeds, "tok/s",
                               target_min=1.5,
                               note=f"same greedy tokens: {'yes' if same else 'NO'}"))
        log(rows[-1])
        rows.append(ceiling_row(ours, B, speeds, sizes, "float32"))
        log(rows[-1])
    return rows


@torch.inference_mode()
def matmul_floor(model: GPT2, batch: int, repeats: int = 20) -> float:
    """Median time (s) of one decode step's weight matmuls and nothing else: each block's four
    Conv1Ds and the LM head on ``[batch, n_embd]`` rows, with the same modules and kernels as a
    step of ``generate``'s decode view (:func:`~gpt2mha.inference.fast.for_decoding`) but no
    attention, norms, residuals or sampling between them.

    At batch 1 every matmul streams its weight from memory once, so this is the floor for a
    step on this machine, set by its memory bandwidth (``weight bytes / floor``); at batch 8 it
    is the floor the matmul library allows for 8 rows.
    """
    c = model.config
    dtype = next(model.parameters()).dtype
    x = torch.randn(batch, c.n_embd, dtype=dtype)
    h = torch.randn(batch, 4 * c.n_embd, dtype=dtype)

    view = for_decoding(model)

    def once():
        for block in view.h:
            block.attn.c_attn(x), block.attn.c_proj(x), block.mlp.c_fc(x), block.mlp.c_proj(h)
        view.lm_head(x[:, None])

    return median_seconds(once, repeats, warmup=2)


def ceiling_row(model: GPT2, batch: int, speeds: tuple[float, float], sizes: Sizes, name: str) -> dict:
    """The ceiling tok/s that :func:`matmul_floor` allows at ``batch``, against transformers."""
    ours_tok_s, hf_tok_s = speeds
    floor = matmul_floor(model, batch, repeats=max(10, 5 * sizes.repeats))
    ceiling = batch / floor
    wte, wpe = model.wte.weight, model.wpe.weight                        # the head reads wte in float32
    head_bytes = wte.numel() * torch.empty(0, dtype=logits_dtype(wte.dtype)).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + head_bytes - \
        (wte.numel() * wte.element_size() + wpe.numel() * wpe.element_size())
    return _ratio_row(f"decode tok/s ceiling, batch {batch}, gpt2mha {name}: weight matmuls alone "
                      f"(no attention, no overhead) / transformers float32", ceiling, hf_tok_s, "tok/s",
                      note=f"floor {floor * 1e3:.1f} ms/step ({weight_bytes / floor / 1e9:.1f} GB/s of weights); "
                           f"gpt2mha decode reaches {ours_tok_s / ceiling:.0%} of it; 1.5x transformers "
                           f"would need {1.5 * hf_tok_s:.1f} tok/s")


def bench_cache(ours: GPT2, sizes: Sizes, log=print) -> list[dict]:
    """Greedy decode with the static KV cache vs recomputing the whole sequence each step, whole
    runs taken in turn (cached, uncached, cached, …) so a slow spell hits both alike."""
    idx = _prompt(1, sizes.prompt, ours.config.n_vocab)
    n = sizes.nocache_tokens
    same = torch.equal(ours_greedy(ours, idx, n), greedy_without_cache(ours, idx, n))   # also the warm-up
    t = interleaved_medians({"cache": lambda: ours_greedy(ours, idx, n),
                             "none": lambda: greedy_without_cache(ours, idx, n)}, sizes.repeats, warmup=0)
    t_cache, t_none = t["cache"], t["none"]
    r = _ratio_row(f"decode tok/s, batch 1, {n} new: static KV cache / no cache (recompute all)",
                   n / t_cache, n / t_none, "tok/s",
                   target_min=5, note=f"same greedy tokens: {'yes' if same else 'NO'}")
    log(r)
    return [r]


@torch.inference_mode()
def step_times(model: GPT2, positions: tuple[int, ...], steps: int, batch: int = 1) -> list[float]:
    """Median time (s) of one single-token decode step with each of ``positions`` tokens already
    cached (on the decode view, as in ``generate``). One cache per position; the steps
    are taken in turn across them (round-robin), so a slow spell of the machine hits all alike.
    """
    c = model.config
    dtype = next(model.parameters()).dtype
    idx = _prompt(batch, max(positions) + steps + 1, c.n_vocab)
    times = [[] for _ in positions]
    view = for_decoding(model)
    caches = []
    for p in positions:
        cache = KVCache(c.n_layer, batch, c.n_head, p + steps + 1, c.head_dim, dtype=dtype)
        view(idx[:, :p], cache=cache, last_only=True, validate=False)      # prefill
        caches.append(cache)
    for s in range(steps + 1):                                             # the first round warms up
        for j, (p, cache) in enumerate(zip(positions, caches)):
            t0 = time.perf_counter()
            view(idx[:, p + s:p + s + 1], cache=cache, last_only=True, validate=False)
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(t[1:]) for t in times]


def bench_positions(ours: GPT2, sizes: Sizes, log=print) -> list[dict]:
    """Decode step time near position ~900 vs near ~100 (the step should cost ~the same)."""
    n_ctx = ours.config.n_ctx
    early, late = (min(p, n_ctx - sizes.position_steps - 2) for p in sizes.positions)
    t_early, t_late = step_times(ours, (early, late), sizes.position_steps)
    r = _ratio_row(f"decode step time, batch 1: at position ~{late} / at ~{early}", t_late * 1e3,
                   t_early * 1e3, "ms", target_max=1.3, note="steps taken in turn at the two positions")
    log(r)
    return [r]


# ---- prefill: time in this process, peak memory in a fresh child per variant
PREFILL_VARIANTS = ("gpt2mha fused", "gpt2mha explicit", "transformers sdpa", "transformers eager")


def _load_variant(variant: str, directory: str):
    if variant.startswith("gpt2mha"):
        model = load_ours(directory)
        model.attn_impl = "sdpa" if variant.endswith("fused") else "explicit"
    else:
        model = load_hf(directory, attn=variant.split()[-1])
    return model


@torch.inference_mode()
def prefill(model, idx: torch.Tensor):
    """Fill a KV cache with the whole prompt and return the last position's logits."""
    if isinstance(model, GPT2):
        c = model.config
        cache = KVCache(c.n_layer, idx.shape[0], c.n_head, idx.shape[1], c.head_dim,
                        dtype=next(model.parameters()).dtype)
        return model(idx, cache=cache, last_only=True, validate=False).logits   # [B, 1, n_vocab]
    return model(idx, use_cache=True, logits_to_keep=1).logits


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def prefill_peak_mb(variant: str, directory: str, tokens: int) -> float | None:
    """Peak resident memory (MB) a prefill of ``tokens`` adds, measured in a fresh subprocess.

    The child runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB: every block of 1 MiB
    or more is mapped on allocation and unmapped on free, so the RSS peak is the peak of live
    tensors. With glibc's default (a threshold that rises to 32 MiB as blocks are freed, the
    freed ones then kept in the heap) the same prefill read 123–152 MB from run to run.
    """
    if not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", variant, "--checkpoint", directory,
           "--tokens", str(tokens)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {variant!r} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def _memory_child(variant: str, directory: str, tokens: int) -> None:
    model = _load_variant(variant, directory)
    idx = _prompt(1, tokens, model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.n_vocab)
    prefill(model, idx[:, :8])                                             # warm up: lazy buffers, kernels
    gc.collect()
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:                          # reset VmHWM to VmRSS
        f.write("5")
    prefill(model, idx)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - before) / 1024}))


def bench_prefill(directory: str, sizes: Sizes, log=print, memory: bool = True) -> list[dict]:
    """Prefill of ``prefill_tokens`` (batch 1, last logits only): time and peak memory per variant."""
    T = sizes.prefill_tokens
    models = {variant: _load_variant(variant, directory) for variant in PREFILL_VARIANTS}
    idx = _prompt(1, T, models["gpt2mha fused"].config.n_vocab)
    times = interleaved_medians({v: (lambda m=m: prefill(m, idx)) for v, m in models.items()}, sizes.repeats)
    del models
    gc.collect()
    peaks = {v: prefill_peak_mb(v, directory, T) if memory and v in sizes.memory_variants else None
             for v in PREFILL_VARIANTS}
    for v in PREFILL_VARIANTS:
        log(f"prefill {v}: {times[v] * 1e3:.0f} ms, peak {peaks[v]} MB")
    f, e, hs = times["gpt2mha fused"], times["gpt2mha explicit"], times["transformers sdpa"]
    rows = [
        _ratio_row(f"prefill T={T} time: transformers sdpa / gpt2mha fused", hs * 1e3, f * 1e3, "ms",
                   note=f"transformers eager {times['transformers eager'] * 1e3:.0f} ms"),
        _ratio_row(f"prefill T={T} time: gpt2mha explicit / gpt2mha fused", e * 1e3, f * 1e3, "ms"),
    ]
    if memory:
        pf, pe, ph = peaks["gpt2mha fused"], peaks["gpt2mha explicit"], peaks["transformers sdpa"]
        hf_peaks = (f"transformers sdpa {ph:.0f} MB, eager {peaks['transformers eager']:.0f} MB; "
                    if ph is not None and peaks["transformers eager"] is not None else "")
        rows.append(_ratio_row(f"prefill T={T} peak memory (RSS added): fused / explicit", pf, pe, "MB",
                               target_max=0.6, note=f"{hf_peaks}KV cache included; live-tensor peak "
                                                    f"(MALLOC_MMAP_THRESHOLD_=1 MiB)"))
    for r in rows:
        log(r)
    return rows


# ---- the attention sublayer alone
def bare_core(attn, x: torch.Tensor) -> torch.Tensor:
    """``c_attn`` + SDPA (causal) + ``c_proj`` and nothing else: the floor for the sublayer."""
    B, T, C = x.shape
    h, hd = attn.n_head, C // attn.n_head
    qkv = torch.addmm(attn.c_attn.bias, x.view(B * T, C), attn.c_attn.weight)      # [B·T, 3C]
    q, k, v = qkv.view(B, T, 3, h, hd).permute(2, 0, 3, 1, 4)                     # 3 × [B, h, T, hd]
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)                   # [B, h, T, hd]
    y = torch.addmm(attn.c_proj.bias, a.transpose(1, 2).reshape(B * T, C), attn.c_proj.weight)
    return y.view(B, T, C)


def attention_variants(n_embd: int, n_head: int, T: int, seed: int = 0) -> dict:
    """Same-weights attention sublayers: name → callable ``x [B, T, n_embd] → y``."""

    transformers = _require_transformers()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    torch.manual_seed(seed)
    ours = CausalSelfAttention(n_embd, n_head).eval()
    with torch.no_grad():
        ours.c_attn.bias.normal_(std=0.02)
        ours.c_proj.bias.normal_(std=0.02)
    fns = {"gpt2mha CausalSelfAttention (fused)": lambda x: ours(x)[0],
           "bare c_attn + SDPA + c_proj": lambda x: bare_core(ours, x)}
    book = fused_to_mha(ours, context_length=T, qkv_bias=True).eval()
    book.attn_impl = "explicit"                              # the book's own core (its default)
    fns["book MultiHeadAttention"] = lambda x: book(x)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]   # additive causal mask
    for impl in ("eager", "sdpa"):
        cfg = transformers.GPT2Config(n_embd=n_embd, n_head=n_head, n_positions=T, attn_implementation=impl)
        hf = GPT2Attention(cfg, layer_idx=0).eval()
        with torch.no_grad():
            for name in ("c_attn", "c_proj"):
                getattr(hf, name).weight.copy_(getattr(ours, name).weight)
                getattr(hf, name).bias.copy_(getattr(ours, name).bias)
        fns[f"transformers GPT2Attention {impl}"] = (
            (lambda x, hf=hf: hf(x, attention_mask=mask[..., :x.shape[1], :x.shape[1]])[0]) if impl == "eager"
            else (lambda x, hf=hf: hf(x)[0]))
    return fns


def bench_attention(sizes: Sizes, n_embd: int = 768, n_head: int = 12, log=print) -> list[dict]:
    B, T = sizes.attn_batch, sizes.attn_tokens
    fns = attention_variants(n_embd, n_head, T)
    x = torch.randn(B, T, n_embd, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = fns["bare c_attn + SDPA + c_proj"](x)
        agree = {name: bool(torch.allclose(fn(x), ref, atol=1e-4, rtol=1e-4)) for name, fn in fns.items()}
        times = interleaved_medians({name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}, sizes.attn_repeats)
    for name in fns:
        log(f"attention {name}: {times[name] * 1e3:.1f} ms, same output {agree[name]}")
    ours, core = times["gpt2mha CausalSelfAttention (fused)"], times["bare c_attn + SDPA + c_proj"]
    shape = f"B={B}, T={T}, {n_head}x{n_embd // n_head}"
    rows = [_ratio_row(f"attention sublayer {shape}: gpt2mha / bare fused core", ours * 1e3, core * 1e3, "ms",
                       target_max=1.05)]
    for name in fns:
        if name.startswith(("book", "transformers")):
            r = _ratio_row(f"attention sublayer {shape}: {name} / gpt2mha", times[name] * 1e3, ours * 1e3, "ms",
                           target_min=2 if name.startswith("book") else None,
                           note="" if agree[name] else "OUTPUT DIFFERS")
            rows.append(r)
    for r in rows:
        log(r)
    return rows


# ---- low precision
def real_text_tokens(config: GPT2Config, n_tokens: int, path: str | None = None,
                     tail: bool = False) -> torch.Tensor | None:
    """``n_tokens`` tokens of real text (tinyshakespeare by default) in the model's tokenizer:
    the first ones, or with ``tail`` the last ones (the part a model trained on the first 90%
    never saw)."""

    path = path or REPO_TEXT
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = text[-n_tokens * 8:] if tail else text[:n_tokens * 8]
    ids = get_tokenizer(config.tokenizer).encode(text)
    return torch.tensor(ids[-n_tokens:] if tail else ids[:n_tokens], dtype=torch.long)


@torch.inference_mode()
def top1_agreements(reference: GPT2, other: GPT2, tokens: torch.Tensor,
                    min_margin: float = DECISIVE) -> tuple[float, float]:
    """``(all, decisive)``: the fraction of positions where ``other``'s argmax equals
    ``reference``'s (teacher forcing, windows of n_ctx tokens), over every position and over the
    positions where the reference is decisive: its two most likely tokens differ in probability
    by at least ``min_margin`` (near-ties flip under any rounding, so these measure the
    precision, not the coin toss). One forward of each model per window; nan where no position
    counts."""
    n_ctx = reference.config.n_ctx
    same = [0, 0]
    total = [0, 0]
    for start in range(0, len(tokens), n_ctx):
        window = tokens[start:start + n_ctx][None]
        ref = reference(window).logits.float()                             # [1, T, n_vocab]
        top2 = ref.softmax(-1).topk(2, dim=-1).values
        agree = ref.argmax(-1) == other(window).logits.argmax(-1)
        for i, keep in enumerate((torch.ones_like(agree), (top2[..., 0] - top2[..., 1]) >= min_margin)):
            same[i] += int((agree & keep).sum())
            total[i] += int(keep.sum())
    a, d = (s_ / t_ if t_ else float("nan") for s_, t_ in zip(same, total))
    return a, d


def top1_agreement(reference: GPT2, other: GPT2, tokens: torch.Tensor, min_margin: float = 0.0) -> float:
    """Fraction of positions where ``other``'s argmax equals ``reference``'s; with ``min_margin``
    > 0 only over the positions where the reference is decisive (:func:`top1_agreements`)."""
    agree, decisive = top1_agreements(reference, other, tokens, min_margin)
    return decisive if min_margin > 0 else agree


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


def memory_bandwidth(mb: int = 340, repeats: int = 5) -> float:
    """Bytes/s ``torch.sum`` reads from a float32 tensor of ``mb`` MB (larger than any cache):
    the rate a decode step's weight reads can hope for on this machine."""
    x = torch.ones(mb * 250_000)
    t = median_seconds(lambda: x.sum(), repeats, warmup=1)
    return x.numel() * 4 / t


def step_bytes(model: GPT2) -> int:
    """Bytes of weights one decode step reads at batch 1: every block matrix and the LM head as
    stored for the kernels (int8/int4 with their scales, or float), with their biases."""

    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            names = ("weight", "scales") if m.scheme == "int8" else ("packed", "scale_zero")
            total += sum(getattr(m, n).nbytes for n in names) + (m.bias.nbytes if m.bias is not None else 0)
    return total


def resident_mb(directory: str) -> float | None:
    """Peak resident memory (MB) that loading ``directory`` and greedily decoding 8 tokens adds to
    a fresh process (weights, decode-time copies, cache), measured like :func:`prefill_peak_mb`."""
    if not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", "resident", "--checkpoint", directory]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"resident-memory child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def _resident_child(directory: str) -> None:
    gc.collect()
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model = load_ours(directory)
    ours_greedy(model, _prompt(1, 4, model.config.n_vocab), 8)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - before) / 1024}))


def logits_cosine(reference: GPT2, other: GPT2, tokens: torch.Tensor) -> float:
    """Cosine similarity of ``other``'s logits to ``reference``'s over real text (all positions
    of the first n_ctx-token window, flattened)."""
    window = tokens[:reference.config.n_ctx][None]
    with torch.inference_mode():
        a, b = reference(window).logits.double(), other(window).logits.double()
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


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
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
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
