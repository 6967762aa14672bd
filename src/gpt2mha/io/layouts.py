"""What a format's reader needs on its way to the canonical state dict (:mod:`.state_dicts`):
exact conversions of whole-model state dicts between GPT-2's Conv1D layout (``[in, out]``, used
as ``x @ W + b``) and nn.Linear's (``[out, in]``), the wrapper's key prefixes (``torch.compile``,
DDP), the check of a file's tensors by the format's own names and shapes before anything is
mapped, the head tied to ``wte`` when it is a copy, and the book's state dict inside a loaded
file. The attention modules' own conversions (the book's classes and GPT-2's fused attention)
are :mod:`gpt2mha.learn.attention_layouts`.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from ..core.model import GPT2Config
from .state_dicts import CheckpointError

#: The four weights per block that GPT-2 stores as Conv1D ``[in, out]`` and nn.Linear as
#: ``[out, in]`` (nanoGPT's ``from_pretrained`` transposes exactly these).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK_KEY = re.compile(r"^((?:transformer\.)?h\.(\d+)\.)(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")

#: Prefixes that wrappers add to every key of the model they wrap: ``torch.compile``
#: (``_orig_mod.``) and DataParallel / DistributedDataParallel (``module.``).
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def strip_wrapper_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the prefixes of :data:`WRAPPER_PREFIXES` (``_orig_mod.``, ``module.``, also nested)
    that every key of a wrapped model's state dict carries; returns a new dict.

    Raises:
        ValueError: only some keys carry such a prefix (naming the prefix and a key with and
            one without it): the dict mixes two models, and guessing could drop weights.
    """
    out = dict(sd)
    while out:
        prefix = next((p for p in WRAPPER_PREFIXES if any(k.startswith(p) for k in out)), None)
        if prefix is None:
            return out
        without = [k for k in out if not k.startswith(prefix)]
        if without:
            with_ = next(k for k in out if k.startswith(prefix))
            raise ValueError(f"some keys carry the wrapper prefix {prefix!r} (e.g. {with_!r}) and others do not "
                             f"(e.g. {without[0]!r}); refusing to guess which model each belongs to")
        out = {k[len(prefix):]: v for k, v in out.items()}
    return out


def _convert_state_dict(sd: dict[str, torch.Tensor], to_linear: bool) -> dict[str, torch.Tensor]:
    src = "Conv1D [in, out]" if to_linear else "nn.Linear [out, in]"
    sd = strip_wrapper_prefixes(sd)
    unknown = [k for k in sd if k.endswith(CONV1D_WEIGHTS) and not _BLOCK_KEY.match(k)]
    if unknown:
        prefix = unknown[0][:unknown[0].index(next(w for w in CONV1D_WEIGHTS if unknown[0].endswith(w)))]
        raise ValueError(f"{unknown[0]}: the prefix {prefix!r} is not a GPT-2 block's ('h.{{i}}.' or "
                         f"'transformer.h.{{i}}.'); strip it first, nothing was converted")
    out, blocks = dict(sd), {}
    for key in sd:
        m = _BLOCK_KEY.match(key)
        if m:
            blocks.setdefault(m.group(1), {})[m.group(3)] = key
    wte = sd.get("wte.weight", sd.get("transformer.wte.weight"))
    for prefix, names in blocks.items():
        ln = sd.get(prefix + "ln_1.weight")
        C = ln.shape[0] if ln is not None else (wte.shape[1] if wte is not None else None)
        shapes = {k: tuple(sd[v].shape) for k, v in names.items()}
        for k, s in shapes.items():
            if len(s) != 2:
                raise ValueError(f"{names[k]} has shape {list(s)}; expected a 2-D {src} weight")
        conv = {k: s if to_linear else s[::-1] for k, s in shapes.items()}   # as Conv1D [in, out]
        if C is None:                                      # no ln_1 / wte: read n_embd off the weights
            C = next(s[1] if k == "mlp.c_proj" else s[0] for k, s in conv.items())
        F = conv.get("mlp.c_fc", (None, None))[1] or conv.get("mlp.c_proj", (None, None))[0]
        expected = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, F), "mlp.c_proj": (F, C)}
        for k, s in conv.items():
            if s != expected[k]:
                want = expected[k] if to_linear else expected[k][::-1]
                raise ValueError(f"{names[k]} has shape {list(shapes[k])}; expected {list(want)} in the "
                                 f"{src} layout (n_embd={C}, MLP width={F})")
        for key in names.values():
            out[key] = sd[key].t().contiguous()
    return out


