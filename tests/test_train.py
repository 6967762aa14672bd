"""The trainer on the-verdict.txt (copied into tests/data): loss goes down, checkpoints load in
gpt2mha and in transformers with equal logits, --resume continues, bad input is refused."""

import io
import json
import os
import re
import sys

import pytest
import torch

from gpt2mha import GPT2, GPT2Config
from gpt2mha.cli import main
from gpt2mha.train.train import TrainConfig, lr_at, train

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
    import gpt2mha.train.train as T

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
        (["--data", VERDICT, "--lr", "1e-4"], "min_lr=0.0002 must be <= --lr=0.0001"),
        (["--data", VERDICT, "--out", str(foreign)], "not a gpt2mha checkpoint"),
    ]
    for extra, needle in cases:
        args = ["train", "--out", str(tmp_path / "o"), "--preset", "tiny", "--iters", "2", *extra]
        assert main(args) == 2, extra
        assert needle in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_resume_with_dropout_is_bit_identical_to_an_uninterrupted_run(tmp_path, monkeypatch):
    """With dropout on, Ctrl-C after the step-10 checkpoint and --resume to 20
    gives exactly the weights, losses and random states of one run to 20 (every RNG the trainer
    draws from is saved: the batch sampler and torch's CPU generator that dropout uses)."""
    import gpt2mha.train.train as T

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


def _interrupt_after(monkeypatch, steps):
    """Make the trainer's next run raise KeyboardInterrupt (Ctrl-C) when it draws training batch
    ``steps + 1``."""
    import gpt2mha.train.train as T

    real, calls = T.get_batch, {"n": 0}

    def interrupt(*args, **kw):
        if args[0].numel() > 10000:                  # the train split (validation is ~2 KB)
            calls["n"] += 1
            if calls["n"] == steps + 1:
                monkeypatch.setattr(T, "get_batch", real)
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(T, "get_batch", interrupt)


