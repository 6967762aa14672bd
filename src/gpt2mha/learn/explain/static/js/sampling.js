// gpt2mha explain: the sampling filters in the page, for an exported page (no server): the same
// steps as gpt2mha.inference.sampling.sample_next before its draw, on the last position's logits.
// logits - max, / temperature; top-k keeps the logits >= the k-th largest; top-p (OpenAI's
// top_p_logits) keeps those >= the last whose inclusive cumulative probability is <= p, at least
// one; temperature below float32's smallest normal number is greedy.
"use strict";

EX.MIN_TEMPERATURE = 1.1754943508222875e-38;

EX.softmax = function (x) {
  let m = -Infinity;
  for (const v of x) if (v > m) m = v;
  const out = new Float64Array(x.length);
  let s = 0;
  for (let i = 0; i < x.length; i++) { out[i] = x[i] === -Infinity ? 0 : Math.exp(x[i] - m); s += out[i]; }
  for (let i = 0; i < x.length; i++) out[i] /= s;
  return out;
};

// logits: Float32Array [n_vocab]; rows: [{id, label, ...}] (the most probable tokens, best first).
// Returns what the app's /api/sample answers (kv_steps.sampling_view).
EX.samplingView = function (logits, rows, t, k, p) {
  const V = logits.length;
  const pModel = EX.softmax(logits);
  let arg = 0;
  for (let i = 1; i < V; i++) if (logits[i] > logits[arg]) arg = i;
  const greedy = t < EX.MIN_TEMPERATURE;
  let pTemp, keptK, keptP, pFinal;
  if (greedy) {
    pTemp = new Float64Array(V); pTemp[arg] = 1;
    keptK = keptP = Array.from({ length: V }, (_, i) => i === arg);
    pFinal = pTemp;
  } else {
    const scaled = new Float64Array(V);
    for (let i = 0; i < V; i++) scaled[i] = (logits[i] - logits[arg]) / t;
    pTemp = EX.softmax(scaled);
    const desc = Array.from(scaled).sort((a, b) => b - a);
    const kth = k === 0 || k >= V ? -Infinity : desc[k - 1];
    keptK = Array.from(scaled, (v) => v >= kth);
    const afterK = scaled.map((v, i) => (keptK[i] ? v : -Infinity));
    let minKept = -Infinity;
    if (p < 1) {
      const sorted = Array.from(afterK).sort((a, b) => b - a);
      const probs = EX.softmax(sorted);
      let cum = 0, count = 0;
      for (const q of probs) { cum += q; if (cum <= p) count++; }
      minKept = sorted[Math.max(0, count - 1)];
    }
    keptP = Array.from(afterK, (v) => v !== -Infinity && v >= minKept);
    pFinal = EX.softmax(afterK.map((v, i) => (keptP[i] ? v : -Infinity)));
  }
  let removedK = 0, removedKMass = 0, removedP = 0, removedPMass = 0, kept = 0;
  for (let i = 0; i < V; i++) {
    if (!keptK[i]) { removedK++; removedKMass += pTemp[i]; } else if (!keptP[i]) { removedP++; removedPMass += pTemp[i]; }
    if (keptP[i]) kept++;
  }
  return { tokens: rows.map((r) => ({ id: r.id, label: r.label, p_model: pModel[r.id], p_temp: pTemp[r.id], kept_k: keptK[r.id],
    kept_p: keptP[r.id], p_final: pFinal[r.id] })), removed_k: removedK, removed_k_mass: removedKMass, removed_p: removedP,
  removed_p_mass: removedPMass, kept, vocab: V, greedy, temperature: t, top_k: k, top_p: p };
};
