"""A small GPT-2 trainer in the nanoGPT spirit: random windows of a text file, AdamW, warmup +
cosine learning rate, gradient clipping, periodic validation and resumable checkpoints.

The first 90% of the file's bytes train, the last 10% validate. Checkpoints are written with
:meth:`GPT2.save_pretrained` (so transformers loads them too) next to ``trainer_state.pt``
(optimizer, step, every random state the run draws from; read back with ``weights_only=True``)
and ``training_log.json``; every file is replaced atomically, so Ctrl-C leaves the last good
checkpoint intact and ``--resume`` continues from it, bit for bit.

Under ``torchrun`` the same code trains data-parallel (``DistributedDataParallel``): every rank
draws the same global batch and keeps its own ``batch_size / world_size`` rows of it (no window
on two ranks), gradients are averaged by DDP's all-reduce, and rank 0 alone prints and writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..core.model import GPT2, GPT2Config
from ..io.checkpoints import CheckpointError, is_checkpoint_dir, save_pretrained
from ..io.formats import load_any
from ..io.tokenizer import get_tokenizer, tokenizer_for
from ..progress import progress_bar
from .. import distributed

STATE_NAME, LOG_NAME = "trainer_state.pt", "training_log.json"


@dataclass
class TrainConfig:
    """Optimisation settings (sizes of the model live in :class:`GPT2Config`).

    Attributes:
        iters: optimizer steps in total; batch_size: windows per step.
        lr: peak learning rate; min_lr: floor of the cosine; warmup: linear warmup steps.
        weight_decay: AdamW decay, applied to matrices only (not biases, LayerNorms).
        grad_clip: max global gradient norm (0: off).
        eval_interval: validate and checkpoint every this many steps; eval_iters: validation
            batches (fixed windows, the same at every validation).
        seed: seeds the initialisation and the batch sampler.

    Raises:
        ValueError: non-positive iters, batch_size, eval_interval or eval_iters; lr <= 0; a
            negative min_lr or warmup; min_lr > lr.
    """

    iters: int = 2000
    batch_size: int = 32
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int = 1337

    def __post_init__(self):
        for name in ("iters", "batch_size", "eval_interval", "eval_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not self.lr > 0 or self.min_lr < 0 or self.warmup < 0:
            raise ValueError(f"lr={self.lr} must be > 0, min_lr={self.min_lr} and warmup={self.warmup} >= 0")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be <= lr={self.lr}: the learning rate decays from lr to "
                             f"min_lr (set both)")


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``iters``."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = min(1.0, (step - tc.warmup) / max(1, tc.iters - tc.warmup))
    return tc.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (tc.lr - tc.min_lr)


def split_bytes(data: bytes) -> tuple[bytes, bytes]:
    """The deterministic split shared by ``train`` and ``perplexity --split``: the first 90% of
    the bytes train, the rest validates. The cut moves forward past UTF-8 continuation bytes
    (``0b10xxxxxx``) to the next character boundary, so both parts of a UTF-8 file stay UTF-8."""
    cut = len(data) * 9 // 10
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut += 1
    return data[:cut], data[cut:]


def load_data(path: str, tokenizer: str, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the first 90% of the file's bytes (train) and of the last 10% (validation).

    Raises:
        ValueError: a missing, empty or non-UTF-8 file, or a split shorter than one context + 1
            tokens.
    """
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"--data {path!r} is empty")
    tok = get_tokenizer(tokenizer)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path!r} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                         f"re-encode it first, e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
                         f"(if it is Latin-1; `file {path}` guesses the encoding)") from None
    parts = [torch.tensor(tok.encode(b.decode("utf-8")), dtype=torch.long) for b in split_bytes(data)]
    for name, ids in zip(("train", "validation"), parts):
        if ids.numel() < n_ctx + 1:
            raise ValueError(f"--data {path!r}: the {name} split has {ids.numel()} tokens, fewer than one context "
                             f"(n_ctx={n_ctx}) + 1; use a longer file or a smaller --n-ctx")
    return parts[0], parts[1]


