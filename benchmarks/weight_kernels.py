"""How fast this machine's PyTorch kernels stream decode-sized weights: ``python benchmarks/weight_kernels.py``.

A decode step at batch 1 multiplies one row by every weight matrix once, so its speed is set
by how many bytes of weights per second the matmul kernels read. This script times the 48
block matrices of GPT-2 124M (per layer ``c_attn [768, 2304]``, ``c_proj [768, 768]``,
``c_fc [768, 3072]``, ``mlp.c_proj [3072, 768]``: 85M weights) for 1 and 8 rows, in float32,
bfloat16 and float16, stored ``[in, out]`` (GPT-2's Conv1D, ``x @ W``) and ``[out, in]``
(``nn.Linear``, ``F.linear(x, W)``), and reports GB/s of weights read. For reference it also
times a plain reduction over 340 MB (``torch.sum``), the memory bandwidth any kernel can hope
for. Each figure is the median of ``--repeats`` passes; the variants are timed in turn
(round-robin) so a slow spell of the shared machine hits them all alike.

This is the evidence behind "What stands in the way" in
benchmarks/archive/RESULTS-2026-11-29-to-12-02.md: on the 2-core
machine the float32 kernels read ~25 GB/s at one row (the bandwidth), the bf16/fp16 ones about
half that although they read half the bytes, and 8-row float32 matmuls about half.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench import interleaved_medians

#: (in, out) of the four weight matrices of one GPT-2 124M block, in forward order.
BLOCK_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))


def matrices(dtype: torch.dtype, layout: str, n_layer: int = 12, seed: int = 0) -> list[torch.Tensor]:
    """The ``n_layer`` blocks' weight matrices, ``[in, out]`` (layout "in,out") or ``[out, in]``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layer):
        for n_in, n_out in BLOCK_SHAPES:
            w = torch.randn(n_in, n_out, generator=g).to(dtype)
            out.append(w if layout == "in,out" else w.t().contiguous())
    return out


def pass_fn(ws: list[torch.Tensor], layout: str, rows: int):
    """One pass: every matrix times a ``[rows, in]`` input of its dtype (outputs discarded)."""
    dtype = ws[0].dtype
    inputs = {n: torch.randn(rows, n).to(dtype) for n in {768, 3072}}
    if layout == "in,out":
        return lambda: [inputs[w.shape[0]] @ w for w in ws]
    return lambda: [F.linear(inputs[w.shape[1]], w) for w in ws]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=11, help="passes per variant (median taken)")
    p.add_argument("--rows", default="1,8", help="comma-separated input rows (batch sizes)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 48 block matrices of GPT-2 124M")
    ref = torch.randn(85_000_000)                                      # 340 MB, out of every cache
    bw = interleaved_medians({"sum": lambda: ref.sum()}, args.repeats)["sum"]
    print(f"reference: torch.sum over {ref.numel() * 4 / 1e6:.0f} MB float32 reads {ref.numel() * 4 / bw / 1e9:.1f} GB/s")
    print(f"{'dtype':9} {'rows':>4} {'layout':8} {'ms/pass':>8} {'GB/s':>6} {'vs float32 same rows/layout':>28}")
    for r in rows:
        fns, nbytes = {}, {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for layout in ("in,out", "out,in"):
                ws = matrices(dtype, layout)
                fns[(dtype, layout)] = pass_fn(ws, layout, r)
                nbytes[(dtype, layout)] = sum(w.numel() * w.element_size() for w in ws)
        med = interleaved_medians(fns, args.repeats)
        for (dtype, layout), t in med.items():
            speedup = med[(torch.float32, layout)] / t
            print(f"{str(dtype).replace('torch.', ''):9} {r:>4} {layout:8} {t * 1e3:8.2f} "
                  f"{nbytes[(dtype, layout)] / t / 1e9:6.1f} {speedup:27.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
