"""The float32 sections of ``benchmarks/bench.py`` (``gpt2mha bench``), gpt2mha against
transformers on the same weights: ``decode`` (tokens/s at each batch size, and the ceiling that a
step's weight matmuls alone allow, :func:`ceiling_row`, which the ``lowp`` section's bf16 row uses
too), ``cache`` (the static KV cache against recomputing the sequence), ``positions`` (a step far
into the context against one early), ``prefill`` (time in this process, peak memory in the
children of ``bench_memory.py``) and ``attention`` (the sublayer alone, against the bare fused
core, the book's ``MultiHeadAttention`` and transformers'). Each ``bench_*`` takes bench.py's
``Sizes`` and returns its table rows.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from bench_common import (_prompt, _ratio_row, _require_transformers, greedy_without_cache, hf_greedy,
                          interleaved_medians, median_seconds, ours_greedy)
from bench_memory import PREFILL_VARIANTS, _load_variant, prefill, prefill_peak_mb
from gpt2mha.api import GPT2
from gpt2mha.core.attention import CausalSelfAttention
from gpt2mha.core.kv_cache import KVCache
from gpt2mha.core.model import logits_dtype
from gpt2mha.inference.fast import for_decoding
from gpt2mha.learn.attention_layouts import fused_to_mha

if TYPE_CHECKING:                                   # bench.py defines Sizes, and imports this module
    from bench import Sizes


# ------------------------------------------------------------------------------ decode, cache, positions
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

