"""The benchmark scripts of benchmarks/ on tiny models: ``gpt2mha bench``'s sections
(benchmarks/bench.py, loaded by path as the command loads it) and the kernel survey
(benchmarks/weight_kernels.py). References: transformers' greedy tokens on the same weights, the
bench's own exact checks, first principles (sizes, shapes, x @ W). No timing assertions."""

import json
import os

import pytest
import torch

from conftest import load_benchmark, small_model
from gpt2mha import GPT2Config

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt")
VERDICT = os.path.join(os.path.dirname(__file__), "data", "the-verdict.txt")
TINY = GPT2Config(n_vocab=300, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")


def test_bench_sections_run_on_a_tiny_model(bench):
    pytest.importorskip("transformers")
    sizes = bench.Sizes(new_tokens=6, nocache_tokens=6, batches=(1, 2), positions=(8, 40), position_steps=3,
                        prefill_tokens=32, attn_batch=2, attn_tokens=32, agree_tokens=64, builtin_agree_tokens=512,
                        repeats=1, attn_repeats=1)
    result = bench.run(preset="tiny-test", config=TINY, sizes=sizes, memory=False, text=VERDICT,
                       sections=("decode", "cache", "positions", "prefill", "attention", "lowp"),
                       log=lambda *a: None)
    rows = {r["figure"]: r for r in result["rows"]}
    decode = [r for f, r in rows.items() if "transformers generate" in f]
    assert len(decode) == 2 and all("same greedy tokens: yes" in r["note"] for r in decode)
    ceilings = [r for f, r in rows.items() if f.startswith("decode tok/s ceiling")]  # fp32 b1, b2; bf16 b1
    assert len(ceilings) == 3 and all(r["value"] > 0 and "ms/step" in r["note"] for r in ceilings)
    assert any("no cache" in f and "same greedy tokens: yes" in r["note"] for f, r in rows.items())
    attn = [r for f, r in rows.items() if f.startswith("attention sublayer")]
    assert len(attn) >= 4 and not any("DIFFERS" in r["note"] for r in attn)
    assert any(f.startswith("top-1 agreement, gpt2mha bfloat16") for f in rows)
    for r in result["rows"]:
        assert r["value"] is not None and (r["ratio"] is None or r["ratio"] > 0)
    first = result["rows"][0]                                   # the progress line on stderr
    assert bench.format_row(first).startswith(f"{first['figure']}: ") and "{" not in bench.format_row(first)
    table = bench.format_table(result)
    assert table.count("\n|") == len(result["rows"]) + 2
    json.dumps(result)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_bench_prefill_peak_memory_child(tmp_path, bench):
    directory = str(tmp_path / "ckpt")
    small_model(n_vocab=300, n_ctx=64).save_pretrained(directory)
    peak = bench.prefill_peak_mb("gpt2mha fused", directory, 64)
    assert peak is not None and 0 <= peak < 500


def test_quick_sizes_bound_every_section(bench):
    """--quick scales down every size that sets a section's work (tokens, batches, positions,
    windows, calibration text, memory children, repeats), not only the repeats."""
    from dataclasses import fields

    full, quick = bench.FULL, bench.QUICK
    effective = {"quant_batches": lambda s: s.quant_batches or s.batches,
                 "slow_decode_tokens": lambda s: s.slow_decode_tokens or s.new_tokens,
                 "calibration_bytes": lambda s: s.calibration_bytes or 16384}
    for f in fields(bench.Sizes):
        q, F = (effective[f.name](s) if f.name in effective else getattr(s, f.name) for s in (quick, full))
        if f.name == "memory_variants":
            assert set(q) < set(F), f.name
        elif isinstance(F, bool):
            assert q <= F, f.name
        elif isinstance(F, tuple):
            assert len(q) <= len(F) and max(q) <= max(F), f.name
        else:
            assert q <= F, f.name
        if f.name not in ("prompt", "batches", "positions"):
            assert q != F, f"--quick leaves {f.name} at the full run's {F}"


def test_top1_agreements_count_what_the_argmaxes_say(bench):
    """Both figures in one pass equal the counts taken by hand from the two models' logits over
    every window (reference: argmax and softmax top-2 margins computed here)."""
    import copy

    from gpt2mha import GPT2

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=40, n_ctx=16, n_embd=16, n_head=2, n_layer=1)).eval()
    low = copy.deepcopy(model)
    with torch.no_grad():
        for p in low.parameters():                                     # another model, partly agreeing
            p.add_(torch.randn(p.shape) * 0.01)
    tokens = torch.randint(0, 40, (40,))                               # windows of 16, 16 and 8
    with torch.no_grad():
        ref = torch.cat([model(tokens[s:s + 16][None]).logits[0] for s in (0, 16, 32)])
        other = torch.cat([low(tokens[s:s + 16][None]).logits[0] for s in (0, 16, 32)])
    same = ref.argmax(-1) == other.argmax(-1)
    top2 = ref.softmax(-1).topk(2, -1).values
    margin = (top2[:, 0] - top2[:, 1]).median().item()                 # about half the positions are decisive
    keep = top2[:, 0] - top2[:, 1] >= margin
    agree, decisive = bench.top1_agreements(model, low, tokens, margin)
    assert 0 < agree < 1                                                # both counts matter
    assert agree == same.sum().item() / len(same) and agree == bench.top1_agreement(model, low, tokens)
    assert decisive == (same & keep).sum().item() / keep.sum().item() == bench.top1_agreement(model, low, tokens, margin)


