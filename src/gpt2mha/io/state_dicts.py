"""The canonical state dict (gpt2mha's names, Conv1D layout: ``h.{i}.attn.c_attn.weight`` …)
and the model it becomes: the last two steps of every load (:mod:`.registry`). Every format's
reader returns a :class:`Checkpoint`; :func:`canonical` normalises its keys once;
:func:`build_model` checks every tensor against the model, then copies each into the model's
dtype (the one dtype conversion of the load).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, NamedTuple

import torch

from ..core.classifier import ClassifierConfig, GPT2Classifier
from ..core.model import GPT2, GPT2Config


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or tensor."""


class CheckpointWarning(UserWarning):
    """A checkpoint that loads, but not the way its files say (e.g. TF's ``checkpoint`` file
    naming another directory's files)."""


IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class Checkpoint(NamedTuple):
    """A checkpoint as a format's reader returns it (:class:`~.registry.CheckpointFormat`).

    Attributes:
        state_dict: the tensors, in the file's dtypes, named as gpt2mha names them or as
            Hugging Face's files do (``transformer.`` prefixes, the legacy ``attn.bias``
            buffers: :func:`canonical` drops them).
        config: the model's :class:`~gpt2mha.core.model.GPT2Config` (a
            :class:`~gpt2mha.core.classifier.ClassifierConfig` for a classifier).
        source: the file errors name.
        quantization: config.json's ``gpt2mha.quantization`` entry when the tensors are a
            quantized model's (:mod:`gpt2mha.inference.quant.checkpoint`), else None.
        builder: ``builder(checkpoint, dtype, model_cls) -> model`` when the format builds its
            own model (a quantized one); None: :func:`build_model`'s float model.
        format: the name of the format that read it (``"hf"``, ``"openai"``, ``"book"``,
            ``"nanogpt"``), set by the registry.
    """

    state_dict: dict[str, torch.Tensor]
    config: GPT2Config
    source: str
    quantization: dict | None = None
    builder: Callable | None = None
    format: str | None = None


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
    """Compare ``sd`` with the model's parameters (names and shapes) before copying anything.

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


def canonical(checkpoint: Checkpoint) -> Checkpoint:
    """A reader's checkpoint in gpt2mha's names, done once per load: :func:`normalize_keys`,
    then (a float model's) the LM head decided as transformers decides it
    (:func:`resolve_lm_head`); a quantized checkpoint's head is the quantized format's to read.

    Raises:
        CheckpointError: see :func:`normalize_keys`.
    """
    sd = normalize_keys(checkpoint.state_dict, checkpoint.source)
    config = checkpoint.config
    if checkpoint.quantization is None:
        sd, config = resolve_lm_head(sd, config, checkpoint.source)
    return checkpoint._replace(state_dict=sd, config=config)


def build_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, model_cls=GPT2) -> GPT2:
    """The model of a canonical :class:`Checkpoint` (:func:`canonical`), in ``dtype``, eval mode:
    the checkpoint's own ``builder`` when it has one (a quantized model), else a model of
    :func:`model_class` built on the meta device, every tensor checked
    (:func:`check_state_dict`) before any is copied, then each copied once into its parameter,
    which converts it from the file's dtype to ``dtype`` (the one conversion of the load).

    Raises:
        CheckpointError: see :func:`model_class`, :func:`check_state_dict`; a value that
            overflows ``dtype`` (e.g. beyond float16's ±65504), naming the tensors.
    """
    if checkpoint.builder is not None:
        return checkpoint.builder(checkpoint, dtype, model_cls)
    sd, config, source = checkpoint.state_dict, checkpoint.config, checkpoint.source
    with torch.device("meta"):
        model = model_class(config, model_cls, source)(config).to(dtype)
    check_state_dict(model, sd, source)
    model = model.to_empty(device="cpu")
    model.load_state_dict(sd, strict=True)
    if dtype != torch.float32:                                   # every tensor was finite (check_state_dict)
        state = model.state_dict()
        overflow = [k for k in sd if not bool(torch.isfinite(state[k]).all())]
        if overflow:
            raise CheckpointError(f"{source}: values of {', '.join(overflow)} overflow {dtype}; load in float32")
    return model.eval()


def model_from_state_dict(sd: dict[str, torch.Tensor], config: GPT2Config, source: str,
                          dtype: torch.dtype = torch.float32, model_cls=GPT2) -> GPT2:
    """A model of ``model_cls`` in eval mode from a state dict in gpt2mha's names (Conv1D
    layout): :func:`build_model` of ``Checkpoint(sd, config, source)``.

    Raises:
        CheckpointError: see :func:`build_model`.
    """
    return build_model(Checkpoint(sd, config, source), dtype, model_cls)


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


def detached_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's state dict, detached, keys as the model names them."""
    return {k: v.detach() for k, v in sd.items()}
