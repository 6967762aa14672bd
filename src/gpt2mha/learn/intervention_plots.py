"""Pictures for the intervention commands: a patching heatmap (layer × head or layer × position)
and a logit-lens table (layer × position, each cell the top token, coloured by its probability).

Drawn with matplotlib (Agg backend, imported only when a picture is drawn) at :data:`DPI`, the
figure sized from the number of cells so every row and column keeps its label: at least
:data:`MIN_CELL` pixels per cell (tick labels of :data:`LABEL_PT` points are ~11 pixels tall),
so 48 layers × 25 heads (GPT-2 1558M) or 150 positions stay legible; the lens' cells are wide
enough for :data:`LENS_CHARS` characters of their token.
"""

from __future__ import annotations

import os

import torch

DPI = 128
#: Smallest cell side in pixels; tick and cell text size in points (6 pt = 10.7 px at 128 dpi).
MIN_CELL, LABEL_PT, CELL_PT = 14, 6, 5.5
#: Margins in pixels: room for row labels (left), column labels (bottom), title (top), colour bar (right).
LEFT, BOTTOM, TOP, RIGHT = 96, 90, 48, 110
#: Characters of a token shown in a lens cell / on an axis.
LENS_CHARS, LABEL_CHARS = 6, 8


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _figure(rows: int, cols: int, cell_w: int, cell_h: int):
    """A figure whose axes hold ``rows × cols`` cells of ``cell_w × cell_h`` pixels."""
    plt = _plt()
    w, h = LEFT + cols * cell_w + RIGHT, TOP + rows * cell_h + BOTTOM
    fig = plt.figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    ax = fig.add_axes((LEFT / w, BOTTOM / h, cols * cell_w / w, rows * cell_h / h))
    return plt, fig, ax, (w, h)


def _short(label: str, n: int) -> str:
    return label if len(label) <= n else label[:n - 1] + "…"


def heatmap(path: str, values: torch.Tensor, row_labels: list[str], col_labels: list[str], title: str,
            xlabel: str, ylabel: str, cbar_label: str) -> tuple[int, int]:
    """Write a heatmap PNG of ``values [rows, cols]`` (a diverging map centred on 0, rows top to
    bottom), every row and column labelled; returns its size in pixels ``(width, height)``."""
    rows, cols = values.shape
    cell = max(MIN_CELL, min(28, 900 // max(cols, 1)))
    plt, fig, ax, size = _figure(rows, cols, cell, max(MIN_CELL, cell))
    v = values.float().numpy()
    lim = float(abs(v).max()) or 1.0
    im = ax.imshow(v, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(cols), [_short(c, LABEL_CHARS) for c in col_labels], fontsize=LABEL_PT,
                  rotation=90 if max(len(c) for c in col_labels) > 2 else 0)
    ax.set_yticks(range(rows), row_labels, fontsize=LABEL_PT)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    cax = fig.add_axes(((size[0] - RIGHT + 16) / size[0], BOTTOM / size[1], 12 / size[0], rows * max(MIN_CELL, cell) / size[1]))
    fig.colorbar(im, cax=cax).set_label(cbar_label, fontsize=7)
    cax.tick_params(labelsize=LABEL_PT)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return size


def lens_picture(path: str, probs: torch.Tensor, tokens: list[list[str]], row_labels: list[str],
                 col_labels: list[str], title: str) -> tuple[int, int]:
    """Write the logit-lens PNG: ``probs [rows, T]`` (the top token's probability, colour) with
    ``tokens[row][t]`` (its text) written in each cell; returns ``(width, height)`` in pixels."""
    rows, cols = probs.shape
    cell_w, cell_h = 8 + 6 * LENS_CHARS, 16                     # ~6 px per character at 5.5 pt
    plt, fig, ax, size = _figure(rows, cols, cell_w, cell_h)
    im = ax.imshow(probs.float().numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for r in range(rows):
        for t in range(cols):
            dark = float(probs[r, t]) > 0.6
            ax.text(t, r, _short(tokens[r][t], LENS_CHARS), ha="center", va="center", fontsize=CELL_PT,
                    color="white" if dark else "black")
    ax.set_xticks(range(cols), [_short(c, LABEL_CHARS) for c in col_labels], fontsize=LABEL_PT, rotation=90)
    ax.set_yticks(range(rows), row_labels, fontsize=LABEL_PT)
    ax.set_xlabel("position (input token)", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    cax = fig.add_axes(((size[0] - RIGHT + 16) / size[0], BOTTOM / size[1], 12 / size[0], rows * cell_h / size[1]))
    fig.colorbar(im, cax=cax).set_label("top token's probability", fontsize=7)
    cax.tick_params(labelsize=LABEL_PT)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return size
