"""Sampling semantics (OpenAI's sample.py: top_k_logits, top_p_logits) and the decode loop."""

import numpy as np
import pytest
import torch

from conftest import ROBUST, assert_same_greedy, small_model
from gpt2mha import GPT2, GPT2Config
from gpt2mha.inference.sampling import MIN_TEMPERATURE, row_seed, sample_next, top_k_logits, top_p_logits


def model(seed=0):
    torch.manual_seed(seed)
    return GPT2(GPT2Config(n_vocab=50, n_ctx=32, n_embd=32, n_head=4, n_layer=2)).eval()


def test_top_k_keeps_logits_at_least_the_kth_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, -2.0]])
    out = top_k_logits(logits, 2)
    # k-th largest is 3.0: ties at the threshold are kept, as in the official `logits < min_values`
    assert torch.isinf(out).tolist() == [[True, False, False, False, True]]
    assert torch.equal(top_k_logits(logits, 0), logits)


def test_top_p_matches_official_formula():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # cumulative 0.5, 0.8, 0.95, 1.0: with p=0.9 the tokens with cumulative <= 0.9 are kept
    kept = ~torch.isinf(top_p_logits(logits, 0.9))
    assert kept.tolist() == [[True, True, False, False]]
    # p below the top probability still keeps the top token
    assert (~torch.isinf(top_p_logits(logits, 0.1))).tolist() == [[True, False, False, False]]


def test_temperature_zero_is_argmax_and_seed_reproducible():
    logits = torch.randn(4, 50)
    assert torch.equal(sample_next(logits, temperature=0), logits.argmax(-1))
    m = model()
    idx = torch.randint(0, 50, (2, 3))
    a = m.generate(idx, 12, temperature=1.0, top_k=10, top_p=0.9, seed=7)
    b = m.generate(idx, 12, temperature=1.0, top_k=10, top_p=0.9, seed=7)
    c = m.generate(idx, 12, temperature=1.0, top_k=10, top_p=0.9, seed=8)
    assert a.shape == (2, 15) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :3], idx)


def test_sampling_distribution_follows_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(20000, 1)
    counts = torch.bincount(sample_next(logits, generator=torch.Generator().manual_seed(1)), minlength=3)
    torch.testing.assert_close(counts / 20000.0, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0), atol=0.015, rtol=0)


def test_eos_stops_rows_and_pads_with_eos():
    m = model(1)
    idx = torch.randint(0, 50, (3, 4))
    first = m.generate(idx, 1, temperature=0)[:, -1]
    out = m.generate(idx, 10, temperature=0, eos_token_id=int(first[0]))
    assert out.shape == (3, 14)
    assert (out[0, 4:] == first[0]).all()


def test_streaming_callback_sees_every_token_in_order():
    m = model(2)
    idx = torch.randint(0, 50, (1, 3))
    seen = []
    out = m.generate(idx, 8, temperature=0, on_token=lambda t: seen.append(int(t[0])))
    assert seen == out[0, 3:].tolist()


