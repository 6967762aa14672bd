"""Every flag of ``gpt2mha generate`` goes with every other: one scheduler runs them all
(``gpt2mha.inference.generate.generate_sequences``), so no pair is refused for running
elsewhere. The flags are read from the parser itself; every pair of their settings is run at
least once on the built-in model (a covering set of runs, built greedily: each run holds many
pairs), and each run must exit 0, print every choice it ran, and agree with the same run
without the flags that only cut or annotate the text (stop strings, the sliding window inside
the context, log-probabilities): each sequence's tokens are a prefix of that run's.

The only pairs refused are contradictions, listed in :data:`CONTRADICTIONS`; flags needing
``<|endoftext|>`` run on a tiny BPE model (the built-in model is byte-level)."""

import contextlib
import io
import itertools
import json

import pytest
import torch

from gpt2mha import GPT2, GPT2Config

#: Flags that are not settings to combine, and why.
NOT_COMBINED = {
    "help": "prints the help",
    "prompt": "the text every run continues (--unconditional runs without it)",
    "prompt_file": "another way to give PROMPT (tests/test_sampling_cli.py)",
    "model": "the model each run takes (the built-in one, or a BPE one for <|endoftext|>)",
    "max_new_tokens": "every run generates 4 tokens",
    "seed": "every run is seeded, so that a run and its consistency rerun sample the same tokens",
    "tp": "needs torchrun's ranks (tests/test_parallel.py runs these flags with --tp 2)",
    "compile": "compiles for 10-60 s (tests/test_compiled.py)",
    "calibration": "GPTQ's text: GPTQ takes seconds to minutes (tests/test_quantize.py)",
    "quiet": "quantization's progress bar only",
}
#: The quantization flags, combined as one setting each (they depend on --quantize; GPTQ is
#: replaced by rounding to nearest, for time).
QUANTIZE = [["--quantize", "int8", "--quantize-method", "rtn"],
            ["--quantize", "int8", "--quantize-method", "rtn", "--activations", "per_row"],
            ["--quantize", "int4", "--quantize-method", "rtn", "--group-size", "32", "--quantize-head", "int4"],
            ["--quantize", "int4", "--quantize-method", "rtn", "--activations", "per_block"],
            ["--quantize", "int8", "--quantize-method", "rtn", "--activations", "auto"],
            ["--quantize", "int4", "--quantize-method", "rtn", "--activations", "exact"]]
QUANTIZE_DESTS = {"quantize", "quantize_method", "activations", "group_size", "quantize_head"}
#: A value for each flag that takes one (a new flag must be given one here).
VALUES = {
    "num_samples": [["--num-samples", "2"]], "temperature": [["--temperature", "0"], ["--temperature", "0.8"]],
    "top_k": [["--top-k", "5"]], "top_p": [["--top-p", "0.9"]], "min_p": [["--min-p", "0.1"]],
    "presence_penalty": [["--presence-penalty", "0.5"]], "frequency_penalty": [["--frequency-penalty", "0.5"]],
    "logit_bias": [["--logit-bias", '{"101": -100}']], "repetition_penalty": [["--repetition-penalty", "1.3"]],
    "no_repeat_ngram_size": [["--no-repeat-ngram-size", "2"]], "min_tokens": [["--min-tokens", "2"]],
    "stop_token_ids": [["--stop-token-ids", "10,32"]], "stop": [["--stop", "e"]], "logprobs": [["--logprobs", "2"]],
    "best_of": [["--best-of", "3"]], "json_schema": [["--json-schema", "schema"]], "regex": [["--regex", "[a-z]+"]],
    "choice": [["--choice", "yes,no"]], "grammar": [["--grammar", "grammar"]],
}
#: The pairs that contradict each other (the only refusals): one constraint on the text at a
#: time; <|endoftext|> both ordinary and the end.
STRUCTURED = {"json_schema", "json_object", "regex", "choice", "grammar"}
CONTRADICTIONS = {frozenset(p) for p in itertools.combinations(sorted(STRUCTURED), 2)} | \
    {frozenset({"ignore_eos", "stop_at_eos"})}
