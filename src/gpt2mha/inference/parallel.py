"""Scaling out on ``torch.distributed``: tensor parallelism by heads, data-parallel training and
scoring, rank-0 I/O. Launched with ``torchrun``; nothing here is home-made transport.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3, figure 3): rank r of N owns heads
``[r·h/N, (r+1)·h/N)``.

- ``attn.c_attn`` (column parallel): the rank keeps the q, k **and** v columns of its heads, taken
  from each of the three n_embd blocks of GPT-2's fused ``[n_embd, 3·n_embd]`` weight
  (:func:`qkv_columns`), so its output is a local q|k|v ``[B, T, 3·n_embd/N]`` and attention
  runs on its own heads only, with no communication.
- ``attn.c_proj`` (row parallel): the rank keeps the input rows of its heads
  ``[n_embd/N, n_embd]``; the partial outputs are summed by one all-reduce, then the bias added.
- ``mlp.c_fc`` by columns ``[n_embd, 4·n_embd/N]`` (GELU is elementwise, so it needs nothing),
  ``mlp.c_proj`` by rows ``[4·n_embd/N, n_embd]``, one all-reduce.
- Embeddings, LayerNorms, the tied LM head and the row-parallel biases are replicated.

So a forward costs 2 all-reduces of ``[B, T, n_embd]`` per layer, and each rank's KV cache holds
only its heads, ``[B, h/N, T, head_dim]`` per layer (the cache is 1/N of the whole).

PyTorch's own TP API (``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``) was measured on this fused layout and not used:
see ``benchmarks/parallel.py --probe-dtensor`` and README "Scaling out". Sharding here is done
once, with plain tensors and ``torch.distributed.all_reduce``.

Data parallelism is ``torch.nn.parallel.DistributedDataParallel`` (see :mod:`gpt2mha.train`);
scoring splits the strided windows across ranks (:func:`perplexity`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import CausalSelfAttention, Conv1D, split_heads
from .model import GPT2, GPT2Config

#: Commands that run under ``torchrun`` (each rank runs the same command line).
DISTRIBUTED_COMMANDS = ("generate", "train", "perplexity")
#: Seconds a collective may wait for the other ranks before this rank gives up (env override).
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "GPT2MHA_DIST_TIMEOUT", 300.0


class DistributedError(RuntimeError):
    """A collective failed: another rank died, stalled past the timeout, or disagreed."""


# ------------------------------------------------------------------------------- process group
@dataclass
class DistInfo:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its machine,
    the ``device`` its tensors live on and the ``backend`` (None: not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that prints and writes files."""
        return self.rank == 0


def info() -> DistInfo:
    """The :class:`DistInfo` of this process (rank 0 of 1 when no process group is initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def timeout_s() -> float:
    """The collective timeout in seconds: ``$GPT2MHA_DIST_TIMEOUT`` or 300.

    Raises:
        ValueError: the variable is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def init_distributed(backend: str | None = None, timeout: float | None = None) -> DistInfo:
    """Join the process group ``torchrun`` describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``).

    Without those variables (a plain ``python -m gpt2mha``) nothing is initialised and rank 0 of
    1 is returned. ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo`` (CPU).
    Collectives that wait longer than ``timeout`` seconds (default :func:`timeout_s`) fail, so a
    rank that died or hangs makes the others stop instead of waiting forever.

    Source: ``torch.distributed.init_process_group`` with ``init_method="env://"``.
    """
    if dist.is_initialized():
        return info()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return DistInfo()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    seconds = timeout_s() if timeout is None else timeout
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
    return info()


