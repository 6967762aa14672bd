"""gpt2mha's C++ products (src/gpt2mha/kernels/products.cpp, int4_products.cpp) through their wrappers
(gpt2mha.inference.quant.gemv); how the library is found and loaded: test_kernels_loading.py.

Reference: float64 products of the dequantized weight, ``x @ (q · s)ᵀ + b`` (NumPy-free: torch
float64 on the CPU). The kernel keeps float32 activations, so it must agree to float32 rounding.
"""

import pytest
import torch

from gpt2mha.inference.quant import gemv
from gpt2mha.kernels import dispatch

needs_kernel = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")


def _case(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) * 0.02 + 1e-3
    b = torch.randn(N, generator=g)
    return x, q, s, b


def _reference(x, q, s, b):
    y = x.double() @ (q.double() * s.double()[:, None]).t()
    return y if b is None else y + b.double()


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (2, 768, 768), (3, 3072, 768), (8, 100, 37), (5, 31, 9), (1, 64, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_gives_the_float_product_of_the_dequantized_weight(M, K, N, bias):
    x, q, s, b = _case(M, K, N)
    b = b if bias else None
    y = gemv.int8_gemv(x, q, s, b)
    ref = _reference(x, q, s, b)
    assert y.shape == (M, N) and y.dtype == torch.float32
    # worst-case float32 rounding: each of the 32 accumulator lanes adds K/32 terms, then 5
    # reduction adds, the scale and the bias: (K/32 + 8) units of 2^-24 of the sum of |terms|
    terms = x.double().abs() @ (q.double().abs() * s.double()[:, None]).t()
    bound = (K / 32 + 8) * 2.0 ** -24 * (terms + (0 if b is None else b.double().abs())) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
def test_each_rows_result_is_the_same_whatever_the_other_rows_and_threads():
    # batch invariance: every row is summed in one fixed order, pairs of rows and single rows alike
    x, q, s, b = _case(7, 3072, 300, seed=1)
    together = gemv.int8_gemv(x, q, s, b)
    for i in range(7):
        assert torch.equal(gemv.int8_gemv(x[i:i + 1], q, s, b)[0], together[i])
    assert torch.equal(gemv.int8_gemv(x[[6, 0, 3]], q, s, b), together[[6, 0, 3]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv.int8_gemv(x, q, s, b), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_non_finite_activation_spoils_only_its_own_row():
    x, q, s, b = _case(3, 64, 16, seed=2)
    x[1, 5] = float("nan")
    y = gemv.int8_gemv(x, q, s, b)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()


@needs_kernel
def test_bad_arguments_are_named():
    x, q, s, b = _case(2, 64, 16)
    with pytest.raises(ValueError, match="x must be a float32"):
        gemv.int8_gemv(x.double(), q, s, b)
    with pytest.raises(ValueError, match=r"weight must be a contiguous int8 CPU tensor \[N, K=64\]"):
        gemv.int8_gemv(x, q[:, :32], s, b)
    with pytest.raises(ValueError, match=r"weight must be a contiguous int8"):
        gemv.int8_gemv(x, q.t().contiguous().t(), s, b)
    with pytest.raises(ValueError, match=r"scales must be a contiguous float32 CPU tensor \[N=16\]"):
        gemv.int8_gemv(x, q, s[:8], b)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.int8_gemv(x, q, s, b.bfloat16())
    # the operator checks its arguments itself (a compiled step calls it directly)
    with pytest.raises(RuntimeError, match=r"int8_gemv: weight must be a contiguous int8 CPU tensor \[N, K=64\]"):
        torch.ops.gpt2mha.int8_gemv(x, q[:, :32].contiguous(), s, b)


def test_without_the_kernels_the_wrappers_say_why(monkeypatch):
    monkeypatch.setattr(gemv, "available", lambda: False)
    monkeypatch.setattr(gemv, "unavailable_reason", lambda: "turned off (GPT2MHA_KERNELS=0)")
    with pytest.raises(RuntimeError, match=r"not available: turned off \(GPT2MHA_KERNELS=0\)"):
        gemv.int8_gemv(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.int8), torch.ones(2))


def _per_row_case(M, K, N, seed=0):
    from gpt2mha.inference.quant.linear import weight_7bit
    from gpt2mha.inference.quant.schemes import quantize_int8
    g = torch.Generator().manual_seed(seed)
    q7, s7 = weight_7bit(*quantize_int8(torch.randn(N, K, generator=g)))
    wsum = (q7.float() * s7.float()[:, None]).sum(1)
    args = (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), s7.float().contiguous(), wsum)
    return torch.randn(M, K, generator=g) * 3, q7, s7.float(), args, torch.randn(N, generator=g)


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (5, 3072, 64), (8, 100, 37), (3, 31, 9), (16, 768, 33),
                                   (11, 64, 32)])