def test_cli_bench_rejects_unknown_sections(capsys):
    from gpt2mha.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--quick", "--json", "--only", "decode,prefill"])
    assert args.quick and args.json and args.func.__name__ == "cmd_bench"
    assert main(["bench", "--only", "nope"]) == 2
    assert "unknown section" in capsys.readouterr().err


def test_kernel_survey_times_the_124m_block_matrices_in_both_layouts():
    """benchmarks/weight_kernels.py: the 48 matrices are 124M's (85M weights), the [out, in] set is the
    transpose of the [in, out] one, and a pass multiplies every matrix once (reference: x @ W)."""
    kernels = load_benchmark("weight_kernels")
    io, oi = kernels.matrices(torch.float32, "in,out", n_layer=2), kernels.matrices(torch.float32, "out,in", n_layer=2)
    assert len(io) == 8 and all(torch.equal(a.t(), b) and b.is_contiguous() for a, b in zip(io, oi))
    assert sum(w.numel() for w in kernels.matrices(torch.bfloat16, "in,out")) == 12 * 768 * (2304 + 768 + 3072 + 3072)
    outs_io, outs_oi = kernels.pass_fn(io, "in,out", 3)(), kernels.pass_fn(oi, "out,in", 3)()
    assert [o.shape for o in outs_io] == [(3, n_out) for _, n_out in kernels.BLOCK_SHAPES * 2]
    assert [o.shape for o in outs_oi] == [o.shape for o in outs_io]


# ------------------------------------------------------------------ the quantized sections
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_bench_quantized_rows_on_a_small_model(bench):
    pytest.importorskip("transformers")
    sizes = bench.Sizes(new_tokens=6, batches=(1, 2), repeats=1, builtin_agree_tokens=512, calibration_bytes=4096)
    config = GPT2Config(n_vocab=300, n_ctx=64, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes")
    result = bench.run(preset="small-test", config=config, sizes=sizes, memory=False, sections=("quant",),
                       text=SHAKESPEARE, log=lambda *a: None)
    rows = {r["figure"]: r for r in result["rows"]}
    for scheme in ("int8", "int4"):
        speed = [r for f, r in rows.items() if f.startswith("decode tok/s") and scheme in f]
        assert len(speed) == 2 and all(r["value"] > 0 and r["vs"] > 0 for r in speed)
        assert "of the measured memory bandwidth" in speed[0]["note"]
        size = rows[f"checkpoint size: {scheme} / float32 (model.safetensors)"]
        assert 0 < size["ratio"] < 0.4
        cos = [r for f, r in rows.items() if f.startswith("logits cosine") and scheme in f]
        assert len(cos) == 1 and cos[0]["value"] > 0.9
    assert rows["checkpoint size: int4 / float32 (model.safetensors)"]["ratio"] < rows[
        "checkpoint size: int8 / float32 (model.safetensors)"]["ratio"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_bench_resident_memory_child_sees_the_smaller_model(tmp_path, bench):
    model = small_model(seed=15, n_ctx=64, n_embd=256, n_head=4, n_layer=4, n_vocab=2048)
    model.save_pretrained(str(tmp_path / "f32"))
    model.quantize("int8", method="rtn").save_pretrained(str(tmp_path / "int8"))
    f32, q = bench.resident_mb(str(tmp_path / "f32")), bench.resident_mb(str(tmp_path / "int8"))
    assert 0 < q < f32                                              # 4 × 3.1M weights vs ~1 byte each
