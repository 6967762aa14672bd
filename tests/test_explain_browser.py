"""gpt2mha explain in a real browser: headless Chromium (Debian's chromium and chromium-driver)
driven by Selenium, with every request to anything but 127.0.0.1 blocked (the page must render
offline). The tests use the page as a learner does (pick a layer and head, hover cells, move a
slider, step a token, ablate, run the checker) and compare every number read off the page with
the Python API's (run_with_cache, the sampling filters, ablate_heads, logit_lens, the checker's
stages) to the precision the page prints.

Set GPT2MHA_SCREENSHOT_DIR to keep one screenshot of each view (the README's pictures).
"""

import os
import re
import shutil
import time

import pytest
import torch

from gpt2mha import DEFAULT_MODEL, GPT2
from gpt2mha.io.checkpoints import builtin_models
from gpt2mha.learn.explain.app import Explain, serve_in_thread
from gpt2mha.learn.explain.checker import CheckLimits
from gpt2mha.learn.explain.session import ModelEntry, Sequence

from conftest import small_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

if os.environ.get("GPT2MHA_REQUIRE_BROWSER") and not (CHROMIUM and CHROMEDRIVER):    # set by .ci/run: CI must run it
    raise RuntimeError("GPT2MHA_REQUIRE_BROWSER is set but chromium/chromedriver are not on PATH")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="headless Chromium is not installed here (Debian packages chromium and chromium-driver: "
                              "apt-get install -y chromium chromium-driver; .ci/run installs them for CI)"),
]

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "src", "gpt2mha", "learn", "explain", "static", "examples")
WAIT_S = 60


@pytest.fixture(scope="module")
def model():
    if DEFAULT_MODEL in builtin_models():
        return GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return small_model(n_vocab=256, n_ctx=96, tokenizer="bytes")


@pytest.fixture(scope="module")
def state(model):
    name = DEFAULT_MODEL if DEFAULT_MODEL in builtin_models() else "random test model"
    state = Explain(ModelEntry(model, name), PROMPT, limits=CheckLimits(), load=GPT2.from_pretrained)
    state.warm()
    return state


@pytest.fixture(scope="module")
def server(state):
    with serve_in_thread(state) as urls:
        yield urls


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1800",
                "--allow-file-access-from-files",
                # offline: no name resolves but 127.0.0.1, and anything not on loopback goes to a closed port
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--proxy-server=http://127.0.0.1:9"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)   # no driver download
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    # the harness really is offline: a page with no policy of its own cannot reach the network
    driver.get("data:text/html,<title>offline</title>")
    reached = driver.execute_async_script("const done = arguments[0]; fetch('http://example.com/', {mode: 'no-cors'})"
                                          ".then(() => done('reached'), () => done('failed'))")
    assert reached == "failed"
    driver.get_log("browser")
    yield driver
    driver.quit()


def wait(driver, script: str, timeout: float = WAIT_S):
    """The value of ``script`` (JavaScript returning something) once it is truthy; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        if time.monotonic() > deadline:
            box = driver.execute_script("return EX.$('error').textContent")
            raise AssertionError(f"timed out after {timeout} s waiting for: {script}\npage error box: {box}")
        time.sleep(0.05)


def severe(driver, answered_400=False):
    """The console's errors; ``answered_400``: the test sent bad input on purpose (the browser logs
    the 400 the app answered it with)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
            and not (answered_400 and e["source"] == "network" and "status of 400" in e["message"])]


def open_page(driver, url):
    driver.get(url)
    wait(driver, "return document.body.dataset.ready === '1'")
    assert severe(driver) == []


def tab(driver, name: str):
    driver.find_element("css selector", f"nav#tabs button[data-tab={name}]").click()
    return wait(driver, f"return document.body.dataset.{name}")


