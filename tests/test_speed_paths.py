"""The fast paths of issue 6 equal the reference: the unchecked decode step over the static KV
cache, batched decoding, bf16/fp16 inference, the cached [n_embd, n_vocab] LM head (never
stale), and the benchmark's pieces on a tiny model. No timing assertions here."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_greedy
from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.attention import attend_explicit, attend_sdpa, attention_mask

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt")
VERDICT = os.path.join(os.path.dirname(__file__), "data", "the-verdict.txt")


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = GPT2(GPT2Config(**{**dict(n_vocab=97, n_ctx=48, n_embd=32, n_head=4, n_layer=3), **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def reference_logits(model, idx):
    """Full forward without any cache, on a fresh copy of the model whose weights are all in
    their default row-major layout (whatever decoding() did to the model's own)."""
    ref = GPT2(model.config).to(next(model.parameters()).dtype).eval()
    ref.load_state_dict({k: v.contiguous() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return ref(idx).logits


# ------------------------------------------------------------------------- static cache
def test_step_over_static_cache_equals_full_forward():
    model = small_model()
    idx = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    full = model(idx)
    with torch.inference_mode():
        cache = KVCache(3, 3, 4, 24, 8)
        logits = [model.step(idx[:, :7], cache, last_only=False)]            # prefill: every position
        logits += [model.step(idx[:, t:t + 1], cache) for t in range(7, 20)]  # one token per step
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(logits, 1), reference_logits(model, idx), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.to_past(), full.present, atol=1e-5, rtol=1e-5)


def test_decode_step_attends_only_to_filled_positions():
    """Garbage beyond cache.length (a reused cache) must not leak into the step."""
    model = small_model(seed=1)
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = KVCache(3, 2, 4, 30, 8)
        cache.k.fill_(1e4)
        cache.v.normal_()
        model.step(idx[:, :9], cache)
        last = model.step(idx[:, 9:], cache)
    torch.testing.assert_close(last[:, -1], reference_logits(model, idx)[:, -1], atol=1e-5, rtol=1e-5)


def test_forward_with_cache_still_checks_inputs():
    model = small_model()
    cache = KVCache(3, 1, 4, 48, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[97]]), cache=cache)
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 48]]))


# ------------------------------------------------------------------------- batch path
def test_batched_generation_equals_each_row_and_the_uncached_reference():
    from gpt2mha.bench import greedy_without_cache

    model = small_model(seed=2)
    idx = torch.randint(0, 97, (8, 5), generator=torch.Generator().manual_seed(2))
    batched = model.generate(idx, 30, temperature=0)
    rows = torch.cat([model.generate(idx[b:b + 1], 30, temperature=0) for b in range(8)])
    uncached = greedy_without_cache(model, idx, 30)
    for b in range(8):
        assert_same_greedy(model, batched[b], rows[b], 5)
        assert_same_greedy(model, batched[b], uncached[b], 5)
    with torch.inference_mode():                                # batch logits == per-row logits
        cache = KVCache(3, 8, 4, 40, 8)
        step = model.step(batched[:, :34], cache)
    torch.testing.assert_close(step[:, -1], reference_logits(model, batched[:, :34])[:, -1], atol=1e-5, rtol=1e-5)