def get_batch(ids: torch.Tensor, n_ctx: int, batch_size: int, generator: torch.Generator):
    """Random windows: inputs ``[B, n_ctx]`` and next-token targets ``[B, n_ctx]``."""
    starts = torch.randint(0, ids.numel() - n_ctx, (batch_size,), generator=generator)
    x = torch.stack([ids[s:s + n_ctx] for s in starts.tolist()])
    y = torch.stack([ids[s + 1:s + n_ctx + 1] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def evaluate_loss(model: GPT2, ids: torch.Tensor, tc: TrainConfig) -> float:
    """Mean next-token loss (nats) over ``eval_iters`` fixed batches of windows of ``ids``.

    Under ``torchrun`` every rank scores its own rows of each batch (:func:`distributed.shard_rows`)
    and the sums are all-reduced, so every rank returns the single-process figure.
    """
    model.eval()
    gen = torch.Generator().manual_seed(0)
    n_ctx = model.config.n_ctx
    di = distributed.info()
    rows = distributed.shard_rows(tc.batch_size, di.rank, di.world_size)
    device = next(model.parameters()).device
    total = 0.0
    for _ in range(tc.eval_iters):
        x, y = get_batch(ids, n_ctx, tc.batch_size, gen)
        x, y = x[rows].to(device), y[rows].to(device)
        total += F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    total, = distributed.all_reduce_sum([total], device=device if di.backend == "nccl" else None)
    return total / (tc.eval_iters * tc.batch_size * n_ctx)


def rng_state(gen: torch.Generator) -> dict:
    """Every random state this rank's training draws from: the batch sampler ``gen`` and torch's
    global CPU generator (dropout on CPU), plus CUDA's where used. Python's ``random`` and NumPy
    are not used by the trainer."""
    state = {"batches": gen.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(gen: torch.Generator, state: dict) -> None:
    """Restore :func:`rng_state`."""
    gen.set_state(state["batches"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def make_optimizer(model: GPT2, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only, betas (0.9, 0.95) as in nanoGPT."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95))


def _save(model, optimizer, step, gen, tc, log, out_dir, loss_ema=None):
    """Write the checkpoint from rank 0 (after gathering every rank's random state); the other
    ranks wait for it at a barrier."""
    rngs = distributed.gather_objects(rng_state(gen))              # a collective: every rank calls it
    if distributed.info().is_main:
        _write(model, optimizer, step, gen, tc, log, out_dir, loss_ema, rngs)
    distributed.barrier()


def _write(model, optimizer, step, gen, tc, log, out_dir, loss_ema, rngs):
    save_pretrained(model, out_dir, overwrite=True)
    state = {"step": step, "optimizer": optimizer.state_dict(), "generator": gen.get_state(),
             "train_config": dataclasses.asdict(tc), "rng": rngs, "loss_ema": loss_ema}
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    os.close(fd)
    torch.save(state, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out_dir, STATE_NAME))
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(log, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(out_dir, LOG_NAME))


#: GPT2Config fields a run started with ``init_from`` may change (they hold no weights).
DROPOUT_FIELDS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")


def _config_changes(config: GPT2Config | dict | None, base: GPT2Config) -> dict:
    """The fields of ``config`` (a :class:`GPT2Config` or a dict of its fields) whose values
    differ from ``base``'s; unknown field names are a ValueError."""
    if config is None:
        return {}
    fields = {f.name for f in dataclasses.fields(GPT2Config)}
    given = dataclasses.asdict(config) if isinstance(config, GPT2Config) else dict(config)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"config: unknown field(s) {unknown}; expected GPT2Config's {sorted(fields)}")
    return {k: v for k, v in given.items() if v != getattr(base, k)}


def _train_config(tc: TrainConfig | dict | None, saved: dict | None) -> tuple[TrainConfig, list[str]]:
    """The settings of a run and, when resuming, one line per setting that differs from the
    checkpoint's (``saved``). A dict holds only the settings to change (of the checkpoint's on
    resume, of :class:`TrainConfig`'s defaults on a new run); a TrainConfig is taken whole."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if isinstance(tc, dict):
        unknown = sorted(set(tc) - fields)
        if unknown:
            raise ValueError(f"tc: unknown setting(s) {unknown}; expected TrainConfig's {sorted(fields)}")
    if saved is None:
        return (TrainConfig(**tc) if isinstance(tc, dict) else tc or TrainConfig()), []
    base = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
    new = dataclasses.replace(base, **tc) if isinstance(tc, dict) else tc or base
    if new.seed != base.seed:
        raise ValueError(f"seed={new.seed}: a resumed run continues the random states saved with the checkpoint "
                         f"(its seed is {base.seed}), so a new seed would change nothing; drop it, or start a new run")
    lines = [f"resume: {name} = {getattr(new, name)} (overrides the checkpoint's {getattr(base, name)})"
             for name in (f.name for f in dataclasses.fields(TrainConfig)) if getattr(new, name) != getattr(base, name)]
    return new, lines


def train(data: str, out_dir: str, config: GPT2Config | dict | None = None, tc: TrainConfig | dict | None = None,
          resume: bool = False, progress: bool = True, init_from: str | None = None) -> dict:
    """Train (or resume training) a GPT-2 on ``data`` and checkpoint it into ``out_dir``.

    Args:
        data: path of a UTF-8 text file.
        out_dir: checkpoint directory; must be empty/new, or (with ``resume``) one of ours.
        config: model sizes of a new run (default: the ``tiny`` preset). With ``resume`` or
            ``init_from`` the model's own config is used; ``config`` (a GPT2Config, or a dict of
            the fields to change) may then differ from it only in dropout (``init_from``).
        tc: the settings, a :class:`TrainConfig` or a dict of the ones to change. A resumed run
            keeps the checkpoint's settings except those in the dict (e.g. ``{"iters": 4000}``),
            and prints one line on stderr per setting that differs from the checkpoint's.
        resume: continue from the checkpoint in ``out_dir``: the same settings, the optimizer,
            the step and every random state, so an interrupted run resumed continues bit for bit.
        progress: show a tqdm bar with loss and tokens/s on stderr (when it is a terminal).
        init_from: fine-tune: start a new run (step 0, a fresh optimizer) from this model's
            weights; anything ``GPT2.from_pretrained`` takes (a built-in
            name, a directory, a hub id, nanoGPT's ckpt.pt, ...). The data is read with that
            model's tokenizer (as nanoGPT's ``init_from``).

    Returns:
        The training log: ``{"config", "train_config", "data", "evals": [{step, train_loss,
        val_loss, seconds}], "seconds", "tokens_per_second"}`` (and ``"init_from"``), with
        ``"steps_run"``: the optimizer steps this call ran (0 when a resumed checkpoint had
        already reached ``iters``; the log's times are then the earlier runs').

    Under ``torchrun`` (a process group initialised, :mod:`gpt2mha.distributed`) it trains with
    ``DistributedDataParallel``; ``batch_size`` is the global batch, split over the ranks.

    Raises:
        ValueError: bad data (see :func:`load_data`), resuming without a checkpoint, a
            batch_size not divisible by the world size, ``resume`` with ``init_from``, a model
            config that would change on resume (or, beyond dropout, with ``init_from``), a new
            seed on resume, a quantized ``init_from`` model or one whose tokenizer cannot read
            text.
        FileExistsError: ``out_dir`` is non-empty and not a gpt2mha checkpoint, or is one
            and ``resume`` was not asked for.
        gpt2mha.distributed.DistributedError: another rank died or did not answer in time.
    """
    di = distributed.info()
    _check_out_dir(out_dir, resume, init_from)
    model, tc, log, state, start = _resumed(out_dir, data, config, tc, di) if resume else \
        _new_run(data, config, tc, init_from, di)
    config = model.config
    log["train_config"] = dataclasses.asdict(tc)
    train_ids, val_ids = load_data(data, config.tokenizer, config.n_ctx)
    model.to(di.device)
    optimizer = make_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    loss_ema = None
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        loss_ema = state.get("loss_ema")
        _restore_rng(gen, state, di)
    if start >= tc.iters:
        return {**log, "steps_run": 0}
    log["world_size"] = di.world_size
    log = _loop(model, optimizer, gen, tc, log, (train_ids, val_ids), start, loss_ema, out_dir, progress, di)
    return {**log, "steps_run": tc.iters - start}


def _check_out_dir(out_dir: str, resume: bool, init_from: str | None) -> None:
    """``out_dir`` fits what was asked: new or empty for a new run, one of ours for ``resume``.

    Raises:
        ValueError: ``resume`` with ``init_from``, or ``resume`` without a checkpoint.
        FileExistsError: a non-empty directory that is not ours, or ours without ``resume``.
    """
    if resume and init_from is not None:
        raise ValueError(f"init_from={init_from!r} starts a new run from a model's weights, resume continues the "
                         f"checkpoint in {out_dir!r}: use one of them (CLI: --init-from or --resume)")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not is_checkpoint_dir(out_dir):
            raise FileExistsError(f"--out {out_dir!r} is not empty and is not a gpt2mha checkpoint; refusing to "
                                  f"write into it")
        if not resume:
            raise FileExistsError(f"--out {out_dir!r} already holds a checkpoint; pass --resume to continue it "
                                  f"or choose another directory")
    elif resume:
        raise ValueError(f"--resume: no checkpoint in {out_dir!r}")


def _check_batch(tc: TrainConfig, di) -> None:
    if tc.batch_size % di.world_size:
        raise ValueError(f"batch_size={tc.batch_size} is not divisible by the world size {di.world_size}; "
                         f"every rank takes batch_size / world_size rows of the global batch")


def _resumed(out_dir: str, data: str, config, tc, di):
    """``(model, settings, log, state, step)`` of the checkpoint in ``out_dir``, its settings
    overridden by ``tc``'s (one line on stderr each, rank 0).

    Raises:
        ValueError: a model config that would change, or a batch the world size does not divide.
    """
    state = torch.load(os.path.join(out_dir, STATE_NAME), weights_only=True)
    tc, overridden = _train_config(tc, state["train_config"])
    _check_batch(tc, di)
    model = load_any(out_dir).train()
    changes = _config_changes(config, model.config)
    if changes:
        raise ValueError("; ".join(f"{k}={v!r}: the checkpoint's model has {k} {getattr(model.config, k)!r}"
                                   for k, v in changes.items())
                         + "; a resumed run continues that model: drop it (or fine-tune the checkpoint into a "
                           "new run with init_from, CLI --init-from)")
    with open(os.path.join(out_dir, LOG_NAME)) as f:
        log = json.load(f)
    if di.is_main:
        if log.get("data") != os.path.basename(data):
            overridden.append(f"resume: data = {os.path.basename(data)} (the checkpoint trained on "
                              f"{log.get('data')})")
        for line in overridden:
            print(line, file=sys.stderr)
    return model, tc, log, state, state["step"]


def _new_run(data: str, config, tc, init_from: str | None, di):
    """``(model, settings, log, None, 0)`` of a new run: a model initialised with ``tc.seed`` (or
    :func:`_fine_tune_start`'s), each rank then drawing its own dropout stream.

    Raises:
        ValueError: see :func:`_fine_tune_start`, or a batch the world size does not divide.
    """
    tc, _ = _train_config(tc, None)
    _check_batch(tc, di)
    torch.manual_seed(tc.seed)
    if init_from is not None:
        model = _fine_tune_start(init_from, config)
    else:
        config = config if isinstance(config, GPT2Config) else \
            GPT2Config.from_preset("tiny", **_config_changes(config, GPT2Config.from_preset("tiny")))
        model = GPT2(config)
        model.init_weights(seed=tc.seed)
    model.train()
    if di.rank:                                                 # each rank its own dropout stream
        torch.manual_seed(tc.seed + di.rank)
    log = {"config": dataclasses.asdict(model.config), "train_config": dataclasses.asdict(tc),
           "data": os.path.basename(data), "evals": [], "seconds": 0.0}
    if init_from is not None:
        log["init_from"] = init_from
    return model, tc, log, None, 0


def _loop(model, optimizer, gen, tc: TrainConfig, log: dict, ids, start: int, loss_ema, out_dir: str,
          progress: bool, di) -> dict:
    """The optimizer steps ``start … tc.iters - 1``: this rank's rows of each global batch, DDP's
    averaged gradients, an evaluation and a checkpoint every ``eval_interval`` steps."""
    train_ids, val_ids = ids
    n_ctx = model.config.n_ctx
    ddp = model
    if di.world_size > 1:
        ddp = DistributedDataParallel(model, device_ids=[di.local_rank] if di.backend == "nccl" else None)
    rows = distributed.shard_rows(tc.batch_size, di.rank, di.world_size)
    bar = progress_bar(range(start, tc.iters), initial=start, total=tc.iters, enabled=progress and di.is_main,
                       desc="train", unit="step", mininterval=2.0, leave=True)
    t0, seconds0, tokens = time.perf_counter(), log["seconds"], 0
    step = start
    try:
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, tc)
            x, y = get_batch(train_ids, n_ctx, tc.batch_size, gen)         # the global batch, same on every rank
            x, y = x[rows].to(di.device), y[rows].to(di.device)            # this rank's rows
            loss = F.cross_entropy(ddp(x).logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()                                     # DDP: gradients averaged over ranks
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            tokens += x.numel() * di.world_size
            loss_value = loss.item()
            if di.world_size > 1:                               # the global batch's mean loss
                loss_value = distributed.all_reduce_sum([loss_value])[0] / di.world_size
            loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
            elapsed = time.perf_counter() - t0
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens / max(elapsed, 1e-9):.0f}", refresh=False)
            done = step + 1
            if done % tc.eval_interval == 0 or done == tc.iters:
                val = evaluate_loss(model, val_ids, tc)
                log["evals"].append({"step": done, "train_loss": loss_ema, "val_loss": val,
                                     "seconds": seconds0 + time.perf_counter() - t0})
                if di.is_main:
                    bar.write(f"step {done}: train loss {loss_ema:.4f}, val loss {val:.4f} "
                              f"({val / math.log(2):.3f} bits/token)")
                log["seconds"] = seconds0 + time.perf_counter() - t0
                log["tokens_per_second"] = tokens / (time.perf_counter() - t0)
                _save(model, optimizer, done, gen, tc, log, out_dir, loss_ema)
    except (torch.distributed.DistError, RuntimeError) as e:
        if di.world_size == 1 or isinstance(e, distributed.DistributedError) or not distributed.is_collective_error(e):
            raise
        raise distributed.collective_failure(e, f"at step {step}") from e
    finally:
        bar.close()
    return log


def _fine_tune_start(init_from: str, config: GPT2Config | dict | None) -> GPT2:
    """The float32 model a fine-tuning run starts from, with the dropout of ``config`` if given.

    Raises:
        ValueError: a quantized model, a tokenizer that cannot read text, or a ``config`` that
            changes anything but dropout (sizes and the tokenizer are the loaded model's).
    """
    try:
        model = load_any(init_from)
    except CheckpointError as e:
        raise ValueError(f"init_from={init_from!r}: {e}") from None
    if getattr(model, "quantization", None):
        raise ValueError(f"init_from={init_from!r} is quantized ({model.quantization['scheme']}): its weights are "
                         f"rounded integers and cannot be trained; fine-tune the float model")
    changes = _config_changes(config, model.config)
    fixed = {k: v for k, v in changes.items() if k not in DROPOUT_FIELDS}
    if fixed:
        raise ValueError("; ".join(f"{k}={v!r}: the model {init_from!r} has {k} {getattr(model.config, k)!r}"
                                   for k, v in fixed.items())
                         + "; a run started from a model keeps its sizes (they hold its weights) and its tokenizer "
                           "(the data is read with it); only dropout may change")
    try:
        tokenizer_for(model.config)
    except ValueError as e:
        raise ValueError(f"init_from={init_from!r}: {e}") from None
    if changes:                                                 # dropout: rebuild, same weights
        tuned = GPT2(dataclasses.replace(model.config, **changes))
        tuned.load_state_dict(model.state_dict())
        model = tuned
    return model


def _restore_rng(gen: torch.Generator, state: dict, di) -> None:
    """Put back the random states saved with the checkpoint (rank r gets rank r's). A checkpoint
    from before random states were saved, or from another world size, restores what it can and
    says so on rank 0."""
    rngs = state.get("rng")
    if rngs is not None and len(rngs) == di.world_size:
        set_rng_state(gen, rngs[di.rank])
        return
    gen.set_state(state["generator"])                           # the batches stay the same either way
    torch.manual_seed(state["train_config"]["seed"] + di.rank + state["step"])
    if di.is_main:
        saved = "no dropout random state" if rngs is None else f"random states of {len(rngs)} rank(s)"
        print(f"note: the checkpoint holds {saved}; this run has {di.world_size}: the batches continue "
              f"exactly, dropout draws a fresh stream", file=sys.stderr)
