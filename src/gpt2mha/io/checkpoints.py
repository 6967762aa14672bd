"""Loading and saving GPT-2 checkpoints in Hugging Face's directory format.

A checkpoint directory holds ``config.json`` (transformers' ``GPT2Config`` keys) and
``model.safetensors`` (or a legacy ``pytorch_model.bin``, read only with
``torch.load(weights_only=True)``), or either sharded as transformers writes large models:
``model.safetensors.index.json`` (``weight_map``: tensor name → shard file) beside
``model-00001-of-0000N.safetensors`` … (:func:`~.files.read_sharded`; ``save_pretrained(…,
max_shard_size=…)`` writes them). Keys may be spelled ``h.0.…`` (OpenAI's conversion) or
``transformer.h.0.…`` (``GPT2LMHeadModel``); the legacy buffers ``attn.bias`` /
``attn.masked_bias`` are ignored. The LM head follows transformers: tied to ``wte`` unless
``tie_word_embeddings`` is false or the file holds an ``lm_head.weight`` that differs from
``wte.weight`` (then a separate head, with a warning); a tied weight stored only as
``lm_head.weight`` (what ``safetensors.torch.save_model`` writes) is read as ``wte.weight``.
Every tensor is checked (names, shapes, dtype, finiteness) before anything is copied, so a bad
file never leaves a half-loaded model.

The module registers the ``hf`` format with the registry (:mod:`.registry`: :func:`is_hf_dir`,
:func:`read_hf`, names resolved by :func:`resolve`), and the ``quantized`` one when
:mod:`gpt2mha.inference.quant` registers its :class:`QuantizedFormat`
(:func:`register_quantized_format`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
from typing import Callable, NamedTuple

import torch
import huggingface_hub
from huggingface_hub import constants, split_torch_state_dict_into_shards
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import save_file

from ..core.model import GPT2, GPT2Config
from .classifiers import classifier_from_hf, classifier_tensors, classifier_to_hf, is_hf_classifier
from .files import (CONFIG_NAME, SHARD_PATTERN, WEIGHTS_FILES, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, find_weights,
                    read_weight_map, read_weights)
from .registry import CheckpointFormat, Source, as_dtype, read_checkpoint, register_format
from .state_dicts import Checkpoint, CheckpointError, build_model
from ..core.classifier import ClassifierConfig
from .tokenizer import HF_TOKENIZER_FILES, hf_tokenizer_files, tokenizer_class


class QuantizedFormat(NamedTuple):
    """How a quantized model is stored, registered by :mod:`gpt2mha.inference.quant` (a layer
    above this one) with :func:`register_quantized_format`.

    Attributes:
        load: ``load(checkpoint, dtype, model_cls) -> model``: the quantized model of a
            :class:`~.state_dicts.Checkpoint` whose ``quantization`` is the ``config.json``
            entry (:func:`read_quantized`), its float tensors in ``dtype``.
        save: ``save(model, dtype) -> (tensors, entry)``: what ``save_pretrained`` writes.
    """

    load: Callable
    save: Callable


_QUANTIZED: list[QuantizedFormat] = []


def register_quantized_format(fmt: QuantizedFormat) -> None:
    """Make ``fmt`` the reader and writer of quantized checkpoints (called once, by
    :mod:`gpt2mha.inference.quant.checkpoint` when it is imported): ``save_pretrained`` writes
    with it, and the registry's ``quantized`` record (detected before a plain Hugging Face
    directory: :func:`is_quantized_dir`) reads with :func:`read_quantized` and builds with it."""
    _QUANTIZED[:] = [fmt]
    register_format(CheckpointFormat("hf", "quantized", is_quantized_dir, read_quantized, order=0, build=fmt.load))


def quantized_format() -> QuantizedFormat:
    """The registered :class:`QuantizedFormat`.

    Raises:
        CheckpointError: none registered (``gpt2mha.inference.quant`` was not imported; importing
            ``gpt2mha`` does it).
    """
    if not _QUANTIZED:
        raise CheckpointError("a quantized checkpoint needs gpt2mha.inference.quant: import gpt2mha first")
    return _QUANTIZED[0]

#: Built-in models shipped inside the package (``gpt2mha/models/<name>/``).
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
#: transformers' generation defaults for the checkpoint (:func:`generation_config_to_hf`).
GENERATION_CONFIG_NAME = "generation_config.json"


def builtin_models() -> list[str]:
    """Names of the models shipped in the package."""
    if not os.path.isdir(MODELS_DIR):
        return []
    return sorted(d for d in os.listdir(MODELS_DIR) if os.path.isfile(os.path.join(MODELS_DIR, d, CONFIG_NAME)))


# ----------------------------------------------------------------------------------- config
def config_from_hf(cfg: dict, source: str = "config.json") -> GPT2Config:
    """transformers' GPT-2 ``config.json`` dict → :class:`GPT2Config`.

    Raises:
        CheckpointError: not a GPT-2 config, a missing size, or an option GPT-2 does not have
            (another activation, another MLP width, inverse-layer-index scaling).
    """
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{source}: model_type={cfg.get('model_type')!r}; only 'gpt2' checkpoints are supported")
    if "n_positions" not in cfg and "n_ctx" in cfg:               # older configs spell it n_ctx
        cfg = {**cfg, "n_positions": cfg["n_ctx"]}
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer") if k not in cfg]
    if missing:
        raise CheckpointError(f"{source}: missing {', '.join(missing)}")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{source}: activation_function={act!r}; GPT-2 uses the tanh GELU ('gelu_new')")
    if cfg.get("n_inner") not in (None, 4 * cfg["n_embd"]):
        raise CheckpointError(f"{source}: n_inner={cfg['n_inner']}; GPT-2's MLP is 4·n_embd={4 * cfg['n_embd']}")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("scale_attn_weights") is False:
        raise CheckpointError(f"{source}: attention scaling options differ from GPT-2's 1/sqrt(head_dim)")
    tie = cfg.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{source}: tie_word_embeddings={tie!r} must be true or false")
    extra = cfg.get("gpt2mha", {})
    if not isinstance(extra, dict):
        raise CheckpointError(f"{source}: 'gpt2mha' must be an object, got {extra!r}")
    floats = {"embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "layer_norm_epsilon": 1e-5}
    values = {k: cfg.get(k, default) for k, default in floats.items()}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CheckpointError(f"{source}: {k}={v!r} must be a number")
    try:
        return GPT2Config(
            n_vocab=cfg["vocab_size"], n_ctx=cfg["n_positions"], n_embd=cfg["n_embd"], n_head=cfg["n_head"],
            n_layer=cfg["n_layer"], tokenizer=extra.get("tokenizer", "bytes" if cfg["vocab_size"] == 256 else "gpt2"),
            tie_word_embeddings=tie, **values)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def config_to_hf(config: GPT2Config) -> dict:
    """:class:`GPT2Config` → a ``config.json`` dict that transformers reads as ``GPT2Config``."""
    eot = 50256 if config.tokenizer == "gpt2" and config.n_vocab > 50256 else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.n_vocab, "n_positions": config.n_ctx, "n_embd": config.n_embd,
        "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": config.layer_norm_epsilon,
        "embd_pdrop": config.embd_pdrop, "attn_pdrop": config.attn_pdrop, "resid_pdrop": config.resid_pdrop,
        "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": eot, "eos_token_id": eot, "use_cache": True,
        "gpt2mha": {"tokenizer": config.tokenizer},
    }


def generation_config_to_hf(config: GPT2Config) -> dict:
    """:class:`GPT2Config` → ``generation_config.json``, the defaults transformers' ``generate``
    and ``pipeline("text-generation")`` use with this checkpoint.

    - ``eos_token_id`` / ``bos_token_id`` / ``pad_token_id``: ``<|endoftext|>`` (50256) for a
      GPT-2 BPE model (as openai-community/gpt2's, so transformers stops there, as
      ``gpt2mha generate --stop-at-eos`` does), none for the byte tokenizer, which has no
      special token (transformers then always generates ``max_new_tokens``, as gpt2mha does).
    - ``suppress_tokens``: the ids past the tokenizer's vocabulary when the model has more
      (e.g. 50304 rows for 50257 BPE ids): gpt2mha never samples them
      (``generate(vocab_size=…)``), so transformers must not either.
    - greedy (``do_sample: false``) unless the caller asks for sampling.
    """
    tok_vocab = tokenizer_class(config.tokenizer).n_vocab
    eot = 50256 if config.tokenizer == "gpt2" and config.n_vocab > 50256 else None
    out = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "do_sample": False}
    if config.n_vocab > tok_vocab:
        out["suppress_tokens"] = list(range(tok_vocab, config.n_vocab))
    return out


def tokenizer_fits(config: GPT2Config) -> bool:
    """Whether the model can read every id of its tokenizer (``n_vocab`` ≥ the tokenizer's ids);
    a smaller test model (e.g. 1000 ids with ``tokenizer="gpt2"``) gets no tokenizer files."""
    return config.n_vocab >= tokenizer_class(config.tokenizer).n_vocab


# ---------------------------------------------------------------------------------- resolve
def resolve(name_or_dir: str) -> str:
    """A local directory, a built-in name or a hub id (in that order) → a local directory.

    Raises:
        CheckpointError: a directory without config.json, a path that does not exist, a name
            close to a built-in one (a typo: the message suggests it; the hub is not asked), or a
            hub id that cannot be downloaded (offline: the message says how to use a local copy).
    """
    if os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, CONFIG_NAME)):
            raise CheckpointError(f"{name_or_dir}: no {CONFIG_NAME} in this directory; expected a Hugging Face "
                                  f"GPT-2 checkpoint ({CONFIG_NAME} + {WEIGHTS_NAME})")
        return name_or_dir
    if name_or_dir in builtin_models():
        return os.path.join(MODELS_DIR, name_or_dir)
    looks_like_path = name_or_dir.startswith((".", "/", "~")) or os.sep + os.sep in name_or_dir or os.path.exists(name_or_dir)
    if looks_like_path or name_or_dir.count("/") > 1 or not name_or_dir:
        raise CheckpointError(f"model={name_or_dir!r} is not a directory, a built-in model "
                              f"({', '.join(builtin_models()) or 'none installed'}) or a hub id")
    close = difflib.get_close_matches(name_or_dir, builtin_models(), n=1, cutoff=0.6)
    if close and "/" not in name_or_dir:                       # a typo of a built-in name: don't ask the hub
        raise CheckpointError(f"model={name_or_dir!r} is not a directory or a built-in model; "
                              f"did you mean {close[0]!r}? (built-in: {', '.join(builtin_models())})")
    return download(name_or_dir)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's host (``HF_ENDPOINT``, default huggingface.co)
    opens within ``timeout`` seconds: one quick probe instead of huggingface_hub's ~25 s of
    retries when there is no network."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def download(repo_id: str) -> str:
    """Fetch ``config.json`` and the weights of a hub repo (cached by huggingface_hub, with a
    progress bar) and return the local snapshot directory. The weights are the first of
    :data:`WEIGHTS_FILES` the repo has; an index is downloaded first, then each shard it names.

    With ``HF_HUB_OFFLINE=1``, or when the hub cannot be reached (:func:`hub_reachable`), only
    huggingface_hub's local cache is read, at once.

    Raises:
        CheckpointError: the download fails (offline and not cached, unknown repo), with how to
            use a local copy.
    """
    offline = bool(constants.HF_HUB_OFFLINE)
    local_only = offline or not hub_reachable()
    try:
        config_path = huggingface_hub.hf_hub_download(repo_id, CONFIG_NAME, local_files_only=local_only)
        for name in WEIGHTS_FILES:                 # offline, a file not cached is EntryNotFoundError's subclass
            try:
                path = huggingface_hub.hf_hub_download(repo_id, name, local_files_only=local_only)
            except EntryNotFoundError:
                if name == WEIGHTS_FILES[-1]:
                    raise
                continue
            if name.endswith(".index.json"):      # then every shard it names
                for shard in dict.fromkeys(read_weight_map(path).values()):
                    huggingface_hub.hf_hub_download(repo_id, shard, local_files_only=local_only)
            break
    except CheckpointError:
        raise
    except Exception as e:
        why = ("HF_HUB_OFFLINE is set and it is not in the local cache" if offline else
               f"the hub ({constants.ENDPOINT}) cannot be reached and it is not in the local cache" if local_only else
               f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        raise CheckpointError(
            f"could not get {repo_id!r} from the Hugging Face hub ({why}). "
            f"Copy the model directory (config.json + model.safetensors) to this machine and pass its path, "
            f"e.g. --model /path/to/{repo_id.split('/')[-1]}, or set HF_HOME to a cache that holds it "
            f"(HF_HUB_OFFLINE=1 reads only that cache, without trying the network).") from None
    return os.path.dirname(config_path)


def load_pretrained(name_or_dir: str, model_cls=GPT2, dtype: torch.dtype = torch.float32) -> GPT2:
    """Build a model from a built-in name, a local Hugging Face directory, or a hub id: the
    registry's pass (:func:`~.registry.read_checkpoint`) over the Hugging Face formats only.

    Args:
        name_or_dir: e.g. ``"shakespeare-byte"``, ``"./my-gpt2"``, ``"openai-community/gpt2"``
            (other formats: :func:`gpt2mha.io.formats.load_any`).
        model_cls: the class to build (:class:`~gpt2mha.core.model.GPT2` or a subclass, e.g.
            the public ``gpt2mha.GPT2``).
        dtype: parameter dtype of the returned model (float32 by default): a torch dtype or a
            name such as ``"bf16"`` (:func:`~.registry.as_dtype`).

    Returns:
        The model in eval mode.

    Raises:
        CheckpointError: see :func:`resolve`, :func:`read_hf`, :func:`~.state_dicts.build_model`.
    """
    dtype = as_dtype(dtype)
    return build_model(read_checkpoint(name_or_dir, "hf", any_name=True), dtype, model_cls)


# ---------------------------------------------------------------------------------- read
def is_model_name(src: str) -> bool:
    """Whether ``src`` (no such path) names a model :func:`resolve` finds: a built-in model or a
    hub id (``owner/name``, no file extension)."""
    if src in builtin_models():
        return True
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", src)) and not os.path.splitext(src)[1]


def is_quantized_config(cfg: dict) -> bool:
    """Whether a ``config.json`` dict is a quantized model's (``gpt2mha.quantization``, written
    by ``save_pretrained`` after ``GPT2.quantize``)."""
    extra = cfg.get("gpt2mha")
    return isinstance(extra, dict) and "quantization" in extra


def is_quantized_dir(source: Source) -> bool:
    """Whether a probed directory is a quantized gpt2mha checkpoint (:func:`is_quantized_config`)."""
    return source.config is not None and is_quantized_config(source.config)


def is_hf_dir(source: Source) -> bool:
    """Whether a probed path is a Hugging Face directory (``config.json`` in it)."""
    return source.is_dir and os.path.isfile(os.path.join(source.path, CONFIG_NAME))


def _read_directory(source: Source) -> tuple[dict, GPT2Config, str, dict[str, torch.Tensor]]:
    """``(config.json dict, config, weights path, tensors as stored)`` of a Hugging Face
    directory; a path that is not one gets :func:`resolve`'s error."""
    directory = source.path if source.config is not None else resolve(source.path)
    config_path = os.path.join(directory, CONFIG_NAME)
    cfg = source.config
    if cfg is None:
        try:
            with open(config_path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_path}: cannot read JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object")
    config = config_from_hf(cfg, config_path)
    weights_path = find_weights(directory)
    return cfg, config, weights_path, read_weights(weights_path)


