"""fp16 on the native forward (kernels/float_products.cpp's conv1d_f16 and linear_f16, cached_forward.cpp's
fp16 kind, inference/dense.py): the products against torch's fp16 GEMM (float32 sums rounded to fp16 once)
and against the float32 products over the weights' exact values; the one-call step and prompt against the
model's own fp16 forward with a KVCache (the reference: tested against transformers elsewhere) on odd shapes
(n_head 1, head_dim 8 to 128, vocabularies that are not a multiple of 8); bit-for-bit invariance over
batches of 1 to 17 rows, 1 to 3 threads and the AVX2 and AVX-512 paths."""

import pytest
import torch
import torch.nn.functional as F

from conftest import small_model, stepwise_logits

from gpt2mha import GPT2, KVCache
from gpt2mha.inference import dense, native
from gpt2mha.inference.decoders import NATIVE, choose_decoder
from gpt2mha.inference.native import NativeStep, native_step
from gpt2mha.inference.quant import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")

FP16_ULP = 2.0 ** -10                                   # fp16's relative step (11-bit significand)


def _model(n_embd=64, n_head=4, n_vocab=97, n_layer=2, n_ctx=64, seed=0):
    # LayerNorm gains and biases moved further than init's (conftest.small_model), in fp16
    return small_model(seed, scale=0.3, n_embd=n_embd, n_head=n_head, n_vocab=n_vocab, n_layer=n_layer,
                       n_ctx=n_ctx).to(torch.float16)


def _cache(model, B, T_max=40):
    c = model.config
    return KVCache(c.n_layer, B, c.n_head, T_max, c.n_embd // c.n_head, dtype=torch.float16)


def _rows(cache, idx):
    L, _, h, T, hd = cache.k.shape
    copy = KVCache(L, len(idx), h, T, hd, dtype=cache.k.dtype)
    for i, b in enumerate(idx):
        copy.load(i, cache, b)
    return copy


# ---- the products ----

@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (8, 64, 96), (3, 24, 40), (17, 8, 7), (5, 137, 1001), (9, 13, 33),
                                   (12, 40, 70), (70, 33, 65), (64, 96, 32)])   # tiles of 8 and the rest; prompts; odd K, N
def test_fp16_products_are_the_float32_sums_rounded_once_and_each_row_is_its_own(M, K, N, both_paths):
    torch.manual_seed(M + K + N)
    x, w, b = torch.randn(M, K), torch.randn(K, N).half(), torch.randn(N).half().float()
    wt = torch.randn(N, K).half()
    x16 = x.half().float()                                            # what a fp16 model's product takes
    for conv, gelu, lin in both_paths(lambda: (dense.conv1d(x, w, b), dense.conv1d(x, w, b, gelu=True), dense.linear(x, wt, b))):
        assert torch.equal(conv.half().float(), conv)                 # fp16 values
        # the float32 products over the weights' exact values, rounded once (the documented definition)
        assert torch.equal(conv, dense.conv1d(x16, w.float(), b).half().float())
        assert torch.equal(lin, dense.linear(x16, wt.float(), b))
        # torch's fp16 GEMM: float32 sums (in MKL's order) rounded once: the same fp16 value but at ties of
        # rounding, never more than one step apart; float64's exact sums bound both
        torch_gemm = torch.addmm(b.half(), x.half(), w).float()
        assert (conv == torch_gemm).float().mean() > 0.99
        assert ((conv - torch_gemm).abs() <= FP16_ULP * torch_gemm.abs() + 2 ** -24).all()
        exact = x16.double() @ wt.double().t() + b.double()
        assert (lin.double() - exact).abs().max() <= 1e-6 * ((x16.double().abs() @ wt.double().abs().t()).max() + b.abs().max())
        want = F.gelu(conv.half(), approximate="tanh").float()
        assert torch.equal(gelu.half().float(), gelu)
        torch.testing.assert_close(gelu, want, rtol=2 * FP16_ULP, atol=1e-6)
        for m in range(M):                                            # the same bits alone as in the batch
            assert torch.equal(dense.conv1d(x[m:m + 1], w, b)[0], conv[m])
            assert torch.equal(dense.linear(x[m:m + 1], wt, b)[0], lin[m])
    wide, narrow = both_paths(lambda: (dense.conv1d(x, w, b, gelu=True), dense.linear(x, wt)))
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])   # AVX-512 = AVX2, bit for bit


def test_fp16_products_round_to_inf_past_fp16s_range_as_torch():
    # 300 * 300 = 90000 > 65504: a fp16 model's GEMM gives inf there; so does conv1d_f16 (and linear stays float32)
    x, w = torch.tensor([[300.0, 1.0]]), torch.tensor([[300.0], [0.5]]).half()
    assert dense.conv1d(x, w).item() == torch.addmm(torch.zeros(1).half(), x.half(), w).item() == float("inf")
    assert dense.linear(x, w.t().contiguous()).item() == 90000.5


def test_the_wrappers_take_fp16_weights_and_name_what_does_not_fit():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be a contiguous float32, bfloat16 or float16 CPU tensor \[K, N\]"):
        dense.conv1d(x, torch.randn(8, 5).double())
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 CPU tensor \[N=5\]"):
        dense.conv1d(x, torch.randn(8, 5).half(), torch.randn(5).half())
    with pytest.raises(RuntimeError, match=r"conv1d_f16: weight must be a contiguous float16 CPU tensor \[K=8, N\]"):
        torch.ops.gpt2mha.conv1d_f16(x, torch.randn(7, 5).half(), None)
    with pytest.raises(RuntimeError, match=r"linear_f16: weight must be a contiguous float16 CPU tensor \[N, K=8\]"):
        torch.ops.gpt2mha.linear_f16(x, torch.randn(8, 5).half(), None)


