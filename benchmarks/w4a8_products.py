"""int4 W4A8 products on packed tiles against the other products of the same shapes:
``python benchmarks/w4a8_products.py [--rows 1,8,64,512] [--threads 2] [--json FILE]``.

For each of GPT-2 124M's four block shapes (and the head at up to 8 rows), ``--layers`` distinct
weights (so a pass streams them from memory, as a step does), ``--rows`` activation rows:

- ``w4a8``: ``torch.ops.gpt2mha.int4_a8_packed`` (int4 per_block layers' product, every row count);
- ``w7a8``: ``torch.ops.gpt2mha.int8_per_row`` (int8 per_row layers' product) on the same shape;
- ``f32``: ``torch.ops.gpt2mha.conv1d_f32`` over float32 weights (a float32 model's product, and an
  exact int4 model's prompts over its dequantized weights);
- ``torch_int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (PyTorch's int4 kernel, bf16
  activations: an exact int4 layer's route where gpt2mha's kernels are not loaded; N a multiple
  of 16 only, so not the head).

Prints ms per product, GMAC/s and each as a ratio to f32 (higher is faster), the variants timed
in turn (round-robin), best of ``--repeats`` passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = (("attn.c_attn", 768, 2304), ("attn.c_proj", 768, 768), ("mlp.c_fc", 768, 3072), ("mlp.c_proj", 3072, 768),
          ("head", 768, 50257))


def contenders(K: int, N: int, layers: int, G: int, rows: int, g: torch.Generator) -> dict:
    """name → a function running the product of ``rows`` rows over each of ``layers`` weights."""
    from gpt2mha.inference.quant import gemv
    from gpt2mha.inference.quant.schemes import pack_int4, quantize_int4
    x = torch.randn(rows, K, generator=g)
    w4, w7, wf, wt = [], [], [], []
    for _ in range(layers):
        w = torch.randn(N, K, generator=g) * 0.05
        q, sz = quantize_int4(w, G)
        w4.append(torch.ops.gpt2mha.int4_pack_a8(pack_int4(q), sz.transpose(0, 1).contiguous(), G))
        q7 = torch.randint(-63, 64, (N, K), dtype=torch.int8, generator=g)
        s = torch.rand(N, generator=g) * 0.01
        w7.append((gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), s, (q7.float() * s[:, None]).sum(1)))
        wf.append(w.t().contiguous())
        if N % 16 == 0:                                   # torch's int4 packing takes N in 16s
            wt.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), sz))
    xb = x.bfloat16()
    out = {
        "w4a8": lambda: [torch.ops.gpt2mha.int4_a8_packed(x, p, pr, G, N, None) for p, pr in w4],
        "w7a8": lambda: [torch.ops.gpt2mha.int8_per_row(x, *a, None, False) for a in w7],
        "f32": lambda: [torch.ops.gpt2mha.conv1d_f32(x, w, None, False) for w in wf],
    }
    if wt:
        out["torch_int4"] = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, G, sz) for p, sz in wt]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="distinct weights per shape (4: ~10-40 MB int4 each)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from gpt2mha import kernels
    if not kernels.available():
        print(f"gpt2mha's kernels are not loaded: {kernels.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"load average at start: {os.getloadavg()}; {args.threads} threads, group {args.group_size}")
    print("| shape [K, N] | rows | w4a8 | w7a8 | f32 | torch int4 (bf16 x) | w4a8 GMAC/s |")
    print("|---|---|---|---|---|---|---|")
    for name, K, N in SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            if name == "head" and rows > 8:
                continue
            layers = 1 if name == "head" else args.layers
            fs = contenders(K, N, layers, args.group_size, rows, g)
            for f in fs.values():
                f()
            best = {k: float("inf") for k in fs}
            for _ in range(args.repeats):
                for k, f in fs.items():
                    t = time.perf_counter()
                    f()
                    best[k] = min(best[k], (time.perf_counter() - t) / layers)
            ms = {k: v * 1e3 for k, v in best.items()}
            cells = " | ".join(f"{ms[k]:.3f} ms ({ms['f32'] / ms[k]:.2f}x)" if k in ms else "—"
                               for k in ("w4a8", "w7a8", "f32", "torch_int4"))
            gmacs = rows * K * N / best["w4a8"] / 1e9
            print(f"| {name} [{K}, {N}] | {rows} | {cells} | {gmacs:.0f} |", flush=True)
            results.append({"shape": name, "K": K, "N": N, "rows": rows, "ms": ms, "w4a8_gmac_s": gmacs})
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "w4a8_products", "date": time.strftime("%Y-%m-%d"),
                       "command": "python benchmarks/w4a8_products.py " + " ".join(argv or sys.argv[1:]),
                       "source": "written by benchmarks/w4a8_products.py --json",
                       "host": platform.processor() or platform.machine(), "threads": args.threads,
                       "group_size": args.group_size, "units": {"ms": "ms per product, best of repeats"},
                       "results": results}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
