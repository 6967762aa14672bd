"""Checkpoint formats learners have, other than Hugging Face's: read, write, convert.

* ``openai``: the directory OpenAI's ``download_model.py`` writes (``checkpoint``,
  ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001``, ``hparams.json``, ``encoder.json``,
  ``vocab.bpe``), read with TensorFlow's own ``tf.train.load_checkpoint`` (``pip install
  'gpt2mha[tf]'``). Variables as ``model`` in openai/gpt-2 ``src/model.py`` creates them:
  ``model/wte [n_vocab, n_embd]``, ``model/wpe [n_ctx, n_embd]``, ``model/h{i}/ln_1/g|b``,
  ``model/h{i}/attn/c_attn/w [1, n_embd, 3·n_embd]`` (conv1d's ``[1, nx, nf]``), ``…/b``,
  ``attn/c_proj``, ``ln_2``, ``mlp/c_fc``, ``mlp/c_proj``, ``model/ln_f/g|b``. Read only.
* ``book``: the state dict of ``GPTModel`` from "Build a Large Language Model (From Scratch)",
  ch. 4/5 (``tok_emb``, ``pos_emb``, ``trf_blocks.{i}.att.W_query|W_key|W_value|out_proj``,
  ``norm1|norm2.scale|shift``, ``ff.layers.0|2``, ``final_norm``, ``out_head``; nn.Linear
  ``[out, in]``), a plain ``.pth`` or ch. 5's ``{"model_state_dict": …}``, with the book's
  config dict (``vocab_size, context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias``)
  given, stored in the file, or in ``<name>.json`` beside it.
* ``nanogpt``: nanoGPT's ``ckpt.pt`` (``model_args`` + ``model``: ``transformer.…`` keys in
  nn.Linear layout, ``_orig_mod.`` prefixes from ``torch.compile``, biases absent with
  ``bias=False``, ``lm_head`` tied to ``wte``). nanoGPT's MLP uses the exact (erf) GELU where
  GPT-2 uses the tanh approximation; the weights are the same, the activations differ a little at
  every MLP (``gpt2mha check-model`` shows where).

Every ``.pt``/``.pth`` is read with ``torch.load(weights_only=True)``. Each reader checks every
name and shape in the format's own spelling before anything is copied, and every mapping is
an exact copy or transpose (no arithmetic), so a round trip is bitwise.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pickle
import re
import warnings

import torch

from .checkpoints import (CONFIG_NAME, CheckpointError, as_dtype, builtin_models, check_state_dict, load_into,
                          load_pretrained, save_pretrained)
from .convert import conv1d_to_linear_state_dict, linear_to_conv1d_state_dict, strip_wrapper_prefixes
from ..core.model import GPT2, GPT2Config
from .tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256

FORMATS = ("hf", "openai", "book", "nanogpt")
WRITABLE = ("hf", "book", "nanogpt")
OPENAI_FILES = ("checkpoint", "model.ckpt.index", "model.ckpt.data-00000-of-00001", "hparams.json")
BOOK_CONFIG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")
TF_EXTRA = "pip install 'gpt2mha[tf]'"


class CheckpointWarning(UserWarning):
    """A checkpoint that loads, but not the way its files say (e.g. TF's ``checkpoint`` file
    naming another directory's files)."""


# ------------------------------------------------------------------------------- common
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


def _shapes(sd: dict) -> dict[str, tuple]:
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
        model = model_cls(config)
    check_state_dict(model, sd, source)
    return load_into(model, sd, dtype)


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


def _state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's state dict, detached, keys as the model names them."""
    return {k: v.detach() for k, v in sd.items()}


# ------------------------------------------------------------------------------- detect
def is_openai_dir(path: str) -> bool:
    """True if ``path`` is a directory holding OpenAI's ``hparams.json`` and a TF checkpoint."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "hparams.json"))
            and (os.path.isfile(os.path.join(path, "checkpoint"))
                 or os.path.isfile(os.path.join(path, "model.ckpt.index"))))


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
    sd = _book_state_dict_of(obj)
    if sd is not None and any(k.endswith("tok_emb.weight") for k in sd):
        return "book"
    keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
    raise CheckpointError(f"{source}: neither nanoGPT's ckpt.pt (model_args + model) nor the book's GPTModel state "
                          f"dict (tok_emb.weight, trf_blocks.…); found {keys}")


# ------------------------------------------------------------------------------- OpenAI
def _import_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")       # TensorFlow's start-up chatter
    try:
        import tensorflow as tf
    except ImportError:
        raise CheckpointError(f"reading OpenAI's TensorFlow checkpoint needs TensorFlow: {TF_EXTRA} "
                              f"(installs tensorflow-cpu)") from None
    return tf


def openai_variables(config: GPT2Config) -> dict[str, tuple[str, tuple]]:
    """OpenAI variable name → (gpt2mha key, OpenAI shape), as ``model()`` in openai/gpt-2
    ``src/model.py`` creates them (conv1d weights ``[1, nx, nf]``, norms ``g``/``b``)."""
    C, V = config.n_embd, config.n_vocab
    out = {"model/wte": ("wte.weight", (V, C)), "model/wpe": ("wpe.weight", (config.n_ctx, C)),
           "model/ln_f/g": ("ln_f.weight", (C,)), "model/ln_f/b": ("ln_f.bias", (C,))}
    for i in range(config.n_layer):
        p, q = f"model/h{i}/", f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + ln + "/g"], out[p + ln + "/b"] = (q + ln + ".weight", (C,)), (q + ln + ".bias", (C,))
        for name, nx, nf in (("attn/c_attn", C, 3 * C), ("attn/c_proj", C, C), ("mlp/c_fc", C, 4 * C),
                             ("mlp/c_proj", 4 * C, C)):
            key = q + name.replace("/", ".")
            out[p + name + "/w"], out[p + name + "/b"] = (key + ".weight", (1, nx, nf)), (key + ".bias", (nf,))
    return out


def verify_bpe_files(directory: str) -> tuple[str, str] | None:
    """``(encoder.json, vocab.bpe)`` paths in ``directory`` after checking their sha256 against
    OpenAI's (the hashes :mod:`gpt2mha.tokenizer` checks); None when the directory has neither.

    Raises:
        CheckpointError: only one of the two, or a file whose hash differs (a modified
            vocabulary would tokenise differently from the weights' training).
    """
    paths = [os.path.join(directory, n) for n in ("encoder.json", "vocab.bpe")]
    present = [os.path.isfile(p) for p in paths]
    if not any(present):
        return None
    if not all(present):
        raise CheckpointError(f"{directory}: has {'encoder.json' if present[0] else 'vocab.bpe'} without "
                              f"{'vocab.bpe' if present[0] else 'encoder.json'}; GPT-2's tokenizer needs both")
    for path, want in zip(paths, (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256)):
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        if got != want:
            raise CheckpointError(f"{path}: sha256 {got} is not OpenAI's GPT-2 file ({want}); this directory's "
                                  f"tokenizer differs from GPT-2's, refusing to tokenise with it")
    return paths[0], paths[1]


def read_openai(directory: str) -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """OpenAI's checkpoint directory → (state dict in gpt2mha's names, config).

    ``hparams.json`` gives ``n_vocab, n_ctx, n_embd, n_head, n_layer``; the checkpoint named by
    the ``checkpoint`` file (or ``model.ckpt``), inside ``directory`` only
    (:func:`checkpoint_prefix`), is read with ``tf.train.load_checkpoint``;
    ``encoder.json``/``vocab.bpe``, when present, are hash-verified (:func:`verify_bpe_files`).

    Raises:
        CheckpointError: TensorFlow missing (naming the extra), bad hparams, a missing,
            unexpected or mis-shaped variable (OpenAI's names and shapes), modified BPE files,
            or a truncated or corrupt data file (naming it and the variable).
    """
    hp_path = os.path.join(directory, "hparams.json")
    try:
        with open(hp_path) as f:
            hp = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{hp_path}: cannot read JSON: {e}") from None
    keys = ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")
    if not isinstance(hp, dict) or any(k not in hp for k in keys):
        raise CheckpointError(f"{hp_path}: expected an object with {', '.join(keys)}; got {hp!r}"[:300])
    try:
        config = GPT2Config(**{k: hp[k] for k in keys}, tokenizer="gpt2" if hp["n_vocab"] >= 50257 else "bytes")
    except ValueError as e:
        raise CheckpointError(f"{hp_path}: {e}") from None
    verify_bpe_files(directory)
    prefix = checkpoint_prefix(directory)
    tf = _import_tf()
    try:
        reader = tf.train.load_checkpoint(prefix)                # the prefix itself: no `checkpoint` lookup
        shapes = reader.get_variable_to_shape_map()
    except Exception as e:
        raise CheckpointError(f"{prefix}: TensorFlow could not read the checkpoint (truncated or corrupt?): "
                              f"{str(e).splitlines()[0][:300]}") from None
    names = openai_variables(config)
    shapes = {k: v for k, v in shapes.items() if k.startswith("model/")}   # not global_step, optimizer slots
    check_tensors({k: tuple(s) for k, s in shapes.items()}, {k: s for k, (_, s) in names.items()}, directory)
    sd = {}
    for name, (key, shape) in names.items():
        try:
            array = reader.get_tensor(name)
        except Exception as e:                                   # TensorFlow: IndexError "Read less bytes ..."
            data = ", ".join(sorted(glob.glob(glob.escape(prefix) + ".data-*"))) or prefix + ".data-*"
            raise CheckpointError(f"{data}: cannot read variable {name} {list(shape)}: the data file is truncated "
                                  f"or corrupt ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        t = torch.from_numpy(array.copy())
        sd[key] = t[0] if len(shape) == 3 else t                 # conv1d [1, nx, nf] → Conv1D [nx, nf]
    return sd, config


def checkpoint_prefix(directory: str) -> str:
    """The TensorFlow checkpoint prefix to read in OpenAI's ``directory``: the one TF's
    ``checkpoint`` state file names (``model_checkpoint_path: "model.ckpt"``), else ``model.ckpt``.

    Only files inside ``directory`` are read: TF's Saver writes the absolute path it saved to,
    so in a copied or moved directory ``checkpoint`` names the original's files; a path outside
    ``directory`` is replaced by its file name inside ``directory``, with a warning.

    Raises:
        CheckpointError: an unreadable ``checkpoint`` file, one without
            ``model_checkpoint_path``, or no ``<prefix>.index`` in the directory.
    """
    state = os.path.join(directory, "checkpoint")
    name, named = "model.ckpt", None
    if os.path.isfile(state):
        try:
            with open(state, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{state}: cannot read TensorFlow's checkpoint state: {e}") from None
        m = re.search(r'^\s*model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', text, re.M)
        if m is None:
            raise CheckpointError(f"{state}: no model_checkpoint_path line; expected TensorFlow's checkpoint state, "
                                  f"e.g. model_checkpoint_path: \"model.ckpt\"")
        named = m.group(1).replace('\\"', '"').replace("\\\\", "\\")
        target = named if os.path.isabs(named) else os.path.join(directory, named)
        root = os.path.realpath(directory)
        if os.path.realpath(target).startswith(root + os.sep):
            name = os.path.relpath(os.path.realpath(target), root)
        else:
            name = os.path.basename(named.rstrip("/\\")) or name
            warnings.warn(f"{state} points to {named}, outside {directory} (TensorFlow writes the absolute path it "
                          f"saved to; the directory was copied or moved?); reading {os.path.join(directory, name)}, "
                          f"the files in the directory given", CheckpointWarning, stacklevel=3)
    prefix = os.path.join(directory, name)
    if not os.path.isfile(prefix + ".index"):
        raise CheckpointError(f"{directory}: no {name}.index" + (f" (the checkpoint the `checkpoint` file names: "
                                                                 f"{named})" if named else "")
                              + f"; expected OpenAI's files {', '.join(OPENAI_FILES)}")
    return prefix


def load_openai(directory: str, dtype: torch.dtype = torch.float32, model_cls=GPT2) -> GPT2:
    """OpenAI's checkpoint directory → a model of ``model_cls`` (eval mode); see :func:`read_openai`."""

    sd, config = read_openai(directory)
    return model_from_state_dict(sd, config, directory, dtype, model_cls)


# --------------------------------------------------------------------------------- book
def _book_state_dict_of(obj):
    if isinstance(obj, dict) and isinstance(obj.get("model_state_dict"), dict):
        obj = obj["model_state_dict"]                             # ch. 5's model_and_optimizer.pth
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and obj:
        try:
            return strip_wrapper_prefixes(obj)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return None


def book_config(sd: dict[str, torch.Tensor], cfg: dict | None, source: str) -> dict:
    """The book's config dict for a GPTModel state dict: sizes read off the tensors, checked
    against ``cfg`` where it gives them; ``n_heads`` must come from ``cfg`` (no shape holds it).

    Raises:
        CheckpointError: no ``n_heads``, an unknown key, or a value contradicting the tensors.
    """
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(BOOK_CONFIG_KEYS))
    if unknown:
        raise CheckpointError(f"{source}: unknown book config keys {unknown}; expected {list(BOOK_CONFIG_KEYS)}")
    for k in ("tok_emb.weight", "pos_emb.weight"):
        if k not in sd or sd[k].dim() != 2:
            raise CheckpointError(f"{source}: no 2-D {k}; not the book's GPTModel state dict")
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("trf_blocks.")})
    found = {"vocab_size": sd["tok_emb.weight"].shape[0], "context_length": sd["pos_emb.weight"].shape[0],
             "emb_dim": sd["tok_emb.weight"].shape[1], "n_layers": n_layers,
             "qkv_bias": "trf_blocks.0.att.W_query.bias" in sd}
    for k, v in found.items():
        if k in cfg and cfg[k] != v:
            raise CheckpointError(f"{source}: config {k}={cfg[k]!r} but the tensors say {v!r}")
    if "n_heads" not in cfg:
        raise CheckpointError(f"{source}: the book's config needs n_heads (no tensor shape holds it): pass it "
                              f"(CLI: --book-config '{{\"n_heads\": 12}}' or a JSON file), or put the config dict "
                              f"in {os.path.splitext(source)[0]}.json")
    return {**found, "drop_rate": 0.0, **cfg}