def test_sampled_batch_is_reproducible_and_valid():
    model = small_model(seed=3)
    idx = torch.randint(0, 97, (8, 3), generator=torch.Generator().manual_seed(3))
    a = model.generate(idx, 20, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    b = model.generate(idx, 20, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    assert torch.equal(a, b) and a.shape == (8, 23) and int(a.min()) >= 0 and int(a.max()) < 97


# ------------------------------------------------------------------------- LM head copy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_copy_is_transposed_float32_wte_and_never_stale(dtype):
    """decoding() keeps a float32 [n_embd, n_vocab] copy of wte, taken afresh each time (a nested
    block reuses it) and freed on exit: weight writes that bump no version counter (.data, fused
    optimizers) cannot leave stale logits."""
    model = small_model(seed=4).to(dtype)
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    w = model.lm_head_weight()
    assert w.shape == (32, 97) and w.is_contiguous() and w.dtype == torch.float32
    assert torch.equal(w, model.wte.weight.t().float())
    with torch.no_grad():
        plain = model(idx).logits
        with model.decoding():
            outer = model._lm_head
            assert outer is not None
            torch.testing.assert_close(model(idx).logits, plain, atol=1e-5, rtol=1e-5)
            with model.decoding():
                assert model._lm_head is outer                  # nested: the same copy
            assert model._lm_head is outer                      # still there after the inner exit
        assert model._lm_head is None                           # freed on exit
    before = model.generate(idx, 6, temperature=0)
    model.wte.weight.data.mul_(-3.0)                            # no version bump
    after = model.generate(idx, 6, temperature=0)
    with torch.no_grad():
        seq = idx
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert not torch.equal(after, before)
    for row, ref_row in zip(after, seq):
        assert_same_greedy(model, row, ref_row, idx.shape[1])


def test_head_inside_decoding_keeps_the_wte_gradient():
    """With autograd on inside decoding(), the head reads wte itself, so wte's gradient includes
    the LM head's part (the copy carries none)."""
    model = small_model(seed=5).to(torch.bfloat16)
    idx = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    model(idx).logits.float().pow(2).sum().backward()
    expected = model.wte.weight.grad.clone()
    model.zero_grad()
    with model.decoding():
        model(idx).logits.float().pow(2).sum().backward()
    torch.testing.assert_close(model.wte.weight.grad, expected)


def test_lm_head_after_generate_fused_optimizer_and_frozen_embeddings():
    model = small_model(seed=6)
    idx = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(6))
    model.generate(idx[:, :3], 2, temperature=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model.train()
    loss = F.cross_entropy(model(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    assert model.wte.weight.grad.abs().sum() > 0                # the head reads the tied weight
    opt.step()
    model.eval()
    with torch.no_grad():
        no_grad = model(idx).logits
    torch.testing.assert_close(no_grad, model(idx).logits.detach(), atol=1e-5, rtol=1e-5)
    model.wte.weight.requires_grad_(False)                      # frozen embeddings after generate
    model.train()
    model(idx).logits.sum().backward()


# ------------------------------------------------------------------------- Conv1D [out, in] copies
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_conv1d_copies_are_transposed_fresh_and_freed(dtype):
    """decoding() gives each Conv1D of a bf16/fp16 model an [out, in] copy of its weight (a
    nested block reuses it, the exit frees it, the parameter itself is untouched); outputs match
    x @ W + b computed in float64 from the model's own weights (independent of either kernel),
    and a weight changed between two generate calls (.data, no version bump) is seen."""
    model = small_model(seed=10).to(dtype)
    conv = model.h[1].attn.c_attn
    ptr, strides = conv.weight.data_ptr(), conv.weight.stride()
    x = torch.randn(3, 4, 32).to(dtype)
    exact = (x.double() @ conv.weight.double() + conv.bias.double())
    with torch.no_grad():
        plain = conv(x)
        with model.decoding():
            copies = [m.weight_t for m in model.modules() if hasattr(m, "weight_t") and m.weight_t is not None]
            assert len(copies) == 4 * 3                         # four Conv1Ds per block
            assert torch.equal(conv.weight_t, conv.weight.t()) and conv.weight_t.is_contiguous()
            fast = conv(x)
            with model.decoding():
                assert model.h[1].attn.c_attn.weight_t is copies[4]   # nested: the same copy
            assert conv.weight_t is not None
        assert conv.weight_t is None and model._lm_head is None
    assert (conv.weight.data_ptr(), conv.weight.stride()) == (ptr, strides)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(fast.double(), exact, **tol)
    torch.testing.assert_close(plain.double(), exact, **tol)
    idx = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(10))
    before = model.generate(idx, 6, temperature=0)
    g = torch.Generator().manual_seed(13)
    for block in model.h:                                       # new block weights, no version bump
        for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
    after = model.generate(idx, 6, temperature=0)
    with model.decoding(), torch.no_grad():
        seq = idx
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert not torch.equal(after, before)
    for row, ref_row in zip(after, seq):
        assert_same_greedy(model, row, ref_row, idx.shape[1])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_while_decoding_takes_no_weight_copies_along(how):
    """A model deep-copied or pickled inside decoding() leaves the block's weight copies behind:
    the copy reads its own weights afterwards, even after they change (no stale logits)."""
    import pickle

    model = small_model(seed=14).to(torch.bfloat16)
    with model.decoding():
        clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert clone._lm_head is None and not clone._decoding
    assert all(m.weight_t is None for m in clone.modules() if hasattr(m, "weight_t"))
    idx = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        for p in clone.parameters():
            p.data.copy_(torch.randn_like(p))
        torch.testing.assert_close(clone(idx).logits, reference_logits(clone, idx))


def _bf16(seed):
    return small_model(seed=seed).to(torch.bfloat16)


def test_copies_are_used_only_while_they_match_the_weights_in_use():
    """Inside decoding() a copy stands in for a weight only while that weight is the very tensor
    it was taken from, unchanged. Reference: the same call outside decoding(), which reads the
    weights themselves. Each case below differed by 0.15-0.5 before the check."""
    import torch.nn.utils.prune as prune
    from torch.func import functional_call

    idx = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(15))
    close = dict(atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        pruned = _bf16(15)                                      # weight recomputed by a pre-hook
        for m in pruned.modules():
            if type(m).__name__ == "Conv1D":
                prune.l1_unstructured(m, "weight", amount=0.3)
        with pruned.decoding():
            for m in pruned.modules():
                if hasattr(m, "weight_orig"):
                    m.weight_orig.add_(torch.randn_like(m.weight_orig) * 0.05)
            inside = pruned(idx).logits
        torch.testing.assert_close(inside, pruned(idx).logits, **close)

        model = _bf16(16)                                       # substituted parameters
        params = {k: (v * 2 if k.endswith(("c_fc.weight", "wte.weight")) else v) for k, v in model.named_parameters()}
        outside = functional_call(model, params, (idx,)).logits
        with model.decoding():
            torch.testing.assert_close(functional_call(model, params, (idx,)).logits, outside, **close)

        donor = _bf16(17)                                       # load_state_dict inside the block
        with model.decoding():
            model.load_state_dict(donor.state_dict())
            torch.testing.assert_close(model(idx).logits, donor(idx).logits, **close)

        with model.decoding():                                  # dtype changed inside the block
            model.half()
            half = model(idx).logits
        torch.testing.assert_close(half, model(idx).logits, **close)


def test_decoding_skips_conv1ds_without_a_weight_and_always_cleans_up():
    """A Conv1D subclass whose weight is not a tensor gets no copy (generate runs), and an
    error inside the block leaves no copy or flag behind."""
    from gpt2mha.attention import Conv1D

    class Quantised(Conv1D):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out)
            self.weight = None

        def forward(self, x):
            return x @ torch.zeros(self.n_in, self.n_out, dtype=x.dtype) + self.bias

    model = _bf16(18)
    model.h[0].mlp.c_fc = Quantised(32, 128).to(torch.bfloat16)
    out = model.generate(torch.tensor([[1, 2, 3]]), 4, temperature=0)
    assert out.shape == (1, 7)
    with pytest.raises(RuntimeError, match="boom"):
        with model.decoding():
            raise RuntimeError("boom")
    assert model._lm_head is None and not model._decoding
    assert all(m._kept is None for m in model.modules() if isinstance(m, Conv1D))


def test_float32_conv1d_keeps_its_layout_and_copies_can_be_declined():
    """float32 reads GPT-2's [in, out] fastest (benchmarks/kernels.py), so no copy is taken;
    transpose_conv1d=False keeps a bf16 model's memory too."""
    model = small_model(seed=11)
    with model.decoding():
        assert all(m.weight_t is None for m in model.modules() if hasattr(m, "weight_t"))
    model = small_model(seed=11).to(torch.bfloat16)
    model.transpose_conv1d = False
    with model.decoding():
        assert all(m.weight_t is None for m in model.modules() if hasattr(m, "weight_t"))


def test_conv1d_copy_is_not_used_when_autograd_wants_the_weight():
    """With autograd on inside decoding(), Conv1D reads its weight itself: the block weights'
    gradients equal those computed outside decoding()."""
    model = small_model(seed=12).to(torch.bfloat16)
    idx = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(12))
    model(idx).logits.float().pow(2).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with model.decoding():
        model(idx).logits.float().pow(2).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_head_returns_unrounded_float32_logits(dtype):
    """The head of a bf16/fp16 model accumulates and returns float32 (float64 stays float64),
    inside decoding() (its float32 copy of wte) and outside, with the same numbers; reference:
    the float32 (float64) formula F.linear(ln_f(x), wte) on the model's own weights."""
    model = small_model(seed=8).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(2, 3, 32).to(dtype)
    h = model.ln_f(x)
    expected = F.linear(h.to(acc), model.wte.weight.to(acc))
    with torch.no_grad():
        plain = model.head(x)
        with model.decoding():
            assert model._lm_head.copy.dtype == acc and model._lm_head.copy.shape == (32, 97)
            decoded = model.head(x)
    assert plain.dtype == decoded.dtype == acc
    torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=1e-5)
    if dtype != torch.float64:                                  # not rounded to the model's dtype
        assert not torch.equal(plain, plain.to(dtype).to(acc))


