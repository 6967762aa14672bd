"""A model's weights in 2 MiB pages: Linux's ``madvise(MADV_COLLAPSE)`` over the memory the native
forward reads every step (:func:`~gpt2mha.inference.native.native_step` starts it, in a thread of
its own, the first time it makes a model's step).

Why: a decode step at batch 1
streams every weight once (497 MB for a float32 124M), and through 4 KiB pages each 4 KiB of it
costs a TLB miss and a page walk. The ``gpt2mha`` command asks torch for 2 MiB pages before torch
starts (``THP_MEM_ALLOC_ENABLE=1``: torch reads it once, at its first allocation, so a library
imported after torch cannot ask for it), but ``generate`` called from Python gets 4 KiB pages:
there, collapsing the weights makes every float dtype's steps faster (by a few percent on a Zen 4:
docs/how-to/choose-configuration.md, "2 MiB pages").

``MADV_COLLAPSE`` (Linux 6.1 on) copies each 2 MiB-aligned block of a range into one huge page and
maps it in place: the same addresses, the same bytes, nothing for torch or the tensors' owners to
notice, safe while other threads read the memory. It costs a copy and the kernel's search for free
2 MiB of physical memory, up to seconds for a float32 124M, which is why it runs beside the
decode, one block at a time, and not in the caller's first step. Blocks that cannot be collapsed
(another mapping in the block, no free huge page, THP off, an older kernel, not Linux) stay as
they are: speed, never results, depends on it. ``GPT2MHA_HUGE_PAGES=0`` turns it off.

Source: Linux's ``Documentation/admin-guide/mm/transhuge.rst`` ("MADV_COLLAPSE").
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading

import torch

#: a huge page on x86-64 and most arm64 kernels: 2 MiB
HUGE_PAGE = 2 << 20
#: include/uapi/asm-generic/mman-common.h (Python's mmap module does not name it)
MADV_COLLAPSE = 25

_lock = threading.Lock()
if hasattr(os, "register_at_fork"):        # a child forked while a thread held it would wait for ever
    os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))
_done: set[int] = set()                # block numbers (address // HUGE_PAGE) already asked for
_why_not = ""                          # set once the kernel refuses MADV_COLLAPSE itself
_probed = False


def why_not() -> str:
    """Why :func:`collapse` does nothing here ("" when it tries): ``GPT2MHA_HUGE_PAGES=0``, not
    Linux, transparent huge pages off, or a kernel that refuses ``MADV_COLLAPSE``."""
    if os.environ.get("GPT2MHA_HUGE_PAGES", "1") == "0":
        return "GPT2MHA_HUGE_PAGES=0"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/enabled: never)"
    except OSError:
        return "no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)"
    _probe()
    return _why_not


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    f = libc.madvise
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def blocks(tensors: list[torch.Tensor], min_bytes: int = HUGE_PAGE) -> list[int]:
    """The 2 MiB blocks (address // HUGE_PAGE, ascending) that hold the storage of each CPU tensor
    of at least ``min_bytes`` bytes in ``tensors`` (its first and last block too, shared with
    whatever lies beside it: collapsing those changes nothing for that memory either)."""
    out = set()
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            continue                                # (sparse and mkldnn tensors have no storage to ask)
        s = t.untyped_storage()
        if s.nbytes() < min_bytes or not s.data_ptr():
            continue
        out.update(range(s.data_ptr() // HUGE_PAGE, (s.data_ptr() + s.nbytes() - 1) // HUGE_PAGE + 1))
    return sorted(out)


def collapse(tensors: list[torch.Tensor], min_bytes: int = HUGE_PAGE) -> int:
    """Collapse the memory of ``tensors`` (each CPU tensor of at least ``min_bytes`` bytes) into
    2 MiB pages, one ``madvise(MADV_COLLAPSE)`` per block; blocks asked for before are skipped.
    Values, addresses and the tensors are untouched. Returns the bytes now in huge pages by this
    call (blocks the kernel collapsed); 0 where :func:`why_not` says why. Never raises for a block
    that cannot be collapsed (another mapping in it, no free huge page): it is left as it is."""
    if why_not():
        return 0
    with _lock:
        todo = [b for b in blocks(tensors, min_bytes) if b not in _done]
        _done.update(todo)
    madvise = _madvise()
    return HUGE_PAGE * sum(madvise(b * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) == 0 for b in todo)


def _probe() -> None:
    # once: MADV_COLLAPSE on a 2 MiB block of fresh memory of our own; EINVAL means a kernel
    # without it (before 6.1); any other refusal (no free huge page now) still means it has it
    global _why_not, _probed
    if _probed:
        return
    with _lock:
        if not _probed:
            _probed = True
            import mmap
            mm = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                mm.write(b"\1" * len(mm))
                buf = ctypes.c_char.from_buffer(mm)
                start = -(-ctypes.addressof(buf) // HUGE_PAGE) * HUGE_PAGE
                if _madvise()(start, HUGE_PAGE, MADV_COLLAPSE) != 0 and ctypes.get_errno() == errno.EINVAL:
                    _why_not = ("the kernel refuses MADV_COLLAPSE (Linux before 6.1, or huge pages turned off "
                                "for this process: prctl PR_SET_THP_DISABLE)")
                del buf
            finally:
                mm.close()


class Collapse(threading.Thread):
    """:func:`collapse` of ``tensors`` in a daemon thread (holding them until it ends); ``bytes``:
    its result once joined (None before)."""

    def __init__(self, tensors: list[torch.Tensor], min_bytes: int = HUGE_PAGE):
        super().__init__(name="gpt2mha-huge-pages", daemon=True)
        self.tensors, self.min_bytes, self.bytes = list(tensors), min_bytes, None

    def run(self) -> None:
        self.bytes = collapse(self.tensors, self.min_bytes)
        self.tensors = []


def collapse_in_background(tensors: list[torch.Tensor], min_bytes: int = HUGE_PAGE) -> Collapse | None:
    """A started :class:`Collapse` of ``tensors``, or None where there is nothing to do
    (:func:`why_not`, no tensor of ``min_bytes``, every block asked for before)."""
    if why_not() or all(b in _done for b in blocks(tensors, min_bytes)):
        return None
    thread = Collapse(tensors, min_bytes)
    thread.start()
    return thread


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes in transparent huge pages of every mapping that overlaps ``t``'s storage (the sum of
    their ``AnonHugePages`` in ``/proc/self/smaps``; 0 where it cannot be read): for tests and
    benchmarks."""
    s = t.untyped_storage()
    lo_t, hi_t = s.data_ptr(), s.data_ptr() + max(s.nbytes(), 1)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii") as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < hi_t and lo_t < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total
