"""gpt2mha.learn.check and ``gpt2mha check``: the project's layouts pass, each classic mistake in
tests/data/broken_mha/ is caught with the right diagnosis, bad input gives exit code 2."""

import itertools
import re
import json
import os
import subprocess
import sys

import pytest
import torch

from gpt2mha.learn.check import CheckError, check
from gpt2mha.learn.check_layout import recognise_layout
from gpt2mha.learn.check_load import parse_args
from gpt2mha.learn.check_reference import MISTAKES, TOL, applicable_mistakes, make_params, reference
from gpt2mha.cli import main

DATA = os.path.join(os.path.dirname(__file__), "data")
BROKEN = os.path.join(DATA, "broken_mha")
GOOD = os.path.join(DATA, "good_mha.py")


# ------------------------------------------------------------------------ passing layouts
@pytest.mark.parametrize("target,kind,cache", [
    ("gpt2mha.core.attention:CausalSelfAttention", "fused", True),
    ("gpt2mha.learn.book:MultiHeadAttention", "split", True),
    ("gpt2mha.learn.book:MultiHeadAttentionWrapper", "wrapper", False),
    (f"{GOOD}:BookMultiHeadAttention", "split", False),
    (f"{GOOD}:BookWrapper", "wrapper", False),
    (f"{GOOD}:HFStyleAttention", "split", False),
    (f"{GOOD}:FusedLinearAttention", "fused", False),
])
def test_correct_modules_match(target, kind, cache):
    r = check(target)
    assert (r.verdict, r.exit_code) == ("match", 0), r.error or r.diagnoses
    assert r.layout.startswith(kind)
    assert r.max_abs_error < 1e-5 and r.diagnoses == [] and r.first_differing_stage is None
    assert r.cache.startswith("tested") == cache
    if cache:
        assert r.cache_max_abs_error < 1e-5
    # every stage the layout has was found by value (SDPA never materialises scores and weights)
    missing = {s.stage for s in r.stages if not s.found}
    sdpa = target.endswith(("CausalSelfAttention", "FusedLinearAttention"))
    assert missing <= ({"scores", "weights"} if sdpa else set())
    # rebuilt with another head count and run past 64 tokens, the cache included
    assert [v.label.partition("=")[0] for v in r.variations][-1] == "T" and len(r.variations) == 2
    assert all(v.ok and v.max_abs_error < 1e-5 for v in r.variations)
    assert r.variations[-1].config["T"] == 70 and r.variations[0].config["num_heads"] != 4
    assert all(v.cache_status == ("tested" if cache else "none") for v in r.variations)


