"""gpt2mha explain without a browser: the page's numbers against the Python API, the security
checks (token, Host, Origin) on the real server, bad input answered with a message, the
checker's subprocess, the export and the command line.

References are independent of the explainer: ``run_with_cache`` (the capture points),
``attention_mask``, ``analyse_heads``, ``logit_lens``, ``ablate_heads``, the sampling filters
and ``generate``.
"""

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from gpt2mha import DEFAULT_MODEL, GPT2, attention_mask
from gpt2mha.inference.sampling import top_k_logits, top_p_logits
from gpt2mha.io.checkpoints import builtin_models
from gpt2mha.learn.explain import security
from gpt2mha.learn.explain.app import Explain, serve_in_thread
from gpt2mha.learn.explain.checker import CheckLimits, run_check
from gpt2mha.learn.explain.session import ModelEntry, Sequence
from gpt2mha.learn.explain.tensors import decode

from conftest import small_model

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "src", "gpt2mha", "learn", "explain", "static", "examples")


@pytest.fixture(scope="module")
def model():
    """The built-in model (byte tokenizer), or a random one of its tokenizer when it is absent."""
    if DEFAULT_MODEL in builtin_models():
        return GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return small_model(n_vocab=256, n_ctx=96, tokenizer="bytes")


@pytest.fixture(scope="module")
def entry(model):
    return ModelEntry(model, "test-model")


@pytest.fixture(scope="module")
def seq(entry):
    return Sequence(entry, entry.encode_prompt(PROMPT))


def test_layer_and_head_units_are_the_capture_points(model, seq):
    from gpt2mha.learn.explain.tensors import LAYER_POINTS

    T, C, hd = len(seq.ids), model.config.n_embd, model.config.head_dim
    _, every = model.run_with_cache(seq.idx)                  # every point hooked: LayerNorms written out
    for layer, head in ((0, 0), (model.config.n_layer - 1, model.config.n_head - 1)):
        # the page reads the layer's own points: the same numbers as run_with_cache of those points
        _, cache = model.run_with_cache(seq.idx, [f"blocks.{layer}.{p}" for p in LAYER_POINTS])
        lu, hu = seq.unit("layer", layer), seq.unit("head", layer, head)
        torch.testing.assert_close(decode(hu["pattern"]), every["pattern", layer][0, head], atol=1e-5, rtol=0)
        attn = model.h[layer].attn
        x = cache["blocks.%d.ln1.hook_out" % layer][0]
        assert torch.equal(decode(lu["x"]), x)
        assert torch.equal(decode(lu["resid_pre"]), cache["resid_pre", layer][0])
        qkv = decode(lu["qkv"])
        assert qkv.shape == (T, 3 * C)
        torch.testing.assert_close(qkv, (x @ attn.c_attn.weight + attn.c_attn.bias).detach(), atol=1e-5, rtol=1e-5)
        for i, name in enumerate("qkv"):                      # head h's slice of each column block
            got = decode(hu[name])
            assert torch.equal(got, cache[name, layer][0, :, head])
            assert torch.equal(got, qkv[:, i * C + head * hd:i * C + (head + 1) * hd])
        mask = attention_mask(T, T)
        assert torch.equal(decode(lu["mask"]).bool(), mask)
        captured = cache["attn_scores", layer][0, head]
        scores = decode(hu["scores"])
        assert torch.equal(scores[mask], captured[mask])
        q, k = cache["q", layer][0, :, head], cache["k", layer][0, :, head]
        torch.testing.assert_close(scores[~mask], (q @ k.T / hd ** 0.5)[~mask], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.where(decode(lu["mask"]).bool(), scores, torch.finfo(torch.float32).min), captured)
        pattern = decode(hu["pattern"])
        assert torch.equal(pattern, cache["pattern", layer][0, head])
        assert (pattern[~mask] == 0).all()
        torch.testing.assert_close(decode(hu["rowsum"]), torch.ones(T))
        assert torch.equal(decode(hu["z"]), cache["z", layer][0, :, head])
        assert torch.equal(decode(lu["concat"]), cache["z", layer][0].reshape(T, C))
        assert torch.equal(decode(lu["attn_out"]), cache["attn_out", layer][0])
        torch.testing.assert_close(decode(lu["resid_mid"]), cache["resid_pre", layer][0] + cache["attn_out", layer][0])
    with pytest.raises(ValueError, match="layer=99 is out of range"):
        seq.unit("layer", 99)
    with pytest.raises(ValueError, match="head=-1 is out of range"):
        seq.unit("head", 0, -1)


