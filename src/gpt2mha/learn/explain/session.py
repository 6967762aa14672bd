"""One model and one sequence as the page sees them: the units it asks for, computed once.

A :class:`ModelEntry` holds a loaded model, its tokenizer and a lock (one computation at a time
per model: the forward's capture points are shared state). A :class:`Sequence` holds a token
sequence (a prompt, then the tokens generated after it), the OpenAI ``past`` of its prefix and
the sampling generator, and answers the page's requests (:meth:`Sequence.unit`), caching each
answer until the sequence changes. The export (:mod:`.export`) asks a :class:`Sequence` the
same questions and writes the answers to files.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

import torch

from ...io.tokenizer import tokenizer_for
from ..interventions import ablate_heads, logit_lens, next_token_shift, parse_heads
from . import heads_view, kv_steps
from .tensors import (capture_layers, check_finite, check_ids, config_dict, encode, head_unit, layer_unit, output_names,
                      pipeline_unit, token_pieces)

#: Layer captures kept per sequence (each is ``[n_head, T, T]`` x2 plus a few ``[T, n_embd]``), and
#: the bytes they may hold together (the last one asked for is always kept): 124M at 1024 tokens
#: is ~110 MB a layer.
KEEP_LAYERS, KEEP_BYTES = 4, 256 << 20
#: Tokens per lens answer: the top tokens of each decoded stream at each position.
LENS_TOP = 3
#: Tokens listed before and after an ablation.
ABLATE_TOP = 10


class ModelEntry:
    """A model the explainer runs: ``model`` (eval mode), ``tok``, ``name`` and ``lock``."""

    def __init__(self, model, name: str):
        if getattr(model, "lora_state", None) is not None:        # adapters unmerged: explained as merged weights
            from ...inference.lora import merged_model
            model = merged_model(model)
        self.model, self.name = model.eval(), name
        self.tok = tokenizer_for(model.config)
        self.lock = threading.RLock()
        self._induction = None

    @property
    def config(self):
        """The model's :class:`~gpt2mha.core.model.GPT2Config`."""
        return self.model.config

    def induction(self):
        """The model's induction scores ``(raw, relative)`` ``[n_layer, n_head]``, computed once."""
        if self._induction is None:
            self._induction = heads_view.model_induction(self.model)
        return self._induction

    def encode_prompt(self, prompt) -> list[int]:
        """``prompt`` tokenized, checked against the context.

        Raises:
            ValueError: not a string, empty, or longer than ``n_ctx`` tokens.
        """
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be text; got {type(prompt).__name__}")
        if prompt == "":
            raise ValueError("the prompt is empty: type at least one character")
        ids = self.tok.encode(prompt)
        check_ids(ids, self.config)
        return ids


