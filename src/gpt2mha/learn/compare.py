"""``gpt2mha check-model``: a learner's whole model against gpt2mha on the same weights, stage by stage.

The checkpoint is read twice: into :class:`~gpt2mha.GPT2` (:mod:`gpt2mha.io.formats`) and into
the learner's own model, their class given as ``FILE.py:Class`` (built as the format builds
it: the book's ``GPTModel(cfg)``, nanoGPT's ``GPT(GPTConfig(**model_args))``) and loaded with
its own ``load_state_dict`` from the file's tensors, or, without a class, the format's
reference: :class:`gpt2mha.learn.book_gpt.GPTModel` for the book,
:class:`gpt2mha.learn.nanogpt_gpt.GPT` (nanoGPT's ``model.py``) for nanoGPT,
:mod:`gpt2mha.core.reference` (NumPy, OpenAI's formulas) for OpenAI's and Hugging Face's
checkpoints (a built-in name or hub id is one of those). Both run in float64 on the same random
ids and are read at the same stages, in order: the embeddings (input of block 0), each block's
attention output, MLP output and output, the final LayerNorm and the logits. gpt2mha's model is
read at its capture points (:func:`capture_points`); a model without them (the learner's, the
book's, nanoGPT's) through forward hooks on its modules, found by name (:func:`capture`). The
first stage whose max abs error exceeds ``atol · max(1, max|gpt2mha|)`` is reported, with a
diagnosis found by re-running gpt2mha's sublayer on the learner's own input (e.g. nanoGPT's
exact-erf GELU where GPT-2 uses the tanh approximation; a LayerNorm with another epsilon).

Warning: a ``FILE.py`` is imported and run with the user's permissions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core.hooks import record
from ..io.checkpoints import CheckpointError
from ..io.formats import book_state_dict_of, read_any, read_book, read_torch_file, source_format

BLOCKS = ("trf_blocks", "transformer.h", "h", "blocks", "layers", "transformer.blocks", "model.layers")
ATTN = ("att", "attn", "attention", "self_attn", "mha")
MLPS = ("ff", "mlp", "feed_forward", "ffn")
FINAL = ("final_norm", "transformer.ln_f", "ln_f", "norm_f", "norm")


@dataclass
class StageResult:
    """One compared activation: ``name`` (e.g. ``"block 1 mlp"``), its shape, the max abs
    error against gpt2mha, gpt2mha's max abs value (the tolerance's scale), and ``ok``."""

    name: str
    shape: list[int]
    max_abs_err: float
    scale: float
    ok: bool


@dataclass
class ModelReport:
    """The outcome of :func:`check_model`. ``exit_code``: 0 every stage matches, 1 a stage
    differs (``first_diff``, ``diagnosis``), 2 the model could not be run (``error``).

    ``gelu``: the GELU gpt2mha's stages were computed with: ``"tanh"`` (GPT-2's, what gpt2mha
    runs), or ``"erf"`` for a nanoGPT checkpoint whose model matches only with nanoGPT's exact
    GELU, the format's (``gelu_difference``: then the logits' max abs difference with the tanh
    GELU, what running the checkpoint in gpt2mha changes)."""

    source: str
    format: str | None = None
    reference: str | None = None
    stages: list[StageResult] = field(default_factory=list)
    first_diff: str | None = None
    diagnosis: str | None = None
    error: str | None = None
    atol: float = 1e-6
    gelu: str = "tanh"
    gelu_difference: float | None = None

    @property
    def exit_code(self) -> int:
        return 2 if self.error else (1 if self.first_diff else 0)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "exit_code": self.exit_code}


def load_class(target: str):
    """``FILE.py:Class`` or ``package.module:Class`` → the class (imports and runs the file).

    Raises:
        ValueError: no ``:``, a missing file or module, or no such class in it.
    """
    if ":" not in target:
        raise ValueError(f"--class {target!r}: expected FILE.py:ClassName or package.module:ClassName")
    where, name = target.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"--class {target!r}: no such file {where}")
        mod_name = "gpt2mha_user_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module                       # dataclasses in the file look themselves up here
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"--class {target!r}: cannot import {where}: {e}") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"--class {target!r}: {where} has no {name}")
    return cls


# ------------------------------------------------------------------------------- capture
def _find(model, paths):
    for path in paths:
        m = model
        for part in path.split("."):
            m = getattr(m, part, None)
            if m is None:
                break
        if m is not None:
            return m
    return None


def _first(out):
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "logits", out)


def capture_points(model, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt2mha's stages for ``idx [B, T]``, read at its capture points (:func:`~gpt2mha.core.hooks.record`).

    Args:
        model: a gpt2mha :class:`~gpt2mha.GPT2` (in eval mode: the stages are read as computed).

    Returns:
        Stage name → float64 tensor, in forward order: ``embeddings`` (``h.0.hook_resid_pre``
        ``[B, T, n_embd]``), per block ``block {i} attn`` (``hook_attn_out``), ``block {i} mlp``
        (``hook_mlp_out``), ``block {i} out`` (``hook_resid_post``), then ``ln_f``
        (``ln_f.hook_normalized``) and ``logits [B, T, n_vocab]``, the model's output.
    """
    stages = {"embeddings": "h.0.hook_resid_pre"}
    for i in range(model.config.n_layer):
        stages.update({f"block {i} attn": f"h.{i}.hook_attn_out", f"block {i} mlp": f"h.{i}.hook_mlp_out",
                       f"block {i} out": f"h.{i}.hook_resid_post"})
    stages["ln_f"] = "ln_f.hook_normalized"
    out = []
    with torch.no_grad():
        seen = record(model, list(stages.values()), lambda: out.append(model(idx).logits))
    return {**{name: seen[point].double() for name, point in stages.items()}, "logits": out[0].double()}


