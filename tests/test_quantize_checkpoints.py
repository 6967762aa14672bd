"""Quantized checkpoints and the command line: save and load with identical logits, format 1
still read, every corrupted, overflowing, mismatched or mistyped entry refused by name, float-only
consumers stopped; the CLI's quantize flags (generate, convert --quantize, --calibration,
--activations), their errors naming the flag, and a model saved quantized used as saved.

References: the model before saving (logits bitwise equal), the format-2 file of the same model,
first principles for the scales that overflow, and the library API given the same arguments for
what the CLI writes and prints."""

import json
import os

import pytest
import torch

from gpt2mha import GPT2
from gpt2mha.inference.quant import QuantizationError, QuantizedHead, QuantizedLinear
from quantize_helpers import float_model, quantized

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_save_load_round_trip_gives_identical_logits(tmp_path, scheme):
    model = quantized(scheme, seed=7, group_size=32 if scheme == "int4" else None)
    model.save_pretrained(str(tmp_path))
    loaded = GPT2.from_pretrained(str(tmp_path))
    idx = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, model(idx).logits)
    assert loaded.quantization == model.quantization and not loaded.training
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["gpt2mha"]["quantization"]["scheme"] == scheme and cfg["quantization_config"]["quant_method"] == "gpt2mha"
    float_size = 4 * sum(p.numel() for p in float_model().parameters())
    assert os.path.getsize(tmp_path / "model.safetensors") < (0.35 if scheme == "int8" else 0.25) * float_size


def _rewrite(path, **changes):
    from safetensors.torch import load_file, save_file

    sd = load_file(path)
    for k, fn in changes.items():
        sd[k] = fn(sd[k])
    save_file(sd, path)


@pytest.mark.parametrize("scheme,key", [("int8", "transformer.h.0.mlp.c_fc.scales"),
                                        ("int4", "transformer.h.1.attn.c_attn.scale_zero")])
def test_corrupted_scales_are_a_named_error(tmp_path, scheme, key):
    quantized(scheme, seed=8).save_pretrained(str(tmp_path))

    def corrupt(t):
        t = t.clone()
        t.view(-1)[3] = float("nan") if scheme == "int8" else 0.0
        if scheme == "int4":
            t[..., 0].view(-1)[5] = -1.0
        return t
    _rewrite(str(tmp_path / "model.safetensors"), **{key: corrupt})
    with pytest.raises(QuantizationError, match=key.removeprefix("transformer.").replace(".", r"\.") + ": corrupted scale"):
        GPT2.from_pretrained(str(tmp_path))


def test_mismatched_group_size_and_missing_tensors_are_named_errors(tmp_path):
    quantized("int4", seed=9, group_size=32).save_pretrained(str(tmp_path))
    cfg_path = tmp_path / "config.json"
    cfg = json.load(open(cfg_path))
    cfg["gpt2mha"]["quantization"]["group_size"] = 64
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(QuantizationError, match="group size 32, but config.json says group_size=64"):
        GPT2.from_pretrained(str(tmp_path))
    cfg["gpt2mha"]["quantization"]["group_size"] = 48
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(QuantizationError, match="group_size=48"):
        GPT2.from_pretrained(str(tmp_path))
    cfg["gpt2mha"]["quantization"]["group_size"] = 32
    json.dump(cfg, open(cfg_path, "w"))
    _rewrite(str(tmp_path / "model.safetensors"), **{"transformer.h.0.attn.c_proj.weight": lambda t: t.to(torch.int32)})
    with pytest.raises(QuantizationError, match=r"h\.0\.attn\.c_proj\.weight: dtype torch\.int32, expected torch\.uint8"):
        GPT2.from_pretrained(str(tmp_path))


def test_float_only_consumers_meet_a_clear_error(tmp_path):
    """The trainer resumes with load_pretrained(...).train(): a quantized directory stops there."""
    quantized("int8", seed=10).save_pretrained(str(tmp_path))
    loaded = GPT2.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"quantized \(int8\).*train the float model"):
        loaded.train()


