"""The other commands: ``trace``, ``heads``, ``ablate``, ``patch``, ``lens``, ``check``, ``check-model``, ``convert``,
``bench``, ``serve``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .common import (batch_invariant_arg, DEFAULT_MAX_BODY_BYTES, DTYPES, DefaultsHelpFormatter, check_quantize_args, json_arg, load_model,
                     model_arg, number, quantize_args, quantized)


#: The largest size trace accepts for any one axis (it builds meta tensors, but their element
#: counts must still fit in int64).
TRACE_MAX_SIZE = 2**20


def cmd_trace(args) -> int:
    from ..learn.trace import format_trace, trace

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
    from ..learn.heads import (ROLE_THRESHOLD, analyse_heads, check_selection, format_strongest, selected_heads,
                              strongest_heads, top_heads)
    from ..learn.heads_html import write_heads

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


def _prompt_ids(model, text: str, name: str, at_least: int = 1):
    """``(tokenizer, ids [1, T])`` of a command-line prompt, checked against the model's context."""
    import torch

    from ..io.tokenizer import tokenizer_for

    tok = tokenizer_for(model.config)
    ids = tok.encode(text) if text else []
    if len(ids) < at_least:
        raise ValueError(f"{name} is {len(ids)} tokens; expected at least {at_least}")
    if len(ids) > model.config.n_ctx:
        raise ValueError(f"{name} is {len(ids)} tokens but the model's context is n_ctx={model.config.n_ctx}")
    return tok, torch.tensor([ids], dtype=torch.long, device=model.wte.weight.device)


def _label(tok, i: int) -> str:
    from ..learn.heads import token_labels
    return token_labels(tok, [i])[0]


def cmd_ablate(args) -> int:
    import torch

    from ..learn.interventions import ablate_heads, next_token_shift, parse_heads

    model = load_model(args.model, args.dtype).eval()
    c = model.config
    heads = parse_heads(args.heads, c.n_layer, c.n_head)        # before the forward passes
    tok, idx = _prompt_ids(model, args.prompt, "PROMPT")
    with torch.no_grad():
        before = model(idx).logits[0, -1]
        after = ablate_heads(model, idx, heads, mean=args.mean)[0, -1]
    shift = next_token_shift(before, after, args.top)
    mode = "mean (each head's mean output over the prompt's positions)" if args.mean else "zero"
    for row in shift["tokens"]:
        row["token"] = _label(tok, row["id"])
    if args.json:
        print(json.dumps({"heads": heads, "mode": "mean" if args.mean else "zero", **shift}))
        return 0
    print(f"{idx.shape[1]} tokens; ablated ({mode}): " + ", ".join(f"layer {l} head {h}" for l, h in heads))
    print(f"{'next token':<14} {'before':>8} {'after':>8} {'change':>8}")
    for row in shift["tokens"]:
        print(f"{row['token']:<14} {row['before']:8.4f} {row['after']:8.4f} {row['after'] - row['before']:+8.4f}")
    b, a = _label(tok, shift["top_before"][0]), _label(tok, shift["top_after"][0])
    print(f"KL(before || after) = {shift['kl']:.4g} nats; largest logit change {shift['max_logit_change']:.4g}; "
          f"top token {b!r} -> {a!r}")
    return 0


def _patch_metric(args, tok):
    from ..learn.interventions import logit_diff

    def first(text, flag):
        ids = tok.encode(text) if text else []
        if not ids:
            raise ValueError(f"{flag} {text!r} is empty; give the token text the model should (not) predict")
        return ids[0], len(ids)
    if args.answer is None:
        raise ValueError("--answer is required: the token the clean prompt should predict next")
    answer, n = first(args.answer, "--answer")
    wrong = None
    if args.metric == "logit-diff":
        if args.wrong is None:
            raise ValueError("--metric logit-diff needs --wrong (the token the corrupted prompt predicts); "
                             "or use --metric logprob")
        wrong, _ = first(args.wrong, "--wrong")
        if wrong == answer:
            raise ValueError(f"--answer and --wrong start with the same token {_label(tok, answer)!r}; "
                             f"the logit difference would be 0")
    return logit_diff(answer, wrong), answer, wrong, n


