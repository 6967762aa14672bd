// gpt2mha explain: every head as a small multiple, one enlarged, its token-to-token lines, and roles.
"use strict";

EX.THUMB_PX = 72;

EX.views.heads = {
  async render() {
    const hu = await EX.unit("heads");
    const c = EX.state.config, L = c.n_layer, H = c.n_head;
    const th = EX.tensor(hu.thumbs), B = th.shape[2];
    const roles = new Map(hu.roles.map((r) => [`${r.layer}.${r.head}`, r]));
    const short = { "previous-token": "prev", "first-token": "first", self: "self", induction: "induct" };
    const rows = [];
    for (let l = 0; l < L; l++) {
      const cells = [];
      for (let h = 0; h < H; h++) {
        const cv = EX.el("canvas", { id: `L${l}H${h}`, width: EX.THUMB_PX, height: EX.THUMB_PX, class: "small",
          title: `layer ${l} head ${h}`, "data-layer": l, "data-head": h });
        EX.thumb(cv, th.data, ((l * H + h) * B) * B, B);
        cv.addEventListener("click", () => { EX.select(l, h); EX.views.heads.pick(); });
        const r = roles.get(`${l}.${h}`);
        const role = r && r.role !== hu.no_role ? ` ${short[r.role] || r.role} ${r.score.toFixed(2)}` : "";
        cells.push(EX.el("td", {}, cv, `${l}.${h}${role}`));
      }
      rows.push(EX.el("tr", {}, cells));
    }
    EX.$("heads-grid").replaceChildren(EX.el("table", { id: "heads-table" }, rows),
      EX.el("p", { class: "hint", id: "thumb-legend", text: EX.views.heads.thumbLegend(hu.pool, B, EX.state.T) }));
    EX.$("roles").replaceChildren(EX.views.heads.roleTable(hu));
    await EX.views.heads.pick();
  },

  // The selected head enlarged (full precision) and its line view.
  async pick() {
    const l = EX.state.layer, h = EX.state.head;
    document.querySelectorAll("#heads-grid canvas").forEach((cv) => cv.classList.toggle("sel", cv.id === `L${l}H${h}`));
    const u = await EX.unit("head", l, h);
    const hu = await EX.unit("heads");
    const r = hu.roles.find((x) => x.layer === l && x.head === h);
    const role = r ? `role: ${r.role} (score ${r.score.toFixed(2)})` : hu.note;
    EX.$("heads-big").replaceChildren(EX.el("h3", { id: "sel", text: `layer ${l} head ${h}` }),
      EX.el("p", { class: "hint", id: "sel-role", text: role }),
      EX.matrix({ id: "m-big", name: "A", t: EX.tensor(u.pattern), kind: "weights", square: true, maxW: 520, maxH: 520,
        describe: EX.tokenDescriber("pairs"), caption: [EX.legend("weights")], axes: { rows: EX.labels(), cols: EX.labels() } }));
    EX.views.heads.lines(EX.tensor(u.pattern), -1);
  },

  // What a small map's pixel is: one cell, or (max pooling) the largest weight of its block.
  thumbLegend(pool, B, T) {
    const scale = "small maps: dark = 0, yellow = 1, every head on the same scale";
    if (B >= T) return `${scale}; one pixel per cell`;
    const what = pool === "max" ? "the largest weight of" : "the mean of";
    return `${scale}; each pixel ${what} its block of about ${(T / B).toFixed(1)}² cells (${pool === "max" ? "max" : "mean"} pooling)`;
  },

  roleTable(hu) {
    if (!hu.roles.length) return EX.el("p", { class: "hint", text: hu.note });
    const keys = hu.role_keys.filter(([, k]) => k in hu.roles[0].scores);
    const sorted = hu.roles.slice().sort((a, b) => b.score - a.score);
    return EX.el("div", {}, EX.el("p", { class: "hint",
      text: `A head gets its strongest role when that score is at least ${hu.threshold}; induction is measured on a random sequence repeated twice. Sorted by score; click a row to open the head.` }),
    EX.el("table", { class: "t", id: "roles-table" }, EX.el("tr", {}, ["layer", "head", "role", "score"].map((x) => EX.el("th", { text: x })),
      keys.map(([label]) => EX.el("th", { text: label }))),
    sorted.map((r) => EX.el("tr", { class: "clickable", onclick: () => { EX.select(r.layer, r.head); EX.views.heads.pick(); } },
      EX.el("td", { class: "num", text: String(r.layer) }), EX.el("td", { class: "num", text: String(r.head) }),
      EX.el("td", { text: r.role }), EX.el("td", { class: "num", text: r.score.toFixed(2) }),
      keys.map(([, k]) => EX.el("td", { class: "num", text: r.scores[k].toFixed(2) }))))));
  },

  // bertviz's line view: queries on the left, keys on the right, a line per weight.
  lines(p, only) {
    const cv = EX.$("lines"), T = p.shape[0], labels = EX.labels();
    const rh = Math.max(3, Math.min(16, Math.floor(900 / T))), top = 10;
    cv.height = T * rh + 2 * top;
    const ctx = cv.getContext("2d"), xl = 150, xr = cv.width - 150;
    ctx.clearRect(0, 0, cv.width, cv.height);
    ctx.font = `${Math.min(12, rh)}px ui-monospace, monospace`;
    ctx.textBaseline = "middle";
    if (rh >= 7) {
      for (let i = 0; i < T; i++) {
        ctx.fillStyle = only === i ? "#c00" : "#222";
        ctx.textAlign = "right"; ctx.fillText(`${labels[i] || ""} ${i}`, xl - 6, top + (i + 0.5) * rh);
        ctx.fillStyle = "#222";
        ctx.textAlign = "left"; ctx.fillText(`${i} ${labels[i] || ""}`, xr + 6, top + (i + 0.5) * rh);
      }
    }
    ctx.strokeStyle = "#3056d3";
    for (let i = 0; i < T; i++) {
      if (only >= 0 && i !== only) continue;
      for (let j = 0; j <= i; j++) {
        const w = p.data[i * T + j];
        if (w < 0.01) continue;
        ctx.globalAlpha = Math.min(1, w);
        ctx.lineWidth = 0.5 + 3 * w;
        ctx.beginPath(); ctx.moveTo(xl, top + (i + 0.5) * rh); ctx.lineTo(xr, top + (j + 0.5) * rh); ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
    cv.onmousemove = (ev) => {
      const i = Math.floor((ev.offsetY - top) / rh);
      const row = ev.offsetX < xl && i >= 0 && i < T ? i : -1;
      if (row !== only) EX.views.heads.lines(p, row);
      if (row >= 0) {
        let best = 0;
        for (let j = 1; j <= row; j++) if (p.data[row * T + j] > p.data[row * T + best]) best = j;
        EX.setHover(`query ${row} ${JSON.stringify(labels[row] || "")} reads most key ${best} ${JSON.stringify(labels[best] || "")}: ${EX.fmt(p.data[row * T + best])}`);
      }
    };
  },
};

// A small multiple: B x B uint8 weights at offset, scaled to the canvas.
EX.thumb = function (cv, data, offset, B) {
  const img = new ImageData(B, B), px = img.data;
  for (let k = 0; k < B * B; k++) {
    const c = EX.colors.weights(data[offset + k] / 255);
    px[4 * k] = c[0]; px[4 * k + 1] = c[1]; px[4 * k + 2] = c[2]; px[4 * k + 3] = 255;
  }
  const off = document.createElement("canvas");
  off.width = off.height = B;
  off.getContext("2d").putImageData(img, 0, 0);
  const ctx = cv.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(off, 0, 0, cv.width, cv.height);
};
