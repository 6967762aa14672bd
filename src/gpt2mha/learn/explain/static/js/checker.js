// gpt2mha explain: "Check my attention": a learner's module checked stage by stage (gpt2mha check),
// in a subprocess of the app, with the reference's tensor and the module's side by side.
"use strict";

EX.EXAMPLES = [["ex-book", "the book's MultiHeadAttention", "book_mha.py"], ["ex-fused", "GPT-2's c_attn/c_proj layout", "gpt2_fused.py"],
  ["ex-wrong", "a deliberately wrong one", "wrong_scale.py"]];

EX.views.check = {
  built: false,

  async render() {
    const box = EX.$("check");
    if (!EX.live) { box.replaceChildren(EX.needsServer("Checking your attention module")); return; }
    if (this.built) return;
    const ck = EX.boot.checker;
    const note = ck.on
      ? EX.el("p", { class: "warn", id: "check-note" }, "Your code runs on this machine, in a separate process of gpt2mha explain, with your permissions: ",
        `a time limit of ${ck.timeout_s} s and a memory limit of ${ck.memory_mb} MB. The app listens on 127.0.0.1 only and takes code only from this page `,
        "(a per-launch token), so nothing else can run code through it. Run only code you trust.")
      : EX.el("p", { class: "warn", id: "check-note", text: `The checker is off: ${ck.note}` });
    const file = EX.el("input", { type: "file", id: "code-file", accept: ".py,text/x-python,text/plain" });
    file.addEventListener("change", async () => { if (file.files[0]) EX.$("code").value = await file.files[0].text(); });
    box.replaceChildren(
      EX.el("p", { class: "lead", text: "Paste a multi-head attention module (the book's MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads) " +
        "signature, GPT-2's c_attn/c_proj layout, q_proj/k_proj/v_proj, ...) or upload its file. The checker copies random reference weights in, " +
        "runs it and the reference on the same input and shows, stage by stage, where the numbers first differ." }),
      note,
      EX.el("div", { class: "controls" }, "Load an example:", EX.EXAMPLES.map(([id, label, f]) =>
        EX.el("button", { type: "button", id, onclick: () => this.example(f) }, label)), EX.el("label", {}, " or a file ", file)),
      EX.el("textarea", { id: "code", spellcheck: "false", placeholder: "class MultiHeadAttention(nn.Module): ..." }),
      EX.el("div", { class: "controls" }, EX.el("label", {}, "class ", EX.el("input", { id: "class-name", placeholder: "(found by name)", style: "width:16em" })),
        EX.el("button", { type: "button", id: "check-run", disabled: !ck.on, onclick: () => this.run() }, "Check"),
        EX.el("span", { class: "spin", id: "check-status" })),
      EX.el("div", { id: "check-result" }));
    this.built = true;
  },

  async example(file) {
    const res = await fetch("static/examples/" + file);
    EX.$("code").value = await res.text();
    EX.$("class-name").value = "";
  },

  async run() {
    const btn = EX.$("check-run"), status = EX.$("check-status");
    btn.disabled = true;
    status.textContent = "checking (a new Python process imports torch first)…";
    const t0 = performance.now();
    try {
      const r = await EX.api("POST", "api/check", { code: EX.$("code").value, class_name: EX.$("class-name").value || null });
      this.show(r);
      status.textContent = `done in ${((performance.now() - t0) / 1000).toFixed(1)} s`;
      EX.showError(null);
    } catch (e) {
      status.textContent = "";
      EX.$("check-result").replaceChildren();
      EX.showError(e.message);
    } finally {
      btn.disabled = false;
    }
  },

  show(r) {
    const box = EX.$("check-result");
    if (r.error) {
      EX.put(box, EX.el("p", { class: "verdict error", id: "check-verdict", text: `could not check: ${r.error}` }),
        r.output ? EX.el("pre", { class: "report", id: "check-output", text: r.output }) : null);
      return;
    }
    const rep = r.report, verdict = rep.verdict;
    const words = { match: "MATCH: it computes GPT-2's multi-head causal attention", mismatch: "MISMATCH: it runs, but the numbers differ",
      error: "COULD NOT RUN", match_without_cache: "MATCH WITHOUT CACHE: it matches; its cache could not be compared" };
    const first = rep.first_differing_stage;
    const tensors = r.tensors || {};
    const pane = EX.el("div", { id: "check-pane" });
    const rows = rep.stages.map((s) => {
      const same = s.found ? "same values" : "differ";
      const tr = EX.el("tr", { class: "clickable" + (s.stage === first ? " first" : ""), "data-stage": s.stage,
        onclick: () => this.pane(pane, s.stage, tensors[s.stage]) },
      EX.el("td", { text: s.stage }), EX.el("td", { class: "mono", text: s.expected ? EX.shape(s.expected) + (s.count > 1 ? " x" + s.count : "") : "-" }),
      EX.el("td", { class: "mono", text: s.seen ? EX.shape(s.seen) : "-" }),
      EX.el("td", { text: s.stage === first ? "first differing stage" : same }), EX.el("td", { class: "mono", text: s.where || "" }));
      return tr;
    });
    EX.put(box,
      EX.el("p", { class: "verdict " + (verdict.startsWith("match") ? "match" : verdict), id: "check-verdict", text: `${r.class}: ${words[verdict] || verdict}` }),
      rep.error ? EX.el("p", { class: "warn", id: "check-error", text: rep.error }) : null,
      rep.diagnosis_text.length ? EX.el("ul", { id: "check-diagnosis" }, rep.diagnosis_text.map((d) => EX.el("li", { text: d }))) : null,
      rows.length ? EX.el("table", { class: "t", id: "check-stages" }, EX.el("tr", {}, ["stage", "expected shape", "seen shape", "values", "where"].map((x) => EX.el("th", { text: x }))), rows) : null,
      rows.length ? EX.el("p", { class: "hint", text: "Click a stage to see the reference's tensor and yours side by side (batch 0, head 0)." }) : null,
      pane,
      EX.el("h3", { text: "The full report (gpt2mha check)" }), EX.el("pre", { class: "report", id: "check-text", text: r.text }),
      r.output ? EX.el("pre", { class: "report", id: "check-output", text: "your code printed:\n" + r.output }) : null);
    const start = first && tensors[first.split(" ")[0]] ? first.split(" ")[0] : "output";
    if (tensors[start]) this.pane(pane, start, tensors[start]);
  },

  pane(pane, stage, t) {
    if (!t) { pane.replaceChildren(EX.el("p", { class: "hint", text: `no tensors for ${stage}` })); return; }
    const exp = EX.tensor(t.expected), seen = EX.tensor(t.seen);
    let diff = "";
    if (seen && exp.shape.join() === seen.shape.join()) {
      let d = 0;
      for (let k = 0; k < exp.data.length; k++) {
        const a = exp.data[k], b = seen.data[k];
        if (a === b) continue;
        d = Math.max(d, Number.isFinite(a - b) ? Math.abs(a - b) : Infinity);
      }
      diff = `max |reference - yours| on what is shown: ${EX.fmt(d)}`;
    }
    const opts = { maxW: 440, maxH: 300, kind: stage === "weights" ? "weights" : "signed" };
    pane.replaceChildren(EX.el("h3", { id: "check-pane-title", text: `stage: ${stage}` }), EX.el("p", { class: "hint", text: diff }),
      EX.el("div", { class: "row" },
        EX.matrix(Object.assign({ id: "m-check-expected", name: "reference", t: exp, caption: `of ${EX.shape(t.expected_shape)}` }, opts)),
        seen ? EX.matrix(Object.assign({ id: "m-check-seen", name: "yours", t: seen, caption: `of ${EX.shape(t.seen_shape)}${t.where ? " (" + t.where + ")" : ""}` }, opts))
          : EX.el("p", { class: "hint", text: "no operation of your module plays this stage" })));
  },
};