def cmd_patch(args) -> int:
    from ..learn.heads import token_labels
    from ..learn.intervention_plots import heatmap
    from ..learn.interventions import patch

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; expected a directory (created if missing)")
    model = load_model(args.model, args.dtype).eval()
    tok, clean = _prompt_ids(model, args.clean, "CLEAN")
    _, corrupt = _prompt_ids(model, args.corrupt, "CORRUPT")
    if clean.shape != corrupt.shape:
        raise ValueError(f"CLEAN is {clean.shape[1]} tokens and CORRUPT is {corrupt.shape[1]}: activation patching "
                         f"needs prompts of the same length (reword one)")
    metric, answer, wrong, n_answer = _patch_metric(args, tok)
    res = patch(model, clean, corrupt, args.hook, metric, per_position=args.per_position or None, last_only=True)
    try:
        shown, what = res.normalized(), "restored share"
    except ValueError:
        shown, what = res.values, f"{args.metric} (clean and corrupt runs are equal)"
    grid = shown if shown.dim() == 2 else shown.sum(-1) if shown.dim() == 3 else shown[:, None]
    cols = res.axes[1] if shown.dim() == 2 else "pos" if shown.dim() == 3 else "layer"
    labels = token_labels(tok, clean[0].tolist())
    col_labels = [str(i) for i in range(grid.shape[1])] if cols == "head" else \
        [f"{i}:{t}" for i, t in enumerate(labels)] if cols == "pos" else ["all"]
    title = (f"patching {res.hook}: {args.metric}, answer {_label(tok, answer)!r}"
             + (f" vs {_label(tok, wrong)!r}" if wrong is not None else "") + ("; summed over heads" if shown.dim() == 3 else "")
             + ("\n1 = the patch restores the clean run, 0 = no effect" if shown is not res.values else ""))
    png = os.path.join(args.out, "patch.png")
    heatmap(png, grid, [str(l) for l in range(grid.shape[0])], col_labels, title, cols, "layer", what)
    out = {"hook": res.hook, "axes": list(res.axes), "metric": args.metric, "answer": _label(tok, answer),
           "answer_tokens": n_answer, "wrong": None if wrong is None else _label(tok, wrong), "clean": res.clean,
           "corrupt": res.corrupt, "values": res.values.tolist(), "normalized": shown.tolist() if shown is not res.values
           else None, "tokens": labels, "png": png}
    with open(os.path.join(args.out, "patch.json"), "w") as f:
        json.dump(out, f)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.metric}: clean {res.clean:.4g}, corrupt {res.corrupt:.4g} (answer {_label(tok, answer)!r}"
          + (f", its first of {n_answer} tokens" if n_answer > 1 else "") + ")")
    flat = shown.flatten().argsort(descending=True)[:5].tolist()
    print(f"largest effects ({what}" + (": (patched - corrupt) / (clean - corrupt)" if shown is not res.values else "")
          + "):")
    for j in flat:
        where = [int(v) for v in torch_unravel(j, tuple(shown.shape))]
        print("  " + ", ".join(f"{a} {v}" for a, v in zip(res.axes, where)) + f": {float(shown.flatten()[j]):.4g}")
    print(f"wrote {png}, {os.path.join(args.out, 'patch.json')}")
    return 0


def torch_unravel(j: int, shape: tuple) -> list[int]:
    """Index ``j`` of a flattened tensor of ``shape`` as one index per axis."""
    out = []
    for n in reversed(shape):
        out.append(j % n)
        j //= n
    return out[::-1]


