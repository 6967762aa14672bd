"""Pictures for the intervention commands: a patching heatmap (layer × head or layer × position)
and a logit-lens table (position × layer, each cell the top token, coloured by its probability).

Drawn with matplotlib (Agg backend, imported only when a picture is drawn) at :data:`DPI`. The
cells have a fixed size in pixels, so 48 layers × 25 heads (GPT-2 1558M) or 150 positions keep
every row and column labelled; then the canvas is fitted to what was drawn (:func:`fit_canvas`),
so a title wider than the grid or long tick labels are never clipped. Every text is at least
:data:`MIN_FONT_PX` pixels tall. The lens runs its longer axis down the picture: a prompt of 47
tokens through 6 layers is 47 rows of 7 cells (654 × 965 px), not one wide strip.
"""

from __future__ import annotations

import os

import torch

DPI = 100
#: Font sizes in points (at 100 dpi a point is 1.39 px): tick labels and cell text, axis labels, title.
LABEL_PT, AXIS_PT, TITLE_PT = 8, 9, 10
#: The smallest text in pixels (8 pt at 100 dpi = 11.1 px; tests/test_interventions.py checks it).
MIN_FONT_PX = 11
#: Smallest heatmap cell side in pixels (a row label of 11 px fits), and the largest.
MIN_CELL, MAX_CELL = 16, 28
#: A lens cell: wide enough for :data:`LENS_CHARS` characters of its token at :data:`LABEL_PT`.
LENS_CELL_W, LENS_CELL_H = 58, 18
#: Characters of a token shown in a lens cell / on an axis.
LENS_CHARS, LABEL_CHARS = 7, 10
#: Blank pixels around everything drawn.
PAD = 8


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _figure(rows: int, cols: int, cell_w: int, cell_h: int):
    """A figure whose axes hold ``rows × cols`` cells of ``cell_w × cell_h`` pixels (the canvas is
    fitted to the labels later, by :func:`fit_canvas`)."""
    plt = _plt()
    w, h = cols * cell_w, rows * cell_h
    fig = plt.figure(figsize=((w + 2 * PAD) / DPI, (h + 2 * PAD) / DPI), dpi=DPI)
    ax = fig.add_axes((PAD / (w + 2 * PAD), PAD / (h + 2 * PAD), w / (w + 2 * PAD), h / (h + 2 * PAD)))
    return fig, ax


def _colorbar(fig, ax, im, label: str) -> None:
    """A 12-pixel colour bar 16 pixels right of ``ax``, as tall as it, labelled."""
    W, H = fig.bbox.width, fig.bbox.height
    box = ax.get_position()
    cax = fig.add_axes((box.x1 + 16 / W, box.y0, 12 / W, box.height))
    fig.colorbar(im, cax=cax).set_label(label, fontsize=AXIS_PT)
    cax.tick_params(labelsize=LABEL_PT)


def fit_canvas(fig, pad: int = PAD) -> tuple[int, int]:
    """Resize ``fig`` to hold everything drawn (titles, tick labels, colour bars) with ``pad``
    pixels around, each axes keeping its size in pixels; returns ``(width, height)`` in pixels."""
    renderer = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    x0, y0, x1, y1 = (v * fig.dpi for v in fig.get_tightbbox(renderer).extents)
    w, h = round(x1 - x0 + 2 * pad), round(y1 - y0 + 2 * pad)
    boxes = [(ax, ax.get_position()) for ax in fig.axes]
    fig.set_size_inches(w / fig.dpi, h / fig.dpi)
    for ax, b in boxes:
        ax.set_position(((b.x0 * W - x0 + pad) / w, (b.y0 * H - y0 + pad) / h, b.width * W / w, b.height * H / h))
    return w, h


def _short(label: str, n: int) -> str:
    return label if len(label) <= n else label[:n - 1] + "…"


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)


