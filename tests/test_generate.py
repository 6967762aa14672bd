"""Sampling semantics (OpenAI's sample.py: top_k_logits, top_p_logits) and the decode loop."""

import pytest
import torch

from conftest import assert_same_greedy
from gpt2mha import GPT2, GPT2Config
from gpt2mha.inference.sampling import sample_next, top_k_logits, top_p_logits


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