def conv1d_to_linear_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 state dict in Conv1D layout (OpenAI, transformers, gpt2mha) → nn.Linear layout (nanoGPT).

    Exactly the four Conv1D weights per block are transposed: ``h.{i}.attn.c_attn.weight``
    ``[C, 3C]`` → ``[3C, C]``, ``attn.c_proj.weight [C, C]``, ``mlp.c_fc.weight [C, 4C]`` →
    ``[4C, C]``, ``mlp.c_proj.weight [4C, C]`` → ``[C, 4C]``; keys may carry a
    ``transformer.`` prefix; every other tensor (biases, LayerNorms, wte, wpe, lm_head, legacy
    ``attn.bias`` buffers) is passed through unchanged. Returns a new dict. The key prefixes
    of ``torch.compile`` (``_orig_mod.``) and DDP (``module.``) are stripped first
    (:func:`strip_wrapper_prefixes`), so the result's keys are the plain model's.

    Raises:
        ValueError: a Conv1D weight whose shape does not fit n_embd (from ``ln_1.weight`` or
            ``wte.weight``) and the MLP width, e.g. a state dict already in Linear layout; a
            block weight under any other prefix (named: nothing would be transposed); keys
            only some of which carry a wrapper prefix.
    """
    return _convert_state_dict(sd, to_linear=True)


def linear_to_conv1d_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nn.Linear-layout GPT-2 state dict (nanoGPT) → Conv1D layout; inverse of :func:`conv1d_to_linear_state_dict`.

    A ``torch.compile``'d nanoGPT's keys (``_orig_mod.transformer.h.0.…``) and DDP's
    (``module.…``) lose that prefix; the result's keys are the plain model's.

    Raises:
        ValueError: a weight whose shape does not fit the nn.Linear ``[out, in]`` layout, a
            block weight under an unknown prefix (named), or a mix of prefixed and plain keys.
    """
    return _convert_state_dict(sd, to_linear=False)


def check_tensors(shapes: dict[str, tuple], expected: dict[str, tuple], source: str,
                  optional: dict[str, tuple] | None = None) -> None:
    """Every name of ``expected`` present with its shape and nothing else (``optional`` names
    may be absent); names are the format's own. ``shapes``: name → shape of what the file holds.
    (Dtypes and finiteness are checked after mapping, by :func:`~.state_dicts.check_state_dict`.)

    Raises:
        CheckpointError: listing every missing, unexpected or mis-shaped tensor.
    """
    optional = optional or {}
    problems = [f"missing tensor {k} {list(s)}" for k, s in expected.items() if k not in shapes]
    problems += [f"unexpected tensor {k} {list(s)}" for k, s in shapes.items() if k not in expected and k not in optional]
    for k, s in shapes.items():
        want = expected.get(k, optional.get(k))
        if want is not None and tuple(s) != tuple(want):
            problems.append(f"{k}: shape {list(s)} != expected {list(want)}")
    if problems:
        raise CheckpointError(f"{source}: cannot load:\n  " + "\n  ".join(problems))


def tensor_shapes(sd: dict) -> dict[str, tuple]:
    """name → shape; a value that is not a tensor is reported by name."""
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{', '.join(map(str, bad[:5]))}: not tensors; expected a state dict")
    return {k: tuple(v.shape) for k, v in sd.items()}


def tie_head(sd: dict[str, torch.Tensor], config: GPT2Config) -> tuple[dict, GPT2Config]:
    """Tie ``lm_head.weight`` to ``wte.weight`` when they are equal (drop it), else untie the
    config (``tie_word_embeddings=False``): the book's ``out_head`` is its own parameter."""
    sd = dict(sd)
    head = sd.pop("lm_head.weight", None)
    if head is None or torch.equal(head, sd["wte.weight"]):
        return sd, dataclasses.replace(config, tie_word_embeddings=True)
    sd["lm_head.weight"] = head
    return sd, dataclasses.replace(config, tie_word_embeddings=False)


def book_config_path(path: str) -> str:
    """Where the config dict of a book checkpoint ``DIR/NAME.pth`` lives: ``DIR/NAME.json``."""
    return os.path.splitext(path)[0] + ".json"


def book_state_dict_of(obj):
    """The state dict inside a loaded book checkpoint (a plain state dict, or chapter 5's
    ``{"model_state_dict": ...}``), with the per-head wrapper's prefixes stripped; None when
    ``obj`` is neither.

    Raises:
        CheckpointError: the wrapper's keys cannot be read (:func:`strip_wrapper_prefixes`).
    """
    if isinstance(obj, dict) and isinstance(obj.get("model_state_dict"), dict):
        obj = obj["model_state_dict"]                             # ch. 5's model_and_optimizer.pth
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and obj:
        try:
            return strip_wrapper_prefixes(obj)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return None


def is_book_lora(sd: dict) -> bool:
    """Whether a book state dict holds appendix E's ``LinearWithLoRA`` layers (``….lora.A``)."""
    return any(k.endswith(".lora.A") for k in sd)
