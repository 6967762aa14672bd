"""gpt2mha: GPT-2's multi-head causal self-attention, exact and fast, with the model around it.

The public names below are imported on first use (PEP 562 module ``__getattr__``), so
``import gpt2mha`` and the ``gpt2mha`` command's ``--help``/``--version`` do not load torch;
``from gpt2mha import GPT2`` works as usual and imports it then.
"""

import importlib

#: The model every command uses when no ``--model`` is given (shipped in the package).
DEFAULT_MODEL = "shakespeare-byte"

__version__ = "0.1.0"

#: public name → the submodule that defines it
_LAZY = {
    "CausalSelfAttention": "attention", "Conv1D": "attention", "attention_mask": "attention",
    "split_heads": "attention", "merge_heads": "attention",
    "CausalAttention": "book", "MultiHeadAttentionWrapper": "book", "MultiHeadAttention": "book",
    "KVCache": "kv_cache",
    "GPT2": "model", "GPT2Config": "model", "GPT2Output": "model", "PRESETS": "model",
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