def book_to_gpt2(sd: dict[str, torch.Tensor], cfg: dict | None = None,
                 source: str = "book state dict") -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """The book's GPTModel state dict (nn.Linear ``[out, in]``) → (gpt2mha state dict, config).

    Per block i (C = emb_dim): ``c_attn.weight [C, 3C] = cat(W_query, W_key, W_value).T``,
    ``c_attn.bias`` their biases (zeros for ``qkv_bias=False``), ``c_proj = out_proj.T``,
    ``ln_1/ln_2 = norm1/norm2 (scale → weight, shift → bias)``, ``mlp.c_fc = ff.layers.0.T``,
    ``mlp.c_proj = ff.layers.2.T``; ``wte = tok_emb``, ``wpe = pos_emb``, ``ln_f =
    final_norm``, ``lm_head = out_head`` (tied when equal to tok_emb). ``drop_rate`` becomes all
    three dropouts. The ``att.mask`` buffers are ignored (GPT-2's mask is built, not stored).

    Raises:
        CheckpointError: see :func:`book_config`; any missing, unexpected or mis-shaped tensor.
    """
    cfg = book_config(sd, cfg, source)
    C, V, T, L = cfg["emb_dim"], cfg["vocab_size"], cfg["context_length"], cfg["n_layers"]
    norms = lambda p: {p + ".scale": (C,), p + ".shift": (C,)}  # noqa: E731
    expected = {"tok_emb.weight": (V, C), "pos_emb.weight": (T, C), **norms("final_norm"), "out_head.weight": (V, C)}
    optional = {}
    for i in range(L):
        b = f"trf_blocks.{i}."
        for w in ("W_query", "W_key", "W_value"):
            expected[b + f"att.{w}.weight"] = (C, C)
            if cfg["qkv_bias"]:
                expected[b + f"att.{w}.bias"] = (C,)
        expected.update({b + "att.out_proj.weight": (C, C), b + "att.out_proj.bias": (C,),
                         b + "ff.layers.0.weight": (4 * C, C), b + "ff.layers.0.bias": (4 * C,),
                         b + "ff.layers.2.weight": (C, 4 * C), b + "ff.layers.2.bias": (C,),
                         **norms(b + "norm1"), **norms(b + "norm2")})
        optional[b + "att.mask"] = (T, T)
    check_tensors(_shapes(sd), expected, source, optional)
    try:
        config = GPT2Config(n_vocab=V, n_ctx=T, n_embd=C, n_head=cfg["n_heads"], n_layer=L,
                            embd_pdrop=cfg["drop_rate"], attn_pdrop=cfg["drop_rate"], resid_pdrop=cfg["drop_rate"],
                            tokenizer="gpt2" if V >= 50257 else "bytes")
    except ValueError as e:
        raise CheckpointError(f"{source}: book config: {e}") from None
    out = {"wte.weight": sd["tok_emb.weight"], "wpe.weight": sd["pos_emb.weight"],
           "ln_f.weight": sd["final_norm.scale"], "ln_f.bias": sd["final_norm.shift"],
           "lm_head.weight": sd["out_head.weight"]}
    for i in range(L):
        b, h = f"trf_blocks.{i}.", f"h.{i}."
        qkv = [b + f"att.{w}" for w in ("W_query", "W_key", "W_value")]
        out[h + "attn.c_attn.weight"] = torch.cat([sd[k + ".weight"] for k in qkv], 0).t().contiguous()  # [C, 3C]
        out[h + "attn.c_attn.bias"] = (torch.cat([sd[k + ".bias"] for k in qkv]) if cfg["qkv_bias"]
                                       else torch.zeros(3 * C, dtype=sd[qkv[0] + ".weight"].dtype))
        out[h + "attn.c_proj.weight"] = sd[b + "att.out_proj.weight"].t().contiguous()
        out[h + "attn.c_proj.bias"] = sd[b + "att.out_proj.bias"]
        for ln, norm in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[h + ln + ".weight"], out[h + ln + ".bias"] = sd[b + norm + ".scale"], sd[b + norm + ".shift"]
        for mine, theirs in (("mlp.c_fc", "ff.layers.0"), ("mlp.c_proj", "ff.layers.2")):
            out[h + mine + ".weight"] = sd[b + theirs + ".weight"].t().contiguous()
            out[h + mine + ".bias"] = sd[b + theirs + ".bias"]
    return tie_head(out, config)