def test_bad_arguments_fail_before_any_work():
    m = model()
    idx = torch.randint(0, 50, (1, 30))
    with pytest.raises(ValueError, match="prompt of 30 tokens \\+ max_new_tokens=5 = 35 > n_ctx=32"):
        m.generate(idx, 5)
    with pytest.raises(ValueError, match="top_p=0"):
        m.generate(idx[:, :3], 2, top_p=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        m.generate(idx[:, :3], 2, top_p=1.5)
    with pytest.raises(ValueError, match="top_k=-1"):
        m.generate(idx[:, :3], 2, top_k=-1)
    with pytest.raises(ValueError, match="temperature=-0.5"):
        m.generate(idx[:, :3], 2, temperature=-0.5)
    with pytest.raises(ValueError, match="empty prompt"):
        m.generate(idx[:, :0], 2)


def test_sliding_window_conditions_on_last_n_ctx_tokens():
    m = model(3)
    idx = torch.randint(0, 50, (1, 30))
    out = m.generate(idx, 6, temperature=0, sliding_window=True)
    assert out.shape == (1, 36)
    seq = idx
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, m(seq[:, -32:]).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert_same_greedy(m, out[0], seq[0], 30, window=32)


def test_sliding_window_accepts_a_prompt_longer_than_n_ctx():
    m = model(4)
    idx = torch.randint(0, 50, (1, 40))
    out = m.generate(idx, 3, temperature=0, sliding_window=True)
    seq = idx
    with torch.no_grad():
        for _ in range(3):
            seq = torch.cat([seq, m(seq[:, -32:]).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert_same_greedy(m, out[0], seq[0], 40, window=32)


def test_right_padding_bad_seed_and_vocab_limit():
    m = model(5)
    with pytest.raises(ValueError, match=r"rows \[0\] end in padding"):
        m.generate(torch.tensor([[5, 6, 0, 0], [1, 2, 3, 4]]), 2,
                   attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    for seed in (1.5, -1, 2**64):
        with pytest.raises(ValueError, match="seed="):
            m.generate(torch.tensor([[1, 2]]), 2, seed=seed)
    with pytest.raises(ValueError, match="token ids in \\[0, n_vocab=50\\)"):
        m.generate(torch.tensor([[1, 50]]), 0)
    out = m.generate(torch.tensor([[1, 2]] * 8), 20, temperature=5.0, seed=0, vocab_size=3)
    assert int(out[:, 2:].max()) < 3


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.1, 0.7), (0.3, 1.5), (1.0, 1.0), (0.0, 1.0)])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature):
    """min-p after temperature equals transformers' TemperatureLogitsWarper then
    MinPLogitsWarper on the same logits: the same tokens survive, and sampling draws from their
    renormalised softmax."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    from gpt2mha.inference.sampling import min_p_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 200, generator=g) * 3
    logits[0, :3] = logits[0].max() + 1                                   # a three-way tie at the top
    theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if min_p > 0:
        theirs = MinPLogitsWarper(min_p)(None, theirs)
    ours = min_p_logits((logits - logits.amax(-1, keepdim=True)) / temperature, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert int((~torch.isinf(ours)).sum(-1).min()) >= 1
    # the draw follows the kept tokens' softmax (20,000 draws of row 1)
    rows = logits[1:2].repeat(20000, 1)
    counts = torch.bincount(sample_next(rows, temperature, min_p=min_p, generator=torch.Generator().manual_seed(1)),
                            minlength=200) / 20000.0
    torch.testing.assert_close(counts, torch.softmax(theirs[1], -1), atol=0.015, rtol=0)


def test_min_p_one_is_greedy_and_bad_min_p_is_refused():
    m = model(6)
    idx = torch.randint(0, 50, (2, 3))
    greedy = m.generate(idx, 8, temperature=0)
    sampled = m.generate(idx, 8, temperature=1.0, min_p=1.0, seed=3)
    for row in range(2):
        assert_same_greedy(m, sampled[row], greedy[row], 3)
    for bad in (-0.1, 1.5, "0.1", True, float("nan")):
        with pytest.raises(ValueError, match=r"min_p=.* must be a number in \[0, 1\]"):
            m.generate(idx, 2, min_p=bad)


def test_strip_padding_gives_each_row_as_its_prompt_alone_would():
    """generate on prompts of different lengths keeps the left padding (pad id 0, itself a valid
    token); strip_padding returns each row as the prompt generated alone (greedy) returns it."""
    from gpt2mha.inference.generate import left_pad, strip_padding

    m = model(7)
    prompts = [[5, 6, 7, 8, 9], [0, 3], [4]]                  # a real token 0 at the start of prompt 1
    out = m.generate(prompts, 6, temperature=0)
    assert out.shape == (3, 11) and out[2, :4].tolist() == [0, 0, 0, 0]
    rows = strip_padding(out, prompts)
    _, mask = left_pad(prompts)
    assert strip_padding(out, attention_mask=mask) == rows
    assert strip_padding(out, prompts, new_only=True) == [r[len(p):] for r, p in zip(rows, prompts)]
    for p, r in zip(prompts, rows):
        alone = m.generate(torch.tensor([p]), 6, temperature=0)[0]
        assert len(r) == len(p) + 6 and r[:len(p)] == p
        assert_same_greedy(m, torch.tensor(r), alone, len(p))
    # a finished row repeats eos: cut after its first
    fake = torch.tensor([[0, 1, 2, 9, 3, 9, 9], [1, 1, 2, 3, 4, 5, 6]])
    assert strip_padding(fake, [[1, 2], [1, 1, 2]], eos_token_id=9) == [[1, 2, 9], [1, 1, 2, 3, 4, 5, 6]]
    assert strip_padding(fake) == fake.tolist()
    for kwargs, needle in [(dict(prompts=[[1]]), "1 prompts for 2 rows"),
                           (dict(prompts=[[1], [2]], attention_mask=mask), "not both"),
                           (dict(new_only=True), "new_only needs prompts or attention_mask"),
                           (dict(prompts=[[1] * 9, [1]]), "9 tokens wide but out has 7 columns"),
                           (dict(attention_mask=torch.ones(3, 2)), r"expected \[B=2, T_mask <= 7\]")]:
        with pytest.raises(ValueError, match=needle):
            strip_padding(fake, **kwargs)


def test_every_argument_of_generate_is_checked_and_named():
    """Each argument of the wrong type, dtype, device or range is a ValueError naming it, raised
    before any work (``meta`` stands in for a tensor on another device than the model's)."""
    m = model()
    idx = torch.randint(0, 50, (2, 4))
    meta = torch.device("meta")
    cases = [("idx", dict(idx=idx.float())), ("idx", dict(idx=idx.bool())), ("idx", dict(idx=idx.to(meta))),
             ("idx", dict(idx=idx.numpy())), ("idx", dict(idx=idx[0])), ("idx", dict(idx="ROMEO:")),
             ("prompts[0][1]", dict(idx=[[1, 2.5]])),
             ("attention_mask", dict(attention_mask=[[1] * 4] * 2)),
             ("attention_mask", dict(attention_mask=torch.ones(2, 4).to(meta))),
             ("attention_mask", dict(attention_mask=torch.full((2, 4), 0.5))),
             ("attention_mask", dict(attention_mask=torch.ones(2, 5))),
             ("max_new_tokens", dict(max_new_tokens=2.0)), ("max_new_tokens", dict(max_new_tokens=-1)),
             ("temperature", dict(temperature="1")), ("top_k", dict(top_k=1.5)), ("top_p", dict(top_p=0)),
             ("min_p", dict(min_p=2)), ("seed", dict(seed=torch.tensor(3.0))),
             ("eos_token_id", dict(eos_token_id=3.5)), ("eos_token_id", dict(eos_token_id=50)),
             ("eos_token_id", dict(eos_token_id=torch.tensor(-1))), ("eos_token_id", dict(eos_token_id="3")),
             ("vocab_size", dict(vocab_size=3.5)), ("vocab_size", dict(vocab_size=0)),
             ("vocab_size", dict(vocab_size=51)), ("on_token", dict(on_token=3)),
             ("sliding_window", dict(sliding_window="no"))]
    for name, kwargs in cases:
        kwargs = {"idx": idx, "max_new_tokens": 2, **kwargs}
        with pytest.raises(ValueError) as info:
            m.generate(kwargs.pop("idx"), kwargs.pop("max_new_tokens"), **kwargs)
        assert str(info.value).startswith(name), (name, str(info.value))
    # 0-d integer tensors are integers
    out = m.generate(idx, torch.tensor(2), temperature=0, eos_token_id=torch.tensor(3), vocab_size=torch.tensor(50))
    assert out.shape == (2, 6)


# ------------------------------------------ masks, ids, temperatures and what generate returns
MODEL = small_model(**ROBUST)
IDX = torch.tensor([[5, 17, 42, 8, 3]])


def test_generate_refuses_a_mask_that_is_not_0_1():
    idx = torch.tensor([[0, 5, 17], [3, 4, 5]])
    with pytest.raises(ValueError, match=r"attention_mask must be bool or hold only 0 .* got the value 0.5"):
        MODEL.generate(idx, 2, temperature=0, attention_mask=torch.tensor([[0.5, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must be bool or hold only 0"):
        MODEL.generate(idx, 2, temperature=0, attention_mask=torch.tensor([[2, 1, 1], [1, 1, 1]]))
    # bool and float 0/1 masks mean the same as integer ones
    ref = MODEL.generate(idx, 3, temperature=0, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    for m in (torch.tensor([[False, True, True], [True, True, True]]), torch.tensor([[0.0, 1, 1], [1, 1, 1]])):
        assert torch.equal(MODEL.generate(idx, 3, temperature=0, attention_mask=m), ref)


def test_float_ids_in_lists_are_refused_and_integer_kinds_accepted():
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]=1.7 is not a token id"):
        MODEL.generate([[1.7, 2.2]], 2, temperature=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds torch.float32 values"):
        MODEL.generate([torch.tensor([1.0, 2.0])], 2, temperature=0)
    with pytest.raises(ValueError, match=r"idx must hold token ids as int64 \(or int32\); got dtype torch.float32"):
        MODEL.generate(torch.tensor([[1.0, 2.0]]), 2, temperature=0)
    ref = MODEL.generate([[5, 17, 42], [8, 3]], 3, temperature=0)
    for prompts in ([np.array([5, 17, 42]), np.array([8, 3])],
                    [torch.tensor([[5, 17, 42]]), torch.tensor([8, 3])],
                    [[np.int64(5), np.int32(17), 42], (8, 3)]):
        assert torch.equal(MODEL.generate(prompts, 3, temperature=0), ref)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30, MIN_TEMPERATURE])
def test_tiny_temperatures_sample_the_argmax_without_crashing(temperature):
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, -1.0, 4.0, 0.0]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert sample_next(logits, temperature, generator=g).tolist() == [1, 0]
    out = MODEL.generate(IDX, 4, temperature=temperature, seed=0)
    assert torch.equal(out, MODEL.generate(IDX, 4, temperature=0))


def test_generate_returns_an_ordinary_tensor():
    out = MODEL.generate(IDX, 3, temperature=0)
    assert not out.is_inference()
    out[0, 0] = 1                                                 # editable in place
    emb = MODEL.wte(out)                                          # and usable in training
    emb.sum().backward()
    assert MODEL.wte.weight.grad is not None
    MODEL.zero_grad(set_to_none=True)


def test_generate_on_a_training_model_samples_with_dropout_off_and_restores_the_mode():
    model = small_model(**ROBUST, embd_pdrop=0.3, attn_pdrop=0.3, resid_pdrop=0.3)
    ref = model.generate(IDX, 8, seed=3)                          # eval mode
    model.train()
    assert torch.equal(model.generate(IDX, 8, seed=3), ref)
    assert torch.equal(model.generate(IDX, 8, seed=3), ref)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    model.h[1].train()                                            # one block left in training mode
    assert torch.equal(model.generate(IDX, 8, seed=3), ref)
    assert [m for m in model.modules() if m.training] == list(model.h[1].modules())   # each mode as it was


def test_seeded_sampling_of_a_batch_row_equals_that_prompt_alone():
    prompts = [[5, 17, 42], [8, 3], [60, 61, 62, 63]]
    out = MODEL.generate(prompts, 10, temperature=1.0, top_k=20, seed=7)
    for i, p in enumerate(prompts):
        alone = MODEL.generate([p], 10, temperature=1.0, top_k=20, seed=row_seed(7, i))
        assert out[i, -10:].tolist() == alone[0, -10:].tolist(), i
    assert row_seed(7, 0) == 7 and len({row_seed(7, i) for i in range(100)}) == 100


def test_generate_argument_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match="is text; generate takes token ids"):
        MODEL.generate("ROMEO:", 5)
    with pytest.raises(ValueError, match=r"idx has shape \(5,\); expected \[B, T\] \(one prompt: idx\[None\]\)"):
        MODEL.generate(IDX[0], 5)
    with pytest.raises(ValueError, match=r"got dtype torch.uint8"):
        MODEL.generate(IDX.to(torch.uint8), 5)
    with pytest.raises(ValueError, match=r"idx has shape \(1, 0\); an empty prompt cannot be continued"):
        MODEL.generate(IDX[:, :0], 5)
    with pytest.raises(ValueError, match=r"max_new_tokens=2.0 must be an integer >= 0; got float"):
        MODEL.generate(IDX, 2.0)
    # numpy integers are integers
    ref = MODEL.generate(IDX, 3, temperature=0.7, top_k=5, seed=1)
    assert torch.equal(MODEL.generate(IDX, np.int64(3), temperature=np.float32(0.7), top_k=np.int32(5),
                                      seed=np.int64(1)), ref)


def test_the_greedy_comparison_accepts_only_near_ties():
    # conftest.assert_same_greedy lets two paths part only where the reference's top logits tie
    seq = MODEL.generate(IDX, 4, temperature=0)[0]
    assert_same_greedy(MODEL, seq, seq.clone(), 5)
    with torch.no_grad():
        logits = MODEL(seq[None, :5]).logits[0, -1]
    worst = seq.clone()
    worst[5] = int(logits.argmin())
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_greedy(MODEL, seq, worst, 5)


def test_sampled_batch_is_reproducible_and_valid():
    model = small_model(seed=3)
    idx = torch.randint(0, 97, (8, 3), generator=torch.Generator().manual_seed(3))
    a = model.generate(idx, 20, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    b = model.generate(idx, 20, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    assert torch.equal(a, b) and a.shape == (8, 23) and int(a.min()) >= 0 and int(a.max()) < 97


def test_penalties_and_logit_bias_follow_openais_formula():
    """adjust_logits is OpenAI's ``mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence``
    plus logit_bias (reference: the formula in NumPy), and a greedy ``generate`` with them equals
    a naive loop that applies that formula to an uncached forward of the whole text at each step
    (counting only generated tokens, not the prompt's)."""
    from gpt2mha.inference.sampling import adjust_logits, bias_vector

    rng = np.random.default_rng(0)
    logits, counts = rng.normal(size=(3, 50)), rng.integers(0, 3, size=(3, 50))
    bias = {3: -100.0, 7: 2.5, 49: 0.25}
    ref = logits - counts * 0.7 - (counts > 0) * 1.3
    ref[:, [3, 7, 49]] += [-100.0, 2.5, 0.25]
    got = adjust_logits(torch.tensor(logits, dtype=torch.float32), torch.tensor(counts), 1.3, 0.7,
                        bias_vector(bias, 50, "cpu"))
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-5)

    m, prompt = model(3), [5, 17, 42, 5]
    kwargs = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"11": 1.5, 12: -100})
    out = m.generate([prompt], 16, temperature=0, **kwargs)[0].tolist()
    ids, counts = list(prompt), np.zeros(50)
    with torch.no_grad():
        for _ in range(16):
            mu = m(torch.tensor([ids])).logits[0, -1].double().numpy()
            mu = mu - counts * 0.6 - (counts > 0) * 1.2
            mu[11] += 1.5
            mu[12] -= 100
            top2 = np.sort(mu)[-2:]
            assert top2[1] - top2[0] > 1e-4                   # no near-tie that rounding could flip
            ids.append(int(mu.argmax()))
            counts[ids[-1]] += 1
    assert out == ids
    assert out[len(prompt):] != m.generate([prompt], 16, temperature=0)[0, len(prompt):].tolist()


def test_logit_bias_bans_and_forces_tokens_and_bad_values_are_named():
    """-100 bans a token from any sampled text, +100 makes it certain (first principles: softmax of
    logits ~N(0,1) shifted by 100); bad penalties and bias entries raise naming the argument."""
    m, prompt = model(4), [[5, 17, 42]] * 4
    banned = {str(t): -100 for t in range(0, 50, 2)}               # every even id
    out = m.generate(prompt, 20, temperature=1.5, seed=3, logit_bias=banned)[:, 3:]
    assert (out % 2 == 1).all()
    out = m.generate(prompt, 20, temperature=1.0, seed=3, logit_bias={"7": 100})[:, 3:]
    assert (out == 7).all()
    seeded = [m.generate(prompt, 12, temperature=1.0, seed=9, presence_penalty=-0.5, frequency_penalty=1.0)
              for _ in range(2)]
    assert torch.equal(*seeded)
    for kwargs, match in [(dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\]"),
                          (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
                          (dict(logit_bias={"50": 1}), r"logit_bias key 50 is not a token id of this model's tokenizer \(ids 0 … 49\)"),
                          (dict(logit_bias={"x": 1}), "logit_bias key 'x' is not a token id"),
                          (dict(logit_bias={3: 101}), r"logit_bias\[3\]=101 must be a number in \[-100, 100\]"),
                          (dict(logit_bias=[3]), "logit_bias must be an object")]:
        with pytest.raises(ValueError, match=match):
            m.generate(prompt, 2, **kwargs)


def test_token_logprobs_are_the_models_log_softmax_with_the_chosen_token_among_the_top():
    """Reference: log-softmax in NumPy (float64). The k largest come first, most probable first;
    the chosen token is appended when outside them (OpenAI's "always the sampled token"); an
    argmax token's logprob equals the top entry exactly (one tensor: lm_eval's is_greedy)."""
    from gpt2mha.inference.sampling import token_logprobs

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    ref = logits.double().numpy()
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    tokens = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin()), 5])
    chosen, top = token_logprobs(logits, tokens, 3)
    np.testing.assert_allclose(chosen, ref[[0, 1, 2], tokens.numpy()], rtol=0, atol=1e-5)
    for r in range(3):
        want = np.argsort(-ref[r])[:3].tolist()
        assert [i for i, _ in top[r][:3]] == want
        np.testing.assert_allclose([v for _, v in top[r]][:3], ref[r, want], rtol=0, atol=1e-5)
        assert len(top[r]) == (3 if tokens[r].item() in want else 4) and tokens[r].item() in [i for i, _ in top[r]]
    assert chosen[0] == top[0][0][1]
    chosen, top = token_logprobs(logits, tokens, 0)
    assert [[i for i, _ in t] for t in top] == [[t] for t in tokens.tolist()]