def cmd_lens(args) -> int:
    from ..learn.heads import token_labels
    from ..learn.intervention_plots import lens_picture
    from ..learn.interventions import logit_lens

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file; expected a directory (created if missing)")
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be at least 1")
    model = load_model(args.model, args.dtype).eval()
    tok, idx = _prompt_ids(model, args.prompt, "PROMPT")
    lens = logit_lens(model, idx, top_k=min(args.top, model.config.n_vocab))
    labels = token_labels(tok, idx[0].tolist())
    top = [[token_labels(tok, lens.ids[r, 0, t].tolist()) for t in range(idx.shape[1])] for r in range(len(lens.labels))]
    png = os.path.join(args.out, "lens.png")
    lens_picture(png, lens.probs[:, 0, :, 0], [[cell[0] for cell in row] for row in top], lens.labels,
                 [f"{i}:{t}" for i, t in enumerate(labels)], f"logit lens: top token of the residual stream "
                 f"through ln_f and the head ({len(labels)} tokens)")
    out = {"layers": lens.labels, "tokens": labels, "top": top, "probs": lens.probs[:, 0].tolist(),
           "next_token_probs": lens.target_probs[:, 0].tolist(), "png": png}
    with open(os.path.join(args.out, "lens.json"), "w") as f:
        json.dump(out, f)
    if args.json:
        print(json.dumps(out))
        return 0
    shown = range(max(0, len(labels) - args.columns), len(labels))
    if len(shown) < len(labels):
        print(f"(last {len(shown)} of {len(labels)} positions; all are in {png})")
    print(f"{'':<11}" + "".join(f"{labels[t][:9]:>10}" for t in shown))
    for r, name in enumerate(lens.labels):
        print(f"{name:<11}" + "".join(f"{top[r][t][0][:9]:>10}" for t in shown))
    print(f"wrote {png}, {os.path.join(args.out, 'lens.json')}")
    return 0


def _add_intervene_commands(sub) -> None:
    """Parsers of ``ablate``, ``patch`` and ``lens`` (:mod:`gpt2mha.learn.interventions`)."""
    ab = sub.add_parser("ablate", help="ablate attention heads and print how the next-token distribution moves",
                        description="Run PROMPT with the given heads' outputs (hook_z) set to zero, or with --mean to "
                                    "their mean over the prompt's positions, and compare the next-token distribution "
                                    "with the plain run. Layers and heads are numbered from 0.")
    ab.add_argument("prompt", metavar="PROMPT")
    ab.add_argument("--heads", required=True, metavar="L.H,...", help="heads to ablate, e.g. 0.3,1.5 (layer.head)")
    ab.add_argument("--mean", action="store_true", help="mean ablation instead of zero ablation")
    ab.add_argument("--top", type=int, default=5, help="top tokens listed before and after (default 5)")
    _model_dtype_json(ab)
    ab.set_defaults(func=cmd_ablate)

    pa = sub.add_parser("patch", help="activation patching: which layers/heads carry the clean answer",
                        description="Run CORRUPT with one activation at a time copied from the CLEAN run (each head "
                                    "of hook_z by default; resid_pre etc. per position) and measure --metric at the "
                                    "last position. Writes OUT/patch.png (layer x head, or layer x position) and "
                                    "OUT/patch.json. CLEAN and CORRUPT must be the same number of tokens; the "
                                    "answers are scored by their first token.")
    pa.add_argument("clean", metavar="CLEAN")
    pa.add_argument("corrupt", metavar="CORRUPT")
    pa.add_argument("--metric", choices=["logit-diff", "logprob"], default="logit-diff",
                    help="logit[answer] - logit[wrong], or the answer's log-probability (default logit-diff)")
    pa.add_argument("--answer", default=None, help="the clean prompt's next token (text)")
    pa.add_argument("--wrong", default=None, help="the corrupted prompt's next token (text; for logit-diff)")
    pa.add_argument("--hook", default="z", help="activation to patch: z (default), q, k, v, pattern, resid_pre, "
                                                "resid_mid, resid_post, attn_out, mlp_out, or a full hook name")
    pa.add_argument("--per-position", action="store_true", help="patch one position at a time (per-head hooks)")
    pa.add_argument("--out", default="patch", metavar="DIR", help="output directory (default ./patch)")
    ln = sub.add_parser("lens", help="logit lens: the top token of the residual stream before every layer",
                        description="Decode the residual stream before each layer (and after the last) through ln_f "
                                    "and the LM head at every position of PROMPT. Prints a layer x position table "
                                    "of top tokens; writes OUT/lens.png (all positions) and OUT/lens.json.")
    ln.add_argument("prompt", metavar="PROMPT")
    ln.add_argument("--top", type=int, default=3, help="top tokens kept per cell in the JSON (default 3)")
    ln.add_argument("--columns", type=int, default=8, help="positions shown in the printed table (default 8)")
    ln.add_argument("--out", default="lens", metavar="DIR", help="output directory (default ./lens)")
    _model_dtype_json(pa)
    _model_dtype_json(ln)
    pa.set_defaults(func=cmd_patch)
    ln.set_defaults(func=cmd_lens)