def test_the_per_row_operator_sums_exactly_as_integers(M, K, N):
    # rows of integers from -128 to 127 round to themselves (a = 1, lo = -128), and the rescale
    # adds (128·1 − 128)·wsum = 0: what is left is the integer product, exact (int64 reference)
    # scaled once in float32, as FBGEMM's W7A8 product. K and N not multiples of 4 and 32 exercise
    # the packing's padding, M of 8 and 16 a second tile.
    _, q7, s7, args, _ = _per_row_case(M, K, N, seed=M + K)
    g = torch.Generator().manual_seed(K)
    u = torch.randint(-128, 128, (M, K), generator=g).float()
    u[:, 0], u[:, -1] = -128.0, 127.0
    u[0] = 127.0
    u[0, 0] = -128.0                                            # nearly the largest sums a row can have
    q7[0] = 63
    args = (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32)) + args[2:]
    y = gemv.int8_per_row(u, *args)
    assert torch.equal(y, (u.long() @ q7.long().t()).float() * s7)
    assert torch.equal(gemv.int8_per_row(u[-1:], *args)[0], y[-1])


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (4, 3072, 70), (9, 100, 37)])
def test_the_per_row_operator_is_the_eager_per_row_layer(M, K, N):
    # the reference: linear.int8_matmul_per_row (torch's ops, _int_mm or FBGEMM for the integer
    # product) plus the bias; the same roundings, so equal up to the order of float additions
    from gpt2mha.inference.quant.linear import int8_matmul_per_row
    x, q7, s7, args, b = _per_row_case(M, K, N, seed=K)
    x[0, :5] = 0.0
    x[-1] = 0.25                                                 # a constant row: a = 0
    want = int8_matmul_per_row(x, q7, s7) + b
    y = gemv.int8_per_row(x, *args, b)
    assert (y - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(gemv.int8_per_row(x, *args) + b, y)                     # the bias: one last addition
    for i in range(M):
        assert torch.equal(gemv.int8_per_row(x[i:i + 1], *args, b)[0], y[i])
    x[1 % M, 7] = float("inf")
    z = gemv.int8_per_row(x, *args, b)
    assert z[1 % M].isnan().all()
    others = [i for i in range(M) if i != 1 % M]
    assert torch.equal(z[others], y[others])


def _gelu64(y):
    """GPT-2's GELU in float64 (openai/gpt-2's ``gelu``, 0.5·y·(1 + tanh(u)), written y·sigmoid(2u):
    the same function, and accurate where 1 + tanh(u) cancels): the fused activation's reference."""
    y = y.double()
    return y * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3))


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (5, 768, 3072), (130, 100, 37)])
def test_the_per_row_operator_applies_gpt2s_gelu_as_torch_does(M, K, N):
    # reference: float64 GELU of the unfused output (the same product bits); and torch's own
    # F.gelu(approximate="tanh") in float32, to its absolute rounding (below about -5 torch's
    # 1 + tanh(u) cancels to 0 in float32, where ours keeps the tiny true value)
    import torch.nn.functional as F
    x, _, _, args, b = _per_row_case(M, K, N, seed=N)
    y = gemv.int8_per_row(x, *args, b)
    g = gemv.int8_per_row(x, *args, b, gelu=True)
    want = _gelu64(y)
    err = (g.double() - want).abs()
    # a few float32 ulps, plus the rounding of exp's float32 argument 2u: four roundings make it
    # (y³, ·0.044715 + y, ·2√(2/π)), each a relative 2^-24 of |2u| in the result
    u = (2 / torch.pi) ** 0.5 * (y.double() + 0.044715 * y.double() ** 3)
    assert (err <= (4 + 8 * u.abs()) * 2.0 ** -24 * want.abs() + 1e-30).all()
    assert (g - F.gelu(y, approximate="tanh")).abs().max() <= 1e-6 * y.abs().max()
    for i in (0, M - 1):                                          # a row's result is its own
        assert torch.equal(gemv.int8_per_row(x[i:i + 1], *args, b, gelu=True)[0], g[i])


