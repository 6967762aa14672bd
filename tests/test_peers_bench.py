"""The conversion helpers of ``benchmarks/peers.py`` (in ``peers_convert.py`` and
``peers_engines.py``), on which its engine figures rest.

Each engine in that benchmark runs weights that one of these helpers wrote, so a wrong helper
would give a wrong figure rather than an error. References: transformers' ``GPT2LMHeadModel``
on the same weights (logits), its state dict (tensor values), the ``gguf`` package's own reader
(what llama.cpp will read), transformers' tokenizer and gpt2mha's tiktoken-based tokenizer.
The engines themselves (llama.cpp, CTranslate2, ONNX Runtime) are not needed, except the
``gguf`` package for the GGUF test (skipped without it).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import load_benchmark

transformers = pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def peers():
    """benchmarks/peers.py (conftest's :func:`load_benchmark`)."""
    return load_benchmark("peers")


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_head=3, n_layer=2, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():                                      # non-zero biases and LayerNorms, so each one counts
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_onnx_decoder_matches_transformers_with_and_without_cache(peers, tiny_hf):
    """OnnxGPT2 (the graph ONNX Runtime runs): a prefill of 7 tokens, then steps of 1 and 4 with
    the cache it returned, gives transformers' logits at the kept positions, batch 2."""
    m = peers.OnnxGPT2(tiny_hf).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_hf(ids).logits                                           # [2, 12, 97]
        past = [torch.zeros(2, 3, 0, 8)] * 4
        out = m(ids[:, :7], torch.arange(7), *past)
        got = [out[0]]
        out = m(ids[:, 7:8], torch.tensor([0]), *out[1:])
        got.append(out[0])
        out = m(ids[:, 8:12], torch.tensor([1, 3]), *out[1:])               # only two of the four kept
        assert out[1].shape == (2, 3, 12, 8)                                # the cache grew by every new position
    torch.testing.assert_close(got[0], ref[:, :7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[:, 7:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], ref[:, [9, 11]], atol=1e-5, rtol=1e-5)


def test_gguf_tensors_are_the_checkpoint_in_llama_cpp_layout(peers, tiny_hf, tmp_path):
    """write_gguf, read back with the gguf package's GGUFReader: every weight is transformers'
    (Conv1D matrices transposed to [out, in]), no tensor missing or extra, GPT-2's sizes in the
    metadata."""
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "tiny.gguf")
    tokens = [f"t{i}" for i in range(97)]
    peers.write_gguf(tiny_hf, path, tokens, None)
    reader = gguf.GGUFReader(path)
    got = {t.name: np.array(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    sd = tiny_hf.state_dict()
    expected = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
                "output_norm.weight": sd["transformer.ln_f.weight"], "output_norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(2):
        h = f"transformer.h.{i}."
        for ours, theirs, transpose in (("attn_norm", "ln_1", False), ("attn_qkv", "attn.c_attn", True),
                                        ("attn_output", "attn.c_proj", True), ("ffn_norm", "ln_2", False),
                                        ("ffn_up", "mlp.c_fc", True), ("ffn_down", "mlp.c_proj", True)):
            w = sd[h + theirs + ".weight"]
            expected[f"blk.{i}.{ours}.weight"] = w.T if transpose else w
            expected[f"blk.{i}.{ours}.bias"] = sd[h + theirs + ".bias"]
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], value.numpy(), err_msg=name)
    field = (lambda key: reader.fields[key].parts[reader.fields[key].data[0]])
    assert bytes(field("general.architecture")).decode() == "gpt2"
    assert [int(field(f"gpt2.{k}")[0]) for k in ("block_count", "context_length", "embedding_length",
                                                  "feed_forward_length", "attention.head_count")] == [2, 32, 24, 96, 3]


def test_llama_cpp_f32_keeps_its_keys_and_values_in_float32(peers, tiny_hf, tmp_path):
    """LlamaCpp's ``kv_cache`` reaches llama.cpp: after the same 20 tokens, a context made with "f32"
    holds 2 bytes more per cached key and value element than one made with "f16" (llama.cpp's
    default), by llama.cpp's own count of a sequence's state (``llama_state_seq_get_size``): 20
    positions x 2 layers x (key, value) x n_embd 24. The two give the same greedy tokens here."""
    pytest.importorskip("llama_cpp")
    path = str(tmp_path / "tiny.gguf")
    peers.write_gguf(tiny_hf, path, [f"t{i}" for i in range(97)], None)
    tokens = np.random.RandomState(0).randint(0, 97, 20)
    size, greedy = {}, {}
    for kv in ("f32", "f16"):
        c = peers.LlamaCpp(f"llama.cpp f32 {kv}", path, 32, 1, 0, kv)
        assert c.kv_cache == kv
        c.logits(tokens)
        size[kv] = c.L.llama_state_seq_get_size(c._context(1)[0], 0)
        greedy[kv] = c.greedy(tokens[None, :5], 6)
        c.close()
    assert size["f32"] - size["f16"] == 20 * 2 * 2 * 24 * (4 - 2)
    np.testing.assert_array_equal(greedy["f32"], greedy["f16"])
    assert peers.LLAMA_KV_CACHE["f32"] == "f32" and "f16" not in peers.LLAMA_KV_CACHE
    with pytest.raises(ValueError, match="kv_cache='q8_0'"):
        peers.LlamaCpp("x", path, 32, 1, 0, "q8_0")


def test_tokenizer_files_give_the_ids_the_checkpoints_use(peers, tmp_path):
    """The vocab.json/merges.txt written beside the checkpoints (CTranslate2 and llama.cpp read
    their vocabularies from them): the byte model's tokenizer maps text to its UTF-8 bytes, and
    the GPT-2 one to the same ids as gpt2mha's tokenizer (tiktoken on OpenAI's files)."""
    from gpt2mha.io.tokenizer import get_tokenizer

    text = "ROMEO: But soft, what light — ünïcode?\n"
    byte_dir, bpe_dir = tmp_path / "bytes", tmp_path / "bpe"
    byte_dir.mkdir(), bpe_dir.mkdir()
    peers.write_tokenizer_files(str(byte_dir), peers.byte_vocab(), [])
    tok = transformers.AutoTokenizer.from_pretrained(str(byte_dir))
    assert len(tok.get_vocab()) == 256
    assert tok.encode(text) == list(text.encode("utf-8"))
    peers.write_tokenizer_files(str(bpe_dir), *peers.gpt2_vocab())
    tok = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    assert len(tok.get_vocab()) == 50257
    assert tok.encode(text) == get_tokenizer("gpt2").encode(text)
    with open(bpe_dir / "vocab.json", encoding="utf-8") as f:
        assert json.load(f)["<|endoftext|>"] == 50256


def test_equal_prefix_counts_steps_where_every_row_agrees(peers):
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert peers.equal_prefix(a, a) == 4
    b = a.copy()
    b[1, 2] = 0                                             # row 1 differs at step 2; step 3 agrees again
    assert peers.equal_prefix(a, b) == 2
    b[0, 0] = 9
    assert peers.equal_prefix(a, b) == 0


@pytest.mark.slow
def test_isolated_runs_each_engine_in_its_own_process_and_names_the_failures(tmp_path, capsys):
    """benchmarks/peers_isolated.py on a tiny workdir laid out as peers.py writes it: transformers
    (the reference) and gpt2mha int8 per_row each report decode tok/s and prefill ms from a child
    process of their own, each beside its KV cache's precision (float32 for both); an engine whose
    files are missing is a 'failed' row, not an error of the whole run."""
    from gpt2mha import GPT2

    iso = load_benchmark("peers_isolated")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=24, n_head=3, n_layer=2, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=None)
    hf_dir = tmp_path / "random-124M"
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(str(hf_dir))
    with open(hf_dir / "config.json") as f:
        config = json.load(f)
    config["gpt2mha"] = {"tokenizer": "bytes"}
    with open(hf_dir / "config.json", "w") as f:
        json.dump(config, f)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2.from_pretrained(str(hf_dir)).quantize("int8", method="rtn", activations="per_row")
    model.save_pretrained(str(tmp_path / "random-124M-engines" / "gpt2mha-int8-per_row"))
    assert iso.main(["--workdir", str(tmp_path), "--engines", "gpt2mha int8 per_row,gpt2mha int4", "--new", "3",
                     "--repeats", "1", "--prefill", "5,9", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "engine" not in line}
    rows = {name.replace(" (KV cache f32)", ""): cells for name, cells in rows.items()}   # both caches float32
    assert rows["gpt2mha int4"] == ["failed"] * 4
    for name in ("transformers float32", "gpt2mha int8 per_row"):
        values = [float(c.split()[0]) for c in rows[name]]
        assert len(values) == 4 and all(v > 0 for v in values)           # b1, b8 tok/s; prefill 5, 9 ms
    assert all(c.endswith("(1.00x)") for c in rows["transformers float32"])


def test_sizes_table_takes_the_best_other_engine_of_each_precision(tmp_path, capsys):
    """benchmarks/peers_sizes.py's ratios: gpt2mha against the fastest other engine of its
    precision, per figure (tok/s: the highest, prefill ms: the lowest, so a ratio above 1 is
    gpt2mha ahead either way), engines that failed or were not run left out; the batch-1 read
    fractions are tok/s × bytes over the streaming read; --report prints the saved run."""
    sizes = load_benchmark("peers_sizes")
    rows = {"gpt2mha int8 per_row": {"b1": 100.0, "b8": 400.0, "p512": 500.0, "read_bytes": 1e8},
            "llama.cpp q8_0": {"b1": 120.0, "b8": 200.0, "p512": 1000.0, "read_bytes": 1.2e8},
            "openvino int8": {"b1": 80.0, "b8": 500.0, "p512": 400.0, "read_bytes": 1e8},
            "ctranslate2 int8": None,                                   # failed
            "gpt2mha float32": {"b1": 10.0, "b8": 50.0, "p512": 900.0, "read_bytes": 5e8}}
    got = sizes.ratios(rows)
    assert set(got) == {"int8"}                                         # float32 has no other engine here
    q = got["int8"]
    assert q["best"]["b1"] == ("llama.cpp q8_0", 120.0) and q["ratio"]["b1"] == pytest.approx(100 / 120)
    assert q["best"]["b8"] == ("openvino int8", 500.0) and q["ratio"]["b8"] == pytest.approx(400 / 500)
    assert q["best"]["p512"] == ("openvino int8", 400.0) and q["ratio"]["p512"] == pytest.approx(400 / 500)
    sizes.read_fractions(rows, 2e10)
    assert rows["gpt2mha int8 per_row"]["b1_of_streaming_read"] == pytest.approx(100 * 1e8 / 2e10)
    assert rows["llama.cpp q8_0"]["b1_read_bytes_per_s"] == pytest.approx(120 * 1.2e8)
    run = {"machine": "m", "software": "s", "command": "c",
           "sizes": {"355M": {"bandwidth": 2e10, "bandwidth_start": 2e10, "bandwidth_end": 1.9e10,
                              "load_start": [0.5, 0, 0], "load_end": [0.7, 0, 0], "engines": rows, "ratios": got}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert sizes.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| int8 | 0.83× (llama.cpp q8_0) | 0.80× (openvino int8) | 0.80× (openvino int8) |" in out
    assert "| int8 | gpt2mha int8 per_row (?) | 100.0 | 400.0 | 500 | 10.0 (50%) |" in out
    assert "| int8 | ctranslate2 int8 | failed | | | |" in out
