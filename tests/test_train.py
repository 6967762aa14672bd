"""The trainer on the-verdict.txt (copied into tests/data): loss goes down, checkpoints load in
gpt2mha and in transformers with equal logits, --resume continues, bad input is refused."""

import json
import os

import pytest
import torch

from gpt2mha import GPT2, GPT2Config
from gpt2mha.cli import main
from gpt2mha.train import TrainConfig, lr_at, train

VERDICT = os.path.join(os.path.dirname(__file__), "data", "the-verdict.txt")
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_args(out, iters):
    return ["train", "--data", VERDICT, "--out", out, "--preset", "tiny", "--iters", str(iters),
            "--batch-size", "8", "--eval-interval", "20", "--lr", "3e-3", "--warmup", "5", "--seed", "1"]


def test_short_run_learns_saves_and_resumes(tmp_path):
    from transformers import GPT2LMHeadModel

    out = str(tmp_path / "run")
    assert main(tiny_args(out, 40)) == 0
    log = json.load(open(os.path.join(out, "training_log.json")))
    assert [e["step"] for e in log["evals"]] == [20, 40]
    first_val = log["evals"][0]["val_loss"]
    assert log["evals"][-1]["val_loss"] < first_val < 5.545   # below uniform over 256 bytes (ln 256)

    ours = GPT2.from_pretrained(out)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, hf(idx).logits, atol=1e-5, rtol=1e-5)

    # --resume continues from step 40 to 60 (the log keeps the earlier evaluations)
    assert main(tiny_args(out, 60) + ["--resume"]) == 0
    log = json.load(open(os.path.join(out, "training_log.json")))
    assert [e["step"] for e in log["evals"]] == [20, 40, 60]
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["step"] == 60


def test_ctrl_c_keeps_last_checkpoint_and_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    """Ctrl-C at step 25 leaves the step-20 checkpoint; resuming to 40 gives the same weights as
    one uninterrupted run to 40."""
    import gpt2mha.train as T

    tc = TrainConfig(iters=40, batch_size=4, eval_interval=20, eval_iters=2, lr=3e-3, warmup=5, seed=3)
    cfg = GPT2Config.from_preset("tiny")
    train(VERDICT, str(tmp_path / "a"), cfg, tc, progress=False)

    real, calls = T.get_batch, {"n": 0}

    def interrupt_at_25(*args, **kw):
        if args[0].numel() > 10000:                  # the train split (validation is ~2 KB)
            calls["n"] += 1
            if calls["n"] == 26:
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(T, "get_batch", interrupt_at_25)
    with pytest.raises(KeyboardInterrupt):
        train(VERDICT, str(tmp_path / "b"), cfg, tc, progress=False)
    monkeypatch.setattr(T, "get_batch", real)
    assert torch.load(str(tmp_path / "b" / "trainer_state.pt"), weights_only=True)["step"] == 20
    GPT2.from_pretrained(str(tmp_path / "b"))                       # the checkpoint is intact
    train(VERDICT, str(tmp_path / "b"), cfg, tc, resume=True, progress=False)
    a, b = GPT2.from_pretrained(str(tmp_path / "a")), GPT2.from_pretrained(str(tmp_path / "b"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_schedule_warmup_then_cosine():
    tc = TrainConfig(iters=100, warmup=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(55, tc) == pytest.approx(0.55) and lr_at(100, tc) == pytest.approx(0.1)


def test_bad_input_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("x" * 300)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--data", str(empty)], "is empty"),
        (["--data", str(short)], "fewer than one context"),
        (["--data", VERDICT, "--n-embd", "30"], "n_embd=30 is not divisible by n_head=4"),
        (["--data", VERDICT, "--out", str(foreign)], "not a gpt2mha checkpoint"),
    ]
    for extra, needle in cases:
        args = ["train", "--out", str(tmp_path / "o"), "--preset", "tiny", "--iters", "2", *extra]
        assert main(args) == 2, extra
        assert needle in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_resume_with_dropout_is_bit_identical_to_an_uninterrupted_run(tmp_path, monkeypatch):
    """Issue 12, item 11: with dropout on, Ctrl-C after the step-10 checkpoint and --resume to 20
    gives exactly the weights, losses and random states of one run to 20 (every RNG the trainer
    draws from is saved: the batch sampler and torch's CPU generator that dropout uses)."""
    import gpt2mha.train as T

    tc = TrainConfig(iters=20, batch_size=4, eval_interval=10, eval_iters=2, lr=3e-3, warmup=5, seed=5)
    cfg = GPT2Config.from_preset("tiny", attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2)
    log_a = train(VERDICT, str(tmp_path / "a"), cfg, tc, progress=False)

    real, calls = T.get_batch, {"n": 0}

    def interrupt_at_13(*args, **kw):
        if args[0].numel() > 10000:                  # the train split
            calls["n"] += 1
            if calls["n"] == 14:
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(T, "get_batch", interrupt_at_13)
    with pytest.raises(KeyboardInterrupt):
        train(VERDICT, str(tmp_path / "b"), cfg, tc, progress=False)
    monkeypatch.setattr(T, "get_batch", real)
    torch.manual_seed(12345)                         # whatever the process did in between
    log_b = train(VERDICT, str(tmp_path / "b"), cfg, tc, resume=True, progress=False)
    a, b = GPT2.from_pretrained(str(tmp_path / "a")), GPT2.from_pretrained(str(tmp_path / "b"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert [(e["train_loss"], e["val_loss"]) for e in log_a["evals"]] == \
        [(e["train_loss"], e["val_loss"]) for e in log_b["evals"]]
    sa = torch.load(str(tmp_path / "a" / "trainer_state.pt"), weights_only=True)
    sb = torch.load(str(tmp_path / "b" / "trainer_state.pt"), weights_only=True)
    assert torch.equal(sa["rng"][0]["torch"], sb["rng"][0]["torch"])
    assert torch.equal(sa["rng"][0]["batches"], sb["rng"][0]["batches"])
