"""Quantized prefill against float32, per product route: ``python benchmarks/quant_prefill.py kernels|prefill|quality|quality-int4``.

The measurements behind ``QuantizedLinear``'s per-shape choice (``DEQUANTIZE_FROM_ROWS``) and
its ``activations="per_row"`` option, on CPUs whose int8 kernel is FBGEMM (no VNNI/AMX):

- ``kernels``: the block matrices of GPT-2 124M (``--n-layer`` layers of the four
  ``BLOCK_SHAPES``) as ``QuantizedLinear`` layers, ``--rows`` input rows, each route forced:
  float32 ``addmm`` over ``[in, out]`` (the float model's Conv1D), int8 two 7-bit pieces on
  FBGEMM, int8 dequantized (the scratch route), int8 dequantized as a fresh ``q · s`` per call
  (the route it replaced), int8 ``per_row`` (W8A7), int4's bf16 kernel, int4 dequantized, and
  int4 dequantized by ``dequantize_int4(unpack_int4(...))`` per call (the route it replaced).
- ``prefill``: random GPT-2 124M (``GPT2(GPT2Config())``) in float32, int8 and int4 (RTN),
  prefilling ``T`` tokens into a ``KVCache`` with last-position logits, for each ``--lengths``;
  quantized models with the default per-shape choice and with each route forced.
- ``quality``: the built-in ``shakespeare-byte`` model, int8 RTN (``--method``), top-1
  agreement with float32 and bits/byte on its last 8192 held-out bytes (as benchmarks/results/quality.json's
  peers' rows: windows of n_ctx, a window's first byte unscored), for ``activations="exact"`` and
  ``"per_row"``, and for other activation roundings (over the 8-bit weights) simulated in float (``x`` rounded and
  dequantized, then ``x̂ @ deq(W)ᵀ``: the integer products' result up to float32 rounding).
  Every product runs on the quantized kernels here (the dequantized route is forbidden), so
  "exact" means the integer pieces.
- ``quality-int4``: the same measure for the int4 configurations of the quality table
  (docs/explanation/quantization.md): W4A8 (``activations="per_block"``, every product: the
  scored windows are prompts) and the exact route beside each, groups of 32 and 64, the int8 or
  the int4 head, GPTQ and RTN.

Timing: one thread (``--threads``), CPU time (``time.process_time``, so time other processes
take from the core is not counted), contenders round-robin in one process, median of
``--repeats`` after one untimed round.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import REPO_TEXT, real_text_tokens, top1_agreements  # noqa: E402
from gpt2mha import GPT2, GPT2Config, KVCache  # noqa: E402
from gpt2mha.inference.quant import int8_linear, linear as qlinear  # noqa: E402
from gpt2mha.inference.quant.linear import QuantizedLinear, int8_kernel  # noqa: E402
from gpt2mha.inference.quant.schemes import dequantize_int4, unpack_int4  # noqa: E402

BLOCK_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))   # (in, out) of one 124M block
NEVER, ALWAYS = 1 << 40, 1


def process_medians(fns: dict, repeats: int) -> dict:
    """Median CPU seconds of each callable, run round-robin after one untimed round."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def forced(fn, int8=None, int4=None):
    """``fn`` run with ``DEQUANTIZE_FROM_ROWS`` set to force (``ALWAYS``) or forbid (``NEVER``)
    the dequantized route."""
    def run():
        saved = dict(qlinear.DEQUANTIZE_FROM_ROWS)
        qlinear.DEQUANTIZE_FROM_ROWS.update({k: v for k, v in (("int8", int8), ("int4", int4)) if v is not None})
        try:
            return fn()
        finally:
            qlinear.DEQUANTIZE_FROM_ROWS.update(saved)
    return run


def layers(n_layer: int, seed: int = 0):
    """float32 ``[in, out]`` weights with biases, and the int8 and int4 (g32) layers made from them."""
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(n_out, n_in, generator=g) * 0.02, torch.zeros(n_out))
          for _ in range(n_layer) for n_in, n_out in BLOCK_SHAPES]
    q8 = [QuantizedLinear.from_float(w, b, "int8") for w, b in ws]
    q4 = [QuantizedLinear.from_float(w, b, "int4", 32) for w, b in ws]
    r8 = [copy.deepcopy(m) for m in q8]
    for m in r8:
        m.activations = "per_row"
    return [(w.t().contiguous(), b) for w, b in ws], q8, q4, r8


