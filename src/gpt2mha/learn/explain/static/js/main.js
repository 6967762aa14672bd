// gpt2mha explain: start-up, tabs, the prompt form, the layer and head pickers.
"use strict";

EX.openTab = function (tab) {
  if (!EX.views[tab]) tab = "steps";
  EX.state.tab = tab;
  document.querySelectorAll("section.view").forEach((s) => { s.hidden = s.id !== "view-" + tab; });
  document.querySelectorAll("nav#tabs button").forEach((b) => b.classList.toggle("on", b.dataset.tab === tab));
  if (location.hash !== "#" + tab) history.replaceState(null, "", location.pathname + location.search + "#" + tab);
  return EX.render(tab);
};

// The sequence changed (a token was appended, or the prompt reset): every view refetches.
EX.afterChange = function () {
  for (const tab of Object.keys(EX.rendered)) if (tab !== EX.state.tab) EX.rendered[tab] = null;
  EX.summary();
};

EX.summary = function () {
  const c = EX.state.config;
  EX.$("summary").textContent = `${EX.state.model}: ${c.n_layer} layers × ${c.n_head} heads, n_embd ${c.n_embd}, head_dim ${c.head_dim}, ` +
    `n_ctx ${c.n_ctx}, vocabulary ${c.n_vocab} (${c.tokenizer}); ${EX.state.T} tokens` +
    (EX.state.T > EX.state.promptLen ? ` (${EX.state.T - EX.state.promptLen} generated)` : "");
};

// A sequence to show: {session, T, prompt_len, tokens, config, model} (the boot data, or a new prompt's).
EX.loadSequence = function (seq) {
  const config = seq.config;
  Object.assign(EX.state, { session: seq.session, config, model: seq.model, version: 0, tokens: seq.tokens, T: seq.T,
    promptLen: seq.prompt_len });
  EX.cache.clear();
  EX.rendered = {};
  EX.views.generate.built = false;
  EX.views.generate.last = null;
  const c = config;
  EX.fillSelect(EX.$("layer"), c.n_layer, Math.min(EX.state.layer, c.n_layer - 1), "layer");
  EX.fillSelect(EX.$("head"), c.n_head, Math.min(EX.state.head, c.n_head - 1), "head");
  EX.select(+EX.$("layer").value, +EX.$("head").value);
  EX.summary();
};

EX.start = async function () {
  const b = EX.boot;
  EX.$("mode").textContent = EX.live ? "live: 127.0.0.1" : "exported: precomputed, no server";
  EX.$("prompt").value = b.prompt || "";
  EX.$("model").value = b.model || "";
  if (!EX.live) {
    EX.$("prompt").readOnly = EX.$("model").readOnly = true;
    EX.$("run").disabled = true;
    EX.$("run").title = "a new prompt needs the model: run gpt2mha explain";
  }
  document.querySelectorAll("nav#tabs button").forEach((btn) => btn.addEventListener("click", () => EX.openTab(btn.dataset.tab)));
  const pick = () => {
    EX.select(+EX.$("layer").value, +EX.$("head").value);
    EX.render(EX.state.tab);
  };
  EX.$("layer").addEventListener("change", pick);
  EX.$("head").addEventListener("change", pick);
  EX.$("prompt-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (!EX.live) return;
    const btn = EX.$("run");
    btn.disabled = true;
    try {
      const r = await EX.api("POST", "api/session", { prompt: EX.$("prompt").value, model: EX.$("model").value.trim() || null });
      EX.loadSequence(r);
      EX.showError(null);
      await EX.openTab(EX.state.tab);
    } catch (e) {
      EX.showError(e.message);
    } finally {
      btn.disabled = false;
    }
  });
  EX.loadSequence(Object.assign({}, b, { session: EX.live ? b.session : "export" }));
  window.addEventListener("hashchange", () => EX.openTab(location.hash.slice(1)));
  await EX.openTab((location.hash || "#steps").slice(1));
  document.body.dataset.ready = "1";
};

EX.start();
