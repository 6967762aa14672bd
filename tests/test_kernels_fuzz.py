"""A seeded random sweep of every kernel against a PyTorch reference: shapes (ragged K and N, 1
to 20 rows), group sizes, bias or none, thread counts 1 to 4, the paths of any subset of the CPU's
features (AVX2 alone, AVX-512 without VNNI, ...), batch
rows against each row alone, cache lengths; and tampered arguments (dtypes, shapes, strides,
NaN/inf scales, empty tensors, group sizes that do not divide), each refused by name before the
kernel reads anything. CI runs it twice: in the suite, and under AddressSanitizer and
UndefinedBehaviorSanitizer (.ci/sanitize, more cases), where a read out of bounds stops the run.

``GPT2MHA_FUZZ_CASES`` (default 30) sets the cases per operator, ``GPT2MHA_FUZZ_SEED`` (default
40) the seed; a failure names its case's seed and sizes, to run it again alone.
"""

import os
import random
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

from gpt2mha import attention_mask
from gpt2mha.inference.quant import gemv
from gpt2mha.inference.quant.linear import int8_matmul_per_row
from gpt2mha.inference.quant.schemes import pack_int4, quantize_int4
from gpt2mha.kernels import dispatch

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")

CASES = int(os.environ.get("GPT2MHA_FUZZ_CASES", "30"))
SEED = int(os.environ.get("GPT2MHA_FUZZ_SEED", "40"))
CPU = sorted(dispatch.cpu())


def _sweep(op: str):
    """(case seed, its random.Random, a torch.Generator) for each case of ``op``, each run with a
    random thread count and, on AVX-512 CPUs, the paths of a random subset of the CPU's features;
    the process's settings restored after."""
    threads, allowed = torch.get_num_threads(), dispatch.allowed()
    try:
        for i in range(CASES):
            seed = zlib.crc32(f"{SEED}/{op}/{i}".encode())
            r = random.Random(seed)
            torch.set_num_threads(r.randint(1, 4))
            if CPU:
                dispatch.allow([f for f in CPU if r.random() < 0.5])
            yield seed, r, torch.Generator().manual_seed(seed)
    finally:
        torch.set_num_threads(threads)
        dispatch.allow(allowed)


def _rows_alone(fn, x, y, r, what):
    i = r.randrange(x.shape[0])                                  # a row alone: the same bits as in the batch
    assert torch.equal(fn(x[i:i + 1])[0], y[i]), f"{what}: row {i} alone differs from the batch"


def test_int8_gemv_sweep():
    for seed, r, g in _sweep("int8_gemv"):
        M, K, N = r.randint(1, 17), r.randint(1, 320), r.randint(1, 80)
        x = torch.randn(M, K, generator=g) * 2
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
        s = torch.rand(N, generator=g) * 0.02 + 1e-3
        b = torch.randn(N, generator=g) if r.random() < 0.5 else None
        what = f"seed {seed}: M={M} K={K} N={N} bias={b is not None}"
        y = gemv.int8_gemv(x, q, s, b)
        w = q.double() * s.double()[:, None]
        ref = x.double() @ w.t() + (0 if b is None else b.double())
        bound = (K / 32 + 8) * 2.0 ** -24 * (x.double().abs() @ w.abs().t() + (0 if b is None else b.double().abs()))
        assert ((y.double() - ref).abs() <= bound + 1e-30).all(), what
        _rows_alone(lambda v: gemv.int8_gemv(v, q, s, b), x, y, r, what)


