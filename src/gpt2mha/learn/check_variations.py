"""More configurations of a module that matched: rebuilt with another head count and run past 64
tokens, so a hard-coded head count or a fixed-size mask or window is caught.
"""

from __future__ import annotations

import inspect as pyinspect
from dataclasses import dataclass, field

import torch

from .check_cache import cached_step, plain_kwargs
from .check_layout import Layout, recognise_layout
from .check_load import CONTEXT_NAMES, HEAD_ALIASES, CheckError, construct, forward_takes_past, is_count, raised_at
from .check_reference import (TOL, applicable_mistakes, copy_params, diagnose_by_reproduction, make_params, max_err,
                              reference)
from .check_stages import first_differing, run_module, stage_rows

#: A second sequence length every check also runs (with the cache step): past 64, and past any
#: small fixed window or buffer a module may hide.
LONG_TOKENS = 70


@dataclass
class Variation:
    """One more configuration the check ran after the first one matched: ``label`` says what
    changed (``num_heads=3``, ``T=70``), ``config`` the sizes; the output's and the cached step's
    max abs errors, the cache text and status (see
    :class:`~gpt2mha.learn.check_cache.CacheResult`), ``ok``, the error forward raised (or None),
    the first differing stage and the diagnoses."""

    label: str
    config: dict = field(default_factory=dict)
    max_abs_error: float | None = None
    cache: str = ""
    cache_status: str = ""
    cache_max_abs_error: float | None = None
    ok: bool = False
    error: str | None = None
    first_differing_stage: str | None = None
    diagnoses: list = field(default_factory=list)


def other_head_counts(layout: Layout) -> list[int]:
    """Head counts to rebuild the module with, nearest the layout's first: divisors of d_out
    (not 1 or d_out) for one projection per role, any count for per-head modules."""
    h = layout.num_heads
    if layout.kind == "wrapper":
        return [c for c in (3, 2, 5) if c != h][:2]
    d = layout.d_out
    divisors = [c for c in range(2, d) if d % c == 0 and c != h]
    return sorted(divisors, key=lambda c: (abs(c - h), c))[:3]


def plan_variations(cls: type, kwargs: dict, given: dict, layout: Layout, T: int, P: int,
                    long_tokens: int = LONG_TOKENS, vary_heads: bool = True) -> tuple[list, list[str]]:
    """The configurations to check besides the first: ``([(label, [kwargs candidates], T), ...],
    notes on what could not be varied)``.

    * another head count (:func:`other_head_counts`), when the constructor takes one
      (:data:`HEAD_ALIASES`): a module that hard-codes its count passes only when the count
      asked for happens to equal it;
    * ``long_tokens`` tokens (past 64), with a context argument the caller did not give raised
      to hold them (plus the past); a context the caller gave caps the length.
    """
    try:
        params = pyinspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    plans, notes = [], []
    if vary_heads and not layout.single_head:
        name = next((n for n in HEAD_ALIASES if n in kwargs or n in params), None)
        counts = other_head_counts(layout)
        if name is None:
            notes.append(f"head count not varied: the constructor takes no head count argument ({layout.heads_from})")
        elif counts:
            plans.append((name, [{**kwargs, name: c} for c in counts], T))
    if long_tokens and long_tokens > T:
        past = P if forward_takes_past(cls) else 0
        contexts = [n for n in CONTEXT_NAMES if n in kwargs or n in params]
        fixed = {n: given[n] for n in contexts if is_count(given.get(n))}
        T2 = min([long_tokens] + [v - past for v in fixed.values()])
        if T2 <= T:
            n = next(iter(fixed))
            notes.append(f"not checked at {long_tokens} tokens: {n}={fixed[n]} was given (pass {n}>={long_tokens + past} "
                         f"to check past 64 tokens)")
        else:
            long_kwargs = {**kwargs, **{n: max(T2 + past, kwargs[n] if is_count(kwargs.get(n)) else 0)
                                        for n in contexts if n not in fixed}}
            plans.append((None, [long_kwargs], T2))
    return plans, notes


