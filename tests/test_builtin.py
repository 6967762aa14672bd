"""The built-in model (issue 3): loads by name offline, meets the quality bar on held-out text
(a real measurement here, not a stored number), and samples reproducibly."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch

import gpt2mha
from gpt2mha import GPT2
from gpt2mha.train.evaluate import perplexity

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "data", "tinyshakespeare.txt")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    import gpt2mha.io.checkpoints as ck

    def no_network(repo_id):
        raise AssertionError(f"tried to download {repo_id}")

    original, ck.download = ck.download, no_network
    try:
        yield GPT2.from_pretrained(gpt2mha.DEFAULT_MODEL)
    finally:
        ck.download = original


def test_builtin_is_a_multi_head_byte_gpt2(model):
    c = model.config
    assert gpt2mha.DEFAULT_MODEL == "shakespeare-byte"
    assert c.tokenizer == "bytes" and c.n_vocab == 256 and c.n_head >= 4
    assert not model.training
    folder = os.path.join(os.path.dirname(gpt2mha.__file__), "models", gpt2mha.DEFAULT_MODEL)
    assert sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) <= 10 * 2**20


def test_bits_per_byte_on_held_out_slice(model):
    data = open(SHAKESPEARE, "rb").read()
    assert hashlib.sha256(data).hexdigest() == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    held_out = data[len(data) * 9 // 10:]                 # the last 10%: never trained on
    text = held_out[:20_000].decode("utf-8")
    result = perplexity(model, text, stride=model.config.n_ctx // 2)
    assert result.bytes == 20_000
    assert result.bits_per_byte < 2.40, result


def test_generate_with_seed_is_reproducible(model):
    idx = torch.tensor([list(b"ROMEO:\n")])
    a = model.generate(idx, 60, temperature=0.8, top_k=40, seed=1234)
    b = model.generate(idx, 60, temperature=0.8, top_k=40, seed=1234)
    assert torch.equal(a, b)
    cli = [sys.executable, "-m", "gpt2mha.cli", "generate", "ROMEO:\n", "--max-new-tokens", "60",
           "--temperature", "0.8", "--top-k", "40", "--seed", "1234"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    assert runs[0].stdout.rstrip("\n") == bytes(a[0].tolist()).decode("utf-8", errors="replace")
