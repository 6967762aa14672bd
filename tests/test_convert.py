"""Exact conversions between attention layouts and between whole-model state dicts (gpt2mha.learn.attention_layouts, gpt2mha.io.layouts).

References: the outputs of the source module (a conversion must not change a single output),
GPT-2's fused column offsets for the per-head view (q at h*hd, k at n_embd + h*hd, v at
2*n_embd + h*hd), the NumPy reference of OpenAI's formulas (gpt2mha.core.reference), and
transformers' GPT2LMHeadModel (its Conv1D modules and logits) for the whole-model state dicts.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from gpt2mha import GPT2, GPT2Config, CausalSelfAttention, MultiHeadAttention, MultiHeadAttentionWrapper
from gpt2mha import attention_mask
from gpt2mha.core import reference
from gpt2mha.io.layouts import conv1d_to_linear_state_dict, linear_to_conv1d_state_dict
from gpt2mha.learn.attention_layouts import (fused_to_heads, fused_to_mha, heads_to_fused, mha_to_fused, mha_to_wrapper,
                                             wrapper_to_mha)

ATOL = 1e-5  # fp32 agreement between different computations


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run faster on one thread


def randomize_(module, seed):
    """Normal(0, 0.5) into every parameter (biases included), so no zero bias hides a bug."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def run(module, x, impl, past=None):
    """Output of any layout for x [B, T, d_in] with the chosen backend (past only for MHA/fused)."""
    module.attn_impl = impl
    with torch.no_grad():
        if isinstance(module, CausalSelfAttention):
            return module(x, past)[0]
        if isinstance(module, MultiHeadAttention):
            return module(x, past=past)
        return module(x)


def per_head_forward(heads, c_proj_bias, x):
    """GPT-2's fused layout taken literally: each head attends on its own q, k, v columns; y = sum_h a_h @ proj_h + b."""
    T = x.shape[1]
    m = attention_mask(T, T)
    y = c_proj_bias.expand(*x.shape[:2], -1).clone()
    for hh in heads:
        q, k, v = (x @ hh[f"{r}_weight"] + hh[f"{r}_bias"] for r in "qkv")   # [B, T, hd]
        w = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        w = torch.softmax(w.masked_fill(~m, -torch.inf), dim=-1)
        y = y + (w @ v) @ hh["proj_weight"]
    return y


def assert_same_params(a, b, atol=1e-6):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=0, msg=k)


# ------------------------------------------------------------------------ property test
@settings(max_examples=100, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 5), P=st.integers(0, 4), d_in=st.integers(1, 8),
       num_heads=st.integers(1, 4), head_dim=st.integers(1, 4), bias=st.booleans(), square=st.booleans(),
       seed=st.integers(0, 2**16))
