"""Batch invariance: which kernels give a row the same bits in any batch, a sweep over the
built-in model, and what the invariant decode path costs.

    python benchmarks/batch_invariance.py survey [--threads 1,2]
    python benchmarks/batch_invariance.py sweep [--prompts 32 --tokens 100]
    python benchmarks/batch_invariance.py cost [--model shakespeare-byte|124M] [--dtype float32]

``survey``: for each kernel, every row of a call of M rows (M = 1 … 64, and a few larger) against
the same row computed alone; attention against the span of keys it reads and the strides of the
cache it reads them from. ``sweep``: the issue's table on the built-in model: prompts generated
in one mixed batch against each alone (rows whose tokens or logits differ), per dtype and weight
format. ``cost``: decode and prefill throughput of the invariant path (what ``generate`` and the
server run) against the previous one (a left-padded prefill, one attention call over the longest
row's span with a mask, float32 products on the batch's own row count), at batch 1, 8 and 16.
What it costs: docs/explanation/batch-invariance.md; the runs, with their conditions:
benchmarks/archive/RESULTS-2026-11-29-to-12-02.md, "Batch invariance".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpt2mha import GPT2, GPT2Config, KVCache  # noqa: E402
from gpt2mha.inference.fast import for_decoding, pad_rows  # noqa: E402
from gpt2mha.inference.generate import left_pad  # noqa: E402
from gpt2mha.inference.quant import QuantizedLinear, gemv, int8_matmul  # noqa: E402
from gpt2mha.inference.quant.schemes import quantize_int8  # noqa: E402

MS = list(range(1, 65)) + [100, 128, 256, 300]


# ------------------------------------------------------------------------------ survey
def row_classes(fn, x: torch.Tensor, ms=MS) -> list[int]:
    """The M for which some row of ``fn(x[:M])`` differs (bitwise) from ``fn`` of that row alone."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(max(ms))])
    return [M for M in ms if not torch.equal(fn(x[:M]), alone[:M])]