#: Flags that need <|endoftext|>: their runs take the BPE model.
NEEDS_EOT = {"unconditional", "stop_at_eos"}
#: Flags that cut or annotate the text without changing a sampled token: a run's tokens are a
#: prefix of the same run's without them. (--stop-token-ids and --stop-at-eos too, unless
#: --min-tokens bans their ids for a while.)
TEXT_ONLY = {"stop", "include_stop_str_in_output", "sliding_window", "echo", "logprobs"}
ENDING = {"stop_token_ids", "stop_at_eos"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
GRAMMAR = 'start: "yes" | "no" | "maybe"\n'


def generate_parser():
    from gpt2mha.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["generate"]


def settings(files: dict) -> dict[str, list[list[str]]]:
    """Each combined flag's settings (lists of arguments), read from ``generate``'s parser: a
    switch is itself, ``--x/--no-x`` both, a choice each of its values, a valued flag its
    :data:`VALUES` (the quantization flags: :data:`QUANTIZE`)."""
    out, missing = {}, []
    for action in generate_parser()._actions:
        dest, flags = action.dest, action.option_strings
        if dest in NOT_COMBINED or dest in QUANTIZE_DESTS:
            continue
        if type(action).__name__ == "BooleanOptionalAction":
            out[dest] = [[f] for f in flags]
        elif action.nargs == 0:
            out[dest] = [[flags[0]]]
        elif action.choices:
            out[dest] = [[flags[0], c] for c in action.choices]
        elif dest in VALUES:
            out[dest] = [[files.get(a, a) for a in args] for args in VALUES[dest]]
        else:
            missing.append(flags[0])
    assert not missing, f"give {missing} a value in VALUES (or a reason in NOT_COMBINED)"
    out["quantize"] = QUANTIZE
    return out


def allowed(levels: dict) -> bool:
    return not any(frozenset(p) in CONTRADICTIONS for p in itertools.combinations(levels, 2))


def covering_runs(factors: dict) -> list[dict]:
    """Runs (``{dest: setting index}``) such that every allowed pair of two flags' settings is
    in at least one: greedily, each run started from an uncovered pair and filled with the
    setting that covers the most uncovered pairs with those already in it. The pairs without a
    flag of :data:`NEEDS_EOT` are covered first, by runs without one (on the built-in model)."""
    names = sorted(factors)
    todo = {((a, i), (b, j)) for a, b in itertools.combinations(names, 2) if allowed({a: 0, b: 0})
            for i in range(len(factors[a])) for j in range(len(factors[b]))}
    runs = []
    for usable in ([n for n in names if n not in NEEDS_EOT], names):
        while any(a in usable and b in usable for (a, _), (b, _) in todo):
            (a, i), (b, j) = min(p for p in todo if p[0][0] in usable and p[1][0] in usable)
            run = {a: i, b: j}
            for name in usable:
                if name in run:
                    continue
                gains = [(sum(tuple(sorted([(name, k), (o, run[o])])) in todo for o in run), -k)
                         for k in range(len(factors[name])) if allowed({**run, name: k})]
                best = max(gains, default=(0, 0))
                if best[0] > 0:
                    run[name] = -best[1]
            todo -= {tuple(sorted(p)) for p in itertools.combinations(run.items(), 2)}
            runs.append(run)
    return runs


def run_cli(argv: list[str], monkeypatch) -> tuple[int, str, str, list]:
    """``gpt2mha generate ARGV`` in this process: exit code, stdout, stderr and the sequences
    the scheduler ran (every candidate, in order)."""
    import gpt2mha.inference.generate as G
    from gpt2mha.cli import main

    ran, real = [], getattr(G.generate_sequences, "real", G.generate_sequences)

    def record(*args, **kwargs):
        ran.extend(real(*args, **kwargs))
        return ran
    record.real = real
    monkeypatch.setattr(G, "generate_sequences", record)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["generate", *argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue(), ran


def argv_of(run: dict, factors: dict, model: list[str]) -> list[str]:
    args = ["--max-new-tokens", "4", "--seed", "3", *model]
    args += [] if "unconditional" in run else ["ROMEO:"]
    for name in sorted(run):
        args += factors[name][run[name]]
    return args


def test_every_pair_of_generate_flags_runs_and_agrees_with_the_run_without_its_text_flags(tmp_path, monkeypatch,
                                                                                        one_thread):
    from gpt2mha.inference.sequence import pick_choices

    torch.manual_seed(0)
    bpe = str(tmp_path / "bpe")
    GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=32, n_head=2, n_layer=1, tokenizer="gpt2")).save_pretrained(bpe)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "yes.lark").write_text(GRAMMAR)
    factors = settings({"schema": str(tmp_path / "schema.json"), "grammar": str(tmp_path / "yes.lark")})
    assert {"stop", "sliding_window", "unconditional", "logprobs", "best_of", "regex"} <= set(factors)
    runs = covering_runs(factors)
    assert len(runs) < 80, len(runs)
    for run in runs:
        model = ["--model", bpe] if NEEDS_EOT & set(run) else []
        argv = argv_of(run, factors, model)
        code, out, err, seqs = run_cli(argv, monkeypatch)
        assert code == 0, (argv, err)
        n = 2 if "num_samples" in run else 1
        assert len(seqs) == (3 if "best_of" in run else n), argv
        assert all(s.finish_reason in ("stop", "length") and 0 < len(s.tokens) <= 4 for s in seqs), argv
        assert all(s.text in out for _, s in pick_choices(seqs)), (argv, out)
        assert out.count("-- log-probabilities") == (n if "logprobs" in run else 0), (argv, out)
        drop = TEXT_ONLY | (ENDING if "min_tokens" not in run else set())
        plain = {k: v for k, v in run.items() if k not in drop}
        if plain == run:
            continue
        code, _, err, again = run_cli(argv_of(plain, factors, model), monkeypatch)
        assert code == 0, err
        for s, t in zip(seqs, again):
            assert s.tokens == t.tokens[:len(s.tokens)], (argv, s.tokens, t.tokens)


