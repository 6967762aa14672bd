"""GPT-2 as a sequence classifier: the same model with its LM head replaced by a small linear
head of ``n_labels`` outputs, read at one position of each sequence.

Two conventions exist, and both are exact here:

* the book's (chapter 6, ``gpt_class_finetune.py``): ``model.out_head = nn.Linear(emb_dim,
  num_classes)`` (with a bias), trained and used on ``model(input_batch)[:, -1, :]``, the last
  position of the sequence as given (the book pads every text to the training set's
  ``max_length`` with ``pad_token_id=50256``, so that position may be a pad token): ``pooling="last"``;
* transformers' ``GPT2ForSequenceClassification``: ``score = nn.Linear(n_embd, num_labels,
  bias=False)`` read at the last token that is not ``pad_token_id`` (``(arange(T) · (ids !=
  pad)).argmax(-1)``; without a pad id, the last position): ``pooling="last_non_pad"``.

Design: :class:`GPT2Classifier` is :class:`~gpt2mha.core.model.GPT2` whose ``lm_head`` is a
:class:`ClassifierHead` (``weight [n_labels, n_embd]``, an optional ``bias [n_labels]``), so the
blocks, the capture points and every checkpoint name but the head's are the language model's;
the forward returns ``logits [B, T, n_labels]`` at every position and :meth:`GPT2Classifier.pooled`
picks one position per row. The settings travel in :class:`ClassifierConfig`, a
:class:`~gpt2mha.core.model.GPT2Config` with the head's fields, so a loader builds either model
from its config alone. The core LM is untouched by any of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .model import GPT2, GPT2Config, logits_dtype

#: ``"last"``: the last position (the book); ``"last_non_pad"``: the last token that is not
#: ``pad_token_id`` (transformers' ``GPT2ForSequenceClassification``).
POOLINGS = ("last", "last_non_pad")


@dataclass
class ClassifierConfig(GPT2Config):
    """A :class:`~gpt2mha.core.model.GPT2Config` plus the classifier head's settings.

    Attributes:
        n_labels: outputs of the head (C).
        head_bias: whether the head has a bias (the book's ``nn.Linear`` does, transformers'
            ``score`` does not).
        labels: the label names, one per output (None: ``LABEL_0`` …, as transformers names them).
        pad_token_id: the padding id (transformers' ``config.pad_token_id``; the book pads with
            50256); None: none.
        pooling: one of :data:`POOLINGS`.
        max_length: the book's convention of padding every text to the training set's length
            (``classify_review(..., max_length=train_dataset.max_length)``); None: no padding.
        tie_word_embeddings: always False (the head is not ``wte``).

    Raises:
        ValueError: naming the field: ``n_labels`` < 1, labels of another count or not strings,
            an unknown pooling, a pad id outside the vocabulary, a ``max_length`` outside
            ``[1, n_ctx]`` or without a pad id, a tied head.
    """

    n_labels: int = 2
    head_bias: bool = False
    labels: tuple[str, ...] | None = None
    pad_token_id: int | None = None
    pooling: str = "last"
    max_length: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.n_labels, bool) or not isinstance(self.n_labels, int) or self.n_labels < 1:
            raise ValueError(f"n_labels={self.n_labels!r} must be an integer >= 1")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True: a classifier's head is its own matrix, not wte")
        if not isinstance(self.head_bias, bool):
            raise ValueError(f"head_bias={self.head_bias!r} must be True or False")
        if self.labels is not None:
            self.labels = tuple(self.labels)
            if len(self.labels) != self.n_labels or not all(isinstance(x, str) for x in self.labels):
                raise ValueError(f"labels={list(self.labels)!r}: expected {self.n_labels} names (strings), one per "
                                 f"output of the head")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r}; expected one of {POOLINGS}")
        if self.pad_token_id is not None and (isinstance(self.pad_token_id, bool) or not isinstance(
                self.pad_token_id, int) or not 0 <= self.pad_token_id < self.n_vocab):
            raise ValueError(f"pad_token_id={self.pad_token_id!r} must be an id in [0, n_vocab={self.n_vocab})")
        if self.max_length is not None:
            if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or not (
                    1 <= self.max_length <= self.n_ctx):
                raise ValueError(f"max_length={self.max_length!r} must be an integer in [1, n_ctx={self.n_ctx}]")
            if self.pad_token_id is None:
                raise ValueError(f"max_length={self.max_length} pads with pad_token_id, which is not set")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ClassifierConfig":
        """A :data:`~gpt2mha.core.model.PRESETS` model's sizes with the head's fields (``n_labels=…``).

        Raises:
            ValueError: unknown preset name, or a bad field (see the class).
        """
        base = GPT2Config.from_preset(name)
        return cls(**{**dataclasses.asdict(base), "tie_word_embeddings": False, **overrides})

    @property
    def label_names(self) -> tuple[str, ...]:
        """``labels``, or transformers' default names ``LABEL_0`` … ``LABEL_{C-1}``."""
        return self.labels if self.labels is not None else tuple(f"LABEL_{i}" for i in range(self.n_labels))