@needs_kernel
def test_the_fused_gelu_at_the_extremes():
    # zero weights make the output the bias exactly, so the bias sets GELU's input: tiny, large
    # and infinite values (float64 reference)
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 1.0, -1.0, 3.0, -3.0, 5.0, -5.0, 9.5,
                           -9.5, 50.0, -50.0, 1e20, -1e20, float("inf")])
    N, K = len(values), 8
    q7 = torch.zeros(N, K, dtype=torch.int8)
    args = (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), torch.ones(N), torch.zeros(N))
    x = torch.randn(3, K)
    g = gemv.int8_per_row(x, *args, values, gelu=True)
    want = _gelu64(values.expand(3, N)).float()
    u = (2 / torch.pi) ** 0.5 * (values.double() + 0.044715 * values.double() ** 3)
    close = (g - want).abs() <= (4 + 8 * u.abs().nan_to_num(posinf=0.0)) * 2.0 ** -24 * want.abs() + 1e-30
    assert (close | (g == want)).all(), (g[0], want[0])                  # inf: equal


def test_packing_puts_four_inputs_of_32_channels_together():
    q = (torch.arange(40 * 6, dtype=torch.int32).remainder(127) - 63).to(torch.int8).view(40, 6)
    P = gemv.pack_rows(q)
    assert P.shape == (2, 2, 32, 4) and P.is_contiguous()
    for t, j, c, i in [(0, 0, 0, 0), (0, 1, 5, 1), (1, 0, 7, 3), (1, 1, 7, 1)]:
        assert P[t, j, c, i] == q[32 * t + c, 4 * j + i]
    assert (P[1, :, 8:] == 0).all() and (P[:, 1, :, 2:] == 0).all()          # channels 40+, inputs 6+
    with pytest.raises(ValueError, match="q must be a 2-D int8 CPU tensor"):
        gemv.pack_rows(q.float())
    q[3, 2] = -128                                        # 8 bits: would saturate the AVX2 path's int16 pairs
    with pytest.raises(ValueError, match=r"q: weights from -128 to 63; expected 7-bit weights in \[-63, 63\]"):
        gemv.pack_rows(q)


@pytest.fixture
def both_paths():
    """Runs a test's body on the AVX-512 VNNI paths and on the AVX2 ones (skips where the CPU
    has no AVX-512 VNNI): yields a function that allows every feature (True) or none (False) and
    returns whether the VNNI paths are taken then; the features allowed before restored after."""
    if not gemv.available() or not {"avx512", "avx512_vnni"} <= dispatch.cpu():
        pytest.skip("the CPU has no AVX-512 VNNI: the kernels have one path here")
    with dispatch.limited(None):
        yield lambda on: dispatch.allow(None if on else ()) >= {"avx512", "avx512_vnni"}


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (8, 3072, 64), (11, 100, 37)])
def test_the_per_row_operators_vnni_and_avx2_paths_give_the_same_bits(both_paths, M, K, N):
    x, _, _, args, b = _per_row_case(M, K, N, seed=K)
    assert both_paths(True) and gemv.vnni()
    vnni = gemv.int8_per_row(x, *args, b)
    vnni_gelu = gemv.int8_per_row(x, *args, b, gelu=True)
    assert not both_paths(False) and not gemv.vnni()
    assert torch.equal(gemv.int8_per_row(x, *args, b), vnni)
    assert torch.equal(gemv.int8_per_row(x, *args, b, gelu=True), vnni_gelu)


