"""What a learner's module did in its forward: every tensor operation recorded, and the
reference stages found among them.

:func:`run_module` runs the module under a ``TorchFunctionMode`` (:class:`Recorder`) that keeps
every floating tensor an operation produced, plus forward hooks naming the submodules called;
:func:`stage_rows` looks for each reference stage (input, projections, view, transpose,
scores, weights, contexts, merged, output) among the recorded tensors by value, and
:func:`diagnose_by_shapes` names mistakes visible from shapes and exceptions alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.hooks import HookPoint
from .check_layout import Layout
from .check_reference import MISTAKES

#: Stage order of a multi-head attention forward (``view``/``transpose`` do not exist in the
#: wrapper layout).
STAGES = ("input", "projections", "view", "transpose", "scores", "weights", "contexts", "merged", "output")
#: Tolerances for "this recorded tensor is that reference stage".
RTOL, ATOL = 1e-4, 1e-5

#: Names of recorded operations, by what they do.
MATMUL_OPS = ("matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "baddbmm")
SOFTMAX_OPS = ("softmax", "_softmax")
VIEW_OPS = ("view", "reshape", "unflatten", "split", "chunk", "unbind", "tensor_split")
TRANSPOSE_OPS = ("transpose", "permute", "swapaxes", "swapdims", "movedim")


@dataclass
class Op:
    """One recorded tensor operation: its name, output shape and value, index, softmax dim,
    and whether a parameter was an operand (a projection, not attention)."""

    name: str
    shape: tuple
    value: torch.Tensor
    dim: int | None = None
    on_param: bool = False


class Recorder(TorchFunctionMode):
    """Records every floating tensor (2-D or more) produced by a torch operation, cloned (so
    in-place edits after it do not change the record)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__setitem__", "size", "dim"):
            return out
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        on_param = any(isinstance(a, nn.Parameter) for a in args)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.is_floating_point():
                self.ops.append(Op(name, tuple(o.shape), o.detach().clone(), dim if name in SOFTMAX_OPS else None,
                                   on_param))
        return out


@dataclass
class Run:
    """One forward of the module: its output (or None), present, recorded ops, hook calls
    ``(module name, output shape)`` and the exception it raised (or None)."""

    output: torch.Tensor | None
    present: object
    ops: list
    calls: list
    error: BaseException | None = None


def _shape(t) -> tuple | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def run_module(module: nn.Module, x: torch.Tensor, **kwargs) -> Run:
    """Run ``module(x, **kwargs)`` under no_grad with the recorder and forward hooks on every
    submodule except gpt2mha's capture points (:class:`~gpt2mha.core.hooks.HookPoint`: a hook
    there changes what gpt2mha's attention computes, e.g. the explicit core instead of SDPA).
    Exceptions are caught into :attr:`Run.error`."""
    rec, calls = Recorder(), []

    def hook(name):
        return lambda mod, inp, out: calls.append((name, _shape(out[0] if isinstance(out, tuple) else out)))

    handles = [m.register_forward_hook(hook(name)) for name, m in module.named_modules()
               if name and not isinstance(m, HookPoint)]
    output = present = error = None
    try:
        with torch.no_grad(), rec:
            result = module(x, **kwargs)
        output, present = result, None
        if isinstance(result, (tuple, list)):
            output, present = result[0], (result[1] if len(result) > 1 else None)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"forward returned {type(output).__name__}; expected a tensor or a (tensor, ...) tuple")
    except (Exception, SystemExit) as e:   # the user's forward may raise anything
        error, output = e, None
    finally:
        for h in handles:
            h.remove()
    ops = [Op("input", tuple(x.shape), x.clone())] + rec.ops
    if output is not None:
        ops.append(Op("output", tuple(output.shape), output.detach().clone()))
    return Run(output, present, ops, calls, error)


@dataclass
class StageRow:
    """One row of the report: stage, expected shape (and count), shape seen, whether the
    reference values were found, and where (op or module name)."""

    stage: str
    expected: tuple | None
    count: int
    seen: tuple | None
    found: bool
    where: str = ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b.to(a.dtype), rtol=RTOL, atol=ATOL, equal_nan=True)


def find_op(ops: list[Op], ref: torch.Tensor) -> Op | None:
    """The first recorded op whose value has ``ref``'s shape and equals it within RTOL/ATOL; None if none."""
    return next((op for op in ops if op.shape == tuple(ref.shape) and _same(op.value, ref)), None)


