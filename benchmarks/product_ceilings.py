"""Where a float32, bf16 or fp16 step's products spend their time, against torch's own GEMMs on the
same shapes (issue 43, item 2): ``python benchmarks/product_ceilings.py [--threads 2] [--rows 1,8,512]
[--dtypes float32,bf16,fp16] [--json FILE]``.

The five products of a GPT-2 124M step (per block: ``c_attn`` 768→2304, ``attn.c_proj`` 768→768,
``c_fc`` 768→3072 with GELU, ``mlp.c_proj`` 3072→768; then the LM head 768→50257 over ``wte``),
random weights, at each row count M (1 and 8: decode batches; 512: a prompt), each product run
over as many distinct weights as a step holds (12 per block product, 1 head), so they stream
from memory as in a step, not from cache. For each dtype:

* gpt2mha's kernel (:func:`gpt2mha.inference.dense.conv1d` / ``linear``: ``conv1d_f32``,
  ``conv1d_bf16``, ``conv1d_f16``, ``linear_f32``, ``linear_bf16``, ``linear_f16``; fixed summation
  order, batch invariant);
* torch's product on the same tensors (``torch.addmm``: MKL's SGEMM for float32, oneDNN's bf16
  GEMM for bf16, with bf16 activations; for fp16 torch's CPU fp16 GEMM, oneDNN's where the CPU
  has AVX-512 FP16 or AMX-FP16, else its own fallback), GELU apart: the ceiling the issue names
  ("the peak oneDNN/MKL reach").

Printed per product and for a whole step (12 blocks + the head): ms (median of ``--repeats``
after a warm-up, the two taking turns), GFLOP/s (2·M·K·N per product) and GB/s of weights
(the bytes a product reads once), and ours / torch's. Times alone are noise on a shared machine;
the ratios within one run are the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import median_seconds  # noqa: E402

#: (name, K, N, layout, count per step): "conv" is GPT-2's Conv1D [K, N]; "linear" the head's [N, K]
PRODUCTS = (("c_attn", 768, 2304, "conv", 12), ("attn.c_proj", 768, 768, "conv", 12),
            ("c_fc", 768, 3072, "conv", 12), ("mlp.c_proj", 3072, 768, "conv", 12),
            ("lm_head", 768, 50257, "linear", 1))


def measure(M: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    """One row per product: ours and torch's seconds, GFLOP/s and weight GB/s at ``M`` rows."""
    from gpt2mha.inference import dense

    g = torch.Generator().manual_seed(0)
    out = []
    for name, K, N, layout, count in PRODUCTS:
        x = torch.randn(M, K, generator=g)
        shape = (K, N) if layout == "conv" else (N, K)
        ws = [(torch.randn(*shape, generator=g) * 0.02).to(dtype) for _ in range(count)]  # a step's copies
        b = torch.randn(N, generator=g) * 0.02 if layout == "conv" else None
        gelu = name == "c_fc"
        xt, bt = x.to(dtype), (b.to(dtype) if b is not None else None)
        if layout == "conv":
            def ours():
                for w in ws:
                    dense.conv1d(x, w, b, gelu=gelu)

            def theirs():
                for w in ws:
                    torch.addmm(bt, xt, w)
        else:
            def ours():
                for w in ws:
                    dense.linear(x, w)

            def theirs():
                for w in ws:
                    torch.mm(xt, w.t())
        t_ours, t_theirs = [], []
        for _ in range(3):                                                          # in turns
            t_ours.append(median_seconds(ours, repeats))
            t_theirs.append(median_seconds(theirs, repeats))
        a, c = statistics.median(t_ours) / count, statistics.median(t_theirs) / count   # per product
        flops, wbytes = 2 * M * K * N, K * N * ws[0].element_size()
        out.append(dict(product=name, M=M, dtype=str(dtype).split(".")[-1], count=count, ours_ms=a * 1e3,
                        torch_ms=c * 1e3, ours_gflops=flops / a / 1e9, torch_gflops=flops / c / 1e9,
                        ours_gbs=wbytes / a / 1e9, torch_gbs=wbytes / c / 1e9, ratio=c / a))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,8,512", help="row counts M, comma-separated (default 1,8,512)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bf16,fp16", help="comma-separated, of float32, bf16, fp16 (default: all)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if any(r < 1 for r in rows) or args.threads < 1 or args.repeats < 1:
        p.error("--rows, --threads and --repeats must be positive")
    names = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    picked = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not picked or any(d not in names for d in picked):
        p.error(f"--dtypes: {args.dtypes!r}: expected some of {', '.join(names)}")
    torch.set_num_threads(args.threads)
    from gpt2mha.kernels import loader
    loader.load()
    res = []
    print(f"torch {torch.__version__}, {args.threads} threads; ours / torch > 1: ours faster")
    print("| dtype | M | product | ours ms | torch ms | ours GFLOP/s | torch GFLOP/s | ours GB/s | torch GB/s | ours / torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (names[d] for d in picked):
        for M in rows:
            rs = measure(M, dtype, args.repeats)
            res += rs
            for r in rs:
                print(f"| {r['dtype']} | {M} | {r['product']} | {r['ours_ms']:.3f} | {r['torch_ms']:.3f} | "
                      f"{r['ours_gflops']:.1f} | {r['torch_gflops']:.1f} | {r['ours_gbs']:.1f} | {r['torch_gbs']:.1f} | "
                      f"{r['ratio']:.2f}x |", flush=True)
            ours = sum(r["ours_ms"] * r["count"] for r in rs)
            theirs = sum(r["torch_ms"] * r["count"] for r in rs)
            print(f"| {rs[0]['dtype']} | {M} | **a step's products** | {ours:.2f} | {theirs:.2f} | | | | | "
                  f"{theirs / ours:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "product_ceilings", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "python benchmarks/product_ceilings.py " + " ".join(argv or sys.argv[1:]),
                       "source": "written by benchmarks/product_ceilings.py --json", "rows": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
