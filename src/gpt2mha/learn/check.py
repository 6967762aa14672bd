"""Check a multi-head attention module someone wrote against GPT-2's attention, stage by stage.

``check("my_mha.py:MultiHeadAttention", {"d_in": 20, ...})`` imports the file (this RUNS ITS
CODE), builds the class, recognises its parameter layout from names and shapes
(``W_query/W_key/W_value[/out_proj]``, ``q_proj/k_proj/v_proj[/o_proj]``, a fused qkv
``nn.Linear``, ``c_attn/c_proj`` Conv1D, a ``heads`` ModuleList of single-head modules, or a
``torch.nn.MultiheadAttention`` inside the module), copies random reference weights in, and
runs it and a reference on the same input. What learners write is taken as it is: the head
count from the constructor argument passed, an attribute or the signature's default, else one
head of width d_out (the book's ``CausalAttention``); no ``out_proj`` means a reference
without one; bare ``nn.Parameter`` weights are tried as ``x @ W`` and ``x @ W.T``. It reports:

* each stage of the forward's order (input, projections, view, transpose, scores, weights,
  contexts, merged, output) with the expected shape and the shape seen in the module (forward
  hooks on its submodules plus a ``TorchFunctionMode`` that records every tensor operation);
  a stage counts as seen when a recorded tensor equals the reference's, and the stage after
  the last one seen is the first differing stage;
* the output's max abs error, and for a module whose forward takes a cache (``past``,
  ``past_key_values``, ``kv_cache``, ``use_cache``, ``start_pos`` ...) the error of a cached step
  (first ``past`` tokens, then the rest with what the first call cached);
* eval-mode determinism: a second run, and with a dropout argument a copy built with dropout
  0.5 run twice, must give the dropout-0 output (``F.dropout`` without ``training=``);
* a diagnosis: the reference is re-run with each classic mistake
  (:data:`~gpt2mha.learn.check_reference.MISTAKES`) and the mistakes that reproduce the
  module's output exactly are named; shapes and exceptions add the mistakes that stop a module
  from running (a ``view`` on a non-contiguous tensor, a missing transpose before ``q @ kᵀ``).

Every check also rebuilds the module with another head count and runs it at
:data:`~gpt2mha.learn.check_variations.LONG_TOKENS` tokens (past 64), cached step included, so
a hard-coded head count or a fixed-size mask or window is caught. The cached step tries the
common conventions (:func:`~gpt2mha.learn.check_cache.cached_step`): a returned ``present``
fed back (``past``, ``layer_past``, ``past_key_values`` with ``use_cache``), a cache object
filled in place (the user's ``*Cache`` class, transformers' ``Cache`` interface, a dict, a
list), or a cache kept in the module (``use_cache=True``, ``start_pos``).

Exit codes (the CLI): 0 the module matches, 1 it runs but does not match, 2 it could not be
checked (file, class, constructor, layout or forward failed), 3 it matches without a cache but
its forward takes a cache (argument, flag or position) that no convention could use, so the
cached path was not compared.

The checker in parts (``gpt2mha.learn.``): ``check_load`` imports the class and reads its
signatures, ``check_layout`` recognises its projections and heads, ``check_reference`` is the
reference attention with the classic mistakes, ``check_stages`` records the module's operations
and finds the stages among them, ``check_cache`` runs the cached step and ``check_variations``
the other head count and length; this module runs them in order and writes the report.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .check_cache import CacheResult, cached_step, plain_kwargs
from .check_layout import Layout, has_bare_weights, recognise_layout
from .check_load import (DROPOUT_NAMES, CheckError, construct, constructor_kwargs, forward_takes_past, load_class,
                         raised_at)
from .check_reference import (MISTAKES, TOL, applicable_mistakes, copy_params, diagnose_by_reproduction, make_params,
                              max_err, reference)
from .check_stages import diagnose_by_shapes, first_differing, run_module, stage_rows
from .check_variations import LONG_TOKENS, run_variations


@dataclass
class CheckReport:
    """Everything :func:`check` found; ``exit_code`` is 0 match, 1 mismatch, 2 could not run,
    3 match without cache (forward takes a cache that could not be compared); ``verdict`` is
    "match", "mismatch", "error" or "match_without_cache". ``variations``: the other head count
    and length checked (:class:`~gpt2mha.learn.check_variations.Variation`)."""

    target: str
    verdict: str = "error"
    exit_code: int = 2
    kwargs: dict = field(default_factory=dict)
    layout: str = ""
    config: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    first_differing_stage: str | None = None
    max_abs_error: float | None = None
    cache: str = "not tested"
    cache_max_abs_error: float | None = None
    cache_stages: list = field(default_factory=list)
    dropout: str = "not tested"
    diagnoses: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    error: str | None = None
    modules_called: list = field(default_factory=list)
    variations: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["diagnosis_text"] = [MISTAKES[m] for m in self.diagnoses]
        for item in [d] + d["variations"]:
            for key in ("max_abs_error", "cache_max_abs_error"):
                if item[key] is not None and not math.isfinite(item[key]):
                    item[key] = str(item[key])
        return d


def _build(target, kwargs: dict, tokens: int, past: int) -> tuple[nn.Module, dict]:
    """Load (if a string), fill kwargs and construct the module in eval mode; the context must
    hold ``tokens`` (plus ``past`` when forward takes a cache, so the cache step can run)."""
    cls = load_class(target) if isinstance(target, str) else target
    kwargs = constructor_kwargs(cls, kwargs, tokens + (past if forward_takes_past(cls) else 0))
    return construct(cls, kwargs), kwargs


def check(target, kwargs: dict | None = None, *, batch: int = 2, tokens: int = 5, past: int = 3,
          seed: int = 0, long_tokens: int = LONG_TOKENS, vary_heads: bool = True) -> CheckReport:
    """Check a multi-head attention module against the reference (see the module docstring).

    Args:
        target: ``"FILE.py:ClassName"``, ``"package.module:ClassName"`` or an nn.Module class.
            Loading a file RUNS ITS CODE.
        kwargs: constructor arguments; required ones the caller leaves out are filled from
            :data:`~gpt2mha.learn.check_load.DEFAULT_KWARGS` (d_in=20, d_out=24, num_heads=4,
            context_length=16 or the tokens needed, dropout=0).
        batch, tokens: input ``[batch, tokens, d_in]``; past: cached tokens for the cache step
            (0 skips it; it runs only when forward takes a cache argument, flag or position
            (:func:`~gpt2mha.learn.check_load.forward_args`), and only then must the context
            hold past + tokens).
        seed: seed of the random input and weights.
        long_tokens: a second length checked (default
            :data:`~gpt2mha.learn.check_variations.LONG_TOKENS`, past 64; 0 skips it);
            vary_heads: also rebuild the module with another head count.

    Bare ``nn.Parameter`` weights are tried as ``[in, out]`` (``x @ W``) and as ``[out, in]``
    (``x @ W.T``); the report keeps the convention that matches (else the one that runs) and
    says which. With a dropout argument the module is also built with dropout 0.5 and run
    twice in eval mode: both outputs must equal the dropout-0 output. The cached step tries
    each common way of passing a cache (:func:`~gpt2mha.learn.check_cache.cached_step`); when
    forward takes one and none works, a matching module gets the verdict
    "match_without_cache" (exit code 3).

    Returns:
        :class:`CheckReport`; never raises for a faulty module (verdict "error", exit code 2).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # tensors of a few hundred numbers: threads only add overhead
    try:
        return _check(target, kwargs, batch, tokens, past, seed, long_tokens, vary_heads)
    finally:
        torch.set_num_threads(threads)


