// gpt2mha explain: multi-head attention of one layer, step by step, with the model's tensors
// (capture points of run_with_cache), for the chosen head. Shapes are printed at every arrow.
"use strict";

EX.arrow = (...parts) => EX.el("div", { class: "arrow" }, ...parts);

EX.tokenDescriber = function (what) {
  const labels = EX.labels();
  const lab = (i) => JSON.stringify(labels[i] === undefined ? "" : labels[i]);
  if (what === "rows") return (i) => `token ${i} ${lab(i)}`;
  return (i, j) => `query ${i} ${lab(i)} -> key ${j} ${lab(j)}`;
};

// A demo of attention_mask(nd, ns) with a past: the same formula OpenAI's code uses,
// m[i, j] = i >= j - ns + nd, for nd new tokens after ns - nd cached ones.
EX.pastMask = function (nd, ns) {
  const data = new Float32Array(nd * ns);
  for (let i = 0; i < nd; i++) for (let j = 0; j < ns; j++) data[i * ns + j] = i >= j - ns + nd ? 1 : 0;
  return { shape: [nd, ns], data };
};

// The masked scores (hook_attn_scores): the scores where the mask is 1, float32's lowest value elsewhere.
EX.masked = function (scores, mask) {
  const data = new Float32Array(scores.data.length);
  for (let k = 0; k < data.length; k++) data[k] = mask.data[k] > 0.5 ? scores.data[k] : -3.4028234663852886e38;
  return { shape: scores.shape, data };
};