def teardown() -> None:
    """Leave the process group (no-op when none was initialised)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def launched(command: str | None):
    """The CLI's frame for one command: join ``torchrun``'s process group for the commands in
    :data:`DISTRIBUTED_COMMANDS`, leave it afterwards, and turn a failed collective (a
    :class:`DistributedError`, a ``torch.distributed.DistError``, or the ``RuntimeError`` gloo
    raises when a peer died or timed out: :func:`is_collective_error`), wherever in the command
    it happens, into one line on stderr, ``error: rank N: a collective in COMMAND failed: ...``,
    and exit status 1 (instead of a traceback, or a hang)."""
    if command not in DISTRIBUTED_COMMANDS:
        yield DistInfo()
        return
    rank = os.environ.get("RANK", "0")
    try:
        di = init_distributed()
        yield di
        barrier()                       # every rank done with its collectives before any leaves
    except (DistributedError, dist.DistError, RuntimeError) as e:
        if not isinstance(e, DistributedError) and not (info().world_size > 1 and is_collective_error(e)):
            raise
        reason = e if isinstance(e, DistributedError) else collective_failure(e, f"in {command}")
        sys.stdout.flush()
        print(f"error: rank {rank}: {reason}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        teardown()


def is_collective_error(e: BaseException) -> bool:
    """Whether ``e`` came out of a collective whose peer died or timed out: a
    ``torch.distributed.DistError``, or the ``RuntimeError`` gloo raises (its message names gloo,
    a closed connection, a peer or a timeout)."""
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def collective_failure(error: BaseException, where: str = "") -> DistributedError:
    """A :class:`DistributedError` that says what most likely happened when ``error`` came out of
    a collective (a peer process died, or did not arrive within the timeout)."""
    return DistributedError(
        f"a collective{' ' + where if where else ''} failed: another rank died or did not answer within "
        f"{timeout_s():.0f} s (${TIMEOUT_ENV}); stopping. See the other ranks' output for the cause. "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")


def rank0_stdout(di: DistInfo | None = None):
    """``sys.stdout`` on rank 0, a sink everywhere else (so a command prints once)."""
    di = di or info()
    return sys.stdout if di.is_main else open(os.devnull, "w")


# ---------------------------------------------------------------------------- tensor parallel
def check_tp(config: GPT2Config, tp: int) -> None:
    """Raises ValueError naming both numbers unless ``n_head`` splits evenly over ``tp`` ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if config.n_head % tp:
        raise ValueError(f"n_head={config.n_head} is not divisible by the tensor-parallel size tp={tp} "
                         f"(world size); use a tp that divides {config.n_head}")


def head_range(n_head: int, rank: int, world_size: int) -> range:
    """The heads rank ``rank`` of ``world_size`` owns: ``[r·h/N, (r+1)·h/N)``."""
    per = n_head // world_size
    return range(rank * per, (rank + 1) * per)


def qkv_columns(n_embd: int, n_head: int, rank: int, world_size: int) -> torch.Tensor:
    """Column indices into c_attn's ``[n_embd, 3·n_embd]`` weight that rank ``rank`` keeps:
    the q, the k and the v columns of its heads, from each of the three n_embd blocks
    (``3·n_embd/N`` indices, int64, ordered q | k | v as the full layout)."""
    heads, head_dim = head_range(n_head, rank, world_size), n_embd // n_head
    lo, hi = heads.start * head_dim, heads.stop * head_dim
    return torch.cat([torch.arange(b * n_embd + lo, b * n_embd + hi) for b in range(3)])


def column_shard(conv: Conv1D, columns: torch.Tensor) -> Conv1D:
    """A :class:`Conv1D` holding ``columns`` of ``conv`` (weight ``[n_in, len(columns)]``, bias
    ``[len(columns)]``): column parallel, its input replicated, no communication."""
    out = Conv1D.__new__(Conv1D)
    nn.Module.__init__(out)
    out.n_in, out.n_out = conv.n_in, len(columns)
    out.weight = nn.Parameter(conv.weight.detach()[:, columns].contiguous(), requires_grad=False)
    out.bias = nn.Parameter(conv.bias.detach()[columns].contiguous(), requires_grad=False)
    return out


