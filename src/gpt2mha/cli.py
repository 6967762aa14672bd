"""The ``gpt2mha`` command: a thin argparse layer over the Python API."""

from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: …)`` after each option's help, except for defaults of None (the help
    says what None means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in model name, local checkpoint directory, or Hugging Face hub id "
                        "(default: the built-in model, offline)")


def load_model(name: str | None, dtype: str = "float32"):
    """The model named on the command line (``None``: :data:`gpt2mha.DEFAULT_MODEL`)."""
    import torch

    from .checkpoints import builtin_models, load_pretrained
    from . import DEFAULT_MODEL

    if name is None:
        if DEFAULT_MODEL not in builtin_models():
            raise SystemExit(f"error: the built-in model {DEFAULT_MODEL!r} is not installed in this package; "
                             f"pass --model DIR_OR_HUB_ID")
        name = DEFAULT_MODEL
    return load_pretrained(name, dtype=getattr(torch, DTYPES[dtype]))


def _quantize_args(p: argparse.ArgumentParser) -> None:
    """``--quantize``, ``--group-size``, ``--quantize-method`` and ``--calibration`` (issue 13)."""
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="weight-only quantize the model after loading: int8 (one scale per output channel) or int4 "
                        "(a scale and zero per group of inputs); the LM head is int8 in both. A directory saved "
                        "quantized loads quantized without this flag")
    p.add_argument("--group-size", type=int, default=None, help="int4's group of inputs per scale (32, 64, 128, 256; "
                                                                "default 32)")
    p.add_argument("--quantize-method", choices=["gptq", "rtn"], default=None,
                   help="gptq (default): round so the layers' outputs on calibration text stay close (the built-in "
                        "model: from seconds to minutes on 2 cores, int8 longer than int4, more on a busy CPU; README "
                        "'Quantized decode'); rtn: round to nearest, instant")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="UTF-8 text file GPTQ calibrates on (default: a 16 KiB Shakespeare sample in the package)")


def quantized(model, args):
    """``model`` quantized as ``--quantize``/``--group-size`` ask (a model loaded quantized must
    match them). Abnormal tensors are reported on stderr (a QuantizationWarning)."""
    if args.group_size is not None and args.quantize != "int4":
        raise ValueError(f"--group-size={args.group_size} applies only to --quantize int4")
    if args.calibration is not None and (args.quantize is None or args.quantize_method == "rtn"):
        raise ValueError(f"--calibration {args.calibration}: calibration text is read only by "
                         f"--quantize int8|int4 with --quantize-method gptq")
    if args.quantize_method is not None and args.quantize is None:
        raise ValueError(f"--quantize-method {args.quantize_method} applies only with --quantize int8|int4")
    if args.quantize is None:
        return model
    if model.quantization:
        if args.quantize != model.quantization["scheme"] or args.group_size not in (None, model.quantization["group_size"]):
            raise ValueError(f"--quantize {args.quantize}: this model was saved quantized as "
                             f"{model.quantization['scheme']} (group_size={model.quantization['group_size']}); "
                             f"quantize the float model instead")
        return model
    calibration = None
    if args.calibration is not None:
        try:
            calibration = read_text(args.calibration, "all")
        except ValueError as e:
            raise ValueError(f"--calibration: {e}") from None
    method = args.quantize_method or "gptq"
    if method == "gptq":
        source = args.calibration or "the packaged calibration text"
        print(f"quantizing to {args.quantize} with GPTQ on {source} (seconds to minutes: int8 takes longer than "
              f"int4, and a busy CPU longer still; convert --quantize saves the result, --quantize-method rtn is "
              f"instant)", file=sys.stderr, flush=True)
    try:
        return model.quantize(args.quantize, args.group_size, method, calibration)
    except ValueError as e:                                      # name the flag the value came from
        message = str(e)
        if message.startswith("calibration") and args.calibration is not None:
            message = f"--calibration {args.calibration}: {message}"
        elif message.startswith("group_size"):
            message = f"--group-size: {message}"
        raise ValueError(message) from None