def survey_products(K=768, N=2304, ms=MS) -> dict[str, list[int]]:
    """Every product kernel the decode view uses, and the raw ones it avoids: the row counts M
    (of ``ms``) at which some row differs from that row alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(ms), K, generator=gen)
    W = torch.randn(K, N, generator=gen) * 0.02
    b = torch.randn(N, generator=gen)
    out = {"float32 addmm (raw)": row_classes(lambda v: torch.addmm(b, v, W), x, ms),
           "float32 F.linear (raw)": row_classes(lambda v: F.linear(v, W.t().contiguous(), b), x, ms),
           "float32 addmm, rows padded to 4 (decode view)":
               row_classes(lambda v: torch.addmm(b, pad_rows(v), W)[:v.shape[0]], x, ms)}
    for dt in (torch.bfloat16, torch.float16):
        Wt, bt = W.t().contiguous().to(dt), b.to(dt)
        out[f"{dt} F.linear (decode view)"] = row_classes(lambda v: F.linear(v, Wt, bt), x.to(dt), ms)
    q, s = quantize_int8(W.t())
    xo = x.clone()
    xo[::7, 5] = 300.0                                          # outlier rows among ordinary ones
    out["int8 int8_matmul, outlier rows mixed in"] = row_classes(lambda v: int8_matmul(v, q, s), xo, ms)
    layer = QuantizedLinear.from_float(W.t(), b, "int4", 32)
    out["int4 _weight_int4pack_mm_for_cpu"] = row_classes(
        lambda v: torch.ops.aten._weight_int4pack_mm_for_cpu(v, layer.packed, 32, layer.scale_zero), x.to(torch.bfloat16), ms)
    if gemv.available():                          # one token per sequence on gpt2mha's kernel (decode view)
        out["int8 int8_gemv (decode view)"] = row_classes(lambda v: gemv.int8_gemv(v, q, s.float(), b), x, ms)
        out["int4 int4_gemv (decode view)"] = row_classes(
            lambda v: gemv.int4_gemv(v, layer.weight, layer.gemv_scales(), 32, layer.bias), x, ms)
    return out


def survey_attention(h=12, hd=64) -> dict[str, list[int]]:
    """SDPA and the explicit core: one decode query over 20 real keys read in a span S >= 20
    (masked keys behind), rows of a batch, and a cache buffer of another length (strides)."""
    from gpt2mha.core.attention import attend_explicit, attend_sdpa

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(16, h, 1, hd, generator=gen)
    k = torch.randn(16, h, 300, hd, generator=gen)
    v = torch.randn(16, h, 300, hd, generator=gen)
    out = {}
    for name, core in (("sdpa", attend_sdpa), ("explicit", attend_explicit)):
        def span(S, L=20):
            return core(q[:1], k[:1, :, :S], v[:1, :, :S], (torch.arange(S) < L)[None, None, None])
        ref = core(q[:1], k[:1, :, :20], v[:1, :, :20], None)
        out[f"attention {name}: 20 keys in a masked span S (S listed where it differs)"] = [
            S for S in (21, 24, 31, 32, 33, 40, 64, 65, 128, 200, 256, 300) if not torch.equal(span(S), ref)]
        alone = torch.cat([core(q[i:i + 1], k[i:i + 1, :, :50], v[i:i + 1, :, :50], None) for i in range(16)])
        out[f"attention {name}: rows of a batch, 50 keys each (B listed where it differs)"] = [
            B for B in range(1, 17) if not torch.equal(core(q[:B], k[:B, :, :50], v[:B, :, :50], None), alone[:B])]
        out[f"attention {name}: 50 keys in a cache buffer of T_max (T_max listed where it differs)"] = [
            T for T in (64, 100, 256, 1024) if not torch.equal(
                core(q[:1], torch.cat([k[:1, :, :50], torch.zeros(1, h, T - 50, hd)], 2)[:, :, :50],
                     torch.cat([v[:1, :, :50], torch.zeros(1, h, T - 50, hd)], 2)[:, :, :50], None), alone[:1])]
    return out


def survey(threads: list[int]) -> None:
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs")
    for n in threads:
        torch.set_num_threads(n)
        for name, bad in {**survey_products(), **survey_attention()}.items():
            shown = bad if len(bad) <= 12 else f"{bad[:12]}… ({len(bad)} values)"
            print(f"threads={n} {name}: {'invariant' if not bad else f'differs at {shown}'}")


# ------------------------------------------------------------------------------- sweep
def sweep(n_prompts: int, n_tokens: int) -> None:
    """The built-in model, ``n_prompts`` random prompts of 1 … 150 bytes generated as one batch
    against each alone: rows whose greedy tokens, or whose logits at some step, differ (float32
    with and without ``batch_invariant``, the other formats by default)."""
    import gpt2mha.inference.generate as G

    seen, real = [], G.sample_next
    G.sample_next = lambda logits, **kw: (seen.append(logits.clone()), real(logits, **kw))[1]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 151, (n_prompts,), generator=gen).tolist()
    prompts = [torch.randint(32, 127, (n,), generator=gen).tolist() for n in lengths]
    for dtype, fmt, flag in (("float32", None, False), ("float32", None, True), ("bfloat16", None, None),
                             ("float16", None, None), ("float32", "int8", None), ("bfloat16", "int4", None),
                             ("bfloat16", "int4-rtn", None)):
        model = GPT2.from_pretrained("shakespeare-byte", dtype=dtype)
        if fmt:
            scheme, _, method = fmt.partition("-")
            model.quantize(scheme, method=method or "gptq")
        t = time.perf_counter()
        seen.clear()
        batch = model.generate(prompts, n_tokens, temperature=0, batch_invariant=flag)[:, -n_tokens:]
        logits_b = torch.stack(seen, 1)
        tokens = logits = 0
        for i, p in enumerate(prompts):
            seen.clear()
            alone = model.generate([p], n_tokens, temperature=0, batch_invariant=flag)[0, -n_tokens:]
            tokens += not torch.equal(alone, batch[i])
            logits += not torch.equal(torch.stack(seen, 1)[0], logits_b[i])
        print(f"{dtype:8s} {fmt or 'float':8s} batch_invariant={flag}: rows whose {n_tokens} greedy tokens differ {tokens}/{n_prompts}, "
              f"whose logits differ at some step {logits}/{n_prompts} ({time.perf_counter() - t:.0f} s)")
    G.sample_next = real


# -------------------------------------------------------------------------------- cost
def previous_view(model):
    """The decode view before batch invariance: float32 products on the batch's own rows."""
    return for_decoding(model, batch_invariant=False)


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def decode_rate(model, B: int, invariant: bool, steps: int, reps: int) -> float:
    """Decode tokens/s of ``B`` rows holding different lengths (32, 39, 46, … tokens)."""
    c = model.config
    view = for_decoding(model, batch_invariant=True) if invariant else previous_view(model)
    lengths = [32 + 7 * i for i in range(B)]
    cache = KVCache(c.n_layer, B, c.n_head, c.n_ctx, c.head_dim, dtype=model.wte.weight.dtype)
    ids = torch.randint(0, c.n_vocab, (B, max(lengths)), generator=torch.Generator().manual_seed(0))
    view(ids, cache=cache, validate=False)
    tok = ids[:, -1:]

    def run():
        cache.trim(lengths)
        for _ in range(steps):
            step = cache.plan(1) if invariant or B == 1 else cache.plan(1, span=cache.length + 1)
            view(tok, cache=cache, step=step, last_only=True, validate=False)
    return B * steps / best_of(run, reps)