class RowParallelConv1D(Conv1D):
    """Row-parallel Conv1D: this rank's input rows ``weight [n_in/N, n_out]`` times its slice
    of the input ``[..., n_in/N]``, partial sums all-reduced over ``group``, then the full
    ``bias [n_out]`` (replicated) added once: ``[..., n_in/N]`` → ``[..., n_out]``.

    Inference only: the all-reduce is not differentiable here (parameters do not require grad).
    Source: Megatron-LM's ``RowParallelLinear`` (Shoeybi et al. 2019, section 3).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group=None, world_size: int = 2):
        nn.Module.__init__(self)
        self.n_in, self.n_out = weight.shape
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group, self.world_size = group, world_size

    @classmethod
    def from_rows(cls, conv: Conv1D, rows: slice, group=None, world_size: int = 2) -> "RowParallelConv1D":
        """The rows ``rows`` of ``conv.weight`` and its whole bias, one of ``world_size`` shards."""
        return cls(conv.weight.detach()[rows], conv.bias.detach(), group, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in)                           # [N, n_in/world]
        w_t = None if self._kept is None else self.weight_t     # decoding()'s [n_out, n_in] copy (bf16/fp16)
        y = F.linear(x2, w_t) if w_t is not None else x2 @ self.weight   # partial sums [N, n_out]
        if self.world_size > 1:
            dist.all_reduce(y, group=self.group)                # sum over the ranks' rows
        y += self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("group", None)
        return state


class ShardedSelfAttention(CausalSelfAttention):
    """One rank's share of a :class:`~gpt2mha.attention.CausalSelfAttention`: its ``n_head/N``
    heads. ``c_attn`` is column-parallel over those heads' q, k and v columns
    (:func:`qkv_columns`), ``c_proj`` row-parallel over their rows (:class:`RowParallelConv1D`,
    one all-reduce).

    ``forward(x [B, T, n_embd], past [B, 2, h/N, P, head_dim])`` → ``(y [B, T, n_embd],
    present [B, 2, h/N, T, head_dim])``: y is the full (summed) output, present this rank's heads.

    Raises:
        ValueError: n_head not divisible by ``world_size`` (:func:`check_tp`).
    """

    def __init__(self, attn: CausalSelfAttention, rank: int, world_size: int, group=None):
        nn.Module.__init__(self)
        if attn.n_head % world_size:
            raise ValueError(f"n_head={attn.n_head} is not divisible by the tensor-parallel size tp={world_size}")
        heads = head_range(attn.n_head, rank, world_size)
        self.n_embd, self.n_head, self.head_dim = attn.n_embd, len(heads), attn.head_dim
        self.attn_pdrop, self.resid_pdrop, self.attn_impl = attn.attn_pdrop, attn.resid_pdrop, attn.attn_impl
        self.c_attn = column_shard(attn.c_attn, qkv_columns(attn.n_embd, attn.n_head, rank, world_size))
        rows = slice(heads.start * attn.head_dim, heads.stop * attn.head_dim)
        self.c_proj = RowParallelConv1D.from_rows(attn.c_proj, rows, group, world_size)

    def split_qkv(self, qkv: torch.Tensor):
        """The local ``[B, T, 3·n_embd/N]`` → q, k, v each ``[B, h/N, T, head_dim]``."""
        q, k, v = qkv.split(self.n_head * self.head_dim, dim=2)
        return split_heads(q, self.n_head), split_heads(k, self.n_head), split_heads(v, self.n_head)


@dataclass
class ShardConfig(GPT2Config):
    """The config of one tensor-parallel rank's shard: ``n_head`` is the rank's own heads
    (``h/N``), so the past, present and :class:`~gpt2mha.kv_cache.KVCache` a sharded model builds
    and checks hold only those; ``head_dim`` stays the full model's; ``tp_rank`` of ``tp_size``.
    ``full()`` gives back the whole model's config."""

    tp_rank: int = 0
    tp_size: int = 1

    @property
    def head_dim(self) -> int:
        return self.n_embd // (self.n_head * self.tp_size)

    def full(self) -> GPT2Config:
        """The unsharded model's :class:`GPT2Config`."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GPT2Config)}
        return GPT2Config(**{**fields, "n_head": self.n_head * self.tp_size})


def shard_model(model: GPT2, rank: int | None = None, world_size: int | None = None, group=None) -> GPT2:
    """Shard ``model`` in place for tensor parallelism by heads; returns it (inference only).

    Every block's attention becomes a :class:`ShardedSelfAttention` (heads
    :func:`head_range`), ``mlp.c_fc`` keeps columns ``[r·4n/N, (r+1)·4n/N)`` and ``mlp.c_proj``
    the same rows (row parallel, one all-reduce). ``model.config`` becomes a
    :class:`ShardConfig` (``n_head = h/N``), so ``model(idx, past=...)`` takes and returns this
    rank's heads ``[B, n_layer, 2, h/N, P, head_dim]`` and ``generate`` allocates a cache of
    ``[B, h/N, T, head_dim]`` per layer. Logits come out whole and equal on every rank.
    Parameters stop requiring grad. Call it with the same weights on every rank. A sharded model
    is for inference: save (and train) the unsharded one.

    Args:
        model: a :class:`~gpt2mha.model.GPT2` (float weights, any device).
        rank, world_size: this rank and the tensor-parallel size (default: the process group's).
        group: the process group of the tensor-parallel ranks (default: the world).

    Raises:
        ValueError: n_head not divisible by world_size (before anything is changed), a model
            already sharded, or a rank outside ``[0, world_size)``.
    """
    if isinstance(model.config, ShardConfig):
        raise ValueError("model is already sharded (its config is a ShardConfig)")
    if rank is None or world_size is None:
        rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    check_tp(model.config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    c = model.config
    model.requires_grad_(False)
    hidden = 4 * c.n_embd // world_size
    cols = slice(rank * hidden, (rank + 1) * hidden)
    with torch.no_grad():
        for block in model.h:
            block.attn = ShardedSelfAttention(block.attn, rank, world_size, group)
            block.mlp.c_fc = column_shard(block.mlp.c_fc, torch.arange(cols.start, cols.stop))
            block.mlp.c_proj = RowParallelConv1D.from_rows(block.mlp.c_proj, cols, group, world_size)
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(GPT2Config)}
    model.config = ShardConfig(**{**fields, "n_head": c.n_head // world_size}, tp_rank=rank, tp_size=world_size)
    return model


def allreduce_bytes_per_token(config: GPT2Config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes each token's activations put through all-reduce in one tensor-parallel forward:
    2 all-reduces (attn.c_proj, mlp.c_proj) of ``n_embd`` values per layer."""
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------------------- data parallel
def shard_rows(n: int, rank: int, world_size: int) -> slice:
    """Rows ``[r·n/N, (r+1)·n/N)`` of a global batch of ``n`` (``n`` divisible by ``N``)."""
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def all_reduce_sum(values, device=None) -> list[float]:
    """Sum python floats over all ranks (float64; identity when not distributed)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj, group=None) -> list:
    """``[obj of rank 0, obj of rank 1, …]`` of ``group`` (default: the world) on each of its
    ranks (``[obj]`` when not distributed)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def perplexity(model, text: str, stride: int | None = None):
    """:func:`gpt2mha.evaluate.perplexity` with the strided windows dealt round-robin over the
    ranks (rank r scores windows r, r+N, …); the summed nats and token counts are all-reduced in
    float64, so every rank returns the single-process figure (up to summation order, ~1e-15).

    Raises:
        ValueError: as :func:`gpt2mha.evaluate.perplexity`.
    """
    from .evaluate import encode_for_scoring, result_from, score_windows, strided_windows

    ids, stride = encode_for_scoring(model, text, stride)
    ids = ids.to(next(model.parameters()).device)
    di = info()
    windows = strided_windows(ids.numel(), model.config.n_ctx, stride)[di.rank::di.world_size]
    nats, tokens = score_windows(model, ids, windows)
    nats, tokens = all_reduce_sum([nats, tokens], device=di.device if di.backend == "nccl" else None)
    return result_from(nats, int(tokens), text)


# ------------------------------------------------------------------------------ CLI helpers
def check_world(tp: int) -> DistInfo:
    """For ``generate --tp N``: the process group must have exactly N ranks (``torchrun
    --nproc-per-node N``), and several ranks need ``--tp``. Raises ValueError saying so."""
    di = info()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp {tp} must be a positive integer")
    if tp != di.world_size:
        how = (f"run it as: torchrun --nproc-per-node {tp} -m gpt2mha generate ... --tp {tp}" if tp > 1 else
               f"pass --tp {di.world_size} to split the heads over the {di.world_size} processes")
        raise ValueError(f"--tp {tp} needs {tp} processes, this run has {di.world_size} (WORLD_SIZE); {how}")
    return di


def tensor_parallel(model: GPT2, tp: int) -> GPT2:
    """``generate --tp N``: check the heads split (before any work), move the model to this
    rank's device and :func:`shard_model` it over the world (a no-op for ``tp == 1``)."""
    check_tp(model.config, tp)
    if tp == 1:
        return model
    return shard_model(model.to(info().device))


def shared_seed(seed: int | None, group=None) -> int | None:
    """The seed every rank of ``group`` (default: the world) samples with, so that
    tensor-parallel ranks draw the same tokens from their (equal, all-reduced) logits: ``seed``
    itself when given, else one drawn at random by the group's first rank (63 bits) and sent to
    all (one all-gather). Not distributed: ``seed`` unchanged (None keeps torch's global
    generator).

    Raises:
        DistributedError: the ranks were given different seeds.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return seed
    proposals = gather_objects((seed, secrets.randbits(63)), group)
    given = [p[0] for p in proposals]
    if any(g != given[0] for g in given):
        raise DistributedError(f"the ranks were given different seeds ({', '.join(f'rank {r}: {g}' for r, g in enumerate(given))}); "
                               f"tensor-parallel ranks must sample with one seed: pass the same --seed to every rank")
    return given[0] if given[0] is not None else proposals[0][1]


def tp_group(model: nn.Module):
    """``(is tensor parallel over several ranks, its process group)`` for a model
    :func:`shard_model` sharded (``(False, None)`` for any other)."""
    for m in model.modules():
        if isinstance(m, RowParallelConv1D):
            return m.world_size > 1, m.group
    return False, None


def weights_fingerprint(model: nn.Module) -> float:
    """A cheap float64 checksum of a model's parameters (the sum of every 997th value of each
    parameter, times its index), to tell whether the ranks loaded the same weights before
    sharding them."""
    total = 0.0
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            total += (i + 1) * float(p.detach().reshape(-1)[::997].double().sum())
    return total


def agree(settings: dict) -> None:
    """Every rank must hold the same ``settings`` (e.g. a command's sampling arguments, its
    prompts' token ids and :func:`weights_fingerprint`): ranks that would run a
    tensor-parallel computation on different inputs are stopped before it starts (one
    all-gather; nothing when not distributed).

    Raises:
        DistributedError: naming the first setting that differs and each rank's value.
    """
    if info().world_size == 1:
        return
    per_rank = gather_objects(settings)
    for name, value in settings.items():
        values = [s.get(name) for s in per_rank]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {str(v)[:60]}" for r, v in enumerate(values))
            raise DistributedError(f"the ranks disagree on {name} ({shown}); every rank must run the same command "
                                   f"on the same files")


def check_same_tokens(tokens: torch.Tensor) -> None:
    """After a tensor-parallel ``generate`` (ranks that passed :func:`agree` and sampled with one
    :func:`shared_seed`): every rank must hold the same ids, since their logits are all-reduced.
    Raises :class:`DistributedError` naming the first position where a rank's ids part from
    rank 0's (one all-gather)."""
    di = info()
    if di.world_size == 1:
        return
    ids = gather_objects(tokens.cpu().tolist())
    for rank, other in enumerate(ids[1:], start=1):
        if other != ids[0]:
            row, col = next(((i, j) for i, (a, b) in enumerate(zip(ids[0], other)) for j, (x, y) in enumerate(zip(a, b))
                             if x != y), (None, None))
            if row is None:
                raise DistributedError(f"rank {rank} generated ids of another shape than rank 0's; the output is not "
                                       f"trustworthy")
            raise DistributedError(f"rank {rank} sampled token {other[row][col]} where rank 0 sampled {ids[0][row][col]} "
                                   f"(row {row}, position {col}), with the same seed, settings and weights: their "
                                   f"logits differed there, so the ranks compute differently (different devices, "
                                   f"dtypes or kernels?); the output is not trustworthy")