@needs_kernel
def test_the_per_row_operator_names_bad_arguments():
    x, q7, s7, (P, qsum, s7c, wsum), b = _per_row_case(2, 35, 4)
    with pytest.raises(RuntimeError, match="qsum must be a contiguous int32"):
        gemv.int8_per_row(x, P, qsum.long(), s7c, wsum)
    with pytest.raises(RuntimeError, match=r"packed must be a contiguous int8 CPU tensor \[ceil\(N/32\)=1"):
        gemv.int8_per_row(x, q7, qsum, s7c, wsum)
    with pytest.raises(RuntimeError, match=r"wsum must be a contiguous float32 CPU tensor \[N=4\]"):
        gemv.int8_per_row(x, P, qsum, s7c, wsum.double())
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous float32 CPU tensor \[N=4\] or None"):
        gemv.int8_per_row(x, P, qsum, s7c, wsum, b[:3])
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor"):
        gemv.int8_per_row(x.double(), P, qsum, s7c, wsum)
    with pytest.raises(RuntimeError, match=r"qsum must be a contiguous int32 CPU tensor \[N\]"):
        gemv.int8_per_row(x, P, qsum[0], s7c, wsum)                         # 0-d: named, not an IndexError
    with pytest.raises(ValueError, match=r"x is empty: \[M, K\] = \[2, 0\]"):
        gemv.int8_per_row(x[:, :0], P, qsum, s7c, wsum)
    with pytest.raises(RuntimeError, match="with K >= 1"):
        torch.ops.gpt2mha.int8_per_row(x[:, :0], P, qsum, s7c, wsum, None, False)


