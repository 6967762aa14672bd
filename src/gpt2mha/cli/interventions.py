"""The intervention commands: ``ablate``, ``patch`` and ``lens`` (:mod:`gpt2mha.learn.interventions`).

Their command lines are checked before torch is imported (:mod:`.checks`); what needs the model
(a prompt longer than its context, a head it does not have, ``--top`` beyond its vocabulary)
once it is loaded, before the forward passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .checks import check_ablate_args, check_lens_args, check_patch_args
from .common import DTYPES, load_model, model_arg


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
    """``gpt2mha ablate``: the next-token distribution before and after ablating ``--heads``."""
    import torch

    from ..inference.sampling import check_logits
    from ..learn.interventions import ablate_heads, next_token_shift, parse_heads

    model = load_model(args.model, args.dtype).eval()
    c = model.config
    heads = parse_heads(args.heads, c.n_layer, c.n_head)        # before the forward passes
    if args.top > c.n_vocab:
        raise ValueError(f"--top={args.top} must be at most the model's vocabulary, n_vocab={c.n_vocab}")
    tok, idx = _prompt_ids(model, args.prompt, "PROMPT")
    with torch.no_grad():
        before = check_logits(model(idx).logits[0, -1], on="PROMPT")
        after = check_logits(ablate_heads(model, idx, heads, mean=args.mean)[0, -1], on="PROMPT, heads ablated")
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
    """``(metric, answer id, wrong id or None, the answer's token count)`` of ``patch``'s flags
    (present and non-empty: :func:`~.checks.check_patch_args`)."""
    from ..learn.interventions import logit_diff

    ids = tok.encode(args.answer)
    answer, n, wrong = ids[0], len(ids), None
    if args.metric == "logit-diff":
        wrong = tok.encode(args.wrong)[0]
        if wrong == answer:
            raise ValueError(f"--answer and --wrong start with the same token {_label(tok, answer)!r}; "
                             f"the logit difference would be 0")
    return logit_diff(answer, wrong), answer, wrong, n


def cmd_patch(args) -> int:
    """``gpt2mha patch``: activation patching from CLEAN into CORRUPT; prints the largest effects and
    writes OUT/patch.png and OUT/patch.json (a warning when the two runs' metrics are too close
    for the restored share to mean anything: :meth:`~gpt2mha.learn.interventions.Patching.normalization_warning`)."""
    import torch

    from ..inference.sampling import check_finite
    from ..learn.heads import token_labels
    from ..learn.intervention_plots import heatmap
    from ..learn.interventions import patch

    model = load_model(args.model, args.dtype).eval()
    tok, clean = _prompt_ids(model, args.clean, "CLEAN")
    _, corrupt = _prompt_ids(model, args.corrupt, "CORRUPT")
    if clean.shape != corrupt.shape:
        raise ValueError(f"CLEAN is {clean.shape[1]} tokens and CORRUPT is {corrupt.shape[1]}: activation patching "
                         f"needs prompts of the same length (reword one)")
    metric, answer, wrong, n_answer = _patch_metric(args, tok)
    res = patch(model, clean, corrupt, args.hook, metric, per_position=args.per_position or None, last_only=True)
    for value, on in ((res.clean, "CLEAN"), (res.corrupt, "CORRUPT"), (res.values, "CORRUPT, patched")):
        check_finite(torch.as_tensor(value).reshape(-1), rows=[], on=on)   # the metric of NaN/inf logits
    try:
        shown, what = res.normalized(), "restored share"
    except ValueError:
        shown, what = res.values, f"{args.metric} (clean and corrupt runs are equal)"
    warning = res.normalization_warning() if shown is not res.values else None
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    grid = shown if shown.dim() == 2 else shown.sum(-1) if shown.dim() == 3 else shown[:, None]
    cols = res.axes[1] if shown.dim() == 2 else "pos" if shown.dim() == 3 else "layer"
    labels = token_labels(tok, clean[0].tolist())
    col_labels = [str(i) for i in range(grid.shape[1])] if cols == "head" else \
        [f"{i}:{t}" for i, t in enumerate(labels)] if cols == "pos" else ["all"]
    title = (f"patching {res.hook}: {args.metric}, answer {_label(tok, answer)!r}"
             + (f" vs {_label(tok, wrong)!r}" if wrong is not None else "") + ("; summed over heads" if shown.dim() == 3 else "")
             + ("\n1 = the patch restores the clean run, 0 = no effect" if shown is not res.values else "")
             + (f"\nunreliable: clean and corrupt differ by {abs(res.clean - res.corrupt):.3g}" if warning else ""))
    png = os.path.join(args.out, "patch.png")
    heatmap(png, grid, [str(l) for l in range(grid.shape[0])], col_labels, title, cols, "layer", what)
    out = {"hook": res.hook, "axes": list(res.axes), "metric": args.metric, "answer": _label(tok, answer),
           "answer_tokens": n_answer, "wrong": None if wrong is None else _label(tok, wrong), "clean": res.clean,
           "corrupt": res.corrupt, "values": res.values.tolist(), "normalized": shown.tolist() if shown is not res.values
           else None, "warning": warning, "tokens": labels, "png": png}
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
    """``gpt2mha lens``: the logit lens as a layer x position table; writes OUT/lens.png and OUT/lens.json
    (``tokens``/``top``: display labels; ``token_ids``/``top_ids``: the same tokens' ids, ``top_ids``
    ``[layer][position][rank]`` as ``top`` and ``probs``)."""
    from ..inference.sampling import check_logits
    from ..learn.heads import token_labels
    from ..learn.intervention_plots import lens_picture
    from ..learn.interventions import logit_lens

    model = load_model(args.model, args.dtype).eval()
    tok, idx = _prompt_ids(model, args.prompt, "PROMPT")
    lens = logit_lens(model, idx, top_k=min(args.top, model.config.n_vocab))
    check_logits(lens.probs, on="PROMPT")                 # the probabilities of NaN/inf logits are NaN
    labels = token_labels(tok, idx[0].tolist())
    top = [[token_labels(tok, lens.ids[r, 0, t].tolist()) for t in range(idx.shape[1])] for r in range(len(lens.labels))]
    png = os.path.join(args.out, "lens.png")
    lens_picture(png, lens.probs[:, 0, :, 0], [[cell[0] for cell in row] for row in top], lens.labels,
                 [f"{i}:{t}" for i, t in enumerate(labels)], f"logit lens: top token of the residual stream "
                 f"through ln_f and the head ({len(labels)} tokens)")
    out = {"layers": lens.labels, "tokens": labels, "token_ids": idx[0].tolist(), "top": top,
           "top_ids": lens.ids[:, 0].tolist(), "probs": lens.probs[:, 0].tolist(),
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


def add_intervene_commands(sub) -> None:
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
    ab.set_defaults(func=cmd_ablate, check=check_ablate_args)

    pa = sub.add_parser("patch", help="activation patching: which layers/heads carry the clean answer",
                        formatter_class=PatchUsageFormatter,
                        description="Run CORRUPT with one activation at a time copied from the CLEAN run (each head "
                                    "of hook_z by default; resid_pre etc. per position) and measure --metric at the "
                                    "last position. Writes OUT/patch.png (layer x head, or layer x position) and "
                                    "OUT/patch.json. CLEAN and CORRUPT must be the same number of tokens; the "
                                    "answers are scored by their first token.")
    pa.add_argument("clean", metavar="CLEAN")
    pa.add_argument("corrupt", metavar="CORRUPT")
    pa.add_argument("--metric", choices=["logit-diff", "logprob"], default="logit-diff",
                    help="logit[answer] - logit[wrong], or the answer's log-probability (default logit-diff)")
    pa.add_argument("--answer", required=True, metavar="TEXT", help="the clean prompt's next token (text)")
    pa.add_argument("--wrong", default=None, metavar="TEXT",
                    help="the corrupted prompt's next token (text); required by --metric logit-diff, the default")
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
    pa.set_defaults(func=cmd_patch, check=check_patch_args)
    ln.set_defaults(func=cmd_lens, check=check_lens_args)


class PatchUsageFormatter(argparse.HelpFormatter):
    """``patch``'s help, whose usage shows ``--wrong`` as required unless ``--metric logprob``
    (argparse marks an option only optional or required; ``check_patch_args`` enforces it), the
    line wrapped again as argparse wraps it: whole ``[…]``/``(…)`` parts, under the command."""

    def _format_usage(self, usage, actions, groups, prefix):
        text = " ".join(super()._format_usage(usage, actions, groups, prefix).split())
        text = text.replace("[--wrong TEXT]", "(--wrong TEXT | --metric logprob)")
        head = text[:text.index(self._prog) + len(self._prog) + 1]        # "usage: gpt2mha patch "
        lines = [""]
        for part in re.findall(r"\(.*?\)(?=\s|$)|\[.*?\](?=\s|$)|\S+", text[len(head):]):
            if lines[-1] and len(head) + len(lines[-1]) + 1 + len(part) > self._width:
                lines.append("")
            lines[-1] = f"{lines[-1]} {part}".lstrip()
        return head + ("\n" + " " * len(head)).join(lines) + "\n\n"


def _model_dtype_json(p) -> None:
    """--model, --dtype and --json, as ablate, patch and lens take them."""
    model_arg(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