def capture(model, idx: torch.Tensor, n_layer: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A model without gpt2mha's capture points (the learner's, the book's, nanoGPT's): run
    ``model(idx)`` with forward hooks on its modules; returns ``(outputs, inputs)`` by stage name
    (the stages of :func:`capture_points`), float64.

    Finds the blocks (a ModuleList/Sequential of ``n_layer`` under a name of :data:`BLOCKS`),
    in each the attention (:data:`ATTN`) and MLP (:data:`MLPS`) children, and the final norm
    (:data:`FINAL`); stages whose module is not found are left out.

    Raises:
        ValueError: no block list of ``n_layer`` modules.
    """
    blocks = _find(model, BLOCKS)
    if blocks is None or not hasattr(blocks, "__len__") or len(blocks) != n_layer:
        raise ValueError(f"{type(model).__name__}: found no list of {n_layer} blocks under any of {', '.join(BLOCKS)}")
    outs, ins, handles = {}, {}, []

    def out_hook(name):
        return lambda mod, args, out: outs.__setitem__(name, _first(out).detach().double().clone())

    def in_hook(name):
        return lambda mod, args: ins.__setitem__(name, args[0].detach().double().clone()) if args else None

    handles.append(blocks[0].register_forward_pre_hook(in_hook("embeddings")))
    for i, block in enumerate(blocks):
        for kind, names in (("attn", ATTN), ("mlp", MLPS)):
            sub = _find(block, names)
            if sub is not None:
                handles.append(sub.register_forward_pre_hook(in_hook(f"block {i} {kind}")))
                handles.append(sub.register_forward_hook(out_hook(f"block {i} {kind}")))
        handles.append(block.register_forward_hook(out_hook(f"block {i} out")))
    final = _find(model, FINAL)
    if final is not None:
        handles.append(final.register_forward_hook(out_hook("ln_f")))
    try:
        with torch.no_grad():
            outs["logits"] = _first(model(idx)).detach().double()
    finally:
        for h in handles:
            h.remove()
    return {"embeddings": ins["embeddings"], **outs}, ins


def reference_stages(sd: dict[str, torch.Tensor], n_head: int, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same stages from :mod:`gpt2mha.core.reference` (NumPy, OpenAI's formulas, float64)."""
    import numpy as np

    from ..core import reference as R

    p = {k: v.detach().double().numpy() for k, v in sd.items()}
    ids = idx.numpy()
    x = p["wte.weight"][ids] + p["wpe.weight"][np.arange(ids.shape[1])]
    out = {"embeddings": x}
    n_layer = 1 + max(int(k.split(".")[1]) for k in p if k.startswith("h."))
    for i in range(n_layer):
        q = f"h.{i}."
        a, _ = R.attn(R.norm(x, p[q + "ln_1.weight"], p[q + "ln_1.bias"]), p[q + "attn.c_attn.weight"],
                      p[q + "attn.c_attn.bias"], p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"], n_head)
        x = x + a
        m = R.mlp(R.norm(x, p[q + "ln_2.weight"], p[q + "ln_2.bias"]), p[q + "mlp.c_fc.weight"],
                  p[q + "mlp.c_fc.bias"], p[q + "mlp.c_proj.weight"], p[q + "mlp.c_proj.bias"])
        x = x + m
        out.update({f"block {i} attn": a, f"block {i} mlp": m, f"block {i} out": x})
    x = R.norm(x, p["ln_f.weight"], p["ln_f.bias"])
    head = p.get("lm_head.weight", p["wte.weight"])
    out["ln_f"], out["logits"] = x, x @ head.T + p.get("lm_head.bias", 0.0)     # a classifier's head may have one
    return {k: torch.from_numpy(np.asarray(v)) for k, v in out.items()}


# ------------------------------------------------------------------------------ diagnose
def _diagnose(stage: str, ours, theirs_in: dict, theirs_out: dict, tol) -> str:
    """Why ``stage`` differs, found by re-running gpt2mha's sublayer on the learner's input."""
    parts = stage.split()
    if stage == "embeddings":
        return ("the token + position embeddings differ: GPT-2 adds wte[idx] + wpe[0 … T-1] (positions from 0); "
                "check the embedding lookups and the positions")
    if stage == "ln_f":
        return "the final LayerNorm differs: GPT-2's uses eps=1e-5 and the biased variance (unbiased=False)"
    if stage == "logits":
        return ("the LM head differs: GPT-2's logits are ln_f(x) @ wteᵀ (tied) or the checkpoint's own head; check "
                "which matrix the output layer uses and that it has no bias")
    i, kind = int(parts[1]), parts[2]
    block = ours.h[i]
    x_in = theirs_in.get(stage)
    if kind == "out":
        return ("the attention and MLP outputs match but the block's output differs: GPT-2's block is "
                "x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)) (pre-norm residuals)")
    if x_in is None:
        return f"block {i}'s {kind} differs"
    with torch.no_grad():
        if kind == "mlp":
            mlp = block.mlp
            if tol(mlp(x_in), theirs_out[stage]):
                return (f"block {i}'s MLP matches on its own input, so the LayerNorm before it (ln_2 / norm2) "
                        f"differs: GPT-2's uses eps=1e-5 and the biased variance (unbiased=False)")
            if tol(_mlp_with_erf_gelu(mlp, x_in), theirs_out[stage]):
                return (f"block {i}'s MLP uses the exact (erf) GELU, e.g. torch.nn.GELU() (nanoGPT's); GPT-2 uses "
                        f"the tanh approximation (OpenAI's gelu, nn.GELU(approximate='tanh')). The weights are the "
                        f"same; the activations differ a little at every MLP")
            return f"block {i}'s MLP differs on the same input: check c_fc → GELU (tanh) → c_proj and their weights"
        a = block.attn(x_in)[0]
        if tol(a, theirs_out[stage]):
            return (f"block {i}'s attention matches on its own input, so the LayerNorm before it (ln_1 / norm1) "
                    f"differs: GPT-2's uses eps=1e-5 and the biased variance (unbiased=False)")
        return (f"block {i}'s attention differs on the same input; check the attention class alone with "
                f"`gpt2mha check FILE.py:AttentionClass`, which names classic mistakes")


def _mlp_with_erf_gelu(mlp, x: torch.Tensor) -> torch.Tensor:
    """gpt2mha's MLP on ``x [B, T, n_embd]`` with the exact (erf) GELU (:func:`erf_gelu`)."""
    with erf_gelu([mlp]):
        return mlp(x)


@contextlib.contextmanager
def erf_gelu(mlps):
    """gpt2mha's ``mlps`` (:class:`~gpt2mha.core.model.MLP`) with the exact (erf) GELU, nanoGPT's,
    in place of GPT-2's tanh approximation while the context lasts, patched at their capture
    points: ``hook_post`` gets ``gelu(hook_pre)`` computed with ``approximate="none"``."""
    handles = []
    for mlp in mlps:
        pre = []
        handles += [mlp.hook_pre.add_hook(lambda t, hook, pre=pre: pre.append(t)),
                    mlp.hook_post.add_hook(lambda t, hook, pre=pre: F.gelu(pre.pop(), approximate="none"))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------- check
def check_model(src: str, cls: str | None = None, fmt: str | None = None, book_config: dict | None = None,
                batch: int = 2, tokens: int = 8, seed: int = 0, atol: float = 1e-6) -> ModelReport:
    """Compare the learner's model (or the format's reference) with gpt2mha on ``src``'s weights.

    Args:
        src: a checkpoint any :mod:`gpt2mha.io.formats` reader takes, a built-in model name or a
            hub id (as ``--model``; :func:`gpt2mha.io.formats.source_format`).
        cls: ``FILE.py:Class`` of the learner's model (book, nanoGPT checkpoints); None: the
            format's reference (see the module docstring).
        batch, tokens: the random ids ``[batch, min(tokens, n_ctx)]``, drawn with ``seed``.
        atol: a stage matches when ``max|theirs - ours| <= atol · max(1, max|ours|)`` (float64).

    Returns:
        A :class:`ModelReport`; errors while loading or running are reported in it (exit 2).
    """
    report = ModelReport(source=src, atol=atol)
    for name, v in (("batch", batch), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name}={v!r} must be a positive integer")
    try:
        fmt = fmt or source_format(src)
        report.format = fmt
        ours, _ = read_any(src, fmt, book_config)
    except CheckpointError as e:
        report.error = f"{type(e).__name__}: {e}"
        return report
    try:
        theirs, report.reference = _learner_model(src, fmt, cls, book_config)
    except Exception as e:                                   # the learner's file or constructor: report it
        report.error = f"{type(e).__name__}: {e}"
        return report
    c = ours.config
    ours = ours.double().eval()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, min(c.n_vocab, 50257), (batch, min(tokens, c.n_ctx)), generator=gen)
    ours_out = capture_points(ours, idx)
    try:
        if theirs is None:
            theirs_out, theirs_in = reference_stages(ours.state_dict(), c.n_head, idx), {}
        else:
            theirs_out, theirs_in = capture(theirs.double().eval(), idx, c.n_layer)
    except Exception as e:                                   # the learner's code failed: report, don't crash
        report.error = f"running {report.reference}: {type(e).__name__}: {e}"
        return report

    report.stages, report.first_diff, report.diagnosis = _compare(ours, ours_out, theirs_in, theirs_out, atol)
    if fmt == "nanogpt" and report.first_diff is not None:   # the format's GELU is nanoGPT's exact one
        with erf_gelu([block.mlp for block in ours.h]):
            stages, first_diff, _ = _compare(ours, capture_points(ours, idx), theirs_in, theirs_out, atol)
        if first_diff is None:
            report.gelu_difference = report.stages[-1].max_abs_err
            report.stages, report.first_diff, report.diagnosis, report.gelu = stages, None, None, "erf"
    return report


def _compare(ours, ours_out: dict, theirs_in: dict, theirs_out: dict, atol: float):
    """``(stages, first_diff, diagnosis)``: each stage of ``theirs_out`` against gpt2mha's
    ``ours_out`` (:class:`StageResult`), the first that differs and why (:func:`_diagnose`)."""
    def close(a, b):
        return (a.shape == b.shape and float((a - b).abs().max()) <= atol * max(1.0, float(b.abs().max()))) \
            if a.numel() else True

    stages, first_diff, diagnosis = [], None, None
    for name, mine in ours_out.items():
        if name not in theirs_out:
            continue
        t = theirs_out[name]
        if name == "logits" and t.dim() == 3 and t.shape[1] == 1 and mine.shape[1] > 1:
            mine = mine[:, -1:]                              # nanoGPT's inference forward: last position only
        if t.shape != mine.shape:
            stages.append(StageResult(name, list(t.shape), float("inf"), float(mine.abs().max()), False))
        else:
            err = float((t - mine).abs().max())
            scale = float(mine.abs().max())
            stages.append(StageResult(name, list(t.shape), err, scale, err <= atol * max(1.0, scale)))
        if not stages[-1].ok and first_diff is None:
            first_diff = name
            if t.shape != mine.shape:
                diagnosis = f"{name}: shape {list(t.shape)}, gpt2mha's {list(mine.shape)}"
            else:
                diagnosis = _diagnose(name, ours, theirs_in, theirs_out, lambda a, b: close(a.double(), b))
    return stages, first_diff, diagnosis


def _learner_model(src: str, fmt: str, cls: str | None, book_config: dict | None):
    """(the learner's model loaded with the file's own tensors, its description), or
    ``(None, "gpt2mha.core.reference …")`` for the NumPy reference."""
    if cls is None:
        if fmt == "book":
            from .book_gpt import GPTModel
            cls_obj, ref = GPTModel, "gpt2mha.learn.book_gpt.GPTModel (the book's chapter 4 model)"
        elif fmt in ("openai", "hf"):
            return None, "gpt2mha.core.reference (NumPy, OpenAI's formulas)"
        else:
            from . import nanogpt_gpt
            cls_obj, ref = nanogpt_gpt.GPT, "gpt2mha.learn.nanogpt_gpt.GPT (nanoGPT's model.py)"
    else:
        if fmt not in ("book", "nanogpt"):
            raise ValueError(f"--class needs a book or nanoGPT checkpoint (their state dict loads into your class); "
                             f"{src} is {fmt!r}: without --class it is checked against gpt2mha.core.reference")
        cls_obj, ref = load_class(cls), cls
    obj = read_torch_file(os.path.join(src, "ckpt.pt") if os.path.isdir(src) else src)
    if fmt == "book":
        _, _, cfg = read_book(src, book_config, obj=obj)
        model, sd = cls_obj(cfg), book_state_dict_of(obj)
        book_extras(model, sd, cfg)
    else:
        from ..io.layouts import strip_wrapper_prefixes
        module = sys.modules.get(cls_obj.__module__)
        config_cls = getattr(module, "GPTConfig", None)
        args = dict(obj["model_args"])
        sd = strip_wrapper_prefixes(obj["model"])
        if cls is None:                  # the built-in: nanoGPT's own fields; no causal-mask buffers (flash path)
            fields = {f.name for f in dataclasses.fields(config_cls)}
            args = {k: v for k, v in args.items() if k in fields}
            sd = {k: v for k, v in sd.items() if not (k.endswith(".attn.bias") and v.dim() == 4)}
        model = cls_obj(config_cls(**args) if config_cls is not None else args)
    result = model.load_state_dict(sd, strict=False)
    params = {n for n, _ in model.named_parameters()}
    missing = [k for k in result.missing_keys if k in params]
    if missing or result.unexpected_keys:
        raise ValueError(f"{ref}.load_state_dict: missing {missing}, unexpected {result.unexpected_keys}")
    return model, ref


def book_extras(model: torch.nn.Module, sd: dict, cfg: dict) -> None:
    """Give the learner's chapter-4 ``GPTModel`` what the state dict holds beyond it, as the book
    does: chapter 6's classifier head (``model.out_head = nn.Linear(emb_dim, num_classes)``)
    and appendix E's LoRA layers (``replace_linear_with_lora(model, rank, alpha)``: rank from
    the shapes, alpha from the config's ``lora_alpha``), in the book's order."""
    w = sd.get("out_head.linear.weight", sd.get("out_head.weight"))
    if isinstance(w, torch.Tensor) and w.dim() == 2 and (
            w.shape[0] != cfg["vocab_size"] or "out_head.bias" in sd or "out_head.linear.bias" in sd):
        model.out_head = torch.nn.Linear(w.shape[1], w.shape[0],
                                         bias="out_head.bias" in sd or "out_head.linear.bias" in sd)
    ranks = [t.shape[1] for k, t in sd.items() if k.endswith(".lora.A")]
    if ranks:
        from .book_gpt import replace_linear_with_lora
        replace_linear_with_lora(model, rank=ranks[0], alpha=cfg["lora_alpha"])


def format_model_report(r: ModelReport) -> str:
    """Human-readable :class:`ModelReport`: one line per stage, then the verdict."""
    lines = [f"checkpoint  {r.source} ({r.format or '?'})", f"compared    {r.reference or '?'} vs gpt2mha.GPT2, "
             f"float64, tolerance {r.atol:g} x max(1, |gpt2mha|)"]
    if r.error:
        return "\n".join(lines + [f"error: {r.error}", "result: COULD NOT RUN (exit 2)"])
    for s in r.stages:
        lines.append(f"  {s.name:<16} {str(s.shape):<16} max abs err {s.max_abs_err:.3g}"
                     f"{'' if s.ok else '   <-- differs'}")
    if r.first_diff:
        lines += [f"first difference: {r.first_diff}", f"diagnosis: {r.diagnosis}", "result: DIFFERS (exit 1)"]
    elif r.gelu == "erf":
        lines += [f"GELU: gpt2mha computed these stages with the exact (erf) GELU, nanoGPT's and so this format's; "
                  f"gpt2mha runs GPT-2's tanh approximation, with which the logits differ by {r.gelu_difference:.3g} "
                  f"(max abs): expected for a nanoGPT checkpoint, not an error",
                  "result: MATCHES up to the format's GELU (exit 0)"]
    else:
        lines.append("result: MATCHES (exit 0)")
    return "\n".join(lines)
