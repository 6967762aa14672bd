"""heads.html in a real browser: headless Chromium (Debian packages ``chromium`` and
``chromium-driver``, installed by .ci/run) driven by Selenium loads the page from disk; the test
reads the rendered DOM, the canvases' pixels, the browser console and a screenshot.

Independent reference: the attention weights gpt2mha computed in Python, compared with the
colours the page's own JavaScript drew for them.
"""

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from gpt2mha import DEFAULT_MODEL, GPT2, GPT2Config
from gpt2mha.io.checkpoints import builtin_models
from gpt2mha.cli import main

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


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1800", "--allow-file-access-from-files"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)   # no driver download
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """heads.html of the built-in model (6 x 6 heads), or of a random 2 x 4 model if it is absent."""
    out = tmp_path_factory.mktemp("heads")
    argv = ["heads", PROMPT, "--out", str(out), "--layer", "1", "--head", "2"]
    if DEFAULT_MODEL not in builtin_models():
        torch.manual_seed(0)
        GPT2(GPT2Config.from_preset("tiny")).save_pretrained(str(out / "model"))
        argv += ["--model", str(out / "model")]
    assert main(argv) == 0
    return out / "heads.html"


def severe(logs):
    return [e for e in logs if e["level"] == "SEVERE"]


def test_console_errors_are_caught_by_this_harness(browser, tmp_path):
    # the console check below can fail: a page with a script error shows up in the log
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><html><body><script>notDefinedAnywhere();</script></body></html>")
    browser.get(bad.as_uri())
    assert any("notDefinedAnywhere" in e["message"] for e in severe(browser.get_log("browser")))


def test_heads_html_renders_every_head_and_selection_changes_the_view(browser, page, tmp_path):
    browser.get(page.as_uri())
    assert severe(browser.get_log("browser")) == []
    js = browser.execute_script
    L, H, T = js("return [D.n_layer, D.n_head, D.T]")
    # every layer/head has a canvas, and each one was drawn (not left blank white)
    drawn = js("""return Array.from(document.querySelectorAll('canvas.small')).map(c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) n++;
        return [c.id, n / (d.length / 4)]; })""")
    assert sorted(i for i, _ in drawn) == sorted(f"L{l}H{h}" for l in range(L) for h in range(H))
    assert all(frac > 0.9 for _, frac in drawn)
    # one canvas per head in the DOM, each labelled with its layer and head
    from selenium.webdriver.common.by import By
    cells = browser.find_elements(By.CSS_SELECTOR, "#heads td")
    assert [c.text for c in cells] == [f"layer {l} head {h}" for l in range(L) for h in range(H)]
    assert browser.find_element(By.ID, "sel").text == "layer 1 head 2"      # the page opens on --layer 1 --head 2
    assert js("return Array.from(document.querySelectorAll('canvas.sel')).map(c => c.id)") == ["L1H2"]
    before = js("return document.getElementById('big').toDataURL()")
    browser.find_element(By.ID, f"L{L - 1}H{H - 1}").click()
    assert browser.find_element(By.ID, "sel").text == f"layer {L - 1} head {H - 1}"
    after = js("return document.getElementById('big').toDataURL()")
    assert after != before
    assert js("return Array.from(document.querySelectorAll('canvas.sel')).map(c => c.id)") == [f"L{L - 1}H{H - 1}"]
    # the big view shows this head's weights: the colour drawn at the strongest key of the last query
    model = GPT2.from_pretrained(DEFAULT_MODEL) if DEFAULT_MODEL in builtin_models() else None
    if model is not None:
        from gpt2mha.learn.heads import analyse_heads
        w = analyse_heads(model, PROMPT).weights[L - 1, 0, H - 1]              # [T, T]
        i, j = T - 1, int(w[T - 1].argmax())
        s = (640 - 80) / T
        g = js(f"return document.getElementById('big').getContext('2d')"
               f".getImageData({80 + (j + 0.5) * s}, {80 + (i + 0.5) * s}, 1, 1).data[1]")
        assert abs(g - (1 + 230 * float(w[i, j]))) <= 3                      # green channel of the page's colour map
    # hover reports the weight under the mouse
    from selenium.webdriver import ActionChains
    big = browser.find_element(By.ID, "big")
    ActionChains(browser).move_to_element_with_offset(big, 320 - 20, 320 - 20).perform()
    assert "-> key" in browser.find_element(By.ID, "hover").text
    assert severe(browser.get_log("browser")) == []
    # a screenshot of the rendered page: the big view is drawn, not blank
    shot = tmp_path / "heads.png"
    assert browser.save_screenshot(str(shot))
    if os.environ.get("GPT2MHA_SCREENSHOT_DIR"):
        shutil.copy(shot, os.path.join(os.environ["GPT2MHA_SCREENSHOT_DIR"], "heads.png"))
    img = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    r = big.rect
    dpr = img.shape[1] / browser.execute_script("return window.innerWidth")
    crop = img[int((r["y"] + 90) * dpr):int((r["y"] + r["height"] - 10) * dpr),
               int((r["x"] + 90) * dpr):int((r["x"] + r["width"] - 10) * dpr)]
    if crop.size:                                             # the big canvas is inside the window
        assert crop.std() > 5 and (crop.mean(axis=(0, 1)) < 250).all()


def test_long_prompt_page_with_only_the_selected_layer_renders(browser, tmp_path):
    # past the size limit heads.html embeds only the selected heads' layers; the others show grey
    from gpt2mha.learn.heads import analyse_heads
    from gpt2mha.learn.heads_html import write_html
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny")).eval()                 # 2 layers x 4 heads
    result = analyse_heads(model, "x" * 60)
    path = tmp_path / "s.html"
    info = write_html(result, str(path), selected=[(1, 3)], max_bytes=1000)
    assert info["layers"] == [1]
    browser.get(path.as_uri())
    assert severe(browser.get_log("browser")) == []
    js = browser.execute_script
    from selenium.webdriver.common.by import By
    assert browser.find_element(By.ID, "sel").text == "layer 1 head 3"  # the selected head is shown
    grey = js("""return ['L0H0', 'L1H3'].map(id => { const c = document.getElementById(id);
        const d = c.getContext('2d').getImageData(48, 60, 1, 1).data; return [d[0], d[1], d[2]]; })""")
    assert grey[0] == [204, 204, 204] and grey[1] != [204, 204, 204]   # layer 0 not embedded, layer 1 drawn
    assert "embeds only layer(s) 1" in browser.find_element(By.ID, "notes").text
