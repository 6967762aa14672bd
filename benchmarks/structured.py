"""Structured outputs: what the grammar's token mask costs batch-1 decoding, and what a schema's
first compile costs.

    python benchmarks/structured.py [--models builtin,124M] [--seeds 8] [--threads 2]
                                    [--json benchmarks/results/structured.json] [--plot FILE.png]

Decode: for each model, one engine slot (batch 1, the route ``generate`` and the server take).
For each seed, the issue's schema (an object with a required string, an integer range and an
enum: tests/test_structured.py's ``SCHEMA``) constrains a sequence until its grammar is complete
(n decode steps); then the same prompt and seed run unconstrained for the same n steps. Only the
decode steps are timed (not the prefill); the two runs alternate, so a busy machine slows both
alike. ``cost`` = 1 - (constrained tok/s) / (unconstrained tok/s) over all the seeds' steps;
``mask_us`` is the mean time of :meth:`RowSampler.mask <gpt2mha.inference.sampling.RowSampler.mask>`
(llguidance's bit mask, unpacked, applied as -inf) per step.

Compile: for each tokenizer, from empty caches: the token → bytes table (once per tokenizer),
the schema to llguidance's grammar, the grammar's matcher for the tokenizer (its lexer), and a
sequence's start (a copy of that matcher, what every later request pays).

The 124M model has random weights (no download): its step costs what a trained one's does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpt2mha import GPT2, GPT2Config, DEFAULT_MODEL  # noqa: E402
from gpt2mha.inference import structured  # noqa: E402
from gpt2mha.inference.engine import Engine  # noqa: E402
from gpt2mha.inference.params import SamplingParams, StructuredOutputs  # noqa: E402
from gpt2mha.inference.sampling import RowSampler  # noqa: E402
from gpt2mha.io.tokenizer import tokenizer_for  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
PROMPT = "A person, as JSON:"


def load(name: str):
    if name == "builtin":
        model = GPT2.from_pretrained(DEFAULT_MODEL)
    else:
        torch.manual_seed(0)
        model = GPT2(GPT2Config.from_preset(name))
    return model.eval()


def compile_times(tok) -> dict:
    """Seconds of a first compile of :data:`SCHEMA` for ``tok``, from empty caches, by stage."""
    structured._TABLES.clear()
    structured._GRAMMARS.clear()
    structured._COMPILED.clear()
    t0 = time.perf_counter()
    structured.token_table(tok)
    t1 = time.perf_counter()
    spec = StructuredOutputs(json=SCHEMA)                       # the schema to llguidance's grammar
    t2 = time.perf_counter()
    grammar = structured.compile_for(spec, tok)
    t3 = time.perf_counter()
    starts = []
    for _ in range(100):
        s0 = time.perf_counter()
        grammar.start()
        starts.append(time.perf_counter() - s0)
    return {"token_table_s": t1 - t0, "schema_to_grammar_s": t2 - t1, "matcher_s": t3 - t2,
            "sequence_start_us": 1e6 * statistics.median(starts)}


def decode(engine: Engine, ids: list[int], params: SamplingParams, steps: int | None) -> tuple[int, float]:
    """Prefill ``ids`` into slot 0, then decode until the grammar is complete (``steps`` None)
    or for ``steps`` steps; returns (steps, seconds of the decode steps)."""
    engine.open(0, params, params.seed)
    try:
        engine.prefill([0], [ids])
        n, spent = 0, 0.0
        while (steps is None and not engine.samplers[0].complete) or (steps is not None and n < steps):
            t0 = time.perf_counter()
            out = engine.decode([0])[0]
            spent += time.perf_counter() - t0
            if isinstance(out, Exception):
                raise out
            n += 1
            if steps is None and n >= 500:
                raise RuntimeError("the schema did not complete in 500 steps")
        return n, spent
    finally:
        engine.release(0)


def measure(name: str, seeds: int) -> dict:
    model = load(name)
    tok = tokenizer_for(model.config)
    compiled = compile_times(tok)
    engine = Engine(model, 1, tokenizer=tok, eos_token_id=tok.eot_token)
    engine.warm_up()
    ids = tok.encode(PROMPT)
    mask_s, mask_calls = [0.0], [0]
    real_mask = RowSampler.mask

    def timed_mask(self, logits, bans):
        t0 = time.perf_counter()
        try:
            return real_mask(self, logits, bans)
        finally:
            mask_s[0] += time.perf_counter() - t0
            mask_calls[0] += 1

    RowSampler.mask = timed_mask
    try:
        plain_steps = plain_s = json_steps = json_s = 0
        lengths = []
        decode(engine, ids, SamplingParams(max_tokens=8, seed=0, structured_outputs={"json": SCHEMA}), None)  # warm
        for seed in range(seeds):
            constrained = SamplingParams(max_tokens=1000, seed=seed, structured_outputs={"json": SCHEMA})
            n, s = decode(engine, ids, constrained, None)
            json_steps, json_s = json_steps + n, json_s + s
            lengths.append(n + 1)                                 # + the prefill's token
            n, s = decode(engine, ids, SamplingParams(max_tokens=1000, seed=seed), n)
            plain_steps, plain_s = plain_steps + n, plain_s + s
    finally:
        RowSampler.mask = real_mask
    plain, constrained = plain_steps / plain_s, json_steps / json_s
    return {"model": name, "route": engine.route.decoder.name, "tokens": lengths,
            "plain_tok_s": plain, "constrained_tok_s": constrained, "cost": 1 - constrained / plain,
            "mask_us": 1e6 * mask_s[0] / max(mask_calls[0], 1), "step_ms": 1e3 / plain, **compiled}


def plot(rows: list[dict], path: str) -> None:
    """One panel per model (its own tok/s axis): unconstrained and constrained decode tok/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        values = [r["plain_tok_s"], r["constrained_tok_s"]]
        ax.bar([0, 1], values, 0.6, color=["tab:blue", "tab:orange"])
        ax.text(1, values[1], f"{-100 * r['cost']:+.1f}%\nmask {r['mask_us']:.0f} µs/step", ha="center",
                va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["unconstrained", "JSON schema"])
        ax.set_title(f"{r['model']} ({r['step_ms']:.1f} ms/step)", fontsize=10)
        ax.set_ylim(0, 1.3 * max(values))
    axes[0][0].set_ylabel("decode tokens/s, batch 1")
    fig.suptitle("Structured outputs: what the grammar's mask costs", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="builtin,124M", help="comma-separated: builtin and/or GPT-2 presets")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    ap.add_argument("--plot", default=None, metavar="FILE", help="draw the tok/s bars into FILE (PNG)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(name, args.seeds) for name in args.models.split(",")]
    print(f"| model | route | tokens (min-max) | unconstrained tok/s | constrained tok/s | cost | mask µs/step | "
          f"step ms | token table s | schema→grammar ms | matcher ms | sequence start µs |")
    print("|---" * 12 + "|")
    for r in rows:
        print(f"| {r['model']} | {r['route']} | {min(r['tokens'])}-{max(r['tokens'])} | {r['plain_tok_s']:.1f} | "
              f"{r['constrained_tok_s']:.1f} | {100 * r['cost']:.1f}% | {r['mask_us']:.0f} | {r['step_ms']:.2f} | "
              f"{r['token_table_s']:.2f} | {1e3 * r['schema_to_grammar_s']:.1f} | {1e3 * r['matcher_s']:.1f} | "
              f"{r['sequence_start_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "seeds": args.seeds, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
