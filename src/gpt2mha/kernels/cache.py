"""The opt-in build into the cache (``GPT2MHA_KERNELS=build``): for a source tree whose C++ was
edited since the install, the sources beside this file compiled once into ``cache_dir()``
under a name that hashes what the library depends on (the sources, the flags, the compiler's
version and torch's), then loaded from there.

Processes that ask at once (the ranks of one ``torchrun``) compute the same name; the first takes
a file lock and compiles, the others wait on the lock and load its library. A library is written
whole or not at all (a temporary file, renamed); the record beside it (written last) holds its
sha256, so a library cut short or replaced since is compiled again; files left by a build that
was killed are removed by the next.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from . import build


def cache_dir() -> Path:
    """Where the opt-in build keeps its libraries: ``$GPT2MHA_CACHE``, else
    ``$XDG_CACHE_HOME/gpt2mha``, else ``~/.cache/gpt2mha``."""
    if os.environ.get("GPT2MHA_CACHE"):
        return Path(os.environ["GPT2MHA_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "gpt2mha"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def library_path(cxx: str) -> Path:
    """The cached library for these sources, flags, compiler (``cxx``) and torch."""
    key = hashlib.sha256("\0".join([build.sources_digest(), " ".join(build.flags()), build.compiler_version(cxx),
                                    torch.__version__]).encode()).hexdigest()[:16]
    return cache_dir() / f"kernels-{key}.so"


def _complete(library: Path) -> bool:
    """Whether ``library`` is there whole: its record names its sha256."""
    try:
        return library.is_file() and json.loads(build.record_path(library).read_text()).get("sha256") == _sha256(library)
    except (OSError, ValueError):
        return False


def build_library() -> Path:
    """The cached library, compiled first where it is missing or incomplete (under the lock).

    Raises:
        FileNotFoundError: no C++ compiler.
        NotADirectoryError: the cache path is not a directory.
        RuntimeError: the compiler failed (its output).
    """
    cxx = build.compiler()
    library = library_path(cxx)
    if _complete(library):
        return library
    if library.parent.exists() and not library.parent.is_dir():
        raise NotADirectoryError(f"the cache path {library.parent} is not a directory (set GPT2MHA_CACHE to one)")
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_name(library.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                         # released when the file closes
        if _complete(library):                                   # another process built it meanwhile
            return library
        for left in library.parent.glob(f".{library.name}.*.tmp"):       # a killed build's (we hold the lock)
            left.unlink(missing_ok=True)
        build.record_path(library).unlink(missing_ok=True)
        sys.stderr.write(f"gpt2mha: GPT2MHA_KERNELS=build: compiling its C++ kernels into {library} (once, 1-2 min)\n")
        sys.stderr.flush()
        build.build_library(library)
    return library

