"""``gpt2mha explain PROMPT --export DIR``: the page with one prompt's numbers, opening from disk.

DIR gets ``index.html`` (the same page, told it is an export), ``static/`` (its JavaScript and
CSS) and ``data/KEY.js``, one file per answer the live app would give (``pipeline``, ``heads``,
``lens``, ``layer_L``, ``head_L_H``), each a script calling ``EXPLAIN_PUT(KEY, {...})``: a
browser loads them from ``file://`` with ``<script>`` tags, with no server and no network. The
views that need the model (a new token, ablation, the checker, another prompt) say so.

Importing this module imports no torch (the command line checks ``--export`` with
:func:`check_export_dir` before torch is loaded).
"""

from __future__ import annotations

import json
import os
import shutil


#: The largest export written, in bytes (estimated before any work: :func:`estimate_bytes`).
EXPORT_MAX_BYTES = 400 << 20


def estimate_bytes(config, T: int) -> int:
    """About how many bytes an export of a ``T``-token prompt writes: float32 values in base64
    (4/3), per layer ``[T, n_embd]`` x5, ``[T, 3·n_embd]``, ``[T, T]`` and per head ``[T, head_dim]``
    x4 and ``[T, T]`` x2, the small multiples (a byte per cell), the lens and the tokens."""
    c = config
    per_layer = T * c.n_embd * 8 + T * T
    per_head = 4 * T * c.head_dim + 2 * T * T + T
    floats = c.n_layer * per_layer + c.n_layer * c.n_head * per_head + 4 * T * c.n_embd + 4 * (c.n_layer + 1) * T
    thumbs = c.n_layer * c.n_head * min(T, 64) ** 2 // 4
    return (floats + thumbs) * 4 * 4 // 3 + 160 * T * 3 + 600 * c.n_layer * (c.n_head + 1)


def check_export_dir(path: str) -> None:
    """Raises ValueError unless ``path`` is new, an empty directory or an earlier export
    (``index.html`` and ``data/`` in it: rewritten)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--export {path!r} is a file; expected a directory to write the page into")
    if os.path.isdir(path) and os.listdir(path) and not (
            os.path.isfile(os.path.join(path, "index.html")) and os.path.isdir(os.path.join(path, "data"))):
        raise ValueError(f"--export {path!r} is a directory that is not empty and holds no earlier export; give a new "
                         f"or empty directory")


def write_unit(data_dir: str, key: str, unit: dict) -> int:
    """``data/KEY.js`` calling ``EXPLAIN_PUT(KEY, unit)``; returns its size in bytes."""
    text = f"EXPLAIN_PUT({json.dumps(key)}, {json.dumps(unit, separators=(',', ':'))});\n"
    path = os.path.join(data_dir, f"{key}.js")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return len(text.encode("utf-8"))


def export(seq, out_dir: str, prompt: str, max_bytes: int = EXPORT_MAX_BYTES) -> dict:
    """Write the page for ``seq`` into ``out_dir``.

    Args:
        seq: the prompt's :class:`~.session.Sequence` (its model and tokens); prompt: its text.
        max_bytes: refuse exports estimated above this (:func:`estimate_bytes`).

    Returns:
        ``{"index": path of index.html, "files": count, "bytes": total}``.

    Raises:
        ValueError: ``out_dir`` unusable (:func:`check_export_dir`), or the export too large.
    """
    from .app import STATIC, page_html

    check_export_dir(out_dir)
    c, T = seq.entry.config, len(seq.ids)
    need = estimate_bytes(c, T)
    if need > max_bytes:
        raise ValueError(f"an export of {T} tokens on this model would write about {need / 2**20:,.0f} MB (limit "
                         f"{max_bytes / 2**20:,.0f} MB); export a shorter prompt, or run gpt2mha explain to see it live")
    data = os.path.join(out_dir, "data")
    os.makedirs(data, exist_ok=True)
    for old in os.listdir(data):
        if old.endswith(".js"):
            os.remove(os.path.join(data, old))
    shutil.copytree(STATIC, os.path.join(out_dir, "static"), dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("index.html", "__pycache__"))
    total, files = 0, 0
    units = [("pipeline", None, None), ("heads", None, None), ("lens", None, None)]
    units += [(kind, l, h) for l in range(c.n_layer) for kind, h in [("layer", None)] + [("head", h) for h in range(c.n_head)]]
    for kind, layer, head in units:
        key = kind if layer is None else f"layer_{layer}" if kind == "layer" else f"head_{layer}_{head}"
        total += write_unit(data, key, seq.unit(kind, layer, head))
        files += 1
    boot = {"mode": "export", "token": "", "session": None, "prompt": prompt, **seq.summary(), "checker": {"on": False, "note": "an exported page has no server", "timeout_s": None,
                                                  "memory_mb": None}}
    index = os.path.join(out_dir, "index.html")
    page = page_html(boot)
    with open(index, "w", encoding="utf-8") as f:
        f.write(page)
    return {"index": index, "files": files + 1, "bytes": total + len(page.encode("utf-8"))}
