"""gpt2mha: GPT-2's multi-head causal self-attention, exact and fast, with the model around it.

The public names below are imported on first use (PEP 562 module ``__getattr__``), so
``import gpt2mha`` and the ``gpt2mha`` command's ``--help``/``--version`` do not load torch;
``from gpt2mha import GPT2`` works as usual and imports it then.

Layout: :mod:`gpt2mha.core` (attention, model, KV cache, capture points: imports only torch),
:mod:`gpt2mha.io` (checkpoints, formats, tokenizers), :mod:`gpt2mha.inference` (sampling,
generation, decode-speed swaps, quantization, tensor parallel), :mod:`gpt2mha.serving`,
:mod:`gpt2mha.learn`, :mod:`gpt2mha.train`; ``gpt2mha.GPT2`` is :class:`gpt2mha.api.GPT2`.
"""

import importlib

#: The model every command uses when no ``--model`` is given (shipped in the package).
DEFAULT_MODEL = "shakespeare-byte"

from .version import __version__

#: public name → the submodule that defines it
_LAZY = {
    "CausalSelfAttention": "core.attention", "Conv1D": "core.attention", "attention_mask": "core.attention",
    "split_heads": "core.attention", "merge_heads": "core.attention",
    "CausalAttention": "learn.book", "MultiHeadAttentionWrapper": "learn.book", "MultiHeadAttention": "learn.book",
    "KVCache": "core.kv_cache", "HookPoint": "core.hooks", "ActivationCache": "learn.activations",
    "GPT2": "api", "GPT2Classifier": "api", "ClassifierConfig": "core.classifier", "GPT2Config": "core.model", "GPT2Output": "core.model", "PRESETS": "core.model",
}

__all__ = [*_LAZY, "DEFAULT_MODEL"]


def __getattr__(name: str):
    """Import the submodule that defines ``name`` on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpt2mha' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value                                     # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
