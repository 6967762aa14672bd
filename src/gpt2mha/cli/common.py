"""What the commands share: the parser class, number types, the model and quantization flags, reading text files."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

#: ``gpt2mha serve --max-body-bytes`` default (:data:`gpt2mha.serving.server.DEFAULT_MAX_BODY_BYTES`,
#: repeated here so the parser does not import FastAPI).
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: int4's group sizes (:data:`gpt2mha.inference.quant.INT4_GROUP_SIZES`) and the activations each
#: scheme takes (:data:`gpt2mha.inference.quant.linear.SCHEME_ACTIVATIONS`), repeated here so that
#: the flags are checked before torch is imported (tests/test_cli.py checks they agree).
INT4_GROUP_SIZES = (32, 64, 128, 256)
SCHEME_ACTIVATIONS = {"int8": ("exact", "per_row", "auto"), "int4": ("exact", "per_block")}


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def is_rank0() -> bool:
    """Whether this process is rank 0 of a ``torchrun`` launch (or not launched by torchrun):
    the one that reports errors found in the command line, which every rank finds alike."""
    return os.environ.get("RANK", "0") == "0"


class Parser(argparse.ArgumentParser):
    """argparse's parser, silent on the ranks other than 0 of a ``torchrun`` launch: every rank
    parses the same command line, so a usage error (exit 2) or ``--help`` is printed once."""

    def _print_message(self, message, file=None):
        if is_rank0():
            super()._print_message(message, file)


def number(kind: type, low: float, high: float | None = None, note: str = ""):
    """An argparse ``type`` parsing an int or a finite float in ``[low, high]``; anything else
    is a usage error naming the flag, the value and the range (exit 2)."""
    name = "an integer" if kind is int else "a finite number"
    expected = f"{name} >= {low}" if high is None else f"{name} in [{low}, {high}]"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}{note}, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: …)`` after each option's help, except for defaults of None (the help
    says what None means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in model name, local checkpoint directory, or Hugging Face hub id "
                        "(default: the built-in model, offline)")


def load_model(name: str | None, dtype: str = "float32"):
    """The model named on the command line (``None``: :data:`gpt2mha.DEFAULT_MODEL`)."""
    import torch

    from .. import DEFAULT_MODEL
    from ..api import GPT2
    from ..io.checkpoints import builtin_models

    if name is None:
        if DEFAULT_MODEL not in builtin_models():
            raise SystemExit(f"error: the built-in model {DEFAULT_MODEL!r} is not installed in this package; "
                             f"pass --model DIR_OR_HUB_ID")
        name = DEFAULT_MODEL
    return GPT2.from_pretrained(name, dtype=getattr(torch, DTYPES[dtype]))


def quiet_arg(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress on stderr (the bars, drawn only when it is a terminal, and GPTQ's notice)."""
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress on stderr: no progress bar (drawn only when stderr is a terminal) and no "
                        "notice that GPTQ is running")


def batch_invariant_arg(p: argparse.ArgumentParser) -> None:
    """``--batch-invariant`` / ``--no-batch-invariant`` (default: on unless the weights are float32)."""
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="float32 matrix products on a multiple of 4 rows, so every sequence's logits are bitwise "
                        "those of its prompt alone, whatever runs beside it (default: on, except for float32 "
                        "weights, where it costs up to 3x at batch 1; docs/explanation/batch-invariance.md)")