def _check(target, kwargs, batch, tokens, past, seed, long_tokens, vary_heads) -> CheckReport:
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    report = CheckReport(target=name)
    given = dict(kwargs or {})
    opts = dict(given=given, long_tokens=long_tokens, vary_heads=vary_heads)
    try:
        if batch < 1 or tokens < 2 or past < 0 or long_tokens < 0:
            raise CheckError(f"need batch >= 1, tokens >= 2, past >= 0 and long_tokens >= 0 (got {batch}, {tokens}, "
                             f"{past}, {long_tokens})")
        module, report.kwargs = _build(target, dict(given), tokens, past)
        try:
            layout = recognise_layout(module, report.kwargs)
        except CheckError as e:                 # bare weights read as [in, out] may not fit; try [out, in]
            try:
                layout = recognise_layout(module, report.kwargs, bare_in_out=False)
            except CheckError:
                raise e from None
        if not has_bare_weights(layout):
            _run_check(module, layout, report, batch, tokens, past, seed, **opts)
        else:
            report = _check_both_conventions(module, report, batch, tokens, past, seed, opts)
    except CheckError as e:
        report.verdict, report.exit_code, report.error = "error", 2, str(e)
    return report


CONVENTIONS = {True: "[in, out], used as x @ W", False: "[out, in], used as x @ W.T (nn.Linear's convention)"}


