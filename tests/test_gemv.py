"""The optional int8 GEMV kernel (inference/quant/gemv.cpp, built by gemv.py).

Reference: float64 products of the dequantized weight, ``x @ (q · s)ᵀ + b`` (NumPy-free: torch
float64 on the CPU). The kernel keeps float32 activations, so it must agree to float32 rounding.
"""

import pytest
import torch

from gpt2mha.inference.quant import gemv

needs_kernel = pytest.mark.skipif(not gemv.available(), reason=f"the kernel does not build here: {gemv.unavailable_reason()}")


def test_the_kernel_builds_where_it_is_required():
    # CI sets GPT2MHA_REQUIRE_GEMV=1 (.ci/run installs g++): there the tests above must run, not skip
    import os
    if os.environ.get("GPT2MHA_REQUIRE_GEMV") == "1":
        assert gemv.available(), gemv.unavailable_reason()
    else:
        assert gemv.available() or gemv.unavailable_reason()


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


def test_where_the_kernel_cannot_be_built_it_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv(gemv.ENV, "0")
    assert gemv._build() == "turned off (GPT2MHA_GEMV=0)"
    monkeypatch.setenv(gemv.ENV, "1")
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(gemv.shutil, "which", lambda name: None)
    assert "no C++ compiler" in gemv._build()
    monkeypatch.setattr(gemv, "available", lambda: False)
    monkeypatch.setattr(gemv, "unavailable_reason", lambda: "no C++ compiler found")
    with pytest.raises(RuntimeError, match="not available: no C\\+\\+ compiler found"):
        gemv.int8_gemv(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.int8), torch.ones(2))


def test_built_kernels_live_in_the_cache_directory_the_environment_names(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2MHA_CACHE", str(tmp_path / "c"))
    assert gemv.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GPT2MHA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert gemv.cache_dir() == tmp_path / "x" / "gpt2mha"


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 768, 300), (5, 3072, 64), (8, 100, 37), (3, 31, 9)])
def test_the_per_row_operator_sums_exactly_as_integers(M, K, N):
    # reference: the same sums in int64 (exact), scaled once in float32, as FBGEMM's W7A8 product
    g = torch.Generator().manual_seed(M + K)
    u = torch.randint(-128, 128, (M, K), generator=g).float()
    q = torch.randint(-63, 64, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) * 0.01
    y = torch.ops.gpt2mha.int8_gemv_rows(u, q, q.sum(1, dtype=torch.int32), s)
    assert torch.equal(y, (u.long() @ q.long().t()).float() * s)
    assert torch.equal(torch.ops.gpt2mha.int8_gemv_rows(u[-1:], q, q.sum(1, dtype=torch.int32), s)[0], y[-1])


@needs_kernel
def test_the_per_row_operator_refuses_values_that_are_not_8_bit_integers():
    u = torch.zeros(2, 32)
    q = torch.ones(4, 32, dtype=torch.int8)
    qsum, s = q.sum(1, dtype=torch.int32), torch.ones(4)
    u[1, 3] = float("nan")                    # a non-finite row: its scale makes the layer's row NaN anyway
    assert torch.equal(torch.ops.gpt2mha.int8_gemv_rows(u, q, qsum, s), torch.zeros(2, 4))
    u[1, 3] = 128.0
    with pytest.raises(RuntimeError, match=r"integers in \[-128, 127\]"):
        torch.ops.gpt2mha.int8_gemv_rows(u, q, qsum, s)
    with pytest.raises(RuntimeError, match="qsum must be a contiguous int32"):
        torch.ops.gpt2mha.int8_gemv_rows(u * 0, q, qsum.long(), s)
