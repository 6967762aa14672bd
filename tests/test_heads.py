"""gpt2mha.learn.heads and heads_html: attention maps, head role scores, the grid PNG and
heads.html, and the ``gpt2mha heads`` command.

Independent references: the attention weights computed in NumPy from OpenAI's formulas
(gpt2mha.core.reference) on the same weights, a GPT-2 whose weights are built by hand to attend
to the previous token, maps built by hand, and PNG/HTML files read back from disk.
"""

import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from gpt2mha import DEFAULT_MODEL, GPT2, GPT2Config
from gpt2mha.cli import main
from gpt2mha.io.checkpoints import builtin_models
from gpt2mha.learn.heads import (NO_ROLE, ROLE_THRESHOLD, analyse_heads, assign_roles, attention_maps,
                                 induction_from_maps, relative_scores, repeated_random_tokens, role_scores,
                                 strongest_heads)
from gpt2mha.learn.heads_html import grid_geometry, head_geometry, ordinal

DATA = os.path.join(os.path.dirname(__file__), "data")


# --------------------------------------------------------------------------- role scores
def previous_token_model(T=16):
    """One layer, two heads. Head 1's weights are built to attend to the previous token:
    wpe[p] is the one-hot e_p, W_q copies it and W_k shifts it by one position, so q_i · k_j is
    large exactly when j = i - 1. Head 0 has zero weights: uniform attention."""
    config = GPT2Config(n_vocab=256, n_ctx=T, n_embd=2 * T, n_head=2, n_layer=1, tokenizer="bytes")
    model = GPT2(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if ".ln_" in name or "ln_f" in name else 0.0)
        model.wpe.weight[:, :T] = torch.eye(T)
        W = model.h[0].attn.c_attn.weight                   # [n_embd, 3·n_embd], q | k | v blocks
        C, hd = config.n_embd, config.head_dim
        for p in range(T):
            W[p, hd + p] = 1.0                               # head 1 query: e_p
            if p + 1 < hd:
                W[p, C + hd + p + 1] = 1.0                   # head 1 key: e_{p+1}
    return model


def test_role_scores_identify_a_synthetic_previous_token_head():
    model = previous_token_model()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    w = attention_maps(model, idx)
    assert w.shape == (1, 2, 2, 16, 16)
    scores = role_scores(w)
    assert scores["previous"][0, 1] > 0.9 and scores["previous"][0, 0] < 0.4
    rel = relative_scores(w)
    rows = strongest_heads(rel, top=1)
    assert rows == [{"role": "previous-token", "layer": 0, "head": 1, "score": pytest.approx(rel["previous"][0, 1].item())}]
    assert rel["previous"][0, 1] > 0.9
    # head 0 has zero weights: uniform rows. Its raw previous-token score is the uniform share
    # mean(1/(i+1)) > 0, its relative score is 0 and it has no role.
    assert scores["previous"][0, 0] == pytest.approx(sum(1 / (i + 1) for i in range(1, 16)) / 15, abs=1e-5)
    assert all(abs(rel[k][0, 0]) < 1e-5 for k in rel)
    assert scores["entropy_norm"][0, 0] == pytest.approx(1.0, abs=1e-5)
    roles = assign_roles(rel)
    assert [r["role"] for r in roles] == [NO_ROLE, "previous-token"]
    assert set(roles[1]["scores"]) == {"previous", "first", "self"}


def test_role_scores_on_hand_made_maps():
    T = 6
    eye, prev, first = torch.eye(T), torch.zeros(T, T), torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    first[:, 0] = 1.0
    w = torch.stack([eye, prev, first])[None, None]             # [1, 1, 3, T, T]
    s = role_scores(w)
    assert s["self"][0].tolist() == [1.0, 0.0, 0.0]
    assert s["previous"][0].tolist() == [0.0, 1.0, pytest.approx(1 / (T - 1))]   # query 1's previous is key 0
    assert s["first"][0].tolist() == [0.0, pytest.approx(1 / (T - 1)), 1.0]
    assert s["entropy"][0].abs().max() < 1e-5
    with pytest.raises(ValueError, match="at least 2 tokens"):
        role_scores(torch.ones(1, 1, 1, 1, 1))