# ---- the step ----

@pytest.mark.parametrize("n_embd,n_head,n_vocab", [(64, 4, 97), (8, 1, 37), (128, 1, 50), (256, 2, 1001), (96, 12, 61)])
def test_fp16_steps_keep_to_the_models_own_fp16_forward(n_embd, n_head, n_vocab):
    # head_dim 16, 8, 128, 128, 8. The same roundings at the same points as the model's own fp16 forward;
    # sums in other orders now and then round to the neighbouring fp16 value, which later layers carry
    model = _model(n_embd, n_head, n_vocab)
    assert native.why_not(model) == "" and isinstance(native_step(model), NativeStep)
    gen = torch.Generator().manual_seed(1)
    ours = _cache(model, 3)
    with torch.inference_mode():
        for b, n in enumerate([5, 1, 12]):
            model(torch.randint(0, n_vocab, (1, n), generator=gen), cache=ours.row(b), last_only=True)
        ref = _rows(ours, range(3))
        step = NativeStep(model)
        for _ in range(4):
            token = torch.randint(0, n_vocab, (3, 1), generator=gen)
            want = model(token, cache=ref, last_only=True).logits[:, -1]
            got = step(token, ours)
            assert got.dtype == torch.float32 and got.shape == (3, n_vocab)
            assert (got - want).abs().max() <= 4e-3 * want.abs().max()
    assert ours.k.dtype == torch.float16 and (ours.k == ref.k).float().mean() > 0.95
    assert ((ours.v.float() - ref.v.float()).abs() <= 4 * FP16_ULP * ref.v.float().abs().amax()).all()


@pytest.mark.parametrize("T", [7, 40, 70])
def test_a_fp16_prompt_in_one_call_keeps_to_the_models_prefill(T):
    # 7 and 40 rows: the step's tiles; 70: packed strips (64+ rows); after 9 cached tokens (keys S > T)
    model = _model(n_embd=96, n_head=3, n_vocab=61, n_ctx=96, seed=9)
    gen = torch.Generator().manual_seed(T)
    caches = [_cache(model, 1, 96) for _ in range(2)]
    first, prompt = torch.randint(0, 61, (1, 9), generator=gen), torch.randint(0, 61, (1, T), generator=gen)
    with torch.inference_mode():
        for cache in caches:
            model(first, cache=cache, last_only=True)
        want = model(prompt, cache=caches[0], last_only=True).logits[:, -1]
        got = NativeStep(model)(prompt, caches[1])
    assert (got - want).abs().max() <= 4e-3 * want.abs().max()
    assert caches[1].lengths == [9 + T] and (caches[0].k == caches[1].k).float().mean() > 0.9
    k0, k1 = caches[0].k.float(), caches[1].k.float()
    assert ((k0 - k1).abs() <= 4 * FP16_ULP * k0.abs().amax()).all()


@pytest.mark.parametrize("n_threads", [1, 3])
def test_fp16_rows_are_their_own_in_batches_of_1_to_17_on_any_number_of_threads(n_threads, threads, both_paths):
    model = _model(n_embd=128, n_head=2, n_vocab=203, seed=4)
    step = NativeStep(model)
    together = _cache(model, 17)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for b in range(17):
            model(torch.randint(0, 203, (1, 1 + (7 * b) % 23), generator=gen), cache=together.row(b), last_only=True)
        tokens = torch.randint(0, 203, (17, 1), generator=gen)
        threads(1)
        alone = [step(tokens[b:b + 1], _rows(together, [b]))[0] for b in range(17)]
        threads(n_threads)
        for B in (2, 8, 17):
            batch = step(tokens[:B], _rows(together, range(B)))
            assert all(torch.equal(batch[b], alone[b]) for b in range(B)), B
        wide, narrow = both_paths(lambda: step(tokens, _rows(together, range(17))))
    assert torch.equal(wide, narrow)


def test_fp16_on_the_trained_model_is_as_close_to_float32_as_its_own_fp16_forward():
    model32 = GPT2.from_pretrained("shakespeare-byte").eval()
    model = GPT2.from_pretrained("shakespeare-byte").eval().to(torch.float16)
    route = choose_decoder(model)
    assert route.decoder.name == NATIVE and route.decoder.batch_invariant
    assert "prefill: the native forward" in route.describe()
    logits = stepwise_logits(model, model32, NativeStep(model))
    err = {k: ((logits[k] - logits["f32"]).abs().amax(-1) / logits["f32"].abs().amax(-1)).median() for k in ("own", "native")}
    assert err["native"] <= 1.25 * err["own"] and err["own"] < 0.005
    assert (logits["native"].argmax(-1) == logits["own"].argmax(-1)).float().mean() >= 0.97
    idx = torch.tensor([list(b"ROMEO:\nWhat light"), list(b"To be, or not to ")])
    out = model.generate(idx, 30, temperature=0)                     # greedy on it, beside the float32 model's
    assert (out[:, idx.shape[1]:] == model32.generate(idx, 30, temperature=0)[:, idx.shape[1]:]).float().mean() >= 0.9
