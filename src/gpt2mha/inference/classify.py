"""Classify texts with a :class:`~gpt2mha.core.classifier.GPT2Classifier`: tokenize, batch,
read the head at each text's pooled position, softmax.

What ``model.classify(texts)``, ``gpt2mha classify`` and the server's ``/v1/classify`` run.
Each text is tokenized alone (no special tokens added, as the book's ``tokenizer.encode`` and
transformers' GPT-2 tokenizer do); rows of a batch are right-padded to the longest, which a
causal model's earlier positions never see, and read at their own pooled position
(:func:`~gpt2mha.core.classifier.pooled_positions`), so a text's logits are those of the text
alone. With the book's ``max_length`` every text is cut to ``min(max_length, n_ctx)`` tokens
and padded to ``max_length`` with ``pad_token_id``, as chapter 6's ``classify_review`` does.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..core.classifier import ClassifierConfig
from ..core.checks import as_int

#: Rows per forward in :func:`classify`.
DEFAULT_BATCH_SIZE = 16


class Classification(NamedTuple):
    """The classification of N texts: ``labels`` (the predicted name of each, the argmax),
    ``probs [N, C]`` and ``logits [N, C]`` (float32, the head's outputs at the pooled position),
    ``n_tokens`` (how many tokens each text was read as, padding excluded)."""

    labels: list[str]
    probs: torch.Tensor
    logits: torch.Tensor
    n_tokens: list[int]


def encode_texts(tokenizer, texts: Sequence, config: ClassifierConfig, max_length: int | None = None,
                 truncate: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Token ids of each text (a string, or a list of ids given as they are), and how many of
    them are the text's own (the rest: the book's padding).

    ``max_length`` (default the config's): the book's padding (cut to ``min(max_length,
    n_ctx)``, padded with ``pad_token_id``); ``truncate``: keep each text's last ``truncate``
    tokens (vLLM's ``truncate_prompt_tokens``).

    Raises:
        ValueError: naming ``texts[i]``: not a string or a list of ids, empty, ids outside the
            vocabulary, longer than the context (without ``truncate``); a bad max_length/truncate.
    """
    max_length = config.max_length if max_length is None else as_int(max_length, "max_length", minimum=1)
    if max_length is not None and config.pad_token_id is None:
        raise ValueError(f"max_length={max_length} pads with the model's pad_token_id, which this model does not have")
    if truncate is not None:
        truncate = as_int(truncate, "truncate", minimum=1)
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
        raise ValueError(f"texts must be a non-empty list of strings (or of token-id lists); got {texts!r}"[:200])
    out, own = [], []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            ids = tokenizer.encode(text)
        elif isinstance(text, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
            ids = list(text)
            bad = [t for t in ids if not 0 <= t < config.n_vocab]
            if bad:
                raise ValueError(f"texts[{i}] has token ids outside [0, n_vocab={config.n_vocab}): {bad[:5]}")
        else:
            raise ValueError(f"texts[{i}] must be a string or a list of token ids; got {type(text).__name__}")
        if truncate is not None:
            ids = ids[-truncate:]
        if max_length is not None:                               # the book's classify_review
            ids = ids[:min(max_length, config.n_ctx)]
            own.append(len(ids))
            ids = ids + [config.pad_token_id] * (max_length - len(ids))
        else:
            own.append(len(ids))
        if not ids:
            raise ValueError(f"texts[{i}] is empty: no token to classify")
        if len(ids) > config.n_ctx:
            raise ValueError(f"texts[{i}] is {len(ids)} tokens, more than the model's context (n_ctx={config.n_ctx}); "
                             f"shorten it or truncate it (truncate=, --truncate)")
        out.append(ids)
    return out, own


@torch.no_grad()
def classify_ids(model, encoded: list[list[int]], n_tokens: list[int] | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> Classification:
    """:class:`Classification` of token-id lists (each within the context), ``batch_size`` rows
    per forward, right-padded (:mod:`module docs <gpt2mha.inference.classify>`); ``n_tokens``:
    the texts' own tokens (default each list's length)."""
    config, device = model.config, model.wte.weight.device
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    logits = []
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start:start + batch_size]
        T = max(len(r) for r in rows)
        idx = torch.tensor([r + [pad] * (T - len(r)) for r in rows], dtype=torch.long, device=device)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
        logits.append(model.pooled(idx, lengths).float().cpu())
    logits = torch.cat(logits)                                    # [N, C]
    probs = logits.softmax(-1)
    names = config.label_names
    n_tokens = [len(r) for r in encoded] if n_tokens is None else list(n_tokens)
    return Classification([names[i] for i in probs.argmax(-1).tolist()], probs, logits, n_tokens)


def classify(model, texts, tokenizer=None, max_length: int | None = None, truncate: int | None = None,
             labels: Sequence[str] | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> Classification:
    """Classify ``texts`` (a string, or a list of strings or token-id lists) with ``model`` (a
    :class:`~gpt2mha.core.classifier.GPT2Classifier` in eval mode).

    Args:
        tokenizer: default the model's (:func:`~gpt2mha.io.tokenizer.tokenizer_for`).
        max_length, truncate: see :func:`encode_texts`.
        labels: names overriding the config's (``--labels``), one per output.
        batch_size: texts per forward.

    Raises:
        ValueError: not a classifier, bad texts (:func:`encode_texts`), labels of another count.
    """
    config = model.config
    if not isinstance(config, ClassifierConfig):
        raise ValueError("this model is a language model (its head has n_vocab outputs), not a classifier: load a "
                         "classifier checkpoint (the book's chapter-6 .pth or a GPT2ForSequenceClassification directory)")
    if labels is not None:
        labels = tuple(labels)
        if len(labels) != config.n_labels:
            raise ValueError(f"labels={list(labels)!r}: this classifier has {config.n_labels} outputs, so it needs "
                             f"{config.n_labels} names")
    if tokenizer is None:
        from ..io.tokenizer import tokenizer_for
        tokenizer = tokenizer_for(config)
    encoded, n_tokens = encode_texts(tokenizer, [texts] if isinstance(texts, str) else texts, config, max_length,
                                     truncate)
    out = classify_ids(model, encoded, n_tokens, batch_size)
    if labels is not None:
        out = out._replace(labels=[labels[i] for i in out.probs.argmax(-1).tolist()])
    return out
