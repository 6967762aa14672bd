"""Shared by the quantization tests (tests/test_quantize.py, tests/test_quantize_checkpoints.py):
the small float32 GPT-2 whose widths the int4 kernel takes, and that model quantized."""

import warnings

import torch

from conftest import small_model
from gpt2mha.inference.quant import QuantizationWarning


def float_model(seed=0, **kw):
    """A random float32 GPT-2 whose widths the int4 kernel takes: conftest's ``small_model`` with
    ``n_ctx=64, n_embd=64, n_layer=2`` (group 32 or 64)."""
    return small_model(seed, **{**dict(n_ctx=64, n_embd=64, n_layer=2), **kw})


def quantized(scheme, seed=0, group_size=None, method="rtn", **kw):
    """``float_model`` quantized; round-to-nearest unless ``method="gptq"`` (then calibrated on
    random ids: the packaged text's GPT-2 ids do not fit n_vocab=97)."""
    model = float_model(seed, **kw)
    calibration = None
    if method == "gptq":
        calibration = torch.randint(0, model.config.n_vocab, (4, model.config.n_ctx),
                                    generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        return model.quantize(scheme, group_size, method, calibration)
