"""CausalSelfAttention (fused Conv1D layout) against independent references.

References: the mask formula of OpenAI's ``attention_mask`` (openai/gpt-2 ``src/model.py``),
GPT-2's fused column layout (q | k | v contiguous blocks) computed by hand with plain per-head
loops, SDPA (PyTorch's fused kernel) for the explicit core, and
transformers' GPT2Attention on the same weights.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from gpt2mha import CausalSelfAttention, attention_mask
from gpt2mha.core.attention import attend_explicit, attend_sdpa, combine_masks
from gpt2mha.core.hooks import record


def test_attention_mask_formula_all_small_sizes():
    # m[i, j] = i >= j - ns + nd, straight from the official code, for every 1 <= nd <= ns <= 8
    for ns in range(1, 9):
        for nd in range(1, ns + 1):
            m = attention_mask(nd, ns)
            assert m.dtype == torch.bool and m.shape == (nd, ns)
            for i in range(nd):
                for j in range(ns):
                    assert bool(m[i, j]) == (i >= j - ns + nd)


def test_attention_mask_rejects_bad_sizes():
    with pytest.raises(ValueError, match="nd=3, ns=2"):
        attention_mask(3, 2)
    with pytest.raises(ValueError, match="nd=0"):
        attention_mask(0, 4)


def per_head_loop_reference(attn, x):
    """GPT-2's fused layout done literally: head h reads q at h*64, k at 768 + h*64, v at 1536 + h*64."""
    W, b = attn.c_attn.weight, attn.c_attn.bias
    C, hd = attn.n_embd, attn.head_dim
    qkv = x @ W + b
    T = x.shape[1]
    heads = []
    for h in range(attn.n_head):
        q = qkv[..., h * hd:(h + 1) * hd]
        k = qkv[..., C + h * hd:C + (h + 1) * hd]
        v = qkv[..., 2 * C + h * hd:2 * C + (h + 1) * hd]
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        causal = torch.ones(T, T).tril().bool()
        scores = scores.masked_fill(~causal, float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v)
    concat = torch.cat(heads, dim=-1)             # head h at columns h*hd : (h+1)*hd
    return concat @ attn.c_proj.weight + attn.c_proj.bias


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_matches_per_head_loop_gpt2_small(impl):
    torch.manual_seed(0)
    attn = CausalSelfAttention(768, 12, attn_impl=impl).eval()
    with torch.no_grad():
        attn.c_attn.bias.normal_()
        attn.c_proj.bias.normal_()
    assert attn.c_attn.weight.shape == (768, 2304) and attn.c_proj.weight.shape == (768, 768)
    x = torch.randn(2, 6, 768)
    y, present = attn(x)
    assert y.shape == (2, 6, 768) and present.shape == (2, 2, 12, 6, 64)
    torch.testing.assert_close(y, per_head_loop_reference(attn, x), atol=1e-5, rtol=1e-5)


def test_matches_transformers_gpt2attention():
    from transformers import GPT2Config as HFConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    torch.manual_seed(1)
    config = HFConfig(n_embd=64, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, attn_implementation="sdpa")
    hf = GPT2Attention(config, layer_idx=0).eval()  # standalone: sdpa applies the causal mask itself
    ours = CausalSelfAttention(64, 4).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
        ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k.startswith(("c_attn", "c_proj"))})
    x = torch.randn(3, 9, 64)
    ref = hf(x)[0]
    for impl in ("sdpa", "explicit"):
        ours.attn_impl = impl
        torch.testing.assert_close(ours(x)[0], ref, atol=1e-5, rtol=1e-5)


def test_past_concatenation_equals_full_pass_and_paths_agree():
    torch.manual_seed(2)
    attn = CausalSelfAttention(32, 4).eval()
    x = torch.randn(2, 10, 32)
    full, present_full = attn(x)
    for split in (1, 4, 9):
        y1, p1 = attn(x[:, :split])
        y2, p2 = attn(x[:, split:], past=p1)
        torch.testing.assert_close(torch.cat([y1, y2], 1), full, atol=1e-5, rtol=1e-5)
        # present holds only the new tokens' keys/values
        assert p2.shape == (2, 2, 4, 10 - split, 8)
        torch.testing.assert_close(torch.cat([p1, p2], -2), present_full)
        attn.attn_impl = "explicit"
        out = []
        w = record(attn, ["hook_pattern"], lambda: out.append(attn(x[:, split:], past=p1)))["hook_pattern"]
        y2e = out[0][0]
        attn.attn_impl = "sdpa"
        torch.testing.assert_close(y2e, y2, atol=1e-5, rtol=1e-5)
        assert w.shape == (2, 4, 10 - split, 10)
        # masked (future) keys get exactly zero weight, bottom-right aligned
        m = attention_mask(10 - split, 10)
        assert (w[..., ~m] == 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 10 - split))