def cmd_generate(args) -> int:
    import torch

    from .generate import check_min_p, check_sampling
    from .tokenizer import StreamDecoder, tokenizer_for

    check_sampling(args.temperature, args.top_k, args.top_p)
    try:
        check_min_p(args.min_p)
    except ValueError:
        raise ValueError(f"--min-p={args.min_p} must be a number in [0, 1] (0: off)") from None
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if args.prompt_file is not None:
        if args.prompt:
            raise ValueError(f"--prompt-file {args.prompt_file} is the prompt; drop the PROMPT ({args.prompt[0]!r}) "
                             f"or the flag")
        args.prompt = [read_prompt_file(args.prompt_file)]
    prompts = args.prompt
    if args.num_samples < 1:
        raise ValueError(f"--num-samples={args.num_samples} must be >= 1")
    if args.unconditional and prompts:
        raise ValueError(f"--unconditional starts from <|endoftext|> alone; drop the PROMPT ({prompts[0]!r}) or "
                         f"the flag")
    if not args.unconditional and not prompts:
        raise ValueError("give a PROMPT to continue (or --unconditional to sample from <|endoftext|>)")
    if "" in prompts:
        which = f"PROMPT {prompts.index('') + 1}" if len(prompts) > 1 else \
            f"--prompt-file {args.prompt_file}" if args.prompt_file is not None else "PROMPT"
        raise ValueError(f"{which} is empty; give at least one character to continue")
    from . import parallel
    parallel.check_world(args.tp)                     # --tp N needs N ranks (torchrun)
    if args.quantize and args.tp > 1:
        raise ValueError(f"--quantize {args.quantize} with --tp {args.tp}: tensor parallelism shards float weights; "
                         f"quantized models run in one process")
    model = quantized(parallel.tensor_parallel(load_model(args.model, args.dtype), args.tp), args)
    tok = tokenizer_for(model.config)
    if args.stop_at_eos and tok.eot_token is None:
        raise ValueError(f"--stop-at-eos: the {tok.name!r} tokenizer of this model has no <|endoftext|> token")
    if args.unconditional and tok.eot_token is None:
        raise ValueError(f"--unconditional starts from <|endoftext|>, which the {tok.name!r} tokenizer of this model "
                         f"does not have; give a PROMPT instead")
    if args.unconditional or len(prompts) > 1 or args.num_samples > 1:
        return _generate_samples(args, model, tok)
    args.prompt = prompts[0]
    try:
        idx = torch.tensor([tok.encode(args.prompt)], dtype=torch.long, device=model.wte.weight.device)
    except UnicodeError:
        raise ValueError("PROMPT is not valid UTF-8 text") from None
    stream, out, started = StreamDecoder(tok), parallel.rank0_stdout(), []

    def on_token(token):
        if not started:                       # the prompt is echoed once the arguments have held up
            out.write(args.prompt)
            started.append(True)
        out.write(stream.push(token.tolist()))
        out.flush()

    ids = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         min_p=args.min_p, seed=args.seed, eos_token_id=tok.eot_token if args.stop_at_eos else None,
                         sliding_window=args.sliding_window, on_token=on_token, vocab_size=tok.n_vocab)
    parallel.check_same_tokens(ids)
    out.write(("" if started else args.prompt) + stream.flush() + "\n")
    return 0


def _generate_samples(args, model, tok) -> int:
    """``--num-samples`` / several PROMPTs / ``--unconditional``: every (prompt, sample) is one
    row of a left-padded batch (OpenAI's ``sample_sequence`` with ``batch_size``; unconditional
    rows start from ``<|endoftext|>``, which is not printed). Each row is printed after a label
    line, its padding dropped by :func:`gpt2mha.tokenizer.decode_rows`; with ``--stop-at-eos`` a
    row ends at its first ``<|endoftext|>``."""
    from . import parallel
    from .generate import left_pad
    from .tokenizer import decode_rows

    try:
        encoded = [[tok.eot_token]] if args.unconditional else [tok.encode(p) for p in args.prompt]
    except UnicodeError:
        raise ValueError("PROMPT is not valid UTF-8 text") from None
    rows = [ids for ids in encoded for _ in range(args.num_samples)]
    idx, mask = (t.to(model.wte.weight.device) for t in left_pad(rows))
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                         eos_token_id=tok.eot_token if args.stop_at_eos else None, attention_mask=mask,
                         sliding_window=args.sliding_window, vocab_size=tok.n_vocab)
    parallel.check_same_tokens(out)
    texts = decode_rows(tok, out.cpu(), mask.cpu(), tok.eot_token if args.stop_at_eos else None)
    skip = len(tok.decode([tok.eot_token])) if args.unconditional else 0     # the start token is not printed
    stdout = parallel.rank0_stdout()
    for i, text in enumerate(texts):
        label = f"sample {i % args.num_samples + 1} of {args.num_samples}"
        if not args.unconditional and len(args.prompt) > 1:
            label = f"prompt {i // args.num_samples + 1} of {len(args.prompt)}, " + label
        print(f"{'=' * 20} {label} {'=' * 20}", text[skip:], sep="\n", file=stdout)
    return 0