def test_all_layouts_backends_and_reference_agree(B, T, P, d_in, num_heads, head_dim, bias, square, seed):
    """wrapper -> MHA -> fused -> per-head view -> fused -> MHA -> wrapper: every layout and both
    backends give the same outputs as the NumPy reference (atol 1e-5), with and without a past;
    every round trip returns the same parameters (atol 1e-6)."""
    C = num_heads * head_dim
    d_in = C if square else d_in
    torch.manual_seed(seed)
    x = torch.randn(B, P + T, d_in)

    # wrapper (d_out = head_dim per head) -> MultiHeadAttention with identity out_proj
    wrapper = randomize_(MultiHeadAttentionWrapper(d_in, head_dim, P + T, 0.0, num_heads, qkv_bias=bias), seed)
    mha = wrapper_to_mha(wrapper)
    assert mha.d_out == C and mha.head_dim == head_dim and (mha.W_query.bias is not None) == bias
    for impl in ("explicit", "sdpa"):
        torch.testing.assert_close(run(mha, x, impl), run(wrapper, x, "explicit"), atol=ATOL, rtol=0)
        torch.testing.assert_close(run(wrapper, x, impl), run(wrapper, x, "explicit"), atol=ATOL, rtol=0)
    back = mha_to_wrapper(mha)
    assert_same_params(back, wrapper)

    # a general MultiHeadAttention (random out_proj) against the NumPy reference, in Conv1D layout
    mha = randomize_(MultiHeadAttention(d_in, C, P + T, 0.0, num_heads, qkv_bias=bias), seed + 1)
    lins = (mha.W_query, mha.W_key, mha.W_value)
    c_attn_w = torch.cat([lin.weight for lin in lins]).t().detach().numpy()
    c_attn_b = np.concatenate([lin.bias.detach().numpy() if bias else np.zeros(C, np.float32) for lin in lins])
    ref, _ = reference.attn(x.numpy(), c_attn_w, c_attn_b, mha.out_proj.weight.t().detach().numpy(),
                            mha.out_proj.bias.detach().numpy(), num_heads)
    ref = torch.from_numpy(ref).float()
    for impl in ("explicit", "sdpa"):
        torch.testing.assert_close(run(mha, x, impl), ref, atol=ATOL, rtol=0)
    if d_in != C:
        with pytest.raises(ValueError, match=f"d_in={d_in} != d_out={C}"):
            mha_to_fused(mha)
        return

    # MultiHeadAttention <-> fused CausalSelfAttention, cached and uncached
    fused = mha_to_fused(mha)
    assert fused.c_attn.weight.shape == (C, 3 * C)
    if not bias:
        assert torch.equal(fused.c_attn.bias, torch.zeros(3 * C))
    _, past = mha(x[:, :P], return_present=True) if P else (None, None)
    for impl in ("explicit", "sdpa"):
        torch.testing.assert_close(run(fused, x, impl), ref, atol=ATOL, rtol=0)
        if P:  # the two layouts share the cache layout [B, 2, h, P, hd]
            with torch.no_grad():
                fused_past = fused(x[:, :P])[1]
            torch.testing.assert_close(fused_past, past, atol=ATOL, rtol=0)
            torch.testing.assert_close(run(fused, x[:, P:], impl, past), ref[:, P:], atol=ATOL, rtol=0)
            torch.testing.assert_close(run(mha, x[:, P:], impl, past), ref[:, P:], atol=ATOL, rtol=0)
    again = fused_to_mha(fused, P + T)
    assert (again.W_query.bias is not None) == bias  # qkv_bias=None: inferred from c_attn.bias
    assert_same_params(again, mha)

    # fused -> per-head view (q | k | v column offsets) -> fused
    heads = fused_to_heads(fused)
    assert len(heads) == num_heads
    for h, hh in enumerate(heads):
        assert torch.equal(hh["k_weight"], fused.c_attn.weight[:, C + h * head_dim:C + (h + 1) * head_dim])
    torch.testing.assert_close(per_head_forward(heads, fused.c_proj.bias.detach(), x), ref, atol=ATOL, rtol=0)
    assert_same_params(heads_to_fused(heads, fused.c_proj.bias.detach()), fused)


# ---------------------------------------------------------------------- single conversions
def test_conversions_keep_mode_backend_dtype_and_rng():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 8, 16, 0.1, num_heads=2).double().train()
    mha.attn_impl = "sdpa"
    state = torch.get_rng_state()
    fused = mha_to_fused(mha)
    assert torch.equal(torch.get_rng_state(), state)  # conversions never consume the global RNG
    assert fused.training and fused.attn_impl == "sdpa" and fused.attn_pdrop == 0.1
    assert fused.c_attn.weight.dtype == torch.float64
    back = fused_to_mha(fused, 16)
    assert back.dropout.p == 0.1 and back.attn_impl == "sdpa" and back.W_query.weight.dtype == torch.float64


