"""The book's attention classes (gpt2mha.learn.book) against the book itself.

References: seed 003 (the book's chapter 3.6 listings, the running batch and the numbers they
print), seed 001 (GPT-2 small's configuration: 768 / 768, 12 heads, context 1024, head_dim 64),
the book's MultiHeadAttention forward transcribed literally below (``book_forward``), and
gpt2mha.attention_mask (the official bottom-right mask rule of seed 002) for the KV cache.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gpt2mha import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, attention_mask

# Seed 003 / issue 4: "Your journey starts with one step" embeddings, stacked twice -> [2, 6, 3].
INPUTS = torch.tensor([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                       [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
BATCH = torch.stack((INPUTS, INPUTS), dim=0)

# Seed 003, "context_vecs[0] (6x4) - head 1 | head 2" (printed to 2 decimals).
WRAPPER_EXPECTED = torch.tensor([[-0.45, 0.22, 0.48, 0.11], [-0.59, 0.01, 0.59, 0.33],
                                 [-0.63, -0.06, 0.62, 0.39], [-0.57, -0.08, 0.55, 0.36],
                                 [-0.55, -0.10, 0.53, 0.34], [-0.53, -0.11, 0.51, 0.35]])
# Seed 003, "print(context_vecs)" of MultiHeadAttention (printed to 4 decimals).
MHA_EXPECTED = torch.tensor([[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
                             [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]])


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors run faster on one thread


def book_forward(mha, x):
    """Seed 003's MultiHeadAttention.forward, line for line (the oracle for the refactored one)."""
    b, num_tokens, d_in = x.shape
    keys, queries, values = mha.W_key(x), mha.W_query(x), mha.W_value(x)
    keys = keys.view(b, num_tokens, mha.num_heads, mha.head_dim).transpose(1, 2)
    values = values.view(b, num_tokens, mha.num_heads, mha.head_dim).transpose(1, 2)
    queries = queries.view(b, num_tokens, mha.num_heads, mha.head_dim).transpose(1, 2)
    attn_scores = queries @ keys.transpose(2, 3)
    mask_bool = mha.mask.bool()[:num_tokens, :num_tokens]
    attn_scores.masked_fill_(mask_bool, -torch.inf)
    attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
    attn_weights = mha.dropout(attn_weights)
    context_vec = (attn_weights @ values).transpose(1, 2)
    context_vec = context_vec.contiguous().view(b, num_tokens, mha.d_out)
    return mha.out_proj(context_vec)


# ------------------------------------------------------------------------ seed 003's numbers
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_wrapper_reproduces_seed003(impl):
    # seed 003 section 3.6.1: torch.manual_seed(123); MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    torch.manual_seed(123)
    context_length = BATCH.shape[1]
    mha = MultiHeadAttentionWrapper(3, 2, context_length, 0.0, num_heads=2)
    mha.attn_impl = impl
    context_vecs = mha(BATCH)
    assert context_vecs.shape == torch.Size([2, 6, 4])
    for row in context_vecs:  # "identical, so both batch elements print the same"
        assert (row - WRAPPER_EXPECTED).abs().max() <= 0.005 + 1e-6


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_multihead_attention_reproduces_seed003(impl):
    # seed 003 section 3.6.2: torch.manual_seed(123); MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    torch.manual_seed(123)
    batch_size, context_length, d_in = BATCH.shape
    mha = MultiHeadAttention(d_in, 2, context_length, 0.0, num_heads=2)
    mha.attn_impl = impl
    context_vecs = mha(BATCH)
    assert isinstance(context_vecs, torch.Tensor)  # the book's interface: just the context tensor
    assert context_vecs.shape == torch.Size([2, 6, 2])
    assert mha.head_dim == 1  # seed 003: "d_out=2 is the TOTAL width (head_dim=1 each)"
    for row in context_vecs:
        assert (row - MHA_EXPECTED).abs().max() <= 0.00005 + 1e-6


def test_causal_attention_is_the_wrappers_first_head():
    # seed 003: "head 1 wrote the left two columns"; under the same seed a lone CausalAttention
    # (section 3.5, created first) is that head, because the wrapper creates its heads in order.
    torch.manual_seed(123)
    ca = CausalAttention(3, 2, 6, 0.0)
    out = ca(BATCH)
    assert out.shape == torch.Size([2, 6, 2])
    assert (out[0] - WRAPPER_EXPECTED[:, :2]).abs().max() <= 0.005 + 1e-6


