"""transformers' ``GPT2ForSequenceClassification`` directories, read and written.

The directory is a GPT-2 checkpoint (:mod:`.checkpoints`) whose ``config.json`` says
``"architectures": ["GPT2ForSequenceClassification"]`` with ``id2label`` (the label names,
``num_labels`` of them), ``pad_token_id``, and whose weights hold ``score.weight [num_labels,
n_embd]`` (``nn.Linear(n_embd, num_labels, bias=False)``) instead of an LM head. It becomes a
:class:`~gpt2mha.core.classifier.GPT2Classifier` with ``pooling="last_non_pad"`` (transformers
reads the last token that is not ``pad_token_id``); gpt2mha's own settings (another pooling, the
book's ``max_length``) ride in ``config.json``'s ``gpt2mha`` section. ``score.weight`` is
gpt2mha's ``lm_head.weight``, copied as it is.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.classifier import POOLINGS, ClassifierConfig
from ..core.model import GPT2Config
from .learner_formats import id2label_names
from .state_dicts import CheckpointError

#: transformers' class name in ``config.json``'s ``architectures``.
HF_CLASSIFIER = "GPT2ForSequenceClassification"


def is_hf_classifier(cfg: dict, sd: dict[str, torch.Tensor]) -> bool:
    """Whether a Hugging Face directory (``config.json`` dict, tensors) is a sequence classifier:
    its ``architectures`` name :data:`HF_CLASSIFIER`, or it holds ``score.weight``."""
    return HF_CLASSIFIER in (cfg.get("architectures") or ()) or "score.weight" in sd


def classifier_from_hf(cfg: dict, config: GPT2Config, sd: dict[str, torch.Tensor],
                       source: str) -> tuple[dict[str, torch.Tensor], ClassifierConfig]:
    """A ``GPT2ForSequenceClassification`` checkpoint's (tensors, config) in gpt2mha's names:
    ``score.weight``/``score.bias`` → ``lm_head.weight``/``lm_head.bias``; the config a
    :class:`~gpt2mha.core.classifier.ClassifierConfig` (labels from ``id2label``, pad id,
    pooling).

    Raises:
        CheckpointError: one line naming the file and the tensor: no ``score.weight``, one
            that is not ``[num_labels, n_embd]``, a ``score.bias`` of another length, an
            ``id2label`` that does not name each output once, an unknown pooling.
    """
    w, b = sd.get("score.weight"), sd.get("score.bias")
    if w is None:
        raise CheckpointError(f"{source}: config.json names {HF_CLASSIFIER} but there is no score.weight tensor")
    if w.dim() != 2 or w.shape[1] != config.n_embd:
        raise CheckpointError(f"{source}: score.weight has shape {list(w.shape)}; expected [num_labels, "
                              f"n_embd={config.n_embd}]")
    n = w.shape[0]
    if b is not None and tuple(b.shape) != (n,):
        raise CheckpointError(f"{source}: score.bias has shape {list(b.shape)}; expected [{n}], one per row of "
                              f"score.weight {list(w.shape)}")
    extra = cfg.get("gpt2mha") or {}
    labels = None
    if isinstance(cfg.get("id2label"), dict) and cfg["id2label"]:
        labels = id2label_names(cfg["id2label"], n, source)
    if labels is not None and labels == [f"LABEL_{i}" for i in range(n)]:
        labels = None                                            # transformers' default names
    pooling = extra.get("pooling", "last_non_pad")
    if pooling not in POOLINGS:
        raise CheckpointError(f"{source}: gpt2mha.pooling={pooling!r}; expected one of {POOLINGS}")
    pad = cfg.get("pad_token_id")
    try:
        config = ClassifierConfig(**{**dataclasses.asdict(config), "tie_word_embeddings": False}, n_labels=n,
                                  head_bias=b is not None, labels=labels, pad_token_id=pad, pooling=pooling,
                                  max_length=extra.get("max_length"))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    sd = {("lm_head." + k.removeprefix("score.")) if k.startswith("score.") else k: v for k, v in sd.items()
          if k != "lm_head.weight"}
    return sd, config


def classifier_to_hf(config: ClassifierConfig, hf_config: dict) -> dict:
    """``config.json`` of a classifier: :func:`~gpt2mha.io.checkpoints.config_to_hf`'s with
    ``architectures`` :data:`HF_CLASSIFIER`, ``id2label``/``label2id``, ``pad_token_id``, and
    gpt2mha's ``pooling``/``max_length``.

    Raises:
        ValueError: the head has a bias (the book's ``nn.Linear``), which transformers' ``score``
            has no place for: nothing is written.
    """
    if config.head_bias:
        raise ValueError("this classifier's head has a bias (the book's chapter-6 nn.Linear), which transformers' "
                         "GPT2ForSequenceClassification (score, bias=False) cannot hold: write the book's format "
                         "instead (gpt2mha convert SRC DST.pth --to book)")
    names = config.label_names
    return {**hf_config, "architectures": [HF_CLASSIFIER], "id2label": {str(i): x for i, x in enumerate(names)},
            "label2id": {x: i for i, x in enumerate(names)}, "pad_token_id": config.pad_token_id,
            "tie_word_embeddings": False,
            "gpt2mha": {**hf_config["gpt2mha"], "pooling": config.pooling, "max_length": config.max_length}}


def classifier_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A classifier's state dict by transformers' names (``transformer.…``, ``score.weight``)."""
    return {("score." + k.removeprefix("lm_head.")) if k.startswith("lm_head.") else f"transformer.{k}": v
            for k, v in sd.items()}
