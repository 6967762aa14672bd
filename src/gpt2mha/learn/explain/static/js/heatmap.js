// gpt2mha explain: a matrix drawn on a canvas, one cell per value, its value on hover.
// Cells are painted into an ImageData at one pixel per cell and scaled up without smoothing:
// a 256 x 576 matrix is 147k pixels, one putImageData and one drawImage.
"use strict";

// Colour maps. signed: blue (negative), white (0), red (positive), scaled by the largest |value|;
// weights: dark violet (0) to yellow (1), as heads.html; mask: blue where a query may read the key.
EX.colors = {
  signed(v, scale) {
    const t = Math.max(-1, Math.min(1, v / scale));
    return t >= 0 ? [255 - 77 * t, 255 - 231 * t, 255 - 212 * t] : [255 + 222 * t, 255 + 153 * t, 255 + 83 * t];
  },
  weights(v) { return [68 + 185 * v, 1 + 230 * v, 84 + 20 * v]; },
  mask(v) { return v > 0.5 ? [48, 86, 211] : [236, 236, 236]; },
};
EX.MASKED_RGB = [205, 205, 205];

EX.dims2 = function (t, column) {
  if (t.shape.length === 2) return t.shape;
  if (t.shape.length === 1) return column ? [t.shape[0], 1] : [1, t.shape[0]];
  throw new Error(`cannot draw a tensor of shape ${EX.shape(t.shape)}`);
};

// spec: {id, name, t (decoded tensor), caption (nodes), kind ("signed" | "weights" | "mask"),
//   maxW, maxH (pixels), square (same cell width and height), column (1-D as a column),
//   marks (columns where a block starts: a line), bands ([{c0, c1}] outlined column ranges),
//   rowBands ([{r0, r1}]), describe(i, j) -> extra hover text,
//   axes ({rows, cols}: token labels drawn down the left and along the top; either may be left out)}
EX.matrix = function (spec) {
  const t = spec.t;
  const [rows, cols] = EX.dims2(t, spec.column);
  const maxW = spec.maxW || 900, maxH = spec.maxH || 360;
  let cw = Math.max(1, Math.min(28, Math.floor(maxW / cols)));
  let ch = Math.max(1, Math.min(28, Math.floor(maxH / rows)));
  if (spec.square) cw = ch = Math.min(cw, ch);
  if (spec.column) cw = Math.max(cw, 18);
  const canvas = EX.el("canvas", { id: spec.id, width: cols * cw, height: rows * ch, "data-rows": rows,
    "data-cols": cols, "data-cw": cw, "data-ch": ch, "data-name": spec.name });
  EX.paint(canvas, t, rows, cols, cw, ch, spec);
  canvas.addEventListener("mousemove", (ev) => {
    const j = Math.floor(ev.offsetX / cw), i = Math.floor(ev.offsetY / ch);
    if (i < 0 || j < 0 || i >= rows || j >= cols) return;
    const v = t.data[i * cols + j];
    const extra = spec.describe ? spec.describe(i, j, v) : "";
    EX.setHover(`${spec.name}[${i}, ${j}] = ${EX.fmt(v)}${extra ? "   " + extra : ""}`, ev);
  });
  canvas.addEventListener("mouseleave", EX.hideTip);
  const cap = EX.el("figcaption", {}, EX.el("b", { text: spec.name }), " ",
    EX.el("span", { class: "shape", text: EX.shape(t.shape) }), spec.caption ? [" ", spec.caption].flat() : []);
  cap.style.maxWidth = Math.max(cols * cw, 260) + "px";             // the caption wraps at the matrix's width
  const ax = spec.axes;
  const body = ax ? EX.el("div", { class: "axes" }, EX.el("div", {}),
    ax.cols ? EX.axis(ax.cols, cols, cw, "cols", spec.id + "-cols") : EX.el("div", {}),
    ax.rows ? EX.axis(ax.rows, rows, ch, "rows", spec.id + "-rows") : EX.el("div", {}), canvas) : canvas;
  return EX.el("figure", { class: "mx", id: spec.id + "-fig" }, cap, EX.el("div", { class: "scroll" }, body));
};

