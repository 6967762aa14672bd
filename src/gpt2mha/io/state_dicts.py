"""State dicts in gpt2mha's names (Conv1D layout, ``h.{i}.attn.c_attn.weight`` …): the checks
every reader runs before anything is copied, and the model they become. Every checkpoint format
(:mod:`.checkpoints`, :mod:`.openai_tf`, :mod:`.learner_formats`) ends here.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings

import torch
from safetensors.torch import load_file

from ..core.classifier import ClassifierConfig, GPT2Classifier
from ..core.model import GPT2, GPT2Config
from .layouts import strip_wrapper_prefixes


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or tensor."""


IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


#: dtype names accepted wherever a dtype is given as text (API and CLI).
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def as_dtype(dtype) -> torch.dtype:
    """A floating torch dtype from a dtype or one of :data:`DTYPE_NAMES` (``"bf16"``, …).

    Raises:
        ValueError: naming the value and the accepted names.
    """
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype={dtype!r}; expected a floating torch dtype or one of {sorted(DTYPE_NAMES)}")


def normalize_keys(sd: dict[str, torch.Tensor], source: str = "state dict") -> dict[str, torch.Tensor]:
    """Drop the ``transformer.`` prefix and the legacy attention buffers (``lm_head.weight`` is
    kept: :func:`resolve_lm_head` decides what it is).

    Raises:
        CheckpointError: a tensor present under both spellings.
    """
    out = {}
    for key, t in sd.items():
        short = key.removeprefix("transformer.")
        if short.endswith(IGNORED_SUFFIXES):
            continue
        if short in out:
            raise CheckpointError(f"{source}: tensor {short} appears twice (as {short} and transformer.{short}); "
                                  f"refusing to guess which one is meant")
        out[short] = t
    return out


def resolve_lm_head(sd: dict[str, torch.Tensor], config: GPT2Config,
                    source: str = "state dict") -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """Decide what a checkpoint's ``lm_head.weight [n_vocab, n_embd]`` is, as transformers does.

    - tied config, ``lm_head.weight`` only: it is the tied weight, read as ``wte.weight``
      (``safetensors.torch.save_model`` keeps one name per shared tensor);
    - tied config, both present and equal: the head copy is dropped;
    - tied config, both present and different: the model is untied
      (``tie_word_embeddings=False``, with a warning), so no tensor is ever dropped;
    - untied config: both are kept (a missing one is reported by :func:`check_state_dict`).

    Returns:
        ``(state dict, config)``, the config untied where needed.
    """
    if "lm_head.weight" not in sd or not config.tie_word_embeddings:
        return sd, config
    sd = dict(sd)
    head = sd.pop("lm_head.weight")
    if "wte.weight" not in sd:
        sd["wte.weight"] = head
        return sd, config
    wte = sd["wte.weight"]
    if head.shape == wte.shape and torch.equal(head, wte):
        return sd, config
    diff = (head.float() - wte.float()).abs().max().item() if head.shape == wte.shape else "shapes differ"
    warnings.warn(f"{source}: lm_head.weight differs from wte.weight (max abs difference {diff}) although the "
                  f"config ties them; loading a separate LM head (tie_word_embeddings=False), as transformers does",
                  stacklevel=3)
    sd["lm_head.weight"] = head
    return sd, dataclasses.replace(config, tie_word_embeddings=False)


def check_state_dict(model: GPT2, sd: dict[str, torch.Tensor], source: str) -> None:
    """Compare ``sd`` with the model's parameters before copying anything.

    Raises:
        CheckpointError: listing every missing, unexpected or mis-shaped tensor (with both
            shapes), a non-floating dtype, or a tensor holding NaN/inf (with its name).
    """
    expected = model.state_dict()
    summary = config_mismatch(model.config, sd)
    problems = [f"missing tensor {k} {list(v.shape)}" for k, v in expected.items() if k not in sd]
    problems += [f"unexpected tensor {k} {list(v.shape)}" for k, v in sd.items() if k not in expected]
    for k, t in sd.items():
        if k not in expected:
            continue
        if t.shape != expected[k].shape:
            problems.append(f"{k}: checkpoint shape {list(t.shape)} != model shape {list(expected[k].shape)}")
        elif not t.is_floating_point():
            problems.append(f"{k}: dtype {t.dtype} is not a floating-point type")
        elif not torch.isfinite(t).all():
            problems.append(f"{k}: contains NaN or inf values")
    if problems:
        head = f"{source}: cannot load" + (f": {summary}" if summary else "")
        if len(problems) > 12:
            problems = problems[:10] + [f"... and {len(problems) - 10} more"]
        raise CheckpointError(head + ":\n  " + "\n  ".join(problems))