def kernels(args) -> None:
    io32, q8, q4, r8 = layers(args.n_layer)
    print(f"{len(io32)} block matrices of 124M, {torch.get_num_threads()} thread(s), int8 kernel {int8_kernel()}, "
          f"load {os.getloadavg()[0]:.2f}")
    for M in args.rows:
        x = {n: torch.randn(M, n, generator=torch.Generator().manual_seed(M)) for n in (768, 3072)}
        fns = {
            "float32 addmm [in,out]": lambda: [torch.addmm(b, x[w.shape[0]], w) for w, b in io32],
            "int8 exact: 7-bit pieces (FBGEMM)": forced(lambda: [m(x[m.n_in]) for m in q8], int8=NEVER),
            "int8 exact: dequantized (scratch)": forced(lambda: [m(x[m.n_in]) for m in q8], int8=ALWAYS),
            "int8 exact: dequantized fresh q*s": lambda: [F.linear(x[m.n_in], m.dequantized(), m.bias) for m in q8],
            "int8 W8A7 per_row": lambda: [m(x[m.n_in]) for m in r8],
            "int4: bf16 kernel": forced(lambda: [m(x[m.n_in]) for m in q4], int4=NEVER),
            "int4: dequantized (scratch)": forced(lambda: [m(x[m.n_in]) for m in q4], int4=ALWAYS),
            "int4: dequantized fresh unpack": lambda: [F.linear(x[m.n_in], dequantize_int4(
                unpack_int4(m.weight), m.scale_zero, m.group_size), m.bias) for m in q4],
            "default int8 (per-shape choice)": lambda: [m(x[m.n_in]) for m in q8],
            "default int4 (per-shape choice)": lambda: [m(x[m.n_in]) for m in q4],
        }
        med = process_medians(fns, args.repeats)
        base = med["float32 addmm [in,out]"]
        print(f"\n{M} row(s): ms per pass over the matrices, speed over float32")
        for name, t in med.items():
            print(f"  {name:36} {t * 1e3:9.2f} ms {base / t:6.2f}x", flush=True)


def prefill(args) -> None:
    torch.manual_seed(0)
    base = GPT2(GPT2Config()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        i8 = copy.deepcopy(base).quantize("int8", method="rtn")
        i4 = copy.deepcopy(base).quantize("int4", method="rtn")
        r8 = copy.deepcopy(base).quantize("int8", method="rtn", activations="per_row")
    print(f"random GPT-2 124M, {torch.get_num_threads()} thread(s), int8 kernel {int8_kernel()}, "
          f"load {os.getloadavg()[0]:.2f}, DEQUANTIZE_FROM_ROWS {qlinear.DEQUANTIZE_FROM_ROWS}")

    def run(model, idx):
        cache = KVCache(12, 1, 12, idx.shape[1], 64)
        return model(idx, cache=cache, last_only=True, validate=False).logits

    for T in args.lengths:
        idx = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(T))
        fns = {"float32": lambda: run(base, idx),
               "int8 (default)": lambda: run(i8, idx),
               "int8 pieces only": forced(lambda: run(i8, idx), int8=NEVER),
               "int8 dequantized only": forced(lambda: run(i8, idx), int8=ALWAYS),
               "int8 per_row (W8A7)": lambda: run(r8, idx),
               "int4 (default)": lambda: run(i4, idx),
               "int4 kernel only": forced(lambda: run(i4, idx), int4=NEVER, int8=NEVER),
               "int4 dequantized only": forced(lambda: run(i4, idx), int4=ALWAYS)}
        med = process_medians(fns, args.repeats)
        ref = med["float32"]
        print(f"\nT = {T}: ms, speed over float32")
        for name, t in med.items():
            print(f"  {name:24} {t * 1e3:9.1f} ms {ref / t:6.2f}x", flush=True)


