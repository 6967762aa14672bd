"""The activation cache, head ablation, activation patching, logit lens and direct logit
attribution, and the ``ablate``/``patch``/``lens`` commands.

References (first principles, on the model's own weights): a hand-written pre-hook on
``attn.c_proj`` that zeroes a head's columns of its input (what a user wrote before these
tools); the residual stream is the sum of what the embeddings, heads, biases and MLPs add;
patching the whole clean residual stream into the corrupted run gives the clean run; the final
logit lens entry is the model's logits; ``ln_f`` is affine once its divisor is fixed.
tests/test_transformer_lens.py compares the same functions with TransformerLens.
"""

import json
import os

import pytest
import torch
from conftest import small_model

from gpt2mha import GPT2, GPT2Config
from gpt2mha.cli import main
from gpt2mha.learn import interventions as iv
from gpt2mha.learn.activations import ActivationCache

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    return small_model(1, n_layer=2)                  # 97 tokens, 32 wide, 4 heads


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def test_zero_ablation_equals_a_hand_written_c_proj_pre_hook(model, idx):
    hd = model.config.head_dim

    def zero_head(h):
        def pre(module, args):
            x = args[0].clone()
            x[..., h * hd:(h + 1) * hd] = 0
            return (x,)
        return pre
    handles = [model.h[0].attn.c_proj.register_forward_pre_hook(zero_head(3)),
               model.h[1].attn.c_proj.register_forward_pre_hook(zero_head(1))]
    try:
        expected = model(idx).logits
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(iv.ablate_heads(model, idx, "0.3,1.1"), expected, **TOL)
    assert not torch.allclose(expected, model(idx).logits, **TOL)


@torch.no_grad()
def test_mean_ablation_puts_the_head_mean_into_c_proj(model, idx):
    hd = model.config.head_dim
    _, cache = model.run_with_cache(idx, names_filter="blocks.1.attn.hook_z")
    mean = cache["z", 1][:, :, 2].mean(dim=(0, 1))                     # [head_dim]

    def pre(module, args):
        x = args[0].clone()
        x[..., 2 * hd:3 * hd] = mean
        return (x,)
    handle = model.h[1].attn.c_proj.register_forward_pre_hook(pre)
    try:
        expected = model(idx).logits
    finally:
        handle.remove()
    torch.testing.assert_close(iv.ablate_heads(model, idx, [(1, 2)], mean=True), expected, **TOL)


def test_parse_heads_names_the_bad_entry():
    assert iv.parse_heads("0.3, 1.5,0.3", 2, 6) == [(0, 3), (1, 5)]
    for bad, needle in (("2.0", "layer 2 is out of range"), ("0.6", "head 6 is out of range"),
                        ("0-3", "not layer.head"), ("", "names no head")):
        with pytest.raises(ValueError, match=needle):
            iv.parse_heads(bad, 2, 6)


