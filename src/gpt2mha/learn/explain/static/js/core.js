// gpt2mha explain: what every view shares: the boot data, talking to the app (or reading an
// export's data files), decoding tensors, number formatting, small DOM helpers, errors.
"use strict";

const EX = {
  boot: JSON.parse(document.getElementById("boot").textContent),
  state: { layer: 0, head: 0, session: null, version: 0, T: 0, config: null, tab: "steps" },
  cache: new Map(),       // unit key -> answer (live: per session version)
  exported: {},           // export mode: unit key -> data, filled by data/*.js
  views: {},              // tab name -> { render() }
};
EX.live = EX.boot.mode === "live";

// Export data files call this (data/<key>.js holds EXPLAIN_PUT("<key>", {...})).
window.EXPLAIN_PUT = (key, value) => { EX.exported[key] = value; };

EX.el = function (tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c.nodeType ? c : String(c));
  return e;
};
EX.$ = (id) => document.getElementById(id);
// replaceChildren without the nulls (an optional part left out), which it would print as "null".
EX.put = (box, ...children) => box.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));

EX.showError = function (message) {
  const box = EX.$("error");
  if (!message) { box.hidden = true; box.textContent = ""; return; }
  box.hidden = false;
  box.textContent = message;
};

// The app's answers are JSON; a refusal or a bad request carries {"error": message}.
EX.api = async function (method, path, body) {
  const opts = { method, headers: { "X-Explain-Token": EX.boot.token } };
  if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
  let res;
  try { res = await fetch(path, opts); } catch (e) {
    throw new Error("the gpt2mha explain server cannot be reached (was it stopped?): " + e.message);
  }
  let data = null;
  try { data = await res.json(); } catch (e) { data = null; }
  if (!res.ok) throw new Error((data && data.error) || `the server answered ${res.status} ${res.statusText}`);
  return data;
};

EX.loadScript = (src) => new Promise((resolve, reject) => {
  const s = document.createElement("script");
  s.src = src;
  s.onload = resolve;
  s.onerror = () => reject(new Error(`this export has no ${src}`));
  document.head.append(s);
});

EX.unitKey = (kind, layer, head) =>
  kind === "layer" ? `layer_${layer}` : kind === "head" ? `head_${layer}_${head}` : kind;

// One view's numbers: from the app (live) or from the export's data files.
EX.unit = async function (kind, layer, head) {
  const key = EX.unitKey(kind, layer, head);
  if (!EX.live) {
    if (!(key in EX.exported)) await EX.loadScript(`data/${key}.js`);
    return EX.exported[key];
  }
  const ck = `${EX.state.session}:${EX.state.version}:${key}`;
  if (EX.cache.has(ck)) return EX.cache.get(ck);
  const q = new URLSearchParams({ session: EX.state.session, kind });
  if (layer !== undefined) q.set("layer", layer);
  if (head !== undefined) q.set("head", head);
  const p = EX.api("GET", "api/unit?" + q.toString());
  EX.cache.set(ck, p);
  try { return await p; } catch (e) { EX.cache.delete(ck); throw e; }
};

// Tensors arrive as {"shape": [...], "f32" | "u8": base64}; decoded once.
EX.b64 = function (s) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(s);          // native where the browser has it
  const bin = atob(s), n = bin.length, out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
  return out;
};
EX.tensor = function (enc) {
  if (!enc) return null;
  if (!enc._t) {
    const bytes = EX.b64(enc.f32 || enc.u8);
    enc._t = { shape: enc.shape, data: enc.f32 ? new Float32Array(bytes.buffer) : bytes };
  }
  return enc._t;
};

// float32's lowest value: what the model writes into masked scores (OpenAI's code: -1e10).
EX.MASKED = -1e30;
EX.isMasked = (v) => v <= EX.MASKED;
// Values are printed with 4 decimals (exponent form beyond 1e5); masked scores say so.
EX.fmt = function (v) {
  if (v === -Infinity) return "-inf";
  if (Number.isNaN(v)) return "NaN";
  if (EX.isMasked(v)) return "masked (float32's lowest; OpenAI's code: -1e10)";
  return Math.abs(v) >= 1e5 ? v.toExponential(4) : v.toFixed(4);
};
EX.pct = (p) => (100 * p).toFixed(2) + "%";
EX.shape = (dims) => "[" + dims.join(", ") + "]";

EX.setHover = function (text, ev) {
  EX.$("hover").textContent = text;
  const tip = EX.$("tip");
  if (ev) { tip.hidden = false; tip.textContent = text; tip.style.left = ev.clientX + 14 + "px"; tip.style.top = ev.clientY + 12 + "px"; }
};
EX.hideTip = () => { EX.$("tip").hidden = true; };

EX.labels = () => (EX.state.tokens || []).map((t) => t.label);

// Options <select> 0..n-1, current value kept when it still exists.
EX.fillSelect = function (sel, n, value, name) {
  sel.replaceChildren(...Array.from({ length: n }, (_, i) => EX.el("option", { value: i, text: `${name} ${i}` })));
  sel.value = Math.min(value, n - 1);
};

EX.needsServer = (what) => EX.el("div", { class: "needs" },
  `${what} needs the model: run `, EX.el("code", { text: "gpt2mha explain" }),
  " (this exported page holds one prompt's precomputed numbers and works without a server).");

// A view renders when its tab opens and again after the sequence changes.
EX.rendered = {};
EX.render = async function (tab) {
  const view = EX.views[tab];
  if (!view) return;
  const stamp = `${EX.state.session}:${EX.state.version}:${EX.state.layer}:${EX.state.head}`;
  if (EX.rendered[tab] === stamp && !view.always) return;
  EX.rendered[tab] = stamp;
  try {
    await view.render();
    document.body.dataset[tab] = stamp;     // what each view last finished drawing (tests, the benchmark)
    EX.showError(null);
  } catch (e) {
    EX.rendered[tab] = null;
    EX.showError(e.message);
  }
};

EX.select = function (layer, head) {
  EX.state.layer = layer;
  EX.state.head = head;
  EX.$("layer").value = layer;
  EX.$("head").value = head;
};