def _int4_case(r, g, groups, per_k):
    G = r.choice(groups)
    K, N, M = G * r.randint(1, max(1, per_k // G)), r.randint(1, 80), r.randint(1, 17)
    x = torch.randn(M, K, generator=g) * 2
    q, scale_zero = quantize_int4(torch.randn(N, K, generator=g) * 0.05 + 0.01, G)
    b = torch.randn(N, generator=g) if r.random() < 0.5 else None
    sz = scale_zero.double().transpose(0, 1).repeat_interleave(G, dim=1)          # [N, K, 2]
    w = (q.double() - 8) * sz[..., 0] + sz[..., 1]
    terms = sz[..., 0] * q.double() + (sz[..., 1] - 8 * sz[..., 0]).abs()         # the kernel's two sums per group
    return M, K, N, G, x, pack_int4(q), scale_zero.transpose(0, 1).contiguous(), b, w, terms


def test_int4_exact_sweep():
    for seed, r, g in _sweep("int4_gemv"):
        M, K, N, G, x, packed, sz, b, w, terms = _int4_case(r, g, (16, 32, 48, 64, 128, 256), 640)
        what = f"seed {seed}: M={M} K={K} N={N} G={G} bias={b is not None}"
        y = gemv.int4_gemv(x, packed, sz, G, b)
        ref = x.double() @ w.t() + (0 if b is None else b.double())
        bound = (K / 8 + 16) * 2.0 ** -24 * (x.double().abs() @ terms.t() + (0 if b is None else b.double().abs()))
        assert ((y.double() - ref).abs() <= bound + 1e-30).all(), what
        _rows_alone(lambda v: gemv.int4_gemv(v, packed, sz, G, b), x, y, r, what)


def test_int4_per_block_sweep():
    for seed, r, g in _sweep("int4_gemv_a8"):
        M, K, N, G, x, packed, sz, b, w, terms = _int4_case(r, g, (32, 64, 96, 128, 256, 384), 800)
        what = f"seed {seed}: M={M} K={K} N={N} G={G} bias={b is not None}"
        if r.random() < 0.3:
            x[0, :G] = 0.0                                                  # an all-zero group: d = 0
        y = gemv.int4_gemv(x, packed, sz, G, b, activations="per_block")
        xg = x.view(M, K // G, G)                                           # W4A8 written out (test_gemv.py)
        amax = xg.abs().amax(-1, keepdim=True)
        # 127 / amax as one float32 division, as the kernel divides (torch's 127.0 / t is 127 · (1 / t):
        # an ulp apart now and then, enough to move an activation off a rounding tie)
        a = torch.round(xg * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
        xq = (a.double() * (amax / 127.0).double()).view(M, K)
        ref = xq @ w.t() + (0 if b is None else b.double())
        bound = (K / 8 + 16) * 2.0 ** -24 * (xq.abs() @ terms.t() + (0 if b is None else b.double().abs()))
        assert ((y.double() - ref).abs() <= bound + 1e-30).all(), what
        _rows_alone(lambda v: gemv.int4_gemv(v, packed, sz, G, b, activations="per_block"), x, y, r, what)


def test_int8_per_row_sweep():
    for seed, r, g in _sweep("int8_per_row"):
        M, K, N = r.randint(1, 20), r.randint(1, 300), r.randint(1, 80)
        x = torch.randn(M, K, generator=g) * 3
        q7 = torch.randint(-63, 64, (N, K), dtype=torch.int8, generator=g)
        s7 = torch.rand(N, generator=g) * 0.01 + 1e-4
        args = (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), s7, (q7.float() * s7[:, None]).sum(1))
        b = torch.randn(N, generator=g) if r.random() < 0.5 else None
        what = f"seed {seed}: M={M} K={K} N={N} bias={b is not None}"
        y = gemv.int8_per_row(x, *args, b)
        want = int8_matmul_per_row(x, q7, s7) + (0 if b is None else b)
        assert (y - want).abs().max() <= 1e-6 * max(want.abs().max().item(), 1.0), what
        _rows_alone(lambda v: gemv.int8_per_row(v, *args, b), x, y, r, what)
        fused = gemv.int8_per_row(x, *args, b, gelu=True)
        assert (fused - F.gelu(y, approximate="tanh")).abs().max() <= 1e-6 * max(y.abs().max().item(), 1.0), what


def _within_float32(y, x, w, b, what):
    """y = x @ w + b (w [K, N]) within float32 summation's rounding of the float64 product: (K + 8) units
    of 2^-24 relative to |x| @ |w| + |b|, whatever the order."""
    ref = x.double() @ w.double() + (0 if b is None else b.double())
    bound = (x.shape[1] + 8) * 2.0 ** -24 * (x.double().abs() @ w.double().abs() + (0 if b is None else b.double().abs()))
    assert ((y.double() - ref).abs() <= bound + 1e-30).all(), what


@pytest.mark.parametrize("op", ["conv1d_f32", "linear_f32"])
def test_float32_products_sweep(op):
    # inference/dense.py's operators: x @ W + b in GPT-2's Conv1D layout ([K, N]) or F.linear's ([N, K])
    from gpt2mha.inference import dense
    for seed, r, g in _sweep(op):                                # up to 80 rows: conv1d_f32's prompt path from 64
        M, K, N = r.choice((r.randint(1, 17), r.randint(1, 80))), r.randint(1, 300), r.randint(1, 80)
        x = torch.randn(M, K, generator=g)
        w = torch.randn(K, N, generator=g) * 0.1
        b = torch.randn(N, generator=g) if r.random() < 0.5 else None
        what = f"seed {seed}: M={M} K={K} N={N} bias={b is not None}"
        if op == "conv1d_f32":
            call = lambda v, gelu=False: dense.conv1d(v, w, b, gelu=gelu)          # noqa: E731
        else:
            wt = w.t().contiguous()
            call = lambda v, gelu=False: dense.linear(v, wt, b)                     # noqa: E731
        y = call(x)
        _within_float32(y, x, w, b, what)
        _rows_alone(call, x, y, r, what)
        if op == "conv1d_f32":
            fused = call(x, gelu=True)
            assert (fused - F.gelu(y, approximate="tanh")).abs().max() <= 1e-6 * max(y.abs().max().item(), 1.0), what


@pytest.mark.parametrize("op", ["conv1d_bf16", "linear_bf16"])
def test_bf16_products_sweep(op):
    # bf16 weights, up to 80 rows (conv1d_bf16's packed-strip prompt path from 64), odd K, part tiles;
    # reference: conv1d_bf16's documented order (bias, then per pair k, k+1 the odd product then the
    # even one, each a fused multiply-add), rounded to bf16; linear_bf16 within float32 rounding
    from gpt2mha.inference import dense
    for seed, r, g in _sweep(op):
        M, K, N = r.randint(1, 80), r.randint(1, 200), r.randint(1, 80)
        x = torch.randn(M, K, generator=g).bfloat16().float()
        w = torch.randn(K, N, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16().float() if r.random() < 0.5 else None
        what = f"seed {seed}: M={M} K={K} N={N} bias={b is not None}"
        if op == "conv1d_bf16":
            call = lambda v, gelu=False: dense.conv1d(v, w, b, gelu=gelu)          # noqa: E731
            y = call(x)
            xf, wf = x.double(), w.double()                   # each step fused: exact in float64, rounded once
            acc = (torch.zeros(N) if b is None else b).expand(M, -1).clone()
            for k in range(0, K, 2):
                if k + 1 < K:
                    acc = (acc.double() + xf[:, k + 1:k + 2] * wf[k + 1]).float()
                acc = (acc.double() + xf[:, k:k + 1] * wf[k]).float()
            assert torch.equal(y, acc.bfloat16().float()), what
            fused = call(x, gelu=True)
            want = F.gelu(y.bfloat16(), approximate="tanh").float()
            assert torch.allclose(fused, want, rtol=2 ** -7, atol=1e-6), what
        else:
            wt = w.t().contiguous()
            call = lambda v, gelu=False: dense.linear(v, wt, b)                     # noqa: E731
            y = call(x)
            _within_float32(y, x, w, b, what)
        _rows_alone(call, x, y, r, what)


@pytest.mark.parametrize("op", ["conv1d_f16", "linear_f16"])
def test_fp16_products_sweep(op):
    # fp16 weights, up to 80 rows (the packed-strip prompt path from 64), odd K, part tiles; x rounded to fp16
    # by the operator. Reference: float64's exact sums of the fp16 values; conv1d_f16 rounds its float32 sum
    # (within float32's rounding of them) to fp16 once, so it is one of the two fp16 values around that sum
    from gpt2mha.inference import dense
    for seed, r, g in _sweep(op):
        M, K, N = r.randint(1, 80), r.randint(1, 200), r.randint(1, 80)
        x = torch.randn(M, K, generator=g)
        w = (torch.randn(K, N, generator=g) * 0.3).half()
        b = torch.randn(N, generator=g).half().float() if r.random() < 0.5 else None
        what = f"seed {seed}: M={M} K={K} N={N} bias={b is not None}"
        x16 = x.half().float()
        if op == "conv1d_f16":
            call = lambda v, gelu=False: dense.conv1d(v, w, b, gelu=gelu)          # noqa: E731
            y = call(x)
            assert torch.equal(y.half().float(), y), what
            ref = x16.double() @ w.double() + (0 if b is None else b.double())
            bound = (K + 8) * 2.0 ** -24 * (x16.double().abs() @ w.double().abs() + (0 if b is None else b.double().abs()))
            step = 2.0 ** -10 * ref.abs() + 2.0 ** -24               # one fp16 step (subnormals: 2^-24)
            assert ((y.double() - ref).abs() <= bound + step).all(), what
            fused = call(x, gelu=True)
            want = F.gelu(y.half(), approximate="tanh").float()
            assert torch.allclose(fused, want, rtol=2 ** -9, atol=1e-6), what
        else:
            wt = w.t().contiguous()
            call = lambda v, gelu=False: dense.linear(v, wt, b)                     # noqa: E731
            y = call(x)
            _within_float32(y, x16, w, b, what)
        _rows_alone(call, x, y, r, what)


def test_causal_attention_sweep():
    for seed, r, g in _sweep("causal_attention"):
        B, h, T, D = r.randint(1, 3), r.randint(1, 4), r.randint(2, 48), r.choice((8, 16, 24, 32, 40, 64))
        S = T + r.randint(0, 20)
        what = f"seed {seed}: B={B} h={h} T={T} S={S} D={D}"
        if r.random() < 0.5:                                     # as attention splits c_attn's output: strided
            q = torch.randn(B, T, 3 * h * D, generator=g)[..., :h * D].view(B, T, h, D).transpose(1, 2)
        else:
            q = torch.randn(B, h, T, D, generator=g)
        k, v = torch.randn(B, h, S, D, generator=g), torch.randn(B, h, S, D, generator=g)
        o = torch.ops.gpt2mha.causal_attention(q, k, v)
        w = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5
        ref = w.masked_fill(~attention_mask(T, S), float("-inf")).softmax(-1) @ v.double()
        assert o.shape == (B, h, T, D) and (o.double() - ref).abs().max() <= 2e-6 * ref.abs().max(), what
        b = r.randrange(B)
        assert torch.equal(torch.ops.gpt2mha.causal_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0], o[b]), what


def test_causal_attention_bf16_sweep():
    # reference: float64 attention over the bf16-rounded q, k, v with each query's exps rounded to
    # bf16 before p v (tests/test_attention_bf16.py says why the tolerance); a row alone, the last
    # query alone: the same bits
    from gpt2mha.inference.dense import has_bf16_dot
    for seed, r, g in _sweep("causal_attention_bf16"):
        if not has_bf16_dot():                                   # no AVX-512 BF16, or not in the sweep's features
            with pytest.raises(RuntimeError, match="needs a CPU with AVX-512 and AVX-512 BF16, both allowed"):
                torch.ops.gpt2mha.causal_attention_bf16(*(torch.randn(1, 1, 2, 8, generator=g) for _ in range(3)))
            continue
        B, h, T, D = r.randint(1, 3), r.randint(1, 4), r.randint(1, 48), r.choice((8, 16, 24, 32, 40, 64, 128))
        S = T + r.randint(0, 21)
        what = f"seed {seed}: B={B} h={h} T={T} S={S} D={D}"
        if r.random() < 0.5:
            q = torch.randn(B, T, 3 * h * D, generator=g)[..., :h * D].view(B, T, h, D).transpose(1, 2)
        else:
            q = torch.randn(B, h, T, D, generator=g)
        k, v = torch.randn(B, h, S, D, generator=g), torch.randn(B, h, S, D, generator=g)
        o = torch.ops.gpt2mha.causal_attention_bf16(q, k, v)
        qb, kb, vb = (t.bfloat16().double() for t in (q, k, v))
        w = ((qb @ kb.transpose(-1, -2)) / D ** 0.5).masked_fill(~attention_mask(T, S), float("-inf"))
        e = torch.exp(w - w.amax(-1, keepdim=True))
        ref = (e.float().bfloat16().double() @ vb) / e.sum(-1, keepdim=True)
        assert o.shape == (B, h, T, D) and (o.double() - ref).abs().max() <= 2e-3, what
        b = r.randrange(B)
        assert torch.equal(torch.ops.gpt2mha.causal_attention_bf16(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0], o[b]), what
        assert torch.equal(torch.ops.gpt2mha.causal_attention_bf16(q[:, :, -1:], k, v), o[:, :, -1:]), what


@pytest.fixture(scope="module")
def native_models():
    """Small int4 per_block and int8 per_row models (head_dim 16 and 8) for the one-call forward."""
    from gpt2mha import GPT2, GPT2Config
    models = []
    for kind, n_head in (("per_block", 4), ("per_row", 8)):
        torch.manual_seed(len(models))
        model = GPT2(GPT2Config(n_vocab=96, n_ctx=48, n_embd=64, n_head=n_head, n_layer=2, tokenizer="bytes")).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "per_row":
                models.append(model.quantize("int8", method="rtn", activations="per_row"))
            else:
                models.append(model.quantize("int4", method="rtn", group_size=32, activations="per_block"))
    return models


def test_one_call_forward_sweep(native_models):
    # rows of different lengths, then decode steps: the model's own steps to within the products'
    # 8-bit rounding of activations (a rounding step now and then), each row's logits its own
    from gpt2mha.core.kv_cache import KVCache
    from gpt2mha.inference.native import NativeStep
    for seed, r, g in _sweep("cached_forward"):
        model = r.choice(native_models)
        c, step = model.config, NativeStep(model)
        lengths = [r.randint(1, 30) for _ in range(r.randint(1, 3))]
        what = f"seed {seed}: {model.quantization['scheme']} lengths={lengths}"
        ours = KVCache(c.n_layer, len(lengths), c.n_head, 40, c.n_embd // c.n_head)
        ref = KVCache(c.n_layer, len(lengths), c.n_head, 40, c.n_embd // c.n_head)
        with torch.inference_mode():
            for b, n in enumerate(lengths):
                prompt = torch.randint(0, c.n_vocab, (1, n), generator=g)
                for cache in (ours, ref):
                    model(prompt, cache=cache.row(b), last_only=True)
            for _ in range(r.randint(1, 3)):
                token = torch.randint(0, c.n_vocab, (len(lengths), 1), generator=g)
                want = model(token, cache=ref, last_only=True).logits[:, -1]
                got = step(token, ours)
                assert (got - want).abs().max() <= 2e-2 * want.abs().max(), what
                assert ours.lengths == ref.lengths, what


# --- tampered arguments: a named error, never a read ---

def _valid(kind, g):
    x = torch.randn(3, 64, generator=g)
    if kind == "int8":
        return x, torch.randint(-127, 128, (20, 64), dtype=torch.int8, generator=g), torch.rand(20, generator=g) + 0.01
    if kind == "per_row":
        q7 = torch.randint(-63, 64, (20, 64), dtype=torch.int8, generator=g)
        s = torch.rand(20, generator=g) + 0.01
        return x, gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), s, (q7.float() * s[:, None]).sum(1)
    q, scale_zero = quantize_int4(torch.randn(20, 64, generator=g), 32)
    return x, pack_int4(q), scale_zero.transpose(0, 1).contiguous()


def _call(kind, args, G=32):
    if kind == "int8":
        return gemv.int8_gemv(*args)
    if kind == "per_row":
        return gemv.int8_per_row(*args)
    return gemv.int4_gemv(*args, G, activations=kind)


def _tamper(arg: torch.Tensor, how: str) -> torch.Tensor:
    if how == "dtype":
        return arg.double() if arg.is_floating_point() else arg.to(torch.int16)
    if how == "shape":
        return arg[..., :-1].contiguous() if arg.dim() > 1 else arg[:-1].contiguous()
    if how == "strides":
        return arg.repeat_interleave(2, dim=-1)[..., ::2]                   # the same values, not contiguous
    if how == "nan":
        bad = arg.clone()
        bad.view(-1)[1] = float("nan")
        return bad
    if how == "inf":
        bad = arg.clone()
        bad.view(-1)[0] = float("inf")
        return bad
    return arg[:0] if arg.dim() == 1 else arg[:, :0]                         # empty


TAMPERED = [("int8", 0, "dtype", "x must be a float32"), ("int8", 0, "empty", "x is empty"),
            ("int8", 1, "shape", "weight must be a contiguous int8"), ("int8", 1, "strides", "weight must be a contiguous"),
            ("int8", 1, "dtype", "weight must be a contiguous int8"), ("int8", 2, "nan", "scales holds NaN or ±inf"),
            ("int8", 2, "inf", "scales holds NaN or ±inf"), ("int8", 2, "shape", "scales must be a contiguous float32"),
            ("int8", 2, "strides", "scales must be a contiguous"),
            ("exact", 0, "empty", "x is empty"), ("exact", 1, "shape", "weight must be a contiguous uint8"),
            ("exact", 1, "strides", "weight must be a contiguous uint8"),
            ("exact", 2, "nan", "scale_zero holds NaN or ±inf"), ("exact", 2, "dtype", "scale_zero must be"),
            ("per_block", 2, "inf", "scale_zero holds NaN or ±inf"), ("per_block", 2, "strides", "scale_zero must be"),
            ("per_row", 0, "empty", "x is empty"), ("per_row", 0, "dtype", "x must be a float32"),
            ("per_row", 3, "nan", "scales7 holds NaN or ±inf"), ("per_row", 4, "inf", "wsum holds NaN or ±inf"),
            ("per_row", 1, "strides", "packed must be a contiguous int8"),
            ("per_row", 2, "shape", r"scales must be a contiguous float32 CPU tensor \[N=19\]"), ("per_row", 3, "dtype", "scales must be a contiguous float32"),
            ("per_row", 2, "empty", "qsum is empty")]


@pytest.mark.parametrize("kind,index,how,message", TAMPERED)
def test_tampered_arguments_are_named(kind, index, how, message):
    args = list(_valid(kind, torch.Generator().manual_seed(index)))
    _call(kind, args)                                                        # the untampered call runs
    args[index] = _tamper(args[index], how)
    with pytest.raises((ValueError, RuntimeError), match=message):
        _call(kind, args)


@pytest.mark.parametrize("G,activations,message", [(24, "exact", "group_size=24: expected a multiple of 16 dividing K=64"),
                                                   (48, "exact", "group_size=48: expected a multiple of 16 dividing"),
                                                   (96, "per_block", "group_size=96: expected a multiple of 32 dividing"),
                                                   (16, "per_block", "group_size=16: expected a multiple of 32")])
def test_group_sizes_that_do_not_fit_are_named(G, activations, message):
    x, packed, sz = _valid("exact", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        gemv.int4_gemv(x, packed, sz, G, activations=activations)