def read_hf(source: Source, options: dict | None = None) -> Checkpoint:
    """A Hugging Face GPT-2 directory → :class:`~.state_dicts.Checkpoint`: ``config.json``
    (:func:`config_from_hf`), the weights (:func:`~.files.find_weights`, :func:`~.files.read_weights`), a
    ``GPT2ForSequenceClassification``'s head and labels (:mod:`.classifiers`).

    Raises:
        CheckpointError: see :func:`resolve`, :func:`config_from_hf`, :func:`~.files.find_weights`,
            :func:`~.files.read_weights`, :func:`~.classifiers.classifier_from_hf`; a quantized
            directory with no quantized format registered.
    """
    cfg, config, weights_path, sd = _read_directory(source)
    if is_quantized_config(cfg):                                  # the quantized record claims it when registered
        return Checkpoint(sd, config, weights_path, cfg["gpt2mha"]["quantization"], quantized_format().load)
    if is_hf_classifier(cfg, sd):                                 # GPT2ForSequenceClassification: score, id2label
        sd, config = classifier_from_hf(cfg, config, sd, weights_path)
    return Checkpoint(sd, config, weights_path)


def read_quantized(source: Source, options: dict | None = None) -> Checkpoint:
    """A quantized gpt2mha directory → :class:`~.state_dicts.Checkpoint` with its
    ``quantization`` entry; the registered :class:`QuantizedFormat` checks and builds it.

    Raises:
        CheckpointError: see :func:`read_hf`.
    """
    cfg, config, weights_path, sd = _read_directory(source)
    return Checkpoint(sd, config, weights_path, cfg["gpt2mha"]["quantization"])