def read_prompt_file(path: str) -> str:
    """``--prompt-file``: the file's exact text (a trailing newline included), or standard input's
    for ``-``. Raises ValueError naming the file when it cannot be read or is not UTF-8."""
    if path != "-":
        try:
            return read_text(path)
        except ValueError as e:
            raise ValueError(f"--prompt-file: {e}") from None
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file -: standard input is not UTF-8 text (byte {e.start})") from None


def read_text(path: str, split: str = "all") -> str:
    """A file's exact text (no newline translation), or the trainer's ``train``/``val`` part of
    it (first 90% / last 10% of the bytes). Raises ValueError naming FILE."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"FILE={path!r}: {e.strerror}") from None
    from .train import split_bytes
    raw = data
    if split != "all":
        data = split_bytes(data)[split == "val"]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        offset = e.start + (len(split_bytes(raw)[0]) if split == "val" else 0)
        raise ValueError(f"FILE={path!r} is not UTF-8 text (byte {offset}: {data[e.start:e.start + 1]!r}); "
                         f"re-encode it first, e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
                         f"(if it is Latin-1; `file {path}` guesses the encoding)") from None


def cmd_perplexity(args) -> int:
    from . import parallel

    text = read_text(args.file, args.split)
    model = quantized(load_model(args.model, args.dtype), args).to(parallel.info().device)
    result = parallel.perplexity(model, text, stride=args.stride)   # windows split over torchrun's ranks
    if not parallel.info().is_main:
        return 0
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"tokens           {result.tokens}\nbytes            {result.bytes}\n"
              f"loss per token   {result.loss_per_token:.4f} nats\nperplexity       {result.perplexity:.3f}\n"
              f"bits per byte    {result.bits_per_byte:.4f}")
    return 0


#: train's options that set the model (GPT2Config fields), as argparse names them
TRAIN_MODEL_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd", "n_ctx": "--n-ctx",
                     "tokenizer": "--tokenizer", "attn_pdrop": "--attn-pdrop", "resid_pdrop": "--resid-pdrop"}
#: train's options that set the optimisation (TrainConfig fields)
TRAIN_SETTINGS = ("iters", "batch_size", "lr", "min_lr", "warmup", "seed", "eval_interval")


def cmd_train(args) -> int:
    """``gpt2mha train``. Every option defaults to None, so the ones given on the command line
    are known: a new run fills the others from the preset and :class:`~gpt2mha.train.TrainConfig`,
    ``--resume`` from the checkpoint (the train function prints each setting given that differs
    from it), ``--init-from`` from the model it loads."""
    from .train import train

    if args.resume and args.init_from is not None:
        raise ValueError(f"--init-from {args.init_from} starts a new run from a model's weights; --resume continues "
                         f"the checkpoint in --out: use one of them")
    model = {k: getattr(args, k) for k in TRAIN_MODEL_FLAGS if getattr(args, k) is not None}
    if model.get("resid_pdrop") is not None:
        model["embd_pdrop"] = model["resid_pdrop"]                   # --resid-pdrop covers the embeddings too
    if args.init_from is not None and args.preset is not None:
        raise ValueError(f"--preset {args.preset}: the model comes from --init-from {args.init_from}; drop --preset")
    if args.init_from is not None or (args.resume and args.preset is None):
        config = model or None                                       # checked against that model by train()
    else:                                                            # a new run; or --resume with the same preset
        from .model import GPT2Config

        preset = args.preset or "tiny"
        if "tokenizer" not in model:
            model["tokenizer"] = "gpt2" if preset in ("124M", "355M", "774M", "1558M") else "bytes"
        config = GPT2Config.from_preset(preset, n_vocab=50257 if model["tokenizer"] == "gpt2" else 256, **model)
    settings = {k: getattr(args, k) for k in TRAIN_SETTINGS if getattr(args, k) is not None}
    try:
        log = train(args.data, args.out, config, settings, resume=args.resume,     # DDP under torchrun
                    init_from=args.init_from)
    except ValueError as e:                                          # name the flags the fields came from
        import re

        flags = {**TRAIN_MODEL_FLAGS, **{k: "--" + k.replace("_", "-") for k in (*TRAIN_SETTINGS, "init_from")}}
        flags = {k: v for k, v in flags.items() if getattr(args, k) is not None}          # the ones given
        message = re.sub(r"\b(%s)=" % "|".join(flags), lambda m: flags[m.group(1)] + "=", str(e)) if flags else str(e)
        raise ValueError(f"--preset {args.preset}: {message}" if args.resume and args.preset else message) from None
    from .parallel import info
    if log["evals"] and info().is_main:
        last = log["evals"][-1]
        print(f"done: step {last['step']}, val loss {last['val_loss']:.4f} nats/token, "
              f"{log['seconds']:.0f} s; checkpoint in {args.out}")
    return 0


#: The largest size trace accepts for any one axis (it builds meta tensors, but their element
#: counts must still fit in int64).
TRACE_MAX_SIZE = 2**20


def cmd_trace(args) -> int:
    from .inspect import format_trace, trace

    for flag in ("batch", "tokens", "d_in", "d_out", "num_heads", "context_length", "past"):
        value = getattr(args, flag)
        if value is not None and value > TRACE_MAX_SIZE:
            raise ValueError(f"--{flag.replace('_', '-')}={value} is too large for a trace; expected at most "
                             f"{TRACE_MAX_SIZE:,}")
    tr = trace(args.layout, b=args.batch, T=args.tokens, d_in=args.d_in, d_out=args.d_out, num_heads=args.num_heads,
               context_length=args.context_length, past=args.past)
    print(json.dumps(tr.to_dict()) if args.json else format_trace(tr))
    return 0


def cmd_heads(args) -> int:
    from .inspect import (ROLE_THRESHOLD, analyse_heads, check_selection, format_strongest, selected_heads,
                          strongest_heads, top_heads, write_heads)

    if args.top < 1:
        raise ValueError(f"--top {args.top} must be at least 1")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; expected a directory to write the maps into "
                         f"(it is created if missing)")
    model = load_model(args.model, args.dtype)
    c = model.config
    check_selection(c.n_layer, c.n_head, args.layer, args.head)   # before the (slower) forward pass
    result = analyse_heads(model, args.prompt)
    rows = strongest_heads(result.relative, args.top)
    heads = selected_heads(c.n_layer, c.n_head, args.layer, args.head, rows)
    if not heads:                                                 # no head has a clear role: draw the closest
        best = max(result.roles, key=lambda r: r["score"])
        heads = [(best["layer"], best["head"])]
    induction = top_heads(result.relative["induction"], 3)
    title = f"{args.model or 'built-in model'}: {c.n_layer} layers x {c.n_head} heads, {len(result.tokens)} tokens"
    files = write_heads(result, args.out, heads, title)
    if args.json:
        print(json.dumps({"files": {k: files[k] for k in ("grid", "heads", "html")}, "strongest": rows,
                          "roles": result.roles, "threshold": ROLE_THRESHOLD, "induction": induction,
                          "tokens": result.labels, "notes": files["notes"],
                          "scores": {k: v.tolist() for k, v in result.scores.items()},
                          "relative": {k: v.tolist() for k, v in result.relative.items()}}))
        return 0
    print(f"{len(result.tokens)} tokens, {c.n_layer} layers x {c.n_head} heads (0-based numbers)")
    print(f"heads with a clear role (one per head, its strongest; score relative to uniform attention: 0 = what "
          f"uniform or random attention gives, 1 = all weight on that key; a role needs >= {ROLE_THRESHOLD}):")
    print(format_strongest(rows, result.roles))
    print("strongest induction heads (a random sequence repeated; weight from the second copy to the token after "
          "the first occurrence): " + ", ".join(f"layer {r['layer']} head {r['head']} {r['score']:.2f}"
                                                 for r in induction))
    for note in files["notes"]:
        print(f"note: {note}")
    print(f"wrote {files['grid']}, {files['html']}" + "".join(f", {p}" for p in files["heads"]))
    return 0


def cmd_check(args) -> int:
    from .check import CheckError, check, format_report, parse_args

    if not 0 <= args.seed < 2**63:
        print(f"error: --seed={args.seed} must be an integer in [0, 2**63)\nresult: COULD NOT RUN (exit 2)",
              file=sys.stderr)
        return 2
    try:
        kwargs = parse_args(args.args)
    except CheckError as e:
        print(f"error: {e}\nresult: COULD NOT RUN (exit 2)", file=sys.stderr)
        return 2
    report = check(args.target, kwargs, batch=args.batch, tokens=args.tokens, past=args.past, seed=args.seed)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return report.exit_code


def _add_inspect_commands(sub) -> None:
    """Parsers of ``trace``, ``heads`` and ``check`` (:mod:`gpt2mha.inspect`, :mod:`gpt2mha.check`)."""
    tr = sub.add_parser("trace", help="print a multi-head attention forward pass stage by stage with shapes",
                        description="Walk one forward pass stage by stage, in the order to debug shapes in (input, projections, view, "
                                    "transpose, scores, weights, contexts, merged, out_proj) with each tensor's "
                                    "shape, the meaning of its axes and the operation between stages. Defaults: "
                                    "GPT-2 small (d_in = d_out = 768, 12 heads), b=2, T=6.")
    tr.add_argument("--layout", choices=["fused", "split", "wrapper"], default="split",
                    help="fused: GPT-2's c_attn/c_proj; split: the book's MultiHeadAttention (W_query/W_key/"
                         "W_value/out_proj); wrapper: MultiHeadAttentionWrapper (default: split)")
    tr.add_argument("--batch", type=int, default=2, help="b (default 2)")
    tr.add_argument("--tokens", type=int, default=6, help="T, new tokens (default 6)")
    tr.add_argument("--d-in", type=int, default=768)
    tr.add_argument("--d-out", type=int, default=None,
                    help="default 768; for --layout wrapper each head's width (default 768 / num_heads)")
    tr.add_argument("--num-heads", type=int, default=12)
    tr.add_argument("--context-length", type=int, default=1024)
    tr.add_argument("--past", type=int, default=0, help="cached tokens before the T new ones (default 0)")
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    tr.set_defaults(func=cmd_trace)

    hd = sub.add_parser("heads", help="attention maps of every layer and head, and head roles, for a prompt",
                        description="Run the model on PROMPT through the explicit attention path and write "
                                    "OUT/grid.png (every layer x head map), OUT/layer{L}_head{H}.png per selected "
                                    "head and OUT/heads.html (self-contained). Gives each head one role, its "
                                    "strongest: previous-token, first-token, self (on PROMPT) or induction (on a "
                                    "repeated random sequence), scored relative to uniform attention, or 'no clear "
                                    "role' below the threshold. Layers and heads are numbered from 0.")
    hd.add_argument("prompt", metavar="PROMPT")
    _model_arg(hd)
    hd.add_argument("--layer", type=int, default=None, help="layer to draw at full size (default: see --head)")
    hd.add_argument("--head", type=int, default=None,
                    help="head to draw at full size; with only --layer: every head of it; with only --head: that "
                         "head in every layer; with neither: the strongest head of each role")
    hd.add_argument("--out", default="heads", metavar="DIR", help="output directory (default ./heads)")
    hd.add_argument("--top", type=int, default=3, help="heads listed per role (default 3)")
    hd.add_argument("--json", action="store_true", help="print files, strongest heads and all scores as JSON")
    hd.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="weights' dtype, as for generate (default float32)")
    hd.set_defaults(func=cmd_heads)

    warning = ("WARNING: check imports FILE.py and runs its code (module body, constructor, forward) with your "
               "permissions. Only check files you trust.")
    ck = sub.add_parser("check", help="check a multi-head attention module you wrote (RUNS the file's code)",
                        description="Build FILE.py:ClassName, recognise its parameter layout (W_query/W_key/W_value/"
                                    "out_proj; q_proj/k_proj/v_proj/o_proj; a fused qkv Linear; c_attn/c_proj "
                                    "Conv1D; a heads ModuleList; a torch.nn.MultiheadAttention inside; single heads "
                                    "such as the book's CausalAttention), copy reference weights in, run both on "
                                    "the same "
                                    "input and report the shapes stage by stage, the first differing stage, the "
                                    "max abs error and a diagnosis of classic mistakes. Exit code 0: matches; 1: "
                                    "runs but does not match; 2: could not be run. " + warning,
                        epilog=warning)
    ck.add_argument("target", metavar="FILE.py:ClassName", help="also package.module:ClassName")
    ck.add_argument("--args", nargs="+", action="extend", default=[], metavar="ARG",
                    help="constructor arguments: a JSON object or key=value items, e.g. --args d_in=20 d_out=24 "
                         "num_heads=4 (missing ones: d_in=20, d_out=24, num_heads=4, context_length=16 or the "
                         "tokens needed, dropout=0)")
    ck.add_argument("--batch", type=int, default=2, help="b (default 2)")
    ck.add_argument("--tokens", type=int, default=5, help="T (default 5)")
    ck.add_argument("--past", type=int, default=3,
                    help="cached tokens for the cache step, when forward takes a past argument (default 3; 0: skip)")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    ck.set_defaults(func=cmd_check)


def cmd_bench(args) -> int:
    from .bench import main_args

    return main_args(args)


#: The sections of ``gpt2mha bench`` (:mod:`gpt2mha.bench`), in the order they run.
BENCH_SECTIONS = ("decode", "cache", "positions", "prefill", "attention", "lowp", "quant")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gpt2mha bench`` and ``python -m gpt2mha.bench`` (kept here, without torch,
    so that building the command's parser imports nothing heavy)."""
    p.add_argument("--quick", action="store_true",
                   help="scaled-down sizes, every section's work bounded (2-3 minutes on 2 idle cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--preset", default="124M", help="model size preset for the random weights (default 124M)")
    p.add_argument("--only", default=",".join(BENCH_SECTIONS),
                   help=f"comma-separated sections to run (default all: {','.join(BENCH_SECTIONS)})")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="real text for top-1 agreement (default: the repo's data/tinyshakespeare.txt)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--quantize", default="int8,int4", metavar="int8|int4",
                   help="weight-only schemes the quant section decodes with (comma-separated; default both)")


