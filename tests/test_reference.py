"""The NumPy reference of OpenAI's formulas (gpt2mha.core.reference) against the formulas and models.

References: the formulas of openai/gpt-2 ``src/model.py`` as seed 002 states them (mask
``m[i, j] = i >= j - ns + nd``, ``w·m - 1e10·(1 - m)``, max-subtracted softmax, scale
rsqrt(head_dim), present = stack([k, v], 1), past concatenated on the sequence axis), PyTorch's
own GELU-tanh / LayerNorm, gpt2mha's CausalSelfAttention and GPT2, and transformers'
GPT2LMHeadModel as an implementation that shares no code with either.
"""

import ast
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import gpt2mha
from gpt2mha import GPT2, GPT2Config, CausalSelfAttention
from gpt2mha.core import reference

ATOL = 1e-5  # fp32 torch vs float64 NumPy (issue 4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run faster on one thread


def np_params(module):
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def randomize_(module, seed, scale=0.3):
    """Add noise to every parameter (biases and LayerNorms too), so nothing is trivially 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module


# ---------------------------------------------------------------------------------- pieces
def test_module_imports_no_torch():
    # issue 4: "No torch import in that module" - checked in the source and by loading the file
    # alone in a fresh interpreter where importing torch is made impossible
    path = reference.__file__
    tree = ast.parse(open(path).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"numpy", "__future__"}
    code = ("import sys, importlib.util; sys.modules['torch'] = None\n"
            f"spec = importlib.util.spec_from_file_location('ref', {path!r}); m = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(m); print(m.attention_mask(2, 3).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]"


def test_attention_mask_formula_and_torch_version():
    # seed 002: m[i, j] = 1[i >= j - ns + nd]; gpt2mha.attention_mask implements the same rule
    for ns in range(1, 9):
        for nd in range(1, ns + 1):
            m = reference.attention_mask(nd, ns)
            expected = [[float(i >= j - ns + nd) for j in range(ns)] for i in range(nd)]
            assert m.tolist() == expected
            assert np.array_equal(m.astype(bool), gpt2mha.attention_mask(nd, ns).numpy())


def test_masking_and_softmax():
    # seed 002: masked scores become w*m - 1e10*(1-m) and get exactly zero weight; softmax subtracts the max
    w = np.random.default_rng(0).normal(size=(1, 1, 3, 5)) * 1e3
    masked = reference.mask_attn_weights(w)
    m = reference.attention_mask(3, 5)
    assert np.array_equal(masked[..., m == 0], np.full((1, 1, int((m == 0).sum())), -1e10))
    p = reference.softmax(masked)
    assert np.all(p[..., m == 0] == 0) and np.allclose(p.sum(-1), 1) and np.isfinite(p).all()
    big = np.array([1000.0, 1001.0, 1002.0])  # would overflow exp without the max subtraction
    assert np.allclose(reference.softmax(big), np.exp([-2, -1, 0]) / np.exp([-2, -1, 0]).sum())


def test_split_merge_and_head_columns():
    # seed 000: head h owns columns h*hd ... (h+1)*hd - 1 of each n_embd block
    x = np.arange(2 * 3 * 12, dtype=np.float64).reshape(2, 3, 12)
    assert reference.split_states(x, 4).shape == (2, 3, 4, 3)
    assert np.array_equal(reference.merge_states(reference.split_states(x, 4)), x)
    h = reference.split_heads(x, 4)
    assert h.shape == (2, 4, 3, 3)
    for i in range(4):
        assert np.array_equal(h[:, i], x[..., i * 3:(i + 1) * 3])
    assert np.array_equal(reference.merge_heads(h), x)


def test_gelu_and_norm_match_torch():
    # GPT-2's tanh GELU (= torch's approximate="tanh") and LayerNorm with eps 1e-5, biased variance
    x = np.random.default_rng(1).normal(size=(4, 7)) * 3
    g, b = np.linspace(0.5, 1.5, 7), np.linspace(-1, 1, 7)
    t = torch.from_numpy(x)
    assert np.allclose(reference.gelu(x), F.gelu(t, approximate="tanh").numpy(), atol=1e-12)
    assert np.allclose(reference.norm(x, g, b), F.layer_norm(t, (7,), torch.from_numpy(g), torch.from_numpy(b),
                                                             eps=1e-5).numpy(), atol=1e-12)


def test_attn_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="n_embd=6 is not divisible by n_head=4"):
        reference.attn(np.zeros((1, 2, 6)), np.zeros((6, 18)), np.zeros(18), np.zeros((6, 6)), np.zeros(6), 4)


# ------------------------------------------------------------------------ property: attention
@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 5), P=st.integers(0, 4), n_head=st.integers(1, 4),
       head_dim=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_attn_matches_causal_self_attention(B, T, P, n_head, head_dim, seed):
    """Reference attn (with a past) == gpt2mha.CausalSelfAttention, both backends (atol 1e-5);
    present is the new tokens' [B, 2, h, T, hd]; attending after a past == attending to it all."""
    C = n_head * head_dim
    torch.manual_seed(seed)
    attn = randomize_(CausalSelfAttention(C, n_head), seed).eval()
    x = torch.randn(B, P + T, C)
    p = np_params(attn)
    args = (p["c_attn.weight"], p["c_attn.bias"], p["c_proj.weight"], p["c_proj.bias"], n_head)
    full, full_present = reference.attn(x.numpy(), *args)
    assert full_present.shape == (B, 2, n_head, P + T, head_dim)
    past = full_present[..., :P, :] if P else None
    y, present = reference.attn(x[:, P:].numpy(), *args, past=past)
    assert np.allclose(y, full[:, P:], atol=1e-10) and np.allclose(present, full_present[..., P:, :], atol=1e-10)
    for impl in ("explicit", "sdpa"):
        attn.attn_impl = impl
        with torch.no_grad():
            yt, pt = attn(x[:, P:], None if past is None else torch.from_numpy(past).float())
        np.testing.assert_allclose(yt.numpy(), y, atol=ATOL, rtol=0)
        np.testing.assert_allclose(pt.numpy(), present, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------- whole model
def tiny_model(seed=0):
    cfg = GPT2Config(n_vocab=50, n_ctx=16, n_embd=24, n_head=3, n_layer=2, tokenizer="bytes")
    torch.manual_seed(seed)
    return randomize_(GPT2(cfg), seed, scale=0.1).eval()


def test_gpt2_forward_matches_gpt2mha_model():
    # the NumPy gpt2_forward against gpt2mha.GPT2 on a small random model, with and without a past
    model = tiny_model()
    p = np_params(model)
    idx = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(idx)
    logits, present = reference.gpt2_forward(idx.numpy(), p, n_head=3)
    assert logits.shape == (2, 11, 50) and present.shape == (2, 2, 2, 3, 11, 8)
    np.testing.assert_allclose(out.logits.numpy(), logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.present.numpy(), present, atol=ATOL, rtol=0)
    # 7 tokens, then 4 more reusing the cache (positions 7..10), equals the uncached pass
    _, past = reference.gpt2_forward(idx[:, :7].numpy(), p, n_head=3)
    tail, tail_present = reference.gpt2_forward(idx[:, 7:].numpy(), p, n_head=3, past=past)
    np.testing.assert_allclose(tail, logits[:, 7:], atol=1e-9, rtol=0)
    with torch.no_grad():
        out_tail = model(idx[:, 7:], past=torch.from_numpy(past).float())
    np.testing.assert_allclose(out_tail.logits.numpy(), tail, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out_tail.present.numpy(), tail_present, atol=ATOL, rtol=0)


def test_gpt2_forward_matches_transformers():
    # transformers' GPT2LMHeadModel shares no code with the reference; its state dict (with the
    # "transformer." prefix, Conv1D layout, lm_head tied) is fed in unchanged
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFConfig(vocab_size=40, n_positions=12, n_embd=16, n_head=4, n_layer=2, bos_token_id=None,
                                  eos_token_id=None)).eval()
    randomize_(hf, 1, scale=0.1)
    idx = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits.numpy()
    params = {k: v for k, v in np_params(hf).items() if k != "lm_head.weight"}
    logits, _ = reference.gpt2_forward(idx.numpy(), params, n_head=4)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
