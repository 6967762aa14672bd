"""The registry of checkpoint formats and the one pass that reads any of them.

A format is one record, :class:`CheckpointFormat`: ``detect(source) -> bool`` and ``read(source,
options) -> Checkpoint`` (:class:`~.state_dicts.Checkpoint`: the state dict and the config),
registered with :func:`register_format` by the module that reads it, when it is imported:
:mod:`.checkpoints` (Hugging Face directories, the classifier among them), :mod:`.openai_tf`,
:mod:`.learner_formats` (nanoGPT's ``ckpt.pt``, the book's state dicts), and
:mod:`gpt2mha.inference.quant.checkpoint` (quantized directories, through
:func:`.checkpoints.register_quantized_format`). :mod:`.formats` imports them all.

A load is one pass (:func:`read_checkpoint`, then :func:`~.state_dicts.build_model`): locate the
path (a built-in name or hub id is resolved by the format that has ``resolve``), probe it once
(a directory's ``config.json`` parsed, a file loaded with ``torch.load``: :class:`Source`),
detect its format once (the first record, in ``order``, that claims it), read it once,
normalise its keys once (:func:`~.state_dicts.canonical`), build the model with the dtype
applied once. The pass walks down the modules (registry, the format's module, files and
layouts, state_dicts) and never returns to one it left (``tests/test_loading_walk.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .files import CONFIG_NAME, read_torch_file
from .state_dicts import Checkpoint, CheckpointError, canonical

#: dtype names accepted wherever a dtype is given as text (API and CLI).
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def as_dtype(dtype) -> torch.dtype:
    """A floating torch dtype from a dtype or one of :data:`DTYPE_NAMES` (``"bf16"``, …).

    Raises:
        ValueError: naming the value and the accepted names.
    """
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype={dtype!r}; expected a floating torch dtype or one of {sorted(DTYPE_NAMES)}")


@dataclass(frozen=True)
class Source:
    """A local checkpoint path, probed once for every detector and reader.

    Attributes:
        path: the file or directory.
        is_dir: whether it is a directory.
        config: a directory's ``config.json`` parsed, when it is a JSON object; else None (the
            reader that needs it says why).
        obj: what ``torch.load(weights_only=True)`` returns for a file, when a format that
            reads files is among those asked; else None.
    """

    path: str
    is_dir: bool
    config: dict | None = None
    obj: Any = None


class CheckpointFormat(NamedTuple):
    """One checkpoint format, as it registers (:func:`register_format`).

    Attributes:
        family: the name users give it (``--from``, ``read_any(fmt=…)``): ``"hf"``,
            ``"openai"``, ``"nanogpt"``, ``"book"``; several records may share one.
        name: the record's own name (one record per name).
        detect: ``detect(source) -> bool``: whether a :class:`Source` is this format; cheap,
            and reading only what the source holds.
        read: ``read(source, options) -> Checkpoint``; ``options``: ``{"book_config": …}``.
        order: detectors run in increasing order (a quantized directory before a plain one).
        kinds: what it reads, ``("dir",)``, ``("file",)`` or both: only its kinds of path are
            offered to its ``detect``, and a file is read with ``torch.load`` only for a
            format that reads files.
        describe: ``{"dir": …, "file": …}``: how the error for an undetected path names the
            format, for each kind it reads (none: a case of another format, not named).
        build: ``build(checkpoint, dtype, model_cls) -> model`` when the format builds its own
            model (a quantized one); None: :func:`~.state_dicts.build_model`'s.
        file: the file read inside a directory (nanoGPT's ``out_dir``: ``ckpt.pt``); a
            directory holding it is this format.
        names: ``names(src) -> bool``: whether a path that does not exist is a name this format
            resolves (a built-in model, a hub id).
        resolve: ``resolve(name) -> directory`` for such names.
    """

    family: str
    name: str
    detect: Callable[[Source], bool]
    read: Callable[[Source, dict], Checkpoint]
    order: int = 50
    kinds: tuple[str, ...] = ("dir",)
    describe: dict = {}
    build: Callable | None = None
    file: str | None = None
    names: Callable[[str], bool] | None = None
    resolve: Callable[[str], str] | None = None


_FORMATS: list[CheckpointFormat] = []


def register_format(fmt: CheckpointFormat) -> None:
    """Add ``fmt`` (replacing a record of the same name), keeping the records in ``order``."""
    _FORMATS[:] = sorted([f for f in _FORMATS if f.name != fmt.name] + [fmt], key=lambda f: f.order)


def registered_formats() -> tuple[CheckpointFormat, ...]:
    """The registered records, in the order their detectors run."""
    return tuple(_FORMATS)


def _resolver() -> CheckpointFormat | None:
    return next((f for f in _FORMATS if f.resolve is not None), None)


def locate(src: str, any_name: bool = False) -> str:
    """``src`` when it exists, else the directory the resolving format (Hugging Face's) makes
    of it: any name with ``any_name`` (``--model``: the resolver's own errors for a path that
    does not exist), else only what its ``names`` accepts (a built-in name, a hub id).

    Raises:
        CheckpointError: ``{src}: no such file or directory``, or the resolver's errors.
    """
    if os.path.exists(src):
        return src
    named = _resolver()
    if named is not None and (any_name or named.names(src)):
        return named.resolve(src)
    raise CheckpointError(f"{src}: no such file or directory")


def probe(path: str, formats) -> Source:
    """:class:`Source` of an existing ``path``: a directory's ``config.json`` parsed, a file's
    ``torch.load`` when one of ``formats`` reads files.

    Raises:
        CheckpointError: the file cannot be read (:func:`~.files.read_torch_file`).
    """
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, CONFIG_NAME), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
        return Source(path, True, config=config if isinstance(config, dict) else None)
    reads_files = any("file" in f.kinds for f in formats)
    return Source(path, False, obj=read_torch_file(path) if reads_files else None)


def detect(source: Source, formats) -> CheckpointFormat | None:
    """The first of ``formats`` that reads ``source``'s kind and claims it: a directory holding
    its ``file``, or its ``detect``; None when none does."""
    kind = "dir" if source.is_dir else "file"
    for fmt in formats:
        if kind not in fmt.kinds:
            continue
        if fmt.file is not None and source.is_dir:
            if os.path.isfile(os.path.join(source.path, fmt.file)):
                return fmt
        elif fmt.detect(source):
            return fmt
    return None


def _one_of(names: list[str], last: str) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" {last} " + names[-1]


def undetected(source: Source) -> CheckpointError:
    """The error for a path no format claims, naming what each format expects there."""
    if source.is_dir:
        expected = [f.describe["dir"] for f in _FORMATS if "dir" in f.describe]
        return CheckpointError(f"{source.path}: no {CONFIG_NAME} in this directory; expected "
                               f"{_one_of(expected, 'or')}")
    expected = [f.describe["file"] for f in _FORMATS if "file" in f.describe]
    obj = source.obj
    keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
    return CheckpointError(f"{source.path}: neither {_one_of(expected, 'nor')}; found {keys}")


def detect_format(path: str) -> str:
    """The family of the format ``path`` holds (:func:`detect` over every registered format).

    Raises:
        CheckpointError: none claims it (naming what was looked for), or no such path.
    """
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise CheckpointError(f"{path}: no such file or directory")
    source = probe(path, _FORMATS)
    fmt = detect(source, _FORMATS)
    if fmt is None:
        raise undetected(source)
    return fmt.family


def source_format(src: str) -> str:
    """:func:`detect_format` for a path; the resolving format's family (``"hf"``) for a name it
    takes (a built-in model, a hub id) where no such path exists, without resolving it.

    Raises:
        CheckpointError: see :func:`detect_format`.
    """
    named = _resolver()
    if not os.path.exists(src) and named is not None and named.names(src):
        return named.family
    return detect_format(src)


def read_checkpoint(src: str, fmt: str | None = None, book_config: dict | None = None,
                    any_name: bool = False) -> Checkpoint:
    """The pass up to the model: :func:`locate` ``src``, :func:`probe` it, :func:`detect` its
    format among ``fmt``'s records (all without ``fmt``; with it and none claiming the path,
    the family's last, general reader reads it and says what is wrong), read it, and normalise
    its keys (:func:`~.state_dicts.canonical`). Build the model with
    :func:`~.state_dicts.build_model`.

    Returns:
        The canonical :class:`~.state_dicts.Checkpoint`, its ``format`` and ``builder`` set
        from the record.

    Raises:
        CheckpointError: see :func:`locate`, :func:`probe`, :func:`undetected` and the readers.
    """
    formats = [f for f in _FORMATS if fmt is None or f.family == fmt]
    if not formats:
        raise CheckpointError(f"no checkpoint format is registered{f' as {fmt!r}' if fmt else ''}: import "
                              f"gpt2mha.io.formats (importing it registers every built-in format)")
    source = probe(locate(src, any_name), formats)
    record = detect(source, formats)
    if record is None and fmt is None:
        raise undetected(source)
    record = record or formats[-1]
    if source.is_dir and record.file is not None:
        source = probe(os.path.join(source.path, record.file), [record])
    checkpoint = record.read(source, {"book_config": book_config})
    return canonical(checkpoint._replace(builder=record.build or checkpoint.builder, format=record.family))