def is_checkpoint_dir(directory: str) -> bool:
    """True if ``directory`` holds a checkpoint written by gpt2mha (config.json with our marker)."""
    try:
        with open(os.path.join(directory, CONFIG_NAME)) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("gpt2mha"), dict)


def shard_size_bytes(max_shard_size) -> int:
    """``max_shard_size`` in bytes: an int, or a string as transformers' ``save_pretrained``
    takes it (huggingface_hub's ``parse_size_to_int``: ``"10MB"``, ``"5GB"``, ``"500KB"``,
    ``"1TB"``; decimal units, 1 MB = 10⁶ bytes).

    Raises:
        ValueError: naming the value: not an int or such a string, or not positive.
    """
    if isinstance(max_shard_size, str):
        try:
            size = parse_size_to_int(max_shard_size)
        except ValueError as e:
            raise ValueError(f"max_shard_size={max_shard_size!r}: {e}") from None
    elif isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    else:
        raise ValueError(f"max_shard_size={max_shard_size!r}: expected bytes as an int or a size such as '10MB'")
    if size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive")
    return size


def save_pretrained(model: GPT2, directory: str, overwrite: bool = False,
                    dtype: torch.dtype = torch.float32, max_shard_size: int | str | None = None) -> list[str]:
    """Write ``config.json`` and ``model.safetensors`` (``transformer.``-prefixed keys; the head
    tied, or ``lm_head.weight`` with ``tie_word_embeddings: false`` for an untied model) that
    ``GPT2LMHeadModel.from_pretrained`` loads with the same logits, ``generation_config.json``
    (:func:`generation_config_to_hf`) and the tokenizer files
    (:func:`gpt2mha.io.tokenizer.hf_tokenizer_files`: ``tokenizer.json``, ``tokenizer_config.json``,
    and for GPT-2 BPE ``vocab.json``, ``merges.txt``, ``special_tokens_map.json``), so
    ``transformers.pipeline("text-generation", model=directory)`` and ``AutoTokenizer`` work on
    the directory and tokenise as gpt2mha does. The tokenizer's name stays in ``config.json``'s
    ``gpt2mha`` section, which is what gpt2mha reads back. A model with fewer ids than its
    tokenizer (a test model) gets no tokenizer files.

    ``dtype`` is the storage dtype of the weights (float32 by default; float16 halves the file,
    as for the built-in model); loading converts back to the dtype asked for.

    ``max_shard_size`` (bytes, or ``"10MB"``-style: :func:`shard_size_bytes`) splits the weights
    as transformers does (huggingface_hub's ``split_torch_state_dict_into_shards``): shards
    ``model-00001-of-0000N.safetensors`` of at most that size (a larger tensor gets a shard of
    its own) and ``model.safetensors.index.json``; when everything fits in one shard, or with
    None (the default), one ``model.safetensors``. Weight files of an earlier save in the
    directory (its single file, index or shards) are removed once the new ones are written.

    Files are written to temporaries and renamed, so an interrupted save leaves the previous
    checkpoint intact. Tokenizer files of an earlier save that this model's tokenizer does not
    have (e.g. ``vocab.json`` when a byte model replaces a BPE one) are removed.

    Returns:
        The paths written, ``config.json`` first.

    Raises:
        FileExistsError: ``directory`` is non-empty and not a gpt2mha checkpoint, unless
            ``overwrite=True`` (nothing a user has is overwritten without asking).
        ValueError: ``dtype`` is not floating point, ``max_shard_size`` unreadable, or a weight
            does not fit in ``dtype`` (e.g. a value beyond float16's ±65504 would be stored as
            inf); nothing is written then.
    """
    if os.path.isdir(directory) and os.listdir(directory) and not (overwrite or is_checkpoint_dir(directory)):
        raise FileExistsError(f"{directory} is not empty and is not a gpt2mha checkpoint; refusing to write into it "
                              f"(choose another directory or pass overwrite=True)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point torch dtype")
    shard_size = None if max_shard_size is None else shard_size_bytes(max_shard_size)
    hf_config = config_to_hf(model.config)
    if isinstance(model.config, ClassifierConfig):               # GPT2ForSequenceClassification's layout
        hf_config = classifier_to_hf(model.config, hf_config)
    tensors = _tensors_to_save(model, dtype, hf_config)
    os.makedirs(directory, exist_ok=True)
    written = _write_weights(directory, tensors, shard_size)
    extra = {GENERATION_CONFIG_NAME: json.dumps(generation_config_to_hf(model.config), indent=2) + "\n"}
    if tokenizer_fits(model.config):
        extra.update(hf_tokenizer_files(model.config.tokenizer, model.config.n_ctx))
    for name, content in extra.items():
        _atomic_write(directory, name, lambda p, content=content: _write_bytes(p, content))
    text = json.dumps(hf_config, indent=2) + "\n"
    _atomic_write(directory, CONFIG_NAME, lambda p: _write_text(p, text))
    written |= {CONFIG_NAME, *extra}
    for name in os.listdir(directory):          # an earlier save's weights: read before, or beside, the new ones
        if name not in written and (name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or name in HF_TOKENIZER_FILES or
                                    (SHARD_PATTERN.fullmatch(name) and name.endswith(".safetensors"))):
            os.remove(os.path.join(directory, name))
    first = [CONFIG_NAME, *sorted(n for n in written if n != CONFIG_NAME)]
    return [os.path.join(directory, n) for n in first]