def gpt2_to_book(model: GPT2) -> tuple[dict[str, torch.Tensor], dict]:
    """:class:`GPT2` → (the book's GPTModel state dict, its config dict); inverse of :func:`book_to_gpt2`.

    ``qkv_bias`` is True iff some ``c_attn.bias`` entry is nonzero; the ``att.mask`` buffers
    (``triu(ones(T, T), 1)``, which GPTModel's ``load_state_dict`` expects) are written;
    ``out_head`` is the head weight (wte when tied).

    Raises:
        ValueError: the dropouts differ (the book has one ``drop_rate``).
    """
    c = model.config
    if not c.embd_pdrop == c.attn_pdrop == c.resid_pdrop:
        raise ValueError(f"the book's GPTModel has one drop_rate; this model has embd_pdrop={c.embd_pdrop}, "
                         f"attn_pdrop={c.attn_pdrop}, resid_pdrop={c.resid_pdrop}")
    sd, C = _state_dict(model.state_dict()), c.n_embd
    qkv_bias = any(bool(sd[f"h.{i}.attn.c_attn.bias"].ne(0).any()) for i in range(c.n_layer))
    cfg = {"vocab_size": c.n_vocab, "context_length": c.n_ctx, "emb_dim": C, "n_heads": c.n_head,
           "n_layers": c.n_layer, "drop_rate": c.resid_pdrop, "qkv_bias": qkv_bias}
    out = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"]}
    mask = torch.triu(torch.ones(c.n_ctx, c.n_ctx), diagonal=1)
    for i in range(c.n_layer):
        b, h = f"trf_blocks.{i}.", f"h.{i}."
        w, bias = sd[h + "attn.c_attn.weight"].t(), sd[h + "attn.c_attn.bias"]      # [3C, C], [3C]
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            out[b + f"att.{name}.weight"] = w[j * C:(j + 1) * C].contiguous()
            if qkv_bias:
                out[b + f"att.{name}.bias"] = bias[j * C:(j + 1) * C].clone()
        out[b + "att.out_proj.weight"] = sd[h + "attn.c_proj.weight"].t().contiguous()
        out[b + "att.out_proj.bias"] = sd[h + "attn.c_proj.bias"]
        out[b + "att.mask"] = mask
        out[b + "ff.layers.0.weight"] = sd[h + "mlp.c_fc.weight"].t().contiguous()
        out[b + "ff.layers.0.bias"] = sd[h + "mlp.c_fc.bias"]
        out[b + "ff.layers.2.weight"] = sd[h + "mlp.c_proj.weight"].t().contiguous()
        out[b + "ff.layers.2.bias"] = sd[h + "mlp.c_proj.bias"]
        for ln, norm in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[b + norm + ".scale"], out[b + norm + ".shift"] = sd[h + ln + ".weight"], sd[h + ln + ".bias"]
    out["final_norm.scale"], out["final_norm.shift"] = sd["ln_f.weight"], sd["ln_f.bias"]
    out["out_head.weight"] = model.output_weight().detach()
    return out, cfg


