"""Checkpoint formats learners have, other than Hugging Face's: read, write, convert.

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
import re

import torch

from ..core.model import GPT2
from .checkpoints import CONFIG_NAME, builtin_models, load_pretrained, save_pretrained
from .learner_formats import book_state_dict_of, read_book, read_nanogpt, save_book, save_nanogpt
from .lora import merge_state_dict, read_adapter
from .openai_tf import OPENAI_FILES, is_openai_dir, load_openai
from .state_dicts import CheckpointError, CheckpointWarning, as_dtype, model_from_state_dict, read_torch_file

#: Re-exported: what readers of a format other than Hugging Face's may want from this module.
__all__ = ["FORMATS", "WRITABLE", "CheckpointWarning", "convert", "detect_format", "source_format", "read_any",
           "load_any", "merge_lora", "read_book", "read_torch_file", "load_openai"]


FORMATS = ("hf", "openai", "book", "nanogpt")


WRITABLE = ("hf", "book", "nanogpt")


def detect_format(path: str) -> str:
    """Which of :data:`FORMATS` ``path`` holds: a directory with ``config.json`` → ``hf``; with
    ``hparams.json`` + a TF checkpoint → ``openai``; with ``ckpt.pt`` (nanoGPT's ``out_dir``),
    or a file with ``model_args`` + ``model`` → ``nanogpt``; a file whose tensors are named
    ``tok_emb.weight``, ``trf_blocks.…`` → ``book``.

    Raises:
        CheckpointError: none of these (naming what was looked for), or a path that does not exist.
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, CONFIG_NAME)):
            return "hf"
        if is_openai_dir(path):
            return "openai"
        if os.path.isfile(os.path.join(path, "ckpt.pt")):
            return "nanogpt"
        raise CheckpointError(f"{path}: no {CONFIG_NAME} in this directory; expected a Hugging Face GPT-2 checkpoint "
                              f"({CONFIG_NAME} + model.safetensors), OpenAI's checkpoint directory "
                              f"({', '.join(OPENAI_FILES)}) or nanoGPT's out_dir (ckpt.pt)")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file or directory")
    obj = read_torch_file(path)
    return _detect_object(obj, path)


def source_format(src: str) -> str:
    """:func:`detect_format` for a path; ``"hf"`` for what ``--model`` takes besides paths: a
    built-in model name (a local path of that name wins) or a hub id (``owner/name``, no file
    extension).

    Raises:
        CheckpointError: see :func:`detect_format` (e.g. no such file or directory).
    """
    if not os.path.exists(src):
        if src in builtin_models():
            return "hf"
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", src) and not os.path.splitext(src)[1]:
            return "hf"
    return detect_format(src)


def _detect_object(obj, source: str) -> str:
    if isinstance(obj, dict) and "model_args" in obj and "model" in obj:
        return "nanogpt"
    sd = book_state_dict_of(obj)
    if sd is not None and any(k.endswith("tok_emb.weight") for k in sd):
        return "book"
    keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
    raise CheckpointError(f"{source}: neither nanoGPT's ckpt.pt (model_args + model) nor the book's GPTModel state "
                          f"dict (tok_emb.weight, trf_blocks.…); found {keys}")


def read_any(src: str, fmt: str | None = None, book_config: dict | None = None,
             model_cls=GPT2, lora=None) -> tuple[GPT2, str]:
    """Load any of :data:`FORMATS` as a float32 model of ``model_cls``; returns ``(model, format)``.

    ``lora``: a LoRA adapter (a PEFT directory or the book's appendix-E ``.pth``), or a list of
    them, merged into the weights in that order (:func:`merge_lora`).

    Raises:
        CheckpointError: an unknown ``fmt`` or anything its reader refuses.
    """
    if fmt is not None and fmt not in FORMATS:
        raise CheckpointError(f"format={fmt!r}; expected one of {FORMATS}")
    fmt = fmt or source_format(src)                              # a built-in name or hub id, as --model takes
    if fmt == "hf":
        model = load_pretrained(src, model_cls)
    elif fmt == "openai":
        model = load_openai(src, model_cls=model_cls)
    else:
        sd, config = read_book(src, book_config)[:2] if fmt == "book" else read_nanogpt(src)
        model = model_from_state_dict(sd, config, src, model_cls=model_cls)
    return (merge_lora(model, lora, book_config, model_cls) if lora else model), fmt


def merge_lora(model: GPT2, lora, book_config: dict | None = None, model_cls=GPT2) -> GPT2:
    """A new float32 model of ``model_cls``: ``model`` with each adapter of ``lora`` (a path or a
    list of paths: :func:`gpt2mha.io.lora.read_adapter`) merged into its weights, in order
    (:func:`gpt2mha.io.lora.merge_state_dict`).

    Raises:
        CheckpointError: a quantized base (merge into the float model, then quantize), or what
            :func:`~gpt2mha.io.lora.read_adapter` / :func:`~gpt2mha.io.lora.check_adapter` refuse.
    """
    if getattr(model, "quantization", None):
        raise CheckpointError(f"the base model is quantized ({model.quantization['scheme']}); LoRA merges into float "
                              f"weights: merge into the float model, then quantize it")
    sd, config = {k: v.detach().float() for k, v in model.state_dict().items()}, model.config
    for path in [lora] if isinstance(lora, (str, os.PathLike)) else lora:
        sd, config = merge_state_dict(sd, config, read_adapter(os.fspath(path), book_config))
    return model_from_state_dict(sd, config, "the merged model", model_cls=model_cls)


def load_any(src: str, dtype: torch.dtype = torch.float32, book_config: dict | None = None,
             model_cls=GPT2, lora=None) -> GPT2:
    """Any model a user names → a model of ``model_cls`` in ``dtype`` (eval mode): a built-in
    name, a Hugging Face directory or hub id (:func:`~gpt2mha.io.checkpoints.load_pretrained`),
    or a local checkpoint in another of :data:`FORMATS` (detected: OpenAI's directory,
    nanoGPT's ``ckpt.pt`` or ``out_dir``, a book ``.pth``), with ``lora`` adapters merged
    (:func:`merge_lora`). What ``GPT2.from_pretrained`` and ``--model`` call.
    """
    if not lora and (not os.path.exists(src) or os.path.isfile(os.path.join(src, CONFIG_NAME))):
        return load_pretrained(src, model_cls, as_dtype(dtype))
    dtype = as_dtype(dtype)
    model, _ = read_any(src, book_config=book_config, model_cls=model_cls, lora=lora)
    if dtype != torch.float32:
        overflow = [k for k, v in model.state_dict().items() if not torch.isfinite(v.to(dtype)).all()]
        if overflow:
            raise CheckpointError(f"{src}: values of {', '.join(overflow)} overflow {dtype}; load in float32")
    return model.to(dtype)


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