def test_each_call_reuses_the_last_calls_cache_memory_zeroed():
    # the next call's cache lies in the last call's storage (generate._SPARE), zeroed first:
    # tokens as with a fresh cache (reference: the same call after the spare is dropped)
    import gpt2mha.inference.generate as G
    model = small_model(**ROBUST)
    G._SPARE.clear()
    want = [model.generate(IDX, 6, temperature=0), model.generate(IDX[:1, :2], 3, seed=5)]
    kept = G._SPARE[torch.float32]
    model.generate(IDX, 30, seed=1)                               # fills more of a larger storage
    got = [model.generate(IDX, 6, temperature=0), model.generate(IDX[:1, :2], 3, seed=5)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert G._SPARE[torch.float32].numel() >= kept.numel()
    G._SPARE.clear()
    storage, _ = G.new_cache((3, 1, 4, 5, 8), torch.float32, "cpu")
    storage.fill_(1.0)                                            # what a call leaves in it
    G.keep_for_next_call(storage)
    again, cache = G.new_cache((3, 1, 4, 5, 8), torch.float32, "cpu")
    assert again is storage and cache.k.data_ptr() == storage.data_ptr() and not storage.any()
    G.keep_for_next_call(again)
    G.keep_for_next_call(torch.empty(G.SPARE_BYTES // 4 + 1))    # more than SPARE_BYTES is not kept
    assert G._SPARE[torch.float32] is again
    G._SPARE.clear()


def test_a_cache_over_given_storage():
    from gpt2mha import KVCache
    k, v = torch.zeros(3, 2, 4, 10, 8), torch.zeros(3, 2, 4, 10, 8)
    cache = KVCache.over(k, v)
    assert cache.k is k and cache.lengths == [0, 0] and cache.max_len == 10
    with pytest.raises(ValueError, match=r"k and v must be two \[n_layer, B, h, T_max, head_dim\] tensors"):
        KVCache.over(k, v[:, :1])
    with pytest.raises(ValueError, match="k and v share memory"):
        KVCache.over(k, k)
    buf = torch.zeros(2 * 3 * 2 * 4 * 10 * 8)
    halves = buf.view(2, 3, 2, 4, 10, 8)
    assert KVCache.over(halves[0], halves[1]).max_len == 10            # two halves of one buffer: fine
    with pytest.raises(ValueError, match="max_len"):
        KVCache.over(k[:, :, :, :0], v[:, :, :, :0])


def test_the_loop_outside_inference_mode_after_generate():
    # the storage generate keeps was made in inference mode; a caller without it gets a new one
    import gpt2mha.inference.generate as G
    from gpt2mha.inference.params import SamplingParams
    model = small_model(**ROBUST)
    want = model.generate(IDX, 4, temperature=0)
    with torch.no_grad():
        seqs = G.run_to_completion(model, IDX.tolist(), SamplingParams(max_tokens=4, temperature=0), None, None, None,
                                   None, None, False, None)
    assert seqs[0].tokens == want[0, IDX.shape[1]:].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_nan_logits_are_a_named_error_at_the_step_they_appear(temperature, quantize):
    """A NaN in the position embedding of position 9 spoils the logits computed there and only
    there: a 3-token prompt's step 7 (its 8th new token is chosen from position 9's logits).
    Greedy used to emit token 0 forever, sampling raised torch's multinomial message; both now
    raise NonFiniteLogitsError naming the step, on the model's own forward and (int8 per_row) on
    the native route. The steps before it are untouched."""
    from gpt2mha.inference.sampling import NonFiniteLogitsError

    model = small_model(4, n_vocab=97, n_ctx=32, n_embd=32, n_head=2, n_layer=2)
    if quantize:
        model.quantize(quantize, method="rtn", activations="per_row")
    with torch.no_grad():
        model.wpe.weight[9, 0] = float("nan")
    prompt = torch.tensor([[5, 6, 7]])
    out = model.generate(prompt, 7, temperature=temperature, seed=1)      # steps 0-6 read positions 2-8
    assert out.shape == (1, 10)
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits at step 7 \(rows \[1\]\); its weights "
                                                   r"or inputs hold NaN/inf"):
        model.generate(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 7]])[:, 1:], 12, temperature=temperature, seed=1,
                       attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