def book_config_path(path: str) -> str:
    """Where the config dict of a book checkpoint ``DIR/NAME.pth`` lives: ``DIR/NAME.json``."""
    return os.path.splitext(path)[0] + ".json"


def read_book(path: str, cfg: dict | None = None, obj=None) -> tuple[dict[str, torch.Tensor], GPT2Config, dict]:
    """A book checkpoint file → (gpt2mha state dict, config, the book's config dict).

    The config dict comes from ``cfg``, else a ``"config"``/``"cfg"`` dict stored in the file,
    else :func:`book_config_path` beside it (``cfg`` entries win over the stored ones).

    Raises:
        CheckpointError: see :func:`read_torch_file`, :func:`book_to_gpt2`.
    """
    obj = read_torch_file(path) if obj is None else obj
    sd = _book_state_dict_of(obj)
    if sd is None:
        raise CheckpointError(f"{path}: expected the book's GPTModel state dict (or {{'model_state_dict': …}})")
    stored = next((obj[k] for k in ("config", "cfg") if isinstance(obj, dict) and isinstance(obj.get(k), dict)), None)
    side = book_config_path(path)
    if stored is None and os.path.isfile(side):
        try:
            with open(side) as f:
                stored = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{side}: cannot read JSON: {e}") from None
    full = book_config(sd, {**(stored or {}), **(cfg or {})}, path)
    sd_ours, config = book_to_gpt2(sd, full, path)
    return sd_ours, config, full


