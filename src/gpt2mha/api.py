"""The public model: the core :class:`~gpt2mha.core.model.GPT2` with loading, saving,
generation and quantization attached, each a short call into the module that does it.

``gpt2mha.GPT2`` is this class; the core class stays free of everything but the model.
"""

from __future__ import annotations

import contextlib

import torch

from .core import classifier as core_classifier
from .core import hooks as _hooks
from .core import model as core
from .inference import classify as _classify
from .inference import lora as _lora
from .inference.generate import generate as _generate
from .inference.quant import quantize_model
from .io.checkpoints import save_pretrained
from .io.formats import load_any
from .learn import activations as _activations


class GPT2(core.GPT2):
    """GPT-2 language model (see :class:`gpt2mha.core.model.GPT2` for the modules, the forward
    and the capture points), plus :meth:`from_pretrained`, :meth:`save_pretrained`,
    :meth:`generate`, :meth:`quantize` and TransformerLens' way in: :meth:`run_with_cache`,
    :meth:`run_with_hooks`, :meth:`hooks`, :meth:`reset_hooks`."""

    #: ``{"scheme", "group_size", "head", "tied", "method"}`` once :meth:`quantize` ran (or a
    #: quantized checkpoint was loaded); None for a float model.
    quantization: dict | None = None

    @classmethod
    def from_pretrained(cls, name_or_dir: str, **kwargs) -> "GPT2":
        """Load a built-in model name, a local Hugging Face GPT-2 directory, or a hub id.

        A path in another format (OpenAI's TF checkpoint directory, nanoGPT's ``ckpt.pt``, the
        book's GPTModel ``.pth``) is read too. Keyword arguments go to
        :func:`gpt2mha.io.formats.load_any`, e.g. ``dtype=torch.bfloat16`` for the parameters'
        dtype; see it for the details and errors.
        """
        return load_any(name_or_dir, model_cls=cls, **kwargs)

    def save_pretrained(self, directory: str, **kwargs) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``GPT2LMHeadModel`` loads (with
        ``max_shard_size=``: shards and ``model.safetensors.index.json``, as transformers writes).

        See :func:`gpt2mha.io.checkpoints.save_pretrained`.
        """
        save_pretrained(self, directory, **kwargs)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, **kwargs) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx [B, T]``; returns ``[B, T + max_new_tokens]``.

        ``temperature=0`` is greedy. See :func:`gpt2mha.inference.generate.generate` for all options.
        """
        return _generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, **kwargs)

    def quantize(self, scheme: str, group_size: int | None = None, method: str = "gptq",
                 calibration=None, activations: str = "exact", head: str = "int8",
                 progress: bool = False) -> "GPT2":
        """Weight-only quantize the model in place for fast CPU inference; returns the model.

        ``"int8"``: symmetric, one scale per output channel; ``"int4"``: a scale and a zero per
        group of ``group_size`` inputs (default 32). Every block Conv1D and the LM head are
        swapped for quantized layers; ``method="gptq"`` (default) rounds by GPTQ on
        ``calibration`` text or ids (None: the packaged Shakespeare sample), ``"rtn"`` to
        nearest. See :func:`gpt2mha.inference.quant.quantize_model` for the details, the error
        report (``model.quantization_report``) and the errors it raises. A quantized model is
        for inference: ``.train()`` raises; ``save_pretrained``/``from_pretrained`` store and
        restore it. ``activations="per_row"`` (int8 only) rounds each activation row to 8 bits
        with its own scale and zero point, over weights re-rounded to 7 bits (W7A8), for faster,
        less exact products; ``"auto"`` keeps the exact products for decode and takes W7A8 for
        long prompts (:func:`gpt2mha.inference.quant.set_activations`). ``activations="per_block"``
        (int4 only) runs decode steps as W4A8: each activation row rounded to 8 bits per group, as
        llama.cpp's q8_0 against q4_0. ``head="int4"`` (int4 only) rounds the LM head to int4 in
        the blocks' groups instead of int8: on 124M a 24 MB head instead of 38.6 (a decode step
        reads 77.5 MB instead of 92), ~1.5 points less top-1 agreement with float32; nothing
        measurable on a small vocabulary such as the built-in model's 256 (docs/explanation/quantization.md,
        "Quality"). GPTQ takes about a minute per 124M model on 2 cores; ``progress=True`` shows a
        bar on stderr (when it is a terminal), as the command line does.
        """
        return quantize_model(self, scheme, group_size, method, calibration, activations, head, progress)

    def train(self, mode: bool = True) -> "GPT2":
        """As ``nn.Module.train``; raises ValueError for a quantized model (train the float one)."""
        if mode and self.quantization:
            raise ValueError(f"this model is quantized ({self.quantization['scheme']}): its weights are rounded integers "
                             f"and cannot be trained; train the float model, then quantize it")
        return super().train(mode)

    def run_with_cache(self, idx: torch.Tensor, names_filter=None, **kwargs):
        """``(logits, cache)``: the forward's logits and the activations at the capture points.

        ``names_filter``: None (every point but the opt-in ``hook_result``), a hook name in
        TransformerLens' spelling (``blocks.0.attn.hook_pattern``) or ours (``h.0.attn.hook_pattern``),
        a list of them, or a predicate of the name. Other keyword arguments go to the forward
        (``cache=`` a KVCache for a prefill or decode step, ``attention_mask``, ``stop=True`` to
        end the forward once every selected point is reached). See
        :func:`gpt2mha.learn.activations.run_with_cache` and
        :class:`~gpt2mha.learn.activations.ActivationCache` (``cache["pattern", 0]``,
        ``stack_head_results``, ``accumulated_resid``).
        """
        return _activations.run_with_cache(self, idx, names_filter, **kwargs)

    def run_with_hooks(self, idx: torch.Tensor, fwd_hooks=(), **kwargs) -> torch.Tensor:
        """Logits ``[B, T, n_vocab]`` of one forward with ``fwd_hooks = [(name_or_filter,
        fn(tensor, hook) -> tensor | None)]`` attached for that call; a returned tensor replaces
        the activation. See :func:`gpt2mha.learn.activations.run_with_hooks`."""
        return _activations.run_with_hooks(self, idx, fwd_hooks, **kwargs)

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=()):
        """``with model.hooks([(name, fn)]):`` the hooks act on every forward in the block
        (``generate``'s prefill and decode steps included) and are removed after it, also on
        error. See :func:`gpt2mha.core.hooks.attached`."""
        with _hooks.attached(self, fwd_hooks) as handles:
            yield handles

    def reset_hooks(self) -> None:
        """Remove every hook from every capture point."""
        _hooks.reset_hooks(self)

    def add_adapters(self, adapters: dict, book_config: dict | None = None) -> "_lora.LoraState":
        """Apply LoRA adapters unmerged, ``{name: PEFT directory, the book's appendix-E .pth, or
        LoraAdapter}``: each row of a batch may then take its own (:meth:`adapter`, the engine's
        slots, ``gpt2mha serve --lora name=DIR``). Merged instead: ``from_pretrained(...,
        lora=PATH)``. See :func:`gpt2mha.inference.lora.apply_lora`."""
        return _lora.apply_lora(self, adapters, book_config)

    def adapter(self, name: str | None):
        """``with model.adapter("name"):`` every forward and ``generate`` in the block runs with
        that adapter (None: the base model). See :func:`gpt2mha.inference.lora.using`."""
        return _lora.using(self, name)


