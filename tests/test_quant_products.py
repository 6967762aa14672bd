"""The quantized layer's product routes: the dequantized-weight product (prefill-sized inputs on
CPUs without VNNI) and the per-row 8-bit activations over 7-bit weights (``activations="per_row"``).

References: float64 ``x @ deq(W)ᵀ`` (the dequantized product), float64 first-principles
rounding of the activations (the per-row product), each row alone (row independence), the
float32 built-in model on held-out bytes, and the model before a save/load round trip."""

import copy
import json
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from conftest import small_model
from gpt2mha import GPT2
from gpt2mha.inference.quant import (QuantizationError, QuantizationWarning, QuantizedLinear, int8_matmul_per_row,
                                     set_activations)
from gpt2mha.inference.quant import gemv
from gpt2mha.inference.quant import linear as qlinear
from gpt2mha.inference.quant.linear import fbgemm_available, weight_7bit
from gpt2mha.inference.quant.schemes import quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")

KERNELS = ["int_mm"] + (["fbgemm"] if fbgemm_available() else [])
SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)


# ------------------------------------------------------------------ the dequantized product
@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("int4", 64)])
def test_dequantized_product_in_chunks_equals_the_float64_product(monkeypatch, scheme, group_size):
    """``dequantized_product`` (scratch buffer, int8 scales on the outputs, int4 nibble halves
    and group offsets) equals float64 ``x @ deq(W)ᵀ`` to float32 rounding, in one chunk and in
    several (DEQUANTIZE_CHUNK small: a last chunk shorter than the others), with a scratch
    grown by one layer and then used by a smaller one."""
    g = torch.Generator().manual_seed(3)
    big = QuantizedLinear.from_float(torch.randn(97, 128, generator=g), None, scheme, group_size)
    small = QuantizedLinear.from_float(torch.randn(16, 64, generator=g) * 3, None, scheme, group_size)
    for chunk in (1 << 24, 128 * 20):                             # 97 outputs in chunks of 20: 5 × 20 − 3
        monkeypatch.setattr(qlinear, "DEQUANTIZE_CHUNK", chunk)
        for layer in (big, small, big):
            for M in (1, 9):
                x = torch.randn(M, layer.n_in, generator=g)
                ref = x.double() @ layer.dequantized().double().t()
                y = layer.dequantized_product(x)
                assert y.shape == (M, layer.n_out) and y.dtype == torch.float32
                assert (rel_err(y, ref) < 1e-6).all(), (chunk, layer.n_out, M)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_route_follows_tokens_per_sequence_not_the_batch(monkeypatch, kernel, scheme, group_size):
    """A decode step over many sequences (``[B, 1, K]``, B past DEQUANTIZE_FROM_ROWS) gives each
    row the bits of that row alone (the quantized kernel for both); one sequence of that many
    tokens (``[1, T, K]``) takes the dequantized product on FBGEMM CPUs, equal to float64
    ``x @ deq(W)ᵀ + b`` to float32 rounding."""
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    g = torch.Generator().manual_seed(8)
    layer = QuantizedLinear.from_float(torch.randn(48, 64, generator=g), torch.randn(48, generator=g),
                                       scheme, group_size)
    n = qlinear.DEQUANTIZE_FROM_ROWS[scheme] + 3
    x = torch.randn(n, 1, 64, generator=g)
    batch = layer(x)
    for i in range(n):
        assert torch.equal(batch[i], layer(x[i:i + 1])[0]), i
    seq = x.view(1, n, 64)
    ref = seq.double() @ layer.dequantized().double().t() + layer.bias.double()
    tol = 1e-6 if kernel == "fbgemm" else (1e-3 if scheme == "int8" else 2e-2)    # int4 kernel: bf16 activations
    assert layer.dequantize_for(n) == (kernel == "fbgemm")
    torch.testing.assert_close(layer(seq).double(), ref, rtol=0, atol=float(ref.abs().max()) * tol)


