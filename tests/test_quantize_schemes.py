"""The quantization schemes and their products on one weight matrix: int8/int4 round trips and
packing, the packed kernels against the dequantized matmul, int8 activations split into 8-bit
pieces (outlier features included), the choice of int8 kernel per CPU, and GPTQ on one weight.

References: first principles (half a quantization step; the pieces' bounds), the dequantized
float64 matmul (for the kernels and products), bf16 activations on torch's int8 kernel (what the
split must beat), and round-to-nearest of the same weight (for GPTQ)."""

import pytest
import torch

from gpt2mha.inference.quant import QuantizedLinear, int8_matmul, split_activations
from gpt2mha.inference.quant.linear import fbgemm_available, int8_kernel, pieces_for
from gpt2mha.inference.quant.gptq import gptq
from gpt2mha.inference.quant.schemes import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                                             quantize_int8, unpack_int4)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the math
def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40)[:, None]
    w[3] = 0                                                     # an all-zero channel
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (40,) and int(q.abs().max()) <= 127
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales.float()[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize_int8(q, scales)[3], torch.zeros(96))


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_error_is_at_most_half_a_step_and_packing_is_exact(group_size):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) + torch.linspace(-3, 3, 48)[:, None]
    q, sz = quantize_int4(w, group_size)
    assert q.shape == w.shape and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (128 // group_size, 48, 2)
    err = (dequantize_int4(q, sz, group_size) - w).abs().view(48, -1, group_size)
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()          # [N, groups]
    bound = scale / 2 + zero.abs() * 2 ** -8 + 1e-6                        # half a step + the zero's bf16 rounding
    assert (err <= bound[..., None]).all()
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 64) and torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("scheme,group_size,n_out", [("int8", None, 97), ("int4", 32, 96), ("int4", 64, 97)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_equals_dequantized_matmul(scheme, group_size, n_out, dtype):
    """The layer's product equals x @ deq(W)ᵀ + b computed in float64: int8 (exact integer
    products of 16-bit activations) to float32's rounding of the result, int4 (bf16 kernel) to
    bf16's (x rounded to bf16 in the reference; n_out = 97 exercises the int4 row padding)."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(n_out, 128, generator=g) * 0.05, torch.randn(n_out, generator=g)
    layer = QuantizedLinear.from_float(w, b, scheme, group_size).to(dtype)
    x = torch.randn(3, 5, 128, generator=g).to(dtype)
    y = layer(x)
    x_ref = x.double() if scheme == "int8" else x.to(torch.bfloat16).double()
    ref = x_ref @ layer.dequantized().double().t() + b.to(dtype).double()
    assert y.shape == (3, 5, n_out) and y.dtype == dtype
    tol = (1e-4 if dtype == torch.float32 else 1e-2) if scheme == "int8" else 2e-2     # bf16 model: bf16 result
    torch.testing.assert_close(y.double(), ref, atol=tol * float(ref.abs().max()), rtol=0)
    if scheme == "int8":
        assert layer.scales.dtype == torch.bfloat16                # .to(dtype) leaves the scales alone


KERNELS = ["int_mm"] + (["fbgemm"] if fbgemm_available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", [1, 2, 7])
def test_int8_products_are_as_exact_as_float32_activations(M, kernel):
    """int8_matmul against float64 x @ deq(W)ᵀ, on every int8 kernel this torch has (whatever
    the CPU picks): error ~3e-5 of the output's size for 8-bit pieces (``_int_mm``), ~1e-4 for
    FBGEMM's 7-bit ones (exact int32 sums), where bf16 activations on the int8 kernel give
    ~2e-3; an all-zero row gives exact zeros."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(300, 192, generator=g)
    q, scales = quantize_int8(w)
    x = torch.randn(M, 192, generator=g) * torch.logspace(-2, 2, M)[:, None]   # rows of very different sizes
    x[0, :5] *= 30                                                  # an outlier inside a row
    ref = x.double() @ dequantize_int8(q, scales).double().t()
    err = (int8_matmul(x, q, scales, kernel).double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert (err < (2e-4 if kernel == "int_mm" else 4e-4)).all(), err
    bf16 = (torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert (err < bf16 / 10).all()                                  # the point of the split: 10x+ closer than bf16
    pieces, a = split_activations(x)
    assert pieces.dtype == torch.int8 and pieces.shape == (2 * M, 192) and a.shape == (M, 1)
    torch.testing.assert_close(a * (pieces[:M].float() + pieces[M:].float() / 254), x,
                               atol=float(x.abs().max()) / 64516 * 1.01, rtol=0)
    assert torch.equal(int8_matmul(torch.zeros(1, 192), q, scales, kernel), torch.zeros(1, 300))


def test_pieces_for_keeps_each_row_within_its_bound():
    """``pieces_for`` against first principles: the last piece's step ``a / (2L)^(n−1)`` with
    ``a = max / L`` must be ≤ 2·mean/1613 (the bound two 8-bit pieces give at WIDE_ROW = 40)
    whenever fewer than MAX_PIECES suffice; n is the smallest such."""
    for levels in (127, 63):
        for ratio in (1.0, 9.0, 10.0, 39.0, 41.0, 1000.0, 2000.0, 1e4, 1e5):
            n = pieces_for(ratio, levels)
            step = lambda k: ratio / levels / (2 * levels) ** (k - 1)            # in units of the mean
            assert n >= 2 and (n == 4 or step(n) <= 2 / 1613 * 1.0001), (levels, ratio, n)
            assert n == 2 or step(n - 1) > 2 / 1613, (levels, ratio, n)
    assert pieces_for(40.0, 127) == 2 and pieces_for(41.0, 127) == 3


def test_int8_kernel_is_chosen_per_cpu_and_can_be_forced(monkeypatch):
    """The kernel choice: one of INT8_KERNELS; the environment variable forces it, and an
    unknown name is refused naming the variable."""
    monkeypatch.delenv("GPT2MHA_INT8_KERNEL", raising=False)
    assert int8_kernel() in ("int_mm", "fbgemm")
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", "int_mm")
    assert int8_kernel() == "int_mm"
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", "vnni")
    with pytest.raises(ValueError, match="GPT2MHA_INT8_KERNEL='vnni'"):
        int8_kernel()
    with pytest.raises(ValueError, match="kernel='x'"):
        int8_matmul(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.int8), torch.ones(3), "x")


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no FBGEMM")
def test_fbgemm_packed_weight_follows_the_layer_weight(monkeypatch):
    """A QuantizedLinear on the FBGEMM kernel packs its weight once and packs again when the
    weight is written in place or replaced; deep copies repack their own (reference: float64
    x @ deq(W)ᵀ + b)."""
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", "fbgemm")
    g = torch.Generator().manual_seed(5)
    layer = QuantizedLinear.from_float(torch.randn(40, 32, generator=g), torch.randn(40, generator=g), "int8")
    x = torch.randn(3, 32, generator=g)

    def check(m):
        ref = x.double() @ m.dequantized().double().t() + m.bias.double()
        torch.testing.assert_close(m(x).double(), ref, rtol=0, atol=float(ref.abs().max()) * 1e-3)
    check(layer)
    packed = layer.fbgemm_packed()
    assert layer.fbgemm_packed() is packed                          # cached
    with torch.no_grad():
        layer.weight[:5] = -layer.weight[:5]
    check(layer)
    assert layer.fbgemm_packed() is not packed
    layer.scales = layer.scales * 2
    check(layer)
    import copy
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
    check(twin)
    check(layer)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_many_rows_give_the_dequantized_product_on_every_kernel(monkeypatch, kernel, scheme, group_size):
    """Prefill-sized inputs (DEQUANTIZE_FROM_ROWS rows and more) and decode-sized ones agree
    with float64 x @ deq(W)ᵀ + b whichever product the CPU picks for them (the dequantized
    float32 weight on FBGEMM CPUs, the quantized kernel elsewhere); the choice follows the kernel."""
    from gpt2mha.inference.quant.linear import DEQUANTIZE_FROM_ROWS
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    g = torch.Generator().manual_seed(9)
    layer = QuantizedLinear.from_float(torch.randn(48, 64, generator=g), torch.randn(48, generator=g),
                                       scheme, group_size)
    rows = DEQUANTIZE_FROM_ROWS[scheme]
    assert layer.dequantize_for(rows) == (kernel == "fbgemm") and not layer.dequantize_for(rows - 1)
    for M in (1, rows - 1, rows):
        x = torch.randn(M, 64, generator=g)
        ref = x.double() @ layer.dequantized().double().t() + layer.bias.double()
        tol = 1e-5 if layer.dequantize_for(M) else (1e-3 if scheme == "int8" else 2e-2)   # int4: bf16 activations
        torch.testing.assert_close(layer(x).double(), ref, rtol=0, atol=float(ref.abs().max()) * tol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_products_stay_exact_beside_an_outlier_feature(kernel):
    """A row with one huge feature (an 'attention sink' dimension, here 3000 against N(0, 1))
    would set a coarse step for the rest of the row; int8_matmul then uses more pieces
    (``pieces_for``: three 8-bit, four 7-bit) and stays ≥ 10x closer to float64 than bf16
    activations (reference: float64 matmul)."""
    g = torch.Generator().manual_seed(28)
    q, scales = quantize_int8(torch.randn(300, 192, generator=g))
    q[:, 7] = 0                                                     # the outlier's weights are zero
    for M in (1, 4):
        x = torch.randn(M, 192, generator=g)
        x[:, 7] = 3000
        ref = x.double() @ dequantize_int8(q, scales).double().t()
        err = float((int8_matmul(x, q, scales, kernel).double() - ref).norm() / ref.norm())
        bf16 = float((torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).double() - ref).norm()
                     / ref.norm())
        assert err < 5e-4 and err < bf16 / 10, (err, bf16)


# ------------------------------------------------------------------ GPTQ
@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(scheme, group_size):
    """With H = I (inputs uncorrelated, equal power) no error has anywhere to go: GPTQ's output
    is exactly round-to-nearest's (Frantar et al., 2022: GPTQ reduces to RTN when H is diagonal)."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(22))
    q, params = gptq(w, torch.eye(64), scheme, group_size)
    rq, rparams = quantize_int8(w) if scheme == "int8" else quantize_int4(w, group_size)
    assert torch.equal(q, rq) and torch.equal(params, rparams)


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("int4", 64)])
def test_gptq_lowers_the_output_error_on_correlated_inputs(scheme, group_size):
    """On correlated calibration inputs X, GPTQ's ‖X·(W − deq(Q))ᵀ‖ is well below
    round-to-nearest's (reference: RTN of the same W) on X and on fresh inputs of the same
    distribution, and its codes stay on the scheme's grid."""
    g = torch.Generator().manual_seed(23)
    K = 128
    mix = torch.randn(K, K, generator=g) / K ** 0.5 + torch.eye(K)
    X, X_new = torch.randn(2048, K, generator=g) @ mix, torch.randn(512, K, generator=g) @ mix
    w = torch.randn(96, K, generator=g) * 0.05
    H = X.double().t() @ X.double()
    q, params = gptq(w, H, scheme, group_size)
    rq, rparams = quantize_int8(w) if scheme == "int8" else quantize_int4(w, group_size)
    if scheme == "int8":
        deq, rtn = dequantize_int8(q, params), dequantize_int8(rq, rparams)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and torch.equal(params, rparams)
    else:
        deq, rtn = dequantize_int4(q, params, group_size), dequantize_int4(rq, rparams, group_size)
        assert int(q.min()) >= 0 and int(q.max()) <= 15 and params.shape == rparams.shape
    for inputs in (X, X_new):
        ours, theirs = (inputs @ (w - deq).t()).norm(), (inputs @ (w - rtn).t()).norm()
        assert ours < 0.8 * theirs, (float(ours), float(theirs))


def test_gptq_refuses_a_hessian_of_the_wrong_shape_or_with_nan():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match=r"hessian: expected a \[32, 32\] matrix for a weight \[8, 32\], got \[16, 16\]"):
        gptq(w, torch.eye(16), "int8")
    bad = torch.eye(32)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="hessian: holds NaN or inf"):
        gptq(w, bad, "int8")
    with pytest.raises(ValueError, match="hessian: not positive definite even in float64"):
        gptq(w, -torch.eye(32), "int8")                          # no damping makes a negative H usable
