"""One decode step of GPT-2 124M (random weights) in float32, int8 and int4, timed in turn:
``python benchmarks/quant_steps.py [--threads N] [--batch B] [--compile]``.

A cheaper stand-in for ``gpt2mha bench --only quant`` when the machine is too busy for whole
``generate`` runs: each model decodes ``--steps`` single-token steps over a 4-token prompt in a
static KV cache on the decode view (as ``generate``), the three taking turns step by step (round-robin), and
the median and minimum step times are printed. One thread avoids OpenMP's two-thread barriers,
which stall whenever another process holds one of the cores. ``--compile`` adds int8 through
``generate(compile=True)``'s compiled step, int4 compiled with float32 (exact) and 8-bit
(``per_block``) activations, and int8 ``per_row`` (W7A8) compiled (:mod:`gpt2mha.inference.compiled`; compiled before
the timed steps, on their shapes): on our own kernel (``int8 compiled``,
:mod:`gpt2mha.inference.quant.gemv`) where it builds, and on inductor's weight-only int8
template with bf16 activations (``int8 compiled, template``), what the step runs without it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from unittest import mock

import torch

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.inference.compiled import CompiledDecoder, cache_len
from gpt2mha.inference.fast import for_decoding
from gpt2mha.inference.quant import set_activations


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="also time int8's compiled decode step")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = GPT2(GPT2Config()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"float32": base, "int8": copy.deepcopy(base).quantize("int8", method="rtn"),
                  "int4": copy.deepcopy(base).quantize("int4", method="rtn")}
        if args.compile:
            models["int4 per_block"] = copy.deepcopy(models["int4"])
            set_activations(models["int4 per_block"], "per_block")
            models["int8 per_row"] = copy.deepcopy(models["int8"])
            set_activations(models["int8 per_row"], "per_row")
    idx = torch.randint(0, 50257, (args.batch, 4 + args.steps), generator=torch.Generator().manual_seed(0))
    caches, views = {}, {name: for_decoding(m) for name, m in models.items()}      # as generate decodes
    steps = {name: (lambda tok, cache, m=m: m(tok, cache=cache, last_only=True, validate=False)) for name, m in views.items()}
    if args.compile:
        from gpt2mha.inference.quant import gemv
        compiled = {}
        if gemv.available():
            compiled["int8 compiled"] = CompiledDecoder(models["int8"])
            compiled["int4 compiled"] = CompiledDecoder(models["int4"])
            compiled["int4 per_block compiled"] = CompiledDecoder(models["int4 per_block"])
        compiled["int8 per_row compiled"] = CompiledDecoder(models["int8 per_row"])
        template = copy.deepcopy(models["int8"])
        with mock.patch.object(gemv, "available", lambda: False):      # the step as it is without our kernel
            compiled["int8 compiled, template"] = CompiledDecoder(template)
        for name, dec in compiled.items():
            steps[name] = dec
            views[name] = for_decoding(template if "template" in name else models[name.removesuffix(" compiled")])
    times = {k: [] for k in steps}
    max_len = cache_len(4 + args.steps, 1024)
    with torch.inference_mode():
        for name, m in views.items():
            caches[name] = KVCache(12, args.batch, 12, max_len, 64)
            m(idx[:, :4], cache=caches[name], last_only=True, validate=False)  # prefill
        for name in compiled if args.compile else ():                         # compiled on the timed shapes
            t0 = time.perf_counter()
            steps[name](idx[:, 4:5], caches[name])
            caches[name].trim([4] * args.batch)
            print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s")
        for s in range(4, 4 + args.steps):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step(idx[:, s:s + 1], caches[name])
                times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["float32"][2:])
    print(f"batch {args.batch}, {args.threads} thread(s), {args.steps} steps each, in turn")
    for name, t in times.items():
        med = statistics.median(t[2:])
        print(f"  {name:24} median {med * 1e3:6.1f} ms  min {min(t) * 1e3:6.1f} ms  float32 / {name} = {ref / med:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