def test_the_covering_runs_cover_every_allowed_pair_and_no_contradiction():
    """The covering set itself (reference: every pair enumerated): each allowed pair of settings
    is in a run, no run holds a contradiction, and every contradiction is a pair of the parser's
    flags (a renamed flag cannot leave a stale entry)."""
    factors = settings({"schema": "s.json", "grammar": "g.lark"})
    runs = covering_runs(factors)
    held = {tuple(sorted(p)) for run in runs for p in itertools.combinations(run.items(), 2)}
    for a, b in itertools.combinations(sorted(factors), 2):
        for i, j in itertools.product(range(len(factors[a])), range(len(factors[b]))):
            assert (((a, i), (b, j)) in held) == allowed({a: i, b: j}), (a, i, b, j)
    dests = {a.dest for a in generate_parser()._actions}
    assert set().union(*CONTRADICTIONS) | NEEDS_EOT | TEXT_ONLY | ENDING <= dests
    assert set(NOT_COMBINED) | QUANTIZE_DESTS | set(VALUES) <= dests | {"help"}


@pytest.mark.parametrize("flags", [["--stop", "X", "--sliding-window"], ["--logprobs", "2", "--unconditional"],
                                   ["--best-of", "2", "--stop-token-ids", "5", "--sliding-window"],
                                   ["--regex", "[a-z ]+", "--sliding-window", "--num-samples", "2"]])
def test_the_former_refusals_run(flags, tmp_path, monkeypatch, one_thread):
    """The pairs gpt2mha generate refused while two loops ran them (the scheduler's flags with
    --sliding-window or --unconditional) exit 0, past the context too (the built-in model's
    n_ctx is 256), and --stop's text is the prefix of the text without it."""
    torch.manual_seed(0)
    bpe = str(tmp_path / "bpe")
    GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=32, n_head=2, n_layer=1, tokenizer="gpt2")).save_pretrained(bpe)
    model = ["--model", bpe] if "--unconditional" in flags else ["ROMEO:"]
    base = [*model, "--seed", "1", "--temperature", "0", "--max-new-tokens", "20" if model[0] == "--model" else "270"]
    code, out, err, seqs = run_cli(base + flags, monkeypatch)
    assert code == 0, err
    if "--stop" in flags:
        code, full, err, _ = run_cli(base + ["--sliding-window"], monkeypatch)
        assert code == 0 and full.startswith(out[:-1]) and "X" not in out[:-1], (out, full)
    if "--regex" in flags:
        assert all(len(s.tokens) == 270 and set(s.text) <= set("abcdefghijklmnopqrstuvwxyz ") for s in seqs)