def test_pipeline_unit(model, seq):
    u = seq.unit("pipeline")
    ids = seq.ids
    assert [t["id"] for t in u["tokens"]] == ids and u["T"] == len(ids)
    assert "".join(t["label"] for t in u["tokens"]).startswith("ROMEO:\u21b5But\u2423soft")
    assert torch.equal(decode(u["embed"]), model.wte.weight[ids].detach())
    assert torch.equal(decode(u["pos"]), model.wpe.weight[:len(ids)].detach())
    probs = model(seq.idx).logits[0, -1].softmax(-1)
    top = probs.topk(len(u["next"]))
    assert [r["id"] for r in u["next"]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([r["p"] for r in u["next"]]), top.values.detach())


def test_heads_unit_roles_are_analyse_heads(model, seq):
    from gpt2mha.learn.heads import analyse_heads

    u = seq.unit("heads")
    ref = analyse_heads(model, PROMPT)
    assert [(r["layer"], r["head"], r["role"]) for r in u["roles"]] == [(r["layer"], r["head"], r["role"]) for r in ref.roles]
    for a, b in zip(u["roles"], ref.roles):
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-5)
    thumbs = decode(u["thumbs"]).float() / 255                  # T <= 64: the patterns themselves, 8-bit
    w = ref.weights[:, 0]
    assert thumbs.shape == w.shape
    assert (thumbs - w).abs().max() <= 0.5 / 255 + 1e-6