@pytest.mark.parametrize("tied", [True, False])
def test_a_format_1_checkpoint_with_the_head_as_quantized_head_loads_bitwise(tmp_path, tied):
    """Quantized checkpoints are written in format 2 (the int8 head stored as ``lm_head.*``, the
    module's path); format 1 stored the same tensors as ``quantized_head.*`` and is still read,
    to the same model. Reference: the format-2 file of the same model (logits bitwise equal)."""
    from safetensors.torch import load_file, save_file

    new, old = str(tmp_path / "format2"), str(tmp_path / "format1")
    quantized("int4", seed=33, group_size=32, tie_word_embeddings=tied).save_pretrained(new)
    cfg = json.load(open(os.path.join(new, "config.json")))
    sd = load_file(os.path.join(new, "model.safetensors"))
    assert cfg["gpt2mha"]["quantization"]["format"] == 2
    assert {"transformer.lm_head.weight", "transformer.lm_head.scales"} <= sd.keys()
    assert not any("quantized_head" in k for k in sd)
    os.makedirs(old)
    cfg["gpt2mha"]["quantization"]["format"] = 1
    cfg["quantization_config"]["format"] = 1
    json.dump(cfg, open(os.path.join(old, "config.json"), "w"))
    save_file({k.replace("transformer.lm_head.", "transformer.quantized_head."): v for k, v in sd.items()},
              os.path.join(old, "model.safetensors"), metadata={"format": "pt"})
    a, b = GPT2.from_pretrained(new), GPT2.from_pretrained(old)
    assert isinstance(b.lm_head, QuantizedHead) and a.quantization == b.quantization
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(33))
    with torch.no_grad():
        assert torch.equal(a(idx).logits, b(idx).logits)
    assert torch.equal(a.generate(idx, 8, temperature=0), b.generate(idx, 8, temperature=0))


def test_checkpoint_with_an_unknown_method_is_refused(tmp_path):
    quantized("int8", seed=29).save_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["gpt2mha"]["quantization"]["method"] = "bogus"
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(QuantizationError, match="quantization method 'bogus' is unknown"):
        GPT2.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"no int4 group size .* use int8 \(group_size was not given: 32 is int4's default\)"):
        float_model(n_embd=48, n_head=4).quantize("int4", method="rtn")


# ------------------------------------------------------------------ what a checkpoint may hold
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_scales_that_would_overflow_the_models_products_are_refused_by_name(tmp_path, scheme):
    """Scales multiplied by 1e30 are finite and positive, but would give NaN logits (q·kᵀ, or
    LayerNorm's squared deviations, overflow). Every scale tensor so corrupted is refused,
    naming it; scales multiplied by 1e10 still give finite logits, so they load (the
    limit is what overflows, from first principles, not a guess at "normal" scales)."""
    from safetensors.torch import load_file

    good = str(tmp_path / "good")
    quantized(scheme, seed=30).save_pretrained(good)
    keys = [k for k in load_file(os.path.join(good, "model.safetensors")) if k.endswith(("scales", "scale_zero"))]
    assert len(keys) == 2 * 4 + 1                                  # every block layer and the head
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    for i, key in enumerate(keys):
        for factor in (1e30, 1e10):
            d = str(tmp_path / f"{i}-{factor:g}")
            os.makedirs(d)
            for name in ("config.json", "model.safetensors"):
                with open(os.path.join(good, name), "rb") as src, open(os.path.join(d, name), "wb") as dst:
                    dst.write(src.read())
            _rewrite(os.path.join(d, "model.safetensors"), **{key: lambda t: (t.float() * factor).to(t.dtype)})
            if factor == 1e30:
                with pytest.raises(QuantizationError) as e:
                    GPT2.from_pretrained(d)
                problem = str(e.value).splitlines()[1].strip()
                assert problem.startswith(key.removeprefix("transformer.") + ": "), (key, problem)
                assert "overflow" in problem or "beyond" in problem
            else:
                with torch.no_grad():
                    assert torch.isfinite(GPT2.from_pretrained(d)(idx).logits).all(), key
                if key.endswith("lm_head.scales"):            # the tied wte is the dequantized head
                    with pytest.raises(QuantizationError, match=r"values of wte\.weight overflow torch\.float16"):
                        GPT2.from_pretrained(d, dtype="float16")


@pytest.mark.parametrize("field,value,message", [
    ("tied", "false", "tied='false' must be a JSON boolean"),
    ("tied", 0, "tied=0 must be a JSON boolean"),
    ("group_size", 32.0, "group_size=32.0 must be a JSON integer or null"),
    ("group_size", True, "group_size=True must be a JSON integer or null"),
    ("format", True, "format=True must be a JSON integer"),
    ("scheme", 4, "scheme=4 must be a JSON string"),
    ("method", None, "method=None must be a JSON string"),
    ("extra", 1, "unknown field 'extra'"),
])
def test_every_field_of_the_quantization_entry_is_type_checked(tmp_path, field, value, message):
    # "tied": "false" is not true (bool("false") would say so), "group_size": 32.0 is not an integer
    quantized("int4", seed=31, group_size=32).save_pretrained(str(tmp_path))
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["gpt2mha"]["quantization"][field] = value
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(QuantizationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPT2.from_pretrained(str(tmp_path))
    del cfg["gpt2mha"]["quantization"][field]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    if field in ("method", "extra"):                               # method may be absent (older checkpoints)
        GPT2.from_pretrained(str(tmp_path))
    else:
        with pytest.raises(QuantizationError, match=f"missing field '{field}'"):
            GPT2.from_pretrained(str(tmp_path))


# ------------------------------------------------------------------ CLI
def test_cli_quantize_flags(tmp_path, capsys):
    from gpt2mha.cli import build_parser, main

    for cmd in (["generate", "x"], ["perplexity", "f"], ["bench"]):
        assert build_parser().parse_args(cmd + ["--quantize", "int4"]).quantize == "int4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--quantize", "int3"])
    assert main(["generate", "x", "--group-size", "32"]) == 2
    assert "--group-size=32 applies only to --quantize int4" in capsys.readouterr().err
    quantized("int8", seed=14, n_vocab=256, tokenizer="bytes").save_pretrained(str(tmp_path))
    assert main(["generate", "ab", "--model", str(tmp_path), "--quantize", "int4", "--max-new-tokens", "2"]) == 2
    assert "saved quantized as int8" in capsys.readouterr().err
    assert main(["bench", "--quantize", "int5"]) == 2