def _tensors_to_save(model: GPT2, dtype: torch.dtype, hf_config: dict) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` stores, by transformers' names; a quantized model's as
    stored for its kernels (its entry goes into ``hf_config``).

    Raises:
        ValueError: a weight that ``dtype`` cannot hold (nothing is written then).
    """
    if getattr(model, "quantization", None):                     # int8/int4 weights stored as they are
        tensors, entry = quantized_format().save(model, dtype)
        tensors = {f"transformer.{k}": v for k, v in tensors.items()}
        hf_config["gpt2mha"]["quantization"] = entry
        hf_config["quantization_config"] = {"quant_method": "gpt2mha", **entry}   # transformers cannot load it
    elif isinstance(model.config, ClassifierConfig):
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in classifier_tensors(model.state_dict()).items()}
    else:
        tensors = {k if k == "lm_head.weight" else f"transformer.{k}": v.detach().to(dtype).contiguous()
                   for k, v in model.state_dict().items()}
    overflow = [k for k, v in model.state_dict().items()
                if v.is_floating_point() and bool(torch.isfinite(v).all()) and not bool(torch.isfinite(v.to(dtype)).all())]
    if overflow:
        raise ValueError(f"dtype={dtype} cannot hold the values of {', '.join(overflow)} (they would be stored as inf); "
                         f"save in float32 or bfloat16. Nothing was written.")
    return tensors


def _write_weights(directory: str, tensors: dict[str, torch.Tensor], shard_size: int | None) -> set[str]:
    """``model.safetensors``, or shards and their index as transformers writes them
    (huggingface_hub's ``split_torch_state_dict_into_shards``); returns the names written."""
    split = None
    if shard_size is not None:
        split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=shard_size)
    if split is None or not split.is_sharded:
        _atomic_write(directory, WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        return {WEIGHTS_NAME}
    for name, names in split.filename_to_tensors.items():
        _atomic_write(directory, name, lambda p, names=names: save_file({n: tensors[n] for n in names}, p,
                                                                        metadata={"format": "pt"}))
    index = json.dumps({"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename},
                       indent=2, sort_keys=True) + "\n"
    _atomic_write(directory, WEIGHTS_INDEX_NAME, lambda p: _write_text(p, index))
    return {*split.filename_to_tensors, WEIGHTS_INDEX_NAME}


def _atomic_write(directory: str, name: str, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(directory, name))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write_bytes(path: str, content: str | bytes) -> None:
    with open(path, "wb") as f:
        f.write(content.encode("utf-8") if isinstance(content, str) else content)


register_format(CheckpointFormat("hf", "hf", is_hf_dir, read_hf, order=10, names=is_model_name, resolve=resolve,
                                 describe={"dir": f"a Hugging Face GPT-2 checkpoint ({CONFIG_NAME} + {WEIGHTS_NAME})"}))