# -------------------------------------------------------------------------------- heads
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    GPT2(GPT2Config.from_preset("tiny")).save_pretrained(str(d / "model"))   # 2 layers x 4 heads, n_ctx 64
    return str(d / "model")


def assert_grid_png(path, n_layer, n_head, T=None):
    """The PNG decodes at the grid's size and every map cell holds a drawn map, not background."""
    geo = grid_geometry(n_layer, n_head, T)
    img = Image.open(path)
    img.load()
    assert img.size == (geo["width"], geo["height"])
    px = torch.from_numpy(np.asarray(img.convert("L"), dtype=np.float32))   # [height, width]
    for (l, h), (x0, y0, x1, y1) in geo["cells"].items():
        cell = px[y0 + 8:y1 - 8, x0 + 8:x1 - 8]
        assert cell.mean() < 200, (l, h)                     # viridis, not white
    gap = px[geo["cells"][(0, 0)][3] + 4, :]                 # a row between layer 0 and layer 1
    assert n_layer == 1 or gap[geo["cells"][(0, 0)][0] + 8:geo["cells"][(0, 0)][2] - 8].mean() > 250


def page_data(page):
    """The data object heads.html embeds (``const D = {...};``)."""
    return json.loads(re.search(r"const D = (\{.*?\});\n", page).group(1).replace("<\\/", "</"))


