"""gpt2mha's causal attention kernel for prefills (kernels/causal_attention.cpp,
``torch.ops.gpt2mha.causal_attention``, used by the decode view's PrefillAttention).

Reference: PyTorch's own ``scaled_dot_product_attention`` with OpenAI's causal mask
(``gpt2mha.attention_mask``, bottom-right aligned), and float64 attention written out; the
kernel sums in another order, so they agree to float32 rounding.
"""

import shutil

import pytest
import torch
import torch.nn.functional as F

from gpt2mha import attention_mask
from gpt2mha.inference.quant import gemv
from gpt2mha.kernels import dispatch

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")


def _qkv(B, h, T, S, D, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:                                         # as CausalSelfAttention splits c_attn's output
        qkv = torch.randn(B, T, 3 * h * D, generator=g)
        q = qkv[..., :h * D].view(B, T, h, D).transpose(1, 2)
    else:
        q = torch.randn(B, h, T, D, generator=g)
    k, v = torch.randn(B, h, S, D, generator=g), torch.randn(B, h, S, D, generator=g)
    return q, k, v


def _reference64(q, k, v):
    T, S = q.shape[-2], k.shape[-2]
    w = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    w = w.masked_fill(~attention_mask(T, S), float("-inf")).softmax(-1)
    return w @ v.double()


@pytest.mark.parametrize("B,h,T,S,D", [(1, 12, 128, 128, 64), (2, 3, 37, 37, 16), (1, 2, 300, 300, 8),
                                       (2, 4, 5, 21, 24), (1, 1, 2, 2, 8), (1, 2, 70, 70, 40)])
def test_the_kernel_is_causal_attention(B, h, T, S, D):
    q, k, v = _qkv(B, h, T, S, D, seed=T + S, strided=D == 16)
    o = torch.ops.gpt2mha.causal_attention(q, k, v)
    assert o.shape == (B, h, T, D) and o.dtype == torch.float32
    ref = _reference64(q, k, v)
    assert (o.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(T, S))
    torch.testing.assert_close(o, sdpa, atol=2e-6, rtol=1e-5)
    assert o.transpose(1, 2).is_contiguous()                    # heads merge with a free reshape


@pytest.mark.parametrize("B,h,T,S,D", [(1, 12, 128, 128, 64), (2, 3, 37, 50, 64), (1, 2, 17, 40, 24),
                                       (1, 2, 33, 33, 40), (1, 2, 64, 97, 80), (1, 1, 1, 1, 16)])
def test_the_avx512_and_avx2_paths_give_the_same_bits(B, h, T, S, D):
    # 16-lane tiles (32 keys, 64 dims, exp on 16 lanes) against the 8-lane ones: each lane's
    # operations are the same, so are the results; sizes that leave 16-key, 16-dim and 8-dim tails
    if "avx512" not in dispatch.cpu():
        pytest.skip("the CPU has no AVX-512: the kernel has one path here")
    q, k, v = _qkv(B, h, T, S, D, seed=7 * T + S, strided=D == 64)
    with dispatch.limited(["avx512"]):
        assert dispatch.paths()["causal_attention"] == "avx512"
        wide = torch.ops.gpt2mha.causal_attention(q * 3, k, v)
    with dispatch.limited(()):
        narrow = torch.ops.gpt2mha.causal_attention(q * 3, k, v)
    assert torch.equal(wide, narrow)
    assert (wide.double() - _reference64(q * 3, k, v)).abs().max() <= 1e-5


def test_nan_rows_are_the_same_nan_on_both_paths():
    # an infinite score makes a NaN row (as SDPA's); its NaNs took the sign of whichever operand
    # each path's multiply kept (0xffc00000 on AVX2, 0x7fc00000 on AVX-512: a break-it review)
    if "avx512" not in dispatch.cpu():
        pytest.skip("the CPU has no AVX-512: the kernel has one path here")
    q, k, v = _qkv(1, 2, 9, 25, 56, seed=3)
    q[0, 0, 8, 3] = float("inf")
    k[0, 1, 0, 5] = float("nan")                     # key 0, which every query of head 1 sees
    with dispatch.limited(["avx512"]):
        wide = torch.ops.gpt2mha.causal_attention(q, k, v)
    with dispatch.limited(()):
        narrow = torch.ops.gpt2mha.causal_attention(q, k, v)
    nan = wide.isnan()
    assert nan[0, 0, 8].all() and nan[0, 1].all() and nan.sum() == 56 * 10      # row 8 of head 0, all of head 1
    assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))        # every bit, NaNs included


