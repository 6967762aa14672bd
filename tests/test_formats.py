"""Checkpoint formats learners have (issue 16, section 2): OpenAI's TF checkpoint directory,
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
from gpt2mha.checkpoints import CheckpointError
from gpt2mha.formats import convert, detect_format, load_any, read_book
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
    from gpt2mha.tokenizer import bpe_data_files

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


def test_openai_checkpoint_without_tensorflow_names_the_extra(openai_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)        # import tensorflow → ImportError
    with pytest.raises(CheckpointError, match=r"needs TensorFlow: pip install 'gpt2mha\[tf\]'"):
        GPT2.from_pretrained(openai_dir[0])
