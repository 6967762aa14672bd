"""The checker's supervisor: runs one command (the check's worker) so that no process it starts
outlives it, and keeps only the tail of what they print.

``python -I reaper.py OUT CMD...`` (run by path, standard library only: it starts in
milliseconds, before the worker imports torch). The reaper makes itself a child subreaper
(Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process the worker starts stays its descendant
whatever it does (a double fork's orphan is re-parented to the reaper, not to PID 1; a new
session or process group changes no parentage), so :func:`kill_tree` finds and kills every one
of them from ``/proc``. It does so when the worker exits, on SIGTERM (the app's stop: the time
limit, or the result is in) and when the app dies (``PR_SET_PDEATHSIG``), then reaps them all.

The worker and its descendants write their stdout/stderr into a pipe (its write end's number in
the worker's ``GPT2MHA_CHECK_OUT_FD``); a thread keeps its last :data:`TAIL_BYTES` and the reaper
writes them to OUT at the end, however much was printed. The reaper exits with the worker's
exit code, or 128 + the signal that killed it.

What it cannot stop: code that kills the reaper itself first (its PID is the worker's parent),
or that asks another process to start one (``systemd-run``, ``at``): the checker runs the
learner's code with the learner's permissions (:mod:`.checker`).
"""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

#: ``prctl`` options (linux/prctl.h).
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
#: Bytes of the output kept (the tail).
TAIL_BYTES = 64 << 10
#: Seconds :func:`kill_tree` may take before it gives up (a process it cannot kill: a kernel D state).
KILL_S = 10.0


def prctl(option: int, arg: int) -> bool:
    """``prctl(option, arg)``; whether it succeeded (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """The PIDs whose chain of parents reaches ``root`` (from ``/proc/PID/stat``; zombies included)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:                                   # gone meanwhile
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])  # after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def reap(worker: int, status: dict) -> None:
    """Reap every exited child (``waitpid(-1, WNOHANG)``); the worker's exit code goes to
    ``status["code"]``."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == worker:
            status["code"] = os.waitstatus_to_exitcode(st)


def kill_tree(worker: int, status: dict) -> bool:
    """SIGKILL every descendant of this process and reap them, until none is left. A process
    started between a look and a kill is found at the next look (its parent's death re-parents
    it here); a killed process cannot start another. Returns whether none is left within
    :data:`KILL_S`."""
    me, deadline = os.getpid(), time.monotonic() + KILL_S
    while time.monotonic() < deadline:
        alive = descendants(me)
        if not alive:
            return True
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap(worker, status)
        time.sleep(0.002)
    return False


def _drain(fd: int, tail: bytearray) -> None:
    """Read ``fd`` to its end, keeping its last :data:`TAIL_BYTES` in ``tail``."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        tail += chunk
        if len(tail) > TAIL_BYTES:
            del tail[:len(tail) - TAIL_BYTES]


def main(argv: list[str]) -> int:
    out_path, cmd = argv[0], argv[1:]
    stop: list = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:                                 # the app died before the line above
        return 1
    r, w = os.pipe()
    worker = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(w,),
                              env={**os.environ, "GPT2MHA_CHECK_OUT_FD": str(w)})
    os.close(w)
    tail = bytearray()
    drain = threading.Thread(target=_drain, args=(r, tail), daemon=True)
    drain.start()
    status: dict = {}
    while "code" not in status and not stop:
        reap(worker.pid, status)
        time.sleep(0.02)
    kill_tree(worker.pid, status)
    drain.join(KILL_S)                                    # every writer is dead: the pipe is at its end
    with open(out_path, "wb") as f:
        f.write(bytes(tail))
    code = status.get("code", -signal.SIGKILL)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