def _check_both_conventions(module, report: CheckReport, b, T, P, seed, opts: dict) -> CheckReport:
    """Run the check with bare weights read as ``[in, out]`` and as ``[out, in]``; keep the best."""
    def attempt(in_out: bool, diagnose: bool) -> CheckReport:
        r = dataclasses.replace(report, notes=[], diagnoses=[], stages=[], cache_stages=[], variations=[])
        try:
            _run_check(module, recognise_layout(module, report.kwargs, bare_in_out=in_out), r, b, T, P, seed,
                       diagnose, bare_in_out=in_out, **opts)
        except CheckError as e:
            r.verdict, r.exit_code, r.error = "error", 2, str(e)
        return r

    tried = []
    for in_out in (True, False):                      # without the (slower) diagnosis by reproduction
        tried.append((in_out, attempt(in_out, False)))
        if tried[-1][1].verdict in ("match", "match_without_cache"):
            break
    rank = {0: 0, 3: 1, 1: 2, 2: 3}                     # match, match without cache, mismatch, error
    in_out, best = min(tried, key=lambda t: (rank[t[1].exit_code], not t[0]))
    if best.verdict == "mismatch":
        best = attempt(in_out, True)
    others = [f"{CONVENTIONS[i]}: {r.verdict}" for i, r in tried if i != in_out]
    if best.verdict in ("match", "match_without_cache"):
        best.notes.append(f"bare nn.Parameter weights: the module stores them {CONVENTIONS[in_out]}")
    else:
        best.notes.append(f"bare nn.Parameter weights: tried both conventions; reporting {CONVENTIONS[in_out]}"
                          + (f" (other: {'; '.join(others)})" if others else ""))
    return best