EX.views.steps = {
  async render() {
    const L = EX.state.layer, h = EX.state.head, c = EX.state.config;
    const box = EX.$("steps");
    const t0 = performance.now();
    const [lu, hu] = await Promise.all([EX.unit("layer", L), EX.unit("head", L, h)]);
    const t1 = performance.now();
    const T = lu.T, C = c.n_embd, hd = c.head_dim, H = c.n_head;
    const tk = (enc) => EX.tensor(enc);
    const rowDesc = EX.tokenDescriber("rows"), pairDesc = EX.tokenDescriber("pairs");
    const rowsOnly = (i) => rowDesc(i);
    const m = (id, name, enc, extra) => EX.matrix(Object.assign({ id: "m-" + id, name, t: tk(enc), describe: rowsOnly, maxH: 240 }, extra));
    const labels = EX.labels();
    const sq = { square: true, maxW: 400, maxH: 400, describe: pairDesc, axes: { rows: labels, cols: labels } };
    const sqrt = Math.sqrt(hd);
    const sl = (base) => `${base + h * hd}:${base + (h + 1) * hd}`;
    const kids = [
      EX.el("p", { class: "lead" }, `Block ${L}'s attention sublayer on the ${T} tokens, head ${h} of ${H} highlighted. `,
        `Sizes: T = ${T}, n_embd = ${C}, n_head = ${H}, head_dim = n_embd / n_head = ${hd}. Every number is the model's `,
        `(capture points `, EX.el("code", { text: `blocks.${L}.attn.hook_q/k/v/attn_scores/pattern/z` }), ", ",
        EX.el("code", { text: `blocks.${L}.ln1.hook_out` }), `, `, EX.el("code", { text: "hook_attn_out" }), `, the residual stream); `,
        "hover a cell to read it."),
      m("resid_pre", "x_in", lu.resid_pre, { caption: `the residual stream entering block ${L}: [T, n_embd]` }),
      EX.arrow(`x = ln_1(x_in)   [T, n_embd] = ${EX.shape([T, C])}`),
      m("x", "x", lu.x, { caption: "after ln_1: what attention reads" }),
      EX.arrow(`qkv = x @ c_attn.weight + c_attn.bias   [T, n_embd] @ [n_embd, 3·n_embd] + [3·n_embd] -> [T, 3·n_embd] = `,
        `${EX.shape([T, C])} @ ${EX.shape([C, 3 * C])} -> ${EX.shape([T, 3 * C])}`),
      m("qkv", "qkv", lu.qkv, { marks: [C, 2 * C], maxW: 940,
        bands: [0, C, 2 * C].map((b) => ({ c0: b + h * hd, c1: b + (h + 1) * hd })),
        describe: (i, j) => `${rowDesc(i)}; column ${j}: ${["q", "k", "v"][Math.floor(j / C)]} block, head ${Math.floor((j % C) / hd)}`,
        caption: [`three column blocks, not per-head chunks: all q at 0, all k at n_embd = ${C}, all v at 2·n_embd = ${2 * C} `,
          `(black lines); head ${h}'s slices outlined: q ${sl(0)}, k ${sl(C)}, v ${sl(2 * C)}`] }),
      EX.arrow(`head ${h}: q_h = qkv[:, ${sl(0)}], k_h = qkv[:, ${sl(C)}], v_h = qkv[:, ${sl(2 * C)}]   each [T, head_dim] = ${EX.shape([T, hd])}`),
      EX.el("div", { class: "row" },
        m("q", "q_h", hu.q, { maxW: 300 }), m("k", "k_h", hu.k, { maxW: 300 }), m("v", "v_h", hu.v, { maxW: 300 })),
      EX.arrow(`scores = q_h @ k_hᵀ / √head_dim   [T, head_dim] @ [head_dim, T] -> [T, T] = ${EX.shape([T, T])};  `,
        `√${hd} = ${sqrt.toFixed(4)} (the scores are scaled, not q or k)`),
      EX.el("div", { class: "row" },
        m("scores", "scores", hu.scores, Object.assign({ caption: "every query · every key, before the mask" }, sq)),
        m("mask", "mask", lu.mask, Object.assign({ kind: "mask",
          caption: [`attention_mask(nd=${T}, ns=${T}): m[i, j] = i >= j - ns + nd (1 = may attend)`] }, sq)),
        EX.matrix(Object.assign({ id: "m-masked", name: "masked", t: EX.masked(tk(hu.scores), tk(lu.mask)),
          describe: pairDesc, caption: "where(m, scores, -1e10): the future is masked (grey)" }, sq))),
      EX.arrow(`A = softmax(masked) over each row (the keys)   [T, T] = ${EX.shape([T, T])}; masked keys get exactly 0`),
      EX.el("div", { class: "row" },
        m("pattern", "A", hu.pattern, Object.assign({ kind: "weights", caption: "the attention pattern (hook_pattern)" }, sq)),
        m("rowsum", "row sums", hu.rowsum, { column: true, maxH: 400, kind: "weights",
          caption: ["Σ_j A[i, j] = 1"], describe: rowsOnly })),
      EX.arrow(`z_h = A @ v_h   [T, T] @ [T, head_dim] -> [T, head_dim] = ${EX.shape([T, hd])}`),
      m("z", "z_h", hu.z, { maxW: 300, caption: "each query's weighted sum of the values (hook_z)" }),
      EX.arrow(`concat the ${H} heads: head h at columns h·head_dim:(h+1)·head_dim -> [T, n_embd] = ${EX.shape([T, C])}`),
      m("concat", "concat", lu.concat, { bands: [{ c0: h * hd, c1: (h + 1) * hd }],
        describe: (i, j) => `${rowDesc(i)}; column ${j}: head ${Math.floor(j / hd)}`,
        caption: `head ${h} at columns ${h * hd}:${(h + 1) * hd} (outlined)` }),
      EX.arrow(`attn_out = concat @ c_proj.weight + c_proj.bias   [T, n_embd] @ [n_embd, n_embd] -> [T, n_embd] = ${EX.shape([T, C])}`),
      m("attn_out", "attn_out", lu.attn_out, { caption: "c_proj mixes the heads (hook_attn_out)" }),
      EX.arrow(`x_mid = x_in + attn_out   the residual add, [T, n_embd] = ${EX.shape([T, C])} (then ln_2, the MLP and its residual add)`),
      m("resid_mid", "x_mid", lu.resid_mid, { caption: "hook_resid_mid" }),
      EX.views.steps.pastDemo(T),
    ];
    box.replaceChildren(...kids);
    EX.painted = performance.now();
    EX.timing = { fetch: t1 - t0, draw: EX.painted - t1 };
    EX.$("steps-note").textContent = `fetched in ${EX.timing.fetch.toFixed(0)} ms, drawn in ${EX.timing.draw.toFixed(0)} ms`;
  },

  // The mask with a cache: nd new queries after a past of P tokens read every cached key.
  pastDemo(T) {
    const nd = Math.min(T, 6);
    const wrap = EX.el("div", {});
    const slider = EX.el("input", { type: "range", min: 0, max: 8, value: 3, id: "past-len" });
    const shown = EX.el("output", { id: "past-len-value", for: "past-len", class: "mono" });
    const draw = () => {
      const P = +slider.value, ns = nd + P;
      shown.textContent = `P = ${P}`;
      wrap.replaceChildren(EX.matrix({ id: "m-pastmask", name: "attention_mask", t: EX.pastMask(nd, ns), kind: "mask",
        square: true, maxW: 320, maxH: 200, caption: [`(nd=${nd}, ns=${ns}): with a past of ${P} cached tokens the mask is `,
          "aligned bottom-right: query i sees every cached key and the new ones up to itself"],
        describe: (i, j) => `query ${i} (position ${P + i}) -> key ${j}${j < P ? " (cached)" : ""}` }));
    };
    slider.addEventListener("input", draw);
    draw();
    return EX.el("div", {}, EX.el("h3", { text: "The mask with a KV cache" }),
      EX.el("label", { class: "hint" }, "past tokens P ", slider, " ", shown), wrap,
      EX.el("p", { class: "hint", text: "Tab 4 runs real decode steps: one query (nd = 1) over the whole cache (ns = T + 1)." }));
  },
};
