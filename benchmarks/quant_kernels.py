"""Which weight-only int8/int4 kernels decode GPT-2 fastest on this CPU: ``python benchmarks/quant_kernels.py``.

The survey behind the kernel choice in ``src/gpt2mha/inference/quant/linear.py``. It times one decode step's
weight matmuls of GPT-2 124M, the 48 block matrices (kernels.py's ``BLOCK_SHAPES``, 85M
weights, distinct so nothing stays in cache) and the LM head (``[50304, 768]``: n_vocab 50257 padded to a
multiple of 64, as gpt2mha pads it for the int4 kernel), for
``--rows`` input rows, with:

- float32 ``x @ W`` (GPT-2's ``[in, out]``, gpt2mha's float32 decode) and bf16 ``F.linear``;
- ``torch.ops.aten._weight_int8pack_mm`` (int8 ``[out, in]``, one scale per output channel)
  with float32, bf16 and fp16 activations;
- gpt2mha's exact int8 products (``int8_matmul``) on ``torch._int_mm`` and on FBGEMM, one
  7-bit piece per row on FBGEMM (W8A7, not exact), and the dequantized weight per call;
- ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (weights packed by
  ``_convert_weight_to_int4pack_for_cpu``, group-wise scale and zero) for groups 32/64/128;
- torchao's ``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig`` on ``nn.Linear`` layers, when
  torchao is installed (it is not a gpt2mha dependency: ``pip install --no-deps torchao``).

Each figure is the median of ``--repeats`` passes, the variants timed in turn (round-robin) so
a slow spell of the shared machine hits all alike. GB/s counts the bytes of weights and scales
read per pass.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from bench import interleaved_medians
from gpt2mha.inference.quant.linear import fbgemm_available, fbgemm_pack, int8_matmul
from gpt2mha.inference.quant.schemes import dequantize_int8, quantize_int4, quantize_int8

BLOCK_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))   # (in, out), as kernels.py
HEAD_SHAPE = (768, 50304)   # 50257 padded to a multiple of 64: the int4 kernel needs N % 16 == 0


def weights(shapes, n_layer: int, seed: int = 0) -> list[torch.Tensor]:
    """Random ``[out, in]`` float32 matrices, ``n_layer`` sets of ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n_out, n_in, generator=g) * 0.02 for _ in range(n_layer) for n_in, n_out in shapes]


def variants(ws: list[torch.Tensor], rows: int, torchao: bool) -> dict:
    """name → (one pass, bytes read per pass)."""
    x32 = {n: torch.randn(rows, n) for n in {w.shape[1] for w in ws}}
    xs = {dt: {n: x.to(dt) for n, x in x32.items()} for dt in (torch.float32, torch.bfloat16, torch.float16)}
    out = {}
    io32 = [w.t().contiguous() for w in ws]                                 # [in, out]
    out["float32 x @ W [in,out]"] = (lambda: [xs[torch.float32][w.shape[0]] @ w for w in io32],
                                     sum(w.numel() * 4 for w in ws))
    bf = [w.to(torch.bfloat16) for w in ws]
    out["bf16 F.linear [out,in]"] = (lambda: [F.linear(xs[torch.bfloat16][w.shape[1]], w) for w in bf],
                                     sum(w.numel() * 2 for w in ws))
    q8 = [quantize_int8(w) for w in ws]                                     # (int8 [out, in], scales [out])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        qs = [(q, s.to(dt)) for q, s in q8]
        name = str(dt).removeprefix("torch.")
        out[f"int8pack, {name} act"] = (
            lambda qs=qs, dt=dt: [torch.ops.aten._weight_int8pack_mm(xs[dt][q.shape[1]], q, s) for q, s in qs],
            sum(q.numel() + s.numel() * s.element_size() for q, s in qs))
    int8_bytes = sum(q.numel() + s.numel() * s.element_size() for q, s in q8)
    out["int8 exact: int8_matmul (int8 pieces, _int_mm), float32 act"] = (   # QuantizedLinear on VNNI/AMX CPUs
        lambda: [int8_matmul(x32[q.shape[1]], q, s, "int_mm") for q, s in q8], int8_bytes)
    if fbgemm_available():                                                  # QuantizedLinear on other x86 CPUs
        fb = [fbgemm_pack(q, s) for q, s in q8]
        out["int8 exact: int8_matmul (7-bit pieces, FBGEMM), float32 act"] = (
            lambda: [int8_matmul(x32[q.shape[1]], q, s, "fbgemm", p) for (q, s), p in zip(q8, fb)], int8_bytes)
        out["int8 W8A7: one 7-bit piece per row (FBGEMM), float32 act"] = (
            lambda: [int8_matmul(x32[q.shape[1]], q, s, "fbgemm", p, 1) for (q, s), p in zip(q8, fb)], int8_bytes)
    out["int8 dequantized per call + float32 F.linear"] = (                 # QuantizedLinear's prefill there
        lambda: [F.linear(x32[q.shape[1]], dequantize_int8(q, s)) for q, s in q8], int8_bytes)
    for g in (32, 64, 128):
        q4 = [quantize_int4(w, g) for w in ws]                              # (int32 [out, in], scale_zero)
        packed = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz) for q, sz in q4]
        for dt in (torch.bfloat16, torch.float32):
            ps = [(p, sz.to(dt)) for p, sz in packed]
            name = str(dt).removeprefix("torch.")
            out[f"int4pack g{g}, {name} act"] = (
                lambda ps=ps, dt=dt, g=g: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[dt][p.shape[1] * 2], p, g, sz)
                                           for p, sz in ps],
                sum(p.numel() + sz.numel() * sz.element_size() for p, sz in ps))
    if torchao:
        out.update(torchao_variants(ws, xs))
    return out


