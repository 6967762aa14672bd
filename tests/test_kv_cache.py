"""The one cache path: OpenAI's past/present, the static KVCache, rows of different lengths.

References: the uncached forward over the same tokens (the cache must not change what a token
attends to), and OpenAI's past/present concatenation (bitwise: the same products in the same
order).
"""

import pytest
import torch

from conftest import ROBUST, small_model
from gpt2mha import GPT2, GPT2Config, KVCache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT2(GPT2Config(n_vocab=97, n_ctx=48, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")).eval()


def new_cache(model, batch, max_len=48):
    c = model.config
    return KVCache(c.n_layer, batch, c.n_head, max_len, c.head_dim)


@torch.no_grad()
def test_past_is_the_cache_built_for_one_call_bitwise(model):
    idx = torch.randint(0, 97, (2, 12))
    full = model(idx)
    part = model(idx[:, :7])
    rest = model(idx[:, 7:], past=part.present)
    cache = new_cache(model, 2)
    model(idx[:, :7], cache=cache)
    cached = model(idx[:, 7:], cache=cache)
    assert torch.equal(rest.logits, cached.logits)                     # same path, same numbers
    torch.testing.assert_close(rest.present, full.present[:, :, :, :, 7:], atol=1e-6, rtol=1e-5)
    assert torch.equal(cache.to_past(), torch.cat([part.present, rest.present], dim=4))
    torch.testing.assert_close(rest.logits, full.logits[:, 7:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rows_of_different_lengths_attend_only_to_their_own_tokens(model):
    torch.manual_seed(1)
    prompts = [torch.randint(0, 97, (n,)) for n in (9, 4, 13)]
    T = max(len(p) for p in prompts)
    idx = torch.stack([torch.cat([p, torch.zeros(T - len(p), dtype=torch.long)]) for p in prompts])  # right-padded
    cache = new_cache(model, 3)
    model(idx, cache=cache)
    cache.trim([len(p) for p in prompts])
    assert cache.lengths == [9, 4, 13]
    nxt = torch.tensor([[5], [6], [7]])
    for step in range(3):                                               # every row at its own position
        logits = model(nxt, cache=cache, last_only=True).logits[:, -1]
        for b, p in enumerate(prompts):
            alone = model(torch.cat([p, nxt[b].repeat(step + 1)])[None]).logits[0, -1]
            torch.testing.assert_close(logits[b], alone, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [12, 7, 16]


@torch.no_grad()
def test_a_view_of_the_first_rows_writes_into_the_whole_cache(model):
    cache = new_cache(model, 4)
    view = cache.rows(2)
    idx = torch.randint(0, 97, (2, 5))
    model(idx, cache=view)
    assert cache.lengths == [5, 5, 0, 0] and view.lengths == [5, 5]
    assert cache.k[:, 2:].abs().sum() == 0                             # rows beyond the view untouched
    other = new_cache(model, 2)
    model(idx, cache=other)
    assert torch.equal(cache.k[:, :2, :, :5], other.k[:, :, :, :5])


@torch.no_grad()
def test_load_copies_a_prefilled_row_into_a_slot(model):
    prefill = new_cache(model, 2)
    idx = torch.randint(0, 97, (2, 6))
    model(idx, cache=prefill)
    slots = new_cache(model, 3)
    slots.load(2, prefill, other_row=1, start=2)                        # skip two left pads
    assert slots.lengths == [0, 0, 4]
    assert torch.equal(slots.k[:, 2, :, :4], prefill.k[:, 1, :, 2:6])
    slots.reset(2)
    assert slots.lengths == [0, 0, 0]


def test_cache_plan_and_trim_errors_name_the_problem(model):
    cache = new_cache(model, 2, max_len=8)
    with pytest.raises(ValueError, match="max_len=8"):
        cache.plan(9)
    with pytest.raises(ValueError, match="span=3"):
        cache.plan(4, span=3)
    with pytest.raises(ValueError, match="lengths=\\[1, 1\\]"):
        cache.trim([1, 1])                                              # longer than what the rows hold
    with pytest.raises(ValueError, match="rows=3"):
        cache.rows(3)
    with pytest.raises(ValueError, match="n_layer=0"):
        KVCache(0, 1, 1, 1, 1)


def test_past_in_grad_mode_gives_the_uncached_logits(model):
    # a forward with past while autograd records: the cache's per-layer views take keys and values
    # that require grad. Reference: the uncached forward over all tokens.
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        past = model(idx[:, :5]).present
        full = model(idx).logits[:, 5:]
    logits = model(idx[:, 5:], past=past).logits
    assert logits.requires_grad
    torch.testing.assert_close(logits.detach(), full, atol=1e-5, rtol=0)


def test_backward_through_past_equals_the_uncached_gradients(model):
    # reference: the same loss on the uncached forward over all tokens; the gradient reaches the
    # parameters both through the new tokens and through the past (computed with grad here)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    model(idx).logits[:, 5:].square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    past = model(idx[:, :5]).present
    model(idx[:, 5:], past=past).logits.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-4, msg=n)
    model.zero_grad()


# ----------------------------------------------- checks of a cache against the model and input
MODEL = small_model(**ROBUST)
IDX = torch.tensor([[5, 17, 42, 8, 3]])


def test_cache_that_does_not_fit_the_model_or_input_is_a_named_error():
    c = MODEL.config

    def cache(**kw):
        sizes = dict(n_layer=c.n_layer, batch_size=1, n_head=c.n_head, max_len=16, head_dim=c.head_dim)
        return KVCache(**{**sizes, **{k: v for k, v in kw.items() if k in sizes}}, dtype=kw.get("dtype", torch.float32))

    rows4 = cache(batch_size=4)
    with pytest.raises(ValueError, match="cache has batch size=4 but the input has 1"):
        MODEL(IDX, cache=rows4)
    assert rows4.k.abs().sum() == 0 and rows4.length == 0          # nothing was written into its rows
    with pytest.raises(ValueError, match="cache has n_layer=1 but the model has 2"):
        MODEL(IDX, cache=cache(n_layer=1))
    with pytest.raises(ValueError, match="cache has n_head=2 but the model has 4"):
        MODEL(IDX, cache=cache(n_head=2, head_dim=16))
    with pytest.raises(ValueError, match="cache has head_dim=4 but the model has 8"):
        MODEL(IDX, cache=cache(head_dim=4))
    with pytest.raises(ValueError, match="cache dtype is torch.float16 but the model's parameters are torch.float32"):
        MODEL(IDX, cache=cache(dtype=torch.float16))
    full = cache(max_len=6)
    MODEL(IDX, cache=full)
    with pytest.raises(ValueError, match="cache holds 5 of max_len=6 positions; 2 new tokens do not fit"):
        MODEL(IDX[:, :2], cache=full)
    # a half-precision past for a float32 model: caught when used, convertible on purpose
    past = MODEL(IDX).present
    with pytest.raises(ValueError, match="cache dtype is torch.float16"):
        MODEL(IDX[:, :1], cache=KVCache.from_past(past.half(), 8))
    ok = KVCache.from_past(past.half(), 8, dtype=torch.float32)
    torch.testing.assert_close(MODEL(IDX[:, :1], cache=ok).logits, MODEL(IDX[:, :1], past=past.half().float()).logits)
    with pytest.raises(ValueError, match="past must be a floating-point tensor"):
        KVCache.from_past(past.long(), 8)


def test_forward_with_cache_still_checks_inputs():
    model = small_model()
    cache = KVCache(3, 1, 4, 48, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[97]]), cache=cache)
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 48]]))


def test_a_cache_filled_under_no_grad_takes_run_with_cache_in_grad_mode():
    """A cache made in grad mode and filled under no_grad, then extended by ``run_with_cache`` in
    grad mode, gives the uncached logits (reference: the model's forward over all the tokens); its
    per-layer views must not be made under the no_grad of the first forward."""
    from gpt2mha.learn.activations import run_with_cache

    model = small_model(**ROBUST)
    c = model.config
    idx = torch.randint(0, 97, (1, 9))
    cache = KVCache(c.n_layer, 1, c.n_head, 32, c.head_dim)
    with torch.no_grad():
        model(idx[:, :6], cache=cache)
        ref = model(idx).logits[:, 6:]
    logits, _ = run_with_cache(model, idx[:, 6:], cache=cache)
    torch.testing.assert_close(logits.detach(), ref, atol=1e-5, rtol=1e-5)
