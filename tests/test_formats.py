"""Checkpoint formats learners have: OpenAI's TF checkpoint directory,
the book's GPTModel state dict, nanoGPT's ckpt.pt; loading, converting both ways, the CLI.

Every checkpoint here is built from first principles by the format's own code: the TF one by
TensorFlow's Saver under OpenAI's variable names and shapes, the book's by a GPTModel written
as the book writes it (tests/data/book_gpt.py), nanoGPT's by a model in nanoGPT's layout
(tests/data/nanogpt_model.py). Reference logits come from that code or from transformers on
the same arrays, never from gpt2mha's own conversion.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpt2mha import GPT2
from gpt2mha.io.checkpoints import CheckpointError
from gpt2mha.io.formats import CheckpointWarning, convert, detect_format, load_any, read_book
from gpt2mha.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from book_gpt import GPTModel  # noqa: E402
from nanogpt_model import GPT as NanoGPT, GPTConfig as NanoConfig  # noqa: E402

ATOL = 2e-5
HP = dict(n_vocab=256, n_ctx=16, n_embd=24, n_head=3, n_layer=2)


def _randomize(model, seed):
    """Nonzero biases, non-unit LayerNorms: every tensor matters to the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1)
                    + (1.0 if name.endswith(("scale", "ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0))
    return model.eval()


# ---------------------------------------------------------------------------- OpenAI TF
def openai_arrays(hp, seed=0):
    """Random float32 arrays under OpenAI's variable names and shapes (src/model.py)."""
    rng = np.random.default_rng(seed)
    C, V = hp["n_embd"], hp["n_vocab"]
    r = lambda *s, scale=0.1, loc=0.0: (loc + scale * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    out = {"model/wte": r(V, C), "model/wpe": r(hp["n_ctx"], C), "model/ln_f/g": r(C, loc=1), "model/ln_f/b": r(C)}
    for i in range(hp["n_layer"]):
        p = f"model/h{i}/"
        for ln in ("ln_1", "ln_2"):
            out[p + ln + "/g"], out[p + ln + "/b"] = r(C, loc=1.0, scale=0.3), r(C, scale=0.3)
        for name, nx, nf in (("attn/c_attn", C, 3 * C), ("attn/c_proj", C, C), ("mlp/c_fc", C, 4 * C),
                             ("mlp/c_proj", 4 * C, C)):
            out[p + name + "/w"], out[p + name + "/b"] = r(1, nx, nf), r(nf)
    return out


def write_tf_checkpoint(directory, arrays, hp):
    """What OpenAI's download_model.py leaves: a TF1 Saver checkpoint + hparams.json."""
    tf = pytest.importorskip("tensorflow", reason="the [tf] extra (pip install 'gpt2mha[tf]')")
    os.makedirs(directory, exist_ok=True)
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name=k) for k, v in arrays.items()]
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, os.path.join(directory, "model.ckpt"))
    with open(os.path.join(directory, "checkpoint"), "w") as f:       # as OpenAI ships it (the Saver writes
        f.write('model_checkpoint_path: "model.ckpt"\nall_model_checkpoint_paths: "model.ckpt"\n')  # absolute paths)
    with open(os.path.join(directory, "hparams.json"), "w") as f:
        json.dump(hp, f)
    return directory


@pytest.fixture(scope="module")
def openai_dir(tmp_path_factory):
    arrays = openai_arrays(HP)
    return write_tf_checkpoint(str(tmp_path_factory.mktemp("openai") / "124M"), arrays, HP), arrays


def hf_from_openai_arrays(arrays, hp):
    """transformers' GPT2LMHeadModel holding the same arrays (its Conv1D is OpenAI's [nx, nf])."""
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

    model = GPT2LMHeadModel(HFConfig(vocab_size=hp["n_vocab"], n_positions=hp["n_ctx"], n_embd=hp["n_embd"],
                                     n_head=hp["n_head"], n_layer=hp["n_layer"])).eval()
    sd = {"transformer.wte.weight": arrays["model/wte"], "transformer.wpe.weight": arrays["model/wpe"],
          "transformer.ln_f.weight": arrays["model/ln_f/g"], "transformer.ln_f.bias": arrays["model/ln_f/b"],
          "lm_head.weight": arrays["model/wte"]}
    for name, a in arrays.items():
        if name.startswith("model/h"):
            layer, *rest = name.removeprefix("model/h").split("/")
            leaf = {"g": "weight", "b": "bias", "w": "weight"}[rest[-1]]
            sd[f"transformer.h.{layer}.{'.'.join(rest[:-1])}.{leaf}"] = a[0] if rest[-1] == "w" else a
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False)
    return model


