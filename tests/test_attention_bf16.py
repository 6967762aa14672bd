"""A bf16 model's prompt attention on AVX-512 BF16 (kernels/causal_attention.cpp,
``torch.ops.gpt2mha.causal_attention_bf16``, which the native forward runs for bf16 prompts).

References: float64 attention written out over the bf16-rounded q, k, v with each query's exps
rounded to bf16 before ``p v`` (as SDPA's flash kernel does for bf16); and, where every score is
equal (q = 0, so every exp is exactly 1), the exact float32 sums in vdpbf16ps's order computed
with NumPy: for each pair of keys (2m, 2m + 1), the odd one's value added first, then the even
one's, then the sum times float32(1 / n).
"""

import numpy as np
import pytest
import torch

from gpt2mha import attention_mask
from gpt2mha.inference.dense import has_bf16_dot
from gpt2mha.inference.quant import gemv
from gpt2mha.kernels import dispatch

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")
needs_bf16 = pytest.mark.skipif(not (gemv.available() and has_bf16_dot()),
                                reason="the CPU has no AVX-512 BF16 (or it is not allowed: gpt2mha.kernels.dispatch)")
attention = (lambda q, k, v: torch.ops.gpt2mha.causal_attention_bf16(q, k, v))


def _qkv(B, h, T, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, T, D, generator=g), torch.randn(B, h, S, D, generator=g),
            torch.randn(B, h, S, D, generator=g))


def _reference(q, k, v):
    """float64 attention over bf16 q, k, v, each query's exps rounded to bf16 before p v."""
    q, k, v = (t.bfloat16().double() for t in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~attention_mask(T, S), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e.float().bfloat16().double() @ v) / e.sum(-1, keepdim=True)


SHAPES = [(1, 12, 128, 128, 64), (2, 3, 37, 37, 16), (1, 2, 33, 33, 8), (2, 4, 5, 21, 24), (1, 1, 2, 2, 8),
          (1, 2, 70, 71, 40), (3, 1, 1, 9, 128), (1, 2, 300, 300, 64)]


@needs_bf16
@pytest.mark.parametrize("B,h,T,S,D", SHAPES)
def test_it_is_attention_over_bf16_values(B, h, T, S, D):
    # odd and even key counts (a last pair with one key), D = 16 k + 8 (a half tile of dims), T < S
    q, k, v = _qkv(B, h, T, S, D, seed=T + S + D)
    o = attention(q, k, v)
    assert o.shape == (B, h, T, D) and o.dtype == torch.float32
    # an exp within float32's rounding of a bf16 rounding boundary may round the other way than
    # float64's: one bf16 step (2^-8 relative) of one weight, seen as ~1e-3 of an output at worst
    torch.testing.assert_close(o.double(), _reference(q, k, v), atol=2e-3, rtol=0)
    assert (o.double() - _reference(q, k, v)).abs().mean() < 2e-5


