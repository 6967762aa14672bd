// gpt2mha explain: the next token, drawn with the library's sampling (temperature, top-k, top-p:
// OpenAI's semantics), appended through one decode step on the KV cache.
"use strict";

EX.views.generate = {
  built: false,
  last: null,       // the last step's answer (the KV row)

  async render() {
    const box = EX.$("generate");
    if (!this.built) this.build(box);
    EX.$("gen-tokens").replaceChildren(EX.tokenChips(EX.state.tokens, EX.state.promptLen));
    if (!EX.live) { await this.preview(); return; }
    EX.$("past-now").textContent = `past: ${EX.shape(this.cacheShape())}  (B, n_layer, 2 = keys|values, n_head, T, head_dim)`;
    await this.preview();
    this.drawRow();
  },

  cacheShape() {
    const c = EX.state.config;
    return [1, c.n_layer, 2, c.n_head, EX.state.T, c.head_dim];
  },

  build(box) {
    const c = EX.state.config;
    const slider = (id, label, min, max, step, value) => {
      const input = EX.el("input", { type: "range", id, min, max, step, value });
      const out = EX.el("span", { class: "mono", id: id + "-value", text: String(value) });
      input.addEventListener("input", () => { out.textContent = input.value; this.schedule(); });
      return EX.el("label", {}, `${label} `, input, " ", out);
    };
    box.replaceChildren(
      EX.el("p", { class: "lead", text: "Sampling as OpenAI's sample_sequence: logits / temperature, then top-k (keep the k largest), then top-p " +
        "(keep the most probable tokens while their cumulative probability stays within p, at least one), then a draw. Temperature 0 is greedy. " +
        "Moving a slider redraws what each filter removes; \"Next token\" draws with the seed's generator (the same draws as gpt2mha generate --seed) " +
        "and runs one decode step on the KV cache." }),
      EX.el("div", { class: "controls" },
        slider("temperature", "temperature", 0, 2, 0.05, 1),
        slider("top_k", "top-k (0 = off)", 0, Math.min(c.n_vocab, 200), 1, 0),
        slider("top_p", "top-p", 0.01, 1, 0.01, 1),
        EX.el("label", {}, "seed ", EX.el("input", { type: "number", id: "seed", value: 1, min: 0, style: "width:7em" })),
        EX.el("button", { id: "next", type: "button", onclick: () => this.next() }, "Next token"),
        EX.el("button", { id: "reset", type: "button", onclick: () => this.reset() }, "Reset to the prompt")),
      EX.el("div", { id: "gen-tokens" }),
      EX.el("p", { class: "hint", id: "drawn" }),
      EX.el("div", { class: "two" },
        EX.el("div", {}, EX.el("h3", { text: "Next-token distribution and the filters" }),
          EX.el("p", { class: "hint", id: "dist-summary" }), EX.el("div", { id: "dist" })),
        EX.el("div", {}, EX.el("h3", { text: "The KV cache" }),
          EX.el("p", { class: "mono", id: "past-now" }), EX.el("ul", { id: "past-history", class: "hint" }),
          EX.el("div", { class: "controls" }, EX.el("label", {}, "layer ", EX.el("select", { id: "kv-layer" })),
            EX.el("label", {}, "head ", EX.el("select", { id: "kv-head" }))),
          EX.el("div", { id: "kv-row" }))));
    if (!EX.live) {                       // an exported page: the filters run here; a draw needs the model
      EX.$("next").disabled = EX.$("reset").disabled = true;
      EX.$("kv-row").parentNode.replaceChildren(EX.el("h3", { text: "The KV cache" }), EX.needsServer("Drawing a token and a decode step on the cache"));
      this.built = true;
      return;
    }
    EX.fillSelect(EX.$("kv-layer"), c.n_layer, EX.state.layer, "layer");
    EX.fillSelect(EX.$("kv-head"), c.n_head, EX.state.head, "head");
    EX.$("kv-layer").addEventListener("change", () => this.drawRow());
    EX.$("kv-head").addEventListener("change", () => this.drawRow());
    this.built = true;
  },

  fields() {
    return { session: EX.state.session, temperature: +EX.$("temperature").value, top_k: +EX.$("top_k").value,
      top_p: +EX.$("top_p").value };
  },

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.preview().catch((e) => EX.showError(e.message)), 60);
  },

  async preview() {
    if (EX.live) { this.drawDist(await EX.api("POST", "api/sample", this.fields())); return; }
    const u = await EX.unit("pipeline"), f = this.fields();
    this.drawDist(EX.samplingView(EX.tensor(u.last_logits).data, u.next, f.temperature, f.top_k, f.top_p));
  },

  drawDist(v) {
    const top = Math.max(...v.tokens.map((r) => r.p_temp), 1e-9);
    const status = (r) => (!r.kept_k ? "removed by top-k" : !r.kept_p ? "removed by top-p" : "kept");
    EX.$("dist-summary").textContent = v.greedy ? "temperature 0: greedy, all the probability on the most probable token" :
      `top-k removes ${v.removed_k} of ${v.vocab} tokens (${EX.pct(v.removed_k_mass)} of the probability after temperature); ` +
      `top-p removes ${v.removed_p} more (${EX.pct(v.removed_p_mass)}); the draw is from ${v.kept} token(s), renormalised.`;
    EX.$("dist").replaceChildren(EX.el("table", { class: "t", id: "dist-table", "data-temperature": v.temperature,
      "data-top-k": v.top_k, "data-top-p": v.top_p },
      EX.el("tr", {}, ["token", "id", "model p", "after temperature", "", "filters", "sampled with p"].map((x) => EX.el("th", { text: x }))),
      v.tokens.map((r) => EX.el("tr", { "data-id": r.id }, EX.el("td", { class: "mono", text: JSON.stringify(r.label) }),
        EX.el("td", { class: "num", text: String(r.id) }), EX.el("td", { class: "num", text: r.p_model.toFixed(4) }),
        EX.el("td", { class: "num", text: r.p_temp.toFixed(4) }),
        EX.el("td", {}, EX.el("span", { class: "bar" + (!r.kept_k ? " k" : !r.kept_p ? " p" : ""),
          style: `width:${Math.round(200 * r.p_temp / top)}px` })),
        EX.el("td", { text: status(r) }), EX.el("td", { class: "num", text: r.p_final.toFixed(4) })))));
  },

  async next() {
    const btn = EX.$("next");
    btn.disabled = true;
    try {
      const before = EX.shape(this.cacheShape());
      const s = await EX.api("POST", "api/step", Object.assign(this.fields(), { seed: EX.$("seed").value, layer: +EX.$("kv-layer").value }));
      EX.state.version = s.version;
      EX.state.T = s.T;
      EX.state.tokens = EX.state.tokens.concat([Object.assign({ bytes: "" }, s.token)]);
      this.last = s;
      const p = s.sampling.tokens.find((r) => r.id === s.token.id);
      EX.$("drawn").textContent = `drew ${JSON.stringify(s.token.label)} (id ${s.token.id}${p ? ", p = " + p.p_final.toFixed(4) : ""}) ` +
        `with seed ${s.seed}; the cache grew from ${before} to ${EX.shape(s.past_after)}`;
      EX.$("past-history").append(EX.el("li", { text: `+ ${JSON.stringify(s.token.label)}: past ${EX.shape(s.past_before)} -> ${EX.shape(s.past_after)}` }));
      EX.rendered.generate = null;
      await EX.render("generate");
      EX.afterChange();
    } catch (e) {
      EX.showError(e.message);
    } finally {
      btn.disabled = false;
    }
  },

  async reset() {
    try {
      const r = await EX.api("POST", "api/reset", { session: EX.state.session });
      EX.state.version = r.version;
      EX.state.T = r.T;
      EX.state.tokens = EX.state.tokens.slice(0, EX.state.promptLen);
      this.last = null;
      EX.$("past-history").replaceChildren();
      EX.$("drawn").textContent = "";
      EX.rendered.generate = null;
      await EX.render("generate");
      EX.afterChange();
    } catch (e) {
      EX.showError(e.message);
    }
  },

  // The last step's new query: one row of scores over every cached key and its own (nd = 1).
  drawRow() {
    const box = EX.$("kv-row");
    const s = this.last;
    if (!s) { box.replaceChildren(EX.el("p", { class: "hint", text: "Press \"Next token\": the new token's query reads the whole cache." })); return; }
    const l = +EX.$("kv-layer").value, h = +EX.$("kv-head").value, c = EX.state.config, S = s.ns;
    const pick = (enc) => { const t = EX.tensor(enc); return { shape: [1, S], data: t.data.subarray((l * c.n_head + h) * S, (l * c.n_head + h + 1) * S) }; };
    const labels = EX.labels();
    const desc = (i, j) => `key ${j} ${JSON.stringify(labels[j] || "")}${j === S - 1 ? " (the new token itself)" : " (cached)"}`;
    box.replaceChildren(
      EX.el("p", { class: "hint", text: `decode step: nd = 1 new query, ns = ${S} keys (${S - 1} cached + itself); layer ${l} head ${h}` }),
      EX.el("div", {}, EX.matrix({ id: "m-kvmask", name: "attention_mask(1, ns)", t: EX.tensor(s.mask), kind: "mask", maxW: 520, maxH: 20, describe: desc,
        axes: { cols: labels } })),
      EX.el("div", {}, EX.matrix({ id: "m-kvscores", name: "scores row", t: pick(s.scores), maxW: 520, maxH: 20, describe: desc })),
      EX.el("div", {}, EX.matrix({ id: "m-kvpattern", name: "weights row", t: pick(s.pattern), kind: "weights", maxW: 520, maxH: 20, describe: desc })),
      EX.el("p", { class: "hint", id: "kv-check", text: l === s.layer ? `equals the last row of a full forward without the cache (layer ${l}, every head): max |Δ| = ${s.full_max_diff.toExponential(2)}` : "" }));
  },
};