def test_dropout_only_in_training():
    torch.manual_seed(3)
    attn = CausalSelfAttention(32, 4, attn_pdrop=0.5, resid_pdrop=0.5)
    x = torch.randn(1, 5, 32)
    attn.eval()
    assert torch.equal(attn(x)[0], attn(x)[0])
    attn.train()
    assert not torch.equal(attn(x)[0], attn(x)[0])


def test_fully_masked_pad_rows_stay_finite():
    torch.manual_seed(4)
    attn = CausalSelfAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = combine_masks(attention_mask(5, 5), pad)
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        y = attn(x, attn_mask=mask)[0]
        assert torch.isfinite(y).all()
        # real tokens of the padded row equal the unpadded row's
        torch.testing.assert_close(y[0, 2:], attn(x[:1, 2:])[0][0], atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        CausalSelfAttention(10, 4)
    attn = CausalSelfAttention(32, 4)
    with pytest.raises(ValueError, match=r"x has shape \(2, 5, 16\)"):
        attn(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="past has shape"):
        attn(torch.randn(2, 5, 32), past=torch.randn(2, 2, 3, 4, 8))
    with pytest.raises(ValueError, match="attn_impl"):
        CausalSelfAttention(32, 4, attn_impl="flash")


def test_query_with_no_allowed_key_reads_nothing_on_both_paths():
    torch.manual_seed(5)
    attn = CausalSelfAttention(16, 2).eval()
    x = torch.randn(1, 4, 16)
    mask = attention_mask(4, 4).clone()
    mask[1] = False                                      # row 1 may read no key at all
    outs = {}
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        outs[impl] = attn(x, attn_mask=mask)[0]
    torch.testing.assert_close(outs["explicit"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    w = record(attn, ["hook_pattern"], lambda: attn(x, attn_mask=mask))["hook_pattern"]
    assert (w[:, :, 1] == 0).all()                       # in particular no weight on future keys


# -------------------------------------------------------- masks, extreme scores, low precision
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_causal_self_attention_reads_0_1_masks_the_same_in_both_cores(dtype):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    causal = attention_mask(5, 5)
    ref = attn(x)[0]                                              # plain causal
    outs = []
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        with torch.no_grad():
            outs.append(attn(x, attn_mask=causal.to(dtype))[0])
    for out in outs:                                              # a 0/1 float mask is not an additive bias
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    bad = causal.float()
    bad[0, 0] = 0.5
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        with pytest.raises(ValueError, match=r"attn_mask must be bool or hold only 0 .* got the value 0.5"):
            attn(x, attn_mask=bad)


@pytest.mark.parametrize("scale", [1.0, 1e12])
def test_explicit_core_gives_masked_keys_zero_weight_for_any_finite_scores(scale):
    # every real score around -1e12: with OpenAI's -1e10 fill the masked keys would be the row's
    # maximum and take all the weight; SDPA gives them none. Reference: SDPA.
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 6, 8)
    v = torch.randn(1, 2, 6, 8)
    k = k * 0 - 1.0 if scale > 1 else k                           # q·k = -sum(q): one sign per query
    q = q.abs() * scale if scale > 1 else q                       # scores ≈ -1e12 for every key
    mask = attention_mask(4, 6)
    seen = []
    a = attend_explicit(q, k, v, mask, hook_pattern=lambda w: seen.append(w) or w)
    w = seen[0]
    assert (w[..., ~mask] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 4))
    torch.testing.assert_close(a, attend_sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,S", [(1, 40), (40, 40), (5, 40)])
def test_low_precision_attention_scores_stay_finite(dtype, T, S):
    """Scores far beyond fp16's range (|q·k| ~ 1e5) still give a finite, correct softmax."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, n, 64, generator=gen) * 40 for n in (T, S))
    v = torch.randn(2, 3, S, 64, generator=gen)
    m = attention_mask(T, S)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m).float()
    ql, kl, vl = (t.to(dtype) for t in (q, k, v))
    fused = attend_sdpa(ql, kl, vl, None if T in (1, S) else m)
    seen = []
    explicit = attend_explicit(ql, kl, vl, m, hook_pattern=lambda p: seen.append(p) or p)
    w = seen[0]
    for a in (fused, explicit):
        assert a.dtype == dtype and torch.isfinite(a).all()
    assert torch.isfinite(w).all() and w.dtype == torch.float32
    torch.testing.assert_close(fused.float(), explicit.float(), atol=2e-2, rtol=0)
    # the reference is computed from the unrounded q, k: compare with the rounded inputs instead
    ref_rounded = F.scaled_dot_product_attention(ql.double(), kl.double(), vl.double(), attn_mask=m).float()
    torch.testing.assert_close(fused.float(), ref_rounded, atol=2e-2, rtol=0)
    assert ref.shape == fused.shape


def test_sdpa_core_compiles_once_over_dynamic_lengths():
    # is_causal must be a plain bool when T == S are symbolic sizes (torch.compile, dynamic=True);
    # reference: the explicit core (OpenAI's formula) run eagerly
    graphs = []

    def backend(gm, example_inputs):                                       # counts the traces
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(attend_sdpa, fullgraph=True, dynamic=True, backend=backend)
    for T in (3, 7, 12):
        q, k, v = (torch.randn(1, 2, T, 8, generator=torch.Generator().manual_seed(T + i)) for i in range(3))
        torch.testing.assert_close(compiled(q, k, v, None), attend_explicit(q, k, v, None), atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1                                                # one trace for every length


def _numpy_formula(q, k, v, mask):
    """OpenAI's attention in float32 NumPy (the reference for non-finite scores): softmax of the
    masked, scaled scores (max subtracted) times v; a NaN score makes its row NaN."""
    import numpy as np

    q, k, v, m = (t.numpy() for t in (q, k, v, mask))
    with np.errstate(all="ignore"):
        w = q @ k.swapaxes(-1, -2) * np.float32(1 / math.sqrt(q.shape[-1]))
        w = np.where(m, w, np.finfo(np.float32).min)
        w = np.exp(w - w.max(-1, keepdims=True))
        return torch.from_numpy((w / w.sum(-1, keepdims=True)) @ v)


@pytest.mark.parametrize("T,S", [(4, 4), (1, 6), (3, 6)])
def test_sdpa_core_gives_nan_where_the_formula_does(T, S):
    """Queries whose scores are all NaN: a NaN query, and one whose products overflow float32
    (1e30 · 1e30, signs mixed: inf - inf). PyTorch's CPU kernel returns zeros for such rows;
    the SDPA core gives NaN there, as the explicit core and OpenAI's formula (NumPy, float32)
    do, and the formula's numbers on every other row."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (T, S, S))
    q[0, 0, -1] = float("nan")                                              # head 0, last query
    q[0, 1, 0] = 1e30 * torch.tensor([1.0, -1] * 4)
    k[0, 1] = 1e30 * torch.tensor([1.0, 1, -1, -1, 1, 1, -1, -1])           # head 1: +inf and -inf products
    mask = attention_mask(T, S)
    ref = _numpy_formula(q, k, v, mask)
    assert torch.isnan(ref[0, 0, -1]).all() and torch.isnan(ref[0, 1]).any()
    if T in (1, S):                                                         # torch's zeros (without a mask)
        assert F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)[0, 0, -1].eq(0).all()
    for a in (attend_sdpa(q, k, v, None), attend_sdpa(q, k, v, mask), attend_explicit(q, k, v, None)):
        assert torch.equal(torch.isnan(a), torch.isnan(ref))
        torch.testing.assert_close(a.nan_to_num(), ref.nan_to_num(), atol=1e-5, rtol=1e-5)


def test_sdpa_core_keeps_rows_that_are_zero_by_the_formula():
    """Values of zero (a row of zeros that is right): the same zeros, no NaN."""
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.zeros(1, 2, 5, 8)
    v[:, 1] = torch.randn(5, 8)
    a = attend_sdpa(q, k, v, None)
    assert torch.equal(a[:, 0], torch.zeros(1, 5, 8)) and torch.isfinite(a).all()
    torch.testing.assert_close(a, attend_explicit(q, k, v, None), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_kernel_gives_nan_for_nan_scores_from_zero_rows_below_keys_on(dtype):
    """formula_where_zeroed checks only calls over fewer than ZERO_ROWS_BELOW keys: from there
    on PyTorch's CPU kernel itself gives NaN for a query whose scores are all NaN (one query, and
    causal prefills), at sizes around its vectors and its key blocks. A torch whose kernel
    zeroes such rows over more keys fails here."""
    from gpt2mha.core.attention import ZERO_ROWS_BELOW

    gen = torch.Generator().manual_seed(0)
    for S in [*range(ZERO_ROWS_BELOW, ZERO_ROWS_BELOW + 40), 255, 256, 257, 511, 512, 513, 1025]:
        for T in (1, S):
            q, k, v = (torch.randn(2, 2, n, 32, generator=gen).to(dtype) for n in (T, S, S))
            q[:, 0] = float("nan")
            a = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
            assert torch.isnan(a[:, 0]).all() and torch.isfinite(a[:, 1]).all(), (S, T)
