"""OpenMP teams when the model runs in a thread other than the one that loaded it (the server's
scheduler thread, a user's worker thread).

Every thread that runs a parallel region keeps a team of OpenMP worker threads (torch's own
products and gpt2mha's kernels both use the OpenMP runtime torch loaded; on Linux that is
GNU libgomp). libgomp counts the worker threads of every team in the process and, when they
outnumber the CPUs, shortens the busy-wait at each barrier from ~300,000 spins to 100
(``gomp_throttled_spin_count_var``, libgomp's ``env.c``): every barrier is then a futex sleep
and wake. A decode step passes ~100 barriers (one or two per product), so on 2 cores the model
run from a new thread while the loading thread's idle team still exists decoded at ~0.6x the
speed of the same model in the loading thread (int4 per_block 124M, 2 threads: 96-114 against
183-208 tok/s; with the loading thread's team released: 183-203).

:func:`release_openmp_workers` releases the calling thread's team (OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``); the runtime starts a new one the next time that
thread runs a parallel region. :class:`~gpt2mha.inference.scheduler.Scheduler` calls it from the
thread that starts it, and sets its own thread's OpenMP thread count to the starting thread's
(:func:`adopt_threads`): a new thread's count is the runtime's default (the CPU count, or
``OMP_NUM_THREADS``), not what ``torch.set_num_threads`` set in another thread.
"""

from __future__ import annotations

import ctypes
import functools
import os

#: ``omp_pause_soft`` (OpenMP 5.0, ``omp_pause_resource_t``): free the runtime's threads, keep its state.
OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's ``libgomp``/``libomp``/``libiomp5``,
    found in ``/proc/self/maps`` once torch is imported), or None where it cannot be found (no
    ``/proc``, no runtime loaded)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libomp", "libiomp5")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def release_openmp_workers() -> bool:
    """Release the calling thread's idle OpenMP worker threads (``omp_pause_resource_all`` with
    ``omp_pause_soft``, OpenMP 5.0 §3.2.43), so that a team another thread starts does not make
    the runtime throttle every team's barrier waits. Call it from a thread that has finished
    running the model and hands it to another (the one that loaded the model, before a serving
    thread takes over). Harmless otherwise: the thread's next parallel region starts a team again.

    Returns:
        whether the runtime released them (False: no OpenMP runtime found, one without
        ``omp_pause_resource_all``, or called inside a parallel region).
    """
    lib = openmp_runtime()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0


def adopt_threads(n: int) -> None:
    """Make the calling thread run ``n`` threads in torch's products and gpt2mha's kernels
    (``torch.set_num_threads(n)``, which sets this thread's OpenMP count): a new thread starts
    with the runtime's default, whatever another thread set.

    Raises:
        ValueError: n < 1.
    """
    import torch
    if n < 1:
        raise ValueError(f"n={n} threads: expected at least 1")
    torch.set_num_threads(n)
