"""CausalSelfAttention (fused Conv1D layout) against independent references.

References: the mask formula of OpenAI's ``attention_mask`` (seed 002), the column layout of
seed 000 (q | k | v contiguous blocks) computed by hand with plain per-head loops, and
transformers' GPT2Attention on the same weights.
"""

import math

import pytest
import torch

from gpt2mha import CausalSelfAttention, attention_mask
from gpt2mha.core.attention import combine_masks
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
    """Seed 000 done literally: head h reads q at h*64, k at 768 + h*64, v at 1536 + h*64."""
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