def test_cli_calibration_and_convert_quantize(tmp_path, capsys):
    """--calibration FILE is what GPTQ reads (same model as the API given that text); convert
    --quantize writes a directory that loads quantized with identical logits."""
    from gpt2mha.cli import main

    src = tmp_path / "float"
    float_model(seed=25, n_vocab=256, tokenizer="bytes").save_pretrained(str(src))
    text = tmp_path / "cal.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "q4"
    assert main(["convert", str(src), str(out), "--quantize", "int4", "--group-size", "64",
                 "--calibration", str(text)]) == 0
    loaded = GPT2.from_pretrained(str(out))
    expected = GPT2.from_pretrained(str(src)).quantize("int4", 64, calibration=text.read_text())
    assert loaded.quantization == expected.quantization == {"scheme": "int4", "group_size": 64, "head": "int8",
                                                            "tied": True, "method": "gptq",
                                                            "activations": "exact"}
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(25))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, expected(idx).logits, atol=1e-5, rtol=0)
    capsys.readouterr()
    assert main(["generate", "ab", "--model", str(src), "--quantize", "int8", "--quantize-method", "rtn",
                 "--calibration", str(text)]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main(["generate", "ab", "--model", str(src), "--max-new-tokens", "5", "--quantize", "int8",
                 "--calibration", str(tmp_path / "no")]) == 2
    assert "--calibration: FILE=" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "book.pth"), "--to", "book", "--quantize", "int8"]) == 2
    assert "only the hf format holds quantized weights" in capsys.readouterr().err


def test_cli_activations_per_row_quantizes_converts_and_sets_a_saved_int8_model(tmp_path, capsys):
    """--activations per_row gives the API's per_row model (same text), is saved by convert, is
    set on a model saved int8, and is refused without an int8 model, with the flag named."""
    from gpt2mha.cli import main

    src = tmp_path / "float"
    float_model(seed=27, n_vocab=256, tokenizer="bytes").save_pretrained(str(src))
    gen = ["generate", "ab", "--max-new-tokens", "8", "--temperature", "0"]
    capsys.readouterr()
    assert main([*gen, "--model", str(src), "--quantize", "int8", "--quantize-method", "rtn",
                 "--activations", "per_row"]) == 0
    text = capsys.readouterr().out
    want = GPT2.from_pretrained(str(src)).quantize("int8", method="rtn", activations="per_row")
    ids = want.generate(torch.tensor([[97, 98]]), 8, temperature=0)[0].tolist()
    assert text.strip().endswith(bytes(ids).decode("utf-8", "replace").strip())
    out = tmp_path / "q8"
    assert main(["convert", str(src), str(out), "--quantize", "int8", "--quantize-method", "rtn",
                 "--activations", "per_row"]) == 0
    assert GPT2.from_pretrained(str(out)).quantization["activations"] == "per_row"
    exact = tmp_path / "q8exact"
    assert main(["convert", str(src), str(exact), "--quantize", "int8", "--quantize-method", "rtn"]) == 0
    capsys.readouterr()
    assert main([*gen, "--model", str(exact), "--activations", "per_row"]) == 0            # a saved int8 model
    assert capsys.readouterr().out == text
    for bad, says in ((["--model", str(src), "--activations", "per_row"], "add --quantize int8"),
                      (["--model", str(src), "--quantize", "int4", "--activations", "per_row"], "--quantize int4"),
                      (["--model", str(src), "--activations", "per_block"], "add --quantize int4, or load a model saved int4"),
                      (["--model", str(exact), "--activations", "per_block"], "does not apply to scheme='int8'"),
                      (["--model", str(src), "--quantize", "int8", "--activations", "per_block"],
                       "does not apply to --quantize int8, which takes exact or per_row or auto")):
        assert main([*gen, *bad]) == 2
        assert says in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "x"), "--activations", "per_row"]) == 2
    assert "--activations per_row applies to quantized models" in capsys.readouterr().err
    # auto: saved with the checkpoint, read back onto every int8 layer
    auto = tmp_path / "q8auto"
    assert main(["convert", str(src), str(auto), "--quantize", "int8", "--quantize-method", "rtn",
                 "--activations", "auto"]) == 0
    loaded = GPT2.from_pretrained(str(auto))
    assert loaded.quantization["activations"] == "auto"
    assert {m.activations for m in loaded.modules() if isinstance(m, QuantizedLinear)} == {"auto"}
    # --activations alone on a model saved int8: the same weights, saved with the new mode
    again = tmp_path / "q8again"
    assert main(["convert", str(auto), str(again), "--activations", "per_row"]) == 0
    reloaded = GPT2.from_pretrained(str(again))
    assert reloaded.quantization["activations"] == "per_row"
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), loaded.state_dict().values()))


