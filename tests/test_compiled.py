"""generate(compile=True): the decode step compiled whole by inductor (inference/compiled.py).

References: the eager int8 model (exact integer products, which equal float32 products of the
dequantized weights to ~1e-4: tests/test_quant*.py), float64 products of the dequantized
weights, and the same products run eagerly (decode_view); the float model for greedy tokens.
"""

import copy
import warnings

import pytest
import torch

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.inference.compiled import (GEMV_ROWS, SPAN_MULTIPLE, SPAN_STEP, GemvInt4Linear, GemvInt8Linear, PerRowInt8Linear, WoqInt8Linear, cache_len,
                                        compiled_decoder, decode_view, options)
from gpt2mha.inference.quant import gemv

pytestmark = pytest.mark.slow                   # each test compiles (inductor's C++): seconds to a minute


@pytest.fixture(scope="module")
def int8_model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=96, n_ctx=128, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes")
    model = GPT2(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.quantize("int8", method="rtn")


INT8_LAYER = GemvInt8Linear if gemv.available() else WoqInt8Linear     # the view's int8 layers on this machine


@pytest.mark.parametrize("kernel", ["gemv", "template"])
def test_the_view_multiplies_int8_weights_on_our_kernel_or_inductors_template(int8_model, kernel, monkeypatch):
    if kernel == "gemv" and not gemv.available():
        pytest.skip(f"the int8 GEMV kernel does not build here: {gemv.unavailable_reason()}")
    if kernel == "template":
        monkeypatch.setattr(gemv, "available", lambda: False)
    view = decode_view(int8_model)
    cls = GemvInt8Linear if kernel == "gemv" else WoqInt8Linear
    layers = [m for m in view.modules() if isinstance(m, cls)]
    assert len(layers) == 4 * int8_model.config.n_layer + 1                        # every block product and the head
    assert layers[0].weight.data_ptr() == int8_model.h[0].attn.c_attn.weight.data_ptr()   # shared, not copied
    x = torch.randn(3, 64)
    ref = x.double() @ int8_model.h[0].attn.c_attn.dequantized().double().t() + int8_model.h[0].attn.c_attn.bias.double()
    y = layers[0](x)
    assert y.dtype == torch.float32
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    if kernel == "gemv":
        assert err < 1e-6                     # float32 activations: the float32 product of the dequantized weight
        assert "max_autotune" not in options(int8_model)
    else:
        assert 1e-6 < err < 2e-2              # bf16 activations and product: not exact, within bf16's rounding
        assert options(int8_model)["max_autotune_gemm_backends"] == "CPP"


def test_compiled_steps_give_the_int8_models_logits_and_advance_the_cache(int8_model):
    B, T, steps = 2, 5, 6
    torch.manual_seed(1)
    idx = torch.randint(0, 96, (B, T + steps))
    dec = compiled_decoder(int8_model)
    with torch.inference_mode():
        eager_view = decode_view(int8_model)
        caches = [KVCache(2, B, 4, cache_len(T + steps, 128), 16) for _ in range(2)]
        for c in caches:
            int8_model(idx[:, :T], cache=c)
        got, same_math, exact = [], [], []
        for s in range(T, T + steps):
            got.append(dec(idx[:, s:s + 1], caches[0]))
            plan = caches[1].plan(1, span=caches[1].max_len, per_row=True)
            same_math.append(eager_view(idx[:, s:s + 1], cache=caches[1], step=plan, last_only=True).logits[:, -1])
            exact.append(int8_model(idx[:, :s + 1]).logits[:, -1])
    assert caches[0].lengths == [T + steps] * B == caches[1].lengths
    got, same_math, exact = torch.stack(got), torch.stack(same_math), torch.stack(exact)
    scale = exact.abs().max().item()
    if INT8_LAYER is GemvInt8Linear:                                    # float32 products of the dequantized weights
        assert (got - same_math).abs().max().item() < 1e-5 * scale
        assert (got - exact).abs().max().item() < 1e-3 * scale           # exact pieces: ~1e-4 per product
    else:
        assert (got - same_math).abs().max().item() < 1e-2 * scale       # same products, other summation order
        assert (got - exact).abs().max().item() < 3e-2 * scale           # bf16 activations vs exact pieces
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not gemv.available(), reason=f"the GEMV kernel does not build here: {gemv.unavailable_reason()}")
@pytest.mark.parametrize("activations", ["exact", "per_block"])
def test_int4_models_decode_compiled_on_the_int4_kernel(activations):
    # references: the eager decode view (the same int4_gemv products, float32 activations) and
    # float64 products of the dequantized weights through the whole model (an int4 layer's
    # dequantized(); its int8 head's too), computed here by swapping every quantized layer for
    # an nn.Linear holding its dequantized weight
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=96, n_ctx=128, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes")
    model = GPT2(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.quantize("int4", method="rtn", group_size=32, activations=activations)
    view = decode_view(model)
    layers = [m for m in view.modules() if isinstance(m, GemvInt4Linear)]
    assert len(layers) == 4 * cfg.n_layer                                  # every block product; the head is int8
    assert all(m.per_block == (activations == "per_block") for m in layers)
    assert layers[0].weight.data_ptr() == model.h[0].attn.c_attn.weight.data_ptr()
    from gpt2mha.inference.quant.linear import QuantizedLinear
    dense = copy.deepcopy(model).double()
    for name, m in list(dense.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, QuantizedLinear):
                lin = torch.nn.Linear(child.n_in, child.n_out, bias=child.bias is not None).double()
                lin.weight.data = child.dequantized().double()
                if child.bias is not None:
                    lin.bias.data = child.bias.double()
                setattr(m, child_name, lin)
    B, T, steps = 2, 5, 4
    idx = torch.randint(0, 96, (B, T + steps))
    dec = compiled_decoder(model)
    with torch.inference_mode():
        eager_view = decode_view(model)
        caches = [KVCache(2, B, 4, cache_len(T + steps, 128), 16) for _ in range(2)]
        for c in caches:
            model(idx[:, :T], cache=c)
        for s in range(T, T + steps):
            got = dec(idx[:, s:s + 1], caches[0])
            plan = caches[1].plan(1, span=caches[1].max_len, per_row=True)
            same = eager_view(idx[:, s:s + 1], cache=caches[1], step=plan, last_only=True).logits[:, -1]
            exact = dense(idx[:, :s + 1]).logits[:, -1]
            scale = exact.abs().max().item()
            assert (got - same).abs().max().item() < 1e-5 * scale
            # the prefill ran torch's int4 kernel (bf16 activations): the cache is off float64's a little;
            # per_block rounds the step's activations to 8 bits as well
            err = (got.double() - exact).abs().max().item() / scale
            assert err < (2e-3 if activations == "exact" else 2e-2)             # measured ~4e-4 / ~5e-3


@pytest.fixture(scope="module")
def per_row_model(int8_model):
    from gpt2mha.inference.quant import set_activations
    model = copy.deepcopy(int8_model)
    set_activations(model, "per_row")
    return model


@pytest.mark.parametrize("kernel", ["fbgemm", "int_mm"])
def test_per_row_layers_give_the_eager_per_row_product_compiled(per_row_model, kernel, monkeypatch):
    # reference: the eager layer's int8_matmul_per_row (quant/int8_products.py), which the quant tests check
    # against float64 products of the dequantized weights
    from gpt2mha.inference.quant.linear import fbgemm_available
    if kernel == "fbgemm" and not fbgemm_available():
        pytest.skip("this torch build has no FBGEMM")
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    view = decode_view(per_row_model)
    layers = [m for m in view.modules() if isinstance(m, PerRowInt8Linear)]
    assert len(layers) == 4 * per_row_model.config.n_layer + 1 and {m.kernel for m in layers} == {kernel}
    assert not any(isinstance(m, (WoqInt8Linear, GemvInt8Linear)) for m in view.modules())
    eager_layer = per_row_model.h[0].mlp.c_fc
    x = torch.randn(2, 3, 64) * 3
    x[1, 2] = 0                                                                   # a constant row: zero range
    with torch.inference_mode():
        want = eager_layer(x)
        for got in (layers[2](x), torch.compile(layers[2], fullgraph=True, dynamic=False)(x)):
            assert got.shape == want.shape == (2, 3, 256) and got.dtype == torch.float32
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        # decode sizes run gpt2mha's kernel where it builds: the same exact integer sums as FBGEMM's
        # and _int_mm's (bitwise equal below)
        assert layers[2].gemv == gemv.available()
        if layers[2].gemv:                                  # 3 rows: within GEMV_ROWS
            assert x[1:].numel() // 64 <= GEMV_ROWS <= layers[2].gemv_rows
            on_gemv = layers[2](x[1:])
            assert (on_gemv - want[1:]).abs().max() <= 1e-5 * want.abs().max()
            layers[2].gemv = False
            assert torch.equal(layers[2](x[1:]), on_gemv)


def test_auto_activations_decode_compiled_as_exact_int8(int8_model):
    # activations="auto" keeps the exact route for one-token steps: its compiled step is the
    # exact int8 model's (our GEMV kernel, or inductor's bf16-activation template without it)
    from gpt2mha.inference.quant import set_activations
    model = copy.deepcopy(int8_model)
    set_activations(model, "auto")
    assert options(model) == options(int8_model)
    view = decode_view(model)
    assert any(isinstance(m, INT8_LAYER) for m in view.modules())
    assert not any(isinstance(m, PerRowInt8Linear) for m in view.modules())


@pytest.mark.parametrize("kernel", ["fbgemm", "int_mm"])
def test_compiled_per_row_steps_follow_the_eager_per_row_model(per_row_model, int8_model, kernel, monkeypatch):
    int8_model_for_options = int8_model
    # int_mm is what VNNI CPUs run: frozen, inductor's lowering of it gave NaN there (options() unfreezes)
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    per_row_model = copy.deepcopy(per_row_model)                  # its own compiled step, on this kernel
    B, T, steps = 2, 5, 6
    idx = torch.randint(0, 96, (B, T + steps), generator=torch.Generator().manual_seed(2))
    dec = compiled_decoder(per_row_model)
    assert "max_autotune" not in dec.options                    # no GEMM template to pick: FBGEMM is an opaque call
    assert dec.options["freezing"] == (kernel == "fbgemm")
    lone = copy.deepcopy(int8_model_for_options)                      # per_row set on one layer alone
    lone.lm_head.activations = "per_row"
    assert options(lone)["freezing"] == (kernel == "fbgemm")
    with torch.inference_mode():
        caches = [KVCache(2, B, 4, cache_len(T + steps, 128), 16) for _ in range(2)]
        for c in caches:
            per_row_model(idx[:, :T], cache=c)
        got, want = [], []
        for s in range(T, T + steps):
            got.append(dec(idx[:, s:s + 1], caches[0]))
            want.append(per_row_model(idx[:, s:s + 1], cache=caches[1]).logits[:, -1])
    got, want = torch.stack(got), torch.stack(want)
    assert caches[0].lengths == [T + steps] * B
    assert (got - want).abs().max() < 1e-3 * want.abs().max()   # same products; a rounding tie may flip one level
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_one_compiled_step_reads_every_span_and_a_batch_prefills_together(per_row_model):
    # the step reads the cache up to the longest row (rounded to SPAN_STEP), a dynamic size: one
    # trace serves spans 16, 32, 48 and 64 here; reference: the eager per_row model's greedy tokens
    from torch._dynamo.utils import counters
    idx = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    want = per_row_model.generate(idx, 50, temperature=0)
    with torch.inference_mode():                                 # (batch 2: the step the test above compiled)
        compiled_decoder(per_row_model)(idx[:, :1], KVCache(2, 2, 4, 64, 16))    # compiled at span 16
    frames = counters["frames"]["ok"]
    got = per_row_model.generate(idx, 50, temperature=0, compile=True)
    assert counters["frames"]["ok"] == frames                                      # no second trace
    assert (got == want).float().mean() >= 0.95                                   # a rare rounding tie may differ


def test_switching_activations_gives_a_new_compiled_step(int8_model):
    # set_activations changes which layers the view holds (GemvInt8Linear / PerRowInt8Linear):
    # a decoder built before the switch must not be reused after it (found by a break-it review)
    from gpt2mha.inference.quant import set_activations
    model = copy.deepcopy(int8_model)
    first = compiled_decoder(model)                              # built, not yet compiled (lazy)
    assert compiled_decoder(model) is first
    set_activations(model, "per_row")
    second = compiled_decoder(model)
    assert second is not first
    assert any(isinstance(m, PerRowInt8Linear) for m in second.step.modules())


def test_the_compiled_step_is_reused_and_rebuilt_when_a_weight_changes():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=64, n_ctx=64, n_embd=32, n_head=2, n_layer=1, tokenizer="bytes")).eval()
    idx = torch.randint(0, 64, (1, 4))
    first = compiled_decoder(model)
    a = model.generate(idx, 6, temperature=0, compile=True)
    assert compiled_decoder(model) is first
    assert torch.equal(a, model.generate(idx, 6, temperature=0))                 # float32: the eager tokens
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)                                            # the tied head, written in place
    assert compiled_decoder(model) is not first                                 # frozen constants would be stale
    assert torch.equal(model.generate(idx, 6, temperature=0, compile=True), model.generate(idx, 6, temperature=0))


