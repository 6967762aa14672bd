"""Weight-only int8 / int4 quantization, applied by swapping modules.

:func:`quantize_model` replaces every block Conv1D and the LM head of a model with a
:class:`QuantizedLinear` (:class:`QuantizedHead`), rounded to nearest or by GPTQ;
:mod:`.checkpoint` stores and restores such a model. The pieces, one concern each:
:mod:`.schemes` (what int8/int4 weights mean, rounding to nearest, packing), :mod:`.gptq`
(GPTQ's rounding), :mod:`.linear` (the quantized layer and its products), :mod:`.model` (the
whole model, calibration, the error report).
"""

from . import checkpoint  # noqa: F401  (registers the quantized checkpoint format with gpt2mha.io)
from .linear import ACTIVATIONS, QuantizedHead, QuantizedLinear, int8_matmul, int8_matmul_per_row, split_activations
from .model import QuantizationWarning, calibration_ids, default_calibration, quantize_model, set_activations
from .schemes import (DEFAULT_GROUP_SIZE, HEAD_SCHEME, HEAD_SCHEMES, INT4_GROUP_SIZES, KERNEL_DTYPE, METHODS, SCHEMES,
                      QuantizationError, check_head, check_scheme)

__all__ = ["ACTIVATIONS", "QuantizedHead", "QuantizedLinear", "int8_matmul", "int8_matmul_per_row", "split_activations",
           "QuantizationWarning", "calibration_ids", "default_calibration", "quantize_model", "set_activations",
           "DEFAULT_GROUP_SIZE", "HEAD_SCHEME", "HEAD_SCHEMES",
           "INT4_GROUP_SIZES", "KERNEL_DTYPE", "METHODS", "SCHEMES", "QuantizationError", "check_head", "check_scheme"]