def torchao_variants(ws, xs) -> dict:
    """torchao's weight-only configs applied with ``quantize_`` to bf16 ``nn.Linear`` layers."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out = {}
    base = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in ws)
    with torch.no_grad():
        for lin, w in zip(base, ws):
            lin.weight.copy_(w)
    base = base.to(torch.bfloat16)
    configs = {"torchao Int8WeightOnlyConfig, bf16 act": Int8WeightOnlyConfig()}
    for fmt in ("plain", "opaque"):   # torchao 0.18 dropped its CPU int4 layout; both are tried and reported
        configs[f"torchao Int4WeightOnlyConfig g64 ({fmt}), bf16 act"] = Int4WeightOnlyConfig(
            group_size=64, int4_packing_format=fmt)
    for name, config in configs.items():
        layers = copy.deepcopy(base)
        try:
            quantize_(layers, config)
            layers[0](xs[torch.bfloat16][layers[0].in_features])
        except Exception as e:                                              # report, keep surveying
            print(f"{name}: could not quantize ({type(e).__name__}: {str(e)[:120]})")
            continue
        x = xs[torch.bfloat16]
        nbytes = sum(w.numel() for w in ws) // (1 if "Int8" in name else 2)
        out[name] = (lambda layers=layers: [lin(x[lin.in_features]) for lin in layers], nbytes)
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=11, help="passes per variant (median taken)")
    p.add_argument("--rows", default="1,8", help="comma-separated input rows (batch sizes)")
    p.add_argument("--n-layer", type=int, default=12, help="blocks of 124M matrices (12: the whole model)")
    p.add_argument("--no-torchao", action="store_true", help="skip torchao even if installed")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    try:
        import torchao  # noqa: F401
        torchao = not args.no_torchao
    except ImportError:
        torchao = False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, torchao: "
          f"{__import__('torchao').__version__ if torchao else 'not used'}")
    for what, ws in (("48 block matrices of GPT-2 124M", weights(BLOCK_SHAPES, args.n_layer)),
                     ("LM head [50304, 768]", weights((HEAD_SHAPE,), 1))):
        for r in (int(r) for r in args.rows.split(",")):
            fns = variants(ws, r, torchao and what.startswith("48"))
            med = interleaved_medians({k: f for k, (f, _) in fns.items()}, args.repeats)
            base = med["float32 x @ W [in,out]"]
            print(f"\n{what}, {r} row(s): ms/pass, GB/s of weights read, speed-up over float32")
            for name, t in med.items():
                print(f"  {name:58} {t * 1e3:7.2f} ms {fns[name][1] / t / 1e9:6.1f} GB/s {base / t:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
