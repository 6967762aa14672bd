"""Tensor parallelism by heads, applied from outside by swapping modules (as gpt-fast's
``apply_tp``). The process group, rank-0 I/O and data parallelism are :mod:`gpt2mha.distributed`.

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
see ``benchmarks/parallel.py --probe-dtensor`` and docs/how-to/scale-out.md. Sharding here is done
once, with plain tensors and ``torch.distributed.all_reduce``.

"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..core.attention import Conv1D
from ..core.model import GPT2, GPT2Config
from ..distributed import DistInfo, DistributedError, gather_objects, info

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
        y = x.reshape(-1, self.n_in) @ self.weight              # partial sums [N, n_out] of [N, n_in/world]
        if self.world_size > 1:
            dist.all_reduce(y, group=self.group)                # sum over the ranks' rows
        y += self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("group", None)
        return state


@dataclass
class ShardConfig(GPT2Config):
    """The config of one tensor-parallel rank's shard: ``n_head`` is the rank's own heads
    (``h/N``), so the past, present and :class:`~gpt2mha.core.kv_cache.KVCache` a sharded model builds
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

    Every block's attention keeps its heads :func:`head_range` (``n_head = h/N``): ``c_attn``
    becomes the column shard of those heads' q, k and v columns (:func:`qkv_columns`), ``c_proj``
    a :class:`RowParallelConv1D` of their rows; ``mlp.c_fc`` keeps columns ``[r·4n/N, (r+1)·4n/N)`` and ``mlp.c_proj``
    the same rows (row parallel, one all-reduce). ``model.config`` becomes a
    :class:`ShardConfig` (``n_head = h/N``), so ``model(idx, past=...)`` takes and returns this
    rank's heads ``[B, n_layer, 2, h/N, P, head_dim]`` and ``generate`` allocates a cache of
    ``[B, h/N, T, head_dim]`` per layer. Logits come out whole and equal on every rank.
    Parameters stop requiring grad. Call it with the same weights on every rank. A sharded model
    is for inference: save (and train) the unsharded one.

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` (float weights, any device).
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
            attn = block.attn
            heads = head_range(attn.n_head, rank, world_size)
            attn.c_attn = column_shard(attn.c_attn, qkv_columns(attn.n_embd, attn.n_head, rank, world_size))
            rows = slice(heads.start * attn.head_dim, heads.stop * attn.head_dim)
            attn.c_proj = RowParallelConv1D.from_rows(attn.c_proj, rows, group, world_size)
            attn.n_head = len(heads)                            # this rank's heads; head_dim stays
            block.mlp.c_fc = column_shard(block.mlp.c_fc, torch.arange(cols.start, cols.stop))
            block.mlp.c_proj = RowParallelConv1D.from_rows(block.mlp.c_proj, cols, group, world_size)
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(GPT2Config)}
    model.config = ShardConfig(**{**fields, "n_head": c.n_head // world_size}, tp_rank=rank, tp_size=world_size)
    return model


def allreduce_bytes_per_token(config: GPT2Config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes each token's activations put through all-reduce in one tensor-parallel forward:
    2 all-reduces (attn.c_proj, mlp.c_proj) of ``n_embd`` values per layer."""
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


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


def tp_group(model: nn.Module):
    """``(is tensor parallel over several ranks, its process group)`` for a model
    :func:`shard_model` sharded (``(False, None)`` for any other)."""
    for m in model.modules():
        if isinstance(m, RowParallelConv1D):
            return m.world_size > 1, m.group
    return False, None


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
