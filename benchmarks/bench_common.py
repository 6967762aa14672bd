"""The helpers that the sections of ``benchmarks/bench.py`` (``gpt2mha bench``) share, several of
which the other benchmarks use too (they import them from bench: ``from bench import
real_text_tokens``): the random checkpoint and its loaders, the timing (medians, contenders in
turn), greedy decoding on either side, real text in a model's tokenizer with the top-1 agreement
and the logits' cosine on it, the bytes of weights a decode step reads against the machine's memory
bandwidth, and the rows of bench's table.

transformers is a benchmark/test dependency only; it is imported inside the functions here.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from gpt2mha.api import GPT2
from gpt2mha.core.model import GPT2Config
from gpt2mha.inference.quant import QuantizedLinear
from gpt2mha.io.tokenizer import get_tokenizer

DECISIVE = 0.05          # top-2 probability margin that makes a position "decisive" for agreement
REPO_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare.txt")


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: gpt2mha bench compares against Hugging Face transformers, which is not "
                         "installed; pip install -e \".[test]\" in a checkout, or pip install transformers (a "
                         "benchmark/test dependency only)") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()           # no load/save bars among the figures
    return transformers


# ------------------------------------------------------------------------------ the weights
def random_checkpoint(directory: str, config: GPT2Config, seed: int = 0) -> str:
    """Save a random ``GPT2LMHeadModel`` of ``config``'s sizes with transformers; returns the dir.

    No bos/eos token is set, so greedy generation never stops early on either side.
    """
    transformers = _require_transformers()
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(vocab_size=config.n_vocab, n_positions=config.n_ctx, n_embd=config.n_embd,
                                        n_head=config.n_head, n_layer=config.n_layer, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    model.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:      # tell our loader which tokenizer
        cfg = json.load(f)
    cfg["gpt2mha"] = {"tokenizer": config.tokenizer}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def load_ours(directory: str, dtype: torch.dtype = torch.float32) -> GPT2:
    return GPT2.from_pretrained(directory, dtype=dtype)


def load_hf(directory: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    transformers = _require_transformers()
    return transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation=attn, dtype=dtype).eval()


# ------------------------------------------------------------------------------ timing
def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """Median wall time (s) of each callable, run round-robin (a, b, a, b, ...) so that a slow
    spell of the machine hits every contender alike; ``warmup`` untimed rounds first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _prompt(batch: int, length: int, n_vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, n_vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers ``generate``: greedy, KV cache on (``use_cache``), exactly ``new_tokens``."""
    with torch.inference_mode():
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)


def ours_greedy(model: GPT2, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(idx, new_tokens, temperature=0)


@torch.inference_mode()
def greedy_without_cache(model: GPT2, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding that recomputes the whole sequence every step (no cache at all)."""
    seq = idx
    for _ in range(new_tokens):
        logits = model(seq, last_only=True).logits[:, -1]                 # [B, n_vocab]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


# ------------------------------------------------------------------------------ the rows of the table
def row(figure, value, vs, unit, ratio=None, target=None, met=None, note=""):
    """One table row: ``figure`` reads "A / B"; ``value`` is A, ``vs`` is B, ``ratio`` A / B."""
    return dict(figure=figure, value=value, vs=vs, unit=unit, ratio=ratio, target=target, met=met, note=note)


def _ratio_row(figure, value, vs, unit, target_min=None, target_max=None, note=""):
    ratio = value / vs if value and vs else None
    target, met = None, None
    if target_min is not None:
        target, met = f">= {target_min}", ratio is not None and ratio >= target_min
    if target_max is not None:
        target, met = f"<= {target_max}", ratio is not None and ratio <= target_max
    return row(figure, value, vs, unit, ratio, target, met, note)


# ------------------------------------------------------------------------------ real text and top-1 agreement
def real_text_tokens(config: GPT2Config, n_tokens: int, path: str | None = None,
                     tail: bool = False) -> torch.Tensor | None:
    """``n_tokens`` tokens of real text (tinyshakespeare by default) in the model's tokenizer:
    the first ones, or with ``tail`` the last ones (the part a model trained on the first 90%
    never saw)."""

    path = path or REPO_TEXT
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = text[-n_tokens * 8:] if tail else text[:n_tokens * 8]
    ids = get_tokenizer(config.tokenizer).encode(text)
    return torch.tensor(ids[-n_tokens:] if tail else ids[:n_tokens], dtype=torch.long)


@torch.inference_mode()
def top1_agreements(reference: GPT2, other: GPT2, tokens: torch.Tensor,
                    min_margin: float = DECISIVE) -> tuple[float, float]:
    """``(all, decisive)``: the fraction of positions where ``other``'s argmax equals
    ``reference``'s (teacher forcing, windows of n_ctx tokens), over every position and over the
    positions where the reference is decisive: its two most likely tokens differ in probability
    by at least ``min_margin`` (near-ties flip under any rounding, so these measure the
    precision, not the coin toss). One forward of each model per window; nan where no position
    counts."""
    n_ctx = reference.config.n_ctx
    same = [0, 0]
    total = [0, 0]
    for start in range(0, len(tokens), n_ctx):
        window = tokens[start:start + n_ctx][None]
        ref = reference(window).logits.float()                             # [1, T, n_vocab]
        top2 = ref.softmax(-1).topk(2, dim=-1).values
        agree = ref.argmax(-1) == other(window).logits.argmax(-1)
        for i, keep in enumerate((torch.ones_like(agree), (top2[..., 0] - top2[..., 1]) >= min_margin)):
            same[i] += int((agree & keep).sum())
            total[i] += int(keep.sum())
    a, d = (s_ / t_ if t_ else float("nan") for s_, t_ in zip(same, total))
    return a, d


def top1_agreement(reference: GPT2, other: GPT2, tokens: torch.Tensor, min_margin: float = 0.0) -> float:
    """Fraction of positions where ``other``'s argmax equals ``reference``'s; with ``min_margin``
    > 0 only over the positions where the reference is decisive (:func:`top1_agreements`)."""
    agree, decisive = top1_agreements(reference, other, tokens, min_margin)
    return decisive if min_margin > 0 else agree


def logits_cosine(reference: GPT2, other: GPT2, tokens: torch.Tensor) -> float:
    """Cosine similarity of ``other``'s logits to ``reference``'s over real text (all positions
    of the first n_ctx-token window, flattened)."""
    window = tokens[:reference.config.n_ctx][None]
    with torch.inference_mode():
        a, b = reference(window).logits.double(), other(window).logits.double()
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


# ------------------------------------------------------------------------------ the bytes a step reads
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()`` or the machine type."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def memory_bandwidth(mb: int = 340, repeats: int = 5) -> float:
    """Bytes/s ``torch.sum`` reads from a float32 tensor of ``mb`` MB (larger than any cache):
    the rate a decode step's weight reads can hope for on this machine."""
    x = torch.ones(mb * 250_000)
    t = median_seconds(lambda: x.sum(), repeats, warmup=1)
    return x.numel() * 4 / t


def step_bytes(model: GPT2) -> int:
    """Bytes of weights one decode step reads at batch 1: every block matrix and the LM head as
    stored for the kernels (int8/int4 with their scales, or float), with their biases."""

    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            names = ("weight", "scales") if m.scheme == "int8" else ("packed", "scale_zero")
            total += sum(getattr(m, n).nbytes for n in names) + (m.bias.nbytes if m.bias is not None else 0)
    return total