def shot(driver, name: str, anchor: str | None = None):
    """With GPT2MHA_SCREENSHOT_DIR set: the window as it is (scrolled to ``anchor``'s element, else
    the top) saved there as ``explain_NAME.png`` in 256 colours."""
    directory = os.environ.get("GPT2MHA_SCREENSHOT_DIR")
    if not directory:
        return
    from PIL import Image

    if anchor:
        driver.execute_script("EX.$(arguments[0]).scrollIntoView({block: 'start'}); window.scrollBy(0, -90)", anchor)
    else:
        driver.execute_script("window.scrollTo(0, 0)")
    path = os.path.join(directory, f"explain_{name}.png")
    driver.save_screenshot(path)
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def hover(driver, canvas_id: str, i: int, j: int) -> str:
    """Move the mouse over cell (i, j) of a drawn matrix; returns the hover line."""
    from selenium.webdriver import ActionChains

    cv = driver.find_element("id", canvas_id)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", cv)
    cw, ch, w, h = driver.execute_script("const c = arguments[0]; return [+c.dataset.cw, +c.dataset.ch, c.width, c.height]", cv)
    ActionChains(driver).move_to_element_with_offset(cv, (j + 0.5) * cw - w / 2, (i + 0.5) * ch - h / 2).perform()
    text = driver.find_element("id", "hover").text
    assert text.startswith(f"{driver.execute_script('return arguments[0].dataset.name', cv)}[{i}, {j}] = "), text
    return text


def printed(text: str) -> float:
    return float(re.search(r"\] = (-?[0-9.]+(?:e[+-]?\d+)?)", text).group(1))


def same_as_printed(text: str, value: float) -> bool:
    """Whether the number after ``= `` in ``text`` is ``value`` to the decimals printed."""
    s = re.search(r"\] = (-?[0-9.]+)(e[+-]?\d+)?", text)
    digits = len(s.group(1).split(".")[1]) if "." in s.group(1) else 0
    step = 10.0 ** (-digits) * (10.0 ** int(s.group(2)[1:]) if s.group(2) else 1.0)
    return abs(printed(text) - value) <= 0.5 * step * (1 + 1e-6) + 1e-12


def test_offline_page_steps_and_pipeline_numbers(browser, server, model):
    base, page = server
    open_page(browser, page)
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "layer")).select_by_value("2")
    Select(browser.find_element("id", "head")).select_by_value("3")
    wait(browser, "return (document.body.dataset.steps || '').endsWith(':2:3')")
    assert severe(browser) == []
    c = model.config
    L, h, C, hd = 2, 3, c.n_embd, c.head_dim
    idx = torch.tensor([list(PROMPT.encode())])
    T = idx.shape[1]
    from gpt2mha.learn.explain.tensors import LAYER_POINTS
    _, cache = model.run_with_cache(idx, [f"blocks.{L}.{p}" for p in LAYER_POINTS])
    q, k = cache["q", L][0, :, h], cache["k", L][0, :, h]
    pattern = cache["pattern", L][0, h]
    j_max = int(pattern[T - 1].argmax())
    checks = [
        ("m-x", 5, 7, float(cache[f"blocks.{L}.ln1.hook_out"][0, 5, 7])),
        ("m-qkv", 4, C + h * hd + 2, float(k[4, 2])),                              # k block, head h's slice
        ("m-q", 9, 1, float(q[9, 1])),
        ("m-scores", 6, 2, float(cache["attn_scores", L][0, h, 6, 2])),
        ("m-scores", 2, 6, float(q[2] @ k[6] / hd ** 0.5)),                        # above the diagonal: before the mask
        ("m-masked", 6, 2, float(cache["attn_scores", L][0, h, 6, 2])),
        ("m-mask", 6, 2, 1.0), ("m-mask", 2, 6, 0.0),
        ("m-pattern", T - 1, j_max, float(pattern[T - 1, j_max])),
        ("m-pattern", 2, 6, 0.0),
        ("m-rowsum", 3, 0, 1.0),
        ("m-z", 3, 5, float(cache["z", L][0, 3, h, 5])),
        ("m-concat", 4, h * hd + 1, float(cache["z", L][0, 4, h, 1])),
        ("m-attn_out", 4, 9, float(cache["attn_out", L][0, 4, 9])),
        ("m-resid_mid", 4, 9, float(cache["resid_mid", L][0, 4, 9])),
    ]
    for canvas, i, j, want in checks:
        text = hover(browser, canvas, i, j)
        assert same_as_printed(text, want), (canvas, i, j, text, want)
    assert "masked" in hover(browser, "m-masked", 2, 6)
    captions = browser.execute_script("return Array.from(document.querySelectorAll('#steps figcaption')).map(f => f.textContent)")
    assert any(f"qkv [{T}, {3 * C}]" in t for t in captions) and any(f"A [{T}, {T}]" in t for t in captions)
    arrows = browser.execute_script("return Array.from(document.querySelectorAll('#steps .arrow')).map(a => a.textContent)")
    assert any(f"[{T}, {C}] @ [{C}, {3 * C}] -> [{T}, {3 * C}]" in a for a in arrows)
    hover(browser, "m-pattern", T - 1, j_max)
    shot(browser, "steps", "m-qkv-fig")
    # the pipeline: tokens and embeddings
    tab(browser, "pipeline")
    chips = browser.execute_script("return Array.from(document.querySelectorAll('#token-chips .tok small')).map(s => +s.textContent)")
    assert chips == idx[0].tolist()
    assert same_as_printed(hover(browser, "m-embed", 3, 11), float(model.wte.weight[idx[0, 3], 11].detach()))
    assert same_as_printed(hover(browser, "m-pos", 3, 11), float(model.wpe.weight[3, 11].detach()))
    browser.find_element("id", "block-1").click()                      # a block opens its attention
    wait(browser, "return EX.state.tab === 'steps' && (document.body.dataset.steps || '').endsWith(':1:3')")
    tab(browser, "pipeline")
    shot(browser, "pipeline")
    hosts = browser.execute_script("return performance.getEntriesByType('resource').map(e => new URL(e.name).host)")
    assert hosts and all(x.startswith("127.0.0.1:") for x in hosts)
    assert severe(browser) == []