def test_two_models_of_one_shape_keep_their_own_compiled_steps():
    torch.manual_seed(0)
    cfg = GPT2Config(n_vocab=64, n_ctx=64, n_embd=32, n_head=2, n_layer=1, tokenizer="bytes")
    models = [GPT2(cfg).eval() for _ in range(2)]
    with torch.no_grad():
        models[1].ln_f.weight.mul_(-1)                                  # the argmin: other tokens
    idx = torch.randint(0, 64, (1, 4))
    eager = [m.generate(idx, 8, temperature=0) for m in models]
    assert not torch.equal(eager[0], eager[1])
    for m, want in [*zip(models, eager), *zip(models, eager)]:          # alternately, twice
        assert torch.equal(m.generate(idx, 8, temperature=0, compile=True), want)


def test_models_of_one_shape_never_share_frozen_weights_through_inductors_caches():
    # inductor's on-disk graph cache once served a compiled 124M step holding another model's
    # frozen weights (same shapes): every product wrong. Matrices of 64k+ weights, as there.
    cfg = GPT2Config(n_vocab=512, n_ctx=64, n_embd=128, n_head=2, n_layer=1, tokenizer="bytes")
    idx = torch.randint(0, 512, (1, 4), generator=torch.Generator().manual_seed(0))
    for seed in (1, 2):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPT2(cfg).eval().quantize("int8", method="rtn")
        with torch.inference_mode():
            cache = [KVCache(1, 1, 2, 64, 64) for _ in range(2)]
            for c in cache:
                model(idx, cache=c)
            tok = torch.tensor([[7]])
            got = compiled_decoder(model)(tok, cache[0])
            want = model(tok, cache=cache[1]).logits[:, -1]
        assert (got - want).abs().max() < 3e-2 * want.abs().max(), f"model {seed}"


