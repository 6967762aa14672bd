"""OpenAI's original checkpoint directory (what ``download_model.py`` writes): ``checkpoint``,
``model.ckpt.index``, ``model.ckpt.data-00000-of-00001``, ``hparams.json``, ``encoder.json``,
``vocab.bpe``, read with TensorFlow's own ``tf.train.load_checkpoint`` (``pip install
'gpt2mha[tf]'``). Variables as ``model`` in openai/gpt-2 ``src/model.py`` creates them:
``model/wte [n_vocab, n_embd]``, ``model/wpe [n_ctx, n_embd]``, ``model/h{i}/ln_1/g|b``,
``model/h{i}/attn/c_attn/w [1, n_embd, 3·n_embd]`` (conv1d's ``[1, nx, nf]``), ``…/b``,
``attn/c_proj``, ``ln_2``, ``mlp/c_fc``, ``mlp/c_proj``, ``model/ln_f/g|b``. Read only.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import warnings

import torch

from ..core.model import GPT2, GPT2Config
from .layouts import check_tensors
from .registry import CheckpointFormat, Source, register_format
from .state_dicts import Checkpoint, CheckpointError, CheckpointWarning, model_from_state_dict
from .tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256


OPENAI_FILES = ("checkpoint", "model.ckpt.index", "model.ckpt.data-00000-of-00001", "hparams.json")


TF_EXTRA = "pip install 'gpt2mha[tf]'"


def is_openai_dir(path: str) -> bool:
    """True if ``path`` is a directory holding OpenAI's ``hparams.json`` and a TF checkpoint."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "hparams.json"))
            and (os.path.isfile(os.path.join(path, "checkpoint"))
                 or os.path.isfile(os.path.join(path, "model.ckpt.index"))))


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
    OpenAI's (the hashes :mod:`gpt2mha.io.tokenizer` checks); None when the directory has neither.

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


def read_openai_source(source: Source, options: dict | None = None) -> Checkpoint:
    """The registry's reader: :func:`read_openai` of a probed directory."""
    sd, config = read_openai(source.path)
    return Checkpoint(sd, config, source.path)


register_format(CheckpointFormat("openai", "openai", lambda source: is_openai_dir(source.path), read_openai_source,
                                 order=20,
                                 describe={"dir": f"OpenAI's checkpoint directory ({', '.join(OPENAI_FILES)})"}))
