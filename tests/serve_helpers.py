"""Shared by the server's tests (tests/test_serve.py, tests/test_serve_scheduler.py,
tests/test_serve_lifecycle.py): the built-in model and its tokenizer, offline ``generate``'s
continuation (the reference for every text) and the comparison of greedy texts with it, a
:meth:`RowSampler.draw` scripted per sequence, waiting for a condition, and
benchmarks/serve_load.py loaded by its path."""

import importlib.util
import os
import time

import pytest
import torch

from conftest import assert_same_greedy
from gpt2mha import GPT2, DEFAULT_MODEL
from gpt2mha.inference.sampling import RowSampler
from gpt2mha.io.tokenizer import tokenizer_for

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def builtin(one_thread):
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return model, tokenizer_for(model.config)


def assert_same_text(model, tok, prompt, got, ref):
    """A greedy text from the server equals offline generate's, or parts from it only at a
    near-tie of the reference logits (conftest.assert_same_greedy; byte model: one token a byte).
    The built-in model is float32, served and generated without ``batch_invariant`` (its
    default): rows of a batch may round apart by ~1e-6 (tests/test_batch_invariance.py holds
    the invariant path to bitwise equality)."""
    if got != ref:
        a, b = tok.encode(prompt + ref), tok.encode(prompt + got)
        n = len(tok.encode(prompt))
        b = (b + a[len(b):])[:len(a)]
        assert_same_greedy(model, a, b, n)


def offline(model, tok, prompt, max_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=None):
    """What offline ``generate`` (as ``gpt2mha generate``) continues ``prompt`` with: ids and text."""
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, vocab_size=tok.n_vocab)[0, len(ids):].tolist()
    return out, tok.decode(out)


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def draw_in(sched, script):
    """A :meth:`RowSampler.draw` that, for ``sched``'s sequences, returns ``script(seq, logits)``
    (or draws as usual where that returns None), and draws as usual for every other sampler
    (offline ``generate``'s references)."""
    real = RowSampler.draw

    def draw(self, logits):
        samplers = sched().engine.samplers
        token = script(sched().slots[samplers.index(self)], logits) if self in samplers else None
        return real(self, logits) if token is None else token
    return draw


def _serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(ROOT, "benchmarks", "serve_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
