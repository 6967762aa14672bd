"""What each command's line alone decides, checked before torch is imported (2 s on an idle
machine, 20 on a busy one): ranges, files that must exist, empty prompts, flags that do not go
together, a C++ compiler for ``--compile``. Each check raises ValueError naming the flag, the
value and what was expected; ``main`` prints it as ``error: …`` and exits 2, as argparse does.
What needs the model (a prompt longer than its context, a layer it does not have) is checked
once it is loaded, before any work.

Nothing here imports torch (tests/test_cli.py runs every command's bad arguments in a fresh
interpreter and checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys

from .common import SCHEME_ACTIVATIONS, check_quantize_args, json_arg, readable_file

#: The largest size trace accepts for any one axis (it builds meta tensors, but their element
#: counts must still fit in int64).
TRACE_MAX_SIZE = 2**20
#: Seeds are 63-bit (:func:`gpt2mha.core.checks.seed`).
SEED_LIMIT = 2**63


def at_least(args, low, *dests: str) -> None:
    """Raises ValueError (``--flag=value must be >= low``) for the first of ``args``' ``dests``
    that is given (not None) and below ``low``."""
    for dest in dests:
        value = getattr(args, dest)
        if value is not None and not value >= low:
            raise ValueError(f"--{dest.replace('_', '-')}={value} must be >= {low}")


def in_range(value, low, high, flag: str, note: str = "", low_open: bool = False, high_open: bool = False) -> None:
    """Raises ValueError (``flag=value must be a number in [low, high]``) unless ``value`` lies in
    the interval (``low_open``/``high_open``: that end excluded); NaN never does."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{flag}={value} must be a number in {interval}{note}")


def seed_in_range(seed: int | None, flag: str = "--seed") -> None:
    """Raises ValueError unless ``seed`` is None or in ``[0, 2**63)``."""
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{flag}={seed} must be an integer in [0, 2**63)")


def nonempty(text: str | None, name: str, what: str = "at least one character") -> None:
    """Raises ValueError (``NAME is empty; give …``) for an empty command-line text."""
    if text is not None and text == "":
        raise ValueError(f"{name} is empty; give {what}")