@needs_kernel
def test_misuse_is_named():
    x = torch.zeros(1, 32, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        gemv.int8_gemv(x, torch.zeros(2, 32, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError, match="requires grad"):
        gemv.int8_per_row(x, gemv.pack_rows(torch.zeros(2, 32, dtype=torch.int8)), torch.zeros(2, dtype=torch.int32),
                          torch.ones(2), torch.zeros(2))


@needs_kernel
def test_decode_products_see_scales_written_in_place_even_in_inference_mode():
    # reference: the same layer's product before the write, doubled (the scales multiply linearly)
    from gpt2mha.inference.quant.linear import QuantizedLinear
    torch.manual_seed(0)
    with torch.inference_mode():
        layer = QuantizedLinear.from_float(torch.randn(16, 32) * 0.1, torch.zeros(16), "int8")
        x = torch.randn(1, 1, 32)
        before = layer(x)
        layer.scales.mul_(2)
        assert torch.allclose(layer(x), 2 * before, rtol=1e-6, atol=1e-7)


# --- int4 (the float32 product with the dequantized int4 weight, (q - 8)·s + z per group) ---

def _int4_case(M, K, N, G, seed=0):
    from gpt2mha.inference.quant.schemes import pack_int4, quantize_int4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2
    q, scale_zero = quantize_int4(torch.randn(N, K, generator=g) * 0.05 + 0.01, G)   # off-centre: zeros matter
    b = torch.randn(N, generator=g)
    return x, q, pack_int4(q), scale_zero, b


def _int4_dequantized(q, scale_zero, G):
    # float64 (q - 8)·s + z, written out here (independent of schemes.dequantize_int4)
    N, K = q.shape
    sz = scale_zero.double().transpose(0, 1).repeat_interleave(G, dim=1)      # [N, K, 2]
    return (q.double() - 8) * sz[..., 0] + sz[..., 1], sz


@needs_kernel
@pytest.mark.parametrize("M,K,N,G", [(1, 768, 2304, 32), (2, 768, 768, 64), (3, 3072, 768, 32), (5, 768, 40, 128),
                                     (4, 512, 9, 256), (1, 48, 3, 16), (8, 96, 17, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_int4_kernel_gives_the_float_product_of_the_dequantized_weight(M, K, N, G, bias):
    x, q, packed, scale_zero, b = _int4_case(M, K, N, G)
    b = b if bias else None
    y = gemv.int4_gemv(x, packed, scale_zero.transpose(0, 1).contiguous(), G, b)
    w, sz = _int4_dequantized(q, scale_zero, G)
    ref = x.double() @ w.t() + (0 if b is None else b.double())
    assert y.shape == (M, N) and y.dtype == torch.float32
    # float32 rounding of s·Σ q·x + (z − 8s)·Σ x per group, summed over the groups: at most about
    # (K/8 + 16) units of 2^-24 of Σ (s·q + |z − 8s|)·|x|; a wrong nibble, group or zero is off by ~s·|x|
    terms = x.double().abs() @ (sz[..., 0] * q.double() + (sz[..., 1] - 8 * sz[..., 0]).abs()).t()
    bound = (K / 8 + 16) * 2.0 ** -24 * (terms + (0 if b is None else b.double().abs()))
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
def test_each_rows_int4_result_is_the_same_whatever_the_other_rows_and_threads():
    x, q, packed, scale_zero, b = _int4_case(7, 3072, 300, 32, seed=1)
    sz = scale_zero.transpose(0, 1).contiguous()
    together = gemv.int4_gemv(x, packed, sz, 32, b)
    for i in range(7):
        assert torch.equal(gemv.int4_gemv(x[i:i + 1], packed, sz, 32, b)[0], together[i])
    assert torch.equal(gemv.int4_gemv(x[[6, 0, 3]], packed, sz, 32, b), together[[6, 0, 3]])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv.int4_gemv(x, packed, sz, 32, b), together)
    finally:
        torch.set_num_threads(threads)
    x[2, 7] = float("nan")
    y = gemv.int4_gemv(x, packed, sz, 32, b)
    assert y[2].isnan().all() and torch.equal(y[[0, 1, 3, 4, 5, 6]], together[[0, 1, 3, 4, 5, 6]])


@needs_kernel
def test_bad_int4_arguments_are_named():
    x, q, packed, scale_zero, b = _int4_case(2, 64, 16, 32)
    sz = scale_zero.transpose(0, 1).contiguous()
    with pytest.raises(ValueError, match="group_size=24: expected a multiple of 16 dividing K=64"):
        gemv.int4_gemv(x, packed, sz, 24, b)
    with pytest.raises(ValueError, match="group_size=True"):
        gemv.int4_gemv(x, packed, sz, True, b)
    with pytest.raises(ValueError, match=r"weight must be a contiguous uint8 CPU tensor \[N, K/2=32\]"):
        gemv.int4_gemv(x, packed.view(torch.int8), sz, 32, b)
    with pytest.raises(ValueError, match=r"scale_zero must be a contiguous bfloat16 CPU tensor \[N=16, K/group_size=2, 2\]"):
        gemv.int4_gemv(x, packed, scale_zero, 32, b)                  # the checkpoint's [K/g, N, 2]: transpose it
    with pytest.raises(ValueError, match="bias must be"):
        gemv.int4_gemv(x, packed, sz, 32, b[:3])
    with pytest.raises(RuntimeError, match=r"int4_gemv: scale_zero must be a contiguous bfloat16"):
        torch.ops.gpt2mha.int4_gemv(x, packed, sz.float(), 32, b)
    with pytest.raises(RuntimeError, match=r"int4_gemv: group_size must be a multiple of 16"):
        torch.ops.gpt2mha.int4_gemv(x, packed, sz, 8, b)


@needs_kernel
def test_int4_layers_decode_on_the_kernel_with_float32_activations():
    # reference: float64 x @ dequantized()ᵀ + b. The int4 fallback (torch's int4pack kernel) takes
    # bf16 activations (~3e-3 relative): the kernel's float32 product must be far closer
    from unittest import mock
    from gpt2mha.inference.quant.linear import QuantizedLinear
    torch.manual_seed(0)
    layer = QuantizedLinear.from_float(torch.randn(48, 256) * 0.1, torch.randn(48), "int4", group_size=32)
    x = torch.randn(3, 1, 256)
    ref = x.double() @ layer.dequantized().double().t() + layer.bias.double()
    scale = ref.abs().max().item()
    with torch.inference_mode():
        with mock.patch.object(torch.ops.gpt2mha, "int4_gemv", wraps=torch.ops.gpt2mha.int4_gemv) as op:
            y = layer(x)
            assert op.call_count == 1
        assert (y.double() - ref).abs().max().item() < 1e-6 * scale
        assert torch.equal(layer(x[1:2])[0], y[1])                        # a row alone: the same bits
        prefill = layer(x.view(1, 3, 256))                               # 3 tokens of one sequence: torch's kernel
        assert 1e-6 * scale < (prefill.double() - ref.view(1, 3, -1)).abs().max().item() < 3e-2 * scale
        layer.scale_zero[..., 0].mul_(2)                                  # scales written in place: seen
        w2 = layer.dequantized().double()
        assert (layer(x).double() - (x.double() @ w2.t() + layer.bias.double())).abs().max().item() < 2e-6 * scale


# --- int4 W4A8 (activations="per_block"): x rounded to 8 bits per group, exact int32 sums ---

def _per_block_reference(x, q, scale_zero, G):
    # float64 W4A8 written out: a = round(x · (127 / max|x|)) per group (the kernel's float32
    # reciprocal and round-half-even, mimicked in float32), d = max|x| / 127, times the float64
    # dequantized weight
    M, K = x.shape
    xg = x.view(M, K // G, G)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))   # one division
    a = torch.round(xg * inv)
    xq = (a.double() * (amax / 127.0).double()).view(M, K)
    w, sz = _int4_dequantized(q, scale_zero, G)
    return xq @ w.t(), xq, w, sz


@needs_kernel
@pytest.mark.parametrize("M,K,N,G", [(1, 768, 2304, 32), (3, 768, 768, 64), (5, 3072, 768, 128), (2, 512, 40, 256),
                                     (6, 96, 17, 32), (4, 64, 9, 32), (2, 192, 11, 64), (3, 768, 20, 384),
                                     (2, 384, 40, 96), (19, 768, 70, 64)])
def test_the_per_block_kernel_gives_the_product_of_rounded_activations(M, K, N, G):
    x, q, packed, scale_zero, b = _int4_case(M, K, N, G)
    x[0, :G] = 0.0                                                       # an all-zero group: d = 0
    y = gemv.int4_gemv(x, packed, scale_zero.transpose(0, 1).contiguous(), G, b, activations="per_block")
    ref, xq, w, sz = _per_block_reference(x, q, scale_zero, G)
    ref = ref + b.double()
    # exact int32 sums, then float32 roundings per group and across groups: the same bound as exact
    terms = xq.abs() @ (sz[..., 0] * q.double() + (sz[..., 1] - 8 * sz[..., 0]).abs()).t()
    bound = (K / 8 + 16) * 2.0 ** -24 * (terms + b.double().abs())
    assert ((y.double() - ref).abs() <= bound).all()
    # and it is not the exact product: rounding x to 8 bits costs ~1e-3 of it
    exact = x.double() @ w.t() + b.double()
    rel = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    assert 1e-5 < rel < 2e-2


@needs_kernel
@pytest.mark.parametrize("M,K,N,G", [(1, 768, 2304, 32), (3, 768, 100, 64), (5, 3072, 70, 128), (2, 512, 40, 256),
                                     (6, 96, 17, 32), (4, 64, 9, 32), (2, 192, 11, 64), (19, 384, 33, 96)])
def test_the_per_block_kernels_vnni_and_avx2_paths_give_the_same_bits(both_paths, M, K, N, G):
    # one order of float operations on both (tiles of 8 rows and of 2; 17, 33, 70 channels: part tiles)
    x, q, packed, scale_zero, b = _int4_case(M, K, N, G, seed=K)
    x[-1, -G:] = 0.0
    sz = scale_zero.transpose(0, 1).contiguous()
    assert both_paths(True)
    vnni = gemv.int4_gemv(x, packed, sz, G, b, activations="per_block")
    assert not both_paths(False)
    avx2 = gemv.int4_gemv(x, packed, sz, G, b, activations="per_block")
    assert torch.equal(avx2, vnni)


@needs_kernel
def test_each_rows_per_block_result_is_its_own():
    x, q, packed, scale_zero, b = _int4_case(19, 768, 200, 32, seed=3)
    sz = scale_zero.transpose(0, 1).contiguous()
    together = gemv.int4_gemv(x, packed, sz, 32, b, activations="per_block")
    for i in range(19):                                                 # tiles of 8, 8 and 3 rows (AVX2: 2)
        assert torch.equal(gemv.int4_gemv(x[i:i + 1], packed, sz, 32, b, activations="per_block")[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv.int4_gemv(x, packed, sz, 32, b, activations="per_block"), together)
    finally:
        torch.set_num_threads(threads)
    x[4, 100] = float("inf")
    y = gemv.int4_gemv(x, packed, sz, 32, b, activations="per_block")
    others = [i for i in range(19) if i != 4]
    assert y[4].isnan().all() and torch.equal(y[others], together[others])
    tiny = x[:2].clone()
    tiny[0, :32] *= 1e-38                                              # 127 / max|x| overflows: zeros
    y = gemv.int4_gemv(tiny, packed, sz, 32, b, activations="per_block")
    zeroed = tiny.clone()
    zeroed[0, :32] = 0.0
    assert torch.equal(y, gemv.int4_gemv(zeroed, packed, sz, 32, b, activations="per_block"))
    with pytest.raises(ValueError, match="group_size=16: expected a multiple of 32"):
        gemv.int4_gemv(x[:, :64], packed[:, :32].contiguous(), torch.ones(200, 4, 2, dtype=torch.bfloat16), 16,
                       activations="per_block")
    with pytest.raises(ValueError, match="activations='rows': expected 'exact' or 'per_block'"):
        gemv.int4_gemv(x, packed, sz, 32, activations="rows")
    x96, _, p96, sz96, _ = _int4_case(1, 384, 8, 96)
    sz96 = sz96.transpose(0, 1).contiguous()
    with pytest.raises(RuntimeError, match="int4_gemv: weight must be a contiguous uint8 CPU tensor"):
        torch.ops.gpt2mha.int4_gemv(x96, p96[0, 0], sz96, 96, None)             # 0-d: named, not an IndexError
    with pytest.raises(RuntimeError, match="int4_gemv_a8: group_size must be a multiple of 32"):
        torch.ops.gpt2mha.int4_gemv_a8(x[:, :64], packed[:, :32].contiguous(),
                                       torch.ones(200, 4, 2, dtype=torch.bfloat16), 16, None)


@needs_kernel
def test_the_w4a8_packing_puts_four_inputs_of_32_channels_in_a_step():
    # the layout written out (w4a8_products.cpp): byte 4c + j of step s of tile t holds
    # q[32t + c, 4s + j] low and q[32t + 16 + c, 4s + j] high; params [t, g, 0/1, c] = s, z - 8s
    x, q, nibbles, scale_zero, b = _int4_case(1, 128, 45, 32, seed=5)
    sz = scale_zero.transpose(0, 1).contiguous()                           # [N, K/G, 2]
    packed, params = torch.ops.gpt2mha.int4_pack_a8(nibbles, sz, 32)
    assert packed.shape == (2, 32, 64) and params.shape == (2, 4, 2, 32)
    qp = torch.cat([q, torch.zeros(64 - 45, 128, dtype=q.dtype)])          # channels past N: 0
    for t, s, c, j in [(0, 0, 0, 0), (0, 5, 3, 2), (1, 31, 12, 3), (1, 7, 15, 1), (0, 31, 15, 3)]:
        byte = int(packed[t, s, 4 * c + j])
        assert byte & 15 == int(qp[32 * t + c, 4 * s + j]) and byte >> 4 == int(qp[32 * t + 16 + c, 4 * s + j])
    szf = sz.float()
    for t, g, c in [(0, 0, 0), (0, 3, 31), (1, 2, 12)]:
        n = 32 * t + c
        assert params[t, g, 0, c] == szf[n, g, 0]
        assert params[t, g, 1, c] == szf[n, g, 1] - 8 * szf[n, g, 0]
    assert (params[1, :, :, 13:] == 0).all()                               # 45 = 32 + 13


@needs_kernel
@pytest.mark.parametrize("M", [1, 8, 19])
def test_the_packed_w4a8_operator_is_the_per_call_one(M):
    x, q, nibbles, scale_zero, b = _int4_case(M, 768, 100, 64, seed=M)
    sz = scale_zero.transpose(0, 1).contiguous()
    packed, params = torch.ops.gpt2mha.int4_pack_a8(nibbles, sz, 64)
    assert torch.equal(torch.ops.gpt2mha.int4_a8_packed(x, packed, params, 64, 100, b),
                       torch.ops.gpt2mha.int4_gemv_a8(x, nibbles, sz, 64, b))
    with pytest.raises(RuntimeError, match=r"int4_a8_packed: packed must be a contiguous uint8 CPU tensor "
                                           r"\[ceil\(n_out/32\)=7, K/4=192, 64\]"):
        torch.ops.gpt2mha.int4_a8_packed(x, packed, params, 64, 200, b)
    with pytest.raises(RuntimeError, match=r"int4_a8_packed: params must be a contiguous float32 CPU tensor"):
        torch.ops.gpt2mha.int4_a8_packed(x, packed, params[:, :6], 64, 100, b)
    with pytest.raises(RuntimeError, match=r"int4_a8_packed: bias must be a contiguous float32 CPU tensor \[N=100\]"):
        torch.ops.gpt2mha.int4_a8_packed(x, packed, params, 64, 100, b[:99])
    with pytest.raises(RuntimeError, match="int4_pack_a8: group_size must be a multiple of 32 dividing K=768; got 48"):
        torch.ops.gpt2mha.int4_pack_a8(nibbles, sz, 48)


@needs_kernel
def test_a_per_block_layer_follows_new_data_and_takes_empty_inputs():
    # a break-it review: `weight.data = t` kept the old packed tiles (their identity and write count
    # unchanged), and zero rows reached the operator, which wants M >= 1
    from gpt2mha.inference.quant.linear import QuantizedLinear
    torch.manual_seed(0)
    layer = QuantizedLinear.from_float(torch.randn(45, 128), torch.randn(45), "int4", 32)
    layer.activations = "per_block"
    x = torch.randn(5, 128)
    with torch.no_grad():
        layer(x)
        layer.weight.data = torch.randint(0, 256, layer.weight.shape, dtype=torch.uint8)
        want = torch.ops.gpt2mha.int4_gemv_a8(x, layer.weight, layer.scale_zero.transpose(0, 1).contiguous(), 32,
                                              layer.bias)
        assert torch.equal(layer(x), want)
        layer.scale_zero.data = layer.scale_zero * 2
        want = torch.ops.gpt2mha.int4_gemv_a8(x, layer.weight, layer.scale_zero.transpose(0, 1).contiguous(), 32,
                                              layer.bias)
        assert torch.equal(layer(x), want)
        assert layer(torch.empty(0, 128)).shape == (0, 45) and layer(torch.empty(2, 0, 128)).shape == (2, 0, 45)


@needs_kernel
def test_per_block_int4_models_decode_on_w4a8_and_keep_it_in_their_checkpoint(tmp_path):
    from unittest import mock
    import warnings
    from gpt2mha import GPT2, GPT2Config
    from gpt2mha.inference.quant import set_activations
    from gpt2mha.inference.quant.linear import QuantizedLinear
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=96, n_ctx=64, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2(cfg).eval().quantize("int4", method="rtn", group_size=32, activations="per_block")
    assert {m.activations for m in model.modules() if isinstance(m, QuantizedLinear) and m.scheme == "int4"} == {"per_block"}
    assert model.lm_head.activations == "exact"                          # the int8 head is not int4's
    idx = torch.randint(0, 96, (3, 9))
    with torch.inference_mode():
        with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as step:
            out = model.generate(idx, 4, temperature=0)
            # 3 prompts and 3 decode steps, each one call of W4A8 products (native.py)
            assert step.call_count == 6
        with mock.patch.object(torch.ops.gpt2mha, "int4_a8_packed", wraps=torch.ops.gpt2mha.int4_a8_packed) as op:
            model(idx[:, :1], last_only=True)
            assert op.call_count == 4 * cfg.n_layer                       # the layers' own one-token forward
            model(idx, last_only=True)
            assert op.call_count == 8 * cfg.n_layer                       # and prompts: W4A8 too
    model.save_pretrained(tmp_path / "q4")
    loaded = GPT2.from_pretrained(str(tmp_path / "q4"))
    assert loaded.quantization["activations"] == "per_block"
    with torch.inference_mode():
        assert torch.equal(loaded.generate(idx, 4, temperature=0), out)
    set_activations(loaded, "exact")
    with pytest.raises(ValueError, match="'per_row' does not apply to scheme='int4'"):
        set_activations(loaded, "per_row")