def test_inference_mlp_equals_training_math_and_spares_outputs_others_may_hold():
    """Without grad the MLP's GELU overwrites c_fc's output (less peak memory in prefill): same
    numbers as the autograd path; a forward hook, a patched c_fc.forward returning a tensor the
    user keeps, and a torch function mode recording outputs all still see the pre-activation."""
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_leaves_parameters_untouched_and_fused_training_exact(dtype):
    """generate touches no parameter (same objects, storage, strides and values), so a fused
    AdamW run that samples midway equals one that does not (nanoGPT's pattern)."""
    def train(sample_midway):
        model = small_model(seed=10).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        gen = torch.Generator().manual_seed(1)
        for it in range(4):
            if sample_midway and it == 2:
                params = {k: (p, p.data_ptr(), p.stride(), p.detach().clone()) for k, p in model.named_parameters()}
                model.eval()
                model.generate(torch.tensor([[1, 2, 3]]), 4, temperature=0)
                model.train()
                for k, p in model.named_parameters():
                    q, ptr, stride, value = params[k]
                    assert p is q and p.data_ptr() == ptr and p.stride() == stride and torch.equal(p.detach(), value), k
            x = torch.randint(0, 97, (2, 16), generator=gen)
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model

    a, b = train(False), train(True)
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), k