def output_dir(path: str, flag: str = "--out") -> None:
    """Raises ValueError when ``path`` exists and is not a directory (pictures go into it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file; expected a directory (created if missing)")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (``torch._inductor.config.cpp.cxx``:
    ``$CXX``, else ``g++``, ``clang++`` on macOS) as a path, when it is on PATH and answers
    ``--version`` (inductor's own test); None otherwise."""
    name = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    path = shutil.which(name) if name else None
    if path is None:
        return None
    try:
        subprocess.run([path, "--version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def check_compile(args) -> None:
    """``--compile`` needs the C++ compiler inductor generates code for (raises ValueError naming it)."""
    if getattr(args, "compile", False) and cxx_compiler() is None:
        cxx = os.environ.get("CXX")
        which = f"CXX={cxx!r} is not a working compiler" if cxx else "no g++ on PATH and CXX is not set"
        raise ValueError(f"--compile needs a C++ compiler for inductor's CPU code ({which}); install one "
                         f"(e.g. apt install g++) or set CXX, or drop --compile")


#: The flags of :class:`~gpt2mha.inference.params.SamplingParams` fields on ``generate`` that are
#: not ``--`` and the field's name (every other field's flag is: ``--top-k`` sets ``top_k``).
PARAM_FLAGS = {"max_tokens": "--max-new-tokens", "n": "--num-samples"}


def param_flag(name: str) -> str:
    """The ``generate`` flag of a :class:`~gpt2mha.inference.params.SamplingParams` field."""
    return PARAM_FLAGS.get(name, "--" + name.replace("_", "-"))


def token_id_list(text: str) -> list[int]:
    """An argparse ``type``: ``"198,50256"`` → ``[198, 50256]`` (the ids' range is checked by
    :class:`~gpt2mha.inference.params.SamplingParams`); anything else is a usage error (exit 2)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas, e.g. 198,50256; got {text!r}") \
            from None


def logit_bias_json(text: str) -> dict:
    """``--logit-bias`` (a JSON object, as a request's ``logit_bias``) as a dict; its ids and
    biases are checked by :class:`~gpt2mha.inference.params.SamplingParams`.

    Raises:
        ValueError: naming the flag, for text that is not a JSON object.
    """
    try:
        bias = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--logit-bias {text!r} is not JSON ({e}); give an object such as "
                         f"'{{\"50256\": -100}}'") from None
    if not isinstance(bias, dict):
        raise ValueError(f"--logit-bias {text!r} must be a JSON object of token id: bias")
    return bias


def sampling_params_of(args):
    """``generate``'s sampling flags as one :class:`~gpt2mha.inference.params.SamplingParams`
    (the object ``generate()`` and the server build; it imports no torch), a flag for each field.

    Raises:
        ValueError: the field's error, naming its flag (``--top-p=0.0 must be …``).
    """
    from ..inference.params import FIELDS, ParamError, SamplingParams

    if isinstance(args.logit_bias, str):
        args.logit_bias = logit_bias_json(args.logit_bias)
    values = {name: getattr(args, param_flag(name)[2:].replace("-", "_")) for name in FIELDS if name not in STRUCTURED}
    values.update(logit_bias=args.logit_bias or {}, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
                  structured_outputs=structured_of(args))
    try:
        return SamplingParams(**values)
    except ParamError as e:                   # the fields it names, as their flags: "n=3" -> "--num-samples=3"
        message = re.sub(r"\b(%s)=" % "|".join(values), lambda m: param_flag(m.group(1)) + "=", str(e))
        raise ValueError(message if message.startswith("--") else f"{param_flag(e.param)}: {message}") from None


#: The field set by one of ``generate``'s structured-output flags (:data:`STRUCTURED_FLAGS`).
STRUCTURED = "structured_outputs"
#: ``generate``'s flags of :class:`~gpt2mha.inference.params.StructuredOutputs`: flag → (its
#: argparse dest, the constraint it gives).
STRUCTURED_FLAGS = {"--json-schema": ("json_schema", "json"), "--json-object": ("json_object", "json_object"),
                    "--regex": ("regex", "regex"), "--choice": ("choice", "choice"), "--grammar": ("grammar", "grammar")}


def structured_of(args):
    """``generate``'s ``--json-schema FILE``, ``--json-object``, ``--regex R``, ``--choice A,B``
    (repeatable) or ``--grammar FILE`` as one :class:`~gpt2mha.inference.params.StructuredOutputs`
    (None for none), its grammar checked (no torch).

    Raises:
        ValueError: naming the flag: two of them, a file that cannot be read, or a schema, regex,
            choice or grammar that llguidance refuses (its message).
    """
    from ..inference.params import GrammarError, StructuredOutputs

    given = [(flag, getattr(args, dest, None)) for flag, (dest, _) in STRUCTURED_FLAGS.items()]
    given = [(flag, value) for flag, value in given if value]
    if len(given) > 1:
        raise ValueError(f"{given[0][0]} and {given[1][0]} both constrain the text; give one of them")
    if not given:
        return None
    flag, value = given[0]
    key = STRUCTURED_FLAGS[flag][1]
    if flag in ("--json-schema", "--grammar"):
        try:
            with open(value, "rb") as f:
                spec = f.read().decode("utf-8")
        except OSError as e:
            raise ValueError(f"{flag} {value!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{flag} {value!r} is not UTF-8 text (byte {e.start})") from None
    elif flag == "--choice":
        spec = [c for part in value for c in part.split(",")]
    else:
        spec = value
    try:
        return StructuredOutputs(**{key: spec})
    except GrammarError as e:
        shown = "" if flag == "--json-object" else f" {value!r}" if flag != "--choice" else f" {','.join(spec)!r}"
        raise ValueError(f"{flag}{shown}: {e.detail}") from None


def check_sampling(args) -> None:
    """``generate``'s sampling flags (:func:`sampling_params_of`: every field's range, once, where
    the library checks it) and ``--tp``."""
    sampling_params_of(args)
    if args.tp < 1:
        raise ValueError(f"--tp {args.tp} must be a positive integer")


def check_perplexity_args(args) -> None:
    """``perplexity``: the quantization flags, then FILE readable and ``--stride`` >= 1."""
    check_quantize_args(args)
    readable_file(args.file)
    at_least(args, 1, "stride")


def check_train_args(args) -> None:
    """``train``: flags that do not go together, the sizes and settings' ranges, ``--data`` a
    file, ``--out`` a directory (one that exists for ``--resume``)."""
    if args.resume and args.init_from is not None:
        raise ValueError(f"--init-from {args.init_from} starts a new run from a model's weights; --resume continues "
                         f"the checkpoint in --out: use one of them")
    if args.init_from is not None and args.preset is not None:
        raise ValueError(f"--preset {args.preset}: the model comes from --init-from {args.init_from}; drop --preset")
    at_least(args, 1, "n_layer", "n_head", "n_embd", "n_ctx", "iters", "batch_size", "eval_interval")
    at_least(args, 0, "warmup", "min_lr")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    for flag in ("attn_pdrop", "resid_pdrop"):
        if getattr(args, flag) is not None:
            in_range(getattr(args, flag), 0, 1, "--" + flag.replace("_", "-"), high_open=True)
    seed_in_range(args.seed)
    if not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data!r} does not exist or is not a file")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; expected a checkpoint directory")
    if args.resume and not os.path.isdir(args.out):
        raise ValueError(f"--resume: no checkpoint in {args.out!r}")


def check_trace_args(args) -> None:
    """``trace``: every size at least 1 (``--past`` at least 0) and at most :data:`TRACE_MAX_SIZE`."""
    for dest in ("batch", "tokens", "d_in", "d_out", "num_heads", "context_length", "past"):
        value = getattr(args, dest)
        if value is not None and value > TRACE_MAX_SIZE:
            raise ValueError(f"--{dest.replace('_', '-')}={value} is too large for a trace; expected at most "
                             f"{TRACE_MAX_SIZE:,}")
        at_least(args, 0 if dest == "past" else 1, dest)


def check_heads_args(args) -> None:
    """``heads``: a PROMPT, ``--top`` >= 1, ``--layer``/``--head`` >= 0, ``--out`` not a file."""
    nonempty(args.prompt, "PROMPT")
    at_least(args, 1, "top")
    for dest in ("layer", "head"):
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise ValueError(f"--{dest} {value} is out of range: layers and heads are numbered from 0")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; expected a directory to write the maps into "
                         f"(it is created if missing)")


def check_heads_list(text: str) -> None:
    """``ablate --heads``: comma-separated ``layer.head`` pairs of numbers from 0 (whether the model
    has them is checked once it is loaded, by :func:`gpt2mha.learn.interventions.parse_heads`)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--heads {text!r} names no head; expected layer.head pairs such as '0.3,1.5'")
    for item in items:
        parts = item.split(".")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--heads: head {item!r} is not layer.head (e.g. '0.3' = layer 0, head 3)")


def check_ablate_args(args) -> None:
    """``ablate``: a PROMPT, ``--heads`` as layer.head pairs, ``--top`` >= 1 (at most the
    vocabulary: checked once the model is loaded)."""
    nonempty(args.prompt, "PROMPT")
    check_heads_list(args.heads)
    at_least(args, 1, "top")


def check_patch_args(args) -> None:
    """``patch``: CLEAN and CORRUPT, ``--answer`` (argparse requires it) non-empty, ``--wrong`` for
    logit-diff (its usage line says so: :class:`~.interventions.PatchUsageFormatter`), ``--out``."""
    nonempty(args.clean, "CLEAN")
    nonempty(args.corrupt, "CORRUPT")
    nonempty(args.answer, "--answer ''", "the token text the model should predict")
    if args.metric == "logit-diff" and args.wrong is None:
        raise ValueError("--metric logit-diff needs --wrong (the token the corrupted prompt predicts); "
                         "or use --metric logprob")
    nonempty(args.wrong, "--wrong ''", "the token text the corrupted prompt predicts")
    output_dir(args.out)


def check_lens_args(args) -> None:
    """``lens``: a PROMPT, ``--top`` and ``--columns`` >= 1, ``--out`` not a file."""
    nonempty(args.prompt, "PROMPT")
    at_least(args, 1, "top", "columns")
    output_dir(args.out)


def _could_not_run(check):
    """``check``, its error followed by check's verdict line, ``result: COULD NOT RUN (exit 2)``."""
    def run(args) -> None:
        try:
            check(args)
        except ValueError as e:
            raise ValueError(f"{e}\nresult: COULD NOT RUN (exit 2)") from None
    run.__doc__ = check.__doc__
    return run


@_could_not_run
def check_check_args(args) -> None:
    """``check``: ``--seed`` in [0, 2**63), ``--batch``/``--tokens`` >= 1, ``--past``/``--long-tokens`` >= 0."""
    seed_in_range(args.seed)
    at_least(args, 1, "batch", "tokens")
    at_least(args, 0, "past", "long_tokens")


@_could_not_run
def check_check_model_args(args) -> None:
    """``check-model``: ``--batch``/``--tokens`` >= 1, ``--atol`` a finite number >= 0,
    ``--seed`` in [0, 2**63), ``--book-config`` a JSON object."""
    at_least(args, 1, "batch", "tokens")
    if not (math.isfinite(args.atol) and args.atol >= 0):
        raise ValueError(f"--atol={args.atol} must be a finite number >= 0")
    seed_in_range(args.seed)
    json_arg(args.book_config, "--book-config")


def check_convert_args(args) -> None:
    """``convert``: the quantization flags, ``--book-config`` a JSON object, and an ``hf`` DST
    that is not a non-empty directory unless ``--overwrite``."""
    check_quantize_args(args)
    json_arg(args.book_config, "--book-config")
    for path in args.lora or ():
        if not os.path.exists(path):
            raise ValueError(f"--lora {path}: no such file or directory")
    if args.to == "hf" and not args.overwrite and os.path.isdir(args.dst) and os.listdir(args.dst):
        raise ValueError(f"{args.dst} is not empty; refusing to overwrite it (pass --overwrite)")


#: The sections of ``gpt2mha bench`` (benchmarks/bench.py), in the order they run.
BENCH_SECTIONS = ("decode", "cache", "positions", "prefill", "attention", "lowp", "quant")


def check_bench_args(args) -> None:
    """``bench``: ``--only`` sections it has, ``--quantize`` schemes, ``--text`` readable."""
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in sections if s not in BENCH_SECTIONS]
    if bad or not sections:
        raise ValueError(f"--only: unknown section(s) {bad}; expected some of {list(BENCH_SECTIONS)}")
    schemes = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if not schemes or any(q not in SCHEME_ACTIVATIONS for q in schemes):
        raise ValueError(f"--quantize={args.quantize!r}: expected int8, int4 or int8,int4")
    if args.text is not None:
        readable_file(args.text, "--text")