def test_names_buffers_and_creation_order():
    # seed 003's attribute names and creation order (W_query, W_key, W_value, out_proj; mask buffer)
    mha = MultiHeadAttention(3, 4, 5, 0.0, num_heads=2)
    assert list(mha.state_dict()) == ["mask", "W_query.weight", "W_key.weight", "W_value.weight",
                                      "out_proj.weight", "out_proj.bias"]
    assert [n for n, _ in mha.named_parameters()] == ["W_query.weight", "W_key.weight", "W_value.weight",
                                                      "out_proj.weight", "out_proj.bias"]
    assert torch.equal(mha.mask, torch.triu(torch.ones(5, 5), diagonal=1))
    assert isinstance(mha.dropout, torch.nn.Dropout)
    w = MultiHeadAttentionWrapper(3, 2, 5, 0.0, num_heads=3, qkv_bias=True)
    assert [n for n, _ in w.named_parameters()][:6] == [
        "heads.0.W_query.weight", "heads.0.W_query.bias", "heads.0.W_key.weight", "heads.0.W_key.bias",
        "heads.0.W_value.weight", "heads.0.W_value.bias"]
    assert len(w.heads) == 3 and w(torch.rand(1, 5, 3)).shape == (1, 5, 6)  # d_out per head: 3 x 2


def test_weights_of_every_layout():
    # need_weights: rows sum to 1 and future keys get exactly 0 (the causal mask of seed 003 / 002)
    torch.manual_seed(4)
    x = torch.randn(2, 5, 3)
    w_ca = CausalAttention(3, 2, 5, 0.0)(x, need_weights=True)[1]
    w_wr = MultiHeadAttentionWrapper(3, 2, 5, 0.0, num_heads=3)(x, need_weights=True)[1]
    w_mha = MultiHeadAttention(3, 6, 5, 0.0, num_heads=3)(x, need_weights=True)[1]
    for w, shape in ((w_ca, (2, 5, 5)), (w_wr, (2, 3, 5, 5)), (w_mha, (2, 3, 5, 5))):
        assert w.shape == shape
        assert torch.all(w.triu(1) == 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(shape[:-1]), atol=1e-6, rtol=0)


def test_book_state_dict_loads_unchanged():
    # a state dict saved by the book's class has exactly these keys and shapes (seed 003 listing)
    torch.manual_seed(0)
    src = MultiHeadAttention(6, 4, 8, 0.0, num_heads=2, qkv_bias=True)
    dst = MultiHeadAttention(6, 4, 8, 0.0, num_heads=2, qkv_bias=True)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(2, 8, 6)
    assert torch.equal(src(x), dst(x))


# ------------------------------------------------------------------------------- seed 001
def test_seed001_gpt2_small_configuration():
    # seed 001: d_in = d_out = 768, 12 heads, context 1024 -> head_dim 64; [2, 1024, 768] in and out.
    # 2,360,064 parameters = 3 * 768 * 768 (W_query, W_key, W_value, no qkv bias) + 768 * 768 + 768 (out_proj)
    torch.manual_seed(0)
    mha = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12)
    assert mha.head_dim == 64 and mha.num_heads == 12 and mha.d_out == 768
    assert sum(p.numel() for p in mha.parameters()) == 2_360_064
    x = torch.randn(2, 1024, 768)
    with torch.no_grad():
        y = mha(x)
        mha.attn_impl = "sdpa"
        y_sdpa = mha(x)
    assert y.shape == (2, 1024, 768)
    torch.testing.assert_close(y_sdpa, y, atol=1e-5, rtol=0)