def heatmap_figure(values: torch.Tensor, row_labels: list[str], col_labels: list[str], title: str, xlabel: str,
                   ylabel: str, cbar_label: str):
    """The figure of :func:`heatmap`, fitted (not saved): for tests and for callers that draw more."""
    rows, cols = values.shape
    cell = max(MIN_CELL, min(MAX_CELL, 900 // max(cols, 1)))
    fig, ax = _figure(rows, cols, cell, cell)
    v = values.float().numpy()
    lim = float(abs(v).max()) or 1.0
    im = ax.imshow(v, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(cols), [_short(c, LABEL_CHARS) for c in col_labels], fontsize=LABEL_PT,
                  rotation=90 if max(len(c) for c in col_labels) > 2 else 0)
    ax.set_yticks(range(rows), row_labels, fontsize=LABEL_PT)
    ax.set_xlabel(xlabel, fontsize=AXIS_PT)
    ax.set_ylabel(ylabel, fontsize=AXIS_PT)
    ax.set_title(title, fontsize=TITLE_PT, loc="left")
    _colorbar(fig, ax, im, cbar_label)
    fit_canvas(fig)
    return fig


def heatmap(path: str, values: torch.Tensor, row_labels: list[str], col_labels: list[str], title: str,
            xlabel: str, ylabel: str, cbar_label: str) -> tuple[int, int]:
    """Write a heatmap PNG of ``values [rows, cols]`` (a diverging map centred on 0, rows top to
    bottom), every row and column labelled; returns its size in pixels ``(width, height)``."""
    fig = heatmap_figure(values, row_labels, col_labels, title, xlabel, ylabel, cbar_label)
    size = round(fig.bbox.width), round(fig.bbox.height)
    _save(fig, path)
    return size


def lens_figure(probs: torch.Tensor, tokens: list[list[str]], row_labels: list[str], col_labels: list[str],
                title: str):
    """The figure of :func:`lens_picture`, fitted (not saved); arguments as there."""
    layers, T = probs.shape
    by_position = T >= layers                                   # the longer axis down the picture
    grid = probs.float().T if by_position else probs.float()
    rows, cols = grid.shape
    fig, ax = _figure(rows, cols, LENS_CELL_W, LENS_CELL_H)
    im = ax.imshow(grid.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for r in range(layers):
        for t in range(T):
            x, y = (r, t) if by_position else (t, r)
            ax.text(x, y, _short(tokens[r][t], LENS_CHARS), ha="center", va="center", fontsize=LABEL_PT,
                    color="white" if float(probs[r, t]) > 0.6 else "black")
    layer_names, positions = row_labels, [_short(c, LABEL_CHARS) for c in col_labels]
    layer_axis = "layer (the residual stream before it; final_post: after the last)"
    position_axis = "position (input token)"
    ax.set_xticks(range(cols), layer_names if by_position else positions, fontsize=LABEL_PT, rotation=90)
    ax.set_yticks(range(rows), positions if by_position else layer_names, fontsize=LABEL_PT)
    ax.set_xlabel(layer_axis if by_position else position_axis, fontsize=AXIS_PT)
    ax.set_ylabel(position_axis if by_position else layer_axis.split(" (")[0], fontsize=AXIS_PT)
    ax.set_title(title, fontsize=TITLE_PT, loc="left")
    _colorbar(fig, ax, im, "top token's probability")
    fit_canvas(fig)
    return fig


def lens_picture(path: str, probs: torch.Tensor, tokens: list[list[str]], row_labels: list[str],
                 col_labels: list[str], title: str) -> tuple[int, int]:
    """Write the logit-lens PNG of ``probs [layers, T]`` (the top token's probability, colour)
    with ``tokens[layer][t]`` (its text) in each cell, ``row_labels`` naming the layers and
    ``col_labels`` the positions. The longer of the two axes runs down the picture: a row per
    position when there are at least as many positions as layers (a long prompt grows the picture
    downwards, its tokens labelled horizontally), else a row per layer. Returns ``(width,
    height)`` in pixels."""
    fig = lens_figure(probs, tokens, row_labels, col_labels, title)
    size = round(fig.bbox.width), round(fig.bbox.height)
    _save(fig, path)
    return size
