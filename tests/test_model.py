"""GPT2 against Hugging Face transformers' GPT2LMHeadModel on the same random weights.

transformers is the independent reference (a test dependency only): logits (fp32, atol 1e-4),
20 greedy tokens, the cached path, and the save/load round trip in both directions.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import ROBUST, assert_same_greedy, hf_random_gpt2, small_model
from gpt2mha import GPT2, GPT2Config, KVCache


@pytest.mark.parametrize("cfg", [
    dict(vocab_size=300, n_positions=64, n_embd=48, n_head=4, n_layer=2),
    dict(vocab_size=513, n_positions=40, n_embd=60, n_head=5, n_layer=3),
    dict(vocab_size=256, n_positions=128, n_embd=64, n_head=1, n_layer=1),
])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, cfg):
    hf = hf_random_gpt2(seed=1, **cfg)
    hf.save_pretrained(tmp_path)
    ours = GPT2.from_pretrained(str(tmp_path))
    torch.manual_seed(0)
    idx = torch.randint(0, cfg["vocab_size"], (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, hf(idx).logits, atol=1e-4, rtol=1e-4)
        ref = hf.generate(idx[:, :4], max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = ours.generate(idx[:, :4], 20, temperature=0)
    for row, ref_row in zip(out, ref):
        assert_same_greedy(ours, row, ref_row, 4)


def test_full_124m_config_matches_transformers(tmp_path):
    hf = hf_random_gpt2(seed=2, vocab_size=50257, n_positions=1024, n_embd=768, n_head=12, n_layer=12)
    hf.save_pretrained(tmp_path)
    ours = GPT2.from_pretrained(str(tmp_path))
    c, ref = ours.config, GPT2Config.from_preset("124M")
    assert (c.n_vocab, c.n_ctx, c.n_embd, c.n_head, c.n_layer) == (ref.n_vocab, ref.n_ctx, ref.n_embd, ref.n_head, ref.n_layer)
    idx = torch.randint(0, 50257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, hf(idx).logits, atol=1e-4, rtol=1e-4)
        ref = hf.generate(idx[:, :4], max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert_same_greedy(ours, ours.generate(idx[:, :4], 20, temperature=0)[0], ref[0], 4)


def test_save_pretrained_loads_in_transformers(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(3)
    ours = GPT2(GPT2Config(n_vocab=320, n_ctx=32, n_embd=32, n_head=4, n_layer=2)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)          # LayerNorms and biases not at their init
    ours.save_pretrained(str(tmp_path / "ckpt"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "ckpt")).eval()
    idx = torch.randint(0, 320, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx).logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)


def test_present_layout_and_cached_steps_equal_full_forward():
    model = small_model(noise="ln")
    torch.manual_seed(5)
    for _ in range(5):
        B, T, k = int(torch.randint(1, 4, ())), int(torch.randint(1, 20, ())), int(torch.randint(1, 8, ()))
        idx = torch.randint(0, 97, (B, T + k))
        with torch.no_grad():
            full = model(idx)
            assert full.present.shape == (B, 3, 2, 4, T + k, 8)   # [B, n_layer, 2, h, T, head_dim]
            out = model(idx[:, :T])
            past, logits = out.present, [out.logits]
            for t in range(T, T + k):
                step = model(idx[:, t:t + 1], past=past)
                past = torch.cat([past, step.present], dim=-2)
                logits.append(step.logits)
        torch.testing.assert_close(torch.cat(logits, 1), full.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(past, full.present, atol=1e-5, rtol=1e-5)


def test_static_cache_equals_past_and_converts_to_official_layout():
    model = small_model(seed=1, noise="ln")
    idx = torch.randint(0, 97, (2, 15))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(3, 2, 4, 20, 8)
        a = model(idx[:, :9], cache=cache).logits
        b = model(idx[:, 9:12], cache=cache).logits                  # several tokens at once
        c = [model(idx[:, t:t + 1], cache=cache).logits for t in range(12, 15)]
    torch.testing.assert_close(torch.cat([a, b, *c], 1), full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.to_past(), full.present, atol=1e-5, rtol=1e-5)
    back = KVCache.from_past(full.present, max_len=20)
    assert back.length == 15 and torch.equal(back.to_past(), full.present)


def test_fused_and_explicit_paths_agree():
    model = small_model(seed=2, noise="ln")
    idx = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        fused = model(idx).logits
        model.attn_impl = "explicit"
        explicit = model(idx).logits
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_with_and_without_cache():
    model = small_model(seed=3, noise="ln")
    idx = torch.randint(0, 97, (2, 5))
    cached = model.generate(idx, 25, temperature=0)
    seq = idx
    with torch.no_grad():
        for _ in range(25):                                         # recompute everything each step
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    for row, ref_row in zip(cached, seq):
        assert_same_greedy(model, row, ref_row, 5)


def test_config_presets_match_gpt2_paper_table_2():
    sizes = {"124M": (12, 12, 768), "355M": (24, 16, 1024), "774M": (36, 20, 1280), "1558M": (48, 25, 1600)}
    for name, (n_layer, n_head, n_embd) in sizes.items():
        c = GPT2Config.from_preset(name)
        assert (c.n_layer, c.n_head, c.n_embd, c.n_vocab, c.n_ctx) == (n_layer, n_head, n_embd, 50257, 1024)
        assert c.head_dim == 64
    with torch.device("meta"):
        assert GPT2(GPT2Config.from_preset("124M")).num_parameters() == 124_439_808


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="n_embd=50 is not divisible by n_head=4"):
        GPT2Config(n_embd=50, n_head=4)
    for field in ("n_head", "n_layer", "n_ctx"):
        with pytest.raises(ValueError, match=field):
            GPT2Config(**{field: 0})
    with pytest.raises(ValueError, match="n_embd=-8"):
        GPT2Config(n_embd=-8, n_head=4)
    model = small_model(noise="ln")
    with pytest.raises(ValueError, match="49 > n_ctx=48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(ValueError, match="token id 97, outside the vocabulary"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match=r"idx has shape \(5,\); expected \[B, T\] \(one sequence: idx\[None\]\)"):
        model(torch.zeros(5, dtype=torch.long))
    good = model(torch.zeros(2, 3, dtype=torch.long)).present
    with pytest.raises(ValueError, match="n_layer is 2, expected 3"):
        model(torch.zeros(2, 1, dtype=torch.long), past=good[:, :2])
    with pytest.raises(ValueError, match="batch is 2, expected 1"):
        model(torch.zeros(1, 1, dtype=torch.long), past=good)
    with pytest.raises(ValueError, match="n_head is 2, expected 4"):
        model(torch.zeros(2, 1, dtype=torch.long), past=good[:, :, :, :2])
    with pytest.raises(ValueError, match="head_dim is 4, expected 8"):
        model(torch.zeros(2, 1, dtype=torch.long), past=good[..., :4])


def _bad_forward_arguments(model):
    """(name, kwargs) pairs: every tensor argument of forward given as a non-tensor, with the
    wrong dtype, on another device (``meta``, standing in for a GPU tensor with a CPU model and
    back) or with the wrong shape; the cached path (``cache=``) too."""
    idx = torch.randint(0, 97, (2, 4))
    past = model(idx).present.detach()
    meta = torch.device("meta")
    yield "idx", dict(idx=[[1, 2, 3]])
    yield "idx", dict(idx=idx.float())
    yield "idx", dict(idx=idx.bool())
    yield "idx", dict(idx=idx.to(meta))
    yield "idx", dict(idx=idx[None])
    for extra in ({}, dict(cache=KVCache(3, 2, 4, 48, 8)), dict(past=past, idx=idx[:, :1])):
        T, S = (1, 5) if "past" in extra else (4, 4)
        base = dict(idx=idx, **extra) if "idx" not in extra else extra
        yield "position_ids", {**base, "position_ids": torch.arange(float(T))}
        yield "position_ids", {**base, "position_ids": torch.ones(T, dtype=torch.bool)}
        yield "position_ids", {**base, "position_ids": torch.arange(T).to(torch.uint8)}
        yield "position_ids", {**base, "position_ids": torch.arange(T).to(torch.complex64)}
        yield "position_ids", {**base, "position_ids": list(range(T))}
        yield "position_ids", {**base, "position_ids": torch.arange(T).to(meta)}
        yield "position_ids", {**base, "position_ids": torch.arange(T)[None, None]}
        yield "position_ids", {**base, "position_ids": torch.arange(T) + 48}
        yield "attention_mask", {**base, "attention_mask": [[1] * S] * 2}
        yield "attention_mask", {**base, "attention_mask": torch.ones(2, S).to(meta)}
        yield "attention_mask", {**base, "attention_mask": torch.full((2, S), 0.5)}
        yield "attention_mask", {**base, "attention_mask": torch.ones(2, S, dtype=torch.complex64)}
        yield "attention_mask", {**base, "attention_mask": torch.ones(2, S + 1)}
    yield "past", dict(idx=idx[:, :1], past=past.tolist())
    yield "past", dict(idx=idx[:, :1], past=past.long())
    yield "past", dict(idx=idx[:, :1], past=past.to(meta))
    yield "past", dict(idx=idx[:, :1], past=past[:, :, 0])
    yield "cache", dict(idx=idx, cache=[past])
    yield "cache", dict(idx=idx, cache=KVCache(3, 2, 4, 48, 8, device=meta))
    yield "cache", dict(idx=idx, cache=KVCache(3, 2, 4, 48, 8, dtype=torch.float64))
    yield "last_only", dict(idx=idx, last_only="yes")


def test_every_tensor_argument_of_forward_is_checked_and_named():
    """A wrong dtype, device, shape or type of any argument is a ValueError naming it, never a
    raw torch error from deep inside (e.g. ``position_ids=torch.arange(8.)`` failing in the
    embedding lookup)."""
    model = small_model(noise="ln")
    cases = list(_bad_forward_arguments(model))
    assert len(cases) > 40
    for name, kwargs in cases:
        kwargs = dict(kwargs)
        with pytest.raises(ValueError) as info:
            with torch.no_grad():
                model(kwargs.pop("idx"), **kwargs)
        assert str(info.value).startswith(name), (name, kwargs, str(info.value))
    # the same arguments of the right kind run, and explicit positions equal the default ones
    idx = torch.randint(0, 97, (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, position_ids=torch.arange(4, dtype=torch.int32)).logits, model(idx).logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_tensors_for_a_cuda_model_are_named():
    model = small_model(noise="ln").cuda()
    idx = torch.randint(0, 97, (2, 4))
    with pytest.raises(ValueError, match=r"^idx is on cpu but the model is on cuda:0"):
        model(idx)
    with pytest.raises(ValueError, match=r"^position_ids is on cpu"):
        model(idx.cuda(), position_ids=torch.arange(4))
    with pytest.raises(ValueError, match=r"^idx is on cpu"):
        model.generate(idx, 2)


# ------------------------------------ past, the untied head, the MLP, the tied head's gradient
IDX = torch.tensor([[5, 17, 42, 8, 3]])


def test_integer_or_bool_past_is_refused():
    model = small_model(**ROBUST)
    past = model(IDX).present
    for bad in (past.long(), past > 0):
        with pytest.raises(ValueError, match="past must be a floating-point tensor"):
            model(IDX[:, :1], past=bad)
        with pytest.raises(ValueError, match="past must be a floating-point tensor"):
            model.h[0].attn(torch.randn(1, 1, 32), past=bad[:, 0])


def test_untied_model_decodes_with_its_own_head():
    model = small_model(**ROBUST, tie_word_embeddings=False)
    assert not torch.equal(model.lm_head.weight, model.wte.weight)
    with torch.no_grad():
        h = model.ln_f(model.h[1](model.h[0](model.wte(IDX) + model.wpe(torch.arange(5)))[0])[0])
        torch.testing.assert_close(model(IDX).logits, h @ model.lm_head.weight.T, atol=1e-5, rtol=1e-5)
    out = model.generate(IDX, 6, temperature=0)                   # cached decode (head copy) = no cache
    ids = IDX
    for _ in range(6):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_inference_mlp_equals_training_math_and_spares_outputs_others_may_hold():
    """The MLP computes c_proj(gelu_tanh(x @ W_fc + b_fc)) (reference: that formula from its own
    weights) with and without autograd, and never writes over c_fc's output: a forward hook, a
    patched c_fc.forward returning a tensor the user keeps, and a torch function mode recording
    outputs all still see the pre-activation, unchanged."""
    model = small_model(seed=9)
    mlp = model.h[0].mlp
    x = torch.randn(2, 5, 32)
    pre = torch.addmm(mlp.c_fc.bias, x.reshape(-1, 32), mlp.c_fc.weight).view(2, 5, 128)
    expected = mlp.c_proj(F.gelu(pre, approximate="tanh"))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)
    kept = []
    handle = mlp.c_fc.register_forward_hook(lambda m, i, out: kept.append(out))
    try:
        with torch.inference_mode():
            torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)
    finally:
        handle.remove()
    torch.testing.assert_close(kept[0], pre.detach(), atol=1e-6, rtol=1e-6)

    owned = pre.detach().clone()                                # activation patching: c_fc returns
    mlp.c_fc.forward = lambda x: owned                          # a tensor the user keeps
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(owned, pre.detach())                     # not overwritten
    del mlp.c_fc.forward

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append(out)
            return out

    seen = []
    with torch.no_grad(), Record():
        mlp(x)
    assert any(isinstance(t, torch.Tensor) and t.shape == pre.shape and torch.equal(t, pre.detach()) for t in seen)


def test_head_uses_the_tied_weight_when_gradients_flow():
    model = small_model(seed=7).train()
    x = torch.randn(2, 3, 32)
    assert model.lm_head(model.ln_f(x)).grad_fn is not None
    model.lm_head(model.ln_f(x)).sum().backward()
    expected = model.ln_f(x).detach().reshape(-1, 32).sum(0)    # d(sum logits)/d(wte[v]) = sum of rows
    torch.testing.assert_close(model.wte.weight.grad, expected.expand(97, 32).contiguous())
