"""Peak memory for ``benchmarks/bench.py``: what a prefill, or loading a checkpoint and greedily
decoding 8 tokens, adds to the resident memory of a fresh process. Each figure is a child process,
``bench.py --memory-child`` (bench.py's ``main`` runs :func:`_memory_child` or
:func:`_resident_child`), with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB; the child resets
its resident-set high-water mark (``/proc/self/clear_refs`` ← 5) and reports ``VmHWM`` less the
``VmRSS`` before. Linux only. Also here: the four prefill variants, which the prefill section
(``bench_float.py``) times in its own process.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import torch

from bench_common import _prompt, load_hf, load_ours, ours_greedy
from gpt2mha.api import GPT2
from gpt2mha.core.kv_cache import KVCache

MMAP_THRESHOLD = 1 << 20   # bytes: allocations this large bypass glibc's heap in the memory children
#: The script each child runs (``bench.py --memory-child``: its ``main`` calls the children here).
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")


PREFILL_VARIANTS = ("gpt2mha fused", "gpt2mha explicit", "transformers sdpa", "transformers eager")


def _load_variant(variant: str, directory: str):
    if variant.startswith("gpt2mha"):
        model = load_ours(directory)
        model.attn_impl = "sdpa" if variant.endswith("fused") else "explicit"
    else:
        model = load_hf(directory, attn=variant.split()[-1])
    return model


@torch.inference_mode()
def prefill(model, idx: torch.Tensor):
    """Fill a KV cache with the whole prompt and return the last position's logits."""
    if isinstance(model, GPT2):
        c = model.config
        cache = KVCache(c.n_layer, idx.shape[0], c.n_head, idx.shape[1], c.head_dim,
                        dtype=next(model.parameters()).dtype)
        return model(idx, cache=cache, last_only=True, validate=False).logits   # [B, 1, n_vocab]
    return model(idx, use_cache=True, logits_to_keep=1).logits


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def prefill_peak_mb(variant: str, directory: str, tokens: int) -> float | None:
    """Peak resident memory (MB) a prefill of ``tokens`` adds, measured in a fresh subprocess.

    The child runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB: every block of 1 MiB
    or more is mapped on allocation and unmapped on free, so the RSS peak is the peak of live
    tensors. With glibc's default (a threshold that rises to 32 MiB as blocks are freed, the
    freed ones then kept in the heap) the same prefill read 123–152 MB from run to run.
    """
    if not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, BENCH, "--memory-child", variant, "--checkpoint", directory,
           "--tokens", str(tokens)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {variant!r} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def _memory_child(variant: str, directory: str, tokens: int) -> None:
    model = _load_variant(variant, directory)
    idx = _prompt(1, tokens, model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.n_vocab)
    prefill(model, idx[:, :8])                                             # warm up: lazy buffers, kernels
    gc.collect()
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:                          # reset VmHWM to VmRSS
        f.write("5")
    prefill(model, idx)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - before) / 1024}))


def resident_mb(directory: str) -> float | None:
    """Peak resident memory (MB) that loading ``directory`` and greedily decoding 8 tokens adds to
    a fresh process (weights, decode-time copies, cache), measured like :func:`prefill_peak_mb`."""
    if not sys.platform.startswith("linux"):
        return None
    cmd = [sys.executable, BENCH, "--memory-child", "resident", "--checkpoint", directory]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"resident-memory child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def _resident_child(directory: str) -> None:
    gc.collect()
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model = load_ours(directory)
    ours_greedy(model, _prompt(1, 4, model.config.n_vocab), 8)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - before) / 1024}))

