"""Padding, fully masked rows, low precision, long inputs.

References: the same rows run unpadded and alone (a left-padded row must give the same logits
on its real tokens), and the full uncached forward for cached steps.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import ROBUST, assert_same_greedy, overflowing_builtin, small_model
from gpt2mha import GPT2, GPT2Config, attention_mask
from gpt2mha.core.attention import combine_masks


MODEL = small_model(**ROBUST)
LOW_PRECISION = {name: small_model(**ROBUST).to(getattr(torch, name)) for name in ("bfloat16", "float16")}


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_left_padding_gives_unpadded_logits(impl):
    MODEL.attn_impl = impl
    try:
        abcd = torch.tensor([[5, 17, 42, 8]])
        padded = torch.tensor([[0, 0, 5, 17, 42, 8]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
        with torch.no_grad():
            ref = MODEL(abcd).logits
            out = MODEL(padded, attention_mask=mask).logits
        torch.testing.assert_close(out[:, 2:], ref, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out).all()
    finally:
        MODEL.attn_impl = "sdpa"


def test_padded_batch_then_cached_step_equals_each_row_alone():
    rows = [[3, 9, 27, 81 % 97, 50], [11, 22, 33]]
    nxt = [[7], [13]]
    idx = torch.tensor([rows[0], [0, 0] + rows[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        first = MODEL(idx, attention_mask=mask)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        step = MODEL(torch.tensor(nxt), past=first.present, attention_mask=step_mask)
        for b, (row, n) in enumerate(zip(rows, nxt)):
            alone = MODEL(torch.tensor([row + n])).logits[0]
            torch.testing.assert_close(step.logits[b, -1], alone[-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(first.logits[b, -len(row):], alone[:-1], atol=1e-5, rtol=1e-5)


def test_cached_step_with_new_only_mask_is_rejected():
    with torch.no_grad():
        past = MODEL(torch.tensor([[1, 2, 3]])).present
        with pytest.raises(ValueError, match=r"expected \[B=1, past \+ T=4\] covering the 3 cached and 1 new"):
            MODEL(torch.tensor([[4]]), past=past, attention_mask=torch.ones(1, 1))


def test_padding_mask_never_disables_causal_masking():
    m = combine_masks(attention_mask(4, 4), torch.ones(1, 4))
    assert torch.equal(m[0, 0], attention_mask(4, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_124m_padded_batch_is_finite(dtype):
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("124M")).to(dtype).eval()
    idx = torch.randint(0, 50257, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :7] = 0                                             # second row: 7 pads, 5 real tokens
    for impl in ("sdpa", "explicit"):
        model.attn_impl = impl
        with torch.no_grad():
            logits = model(idx, attention_mask=mask).logits
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all(), impl


def test_batched_greedy_generation_equals_each_prompt_alone():
    prompts = [[4, 8, 15, 16, 23, 42], [1], [60, 61, 62]]
    batched = MODEL.generate(prompts, 12, temperature=0)
    T = max(map(len, prompts))
    for b, p in enumerate(prompts):
        alone = MODEL.generate(torch.tensor([p]), 12, temperature=0)
        assert batched[b, T - len(p):T].tolist() == p
        assert_same_greedy(MODEL, batched[b, T - len(p):], alone[0], len(p))


def test_long_inputs_error_by_default_and_slide_when_asked():
    with pytest.raises(ValueError, match="41 > n_ctx=40"):
        MODEL(torch.zeros(1, 41, dtype=torch.long))
    with pytest.raises(ValueError, match="sliding_window"):
        MODEL.generate(torch.zeros(1, 38, dtype=torch.long), 5)
    out = MODEL.generate(torch.ones(1, 38, dtype=torch.long), 5, temperature=0, sliding_window=True)
    assert out.shape == (1, 43)


# ---------------------------------------------------------------------------- property tests
@settings(max_examples=100, deadline=None)            # the suite's longest test at 200 (every example runs B + 2 forwards)
@given(st.data())
def test_property_padding_patterns(data):
    """Random batch, left padding and past length: real tokens match each row run alone."""
    B = data.draw(st.integers(1, 3))
    lengths = [data.draw(st.integers(1, 8)) for _ in range(B)]
    T = max(lengths)
    P = data.draw(st.integers(0, T - min(lengths) if min(lengths) < T else 0))
    P = min(P, min(lengths) - 1) if min(lengths) > 1 else 0   # past covers only tokens every row has
    rows = [data.draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)) for n in lengths]
    idx = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        split = T - P if P else T
        first = MODEL(idx[:, :split], attention_mask=mask[:, :split]) if P else None
        out = (MODEL(idx[:, split:], past=first.present, attention_mask=mask) if P
               else MODEL(idx, attention_mask=mask))
        logits = torch.cat([first.logits, out.logits], 1) if P else out.logits
        assert torch.isfinite(logits).all()
        for b, r in enumerate(rows):
            alone = MODEL(torch.tensor([r])).logits[0]
            torch.testing.assert_close(logits[b, T - len(r):], alone, atol=1e-4, rtol=1e-4)


@settings(max_examples=200, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 10), P=st.integers(0, 10), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       impl=st.sampled_from(["sdpa", "explicit"]), n_pad=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_property_cached_equals_uncached_and_finite(B, T, P, dtype, impl, n_pad, seed):
    """Cached == uncached (fp32), and no NaN/inf with pads in any dtype, on both paths."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[0, :min(n_pad, P + T - 1)] = 0
    model = MODEL if dtype == "float32" else LOW_PRECISION[dtype]
    model.attn_impl = impl
    try:
        with torch.no_grad():
            full = model(idx, attention_mask=mask).logits
            assert torch.isfinite(full.float()).all()
            if P and dtype == "float32":
                past = model(idx[:, :P], attention_mask=mask[:, :P]).present
                step = model(idx[:, P:], past=past, attention_mask=mask).logits
                torch.testing.assert_close(step, full[:, P:], atol=1e-5, rtol=1e-5)
    finally:
        model.attn_impl = "sdpa"


