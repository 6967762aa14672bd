"""Tensor parallelism by heads, data-parallel training and distributed perplexity on 2 gloo
processes over 127.0.0.1. The reference for every figure is the same computation in
one process (the unsharded model, the single-process trainer, evaluate.perplexity)."""

import copy
import dataclasses
import json
import os

import pytest
import torch

from dist_helpers import run_ranks, values
from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.core.hooks import record
from gpt2mha.inference import parallel
from gpt2mha import distributed
from gpt2mha.train.evaluate import distributed_perplexity

VERDICT = os.path.join(os.path.dirname(__file__), "data", "the-verdict.txt")
pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(config: GPT2Config, seed: int = 0) -> GPT2:
    """Random weights with LayerNorms and biases away from 1/0, so a shard that drops or
    doubles a bias or scale is seen."""
    model = GPT2(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("ln_f"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


class RecordingCache(KVCache):
    """Records each cache generate makes (over its storage: KVCache.over)."""
    made = []

    @classmethod
    def over(cls, k, v):
        cache = super().over(k, v)
        RecordingCache.made.append(cache)
        return cache


def tp_checks(rank, world, config_kwargs, greedy_steps):
    """Everything tensor-parallel on one rank: logits without/with past, with a KVCache, with a
    left-padded batch, greedy tokens, and the bytes of the parameters and of generate's cache."""
    import gpt2mha.inference.generate as G

    config = GPT2Config(**config_kwargs)
    full = random_model(config)
    tp = parallel.shard_model(copy.deepcopy(full))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.n_vocab, (2, 9), generator=gen)
    out = {}
    with torch.no_grad():
        ref, ref_present = full(idx)
        got, present = tp(idx)
        out["no_past"] = (got - ref).abs().max().item()
        heads = parallel.head_range(config.n_head, rank, world)
        out["present"] = (present - ref_present[:, :, :, heads.start:heads.stop]).abs().max().item()
        out["present_shape"] = tuple(present.shape)
        nxt = torch.randint(0, config.n_vocab, (2, 3), generator=gen)
        ref2 = full(nxt, past=ref_present).logits
        out["past"] = (tp(nxt, past=present).logits - ref2).abs().max().item()
        cache_full = KVCache(config.n_layer, 2, config.n_head, 16, config.head_dim)
        cache_tp = KVCache(config.n_layer, 2, tp.config.n_head, 16, tp.config.head_dim)
        full(idx, cache=cache_full), tp(idx, cache=cache_tp)
        out["cache"] = (tp(nxt, cache=cache_tp).logits - full(nxt, cache=cache_full).logits).abs().max().item()
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :4] = 0                                         # row 0 left-padded by 4
        out["padded"] = (tp(idx, attention_mask=mask).logits - full(idx, attention_mask=mask).logits).abs().max().item()

    prompts = [[5, 17, 3], [9, 1, 22, 8, 4, 30]]                  # left-padded batch inside generate
    G.KVCache, RecordingCache.made = RecordingCache, []
    try:
        full_tokens = full.generate(prompts, greedy_steps, temperature=0)
        tp_tokens = tp.generate(prompts, greedy_steps, temperature=0)
        full_cache, tp_cache = RecordingCache.made
    finally:
        G.KVCache = KVCache
    out["greedy"] = (full_tokens.tolist(), tp_tokens.tolist(), [len(p) for p in prompts])
    out["unseeded"] = tp.generate(prompts, 20, temperature=1.0).tolist()   # the Python API: one shared seed
    out["cache_bytes"] = (full_cache.k.nbytes + full_cache.v.nbytes, tp_cache.k.nbytes + tp_cache.v.nbytes)
    out["param_bytes"] = (dict((n, p.nbytes) for n, p in full.named_parameters()),
                          dict((n, p.nbytes) for n, p in tp.named_parameters()))
    return out