def test_cli_resume_without_flags_continues_bit_for_bit_and_overrides_only_what_is_given(tmp_path, monkeypatch,
                                                                                         capsys):
    """A run made with non-default settings, Ctrl-C'd after its step-10 checkpoint and resumed with
    ``--resume`` alone keeps the checkpoint's settings: the weights, losses and random states
    equal one uninterrupted run's exactly. A flag given on resume overrides that setting alone,
    with one line saying so."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--iters", "20", "--batch-size", "4", "--eval-interval", "10", "--lr", "3e-3", "--warmup", "5",
            "--seed", "5", "--attn-pdrop", "0.1"]
    assert main(["train", "--data", VERDICT, "--out", a, *args]) == 0
    _interrupt_after(monkeypatch, 13)
    assert main(["train", "--data", VERDICT, "--out", b, *args]) == 130           # Ctrl-C
    capsys.readouterr()
    assert main(["train", "--data", VERDICT, "--out", b, "--resume"]) == 0
    assert "resume:" not in capsys.readouterr().err                               # nothing overridden
    ma, mb = GPT2.from_pretrained(a), GPT2.from_pretrained(b)
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), name
    la, lb = (json.load(open(os.path.join(d, "training_log.json"))) for d in (a, b))
    assert la["train_config"] == lb["train_config"] and la["train_config"]["batch_size"] == 4
    assert [(e["step"], e["train_loss"], e["val_loss"]) for e in la["evals"]] == \
        [(e["step"], e["train_loss"], e["val_loss"]) for e in lb["evals"]]
    sa, sb = (torch.load(os.path.join(d, "trainer_state.pt"), weights_only=True) for d in (a, b))
    assert torch.equal(sa["rng"][0]["torch"], sb["rng"][0]["torch"])

    # resumed with --iters 30 (and --batch-size equal to the checkpoint's): iters alone changes
    assert main(["train", "--data", VERDICT, "--out", b, "--resume", "--iters", "30", "--batch-size", "4"]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("resume:")]
    assert lines == ["resume: iters = 30 (overrides the checkpoint's 20)"]
    lb = json.load(open(os.path.join(b, "training_log.json")))
    assert [e["step"] for e in lb["evals"]] == [10, 20, 30]                       # eval_interval stays 10
    assert {k: lb["train_config"][k] for k in ("iters", "batch_size", "lr", "warmup")} == \
        {"iters": 30, "batch_size": 4, "lr": 3e-3, "warmup": 5}


def test_resume_refuses_what_it_cannot_change(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(tiny_args(out, 20)) == 0
    before = open(os.path.join(out, "model.safetensors"), "rb").read()
    capsys.readouterr()
    for extra, needle in [(["--seed", "9"], "--seed=9: a resumed run continues the random states"),
                          (["--n-layer", "3"], "--n-layer=3: the checkpoint's model has n_layer 2"),
                          (["--tokenizer", "gpt2"], "--tokenizer='gpt2': the checkpoint's model has tokenizer 'bytes'"),
                          (["--preset", "shakespeare"], "--preset shakespeare: n_ctx=256: the checkpoint's model has n_ctx 64"),
                          (["--init-from", out], "use one of them")]:
        assert main(["train", "--data", VERDICT, "--out", out, "--resume", *extra]) == 2, extra
        assert needle in capsys.readouterr().err
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == before
    # the Python API: a TrainConfig taken whole says what it overrides; a dict changes only its keys
    tc = TrainConfig(iters=20, batch_size=8, eval_interval=20, lr=3e-3, warmup=5, seed=1)
    train(VERDICT, out, tc=tc, resume=True, progress=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"tc: unknown setting\(s\) \['batch'\]"):
        train(VERDICT, out, tc={"batch": 4}, resume=True, progress=False)


def test_init_from_starts_a_new_run_from_the_models_weights(tmp_path, capsys):
    """``--init-from MODEL``: step 0, a fresh AdamW, MODEL's weights. After one step every weight
    moved by at most what one AdamW step allows from MODEL's (first principles: Adam's first
    update m̂/√v̂ = g/|g| has magnitude <= 1, so |Δw| <= lr·(1 + weight_decay·|w|)), while a
    new initialisation would be far from them."""
    torch.manual_seed(0)
    base = GPT2(GPT2Config.from_preset("tiny"))
    base.save_pretrained(str(tmp_path / "base"))
    out = str(tmp_path / "tuned")
    assert main(["train", "--data", VERDICT, "--out", out, "--init-from", str(tmp_path / "base"), "--iters", "1",
                 "--batch-size", "4", "--lr", "1e-3", "--warmup", "0", "--eval-interval", "1", "--seed", "2",
                 "--attn-pdrop", "0.1"]) == 0
    tuned = GPT2.from_pretrained(out)
    lr, wd = 1e-3, TrainConfig().weight_decay
    for (name, p), q in zip(base.named_parameters(), tuned.parameters()):
        bound = lr * (1 + (wd * p.abs() if p.dim() >= 2 else 0)) + 1e-7
        assert ((q - p).abs() <= bound).all(), name
    assert sum((q - p).abs().sum() for p, q in zip(base.parameters(), tuned.parameters())) > 0   # it trained
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)
    assert state["step"] == 1 and state["optimizer"]["state"][0]["step"] == 1               # fresh optimizer
    log = json.load(open(os.path.join(out, "training_log.json")))
    assert log["init_from"] == str(tmp_path / "base") and [e["step"] for e in log["evals"]] == [1]
    assert log["config"]["attn_pdrop"] == 0.1 and log["config"]["n_embd"] == 32                # dropout changed only


def test_init_from_refusals(tmp_path, capsys):
    torch.manual_seed(0)
    GPT2(GPT2Config.from_preset("tiny")).save_pretrained(str(tmp_path / "base"))
    GPT2(GPT2Config(n_vocab=1000, n_ctx=32, n_embd=16, n_head=2, n_layer=1)).save_pretrained(str(tmp_path / "v"))
    q = GPT2(GPT2Config.from_preset("tiny")).quantize("int8", method="rtn")
    q.save_pretrained(str(tmp_path / "q"))
    base = str(tmp_path / "base")
    for extra, needle in [(["--init-from", base, "--tokenizer", "gpt2"],
                           f"--tokenizer='gpt2': the model {base!r} has tokenizer 'bytes'"),
                          (["--init-from", base, "--n-embd", "64"], "--n-embd=64: the model"),
                          (["--init-from", base, "--preset", "tiny"], f"--preset tiny: the model comes from --init-from"),
                          (["--init-from", str(tmp_path / "q")], "is quantized (int8)"),
                          (["--init-from", str(tmp_path / "v")], "n_vocab=1000, fewer ids than its tokenizer 'gpt2'"),
                          (["--init-from", str(tmp_path / "missing")], "--init-from="),
                          (["--init-from", base, "--resume"], "use one of them")]:
        assert main(["train", "--data", VERDICT, "--out", str(tmp_path / "o"), "--iters", "1", *extra]) == 2, extra
        assert needle in capsys.readouterr().err, extra
    assert not os.path.exists(tmp_path / "o")


# ------------------------------------------------------------------ the shared train/val split
def test_val_split_of_a_multibyte_file_is_scored_and_matches_the_trainers(tmp_path, capsys):
    from gpt2mha.cli import read_text
    from gpt2mha.train.train import split_bytes
    path = tmp_path / "e.txt"
    path.write_text("é" * 1001, encoding="utf-8")                  # 2002 bytes: the 90% cut (1801) is mid-character
    train, val = split_bytes(path.read_bytes())
    assert train.decode("utf-8") + val.decode("utf-8") == "é" * 1001   # both halves decode, nothing lost
    assert len(train) == 1802 and read_text(str(path), "val") == "é" * 100
    assert main(["perplexity", str(path), "--split", "val", "--json"]) == 0
    assert '"bytes": 200' in capsys.readouterr().out


def test_resume_with_no_steps_left_says_there_is_nothing_to_do(tmp_path, capsys):
    """``--resume`` of a run already at --iters trains nothing and says so, without the earlier
    run's loss and seconds presented as this run's ("done: … 71 s")."""
    out = str(tmp_path / "run")
    assert main(tiny_args(out, 20)) == 0
    assert "done: step 20" in capsys.readouterr().out
    before = open(os.path.join(out, "model.safetensors"), "rb").read()
    assert main(["train", "--data", VERDICT, "--out", out, "--resume"]) == 0
    assert capsys.readouterr().out == (f"nothing to do: the checkpoint in {out} is at step 20 and --iters is 20; "
                                       f"pass a larger --iters to train on\n")
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == before
    log = train(VERDICT, out, tc={"iters": 20}, resume=True, progress=False)
    assert log["steps_run"] == 0 and [e["step"] for e in log["evals"]] == [20]


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal, so that progress bars draw on it."""

    def isatty(self):
        return True


def test_train_bar_shows_on_a_terminal_unless_quiet(tmp_path, capsys, monkeypatch):
    """The training bar is drawn on stderr when it is a terminal, not with --quiet, not in a pipe
    or log (tqdm used to write it to any stderr); the evaluations are printed either way."""
    runs = {}
    for name, flags, stderr in (("tty", [], FakeTerminal()), ("quiet", ["--quiet"], FakeTerminal()),
                                ("pipe", [], None)):
        if stderr is not None:
            monkeypatch.setattr(sys, "stderr", stderr)
        assert main(tiny_args(str(tmp_path / name), 20) + flags) == 0
        monkeypatch.undo()
        captured = capsys.readouterr()
        runs[name] = (stderr.getvalue() if stderr is not None else captured.err, captured.out)
    assert re.search(r"train:.*\b20/20\b", runs["tty"][0]), runs["tty"][0]
    assert "train:" not in runs["quiet"][0] and "train:" not in runs["pipe"][0]
    assert all("step 20: train loss" in out for _, out in runs.values())
