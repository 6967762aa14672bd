"""Any checkpoint format, read, written and converted: the public face of the registry
(:mod:`.registry`); importing this module registers every built-in format.

* ``hf``: a Hugging Face GPT-2 directory (:mod:`gpt2mha.io.checkpoints`), a built-in model name
  or a hub id; a quantized gpt2mha directory is read by the format
  :mod:`gpt2mha.inference.quant` registers.
* ``openai``: the directory OpenAI's ``download_model.py`` writes (``checkpoint``,
  ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001``, ``hparams.json``, ``encoder.json``,
  ``vocab.bpe``), read with TensorFlow's own ``tf.train.load_checkpoint`` (``pip install
  'gpt2mha[tf]'``). Variables as ``model`` in openai/gpt-2 ``src/model.py`` creates them:
  ``model/wte [n_vocab, n_embd]``, ``model/wpe [n_ctx, n_embd]``, ``model/h{i}/ln_1/g|b``,
  ``model/h{i}/attn/c_attn/w [1, n_embd, 3·n_embd]`` (conv1d's ``[1, nx, nf]``), ``…/b``,
  ``attn/c_proj``, ``ln_2``, ``mlp/c_fc``, ``mlp/c_proj``, ``model/ln_f/g|b``. Read only.
* ``book`` (the book's ``GPTModel`` state dict: chapter 5's language model or chapter 6's
  classifier, whose ``out_head`` has ``num_classes`` rows) and ``nanogpt`` (nanoGPT's
  ``ckpt.pt``): their layouts are described in :mod:`gpt2mha.io.learner_formats`, which reads
  and writes them. A classifier (the book's, or transformers' ``GPT2ForSequenceClassification``
  directory, :mod:`gpt2mha.io.classifiers`) loads as a
  :class:`~gpt2mha.core.classifier.GPT2Classifier`.
  nanoGPT's MLP uses the exact (erf) GELU where GPT-2 uses the tanh approximation; the weights are the same, the activations differ a little at
  every MLP (``gpt2mha check-model`` shows where).

Every ``.pt``/``.pth`` is read with ``torch.load(weights_only=True)``. Each reader checks every
name and shape in the format's own spelling before anything is copied, and every mapping is
an exact copy or transpose (no arithmetic), so a round trip is bitwise.
"""

from __future__ import annotations

import os

import torch

from ..core.model import GPT2
from .checkpoints import save_pretrained
from .files import read_torch_file
from .layouts import book_state_dict_of
from .learner_formats import read_book, read_nanogpt, save_book, save_nanogpt
from .lora import merge_adapters
from .openai_tf import load_openai
from .registry import as_dtype, detect_format, read_checkpoint, source_format
from .state_dicts import Checkpoint, CheckpointError, CheckpointWarning, build_model

#: Re-exported: what readers of a format other than Hugging Face's may want from this module.
__all__ = ["FORMATS", "WRITABLE", "CheckpointWarning", "convert", "detect_format", "source_format", "read_any",
           "load_any", "merge_lora", "read_book", "read_nanogpt", "read_torch_file", "load_openai",
           "book_state_dict_of"]


FORMATS = ("hf", "openai", "book", "nanogpt")


WRITABLE = ("hf", "book", "nanogpt")


def read_any(src: str, fmt: str | None = None, book_config: dict | None = None,
             model_cls=GPT2, lora=None) -> tuple[GPT2, str]:
    """Load any of :data:`FORMATS` as a float32 model of ``model_cls``; returns ``(model, format)``.

    ``src``: a path, or a built-in model name or hub id (:func:`~.registry.source_format`).
    ``fmt``: the format, instead of detecting it. ``lora``: a LoRA adapter (a PEFT directory
    or the book's appendix-E ``.pth``), or a list of them, merged into the weights in that
    order (:func:`~.lora.merge_adapters`).

    Raises:
        CheckpointError: an unknown ``fmt`` or anything its reader refuses.
    """
    if fmt is not None and fmt not in FORMATS:
        raise CheckpointError(f"format={fmt!r}; expected one of {FORMATS}")
    checkpoint = read_checkpoint(src, fmt, book_config)
    if lora:
        checkpoint = merge_adapters(checkpoint, lora, book_config)
    return build_model(checkpoint, torch.float32, model_cls), checkpoint.format


