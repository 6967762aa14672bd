"""Pictures of the attention maps: a grid PNG of every head, one PNG per selected head, and a
self-contained ``heads.html`` (data inline, no network).

The PNGs are drawn with matplotlib (Agg backend, imported only when a picture is drawn);
token labels are thinned to one per :data:`LABEL_PX` pixels and cut to :data:`LABEL_CHARS`
characters, and each picture says what it left out. The page embeds the maps as 8-bit lower
triangles and draws them with its own JavaScript.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os

import torch

from .heads import ROLE_THRESHOLD, ROLES, HeadsResult, format_strongest, strongest_heads

#: Grid geometry in pixels at :data:`DPI` (a power of two, so inches * DPI is exact). RIGHT holds
#: the colour bar, BOTTOM the key labels and a line saying how labels were thinned.
DPI, CELL, GAP, LEFT, BOTTOM, TOP, RIGHT = 128, 128, 16, 88, 104, 48, 96
#: Cell side for prompts longer than 64 tokens (more room for labels).
CELL_LONG = 192
#: Token labels: font size in points (6 pt = 10.7 px at 128 dpi), at most one label per
#: LABEL_PX pixels of a map's side, each cut to LABEL_CHARS characters.
LABEL_PT, LABEL_PX, LABEL_CHARS = 6, 16, 8


def grid_geometry(n_layer: int, n_head: int, T: int | None = None) -> dict:
    """Pixel size of the grid PNG, each map's box, the colour bar's box and the label thinning.

    Args:
        n_layer, n_head: the grid's rows and columns; T: prompt tokens (maps get
            :data:`CELL_LONG` pixels instead of :data:`CELL` past 64 tokens).

    Returns:
        ``{"width", "height", "cell", "cells": {(layer, head): (x0, y0, x1, y1)}, "colorbar":
        (x0, y0, x1, y1), "label_step"}``, y from the top; layers are rows (layer 0 on top),
        heads are columns; every ``label_step``-th token is labelled: at most one label per
        :data:`LABEL_PX` pixels of a map's side, so every token up to 8 (128-pixel maps), then
        ``ceil(T / 8)``; past 64 tokens the maps are 192 pixels and the step ``ceil(T / 12)``.
    """
    cell = CELL_LONG if T is not None and T > 64 else CELL
    width = LEFT + n_head * cell + (n_head - 1) * GAP + RIGHT
    height = TOP + n_layer * cell + (n_layer - 1) * GAP + BOTTOM
    cells = {}
    for l in range(n_layer):
        for h in range(n_head):
            x0, y0 = LEFT + h * (cell + GAP), TOP + l * (cell + GAP)
            cells[(l, h)] = (x0, y0, x0 + cell, y0 + cell)
    bar_x = width - RIGHT + 12
    colorbar = (bar_x, TOP, bar_x + 12, height - BOTTOM)
    step = max(1, math.ceil((T or 1) / (cell // LABEL_PX)))
    return {"width": width, "height": height, "cell": cell, "cells": cells, "colorbar": colorbar, "label_step": step}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _mpl_text(s: str) -> str:
    return s.replace("$", r"\$")


def _short(label: str, n: int = LABEL_CHARS) -> str:
    return label if len(label) <= n else label[:n - 1] + "\u2026"


def _tick_labels(ax, labels: list[str], x: bool, y: bool, fontsize: float, step: int) -> None:
    """Token labels on the axes: every ``step``-th token, each cut to :data:`LABEL_CHARS` characters."""
    ticks = list(range(0, len(labels), step))
    text = [_mpl_text(_short(labels[i]) if step == 1 else f"{i} {_short(labels[i])}") for i in ticks]
    ax.set_xticks(ticks if x else [])
    ax.set_yticks(ticks if y else [])
    if x:
        ax.set_xticklabels(text, rotation=90, fontsize=fontsize)
    if y:
        ax.set_yticklabels(text, fontsize=fontsize)


def ordinal(n: int) -> str:
    """``1`` → ``"1st"``, ``2`` → ``"2nd"``, ``3`` → ``"3rd"``, ``11`` → ``"11th"``, ``22`` → ``"22nd"``."""
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def grid_notes(labels: list[str], step: int) -> list[str]:
    """What the grid leaves out: thinned labels, shortened labels."""
    notes = []
    if step > 1:
        notes.append(f"grid.png labels every {ordinal(step)} of {len(labels)} tokens (0, {step}, {2 * step}, ...), "
                     f"each with its position")
    if any(len(t) > LABEL_CHARS for t in labels):
        notes.append(f"grid.png token labels longer than {LABEL_CHARS} characters are cut (…)")
    return notes


def write_grid_png(weights: torch.Tensor, labels: list[str], path: str, title: str = "") -> dict:
    """Every layer x head map of sequence 0 in one PNG (rows = layers, columns = heads), with a
    colour bar (viridis, 0 to 1) and token labels on the outer maps, thinned to one per
    :data:`LABEL_PX` pixels; the image says below the maps when labels were thinned or cut.

    Args:
        weights: ``[n_layer, B, h, T, T]``; labels: T token labels (outer axes only).
        path: the PNG to write.

    Returns:
        :func:`grid_geometry` of the written image, plus ``"notes"`` (:func:`grid_notes`) and
        ``"labels_drawn"``: the token labels matplotlib drew under the maps.
    """
    plt = _plt()
    L, _, H, T, _ = weights.shape
    geo = grid_geometry(L, H, T)
    W, Hpx, cell = geo["width"], geo["height"], geo["cell"]
    fig = plt.figure(figsize=(W / DPI, Hpx / DPI), dpi=DPI)
    im = None
    for (l, h), (x0, y0, x1, y1) in geo["cells"].items():
        ax = fig.add_axes((x0 / W, 1 - y1 / Hpx, cell / W, cell / Hpx))
        im = ax.imshow(weights[l, 0, h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                       interpolation="nearest")
        ax.set_title(f"layer {l} head {h}", fontsize=LABEL_PT, pad=1.5)
        _tick_labels(ax, labels, x=l == L - 1, y=h == 0, fontsize=LABEL_PT, step=geo["label_step"])
        ax.tick_params(length=1.5, pad=0.5)
    bx0, by0, bx1, by1 = geo["colorbar"]
    cax = fig.add_axes((bx0 / W, 1 - by1 / Hpx, (bx1 - bx0) / W, (by1 - by0) / Hpx))
    cb = fig.colorbar(im, cax=cax)
    cb.ax.tick_params(labelsize=LABEL_PT)
    cb.set_label("attention weight", fontsize=LABEL_PT)
    fig.suptitle(_mpl_text(title or "attention maps"), fontsize=8, y=1 - 8 / Hpx, va="top")
    fig.text(LEFT / W, 1 - 30 / Hpx, "rows: layers, columns: heads; in each map row = query token, column = key token",
             fontsize=LABEL_PT)
    corner = fig.axes[(L - 1) * H]                                   # bottom-left map: both axes labelled
    geo["labels_drawn"] = [t.get_text() for t in corner.get_xticklabels()]
    geo["notes"] = grid_notes(labels, geo["label_step"])
    if geo["notes"]:
        fig.text(4 / W, 6 / Hpx, _mpl_text("; ".join(geo["notes"])), fontsize=LABEL_PT)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return geo


def head_geometry(T: int) -> tuple[int, int]:
    """Pixel size (width, height) of a single-head PNG for T tokens: a square map of
    ``clamp(16·T, 512, 2048)`` pixels plus margins for labels and the colour bar."""
    side = max(512, min(2048, 16 * T))
    return side + 112 + 96, side + 112 + 48


def write_head_png(weights: torch.Tensor, labels: list[str], layer: int, head: int, path: str) -> None:
    """One head's map of sequence 0 at full size, every token labelled (thinned past 96).

    Args:
        weights: ``[n_layer, B, h, T, T]``; layer, head: 0-based.
    """
    plt = _plt()
    T = weights.shape[-1]
    W, H = head_geometry(T)
    side = W - 112 - 96
    fig = plt.figure(figsize=(W / DPI, H / DPI), dpi=DPI)
    ax = fig.add_axes((112 / W, 112 / H, side / W, side / H))
    im = ax.imshow(weights[layer, 0, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    _tick_labels(ax, labels, x=True, y=True, fontsize=6, step=max(1, math.ceil(T / 96)))   # >= 16 px per label
    ax.set_xlabel("key token", fontsize=7)
    ax.set_ylabel("query token", fontsize=7)
    ax.set_title(f"layer {layer} head {head}", fontsize=8)
    cax = fig.add_axes(((112 + side + 16) / W, 112 / H, 16 / W, side / H))
    fig.colorbar(im, cax=cax).ax.tick_params(labelsize=5)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


#: heads.html embeds the maps as 8-bit lower triangles; past this many bytes of maps it embeds
#: only the layers of the selected heads.
HTML_MAX_MAP_BYTES = 4_000_000


def quantise_maps(w: torch.Tensor) -> bytes:
    """Maps ``[n, T, T]`` (causal, values in [0, 1]) → the lower triangles as uint8 ``round(255·w)``,
    map after map, row after row (row i holds keys 0..i): ``n · T(T+1)/2`` bytes."""
    T = w.shape[-1]
    rows, cols = torch.tril_indices(T, T)
    return (w[:, rows, cols].clamp(0, 1) * 255).round().to(torch.uint8).numpy().tobytes()


def html_layers(n_layer: int, n_head: int, T: int, selected: list[tuple[int, int]] | None,
                max_bytes: int = HTML_MAX_MAP_BYTES) -> list[int]:
    """Layers whose maps heads.html embeds: all of them when ``n_layer·n_head·T(T+1)/2`` bytes
    fit in ``max_bytes``, else the layers of the ``selected`` heads (layer 0 if none)."""
    if n_layer * n_head * T * (T + 1) // 2 <= max_bytes:
        return list(range(n_layer))
    return sorted({l for l, _ in selected or []}) or [0]


def write_html(result: HeadsResult, path: str, title: str = "attention heads", grid_png: str | None = None,
               selected: list[tuple[int, int]] | None = None, max_bytes: int = HTML_MAX_MAP_BYTES) -> dict:
    """One self-contained HTML page: every head as a small canvas (id ``L{layer}H{head}``),
    a large view of the clicked head (at first the first of ``selected``, e.g. ``--layer 2
    --head 5``'s) with token labels and hover values, the role and the
    raw and relative scores of every head, and the grid PNG inlined as a data URI. No
    external resources.

    The maps are embedded quantised to 8 bits (steps of 1/255), lower triangles only, base64:
    ``n_layer·n_head·T(T+1)/2`` bytes before base64, about 0.55 MB for 6 x 6 heads and 150
    tokens. Past ``max_bytes`` only the layers of the ``selected`` heads are embedded
    (:func:`html_layers`); the page says so and the other layers' canvases stay grey.

    Args:
        result: from :func:`analyse_heads` (sequence 0 is shown).
        path: the HTML file to write; grid_png: optional PNG path to embed.

    Returns:
        ``{"layers": embedded layers, "notes": [...]}``.
    """
    w = result.weights[:, 0]                                               # [L, h, T, T]
    L, H, T = w.shape[0], w.shape[1], w.shape[-1]
    layers = html_layers(L, H, T, selected, max_bytes)
    notes = ["heads.html holds the weights rounded to 8 bits (steps of 1/255)"]
    if len(layers) < L:
        notes.append(f"heads.html embeds only layer(s) {', '.join(map(str, layers))}: all {L} layers of a {T}-token "
                     f"prompt would take {L * H * T * (T + 1) // 2 / 1e6:.1f} MB (limit {max_bytes / 1e6:.1f} MB); "
                     f"pick others with --layer")
    q = quantise_maps(w[layers].reshape(len(layers) * H, T, T))
    first = list(selected[0]) if selected else [layers[0], 0]              # the page opens on it
    data = {"labels": result.labels, "n_layer": L, "n_head": H, "T": T, "layers": layers, "selected": first,
            "maps": base64.b64encode(q).decode()}
    payload = json.dumps(data).replace("</", "<\\/")
    rows = []
    for l in range(L):
        cells = "".join(f'<td><canvas id="L{l}H{h}" width="96" height="96" data-layer="{l}" data-head="{h}" '
                        f'title="layer {l} head {h}"></canvas><br>layer {l} head {h}</td>' for h in range(H))
        rows.append(f"<tr>{cells}</tr>")
    roles = {(r["layer"], r["head"]): r for r in result.roles}
    rel_keys = [k for _, k in ROLES if k in result.relative]
    score_rows = []
    for l in range(L):
        for h in range(H):
            raw = "".join(f"<td>{float(result.scores[k][l, h]):.3f}</td>"
                          for k in ("previous", "first", "self", "induction", "entropy_norm") if k in result.scores)
            rel = "".join(f"<td>{float(result.relative[k][l, h]):.2f}</td>" for k in rel_keys)
            role = html.escape(roles[(l, h)]["role"]) if (l, h) in roles else ""
            score_rows.append(f"<tr><td>{l}</td><td>{h}</td><td>{role}</td>{rel}{raw}</tr>")
    raw_head = "".join(f"<th>{k} (raw)</th>" for k in ("previous", "first", "self", "induction", "entropy_norm")
                       if k in result.scores)
    rel_head = "".join(f"<th>{k}</th>" for k in rel_keys)
    strongest = ""
    if result.relative:
        strongest = html.escape(format_strongest(strongest_heads(result.relative, 3), result.roles))
    img = ""
    if grid_png:
        with open(grid_png, "rb") as f:
            img = f'<img alt="grid" src="data:image/png;base64,{base64.b64encode(f.read()).decode()}">'
    page = _HTML.format(title=html.escape(title), prompt=html.escape("".join(result.labels)), L=L, H=H, T=T,
                        grid="\n".join(rows), scores="\n".join(score_rows), raw_head=raw_head, rel_head=rel_head,
                        strongest=strongest, img=img, payload=payload, threshold=ROLE_THRESHOLD,
                        notes="".join(f"<li>{html.escape(n)}</li>" for n in notes))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return {"layers": layers, "notes": notes}


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }} td {{ text-align: center; font-size: 11px; padding: 2px; }}
canvas.small {{ cursor: pointer; }} canvas.small.sel {{ outline: 3px solid #e33; }} #big {{ border: 1px solid #ccc; }}
table.s td {{ padding: 1px 8px; }} pre {{ background: #f4f4f4; padding: .5em; }}
</style></head><body>
<h1>{title}</h1>
<p>Prompt ({T} tokens; space shown as &#9251;, newline as &#8629;): <code>{prompt}</code></p>
<p id="explain">Every step of these heads' attention with the model's numbers (q, k, v, scores, mask, softmax, c_proj),
the KV cache and your own attention module checked: <code>gpt2mha explain</code> with this prompt opens it interactively.</p>
<p>{L} layers x {H} heads. In every map row = query token, column = key token; brighter = more weight.
Click a small map to enlarge it.</p>
<ul id="notes">{notes}</ul>
<h2>Heads with a clear role</h2>
<p>Each head gets one role, its strongest, scored relative to uniform attention (0 = what uniform or random
attention gives, 1 = all weight on that key); below {threshold} a head has no clear role. Induction is measured on a
random sequence repeated twice.</p>
<pre>{strongest}</pre>
<h2>Selected head: <span id="sel"></span></h2>
<canvas id="big" width="640" height="640"></canvas><div id="hover">&nbsp;</div>
<h2>All heads</h2>
<table id="heads">{grid}</table>
<h2>Scores of every head</h2>
<table class="s"><tr><th>layer</th><th>head</th><th>role</th>{rel_head}{raw_head}</tr>
{scores}
</table>
<h2>Grid image</h2>{img}
<script>
const D = {payload};
const Q = Uint8Array.from(atob(D.maps), (c) => c.charCodeAt(0)), TRI = D.T * (D.T + 1) / 2;
function weight(l, h, i, j) {{ const k = D.layers.indexOf(l);
  if (k < 0 || j > i) return j > i ? 0 : null;
  return Q[(k * D.n_head + h) * TRI + i * (i + 1) / 2 + j] / 255; }}
function color(v) {{ const r = Math.round(68 + 185 * v), g = Math.round(1 + 230 * v), b = Math.round(84 + 20 * v);
  return `rgb(${{r}},${{g}},${{b}})`; }}
function draw(cv, l, h, margin) {{
  const ctx = cv.getContext("2d"), T = D.T, s = (cv.width - margin) / T;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
  if (!D.layers.includes(l)) {{ ctx.fillStyle = "#ccc";
    ctx.fillRect(margin, margin, cv.width - margin, cv.height - margin);
    ctx.fillStyle = "#000"; ctx.font = "10px sans-serif"; ctx.fillText("not embedded", margin + 4, margin + 14); return s; }}
  const edge = (k) => Math.round(margin + k * s);                 // whole pixels: no seams between cells
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {{
    ctx.fillStyle = color(weight(l, h, i, j));
    ctx.fillRect(edge(j), edge(i), edge(j + 1) - edge(j), edge(i + 1) - edge(i)); }}
  if (margin > 0) {{ ctx.fillStyle = "#000"; ctx.font = Math.max(6, Math.min(12, s)) + "px sans-serif";
    const step = Math.max(1, Math.ceil(T / ((cv.width - margin) / 10)));
    for (let i = 0; i < T; i += step) {{ ctx.fillText(D.labels[i], 2, margin + (i + 0.8) * s);
      ctx.save(); ctx.translate(margin + (i + 0.8) * s, margin - 2); ctx.rotate(-Math.PI / 2);
      ctx.fillText(D.labels[i], 0, 0); ctx.restore(); }} }}
  return s;
}}
let cur = [0, 0];
function select(l, h) {{ cur = [l, h]; document.getElementById("sel").textContent = `layer ${{l}} head ${{h}}`;
  document.querySelectorAll("canvas.small").forEach((c) => c.classList.toggle("sel", c.id === `L${{l}}H${{h}}`));
  draw(document.getElementById("big"), l, h, 80); }}
for (let l = 0; l < D.n_layer; l++) for (let h = 0; h < D.n_head; h++) {{
  const cv = document.getElementById(`L${{l}}H${{h}}`); cv.className = "small";
  draw(cv, l, h, 0); cv.onclick = () => select(l, h); }}
const big = document.getElementById("big");
big.onmousemove = (e) => {{ const T = D.T, s = (big.width - 80) / T, r = big.getBoundingClientRect();
  const j = Math.floor((e.clientX - r.left - 80) / s), i = Math.floor((e.clientY - r.top - 80) / s);
  const v = weight(cur[0], cur[1], i, j);
  if (i >= 0 && j >= 0 && i < T && j < T && v !== null) document.getElementById("hover").textContent =
    `query ${{i}} "${{D.labels[i]}}" -> key ${{j}} "${{D.labels[j]}}": ${{v.toFixed(3)}}`; }};
select(D.selected[0], D.selected[1]);
</script>
</body></html>
"""


def write_heads(result: HeadsResult, out_dir: str, heads: list[tuple[int, int]], title: str = "") -> dict:
    """Write ``grid.png``, ``layer{L}_head{H}.png`` per selected head and ``heads.html``.

    Returns:
        ``{"grid": path, "heads": [paths], "html": path, "geometry": grid_geometry, "notes": what
        the files leave out (thinned labels, 8-bit weights, layers not embedded), "html_layers"}``.
    """
    os.makedirs(out_dir, exist_ok=True)
    grid = os.path.join(out_dir, "grid.png")
    geo = write_grid_png(result.weights, result.labels, grid, title)
    paths = []
    for l, h in heads:
        p = os.path.join(out_dir, f"layer{l}_head{h}.png")
        write_head_png(result.weights, result.labels, l, h, p)
        paths.append(p)
    page = os.path.join(out_dir, "heads.html")
    info = write_html(result, page, title or "attention heads", grid, heads)
    return {"grid": grid, "heads": paths, "html": page, "geometry": geo, "notes": geo["notes"] + info["notes"],
            "html_layers": info["layers"]}