def quantize_args(p: argparse.ArgumentParser) -> None:
    """``--quantize``, ``--group-size``, ``--quantize-head``, ``--quantize-method`` and ``--calibration``."""
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weight-only quantize the model after loading: int8 (one scale per output channel) or int4 "
                        "(a scale and zero per group of inputs); the LM head is int8 in both unless --quantize-head "
                        "says int4. A directory saved quantized loads quantized without this flag")
    p.add_argument("--quantize-head", choices=["int8", "int4"], default=None,
                   help="the LM head's scheme (default int8); int4 (with --quantize int4: the blocks' groups): a 124M "
                        "head of 24 MB instead of 38.6 (a decode step reads 77.5 MB instead of 92) for ~1.5 points "
                        "less top-1 agreement with float32; nothing measurable on the built-in model, whose head "
                        "(256 bytes wide) is ~49 KB")
    p.add_argument("--group-size", type=int, default=None, help="int4's group of inputs per scale (32, 64, 128, 256; "
                                                                "default 32)")
    p.add_argument("--quantize-method", choices=["gptq", "rtn"], default=None,
                   help="gptq (default): round so the layers' outputs on calibration text stay close (the built-in "
                        "model: from seconds to minutes on 2 cores, more on a busy CPU; docs/how-to/quantize.md); "
                        "rtn: round to nearest, instant")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="UTF-8 text file GPTQ calibrates on (default: a 16 KiB Shakespeare sample in the package)")
    p.add_argument("--activations", choices=["exact", "per_row", "auto", "per_block"], default=None,
                   help="how a quantized model's products treat the activations: exact (default; never rounded: "
                        "float32 times the int8/int4 weights on gpt2mha's GEMV kernel for decode steps, integer "
                        "pieces else); int8: per_row (each row rounded to 8 bits over 7-bit weights, W7A8: faster "
                        "prefill and batched decode, less exact) or auto (exact for decode, per_row for prompts of "
                        "64+ tokens on CPUs without VNNI); int4: per_block (decode steps with each row rounded to 8 "
                        "bits per group, W4A8 as llama.cpp q4_0; docs/explanation/quantization.md); also sets it on a model "
                        "saved quantized")


def check_quantize_args(args) -> None:
    """The quantization flags must go together, and ``--calibration`` must be a readable file
    (raises ValueError naming them). Imports no torch: it runs before the command does."""
    if args.group_size is not None and args.quantize != "int4":
        raise ValueError(f"--group-size={args.group_size} applies only to --quantize int4")
    if args.group_size is not None and args.group_size not in INT4_GROUP_SIZES:   # n_embd is checked on loading
        raise ValueError(f"--group-size: group_size={args.group_size}: int4 needs one of {INT4_GROUP_SIZES} (the "
                         f"CPU kernel's sizes)")
    if args.calibration is not None and (args.quantize is None or args.quantize_method == "rtn"):
        raise ValueError(f"--calibration {args.calibration}: calibration text is read only by "
                         f"--quantize int8|int4 with --quantize-method gptq")
    if args.calibration is not None:
        readable_file(args.calibration, "--calibration: FILE")
    if args.quantize_head == "int4" and args.quantize not in (None, "int4"):
        raise ValueError(f"--quantize-head int4 needs --quantize int4 (the head takes the blocks' groups); got "
                         f"--quantize {args.quantize}")
    if args.quantize_method is not None and args.quantize is None:
        raise ValueError(f"--quantize-method {args.quantize_method} applies only with --quantize int8|int4")
    activations = getattr(args, "activations", None)
    if activations is not None and args.quantize is not None and activations not in SCHEME_ACTIVATIONS[args.quantize]:
        raise ValueError(f"--activations {activations} does not apply to --quantize {args.quantize}, which takes "
                         f"{' or '.join(SCHEME_ACTIVATIONS[args.quantize])}")