def _run_check(module, layout: Layout, report: CheckReport, b: int, T: int, P: int, seed: int,
               diagnose: bool = True, given: dict | None = None, long_tokens: int = LONG_TOKENS,
               vary_heads: bool = True, bare_in_out: bool = True) -> None:
    """Fill ``report`` for a built module with a recognised layout (``diagnose``: also look for the
    classic mistakes that reproduce a mismatch). When the output and the cached step match, the
    module is also built and checked with another head count and at ``long_tokens`` tokens
    (:func:`~gpt2mha.learn.check_variations.plan_variations`; ``given``: the constructor
    arguments the caller passed).

    Raises:
        CheckError: the reference weights do not fit the module, or its forward raised.
    """
    h = layout.num_heads
    _describe(layout, report, b, T, P, seed)
    gen = torch.Generator().manual_seed(seed)
    p = make_params(layout, gen)
    try:
        copy_params(layout, p)
    except RuntimeError as e:
        raise CheckError(f"could not copy the reference weights in: {e}") from None
    x = torch.randn(b, P + T, layout.d_in, generator=gen)                # [b, P + T, d_in]
    ref = reference(x[:, P:], p, h)
    plain = plain_kwargs(module, T, b)
    run = run_module(module, x[:, P:], **plain)
    report.modules_called = sorted({n for n, _ in run.calls})
    report.stages = stage_rows(layout, ref, run)
    report.diagnoses = diagnose_by_shapes(run, b, T, h)
    if run.error is not None:
        report.first_differing_stage = first_differing(report.stages)
        raise CheckError(f"forward raised {type(run.error).__name__}: {run.error}{raised_at(run.error)}")
    report.max_abs_error = max_err(run.output, ref["output"])
    if run.output.shape != ref["output"].shape:
        report.notes.append(f"output shape {tuple(run.output.shape)} != expected {tuple(ref['output'].shape)}")
    outputs = {0: run.output}                                            # past length -> output
    cache = _compare_cached_step(module, layout, report, x, p, P, outputs)
    ok = outputs_ok = report.max_abs_error <= TOL and (report.cache_max_abs_error is None or
                                                       report.cache_max_abs_error <= TOL)
    _out_proj_notes(layout, report, ok)
    if outputs_ok:
        report.variations = run_variations(type(module), report.kwargs, given or {}, layout, b, T, P, seed,
                                           long_tokens, vary_heads, bare_in_out, report.notes)
        ok = _report_failing_variation(report)
    nondeterministic = _check_dropout(module, layout, report, x[:, P:], run.output, plain)
    if nondeterministic:
        report.diagnoses.append("dropout_in_eval")
        ok = False
    if diagnose and not outputs_ok and not nondeterministic and all(o is not None and o.shape == ref["output"].shape
                                                                   for o in outputs.values()):
        extra = diagnose_by_reproduction(x, p, layout, outputs, T, applicable_mistakes(layout, len(outputs) > 1))
        report.diagnoses += [m for m in extra if m not in report.diagnoses]
    if ok:
        report.diagnoses = []
    untested = cache.status == "untested" or any(v.cache_status == "untested" for v in report.variations)
    report.verdict, report.exit_code = (("match_without_cache", 3) if untested else ("match", 0)) if ok \
        else ("mismatch", 1)


def _describe(layout: Layout, report: CheckReport, b: int, T: int, P: int, seed: int) -> None:
    """The layout, the check's sizes and notes on what the layout leaves out, into ``report``."""
    report.layout = layout.describe()
    report.config = dict(b=b, T=T, past=P, d_in=layout.d_in, d_out=layout.d_out, num_heads=layout.num_heads,
                         head_dim=layout.head_dim, seed=seed)
    if layout.other:
        report.notes.append(f"parameters outside the attention layout, left as they are: {', '.join(layout.other)}")
    if layout.single_head:
        report.notes.append("no head count found (no num_heads argument, attribute or default): checked as one head "
                            "of width d_out. If the module has several heads, keep the count in self.num_heads or "
                            "take it as a constructor argument num_heads")


def _compare_cached_step(module, layout: Layout, report: CheckReport, x: torch.Tensor, p, P: int,
                         outputs: dict) -> CacheResult:
    """Run the cached step (:func:`~gpt2mha.learn.check_cache.cached_step`) and compare it with
    the reference on ``x [b, P + T, d_in]``; its output goes into ``outputs[P]``, its error and
    stages into ``report``, and the first differing stage is set (the cached step's when the
    plain run matches). Returns the :class:`~gpt2mha.learn.check_cache.CacheResult`."""
    cache = cached_step(module, x, P, layout.num_heads, layout.head_dim)
    report.cache = cache.text
    if cache.status == "failed":
        report.cache_max_abs_error = float("inf")
    elif cache.status == "tested":
        ref_cached = reference(x, p, layout.num_heads, P)
        report.cache_max_abs_error = max_err(cache.step.output, ref_cached["output"])
        report.cache_stages = stage_rows(layout, ref_cached, cache.step)
        outputs[P] = cache.step.output
    report.first_differing_stage = first_differing(report.stages)
    if report.first_differing_stage is None and report.cache_stages:
        cached = first_differing(report.cache_stages)
        report.first_differing_stage = cached and f"{cached} (cached step)"
    return cache