# ------------------------------------------------------------------ quality of activation roundings
def _round_sym(x, levels, block=None):
    M, K = x.shape
    xb = x.view(M, K // (block or K), -1)
    a = xb.abs().amax(-1, keepdim=True).clamp(min=1e-30) / levels
    return (torch.round(xb / a) * a).view(M, K)


def _round_asym(x, levels, block=None):
    M, K = x.shape
    xb = x.view(M, K // (block or K), -1)
    lo = xb.amin(-1, keepdim=True)
    a = (xb.amax(-1, keepdim=True) - lo).clamp(min=1e-30) / levels
    return (torch.round((xb - lo) / a) * a + lo).view(M, K)


def _block(K, b):
    return b if K % b == 0 else math.gcd(K, b)


#: Simulated activation roundings: name → x ↦ x̂ (``[M, K]`` float32).
SIMULATED = {
    "symmetric 7-bit per row (int8_matmul pieces=1)": lambda x: _round_sym(x, 63),
    "symmetric 8-bit per row (CTranslate2-like)": lambda x: _round_sym(x, 127),
    "asymmetric 7-bit per row": lambda x: _round_asym(x, 127),
    "asymmetric 8-bit per row (8-bit weights)": lambda x: _round_asym(x, 255),
    "symmetric 7-bit per (row, 32) (q8_0-like, 7 bits)": lambda x: _round_sym(x, 63, _block(x.shape[1], 32)),
    "symmetric 8-bit per (row, 32) (llama.cpp q8_0-like)": lambda x: _round_sym(x, 127, _block(x.shape[1], 32)),
    "symmetric 7-bit per (row, 128)": lambda x: _round_sym(x, 63, _block(x.shape[1], 128)),
    "symmetric 7-bit per (row, 256)": lambda x: _round_sym(x, 63, _block(x.shape[1], 256)),
    "asymmetric 7-bit per (row, 128)": lambda x: _round_asym(x, 127, _block(x.shape[1], 128)),
    "asymmetric 7-bit per (row, 256)": lambda x: _round_asym(x, 127, _block(x.shape[1], 256)),
}


def bits_per_byte(model, tokens: torch.Tensor, n_ctx: int) -> float:
    """Mean next-byte cross-entropy in bits over windows of n_ctx (each window's first byte unscored)."""
    nats, count = 0.0, 0
    for start in range(0, len(tokens), n_ctx):
        w = tokens[start:start + n_ctx]
        nats += float(F.cross_entropy(model(w[None]).logits[0, :-1].double(), w[1:], reduction="sum"))
        count += len(w) - 1
    return nats / count / math.log(2)


def quality(args) -> None:
    ref = GPT2.from_pretrained("shakespeare-byte").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = copy.deepcopy(ref).quantize("int8", method=args.method)
    per_row = copy.deepcopy(exact)
    for m in per_row.modules():
        if isinstance(m, QuantizedLinear):
            m.activations = "per_row"
    per_row.quantization["activations"] = "per_row"
    text = real_text_tokens(ref.config, args.bytes, REPO_TEXT, tail=True)
    n = ref.config.n_ctx
    print(f"shakespeare-byte, int8 {args.method}, {len(text)} held-out bytes, int8 kernel {int8_kernel()}; "
          f"float32 bits/byte {bits_per_byte(ref, text, n):.4f}")
    original = int8_linear.int8_matmul                                  # what the int8 layers call
    runs = [("exact (default)", exact, None), ("per_row: asymmetric 8-bit per row, 7-bit weights", per_row, None)]
    runs += [(f"{k} [simulated]", exact, f) for k, f in SIMULATED.items()]
    for name, model, rounding in runs:
        if rounding is not None:                                         # x̂ @ deq(W)ᵀ in float32
            int8_linear.int8_matmul = (lambda x, q, s, *a, f=rounding, **k:
                                       f(x.float()) @ (q.float() * s.float()[:, None]).t())
        try:
            run = forced(lambda: (top1_agreements(ref, model, text), bits_per_byte(model, text, n)), int8=NEVER)
            (top1, decisive), bpb = run()
        finally:
            int8_linear.int8_matmul = original
        print(f"  {name:56} top-1 {top1:.2%} (decisive {decisive:.2%})  bits/byte {bpb:.4f}", flush=True)


#: quality-int4's configurations: (name, quantize() keywords)
INT4_CONFIGS = (("int4 g32 (GPTQ)", {}), ("int4 g32 (RTN)", {"method": "rtn"}),
                ("int4 g64 (GPTQ)", {"group_size": 64}), ("int4 g32, int4 head (GPTQ)", {"head": "int4"}),
                ("int4 g64, int4 head (GPTQ)", {"head": "int4", "group_size": 64}),
                ("int4 g32, int4 head (RTN)", {"head": "int4", "method": "rtn"}))


def quality_int4(args) -> None:
    from gpt2mha.inference.quant import set_activations
    ref = GPT2.from_pretrained("shakespeare-byte").eval()
    text = real_text_tokens(ref.config, args.bytes, REPO_TEXT, tail=True)
    n = ref.config.n_ctx
    print(f"shakespeare-byte, {len(text)} held-out bytes; float32 bits/byte {bits_per_byte(ref, text, n):.4f}")
    with torch.inference_mode():
        for name, kw in INT4_CONFIGS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = copy.deepcopy(ref).quantize("int4", activations="per_block", **kw)
            for acts in ("per_block", "exact"):
                set_activations(model, acts)
                top1, decisive = top1_agreements(ref, model, text)
                print(f"  {name:30} activations={acts:9} top-1 {top1:.2%} (decisive {decisive:.2%})  "
                      f"bits/byte {bits_per_byte(model, text, n):.4f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("kernels", "prefill", "quality", "quality-int4"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median taken)")
    p.add_argument("--rows", default="1,8,16,32,64,128,256,512", help="kernels: input rows")
    p.add_argument("--n-layer", type=int, default=12, help="kernels: blocks of 124M matrices")
    p.add_argument("--lengths", default="1,8,64,512", help="prefill: prompt lengths")
    p.add_argument("--method", default="rtn", choices=("rtn", "gptq"), help="quality: int8 rounding")
    p.add_argument("--bytes", type=int, default=8192, help="quality: held-out bytes")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        p.error(f"--repeats={args.repeats} and --threads={args.threads} must be >= 1")
    args.rows = [int(r) for r in args.rows.split(",")]
    args.lengths = [int(r) for r in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        {"kernels": kernels, "prefill": prefill, "quality": quality, "quality-int4": quality_int4}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