@torch.no_grad()
def test_cache_answers_to_every_spelling_and_stacks_the_residual_stream(model, idx):
    logits, cache = model.run_with_cache(idx)
    assert isinstance(cache, ActivationCache) and "h.0.attn.hook_result" not in cache   # opt-in
    assert cache["blocks.1.attn.hook_pattern"] is cache["pattern", 1] is cache["h.1.attn.hook_pattern"]
    assert cache["resid_post", -1] is cache["blocks.1.hook_resid_post"] and cache["embed"] is cache["hook_embed"]
    with pytest.raises(KeyError, match="not in this cache"):
        cache["blocks.0.attn.hook_result"]
    # the last layer's residual stream = embeddings + every head + attention biases + MLPs
    heads, labels = cache.stack_head_results(return_labels=True)
    assert labels[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"] and heads.shape == (8, 2, 8, 32)
    parts = cache["hook_embed"] + cache["hook_pos_embed"] + heads.sum(0)
    for l in range(2):
        parts = parts + model.h[l].attn.c_proj.bias + cache["mlp_out", l]
    torch.testing.assert_close(parts, cache["resid_post", 1], **TOL)
    stack, labels = cache.accumulated_resid(incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"]
    torch.testing.assert_close(stack[1], cache["resid_pre", 0] + cache["attn_out", 0], **TOL)
    torch.testing.assert_close(iv.lens_logits(model, cache)[-1], logits, **TOL)


@torch.no_grad()
def test_direct_logit_attributions_add_up_to_the_logit(model, idx):
    logits, cache = model.run_with_cache(idx)
    answer, wrong = torch.tensor([5, 9]), torch.tensor([7, 7])
    dla = iv.direct_logit_attribution(model, cache, answer, wrong)     # [B, L, h]
    assert dla.shape == (2, 2, 4)
    rest, _ = cache.stack_head_results(incl_remainder=True, pos_slice=-1, return_labels=True)
    scaled = cache.apply_ln_to_stack(rest[-1:], pos_slice=-1)[0]      # everything but the heads
    W, g, b = model.wte.weight, model.ln_f.weight, model.ln_f.bias
    d = W[answer] - W[wrong]
    total = dla.sum((1, 2)) + (scaled * g * d).sum(-1) + (b * d).sum(-1)
    torch.testing.assert_close(total, logits[torch.arange(2), -1, answer] - logits[torch.arange(2), -1, wrong], **TOL)


@torch.no_grad()
def test_patching_the_whole_clean_stream_restores_the_clean_metric(model, idx):
    clean, corrupt = idx[:1], idx[1:]
    metric = iv.logit_diff(4, 11)
    res = iv.patch(model, clean, corrupt, "resid_pre", metric, per_position=False)
    assert res.axes == ("layer",)
    torch.testing.assert_close(res.values, torch.full((2,), res.clean), **TOL)   # layer 0 and 1: all positions
    by_pos = iv.patch(model, clean, corrupt, "resid_post", metric, batch_size=3)
    assert by_pos.values.shape == (2, 8)
    torch.testing.assert_close(by_pos.values[1, -1], torch.tensor(res.clean), **TOL)   # last layer, last position
    torch.testing.assert_close(by_pos.values[1, :-1], torch.full((7,), res.corrupt), **TOL)   # earlier: no effect
    heads = iv.patch(model, clean, corrupt, "blocks.1.attn.hook_z", metric, batch_size=1)
    assert heads.axes == ("layer", "head") and heads.values.shape == (1, 4)
    # a head's patch = that head's clean output in the corrupted run, by hand
    _, cc = model.run_with_cache(clean, names_filter="blocks.1.attn.hook_z")
    hand = model.run_with_hooks(corrupt, [("blocks.1.attn.hook_z",
                                           lambda z, hook: torch.cat([z[:, :, :2], cc["z", 1][:, :, 2:3], z[:, :, 3:]], 2))])
    torch.testing.assert_close(heads.values[0, 2], metric(hand), **TOL)
    with pytest.raises(ValueError, match="same shape"):
        iv.patch(model, clean, corrupt[:, :5], "z", metric)
    with pytest.raises(ValueError, match="cannot be patched"):
        iv.patch(model, clean, corrupt, "blocks.0.hook_zz", metric)


@torch.no_grad()
def test_logit_lens_final_row_is_the_models_distribution(model, idx):
    lens = iv.logit_lens(model, idx, top_k=4)
    assert lens.labels == ["0_pre", "1_pre", "final_post"] and lens.ids.shape == (3, 2, 8, 4)
    probs = model(idx).logits.softmax(-1)
    top = probs.topk(4, dim=-1)
    assert torch.equal(lens.ids[-1], top.indices)
    torch.testing.assert_close(lens.probs[-1], top.values, **TOL)
    torch.testing.assert_close(lens.target_probs[-1, :, :-1], probs[:, :-1].gather(-1, idx[:, 1:, None])[..., 0], **TOL)
    with pytest.raises(ValueError, match="top_k=0"):
        iv.logit_lens(model, idx, top_k=0)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    torch.manual_seed(0)
    m = GPT2(GPT2Config(n_vocab=256, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes"))
    path = tmp_path_factory.mktemp("bytes") / "m"
    m.save_pretrained(str(path))
    return str(path)


def test_ablate_command_reports_the_shift_of_the_api(byte_model, capsys):
    assert main(["ablate", "To be, or", "--heads", "0.3,1.1", "--model", byte_model, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = GPT2.from_pretrained(byte_model).eval()
    idx = torch.tensor([list(b"To be, or")])
    with torch.no_grad():
        before = model(idx).logits[0, -1].softmax(-1)
        after = iv.ablate_heads(model, idx, [(0, 3), (1, 1)])[0, -1].softmax(-1)
    assert out["heads"] == [[0, 3], [1, 1]] and out["mode"] == "zero"
    for row in out["tokens"]:
        assert row["before"] == pytest.approx(float(before[row["id"]]), abs=1e-6)
        assert row["after"] == pytest.approx(float(after[row["id"]]), abs=1e-6)
    assert out["kl"] == pytest.approx(float((before * (before.log() - after.log())).sum()), abs=1e-5)
    assert main(["ablate", "To be", "--heads", "2.0", "--model", byte_model]) == 2
    assert "layer 2 is out of range" in capsys.readouterr().err


def test_patch_and_lens_commands_write_pictures_and_json(byte_model, tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["patch", "ab cd", "ab ce", "--answer", "x", "--wrong", "y", "--model", byte_model,
                 "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    model = GPT2.from_pretrained(byte_model).eval()
    expected = iv.patch(model, torch.tensor([list(b"ab cd")]), torch.tensor([list(b"ab ce")]), "z",
                        iv.logit_diff(ord("x"), ord("y")))
    torch.testing.assert_close(torch.tensor(printed["values"]), expected.values, **TOL)
    assert json.loads((out / "patch.json").read_text())["values"] == printed["values"]
    from PIL import Image
    assert Image.open(out / "patch.png").size[0] > 200
    assert main(["patch", "ab cd", "ab c", "--answer", "x", "--wrong", "y", "--model", byte_model,
                 "--out", str(out)]) == 2
    assert "same length" in capsys.readouterr().err
    assert main(["patch", "ab cd", "ab ce", "--answer", "x", "--model", byte_model, "--out", str(out)]) == 2
    assert "--wrong" in capsys.readouterr().err
    lens_dir = tmp_path / "l"
    assert main(["lens", "hello", "--model", byte_model, "--out", str(lens_dir)]) == 0
    text = capsys.readouterr().out
    assert "final_post" in text and os.path.exists(lens_dir / "lens.png")
    saved = json.loads((lens_dir / "lens.json").read_text())
    top_final = model(torch.tensor([list(b"hello")])).logits[0].argmax(-1)
    from gpt2mha.io.tokenizer import tokenizer_for
    from gpt2mha.learn.heads import token_labels
    assert [row[0] for row in saved["top"][-1]] == token_labels(tokenizer_for(model.config), top_final.tolist())


def test_lens_json_gives_token_ids_beside_the_labels(byte_model, tmp_path, capsys):
    """lens --json: the prompt's ids (the byte tokenizer's: the UTF-8 bytes) and each cell's top
    ids, in the shape of ``top`` and ``probs``, the final row the model's own top-k; the labels
    are those ids' labels."""
    from gpt2mha.io.tokenizer import tokenizer_for
    from gpt2mha.learn.heads import token_labels

    assert main(["lens", "h\u00e9 !", "--model", byte_model, "--top", "2", "--out", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == list("h\u00e9 !".encode("utf-8"))
    model = GPT2.from_pretrained(byte_model).eval()
    tok = tokenizer_for(model.config)
    assert printed["tokens"] == token_labels(tok, printed["token_ids"])
    ids = torch.tensor(printed["top_ids"])
    assert ids.shape == (3, 5, 2) == torch.tensor(printed["probs"]).shape
    with torch.no_grad():
        assert ids[-1].tolist() == model(torch.tensor([printed["token_ids"]])).logits[0].topk(2).indices.tolist()
    assert printed["top"] == [[token_labels(tok, cell) for cell in row] for row in printed["top_ids"]]
    assert json.loads((tmp_path / "lens.json").read_text()) == printed


def test_ablate_top_and_lens_columns_out_of_range_are_usage_errors(byte_model, tmp_path, capsys):
    """``ablate --top 0``, ``--top`` beyond the vocabulary and ``lens --columns 0`` are errors
    naming the flag (exit 2), as ``lens --top 0`` is, not a traceback or an empty table."""
    for argv, says in [(["ablate", "To be", "--heads", "0.1", "--top", "0"], "--top=0 must be >= 1"),
                       (["ablate", "To be", "--heads", "0.1", "--top", "100000"],
                        "--top=100000 must be at most the model's vocabulary, n_vocab=256"),
                       (["lens", "To be", "--columns", "0", "--out", str(tmp_path / "l")], "--columns=0 must be >= 1"),
                       (["lens", "To be", "--columns", "-3", "--out", str(tmp_path / "l")], "--columns=-3 must be >= 1"),
                       (["lens", "To be", "--top", "0", "--out", str(tmp_path / "l")], "--top=0 must be >= 1")]:
        assert main([*argv, "--model", byte_model]) == 2, argv
        captured = capsys.readouterr()
        assert says in captured.err and captured.out == "", argv
    assert main(["ablate", "To be", "--heads", "0.1", "--top", "256", "--model", byte_model]) == 0  # the whole vocabulary


def test_patch_warns_when_clean_and_corrupt_metrics_are_too_close_to_normalise(byte_model, tmp_path, capsys):
    """The restored share divides by clean - corrupt: below MIN_METRIC_GAP (1 nat) the command
    says so on stderr, in patch.json and in the picture's title; a gap of 1 or more does not."""
    p = iv.Patching(torch.tensor([[3.6]]), ("layer", "head"), clean=3.529, corrupt=3.642, hook="z")
    assert p.normalized().item() == pytest.approx(0.372, abs=1e-3)
    assert "differ by only 0.113" in p.normalization_warning()
    assert iv.Patching(torch.tensor([[1.0]]), ("layer", "head"), 3.0, 2.0, "z").normalization_warning() is None
    assert iv.MIN_METRIC_GAP == 1.0
    out = tmp_path / "p"
    assert main(["patch", "ab cd", "ab ce", "--answer", "x", "--wrong", "y", "--model", byte_model,
                 "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert abs(printed["clean"] - printed["corrupt"]) < 1                   # random weights: a small gap
    assert printed["warning"] and "differ by only" in printed["warning"]
    assert captured.err.startswith("warning: the clean and corrupted metrics differ by only")


@pytest.mark.parametrize("layers,cols", [(6, 6), (12, 12), (48, 25)])
def test_pictures_fit_their_titles_and_labels_at_a_readable_size(layers, cols):
    """patch.png and lens.png at 6 x 6, 12 x 12 and 48 x 25: every text drawn (the two-line title,
    tick labels, axis and colour-bar labels) lies inside the canvas and is at least MIN_FONT_PX
    (11) pixels tall; the lens of a long prompt grows downwards, not into a wide strip."""
    from matplotlib.text import Text

    from gpt2mha.learn import intervention_plots as plots

    title = ("patching z: logit-diff, answer 'x' vs 'y'\n1 = the patch restores the clean run, 0 = no effect\n"
             "unreliable: clean and corrupt differ by 0.113")
    heat = plots.heatmap_figure(torch.randn(layers, cols), [str(i) for i in range(layers)],
                                [str(i) for i in range(cols)], title, "head", "layer", "restored share")
    names = [f"{i}_pre" for i in range(layers)] + ["final_post"]
    lens = plots.lens_figure(torch.rand(layers + 1, cols), [[f"tok{r}_{t}" for t in range(cols)] for r in names],
                             names, [f"{t}:w{t}" for t in range(cols)],
                             f"logit lens: top token of the residual stream through ln_f and the head ({cols} tokens)")
    for fig, heading in ((heat, title), (lens, f"logit lens: top token of the residual stream through ln_f and the "
                                                f"head ({cols} tokens)")):
        fig.canvas.draw()
        renderer, canvas = fig.canvas.get_renderer(), fig.bbox
        tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)    # everything drawn, in pixels
        assert tight.x0 >= 0 and tight.y0 >= 0 and tight.x1 <= canvas.x1 and tight.y1 <= canvas.y1, tight
        main_axes = fig.axes[0]
        [shown_title] = [t for t in fig.findobj(Text) if t.get_text() == heading]
        texts = [shown_title, main_axes.xaxis.label, main_axes.yaxis.label, fig.axes[1].yaxis.label,
                 *main_axes.get_xticklabels(), *main_axes.get_yticklabels()]
        for t in texts:
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= canvas.x1 and box.y1 <= canvas.y1, t.get_text()
        for t in fig.findobj(Text):
            if t.get_visible() and t.get_text():
                assert t.get_fontsize() * fig.dpi / 72 >= plots.MIN_FONT_PX, (t.get_text(), t.get_fontsize())
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_lens_picture_of_a_long_prompt_runs_down_with_readable_cells(tmp_path):
    """The built-in model's 6 layers over 47 tokens (lens.png was 2274 x 250 px): a row per
    position, so the picture is taller than wide, every row at least 18 px."""
    from PIL import Image

    from gpt2mha.learn import intervention_plots as plots

    names = [f"{i}_pre" for i in range(6)] + ["final_post"]
    size = plots.lens_picture(str(tmp_path / "lens.png"), torch.rand(7, 47), [["e"] * 47 for _ in names], names,
                              [f"{t}:e" for t in range(47)], "logit lens (47 tokens)")
    assert Image.open(tmp_path / "lens.png").size == size
    assert size[1] > size[0] and size[1] >= 47 * 18 and size[0] < 1000, size


def test_patch_usage_says_what_the_default_metric_requires(capsys):
    """The usage line (in --help, in a usage error and on the generated CLI reference page) shows
    --answer as required and --wrong as required unless --metric logprob, as the command enforces;
    every option still appears once, the line wrapped within argparse's width; a missing
    --answer is argparse's usage error naming it (exit 2)."""
    import importlib.util
    import pathlib

    from gpt2mha.cli import build_parser

    path = pathlib.Path(__file__).parent.parent / "docs_hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    sub = hook.subcommands(build_parser())["patch"][0]
    usage = sub.format_usage()
    flat = " ".join(usage.split())
    assert flat.startswith("usage: gpt2mha patch [-h] [--metric {logit-diff,logprob}] --answer TEXT "
                           "(--wrong TEXT | --metric logprob) [--hook HOOK]") and flat.endswith("[--json] CLEAN CORRUPT")
    assert "[--wrong" not in flat and "[--answer" not in flat
    for action in hook.arguments(sub):
        for flag in action.option_strings:
            assert f"{flag} " in flat or f"{flag}]" in flat, flag
    assert all(len(line) <= sub._get_formatter()._width for line in usage.splitlines())
    assert usage.strip() in hook.render()
    with pytest.raises(SystemExit) as e:
        main(["patch", "ab", "ac"])
    assert e.value.code == 2 and "the following arguments are required: --answer" in capsys.readouterr().err
