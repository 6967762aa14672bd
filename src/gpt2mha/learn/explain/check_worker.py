"""The subprocess that checks a learner's module for the explainer (``python -m
gpt2mha.learn.explain.check_worker FILE RESULT CLASS MEMORY_MB``).

It imports torch and the checker first, prints ``ready``, then sends its own stdout/stderr to
the output pipe of its parent, :mod:`.reaper` (file descriptor ``GPT2MHA_CHECK_OUT_FD``; run
alone: the file ``RESULT.out``), caps its address space at what it holds plus ``MEMORY_MB``
(``RLIMIT_AS``), and only then imports FILE (running its code) and runs
:func:`gpt2mha.learn.check.check`. It writes ``RESULT`` (JSON; written whole, then renamed into
place, so a file there is a complete answer): the report
(:meth:`~gpt2mha.learn.check.CheckReport.to_dict`), the terminal text ``gpt2mha check``
prints, and each stage's tensors, the reference's and the module's side by side
(:func:`stage_tensors`), and ends at once (``os._exit``: a thread the module left running
does not hold it). The app (:mod:`.checker`) enforces the time limit; the reaper kills whatever
the module started.
"""

from __future__ import annotations

import ast
import json
import os
import sys

#: Largest side of a stage tensor sent to the page (rows and columns beyond it are cut).
SHOW = 64


def pick_class(source: str, name: str | None) -> str:
    """The class to check in ``source`` (read with ``ast``, nothing run): ``name`` when given,
    else the only class, else the last whose name holds ``MultiHead``, else the last holding
    ``Attention``.

    Raises:
        ValueError: a syntax error (with its line), no class, the named class missing, or
            several candidates.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"the code does not parse: {e.msg} (line {e.lineno})") from None
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    if name:
        if name not in classes:
            raise ValueError(f"no class {name!r} in the code; classes defined there: {', '.join(classes) or 'none'}")
        return name
    if not classes:
        raise ValueError("the code defines no class: paste an nn.Module subclass (e.g. the book's MultiHeadAttention)")
    for word in ("MultiHead", "Attention"):
        hits = [c for c in classes if word.lower() in c.lower()]
        if hits:
            return hits[-1]
    if len(classes) == 1:
        return classes[0]
    raise ValueError(f"several classes ({', '.join(classes)}): type the name of the one to check")


def _shown(t, stage: str):
    """A stage tensor cut to two axes for the page: batch 0, head 0 (``view`` is ``[b, T, h,
    head_dim]``: head 0 is its third axis), at most :data:`SHOW` rows and columns."""
    if t.dim() == 4:
        t = t[0, :, 0] if stage == "view" else t[0, 0]
    while t.dim() > 2:
        t = t[0]
    if t.dim() == 1:
        t = t[None]
    return t[:SHOW, :SHOW]


def stage_tensors(spec: str, report) -> dict:
    """Each stage's reference tensor and the module's (the recorded op that equals it, else the op
    that plays that stage), as the check's first configuration computes them (same seed, weights
    and input; :func:`gpt2mha.learn.check._run_check`'s first steps).

    Returns:
        ``{stage: {"expected", "seen" (None when no op plays it): encoded [rows, cols] slices,
        "expected_shape", "seen_shape", "where"}}``; empty when the module could not be built.
    """
    import torch

    from ..check_cache import plain_kwargs
    from ..check_layout import recognise_layout
    from ..check_load import construct, load_class
    from ..check_reference import copy_params, make_params, reference
    from ..check_stages import find_op, role_indices, expected_stages, run_module
    from .tensors import encode

    c = report.config
    module = construct(load_class(spec), report.kwargs)
    bare_in_out = not any("[out, in]" in n and "stores them" in n for n in report.notes)
    layout = recognise_layout(module, report.kwargs, bare_in_out=bare_in_out)
    gen = torch.Generator().manual_seed(c["seed"])
    p = make_params(layout, gen)
    copy_params(layout, p)
    b, T, P = c["b"], c["T"], c["past"]
    x = torch.randn(b, P + T, layout.d_in, generator=gen)
    ref = reference(x[:, P:], p, layout.num_heads)
    run = run_module(module, x[:, P:], **plain_kwargs(module, T, b))
    roles = role_indices(run.ops)
    out = {}
    for stage, tensors in expected_stages(layout, ref).items():
        if tensors is None:
            continue
        hits = [(t, find_op(run.ops, t)) for t in tensors]
        expected, op = next(((t, o) for t, o in hits if o is not None), (tensors[0], None))
        if stage == "scores" and op is None:
            expected = tensors[3]                         # scaled, masked with -inf: what softmax reads
        if op is None and roles.get(stage) is not None:
            op = run.ops[roles[stage]]
        out[stage] = {"expected": encode(_shown(expected, stage)), "expected_shape": list(expected.shape),
                      "seen": encode(_shown(op.value, stage)) if op is not None else None,
                      "seen_shape": list(op.shape) if op is not None else None, "where": op.name if op else ""}
    return out


def main(argv: list[str]) -> int:
    path, result, name, memory_mb = argv[0], argv[1], argv[2] or None, int(argv[3])
    import resource

    import torch  # noqa: F401  (imported before the limit: the interpreter's own memory)

    from ..check import check, format_report
    from ..check_reference import MISTAKES

    torch.set_num_threads(1)
    print("ready", flush=True)
    out = int(os.environ.pop("GPT2MHA_CHECK_OUT_FD", "-1"))
    if out < 0:
        out = os.open(result + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = held + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    answer: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            cls = pick_class(f.read(), name)
        spec = f"{path}:{cls}"
        report = check(spec)
        answer = {"report": report.to_dict(), "text": format_report(report), "class": cls,
                  "mistakes": {k: MISTAKES[k] for k in report.diagnoses}}
        answer["report"]["target"] = cls
        answer["text"] = answer["text"].replace(spec, cls)
        if report.layout:
            try:
                answer["tensors"] = stage_tensors(spec, report)
            except Exception as e:       # the report stands without the pictures
                answer["tensors_error"] = f"{type(e).__name__}: {e}"
    except ValueError as e:
        answer = {"error": str(e)}
    except MemoryError:
        answer = {"error": f"the module ran out of memory (the checker's limit is {memory_mb} MB)"}
    text = json.dumps(answer).replace(json.dumps(path)[1:-1], os.path.basename(path))   # no temp paths shown
    with open(result + ".part", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(result + ".part", result)
    return 0


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:                 # a stream the module replaced or closed
            pass


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:                 # still ends here (SystemExit from the module: no result)
        import traceback
        traceback.print_exc()
        code = 1
    _flush()
    os._exit(code)                        # no wait for threads the module started, no atexit of its own
