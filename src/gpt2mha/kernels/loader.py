"""Finding and loading gpt2mha's kernel library (see the package's docstring for
``GPT2MHA_KERNELS`` and ``GPT2MHA_CPU_FEATURES``): once per process, thread-safe, checked against
the torch it runs with and the sources beside it, the CPU features it may take narrowed as
``GPT2MHA_CPU_FEATURES`` says (:mod:`.dispatch`), the fake (meta) implementations registered
after it (:mod:`.fakes`), and one :class:`KernelsUnavailable` warning where none loads."""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from pathlib import Path

import torch

from . import build

ENV = "GPT2MHA_KERNELS"
#: The CPU features the kernels may take, comma-separated (:func:`features_setting`).
FEATURES_ENV = "GPT2MHA_CPU_FEATURES"
#: The CPU features the kernels' paths ask for beyond AVX2, FMA and F16C (every path has those):
#: AVX-512 F/BW/DQ/VL, AVX-512 VNNI, AVX-512 BF16 (``dispatch.h``'s names).
FEATURES = ("avx512", "avx512_vnni", "avx512_bf16")
BASELINE = "avx2"
OFF = ("0", "false", "off", "no")
ON = ("", "1", "true", "on", "yes")
#: What runs where the kernels are not loaded (said once, with the reason).
ROUTES = ("decode products on PyTorch's int8/int4 kernels (int4 per_block models take bf16 activations there, "
          "not W4A8), prefill attention by SDPA, generate without the one-call forward: slower, and results "
          "differ from the kernels' in the last bits (per_block: in the activations' rounding)")


class KernelsUnavailable(RuntimeWarning):
    """Said once per process where gpt2mha's kernels are not loaded: why, and the routes taken instead."""


def setting() -> str:
    """``GPT2MHA_KERNELS`` as ``"on"``, ``"off"``, ``"build"`` or a
    library's path.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return "off"
    if value.lower() in ON:
        return "on"
    if value.lower() == "build":
        return "build"
    if value.endswith(".so") or os.sep in value:
        return value
    raise ValueError(f"{ENV}={value!r}: expected 1 (the library built at install), 0 (none), build (compile the "
                     f"sources into the cache) or the path of a built library (.so)")


def features_setting() -> tuple[str, ...] | None:
    """``GPT2MHA_CPU_FEATURES`` as the features the kernels may take (None where it is unset or
    empty: every feature the CPU has): a comma-separated list of :data:`FEATURES`, or ``avx2``
    (the AVX2 paths only; ``avx2`` in a list changes nothing). An AVX-512 VNNI or BF16 path needs
    ``avx512`` too.

    Raises:
        ValueError: a name not in :data:`FEATURES` or ``avx2``.
    """
    value = os.environ.get(FEATURES_ENV, "").strip()
    if not value:
        return None
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in (BASELINE, *FEATURES)]
    if bad:
        raise ValueError(f"{FEATURES_ENV}={value!r}: {bad[0]!r} is not one of {BASELINE}, {', '.join(FEATURES)} "
                         f"(comma-separated: the CPU features the kernels may take)")
    return tuple(n for n in FEATURES if n in names)


def installed_library() -> Path | None:
    """The library built at install, beside this file (None where there is none)."""
    found = sorted(build.HERE.glob("_kernels*.so"))
    return found[0] if found else None


def _record(library: Path) -> dict:
    try:
        return json.loads(build.record_path(library).read_text())
    except (OSError, ValueError):
        return {}


def _mismatch(library: Path, installed: bool) -> str:
    """Why ``library`` must not be loaded: built against another torch (its C++ ABI differs), or,
    for the installed one, from other sources than those beside it (edited since); else ""."""
    record = _record(library)
    if record.get("torch") and record["torch"].split("+")[0] != torch.__version__.split("+")[0]:
        return (f"{library} was built against torch {record['torch']}, this process runs torch {torch.__version__} "
                f"(a C++ library is tied to one torch): reinstall gpt2mha against this torch "
                f"(pip install --no-build-isolation --force-reinstall --no-deps .)")
    if installed and record.get("sources") and build.sources_digest() not in ("", record["sources"]):
        return (f"{library} was built from other sources than those in {build.HERE} (edited since the install): "
                f"rebuild it (pip install -e ., or pip install --no-build-isolation -e . to reuse this torch), "
                f"or set {ENV}=build to compile them into the cache")
    return ""


def _find() -> tuple[Path | None, str, str]:
    """(the library to load, where it comes from: "installed", "cache" or "path", why there is none)."""
    mode = setting()
    if mode == "off":
        return None, "", f"turned off ({ENV}=0)"
    why = build.platform_supported()
    if why:
        return None, "", why
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, "", f"the CPU has no AVX2 and FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if mode == "build":
        from . import cache
        return cache.build_library(), "cache", ""
    if mode != "on":
        path = Path(mode).expanduser()
        if not path.is_file():
            return None, "", f"{ENV}={mode}: no such library"
        return path, "path", ""
    library = installed_library()
    if library is None:
        return None, "", (f"no library in {build.HERE}: gpt2mha was installed without its kernels (on another "
                          f"platform, or with {ENV}=0 set); reinstall it with pip install . (a C++ compiler "
                          f"needed), or set {ENV}=build to compile them into the cache")
    return library, "installed", ""


_LOADED: dict = {"library": None}


def _recovery(library: Path, origin: str) -> str:
    if origin == "cache":
        return f"delete {library} (it is compiled again on the next run)"
    if origin == "path":
        return f"check {ENV}={library}"
    return (f"reinstall gpt2mha (pip install --force-reinstall --no-deps ., or pip install -e . in a source "
            f"tree), or delete {library} to run without the kernels")


def _load() -> str:
    features = features_setting()
    library, origin, why = _find()
    if library is None:
        return why
    why = _mismatch(library, origin == "installed")
    if why:
        return why
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        return f"{library} does not load ({str(e).splitlines()[0][:300]}): {_recovery(library, origin)}"
    if features is not None:
        torch.ops.gpt2mha.allow_cpu_features(list(features))
    from . import fakes
    fakes.register()
    _LOADED["library"] = library
    return ""


_LOCK = threading.Lock()


@functools.cache
def _loaded() -> str:
    try:
        why = _load()
    except (OSError, RuntimeError) as e:             # the opt-in build failed (its message names the file)
        why = f"{type(e).__name__}: {e}"
    if why:
        warnings.warn(f"gpt2mha: its C++ kernels are not loaded ({why}). Instead: {ROUTES}.", KernelsUnavailable,
                      stacklevel=4)
    return why


def load() -> str:
    """Loads the library once per process (threads asking at once wait for one answer) and
    returns "" or why it is not loaded. Compiles nothing unless ``GPT2MHA_KERNELS=build``.

    Raises:
        ValueError: ``GPT2MHA_KERNELS`` or ``GPT2MHA_CPU_FEATURES`` holds something it cannot mean
            (:func:`setting`, :func:`features_setting`).
    """
    with _LOCK:
        return _loaded()


def available() -> bool:
    """Whether the kernels are loaded (loads them on the first call: :func:`load`)."""
    return load() == ""


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return load()


def loaded_library() -> Path | None:
    """The library loaded in this process (None before :func:`load` or where none loaded)."""
    return _LOADED["library"]