def page_maps(data):
    """Decode the page's 8-bit lower-triangle maps → ``[len(layers), n_head, T, T]`` float (independent of its JS)."""
    import base64
    T, H, n = data["T"], data["n_head"], len(data["layers"])
    q = np.frombuffer(base64.b64decode(data["maps"]), dtype=np.uint8).reshape(n * H, T * (T + 1) // 2)
    out = torch.zeros(n * H, T, T)
    rows, cols = np.tril_indices(T)
    out[:, rows, cols] = torch.from_numpy(q.astype(np.float32) / 255)
    return out.reshape(n, H, T, T)


def test_heads_writes_grid_png_head_pngs_and_html(tiny_dir, tmp_path, capsys):
    out = tmp_path / "maps"
    prompt = "To be, or not to be"
    assert main(["heads", prompt, "--model", tiny_dir, "--layer", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert_grid_png(out / "grid.png", 2, 4)
    T = len(prompt.encode())
    for h in range(4):                                       # --layer 1 alone selects all its heads
        img = Image.open(out / f"layer1_head{h}.png")
        assert img.size == head_geometry(T)
    assert not (out / "layer0_head0.png").exists()
    page = (out / "heads.html").read_text()
    for l in range(2):
        for h in range(4):
            assert f'id="L{l}H{h}"' in page and f"layer {l} head {h}" in page
    assert "data:image/png;base64," in page and "<script src" not in page and "http" not in page
    data = page_data(page)
    assert data["labels"] == list(prompt.replace(" ", "\u2423"))          # token labels inlined, spaces shown
    maps = page_maps(data)
    assert maps.shape == (2, 4, T, T) and data["layers"] == [0, 1]
    assert (maps.sum(-1) - 1).abs().max() < T / 255                     # rows sum to 1 up to 8-bit rounding
    # a random tiny model: no head has a clear role, and the output says so
    assert "8 of 8 heads have no clear role" in text and "strongest induction heads" in text


def reference_maps(model, idx):
    """Every layer's attention weights ``[n_layer, B, h, T, T]`` from gpt2mha.core.reference
    (NumPy, float64, OpenAI's ``attn`` written out) on the model's weights."""
    from gpt2mha.core import reference as R

    p = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    ids, n_head = idx.numpy(), model.config.n_head
    x = p["wte.weight"][ids] + p["wpe.weight"][np.arange(ids.shape[1])]
    maps = []
    for layer in range(model.config.n_layer):
        pre = f"h.{layer}."
        qkv = R.conv1d(R.norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"]), p[pre + "attn.c_attn.weight"],
                       p[pre + "attn.c_attn.bias"])
        q, k, _ = (R.split_heads(t, n_head) for t in np.split(qkv, 3, axis=-1))          # [B, h, T, hd]
        maps.append(R.softmax(R.mask_attn_weights(q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]))))
        x, _ = R.block(x, p, pre, n_head)
    return np.stack(maps)


def test_heads_python_api_and_json(tiny_dir, tmp_path, capsys):
    model = GPT2.from_pretrained(tiny_dir)
    idx = torch.tensor([list(b"hello there"), list(b"general kenobi"[:11])])
    w = attention_maps(model, idx)
    assert w.shape == (2, 2, 4, 11, 11)
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 4, 11), atol=1e-5)
    assert (w.triu(1) == 0).all()                           # causal: no weight on later tokens
    # the maps are the ones the model uses: its explicit path with weights reproduces its logits
    logits = model(idx).logits
    model.attn_impl = "explicit"
    assert torch.allclose(model(idx).logits, logits, atol=1e-4)
    # and they are OpenAI's weights softmax(mask(q·kᵀ/√hd)) of every layer, computed in NumPy
    torch.testing.assert_close(w.double(), torch.from_numpy(reference_maps(model, idx)), atol=1e-5, rtol=0)
    assert main(["heads", "abcdefgh", "--model", tiny_dir, "--layer", "0", "--head", "2", "--out",
                 str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["files"]["heads"] == [str(tmp_path / "layer0_head2.png")]
    assert len(data["scores"]["previous"]) == 2 and len(data["scores"]["previous"][0]) == 4
    assert data["tokens"] == list("abcdefgh")
    # one role per head, every raw and relative score, the threshold and the induction ranking
    assert [(r["layer"], r["head"]) for r in data["roles"]] == [(l, h) for l in range(2) for h in range(4)]
    assert all(set(r["scores"]) == {"previous", "first", "self", "induction"} for r in data["roles"])
    assert set(data["relative"]) == {"previous", "first", "self", "induction"} and data["threshold"] == ROLE_THRESHOLD
    assert {"entropy", "entropy_norm", "induction"} <= set(data["scores"]) and len(data["induction"]) == 3


@pytest.mark.parametrize("argv,message", [
    (["x" * 65], "context is n_ctx=64"),
    (["hello", "--layer", "2"], "--layer 2 is out of range: the model has 2 layers"),
    (["hello", "--head", "-1"], "--head -1 is out of range"),
    (["a"], "at least 2 tokens"),
])
def test_heads_bad_input_exits_2(tiny_dir, tmp_path, argv, message, capsys):
    assert main(["heads", *argv, "--model", tiny_dir, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(DEFAULT_MODEL not in builtin_models(), reason=f"built-in model {DEFAULT_MODEL} not installed yet")
def test_heads_on_the_builtin_model(tmp_path, capsys):
    model = GPT2.from_pretrained(DEFAULT_MODEL)
    L, H = model.config.n_layer, model.config.n_head
    assert main(["heads", "ROMEO:\nBut soft, what light", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert_grid_png(tmp_path / "grid.png", L, H)
    page = (tmp_path / "heads.html").read_text()
    assert all(f'id="L{l}H{h}"' in page for l in range(L) for h in range(H))
    assert re.search(r"\d+ of 36 heads have no clear role", text)
    assert re.search(r"strongest induction heads .*: layer \d head \d -?\d\.\d\d, layer", text)
    heads = sorted(tmp_path.glob("layer*_head*.png"))
    assert 1 <= len(heads) <= 4
    for p in heads:
        assert Image.open(p).size == head_geometry(len("ROMEO:\nBut soft, what light"))


# ------------------------------------------------------------------ roles over a baseline
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_random_weights_give_no_head_a_confident_role(seed, scale):
    # GPT-2's init (std 0.02: near-uniform attention) and the same weights scaled 30x (peaked
    # attention, but on keys chosen by random weights): no head reaches the role threshold
    torch.manual_seed(seed)
    model = GPT2(GPT2Config.from_preset("tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    r = analyse_heads(model, "To be, or not to be, that is the question: whether 'tis nobler")
    assert {row["role"] for row in r.roles} == {NO_ROLE}
    assert max(float(v.max()) for v in r.relative.values()) < ROLE_THRESHOLD
    assert strongest_heads(r.relative) == []
    assert set(r.relative) == {"previous", "first", "self", "induction"}
    if scale > 1:      # the attention really is peaked, so the baseline (not flat maps) is what keeps roles away
        assert r.weights.max() > 0.9


def test_induction_score_on_hand_made_maps():
    n = 6
    T = 2 * n
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    induction = uniform.clone()
    for j in range(n):
        induction[n + j] = 0.0
        induction[n + j, j + 1] = 1.0                    # the token after the first occurrence
    duplicate = uniform.clone()
    for j in range(n):
        duplicate[n + j] = 0.0
        duplicate[n + j, j] = 1.0                        # the first occurrence itself: not induction
    w = torch.stack([induction, uniform, duplicate])[None, None]      # [1, 1, 3, T, T]
    raw, rel = induction_from_maps(w)
    assert raw[0].tolist() == pytest.approx([1.0, sum(1 / (n + j + 1) for j in range(n)) / n, 0.0])
    assert rel[0, 0] == pytest.approx(1.0) and rel[0, 1] == pytest.approx(0.0, abs=1e-6) and rel[0, 2] < 0
    with pytest.raises(ValueError, match="2n, 2n"):
        induction_from_maps(torch.ones(1, 1, 1, 5, 5))
    idx = repeated_random_tokens(GPT2Config.from_preset("tiny"), n=8, batch=3)
    assert idx.shape == (3, 16) and torch.equal(idx[:, :8], idx[:, 8:])


@pytest.mark.skipif(DEFAULT_MODEL not in builtin_models(), reason=f"built-in model {DEFAULT_MODEL} not installed yet")
def test_builtin_model_induction_heads_and_why_none_is_confident():
    # The built-in byte model's strongest induction scores are ~0 (README says so). Cross-check from
    # first principles: a model with induction heads predicts a repeated passage better the second
    # time; this one does not.
    from gpt2mha.learn.heads import induction_scores, top_heads
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    raw, rel = induction_scores(model)
    assert rel.shape == (6, 6) and float(rel.max()) < ROLE_THRESHOLD
    assert len(top_heads(rel, 3)) == 3
    text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
    idx = torch.tensor([list(text + text)])
    n = len(text)
    with torch.no_grad():
        logp = torch.log_softmax(model(idx).logits[0, :-1], -1).gather(-1, idx[0, 1:, None])[:, 0]
    first, second = -logp[:n - 1].mean(), -logp[n:].mean()
    assert second > 0.8 * first                           # an induction model would roughly halve this


# ------------------------------------------------------------------- images and page size
@pytest.fixture(scope="module")
def long_result():
    """The built-in model (or a random tiny-width one) on a 150-token prompt."""
    text = open(os.path.join(DATA, "the-verdict.txt")).read()[:150]
    name = DEFAULT_MODEL if DEFAULT_MODEL in builtin_models() else None
    torch.manual_seed(0)
    model = GPT2.from_pretrained(name) if name else GPT2(GPT2Config(n_vocab=256, n_ctx=256, n_embd=48, n_head=6,
                                                                   n_layer=6, tokenizer="bytes"))
    return analyse_heads(model.eval(), text)


def test_grid_png_at_150_tokens_has_a_colour_bar_and_thinned_labels(long_result, tmp_path):
    from gpt2mha.learn.heads_html import write_grid_png
    import matplotlib
    geo = write_grid_png(long_result.weights, long_result.labels, str(tmp_path / "g.png"))
    assert geo["label_step"] == 13 and geo["cell"] == 192               # 192 px / 16 px = 12 labels per axis
    assert geo["notes"] == ["grid.png labels every 13th of 150 tokens (0, 13, 26, ...), each with its position"]
    assert_grid_png(tmp_path / "g.png", 6, 6, 150)
    img = np.asarray(Image.open(tmp_path / "g.png").convert("RGB"), dtype=np.float32)
    x0, y0, x1, y1 = geo["colorbar"]
    column = img[y0 + 2:y1 - 2, (x0 + x1) // 2]                          # top = 1.0, bottom = 0.0
    viridis = matplotlib.colormaps["viridis"]
    top, bottom = (np.array(viridis(v)[:3]) * 255 for v in (1.0, 0.0))
    assert np.abs(column[0] - top).max() < 12 and np.abs(column[-1] - bottom).max() < 12
    assert np.abs(column[len(column) // 2] - np.array(viridis(0.5)[:3]) * 255).max() < 12


def test_heads_html_stays_small_for_long_prompts(long_result, tmp_path):
    from gpt2mha.learn.heads_html import write_html
    T = 150
    info = write_html(long_result, str(tmp_path / "h.html"))
    size = (tmp_path / "h.html").stat().st_size
    maps_bytes = 36 * T * (T + 1) // 2                                   # 8-bit lower triangles
    assert size < maps_bytes * 4 / 3 + 60_000                            # base64 plus the page itself
    data = page_data((tmp_path / "h.html").read_text())
    maps = page_maps(data)
    assert info["layers"] == data["layers"] == list(range(6))
    assert (maps - long_result.weights[:, 0]).abs().max() <= 0.5 / 255 + 1e-6   # rounding only
    # past the limit only the selected heads' layers go in, and the page says so
    info = write_html(long_result, str(tmp_path / "s.html"), selected=[(3, 1)], max_bytes=maps_bytes // 2)
    page = (tmp_path / "s.html").read_text()
    assert info["layers"] == [3] and page_data(page)["layers"] == [3]
    assert "embeds only layer(s) 3" in page and len(page) < size / 3
    assert torch.allclose(page_maps(page_data(page))[0], long_result.weights[3, 0], atol=0.5 / 255 + 1e-6)


@pytest.mark.parametrize("T,step,cell", [(8, 1, 128), (9, 2, 128), (20, 3, 128), (65, 6, 192)])
def test_grid_png_labels_drawn_follow_the_stated_thinning(T, step, cell, tmp_path):
    """The labels matplotlib drew under grid.png's maps: every token up to 8 tokens (128-pixel maps,
    one label per 16 pixels), then every ceil(T/8)-th with its position, and past 64 tokens
    192-pixel maps with every ceil(T/12)-th (README, 'heads'); the note names the step with its
    ordinal."""
    from gpt2mha.learn.heads_html import write_grid_png

    w = torch.softmax(torch.randn(2, 1, 4, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e9), -1)
    labels = [f"t{i}" for i in range(T)]
    geo = write_grid_png(w, labels, str(tmp_path / "g.png"))
    assert (geo["label_step"], geo["cell"]) == (step, cell)
    if step == 1:
        assert geo["labels_drawn"] == labels and geo["notes"] == []
    else:
        assert geo["labels_drawn"] == [f"{i} t{i}" for i in range(0, T, step)]
        assert geo["notes"] == [f"grid.png labels every {ordinal(step)} of {T} tokens (0, {step}, {2 * step}, ...), "
                                f"each with its position"]


def test_ordinal():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]


@pytest.mark.parametrize("flags,first", [(["--layer", "1", "--head", "2"], [1, 2]), (["--layer", "1"], [1, 0]),
                                         (["--head", "3"], [0, 3])])
def test_heads_html_opens_on_the_selected_head(tiny_dir, tmp_path, flags, first, capsys):
    """heads.html starts on the head the command selected (the first one it drew at full size),
    not on layer 0 head 0."""
    out = tmp_path / "maps"
    assert main(["heads", "To be, or not", "--model", tiny_dir, "--out", str(out), "--json", *flags]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert os.path.basename(files["heads"][0]) == f"layer{first[0]}_head{first[1]}.png"
    page = (out / "heads.html").read_text()
    assert page_data(page)["selected"] == first
    assert "select(D.selected[0], D.selected[1]);" in page