def check_tp_results(results, config: GPT2Config, world: int):
    from conftest import assert_same_greedy

    per_rank = values(results)
    replicated = ("wte.", "wpe.", "lm_head.", "ln_", "attn.c_proj.bias", "mlp.c_proj.bias")
    for rank, r in enumerate(per_rank):
        # logits equal the one-process model's (float32; only summation order differs)
        for key in ("no_past", "past", "cache", "padded", "present"):
            assert r[key] < 1e-5, (rank, key, r[key])
        assert r["present_shape"] == (2, config.n_layer, 2, config.n_head // world, 9, config.head_dim)
        # greedy tokens: identical (they could only part at a near-tie of the one-process logits)
        full_tokens, tp_tokens, lengths = r["greedy"]
        if full_tokens != tp_tokens:
            model = random_model(config)
            for a, b, n in zip(full_tokens, tp_tokens, lengths):
                pad = max(lengths) - n                          # left padding of this row
                assert_same_greedy(model, a[pad:], b[pad:], n)
        # the KV cache generate allocates holds 1/N of the heads
        full_cache, tp_cache = r["cache_bytes"]
        assert tp_cache * world == full_cache
        # parameters: the block matrices and sharded biases are 1/N, the rest replicated (first principles)
        full_p, tp_p = r["param_bytes"]
        assert full_p.keys() == tp_p.keys()
        expect = sum(b if any(s in n for s in replicated) else b // world for n, b in full_p.items())
        assert sum(tp_p.values()) == expect
        for n, b in full_p.items():
            assert tp_p[n] == (b if any(s in n for s in replicated) else b // world), n
        sharded = sum(b for n, b in full_p.items() if not any(s in n for s in replicated))
        assert sum(full_p.values()) - sum(tp_p.values()) == sharded - sharded // world
    assert per_rank[0]["greedy"][1] == per_rank[1]["greedy"][1]        # every rank decoded the same ids
    assert per_rank[0]["unseeded"] == per_rank[1]["unseeded"]          # and sampled the same without a seed


def test_tp2_equals_one_process_on_a_4_head_model(tmp_path):
    config = GPT2Config(n_vocab=64, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")
    results = run_ranks(tp_checks, 2, str(tmp_path), dataclasses.asdict(config), 50, timeout=150)
    check_tp_results(results, config, 2)


@pytest.mark.slow
def test_tp2_equals_one_process_on_the_124M_preset(tmp_path):
    """All 12 layers and 12 heads of GPT-2 small (random weights); 12 greedy steps (50 on the 4-head model)."""
    config = GPT2Config.from_preset("124M", n_ctx=64)
    results = run_ranks(tp_checks, 2, str(tmp_path), dataclasses.asdict(config), 12, timeout=400)
    check_tp_results(results, config, 2)


def test_c_attn_shard_takes_q_k_and_v_of_its_heads():
    """Rank r's c_attn columns are q, k and v of heads [r·h/N, (r+1)·h/N), not a contiguous third."""
    n_embd, n_head, hd = 12, 6, 2
    cols = [parallel.qkv_columns(n_embd, n_head, r, 3).tolist() for r in range(3)]
    assert cols[0] == [0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26, 27]
    assert sorted(sum(cols, [])) == list(range(3 * n_embd))       # every column exactly once
    model = GPT2(GPT2Config(n_vocab=8, n_ctx=8, n_embd=n_embd, n_head=n_head, n_layer=1))
    x = torch.randn(1, 3, n_embd)
    names = ["hook_q", "hook_k", "hook_v"]                          # [1, 3, h, 2] each
    with torch.no_grad():
        attn = model.h[0].attn
        full = record(attn, names, lambda: attn(x), stop=True)
        shard = parallel.shard_model(copy.deepcopy(model), rank=1, world_size=3).h[0].attn
        part = record(shard, names, lambda: shard(x), stop=True)  # heads 2, 3 (stops before c_proj's all-reduce)
    assert shard.n_head == 2
    for name in names:
        torch.testing.assert_close(part[name], full[name][:, :, 2:4], atol=1e-6, rtol=0)


def test_heads_not_divisible_by_world_size_is_refused_before_any_work():
    model = GPT2(GPT2Config(n_vocab=8, n_ctx=8, n_embd=12, n_head=6, n_layer=1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"n_head=6 is not divisible by the tensor-parallel size tp=4"):
        parallel.shard_model(model, rank=0, world_size=4)
    assert not isinstance(model.config, parallel.ShardConfig)       # nothing changed
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------------------ data parallel
def ddp_and_scoring_checks(rank, world, out_dir):
    """On each rank: distributed perplexity, DDP training (20 steps, checkpoint writes counted),
    --resume to 30, and dropout runs for a bit-identical DDP resume."""
    import gpt2mha.train.train as T
    from gpt2mha.train.train import TrainConfig, train

    out = {}
    model = random_model(GPT2Config.from_preset("tiny"), seed=3)
    text = open(VERDICT, encoding="utf-8").read()[:4000]
    out["ppl"] = dataclasses.asdict(distributed_perplexity(model, text, stride=24))

    writes, real_write = [], T._write
    T._write = lambda *a, **k: (writes.append(a[2]), real_write(*a, **k))
    cfg = GPT2Config.from_preset("tiny")
    tc = TrainConfig(iters=20, batch_size=8, eval_interval=10, eval_iters=2, lr=3e-3, min_lr=3e-3, warmup=0, seed=1)
    out["log20"] = train(VERDICT, os.path.join(out_dir, "run"), cfg, tc, progress=False)["evals"]
    tc30 = dataclasses.replace(tc, iters=30)
    out["log30"] = train(VERDICT, os.path.join(out_dir, "run"), cfg, tc30, resume=True, progress=False)["evals"]
    out["writes"] = list(writes)

    drop = GPT2Config.from_preset("tiny", attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2)
    tcd = dataclasses.replace(tc, iters=30, eval_interval=15)
    train(VERDICT, os.path.join(out_dir, "drop_a"), drop, tcd, progress=False)
    train(VERDICT, os.path.join(out_dir, "drop_b"), drop, dataclasses.replace(tcd, iters=15), progress=False)
    train(VERDICT, os.path.join(out_dir, "drop_b"), drop, tcd, resume=True, progress=False)
    return out


def test_ddp2_training_and_scoring_equal_one_process(tmp_path):
    from gpt2mha.train.evaluate import perplexity
    from gpt2mha.train.train import TrainConfig, train

    results = values(run_ranks(ddp_and_scoring_checks, 2, str(tmp_path), str(tmp_path), timeout=240))

    # distributed perplexity = the single-process figure (relative 1e-6), on every rank
    model = random_model(GPT2Config.from_preset("tiny"), seed=3)
    text = open(VERDICT, encoding="utf-8").read()[:4000]
    single = perplexity(model, text, stride=24)
    for r in results:
        assert r["ppl"]["tokens"] == single.tokens
        assert r["ppl"]["perplexity"] == pytest.approx(single.perplexity, rel=1e-6)
        assert r["ppl"]["loss_per_token"] == pytest.approx(single.loss_per_token, rel=1e-6)

    # same global batch and seed: the loss after 20 (and 30, resumed) steps equals one process's
    cfg = GPT2Config.from_preset("tiny")
    tc = TrainConfig(iters=30, batch_size=8, eval_interval=10, eval_iters=2, lr=3e-3, min_lr=3e-3, warmup=0, seed=1)
    ref = train(VERDICT, str(tmp_path / "single"), cfg, tc, progress=False)["evals"]
    for r in results:
        assert [e["step"] for e in r["log30"]] == [10, 20, 30]          # resume continued the log
        for got, want in zip(r["log30"], ref):
            assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-4)
            assert got["val_loss"] == pytest.approx(want["val_loss"], abs=1e-4)
        assert r["log20"][-1]["val_loss"] == pytest.approx(ref[1]["val_loss"], abs=1e-4)
    ddp = GPT2.from_pretrained(str(tmp_path / "run"))
    one = GPT2.from_pretrained(str(tmp_path / "single"))
    for (name, p), q in zip(ddp.named_parameters(), one.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=name)
    # rank 0 alone wrote each checkpoint (steps 10, 20, then 30 after the resume)
    assert results[0]["writes"] == [10, 20, 30] and results[1]["writes"] == []
    state = torch.load(str(tmp_path / "run" / "trainer_state.pt"), weights_only=True)
    assert state["step"] == 30 and len(state["rng"]) == 2                # one random state per rank
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])
    # with dropout, DDP 15 + resume 15 is bit-identical to DDP 30 (every rank's RNG restored)
    a, b = GPT2.from_pretrained(str(tmp_path / "drop_a")), GPT2.from_pretrained(str(tmp_path / "drop_b"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def dying_rank(rank, world, out_dir, how):
    """Rank 1 dies (or hangs) at its 4th training batch; rank 0 must stop with a clear error."""
    import time

    import gpt2mha.train.train as T
    from gpt2mha.train.train import TrainConfig, train

    real, calls = T.get_batch, {"n": 0}

    def get_batch(ids, *args, **kw):
        if rank == 1 and ids.numel() > 10000:
            calls["n"] += 1
            if calls["n"] == 4:
                if how == "dies":
                    os._exit(3)
                time.sleep(12)                  # past the 5 s collective timeout
        return real(ids, *args, **kw)

    T.get_batch = get_batch
    tc = TrainConfig(iters=50, batch_size=4, eval_interval=50, eval_iters=1, seed=1)
    t0 = time.monotonic()
    try:
        train(VERDICT, os.path.join(out_dir, "run"), GPT2Config.from_preset("tiny"), tc, progress=False)
    except distributed.DistributedError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("how", ["dies", pytest.param("hangs", marks=pytest.mark.slow)])
def test_a_rank_that_dies_or_hangs_stops_the_others_with_a_clear_message(tmp_path, how):
    results = run_ranks(dying_rank, 2, str(tmp_path), str(tmp_path), how, timeout=90, collective_timeout=5)
    status, r0 = results[0]
    assert status == "ok", r0
    assert r0["error"] is not None, "rank 0 trained on without rank 1"
    assert "another rank died or did not answer within 5 s" in r0["error"] and "at step 3" in r0["error"]
    assert r0["seconds"] < 60
    assert results[1][0] in ("missing",) if how == "dies" else True


# -------------------------------------------------- the CLI on several ranks (sampling, failures)
def run_cli(argv):
    """``gpt2mha ARGV`` in this process: (exit code, stdout, stderr); SystemExit becomes the code."""
    import contextlib
    import io

    from gpt2mha.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def disagreeing_checks(rank):
    """Ranks given different settings, seeds, or holding different tokens: each check's message."""
    out = {}
    for name, check in (("settings", lambda: distributed.agree({"--top-k": 40, "--temperature": 0.8 + 0.1 * rank})),
                        ("seeds", lambda: distributed.shared_seed(5 + rank)),
                        ("tokens", lambda: parallel.check_same_tokens(torch.tensor([[1, 2, 3, 4 + rank, 5]])))):
        try:
            check()
            out[name] = None
        except distributed.DistributedError as e:
            out[name] = str(e)
    parallel.check_same_tokens(torch.tensor([[1, 2, 3]]))           # equal tokens pass
    distributed.agree({"--top-k": 40})
    return out


def unseeded_cli_ranks(rank, world, commands):
    """Each command run by ``gpt2mha``'s main on this rank (the process group kept between them),
    with the seed each rank sampled with recorded; then :func:`disagreeing_checks`."""
    seeds, real_seed, real_teardown = [], distributed.shared_seed, distributed.teardown
    distributed.shared_seed = lambda seed: (seeds.append(real_seed(seed)), seeds[-1])[1]
    distributed.teardown = lambda: None
    try:
        return [run_cli(argv) for argv in commands], seeds, disagreeing_checks(rank)
    finally:
        distributed.shared_seed, distributed.teardown = real_seed, real_teardown


def test_unseeded_tp2_generate_samples_one_seed_and_prints_what_one_process_prints_with_it(tmp_path, capsys):
    """Without --seed, the tensor-parallel ranks sample with one seed drawn by rank 0 (not each
    from its own unseeded generator, which would part the ranks' tokens): both ranks exit 0, rank 0 alone
    prints, and what it prints is what one process prints with --seed set to that seed
    (reference: the single-process CLI), for one prompt and for --num-samples batches.
    Ranks that would sample differently (other settings or seed given, or tokens that part)
    are stopped with the cause named, the same message on every rank."""
    from gpt2mha.cli import main

    commands = [["generate", "ROMEO:", "--tp", "2", "--max-new-tokens", "24"],
                ["generate", "ROMEO:", "JULIET:", "--num-samples", "2", "--tp", "2", "--max-new-tokens", "12",
                 "--temperature", "0.9", "--top-k", "30"]]
    (r0, seeds0, bad0), (r1, seeds1, bad1) = values(run_ranks(unseeded_cli_ranks, 2, str(tmp_path), commands,
                                                              timeout=150))
    assert seeds0 == seeds1 and len(seeds0) == 2 and None not in seeds0 and seeds0[0] != seeds0[1]
    for (code0, out0, err0), (code1, out1, err1), argv, seed in zip(r0, r1, commands, seeds0):
        assert (code0, code1) == (0, 0), (err0, err1)
        assert out1 == "" and err0 == err1 == ""
        i = argv.index("--tp")
        one = argv[:i] + argv[i + 2:] + ["--seed", str(seed)]
        assert main(one) == 0
        assert out0 == capsys.readouterr().out and out0.startswith(("ROMEO:", "=" * 20))

    assert bad0 == bad1
    assert "disagree on --temperature (rank 0: 0.8, rank 1: 0.9" in bad0["settings"] and "top-k" not in bad0["settings"]
    assert "different seeds (rank 0: 5, rank 1: 6)" in bad0["seeds"]
    assert "rank 1 sampled token 5 where rank 0 sampled 4 (row 0, position 3)" in bad0["tokens"]
    assert "logits differed" in bad0["tokens"]


def test_tp2_runs_the_schedulers_flags_as_one_process(tmp_path, capsys):
    """--stop, --logprobs with --echo, --best-of, --stop-token-ids and --sliding-window with --tp 2
    (one scheduler runs them all, stepping alike on every rank: every sequence admitted in the
    first step, seeds from one shared seed): both ranks exit 0, rank 0 alone prints, and it
    prints what one process prints with that seed (reference: the single-process CLI)."""
    from gpt2mha.cli import main

    commands = [["generate", "ROMEO:", "--tp", "2", "--max-new-tokens", "24", "--stop", "e,", "--logprobs", "2",
                 "--echo", "--seed", "3"],
                ["generate", "ROMEO:", "JULIET:", "--tp", "2", "--num-samples", "2", "--best-of", "3",
                 "--max-new-tokens", "12", "--stop-token-ids", "10"],
                ["generate", "ROMEO:", "--tp", "2", "--max-new-tokens", "258", "--sliding-window", "--temperature", "0",
                 "--stop", "zz"]]
    (r0, seeds0, _), (r1, seeds1, _) = values(run_ranks(unseeded_cli_ranks, 2, str(tmp_path), commands, timeout=240))
    assert seeds0 == seeds1 and len(seeds0) == 3 and seeds0[0] == 3
    for (code0, out0, err0), (code1, out1, err1), argv, seed in zip(r0, r1, commands, seeds0):
        assert (code0, code1) == (0, 0), (err0, err1)
        assert out1 == "" and err0 == err1 == ""
        one = [a for i, a in enumerate(argv) if "--tp" not in argv[max(i - 1, 0):i + 1]]
        one = [a for i, a in enumerate(one) if "--seed" not in one[max(i - 1, 0):i + 1]] + ["--seed", str(seed)]
        assert main(one) == 0
        assert_same_but_rounding(out0, capsys.readouterr().out)
    assert "-- log-probabilities (prompt and new tokens" in r0[0][1] and r0[1][1].count("=" * 20) == 8


def assert_same_but_rounding(tp: str, one: str, tol: float = 1e-3) -> None:
    """The same text, except the printed log-probabilities (4 decimals), which may differ within
    ``tol``: the ranks all-reduce their partial sums, in another order than one process adds them."""
    import re

    number = r"-?\d+\.\d{4}\b"
    assert re.sub(number, "#", tp) == re.sub(number, "#", one)
    for a, b in zip(re.findall(number, tp), re.findall(number, one)):
        assert abs(float(a) - float(b)) <= tol, (a, b)


def failing_rank_cli(rank, world, command, how, text_path):
    """Rank 1 dies (os._exit) or stalls past the 5 s collective timeout in the middle of
    ``gpt2mha generate --tp 2`` or ``perplexity``; every rank runs the CLI's main."""
    import time

    def fail():
        if how == "dies":
            os._exit(3)
        time.sleep(12)

    if rank == 1 and command == "generate":
        real, calls = parallel.RowParallelConv1D.forward, {"n": 0}

        def forward(self, x):
            calls["n"] += 1
            if calls["n"] == 40:                            # some tokens in (2 all-reduces a layer, 6 layers)
                fail()
            return real(self, x)
        parallel.RowParallelConv1D.forward = forward
    if rank == 1 and command == "perplexity":
        from gpt2mha.train import evaluate
        evaluate.score_windows = lambda *a, **k: fail()     # before its share reaches the all-reduce
    argv = (["generate", "ROMEO:", "--tp", "2", "--max-new-tokens", "60", "--seed", "1"] if command == "generate"
            else ["perplexity", text_path, "--stride", "128"])
    return run_cli(argv)


@pytest.mark.parametrize("command,how", [("generate", "dies"), pytest.param("generate", "stalls", marks=pytest.mark.slow),
                                         pytest.param("perplexity", "dies", marks=pytest.mark.slow)])
def test_a_rank_that_dies_or_stalls_in_a_torchrun_command_is_one_line(tmp_path, command, how):
    """The README's promise for every command under torchrun: when a peer dies or stalls past
    GPT2MHA_DIST_TIMEOUT, the surviving rank prints one line, `error: rank 0: a collective in
    COMMAND failed: another rank died or did not answer within 5 s ...`, no traceback, exit 1;
    a streamed generation first ends its line."""
    text_path = str(tmp_path / "text.txt")
    with open(VERDICT, encoding="utf-8") as f:
        open(text_path, "w", encoding="utf-8").write(f.read()[:3000])
    results = run_ranks(failing_rank_cli, 2, str(tmp_path), command, how, text_path, timeout=120,
                        collective_timeout=5)
    status, (code, out, err) = results[0]
    assert status == "ok"
    assert code == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: rank 0: a collective in {command} failed: another rank died or did not answer "
                          f"within 5 s"), err
    if command == "generate":
        assert out.startswith("ROMEO:") and out.endswith("\n") and len(out) > len("ROMEO:\n")


# ---------------------------------------------------------------------------- the torchrun CLI
@pytest.mark.slow
def test_torchrun_generate_tp2_prints_once_the_tokens_of_one_process(tmp_path):
    from dist_helpers import single, torchrun

    args = ["generate", "ROMEO:", "--max-new-tokens", "40", "--temperature", "0.8", "--top-k", "20", "--seed", "7"]
    one = single(args)
    two = torchrun(args + ["--tp", "2"])
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.startswith("ROMEO:")     # once, from rank 0
    # 3 heads over 2 ranks: refused before any work, the message names both numbers
    GPT2(GPT2Config(n_vocab=256, n_ctx=32, n_embd=24, n_head=3, n_layer=1, tokenizer="bytes")).save_pretrained(
        str(tmp_path / "three"))
    bad = torchrun(["generate", "hi", "--model", str(tmp_path / "three"), "--tp", "2"])
    assert bad.returncode != 0 and bad.stdout == ""
    assert "n_head=3 is not divisible by the tensor-parallel size tp=2" in bad.stderr
    no_torchrun = single(["generate", "hi", "--tp", "2"])
    assert no_torchrun.returncode == 2 and "--tp 2 needs 2 processes, this run has 1" in no_torchrun.stderr
    # a flag conflict is found before the process group and said once (rank 0), exit 2
    conflict = "--quantize int8 with --tp 2: tensor parallelism shards float weights"
    for run in (torchrun(["generate", "hi", "--tp", "2", "--quantize", "int8"]),
                single(["generate", "hi", "--tp", "2", "--quantize", "int8"])):
        assert run.returncode != 0 and run.stderr.count(conflict) == 1 and "WORLD_SIZE" not in run.stderr, run.stderr
    assert "exitcode  : 2" in run.stderr or run.returncode == 2
    # unseeded: the ranks share one seed (no "sampled different tokens"); rank 0 prints the 2 samples once
    free = torchrun(["generate", "ROMEO:", "--num-samples", "2", "--max-new-tokens", "20", "--tp", "2"])
    assert free.returncode == 0, free.stderr
    assert [free.stdout.count(f"sample {i} of 2") for i in (1, 2)] == [1, 1]


@pytest.mark.slow
def test_torchrun_train_and_perplexity(tmp_path):
    from dist_helpers import single, torchrun

    out = str(tmp_path / "run")
    args = ["train", "--data", VERDICT, "--out", out, "--iters", "20", "--batch-size", "8", "--eval-interval",
            "10", "--lr", "3e-3", "--warmup", "5", "--seed", "1"]
    run = torchrun(args)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("done: step 20") == 1                        # rank 0 alone reports
    assert [e["step"] for e in json.load(open(os.path.join(out, "training_log.json")))["evals"]] == [10, 20]
    assert len(torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["rng"]) == 2
    # (equality with one process and --resume: test_ddp2_training_and_scoring_equal_one_process)

    one = single(["perplexity", VERDICT, "--model", out, "--json", "--stride", "32"])
    two = torchrun(["perplexity", VERDICT, "--model", out, "--json", "--stride", "32"])
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)                 # one JSON line: rank 0 only
    assert b["tokens"] == a["tokens"] and b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-6)


def test_tp1_shard_is_the_model_itself_without_a_process_group():
    """tp=1 keeps every head and row (no collective is needed or called): same logits and present."""
    config = GPT2Config(n_vocab=64, n_ctx=32, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")
    full = random_model(config)
    one = parallel.shard_model(copy.deepcopy(full), rank=0, world_size=1)
    assert isinstance(one.config, parallel.ShardConfig) and one.config.head_dim == config.head_dim
    assert isinstance(one.h[0].attn.c_proj, parallel.RowParallelConv1D) and one.h[0].attn.n_head == config.n_head
    idx = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        (a, pa), (b, pb) = full(idx), one(idx)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    torch.testing.assert_close(pb, pa, atol=1e-6, rtol=0)


def test_ddp_global_batch_not_divisible_by_the_world_size_is_refused(tmp_path, monkeypatch):
    from gpt2mha.train.train import TrainConfig, train

    monkeypatch.setattr(distributed, "info", lambda: distributed.DistInfo(rank=0, world_size=3))
    with pytest.raises(ValueError, match=r"batch_size=4 is not divisible by the world size 3"):
        train(VERDICT, str(tmp_path / "run"), GPT2Config.from_preset("tiny"), TrainConfig(iters=2, batch_size=4),
              progress=False)
    assert not (tmp_path / "run").exists()                          # nothing written