def _model_dtype_json(p) -> None:
    """--model, --dtype and --json, as ablate, patch and lens take them."""
    model_arg(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_check(args) -> int:
    from ..learn.check import CheckError, check, format_report
    from ..learn.check_load import parse_args

    if not 0 <= args.seed < 2**63:
        print(f"error: --seed={args.seed} must be an integer in [0, 2**63)\nresult: COULD NOT RUN (exit 2)",
              file=sys.stderr)
        return 2
    try:
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
    tr.set_defaults(func=cmd_trace)

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
    ck.set_defaults(func=cmd_check)


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


#: The sections of ``gpt2mha bench`` (benchmarks/bench.py), in the order they run.
BENCH_SECTIONS = ("decode", "cache", "positions", "prefill", "attention", "lowp", "quant")


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
    b.set_defaults(func=cmd_bench)


def cmd_convert(args) -> int:
    from ..io.formats import convert

    if args.quantize is None and (args.group_size is not None or args.calibration is not None
                                  or args.quantize_method is not None or args.quantize_head is not None):
        quantized(None, args)                                   # the named error for a stray option
    # --activations alone sets the mode on a model saved int8 (and names the flag for a float one)
    written = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, src_format=args.src_format,
                      book_config=json_arg(args.book_config, "--book-config"),
                      quantize=(lambda m: quantized(m, args)) if args.quantize or args.activations else None)
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
    quantize_args(cv)
    cv.set_defaults(func=cmd_convert)

    warning = "WARNING: with --class, FILE.py is imported and run with your permissions. Only use files you trust."
    cm = sub.add_parser("check-model", help="compare your whole model with gpt2mha on the same checkpoint, layer by layer",
                        description="Load SRC into gpt2mha and into your own model (--class FILE.py:Class: the book's "
                                    "GPTModel built with the config dict, nanoGPT's GPT built with GPTConfig(**model_args), "
                                    "each loaded with its load_state_dict from the file's tensors) or, without --class, "
                                    "the format's reference (the book's chapter 4 GPTModel; nanoGPT's model.py GPT, "
                                    "built in: nanoGPT need not be installed; NumPy's OpenAI formulas for "
                                    "OpenAI/Hugging Face checkpoints). Run both on the same ids in float64 and report "
                                    "the embeddings, each block's attention, MLP and output, ln_f and the logits, the "
                                    "first that differs and why. Exit 0: matches; 1: differs; 2: could not run. "
                                    + warning, epilog=warning)
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
    cm.set_defaults(func=cmd_check_model)