def test_fused_to_mha_bias_rules():
    # qkv_bias=False in the book layout: converting back needs zero bias or qkv_bias=True
    torch.manual_seed(0)
    fused = CausalSelfAttention(8, 2)           # zero c_attn.bias after init
    assert fused_to_mha(fused, 4).W_query.bias is None
    assert fused_to_mha(fused, 4, qkv_bias=True).W_query.bias is not None
    with torch.no_grad():
        fused.c_attn.bias[3] = 0.5
    with pytest.raises(ValueError, match="c_attn.bias has nonzero entries; convert with qkv_bias=True"):
        fused_to_mha(fused, 4, qkv_bias=False)
    assert fused_to_mha(fused, 4).W_query.bias is not None


def test_conversion_size_errors():
    # every conversion checks sizes before copying and names the tensor and both shapes
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    wrapper.heads[1].W_key = torch.nn.Linear(3, 5, bias=False)
    with pytest.raises(ValueError, match=r"heads\[1\].W_key.weight has shape \[5, 3\], expected \[2, 3\]"):
        wrapper_to_mha(wrapper)

    mha = MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    with pytest.raises(ValueError, match="out_proj is not the identity"):
        mha_to_wrapper(mha)
    mha.W_value = torch.nn.Linear(4, 6, bias=False)
    with pytest.raises(ValueError, match=r"W_value.weight has shape \[6, 4\], expected \[4, 4\]"):
        mha_to_fused(mha)

    fused = CausalSelfAttention(4, 2)
    fused.c_attn.weight = torch.nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"c_attn.weight has shape \[4, 8\], expected \[4, 12\]"):
        fused_to_mha(fused, 6)
    with pytest.raises(ValueError, match=r"c_attn.weight has shape \[4, 8\], expected \[4, 12\]"):
        fused_to_heads(fused)

    heads = fused_to_heads(CausalSelfAttention(4, 2))
    with pytest.raises(ValueError, match=r"c_proj_bias has shape \[3\], expected \[4\]"):
        heads_to_fused(heads, torch.zeros(3))
    bad = [dict(h) for h in heads]
    bad[1]["v_bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"heads\[1\]\['v_bias'\] has shape \[3\], expected \[2\]"):
        heads_to_fused(bad, torch.zeros(4))
    del bad[0]["proj_weight"]
    with pytest.raises(ValueError, match=r"heads\[0\] is missing proj_weight"):
        heads_to_fused(bad, torch.zeros(4))
    with pytest.raises(ValueError, match="heads is empty"):
        heads_to_fused([], torch.zeros(4))


# --------------------------------------------------------------- whole-model state dicts
def hf_tiny_gpt2(seed=0):
    """A random transformers GPT2LMHeadModel (n_embd 16, 2 heads, 2 layers, MLP 64), eval mode."""
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = HFConfig(vocab_size=40, n_positions=12, n_embd=16, n_head=2, n_layer=2, bos_token_id=None,
                   eos_token_id=None, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # nonzero biases, non-unit LayerNorms
    return model


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_state_dict_conv1d_linear_against_transformers(prefix):
    """transformers' GPT2LMHeadModel is the reference Conv1D layout: exactly the four Conv1D
    weights per block are transposed, each then works as nn.Linear (F.linear == HF Conv1D),
    the round trip is exact, and the Conv1D dict gives gpt2mha.GPT2 the same logits."""
    hf = hf_tiny_gpt2()
    sd = {k.removeprefix("transformer.") if not prefix else k: v for k, v in hf.state_dict().items()}
    lin = conv1d_to_linear_state_dict(sd)
    assert lin.keys() == sd.keys()
    changed = {k for k in sd if not torch.equal(sd[k], lin[k])}
    assert changed == {f"{prefix}h.{i}.{name}" for i in range(2) for name in
                       ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")}
    for k in changed:
        assert torch.equal(lin[k], sd[k].t())
    assert lin[f"{prefix}h.0.attn.c_attn.weight"].shape == (48, 16)  # nn.Linear [out, in]
    assert lin[f"{prefix}h.0.mlp.c_fc.weight"].shape == (64, 16)

    with torch.no_grad():
        for i, block in enumerate(hf.transformer.h):
            for name, mod in (("attn.c_attn", block.attn.c_attn), ("attn.c_proj", block.attn.c_proj),
                              ("mlp.c_fc", block.mlp.c_fc), ("mlp.c_proj", block.mlp.c_proj)):
                key = f"{prefix}h.{i}.{name}"
                xi = torch.randn(3, 5, mod.weight.shape[0])
                torch.testing.assert_close(F.linear(xi, lin[key + ".weight"], lin[key + ".bias"]), mod(xi),
                                           atol=1e-6, rtol=0)

    back = linear_to_conv1d_state_dict(lin)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    model = GPT2(GPT2Config(n_vocab=40, n_ctx=12, n_embd=16, n_head=2, n_layer=2, tokenizer="bytes")).eval()
    model.load_state_dict({k.removeprefix("transformer."): v for k, v in back.items()
                           if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))})
    idx = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, hf(idx).logits, atol=ATOL, rtol=0)


