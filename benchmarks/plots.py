"""The documentation's figures, drawn from the benchmarks' JSON:
``python benchmarks/plots.py [--results DIR] [--out DIR]``.

Reads the current results in ``benchmarks/results/`` (older runs live in ``benchmarks/archive/``)
and writes the PNGs the docs show into ``docs/images/``:

- ``decode.png``: decode tokens/s at batch 1 and 8 per engine (``peers.json``, written by
  ``benchmarks/peers_isolated.py --json FILE``);
- ``prefill.png``: time to the first token by prompt length per engine (``peers.json``);
- ``quality.png``: top-1 agreement with float32 against the bytes a decode step reads, one point
  per weight format (``quality.json``);
- ``serve.png``: served tokens/s by concurrent clients, per model (``serve.json``).

A missing JSON skips its figures (said on stderr); every figure's title names the machine and
the date of its run. After a new run: put its JSON in ``benchmarks/results/`` (the one it
replaces into ``benchmarks/archive/``), run this script, commit both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(HERE, "..", "docs", "images")

#: gpt2mha's engines in one colour family, the peers in grey tones
OURS, PEER, REFERENCE = "#1f77b4", "#8c8c8c", "#d62728"


def load(results: str, name: str) -> dict | None:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        print(f"plots: {path} not found; its figures are skipped", file=sys.stderr)
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def where(run: dict) -> str:
    """The run's host and date in a few words (its ``host`` field, else its machine's first words)."""
    host = run.get("host") or run.get("machine", "").split(",")[0]
    return ", ".join(x for x in (host, run.get("date", "")) if x)


def _title(ax, text: str, run: dict) -> None:
    ax.set_title(f"{text}\n{where(run)}", fontsize=11)


def _colour(name: str, reference: str | None = None) -> str:
    if name == reference:
        return REFERENCE
    return OURS if name.startswith("gpt2mha") else PEER


def bars_figure(peers: dict, keys: list[str], xlabel: str, title: str, plt):
    """One horizontal bar per engine and key (the first key lightest), each labelled with its value."""
    engines = [n for n in peers["engines"] if any(peers["engines"][n].get(k) is not None for k in keys)]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(keys) * len(engines) + 1.6))
    height = 0.8 / len(keys)
    for i, name in enumerate(engines):
        r = peers["engines"][name]
        for j, key in enumerate(keys):
            if r.get(key) is None:
                continue
            y = i + (j - (len(keys) - 1) / 2) * height
            ax.barh(y, r[key], height, color=_colour(name, peers.get("reference")), alpha=0.55 + 0.45 * j / max(1, len(keys) - 1))
            ax.text(r[key], y, f" {r[key]:.0f}", va="center", fontsize=9)
    ax.set_yticks(range(len(engines)), engines)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(r.get(k) or 0 for r in peers["engines"].values() for k in keys) * 1.15)
    _title(ax, title, peers)
    fig.tight_layout()
    return fig


def decode_figure(peers: dict, plt):
    keys = [k for k in ("b1", "b8") if any(k in r for r in peers["engines"].values())]
    return bars_figure(peers, keys, "decode tokens/s (higher is faster); light: batch 1, dark: batch 8",
                       "Decode speed, GPT-2 124M, each engine alone in its process", plt)


def prefill_figure(peers: dict, plt):
    keys = sorted({k for r in peers["engines"].values() for k in r if k.startswith("p")}, key=lambda k: int(k[1:]))
    lengths = ", ".join(k[1:] for k in keys)
    return bars_figure(peers, keys, f"time to the first token, ms (lower is faster); prompts of {lengths} tokens, "
                                    "light to dark", "Prefill, GPT-2 124M, batch 1", plt)


def quality_figure(quality: dict, plt):
    fig, ax = plt.subplots(figsize=(8, 5.2))
    placed = []                                            # labels so far: (x, y) of their points
    for s in quality["schemes"]:
        if s.get("mb_per_step") is None:
            continue
        x, y = s["mb_per_step"], s["top1"]
        ours = s.get("engine") == "gpt2mha"
        ax.scatter(x, y, color=OURS if ours else PEER, marker="o" if ours else "s", zorder=3)
        near = sum(1 for px, py in placed if abs(px / x - 1) < 0.25 and abs(py - y) < 0.35)
        ax.annotate(s["name"], (x, y), textcoords="offset points", xytext=(5, 3 - 11 * near), fontsize=8)
        placed.append((x, y))
    ax.set_xscale("log")
    ticks = [t for t in (50, 64, 80, 100, 125, 160, 200, 250, 320, 400, 500, 640, 800, 1000)
             if any(s.get("mb_per_step") and s["mb_per_step"] / 1.3 < t < s["mb_per_step"] * 1.3
                    for s in quality["schemes"])]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("MB one batch-1 decode step of GPT-2 124M reads (log; fewer is faster)")
    ax.set_ylabel("top-1 agreement with float32 (%), built-in model")
    ax.grid(True, alpha=0.3)
    _title(ax, "Quality against bytes per step (circles: gpt2mha, squares: peers)", quality)
    fig.tight_layout()
    return fig


def serve_figure(serve: dict, plt):
    models = list(serve["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        levels = serve["models"][model]
        clients = [p["clients"] for p in levels]
        ax.plot(clients, [p["tok_s"] for p in levels], marker="o", color=OURS)
        for p in levels:
            ax.annotate(f"{p['tok_s']:.0f}", (p["clients"], p["tok_s"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("tokens/s, all clients")
        ax.set_ylim(0, max(p["tok_s"] for p in levels) * 1.2)
        ax.set_title(model, fontsize=10)
    fig.suptitle(f"gpt2mha serve, end to end over HTTP\n{where(serve)}", fontsize=11)
    fig.tight_layout()
    return fig


FIGURES = {"decode.png": ("peers.json", decode_figure), "prefill.png": ("peers.json", prefill_figure),
           "quality.png": ("quality.json", quality_figure), "serve.png": ("serve.json", serve_figure)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=RESULTS, metavar="DIR", help="the JSON files (default: benchmarks/results)")
    p.add_argument("--out", default=OUT, metavar="DIR", help="where the PNGs go (default: docs/images)")
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    written = []
    for png, (source, draw) in FIGURES.items():
        data = load(args.results, source)
        if data is None:
            continue
        fig = draw(data, plt)
        path = os.path.join(args.out, png)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
        print(f"wrote {os.path.relpath(path)}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
