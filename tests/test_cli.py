"""The gpt2mha command, run as a new user would (subprocess, offline)."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from gpt2mha import GPT2, GPT2Config
from gpt2mha.cli import main

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "HTTPS_PROXY": "http://127.0.0.1:9"}


@pytest.fixture
def byte_model(tmp_path):
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=256, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes"))
    model.save_pretrained(str(tmp_path / "m"))
    return str(tmp_path / "m")


def run(*args):
    return subprocess.run([sys.executable, "-m", "gpt2mha.cli", *args], capture_output=True, text=True,
                          env=OFFLINE, timeout=300)


def test_generate_subprocess_offline_is_reproducible(byte_model):
    a = run("generate", "ROMEO:", "--model", byte_model, "--max-new-tokens", "20", "--seed", "3")
    b = run("generate", "ROMEO:", "--model", byte_model, "--max-new-tokens", "20", "--seed", "3")
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("ROMEO:") and a.stdout == b.stdout
    # the printed text is exactly the model's tokens: same ids as the Python API
    model = GPT2.from_pretrained(byte_model)
    ids = model.generate(torch.tensor([list(b"ROMEO:")]), 20, seed=3)
    assert a.stdout.rstrip("\n").encode("utf-8", "surrogateescape") != b""
    assert bytes(ids[0].tolist()).decode("utf-8", errors="replace") == a.stdout[:-1]


def test_generate_greedy_and_bad_arguments(byte_model, capsys):
    assert main(["generate", "ab", "--model", byte_model, "--max-new-tokens", "5", "--temperature", "0"]) == 0
    for bad, needle in [(["--top-p", "0"], "--top-p=0.0"), (["--top-k", "-1"], "--top-k=-1"),
                        (["--temperature", "-1"], "--temperature=-1.0"), (["--max-new-tokens", "100"], "n_ctx=64"),
                        (["--max-new-tokens", "-5"], "--max-new-tokens=-5 must be an integer >= 0")]:
        assert main(["generate", "ab", "--model", byte_model, *bad]) == 2
        assert needle in capsys.readouterr().err
    assert main(["generate", "", "--model", byte_model]) == 2
    assert "PROMPT is empty" in capsys.readouterr().err
    # a prompt too long for n_ctx is refused before any quantization (GPTQ takes seconds to minutes)
    import gpt2mha.inference.quant as qmodel
    calls = []
    real = qmodel.quantize_model
    qmodel.quantize_model = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        assert main(["generate", "a" * 60, "--model", byte_model, "--max-new-tokens", "10", "--quantize", "int8"]) == 2
        assert "prompt of 60 tokens + max_new_tokens=10 = 70 > n_ctx=64" in capsys.readouterr().err and not calls
    finally:
        qmodel.quantize_model = real
    assert main(["generate", "x", "--model", "/nonexistent/dir"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_perplexity_json_matches_direct_cross_entropy(byte_model, tmp_path, capsys):
    text = "To be, or not to be, that is the question.\n" * 3
    f = tmp_path / "t.txt"
    f.write_text(text)
    assert main(["perplexity", str(f), "--model", byte_model, "--json", "--stride", "64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"loss_per_token", "perplexity", "bits_per_byte", "tokens", "bytes"}
    # independent computation: with stride = n_ctx = 64 the windows do not overlap, so the
    # score is plain chunked cross-entropy: inputs ids[s:s+64] predict ids[s+1:s+65]
    model = GPT2.from_pretrained(byte_model)
    ids = torch.tensor(list(text.encode()))
    nats = 0.0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 64):
            inputs, targets = ids[s:s + 64], ids[s + 1:s + 65]
            logits = model(inputs[None, :len(targets)]).logits[0]
            nats += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
    assert result["tokens"] == len(ids) - 1 and result["bytes"] == len(text.encode())
    assert result["loss_per_token"] == pytest.approx(nats / (len(ids) - 1), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / (len(text.encode()) * 0.6931471805599453), rel=1e-5)


def test_perplexity_reads_the_exact_bytes_and_names_bad_files(byte_model, tmp_path, capsys):
    crlf, lf = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    crlf.write_bytes(b"hello\r\nworld\r\n" * 3)
    lf.write_bytes(b"hello\nworld\n" * 3)
    results = []
    for f in (crlf, lf):
        assert main(["perplexity", str(f), "--model", byte_model, "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["bytes"] == 42 and results[1]["bytes"] == 36
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfeabc")
    assert main(["perplexity", str(bad), "--model", byte_model]) == 2
    assert f"FILE={str(bad)!r} is not UTF-8" in capsys.readouterr().err


def test_generate_errors_do_not_echo_the_prompt_and_vocab_mismatch_is_clear(byte_model, tmp_path, capsys):
    assert main(["generate", "xyz", "--model", byte_model, "--max-new-tokens", "1000"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "n_ctx=64" in captured.err
    torch.manual_seed(0)
    GPT2(GPT2Config(n_vocab=1000, n_ctx=32, n_embd=16, n_head=2, n_layer=1)).save_pretrained(str(tmp_path / "v"))
    assert main(["generate", "hi", "--model", str(tmp_path / "v")]) == 2
    assert "n_vocab=1000, fewer ids than its tokenizer 'gpt2'" in capsys.readouterr().err


def test_perplexity_split_val_scores_the_trainers_held_out_bytes(byte_model, tmp_path, capsys):
    data = bytes(range(32, 127)) * 3
    whole, tail = tmp_path / "whole.txt", tmp_path / "tail.txt"
    whole.write_bytes(data)
    tail.write_bytes(data[len(data) * 9 // 10:])
    outs = []
    for args in ([str(whole), "--split", "val"], [str(tail)]):
        assert main(["perplexity", *args, "--model", byte_model, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0]["bytes"] == len(data) - len(data) * 9 // 10


HEAVY = ("torch", "tensorflow", "transformers", "matplotlib", "fastapi", "tiktoken", "numpy")
#: Runs ``python -m gpt2mha ARGS`` in this interpreter and prints, at exit, the heavy modules it imported.
PROBE = """
import json, runpy, sys
sys.argv = ["gpt2mha", *sys.argv[1:]]
try:
    runpy.run_module("gpt2mha", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(%r))}), file=sys.stderr)