def expected_stages(layout: Layout, ref: dict) -> dict[str, list[torch.Tensor] | None]:
    """Stage → reference tensors the module should produce somewhere (None: not in this layout).
    For the wrapper, head 0's slice; for scores, any of unscaled/scaled, masked or not."""
    wrapper = layout.kind == "wrapper"
    hd = layout.head_dim
    s, scaled = ref["scores"], ref["scores"] / ref["scale"]
    m = ref["mask"]
    score_forms = [s, scaled, s.masked_fill(~m, float("-inf")), scaled.masked_fill(~m, float("-inf")),
                   scaled.masked_fill(~m, -1e10), s.masked_fill(~m, -1e10)]
    head0 = (lambda t: t[:, 0]) if wrapper or layout.single_head else (lambda t: t)   # [b, T, ...] per head
    return {
        "input": [ref["input"]],
        "projections": ([ref[n][..., :hd] for n in "qkv"] if wrapper else
                        [ref["qkv"]] if layout.kind == "fused" else [ref["q"], ref["k"], ref["v"]]),
        "view": None if wrapper or layout.single_head else ref["view"],          # one head: nothing to split
        "transpose": None if wrapper or layout.single_head else ref["transpose"],
        "scores": [head0(t) for t in score_forms],
        "weights": [head0(ref["weights"])],
        "contexts": [head0(ref["contexts"])],
        "merged": None if wrapper or layout.out is None else [ref["merged"]],
        "output": [ref["output"]],
    }


def role_indices(ops: list[Op]) -> dict[str, int | None]:
    """Best guess of which recorded op plays each stage, for the "seen" shape when values differ."""
    mm = [i for i, o in enumerate(ops) if o.name in MATMUL_OPS and not o.on_param]
    sm = next((i for i, o in enumerate(ops) if o.name in SOFTMAX_OPS), None)
    sdpa = next((i for i, o in enumerate(ops) if o.name == "scaled_dot_product_attention"), None)
    scores = next((i for i in mm if sm is None or i < sm), None)
    contexts = next((i for i in mm if sm is not None and i > sm), sdpa)
    before = scores if scores is not None else (sdpa if sdpa is not None else len(ops))
    view = next((i for i, o in enumerate(ops[:before]) if o.name in VIEW_OPS and len(o.shape) == 4), None)
    trans = next((i for i, o in enumerate(ops[:before]) if o.name in TRANSPOSE_OPS and len(o.shape) == 4), None)
    merged = None
    if contexts is not None:                       # the last 3-D op before the output projection (or the output)
        out_proj = next((i for i in range(contexts + 1, len(ops)) if ops[i].on_param), None)
        end = out_proj if out_proj is not None else len(ops) - (ops[-1].name == "output")
        merged = next((i for i in range(end - 1, contexts, -1) if len(ops[i].shape) == 3), None)
    return {"input": 0, "projections": next((i for i, o in enumerate(ops) if o.on_param), None),
            "view": view, "transpose": trans, "scores": scores, "weights": sm, "contexts": contexts,
            "merged": merged, "output": len(ops) - 1 if ops[-1].name == "output" else None}


def stage_rows(layout: Layout, ref: dict, run: Run) -> list[StageRow]:
    """Compare the recorded ops with the reference stage by stage (see :func:`expected_stages`)."""
    expected = expected_stages(layout, ref)
    roles = role_indices(run.ops)
    rows = []
    for stage in STAGES:
        tensors = expected[stage]
        if tensors is None:
            continue
        if stage == "scores":
            hit = next((op for op in (find_op(run.ops, t) for t in tensors) if op), None)
            found, count, where = hit is not None, 1, hit.name if hit else ""
        else:
            hits = [find_op(run.ops, t) for t in tensors]
            found, count = all(hits), len(tensors)
            hit = hits[0]
            where = ", ".join(sorted({h.name for h in hits if h})) if found else ""
        i = roles.get(stage)
        seen = hit.shape if found else (run.ops[i].shape if i is not None else None)
        if stage == "projections" and layout.kind == "wrapper":
            count = 3 * layout.num_heads
        rows.append(StageRow(stage, tuple(tensors[0].shape), count, seen, found, where))
    return rows


def first_differing(rows: list[StageRow]) -> str | None:
    """The stage after the last stage whose values were found (None if the output was found)."""
    if rows and rows[-1].found:
        return None
    last = max((i for i, r in enumerate(rows) if r.found), default=-1)
    return rows[min(last + 1, len(rows) - 1)].stage


def diagnose_by_shapes(run: Run, b: int, T: int, h: int) -> list[str]:
    """Mistakes visible from the recorded ops and the exception: a softmax over an axis other
    than the last, scores of shape (b, T, h, h) (q and k not transposed), a view on a
    non-contiguous tensor."""
    found = []
    for op in run.ops:
        if op.name in SOFTMAX_OPS and op.dim is not None and len(op.shape) >= 3:
            dim = op.dim % len(op.shape)
            if dim == len(op.shape) - 2:
                found.append("softmax_queries")
            elif dim == 1 and len(op.shape) == 4:
                found.append("softmax_heads")
        if op.name in MATMUL_OPS and not op.on_param and op.shape == (b, T, h, h) and T != h:
            found.append("split_no_transpose")
    if run.error is not None and "view size is not compatible" in str(run.error):
        found.append("view_non_contiguous")
    return sorted(set(found), key=list(MISTAKES).index)

