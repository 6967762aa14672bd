"""The other commands: ``trace``, ``heads``, ``check``, ``check-model``, ``convert``, ``bench``, ``serve``
(``ablate``, ``patch`` and ``lens`` are in :mod:`.interventions`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .checks import (BENCH_SECTIONS, check_bench_args, check_compile, check_check_args, check_check_model_args, check_convert_args,
                     check_heads_args, check_trace_args)
from .common import (batch_invariant_arg, DEFAULT_MAX_BODY_BYTES, DTYPES, DefaultsHelpFormatter, check_quantize_args, json_arg, load_model,
                     model_arg, number, quantize_args, quantized, quiet_arg)
from .interventions import add_intervene_commands


def cmd_trace(args) -> int:
    from ..learn.trace import format_trace, trace

    tr = trace(args.layout, b=args.batch, T=args.tokens, d_in=args.d_in, d_out=args.d_out, num_heads=args.num_heads,
               context_length=args.context_length, past=args.past)
    print(json.dumps(tr.to_dict()) if args.json else format_trace(tr))
    return 0


def cmd_heads(args) -> int:
    from ..inference.sampling import check_logits
    from ..learn.heads import (ROLE_THRESHOLD, analyse_heads, check_selection, format_strongest, selected_heads,
                              strongest_heads, top_heads)
    from ..learn.heads_html import write_heads

    model = load_model(args.model, args.dtype)                    # (--top, --out: check_heads_args)
    c = model.config
    check_selection(c.n_layer, c.n_head, args.layer, args.head)   # before the (slower) forward pass
    result = analyse_heads(model, args.prompt)
    check_logits(result.weights, what="attention weights", on="PROMPT")
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
    print(f"every step of the attention with these numbers, interactive: {explain_command(args.prompt, args.model)}")
    return 0


def explain_command(prompt: str, model: str | None) -> str:
    """The ``gpt2mha explain`` line that opens PROMPT (and MODEL) in the interactive page."""
    import shlex
    return f"gpt2mha explain {shlex.quote(prompt)}" + (f" --model {shlex.quote(model)}" if model else "")


def cmd_check(args) -> int:
    from ..learn.check import CheckError, check, format_report
    from ..learn.check_load import parse_args

    try:                                                          # (--seed, the sizes: check_check_args)
        kwargs = parse_args(args.args)
    except CheckError as e:
        print(f"error: {e}\nresult: COULD NOT RUN (exit 2)", file=sys.stderr)
        return 2
    report = check(args.target, kwargs, batch=args.batch, tokens=args.tokens, past=args.past, seed=args.seed,
                   long_tokens=args.long_tokens)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return report.exit_code


def _add_inspect_commands(sub) -> None:
    """Parsers of ``trace``, ``heads`` and ``check`` (:mod:`gpt2mha.learn.trace`, :mod:`gpt2mha.learn.heads`,
    :mod:`gpt2mha.learn.check`)."""
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
    tr.set_defaults(func=cmd_trace, check=check_trace_args)

    hd = sub.add_parser("heads", help="attention maps of every layer and head, and head roles, for a prompt",
                        description="Run the model on PROMPT through the explicit attention path and write "
                                    "OUT/grid.png (every layer x head map), OUT/layer{L}_head{H}.png per selected "
                                    "head and OUT/heads.html (self-contained). Gives each head one role, its "
                                    "strongest: previous-token, first-token, self (on PROMPT) or induction (on a "
                                    "repeated random sequence), scored relative to uniform attention, or 'no clear "
                                    "role' below the threshold. Layers and heads are numbered from 0.")
    hd.add_argument("prompt", metavar="PROMPT")
    model_arg(hd)
    hd.add_argument("--layer", type=int, default=None, help="layer to draw at full size (default: see --head)")
    hd.add_argument("--head", type=int, default=None,
                    help="head to draw at full size; with only --layer: every head of it; with only --head: that "
                         "head in every layer; with neither: the strongest head of each role")
    hd.add_argument("--out", default="heads", metavar="DIR", help="output directory (default ./heads)")
    hd.add_argument("--top", type=int, default=3, help="heads listed per role (default 3)")
    hd.add_argument("--json", action="store_true", help="print files, strongest heads and all scores as JSON")
    hd.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="weights' dtype, as for generate (default float32)")
    hd.set_defaults(func=cmd_heads, check=check_heads_args)

    warning = ("WARNING: check imports FILE.py and runs its code (module body, constructor, forward) with your "
               "permissions. Only check files you trust.")
    ck = sub.add_parser("check", help="check a multi-head attention module you wrote (RUNS the file's code)",
                        description="Build FILE.py:ClassName, recognise its parameter layout (W_query/W_key/W_value/"
                                    "out_proj; q_proj/k_proj/v_proj/o_proj; a fused qkv Linear; c_attn/c_proj "
                                    "Conv1D; a heads ModuleList; a torch.nn.MultiheadAttention inside; single heads "
                                    "such as the book's CausalAttention), copy reference weights in, run both on "
                                    "the same "
                                    "input and report the shapes stage by stage, the first differing stage, the "
                                    "max abs error and a diagnosis of classic mistakes. The module is also rebuilt "
                                    "with another head count and run at --long-tokens tokens, and a cached step is "
                                    "compared when forward takes a cache (a returned present fed back as past / "
                                    "layer_past / past_key_values, with use_cache; a cache object, transformers' "
                                    "Cache interface, a dict or a list filled in place; a cache kept in the module "
                                    "with use_cache=True or start_pos). Exit code 0: matches; 1: "
                                    "runs but does not match; 2: could not be run; 3: matches without a cache, but "
                                    "forward takes a cache that no convention could use (or --past 0), so the "
                                    "cached path was not compared. " + warning,
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
    ck.add_argument("--long-tokens", type=int, default=70,
                    help="a second sequence length checked, past 64 (default 70; 0: skip); a context length given "
                         "in --args caps it")
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--json", action="store_true", help="print one JSON object")
    ck.set_defaults(func=cmd_check, check=check_check_args)


def cmd_bench(args) -> int:
    """``benchmarks/bench.py`` of the source checkout this package runs from (the benchmarks are
    not installed with the package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks", "bench.py")
    if not os.path.isfile(path):
        raise ValueError("gpt2mha bench runs benchmarks/bench.py from a source checkout of gpt2mha (git clone, then "
                         "pip install -e .); this installation has no benchmarks/ directory")
    spec = importlib.util.spec_from_file_location("gpt2mha_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench                              # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench.main_args(args)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gpt2mha bench`` and ``python benchmarks/bench.py`` (kept here, without torch,
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
    b.set_defaults(func=cmd_bench, check=check_bench_args)


def cmd_convert(args) -> int:
    from ..io.formats import convert

    if args.quantize is None and (args.group_size is not None or args.calibration is not None
                                  or args.quantize_method is not None or args.quantize_head is not None):
        quantized(None, args)                                   # the named error for a stray option
    # --activations alone sets the mode on a model saved int8 (and names the flag for a float one)
    written = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, src_format=args.src_format,
                      book_config=json_arg(args.book_config, "--book-config"),
                      quantize=(lambda m: quantized(m, args)) if args.quantize or args.activations else None,
                      lora=args.lora)
    print("wrote " + ", ".join(written))
    return 0


def cmd_check_model(args) -> int:
    from ..learn.compare import check_model, format_model_report

    report = check_model(args.src, cls=args.cls, fmt=args.src_format, book_config=json_arg(args.book_config, "--book-config"),
                         batch=args.batch, tokens=args.tokens, seed=args.seed, atol=args.atol)
    print(json.dumps(report.to_dict()) if args.json else format_model_report(report))
    return report.exit_code


def _add_formats_commands(sub) -> None:
    """Parsers of ``convert`` and ``check-model`` (:mod:`gpt2mha.io.formats`, :mod:`gpt2mha.learn.compare`)."""
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
    cv.add_argument("--lora", action="append", default=None, metavar="ADAPTER",
                    help="merge a LoRA adapter into SRC's weights first, so DST is a plain checkpoint: a PEFT adapter "
                         "directory (adapter_config.json + adapter_model.safetensors) or the book's appendix-E .pth "
                         "(lora_alpha from --book-config or NAME.json); repeat to merge several, in order. The book's "
                         "appendix-E .pth as SRC is merged without it")
    quantize_args(cv)
    quiet_arg(cv)
    cv.set_defaults(func=cmd_convert, check=check_convert_args)

    warning = "WARNING: with --class, FILE.py is imported and run with your permissions. Only use files you trust."
    cm = sub.add_parser("check-model", help="compare your whole model with gpt2mha on the same checkpoint, layer by layer",
                        description="Load SRC into gpt2mha and into your own model (--class FILE.py:Class: the book's "
                                    "GPTModel built with the config dict, nanoGPT's GPT built with GPTConfig(**model_args), "
                                    "each loaded with its load_state_dict from the file's tensors) or, without --class, "
                                    "the format's reference (the book's chapter 4 GPTModel; nanoGPT's model.py GPT, "
                                    "built in: nanoGPT need not be installed; NumPy's OpenAI formulas for "
                                    "OpenAI/Hugging Face checkpoints). Run both on the same ids in float64 and report "
                                    "the embeddings, each block's attention, MLP and output, ln_f and the logits, the "
                                    "first that differs and why. A nanoGPT checkpoint implies nanoGPT's exact (erf) "
                                    "GELU where GPT-2 (and gpt2mha) use the tanh approximation: a model that matches "
                                    "gpt2mha run with the erf GELU matches up to the format's GELU, reported with the "
                                    "logits' difference the tanh GELU makes (exit 0). Exit 0: matches; 1: differs; "
                                    "2: could not run. " + warning, epilog=warning)
    cm.add_argument("src", metavar="SRC", help="a checkpoint file or directory in any format convert reads, a "
                                               "built-in model name or a hub id (as --model)")
    cm.add_argument("--class", dest="cls", default=None, metavar="FILE.py:Class", help="your model class")
    cm.add_argument("--from", dest="src_format", choices=["hf", "openai", "book", "nanogpt"], default=None,
                    help="format of SRC (default: detected)")
    cm.add_argument("--book-config", default=None, metavar="JSON", help="the book's config dict (JSON or a JSON file)")
    cm.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    cm.add_argument("--tokens", type=int, default=8, help="tokens per sequence (default 8, at most n_ctx)")
    cm.add_argument("--seed", type=int, default=0, help="seed of the random ids (default 0)")
    cm.add_argument("--atol", type=float, default=1e-6, help="tolerance, times max(1, |activation|) (default 1e-6)")
    cm.add_argument("--json", action="store_true", help="print one JSON object")
    cm.set_defaults(func=cmd_check_model, check=check_check_model_args)


def cmd_serve(args) -> int:
    import logging

    try:
        from ..serving.server import serve
    except ImportError as e:
        raise SystemExit(f"error: gpt2mha serve needs FastAPI and uvicorn ({e}): pip install 'gpt2mha[serve]' "
                         f"(from a clone of the repository: pip install -e '.[serve]')")
    from .. import DEFAULT_MODEL
    from ..serving.chat import load_chat_template

    try:                                      # before loading the model: a bad file fails at once
        template = load_chat_template(args.chat_template)         # a built-in name, none, or a file
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    if args.threads is not None:              # (the numbers were checked by argparse, the flags by main)
        import torch
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    name = args.served_model_name or args.model or DEFAULT_MODEL

    def load():                               # in serve's loading thread, once the port is open
        return served_model(args)[:2]

    try:
        serve(None, None, name, host=args.host, port=args.port, max_batch=args.max_batch,
              max_queue=args.max_queue, graceful_timeout=args.graceful_timeout, max_body_bytes=args.max_body_bytes,
              chat_template=template, max_stop=args.max_stop, batch_invariant=args.batch_invariant,
              compile=args.compile, api_key=args.api_key, metrics=not args.no_metrics, load=load,
              max_tokens_overflow=args.max_tokens_overflow, lora=lora_args(args.lora),
              prefix_cache_mb=0 if args.no_prefix_cache else args.prefix_cache_mb)
    except RuntimeError as e:                 # could not bind: uvicorn logged why
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def lora_args(specs: list[str] | None) -> dict[str, str]:
    """``--lora name=DIR`` flags → ``{name: DIR}``.

    Raises:
        ValueError: a flag without ``name=``, a name given twice, a path that does not exist.
    """
    out = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=DIR (the model id requests use, then the adapter)")
        if name in out:
            raise ValueError(f"--lora {spec!r}: the name {name!r} is given twice")
        if not os.path.exists(path):
            raise ValueError(f"--lora {spec!r}: {path}: no such file or directory")
        out[name] = path
    return out


def served_model(args):
    """What ``gpt2mha serve`` serves for its parsed ``args``: ``(model, tokenizer, name)``, the
    model loaded (and quantized) from ``--model``, served as ``--served-model-name`` or else
    ``--model`` as given (the built-in name without one)."""
    from .. import DEFAULT_MODEL
    from ..io.tokenizer import tokenizer_for

    model = quantized(load_model(args.model, args.dtype), args)
    return model, tokenizer_for(model.config), args.served_model_name or args.model or DEFAULT_MODEL


def check_serve_args(args, address: bool = True) -> None:
    """What ``serve``'s line alone decides, before torch is imported and the model loaded: the
    quantization flags, that ``--host``/``--port`` can be listened on now (a port in use is
    one error line, exit 2, at once: :func:`gpt2mha.serving.address.check_address`; not with
    ``address`` False: Ray Serve's proxy of a running cluster listens there), and the
    API key (:func:`serve_api_key`, set in ``args.api_key``)."""
    from ..serving.address import check_address

    check_quantize_args(args)
    check_compile(args)
    lora_args(args.lora)
    if args.lora and args.compile:
        raise ValueError("--lora with --compile: the compiled step runs no adapters; serve adapters on the decode view "
                         "(drop --compile)")
    if address:
        check_address(args.host, args.port)
    args.api_key = serve_api_key(args)


#: The environment variable ``gpt2mha serve`` reads its API key from when no flag gives one.
API_KEY_ENV = "GPT2MHA_API_KEY"


def serve_api_key(args) -> str | None:
    """``gpt2mha serve``'s API key: ``--api-key``, else the first line of ``--api-key-file``, else
    :data:`API_KEY_ENV`, else None (no authentication).

    Raises:
        ValueError: both flags, a file that cannot be read, or an empty key.
    """
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key, where = f.readline().strip(), f"--api-key-file {args.api_key_file}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
    elif args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif os.environ.get(API_KEY_ENV) is not None:
        key, where = os.environ[API_KEY_ENV].strip(), API_KEY_ENV
    else:
        return None
    if not key:
        raise ValueError(f"{where}: the API key is empty")
    return key


#: ``gpt2mha serve --max-stop`` default (:data:`gpt2mha.serving.protocol.MAX_STOP`, repeated so that
#: parsing arguments needs no FastAPI; tests/test_serve_lifecycle.py checks that the two agree)
DEFAULT_MAX_STOP = 64


def _add_serve_command(sub) -> None:
    """Parser of ``serve`` (:mod:`gpt2mha.serving`)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions) with continuous batching",
                       formatter_class=DefaultsHelpFormatter,
                       description="Serve the model over HTTP in the OpenAI completions format: POST /v1/completions "
                                   "(streaming with server-sent events), POST /v1/chat/completions (through "
                                   "--chat-template), GET /v1/models, POST /tokenize, POST /detokenize, "
                                   "GET /tokenizer_info; GET /live, /health (readiness), /version, /metrics. Requests "
                                   "are batched continuously: every decode step advances all running sequences, new "
                                   "ones join at the next step. The port opens at once and the model loads behind it "
                                   "(/health says ok once it is warmed up); SIGTERM drains (/health 503, new requests "
                                   "503, in-flight ones finish within --graceful-timeout), then exits 0.")
    model_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=number(int, 0, 65535, " (0: any free port)"), default=8000,
                   help="port (0: any free port)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype")
    s.add_argument("--max-batch", type=number(int, 1), default=16, help="sequences decoded together (cache slots)")
    batch_invariant_arg(s)
    s.add_argument("--max-queue", type=number(int, 0), default=256,
                   help="sequences that may wait for a slot; beyond it requests get HTTP 429 (retry later). A "
                        "request with more prompts than --max-batch + --max-queue gets 400: it can never fit")
    s.add_argument("--prefix-cache-mb", type=number(float, 0), default=None,
                   help="MiB of keys and values of prompt prefixes kept for later prompts that start the same "
                        "(least recently used evicted; default: a tenth of the memory available, at most 1024; "
                        "0: off). Exact: on only on routes where a prompt served from it gets the same bits "
                        "(docs/explanation/prefix-caching.md)")
    s.add_argument("--no-prefix-cache", action="store_true", help="no prefix cache (as --prefix-cache-mb 0)")
    s.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch's intra-op threads for the model (default: torch's choice, one per core); on a "
                        "machine shared with other work, fewer threads than cores avoid oversubscription")
    s.add_argument("--graceful-timeout", type=number(float, 0), default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish while the server drains (/health "
                        "and new requests 503); then they are cancelled (HTTP 503, or an error event ending a stream)")
    s.add_argument("--max-body-bytes", type=number(int, 1), default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest request body accepted; larger ones get HTTP 413")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and requests' 'model' field (default: --model as given)")
    s.add_argument("--chat-template", default="plain", metavar="NAME|FILE",
                   help="the chat template of POST /v1/chat/completions: a built-in one by name (plain: 'role: "
                        "content' lines then 'assistant:'; chatml: ChatML turns; alpaca: the book's chapter-7 "
                        "instruction format, format_input then '### Response:'), none (no chat: that route answers "
                        "400), or a Jinja file (transformers' apply_chat_template semantics: messages, "
                        "add_generation_prompt, bos_token, eos_token; a .json file: its 'chat_template')")
    s.add_argument("--max-stop", type=number(int, 1), default=DEFAULT_MAX_STOP, metavar="N",
                   help="stop strings a request may send; more get HTTP 400 (lm-evaluation-harness sends a task's "
                        "'until' strings plus the EOS string: 1 + len(until); OpenAI's API takes 4, vLLM and "
                        "llama.cpp's server have no limit)")
    s.add_argument("--max-tokens-overflow", choices=["clip", "refuse"], default="clip",
                   help="a request whose max_tokens goes past the room its prompt leaves in the context: clip "
                        "(its completion ends where the context does, finish_reason 'length', as llama.cpp's "
                        "server; clients' defaults such as LangChain's max_tokens=256 then work on small-context "
                        "models) or refuse (HTTP 400 context_length_exceeded, as OpenAI's API and vLLM)")
    s.add_argument("--lora", action="append", default=None, metavar="NAME=DIR",
                   help="serve a LoRA adapter (a PEFT directory, or the book's appendix-E .pth with lora_alpha in its "
                        "NAME.json) unmerged over the one base model as model id NAME; repeat for several. Requests "
                        "pick one by 'model' (the base by its own name); rows of different adapters batch together, "
                        "each with the tokens it gets alone under --batch-invariant. Quantized bases apply adapters "
                        "in float")
    s.add_argument("--compile", action="store_true",
                   help="serve on the compiled decode step (as generate --compile), compiled before /health says ok")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /live, /health, /version and "
                        "/metrics (401 otherwise); default: the GPT2MHA_API_KEY environment variable, else none. A key "
                        "on the command line shows in ps: prefer the variable or --api-key-file")
    s.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE's first line")
    s.add_argument("--no-metrics", action="store_true",
                   help="do not serve GET /metrics (Prometheus text format, vLLM's metric names under gpt2mha:)")
    quantize_args(s)
    s.set_defaults(func=cmd_serve, check=check_serve_args)

    i = sub.add_parser("info", help="a model's shapes, weights and the route its prefill and decode take (and why)",
                       formatter_class=DefaultsHelpFormatter,
                       description="Print the model's sizes and weights, whether gpt2mha's C++ kernels are loaded, "
                                   "and the route generate and serve take for it with these flags (and why not the "
                                   "others). With --quantize the route is that of the model quantized so, found "
                                   "without running GPTQ (the route depends on the scheme, group size, activations "
                                   "and head, not on how the weights are rounded).")
    model_arg(i)
    i.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype")
    i.add_argument("--compile", action="store_true", help="the route with generate --compile")
    batch_invariant_arg(i)
    quantize_args(i)
    i.set_defaults(func=cmd_info, check=check_quantize_args)


def cmd_info(args) -> int:
    """``gpt2mha info``: the model's config, its quantization and the route generate and serve
    take for it (:func:`~gpt2mha.inference.decoders.choose_decoder`), with why not the others.

    With ``--quantize`` (a float model): the route the model quantized so takes, found on the
    model rounded to nearest, not by GPTQ (seconds to minutes): the route reads the layers'
    schemes, group size, activations and head, never how their weights were rounded."""
    from ..inference.decoders import choose_decoder

    model = load_model(args.model, args.dtype)
    if args.quantize is not None and not getattr(model, "quantization", None):
        args = argparse.Namespace(**{**vars(args), "quantize_method": "rtn", "calibration": None})
    model = quantized(model, args)
    c = model.config
    q = getattr(model, "quantization", None) or {}
    print(f"model        {args.model or 'the built-in model'}: n_layer {c.n_layer}, n_head {c.n_head}, n_embd "
          f"{c.n_embd}, n_ctx {c.n_ctx}, n_vocab {c.n_vocab}, {sum(p.numel() for p in model.parameters()):,} "
          f"float parameters")
    print(f"weights      {model.wte.weight.dtype}" + (f", {q.get('scheme')} ({q.get('activations', 'exact')} "
                                                     f"activations, {q.get('head', 'int8')} head)" if q else ""))
    from .. import kernels
    print("kernels      " + ("gpt2mha's C++ kernels loaded" if kernels.available() else
                             f"not loaded: {kernels.unavailable_reason()}"))
    route = choose_decoder(model, compile=args.compile, batch_invariant=args.batch_invariant)
    d = route.decoder
    print(f"decode       the {d.name} ({'batch invariant' if d.batch_invariant else 'not batch invariant'}, "
          f"{'hooks act' if d.runs_hooks else 'while a hook is attached: the decode view'})")
    print("prefill      " + route.describe().split("prefill: ")[1].split(";")[0])
    from ..inference.prefix_cache import why_inexact
    why = why_inexact(d)
    print("prefix cache " + (f"off: {why}" if why else "exact here (gpt2mha serve keeps it on; --no-prefix-cache)"))
    for name, why in route.why_not.items():
        print(f"not the {name}: {why}")
    return 0


def add_commands(sub) -> None:
    """The ``trace``, ``heads``, ``ablate``, ``patch``, ``lens``, ``check``, ``check-model``, ``convert``, ``bench``
    and ``serve`` subcommands."""
    _add_inspect_commands(sub)
    add_intervene_commands(sub)
    _add_bench_command(sub)
    _add_formats_commands(sub)
    _add_serve_command(sub)