def cmd_serve(args) -> int:
    import logging

    try:
        from ..serving.server import serve
    except ImportError as e:
        raise SystemExit(f"error: gpt2mha serve needs FastAPI and uvicorn ({e}): pip install 'gpt2mha[serve]' "
                         f"(from a clone of the repository: pip install -e '.[serve]')")
    from .. import DEFAULT_MODEL
    from ..io.tokenizer import tokenizer_for
    from ..serving.chat import load_chat_template

    try:                                      # before loading the model: a bad file fails at once
        template = load_chat_template(args.chat_template)         # a built-in name, none, or a file
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    if args.threads is not None:              # (the numbers were checked by argparse, the flags by main)
        import torch
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    model = quantized(load_model(args.model, args.dtype), args)
    name = args.served_model_name or args.model or DEFAULT_MODEL
    try:
        serve(model, tokenizer_for(model.config), name, host=args.host, port=args.port, max_batch=args.max_batch,
              max_queue=args.max_queue, graceful_timeout=args.graceful_timeout, max_body_bytes=args.max_body_bytes,
              chat_template=template, max_stop=args.max_stop, batch_invariant=args.batch_invariant)
    except RuntimeError as e:                 # could not bind: uvicorn logged why
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def check_serve_args(args) -> None:
    """What ``serve``'s line alone decides, before torch is imported and the model loaded: the
    quantization flags, and that ``--host``/``--port`` can be listened on now (a port in use is
    one error line, exit 2, at once: :func:`gpt2mha.serving.address.check_address`)."""
    from ..serving.address import check_address

    check_quantize_args(args)
    check_address(args.host, args.port)


#: ``gpt2mha serve --max-stop`` default (:data:`gpt2mha.serving.protocol.MAX_STOP`, repeated so that
#: parsing arguments needs no FastAPI; tests/test_serve.py checks that the two agree)
DEFAULT_MAX_STOP = 64


def _add_serve_command(sub) -> None:
    """Parser of ``serve`` (:mod:`gpt2mha.serving`)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions) with continuous batching",
                       formatter_class=DefaultsHelpFormatter,
                       description="Serve the model over HTTP in the OpenAI completions format: POST /v1/completions "
                                   "(streaming with server-sent events), POST /v1/chat/completions (through "
                                   "--chat-template), GET /v1/models, GET /health, POST /tokenize, POST /detokenize, "
                                   "GET /tokenizer_info. Requests are "
                                   "batched continuously: every decode step advances all running sequences, new "
                                   "ones join at the next step. Needs the 'serve' extra: pip install -e '.[serve]'.")
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
    s.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch's intra-op threads for the model (default: torch's choice, one per core); on a "
                        "machine shared with other work, fewer threads than cores avoid oversubscription")
    s.add_argument("--graceful-timeout", type=number(float, 0), default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish; then they are cancelled "
                        "(HTTP 503, or an error event ending a stream)")
    s.add_argument("--max-body-bytes", type=number(int, 1), default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest request body accepted; larger ones get HTTP 413")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and requests' 'model' field (default: --model as given)")
    s.add_argument("--chat-template", default="plain", metavar="NAME|FILE",
                   help="the chat template of POST /v1/chat/completions: a built-in one by name (plain: 'role: "
                        "content' lines then 'assistant:'; chatml: ChatML turns), none (no chat: that route answers "
                        "400), or a Jinja file (transformers' apply_chat_template semantics: messages, "
                        "add_generation_prompt, bos_token, eos_token; a .json file: its 'chat_template')")
    s.add_argument("--max-stop", type=number(int, 1), default=DEFAULT_MAX_STOP, metavar="N",
                   help="stop strings a request may send; more get HTTP 400 (lm-evaluation-harness sends a task's "
                        "'until' strings plus the EOS string: 1 + len(until); OpenAI's API takes 4, vLLM and "
                        "llama.cpp's server have no limit)")
    quantize_args(s)
    s.set_defaults(func=cmd_serve, check=check_serve_args)


def add_commands(sub) -> None:
    """The ``trace``, ``heads``, ``ablate``, ``patch``, ``lens``, ``check``, ``check-model``, ``convert``, ``bench``
    and ``serve`` subcommands."""
    _add_inspect_commands(sub)
    _add_intervene_commands(sub)
    _add_bench_command(sub)
    _add_formats_commands(sub)
    _add_serve_command(sub)