# ------------------------------------------------------------------ per-row activations
def test_weight_7bit_is_within_half_a_7bit_step():
    """weight_7bit against first principles: integers in [-63, 63], each channel's largest
    weight at ±63, and ``q7 · s7`` within half a 7-bit step (plus float32 rounding) of ``q · s``."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40)[:, None]
    w[3] = 0
    q, s = quantize_int8(w)
    q7, s7 = weight_7bit(q, s)
    assert q7.dtype == torch.int8 and int(q7.abs().max()) == 63 and int(q7[3].abs().max()) == 0
    err = (q7.float() * s7[:, None] - q.float() * s.float()[:, None]).abs()
    assert (err <= s7[:, None] / 2 * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("activations", ["exact", "per_row", "auto"])
def test_int8_weights_of_minus_128_compute_as_their_dequantized_product(monkeypatch, kernel, activations):
    """Other int8 tools write −128 (the full int8 range), which gpt2mha's own rounding never
    does. A layer holding it computes, on every route (exact pieces, per_row on FBGEMM or
    ``_int_mm``, the VNNI/AVX2 operator where built; 1 and 300 rows), the product of its
    dequantized weight (reference: float64 ``x @ (q · s)ᵀ``) to the route's own accuracy, and
    weight_7bit maps −128 to −63 (−128 · 63 / 128), within [-63, 63]."""
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    g = torch.Generator().manual_seed(11)
    layer = QuantizedLinear.from_float(torch.randn(72, 64, generator=g), None, "int8")
    with torch.no_grad():
        layer.weight[::3, 5] = -128                            # row 0: -128 is its only top
        layer.weight[0] = layer.weight[0].clamp(-100, 100)
        layer.weight[0, 7] = -128
        layer.weight[1] = -128                                 # a row of nothing else
    q7, s7 = weight_7bit(layer.weight, layer.scales)
    assert int(q7.abs().max()) == 63 and int(q7[0, 7]) == -63 and (q7[1] == -63).all()
    layer.activations = activations
    ref_w = layer.weight.double() * layer.scales.double()[:, None]
    for rows in (1, 300):
        x = torch.randn(rows, 64, generator=g)
        y = layer(x)
        err = rel_err(y, x.double() @ ref_w.t())
        # exact: float32 on the GEMV kernel, integer pieces without it (FBGEMM's 7-bit pieces: ~1e-4)
        exact = 3e-4 if kernel == "fbgemm" else 1e-4
        bound = exact if activations == "exact" or (activations == "auto" and rows == 1) else 3e-2
        assert (err < bound).all(), (rows, float(err.max()))


@pytest.mark.parametrize("kernel", KERNELS)
def test_per_row_product_equals_first_principles_and_each_row_alone(kernel):
    """int8_matmul_per_row against float64 arithmetic written from its definition (each row
    rounded to ``lo + a·round((x − lo)/a)``, ``a = (max − min)/255``, times ``q7 · s7``): equal to
    float32 rounding, so the integer sums are exact on this kernel. Each row's result equals
    the row computed alone (bitwise), and a row holding inf or NaN gives NaN without touching
    the others."""
    g = torch.Generator().manual_seed(21)
    q7, s7 = weight_7bit(*quantize_int8(torch.randn(300, 192, generator=g)))
    x = torch.randn(6, 192, generator=g) * torch.logspace(-2, 2, 6)[:, None]
    x[1] = x[1].abs()                                              # a one-sided row (as after GELU)
    x[2, :3] *= 40                                                 # an outlier feature
    xd = x.double()
    lo, hi = xd.min(-1, keepdim=True).values, xd.max(-1, keepdim=True).values
    a = (hi - lo) / 255
    xr = lo + a * torch.round((xd - lo) / a)
    ref = xr @ (q7.double() * s7.double()[:, None]).t()
    y = int8_matmul_per_row(x, q7, s7, kernel)
    assert y.dtype == torch.float32 and (rel_err(y, ref) < 1e-5).all(), rel_err(y, ref)
    for i in range(len(x)):
        assert torch.equal(int8_matmul_per_row(x[i:i + 1], q7, s7, kernel)[0], y[i]), i
    bad = x.clone()
    bad[0, 5], bad[3, 7] = float("inf"), float("nan")
    yb = int8_matmul_per_row(bad, q7, s7, kernel)
    assert yb[[0, 3]].isnan().all() and torch.equal(yb[[1, 2, 4, 5]], y[[1, 2, 4, 5]])
    with pytest.raises(ValueError, match="q7=None: the 7-bit weights are needed"):
        int8_matmul_per_row(x, None, s7, kernel)
    with pytest.raises(ValueError, match=r"q7: weights up to 127 .* \[-63, 63\]"):
        int8_matmul_per_row(x, quantize_int8(torch.randn(4, 192, generator=g))[0], torch.ones(4), kernel)


@pytest.mark.skipif(len(KERNELS) < 2, reason="needs both int8 kernels")
def test_per_row_kernels_give_the_same_sums():
    """FBGEMM and _int_mm take the same integers, so their per-row products agree to float32
    rounding of the rescale."""
    g = torch.Generator().manual_seed(4)
    q7, s7 = weight_7bit(*quantize_int8(torch.randn(64, 96, generator=g)))
    x = torch.randn(5, 96, generator=g)
    a, b = (int8_matmul_per_row(x, q7, s7, k) for k in KERNELS)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))


@pytest.mark.parametrize("kernel", KERNELS)
def test_per_row_layer_follows_its_weight_and_validates(monkeypatch, kernel):
    """A per-row layer caches its 7-bit weights and makes them again after an in-place write;
    its output equals int8_matmul_per_row over weight_7bit of the current weight plus the bias;
    bad values of ``activations`` are named errors."""
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    g = torch.Generator().manual_seed(5)
    layer = QuantizedLinear.from_float(torch.randn(40, 32, generator=g), torch.randn(40, generator=g), "int8")
    layer.activations = "per_row"
    x = torch.randn(3, 32, generator=g)

    def check():
        q7, s7 = weight_7bit(layer.weight, layer.scales)
        torch.testing.assert_close(layer(x), int8_matmul_per_row(x, q7, s7, kernel) + layer.bias, rtol=1e-6, atol=1e-6)
    check()
    # on AVX-512 VNNI CPUs the layer runs gpt2mha's per_row operator on its packed copy (for
    # every row count), elsewhere torch's ops on the 7-bit weight
    weights = layer.per_row_packed if gemv.vnni() else layer.per_row_weights
    cached = weights()
    assert weights() is cached
    with torch.no_grad():
        layer.weight[:5] = -layer.weight[:5]
    check()
    assert weights() is not cached
    if gemv.vnni():
        with mock.patch.object(torch.ops.gpt2mha, "int8_per_row", wraps=torch.ops.gpt2mha.int8_per_row) as op:
            many = torch.randn(300, 32, generator=g)
            y = layer(many)
            assert op.call_count == 1 and y.shape == (300, 40)
            q7, s7 = weight_7bit(layer.weight, layer.scales)
            torch.testing.assert_close(y, int8_matmul_per_row(many, q7, s7, kernel) + layer.bias, rtol=1e-6, atol=1e-6)
    assert "activations=per_row" in repr(layer) and copy.deepcopy(layer).activations == "per_row"
    with pytest.raises(ValueError, match=r"activations='rows': an int8 layer takes one of \('exact', 'per_row', 'auto'\)"):
        layer.activations = "rows"
    with pytest.raises(ValueError, match=r"activations='per_block': an int8 layer takes one of"):
        layer.activations = "per_block"
    int4 = QuantizedLinear.from_float(torch.randn(8, 32, generator=g), None, "int4", 32)
    with pytest.raises(ValueError, match=r"activations='per_row': an int4 layer takes one of \('exact', 'per_block'\)"):
        int4.activations = "per_row"


@pytest.mark.parametrize("kernel", KERNELS)
def test_auto_activations_pick_per_row_where_exact_would_dequantize(monkeypatch, kernel):
    """activations="auto" gives, bit for bit, the exact layer's product where the exact route runs
    its integer pieces (decode steps, short prompts, a batch of single tokens: the count is the
    tokens per sequence, never the batch) and the per_row layer's where it would multiply by the
    dequantized weight (dequantize_for: 64+ tokens on FBGEMM CPUs)."""
    monkeypatch.setenv("GPT2MHA_INT8_KERNEL", kernel)
    g = torch.Generator().manual_seed(6)
    layers = {a: QuantizedLinear.from_float(torch.randn(40, 32, generator=torch.Generator().manual_seed(7)),
                                            torch.randn(40, generator=torch.Generator().manual_seed(8)), "int8")
              for a in ("exact", "per_row", "auto")}
    for a, layer in layers.items():
        layer.activations = a
    T = qlinear.DEQUANTIZE_FROM_ROWS["int8"]
    with torch.inference_mode():
        for shape in [(1, 1, 32), (100, 1, 32), (2, T - 1, 32), (1, T, 32), (3, 2 * T, 32), (T, 32)]:
            x = torch.randn(*shape, generator=g)
            many = layers["exact"].dequantize_for(shape[-2])
            assert many == (kernel == "fbgemm" and shape[-2] >= T)
            got, want = layers["auto"](x), layers["per_row" if many else "exact"](x)
            assert torch.equal(got, want), shape
            if many:                                            # per_row differs from exact's dequantized product
                assert not torch.equal(got, layers["exact"](x))


def _model():
    return small_model(0, n_ctx=64, n_embd=64, n_layer=2)


def test_quantize_with_per_row_activations_round_trips_and_names_errors(tmp_path):
    """``quantize(..., activations="per_row")`` sets every int8 layer (the head too) and the
    model's record; logits stay near the float32 model's and change from the exact ones; a
    checkpoint restores the choice (identical logits); an exact model's checkpoint keeps the
    entry older versions read; bad values are named errors, at quantize and at load."""
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    ref = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        exact = copy.deepcopy(ref).quantize("int8", method="rtn")
        fast = copy.deepcopy(ref).quantize("int8", method="rtn", activations="per_row")
    layers = [m for m in fast.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 9 and all(m.activations == "per_row" for m in layers)
    assert fast.quantization["activations"] == "per_row" and exact.quantization["activations"] == "exact"
    with torch.no_grad():
        r, e, f = ref(idx).logits, exact(idx).logits, fast(idx).logits
    assert not torch.equal(e, f) and F.cosine_similarity(f.flatten(), r.flatten(), dim=0) > 0.999
    fast.save_pretrained(str(tmp_path / "fast"))
    exact.save_pretrained(str(tmp_path / "exact"))
    assert "activations" not in json.load(open(tmp_path / "exact" / "config.json"))["gpt2mha"]["quantization"]
    loaded = GPT2.from_pretrained(str(tmp_path / "fast"))
    assert loaded.quantization == fast.quantization
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, f)
    set_activations(loaded, "exact")
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, e)
    with pytest.raises(ValueError, match=r"activations='per_row' does not apply to scheme='int4': int4 takes exact or per_block"):
        copy.deepcopy(ref).quantize("int4", method="rtn", activations="per_row")
    with pytest.raises(ValueError, match=r"activations='fast': expected one of"):
        copy.deepcopy(ref).quantize("int8", method="rtn", activations="fast")
    with pytest.raises(ValueError, match="the model is not quantized"):
        set_activations(ref, "per_row")
    cfg_path = tmp_path / "fast" / "config.json"
    cfg = json.load(open(cfg_path))
    cfg["gpt2mha"]["quantization"]["activations"] = "per_block"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(QuantizationError, match="activations='per_block' does not apply to scheme='int8'"):
        GPT2.from_pretrained(str(tmp_path / "fast"))                  # int4's value in an int8 checkpoint
    cfg["gpt2mha"]["quantization"]["activations"] = "per_tile"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(QuantizationError, match="activations='per_tile': expected one of"):
        GPT2.from_pretrained(str(tmp_path / "fast"))


# Measured on these 4096 held-out bytes (round to nearest): per_row 97.6% top-1 agreement with
# float32 (exact activations 99.5%); benchmarks/results/quality.json holds the figures on 8192
# bytes, with the peers' (llama.cpp q8_0 98.30%, ONNX Runtime int8 96.25%, CTranslate2 int8 95.84%).
def test_builtin_model_with_per_row_activations_agrees_with_float32():
    from gpt2mha import DEFAULT_MODEL
    from gpt2mha.io.checkpoints import builtin_models

    if DEFAULT_MODEL not in builtin_models() or not os.path.exists(SHAKESPEARE):
        pytest.skip("the built-in model or data/tinyshakespeare.txt is not installed")
    with open(SHAKESPEARE, "rb") as f:
        tokens = torch.tensor(list(f.read()[-4096:]))                 # never trained on
    model = GPT2.from_pretrained(DEFAULT_MODEL)
    q = copy.deepcopy(model).quantize("int8", method="rtn", activations="per_row")
    with torch.no_grad():
        windows = tokens.view(-1, model.config.n_ctx)
        ref, out = model(windows[:, :-1]).logits, q(windows[:, :-1]).logits
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.96
    loss = lambda logits: F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())   # noqa: E731
    assert loss(out) - loss(ref) <= 0.01