def save_book(model: GPT2, path: str, overwrite: bool = False) -> tuple[str, str]:
    """Write the book's GPTModel state dict to ``path`` (``torch.save``; the book loads it with
    ``model.load_state_dict(torch.load(path, weights_only=True))``) and its config dict to
    :func:`book_config_path`. Returns both paths.

    Raises:
        FileExistsError: either file exists, unless ``overwrite``.
    """
    sd, cfg = gpt2_to_book(model)
    side = book_config_path(path)
    _refuse_existing([path, side], overwrite)
    _mkdir_for(path)
    torch.save(sd, path)
    with open(side, "w") as f:
        json.dump(cfg, f, indent=2)
    return path, side


# ------------------------------------------------------------------------------ nanoGPT
def nanogpt_to_gpt2(ckpt: dict, source: str = "ckpt.pt") -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """nanoGPT's checkpoint dict (``model_args`` + ``model``) → (gpt2mha state dict, config).

    ``_orig_mod.``/``module.`` prefixes are stripped, the causal-mask buffers ``attn.bias``
    (nanoGPT without flash attention) dropped, the four nn.Linear weights per block transposed
    (:func:`~gpt2mha.convert.linear_to_conv1d_state_dict`), and with ``bias=False`` every
    bias is zeros. ``block_size`` → n_ctx; ``vocab_size`` (e.g. 50304, padded) → n_vocab.

    Raises:
        CheckpointError: missing ``model_args`` fields, a missing, unexpected or mis-shaped tensor.
    """
    args = ckpt.get("model_args")
    need = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
    if not isinstance(args, dict) or any(k not in args for k in need):
        raise CheckpointError(f"{source}: model_args must hold {', '.join(need)}; got {args!r}"[:300])
    if not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"{source}: 'model' is not a state dict")
    bias = bool(args.get("bias", True))
    try:
        config = GPT2Config(n_vocab=args["vocab_size"], n_ctx=args["block_size"], n_embd=args["n_embd"],
                            n_head=args["n_head"], n_layer=args["n_layer"],
                            **{k: float(args.get("dropout", 0.0)) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")},
                            tokenizer="gpt2" if args["vocab_size"] >= 50257 else "bytes")
    except ValueError as e:
        raise CheckpointError(f"{source}: model_args: {e}") from None
    try:
        sd = strip_wrapper_prefixes(ckpt["model"])
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    C, V, T = config.n_embd, config.n_vocab, config.n_ctx
    expected, optional = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}, {}
    optional["lm_head.weight"] = (V, C)

    def linear(name, out_f, in_f):
        expected[name + ".weight"] = (out_f, in_f)
        if bias:
            expected[name + ".bias"] = (out_f,)

    def norm(name):
        expected[name + ".weight"] = (C,)
        if bias:
            expected[name + ".bias"] = (C,)

    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        norm(p + "ln_1"), norm(p + "ln_2")
        linear(p + "attn.c_attn", 3 * C, C), linear(p + "attn.c_proj", C, C)
        linear(p + "mlp.c_fc", 4 * C, C), linear(p + "mlp.c_proj", C, 4 * C)
        optional[p + "attn.bias"] = (1, 1, T, T)
    norm("transformer.ln_f")
    check_tensors(_shapes(sd), expected, source, optional)
    sd = {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}
    sd = {k.removeprefix("transformer."): v for k, v in linear_to_conv1d_state_dict(sd).items()}
    if not bias:                                   # nanoGPT's bias=False: LayerNorms and Linears without bias
        for name, t in list(sd.items()):
            if name.endswith(".weight") and name not in ("wte.weight", "wpe.weight", "lm_head.weight"):
                sd[name.removesuffix("weight") + "bias"] = torch.zeros(t.shape[-1], dtype=t.dtype)  # out features
    return tie_head(sd, config)