def test_project_layouts_pass_through_the_cli_with_args(capsys):
    assert main(["check", "gpt2mha.core.attention:CausalSelfAttention", "--args", '{"n_embd": 36, "n_head": 6}']) == 0
    out = capsys.readouterr().out
    assert "layout: fused (c_attn, c_proj) d_in=36 d_out=36 num_heads=6 head_dim=6" in out
    assert "result: MATCH" in out and "cache: tested" in out
    assert main(["check", "gpt2mha.learn.book:MultiHeadAttention", "--args", "d_in=12,d_out=16", "num_heads=2",
                 "qkv_bias=true", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "match" and data["kwargs"]["qkv_bias"] is True and data["config"]["head_dim"] == 8


# ------------------------------------------------------------------------ classic mistakes
BROKEN_CASES = [  # file, diagnosis, exit code, first differing stage
    ("interleaved_qkv", "interleaved_qkv", 1, "view"),
    ("missing_transpose", "merge_no_transpose", 1, "merged"),
    ("missing_transpose_split", "split_no_transpose", 2, "transpose"),
    ("view_non_contiguous", "view_non_contiguous", 2, "merged"),
    ("scale_d_out", "scale_d_out", 1, "weights"),
    ("scale_d_in", "scale_d_in", 1, "weights"),
    ("no_causal_mask", "no_mask", 1, "weights"),
    ("mask_no_cache_offset", "mask_not_offset", 1, "weights (cached step)"),
    ("softmax_wrong_axis", "softmax_queries", 1, "weights"),
    ("heads_wrong_order", "merge_wrong_order", 1, "merged"),
    ("missing_out_proj", "no_out_proj", 1, "output"),
    ("mask_after_softmax", "mask_after_softmax", 1, "weights"),
    ("anti_causal_mask", "anti_causal_mask", 1, "weights"),
    ("split_keys_wrong", "split_keys_no_transpose", 1, "view"),
    # wrong only on the cached path, each under another cache convention
    ("past_key_values_no_offset", "mask_not_offset", 1, "weights (cached step)"),
    ("hf_cache_ignores_past", "past_ignored", 1, "scores (cached step)"),
    ("cache_object_overwrites", "past_ignored", 1, "scores (cached step)"),
    ("kv_cache_dict_wrong_order", "past_after_new", 1, "scores (cached step)"),
    ("use_cache_no_position", "mask_not_offset", 1, "weights (cached step)"),
    # right only with the head count asked for by default
    ("hard_coded_heads", "hard_coded_heads", 1, "view (num_heads=3)"),
]


@pytest.mark.parametrize("name,diagnosis,code,stage", BROKEN_CASES, ids=[c[0] for c in BROKEN_CASES])
def test_each_classic_mistake_is_caught_with_the_right_diagnosis(name, diagnosis, code, stage):
    r = check(os.path.join(BROKEN, f"{name}.py") + ":MultiHeadAttention")
    assert r.exit_code == code and r.verdict == ("mismatch" if code == 1 else "error")
    assert r.diagnoses == [diagnosis]
    assert r.first_differing_stage == stage
    if code == 1:
        errors = [r.max_abs_error, r.cache_max_abs_error] + [v.max_abs_error for v in r.variations]
        assert max(e for e in errors if e is not None) > 1e-3
    else:
        assert "forward raised RuntimeError" in r.error and f"{name}.py line" in r.error


def test_broken_modules_fail_the_way_the_report_says(capsys):
    assert main(["check", os.path.join(BROKEN, "mask_no_cache_offset.py:MultiHeadAttention")]) == 1
    out = capsys.readouterr().out
    # without a cache it is right: the printed error is below the match tolerance (not exactly 0:
    # the module and the reference sum in different orders on some CPUs and thread counts)
    err = float(re.search(r"output max abs error: (\S+) \(match below", out).group(1))
    assert err < TOL
    assert "cache: tested: 3 past tokens" in out and "not offset for a cache" in out
    assert "result: MISMATCH" in out
    assert main(["check", os.path.join(BROKEN, "missing_transpose_split.py:MultiHeadAttention")]) == 2
    out = capsys.readouterr().out
    assert "(2, 5, 4, 4)" in out and "SHAPE differs" in out           # scores (b, T, h, h) seen
    assert "missing transpose" in out and "result: COULD NOT RUN" in out
    assert main(["check", os.path.join(BROKEN, "missing_out_proj.py:MultiHeadAttention")]) == 1
    assert "out_proj is defined but forward never called it" in capsys.readouterr().out


def test_every_mistake_changes_the_output_under_the_default_configuration():
    # otherwise two diagnoses could not be told apart (d_in=20, d_out=24, 4 heads of 6, T=5)
    from gpt2mha.learn.check_layout import Layout, Proj
    gen = torch.Generator().manual_seed(0)
    W = torch.zeros(72, 20)
    layout = Layout("fused", 20, 24, 4, qkv=Proj("qkv", W, torch.zeros(72), False),
                    out=Proj("o", torch.zeros(24, 24), torch.zeros(24), False))
    p = make_params(layout, gen)
    x = torch.randn(2, 8, 20, generator=gen)
    outs = {m: reference(x, p, 4, past=3, mistakes={m})["output"] for m in applicable_mistakes(layout, True)}
    outs["correct"] = reference(x, p, 4, past=3)["output"]
    for (a, ya), (b, yb) in itertools.combinations(outs.items(), 2):
        assert not torch.allclose(ya, yb, atol=1e-3, equal_nan=True), (a, b)


def test_reference_equals_causal_self_attention_with_a_cache():
    from gpt2mha import CausalSelfAttention
    attn = CausalSelfAttention(24, 4)
    layout = recognise_layout(attn)
    p = make_params(layout, torch.Generator().manual_seed(1))
    from gpt2mha.learn.check_reference import copy_params
    copy_params(layout, p)
    x = torch.randn(2, 8, 24)
    _, present = attn(x[:, :3])
    y, _ = attn(x[:, 3:], present)
    assert torch.allclose(reference(x, p, 4, past=3)["output"], y, atol=1e-5)


def test_equal_widths_make_scale_mistakes_ambiguous_and_the_report_says_both():
    r = check(os.path.join(BROKEN, "scale_d_out.py:MultiHeadAttention"), {"d_in": 24, "d_out": 24})
    assert r.exit_code == 1 and r.diagnoses == ["scale_d_out", "scale_d_in"]


def test_out_proj_is_optional_a_module_without_one_is_checked_without_it(tmp_path):
    # the book calls out_proj optional: the reference drops it too
    src = open(os.path.join(BROKEN, "missing_out_proj.py")).read().replace(
        "        self.out_proj = nn.Linear(d_out, d_out)\n", "")
    (tmp_path / "no_proj.py").write_text(src)
    r = check(f"{tmp_path / 'no_proj.py'}:MultiHeadAttention")
    assert (r.verdict, r.exit_code, r.diagnoses) == ("match", 0, [])
    assert r.max_abs_error < 1e-5 and "no output projection" in r.layout
    assert any("checked against the reference without one" in n for n in r.notes)


# ------------------------------------------------------------------------------ bad input
def test_missing_file_and_class(capsys):
    assert main(["check", os.path.join(BROKEN, "nope.py") + ":MultiHeadAttention"]) == 2
    assert "nope.py: no such file" in capsys.readouterr().out
    assert main(["check", GOOD + ":Nope"]) == 2
    out = capsys.readouterr().out
    assert "no class 'Nope'" in out and "BookMultiHeadAttention, BookWrapper" in out and "COULD NOT RUN" in out
    assert main(["check", GOOD]) == 2
    assert "expected FILE.py:ClassName" in capsys.readouterr().out


def test_unrecognised_layout_lists_the_parameters_found(capsys):
    assert main(["check", os.path.join(BROKEN, "unrecognised.py:Mystery"), "--args", "d_in=20", "d_out=24",
                 "num_heads=4"]) == 2
    out = capsys.readouterr().out
    assert "cannot recognise the parameter layout of Mystery" in out
    assert "alpha.weight [73, 20], alpha.bias [73], omega.weight [24, 24], omega.bias [24]" in out
    assert "W_query/W_key/W_value" in out


def test_import_errors_constructor_errors_and_bad_args(tmp_path, capsys):
    (tmp_path / "boom.py").write_text("import torch\nraise RuntimeError('boom at import')\n")
    assert main(["check", f"{tmp_path / 'boom.py'}:X"]) == 2
    out = capsys.readouterr().out
    assert "importing it raised RuntimeError: boom at import" in out and "boom.py line 2" in out
    (tmp_path / "needs.py").write_text("from torch import nn\n\nclass M(nn.Module):\n"
                                       "    def __init__(self, d_in, flavour):\n        super().__init__()\n")
    assert main(["check", f"{tmp_path / 'needs.py'}:M"]) == 2
    assert "needs 'flavour'" in capsys.readouterr().out
    assert main(["check", GOOD + ":BookMultiHeadAttention", "--args", "d_out=25"]) == 2
    assert "d_out must be divisible by num_heads" in capsys.readouterr().out
    assert main(["check", GOOD + ":BookMultiHeadAttention", "--args", "oops"]) == 2
    assert "expected key=value" in capsys.readouterr().err
    assert main(["check", GOOD + ":BookMultiHeadAttention", "--args", "context_length=4"]) == 2
    assert "shorter than the check's tokens = 5" in capsys.readouterr().out       # forward takes no cache
    assert main(["check", "gpt2mha.learn.book:MultiHeadAttention", "--args", "context_length=6"]) == 2
    assert "shorter than the check's past + tokens = 8" in capsys.readouterr().out


def test_parse_args():
    assert parse_args(['{"d_in": 3, "qkv_bias": true}', "d_out=4,num_heads=2", "name=abc", "dropout=0.0"]) == \
        {"d_in": 3, "qkv_bias": True, "d_out": 4, "num_heads": 2, "name": "abc", "dropout": 0.0}
    with pytest.raises(CheckError):
        parse_args(["[1, 2]"])


def test_help_warns_that_the_file_runs_and_exit_codes_from_a_real_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-m", "gpt2mha.cli", "check", "--help"], capture_output=True, text=True,
                         env=env)
    text = " ".join(run.stdout.split())
    assert run.returncode == 0 and "runs its code" in text and "Exit code 0: matches; 1: runs but" in text
    run = subprocess.run([sys.executable, "-m", "gpt2mha.cli", "check",
                          os.path.join(BROKEN, "no_causal_mask.py:MultiHeadAttention"), "--json"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 1
    data = json.loads(run.stdout)
    assert data["diagnoses"] == ["no_mask"] and data["diagnosis_text"] == [MISTAKES["no_mask"]]
    assert data["exit_code"] == 1 and data["first_differing_stage"] == "weights"


# ---------------------------------------------------------------------- what learners write
LEARNER = os.path.join(DATA, "learner_mha.py")


def test_the_books_single_head_causal_attention_passes(capsys):
    assert main(["check", "gpt2mha.learn.book:CausalAttention"]) == 0
    out = capsys.readouterr().out
    assert "num_heads=1 head_dim=24 (single head" in out and "no output projection" in out
    assert "result: MATCH" in out
    r = check(f"{GOOD}:CausalAttention", {"d_in": 7, "d_out": 5})
    assert r.verdict == "match" and r.config["head_dim"] == 5
    # the scores/weights/contexts stages are found per head, without a head axis: [b, T, T]
    assert {s.stage for s in r.stages if s.found} == {"input", "projections", "scores", "weights", "contexts", "output"}


@pytest.mark.parametrize("name", ["SelfAttention_v1", "SelfAttention_v2"])
def test_the_books_non_causal_single_heads_are_checked_and_reported_as_unmasked(name):
    # sections 3.3-3.4 of the book: one head, no mask; the checker must say exactly that
    r = check(f"{LEARNER}:{name}")
    assert (r.verdict, r.diagnoses, r.first_differing_stage) == ("mismatch", ["no_mask"], "weights")
    assert "single head" in r.layout
    if name == "SelfAttention_v1":                                    # bare [d_in, d_out] weights, x @ W
        assert any("tried both conventions; reporting [in, out], used as x @ W" in n for n in r.notes)


@pytest.mark.parametrize("name,kind,heads_from", [
    ("HeadsFromDefault", "split", "signature default num_heads=3"),
    ("LinearConventionParams", "split", "self.h = 4"),
    ("CausalBareHead", "split", None),
    ("TorchMHABatchFirst", "fused", "attn.num_heads = 4"),
    ("TorchMHASeqFirst", "fused", "mha.num_heads = 4"),
    ("TorchMHASeparateWeights", "split", "mha.num_heads = 4"),
])
def test_learner_layouts_match(name, kind, heads_from):
    r = check(f"{LEARNER}:{name}")
    assert (r.verdict, r.exit_code) == ("match", 0), (r.error, r.diagnoses, r.notes)
    assert r.layout.startswith(kind) and r.max_abs_error < 1e-5
    if heads_from:
        assert f"num_heads from {heads_from}" in r.layout
    else:
        assert "single head" in r.layout
    if name.startswith("TorchMHA"):
        assert "torch.nn.MultiheadAttention at" in r.layout


def test_bare_weights_report_the_convention_the_module_uses():
    r = check(f"{LEARNER}:LinearConventionParams")
    assert any("stores them [out, in], used as x @ W.T" in n for n in r.notes)
    r = check(f"{LEARNER}:CausalBareHead")
    assert any("stores them [in, out], used as x @ W" in n for n in r.notes)
    # square weights: both conventions fit the shapes, only one computes the right output
    r = check(f"{LEARNER}:LinearConventionParams", {"d_in": 24, "d_out": 24})
    assert r.verdict == "match" and any("[out, in]" in n for n in r.notes)


def test_head_count_from_a_constructor_argument_under_an_unknown_name(tmp_path):
    # the count is a required argument named "heads", stored as self.nh: only the argument passed tells it
    src = open(LEARNER).read().replace("def __init__(self, d_in, d_out, heads=4):", "def __init__(self, d_in, d_out, heads):")
    src = src.replace("self.h = heads", "self.nh = heads").replace("self.h,", "self.nh,")
    (tmp_path / "m.py").write_text(src)
    r = check(f"{tmp_path / 'm.py'}:LinearConventionParams", {"heads": 2})
    assert r.verdict == "match" and "num_heads from constructor argument heads=2" in r.layout


def test_torch_multihead_attention_weights_are_copied_in():
    # an independent look: after the check, the module's own in_proj/out_proj hold the reference weights,
    # so running torch's MultiheadAttention on them reproduces the reference output
    from gpt2mha.learn.check_load import load_class
    from gpt2mha.learn.check_reference import copy_params
    cls = load_class(f"{LEARNER}:TorchMHABatchFirst")
    m = cls(24, 4).eval()
    layout = recognise_layout(m, {})
    p = make_params(layout, torch.Generator().manual_seed(3))
    copy_params(layout, p)
    assert torch.equal(m.attn.in_proj_weight, torch.cat([p.Wq, p.Wk, p.Wv]))
    x = torch.randn(2, 6, 24)
    with torch.no_grad():
        assert torch.allclose(m(x), reference(x, p, 4)["output"], atol=1e-5)


def test_dropout_without_training_flag_is_caught_in_eval_mode(capsys):
    assert main(["check", os.path.join(BROKEN, "dropout_in_eval.py:MultiHeadAttention")]) == 1
    out = capsys.readouterr().out
    err = float(re.search(r"output max abs error: (\S+) \(match below", out).group(1))
    assert err < TOL                                          # with dropout 0 it is right
    assert "dropout: FAILED: in eval mode with dropout=0.5" in out and "training=self.training" in out
    # the correct book module passes the same test
    r = check("gpt2mha.learn.book:MultiHeadAttention")
    assert r.verdict == "match" and r.dropout.startswith("tested: in eval mode with dropout=0.5")


def test_tokens_need_room_for_the_cache_only_when_the_cache_is_tested():
    r = check(f"{GOOD}:BookMultiHeadAttention", {"context_length": 6}, tokens=6, past=3)
    assert r.verdict == "match" and r.cache.startswith("not tested")
    # a context length given caps the longer length: said, not silently skipped
    assert [v.label for v in r.variations] == ["num_heads=3"]
    assert any("not checked at 70 tokens: context_length=6 was given" in n for n in r.notes)
    r = check(f"{GOOD}:BookMultiHeadAttention", {"context_length": 40})
    assert r.verdict == "match" and r.variations[-1].label == "T=40"
    r = check(f"{GOOD}:BookMultiHeadAttention", tokens=20)           # default context grows to the tokens
    assert r.verdict == "match" and r.kwargs["context_length"] == 20
    r = check("gpt2mha.learn.book:MultiHeadAttention", tokens=20, past=3)
    assert r.verdict == "match" and r.kwargs["context_length"] == 23 and r.cache.startswith("tested")


def test_torch_multihead_attention_without_a_causal_mask_is_diagnosed(tmp_path):
    (tmp_path / "m.py").write_text(
        "from torch import nn\n\n\nclass M(nn.Module):\n    def __init__(self, d_model, nhead):\n"
        "        super().__init__()\n        self.attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)\n\n"
        "    def forward(self, x):\n        return self.attn(x, x, x)[0]\n")
    r = check(f"{tmp_path / 'm.py'}:M")
    assert (r.verdict, r.diagnoses) == ("mismatch", ["no_mask"])
    assert "torch.nn.MultiheadAttention at attn (batch_first=True)" in r.layout
    assert not any("never called" in n for n in r.notes)       # MHA uses out_proj.weight, not out_proj(...)


# -------------------------------------------------------- every path compared: caches, heads, lengths
CACHE_CONVENTIONS = [  # correct class in good_mha.py, how the cache must have been passed
    ("HFLegacyPastKeyValues", "past_key_values=present"),
    ("HFCacheObject", "past_key_values = a cache object with transformers' Cache interface"),
    ("InPlaceDictCache", "kv_cache = a dict filled in place"),
    ("OwnCacheObject", "cache = a KVCache(max_batch_size=2, max_seq_len=8, n_heads=4, head_dim=6) filled in place"),
    ("BookKVCache", "use_cache=True, the cache kept in the module"),
    ("LlamaStartPos", "start_pos, the cache kept in the module"),
]


@pytest.mark.parametrize("name,how", CACHE_CONVENTIONS, ids=[c[0] for c in CACHE_CONVENTIONS])
def test_each_cache_convention_is_compared_and_a_correct_module_matches(name, how):
    # the cached step (3 tokens, then 5 with what the first call cached) must equal the
    # reference's attention of the 5 new queries over all 8 keys (first principles, reference())
    r = check(f"{GOOD}:{name}")
    assert (r.verdict, r.exit_code) == ("match", 0), (r.error, r.cache, r.notes)
    assert r.cache == f"tested: 3 past tokens, then 5 new ones with {how}" or r.cache.startswith(
        f"tested: 3 past tokens, then 5 new ones with {how}")
    assert r.cache_max_abs_error < 1e-5
    assert [v.cache_status for v in r.variations] == ["tested", "tested"] and all(v.ok for v in r.variations)


def test_the_broken_cache_modules_pass_without_their_cache():
    # what made them dangerous: without the cached step each one is right
    for name in ("past_key_values_no_offset", "hf_cache_ignores_past", "cache_object_overwrites",
                 "kv_cache_dict_wrong_order", "use_cache_no_position"):
        r = check(os.path.join(BROKEN, f"{name}.py:MultiHeadAttention"))
        assert r.max_abs_error < TOL and r.cache_max_abs_error > 1e-2, name


@pytest.mark.parametrize("name,label", [("hard_coded_heads", "num_heads=3"), ("local_window", "T=70"),
                                        ("fixed_mask_64", "T=70")])
def test_modules_right_only_at_the_first_sizes_are_caught_by_the_default_variations(name, label):
    target = os.path.join(BROKEN, f"{name}.py:MultiHeadAttention")
    alone = check(target, long_tokens=0, vary_heads=False)           # the old check: 4 heads, 5 tokens
    assert (alone.verdict, alone.exit_code) == ("match", 0)
    r = check(target)
    assert (r.verdict, r.exit_code) == ("mismatch", 1)
    bad = [v for v in r.variations if not v.ok]
    assert [v.label for v in bad] == [label] and r.first_differing_stage.endswith(f"({label})")
    if name == "fixed_mask_64":                                      # a 64 x 64 mask cannot cover 70 tokens
        assert "forward raised RuntimeError" in bad[0].error and "fixed_mask_64.py line" in bad[0].error
    else:
        assert bad[0].max_abs_error > 1e-2
    if name == "local_window":                                       # right up to 6 tokens, wrong from 7 on
        assert check(target, tokens=6, long_tokens=0, vary_heads=False).verdict == "match"
        assert check(target, tokens=7, long_tokens=0, vary_heads=False).verdict == "mismatch"


UNUSABLE_CACHE = """import torch
from torch import nn


class Store:
    def __init__(self):
        self.k = None


class M(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.h = num_heads
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.v_proj, self.o_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, x, cache=None):
        b, T, C = x.shape
        split = lambda t: t.view(b, T, self.h, C // self.h).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if cache is not None:
            k, v = cache.remember(k, v)          # an interface the checker cannot know
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, T, C))
"""


def test_a_cache_the_check_cannot_use_is_match_without_cache_exit_3(tmp_path, capsys):
    (tmp_path / "m.py").write_text(UNUSABLE_CACHE)
    r = check(f"{tmp_path / 'm.py'}:M")
    assert (r.verdict, r.exit_code) == ("match_without_cache", 3) and r.max_abs_error < 1e-5
    assert r.cache.startswith("not tested: forward takes cache but no way of passing a cache worked")
    assert "'HFStyleCache' object has no attribute 'remember'" in r.cache and "a dict filled in place" in r.cache
    assert main(["check", f"{tmp_path / 'm.py'}:M"]) == 3
    out = capsys.readouterr().out
    assert "result: MATCH WITHOUT CACHE" in out and "(exit 3)" in out
    # --past 0 leaves the cache of a module that has one uncompared: not a full match either
    assert main(["check", "gpt2mha.learn.book:MultiHeadAttention", "--past", "0"]) == 3
    assert "not tested (--past 0), although forward takes past, return_present" in capsys.readouterr().out
    # a module without any cache argument still gets a plain MATCH
    assert main(["check", f"{GOOD}:BookMultiHeadAttention", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "match" and [v["label"] for v in data["variations"]] == ["num_heads=3", "T=70"]


def test_forward_args_classify_cache_flag_and_positions():
    from gpt2mha.learn.check_load import forward_args

    class A(torch.nn.Module):
        def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False, kv_seq_len=0,
                    cache_position=None, output_attentions=False):
            pass

    fa = forward_args(A)
    assert (fa.cache, fa.flag, fa.positions) == ("layer_past", "use_cache", {"cache_position": "tensor"})

    class B(torch.nn.Module):
        def forward(self, x, start_pos):
            pass

    fa = forward_args(B())
    assert (fa.cache, fa.flag, fa.positions, fa.required_positions) == (None, None, {"start_pos": "int"},
                                                                         ["start_pos"])
    assert not forward_args(torch.nn.Linear(2, 2)).takes_cache