def _add_bench_command(sub) -> None:
    b = sub.add_parser("bench", help="speed and memory against Hugging Face transformers on the same random weights")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)


def _json_arg(text: str | None, name: str) -> dict | None:
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


def cmd_convert(args) -> int:
    from .formats import convert

    if args.quantize is None and (args.group_size is not None or args.calibration is not None
                                  or args.quantize_method is not None):
        quantized(None, args)                                   # the named error for a stray option
    written = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, src_format=args.src_format,
                      book_config=_json_arg(args.book_config, "--book-config"),
                      quantize=(lambda m: quantized(m, args)) if args.quantize else None)
    print("wrote " + ", ".join(written))
    return 0


def cmd_check_model(args) -> int:
    from .compare import check_model, format_model_report

    report = check_model(args.src, cls=args.cls, fmt=args.src_format, book_config=_json_arg(args.book_config, "--book-config"),
                         batch=args.batch, tokens=args.tokens, seed=args.seed, atol=args.atol)
    print(json.dumps(report.to_dict()) if args.json else format_model_report(report))
    return report.exit_code


def _add_formats_commands(sub) -> None:
    """Parsers of ``convert`` and ``check-model`` (:mod:`gpt2mha.formats`)."""
    cv = sub.add_parser("convert", help="convert a checkpoint (OpenAI TF dir, nanoGPT ckpt.pt, the book's GPTModel "
                                        ".pth, Hugging Face dir) to a Hugging Face dir, the book's or nanoGPT's format",
                        description="Read SRC in any supported format (detected: a Hugging Face directory; OpenAI's "
                                    "download_model.py directory, read with TensorFlow: pip install 'gpt2mha[tf]'; "
                                    "nanoGPT's ckpt.pt or out_dir; the book's GPTModel state dict .pth, whose config "
                                    "dict comes from --book-config or NAME.json beside it) and write it to DST. "
                                    "Nothing existing is overwritten without --overwrite.")
    cv.add_argument("src", metavar="SRC")
    cv.add_argument("dst", metavar="DST", help="hf: a directory; book: NAME.pth (+ NAME.json); nanogpt: a directory "
                                               "or file (ckpt.pt)")
    cv.add_argument("--to", choices=["hf", "book", "nanogpt"], default="hf", help="format to write (default hf)")
    cv.add_argument("--from", dest="src_format", choices=["hf", "openai", "book", "nanogpt"], default=None,
                    help="format of SRC (default: detected)")
    cv.add_argument("--book-config", default=None, metavar="JSON",
                    help="the book's config dict (JSON or a JSON file), e.g. '{\"n_heads\": 12}'; only n_heads "
                         "is needed, the other sizes are read off the tensors")
    cv.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    _quantize_args(cv)
    cv.set_defaults(func=cmd_convert)

    warning = "WARNING: with --class, FILE.py is imported and run with your permissions. Only use files you trust."
    cm = sub.add_parser("check-model", help="compare your whole model with gpt2mha on the same checkpoint, layer by layer",
                        description="Load SRC into gpt2mha and into your own model (--class FILE.py:Class: the book's "
                                    "GPTModel built with the config dict, nanoGPT's GPT built with GPTConfig(**model_args), "
                                    "each loaded with its load_state_dict from the file's tensors) or, without --class, "
                                    "the format's reference (the book's chapter 4 GPTModel; NumPy's OpenAI formulas for "
                                    "OpenAI/Hugging Face checkpoints). Run both on the same ids in float64 and report "
                                    "the embeddings, each block's attention, MLP and output, ln_f and the logits, the "
                                    "first that differs and why. Exit 0: matches; 1: differs; 2: could not run. "
                                    + warning, epilog=warning)
    cm.add_argument("src", metavar="SRC")
    cm.add_argument("--class", dest="cls", default=None, metavar="FILE.py:Class", help="your model class")
    cm.add_argument("--from", dest="src_format", choices=["hf", "openai", "book", "nanogpt"], default=None,
                    help="format of SRC (default: detected)")
    cm.add_argument("--book-config", default=None, metavar="JSON", help="the book's config dict (JSON or a JSON file)")
    cm.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    cm.add_argument("--tokens", type=int, default=8, help="tokens per sequence (default 8, at most n_ctx)")
    cm.add_argument("--seed", type=int, default=0, help="seed of the random ids (default 0)")
    cm.add_argument("--atol", type=float, default=1e-6, help="tolerance, times max(1, |activation|) (default 1e-6)")
    cm.add_argument("--json", action="store_true", help="print one JSON object")
    cm.set_defaults(func=cmd_check_model)