def test_mask_values_other_than_0_and_1_are_rejected():
    idx = torch.tensor([[1, 2, 3, 4]])
    for bad in ([[2, 2, 2, 2]], [[0.5, 1, 1, 1]], [[-1, 1, 1, 1]]):
        with pytest.raises(ValueError, match=r"attention_mask must be bool or hold only 0 \(masked/pad\) and 1"):
            MODEL(idx, attention_mask=torch.tensor(bad))


def test_every_route_gives_nan_when_every_score_is_nan(one_thread):
    """OpenAI's formula gives NaN for a query whose scores are NaN: the explicit core does, and
    so must the SDPA core (whose CPU kernel alone would give 0: finite logits), the decode view
    (prefill and steps; a 1-token prompt attends through SDPA), the route generate takes (the
    native forward where the kernels are built) and run_with_cache."""
    from gpt2mha.core.kv_cache import KVCache
    from gpt2mha.inference.decoders import ViewDecoder, choose_decoder
    from gpt2mha.learn.activations import run_with_cache

    model = overflowing_builtin()
    c = model.config
    idx = torch.tensor([list(b"To be")])           # where torch's zeros gave finite logits on SDPA
    outs = {}
    with torch.no_grad():
        outs["sdpa"] = model(idx).logits
        model.attn_impl = "explicit"
        outs["explicit"] = model(idx).logits
        model.attn_impl = "sdpa"
        outs["run_with_cache"] = run_with_cache(model, idx)[0]
        for name, decoder in (("view", ViewDecoder(model)), ("route", choose_decoder(model).decoder)):
            for T in (1, idx.shape[1]):
                cache = KVCache(c.n_layer, 1, c.n_head, 16, c.n_embd // c.n_head)
                outs[f"{name} prefill {T}"] = decoder.prefill(idx[:, :T], cache)
                outs[f"{name} step after {T}"] = decoder.step(idx[:, :1], cache)
    assert torch.isnan(outs["explicit"]).all()                    # the formula: NaN from layer 0 on
    assert {name: bool(torch.isnan(out).all()) for name, out in outs.items()} == {name: True for name in outs}