def test_thumbnails_keep_each_blocks_largest_weight():
    """At 1024 tokens a head that puts all its weight on one key per query (previous-token, the
    diagonal) still reaches full brightness in its 64 x 64 small map: each pixel is its 16 x 16
    block's largest weight (NumPy's block max the reference), and so for T = 100 with
    adaptive pooling's windows (rows floor(i·T/B) to ceil((i+1)·T/B), PyTorch's documented rule)."""
    import numpy as np

    from gpt2mha.learn.explain.heads_view import POOL, THUMB, heads_unit, thumbnails

    T = 1024
    prev = torch.zeros(T, T)
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    prev[0, 0] = 1.0
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    patterns = torch.stack([prev, uniform])[None]                         # [1, 2, T, T]
    got = thumbnails(patterns)
    want = patterns.numpy().reshape(1, 2, THUMB, T // THUMB, THUMB, T // THUMB).max(axis=(3, 5))
    assert POOL == "max" and got.shape == (1, 2, THUMB, THUMB)
    np.testing.assert_array_equal(got.numpy(), want)
    u8 = decode(heads_unit(got, None, None)["thumbs"])
    assert int(u8[0, 0].max()) == 255 and int(u8[0, 1].max()) == 255   # a mean gave 16 and 255
    T = 100
    p = torch.rand(1, 1, T, T, generator=torch.Generator().manual_seed(0))
    lo = [i * T // THUMB for i in range(THUMB)]
    hi = [-(-(i + 1) * T // THUMB) for i in range(THUMB)]
    want = np.array([[p[0, 0, lo[i]:hi[i], lo[j]:hi[j]].max().item() for j in range(THUMB)] for i in range(THUMB)])
    np.testing.assert_array_equal(thumbnails(p)[0, 0].numpy(), want.astype(np.float32))


def test_sampling_view_is_the_librarys_filters_and_steps_draw_as_generate(model, entry, seq):
    logits = seq.logits()[-1]
    v = seq.sampling(0.7, 5, 0.8)
    scaled = ((logits - logits.max()) / 0.7)[None]
    after_k = top_k_logits(scaled, 5)
    after_p = top_p_logits(after_k, 0.8)
    final = after_p.softmax(-1)[0]
    for r in v["tokens"]:
        assert r["p_final"] == pytest.approx(float(final[r["id"]]), abs=1e-7)
        assert r["kept_k"] == bool(torch.isfinite(after_k[0, r["id"]]))
        assert r["kept_p"] == bool(torch.isfinite(after_p[0, r["id"]]))
    assert v["removed_k"] == model.config.n_vocab - 5 and v["kept"] == int(torch.isfinite(after_p).sum())
    greedy = seq.sampling(0, 0, 1.0)
    assert greedy["greedy"] and greedy["kept"] == 1 and greedy["tokens"][0]["id"] == int(logits.argmax())
    with pytest.raises(ValueError, match="top_p"):
        seq.sampling(1.0, 0, 1.5)
    # three steps on the cache with seed 7 draw what generate draws with seed 7
    s = Sequence(entry, list(seq.ids))
    steps = [s.step(0.9, 0, 1.0, seed=7, layer=1) for _ in range(3)]
    want = model.generate(seq.idx, 3, temperature=0.9, seed=7)[0, len(seq.ids):].tolist()
    assert [st["token"]["id"] for st in steps] == want
    c, T = model.config, len(seq.ids)
    assert steps[0]["past_before"] == [1, c.n_layer, 2, c.n_head, T, c.head_dim]
    assert steps[-1]["past_after"] == [1, c.n_layer, 2, c.n_head, T + 3, c.head_dim]
    # the step's row over the cache is the last row of a full forward over the longer sequence
    _, cache = model.run_with_cache(torch.tensor([s.ids]))
    last = steps[-1]
    assert last["ns"] == T + 3 and last["nd"] == 1
    torch.testing.assert_close(decode(last["pattern"])[1], cache["pattern", 1][0, :, -1], atol=1e-6, rtol=1e-5)
    assert torch.equal(decode(last["mask"]).bool(), attention_mask(1, T + 3))
    assert s.reset()["T"] == T and s.ids == seq.ids


def test_ablate_and_lens_are_the_interventions(model, seq):
    from gpt2mha.learn.interventions import ablate_heads, logit_lens, next_token_shift

    r = seq.ablate([[0, 1], [1, 0]], "mean")
    with torch.no_grad():
        before = model(seq.idx).logits[0, -1]
        after = ablate_heads(model, seq.idx, [(0, 1), (1, 0)], mean=True)[0, -1]
    ref = next_token_shift(before, after, top=10)
    assert r["kl"] == pytest.approx(ref["kl"], rel=1e-4, abs=1e-7)
    assert [t["id"] for t in r["tokens"]] == [t["id"] for t in ref["tokens"]]
    assert [t["after"] for t in r["tokens"]] == pytest.approx([t["after"] for t in ref["tokens"]], abs=1e-6)
    with pytest.raises(ValueError, match="names no head"):
        seq.ablate([], "zero")
    with pytest.raises(ValueError, match="mode"):
        seq.ablate([[0, 0]], "half")
    lens = seq.unit("lens")
    ref = logit_lens(model, seq.idx, top_k=3)
    assert lens["rows"] == ref.labels and lens["top_ids"] == ref.ids[:, 0].tolist()
    torch.testing.assert_close(decode(lens["top_p"]), ref.probs[:, 0])


def test_refusal_rules():
    tok = "s3cret"
    ok = {"host": "127.0.0.1:8000", security.TOKEN_HEADER: tok}
    hosts = security.LOOPBACK
    assert security.refusal("POST", "/api/step", ok, tok, hosts, 8000) is None
    assert security.refusal("POST", "/api/step", {**ok, "origin": "http://127.0.0.1:8000"}, tok, hosts, 8000) is None
    assert "cross-origin" in security.refusal("POST", "/api/step", {**ok, "origin": "http://evil.example"}, tok, hosts, 8000)
    assert "cross-origin" in security.refusal("POST", "/api/step", {**ok, "origin": "http://127.0.0.1:9999"}, tok, hosts, 8000)
    assert "cross-origin" in security.refusal("POST", "/api/step", {**ok, "origin": "null"}, tok, hosts, 8000)
    assert "foreign Host" in security.refusal("GET", "/", {**ok, "host": "rebind.evil.example:8000"}, tok, hosts, 8000)
    assert "foreign Host" in security.refusal("GET", "/", {**ok, "host": "127.0.0.1:8001"}, tok, hosts, 8000)
    assert "foreign Host" in security.refusal("GET", "/", {}, tok, hosts, 8000)
    assert "missing token" in security.refusal("GET", "/api/unit", {"host": "localhost:8000"}, tok, hosts, 8000)
    assert "wrong token" in security.refusal("GET", "/api/unit", {**ok, security.TOKEN_HEADER: "s3cre"}, tok, hosts, 8000)
    assert "cross-site" in security.refusal("POST", "/api/check", {**ok, "sec-fetch-site": "cross-site"}, tok, hosts, 8000)
    assert security.refusal("GET", "/static/js/core.js", {"host": "localhost:8000"}, tok, hosts, 8000) is None


@pytest.fixture(scope="module")
def server(entry):
    state = Explain(entry, PROMPT, limits=CheckLimits(timeout_s=20), load=GPT2.from_pretrained)
    with serve_in_thread(state) as (base, page):
        yield state, base, page


def _session(page):
    html = httpx.get(page).text
    boot = json.loads(html.split('<script id="boot" type="application/json">')[1].split("</script>")[0])
    return boot


@pytest.mark.slow
def test_server_refuses_cross_origin_missing_token_and_foreign_host(server):
    state, base, page = server
    port = base.rsplit(":", 1)[1]
    boot = _session(page)
    assert boot["token"] == state.token and boot["mode"] == "live"
    H = {security.TOKEN_HEADER: state.token}
    body = {"session": boot["session"], "temperature": 1.0}
    code = {"code": "import os\nos.system('touch /tmp/gpt2mha-explain-pwned')\n"}
    ok = httpx.post(base + "/api/sample", json=body, headers=H)
    assert ok.status_code == 200 and ok.json()["tokens"]
    refused = [
        httpx.post(base + "/api/check", json=code, headers={**H, "Origin": "http://evil.example"}),      # cross-origin
        httpx.post(base + "/api/check", json=code),                                                     # no token
        httpx.post(base + "/api/check", json=code, headers={security.TOKEN_HEADER: "guess"}),           # wrong token
        httpx.post(base + "/api/check", json=code, headers={**H, "Host": f"rebind.evil.example:{port}"}),  # DNS rebinding
        httpx.get(page, headers={"Host": f"rebind.evil.example:{port}"}),                              # the page itself
        httpx.post(base + "/api/step", json=body, headers={**H, "Sec-Fetch-Site": "cross-site"}),
    ]
    assert [r.status_code for r in refused] == [403] * len(refused)
    assert all("error" in r.json() for r in refused)
    assert not os.path.exists("/tmp/gpt2mha-explain-pwned")
    no_token_page = httpx.get(base + "/")
    assert no_token_page.status_code == 403 and state.token not in no_token_page.text
    assert httpx.get(base + "/static/js/core.js").status_code == 200          # the page's own files need no token


@pytest.mark.slow
def test_bad_input_is_a_message_not_a_500(server, tmp_path):
    state, base, page = server
    boot = _session(page)
    H = {security.TOKEN_HEADER: state.token}
    n_ctx = boot["config"]["n_ctx"]
    cases = [
        (httpx.post(base + "/api/session", json={"prompt": ""}, headers=H), 400, "the prompt is empty"),
        (httpx.post(base + "/api/session", json={"prompt": "x" * (n_ctx + 1)}, headers=H), 400, f"n_ctx={n_ctx}"),
        (httpx.post(base + "/api/session", json={"prompt": "hi", "model": str(tmp_path / "nope")}, headers=H), 400,
         "is not a directory"),
        (httpx.post(base + "/api/sample", content=b"{not json", headers=H), 400, "not JSON"),
        (httpx.post(base + "/api/sample", json={"session": "gone"}, headers=H), 404, "reload the page"),
        (httpx.get(base + "/api/unit", params={"session": boot["session"], "kind": "head", "layer": 0, "head": 99},
                   headers=H), 400, "head=99 is out of range"),
        (httpx.get(base + "/api/unit", params={"session": boot["session"], "kind": "layer", "layer": "x"}, headers=H),
         400, "must be an integer"),
        (httpx.post(base + "/api/step", json={"session": boot["session"], "top_k": -1}, headers=H), 400, "top_k"),
        (httpx.post(base + "/api/check", json={"code": ""}, headers=H), 400, "the code is empty"),
        (httpx.get(base + "/api/nothing", headers=H), 404, "Not Found"),
    ]
    for r, status, words in cases:
        assert (r.status_code, words in r.json()["error"]) == (status, True), r.text
    # a prompt exactly n_ctx long is fine
    r = httpx.post(base + "/api/session", json={"prompt": "x" * n_ctx}, headers=H)
    assert r.status_code == 200 and r.json()["T"] == n_ctx


def _client(state):
    from gpt2mha.learn.explain.app import guarded_app
    from starlette.testclient import TestClient

    return TestClient(guarded_app(state, "127.0.0.1", 8765), base_url="http://127.0.0.1:8765")


def test_infinite_temperature_is_a_400_and_changes_nothing(entry):
    """temperature 1e400 (JSON's overflow to infinity), Infinity or NaN: a 400 naming the field,
    the sequence untouched; a good step after them still works."""
    state = Explain(entry, PROMPT)
    client, sid = _client(state), state.boot()["session"]
    H = {security.TOKEN_HEADER: state.token, "content-type": "application/json"}
    seq = state.sessions[sid]
    before = (list(seq.ids), seq.version)
    for route in ("sample", "step"):
        for raw in ("1e400", "Infinity", "NaN"):
            r = client.post(f"/api/{route}", content=f'{{"session": "{sid}", "temperature": {raw}, "seed": 1}}', headers=H)
            assert r.status_code == 400 and r.json()["error"].startswith("temperature="), (route, raw, r.text)
    assert (seq.ids, seq.version, seq.generator) == (*before, None)
    r = client.post("/api/step", json={"session": sid, "temperature": 1.0, "seed": 1}, headers=H)
    assert r.status_code == 200 and r.json()["T"] == len(before[0]) + 1


def test_a_nan_model_is_a_message_and_a_failed_step_changes_nothing(entry):
    """A model whose numbers are NaN (layer 0's c_attn bias): the heads view, the sampling view,
    an ablation and a step answer 422 with a message saying the model's numbers are not finite
    (never a bare JSON error); the failed step leaves the sequence, its version and its
    generator as they were."""
    import copy

    model = copy.deepcopy(entry.model)
    with torch.no_grad():
        model.h[0].attn.c_attn.bias[0] = float("nan")
    state = Explain(ModelEntry(model, "nan model"), PROMPT)
    client, sid = _client(state), state.boot()["session"]
    H = {security.TOKEN_HEADER: state.token}
    seq = state.sessions[sid]
    before = (list(seq.ids), seq.version)
    answers = [client.get("/api/unit", params={"session": sid, "kind": "heads"}, headers=H),
               client.post("/api/sample", json={"session": sid, "temperature": 1.0}, headers=H),
               client.post("/api/ablate", json={"session": sid, "heads": [[0, 0]]}, headers=H),
               client.post("/api/step", json={"session": sid, "temperature": 1.0, "seed": 3}, headers=H),
               client.post("/api/step", json={"session": sid, "temperature": 0}, headers=H)]
    for r in answers:
        assert r.status_code == 422, r.text
        assert "not finite" in r.json()["error"] and "JSON" not in r.json()["error"], r.text
    assert (seq.ids, seq.version, seq.generator, seq.seed) == (*before, None, None)


@pytest.mark.slow
def test_checker_off_beyond_loopback(entry):
    state = Explain(entry, PROMPT, limits=None, checker_note="listening beyond 127.0.0.1")
    from gpt2mha.learn.explain.app import guarded_app
    from starlette.testclient import TestClient

    client = TestClient(guarded_app(state, "0.0.0.0"), base_url="http://192.168.1.5:8765")
    r = client.post("/api/check", json={"code": "x = 1"}, headers={security.TOKEN_HEADER: state.token})
    assert r.status_code == 403 and "the checker is off" in r.json()["error"]


@pytest.mark.slow
def test_checker_subprocess_verdicts_and_limits():
    with open(os.path.join(EXAMPLES, "book_mha.py")) as f:
        book = f.read()
    good = run_check(book)
    assert good["report"]["verdict"] == "match" and good["class"] == "MultiHeadAttention"
    assert set(good["tensors"]) >= {"projections", "scores", "weights", "output"}
    with open(os.path.join(EXAMPLES, "wrong_scale.py")) as f:
        wrong = run_check(f.read())
    assert wrong["report"]["verdict"] == "mismatch" and wrong["report"]["first_differing_stage"] == "weights"
    w = wrong["tensors"]["weights"]
    assert decode(w["expected"]).shape == decode(w["seen"]).shape and not torch.equal(decode(w["expected"]),
                                                                                       decode(w["seen"]))
    raises = run_check(book.replace("return self.out_proj(context_vec)", "raise RuntimeError('my bug')"))
    assert "my bug" in raises["report"]["error"] and "your_module.py line" in raises["report"]["error"]
    shape = run_check(book.replace("return self.out_proj(context_vec)", "return self.out_proj(context_vec)[:, :1]"))
    assert shape["report"]["verdict"] == "mismatch" and any("output shape" in n for n in shape["report"]["notes"])
    loop = run_check(book.replace("b, num_tokens, d_in = x.shape", "while True: pass"), limits=CheckLimits(timeout_s=2))
    assert "did not finish within the time limit of 2 s" in loop["error"]
    hog = "import torch\nkeep = [torch.ones(2**27) for _ in range(64)]\nclass MultiHeadAttention(torch.nn.Module):\n    pass\n"
    memory = run_check(hog, limits=CheckLimits(memory_mb=256))
    assert "memory" in json.dumps(memory)


def _book():
    with open(os.path.join(EXAMPLES, "book_mha.py")) as f:
        return f.read()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_checker_leaves_no_process_the_module_started(tmp_path):
    """A module that forks a child, double-forks an orphan and starts a process in a new session
    (each noting its PID; the module is imported more than once, so each happens several times):
    the check still matches, and once run_check returns none of those processes runs; the same
    when the module then loops forever and the check is stopped at its time limit."""
    import time

    pids = tmp_path / "pids"
    spawn = f"""import os, subprocess, time
def _note(pid):
    with open({str(pids)!r}, "a") as f:
        f.write(f"{{pid}}\\n")
if os.fork() == 0:                                  # a child
    _note(os.getpid()); time.sleep(120); os._exit(0)
if os.fork() == 0:                                  # a double fork: the grandchild is orphaned
    if os.fork() == 0:
        _note(os.getpid()); time.sleep(120); os._exit(0)
    os._exit(0)
_note(subprocess.Popen(["sleep", "120"], start_new_session=True).pid)   # out of the process group
"""
    for tail, limit in (("", 60), ("\nwhile True:\n    pass\n", 3)):
        pids.write_text("")
        started = time.monotonic()
        r = run_check(spawn + _book() + tail, limits=CheckLimits(timeout_s=limit))
        if tail:
            assert "did not finish within the time limit of 3 s" in r["error"], r
        else:
            assert r["report"]["verdict"] == "match", r
            assert time.monotonic() - started < 50             # the result, not the time limit
        noted = [int(x) for x in pids.read_text().split()]
        try:
            assert len(noted) >= 3
            deadline = time.monotonic() + 5                    # the kernel may take a moment to reap
            while any(map(_running, noted)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [p for p in noted if _running(p)] == [], tail
        finally:
            for pid in noted:                                  # a failing run leaves none either
                if _running(pid):
                    os.kill(pid, 9)


@pytest.mark.slow
def test_checker_answers_once_the_result_is_written():
    """A module that leaves a non-daemon thread sleeping: the check's answer comes as soon as the
    worker wrote it, not at the time limit."""
    import time

    started = time.monotonic()
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n" + _book()
    r = run_check(code, limits=CheckLimits(timeout_s=30))
    assert "error" not in r and r["report"]["verdict"] == "match", r
    assert time.monotonic() - started < 25


@pytest.mark.slow
def test_checker_output_is_capped_and_only_its_tail_read():
    """A module printing 256 MB: the check matches, the answer carries the output's last 4,000
    characters, and the process that ran run_check never held the output (its peak memory grows
    by far less than 256 MB; measured in a fresh interpreter that imports no torch)."""
    code = ("import sys\nfor _ in range(256):\n    sys.stdout.write('x' * (2**20 - 1) + '\\n')\nprint('THE END')\n"
            + _book())
    script = ("import json, resource, sys\nfrom gpt2mha.learn.explain.checker import run_check\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "r = run_check(sys.stdin.read())\n"
              "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
              "print(json.dumps({'verdict': r.get('report', {}).get('verdict'), 'error': r.get('error'), "
              "'output': r['output'], 'grew_kb': grew, 'torch': 'torch' in sys.modules}))\n")
    run = subprocess.run([sys.executable, "-c", script], input=code, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert (got["verdict"], got["error"], got["torch"]) == ("match", None, False), got
    assert len(got["output"]) == 4000 and got["output"].endswith("x\nTHE END\n")
    assert got["grew_kb"] < 64 * 1024, got["grew_kb"]


def test_checker_reports_a_syntax_error_without_a_worker(monkeypatch):
    """Code that does not compile, or names no class, is answered before any process starts."""
    import gpt2mha.learn.explain.checker as checker

    monkeypatch.setattr(checker.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
    r = run_check("class MultiHeadAttention:\n    def forward(self, x:\n        return x\n")
    assert r == {"error": "the code does not parse: '(' was never closed (line 2)", "output": ""}
    assert "'return' outside function" in run_check("return 1\nclass A:\n    pass\n")["error"]
    assert "defines no class" in run_check("x = 1\n")["error"]


def test_export_writes_the_live_units(seq, tmp_path):
    from gpt2mha.learn.explain.export import estimate_bytes, export

    out = tmp_path / "page"
    info = export(seq, str(out), PROMPT)
    c = seq.entry.config
    assert info["files"] == 4 + c.n_layer * (1 + c.n_head)
    html = (out / "index.html").read_text()
    assert '"mode": "export"' in html and "__BOOT__" not in html
    assert (out / "static" / "js" / "core.js").is_file()
    text = (out / "data" / "head_1_2.js").read_text()
    assert text.startswith('EXPLAIN_PUT("head_1_2", ')
    unit = json.loads(text[len('EXPLAIN_PUT("head_1_2", '):-3])
    assert torch.equal(decode(unit["pattern"]), decode(seq.unit("head", 1, 2)["pattern"]))
    assert 0.9 < info["bytes"] / estimate_bytes(c, len(seq.ids)) < 1.1
    with pytest.raises(ValueError, match="would write about"):
        export(seq, str(tmp_path / "big"), PROMPT, max_bytes=1000)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export(seq, str(tmp_path / "busy"), PROMPT)
    export(seq, str(out), PROMPT)                      # an earlier export is rewritten


def test_cli_errors_before_torch(tmp_path):
    (tmp_path / "file").write_text("x")
    code = ("import sys; from gpt2mha.cli import main; "
            "codes = [main(a) for a in (['explain', ''], ['explain', '--port', '-1'], ['explain', '--model', './missing'], "
            "['explain', '--export', sys.argv[1]], ['explain', '--check-timeout', '0'])]; "
            "print(codes, any(m == 'torch' for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "file")], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[2, 2, 2, 2, 2] False", r.stderr
    for words in ("PROMPT is empty", "--port -1", "no such file or directory", "is a file", "--check-timeout"):
        assert words in r.stderr


def test_cli_port_in_use_is_one_line_before_the_model(monkeypatch, capsys):
    """`gpt2mha explain --port P` with P taken by a listening socket: exit 2 at once with one
    error line naming the address and the reason, the model never loaded (as `gpt2mha serve`)."""
    import socket
    import time

    import gpt2mha.cli.common as common
    from gpt2mha.cli import main

    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["explain", "--port", str(port)]) == 2
        assert time.monotonic() - started < 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "Address already in use" in err, err


@pytest.mark.slow
def test_cli_export(tmp_path):
    from gpt2mha.cli import main

    out = tmp_path / "exp"
    argv = ["explain", "ROMEO:", "--export", str(out)]
    if DEFAULT_MODEL not in builtin_models():
        small_model(n_vocab=256, n_ctx=96, tokenizer="bytes").save_pretrained(str(tmp_path / "m"))
        argv += ["--model", str(tmp_path / "m")]
    assert main(argv) == 0
    assert (out / "index.html").is_file() and (out / "data" / "pipeline.js").is_file()
    assert main(["explain", "x" * 100_000, "--export", str(tmp_path / "long")] + argv[4:]) == 2


def test_heads_output_links_the_explainer(tmp_path, capsys):
    import shlex

    from gpt2mha.cli import build_parser, main

    small_model(n_vocab=256, n_ctx=96, tokenizer="bytes").save_pretrained(str(tmp_path / "m"))
    prompt = "ROMEO:\nBut soft"
    assert main(["heads", prompt, "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 0
    command = capsys.readouterr().out.split("interactive: ", 1)[1].rstrip("\n")    # a quoted newline spans lines
    args = build_parser().parse_args(shlex.split(command)[1:])          # the printed line runs as it is
    assert (args.command, args.prompt, args.model) == ("explain", prompt, str(tmp_path / "m"))
    assert "<code>gpt2mha explain</code>" in (tmp_path / "o" / "heads.html").read_text()


@pytest.mark.slow
def test_cli_serves_the_page_until_interrupted(tmp_path):
    import signal

    argv = [sys.executable, "-m", "gpt2mha", "explain", "JULIET: O Romeo", "--port", "0"]
    if DEFAULT_MODEL not in builtin_models():
        small_model(n_vocab=256, n_ctx=96, tokenizer="bytes").save_pretrained(str(tmp_path / "m"))
        argv += ["--model", str(tmp_path / "m")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(180, proc.kill)               # every wait below is bounded: the process ends by then
    watchdog.start()
    try:
        line = proc.stdout.readline()
        url = line.split("open ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and "/?token=" in url
        page = httpx.get(url, timeout=60)
        assert page.status_code == 200 and "JULIET: O Romeo" in page.text
        assert httpx.get(url.split("?")[0], timeout=60).status_code == 403
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode in (0, 130)


def test_a_bpe_model_gets_its_pieces_and_every_view(tmp_path):
    from gpt2mha.learn.explain.export import export

    model = small_model(n_vocab=50257, n_ctx=64, n_layer=2, tokenizer="gpt2")
    entry = ModelEntry(model, "random BPE")
    s = Sequence(entry, entry.encode_prompt("Hello world, hello world"))
    tokens = s.summary()["tokens"]
    assert [t["label"] for t in tokens][:3] == ["Hello", "\u2423world", ","]
    assert tokens[1]["bytes"] == "20 77 6f 72 6c 64"
    for kind, layer, head in (("pipeline", None, None), ("layer", 1, None), ("head", 1, 3), ("heads", None, None),
                              ("lens", None, None)):
        assert s.unit(kind, layer, head)["version"] == 0
    v = s.sampling(1.0, 40, 0.9)
    assert v["vocab"] == 50257 and v["removed_k"] == 50257 - 40
    assert s.step(1.0, 40, 0.9, seed=3)["past_after"][4] == len(s.ids)
    assert export(s, str(tmp_path / "bpe"), "Hello world, hello world")["files"] == 4 + 2 * 5


def test_the_page_files_ship_in_the_package():
    """Every file of the page matches one of pyproject.toml's package-data patterns (a wheel
    without them serves a blank page)."""
    import fnmatch
    import pathlib

    tomllib = pytest.importorskip("tomllib")                  # Python 3.11+

    root = pathlib.Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gpt2mha"]
    package = root / "src" / "gpt2mha"
    files = [p.relative_to(package).as_posix() for p in (package / "learn" / "explain" / "static").rglob("*") if p.is_file()
             and "__pycache__" not in p.parts]
    assert len(files) >= 14
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/") for pat in patterns)] == []