def test_state_dict_conversion_size_errors():
    sd = {k.removeprefix("transformer."): v for k, v in hf_tiny_gpt2().state_dict().items()}
    with pytest.raises(ValueError, match=r"h.0.attn.c_attn.weight has shape \[48, 16\]; expected \[16, 48\] "
                                         r"in the Conv1D \[in, out\] layout"):
        conv1d_to_linear_state_dict(conv1d_to_linear_state_dict(sd))  # already nn.Linear layout
    with pytest.raises(ValueError, match=r"h.0.attn.c_attn.weight has shape \[16, 48\]; expected \[48, 16\] "
                                         r"in the nn.Linear \[out, in\] layout"):
        linear_to_conv1d_state_dict(sd)
    bad = dict(sd, **{"h.1.mlp.c_proj.weight": torch.zeros(32, 16)})
    with pytest.raises(ValueError, match=r"h.1.mlp.c_proj.weight has shape \[32, 16\]; expected \[64, 16\]"):
        conv1d_to_linear_state_dict(bad)
    bad = dict(sd, **{"h.0.attn.c_proj.weight": torch.zeros(16)})
    with pytest.raises(ValueError, match=r"h.0.attn.c_proj.weight has shape \[16\]; expected a 2-D"):
        conv1d_to_linear_state_dict(bad)


@pytest.mark.parametrize("wrapper", ["_orig_mod.", "module.", "module._orig_mod."])
def test_state_dict_conversion_strips_wrapper_prefixes(wrapper):
    """A torch.compile'd (or DDP) nanoGPT state dict, every key prefixed, is converted like the
    plain one, not passed through untransposed: the prefix is stripped and the result equals the
    plain dict's conversion; the transposes are checked against the plain tensors themselves."""
    plain = conv1d_to_linear_state_dict(hf_tiny_gpt2().state_dict())      # nanoGPT's Linear layout
    wrapped = {wrapper + k: v for k, v in plain.items()}
    back = linear_to_conv1d_state_dict(wrapped)
    assert back.keys() == plain.keys()
    assert back["transformer.h.1.mlp.c_fc.weight"].shape == (16, 64)
    for k in plain:
        expect = plain[k].t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else plain[k]
        assert torch.equal(back[k], expect), k


def test_state_dict_conversion_refuses_unknown_or_mixed_prefixes():
    plain = conv1d_to_linear_state_dict(hf_tiny_gpt2().state_dict())
    with pytest.raises(ValueError, match=r"the prefix 'model\.transformer\.h\.0\.' is not a GPT-2 block's"):
        linear_to_conv1d_state_dict({"model." + k: v for k, v in plain.items()})
    mixed = {("_orig_mod." + k if "h.0." in k else k): v for k, v in plain.items()}
    with pytest.raises(ValueError, match=r"wrapper prefix '_orig_mod\.'.*others do not"):
        linear_to_conv1d_state_dict(mixed)
