// gpt2mha explain: ablate heads and watch the next-token distribution move; the logit lens.
"use strict";

EX.views.intervene = {
  async render() {
    const box = EX.$("intervene");
    box.replaceChildren(EX.el("h3", { text: "Ablate heads" }), this.ablateBox(), EX.el("h3", { text: "The logit lens" }),
      EX.el("p", { class: "hint", text: "The residual stream before each block (and after the last) decoded through ln_f and the LM head: " +
        "the token each layer would predict next, and its probability. The bottom row is the model's own prediction." }),
      EX.el("div", { id: "lens" }, EX.el("span", { class: "spin", text: "computing…" })));
    await this.lens();
  },

  ablateBox() {
    if (!EX.live) return EX.needsServer("Ablating a head");
    const c = EX.state.config;
    const grid = EX.el("table", { class: "ab-grid", id: "ab-grid" }, EX.el("tr", {}, EX.el("td"),
      Array.from({ length: c.n_head }, (_, h) => EX.el("td", { text: `h${h}` }))),
    Array.from({ length: c.n_layer }, (_, l) => EX.el("tr", {}, EX.el("td", { text: `layer ${l}` }),
      Array.from({ length: c.n_head }, (_, h) => EX.el("td", {}, EX.el("input", { type: "checkbox", id: `ab-${l}-${h}`,
        "data-layer": l, "data-head": h, title: `layer ${l} head ${h}` }))))));
    return EX.el("div", {}, EX.el("p", { class: "hint", text: "Tick heads and run: their outputs (hook_z) are set to 0, or to their " +
      "mean over the prompt's positions, and the last position's next-token distribution is compared with the plain run." }),
    grid, EX.el("div", { class: "controls" },
      EX.el("label", {}, EX.el("input", { type: "radio", name: "ab-mode", value: "zero", id: "ab-zero", checked: true }), " zero"),
      EX.el("label", {}, EX.el("input", { type: "radio", name: "ab-mode", value: "mean", id: "ab-mean" }), " mean"),
      EX.el("button", { type: "button", id: "ab-run", onclick: () => this.ablate() }, "Ablate")),
    EX.el("div", { id: "ab-result" }));
  },

  async ablate() {
    const heads = Array.from(document.querySelectorAll("#ab-grid input:checked")).map((b) => [+b.dataset.layer, +b.dataset.head]);
    const mode = EX.$("ab-mean").checked ? "mean" : "zero";
    try {
      const r = await EX.api("POST", "api/ablate", { session: EX.state.session, heads, mode });
      const top = Math.max(...r.tokens.map((t) => Math.max(t.before, t.after)), 1e-9);
      EX.$("ab-result").replaceChildren(
        EX.el("p", { class: "hint", id: "ab-summary", text: `${mode} ablation of ${r.heads.map((p) => p.join(".")).join(", ")}: ` +
          `KL(before ‖ after) = ${r.kl.toFixed(4)} nats, largest logit change ${r.max_logit_change.toFixed(4)}` }),
        EX.el("table", { class: "t", id: "ab-table" }, EX.el("tr", {}, ["token", "id", "before", "", "after", ""].map((x) => EX.el("th", { text: x }))),
          r.tokens.map((t) => EX.el("tr", { "data-id": t.id }, EX.el("td", { class: "mono", text: JSON.stringify(t.label) }),
            EX.el("td", { class: "num", text: String(t.id) }), EX.el("td", { class: "num", text: t.before.toFixed(4) }),
            EX.el("td", {}, EX.el("span", { class: "bar", style: `width:${Math.round(160 * t.before / top)}px` })),
            EX.el("td", { class: "num", text: t.after.toFixed(4) }),
            EX.el("td", {}, EX.el("span", { class: "bar p", style: `width:${Math.round(160 * t.after / top)}px` }))))));
      EX.showError(null);
    } catch (e) {
      EX.showError(e.message);
    }
  },

  async lens() {
    const u = await EX.unit("lens");
    const T = u.tokens.length, R = u.rows.length;
    const probs = EX.tensor(u.top_p), k = probs.shape[2];
    const top1 = { shape: [R, T], data: new Float32Array(R * T) };
    for (let r = 0; r < R; r++) for (let t = 0; t < T; t++) top1.data[r * T + t] = probs.data[(r * T + t) * k];
    const lab = (id) => u.labels[String(id)];
    const cols = Math.min(T, 16), first = T - cols;
    const table = EX.el("table", { class: "lens", id: "lens-table" },
      EX.el("tr", {}, EX.el("td"), Array.from({ length: cols }, (_, c) => EX.el("td", { class: "mono", text: `${first + c} ${JSON.stringify(u.tokens[first + c].label)}` }))),
      u.rows.map((name, r) => EX.el("tr", {}, EX.el("td", { class: "mono", text: name }),
        Array.from({ length: cols }, (_, c) => {
          const t = first + c, p = probs.data[(r * T + t) * k];
          return EX.el("td", { title: `top ${k}: ` + u.top_ids[r][t].map((id, i) => `${JSON.stringify(lab(id))} ${probs.data[(r * T + t) * k + i].toFixed(4)}`).join(", "),
            style: `background: rgba(48,86,211,${(0.08 + 0.6 * p).toFixed(2)})` },
          JSON.stringify(lab(u.top_ids[r][t][0])), EX.el("br"), p.toFixed(2));
        }))));
    EX.$("lens").replaceChildren(
      EX.el("p", { class: "hint", text: cols < T ? `the last ${cols} of ${T} positions; the map below has them all` : "" }), table,
      EX.matrix({ id: "m-lens", name: "top-1 probability", t: top1, kind: "weights", maxW: 900, maxH: 200,
        describe: (r, t) => `${u.rows[r]}, position ${t} ${JSON.stringify(u.tokens[t].label)}: top token ${JSON.stringify(lab(u.top_ids[r][t][0]))}` }));
  },
};