def test_each_querys_result_is_its_own():
    # batch invariance: a query's output is the same bits whatever the other queries, heads,
    # sequences and threads of the call (a shorter prompt of the same tokens, one head, one thread)
    q, k, v = _qkv(2, 3, 77, 77, 64, seed=1)
    full = torch.ops.gpt2mha.causal_attention(q, k, v)
    for T in (1, 6, 33, 64):
        assert torch.equal(torch.ops.gpt2mha.causal_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T]), full[:, :, :T])
    assert torch.equal(torch.ops.gpt2mha.causal_attention(q[1:, 2:], k[1:, 2:], v[1:, 2:]), full[1:, 2:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.gpt2mha.causal_attention(q, k, v), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cut", [20, 18, 33])
def test_a_query_ignores_the_keys_after_it(cut):
    # whatever sits in later keys and values (huge, NaN) never reaches an earlier query, at any
    # row of the kernel's passes (cut 18 and 33 fall inside them)
    q, k, v = _qkv(1, 2, 40, 40, 8, seed=2)
    o = torch.ops.gpt2mha.causal_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = 1e4
    v2[:, :, cut:] = float("nan")
    o2 = torch.ops.gpt2mha.causal_attention(q, k2, v2)
    assert torch.equal(o2[:, :, :cut], o[:, :, :cut]) and o2[:, :, cut:].isnan().all()


def test_huge_scores_keep_their_gaps_and_non_finite_ones_give_nan_rows():
    # reference: SDPA with OpenAI's mask. Scores ~3e10 apart by ~1e5: all weight on the largest
    q = torch.zeros(1, 1, 2, 8)
    k = torch.zeros(1, 1, 2, 8)
    v = torch.arange(16.0).view(1, 1, 2, 8)
    q[..., 0] = 1.0
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 9.0e10, 9.0e10 + 2e5
    o = torch.ops.gpt2mha.causal_attention(q, k, v)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(2, 2)))
    torch.testing.assert_close(o[0, 0, 1], v[0, 0, 1])
    q2, k2, v2 = _qkv(1, 2, 12, 12, 8, seed=3)
    q2[0, 1, 5, 3] = float("inf")                                  # ±inf scores: a NaN row
    k2[0, 0, 2] = float("nan")                                     # NaN scores: NaN from query 2 on
    o2 = torch.ops.gpt2mha.causal_attention(q2, k2, v2)
    want = _reference64(q2, k2, v2)                                # (SDPA spreads NaN to every query)
    assert torch.equal(o2.isnan(), want.isnan())
    assert o2[0, 1, 5].isnan().all() and o2[0, 0, 2:].isnan().all() and not o2[0, 0, :2].isnan().any()
    torch.testing.assert_close(o2.nan_to_num().double(), want.nan_to_num(), atol=2e-6, rtol=1e-5)


def test_bad_arguments_are_named():
    q, k, v = _qkv(1, 2, 4, 4, 8)
    with pytest.raises(RuntimeError, match=r"causal_attention: q must be a float32 CPU tensor \[B, h, T, D\]"):
        torch.ops.gpt2mha.causal_attention(q.double(), k, v)
    with pytest.raises(RuntimeError, match="whose last dimension is contiguous"):
        torch.ops.gpt2mha.causal_attention(q, k.transpose(2, 3), v)
    with pytest.raises(RuntimeError, match=r"head_dim=6 must be a positive multiple of 8"):
        torch.ops.gpt2mha.causal_attention(q[..., :6], k[..., :6], v[..., :6])
    with pytest.raises(RuntimeError, match=r"needs 1 <= T <= S .*got T=4, S=3"):
        torch.ops.gpt2mha.causal_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(RuntimeError, match=r"k and v must be \[B=1, h=2, S, D=8\]"):
        torch.ops.gpt2mha.causal_attention(q, k, v[:, :1])


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor compiles C++: no compiler here")
def test_inside_torch_compile_the_kernel_is_one_opaque_call():
    # a registered fake: dynamo traces it with fullgraph=True (reference: the eager call)
    q, k, v = _qkv(1, 2, 9, 9, 8, seed=4)
    f = torch.compile(lambda q, k, v: torch.ops.gpt2mha.causal_attention(q, k, v) * 2.0, fullgraph=True)
    torch.testing.assert_close(f(q, k, v), torch.ops.gpt2mha.causal_attention(q, k, v) * 2.0)