def gpt2_to_nanogpt(model: GPT2) -> dict:
    """:class:`GPT2` → a nanoGPT checkpoint dict that nanoGPT's ``sample.py`` loads: ``model``
    (``transformer.…`` keys, nn.Linear layout, ``lm_head.weight`` = wte), ``model_args``
    (``bias=False`` iff every bias is exactly zero, ``dropout`` = resid_pdrop), ``iter_num`` 0,
    ``best_val_loss`` inf, ``config`` {} (no optimizer state: not a run to resume).

    Raises:
        ValueError: an untied LM head (nanoGPT always ties it to wte).
    """
    c = model.config
    if not c.tie_word_embeddings:
        raise ValueError("nanoGPT ties lm_head to wte; this model has a separate LM head (tie_word_embeddings=False)")
    sd = _state_dict(model.state_dict())
    bias = any(bool(v.ne(0).any()) for k, v in sd.items() if k.endswith(".bias"))
    lin = conv1d_to_linear_state_dict({"transformer." + k: v for k, v in sd.items()})
    if not bias:
        lin = {k: v for k, v in lin.items() if not k.endswith(".bias")}
    lin["lm_head.weight"] = lin["transformer.wte.weight"]
    args = {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "block_size": c.n_ctx,
            "bias": bias, "vocab_size": c.n_vocab, "dropout": c.resid_pdrop}
    return {"model": lin, "model_args": args, "iter_num": 0, "best_val_loss": float("inf"), "config": {}}


