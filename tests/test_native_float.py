"""float32 and bf16 on the native forward (kernels/float_products.cpp, bf16_products.cpp, cached_forward.cpp's
float products, inference/dense.py): the products against torch's (the same sums in another order), the one-call
step against the model's own forward with a KVCache (the reference: tested against transformers and
openai/gpt-2 elsewhere) on odd shapes (n_head 1, head_dim 8 to 128, vocabularies that are not a
multiple of 8), batches of 1 to 17 rows, 1 to 3 threads; and bit-for-bit invariance: a row's logits
alone equal its logits in any batch, on any number of threads, on the AVX2 and AVX-512 paths."""

import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from conftest import stepwise_logits

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.inference import dense, native
from gpt2mha.inference.decoders import NATIVE, choose_decoder
from gpt2mha.inference.native import NativeStep, native_step
from gpt2mha.inference.quant import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")


def _model(n_embd=64, n_head=4, n_vocab=97, n_layer=2, n_ctx=64, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_vocab=n_vocab, n_ctx=n_ctx, n_embd=n_embd, n_head=n_head, n_layer=n_layer, tokenizer="bytes")
    model = GPT2(cfg).eval()
    with torch.no_grad():                               # larger LayerNorm gains and biases than init's
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _prefilled(model, lengths, max_len=40, seed=1):
    """A cache whose row b holds lengths[b] tokens of a random prompt, prefilled by the model."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(c.n_layer, len(lengths), c.n_head, max_len, c.n_embd // c.n_head)
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            model(torch.randint(0, c.n_vocab, (1, n), generator=gen), cache=cache.row(b), last_only=True)
    return cache


def _clone(cache, rows=None):
    rows = range(cache.batch_size) if rows is None else rows
    L, _, h, T, hd = cache.k.shape
    copy = KVCache(L, len(rows), h, T, hd)
    for i, b in enumerate(rows):
        copy.load(i, cache, b)
    return copy


def _close(got, want):
    # float32 sums in another order: within ~1e-6 of the logits' scale
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-6 * scale, (got - want).abs().max().item() / scale


# ---- the products ----

@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (8, 768, 768), (3, 8, 7), (17, 24, 40), (5, 136, 1001),
                                   (2, 3072, 768), (9, 13, 33), (16, 64, 129), (8, 517, 100), (1, 517, 100),
                                   (70, 37, 101), (64, 96, 50)])   # prompts (64+ rows): packed strips, part ones
def test_the_products_are_torchs_to_float32_rounding_and_each_row_its_own(M, K, N, both_paths):
    torch.manual_seed(M * K + N)
    x, w, wt, b = torch.randn(M, K), torch.randn(K, N), torch.randn(N, K), torch.randn(N)
    scale = (x.abs() @ w.abs()).max().item() + b.abs().max().item()      # |x| |w|: what rounding is relative to
    for (conv, lin, gelu) in both_paths(lambda: (dense.conv1d(x, w, b), dense.linear(x, wt, b), dense.conv1d(x, w, b, gelu=True))):
        assert (conv - torch.addmm(b, x, w)).abs().max() <= 1e-6 * scale
        assert (lin - F.linear(x, wt, b)).abs().max() <= 1e-6 * ((x.abs() @ wt.abs().t()).max() + b.abs().max())
        torch.testing.assert_close(gelu, F.gelu(torch.addmm(b, x, w), approximate="tanh"), rtol=1e-5, atol=1e-6 * scale)
        for m in range(M):                         # the same bits alone as in the batch
            assert torch.equal(dense.conv1d(x[m:m + 1], w, b)[0], conv[m])
            assert torch.equal(dense.linear(x[m:m + 1], wt, b)[0], lin[m])
    wide, narrow = both_paths(lambda: (dense.conv1d(x, w, b, gelu=True), dense.linear(x, wt)))
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])   # AVX-512 = AVX2, bit for bit


@pytest.mark.parametrize("op", ["conv1d_f32", "conv1d_f16", "conv1d_bf16"])
def test_one_row_on_1_to_3_threads_is_the_batched_rows_bits(op, threads, both_paths):
    # one row (a decode step) takes its own route where it is float32 on AVX-512 (each thread a contiguous
    # span of the columns read as row streams), else walk.h's tiles at one row. Large enough for the
    # threads (K N >= 2^18 multiply-adds), K odd and past two of walk.h's 256-row blocks, N = 1001: the
    # spans end inside a vector; the batch of 9 rows on 1 and 3 threads too.
    torch.manual_seed(11)
    K, N = 701, 1001
    dt = {"conv1d_f32": torch.float32, "conv1d_f16": torch.float16, "conv1d_bf16": torch.bfloat16}[op]
    x, w, b = torch.randn(9, K).to(dt).float(), (torch.randn(K, N) * 0.05).to(dt), torch.randn(N).to(dt).float()
    call = getattr(torch.ops.gpt2mha, op)
    def rows():
        threads(3)
        outs = [call(x, w, b, True)]                   # 9 rows: the tiles
        threads(1)
        batch = call(x, w, b, True)
        for n in (1, 2, 3):
            threads(n)
            outs.append(torch.stack([call(x[m:m + 1], w, b, True)[0] for m in range(9)]))
        return batch, outs
    for batch, outs in both_paths(rows):
        for alone in outs:
            assert torch.equal(alone, batch)           # the same bits on any number of threads
    ref = F.gelu(torch.addmm(b, x, w.float()), approximate="tanh")
    assert (batch - ref).abs().max() <= 0.02 * ref.abs().max()   # dtype's roundings of the same products


def test_the_products_sum_in_order_bias_first():
    # one output of conv1d_f32: bias, then + x[k] w[k] fused, k = 0, 1, ... (float64 holds each fused step exactly
    # before its one rounding); linear_f32: 16 lanes, then the fixed tree
    torch.manual_seed(3)
    x, w, b = torch.randn(1, 40), torch.randn(40, 1), torch.randn(1)
    acc = b[0]
    for k in range(40):
        acc = (acc.double() + x[0, k].double() * w[k, 0].double()).float()
    assert dense.conv1d(x, w, b)[0, 0] == acc
    lanes = torch.zeros(16)
    for k in range(40):
        lanes[k % 16] = (lanes[k % 16].double() + x[0, k].double() * w[k, 0].double()).float()
    t = lanes[:8] + lanes[8:]
    t = t[:4] + t[4:]
    t = t[:2] + t[2:]
    assert dense.linear(x, w.t().contiguous())[0, 0] == t[0] + t[1]


def test_the_wrappers_name_what_does_not_fit():
    x, w = torch.randn(2, 8), torch.randn(8, 5)
    with pytest.raises(ValueError, match=r"x must be a non-empty float32 CPU tensor \[M, K\]; got torch.float64"):
        dense.conv1d(x.double(), w)
    with pytest.raises(ValueError, match=r"x must be a non-empty"):
        dense.conv1d(torch.randn(0, 8), w)
    with pytest.raises(ValueError, match=r"weight must be a contiguous float32, bfloat16 or float16 CPU tensor \[K, N\] with K=8"):
        dense.conv1d(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"\(not contiguous\)"):
        dense.conv1d(x, torch.randn(5, 8).t())
    with pytest.raises(ValueError, match=r"weight must be a contiguous float32, bfloat16 or float16 CPU tensor \[N, K\] with K=8"):
        dense.linear(x, w)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 CPU tensor \[N=5\]"):
        dense.conv1d(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="x requires grad"):
        dense.linear(x.requires_grad_(), w.t().contiguous())
    with pytest.raises(RuntimeError, match=r"conv1d_f32: weight must be a contiguous float32 CPU tensor \[K=8, N\]"):
        torch.ops.gpt2mha.conv1d_f32(torch.randn(2, 8), torch.randn(7, 5), None)     # the operator checks too


# ---- the step ----

SHAPES = pytest.mark.parametrize("n_embd,n_head,n_vocab", [(64, 4, 97), (8, 1, 37), (128, 1, 50), (256, 2, 1001),
                                                          (96, 12, 61)])


@SHAPES
def test_float32_steps_match_the_models_own_steps(n_embd, n_head, n_vocab):
    # head_dim 16, 8, 128, 128, 8; n_head 1; vocabularies of 97, 37, 50, 1001, 61
    model = _model(n_embd, n_head, n_vocab)
    assert native.why_not(model) == "" and isinstance(native_step(model), NativeStep)
    step = NativeStep(model)
    ours = _prefilled(model, [5, 1, 12])
    ref = _clone(ours)
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for _ in range(5):
            token = torch.randint(0, n_vocab, (3, 1), generator=gen)
            want = model(token, cache=ref, last_only=True).logits[:, -1]
            got = step(token, ours)
            assert got.shape == want.shape == (3, n_vocab) and got.dtype == torch.float32
            _close(got, want)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    for b, n in enumerate(ref.lengths):                # the keys and values each step wrote
        _close(ours.k[:, b, :, :n], ref.k[:, b, :, :n])
        _close(ours.v[:, b, :, :n], ref.v[:, b, :, :n])


@pytest.mark.parametrize("start", [0, 9])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_float32_prompt_in_one_call_matches_the_models_prefill(start, n_threads, threads):
    # start 9: a second chunk over cached keys (S > T); 23 and 40 rows: every tile of 8 rows and the rest
    threads(n_threads)
    model = _model(n_embd=96, n_head=3, n_vocab=61, seed=8)
    step = NativeStep(model)
    assert step.prefill is step
    for T in (23, 40):
        ours = _prefilled(model, [start], max_len=64) if start else KVCache(2, 1, 3, 64, 32)
        ref = _clone(ours)
        prompt = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.inference_mode():
            want = model(prompt, cache=ref, last_only=True).logits[:, -1]
            got = step(prompt, ours)
        _close(got, want)
        assert ours.lengths == ref.lengths == [start + T]
        _close(ours.k, ref.k)
        _close(ours.v, ref.v)


@pytest.mark.parametrize("start", [0, 9])
def test_a_batch_of_prompts_gives_each_row_its_last_tokens_logits_and_its_whole_cache(start):
    # the last block runs each row's last token alone (cached_forward.cpp): row b's logits must be its
    # own prompt's, every position's keys and values in the cache the model's; and each row's logits the
    # bits of that row prompted alone (reference: the model's own forward, row by row)
    model = _model(n_embd=96, n_head=3, n_vocab=61, seed=5)
    step = NativeStep(model)
    B, T = 3, 23
    ours = _prefilled(model, [start] * B, max_len=64) if start else KVCache(2, B, 3, 64, 32)
    ref, alone = _clone(ours), [_clone(ours, [b]) for b in range(B)]
    prompt = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = torch.cat([model(prompt[b:b + 1], cache=ref.row(b), last_only=True).logits[:, -1] for b in range(B)])
        got = step(prompt, ours)
        each = [step(prompt[b:b + 1], alone[b])[0] for b in range(B)]
    _close(got, want)
    assert all(torch.equal(got[b], each[b]) for b in range(B))
    assert ours.lengths == [start + T] * B
    _close(ours.k, ref.k)
    _close(ours.v, ref.v)

@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_every_row_is_its_own_in_batches_of_1_to_17_on_any_number_of_threads(n_threads, threads):
    model = _model(n_embd=128, n_head=2, n_vocab=203, seed=4)
    step = NativeStep(model)
    lengths = [1 + (7 * b) % 23 for b in range(17)]
    together = _prefilled(model, lengths)
    tokens = torch.randint(0, 203, (17, 1), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        threads(1)
        alone = [step(tokens[b:b + 1], _clone(together, [b]))[0] for b in range(17)]
        threads(n_threads)
        for B in (1, 2, 8, 17):
            batch = step(tokens[:B], _clone(together, range(B)))
            for b in range(B):
                assert torch.equal(batch[b], alone[b]), (B, b)       # the same bits
        ref = _clone(together)
        _close(torch.stack(alone), model(tokens, cache=ref, last_only=True).logits[:, -1])


def test_the_avx2_path_gives_the_avx512_bits(both_paths):
    model = _model(n_embd=96, n_head=3, n_vocab=77, seed=6)
    cache = _prefilled(model, [4, 9])
    token = torch.tensor([[3], [70]])
    with torch.inference_mode():
        wide, narrow = both_paths(lambda: NativeStep(model)(token, _clone(cache)))
    assert torch.equal(wide, narrow)


def test_generate_runs_float32_models_on_it_with_the_models_greedy_tokens():
    model = GPT2.from_pretrained("shakespeare-byte").eval()
    route = choose_decoder(model)
    assert route.decoder.name == NATIVE and route.decoder.batch_invariant
    assert "prefill: the native forward" in route.describe()
    bf16 = GPT2.from_pretrained("shakespeare-byte").eval().to(torch.bfloat16)
    assert "prefill: the native forward" in choose_decoder(bf16).describe()
    idx = torch.tensor([list(b"ROMEO:\nWhat light"), list(b"To be, or not to ")])
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        out = model.generate(idx, 40, temperature=0)
    assert op.call_count == 2 + 39                                  # each prompt, then the steps
    with mock.patch.object(native, "native_step", lambda m: None):   # the decode view, MKL's products
        assert torch.equal(out, model.generate(idx, 40, temperature=0))


def test_models_the_float32_route_does_not_take_decode_as_before():
    model = _model()
    handle = model.h[0].attn.register_forward_hook(lambda m, i, o: o)
    assert native_step(model) is None and choose_decoder(model).decoder.name != NATIVE
    handle.remove()
    assert isinstance(native_step(model), NativeStep)
    model.h[1].mlp.c_fc.bias = None
    assert native.why_not(model) == "its blocks' layers are not all float32 Conv1Ds with biases"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert native_step(_model().to(torch.float64)) is None
    odd = _model(n_embd=36, n_head=3)                                # head_dim 12
    assert native.why_not(odd) == "head_dim=12 is not a multiple of 8 (the kernels' vectors)"
    with torch.no_grad():
        model = _model()
        kept = native_step(model)
        model.h[0].attn.c_attn.weight.mul_(2)                        # written in place: made again, reads the new
        fresh = native_step(model)
    assert fresh is not kept
    cache = _prefilled(model, [3])
    ref = _clone(cache)
    with torch.inference_mode():
        _close(fresh(torch.tensor([[5]]), cache), model(torch.tensor([[5]]), cache=ref, last_only=True).logits[:, -1])


# ---- bf16 ----

def _bf16_reference(x, w, b):
    """conv1d_bf16's order for every output: bias, then per pair (k, k+1) the odd product then the even one,
    each a fused multiply-add in float32 (vdpbf16ps's order: float64 holds each step exactly before its one
    rounding), then rounded to bf16."""
    xf, wf = x.bfloat16().double(), w.double()
    K = xf.shape[1]
    acc = b.float().expand(xf.shape[0], -1).clone()
    for k in range(0, K, 2):
        if k + 1 < K:
            acc = (acc.double() + xf[:, k + 1:k + 2] * wf[k + 1]).float()
        acc = (acc.double() + xf[:, k:k + 1] * wf[k]).float()
    return acc.bfloat16()


@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (8, 64, 96), (3, 24, 40), (17, 8, 7), (5, 137, 1001), (9, 13, 33),
                                   (8, 517, 100), (1, 517, 100),   # K odd over walk.h's 256-row blocks
                                   (12, 40, 70), (70, 33, 65), (64, 96, 32)])   # tiles of 8+4; prompts: 8s+4+1+1, odd K
def test_bf16_products_sum_in_vdpbf16ps_order_and_each_row_is_its_own(M, K, N, both_paths):
    torch.manual_seed(M + K + N)
    x, w, b = torch.randn(M, K).bfloat16().float(), torch.randn(K, N).bfloat16(), torch.randn(N).bfloat16().float()
    wt = torch.randn(N, K).bfloat16()
    for conv, gelu, lin in both_paths(lambda: (dense.conv1d(x, w, b), dense.conv1d(x, w, b, gelu=True), dense.linear(x, wt))):
        assert torch.equal(conv.bfloat16().float(), conv)                # bf16 values
        assert torch.equal(conv.bfloat16(), _bf16_reference(x, w, b))
        assert (conv.bfloat16() == torch.addmm(b.bfloat16(), x.bfloat16(), w)).float().mean() > 0.99   # torch's GEMM
        want = F.gelu(conv.bfloat16(), approximate="tanh").float()
        torch.testing.assert_close(gelu, want, rtol=2 ** -7, atol=1e-6)  # torch's tanh form loses the far negative tail
        exact = x.double() @ wt.double().t()
        assert (lin.double() - exact).abs().max() <= 1e-6 * (x.double().abs() @ wt.double().abs().t()).max()
        for m in range(M):
            assert torch.equal(dense.conv1d(x[m:m + 1], w, b)[0], conv[m])
            assert torch.equal(dense.linear(x[m:m + 1], wt)[0], lin[m])
    wide, narrow = both_paths(lambda: (dense.conv1d(x, w, b, gelu=True), dense.linear(x, wt)))
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])   # vdpbf16ps = its adds on AVX2


def test_bf16_products_fuse_each_step_where_a_product_overflows(both_paths):
    # 3e38 * 2 overflows float32 alone; fused with the bias it is 3e38: both paths fuse, as vdpbf16ps does
    # (a break-it review found the AVX2 path rounding the product first: inf there, 3.0e38 here)
    x, b = torch.tensor([[3e38, 3e38]]), torch.tensor([-3e38])
    w = torch.tensor([[2.0], [0.0]]).bfloat16()
    pair = torch.tensor([[2.0], [-2.0]]).bfloat16()
    for conv, two, lin in both_paths(lambda: (dense.conv1d(x, w, b), dense.conv1d(x, pair), dense.linear(x, pair.t().contiguous()))):
        assert torch.equal(conv, _bf16_reference(x, w, b).float()) and conv.isfinite().all()
        assert two.item() == float("-inf") and lin.item() == float("-inf")    # fma(3e38, 2, -inf): -inf, not nan


@pytest.mark.parametrize("n_embd,n_head,n_vocab", [(64, 4, 97), (8, 1, 37), (256, 2, 1001), (96, 12, 61)])
def test_bf16_steps_keep_to_the_models_own_bf16_forward(n_embd, n_head, n_vocab):
    # the same roundings at the same points; sums in other orders now and then round to the neighbouring bf16 value
    model = _model(n_embd, n_head, n_vocab).to(torch.bfloat16)
    assert native.why_not(model) == "" and isinstance(native_step(model), NativeStep)
    c = model.config
    gen = torch.Generator().manual_seed(1)
    ours = KVCache(c.n_layer, 3, c.n_head, 40, c.n_embd // c.n_head, dtype=torch.bfloat16)
    with torch.inference_mode():
        for b, n in enumerate([5, 1, 12]):
            model(torch.randint(0, n_vocab, (1, n), generator=gen), cache=ours.row(b), last_only=True)
        ref = KVCache(c.n_layer, 3, c.n_head, 40, c.n_embd // c.n_head, dtype=torch.bfloat16)
        for b in range(3):
            ref.load(b, ours, b)
        step = NativeStep(model)
        for _ in range(4):
            token = torch.randint(0, n_vocab, (3, 1), generator=gen)
            want = model(token, cache=ref, last_only=True).logits[:, -1]
            got = step(token, ours)
            assert got.dtype == torch.float32
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert ours.k.dtype == torch.bfloat16 and (ours.k == ref.k).float().mean() > 0.9


def test_bf16_on_the_trained_model_is_as_close_to_float32_as_its_own_bf16_forward():
    model32 = GPT2.from_pretrained("shakespeare-byte").eval()
    model = GPT2.from_pretrained("shakespeare-byte").eval().to(torch.bfloat16)
    assert choose_decoder(model).decoder.name == NATIVE
    logits = stepwise_logits(model, model32, NativeStep(model))
    err = {k: ((logits[k] - logits["f32"]).abs().amax(-1) / logits["f32"].abs().amax(-1)).median() for k in ("own", "native")}
    assert err["native"] <= 1.25 * err["own"] and err["own"] < 0.02
    top1 = (logits["native"].argmax(-1) == logits["own"].argmax(-1)).float().mean()
    assert top1 >= 0.95


@pytest.mark.parametrize("T", [7, 40])
def test_a_bf16_prompt_in_one_call_keeps_to_the_models_prefill(T):
    # 7 rows: conv1d_bf16; 40: oneDNN's GEMM (torch's addmm, the model's own); start 9: over cached keys
    model = _model(n_embd=96, n_head=3, n_vocab=61, seed=9).to(torch.bfloat16)
    c = model.config
    gen = torch.Generator().manual_seed(T)
    caches = [KVCache(c.n_layer, 1, c.n_head, 64, 32, dtype=torch.bfloat16) for _ in range(2)]
    first, prompt = torch.randint(0, 61, (1, 9), generator=gen), torch.randint(0, 61, (1, T), generator=gen)
    with torch.inference_mode():
        for cache in caches:
            model(first, cache=cache, last_only=True)
        want = model(prompt, cache=caches[0], last_only=True).logits[:, -1]
        got = NativeStep(model)(prompt, caches[1])
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert caches[1].lengths == [9 + T] and (caches[0].k == caches[1].k).float().mean() > 0.9


@pytest.mark.parametrize("n_threads", [1, 3])
def test_bf16_rows_are_their_own_in_batches_of_1_to_17_on_any_number_of_threads(n_threads, threads, both_paths):
    model = _model(n_embd=128, n_head=2, n_vocab=203, seed=4).to(torch.bfloat16)
    step = NativeStep(model)
    c = model.config
    together = KVCache(c.n_layer, 17, c.n_head, 40, c.n_embd // c.n_head, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for b in range(17):
            model(torch.randint(0, 203, (1, 1 + (7 * b) % 23), generator=gen), cache=together.row(b), last_only=True)

    def rows(idx):
        copy = KVCache(c.n_layer, len(idx), c.n_head, 40, c.n_embd // c.n_head, dtype=torch.bfloat16)
        for i, b in enumerate(idx):
            copy.load(i, together, b)
        return copy
    tokens = torch.randint(0, 203, (17, 1), generator=gen)
    with torch.inference_mode():
        threads(1)
        alone = [step(tokens[b:b + 1], rows([b]))[0] for b in range(17)]
        threads(n_threads)
        for B in (2, 8, 17):
            batch = step(tokens[:B], rows(range(B)))
            assert all(torch.equal(batch[b], alone[b]) for b in range(B))
        wide, narrow = both_paths(lambda: step(tokens, rows(range(17))))
    assert torch.equal(wide, narrow)