def test_d_in_different_from_d_out():
    # issue 4: "d_in != d_out works" (seed 003 itself uses d_in=3, d_out=2)
    torch.manual_seed(1)
    mha = MultiHeadAttention(5, 8, 10, 0.0, num_heads=4, qkv_bias=True)
    x = torch.randn(3, 7, 5)
    y = mha(x)
    assert y.shape == (3, 7, 8)
    torch.testing.assert_close(y, book_forward(mha, x), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- bad input
def test_divisibility_error_names_both_values():
    # seed 001: "check this divisibility requirement rather than assuming"
    with pytest.raises(ValueError, match="d_out=10 is not divisible by num_heads=4"):
        MultiHeadAttention(3, 10, 6, 0.0, num_heads=4)


@pytest.mark.parametrize("cls, extra", [(CausalAttention, {}), (MultiHeadAttentionWrapper, {"num_heads": 2}),
                                        (MultiHeadAttention, {"num_heads": 2})])
def test_bad_input_errors(cls, extra):
    # issue 4 acceptance: clear errors naming the argument
    m = cls(3, 2, 6, 0.0, **extra)
    with pytest.raises(ValueError, match=r"num_tokens=7 .*context_length=6"):
        m(torch.rand(2, 7, 3))
    with pytest.raises(ValueError, match=r"rank 3 \[b, num_tokens, d_in=3\]"):
        m(torch.rand(6, 3))
    with pytest.raises(ValueError, match=r"last dimension 4 != d_in=3"):
        m(torch.rand(2, 6, 4))
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"dropout={bad} must be a number in \[0, 1\)"):
            cls(3, 2, 6, bad, **extra)
    for name, args in (("d_in", (0, 2, 6)), ("d_out", (3, -2, 6)), ("context_length", (3, 2, 0))):
        with pytest.raises(ValueError, match=f"{name}="):
            cls(*args, 0.0, **extra)
    if extra:
        with pytest.raises(ValueError, match="num_heads=0"):
            cls(3, 2, 6, 0.0, num_heads=0)
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        m.attn_impl = "flash"
        m(torch.rand(1, 2, 3))


def test_bad_past_errors():
    mha = MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    x = torch.rand(2, 2, 4)
    with pytest.raises(ValueError, match=r"past has shape \(2, 2, 3, 1, 2\); expected \[b=2, 2, num_heads=2"):
        mha(x, past=torch.rand(2, 2, 3, 1, 2))
    with pytest.raises(ValueError, match=r"num_tokens=2 \(after 5 past tokens\) exceeds context_length=6"):
        mha(x, past=torch.rand(2, 2, 2, 5, 2))


# --------------------------------------------------------------------------- masking / NaN
@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_masked_scores_never_nan(impl):
    # huge scores and a one-token row: the causal row is never empty and masked scores become -1e10
    torch.manual_seed(2)
    mha = MultiHeadAttention(4, 4, 8, 0.0, num_heads=2)
    mha.attn_impl = impl
    for x in (torch.randn(2, 8, 4) * 1e4, torch.randn(1, 1, 4), torch.zeros(1, 8, 4)):
        assert torch.isfinite(mha(x)).all()
    y, w = mha(torch.randn(1, 8, 4) * 1e3, need_weights=True)
    assert torch.isfinite(w).all() and torch.equal(w[0, 0].triu(1), torch.zeros(8, 8))


def test_training_dropout_matches_the_book():
    # explicit path in training mode draws the same dropout mask as the book's nn.Dropout on the weights
    torch.manual_seed(3)
    mha = MultiHeadAttention(3, 4, 6, 0.5, num_heads=2).train()
    x = torch.randn(2, 6, 3)
    torch.manual_seed(7)
    ours = mha(x)
    torch.manual_seed(7)
    theirs = book_forward(mha, x)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    mha.eval()
    torch.testing.assert_close(mha(x), book_forward(mha, x), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- property tests
@settings(max_examples=80, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 6), P=st.integers(0, 5), d_in=st.integers(1, 9),
       num_heads=st.integers(1, 4), head_dim=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_mha_backends_cache_and_book_agree(B, T, P, d_in, num_heads, head_dim, bias, seed):
    """Random sizes: the book's literal forward, both backends, and cached vs uncached all agree
    (atol 1e-5, fp32); weights are zero exactly where gpt2mha.attention_mask (seed 002) says."""
    torch.manual_seed(seed)
    d_out = num_heads * head_dim
    mha = MultiHeadAttention(d_in, d_out, P + T, 0.0, num_heads, qkv_bias=bias).eval()
    x = torch.randn(B, P + T, d_in)
    with torch.no_grad():
        full = book_forward(mha, x)
        for impl in ("explicit", "sdpa"):
            mha.attn_impl = impl
            torch.testing.assert_close(mha(x), full, atol=1e-5, rtol=0)
            if P:  # prefill P tokens, then T tokens attending to the cached P
                _, past = mha(x[:, :P], return_present=True)
                y, present, w = mha(x[:, P:], past=past, return_present=True, need_weights=True)
                torch.testing.assert_close(y, full[:, P:], atol=1e-5, rtol=0)
                assert present.shape == (B, 2, num_heads, T, head_dim)
                assert w.shape == (B, num_heads, T, P + T)
                assert torch.all(w[~attention_mask(T, P + T).expand_as(w)] == 0)
                torch.testing.assert_close(w.sum(-1), torch.ones(B, num_heads, T), atol=1e-5, rtol=0)