def _out_proj_notes(layout: Layout, report: CheckReport, ok: bool) -> None:
    """Notes on the output projection: none in the module, or one that forward never called."""
    if layout.out is None and layout.kind != "wrapper":
        report.notes.append("no output projection (out_proj / o_proj / c_proj; the book calls it optional): checked "
                            "against the reference without one")
    if layout.out is not None and layout.out.name not in report.modules_called and not ok and not layout.source:
        # (torch.nn.MultiheadAttention uses out_proj's weight without calling the module)
        report.notes.append(f"{layout.out.name} is defined but forward never called it")


def _report_failing_variation(report: CheckReport) -> bool:
    """Whether every variation matched; if one did not, its stage, diagnoses and a note go into
    ``report``."""
    failing = [v for v in report.variations if not v.ok]
    if not failing:
        return True
    f = failing[0]
    report.first_differing_stage = f"{f.first_differing_stage or 'output'} ({f.label})"
    report.diagnoses += [m for m in f.diagnoses if m not in report.diagnoses]
    what = f.error or f"the output differs by {_fmt_err(f.max_abs_error)}" + (
        f", the cached step by {_fmt_err(f.cache_max_abs_error)}" if f.cache_max_abs_error is not None else "")
    report.notes.append(f"the first configuration matches, but with {f.label}: {what}")
    return False


def _fmt_err(e: float | None) -> str:
    return "-" if e is None else f"{e:.3g}"


#: Dropout probability of the eval-mode determinism check.
DROPOUT_CHECK_P = 0.5


def _check_dropout(module, layout: Layout, report: CheckReport, x: torch.Tensor, y0: torch.Tensor,
                   plain: dict | None = None) -> bool:
    """Eval mode must turn dropout off: run the module again (same input), and, when its constructor
    takes a dropout argument, a copy built with dropout = :data:`DROPOUT_CHECK_P` twice; every
    output must equal ``y0`` (the dropout-0 output). ``plain``: forward's other arguments
    (:func:`~gpt2mha.learn.check_cache.plain_kwargs`). Returns True if one differs."""
    plain = plain or {}
    again = run_module(module, x, **plain)
    if again.error is None and max_err(again.output, y0) > 0:
        report.dropout = "FAILED: two eval-mode runs on the same input differ"
        return True
    names = [n for n in DROPOUT_NAMES if n in report.kwargs]
    if not names:
        report.dropout = "eval-mode output deterministic (the constructor takes no dropout argument)"
        return False
    kwargs = {**report.kwargs, **{n: DROPOUT_CHECK_P for n in names}}
    try:
        other = construct(type(module), kwargs)
        other.load_state_dict(module.state_dict())
    except (CheckError, RuntimeError) as e:
        report.dropout = f"not tested (building it with {names[0]}={DROPOUT_CHECK_P} failed: {e})"
        return False
    runs = [run_module(other, x, **plain) for _ in range(2)]
    if any(r.error is not None for r in runs):
        error = runs[0].error or runs[1].error
        report.dropout = f"not tested (forward with {names[0]}={DROPOUT_CHECK_P} raised {error})"
        return False
    errs = [max_err(r.output, y0) for r in runs]
    what = ", ".join(f"{n}={DROPOUT_CHECK_P}" for n in names)
    if max(errs) > TOL:
        same = max_err(runs[0].output, runs[1].output) == 0
        report.dropout = (f"FAILED: in eval mode with {what} the output differs from dropout 0 by {max(errs):.3g}"
                          + ("" if same else " and from run to run"))
        return True
    report.dropout = f"tested: in eval mode with {what} the output equals dropout 0 (max abs error {max(errs):.3g})"
    return False