def test_compile_refuses_what_it_cannot_run():
    model = GPT2(GPT2Config(n_vocab=64, n_ctx=64, n_embd=32, n_head=2, n_layer=1, tokenizer="bytes")).eval()
    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="compile"):
        model.generate(idx, 2, compile="yes")
    handle = model.h[0].mlp.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(ValueError, match="forward hooks"):
        model.generate(idx, 2, compile=True)
    handle.remove()
    dec = compiled_decoder(model)
    with pytest.raises(RuntimeError, match="without gradients"):
        dec(idx[:, :1], KVCache(1, 1, 2, 64, 16))


def test_cache_lengths_round_up_to_shared_shapes():
    assert cache_len(1, 1024) == SPAN_MULTIPLE
    assert cache_len(SPAN_MULTIPLE + 1, 1024) == 2 * SPAN_MULTIPLE
    assert cache_len(1000, 1024) == 1024 and cache_len(100, 80) == 80


def test_cli_compile_prints_the_eager_greedy_text_on_the_built_in_int8_model(capsys):
    from gpt2mha.cli import main
    args = ["generate", "ROMEO:", "--max-new-tokens", "24", "--temperature", "0", "--quantize", "int8",
            "--quantize-method", "rtn"]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main([*args, "--compile"]) == 0
    assert capsys.readouterr().out == eager        # bf16 activations: no near-tie on these 24 bytes (99% top-1)
