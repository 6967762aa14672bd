"""Generation as OpenAI's sampler offers it: --unconditional, several
prompts and --num-samples as labelled samples, a decode that drops left padding, and --dtype
on perplexity and heads."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from gpt2mha import GPT2, GPT2Config
from gpt2mha.cli import main
from gpt2mha.inference.generate import left_pad
from gpt2mha.inference.generate import decode_rows
from gpt2mha.io.tokenizer import ByteTokenizer, GPT2Tokenizer

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}
LABEL = re.compile(r"^={20} (.*) ={20}$", re.M)


def samples(text):
    """{label: sample text} from generate's labelled output."""
    parts = LABEL.split(text)
    return {parts[i]: parts[i + 1].removeprefix("\n").removesuffix("\n") for i in range(1, len(parts), 2)}


@pytest.fixture
def byte_model(tmp_path):
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=256, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes"))
    model.save_pretrained(str(tmp_path / "bytes"))
    return str(tmp_path / "bytes")


@pytest.fixture
def bpe_model(tmp_path):
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1, tokenizer="gpt2"))
    model.save_pretrained(str(tmp_path / "bpe"))
    return str(tmp_path / "bpe")


def test_unconditional_starts_from_endoftext(bpe_model, capsys, one_thread):
    """As OpenAI's sample_sequence(start_token=enc.encoder['<|endoftext|>']): each sample is
    what the model generates after id 50256 alone, printed without it, labelled."""
    assert main(["generate", "--unconditional", "--num-samples", "3", "--model", bpe_model, "--max-new-tokens", "6",
                 "--seed", "5"]) == 0
    got = samples(capsys.readouterr().out)
    model = GPT2.from_pretrained(bpe_model)
    out = model.generate(torch.full((3, 1), 50256), 6, seed=5)
    tok = GPT2Tokenizer()
    assert got == {f"sample {i + 1} of 3": tok.decode(out[i, 1:].tolist()) for i in range(3)}


def test_unconditional_errors(byte_model, bpe_model, capsys):
    assert main(["generate", "--unconditional", "--model", byte_model]) == 2
    assert "--unconditional starts from <|endoftext|>, which the 'bytes' tokenizer" in capsys.readouterr().err
    assert main(["generate", "hi", "--unconditional", "--model", bpe_model]) == 2
    assert "drop the PROMPT ('hi')" in capsys.readouterr().err
    assert main(["generate", "--model", bpe_model]) == 2
    assert "give a PROMPT" in capsys.readouterr().err
    assert main(["generate", "hi", "--num-samples", "0", "--model", bpe_model]) == 2
    assert "--num-samples=0 must be an integer in [1, 128]" in capsys.readouterr().err