@torch.inference_mode()
def prefill_rate(model, B: int, invariant: bool, reps: int) -> float:
    """Prefill prompt tokens/s of ``B`` prompts of 10, 17, 24, … tokens: each alone into its
    row (invariant) or one left-padded batch (previous)."""
    c = model.config
    view = for_decoding(model, batch_invariant=True) if invariant else previous_view(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, c.n_vocab, (10 + 7 * (i % 8),), generator=gen).tolist() for i in range(B)]
    cache = KVCache(c.n_layer, B, c.n_head, c.n_ctx, c.head_dim, dtype=model.wte.weight.dtype)

    def run():
        cache.trim([0] * B)
        if invariant:
            for b, p in enumerate(prompts):
                view(torch.tensor([p]), cache=cache.row(b), last_only=True, validate=False)
        else:
            idx, mask = left_pad(prompts)
            view(idx, attention_mask=mask.bool() if B > 1 else None, cache=cache, last_only=True, validate=False)
    return sum(map(len, prompts)) / best_of(run, reps)


def cost(model_name: str, dtypes: list[str], batches: list[int], steps: int, reps: int) -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {model_name}, threads={torch.get_num_threads()}, {load}")
    for dtype in dtypes:
        if model_name == "shakespeare-byte":
            model = GPT2.from_pretrained(model_name, dtype=dtype)
        else:
            model = GPT2(GPT2Config.from_preset(model_name)).eval().to(getattr(torch, dtype))
        for B in batches:
            d = [decode_rate(model, B, inv, steps, reps) for inv in (False, True)]
            p = [prefill_rate(model, B, inv, reps) for inv in (False, True)]
            print(f"{dtype:8s} B={B:2d}  decode tok/s previous {d[0]:8.1f}  invariant {d[1]:8.1f} ({d[1] / d[0]:.2f}x)   "
                  f"prefill tok/s previous {p[0]:8.1f}  invariant {p[1]:8.1f} ({p[1] / p[0]:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["survey", "sweep", "cost"])
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (survey) or one count")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--model", default="shakespeare-byte", help="shakespeare-byte or a preset (124M: random weights)")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    threads = [int(n) for n in (args.threads or str(torch.get_num_threads())).split(",")]
    if args.what == "survey":
        survey(threads)
        return 0
    torch.set_num_threads(threads[0])
    if args.what == "sweep":
        sweep(args.prompts, args.tokens)
    else:
        cost(args.model, args.dtype.split(","), [int(b) for b in args.batch.split(",")], args.steps, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
