"""The native forward's float routes against the decode view, side by side (issue 43):
``python benchmarks/float_routes.py [--threads 2] [--rounds 5] [--new 64] [--models float32,bf16,fp16,...] [--json FILE]``.

GPT-2 124M with random weights (``init_weights(0)``) in float32, bf16, fp16 and int4 per_block
(round to nearest, groups of 32, the int4 head): each one through ``generate`` on its native
route (what ``generate`` and the server take now: :func:`~gpt2mha.inference.decoders.choose_decoder`)
and on the decode view (the route before: ``native_step`` patched to None), the routes taking
turns round by round (a, b, a, b, ...), so that a busy machine slows both alike. Printed: decode
tokens/s at batch 1 and 8 (a 4-token prompt, ``--new`` greedy tokens, the prompt included, as
``benchmarks/peers.py`` counts them), prefill of 512 tokens (ms, the time to the first token's
logits), the best and the median of ``--rounds``, and the GB/s the batch-1 steps' weight reads
imply beside ``torch.sum``'s over 340 MB (the machine's memory speed, ``bench_common.memory_bandwidth``).
Whether each pair of routes gave the same greedy tokens is printed too (float32: yes but at
exact near-ties; bf16, fp16 and int4: two roundings of the same model, which part at near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2mha import GPT2, GPT2Config, KVCache  # noqa: E402
from gpt2mha.inference import native  # noqa: E402
from gpt2mha.inference.decoders import choose_decoder  # noqa: E402

ROUTES = ("native", "view")


MODELS = ("float32", "bf16", "fp16", "int4 per_block")


def models(names=MODELS) -> dict:
    """``{name: model}`` of ``names``: float32, bf16, fp16 and int4 per_block with the int4 head, from one seed."""
    def base():
        m = GPT2(GPT2Config.from_preset("124M")).eval()
        m.init_weights(0)
        return m
    def int4():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return base().quantize("int4", method="rtn", activations="per_block", head="int4")
    make = {"float32": base, "bf16": lambda: base().to(torch.bfloat16), "fp16": lambda: base().to(torch.float16),
            "int4 per_block": int4}
    return {name: make[name]() for name in names}


def step_bytes(model) -> int:
    """Bytes of weights a batch-1 step reads: every parameter and buffer but the position embedding,
    torch's int4 packing (the native route reads the nibbles) and, under a quantized head, wte."""
    from gpt2mha.inference.quant.linear import QuantizedLinear
    skip = {"wpe.weight"} | ({"wte.weight"} if isinstance(model.lm_head, QuantizedLinear) else set())
    named = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.nbytes for n, t in named if n not in skip and "packed" not in n)


def on_route(route: str):
    """A context in which ``generate`` takes ``route``."""
    return mock.patch.object(native, "native_step", native.native_step if route == "native" else (lambda m: None))


def decode(model, batch: int, new: int) -> tuple[float, torch.Tensor]:
    prompt = torch.randint(0, model.config.n_vocab, (1, 4), generator=torch.Generator().manual_seed(0)).repeat(batch, 1)
    start = time.perf_counter()
    out = model.generate(prompt, new, temperature=0)
    return batch * new / (time.perf_counter() - start), out


def prefill(model, route: str, T: int = 512) -> float:
    c = model.config
    ids = torch.randint(0, c.n_vocab, (1, T), generator=torch.Generator().manual_seed(1))
    decoder = choose_decoder(model).decoder
    cache = KVCache(c.n_layer, 1, c.n_head, T + 1, c.n_embd // c.n_head, dtype=model.wte.weight.dtype)
    start = time.perf_counter()
    with torch.inference_mode():
        decoder.prefill(ids, cache)
    return (time.perf_counter() - start) * 1e3


def run(threads: int, rounds: int, new: int, log=print, names=MODELS) -> dict:
    from bench import memory_bandwidth
    torch.set_num_threads(threads)
    ms = models(names)
    res: dict = {"threads": threads, "rounds": rounds, "new_tokens": new, "figures": {}}
    outs: dict = {}
    for name, model in ms.items():
        for route in ROUTES:                                       # warm-up: every shape once
            with on_route(route):
                decode(model, 1, 4), decode(model, 8, 4), prefill(model, route, 64)
        log(f"{name}: {choose_decoder(model).describe()}")
    for r in range(rounds):
        for name, model in ms.items():
            for route in ROUTES:
                with on_route(route):
                    for batch in (1, 8):
                        tps, out = decode(model, batch, new)
                        res["figures"].setdefault(f"{name}|{route}|decode b{batch} tok/s", []).append(tps)
                        outs[(name, route, batch)] = out
                    res["figures"].setdefault(f"{name}|{route}|prefill 512 ms", []).append(prefill(model, route))
        log(f"round {r + 1}/{rounds} done")
    res["same greedy tokens"] = {f"{name} b{b}": bool(torch.equal(outs[(name, "native", b)], outs[(name, "view", b)]))
                                 for name in ms for b in (1, 8)}
    res["memory GB/s (torch.sum)"] = memory_bandwidth() / 1e9
    res["step MB"] = {name: step_bytes(m) / 1e6 for name, m in ms.items()}
    return res


def report(res: dict) -> str:
    lines = [f"threads {res['threads']}, {res['rounds']} rounds, {res['new_tokens']} new tokens; "
             f"torch.sum reads {res['memory GB/s (torch.sum)']:.1f} GB/s", "",
             f"{'model | route | figure':52s} {'best':>9s} {'median':>9s}"]
    for key, values in res["figures"].items():
        best = min(values) if "ms" in key else max(values)
        lines.append(f"{key.replace('|', ' | '):52s} {best:9.1f} {statistics.median(values):9.1f}")
    for name, mb in res["step MB"].items():
        tps = max(res["figures"][f"{name}|native|decode b1 tok/s"])
        lines.append(f"{name}: a batch-1 step reads {mb:.0f} MB: the native route's best implies {mb * tps / 1e3:.1f} GB/s")
    lines.append("same greedy tokens on both routes: " + ", ".join(f"{k} {v}" for k, v in res["same greedy tokens"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new", type=int, default=64, help="greedy tokens per decode run (default 64)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args(argv)
    names = tuple(n.strip() for n in args.models.split(",") if n.strip())
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        p.error(f"--models: {unknown or args.models!r} not among {', '.join(MODELS)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())   # "date": when the run began
    res = run(args.threads, args.rounds, args.new, log=lambda m: print(m, file=sys.stderr, flush=True), names=names)
    res = {"benchmark": "float_routes", "command": " ".join(["python benchmarks/float_routes.py", *(sys.argv[1:] if argv is None else argv)]),
           "date": started, "source": "written by benchmarks/float_routes.py --json", **res}
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