def test_attention_matrices_label_their_axes_and_the_past_slider_shows_its_value(browser, server, state):
    """Every token-by-token matrix (scores, mask, masked, A, the heads view's enlarged head) has the
    tokens' labels down its left and along its top, each at its row's or column's centre (the
    labels are token_pieces', the Python side's); the KV-cache mask has them along its top; the
    past-tokens slider prints its value as it moves."""
    from selenium.webdriver.common.keys import Keys

    from gpt2mha.learn.explain.tensors import token_pieces

    open_page(browser, server[1])
    wait(browser, "return document.body.dataset.steps")
    labels = [p["label"] for p in token_pieces(state.entry.tok, state.pristine.ids)]
    T = len(labels)

    def axes(mid):
        return browser.execute_script("""const m = EX.$(arguments[0]), r = EX.$(arguments[0] + '-rows'), c = EX.$(arguments[0] + '-cols');
            if (!r || !c) return null;
            const box = (e) => e.getBoundingClientRect(), ink = (e) => { const d = e.getContext('2d').getImageData(0, 0, e.width, e.height).data;
              let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; };
            return {rows: JSON.parse(r.dataset.labels), cols: JSON.parse(c.dataset.labels), step: +r.dataset.step, ch: +m.dataset.ch,
                    ink: [ink(r), ink(c)], top: [box(r).top, box(m).top], bottom: [box(r).bottom, box(m).bottom],
                    left: [box(c).left, box(m).left], above: [box(c).bottom, box(m).top], beside: [box(r).right, box(m).left]};""", mid)

    for mid in ("m-scores", "m-mask", "m-masked", "m-pattern"):
        a = axes(mid)
        assert a is not None, mid
        want = [[i, f"{labels[i]} {i}"] for i in range(0, T, a["step"])]
        assert a["rows"] == want and a["cols"] == want, (mid, a["rows"][:3])
        assert a["step"] == -(-9 // a["ch"]) and min(a["ink"]) > 50               # drawn, every ceil(9 px / cell)-th
        assert a["top"][0] == pytest.approx(a["top"][1], abs=1) and a["bottom"][0] == pytest.approx(a["bottom"][1], abs=1)
        assert a["left"][0] == pytest.approx(a["left"][1], abs=1)
        assert a["above"][0] == pytest.approx(a["above"][1], abs=1) and a["beside"][0] == pytest.approx(a["beside"][1], abs=1)
    value = browser.find_element("id", "past-len-value")
    assert value.text == "P = 3"
    browser.find_element("id", "past-len").send_keys(Keys.ARROW_RIGHT)
    assert value.text == "P = 4"
    assert browser.execute_script("return EX.$('m-pastmask').dataset.cols") == str(min(T, 6) + 4)
    tab(browser, "heads")
    wait(browser, "return EX.$('m-big')")
    a = axes("m-big")
    assert a is not None and a["rows"] == [[i, f"{labels[i]} {i}"] for i in range(0, T, a["step"])]
    assert browser.find_element("id", "thumb-legend").text.endswith("one pixel per cell")
    tab(browser, "generate")
    browser.find_element("id", "next").click()
    wait(browser, "return EX.$('m-kvmask-cols')")
    kv = browser.execute_script("return JSON.parse(EX.$('m-kvmask-cols').dataset.labels)")
    assert kv[0] == [0, f"{labels[0]} 0"] and kv[-1][0] >= T - 9
    browser.find_element("id", "reset").click()
    wait(browser, f"return document.querySelectorAll('#gen-tokens .tok').length === {T}")
    assert severe(browser) == []


def test_heads_legend_says_the_pooling_on_a_long_prompt(browser, server, model):
    """A prompt longer than a small map (THUMB = 64 cells): the legend says each pixel is the
    largest weight of its block, and the brightest pixel of every map is as bright as its head's
    largest weight (each row of a pattern sums to 1: some weight is at least 1/T, and the first
    query's is 1)."""
    n = min(model.config.n_ctx, 200)
    open_page(browser, server[1])
    browser.execute_script("EX.$('prompt').value = arguments[0]; EX.$('model').value = ''", "ROMEO: " * (n // 7))
    browser.find_element("id", "run").click()
    wait(browser, f"return EX.state.T === {n // 7 * 7} && document.body.dataset.steps")
    tab(browser, "heads")
    legend = wait(browser, "return EX.$('thumb-legend') && EX.$('thumb-legend').textContent")
    T = n // 7 * 7
    assert legend.endswith(f"each pixel the largest weight of its block of about {T / 64:.1f}² cells (max pooling)"), legend
    brightest = browser.execute_script("""return Array.from(document.querySelectorAll('#heads-grid canvas')).map(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let m = 0;
        for (let i = 1; i < d.length; i += 4) m = Math.max(m, d[i]); return m; })""")
    assert min(brightest) >= 230                          # green channel: 1 + 230·v, the top-left cell's v = 1
    assert severe(browser) == []


def test_heads_grid_big_view_lines_and_roles(browser, server, model):
    from gpt2mha.learn.heads import analyse_heads

    open_page(browser, server[1])
    tab(browser, "heads")
    c = model.config
    ids = browser.execute_script("return Array.from(document.querySelectorAll('#heads-grid canvas')).map(c => c.id)")
    assert ids == [f"L{l}H{h}" for l in range(c.n_layer) for h in range(c.n_head)]
    drawn = browser.execute_script("""return Array.from(document.querySelectorAll('#heads-grid canvas')).map(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0) n++; return n / (d.length / 4); })""")
    assert min(drawn) > 0.99
    browser.find_element("id", "L1H2").click()
    wait(browser, "return EX.$('sel') && EX.$('sel').textContent === 'layer 1 head 2'")
    ref = analyse_heads(model, PROMPT)
    w = ref.weights[1, 0, 2]
    T = w.shape[0]
    j = int(w[T - 1].argmax())
    assert same_as_printed(hover(browser, "m-big", T - 1, j), float(w[T - 1, j]))
    role = next(r for r in ref.roles if (r["layer"], r["head"]) == (1, 2))
    assert browser.find_element("id", "sel-role").text == f"role: {role['role']} (score {role['score']:.2f})"
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#roles-table tr')).slice(1).map(r => "
                                  "Array.from(r.children).slice(0, 4).map(td => td.textContent))")
    best = sorted(ref.roles, key=lambda r: -r["score"])
    assert len(rows) == c.n_layer * c.n_head
    assert rows[0] == [str(best[0]["layer"]), str(best[0]["head"]), best[0]["role"], f"{best[0]['score']:.2f}"]
    inked = browser.execute_script("""const c = EX.$('lines'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;""")
    assert inked > 1000
    shot(browser, "heads")
    assert severe(browser) == []


def test_sampling_sliders_next_token_and_kv_cache(browser, server, model, state):
    from selenium.webdriver.common.keys import Keys

    from gpt2mha.learn.explain.kv_steps import filtered

    open_page(browser, server[1])
    tab(browser, "generate")
    wait(browser, "return EX.$('dist-table')")
    slider = browser.find_element("id", "temperature")
    for _ in range(4):                                               # 1.0 -> 0.8, one step at a time
        slider.send_keys(Keys.ARROW_LEFT)
    k_slider = browser.find_element("id", "top_k")
    for _ in range(5):                                               # 0 -> 5
        k_slider.send_keys(Keys.ARROW_RIGHT)
    wait(browser, "const t = EX.$('dist-table'); return t && t.dataset.temperature === '0.8' && t.dataset.topK === '5'")
    seq = Sequence(state.entry, list(PROMPT.encode()))
    p_temp, after_k, _, p_final = filtered(seq.logits()[-1], 0.8, 5, 1.0)
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#dist-table tr')).slice(1).map(r => "
                                  "[+r.dataset.id, r.children[3].textContent, r.children[5].textContent, r.children[6].textContent])")
    assert len(rows) == 30
    for tid, temp, status, final in rows:
        assert abs(float(temp) - float(p_temp[tid])) <= 0.5e-4 + 1e-7
        assert abs(float(final) - float(p_final[tid])) <= 0.5e-4 + 1e-7
        assert status == ("kept" if torch.isfinite(after_k[tid]) else "removed by top-k")
    assert [s for _, _, s, _ in rows].count("kept") == 5
    # one step: the token Python draws with the same seed and filters, the cache one longer
    T = len(seq.ids)
    browser.find_element("id", "next").click()
    wait(browser, "return EX.$('drawn').textContent.length > 0 && EX.$('kv-row').querySelector('canvas')")
    step = seq.step(0.8, 5, 1.0, seed=1, layer=0)
    chips = browser.execute_script("return Array.from(document.querySelectorAll('#gen-tokens .tok small')).map(s => +s.textContent)")
    assert chips == seq.ids
    c = model.config
    assert f"[1, {c.n_layer}, 2, {c.n_head}, {T + 1}, {c.head_dim}]" in browser.find_element("id", "past-now").text
    assert f"[1, {c.n_layer}, 2, {c.n_head}, {T}, {c.head_dim}] -> [1, {c.n_layer}, 2, {c.n_head}, {T + 1}, {c.head_dim}]" \
        in browser.find_element("id", "past-history").text
    from gpt2mha.learn.explain.tensors import decode
    row = decode(step["pattern"])[0, 0]                              # layer 0, head 0: the selects' default
    assert row.shape[0] == T + 1
    for j in (0, T // 2, T):
        assert same_as_printed(hover(browser, "m-kvpattern", 0, j), float(row[j]))
    assert same_as_printed(hover(browser, "m-kvmask", 0, T), 1.0)
    shot(browser, "generate")
    browser.find_element("id", "reset").click()
    wait(browser, f"return document.querySelectorAll('#gen-tokens .tok').length === {T}")
    assert severe(browser) == []


def test_ablate_a_head_and_the_logit_lens(browser, server, model):
    from gpt2mha.learn.interventions import ablate_heads, logit_lens, next_token_shift

    open_page(browser, server[1])
    tab(browser, "intervene")
    browser.find_element("id", "ab-0-1").click()
    browser.find_element("id", "ab-1-0").click()
    browser.find_element("id", "ab-mean").click()
    browser.find_element("id", "ab-run").click()
    wait(browser, "return EX.$('ab-table')")
    idx = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        ref = next_token_shift(model(idx).logits[0, -1], ablate_heads(model, idx, [(0, 1), (1, 0)], mean=True)[0, -1], top=10)
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#ab-table tr')).slice(1).map(r => "
                                  "[+r.dataset.id, +r.children[2].textContent, +r.children[4].textContent])")
    assert [r[0] for r in rows] == [t["id"] for t in ref["tokens"]]
    for (_, before, after), t in zip(rows, ref["tokens"]):
        assert abs(before - t["before"]) <= 0.5e-4 + 1e-7 and abs(after - t["after"]) <= 0.5e-4 + 1e-7
    assert f"KL(before ‖ after) = {ref['kl']:.4f}" in browser.find_element("id", "ab-summary").text
    lens = logit_lens(model, idx, top_k=3)
    T = idx.shape[1]
    assert same_as_printed(hover(browser, "m-lens", 2, T - 1), float(lens.probs[2, 0, T - 1, 0]))
    shot(browser, "intervene")
    assert severe(browser) == []


def _set_code(driver, code: str):
    driver.execute_script("EX.$('code').value = arguments[0]", code)


def _check(driver, timeout=180):
    driver.execute_script("EX.$('check-result').replaceChildren(); EX.showError(null)")
    driver.find_element("id", "check-run").click()
    return wait(driver, "return (EX.$('check-verdict') && EX.$('check-verdict').textContent) || "
                        "(!EX.$('error').hidden && 'ERROR: ' + EX.$('error').textContent)", timeout)


def test_checker_on_a_correct_a_wrong_and_broken_modules(browser, server, state):
    from gpt2mha.learn.check import check
    from gpt2mha.learn.explain.check_worker import _shown, stage_tensors
    from gpt2mha.learn.explain.tensors import decode

    open_page(browser, server[1])
    tab(browser, "check")
    assert "time limit of 30 s" in browser.find_element("id", "check-note").text      # `gpt2mha explain`'s default
    browser.find_element("id", "ex-book").click()
    wait(browser, "return EX.$('code').value.includes('class MultiHeadAttention')")
    assert _check(browser).startswith("MultiHeadAttention: MATCH")
    browser.find_element("id", "ex-wrong").click()
    wait(browser, "return EX.$('code').value.includes('wrong')")
    assert "MISMATCH" in _check(browser)
    assert browser.execute_script("return EX.$('check-stages').querySelector('tr.first').dataset.stage") == "weights"
    shot(browser, "check", "check-verdict")
    # the tensors shown are the checker's: the reference's and the module's weights, batch 0, head 0
    path = os.path.join(EXAMPLES, "wrong_scale.py")
    report = check(f"{path}:MultiHeadAttention")
    ref = {k: (decode(v["expected"]), decode(v["seen"])) for k, v in stage_tensors(f"{path}:MultiHeadAttention", report).items()}
    expected, seen = ref["weights"]
    assert same_as_printed(hover(browser, "m-check-expected", 3, 1), float(expected[3, 1]))
    assert same_as_printed(hover(browser, "m-check-seen", 3, 1), float(seen[3, 1]))
    assert float(expected[3, 1]) != pytest.approx(float(seen[3, 1]), abs=1e-3)
    with open(os.path.join(EXAMPLES, "book_mha.py")) as f:
        book = f.read()
    _set_code(browser, book.replace("return self.out_proj(context_vec)", "raise RuntimeError('my bug')"))
    assert "COULD NOT RUN" in _check(browser)
    assert "my bug" in browser.find_element("id", "check-error").text
    _set_code(browser, book.replace("return self.out_proj(context_vec)", "return self.out_proj(context_vec)[:, :1]"))
    assert "MISMATCH" in _check(browser)
    assert "output shape (2, 1, 24) != expected (2, 5, 24)" in browser.find_element("id", "check-text").text
    _set_code(browser, "")
    assert "the code is empty" in _check(browser)
    _set_code(browser, "class MultiHeadAttention:\n    def forward(self, x:\n        return x\n")
    started = time.monotonic()
    assert "the code does not parse: '(' was never closed (line 2)" in _check(browser)
    assert time.monotonic() - started < 5                 # compiled by the app: no worker imports torch for it
    limits, state.limits = state.limits, CheckLimits(timeout_s=3)
    try:
        _set_code(browser, book.replace("b, num_tokens, d_in = x.shape", "while True: pass"))
        assert "did not finish within the time limit of 3 s" in _check(browser)
    finally:
        state.limits = limits
    assert severe(browser, answered_400=True) == []


def test_bad_prompts_and_models_get_a_message_on_the_page(browser, server, model, tmp_path):
    open_page(browser, server[1])
    n_ctx = model.config.n_ctx
    for prompt, model_path, words in (("", "", "the prompt is empty"), ("x" * (n_ctx + 1), "", f"n_ctx={n_ctx}"),
                                      ("hi", str(tmp_path / "no_such_model"), "is not a directory")):
        browser.execute_script("EX.$('prompt').value = arguments[0]; EX.$('model').value = arguments[1]", prompt, model_path)
        browser.find_element("id", "run").click()
        text = wait(browser, "return !EX.$('error').hidden && EX.$('error').textContent")
        assert words in text
        assert browser.execute_script("return document.querySelectorAll('#steps canvas').length") > 10   # the page stays
        browser.execute_script("EX.showError(null)")
    assert severe(browser, answered_400=True) == []
    # a good new prompt replaces the sequence
    browser.execute_script("EX.$('prompt').value = 'JULIET:'; EX.$('model').value = ''")
    browser.find_element("id", "run").click()
    wait(browser, "return EX.state.T === 7 && (document.body.dataset.steps || '').length > 0 && "
                  "EX.$('m-pattern') && EX.$('m-pattern').dataset.rows === '7'")
    assert severe(browser) == []


def test_export_opens_from_disk_offline(browser, state, model, tmp_path):
    from gpt2mha.learn.explain.export import export

    out = tmp_path / "page"
    export(state.pristine, str(out), PROMPT)
    open_page(browser, (out / "index.html").as_uri())
    assert "exported" in browser.find_element("id", "mode").text
    wait(browser, "return document.body.dataset.steps")
    _, cache = model.run_with_cache(torch.tensor([list(PROMPT.encode())]), "blocks.0.attn.hook_pattern")
    w = cache["pattern", 0][0, 0]
    assert same_as_printed(hover(browser, "m-pattern", 9, 4), float(w[9, 4]))
    tab(browser, "heads")
    assert browser.execute_script("return document.querySelectorAll('#heads-grid canvas').length") == \
        model.config.n_layer * model.config.n_head
    for name in ("generate", "check"):
        tab(browser, name)
        assert "gpt2mha explain" in browser.find_element("css selector", f"#view-{name} .needs").text
    # the sampling filters run in the exported page itself: the library's numbers all the same
    from selenium.webdriver.common.keys import Keys

    from gpt2mha.learn.explain.kv_steps import filtered

    assert browser.find_element("id", "next").get_attribute("disabled") is not None
    tab(browser, "generate")
    for key, slider, presses in ((Keys.ARROW_LEFT, "temperature", 6), (Keys.ARROW_LEFT, "top_p", 10)):
        for _ in range(presses):
            browser.find_element("id", slider).send_keys(key)
    wait(browser, "const t = EX.$('dist-table'); return t && t.dataset.temperature === '0.7' && t.dataset.topP === '0.9'")
    with torch.no_grad():
        logits = model(torch.tensor([list(PROMPT.encode())])).logits[0, -1]
    p_temp, _, after_p, p_final = filtered(logits, 0.7, 0, 0.9)
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#dist-table tr')).slice(1).map(r => "
                                  "[+r.dataset.id, r.children[3].textContent, r.children[5].textContent, r.children[6].textContent])")
    assert len(rows) == 30
    for tid, temp, status, final in rows:
        assert abs(float(temp) - float(p_temp[tid])) <= 0.5e-4 + 1e-6
        assert abs(float(final) - float(p_final[tid])) <= 0.5e-4 + 1e-6
        assert status == ("kept" if torch.isfinite(after_p[tid]) else "removed by top-p")
    tab(browser, "intervene")
    wait(browser, "return EX.$('lens-table')")
    loaded = browser.execute_script("return Array.from(document.querySelectorAll('script[src], link[href]'))"
                                    ".map(e => new URL(e.src || e.href).protocol)")
    assert len(loaded) > 9 and set(loaded) <= {"file:", "data:"}                 # the page's files and its data
    assert severe(browser) == []
