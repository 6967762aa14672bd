"""Offline ``generate`` and the scheduler alone for ``benchmarks/serve_peers.py``, in a worker
process of its own (``serve_peers.py --worker`` runs :func:`worker`; :class:`Worker` is the
parent's side): what the served figures are set against, on the same saved models, prompts and
threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from serve_peers_servers import EOT

#: The script the worker process runs (``serve_peers.py --worker``: its ``main`` calls :func:`worker`).
SERVE_PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_peers.py")


def offline_cell(model, tok, prompts: list[str], new: int) -> dict:
    """Offline ``generate`` (greedy, batch 1) on each prompt: tokens, end-to-end and decode tok/s, texts."""
    import torch

    e2e, decode, texts = [], [], []
    for p in prompts:
        idx = torch.tensor([tok.encode(p)])
        t0 = time.perf_counter()
        model.generate(idx, 1, temperature=0, eos_token_id=EOT, vocab_size=tok.n_vocab)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(idx, new, temperature=0, eos_token_id=EOT, vocab_size=tok.n_vocab)
        tn = time.perf_counter() - t0
        ids = out[0, idx.shape[1]:].tolist()
        n = ids.index(EOT) + 1 if EOT in ids else len(ids)
        texts.append(tok.decode([t for t in ids[:n] if t != EOT]))
        e2e.append(n / tn)
        decode.append((n - 1) / (tn - t1) if n > 1 and tn > t1 else float("nan"))
    return dict(e2e=e2e, decode=decode, texts=texts)


def scheduler_cell(model, tok, prompts: list[str], new: int, clients: int) -> dict:
    """The same requests through the scheduler alone in this process (no HTTP): ``clients`` in
    flight, the next submitted as soon as one finishes (as serve_load.engine_workload)."""
    from gpt2mha.inference.params import SamplingParams
    from gpt2mha.inference.scheduler import Scheduler

    params = SamplingParams(max_tokens=new, temperature=0)
    sched = Scheduler(model, tok, max_batch=16)
    todo, finished = [tok.encode(p) for p in prompts][::-1], []
    total = len(todo)

    def on_event(seq, text, done):
        if done:
            finished.append(seq)

    t0 = time.perf_counter()
    for _ in range(min(clients, len(todo))):
        sched.submit([todo.pop()], params, on_event)
    while not sched.idle():
        sched.step()
        while todo and len(finished) + clients > total - len(todo):
            sched.submit([todo.pop()], params, on_event)
    dt = time.perf_counter() - t0
    sched.stop()
    n = sum(len(s.tokens) for s in finished)
    return dict(tokens=n, wall=dt, tokens_per_s=n / dt)


def in_thread(fn, *a):
    """``fn(*a)`` in a new thread, as ``gpt2mha serve`` runs the model in its scheduler's thread:
    the calling thread's OpenMP workers released first and the new thread given its thread
    count (``Scheduler.start``, :mod:`gpt2mha.inference.threads`)."""
    import threading

    import torch

    from gpt2mha.inference.threads import adopt_threads, release_openmp_workers

    n = torch.get_num_threads()
    release_openmp_workers()
    out = {}

    def run():
        adopt_threads(n)
        out["r"] = fn(*a)
    th = threading.Thread(target=run)
    th.start()
    th.join()
    return out["r"]


def worker(dirs: dict, threads: int) -> int:
    """``serve_peers.py --worker``: a process of its own for offline ``generate`` and the
    scheduler alone (``torch.set_num_threads(threads)`` as ``gpt2mha serve --threads`` and
    ``gpt2mha generate --threads`` set it). Reads one JSON command a line on stdin, answers one
    JSON line on stdout: ``{"op": "offline" | "offline_thread" | "sched", "engine", "prompts",
    "tokens", "clients"}``. Offline runs in the main thread (as ``gpt2mha generate``), or in a
    thread of its own (``offline_thread``: as the server's scheduler thread runs the model);
    the scheduler alone runs in a thread, as in the server."""
    import torch

    from gpt2mha import GPT2
    from gpt2mha.io.tokenizer import tokenizer_for

    torch.set_num_threads(threads)
    models = {name: GPT2.from_pretrained(d) for name, d in dirs.items()}
    tok = tokenizer_for(next(iter(models.values())).config)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        m = models[cmd["engine"]]
        if cmd["op"] == "offline":
            r = offline_cell(m, tok, cmd["prompts"], cmd["tokens"])
        elif cmd["op"] == "offline_thread":
            r = in_thread(offline_cell, m, tok, cmd["prompts"], cmd["tokens"])
        else:
            r = in_thread(scheduler_cell, m, tok, cmd["prompts"], cmd["tokens"], cmd["clients"])
        print(json.dumps(r), flush=True)
    return 0


class Worker:
    """The parent's side of :func:`worker`."""

    def __init__(self, dirs: dict, threads: int, log_path: str):
        self.log = open(log_path, "w")
        from gpt2mha.cli import HUGE_PAGES_ENV                    # 2 MiB pages, as the command asks for them
        env = {**os.environ, HUGE_PAGES_ENV: os.environ.get(HUGE_PAGES_ENV, "1")}
        self.proc = subprocess.Popen([sys.executable, SERVE_PEERS, "--worker", json.dumps(dirs),
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        if not json.loads(self.proc.stdout.readline() or "{}").get("ready"):
            self.stop()
            raise RuntimeError(f"the offline worker did not start; see {log_path}")

    def __call__(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the offline worker died")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

