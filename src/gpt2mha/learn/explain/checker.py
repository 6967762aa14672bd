""""Check my attention": a learner's module checked in a subprocess with a time and memory limit.

The code the learner pastes is compiled here first (a syntax error is answered at once), then
written to a private temporary directory and checked by :mod:`.check_worker` in a new process:
the same :func:`gpt2mha.learn.check.check` as ``gpt2mha check``. The worker runs under
:mod:`.reaper`, a child subreaper that kills every process the module starts (a fork, a double
fork, a new session) when the check ends, and keeps only the tail of what they print. The time
limit counts from the moment the worker has imported torch (importing torch is not the
learner's code); the memory limit caps the worker's address space beyond what the interpreter
already holds. A module that loops forever is stopped at the limit; one that allocates too much
fails inside the worker (MemoryError) or is killed by the system; each gets a message that says
so. The result, once the worker has written it, is the answer (a thread the module left running
does not turn it into a timeout).

This runs the learner's code with the learner's permissions: the app offers it only on
127.0.0.1, behind the per-launch token (:mod:`.security`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

#: Largest module source accepted, in bytes.
MAX_CODE_BYTES = 200_000


@dataclass
class CheckLimits:
    """``timeout_s``: seconds the learner's code may run (import, build, check); ``memory_mb``:
    address space it may add; ``startup_s``: seconds the worker may take to import torch."""

    timeout_s: float = 30.0
    memory_mb: int = 2048
    startup_s: float = 180.0

    def __post_init__(self):
        for name in ("timeout_s", "startup_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ValueError(f"{name}={value!r} must be a number of seconds in (0, 1e6)")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or not 64 <= self.memory_mb <= 2**20:
            raise ValueError(f"memory_mb={self.memory_mb!r} must be an integer in [64, 1048576]")


#: The supervisor the worker runs under (run by path: it imports no package).
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
#: Characters of the output returned (its tail).
OUTPUT_CHARS = 4000
#: Seconds the reaper may take to kill and reap everything once told to stop.
STOP_S = 20.0


def _stop(proc: subprocess.Popen) -> None:
    """Stop the reaper and reap it: SIGTERM (it kills the worker and every process the module
    started, then writes the output's tail); its whole process group killed only if it does not
    end within :data:`STOP_S`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _wait_ready(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether the worker printed ``ready`` within ``seconds``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, line = time.monotonic() + seconds, b""
    try:
        while time.monotonic() < deadline and b"\n" not in line:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(proc.stdout.fileno(), 64)
            if not chunk:
                break
            line += chunk
    finally:
        sel.close()
    return line.startswith(b"ready")


def _tail(path: str, n: int = OUTPUT_CHARS) -> str:
    """The last ``n`` characters (about: the last ``4·n`` bytes, decoded) of the file ``path``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * n))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-n:]


def _precheck(code: str, class_name: str | None) -> str:
    """The class to check, found without running the code: ``code`` compiled (a syntax error
    with its line), then :func:`.check_worker.pick_class`.

    Raises:
        ValueError: the code does not compile, or no class to check in it.
    """
    from .check_worker import pick_class

    try:
        compile(code, "your_module.py", "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ValueError(f"the code does not parse: {e.msg} (line {e.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as e:   # a NUL byte, nesting too deep for the compiler
        raise ValueError(f"the code does not compile: {type(e).__name__}: {e}") from None
    return pick_class(code, class_name)


def _wait_result(proc: subprocess.Popen, result: str, seconds: float) -> bool:
    """Whether the worker wrote ``result`` or its reaper ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(result):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            proc.wait(timeout=min(0.02, left))
            return True
        except subprocess.TimeoutExpired:
            pass
    return True


def run_check(code: str, class_name: str | None = None, limits: CheckLimits | None = None) -> dict:
    """Check the module in ``code`` (Python source) in a limited subprocess.

    Args:
        code: the source; class_name: the class to check (None: :func:`.check_worker.pick_class`
            picks it).

    Returns:
        ``{"report", "text", "class", "tensors", "output", "seconds"}`` (see :mod:`.check_worker`),
        or ``{"error": message, "output"}`` when the module could not be checked at all (bad
        input, a timeout, out of memory, a crash). Never raises for the learner's code.

    Raises:
        ValueError: ``code`` empty, not text or over :data:`MAX_CODE_BYTES`; a class name that
            is not an identifier.
    """
    limits = limits or CheckLimits()
    if not isinstance(code, str) or not code.strip():
        raise ValueError("the code is empty: paste a Python class (e.g. the book's MultiHeadAttention)")
    if len(code.encode("utf-8", errors="replace")) > MAX_CODE_BYTES:
        raise ValueError(f"the code is {len(code.encode('utf-8', errors='replace')):,} bytes; the checker takes at "
                         f"most {MAX_CODE_BYTES:,}")
    if class_name is not None and (not isinstance(class_name, str) or
                                   (class_name and not class_name.isidentifier())):
        raise ValueError(f"class name {class_name!r} is not a Python identifier")
    try:
        cls = _precheck(code, class_name)
    except ValueError as e:
        return {"error": str(e), "output": ""}
    with tempfile.TemporaryDirectory(prefix="gpt2mha-explain-check-") as tmp:
        path, result = os.path.join(tmp, "your_module.py"), os.path.join(tmp, "result.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        cmd = [sys.executable, "-I", REAPER, result + ".out",
               sys.executable, "-m", "gpt2mha.learn.explain.check_worker", path, result, cls, str(limits.memory_mb)]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=tmp, env=env, start_new_session=True)
        try:
            if not _wait_ready(proc, limits.startup_s):
                return {"error": f"the checker's process did not start within {limits.startup_s:g} s (importing torch); "
                                 f"try again", "output": ""}
            start = time.monotonic()
            finished = _wait_result(proc, result, limits.timeout_s)
            seconds = time.monotonic() - start
        finally:
            _stop(proc)
            proc.stdout.close()
        output = _tail(result + ".out")
        if not finished:
            return {"error": f"your module did not finish within the time limit of {limits.timeout_s:g} s and was "
                             f"stopped (an endless loop?)", "output": output}
        if not os.path.exists(result):
            code = proc.returncode
            why = ("killed by a signal: out of memory?" if code < 0 or code > 128 else f"exit code {code}")
            return {"error": f"the check ended without a result ({why}; the memory limit is {limits.memory_mb} MB)",
                    "output": output}
        with open(result, encoding="utf-8") as f:
            answer = json.load(f, parse_constant=str)         # a NaN or infinity as text: JSON has no such number
    answer["output"] = output
    answer["seconds"] = round(seconds, 3)
    return answer
