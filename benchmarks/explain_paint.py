"""How fast gpt2mha explain's page draws, in headless Chromium (a benchmark, not a test).

Serves the explainer on 127.0.0.1 for a prompt of ``--tokens`` tokens (Shakespeare from the
package's calibration text) and measures, inside the page (``performance.now()``):

* first paint: from the start of navigation to the end of drawing the step-by-step view
  (every matrix of layer 0, head 0), per page load (the launch's prompt is computed at start-up,
  as ``gpt2mha explain`` does before it prints the address);
* head switch: from picking another head of the same layer to the end of its drawing (the
  request, the decode, every canvas of the view);
* layer switch: the same for another layer (the server runs the forward for it);
* heads grid: the small multiples of every head and the enlarged one.

Usage::

    python benchmarks/explain_paint.py                      # the built-in model, 256 tokens
    python benchmarks/explain_paint.py --shape 124M --tokens 1024   # random weights of GPT-2 small's shape

Needs Debian's chromium and chromium-driver (``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time


def prompt_of(tok, n: int) -> str:
    """About ``n`` tokens of Shakespeare (the package's calibration sample), cut to exactly n."""
    path = os.path.join(os.path.dirname(__file__), "..", "src", "gpt2mha", "data", "calibration.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return tok.decode(ids[:n])


def browser(chromium: str, chromedriver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=opts)
    driver.set_script_timeout(300)
    driver.set_page_load_timeout(300)
    return driver


SWITCH = """const [layer, head, tab, done] = arguments;
EX.select(layer, head);
const t0 = performance.now();
const view = tab === 'heads' ? EX.openTab('heads') : EX.render(tab);
view.then(() => requestAnimationFrame(() => done(performance.now() - t0)));"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model to load (default: the built-in one)")
    p.add_argument("--shape", default=None, help="instead of --model: random weights of this preset (e.g. 124M)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5, help="page loads and switches measured")
    args = p.parse_args(argv)
    chromium, chromedriver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        print("needs chromium and chromedriver on PATH (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    import torch

    from gpt2mha import DEFAULT_MODEL, GPT2, GPT2Config
    from gpt2mha.learn.explain.app import Explain, serve_in_thread
    from gpt2mha.learn.explain.session import ModelEntry

    if args.shape:
        torch.manual_seed(0)
        model, name = GPT2(GPT2Config.from_preset(args.shape)).eval(), f"random {args.shape}"
    else:
        name = args.model or DEFAULT_MODEL
        model = GPT2.from_pretrained(name).eval()
    entry = ModelEntry(model, name)
    prompt = prompt_of(entry.tok, args.tokens)
    t0 = time.perf_counter()
    state = Explain(entry, prompt)
    state.warm()
    print(f"{name}: {model.config.n_layer} layers x {model.config.n_head} heads, {len(entry.encode_prompt(prompt))} tokens; "
          f"start-up computation {time.perf_counter() - t0:.2f} s; torch threads {torch.get_num_threads()}")
    driver = browser(chromium, chromedriver)
    try:
        with serve_in_thread(state) as (_, page):
            first, heads, layers, grids, parts = [], [], [], [], []
            H, L = model.config.n_head, model.config.n_layer
            for r in range(args.repeat):
                driver.get(page)
                end = time.monotonic() + 300
                while not driver.execute_script("return document.body.dataset.steps && EX.painted"):
                    if time.monotonic() > end:
                        raise RuntimeError("the page did not paint within 300 s")
                    time.sleep(0.02)
                first.append(driver.execute_script("return EX.painted"))
                parts.append(driver.execute_script("return [EX.painted - EX.timing.fetch - EX.timing.draw, "
                                                   "EX.timing.fetch, EX.timing.draw]"))
                heads.append(driver.execute_async_script(SWITCH, 0, 1 + r % (H - 1), "steps"))
                layers.append(driver.execute_async_script(SWITCH, 1 + r % (L - 1), 0, "steps"))
                grids.append(driver.execute_async_script(SWITCH, 0, 0, "heads"))
    finally:
        driver.quit()

    def line(label, xs):
        print(f"  {label:<34} median {statistics.median(xs):7.1f} ms   min {min(xs):7.1f}   max {max(xs):7.1f}   (n={len(xs)})")
    print("in headless Chromium:")
    line("first paint (navigation -> drawn)", first)
    for i, what in enumerate(("  of which: page and scripts", "            the numbers' requests", "            decoding and drawing")):
        line(what, [p[i] for p in parts])
    line("head switch (same layer)", heads)
    line("layer switch (server forward)", layers)
    line("heads grid + enlarged head", grids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