def test_head_uses_the_tied_weight_when_gradients_flow():
    model = small_model(seed=7).train()
    x = torch.randn(2, 3, 32)
    assert model.head(x).grad_fn is not None
    model.head(x).sum().backward()
    expected = model.ln_f(x).detach().reshape(-1, 32).sum(0)    # d(sum logits)/d(wte[v]) = sum of rows
    torch.testing.assert_close(model.wte.weight.grad, expected.expand(97, 32).contiguous())


# ------------------------------------------------------------------------- bf16 / fp16
def _confident_model():
    """The built-in trained model if installed; otherwise a tiny byte model trained here."""
    from gpt2mha import DEFAULT_MODEL
    from gpt2mha.checkpoints import builtin_models

    if DEFAULT_MODEL in builtin_models():
        return GPT2.from_pretrained(DEFAULT_MODEL)
    with open(SHAKESPEARE if os.path.exists(SHAKESPEARE) else VERDICT, "rb") as f:
        ids = torch.tensor(list(f.read()))[:-16384]             # keep the tail held out
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=256, n_ctx=64, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        ix = torch.randint(0, len(ids) - 65, (16,), generator=gen)
        x = torch.stack([ids[i:i + 65] for i in ix])
        loss = F.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def confident():
    """(fp32 model, held-out real text as bytes: the last 8192 of tinyshakespeare, which the
    built-in model never trained on)."""
    model = _confident_model()
    with open(SHAKESPEARE if os.path.exists(SHAKESPEARE) else VERDICT, "rb") as f:
        tokens = torch.tensor(list(f.read()[-8192:]))
    return model, tokens


