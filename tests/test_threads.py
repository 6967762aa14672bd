"""OpenMP teams across threads (gpt2mha.inference.threads): the thread that hands the model to
another releases its idle workers, and a new thread runs the thread count it is given.

Why it matters: libgomp throttles every barrier's busy-wait (300,000 spins → 100) once the
worker threads of all teams outnumber the CPUs, so the server's scheduler thread ran its steps
at ~0.6x while the loading thread's idle team lived (benchmarks/serve_peers.py, "in a thread").
Each check runs in a fresh interpreter: teams are process state.
"""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_releasing_the_workers_ends_the_callers_openmp_threads():
    out = run("""
        import os, time, torch
        from gpt2mha.inference.threads import openmp_runtime, release_openmp_workers
        torch.set_num_threads(2)
        a = torch.randn(512, 512); (a @ a).exp_()           # a parallel region: the team starts
        n = lambda: len(os.listdir("/proc/self/task"))
        before = n()
        assert openmp_runtime() is not None
        ok = release_openmp_workers()
        for _ in range(100):                                 # the workers leave asynchronously
            if n() < before: break
            time.sleep(0.02)
        after = n()
        (a @ a).exp_()                                      # and come back when needed
        print(ok, before, after, n())
    """).split()
    ok, before, after, again = out[0], *map(int, out[1:])
    assert ok == "True"
    assert after == before - 1, (before, after)             # the one worker of a 2-thread team
    assert again == before


def test_a_new_thread_runs_the_count_it_adopts_not_the_runtimes_default():
    out = run("""
        import ctypes, threading, torch
        from gpt2mha.inference.threads import adopt_threads, openmp_runtime
        torch.set_num_threads(1)
        lib = openmp_runtime()
        got = []
        def f():
            got.append(lib.omp_get_max_threads())           # the runtime's default here
            adopt_threads(3)
            got.append(lib.omp_get_max_threads())
        t = threading.Thread(target=f); t.start(); t.join()
        print(lib.omp_get_max_threads(), *got)
    """).split()
    main, default, adopted = map(int, out)
    assert main == 1 and adopted == 3
    with pytest.raises(ValueError, match="n=0 threads"):
        from gpt2mha.inference.threads import adopt_threads
        adopt_threads(0)


def test_the_scheduler_thread_takes_the_starting_threads_count_and_its_workers_go():
    out = run("""
        import os, time, threading, torch
        from gpt2mha.api import GPT2
        from gpt2mha.io.tokenizer import tokenizer_for
        from gpt2mha.inference.threads import openmp_runtime
        from gpt2mha.inference.scheduler import Scheduler
        torch.set_num_threads(5)                             # not the runtime's default on CI's 2 cores
        m = GPT2.from_pretrained("shakespeare-byte")
        a = torch.randn(512, 512); (a @ a).exp_()
        sched = Scheduler(m, tokenizer_for(m.config), max_batch=2)
        names = lambda: sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
        before = len(names())
        seen = []
        sched.engine.warm_up = lambda: seen.append(openmp_runtime().omp_get_max_threads())
        sched.start(); sched.wait_ready(60)
        for _ in range(250):                                 # the workers leave asynchronously
            if len(names()) <= before - 3: break
            time.sleep(0.02)
        print(seen[0], before, len(names()))
        sched.stop()
    """).split()
    threads, before, after = map(int, out)
    assert threads == 5
    assert after == before - 4 + 1    # the caller's 4 OpenMP workers went, the scheduler's thread came
