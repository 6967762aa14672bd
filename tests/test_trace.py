"""gpt2mha.learn.trace and ``gpt2mha trace``: the stage-by-stage shape trace of a multi-head attention.

Independent references: GPT-2 small's shapes (b=2, T=6) worked out by hand, and the shapes real
modules produce on the same sizes (CausalSelfAttention with its weights read at the
``hook_pattern`` capture point, the book's classes).
"""

import json
import re

import pytest
import torch

from gpt2mha import CausalSelfAttention
from gpt2mha.cli import main
from gpt2mha.core.hooks import record
from gpt2mha.learn.trace import trace

SHAPE = re.compile(r"\((\d+(?:, \d+)*)\)")


def stage_shapes(text):
    """Shapes of the numbered stage lines of ``gpt2mha trace`` output, in order."""
    shapes = []
    for line in text.splitlines():
        if re.match(r"\s*\d+\s+\w+\s+\(", line):
            shapes.append(tuple(int(n) for n in SHAPE.search(line).group(1).split(", ")))
    return shapes


def is_subsequence(wanted, seq):
    it = iter(seq)
    return all(any(w == s for s in it) for w in wanted)


#: GPT-2 small's attention (d = 768, 12 heads of 64) on b=2, T=6: input, view, transpose, scores,
#: contexts, merged, worked out by hand from the book's walkthrough of MultiHeadAttention.
GPT2_SMALL_SHAPES = [(2, 6, 768), (2, 6, 12, 64), (2, 12, 6, 64), (2, 12, 6, 6), (2, 12, 6, 64), (2, 6, 768)]


@pytest.mark.parametrize("layout", ["split", "fused"])
def test_trace_gpt2_small_has_the_walkthrough_shapes_in_order(layout, capsys):
    assert main(["trace", "--layout", layout]) == 0
    out = capsys.readouterr().out
    shapes = stage_shapes(out)
    assert is_subsequence(GPT2_SMALL_SHAPES, shapes), shapes
    assert shapes[0] == (2, 6, 768) and shapes[-1] == (2, 6, 768)
    # the operations between stages, head_dim and the mask are printed
    for text in ("view(b, T, num_heads, head_dim)", "transpose(1, 2)", "contiguous().view(b, T, d_out)",
                 "head_dim=64", "mask (6, 6)", "softmax(dim=-1)"):
        assert text in out
    scores = next(line for line in out.splitlines() if re.match(r"\s*\d+\s+scores\s", line))
    assert "(2, 12, 6, 6)" in scores and "[b, h, T, S]" in scores


def test_trace_with_past_4_has_scores_2_12_6_10(capsys):
    assert main(["trace", "--past", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {s["name"]: s for s in data["stages"]}
    assert by_name["scores"]["shape"] == [2, 12, 6, 10]
    assert by_name["weights"]["shape"] == [2, 12, 6, 10]
    assert by_name["past"]["shape"] == [2, 12, 10, 64]
    assert data["mask_shape"] == [6, 10] and data["head_dim"] == 64
    assert by_name["scores"]["axes"] == ["b", "h", "T", "S"] and "S" in data["axes"]
    names = [s["name"] for s in data["stages"]]
    assert names.index("view") < names.index("transpose") < names.index("scores") < names.index("contexts") \
        < names.index("merged") < names.index("out_proj")


@pytest.mark.parametrize("b,T,d,h,P", [(3, 4, 40, 5, 2), (1, 7, 24, 3, 0), (2, 1, 16, 8, 5)])
def test_trace_fused_matches_what_causal_self_attention_computes(b, T, d, h, P):
    tr = {s.name: s.shape for s in trace("fused", b=b, T=T, d_in=d, d_out=d, num_heads=h, context_length=64,
                                         past=P).stages}
    attn = CausalSelfAttention(d, h)
    past = torch.randn(b, 2, h, P, d // h) if P else None
    outs = []
    seen = record(attn, ["hook_pattern"], lambda: outs.append(attn(torch.randn(b, T, d), past)))
    (y, present), w = outs[0], seen["hook_pattern"]          # w: the weights softmaxed in the forward
    assert tr["scores"] == tr["weights"] == tuple(w.shape) == (b, h, T, P + T)
    assert tr["out_proj"] == tuple(y.shape)
    assert tr["transpose"] == tuple(present[:, 0].shape) == (b, h, T, d // h)


def test_trace_split_and_wrapper_match_the_book_classes():
    from gpt2mha.learn.book import MultiHeadAttention, MultiHeadAttentionWrapper

    x = torch.randn(3, 5, 20)
    tr = {s.name: s.shape for s in trace("split", b=3, T=5, d_in=20, d_out=24, num_heads=4, context_length=8).stages}
    y, w = MultiHeadAttention(20, 24, 8, 0.0, 4)(x, need_weights=True)
    assert tr["out_proj"] == tuple(y.shape) == (3, 5, 24) and tr["weights"] == tuple(w.shape)
    assert tr["view"] == (3, 5, 4, 6) and tr["projections"] == (3, 5, 24)
    tw = trace("wrapper", b=3, T=5, d_in=20, d_out=6, num_heads=4, context_length=8)
    y = MultiHeadAttentionWrapper(20, 6, 8, 0.0, 4)(x)
    assert tw.stages[-1].shape == tuple(y.shape) == (3, 5, 24)
    assert {s.name: s.shape for s in tw.stages}["scores"] == (3, 5, 5) and tw.head_dim == 6
    assert not any(s.name in ("view", "transpose", "out_proj") for s in tw.stages)


@pytest.mark.parametrize("argv,message", [
    (["--d-out", "100", "--num-heads", "12"], "not divisible by num_heads"),
    (["--past", "1020"], "context_length"),
    (["--tokens", "0"], "tokens=0"),
])
def test_trace_bad_configuration_exits_2(argv, message, capsys):
    assert main(["trace", *argv]) == 2
    assert message in capsys.readouterr().err