class Sequence:
    """A token sequence of one model and everything the page shows about it.

    Args:
        entry: the :class:`ModelEntry`; ids: the prompt's token ids (checked: 1..n_ctx).

    Attributes:
        ids: the tokens so far; prompt_len: how many of them are the prompt; version: bumped
            each time ``ids`` changes (the page refetches what it shows).
    """

    def __init__(self, entry: ModelEntry, ids: list[int]):
        check_ids(ids, entry.config)
        self.entry, self.prompt_len = entry, len(ids)
        self.ids = list(ids)
        self.version = 0
        self.seed: int | None = None
        self.generator: torch.Generator | None = None
        self._reset_caches()

    def fork(self) -> "Sequence":
        """A new sequence of the same model and tokens that starts with this one's answers
        (a page load starts from the launch's warmed prompt without sharing its state)."""
        other = Sequence(self.entry, self.ids[:self.prompt_len])
        if len(self.ids) == self.prompt_len:
            other._layers, other._units = OrderedDict(self._layers), dict(self._units)
            other._logits, other._past = self._logits, self._past
        return other

    def _reset_caches(self) -> None:
        self._layers: OrderedDict = OrderedDict()
        self._units: dict = {}
        self._logits = self._past = None

    @property
    def idx(self) -> torch.Tensor:
        """``[1, T]`` int64."""
        return torch.tensor([self.ids], dtype=torch.long)

    def summary(self) -> dict:
        """What a page needs to start on this sequence: ``{"T", "prompt_len", "tokens"
        (:func:`~.tensors.token_pieces`), "config", "model"}``."""
        return {"T": len(self.ids), "prompt_len": self.prompt_len, "tokens": token_pieces(self.entry.tok, self.ids),
                "config": config_dict(self.entry.config), "model": self.entry.name}

    # ------------------------------------------------------------------ the views' data
    def layer_capture(self, layer: int) -> dict:
        """:func:`~.tensors.capture_layers` of ``layer`` (the last :data:`KEEP_LAYERS` asked for are kept,
        within :data:`KEEP_BYTES`)."""
        if layer not in self._layers:
            self._layers.update(capture_layers(self.entry.model, self.idx, [layer]))
        self._layers.move_to_end(layer)
        held = lambda: sum(t.numel() * t.element_size() for cap in self._layers.values() for t in cap.values())
        while len(self._layers) > 1 and (len(self._layers) > KEEP_LAYERS or held() > KEEP_BYTES):
            self._layers.popitem(last=False)
        return self._layers[layer]

    def logits(self) -> torch.Tensor:
        """The sequence's logits ``[T, n_vocab]`` (a plain forward)."""
        if self._logits is None:
            self._logits, self._past = kv_steps.prefill(self.entry.model, self.idx)
        return self._logits

    def past(self) -> torch.Tensor:
        """OpenAI's ``past`` of the sequence, ``[1, n_layer, 2, n_head, T, head_dim]``."""
        if self._past is None:
            self._logits, self._past = kv_steps.prefill(self.entry.model, self.idx)
        return self._past

    def check_generates(self) -> None:
        """Raises ValueError for a classifier (its head scores labels, not next tokens)."""
        names = output_names(self.entry.config)
        if names:
            raise ValueError(f"this model is a classifier ({', '.join(names)}): its last view shows the labels' "
                             f"probabilities; it does not draw next tokens")

    def check_layer_head(self, layer, head=None) -> None:
        """Raises ValueError unless ``layer`` (and ``head``) are integers inside the model."""
        c = self.entry.config
        for name, value, n in (("layer", layer, c.n_layer), ("head", head, c.n_head)):
            if name == "head" and head is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
                raise ValueError(f"{name}={value!r} is out of range: the model has {n} {name}s (0..{n - 1})")

    def unit(self, kind: str, layer: int | None = None, head: int | None = None) -> dict:
        """One answer for the page: ``pipeline``, ``layer`` (needs ``layer``), ``head`` (``layer``
        and ``head``), ``heads`` or ``lens``; computed on first ask, then cached.

        Raises:
            ValueError: an unknown kind, or a layer/head outside the model.
        """
        if kind not in ("pipeline", "layer", "head", "heads", "lens"):
            raise ValueError(f"unknown view {kind!r}; expected pipeline, layer, head, heads or lens")
        if kind in ("layer", "head"):
            self.check_layer_head(layer, head if kind == "head" else None)
        key = (kind, layer if kind in ("layer", "head") else None, head if kind == "head" else None)
        if key not in self._units:
            with self.entry.lock:
                self._units[key] = {**self._compute(kind, layer, head), "version": self.version}
        return self._units[key]

    def _compute(self, kind: str, layer, head) -> dict:
        e = self.entry
        if kind == "pipeline":
            unit, self._logits = pipeline_unit(e.model, e.tok, self.idx)
            return {**unit, "prompt_len": self.prompt_len, "model": e.name}
        if kind == "layer":
            return layer_unit(self.layer_capture(layer), layer)
        if kind == "head":
            return head_unit(self.layer_capture(layer), layer, head)
        if kind == "heads":
            thumbs, relative = heads_view.collect(e.model, self.idx)
            return heads_view.heads_unit(thumbs, relative, e.induction())
        return self._lens()

    def _lens(self) -> dict:
        """The logit lens (:func:`~gpt2mha.learn.interventions.logit_lens`): for every layer's input
        and the final stream, each position's top :data:`LENS_TOP` tokens and the probability of
        the token that follows it."""
        e = self.entry
        names = output_names(e.config)
        if names:
            raise ValueError(f"this model is a classifier ({', '.join(names)}): the lens decodes next tokens; its "
                             f"head's view is the pipeline's last one")
        with torch.no_grad():
            lens = logit_lens(e.model, self.idx, top_k=min(LENS_TOP, e.config.n_vocab))
        ids = lens.ids[:, 0]                                              # [L + 1, T, k]
        vocab = sorted(set(ids.flatten().tolist()))
        return {"rows": lens.labels, "tokens": token_pieces(e.tok, self.ids), "top_ids": ids.tolist(),
                "top_p": encode(lens.probs[:, 0]), "next_p": encode(lens.target_probs[:, 0]),
                "labels": dict(zip(map(str, vocab), (p["label"] for p in token_pieces(e.tok, vocab))))}

    # ------------------------------------------------------------------ interventions
    def ablate(self, heads, mode: str) -> dict:
        """The next-token distribution with ``heads`` (``[[layer, head], ...]``) ablated (``mode``
        ``"zero"`` or ``"mean"``: :func:`~gpt2mha.learn.interventions.ablate_heads`), against the
        plain run (:func:`~gpt2mha.learn.interventions.next_token_shift`, top :data:`ABLATE_TOP`).

        Raises:
            ValueError: no heads, a head outside the model, or another mode.
        """
        if mode not in ("zero", "mean"):
            raise ValueError(f"mode={mode!r}; expected 'zero' or 'mean'")
        c = self.entry.config
        if not isinstance(heads, (list, tuple)) or not heads:
            raise ValueError("heads names no head: pick at least one (layer, head) to ablate")
        pairs = parse_heads([tuple(h) if isinstance(h, (list, tuple)) else h for h in heads], c.n_layer, c.n_head)
        with self.entry.lock, torch.no_grad():
            before = self.logits()[-1]
            after = ablate_heads(self.entry.model, self.idx, pairs, mean=mode == "mean")[0, -1].float()
        shift = next_token_shift(before, after, top=ABLATE_TOP)
        labels = token_pieces(self.entry.tok, [t["id"] for t in shift["tokens"]])
        for t, p in zip(shift["tokens"], labels):
            t["label"] = p["label"]
        return {"heads": [list(p) for p in pairs], "mode": mode, **shift}

    # ------------------------------------------------------------------ generation
    def sampling(self, temperature, top_k, top_p) -> dict:
        """:func:`~.kv_steps.sampling_view` of the last position's logits."""
        t, k, p, _ = kv_steps.check_sampling(temperature, top_k, top_p)
        self.check_generates()
        with self.entry.lock:
            return kv_steps.sampling_view(self.entry.tok, self.logits()[-1], t, k, p)

    def step(self, temperature, top_k, top_p, seed=None, layer: int = 0) -> dict:
        """Draw the next token (:func:`~.kv_steps.draw`, with this sequence's generator, seeded
        by ``seed``: a new seed restarts it; None: a random seed, reported), append it and run
        the decode step on the cache (:func:`~.kv_steps.decode_step`). The sequence changes only
        once the whole answer is computed and finite: a step that fails leaves the tokens, the
        cache and the generator as they were.

        Returns:
            :func:`~.kv_steps.step_unit`, plus ``"sampling"`` (the distribution the token was
            drawn from), ``"seed"``, ``"T"`` and the new ``"version"``.

        Raises:
            ValueError: bad sampling fields or layer, or the sequence already fills the context;
                :class:`~.tensors.NonFiniteError`: the answer holds NaN or infinity;
                :class:`~gpt2mha.inference.sampling.NonFiniteLogitsError`: NaN or infinite logits.
        """
        t, k, p, seed = kv_steps.check_sampling(temperature, top_k, top_p, seed)
        self.check_layer_head(layer)
        self.check_generates()
        c = self.entry.config
        if len(self.ids) >= c.n_ctx:
            raise ValueError(f"the sequence fills the model's context (n_ctx={c.n_ctx} tokens): reset it or start "
                             f"from a shorter prompt")
        with self.entry.lock:
            generator = torch.Generator()
            if self.generator is None or (seed is not None and seed != self.seed):
                seed = secrets.randbelow(2**63) if seed is None else seed
                generator.manual_seed(seed)
            else:
                seed = self.seed
                generator.set_state(self.generator.get_state())
            past = self.past()
            last = self.logits()[-1]
            view = kv_steps.sampling_view(self.entry.tok, last, t, k, p)
            token = kv_steps.draw(last, t, k, p, generator)
            before = tuple(past.shape)
            step = kv_steps.decode_step(self.entry.model, past, token)
            full = capture_layers(self.entry.model, torch.tensor([self.ids + [token]]), [layer])[layer]
            unit = kv_steps.step_unit(self.entry.tok, token, before, step, full["pattern"][:, -1], layer)
            answer = {**unit, "sampling": view, "seed": seed, "T": len(self.ids) + 1, "version": self.version + 1}
            check_finite(answer, "the step's answer")
            logits = torch.cat([self._logits, step["logits"][None]])
            self.seed, self.generator = seed, generator
            self.ids.append(token)
            self.version += 1
            self._reset_caches()
            self._logits, self._past = logits, step["past"]
        return answer

    def reset(self) -> dict:
        """Back to the prompt alone (the generator restarts from its seed at the next step)."""
        with self.entry.lock:
            del self.ids[self.prompt_len:]
            self.version += 1
            self.generator = None
            self._reset_caches()
        return {"T": len(self.ids), "version": self.version}

    def cache_shape(self) -> list[int]:
        """The shape of the ``past`` the next step reads, ``[1, n_layer, 2, n_head, T, head_dim]``."""
        c = self.entry.config
        return [1, c.n_layer, 2, c.n_head, len(self.ids), c.head_dim]