def cmd_serve(args) -> int:
    import logging

    try:
        from .serve import serve
    except ImportError as e:
        raise SystemExit(f"error: gpt2mha serve needs FastAPI and uvicorn ({e}): pip install 'gpt2mha[serve]' "
                         f"(from a clone of the repository: pip install -e '.[serve]')")
    from .tokenizer import tokenizer_for
    from . import DEFAULT_MODEL

    for name in ("max_batch", "max_queue"):
        value = getattr(args, name)
        if value < (1 if name == "max_batch" else 0):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= {1 if name == 'max_batch' else 0}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be >= 1")
        import torch
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    model = quantized(load_model(args.model, args.dtype), args)
    name = args.served_model_name or args.model or DEFAULT_MODEL
    serve(model, tokenizer_for(model.config), name, host=args.host, port=args.port,
          max_batch=args.max_batch, max_queue=args.max_queue, graceful_timeout=args.graceful_timeout)
    return 0


def _add_serve_command(sub) -> None:
    """Parser of ``serve`` (:mod:`gpt2mha.serve`, :mod:`gpt2mha.scheduler`)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions) with continuous batching",
                       formatter_class=DefaultsHelpFormatter,
                       description="Serve the model over HTTP in the OpenAI completions format: POST /v1/completions "
                                   "(streaming with server-sent events), GET /v1/models, GET /health. Requests are "
                                   "batched continuously: every decode step advances all running sequences, new "
                                   "ones join at the next step. Needs the 'serve' extra: pip install -e '.[serve]'.")
    _model_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype")
    s.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (cache slots)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="sequences that may wait for a slot; beyond it requests get HTTP 429")
    s.add_argument("--threads", type=int, default=None,
                   help="torch's intra-op threads for the model (default: torch's choice, one per core); on a "
                        "machine shared with other work, fewer threads than cores avoid oversubscription")
    s.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and requests' 'model' field (default: --model as given)")
    _quantize_args(s)
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="gpt2mha", description="GPT-2 multi-head attention, exact and fast.")
    parser.add_argument("--version", action="version", version=f"gpt2mha {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt (streams tokens as they are sampled)",
                       formatter_class=DefaultsHelpFormatter)
    g.add_argument("prompt", metavar="PROMPT", nargs="*",
                   help="text to continue; several PROMPTs are sampled as one batch and printed as labelled samples")
    g.add_argument("--prompt-file", "-f", default=None, metavar="FILE",
                   help="read the prompt from FILE (its exact UTF-8 text, a final newline included), '-' for "
                        "standard input; instead of PROMPT")
    _model_arg(g)
    g.add_argument("--unconditional", action="store_true",
                   help="sample from <|endoftext|> alone, as OpenAI's generate_unconditional_samples.py (BPE models)")
    g.add_argument("--num-samples", type=int, default=1, help="samples per PROMPT, printed one after another, labelled")
    g.add_argument("--max-new-tokens", type=int, default=100, help="number of tokens to generate (>= 0)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep only tokens at least this fraction as likely as the most likely one, after "
                        "--temperature (transformers' min_p); in [0, 1], 0: off")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights' dtype; on CPU bfloat16/float16 halve the weights' memory but decode no "
                        "faster than float32 (benchmarks/RESULTS.md); logits stay float32")
    g.add_argument("--stop-at-eos", action="store_true", help="stop when <|endoftext|> is sampled")
    g.add_argument("--sliding-window", action="store_true",
                   help="allow prompt + new tokens beyond n_ctx by keeping only the last n_ctx tokens")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: split the heads over this many processes "
                        "(torchrun --nproc-per-node N -m gpt2mha generate ... --tp N; README 'Scaling out')")
    _quantize_args(g)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="loss, perplexity and bits per byte of a text file",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("file", metavar="FILE")
    _model_arg(p)
    p.add_argument("--stride", type=int, default=None, help="window step in tokens (default n_ctx // 2)")
    p.add_argument("--split", choices=["all", "train", "val"], default="all",
                   help="score the whole file, or the trainer's split of it (train: first 90%% of the bytes, "
                        "val: last 10%%)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights' dtype, as for generate (the logits and the loss stay float32)")
    _quantize_args(p)
    p.set_defaults(func=cmd_perplexity)

    t = sub.add_parser("train", help="train a GPT-2 on a text file (first 90%% train, last 10%% validation)")
    t.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file")
    t.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory (new, or ours with --resume)")
    t.add_argument("--preset", default=None,
                   help="size preset of a new run (tiny, shakespeare, 124M, ...; default tiny); the flags below "
                        "override it")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--n-ctx"):
        t.add_argument(flag, type=int, default=None)
    t.add_argument("--tokenizer", choices=["bytes", "gpt2"], default=None,
                   help="of a new run (default: gpt2 for the GPT-2 presets, else bytes)")
    t.add_argument("--iters", type=int, default=None, help="optimizer steps in all (default 2000)")
    t.add_argument("--batch-size", type=int, default=None, help="windows per step, the global batch (default 32)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    t.add_argument("--min-lr", type=float, default=None, help="the cosine's floor (default 2e-4)")
    t.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default 100)")
    t.add_argument("--eval-interval", type=int, default=None,
                   help="validate and checkpoint every this many steps (default 250)")
    t.add_argument("--attn-pdrop", type=float, default=None, help="dropout on attention weights (default 0)")
    t.add_argument("--resid-pdrop", type=float, default=None,
                   help="dropout on residual branches and embeddings (default 0)")
    t.add_argument("--seed", type=int, default=None, help="initialisation and batch sampler (default 1337)")
    t.add_argument("--resume", action="store_true",
                   help="continue the checkpoint in --out with its settings, optimizer and random states; the "
                        "options above given here override its settings (one line each says so); the model's "
                        "sizes and the seed cannot change")
    t.add_argument("--init-from", default=None, metavar="MODEL",
                   help="fine-tune: start a new run at step 0, with its own optimizer, from MODEL's weights (any "
                        "--model value: built-in name, directory, hub id, nanoGPT ckpt.pt, ...); the data is read "
                        "with MODEL's tokenizer; only dropout may differ from MODEL's config")
    t.set_defaults(func=cmd_train)
    _add_inspect_commands(sub)
    _add_bench_command(sub)
    _add_formats_commands(sub)
    _add_serve_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .parallel import launched
    try:
        with launched(args.command):          # joins torchrun's process group for generate/train/perplexity
            return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                   # e.g. `gpt2mha generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