""" % (HEAVY,)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["generate", "--help"], ["train", "--help"],
                                  ["bench", "--help"], ["serve", "--help"], ["heads", "--help"]])
def test_help_and_version_import_no_heavy_module(args):
    """The parser is built without torch, TensorFlow, transformers, matplotlib, FastAPI or
    tiktoken: they are imported only by the commands that use them (checked in sys.modules)."""
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=OFFLINE,
                         timeout=120)
    result = json.loads(out.stderr.strip().splitlines()[-1])
    assert result == {"code": 0, "heavy": []}, out.stderr
    if args == ["--version"]:                                 # the version pyproject.toml declares
        import re

        with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), encoding="utf-8") as f:
            version = re.search(r'(?m)^version = "([^"]+)"', f.read()).group(1)
        assert out.stdout == f"gpt2mha {version}\n"


def test_package_names_load_on_first_use():
    """``import gpt2mha`` loads no torch; each public name imports its module on first access."""
    code = ("import sys, gpt2mha; assert 'torch' not in sys.modules; from gpt2mha import GPT2, KVCache, PRESETS; "
            "import gpt2mha.api as m; assert GPT2 is m.GPT2 and 'tiny' in PRESETS; "
            "assert set(gpt2mha.__all__) <= set(dir(gpt2mha)); "
            "assert all(getattr(gpt2mha, n) is not None for n in gpt2mha.__all__); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=OFFLINE, timeout=120)
    assert out.stdout == "ok\n", out.stderr
    import gpt2mha

    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        gpt2mha.NotAName


def test_flag_conflicts_are_found_before_torchrun_and_said_once(capsys, monkeypatch):
    """A conflict of flags is a usage error found from the command line alone, before any
    process group (not a complaint about WORLD_SIZE), exit 2 as argparse's; under torchrun
    (RANK set) only rank 0 says it, as only rank 0 prints argparse's own errors."""
    conflict = "--quantize int8 with --tp 2: tensor parallelism shards float weights"
    assert main(["generate", "hi", "--tp", "2", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert conflict in err and "WORLD_SIZE" not in err
    assert main(["perplexity", "no-such-file.txt", "--group-size", "32"]) == 2    # before reading the file
    assert "--group-size=32 applies only to --quantize int4" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")                                   # another rank of the same launch
    assert main(["generate", "hi", "--tp", "2", "--quantize", "int8"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--no-such-flag"])
    assert e.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


#: One command line per cheap check of each command (ranges, files that must exist, empty
#: prompts, flags that do not go together) and what its error says. {missing}: no such file;
#: {file}: a text file; {dir}: a directory that does not exist yet; {full}: a non-empty one.
BAD_LINES = [
    (["generate", "hi", "--top-p", "2"], "--top-p=2.0 must be a number in (0, 1]"),
    (["generate", "hi", "--temperature", "-1"], "--temperature=-1.0 must be a finite number >= 0"),
    (["generate", "hi", "--presence-penalty", "3"], "--presence-penalty=3.0 must be a number in [-2, 2]"),
    (["generate", "hi", "--num-samples", "0"], "--num-samples=0 must be an integer in [1, 128]"),
    (["generate", ""], "PROMPT is empty"),
    (["generate", "-f", "{missing}"], "--prompt-file: FILE='{missing}': No such file or directory"),
    (["generate", "hi", "--quantize", "int4", "--group-size", "48"], "--group-size: group_size=48: int4 needs one of"),
    (["generate", "hi", "--quantize", "int8", "--calibration", "{missing}"], "--calibration: FILE='{missing}'"),
    (["generate", "hi", "--quantize", "int8", "--activations", "per_block"], "does not apply to --quantize int8"),
    (["perplexity", "{missing}"], "FILE='{missing}': No such file or directory"),
    (["perplexity", "{file}", "--stride", "0"], "--stride=0 must be >= 1"),
    (["train", "--data", "{missing}", "--out", "{dir}"], "--data '{missing}' does not exist"),
    (["train", "--data", "{file}", "--out", "{dir}", "--lr", "0"], "--lr=0.0 must be > 0"),
    (["train", "--data", "{file}", "--out", "{dir}", "--iters", "0"], "--iters=0 must be >= 1"),
    (["train", "--data", "{file}", "--out", "{file}"], "--out '{file}' is a file"),
    (["train", "--data", "{file}", "--out", "{dir}", "--resume"], "--resume: no checkpoint in '{dir}'"),
    (["train", "--data", "{file}", "--out", "{dir}", "--resume", "--init-from", "x"], "use one of them"),
    (["trace", "--tokens", "0"], "--tokens=0 must be >= 1"),
    (["heads", "", "--out", "{dir}"], "PROMPT is empty"),
    (["heads", "ab", "--top", "0", "--out", "{dir}"], "--top=0 must be >= 1"),
    (["heads", "ab", "--out", "{file}"], "--out '{file}' is a file"),
    (["ablate", "ab", "--heads", "0.1", "--top", "0"], "--top=0 must be >= 1"),
    (["ablate", "", "--heads", "0.1"], "PROMPT is empty"),
    (["ablate", "ab", "--heads", "0-1"], "--heads: head '0-1' is not layer.head"),
    (["patch", "", "ab", "--answer", "x", "--wrong", "y", "--out", "{dir}"], "CLEAN is empty"),
    (["patch", "ab", "ac", "--answer", "x", "--out", "{dir}"], "--metric logit-diff needs --wrong"),
    (["patch", "ab", "ac", "--answer", "", "--metric", "logprob", "--out", "{dir}"], "--answer '' is empty"),
    (["lens", "ab", "--columns", "0", "--out", "{dir}"], "--columns=0 must be >= 1"),
    (["lens", "", "--out", "{dir}"], "PROMPT is empty"),
    (["check", "x.py:A", "--tokens", "0"], "--tokens=0 must be >= 1\nresult: COULD NOT RUN (exit 2)"),
    (["check-model", "x", "--atol", "-1"], "--atol=-1.0 must be a finite number >= 0"),
    (["convert", "shakespeare-byte", "{full}"], "{full} is not empty; refusing to overwrite it"),
    (["convert", "shakespeare-byte", "{dir}", "--group-size", "32"], "--group-size=32 applies only to --quantize int4"),
    (["bench", "--only", "nope"], "--only: unknown section(s) ['nope']"),
    (["bench", "--text", "{missing}"], "--text='{missing}': No such file or directory"),
    (["serve", "--quantize", "int8", "--calibration", "{missing}"], "--calibration: FILE='{missing}'"),
]

#: Runs ``main`` on each command line given as JSON in argv[1] in this fresh interpreter and
#: prints, as JSON, each exit code and stderr, and whether torch was imported.
BAD_LINES_PROBE = """
import contextlib, io, json, sys
from gpt2mha.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException as e:
            code = repr(e)
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def test_every_commands_cheap_checks_come_before_torch_is_imported(tmp_path):
    """A bad range, a missing file or an empty prompt is an error (exit 2, the flag named) found
    from the command line alone: in a fresh interpreter, torch is never imported (importing it
    takes 2 s on an idle machine, up to 20 on a busy one)."""
    text, full = tmp_path / "t.txt", tmp_path / "full"
    text.write_text("some text\n")
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    paths = {"missing": str(tmp_path / "missing.txt"), "file": str(text), "dir": str(tmp_path / "new"),
             "full": str(full)}
    lines = [[arg.format(**paths) for arg in argv] for argv, _ in BAD_LINES]
    out = subprocess.run([sys.executable, "-c", BAD_LINES_PROBE, json.dumps(lines)], capture_output=True, text=True,
                         env=OFFLINE, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for (argv, needle), (code, err) in zip(BAD_LINES, got["results"]):
        assert code == 2 and needle.format(**paths) in err, (argv, code, err)
        assert err.startswith("error: ") and "Traceback" not in err, (argv, err)
    assert got["torch"] is False
    assert not os.path.exists(paths["dir"]) and (full / "keep.txt").read_text() == "mine"


COMPILE_PROBE = """
import sys
from gpt2mha.cli import main
code = main(["generate", "hi", "--compile", "--max-new-tokens", "2"])
print("torch" in sys.modules, code)
"""


def test_compile_without_a_compiler_is_one_line_before_any_work(tmp_path):
    """``--compile`` where inductor would find no C++ compiler ($CXX unset and no g++ on PATH, or
    $CXX not a program): one line naming it, exit 2, before torch is imported; a program
    answering ``--version`` (inductor's own test) passes the check."""
    from gpt2mha.cli.checks import cxx_compiler

    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in OFFLINE.items() if k != "CXX"}
    for extra in ({"PATH": str(empty)}, {"CXX": str(tmp_path / "no-such-g++")}):
        out = subprocess.run([sys.executable, "-c", COMPILE_PROBE], capture_output=True, text=True,
                             env={**env, **extra}, timeout=300)
        assert out.stdout.split() == ["False", "2"], out
        assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("error: --compile needs a C++ compiler")
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho fake 1.0\n")
    fake.chmod(0o755)
    old = os.environ.get("CXX")
    os.environ["CXX"] = str(fake)
    try:
        assert cxx_compiler() == str(fake)
        os.environ["CXX"] = str(tmp_path / "no-such-g++")
        assert cxx_compiler() is None
    finally:
        os.environ.pop("CXX") if old is None else os.environ.__setitem__("CXX", old)


def test_the_clis_copies_of_library_constants_agree():
    """The checks run without torch on copies of the library's ranges: they must stay equal."""
    from gpt2mha.cli import checks, common
    from gpt2mha.inference.quant import INT4_GROUP_SIZES
    from gpt2mha.inference.quant.linear import SCHEME_ACTIVATIONS

    assert common.INT4_GROUP_SIZES == INT4_GROUP_SIZES and common.SCHEME_ACTIVATIONS == SCHEME_ACTIVATIONS
    assert not hasattr(checks, "MAX_PENALTY")           # the sampling ranges: SamplingParams, torch-free


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal, so that progress bars draw on it."""

    def isatty(self):
        return True


@pytest.mark.parametrize("quiet", [False, True])
def test_long_commands_show_a_progress_bar_on_a_terminal_unless_quiet(byte_model, tmp_path, capsys, monkeypatch,
                                                                     quiet):
    """perplexity (its windows), quantizing (each tensor, for generate and convert) draw a tqdm
    bar on stderr when it is a terminal; --quiet and a stderr that is not a terminal get none."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4)
    runs = [(["perplexity", str(text), "--model", byte_model, "--stride", "16"], "perplexity:"),
            (["generate", "ab", "--model", byte_model, "--max-new-tokens", "2", "--quantize", "int8",
              "--quantize-method", "rtn"], "quantize int8 (rtn):"),
            (["convert", byte_model, str(tmp_path / "q"), "--quantize", "int4", "--quantize-method", "rtn"],
             "quantize int4 (rtn):")]
    for argv, bar in runs:
        terminal = FakeTerminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main([*argv, *(["--quiet"] if quiet else [])]) == 0
        monkeypatch.undo()
        assert (bar in terminal.getvalue()) != quiet, (argv, terminal.getvalue())
        assert main([*argv, "--overwrite"] if argv[0] == "convert" else argv) == 0
        assert bar not in capsys.readouterr().err                            # not a terminal: no bar


# ---------------------------------------------------------------------- messages for odd input
def test_cli_tiny_temperature_is_greedy(capsys):
    assert main(["generate", "ab", "--max-new-tokens", "5", "--temperature", "1e-45"]) == 0
    tiny = capsys.readouterr().out
    assert main(["generate", "ab", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert tiny == capsys.readouterr().out


def test_non_utf8_files_get_a_hint(tmp_path):
    from gpt2mha.cli import read_text
    from gpt2mha.train.train import TrainConfig, train
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait, ".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3: b'\\xe9'\); re-encode it first, e.g. iconv"):
        read_text(str(path))
    with pytest.raises(ValueError, match=r"--data .* is not UTF-8 text \(byte 3.*iconv"):
        train(str(path), str(tmp_path / "run"), GPT2Config.from_preset("tiny", n_ctx=8), TrainConfig(iters=1))


def test_cli_absurd_values_are_errors_not_tracebacks(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["heads", "ab", "--out", str(afile)]) == 2
    assert "is a file; expected a directory" in capsys.readouterr().err and afile.read_text() == "mine"
    assert main(["trace", "--batch", str(10**20)]) == 2
    assert "--batch=100000000000000000000 is too large for a trace" in capsys.readouterr().err
    assert main(["check", "gpt2mha.learn.book:MultiHeadAttention", "--seed", str(10**20)]) == 2
    assert "--seed=100000000000000000000 must be an integer in [0, 2**63)" in capsys.readouterr().err


def test_generate_with_nan_logits_says_so_in_one_line(byte_model, capsys, monkeypatch):
    """A model whose position 8 embedding went NaN (loading refuses such a file, so it is made in
    memory: fp16 overflow does the same): `generate` prints the text up to the step before, then
    one line naming the step (not a traceback), exit code 1."""
    import gpt2mha.cli.generation as generation

    model = GPT2.from_pretrained(byte_model)
    with torch.no_grad():
        model.wpe.weight[8, 1] = float("nan")
    monkeypatch.setattr(generation, "load_model", lambda name, dtype="float32": model)
    assert main(["generate", "ab", "--model", byte_model, "--max-new-tokens", "20", "--temperature", "0"]) == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == ("error: the model produced NaN or infinite logits at step 7 "
                                            "(rows [0]); its weights or inputs hold NaN/inf, or its activations overflow")
    assert out.startswith("ab") and len(out.encode("utf-8", "surrogateescape")) < 2 + 20


@pytest.mark.parametrize("argv, on", [
    (["ablate", "To be", "--heads", "0.1"], "PROMPT"),
    (["lens", "To be", "--out", "{dir}"], "PROMPT"),
    (["patch", "To be", "To go", "--answer", "a", "--wrong", "b", "--out", "{dir}"], "CLEAN"),
    (["heads", "To be", "--out", "{dir}"], "PROMPT"),
    (["perplexity", "{text}"], "the window of tokens 0..12"),
])
def test_every_command_that_runs_a_nonfinite_model_says_so(argv, on, tmp_path, capsys, monkeypatch, one_thread):
    """The built-in model with c_attn scaled by 1e30 (every attention score NaN, the weights finite):
    each command that runs it ends in generate's one error line (the same check), exit 1, and
    prints no number; each printed a plausible table or `nan` while the SDPA core gave finite
    logits for NaN scores."""
    import gpt2mha.cli.generation as generation
    import gpt2mha.cli.interventions as interventions
    import gpt2mha.cli.tools as tools
    from conftest import overflowing_builtin

    model = overflowing_builtin()
    for module in (generation, interventions, tools):
        monkeypatch.setattr(module, "load_model", lambda name, dtype="float32": model)
    (tmp_path / "t.txt").write_text("To be, or not")
    argv = [a.format(dir=tmp_path / "out", text=tmp_path / "t.txt") for a in argv]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines()[-1].startswith("error: the model produced NaN or infinite ")
    assert f" on {on}; its weights or inputs hold NaN/inf, or its activations overflow" in err


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(_thp_mode() != "madvise", reason="2 MiB pages are asked for with madvise: the kernel's "
                    "transparent huge pages must be in 'madvise' mode for the two cases to differ")
@pytest.mark.parametrize("env,huge", [(None, True), ("0", False)])
def test_the_command_asks_torch_for_2mib_pages_unless_told_not_to(byte_model, env, huge):
    """``gpt2mha`` sets THP_MEM_ALLOC_ENABLE=1 before torch is imported (unless the environment
    sets it): torch then madvises its allocations of 2 MiB and more to huge pages, so a 64 MiB
    tensor written in that process adds AnonHugePages (/proc/self/smaps_rollup); with ``=0``
    none."""
    code = ("import sys\nfrom gpt2mha.cli import main\nassert main(['info', '--model', sys.argv[1]]) == 0\n"
            "import torch\n"
            "def huge():\n"
            "    return int([l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0].split()[1])\n"
            "before = huge(); x = torch.ones(16 << 20); print('HUGE_KB', huge() - before)")
    e = {k: v for k, v in OFFLINE.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env is not None:
        e["THP_MEM_ALLOC_ENABLE"] = env
    r = subprocess.run([sys.executable, "-c", code, byte_model], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr
    kb = int(r.stdout.split("HUGE_KB", 1)[1])
    assert kb >= 2048 if huge else kb == 0