def quantized(model, args):
    """``model`` quantized as ``--quantize``/``--group-size``/``--quantize-method`` ask. A model
    loaded quantized is used as saved: each of those flags given must match what it was saved
    with, and ``--calibration`` is refused (nothing is re-quantized); the error names both sides.
    Abnormal tensors are reported on stderr (a QuantizationWarning); a progress bar shows there,
    on a terminal, unless ``--quiet``."""
    check_quantize_args(args)
    activations = getattr(args, "activations", None)
    if args.quantize is None:
        head = args.quantize_head                                # alone: must match a model saved quantized
        saved = getattr(model, "quantization", None)
        if head is not None and not saved:
            raise ValueError(f"--quantize-head {head} applies only with --quantize "
                             f"{'int4' if head == 'int4' else 'int8|int4'} (or to a model saved quantized)")
        if head is not None and saved["head"] != head:
            raise ValueError(f"--quantize-head {head}: this model was saved quantized as {saved['scheme']} with an "
                             f"{saved['head']} head; a model loaded quantized is not quantized again: drop the flag, "
                             f"or quantize the float model instead")
        if activations is None:
            return model
        if not getattr(model, "quantization", None):
            schemes = " or ".join(k for k, v in SCHEME_ACTIVATIONS.items() if activations in v)
            raise ValueError(f"--activations {activations} applies to quantized models: add --quantize {schemes}, "
                             f"or load a model saved {schemes}")
        return _set_activations(model, activations)
    if getattr(model, "quantization", None):                     # convert reads a core GPT2, without the attribute
        q = model.quantization
        saved = {"--quantize": q["scheme"], "--group-size": q["group_size"], "--quantize-method": q.get("method", "rtn"),
                 "--quantize-head": q["head"]}
        asked = {"--quantize": args.quantize, "--group-size": args.group_size, "--quantize-method": args.quantize_method,
                 "--quantize-head": args.quantize_head}
        clash = [f"{flag} {asked[flag]}" for flag in asked if asked[flag] is not None and asked[flag] != saved[flag]]
        if args.calibration is not None:                         # nothing is re-quantized: it would be ignored
            clash.append(f"--calibration {args.calibration}")
        if clash:
            raise ValueError(f"{' '.join(clash)}: this model was saved quantized as {q['scheme']} (group_size="
                             f"{q['group_size']}, method {saved['--quantize-method']}, head {q['head']}); a model loaded quantized is "
                             f"not quantized again: drop these flags to use it as saved, or quantize the float model "
                             f"instead")
        return _set_activations(model, activations) if activations is not None else model
    calibration = None
    if args.calibration is not None:
        try:
            calibration = read_text(args.calibration, "all")
        except ValueError as e:
            raise ValueError(f"--calibration: {e}") from None
    method = args.quantize_method or "gptq"
    quiet = getattr(args, "quiet", False)
    if method == "gptq" and not quiet:
        source = args.calibration or "the packaged calibration text"
        print(f"quantizing to {args.quantize} with GPTQ on {source} (seconds to minutes, longer on a "
              f"busy CPU; convert --quantize saves the result, --quantize-method rtn is "
              f"instant)", file=sys.stderr, flush=True)
    from ..inference.quant import quantize_model

    try:
        return quantize_model(model, args.quantize, args.group_size, method, calibration, activations or "exact",
                              args.quantize_head or "int8", progress=not quiet)
    except ValueError as e:                                      # name the flag the value came from
        message = str(e)
        if message.startswith("calibration") and args.calibration is not None:
            message = f"--calibration {args.calibration}: {message}"
        elif message.startswith("group_size"):
            message = f"--group-size: {message}"
        raise ValueError(message) from None


def _set_activations(model, activations: str):
    """``model`` (quantized) with ``--activations`` set on its products; the error names the flag."""
    from ..inference.quant import set_activations

    try:
        set_activations(model, activations)
    except ValueError as e:
        raise ValueError(f"--activations {activations}: {e}") from None
    return model


def readable_file(path: str, name: str = "FILE") -> None:
    """Raises ValueError (``NAME='path': No such file or directory``, or why else it cannot be
    read) unless ``path`` is a file this process can open; reads nothing."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"{name}={path!r}: {e.strerror}") from None


def read_text(path: str, split: str = "all") -> str:
    """A file's exact text (no newline translation), or the trainer's ``train``/``val`` part of
    it (first 90% / last 10% of the bytes). Raises ValueError naming FILE."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"FILE={path!r}: {e.strerror}") from None
    raw = data
    if split != "all":
        from ..train.train import split_bytes                   # (torch: not for a prompt file's checks)
        data = split_bytes(data)[split == "val"]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        offset = e.start + (len(split_bytes(raw)[0]) if split == "val" else 0)
        raise ValueError(f"FILE={path!r} is not UTF-8 text (byte {offset}: {data[e.start:e.start + 1]!r}); "
                         f"re-encode it first, e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
                         f"(if it is Latin-1; `file {path}` guesses the encoding)") from None


def json_arg(text: str | None, name: str) -> dict | None:
    """A JSON object given inline or as a file path (``--book-config``)."""
    if text is None:
        return None
    try:
        value = json.loads(open(text).read() if os.path.isfile(text) else text)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}={text!r} is neither a JSON object nor a readable JSON file: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={text!r}: expected a JSON object, got {type(value).__name__}")
    return value