# overall top-1 agreement, and at positions where fp32's top-2 probabilities differ by >= 0.05.
# Measured on the built-in model (float32 logits from the low-precision body): bf16 99.08% /
# 99.99%, fp16 99.88% / 100%. The bounds leave room for other CPUs' kernels rounding
# differently; `gpt2mha bench` reports the figure against issue 6's 99% target.
AGREEMENT = {torch.bfloat16: (0.985, 0.998), torch.float16: (0.995, 0.999)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_top1_agrees_with_fp32_on_real_text(confident, dtype):
    from gpt2mha.bench import top1_agreements

    model, tokens = confident
    low = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        logits = low(tokens[None, :model.config.n_ctx]).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()   # the head runs in fp32
    overall, decisive = AGREEMENT[dtype]
    agree, agree_decisive = top1_agreements(model, low, tokens)            # one pass, both figures
    assert agree >= overall and agree_decisive >= decisive


def test_top1_agreements_count_what_the_argmaxes_say():
    """Both figures in one pass equal the counts taken by hand from the two models' logits over
    every window (reference: argmax and softmax top-2 margins computed here)."""
    from gpt2mha.bench import top1_agreement, top1_agreements

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=40, n_ctx=16, n_embd=16, n_head=2, n_layer=1)).eval()
    low = copy.deepcopy(model)
    with torch.no_grad():
        for p in low.parameters():                                     # another model, partly agreeing
            p.add_(torch.randn(p.shape) * 0.01)
    tokens = torch.randint(0, 40, (40,))                               # windows of 16, 16 and 8
    with torch.no_grad():
        ref = torch.cat([model(tokens[s:s + 16][None]).logits[0] for s in (0, 16, 32)])
        other = torch.cat([low(tokens[s:s + 16][None]).logits[0] for s in (0, 16, 32)])
    same = ref.argmax(-1) == other.argmax(-1)
    top2 = ref.softmax(-1).topk(2, -1).values
    margin = (top2[:, 0] - top2[:, 1]).median().item()                 # about half the positions are decisive
    keep = top2[:, 0] - top2[:, 1] >= margin
    agree, decisive = top1_agreements(model, low, tokens, margin)
    assert 0 < agree < 1                                                # both counts matter
    assert agree == same.sum().item() / len(same) and agree == top1_agreement(model, low, tokens)
    assert decisive == (same & keep).sum().item() / keep.sum().item() == top1_agreement(model, low, tokens, margin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cached_decode_matches_its_own_forward(confident, dtype):
    """The static cache in bf16/fp16 is the same computation as the full low-precision forward
    (teacher-forced argmax agreement; shapes differ, so kernels round differently)."""
    model, tokens = confident
    low = copy.deepcopy(model).to(dtype)
    T = min(model.config.n_ctx, 64)
    window = tokens[None, :T]
    with torch.inference_mode():
        full = low(window).logits.argmax(-1)
        cache = KVCache(low.config.n_layer, 1, low.config.n_head, T, low.config.head_dim, dtype=dtype)
        stepped = torch.cat([low.step(window[:, :1], cache)] +
                            [low.step(window[:, t:t + 1], cache) for t in range(1, T)], 1).argmax(-1)
    assert cache.k.dtype == dtype
    assert (full == stepped).float().mean() >= 0.97
    out = low.generate(window[:, :8], 16, temperature=0)
    assert out.shape == (1, 24)


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
    explicit, w = attend_explicit(ql, kl, vl, m)
    for a in (fused, explicit):
        assert a.dtype == dtype and torch.isfinite(a).all()
    assert torch.isfinite(w).all() and w.dtype == torch.float32
    torch.testing.assert_close(fused.float(), explicit.float(), atol=2e-2, rtol=0)
    # the reference is computed from the unrounded q, k: compare with the rounded inputs instead
    ref_rounded = F.scaled_dot_product_attention(ql.double(), kl.double(), vl.double(), attn_mask=m).float()
    torch.testing.assert_close(fused.float(), ref_rounded, atol=2e-2, rtol=0)
    assert ref.shape == fused.shape


# ------------------------------------------------------------------------- the bench's pieces
TINY = GPT2Config(n_vocab=300, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")


def test_bench_sections_run_on_a_tiny_model(capsys):
    pytest.importorskip("transformers")
    from gpt2mha import bench

    sizes = bench.Sizes(new_tokens=6, nocache_tokens=6, batches=(1, 2), positions=(8, 40), position_steps=3,
                        prefill_tokens=32, attn_batch=2, attn_tokens=32, agree_tokens=64, builtin_agree_tokens=512,
                        repeats=1, attn_repeats=1)
    result = bench.run(preset="tiny-test", config=TINY, sizes=sizes, memory=False, text=VERDICT,
                       sections=("decode", "cache", "positions", "prefill", "attention", "lowp"),
                       log=lambda *a: None)
    rows = {r["figure"]: r for r in result["rows"]}
    decode = [r for f, r in rows.items() if "transformers generate" in f]
    assert len(decode) == 2 and all("same greedy tokens: yes" in r["note"] for r in decode)
    ceilings = [r for f, r in rows.items() if f.startswith("decode tok/s ceiling")]  # fp32 b1, b2; bf16 b1
    assert len(ceilings) == 3 and all(r["value"] > 0 and "ms/step" in r["note"] for r in ceilings)
    assert any("no cache" in f and "same greedy tokens: yes" in r["note"] for f, r in rows.items())
    attn = [r for f, r in rows.items() if f.startswith("attention sublayer")]
    assert len(attn) >= 4 and not any("DIFFERS" in r["note"] for r in attn)
    assert any(f.startswith("top-1 agreement, gpt2mha bfloat16") for f in rows)
    for r in result["rows"]:
        assert r["value"] is not None and (r["ratio"] is None or r["ratio"] > 0)
    first = result["rows"][0]                                   # the progress line on stderr
    assert bench.format_row(first).startswith(f"{first['figure']}: ") and "{" not in bench.format_row(first)
    table = bench.format_table(result)
    assert table.count("\n|") == len(result["rows"]) + 2
    import json
    json.dumps(result)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_bench_prefill_peak_memory_child(tmp_path):
    from gpt2mha import bench

    directory = str(tmp_path / "ckpt")
    small_model(n_vocab=300, n_ctx=64).save_pretrained(directory)
    peak = bench.prefill_peak_mb("gpt2mha fused", directory, 64)
    assert peak is not None and 0 <= peak < 500


def test_quick_sizes_bound_every_section():
    """--quick scales down every size that sets a section's work (tokens, batches, positions,
    windows, calibration text, memory children, repeats), not only the repeats."""
    from dataclasses import fields

    from gpt2mha import bench

    full, quick = bench.FULL, bench.QUICK
    effective = {"quant_batches": lambda s: s.quant_batches or s.batches,
                 "slow_decode_tokens": lambda s: s.slow_decode_tokens or s.new_tokens,
                 "calibration_bytes": lambda s: s.calibration_bytes or 16384}
    for f in fields(bench.Sizes):
        q, F = (effective[f.name](s) if f.name in effective else getattr(s, f.name) for s in (quick, full))
        if f.name == "memory_variants":
            assert set(q) < set(F), f.name
        elif isinstance(F, bool):
            assert q <= F, f.name
        elif isinstance(F, tuple):
            assert len(q) <= len(F) and max(q) <= max(F), f.name
        else:
            assert q <= F, f.name
        if f.name not in ("prompt", "batches", "positions"):
            assert q != F, f"--quick leaves {f.name} at the full run's {F}"


def test_cli_bench_rejects_unknown_sections(capsys):
    from gpt2mha.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--quick", "--json", "--only", "decode,prefill"])
    assert args.quick and args.json and args.func.__name__ == "cmd_bench"
    assert main(["bench", "--only", "nope"]) == 2
    assert "unknown section" in capsys.readouterr().err


def test_kernel_survey_times_the_124m_block_matrices_in_both_layouts():
    """benchmarks/kernels.py: the 48 matrices are 124M's (85M weights), the [out, in] set is the
    transpose of the [in, out] one, and a pass multiplies every matrix once (reference: x @ W)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernels.py")
    spec = importlib.util.spec_from_file_location("kernels", path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    io, oi = kernels.matrices(torch.float32, "in,out", n_layer=2), kernels.matrices(torch.float32, "out,in", n_layer=2)
    assert len(io) == 8 and all(torch.equal(a.t(), b) and b.is_contiguous() for a, b in zip(io, oi))
    assert sum(w.numel() for w in kernels.matrices(torch.bfloat16, "in,out")) == 12 * 768 * (2304 + 768 + 3072 + 3072)
    outs_io, outs_oi = kernels.pass_fn(io, "in,out", 3)(), kernels.pass_fn(oi, "out,in", 3)()
    assert [o.shape for o in outs_io] == [(3, n_out) for _, n_out in kernels.BLOCK_SHAPES * 2]
    assert [o.shape for o in outs_oi] == [o.shape for o in outs_io]