def _fmt_shape(shape, count=1) -> str:
    if shape is None:
        return "-"
    return str(tuple(shape)) + (f" x{count}" if count > 1 else "")


def format_report(r: CheckReport) -> str:
    """The report as terminal text, ending with the result line that names the exit code."""
    args = ", ".join(f"{k}={v!r}" for k, v in r.kwargs.items())
    lines = [f"check {r.target}" + (f"({args})" if args else "")]
    if r.layout:
        c = r.config
        lines.append(f"layout: {r.layout}")
        lines.append(f"input: b={c['b']} T={c['T']} d_in={c['d_in']} (random weights and input, seed {c['seed']})")
    for title, rows in (("stages", r.stages), ("stages of the cached step", r.cache_stages)):
        if not rows or (title != "stages" and r.cache_max_abs_error is not None and r.cache_max_abs_error <= TOL):
            continue
        first = first_differing(rows)
        lines.append(f"\n{title}:\n  {'stage':<12} {'expected':<20} {'seen':<20} values")
        for row in rows:
            later_found = any(x.found for x in rows[rows.index(row):])
            status = ("ok" if row.found else "not materialised" if row.stage in ("scores", "weights") and later_found
                      else "not reached" if r.error and row.seen is None else "differ")
            if row.seen is not None and row.expected is not None and tuple(row.seen) != tuple(row.expected):
                status = "SHAPE differs"
            mark = "   <- first differing stage" if row.stage == first and r.verdict != "match" else ""
            lines.append(f"  {row.stage:<12} {_fmt_shape(row.expected, row.count):<20} "
                         f"{_fmt_shape(row.seen, row.count if row.found else 1):<20} {status}{mark}")
    if r.max_abs_error is not None:
        lines.append(f"\noutput max abs error: {r.max_abs_error:.3g} (match below {TOL:g})")
    if r.layout:
        lines.append(f"cache: {r.cache}" + (f", max abs error {r.cache_max_abs_error:.3g}"
                                            if r.cache_max_abs_error is not None else ""))
        lines.append(f"dropout: {r.dropout}")
    if r.variations:
        lines.append("also checked (rebuilt, new random weights and input):")
        for v in r.variations:
            c = v.config
            sizes = ", ".join(f"{k}={c[k]}" for k in ("num_heads", "head_dim", "T") if not v.label.startswith(k + "="))
            text = f"  {v.label} ({sizes}): "
            if v.error:
                text += f"{v.error}   DIFFERS"
            else:
                text += f"output max abs error {_fmt_err(v.max_abs_error)}"
                if v.cache_status in ("tested", "failed"):
                    text += f", cached step {_fmt_err(v.cache_max_abs_error)}"
                elif v.cache_status == "untested":
                    text += ", cache not tested"
                text += "   ok" if v.ok else "   DIFFERS" + (f" (first differing stage: {v.first_differing_stage})"
                                                           if v.first_differing_stage else "")
            lines.append(text)
    for note in r.notes:
        lines.append(f"note: {note}")
    if r.error:
        lines.append(f"\nerror: {r.error}")
    if r.diagnoses:
        lines.append("\ndiagnosis:")
        lines += [f"  - {MISTAKES[m]}" for m in r.diagnoses]
    elif r.verdict == "mismatch":
        lines.append("\ndiagnosis: none of the classic mistakes reproduces this output; start at the first "
                     "differing stage")
    result = {"match": "MATCH: the module computes GPT-2's multi-head causal attention (exit 0)",
              "mismatch": "MISMATCH: the module runs but its output differs from the reference (exit 1)",
              "error": "COULD NOT RUN: the module could not be checked (exit 2)",
              "match_without_cache": "MATCH WITHOUT CACHE: the module matches without a cache, but forward takes a "
                                     "cache the check could not compare (exit 3)"}[r.verdict]
    lines.append(f"\nresult: {result}")
    return "\n".join(lines)

