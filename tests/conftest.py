"""Shared helpers and fixtures: small random GPT-2 models (ours and Hugging Face transformers'),
the benchmark scripts of benchmarks/ loaded by path, one-thread runs and the greedy comparison."""

import importlib.util
import os
import sys

import pytest
import torch

DATA = os.path.join(os.path.dirname(__file__), "data")
SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")

#: which parameters :func:`small_model` moves away from their initial values
NOISE = {"ln": lambda name: "ln" in name,
         "ln_bias": lambda name: "ln" in name or name.endswith("bias"),
         "all": lambda name: True}


def small_model(seed=0, *, noise="ln_bias", scale=0.2, **config):
    """A random float32 :class:`gpt2mha.GPT2` in eval mode: ``GPT2Config(n_vocab=97, n_ctx=48,
    n_embd=32, n_head=4, n_layer=3)`` with ``config`` overriding fields, GPT-2's initialisation
    under ``torch.manual_seed(seed)``, then Gaussian noise of std ``scale`` added to the
    parameters :data:`NOISE` ``[noise]`` selects (LayerNorms and biases by default), so that a
    path which drops or doubles a scale or a bias is seen."""
    from gpt2mha import GPT2, GPT2Config

    torch.manual_seed(seed)
    model = GPT2(GPT2Config(**{**dict(n_vocab=97, n_ctx=48, n_embd=32, n_head=4, n_layer=3), **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if NOISE[noise](name):
                p.add_(torch.randn_like(p) * scale)
    return model


def overflowing_builtin():
    """The built-in model with ``c_attn`` scaled by 1e30: every score ``q · k`` overflows float32
    (products of +-1e60, signs mixed: inf - inf = NaN), in every layer; the weights are finite."""
    from gpt2mha import GPT2

    model = GPT2.from_pretrained("shakespeare-byte").eval()
    with torch.no_grad():
        for block in model.h:
            block.attn.c_attn.weight.mul_(1e30)
            block.attn.c_attn.bias.mul_(1e30)
    return model


@pytest.fixture
def threads():
    """``threads(n)`` sets torch's (and so the kernels') intra-op threads; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def both_paths():
    """``both_paths(fn)``: ``(fn() on the kernels' AVX-512 paths (where the CPU has them), fn() on
    their AVX2 paths)``; the features allowed before restored after."""
    from gpt2mha.kernels import dispatch

    def run(fn):
        with dispatch.limited(None):
            wide = fn()
        with dispatch.limited(()):
            return wide, fn()
    return run


def stepwise_logits(model, model32, native_step, text=b"ROMEO:\nWhat light through yonder window breaks? It is "
                                                         b"the east, and Juliet is the sun."):
    """Logits ``[T - 4, n_vocab]`` of each token of ``text`` after its first 4 (prefilled), one step at a
    time with a KVCache: ``{"own": model's forward, "native": native_step's, "f32": model32's}``."""
    from gpt2mha import KVCache

    ids = torch.tensor([list(text)])
    c, T = model.config, ids.shape[1]
    dtype = model.wte.weight.dtype
    logits = {}
    with torch.inference_mode():
        for name, m, dt in (("own", model, dtype), ("native", model, dtype), ("f32", model32, torch.float32)):
            cache = KVCache(c.n_layer, 1, c.n_head, T, c.n_embd // c.n_head, dtype=dt)
            m(ids[:, :4], cache=cache, last_only=True)
            step = native_step if name == "native" else (lambda t, cc, m=m: m(t, cache=cc, last_only=True).logits[:, -1])
            logits[name] = torch.cat([step(ids[:, t:t + 1], cache) for t in range(4, T)])
    return logits


#: :func:`small_model` as the padding, argument-check and generation tests use it: a 40-token
#: context, 2 layers, every parameter moved by noise of std 0.05
ROBUST = dict(n_ctx=40, n_layer=2, noise="all", scale=0.05)


def module_tree(model):
    """What a model holds: every module (path, type, identity), buffer and parameter (path,
    identity, storage, strides). Equal before and after a call that must leave the model as it was."""
    return ([(n, type(m), id(m)) for n, m in model.named_modules()],
            [(n, b.data_ptr(), tuple(b.shape), b.dtype) for n, b in model.named_buffers()],
            [(n, id(p), p.data_ptr(), p.stride(), p.dtype) for n, p in model.named_parameters()])


def load_benchmark(name: str = "bench"):
    """``benchmarks/NAME.py`` imported by its path, as ``gpt2mha bench`` loads bench.py (the
    benchmarks are scripts of the source checkout, not part of the package); the directory is
    put on ``sys.path`` so that the scripts import each other as they do when run."""
    if name in sys.modules:
        return sys.modules[name]
    directory = os.path.abspath(BENCHMARKS)
    if directory not in sys.path:
        sys.path.append(directory)
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@pytest.fixture(scope="session")
def bench():
    """benchmarks/bench.py (:func:`load_benchmark`)."""
    return load_benchmark("bench")


def hf_random_gpt2(seed=0, **cfg):
    """A transformers GPT2LMHeadModel with random weights, LayerNorms included (eval mode)."""
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = HFConfig(**{**dict(vocab_size=300, n_positions=64, n_embd=48, n_head=4, n_layer=2,
                                bos_token_id=None, eos_token_id=None), **cfg})
    return randomize_norms_and_biases(GPT2LMHeadModel(config).eval())


def randomize_norms_and_biases(model, **stds):
    """``model`` (a transformers GPT-2) with random LayerNorm weights (mean 1) and biases (std 0.1)
    instead of transformers' 1 and 0, so a checkpoint test sees every tensor; ``stds``: other
    parameters by name and the std of their normal draw. Returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.normal_(mean=1.0 if name.endswith("weight") else 0.0, std=0.3)
            elif name.endswith("bias"):
                p.normal_(std=0.1)
            elif name in stds:
                p.normal_(std=stds[name])
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """(transformers model, directory it was saved to with save_pretrained)."""
    model = hf_random_gpt2()
    model.save_pretrained(tmp_path / "hf")
    return model, str(tmp_path / "hf")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads; one thread is much faster on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_same_greedy(model, a, b, start: int, window: int | None = None, tol: float = 1e-4) -> None:
    """Two greedy continuations of one prompt, computed along different paths (cached or not,
    batched or alone, another library), are the same tokens, except that they may part at a
    near-tie: a position where ``model``'s uncached logits (the reference) put both chosen tokens
    within ``tol`` of the maximum, which another CPU's or thread count's summation order may flip.
    After such a position the sequences legitimately differ and are not compared further.

    Args: ``a``, ``b``: 1-D token sequences (prompt first, no padding); ``start``: prompt length;
    ``window``: condition the reference on the last ``window`` tokens only (sliding window).
    """
    a, b = [int(t) for t in a], [int(t) for t in b]
    assert len(a) == len(b) and a[:start] == b[:start], (a, b)
    for j in range(start, len(a)):
        if a[j] != b[j]:
            ctx = torch.tensor([a[:j]])[:, -(window or j):]
            with torch.no_grad():
                logits = model(ctx).logits[0, -1].double()
            best = logits.max()
            gaps = (best - logits[a[j]]).item(), (best - logits[b[j]]).item()
            assert max(gaps) <= tol * max(1.0, best.abs().item()), (
                f"position {j}: tokens {a[j]} vs {b[j]} differ, but their logits are {gaps} below the "
                f"maximum: not a near-tie, a real difference")
            return


def greedy_margin(model, ids, start: int, vocab: int | None = None) -> float:
    """Smallest gap between the largest and the second-largest logit (float64, over the first
    ``vocab`` ids) at the positions that chose ``ids[start:]`` of a greedy run of ``model`` (a
    gpt2mha GPT2). Two implementations agree on every greedy token when it is well above their
    float32 rounding differences (~1e-5), on any CPU and thread count."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits.double()[0, start - 1:len(ids) - 1, :vocab]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def cli_continuation(prompt: str, directory: str, n: int, *flags: str) -> str:
    """What ``gpt2mha generate PROMPT --temperature 0 --max-new-tokens N --model DIR [flags]``
    prints after the echoed prompt (without its final newline), run in this process."""
    import contextlib
    import io

    from gpt2mha.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["generate", prompt, "--temperature", "0", "--max-new-tokens", str(n), "--model", directory, *flags])
    out = buf.getvalue()
    assert code == 0 and out.startswith(prompt) and out.endswith("\n"), out
    return out[len(prompt):-1]


def record_sampled_logits(monkeypatch, slots_of):
    """Spy on ``Engine.sample``: returns ``{id(sequence): [logits row, ...]}``, filled with the
    logits each sequence's tokens are chosen from; ``slots_of()`` gives the scheduler's slots
    (the sequence in each slot) when a step samples."""
    from gpt2mha.inference.engine import Engine

    seen, real = {}, Engine.sample

    def sample(self, slots, logits, rows):
        for slot, row in zip(slots, rows):
            seen.setdefault(id(slots_of()[slot]), []).append(logits[row].clone())
        return real(self, slots, logits, rows)
    monkeypatch.setattr(Engine, "sample", sample)
    return seen