class ClassifierHead(nn.Module):
    """``x @ weightᵀ (+ bias)``, ``[B, T, n_embd]`` → ``[B, T, n_labels]``, computed and
    returned in float32 (float64 for float64) whatever the model's dtype, as
    :class:`~gpt2mha.core.model.LMHead`. ``weight [n_labels, n_embd]`` (nn.Linear's layout, the
    book's ``out_head`` and transformers' ``score``), ``bias [n_labels]`` or None."""

    def __init__(self, n_embd: int, n_labels: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_labels, n_embd))
        self.bias = nn.Parameter(torch.zeros(n_labels)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = logits_dtype(self.weight.dtype)
        return F.linear(x.to(acc), self.weight.to(acc), None if self.bias is None else self.bias.to(acc))


def pooled_positions(idx: torch.Tensor, lengths: torch.Tensor, config: ClassifierConfig) -> torch.Tensor:
    """The position read in each row of ``idx [B, T]`` (int64 ``[B]``).

    ``lengths [B]``: each row's real tokens (the rest is right padding added to batch rows of
    different lengths, which a causal model's earlier positions never see). ``"last"``: position
    ``length - 1`` (the book's ``[:, -1, :]`` of the row alone); ``"last_non_pad"``: the last
    position among the row's own tokens whose id is not ``pad_token_id``, 0 when all are
    (transformers' rule; without a pad id, the last).
    """
    T = idx.shape[1]
    if config.pooling == "last" or config.pad_token_id is None:
        return lengths - 1
    pos = torch.arange(T, device=idx.device)
    real = (idx != config.pad_token_id) & (pos[None, :] < lengths[:, None])
    return (pos[None, :] * real).argmax(-1)


class GPT2Classifier(GPT2):
    """GPT-2 with a :class:`ClassifierHead` in ``lm_head``'s place (also reachable as
    ``score``, transformers' name): ``forward`` returns ``logits [B, T, n_labels]``.

    Args:
        config: a :class:`ClassifierConfig`.

    Raises:
        ValueError: ``config`` is not a :class:`ClassifierConfig`.
    """

    def __init__(self, config: ClassifierConfig):
        if not isinstance(config, ClassifierConfig):
            raise ValueError(f"config must be a ClassifierConfig (the head's n_labels and pooling); got "
                             f"{type(config).__name__}")
        super().__init__(config)
        self.lm_head = ClassifierHead(config.n_embd, config.n_labels, config.head_bias)
        with torch.no_grad():                                   # as GPT2.init_weights: normal(0, 0.02), zero bias
            self.lm_head.weight.normal_(0.0, 0.02)

    @property
    def score(self) -> ClassifierHead:
        """The head (transformers' ``GPT2ForSequenceClassification.score``)."""
        return self.lm_head

    def pooled(self, idx: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits ``[B, n_labels]`` (float32) at each row's pooled position
        (:func:`pooled_positions`), ``lengths [B]`` the rows' real tokens (default: all ``T``).

        Raises:
            ValueError: see :meth:`~gpt2mha.core.model.GPT2.forward`; lengths outside ``[1, T]``.
        """
        B, T = idx.shape
        lengths = torch.full((B,), T, dtype=torch.long) if lengths is None else torch.as_tensor(lengths)
        if lengths.shape != (B,) or int(lengths.min()) < 1 or int(lengths.max()) > T:
            raise ValueError(f"lengths must be {B} integers in [1, T={T}]; got {lengths.tolist()}")
        logits = self(idx).logits                                # [B, T, n_labels]
        pos = pooled_positions(idx, lengths.to(idx.device), self.config)
        return logits[torch.arange(B, device=idx.device), pos]
