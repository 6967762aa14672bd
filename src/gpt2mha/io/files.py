"""Tensors read from disk, safely: ``torch.load(weights_only=True)`` for pickles (``.pt``,
``.pth``, ``.bin``), safetensors, and the weights of a Hugging Face directory (one file, or
shards and their index as transformers writes them), each error naming the file. Every
format's reader and the registry's probe (:mod:`.registry`) read through these functions.
"""

from __future__ import annotations

import json
import os
import pickle
import re

import torch
from safetensors.torch import load_file

from .state_dicts import CheckpointError

#: A Hugging Face directory's config and weights (transformers' names).
CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME = "config.json", "model.safetensors", "pytorch_model.bin"
#: The index of a sharded checkpoint (transformers' names): ``{"metadata": …, "weight_map":
#: {tensor name: shard file name}}``, beside shards ``model-00001-of-00003.safetensors`` ….
WEIGHTS_INDEX_NAME, LEGACY_WEIGHTS_INDEX_NAME = WEIGHTS_NAME + ".index.json", LEGACY_WEIGHTS_NAME + ".index.json"
#: Weight files in the order transformers prefers them: one safetensors file, sharded
#: safetensors, one .bin, sharded .bin.
WEIGHTS_FILES = (WEIGHTS_NAME, WEIGHTS_INDEX_NAME, LEGACY_WEIGHTS_NAME, LEGACY_WEIGHTS_INDEX_NAME)
#: A shard's file name as transformers and huggingface_hub write it.
SHARD_PATTERN = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")


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


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, or of a ``.bin`` read with ``weights_only=True``.

    Raises:
        CheckpointError: truncated/corrupt file, or a pickle that would run code.
    """
    if path.endswith(".safetensors"):
        try:
            return load_file(path)
        except Exception as e:  # safetensors raises its own SafetensorError on bad headers/lengths
            raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: this pickle asks to run code or build objects other than "
                              f"tensors ({str(e).splitlines()[-1] if str(e) else 'unsafe'}); convert it to "
                              f"safetensors from a trusted source") from None
    except Exception as e:
        raise CheckpointError(f"{path}: could not be read as a PyTorch state dict (truncated or corrupt?): {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors")
    return sd


def read_weight_map(index_path: str) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index, checked: an object of tensor name → shard
    file name, each shard a plain file name (nothing outside the directory is read), no tensor
    listed twice.

    Raises:
        CheckpointError: unreadable JSON, no ``weight_map``, a shard path, a duplicate name.
    """
    duplicates = []

    def pairs(items):
        seen = {}
        for k, v in items:
            if k in seen:
                duplicates.append((k, seen[k], v))
            seen[k] = v
        return seen

    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f, object_pairs_hook=pairs)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: cannot read JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: expected an object with a non-empty \"weight_map\" (tensor name → shard "
                              f"file), as transformers writes it")
    for k, a, b in duplicates:
        if isinstance(a, str) and isinstance(b, str):
            raise CheckpointError(f"{index_path}: tensor {k} is listed twice in weight_map ({a} and {b}); refusing to "
                                  f"guess which one is meant")
    bad = [f"{k}: {v!r}" for k, v in weight_map.items()
           if not isinstance(v, str) or not v or os.path.basename(v) != v or v in (".", "..")]
    if bad:
        raise CheckpointError(f"{index_path}: weight_map must name shard files in this directory (plain file names); "
                              f"got {', '.join(bad[:3])}")
    return weight_map


def read_sharded(index_path: str) -> dict[str, torch.Tensor]:
    """Tensors of a sharded checkpoint: every shard the index's ``weight_map`` names, read from
    the index's directory (:func:`read_state_dict` each), checked against the index.

    Raises:
        CheckpointError: see :func:`read_weight_map`; a missing shard (named, with how many tensors
            it should hold), a tensor found in two shards (both named), a tensor the index puts
            in a shard that does not hold it, or one a shard holds that the index does not list.
    """
    directory = os.path.dirname(index_path)
    weight_map = read_weight_map(index_path)
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [f for f in shards if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        counts = {f: sum(v == f for v in weight_map.values()) for f in missing}
        raise CheckpointError(f"{index_path}: missing shard{'s' if len(missing) > 1 else ''} "
                              + ", ".join(f"{f} ({counts[f]} tensors, e.g. "
                                          f"{next(k for k, v in weight_map.items() if v == f)})" for f in missing)
                              + f" in {directory}")
    sd, where, problems = {}, {}, []
    for shard in shards:
        for k, t in read_state_dict(os.path.join(directory, shard)).items():
            if k in where:
                raise CheckpointError(f"{index_path}: tensor {k} is in two shards, {where[k]} and {shard}; refusing to "
                                      f"guess which one is meant")
            where[k] = shard
            if k not in weight_map:
                problems.append(f"{shard} holds {k}, which the index does not list")
            elif weight_map[k] != shard:
                problems.append(f"the index puts {k} in {weight_map[k]}, but {shard} holds it")
            sd[k] = t
    problems += [f"the index puts {k} in {v}, which does not hold it" for k, v in weight_map.items() if k not in where]
    if problems:
        raise CheckpointError(f"{index_path}: the shards do not match the index:\n  " + "\n  ".join(problems[:10])
                              + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""))
    return sd


def find_weights(directory: str) -> str:
    """The weights of a checkpoint directory: the first of :data:`WEIGHTS_FILES` present.

    Raises:
        CheckpointError: none of them (naming what was looked for).
    """
    for name in WEIGHTS_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME} with its shards, "
                          f"{LEGACY_WEIGHTS_NAME}, {LEGACY_WEIGHTS_INDEX_NAME}) next to {CONFIG_NAME}")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a weights file or of a sharded checkpoint's index (:func:`read_sharded`)."""
    return read_sharded(path) if path.endswith(".index.json") else read_state_dict(path)