def read_nanogpt(path: str, obj=None) -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """nanoGPT's ``ckpt.pt`` (or its ``out_dir``) → (gpt2mha state dict, config)."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    obj = read_torch_file(path) if obj is None else obj
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected nanoGPT's checkpoint dict (model_args + model)")
    return nanogpt_to_gpt2(obj, path)


def save_nanogpt(model: GPT2, path: str, overwrite: bool = False) -> str:
    """``torch.save`` :func:`gpt2_to_nanogpt` to ``path`` (a directory gets ``ckpt.pt``)."""
    if os.path.isdir(path) or not os.path.splitext(path)[1]:
        path = os.path.join(path, "ckpt.pt")
    ckpt = gpt2_to_nanogpt(model)
    _refuse_existing([path], overwrite)
    _mkdir_for(path)
    torch.save(ckpt, path)
    return path


# ----------------------------------------------------------------------------- dispatch
def _refuse_existing(paths: list[str], overwrite: bool) -> None:
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; refusing to "
                              f"overwrite {'it' if len(existing) == 1 else 'them'} (pass --overwrite / "
                              f"overwrite=True)")


def _mkdir_for(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def read_any(src: str, fmt: str | None = None, book_config: dict | None = None,
             model_cls=GPT2) -> tuple[GPT2, str]:
    """Load any of :data:`FORMATS` as a float32 model of ``model_cls``; returns ``(model, format)``.

    Raises:
        CheckpointError: an unknown ``fmt`` or anything its reader refuses.
    """
    if fmt is not None and fmt not in FORMATS:
        raise CheckpointError(f"format={fmt!r}; expected one of {FORMATS}")
    fmt = fmt or source_format(src)                              # a built-in name or hub id, as --model takes
    if fmt == "hf":
        return load_pretrained(src, model_cls), fmt
    if fmt == "openai":
        return load_openai(src, model_cls=model_cls), fmt
    if fmt == "book":
        sd, config, _ = read_book(src, book_config)
    else:
        sd, config = read_nanogpt(src)
    return model_from_state_dict(sd, config, src, model_cls=model_cls), fmt


def load_any(src: str, dtype: torch.dtype = torch.float32, book_config: dict | None = None,
             model_cls=GPT2) -> GPT2:
    """Any model a user names → a model of ``model_cls`` in ``dtype`` (eval mode): a built-in
    name, a Hugging Face directory or hub id (:func:`~gpt2mha.io.checkpoints.load_pretrained`),
    or a local checkpoint in another of :data:`FORMATS` (detected: OpenAI's directory,
    nanoGPT's ``ckpt.pt`` or ``out_dir``, a book ``.pth``). What ``GPT2.from_pretrained`` and
    ``--model`` call.
    """
    if not os.path.exists(src) or os.path.isfile(os.path.join(src, CONFIG_NAME)):
        return load_pretrained(src, model_cls, as_dtype(dtype))
    dtype = as_dtype(dtype)
    model, _ = read_any(src, book_config=book_config, model_cls=model_cls)
    if dtype != torch.float32:
        overflow = [k for k, v in model.state_dict().items() if not torch.isfinite(v.to(dtype)).all()]
        if overflow:
            raise CheckpointError(f"{src}: values of {', '.join(overflow)} overflow {dtype}; load in float32")
    return model.to(dtype)


def convert(src: str, dst: str, to: str = "hf", overwrite: bool = False, src_format: str | None = None,
            book_config: dict | None = None, quantize=None) -> list[str]:
    """Read ``src`` (any of :data:`FORMATS`) and write it to ``dst`` as ``to`` (``hf``: a
    directory ``GPT2LMHeadModel`` loads, with the tokenizer and generation files that
    transformers' ``pipeline`` and ``AutoTokenizer`` read, :func:`~gpt2mha.checkpoints.save_pretrained`;
    ``book``: ``DST.pth`` + ``DST.json``; ``nanogpt``:
    ``ckpt.pt``). Returns the paths written.

    ``quantize``: a function applied to the float model before an ``hf`` directory is written
    (e.g. ``lambda m: m.quantize("int8")``), so the directory holds a quantized model
    (gpt2mha reads it; transformers does not).

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
    model, _ = read_any(src, src_format, book_config)
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
