"""Tensor parallelism (TP=2 vs TP=1 decode) and data parallelism (DDP=2 vs 1 training) on this
machine's CPUs over gloo, with the bytes each step all-reduces; plus a probe of PyTorch's own TP
API (DTensor ``parallelize_module``) on GPT-2's fused q|k|v layout.

    python benchmarks/parallel.py                 # TP and DDP tables (launches torchrun itself)
    python benchmarks/parallel.py --probe-dtensor # what ColwiseParallel/RowwiseParallel can express

The one-process figures are measured with 1 and with 2 intra-op threads; the 2-rank figures
give each rank 1 thread (torchrun's default), so "TP=2" and "TP=1, 2 threads" use the same two
cores. Other processes on a shared machine move every figure: note ``uptime`` with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from gpt2mha import GPT2, GPT2Config
from gpt2mha.inference import parallel as tp
from gpt2mha import distributed as parallel
from gpt2mha.train.train import TrainConfig, get_batch, make_optimizer

HERE = os.path.abspath(__file__)
VERDICT = os.path.join(os.path.dirname(HERE), "..", "data", "the-verdict.txt")


def decode_rate(model: GPT2, steps: int, batch: int, repeats: int) -> float:
    """Best-of-``repeats`` greedy decode speed, new tokens per second (batch rows × steps / s)."""
    idx = torch.randint(0, model.config.n_vocab, (batch, 8), generator=torch.Generator().manual_seed(0))
    model.generate(idx, 2, temperature=0)                       # warm-up
    best = float("inf")
    for _ in range(repeats):
        parallel.barrier()
        t0 = time.perf_counter()
        model.generate(idx, steps, temperature=0)
        parallel.barrier()
        best = min(best, time.perf_counter() - t0)
    return batch * steps / best


def train_rate(config: GPT2Config, steps: int, batch: int, repeats: int) -> float:
    """Training tokens per second (global batch × n_ctx per step), DDP over the world when
    there is one; the step is the trainer's (forward, backward, clip, AdamW)."""
    from torch.nn.parallel import DistributedDataParallel

    di = parallel.info()
    torch.manual_seed(0)
    model = GPT2(config).train()
    ddp = DistributedDataParallel(model) if di.world_size > 1 else model
    opt = make_optimizer(model, TrainConfig(batch_size=batch))
    ids = torch.randint(0, config.n_vocab, (20_000,), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    rows = parallel.shard_rows(batch, di.rank, di.world_size)

    def step():
        x, y = get_batch(ids, config.n_ctx, batch, gen)
        loss = torch.nn.functional.cross_entropy(ddp(x[rows]).logits.flatten(0, 1), y[rows].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    best = float("inf")
    for _ in range(repeats):
        parallel.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        parallel.barrier()
        best = min(best, time.perf_counter() - t0)
    return batch * config.n_ctx * steps / best


def measure(args) -> dict:
    """Both figures for the current world (1 process, or this rank of torchrun's)."""
    di = parallel.info()
    tp_config = GPT2Config.from_preset(args.tp_preset, n_ctx=128)
    torch.manual_seed(0)
    model = GPT2(tp_config).eval()
    if di.world_size > 1:
        tp.shard_model(model)
    out = {"decode_tok_s": decode_rate(model, args.decode_steps, args.batch, args.repeats)}
    del model
    out["train_tok_s"] = train_rate(GPT2Config.from_preset(args.train_preset), args.train_steps, args.train_batch,
                                    args.repeats)
    return out


def worker(args) -> None:
    parallel.init_distributed()
    torch.set_num_threads(1)
    result = measure(args)
    if parallel.info().is_main:
        print("RESULT " + json.dumps(result), flush=True)
    parallel.teardown()


def bytes_table(args) -> dict:
    tp_config = GPT2Config.from_preset(args.tp_preset)
    per_token = tp.allreduce_bytes_per_token(tp_config)
    train_model = GPT2(GPT2Config.from_preset(args.train_preset))
    return {"tp_bytes_per_token": per_token, "tp_bytes_per_step": per_token * args.batch,
            "tp_allreduces_per_step": 2 * tp_config.n_layer,
            "ddp_bytes_per_step": 4 * train_model.num_parameters()}


def main_bench(args) -> None:
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if not isinstance(v, bool)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), HERE, "--worker", *forwarded]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    rows = {}

    def keep_best(name, result):
        print(f"measured {name}: {result}", file=sys.stderr)
        old = rows.setdefault(name, result)
        rows[name] = {k: max(v, old[k]) for k, v in result.items()}

    for _ in range(args.rounds):                               # the three set-ups in turn, best of the rounds
        for threads in (1, 2):
            torch.set_num_threads(threads)
            keep_best(f"1 process, {threads} thread(s)", measure(args))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        keep_best("2 processes (gloo), 1 thread each", json.loads(line[0][7:]))
    nbytes = bytes_table(args)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"best of {args.rounds} rounds x {args.repeats} timings")
    print(f"decode: {args.tp_preset} random weights, batch {args.batch}, {args.decode_steps} greedy steps, TP by heads; "
          f"train: {args.train_preset}, global batch {args.train_batch}, {args.train_steps} steps, DDP")
    base = rows["1 process, 1 thread(s)"]
    print(f"{'':36s}{'decode tok/s':>14s}{'vs TP=1/1t':>12s}{'train tok/s':>14s}{'vs DDP=1/1t':>13s}")
    for name, r in rows.items():
        print(f"{name:36s}{r['decode_tok_s']:14.1f}{r['decode_tok_s'] / base['decode_tok_s']:12.2f}"
              f"{r['train_tok_s']:14.0f}{r['train_tok_s'] / base['train_tok_s']:13.2f}")
    print(f"TP=2 all-reduce per decode step: {nbytes['tp_allreduces_per_step']} all-reduces, "
          f"{nbytes['tp_bytes_per_step']:,} bytes ({nbytes['tp_bytes_per_token']:,} per token = 2 x n_layer x n_embd x 4)")
    print(f"DDP=2 all-reduce per training step: {nbytes['ddp_bytes_per_step']:,} bytes (every gradient, float32)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ DTensor probe
def probe_worker() -> None:
    """On 2 gloo ranks: what torch.distributed.tensor.parallel does with GPT-2's attention."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gpt2mha.core.attention import CausalSelfAttention, merge_heads, split_heads

    parallel.init_distributed()
    rank, n = dist.get_rank(), 32
    mesh = init_device_mesh("cpu", (2,))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    torch.manual_seed(0)
    attn = CausalSelfAttention(n, 4).eval()
    x = torch.randn(2, 5, n)
    with torch.no_grad():
        ref = attn(x)[0]

    # 1. the styles on GPT-2's Conv1D modules
    try:
        parallelize_module(CausalSelfAttention(n, 4), mesh, {"c_attn": ColwiseParallel(), "c_proj": RowwiseParallel()})
        say("1. Conv1D c_attn/c_proj: accepted")
    except Exception as e:                                      # noqa: BLE001 - the probe reports what happens
        say(f"1. Conv1D c_attn/c_proj: refused: {type(e).__name__}: {e}")

    # 2. the same weights as nn.Linear, sharded contiguously by ColwiseParallel
    def as_linear(conv, order=None):
        w = conv.weight.detach().t() if order is None else conv.weight.detach().t()[order]
        b = conv.bias.detach() if order is None else conv.bias.detach()[order]
        lin = nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(w), lin.bias.copy_(b)
        return lin

    naive = nn.ModuleDict({"qkv": as_linear(attn.c_attn), "proj": as_linear(attn.c_proj)})
    parallelize_module(naive, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
    local = naive["qkv"].weight.to_local()                      # this rank's rows of the [3n, n] Linear weight
    full = attn.c_attn.weight.detach().t()
    kept = torch.tensor([int((full == row).all(dim=1).nonzero()[0]) for row in local])  # which q|k|v columns
    roles = {"q": int((kept < n).sum()), "k": int(((kept >= n) & (kept < 2 * n)).sum()), "v": int((kept >= 2 * n).sum())}
    with torch.no_grad():                                       # running 2 local heads on that shard anyway
        q, k, v = naive["qkv"](x).split(n // 2, dim=2)
        a = torch.nn.functional.scaled_dot_product_attention(split_heads(q, 2), split_heads(k, 2),
                                                             split_heads(v, 2), is_causal=True)
        wrong = (naive["proj"](merge_heads(a)) - ref).abs().max().item()
    say(f"2. nn.Linear + ColwiseParallel on the fused weight: rank 0's shard holds q|k|v columns {roles} "
        f"(all queries, half the keys, no values); attention on it: max |y - one process| = {wrong:.2e} (wrong)")

    # 3. rows permuted first so each rank's q|k|v is contiguous: then Colwise + Rowwise are right
    order = torch.cat([tp.qkv_columns(n, 4, r, 2) for r in range(2)])
    perm = nn.ModuleDict({"qkv": as_linear(attn.c_attn, order), "proj": as_linear(attn.c_proj)})
    parallelize_module(perm, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
    with torch.no_grad():
        q, k, v = perm["qkv"](x).split(n // 2, dim=2)           # local [B, T, 3·n/2] (use_local_output)
        a = torch.nn.functional.scaled_dot_product_attention(split_heads(q, 2), split_heads(k, 2),
                                                             split_heads(v, 2), is_causal=True)
        y = perm["proj"](merge_heads(a))
    err = (y - ref).abs().max().item()
    say(f"3. nn.Linear with c_attn's columns permuted per rank + Colwise/Rowwise, attention told its 2 local heads: "
        f"max |y - one process| = {err:.2e} ({'equal' if err < 1e-5 else 'DIFFERENT'})")
    parallel.teardown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-preset", default="124M", help="model for the decode figures (random weights)")
    p.add_argument("--batch", type=int, default=1, help="decode batch rows")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--train-preset", default="shakespeare")
    p.add_argument("--train-batch", type=int, default=8, help="global batch (windows)")
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="best of this many timings per round")
    p.add_argument("--rounds", type=int, default=2, help="the three set-ups are measured in turn this many times")
    p.add_argument("--probe-dtensor", action="store_true", help="run the DTensor probe instead (launches torchrun)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.probe_worker:
        return probe_worker()
    if args.probe_dtensor:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), HERE, "--probe-worker"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        print(proc.stdout, end="")
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        return
    main_bench(args)


if __name__ == "__main__":
    main()