@needs_bf16
@pytest.mark.parametrize("T,S,D", [(7, 7, 16), (6, 9, 24), (1, 1, 8), (33, 64, 64), (40, 41, 8)])
def test_with_equal_scores_it_is_the_pairs_sum_exactly(T, S, D):
    # q = 0: every score 0, every exp 1 (exact in bf16), each row's sum n: the output is the values'
    # sum in vdpbf16ps's order over the row's own keys (odd key first in each pair; a row with an
    # odd count takes its last key alone), times float32(1 / n), bit for bit
    _, k, v = _qkv(1, 2, T, S, D, seed=S)
    got = attention(torch.zeros(1, 2, T, D), k, v).numpy()
    vb = v.bfloat16().float().numpy()
    want = np.zeros(got.shape, np.float32)
    for i in range(T):
        n = i + S - T + 1
        acc = np.zeros((1, 2, D), np.float32)
        for m in range((n + 1) // 2):
            if 2 * m + 1 < n:
                acc = acc + vb[:, :, 2 * m + 1]
            acc = acc + vb[:, :, 2 * m]
        want[:, :, i] = acc * (np.float32(1) / np.float32(n))
    np.testing.assert_array_equal(got, want)


@needs_bf16
def test_each_querys_result_is_its_own():
    # a batch row alone, the last query alone (the native forward's last block), the last 5 queries
    # (other tiles of rows): the same bits as in the whole
    q, k, v = _qkv(3, 2, 45, 51, 24, seed=3)
    o = attention(q, k, v)
    assert torch.equal(attention(q[1:2], k[1:2], v[1:2]), o[1:2])
    assert torch.equal(attention(q[:, :, -1:], k, v), o[:, :, -1:])
    assert torch.equal(attention(q[:, :, -5:], k, v), o[:, :, -5:])


@needs_bf16
@pytest.mark.parametrize("S", [8, 9])
def test_a_later_non_finite_value_does_not_reach_earlier_queries(S):
    # the last key's value inf: every earlier query (some of them sharing that key's pair with
    # their own last key) is as it is with a finite value there; the last query sees inf
    q, k, v = _qkv(1, 2, S, S, 16, seed=S)
    bad = v.clone()
    bad[:, :, -1] = float("inf")
    o, o_bad = attention(q, k, v), attention(q, k, bad)
    assert torch.equal(o_bad[:, :, :-1], o[:, :, :-1])
    assert not torch.isfinite(o_bad[:, :, -1]).all()


@needs_bf16
def test_a_nan_score_gives_a_nan_row_and_no_other():
    q, k, v = _qkv(1, 2, 10, 10, 16, seed=1)
    q[0, 1, 4, 3] = float("nan")
    o, clean = attention(q, k, v), attention(torch.where(q.isnan(), 0.0, q), k, v)
    assert o[0, 1, 4].isnan().all()
    rows = torch.ones(10, dtype=torch.bool)
    rows[4] = False
    assert torch.equal(o[0, 1, rows], clean[0, 1, rows]) and torch.equal(o[0, 0], clean[0, 0])


@needs_bf16
def test_inputs_are_rounded_to_bf16_first():
    q, k, v = _qkv(2, 2, 20, 20, 16, seed=5)
    assert torch.equal(attention(q, k, v), attention(*(t.bfloat16().float() for t in (q, k, v))))


def test_bad_arguments_are_named_and_it_needs_the_instruction():
    q, k, v = _qkv(1, 2, 4, 4, 8)
    with pytest.raises(RuntimeError, match=r"causal_attention_bf16: q must be a float32 CPU tensor"):
        attention(q.double(), k, v)
    with pytest.raises(RuntimeError, match=r"causal_attention_bf16: needs 1 <= T <= S .*got T=4, S=3"):
        attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(RuntimeError, match=r"causal_attention_bf16: head_dim=6 must be a positive multiple of 8"):
        attention(q[..., :6], k[..., :6], v[..., :6])
    with dispatch.limited(["avx512", "avx512_vnni"]), \
            pytest.raises(RuntimeError, match=r"needs a CPU with AVX-512 and AVX-512 BF16, both allowed "
                                              r"\(gpt2mha\.kernels\.dispatch\.allow\)"):
        attention(q, k, v)


@needs_bf16
def test_a_bf16_models_prompt_takes_it_and_stays_near_its_forward():
    # the native forward of a bf16 model, whose prompts take it here: its prompt logits near the
    # model's own forward (SDPA over bf16), the same greedy token
    from gpt2mha import GPT2, GPT2Config
    from gpt2mha.core.kv_cache import KVCache
    from gpt2mha.inference.native import native_step

    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=211, n_ctx=64, n_embd=48, n_head=3, n_layer=2)
    model = GPT2(cfg).to(torch.bfloat16).eval()
    step = native_step(model)
    prompt = torch.randint(0, 211, (2, 40))
    with torch.inference_mode():
        ref = model(prompt).logits[:, -1].float()
        got = step(prompt, KVCache(2, 2, 3, 64, 16, dtype=torch.bfloat16))
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