def test_openai_checkpoint_loads_with_the_same_logits(openai_dir):
    """GPT2.from_pretrained(DIR) on a TF checkpoint written with OpenAI's names and shapes gives
    the logits transformers gives on the same arrays."""
    directory, arrays = openai_dir
    assert detect_format(directory) == "openai"
    model = GPT2.from_pretrained(directory)
    assert model.config.n_layer == 2 and model.config.n_head == 3 and model.config.tokenizer == "bytes"
    hf = hf_from_openai_arrays(arrays, HP)
    idx = torch.randint(0, HP["n_vocab"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, hf(idx).logits, atol=ATOL, rtol=0)
    assert torch.equal(model.h[1].attn.c_attn.weight, torch.from_numpy(arrays["model/h1/attn/c_attn/w"][0]))


def test_openai_checkpoint_on_the_command_line(openai_dir, capsys):
    directory, _ = openai_dir
    assert main(["generate", "ab", "--model", directory, "--temperature", "0", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    model = GPT2.from_pretrained(directory)
    out = model.generate(torch.tensor([list(b"ab")]), 4, temperature=0)
    assert text == bytes(out[0].tolist()).decode("utf-8", errors="replace") + "\n"


def test_openai_checkpoint_bpe_files_verified(openai_dir, tmp_path):
    from gpt2mha.io.tokenizer import bpe_data_files

    directory, _ = openai_dir
    d = str(tmp_path / "m")
    shutil.copytree(directory, d)
    encoder, vocab = bpe_data_files()
    shutil.copy(encoder, d)
    shutil.copy(vocab, d)
    GPT2.from_pretrained(d)                                     # OpenAI's own files: accepted
    with open(os.path.join(d, "vocab.bpe"), "a") as f:
        f.write("x y\n")
    with pytest.raises(CheckpointError, match=r"vocab.bpe: sha256 .* is not OpenAI's GPT-2 file"):
        GPT2.from_pretrained(d)
    os.remove(os.path.join(d, "vocab.bpe"))
    with pytest.raises(CheckpointError, match="has encoder.json without vocab.bpe"):
        GPT2.from_pretrained(d)


def test_openai_checkpoint_wrong_variables_named(tmp_path):
    arrays = openai_arrays(HP)
    arrays["model/h1/mlp/c_fc/w"] = arrays["model/h1/mlp/c_fc/w"][0]          # [nx, nf]: not conv1d's [1, nx, nf]
    del arrays["model/ln_f/b"]
    d = write_tf_checkpoint(str(tmp_path / "bad"), arrays, HP)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(d)
    assert "model/h1/mlp/c_fc/w: shape [24, 96] != expected [1, 24, 96]" in str(e.value)
    assert "missing tensor model/ln_f/b [24]" in str(e.value)


def test_openai_checkpoint_file_naming_another_directory_reads_the_directory_given(openai_dir, tmp_path):
    """TF's Saver writes the absolute path it saved to into `checkpoint`, so a copied directory
    names the original's files: the copy's own files are read, with a warning, and a truncated
    copy is an error naming its data file, never the original's numbers."""
    import re
    import warnings

    directory, arrays = openai_dir
    copy = str(tmp_path / "copy")
    own = openai_arrays(HP, seed=5)
    write_tf_checkpoint(copy, own, HP)
    with open(os.path.join(copy, "checkpoint"), "w") as f:         # what TF's Saver wrote in the original
        f.write(f'model_checkpoint_path: "{os.path.abspath(directory)}/model.ckpt"\n')
    with pytest.warns(CheckpointWarning, match=r"points to .*124M/model.ckpt, outside .*copy"):
        model = GPT2.from_pretrained(copy)
    assert torch.equal(model.wte.weight, torch.from_numpy(own["model/wte"]))          # the copy's numbers
    assert not torch.equal(model.wte.weight, torch.from_numpy(arrays["model/wte"]))
    data = os.path.join(copy, "model.ckpt.data-00000-of-00001")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(copy)
    assert re.match(re.escape(data) + r": cannot read variable model/\S+ \[.*\]: the data file is truncated", str(e.value))
    # OpenAI's own download names the prefix relatively: read without a warning; truncated: the same error
    with open(os.path.join(copy, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "model.ckpt"\nall_model_checkpoint_paths: "model.ckpt"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match=re.escape(data) + ": cannot read variable"):
            load_any(copy)
    with open(os.path.join(copy, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "model-1000"\n')
    with pytest.raises(CheckpointError, match=r"no model-1000.index \(the checkpoint the `checkpoint` file names"):
        load_any(copy)


def test_openai_checkpoint_without_tensorflow_names_the_extra(openai_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)        # import tensorflow → ImportError
    with pytest.raises(CheckpointError, match=r"needs TensorFlow: pip install 'gpt2mha\[tf\]'"):
        GPT2.from_pretrained(openai_dir[0])


# ------------------------------------------------------------------------------- book
BOOK_CFG = {"vocab_size": 256, "context_length": 16, "emb_dim": 24, "n_heads": 3, "n_layers": 2,
            "drop_rate": 0.1, "qkv_bias": False}


def book_model(seed=0, **cfg):
    torch.manual_seed(seed)
    return _randomize(GPTModel({**BOOK_CFG, **cfg}), seed)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_book_state_dict_loads_with_the_same_logits(tmp_path, qkv_bias, one_thread):
    """The book's GPTModel trained in ch. 5 saves model.state_dict(); with its config dict
    beside it (NAME.json) GPT2.from_pretrained reads it; logits equal GPTModel's own."""
    book = book_model(qkv_bias=qkv_bias)
    path = str(tmp_path / "model.pth")
    torch.save(book.state_dict(), path)
    with open(tmp_path / "model.json", "w") as f:
        json.dump({**BOOK_CFG, "qkv_bias": qkv_bias}, f)
    assert detect_format(path) == "book"
    model = GPT2.from_pretrained(path)
    assert not model.config.tie_word_embeddings                 # the book's out_head is its own matrix
    assert model.config.attn_pdrop == 0.1
    idx = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, book(idx), atol=ATOL, rtol=0)


def test_book_config_from_argument_or_stored_and_errors(tmp_path, one_thread):
    book = book_model()
    path = str(tmp_path / "model_and_optimizer.pth")            # ch. 5's layout, with an optimizer
    opt = torch.optim.AdamW(book.parameters(), lr=1e-3)
    book(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    torch.save({"model_state_dict": book.state_dict(), "optimizer_state_dict": opt.state_dict()}, path)
    with pytest.raises(CheckpointError, match=r"needs n_heads \(no tensor shape holds it\)"):
        GPT2.from_pretrained(path)
    with pytest.raises(CheckpointError, match=r"config emb_dim=32 but the tensors say 24"):
        load_any(path, book_config={"n_heads": 3, "emb_dim": 32})
    model = load_any(path, book_config={"n_heads": 3})
    idx = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, book.eval()(idx), atol=ATOL, rtol=0)
    sd = book.state_dict()
    del sd["trf_blocks.1.ff.layers.2.bias"]
    sd["trf_blocks.0.att.W_key.weight"] = torch.zeros(24, 12)
    torch.save(sd, path)
    with pytest.raises(CheckpointError) as e:
        load_any(path, book_config={"n_heads": 3})
    assert "missing tensor trf_blocks.1.ff.layers.2.bias [24]" in str(e.value)
    assert "trf_blocks.0.att.W_key.weight: shape [24, 12] != expected [24, 24]" in str(e.value)


def test_book_round_trip_through_hf_is_exact(tmp_path, one_thread):
    """book .pth → gpt2mha convert → HF directory (transformers' logits equal the book's) →
    convert --to book → GPTModel.load_state_dict(strict) takes it, every tensor bitwise equal."""
    from transformers import GPT2LMHeadModel

    book = book_model(qkv_bias=True)
    path = str(tmp_path / "model.pth")
    torch.save(book.state_dict(), path)
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back" / "model.pth")
    assert main(["convert", path, hf_dir, "--book-config", json.dumps({"n_heads": 3})]) == 0
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, book(idx), atol=ATOL, rtol=0)
    assert main(["convert", hf_dir, back, "--to", "book"]) == 0
    with open(tmp_path / "back" / "model.json") as f:
        assert json.load(f) == {**BOOK_CFG, "qkv_bias": True, "drop_rate": 0.0}
    sd = torch.load(back, weights_only=True)
    assert sd.keys() == book.state_dict().keys()
    for k, v in book.state_dict().items():
        assert torch.equal(sd[k], v), k
    fresh = GPTModel({**BOOK_CFG, "qkv_bias": True})
    fresh.load_state_dict(sd, strict=True)


# ------------------------------------------------------------------------------ nanoGPT
def nano_checkpoint(path, bias=True, compiled=True, gelu="tanh", seed=0):
    """A ckpt.pt as nanoGPT's train.py writes it (model_args, model with _orig_mod. keys,
    optimizer, iter_num, best_val_loss, config)."""
    args = dict(n_layer=2, n_head=3, n_embd=24, block_size=16, bias=bias, vocab_size=256, dropout=0.0)
    torch.manual_seed(seed)
    model = _randomize(NanoGPT(NanoConfig(**args, gelu=gelu)), seed)
    sd = model.state_dict()
    if compiled:
        sd = {"_orig_mod." + k: v for k, v in sd.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.save({"model": sd, "optimizer": opt.state_dict(), "model_args": args, "iter_num": 100,
                "best_val_loss": torch.tensor(2.5), "config": {"dataset": "shakespeare_char"}}, path)
    return model


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_checkpoint_loads_with_the_same_logits(tmp_path, bias, one_thread):
    """A torch.compile'd run's ckpt.pt (bias on or off) loads; with GPT-2's tanh GELU in the
    nanoGPT-layout model the logits are equal; the round trip --to nanogpt is bitwise."""
    ref = nano_checkpoint(str(tmp_path / "ckpt.pt"), bias=bias)
    assert detect_format(str(tmp_path)) == "nanogpt"           # nanoGPT's out_dir
    model = GPT2.from_pretrained(str(tmp_path / "ckpt.pt"))
    assert model.config.tie_word_embeddings and model.config.n_ctx == 16
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, ref(idx, targets=idx)[0], atol=ATOL, rtol=0)
    out = str(tmp_path / "again")
    convert(str(tmp_path), out, to="nanogpt")
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["model_args"]["bias"] is bias
    fresh = NanoGPT(NanoConfig(**ckpt["model_args"], gelu="tanh"))
    fresh.load_state_dict(ckpt["model"], strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_nanogpt_errors_name_the_tensor(tmp_path):
    nano_checkpoint(str(tmp_path / "ckpt.pt"))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model"]["_orig_mod.transformer.h.0.attn.c_attn.weight"] = torch.zeros(24, 72)    # Conv1D, not Linear
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match=r"transformer.h.0.attn.c_attn.weight: shape \[24, 72\] != "
                                              r"expected \[72, 24\]"):
        GPT2.from_pretrained(str(tmp_path / "ckpt.pt"))


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    nano_checkpoint(str(tmp_path / "ckpt.pt"))
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    assert main(["convert", str(tmp_path / "ckpt.pt"), str(dst)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err and (dst / "notes.txt").read_text() == "mine"
    assert main(["convert", str(tmp_path / "ckpt.pt"), str(dst), "--overwrite"]) == 0
    assert detect_format(str(dst)) == "hf"
    book = str(tmp_path / "b.pth")
    assert main(["convert", str(dst), book, "--to", "book"]) == 0
    assert main(["convert", str(dst), book, "--to", "book"]) == 2
    assert "b.pth, " in (err := capsys.readouterr().err) and "already exist; refusing to overwrite them" in err


def test_convert_takes_builtin_names_and_refuses_quantized_sources_for_float_formats(tmp_path, capsys):
    """From a new-user walkthrough: `convert shakespeare-byte DST` said "no such file", and a
    quantized checkpoint converted --to book wrote int8 tensors of the wrong shapes with exit 0."""
    from gpt2mha import GPT2
    hf = str(tmp_path / "hf")
    assert main(["convert", "shakespeare-byte", hf]) == 0
    idx = torch.tensor([list(b"ROMEO:")])
    with torch.no_grad():
        torch.testing.assert_close(GPT2.from_pretrained(hf)(idx).logits, GPT2.from_pretrained("shakespeare-byte")(idx).logits)
    q8 = str(tmp_path / "q8")
    GPT2.from_pretrained("shakespeare-byte").quantize("int8", method="rtn").save_pretrained(q8)   # any rounding
    capsys.readouterr()
    for to, dst in (("book", tmp_path / "q8.pth"), ("nanogpt", tmp_path / "q8nano")):
        assert main(["convert", q8, str(dst), "--to", to]) == 2
        assert f"is a quantized checkpoint (int8); the {to} format holds float weights only" in capsys.readouterr().err
        assert not os.path.exists(dst)


@pytest.mark.slow
def test_converted_builtin_byte_model_generates_in_transformers_pipeline_as_gpt2mha(tmp_path, capsys):
    """`gpt2mha convert shakespeare-byte DIR` writes a byte tokenizer transformers loads: its ids
    are the prompt's UTF-8 bytes (a 3-byte dash included) and ``pipeline("text-generation")``'s
    greedy continuation is the text of ``gpt2mha generate PROMPT --temperature 0`` on DIR (the
    byte model has no end-of-text token: both run all the new tokens)."""
    from transformers import AutoTokenizer, pipeline

    from conftest import cli_continuation, greedy_margin

    d, n = str(tmp_path / "byte"), 60
    assert main(["convert", "shakespeare-byte", d]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    prompt = "KING RICHARD III:\nNow is the winter of our discontent \u2014 "
    assert AutoTokenizer.from_pretrained(d).encode(prompt) == list(prompt.encode("utf-8"))
    model = GPT2.from_pretrained(d)
    ids = list(prompt.encode("utf-8"))
    out = model.generate(torch.tensor([ids]), n, temperature=0)[0].tolist()
    assert greedy_margin(model, out, len(ids)) > 1e-3          # no near-tie that rounding could flip
    expected = cli_continuation(prompt, d, n)
    assert expected == bytes(out[len(ids):]).decode("utf-8", errors="replace")
    got = pipeline("text-generation", model=d)(prompt, do_sample=False, max_new_tokens=n, return_full_text=False)
    assert got[0]["generated_text"] == expected


# -------------------------------------------------------------------------- check-model
BOOK_GPT = os.path.join(os.path.dirname(__file__), "data", "book_gpt.py")
NANO_GPT = os.path.join(os.path.dirname(__file__), "data", "nanogpt_model.py")


def test_check_model_matches_the_learners_book_model(tmp_path, capsys, one_thread):
    """The learner's GPTModel class (tests/data/book_gpt.py) and, without a class, gpt2mha's
    chapter-4 reference both match gpt2mha stage by stage on a book checkpoint."""
    torch.save(book_model(qkv_bias=True).state_dict(), tmp_path / "m.pth")
    cfg = json.dumps({"n_heads": 3})
    assert main(["check-model", str(tmp_path / "m.pth"), "--class", BOOK_GPT + ":GPTModel", "--book-config", cfg]) == 0
    out = capsys.readouterr().out
    for stage in ("embeddings", "block 0 attn", "block 0 mlp", "block 1 out", "ln_f", "logits"):
        assert stage in out
    assert "result: MATCHES (exit 0)" in out
    assert main(["check-model", str(tmp_path / "m.pth"), "--book-config", cfg]) == 0


def test_check_model_finds_nanogpts_erf_gelu(tmp_path, capsys, one_thread):
    """nanoGPT's own MLP (exact erf GELU) on a nanoGPT checkpoint matches gpt2mha with the
    format's GELU, erf: every stage, exit 0, "up to the format's GELU", with the logits'
    difference under GPT-2's tanh GELU (what gpt2mha runs) as the figure, that of the
    nanoGPT-layout model against gpt2mha's own forward (the reference)."""
    theirs = nano_checkpoint(str(tmp_path / "ckpt.pt"), gelu="none").double()
    code = main(["check-model", str(tmp_path / "ckpt.pt"), "--class", NANO_GPT + ":GPT", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["exit_code"] == 0 and report["first_diff"] is None
    assert all(s["ok"] for s in report["stages"]) and report["gelu"] == "erf"
    assert report["stages"][-1]["name"] == "logits" and report["stages"][-1]["shape"] == [2, 1, 256]
    ours = GPT2.from_pretrained(str(tmp_path / "ckpt.pt")).double().eval()
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))       # check-model's ids
    with torch.no_grad():
        expected = float((theirs(idx)[0][:, -1] - ours(idx).logits[:, -1]).abs().max())
    assert report["gelu_difference"] == pytest.approx(expected, rel=1e-9) and expected > 1e-5
    assert main(["check-model", str(tmp_path / "ckpt.pt"), "--class", NANO_GPT + ":GPT"]) == 0
    out = capsys.readouterr().out
    assert "result: MATCHES up to the format's GELU (exit 0)" in out and f"differ by {expected:.3g}" in out


def test_check_model_on_a_nanogpt_checkpoint_gpt2mha_wrote(tmp_path, capsys, one_thread):
    """`convert shakespeare-byte --to nanogpt`, then `check-model` on what it wrote: equal up to
    the format's GELU (exit 0), not DIFFERS; a real difference in such a checkpoint (a LayerNorm
    weight of the reference changed) is still found, with the erf GELU too."""
    assert main(["convert", "shakespeare-byte", str(tmp_path / "nano"), "--to", "nanogpt"]) == 0
    capsys.readouterr()
    assert main(["check-model", str(tmp_path / "nano")]) == 0
    out = capsys.readouterr().out
    assert "result: MATCHES up to the format's GELU (exit 0)" in out and "<-- differs" not in out
    src = open(NANO_GPT).read()
    assert "self.bias, 1e-5)" in src
    (tmp_path / "mine.py").write_text(src.replace("self.bias, 1e-5)", "self.bias, 1e-2)"))
    assert main(["check-model", str(tmp_path / "nano"), "--class", str(tmp_path / "mine.py") + ":GPT"]) == 1
    assert "first difference: block 0 attn" in capsys.readouterr().out


def test_check_model_finds_a_layernorm_epsilon(tmp_path, capsys, one_thread):
    """A learner's LayerNorm with eps=1e-2 (instead of 1e-5): the first stage that differs is
    block 0's attention, and re-running gpt2mha's attention on the learner's input shows it is
    the norm before it."""
    src = open(BOOK_GPT).read().replace("self.eps = 1e-5", "self.eps = 1e-2")
    (tmp_path / "mine.py").write_text(src)
    torch.save(book_model().state_dict(), tmp_path / "m.pth")
    assert main(["check-model", str(tmp_path / "m.pth"), "--class", str(tmp_path / "mine.py") + ":GPTModel",
                 "--book-config", '{"n_heads": 3}']) == 1
    out = capsys.readouterr().out
    assert "first difference: block 0 attn" in out and "the LayerNorm before it (ln_1 / norm1)" in out


def test_check_model_points_at_a_wrong_attention(tmp_path, capsys, one_thread):
    """Scores scaled by sqrt(d_out) instead of sqrt(head_dim): block 0's attention differs on its
    own input, and the report sends the learner to `gpt2mha check` for that class."""
    src = open(BOOK_GPT).read().replace("keys.shape[-1] ** 0.5", "self.d_out ** 0.5")
    (tmp_path / "mine.py").write_text(src)
    torch.save(book_model().state_dict(), tmp_path / "m.pth")
    assert main(["check-model", str(tmp_path / "m.pth"), "--class", str(tmp_path / "mine.py") + ":GPTModel",
                 "--book-config", '{"n_heads": 3}', "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_diff"] == "block 0 attn" and report["stages"][0]["ok"]
    assert "attention differs on the same input" in report["diagnosis"] and "gpt2mha check" in report["diagnosis"]


def test_capture_points_are_the_stages_forward_hooks_and_numpy_see(one_thread):
    """check-model reads gpt2mha at its capture points: the same stages, in the same order, as
    forward hooks on its modules (how a learner's model is read) and as OpenAI's formulas in
    NumPy (gpt2mha.core.reference) on the same weights, float64."""
    from gpt2mha import GPT2Config
    from gpt2mha.learn.compare import capture, capture_points, reference_stages

    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=64, n_ctx=16, n_embd=24, n_head=3, n_layer=2, tokenizer="bytes")).double().eval()
    idx = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    points = capture_points(model, idx)
    hooked, _ = capture(model, idx, 2)
    numpy = reference_stages(model.state_dict(), 3, idx)
    assert list(points) == list(hooked) == list(numpy) and len(points) == 1 + 3 * 2 + 2
    for name in points:
        torch.testing.assert_close(points[name], hooked[name], atol=1e-12, rtol=0)
        torch.testing.assert_close(points[name], numpy[name], atol=1e-10, rtol=0)


def test_check_model_openai_against_numpy_reference(openai_dir, capsys):
    assert main(["check-model", openai_dir[0]]) == 0
    assert "gpt2mha.core.reference" in capsys.readouterr().out


def test_check_model_reports_what_cannot_run(tmp_path, capsys):
    nano_checkpoint(str(tmp_path / "ckpt.pt"))
    assert main(["check-model", str(tmp_path / "nope.pt")]) == 2
    assert "nope.pt: no such file or directory" in capsys.readouterr().out
    assert main(["check-model", str(tmp_path / "ckpt.pt"), "--class", BOOK_GPT + ":GPTModel"]) == 2
    assert "COULD NOT RUN" in capsys.readouterr().out


@pytest.mark.parametrize("bias", [True, False])
def test_builtin_nanogpt_reference_agrees_with_nanogpts_model(bias, one_thread):
    """gpt2mha.learn.nanogpt_gpt.GPT, loaded with the state dict of the nanoGPT-layout model of
    tests/data (nanoGPT's erf GELU, bias on or off), computes what that model computes: every
    stage check-model records and the logits of both forward branches, in float64."""
    from gpt2mha.learn.compare import capture
    from gpt2mha.learn.nanogpt_gpt import GPT as BuiltinGPT, GPTConfig as BuiltinConfig

    args = dict(n_layer=2, n_head=3, n_embd=24, block_size=16, bias=bias, vocab_size=256, dropout=0.0)
    theirs = _randomize(NanoGPT(NanoConfig(**args, gelu="none")), 3).double()
    ours = BuiltinGPT(BuiltinConfig(**args)).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours.double()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, loss = ours(idx, targets=idx)
        torch.testing.assert_close(full, theirs(idx, targets=idx)[0], atol=1e-10, rtol=0)
        torch.testing.assert_close(ours(idx)[0], theirs(idx)[0], atol=1e-10, rtol=0)
        assert ours(idx)[0].shape == (2, 1, 256)
        torch.testing.assert_close(ours(idx)[0], full[:, -1:], atol=1e-12, rtol=0)
        assert torch.isclose(loss, torch.nn.functional.cross_entropy(full.reshape(-1, 256), idx.reshape(-1)))
    a, _ = capture(ours, idx, 2)
    b, _ = capture(theirs, idx, 2)
    assert list(a) == list(b) and len(a) == 1 + 3 * 2 + 2
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-10, rtol=0)


def test_check_model_on_a_nanogpt_checkpoint_without_nanogpt(tmp_path, capsys, one_thread):
    """`check-model ckpt.pt` needs no nanoGPT code (--class): it runs the built-in nanoGPT
    reference, and reports what the independent nanoGPT-layout model reports."""
    nano_checkpoint(str(tmp_path / "ckpt.pt"), gelu="none")
    assert main(["check-model", str(tmp_path / "ckpt.pt"), "--json"]) == 0
    builtin = json.loads(capsys.readouterr().out)
    assert builtin["reference"] == "gpt2mha.learn.nanogpt_gpt.GPT (nanoGPT's model.py)"
    assert builtin["first_diff"] is None and builtin["gelu"] == "erf"
    assert main(["check-model", str(tmp_path / "ckpt.pt"), "--class", NANO_GPT + ":GPT", "--json"]) == 0
    independent = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in builtin["stages"]] == [s["name"] for s in independent["stages"]]
    for mine, theirs in zip(builtin["stages"], independent["stages"]):
        assert mine["ok"] == theirs["ok"] and abs(mine["max_abs_err"] - theirs["max_abs_err"]) < 1e-12
    assert abs(builtin["gelu_difference"] - independent["gelu_difference"]) < 1e-12
    assert main(["check-model", str(tmp_path)]) == 0                   # nanoGPT's out_dir
    assert "MATCHES up to the format's GELU" in capsys.readouterr().out


def test_check_model_takes_builtin_names_as_model_and_convert_do(capsys, one_thread):
    from gpt2mha.io.formats import source_format

    assert main(["check-model", "shakespeare-byte", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint  shakespeare-byte (hf)" in out and "gpt2mha.core.reference" in out and "MATCHES (exit 0)" in out
    assert source_format("someone/tiny-gpt2") == "hf" and source_format("shakespeare-byte") == "hf"
    with pytest.raises(CheckpointError, match="no such file or directory"):
        source_format("out/ckpt.pt")