def config_mismatch(config: GPT2Config, sd: dict[str, torch.Tensor]) -> str:
    """One line saying which config sizes the weights contradict, e.g. ``config.json says
    n_embd=64 but the weights have n_embd=48 (wte.weight [300, 48])``; "" when none do."""
    said = []
    wte, wpe = sd.get("wte.weight"), sd.get("wpe.weight")
    if wte is not None and wte.dim() == 2:
        for name, want, have in (("n_vocab", config.n_vocab, wte.shape[0]), ("n_embd", config.n_embd, wte.shape[1])):
            if want != have:
                said.append(f"{name}={want} but the weights have {name}={have} (wte.weight {list(wte.shape)})")
    if wpe is not None and wpe.dim() == 2 and wpe.shape[0] != config.n_ctx:
        said.append(f"n_ctx={config.n_ctx} but the weights have n_ctx={wpe.shape[0]} (wpe.weight {list(wpe.shape)})")
    layers = {int(k.split(".")[1]) for k in sd if k.startswith("h.") and k.split(".")[1].isdigit()}
    if layers and max(layers) + 1 != config.n_layer:
        said.append(f"n_layer={config.n_layer} but the weights have {max(layers) + 1} blocks (h.0 … h.{max(layers)})")
    return ("config.json says " + "; ".join(said)) if said else ""


def load_into(model: GPT2, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> GPT2:
    """Fill a model built on the meta device with ``sd`` (checked by :func:`check_state_dict`):
    real storage on the CPU, float32 values converted to ``dtype``; eval mode."""
    model = model.to_empty(device="cpu")
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.to(dtype).eval()


class CheckpointWarning(UserWarning):
    """A checkpoint that loads, but not the way its files say (e.g. TF's ``checkpoint`` file
    naming another directory's files)."""


def check_tensors(shapes: dict[str, tuple], expected: dict[str, tuple], source: str,
                  optional: dict[str, tuple] | None = None) -> None:
    """Every name of ``expected`` present with its shape and nothing else (``optional`` names
    may be absent); names are the format's own. ``shapes``: name → shape of what the file holds.
    (Dtypes and finiteness are checked after mapping, by :func:`model_from_state_dict`.)

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


def model_from_state_dict(sd: dict[str, torch.Tensor], config: GPT2Config, source: str,
                          dtype: torch.dtype = torch.float32, model_cls=GPT2) -> GPT2:
    """A model of ``model_cls`` in eval mode from a state dict in gpt2mha's names (Conv1D layout).

    Raises:
        CheckpointError: see :func:`gpt2mha.io.checkpoints.check_state_dict`.
    """
    with torch.device("meta"):
        model = model_class(config, model_cls, source)(config)
    check_state_dict(model, sd, source)
    return load_into(model, sd, dtype)


def model_class(config: GPT2Config, model_cls=GPT2, source: str = "checkpoint") -> type:
    """The class a loader builds for ``config``: ``model_cls`` for a language model; for a
    :class:`~gpt2mha.core.classifier.ClassifierConfig`, ``model_cls`` when it is a classifier
    class, else its ``classifier_class`` attribute (the public ``gpt2mha.GPT2`` names
    ``gpt2mha.GPT2Classifier`` there), else the core :class:`~gpt2mha.core.classifier.GPT2Classifier`.

    Raises:
        CheckpointError: a classifier class asked for a language model's checkpoint.
    """
    if isinstance(config, ClassifierConfig):
        if issubclass(model_cls, GPT2Classifier):
            return model_cls
        return getattr(model_cls, "classifier_class", None) or GPT2Classifier
    if issubclass(model_cls, GPT2Classifier):
        raise CheckpointError(f"{source}: a language model (its head has n_vocab={config.n_vocab} outputs), not a "
                              f"classifier; load it with GPT2.from_pretrained")
    return model_cls


def read_torch_file(path: str):
    """``torch.load(path, map_location="cpu", weights_only=True)`` with errors naming the file.

    Raises:
        CheckpointError: unreadable, truncated, or a pickle that asks to run code.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: this pickle asks to run code or build objects other than tensors "
                              f"and plain containers ({str(e).splitlines()[-1] if str(e) else 'unsafe'})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
    except Exception as e:
        raise CheckpointError(f"{path}: could not be read with torch.load (truncated or corrupt?): {e}") from None


def detached_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's state dict, detached, keys as the model names them."""
    return {k: v.detach() for k, v in sd.items()}


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, or of a ``.bin`` read with ``weights_only=True``.

    Raises:
        CheckpointError: truncated/corrupt file, or a pickle that would run code.
    """
    if path.endswith(".safetensors"):
        try:
            return load_file(path)
        except Exception as e:  # safetensors raises its own SafetensorError on bad headers/lengths
            raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: this pickle asks to run code or build objects other than "
                              f"tensors ({str(e).splitlines()[-1] if str(e) else 'unsafe'}); convert it to "
                              f"safetensors from a trusted source") from None
    except Exception as e:
        raise CheckpointError(f"{path}: could not be read as a PyTorch state dict (truncated or corrupt?): {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors")
    return sd


def book_config_path(path: str) -> str:
    """Where the config dict of a book checkpoint ``DIR/NAME.pth`` lives: ``DIR/NAME.json``."""
    return os.path.splitext(path)[0] + ".json"


def book_state_dict_of(obj):
    """The state dict inside a loaded book checkpoint (a plain state dict, or chapter 5's
    ``{"model_state_dict": ...}``), with the per-head wrapper's prefixes stripped; None when
    ``obj`` is neither.

    Raises:
        CheckpointError: the wrapper's keys cannot be read (:func:`~gpt2mha.io.layouts.strip_wrapper_prefixes`).
    """
    if isinstance(obj, dict) and isinstance(obj.get("model_state_dict"), dict):
        obj = obj["model_state_dict"]                             # ch. 5's model_and_optimizer.pth
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and obj:
        try:
            return strip_wrapper_prefixes(obj)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return None