def run_variations(cls: type, kwargs: dict, given: dict, layout: Layout, b: int, T: int, P: int, seed: int,
                   long_tokens: int, vary_heads: bool, bare_in_out: bool, notes: list) -> list[Variation]:
    """Build and check each configuration of :func:`plan_variations` (new random weights and
    input, the cached step included); a head count the module cannot be built with is skipped
    for the next candidate. Notes on what was not varied are appended to ``notes``."""
    plans, skipped = plan_variations(cls, kwargs, given, layout, T, P, long_tokens, vary_heads)
    notes += skipped
    out = []
    for i, (name, candidates, tokens) in enumerate(plans):
        errors = []
        for kw in candidates:
            try:
                module = construct(cls, kw)
                vlayout = recognise_layout(module, kw, bare_in_out=bare_in_out)
            except CheckError as e:
                errors.append(str(e))
                continue
            label = f"{name}={kw[name]}" if name else f"T={tokens}"
            out.append(_check_variation(module, vlayout, label, b, tokens, P, seed + 1 + i,
                                        layout.num_heads if name else None))
            break
        else:
            notes.append(f"{name} not varied: building the module with {name} in "
                         f"{[kw[name] for kw in candidates]} failed ({errors[-1] if errors else 'no candidate'})")
    return out


def _check_variation(module, layout: Layout, label: str, b: int, T: int, P: int, seed: int,
                     first_heads: int | None) -> Variation:
    """Compare one rebuilt module with the reference: the output and the cached step; on a
    mismatch the first differing stage and a diagnosis (``first_heads``: the first
    configuration's head count, to recognise a hard-coded one)."""
    h, hd = layout.num_heads, layout.head_dim
    v = Variation(label, dict(b=b, T=T, past=P, d_in=layout.d_in, d_out=layout.d_out, num_heads=h, head_dim=hd,
                              seed=seed))
    gen = torch.Generator().manual_seed(seed)
    p = make_params(layout, gen)
    try:
        copy_params(layout, p)
    except RuntimeError as e:
        v.error = f"could not copy the reference weights in: {e}"
        return v
    x = torch.randn(b, P + T, layout.d_in, generator=gen)
    ref = reference(x[:, P:], p, h)
    run = run_module(module, x[:, P:], **plain_kwargs(module, T, b))
    if run.error is not None:
        v.error = f"forward raised {type(run.error).__name__}: {run.error}{raised_at(run.error)}"
        v.first_differing_stage = first_differing(stage_rows(layout, ref, run))
        return v
    v.max_abs_error = max_err(run.output, ref["output"])
    outputs, refs = {0: run.output}, {0: ref}
    cache = cached_step(module, x, P, h, hd)
    v.cache, v.cache_status = cache.text, cache.status
    if cache.status == "failed":
        v.cache_max_abs_error = float("inf")
    elif cache.status == "tested":
        refs[P] = reference(x, p, h, P)
        v.cache_max_abs_error = max_err(cache.step.output, refs[P]["output"])
        outputs[P] = cache.step.output
    v.ok = v.max_abs_error <= TOL and (v.cache_max_abs_error is None or v.cache_max_abs_error <= TOL)
    if v.ok:
        return v
    v.first_differing_stage = first_differing(stage_rows(layout, ref, run))
    if v.first_differing_stage is None and P in refs:
        cached = first_differing(stage_rows(layout, refs[P], cache.step))
        v.first_differing_stage = cached and f"{cached} (cached step)"
    if any(o is None or o.shape != refs[k]["output"].shape for k, o in outputs.items()):
        return v
    if first_heads and first_heads != h and layout.d_out % first_heads == 0 and all(
            max_err(o, reference(x if past else x[:, P:], p, first_heads, past)["output"]) <= TOL
            for past, o in outputs.items()):
        v.diagnoses = ["hard_coded_heads"]
    else:
        v.diagnoses = diagnose_by_reproduction(x, p, layout, outputs, T, applicable_mistakes(layout, len(outputs) > 1))
    return v

