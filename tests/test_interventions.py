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
