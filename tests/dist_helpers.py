"""Run a function on N local gloo ranks (127.0.0.1, a free port), bounded in time, and collect
what each rank returns. Used by tests/test_parallel.py."""

import os
import pickle
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(port: int, rank: int, world_size: int, timeout_s: float = 60) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo", "GPT2MHA_DIST_TIMEOUT": str(timeout_s),
            "OMP_NUM_THREADS": "1"}


def _entry(rank, fn, world_size, port, out_dir, args, timeout_s):
    os.environ.update(loopback_env(port, rank, world_size, timeout_s))
    import torch

    torch.set_num_threads(1)
    from gpt2mha import distributed

    try:
        distributed.init_distributed()
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as e:                      # reported to the parent, never swallowed
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        distributed.teardown()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world_size: int, out_dir: str, *args, timeout: float = 120, collective_timeout: float = 60):
    """``[fn(rank, world_size, *args) for each rank]``, each in its own spawned process with the
    gloo process group initialised. Kills every rank after ``timeout`` seconds. Returns a list
    of ``("ok", value)`` or ``("error", traceback)`` (``("missing", None)`` if a rank died)."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args, collective_timeout),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not all(not p.is_alive() for p in ctx.processes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s")
            time.sleep(0.1)
    finally:
        for p in ctx.processes:                     # only the processes this call started
            if p.is_alive():
                p.kill()
            p.join(5)
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(("missing", None))
    return results


def values(results):
    """The ranks' return values; fails with every rank's traceback if one did not return."""
    bad = [(r, res) for r, res in enumerate(results) if res[0] != "ok"]
    if bad:
        msg = "\n".join(f"rank {r}: {res[0]}: {res[1]}" for r, res in bad)
        raise AssertionError(f"ranks failed:\n{msg}")
    return [res[1] for res in results]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120, env_extra: dict | None = None):
    """``torchrun --nproc-per-node nproc -m gpt2mha ARGS`` on 127.0.0.1 (a free port), in its own
    process group so that a timeout kills the agent and every worker it started. Returns the
    CompletedProcess (text stdout/stderr).

    Run again once when a worker aborted with "terminate called without an active exception":
    a C++ thread of torch's c10d/gloo left joinable at the worker's exit (seen once in a clean-clone
    CI run of 1111 tests, not reproduced in 4 reruns; gpt2mha's code has no C++ thread). A failure
    of ours fails again on the rerun."""
    result = _torchrun_once(args, nproc, timeout, env_extra)
    if result.returncode != 0 and "terminate called without an active exception" in result.stderr:
        result = _torchrun_once(args, nproc, timeout, env_extra)
    return result


def _torchrun_once(args: list[str], nproc: int, timeout: float, env_extra: dict | None):
    import signal
    import subprocess

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "GPT2MHA_DIST_TIMEOUT": "60",
           **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "gpt2mha", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # the session this call started
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def single(args: list[str], timeout: float = 120):
    """``python -m gpt2mha ARGS`` in one process."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "gpt2mha", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
