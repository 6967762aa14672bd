// gpt2mha explain: the whole model at a glance: tokens, embeddings, blocks, ln_f, LM head, next token.
"use strict";

EX.tokenChips = function (tokens, promptLen) {
  return EX.el("div", { class: "tokens", id: "token-chips" }, tokens.map((t, i) =>
    EX.el("span", { class: "tok" + (promptLen !== undefined && i >= promptLen ? " gen" : ""),
      title: `position ${i}, id ${t.id}, bytes ${t.bytes}` }, t.label, EX.el("small", { text: String(t.id) }))));
};

EX.distBars = function (rows, key, id) {
  const top = Math.max(...rows.map((r) => r[key]), 1e-9);
  return EX.el("table", { class: "t", id }, EX.el("tr", {}, EX.el("th", { text: "token" }), EX.el("th", { text: "id" }),
    EX.el("th", { text: "probability" }), EX.el("th", {})),
  rows.map((r) => EX.el("tr", {}, EX.el("td", { class: "mono", text: JSON.stringify(r.label) }),
    EX.el("td", { class: "num", text: String(r.id) }), EX.el("td", { class: "num", text: r[key].toFixed(4) }),
    EX.el("td", {}, EX.el("span", { class: "bar", style: `width:${Math.round(240 * r[key] / top)}px` })))));
};

EX.views.pipeline = {
  async render() {
    const u = await EX.unit("pipeline");
    const c = u.config, T = u.T;
    const tok = c.tokenizer === "bytes" ? "one token per UTF-8 byte (ids 0-255)" : "GPT-2's byte-level BPE (50257 ids)";
    const m = (id, name, enc, caption) => EX.matrix({ id: "m-" + id, name, t: EX.tensor(enc), caption, maxW: 600, maxH: 200,
      describe: (i) => `token ${i} ${JSON.stringify(u.tokens[i] ? u.tokens[i].label : "")}` });
    const blocks = Array.from({ length: c.n_layer }, (_, l) => EX.el("div", { class: "block", id: `block-${l}`,
      title: `open block ${l}'s attention`, onclick: () => { EX.select(l, EX.state.head); EX.openTab("steps"); } },
    EX.el("b", { text: `block ${l}` }), EX.el("br"), `x + attn(ln_1(x)) (${c.n_head} heads)`, EX.el("br"), "x + mlp(ln_2(x))"));
    EX.$("pipeline").replaceChildren(
      EX.el("h3", { text: `1. Tokens: ${T} (${tok})` }),
      EX.tokenChips(u.tokens, u.prompt_len),
      EX.el("p", { class: "hint", text: "Each chip: the text piece (space ␣, newline ↵), its id below; hover it for its bytes." }),
      EX.arrow(`ids [T] = [${T}]`),
      EX.el("h3", { text: "2. Embeddings" }),
      EX.el("div", { class: "row" },
        m("embed", "wte[ids]", u.embed, `token embedding, [T, n_embd] = ${EX.shape([T, c.n_embd])}`),
        m("pos", "wpe[0..T-1]", u.pos, "position embedding, same shape")),
      EX.arrow(`h0 = wte[ids] + wpe[positions]   [T, n_embd] = ${EX.shape([T, c.n_embd])}`),
      m("h0", "h0", u.h0, "block 0's input"),
      EX.arrow(`${c.n_layer} blocks, each [T, n_embd] -> [T, n_embd]; click one to open its attention`),
      EX.el("div", { class: "blocks" }, blocks),
      EX.arrow(`ln_f   [T, n_embd] = ${EX.shape([T, c.n_embd])}`),
      m("ln_f", "ln_f(h)", u.ln_f, "the last stream, normalised"),
      EX.arrow(`logits = ln_f(h) @ wteᵀ   [T, n_embd] @ [n_embd, n_vocab] -> [T, n_vocab] = ${EX.shape([T, c.n_vocab])}; `,
        "softmax of the last row:"),
      EX.el("h3", { text: "3. The next-token distribution (last position)" }),
      EX.distBars(u.next, "p", "next-dist"));
  },
};
