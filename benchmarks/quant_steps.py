"""One decode step of GPT-2 124M (random weights) in float32, int8 and int4, timed in turn:
``python benchmarks/quant_steps.py [--threads N] [--batch B]``.

A cheaper stand-in for ``gpt2mha bench --only quant`` when the machine is too busy for whole
``generate`` runs: each model decodes ``--steps`` single-token steps over a 4-token prompt in a
static KV cache on the decode view (as ``generate``), the three taking turns step by step (round-robin), and
the median and minimum step times are printed. One thread avoids OpenMP's two-thread barriers,
which stall whenever another process holds one of the cores.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.inference.fast import for_decoding


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = GPT2(GPT2Config()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"float32": base, "int8": copy.deepcopy(base).quantize("int8", method="rtn"),
                  "int4": copy.deepcopy(base).quantize("int4", method="rtn")}
    idx = torch.randint(0, 50257, (args.batch, 4 + args.steps), generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in models}
    caches, views = {}, {name: for_decoding(m) for name, m in models.items()}      # as generate decodes
    with torch.inference_mode():
        for name, m in views.items():
            caches[name] = KVCache(12, args.batch, 12, 4 + args.steps, 64)
            m(idx[:, :4], cache=caches[name], last_only=True, validate=False)  # prefill
        for s in range(4, 4 + args.steps):
            for name, m in views.items():
                t0 = time.perf_counter()
                m(idx[:, s:s + 1], cache=caches[name], last_only=True, validate=False)
                times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["float32"][2:])
    print(f"batch {args.batch}, {args.threads} thread(s), {args.steps} steps each, in turn")
    for name, t in times.items():
        med = statistics.median(t[2:])
        print(f"  {name:8} median {med * 1e3:6.1f} ms  min {min(t) * 1e3:6.1f} ms  float32 / {name} = {ref / med:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
