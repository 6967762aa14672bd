"""Several processes on ``torch.distributed``, launched with ``torchrun``: the process group,
one clear line when a peer dies or stalls, rank-0 I/O, the small collectives the commands use,
and data-parallel scoring. Nothing here is home-made transport.

Data-parallel training is ``torch.nn.parallel.DistributedDataParallel`` (:mod:`gpt2mha.train.train`);
scoring deals the strided windows over the ranks (:func:`perplexity`); tensor parallelism is
:mod:`gpt2mha.inference.parallel`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .evaluate import encode_for_scoring, result_from, score_windows, strided_windows

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


def perplexity(model, text: str, stride: int | None = None, progress: bool = False):
    """:func:`gpt2mha.train.evaluate.perplexity` with the strided windows dealt round-robin over the
    ranks (rank r scores windows r, r+N, …); the summed nats and token counts are all-reduced in
    float64, so every rank returns the single-process figure (up to summation order, ~1e-15).
    ``progress``: rank 0 shows a bar of its windows on stderr (when it is a terminal).

    Raises:
        ValueError, NonFiniteLogitsError: as :func:`gpt2mha.train.evaluate.perplexity`.
    """
    ids, stride = encode_for_scoring(model, text, stride)
    ids = ids.to(next(model.parameters()).device)
    di = info()
    windows = strided_windows(ids.numel(), model.config.n_ctx, stride)[di.rank::di.world_size]
    nats, tokens = score_windows(model, ids, windows, progress and di.is_main)
    nats, tokens = all_reduce_sum([nats, tokens], device=di.device if di.backend == "nccl" else None)
    return result_from(nats, int(tokens), text)



# ------------------------------------------------------------------------- agreeing ranks
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


def weights_fingerprint(model: torch.nn.Module) -> float:
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
