"""Weight-only int8 / int4 quantization, applied by swapping modules.

:func:`quantize_model` replaces every block Conv1D and the LM head of a model with a
:class:`QuantizedLinear` (:class:`QuantizedHead`) of its scheme's class, rounded to nearest or by
GPTQ; :mod:`.checkpoint` stores and restores such a model. The pieces, one concern each:
:mod:`.schemes` (what int8/int4 weights mean, rounding to nearest, packing), :mod:`.gptq`
(GPTQ's rounding), :mod:`.linear` (the quantized layer's base and the registry of its classes),
:mod:`.int8_linear` and :mod:`.int4_linear` (one file per scheme: its layer classes and their
products), :mod:`.model` (the whole model, calibration, the error report).
"""

# .linear first: it imports the scheme files, which build on it
from .linear import (ACTIVATIONS, DEFAULT_ACTIVATIONS, DEFAULT_GROUP_SIZE, HEAD_SCHEMES, SCHEME_ACTIVATIONS, SCHEMES,  # isort: skip
                     QuantizedHead, QuantizedLinear, check_head, check_scheme, int8_matmul, int8_matmul_per_row,
                     layer_class, split_activations)
from .int4_linear import Int4Linear, W4A8Linear
from .int8_linear import AutoInt8Linear, Int8Linear, W7A8Linear
from .model import QuantizationWarning, calibration_ids, default_calibration, quantize_model, set_activations
from .schemes import HEAD_SCHEME, INT4_GROUP_SIZES, KERNEL_DTYPE, METHODS, QuantizationError
from . import checkpoint  # noqa: F401  (registers the quantized checkpoint format with gpt2mha.io)

__all__ = ["ACTIVATIONS", "QuantizedHead", "QuantizedLinear", "int8_matmul", "int8_matmul_per_row", "split_activations",
           "Int8Linear", "W7A8Linear", "AutoInt8Linear", "Int4Linear", "W4A8Linear", "layer_class",
           "DEFAULT_ACTIVATIONS", "SCHEME_ACTIVATIONS",
           "QuantizationWarning", "calibration_ids", "default_calibration", "quantize_model", "set_activations",
           "DEFAULT_GROUP_SIZE", "HEAD_SCHEME", "HEAD_SCHEMES",
           "INT4_GROUP_SIZES", "KERNEL_DTYPE", "METHODS", "SCHEMES", "QuantizationError", "check_head", "check_scheme"]