def test_cli_quantize_flags_name_themselves_and_convert_never_writes_over_its_source(tmp_path, capsys):
    """--quantize-method alone is refused like --group-size alone; library errors are given
    with the flag they came from; convert refuses a DST that is a symlink to SRC (with
    --quantize --overwrite it would replace the float weights it reads)."""
    from gpt2mha.cli import main

    src = tmp_path / "float"
    float_model(seed=30, n_vocab=256, tokenizer="bytes").save_pretrained(str(src))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    runs = [(["generate", "ab", "--model", str(src), "--quantize-method", "rtn"],
             "--quantize-method rtn applies only with --quantize int8|int4"),
            (["generate", "ab", "--model", str(src), "--max-new-tokens", "5", "--quantize", "int4", "--group-size", "48"],
             "--group-size: group_size=48: int4 needs one of"),
            (["generate", "ab", "--model", str(src), "--max-new-tokens", "5", "--quantize", "int8", "--calibration",
              str(short)],
             f"--calibration {short}: calibration: 3 tokens, fewer than one row of 64")]
    for argv, message in runs:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    link = tmp_path / "link"
    os.symlink(src, link)
    before = (src / "model.safetensors").read_bytes()
    assert main(["convert", str(src), str(link), "--quantize", "int8", "--overwrite"]) == 2
    assert "SRC and DST are the same path" in capsys.readouterr().err
    assert (src / "model.safetensors").read_bytes() == before and GPT2.from_pretrained(str(src)).quantization is None


def test_a_model_loaded_quantized_is_not_requantized_with_other_flags(tmp_path, capsys):
    from gpt2mha.cli import main

    d = str(tmp_path / "rtn")
    quantized("int4", seed=32, group_size=32, n_vocab=256, tokenizer="bytes").save_pretrained(d)
    run = ["generate", "ab", "--model", d, "--max-new-tokens", "2", "--temperature", "0"]
    assert main(run + ["--quantize", "int4", "--quantize-method", "gptq"]) == 2
    err = capsys.readouterr().err
    assert "--quantize-method gptq: this model was saved quantized as int4 (group_size=32, method rtn, head int8)" in err
    assert main(run + ["--quantize", "int4", "--quantize-head", "int4"]) == 2
    assert "--quantize-head int4: this model was saved quantized as int4" in capsys.readouterr().err
    assert main(run + ["--quantize-head", "int4"]) == 2             # alone: checked against the saved head
    assert "--quantize-head int4: this model was saved quantized as int4 with an int8 head" in capsys.readouterr().err
    assert main(run + ["--quantize-head", "int8"]) == 0             # the saved one: used as saved
    capsys.readouterr()
    assert main(["generate", "ab", "--max-new-tokens", "2", "--quantize-head", "int4"]) == 2      # a float model
    assert "--quantize-head int4 applies only with --quantize int4 (or to a model saved quantized)" in \
        capsys.readouterr().err
    assert main(run + ["--quantize", "int4", "--group-size", "64"]) == 2
    assert "--group-size 64: this model was saved quantized as int4" in capsys.readouterr().err
    text = tmp_path / "c.txt"
    text.write_text("calibration")
    assert main(run + ["--quantize", "int4", "--quantize-method", "gptq", "--calibration", str(text)]) == 2
    assert f"--quantize-method gptq --calibration {text}: " in capsys.readouterr().err
    # flags that say what it was saved with are accepted: the same tokens as without them
    assert main(run + ["--quantize", "int4", "--quantize-method", "rtn", "--group-size", "32"]) == 0
    with_flags = capsys.readouterr().out
    assert main(run) == 0 and capsys.readouterr().out == with_flags