class GPT2Classifier(core_classifier.GPT2Classifier, GPT2):
    """GPT-2 as a sequence classifier (:class:`gpt2mha.core.classifier.GPT2Classifier`: the
    model with a ``[n_labels, n_embd]`` head in the LM head's place) with :class:`GPT2`'s
    loading, saving and hooks, plus :meth:`classify`. ``GPT2.from_pretrained`` returns one for a
    classifier checkpoint: the book's chapter-6 ``.pth`` (``out_head`` of ``num_classes`` rows)
    or a ``GPT2ForSequenceClassification`` directory."""

    def classify(self, texts, max_length: int | None = None, truncate: int | None = None, labels=None,
                 batch_size: int = _classify.DEFAULT_BATCH_SIZE) -> "_classify.Classification":
        """Classify ``texts`` (a string or a list of strings/token-id lists): ``(labels, probs
        [N, C], logits [N, C], n_tokens)``. See :func:`gpt2mha.inference.classify.classify`."""
        return _classify.classify(self, texts, max_length=max_length, truncate=truncate, labels=labels,
                                  batch_size=batch_size)

    def quantize(self, *args, **kwargs):
        """Raises ValueError: the quantized layers hold a language model's head (no bias, n_vocab rows)."""
        raise ValueError("this model is a classifier: gpt2mha quantizes language models only; classify with the float "
                         "model")

    def generate(self, *args, **kwargs):
        """Raises ValueError: a classifier's head scores labels, not next tokens."""
        raise ValueError(f"this model is a classifier ({self.config.n_labels} labels), not a language model: it "
                         f"classifies texts (model.classify, gpt2mha classify, POST /v1/classify) and does not "
                         f"generate")


#: The class ``GPT2.from_pretrained`` builds for a classifier checkpoint
#: (:func:`gpt2mha.io.state_dicts.model_class`).
GPT2.classifier_class = GPT2Classifier