def test_several_prompts_and_samples_are_labelled_and_unpadded(byte_model, capsys, one_thread):
    """Prompts of different lengths in one batch: each labelled sample equals that prompt
    generated alone (greedy), with no NUL bytes from the left padding."""
    prompts = ["a", "hello, world"]
    assert main(["generate", *prompts, "--num-samples", "2", "--model", byte_model, "--max-new-tokens", "7",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert "\x00" not in text
    got = samples(text)
    model = GPT2.from_pretrained(byte_model)
    expect = {}
    for j, p in enumerate(prompts):
        alone = bytes(model.generate(torch.tensor([list(p.encode())]), 7, temperature=0)[0].tolist())
        for s in range(2):
            expect[f"prompt {j + 1} of 2, sample {s + 1} of 2"] = alone.decode("utf-8", errors="replace")
    assert got == expect


def test_decode_rows_drops_left_padding():
    tok = ByteTokenizer()
    rows = [list(b"hi"), list(b"hello"), list(b"x")]
    idx, mask = left_pad(rows)                                  # pad id 0: a NUL byte when decoded
    out = torch.cat([idx, torch.tensor([[33], [63], [46]])], dim=1)   # one generated token per row
    assert decode_rows(tok, out, mask) == ["hi!", "hello?", "x."]
    assert tok.decode(out[0].tolist()).startswith("\x00")     # what a plain decode gives
    assert decode_rows(tok, idx) == [tok.decode(r) for r in idx.tolist()]
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\); expected \[B=3, T_mask <= 6\]"):
        decode_rows(tok, out, mask[:2])


def numbers(obj):
    """Every number in a JSON value, in order (the role scores, whatever their nesting)."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj) for x in numbers(obj[k])]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers(v)]
    return [float(obj)] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


def test_dtype_on_perplexity_and_heads(byte_model, tmp_path, capsys, one_thread):
    """--dtype reaches the model: bfloat16 results differ from float32 (the flag took effect)
    and stay close (the same weights, rounded)."""
    f = tmp_path / "t.txt"
    f.write_text("To be, or not to be, that is the question. " * 3)
    res = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["perplexity", str(f), "--model", byte_model, "--json", "--dtype", dtype]) == 0
        res[dtype] = json.loads(capsys.readouterr().out)["loss_per_token"]
    assert res["float32"] != res["bfloat16"] and res["bfloat16"] == pytest.approx(res["float32"], rel=0.01)
    scores = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["heads", "to be or not to be", "--model", byte_model, "--json", "--dtype", dtype,
                     "--out", str(tmp_path / dtype)]) == 0
        scores[dtype] = torch.tensor(numbers(json.loads(capsys.readouterr().out)["scores"]))
    assert not torch.equal(scores["float32"], scores["bfloat16"])
    torch.testing.assert_close(scores["bfloat16"], scores["float32"], atol=0.02, rtol=0)


def test_stop_at_eos_ends_each_labelled_sample_at_its_first_endoftext(tmp_path, capsys, one_thread):
    """A model built to always predict <|endoftext|> (ln_f's output is the constant v, and
    wte[50256] is the only row along v): with --stop-at-eos each sample shows it once; without,
    every new token is it."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1, tokenizer="gpt2"))
    with torch.no_grad():
        v = torch.randn(16)
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(v)
        model.wte.weight.mul_(0.01)
        model.wte.weight[50256] = 10 * v / v.norm()
    model.save_pretrained(str(tmp_path / "eos"))
    eot = "<|endoftext|>"
    for flags, n in ((["--stop-at-eos"], 1), ([], 4)):
        assert main(["generate", "hello", "a b", "--model", str(tmp_path / "eos"), "--max-new-tokens", "4",
                     "--temperature", "0", *flags]) == 0
        got = samples(capsys.readouterr().out)
        assert got == {"prompt 1 of 2, sample 1 of 1": "hello" + eot * n, "prompt 2 of 2, sample 1 of 1": "a b" + eot * n}


def test_prompt_file_and_stdin_give_the_prompt_arguments_output(byte_model, tmp_path, capsys, one_thread):
    """--prompt-file FILE (and '-' for standard input) is the PROMPT argument with the file's exact
    text: the same output for the same seed; --min-p reaches the sampler (the Python API's
    min_p gives the same text)."""
    text = "ROMEO:\nWhat, ho!\n"
    f = tmp_path / "prompt.txt"
    f.write_bytes(text.encode())
    args = ["--model", byte_model, "--max-new-tokens", "12", "--seed", "4", "--min-p", "0.5"]
    assert main(["generate", text, *args]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", "--prompt-file", str(f), *args]) == 0
    assert capsys.readouterr().out == expected
    model = GPT2.from_pretrained(byte_model)
    prompt = torch.tensor([list(text.encode())])
    ids = model.generate(prompt, 12, seed=4, min_p=0.5)
    assert expected == bytes(ids[0].tolist()).decode("utf-8", errors="replace") + "\n"
    assert not torch.equal(ids, model.generate(prompt, 12, seed=4))              # min_p changed the draw
    piped = subprocess.run([sys.executable, "-m", "gpt2mha", "generate", "-f", "-", *args], input=text.encode(),
                           capture_output=True, env=OFFLINE, timeout=300)
    assert piped.returncode == 0 and piped.stdout.decode() == expected, piped.stderr
    empty, latin = tmp_path / "empty.txt", tmp_path / "latin.txt"
    empty.write_text("")
    latin.write_bytes(b"caf\xe9")
    for extra, needle in [(["--prompt-file", str(empty)], f"--prompt-file {empty} is empty"),
                          (["--prompt-file", str(latin)], f"--prompt-file: FILE={str(latin)!r} is not UTF-8"),
                          (["--prompt-file", str(tmp_path / "no")], "No such file"),
                          (["x", "--prompt-file", str(f)], "drop the PROMPT ('x') or the flag"),
                          (["x", "--min-p", "1.5"], "--min-p=1.5 must be a number in [0, 1]")]:
        assert main(["generate", *extra, "--model", byte_model]) == 2, extra
        assert needle in capsys.readouterr().err


def test_penalty_and_logit_bias_flags_reach_generate_and_bad_values_are_named(byte_model, capsys, one_thread):
    """--presence-penalty/--frequency-penalty/--logit-bias print what the API's generate gives
    with the same arguments (reference: generate itself); bad values are errors naming the flag."""
    flags = ["--max-new-tokens", "12", "--temperature", "0.8", "--seed", "5", "--model", byte_model]
    adjust = ["--presence-penalty", "0.7", "--frequency-penalty", "-0.4", "--logit-bias", '{"97": 5, "98": -100}']
    assert main(["generate", "ab", *flags, *adjust]) == 0
    model = GPT2.from_pretrained(byte_model)
    ids = model.generate(torch.tensor([[97, 98]]), 12, temperature=0.8, seed=5, presence_penalty=0.7,
                         frequency_penalty=-0.4, logit_bias={"97": 5, "98": -100}, vocab_size=256)[0].tolist()
    assert capsys.readouterr().out == bytes(ids).decode("utf-8", errors="replace") + "\n"
    assert 98 not in ids[2:]
    for bad, match in [(["--presence-penalty", "2.5"], r"--presence-penalty=2.5 must be a number in \[-2, 2\]"),
                       (["--frequency-penalty", "-9"], r"--frequency-penalty=-9.0 must be"),
                       (["--logit-bias", "{1: 2}"], "--logit-bias '{1: 2}' is not JSON"),
                       (["--logit-bias", "[1]"], "--logit-bias '\\[1\\]' must be a JSON object"),
                       (["--logit-bias", '{"256": 1}'], r"--logit-bias: logit_bias key 256 is not a token id of this model's "
                                                        r"tokenizer \(ids 0 … 255\)")]:
        assert main(["generate", "ab", *flags, *bad]) != 0
        assert re.search(match, capsys.readouterr().err), bad
