"""Which paths the kernels take on this CPU: the Python side of ``dispatch.h``.

Every kernel has an AVX2 path (AVX2, FMA and F16C: the library needs them); some have a faster
one for a CPU feature beyond, chosen at run time by one switch per path that asks exactly the
features its code uses (the same bits either way):

=========================== ===============================  =========================================
switch                      path (its features)              the kernels it chooses for
=========================== ===============================  =========================================
``conv1d``                  ``avx512``                       ``conv1d_f32``, ``conv1d_f16``
``linear``                  ``avx512``                       ``linear_f32``, ``linear_f16``
``gelu``                    ``avx512``                       the GELU after ``conv1d_f16`` and ``conv1d_bf16``
``causal_attention``        ``avx512``                       ``causal_attention``
``per_row_rounding``        ``avx512``                       ``int8_per_row``'s rounding of its rows
``per_row``                 ``avx512_vnni`` (and avx512)     ``int8_per_row``'s product and rescale
``w4a8``                    ``avx512_vnni`` (and avx512)     ``int4_a8_packed``, ``int4_gemv_a8``
``bf16``                    ``avx512_bf16`` (and avx512)     ``conv1d_bf16``, ``linear_bf16``; the one-call
                                                             forward's bf16 prompts (else oneDNN)
``causal_attention_bf16``   ``avx512_bf16`` (and avx512)     ``causal_attention_bf16`` (else refused)
=========================== ===============================  =========================================

The kernels take the CPU's features as far as :func:`allowed` (all by default; ``GPT2MHA_CPU_FEATURES``
at load, :func:`allow` and :func:`limited` after): tests run the AVX2 paths, or AVX-512 without
VNNI, on a CPU that has more. :func:`paths` names what each switch takes for any set of features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from . import loader
from .loader import FEATURES

_PATHS: dict = {"now": None}


def _require() -> None:
    if not loader.available():
        raise RuntimeError(f"gpt2mha's kernels are not loaded: {loader.unavailable_reason()}")


def _names(features: Iterable[str] | None, what: str) -> list[str]:
    if isinstance(features, str):
        raise TypeError(f"{what}={features!r}: expected a collection of feature names, not a string")
    names = list(features)
    bad = [n for n in names if n not in FEATURES]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not one of {', '.join(FEATURES)} (AVX2, FMA and F16C are always taken)")
    return names


def cpu() -> frozenset[str]:
    """The CPU's features of :data:`~.loader.FEATURES` (empty where the kernels are not loaded)."""
    return frozenset(torch.ops.gpt2mha.cpu_features()) if loader.available() else frozenset()


def allowed() -> frozenset[str]:
    """The features the kernels may take (all of :data:`~.loader.FEATURES` unless narrowed).

    Raises:
        RuntimeError: the kernels are not loaded.
    """
    _require()
    return frozenset(torch.ops.gpt2mha.allowed_cpu_features())


def enabled() -> frozenset[str]:
    """The features the kernels take now: the CPU's, as far as :func:`allowed` (empty where the
    kernels are not loaded)."""
    return cpu() & allowed() if loader.available() else frozenset()


def allow(features: Iterable[str] | None) -> frozenset[str]:
    """Lets the kernels take only ``features`` (names of :data:`~.loader.FEATURES`; None: all),
    process-wide, every thread, from the next call on; returns :func:`enabled`. ``allow(())``
    keeps to the AVX2 paths.

    Raises:
        RuntimeError: the kernels are not loaded.
        TypeError: ``features`` is a string.
        ValueError: a name not in :data:`~.loader.FEATURES`.
    """
    names = list(FEATURES) if features is None else _names(features, "features")
    _require()
    _PATHS["now"] = None
    return frozenset(torch.ops.gpt2mha.allow_cpu_features(names))


@contextlib.contextmanager
def limited(features: Iterable[str] | None) -> Iterator[frozenset[str]]:
    """:func:`allow` ``(features)`` inside the block (yields :func:`enabled`), the features allowed
    before restored after."""
    before = allowed()
    try:
        yield allow(features)
    finally:
        allow(before)


def paths(features: Iterable[str] | None = None) -> dict[str, str]:
    """Each switch's path (the table in this module's docstring) on a CPU with exactly
    ``features`` (names of :data:`~.loader.FEATURES`): ``avx2``, ``avx512``, ``avx512_vnni``,
    ``avx512_bf16`` or ``refused``, from the switches themselves. None: the paths taken now
    ({} where the kernels are not loaded; kept until :func:`allow`).

    Raises:
        RuntimeError: ``features`` given and the kernels not loaded.
        TypeError, ValueError: ``features`` is a string, or holds a name not in :data:`~.loader.FEATURES`.
    """
    if features is not None:
        names = _names(features, "features")
        _require()
        return dict(p.split("=") for p in torch.ops.gpt2mha.kernel_paths(names))
    if _PATHS["now"] is None:
        _PATHS["now"] = dict(p.split("=") for p in torch.ops.gpt2mha.kernel_paths(None)) if loader.available() else {}
    return _PATHS["now"]