// Token labels along one axis of a matrix: "rows" down its left (right-aligned), "cols" along its
// top (turned a quarter). Label i sits at cell i's centre; when cells are smaller than the font,
// every step-th label is drawn (step = ceil(font / cell)). Each reads "label index" (the hover line
// says the rest); the labels drawn are in the canvas's data-labels ([[index, text], ...]).
EX.AXIS_FONT = 9;
EX.AXIS_DEPTH = 90;
EX.axis = function (labels, n, cell, along, id) {
  const step = Math.max(1, Math.ceil(EX.AXIS_FONT / cell));
  const font = `${EX.AXIS_FONT}px ui-monospace, monospace`;
  const shown = [];
  for (let i = 0; i < n; i += step) {
    const lab = labels[i] === undefined ? "" : String(labels[i]);
    shown.push([i, (lab.length > 10 ? lab.slice(0, 9) + "…" : lab) + " " + i]);
  }
  const measure = document.createElement("canvas").getContext("2d");
  measure.font = font;
  const depth = Math.min(EX.AXIS_DEPTH, Math.ceil(Math.max(0, ...shown.map(([, t]) => measure.measureText(t).width))) + 6);
  const len = n * cell + 2;                                           // the matrix's canvas and its 1 px border
  const rows = along === "rows";
  const cv = EX.el("canvas", { id, class: "axis", width: rows ? depth : len, height: rows ? len : depth,
    "data-labels": JSON.stringify(shown), "data-step": step });
  const ctx = cv.getContext("2d");
  ctx.font = font;
  ctx.fillStyle = "#333";
  ctx.textBaseline = "middle";
  for (const [i, text] of shown) {
    const at = 1 + (i + 0.5) * cell;
    if (rows) {
      ctx.textAlign = "right";
      ctx.fillText(text, depth - 3, at);
    } else {
      ctx.save();
      ctx.translate(at, depth - 3);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
  }
  return cv;
};

EX.paint = function (canvas, t, rows, cols, cw, ch, spec) {
  const kind = spec.kind || "signed";
  let scale = 0;
  if (kind === "signed") {
    for (let k = 0; k < t.data.length; k++) {
      const v = t.data[k];
      if (!EX.isMasked(v) && Number.isFinite(v) && Math.abs(v) > scale) scale = Math.abs(v);
    }
    scale = scale || 1;
  }
  const img = new ImageData(cols, rows), px = img.data, color = EX.colors[kind];
  for (let k = 0; k < rows * cols; k++) {
    const v = t.data[k];
    const c = EX.isMasked(v) || v === -Infinity ? EX.MASKED_RGB : Number.isNaN(v) ? [0, 0, 0] : color(v, scale);
    px[4 * k] = c[0]; px[4 * k + 1] = c[1]; px[4 * k + 2] = c[2]; px[4 * k + 3] = 255;
  }
  const off = document.createElement("canvas");
  off.width = cols; off.height = rows;
  off.getContext("2d").putImageData(img, 0, 0);
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(off, 0, 0, cols * cw, rows * ch);
  ctx.fillStyle = "#111";
  for (const c of spec.marks || []) ctx.fillRect(Math.max(0, c * cw - 1), 0, 2, rows * ch);
  ctx.strokeStyle = "#ff9800";
  ctx.lineWidth = 2;
  for (const b of spec.bands || []) ctx.strokeRect(b.c0 * cw + 1, 1, (b.c1 - b.c0) * cw - 2, rows * ch - 2);
  for (const b of spec.rowBands || []) ctx.strokeRect(1, b.r0 * ch + 1, cols * cw - 2, (b.r1 - b.r0) * ch - 2);
  canvas.dataset.scale = scale;
};

// A small legend line for a colour map.
EX.legend = function (kind, scale) {
  if (kind === "weights") return EX.el("span", { class: "hint", text: "dark = 0, yellow = 1" });
  if (kind === "mask") return EX.el("span", { class: "hint", text: "blue = may attend (1), grey = masked (0)" });
  return EX.el("span", { class: "hint", text: `blue < 0 < red${scale ? ", full colour at ±" + scale : ""}` });
};