def merge_lora(model: GPT2, lora, book_config: dict | None = None, model_cls=GPT2) -> GPT2:
    """A new float32 model of ``model_cls``: ``model`` with each adapter of ``lora`` (a path or a
    list of paths: :func:`gpt2mha.io.lora.read_adapter`) merged into its weights, in order
    (:func:`gpt2mha.io.lora.merge_adapters`).

    Raises:
        CheckpointError: a quantized base (merge into the float model, then quantize), or what
            :func:`~gpt2mha.io.lora.read_adapter` / :func:`~gpt2mha.io.lora.check_adapter` refuse.
    """
    quantization = getattr(model, "quantization", None)
    sd = {} if quantization else {k: v.detach().float() for k, v in model.state_dict().items()}
    merged = merge_adapters(Checkpoint(sd, model.config, "the merged model", quantization), lora, book_config)
    return build_model(merged, torch.float32, model_cls)


def load_any(src: str, dtype: torch.dtype = torch.float32, book_config: dict | None = None,
             model_cls=GPT2, lora=None) -> GPT2:
    """Any model a user names → a model of ``model_cls`` in ``dtype`` (eval mode): a built-in
    name, a Hugging Face directory or hub id (:func:`~gpt2mha.io.checkpoints.resolve`), or a
    local checkpoint in another of :data:`FORMATS` (detected: OpenAI's directory, nanoGPT's
    ``ckpt.pt`` or ``out_dir``, a book ``.pth``), with ``lora`` adapters merged. What
    ``GPT2.from_pretrained`` and ``--model`` call.

    One pass (:mod:`.registry`): locate, probe, detect, read and normalise the keys once
    (:func:`~.registry.read_checkpoint`), merge the adapters (:func:`~.lora.merge_adapters`),
    build the model with each tensor converted once, to ``dtype``
    (:func:`~.state_dicts.build_model`).

    Raises:
        ValueError: ``dtype`` is not a floating dtype or one of its names.
        CheckpointError: what :func:`~.registry.read_checkpoint`, the adapters or
            :func:`~.state_dicts.build_model` refuse (e.g. values that overflow ``dtype``).
    """
    dtype = as_dtype(dtype)
    checkpoint = read_checkpoint(src, book_config=book_config, any_name=True)
    if lora:
        checkpoint = merge_adapters(checkpoint, lora, book_config)
    return build_model(checkpoint, dtype, model_cls)


def convert(src: str, dst: str, to: str = "hf", overwrite: bool = False, src_format: str | None = None,
            book_config: dict | None = None, quantize=None, lora=None) -> list[str]:
    """Read ``src`` (any of :data:`FORMATS`) and write it to ``dst`` as ``to`` (``hf``: a
    directory ``GPT2LMHeadModel`` loads, with the tokenizer and generation files that
    transformers' ``pipeline`` and ``AutoTokenizer`` read, :func:`~gpt2mha.io.checkpoints.save_pretrained`;
    ``book``: ``DST.pth`` + ``DST.json``; ``nanogpt``:
    ``ckpt.pt``). Returns the paths written.

    ``quantize``: a function applied to the float model before an ``hf`` directory is written
    (e.g. ``lambda m: m.quantize("int8")``), so the directory holds a quantized model
    (gpt2mha reads it; transformers does not).

    ``lora``: LoRA adapters merged into the weights first (:func:`merge_lora`), so ``dst`` is a
    plain checkpoint (the book's appendix-E ``.pth`` as ``src`` is merged without it).

    Raises:
        FileExistsError: ``dst`` exists (a non-empty directory for ``hf``), unless ``overwrite``.
        CheckpointError / ValueError: an unreadable source, an unknown format, or a model the
            target cannot hold (e.g. an untied head as nanoGPT).
    """
    if to not in WRITABLE:
        raise ValueError(f"to={to!r}; gpt2mha writes {', '.join(WRITABLE)} (OpenAI's TF format is read only)")
    if os.path.realpath(src) == os.path.realpath(dst):        # a symlink to SRC is SRC
        raise ValueError(f"SRC and DST are the same path ({src}); write the conversion elsewhere")
    if quantize is not None and to != "hf":
        raise ValueError(f"quantize: only the hf format holds quantized weights, not {to!r}")
    if to == "hf" and os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise FileExistsError(f"{dst} is not empty; refusing to overwrite it (pass --overwrite / overwrite=True)")
    model, _ = read_any(src, src_format, book_config, lora=lora)
    if quantize is not None:
        model = quantize(model)
    if to != "hf" and getattr(model, "quantization", None):
        raise CheckpointError(f"{src} is a quantized checkpoint ({model.quantization['scheme']}); the {to} format holds "
                              f"float weights only: convert the float checkpoint, then quantize it in gpt2mha")
    if to == "hf":
        if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
            raise FileExistsError(f"{dst} is not empty; refusing to overwrite it (pass --overwrite / overwrite=True)")
        return save_pretrained(model, dst, overwrite=True)
    if to == "book":
        return list(save_book(model, dst, overwrite))
    return [save_nanogpt(model, dst, overwrite)]
