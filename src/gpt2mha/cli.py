"""The ``gpt2mha`` command: a thin argparse layer over the Python API."""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


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


def cmd_generate(args) -> int:
    import torch

    from .generate import check_sampling
    from .tokenizer import StreamDecoder, get_tokenizer

    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.prompt == "":
        raise ValueError("PROMPT is empty; give at least one character to continue")
    model = load_model(args.model, args.dtype)
    tok = get_tokenizer(model.config.tokenizer)
    idx = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    stream = StreamDecoder(tok)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()

    def on_token(token):
        out.write(stream.push(token.tolist()))
        out.flush()

    model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, eos_token_id=tok.eot_token if args.stop_at_eos else None,
                   sliding_window=args.sliding_window, on_token=on_token)
    out.write(stream.flush() + "\n")
    return 0


def cmd_perplexity(args) -> int:
    from .evaluate import perplexity

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"FILE={args.file!r}: {e.strerror}") from None
    model = load_model(args.model)
    result = perplexity(model, text, stride=args.stride)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"tokens           {result.tokens}\nbytes            {result.bytes}\n"
              f"loss per token   {result.loss_per_token:.4f} nats\nperplexity       {result.perplexity:.3f}\n"
              f"bits per byte    {result.bits_per_byte:.4f}")
    return 0


def cmd_train(args) -> int:
    from .model import GPT2Config
    from .train import TrainConfig, train

    sizes = {k: v for k, v in dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                   n_ctx=args.n_ctx).items() if v is not None}
    drop = {k: v for k, v in dict(attn_pdrop=args.attn_pdrop, resid_pdrop=args.resid_pdrop,
                                  embd_pdrop=args.resid_pdrop).items() if v is not None}
    tokenizer = args.tokenizer or ("gpt2" if args.preset in ("124M", "355M", "774M", "1558M") else "bytes")
    n_vocab = 50257 if tokenizer == "gpt2" else 256
    config = GPT2Config.from_preset(args.preset, n_vocab=n_vocab, tokenizer=tokenizer, **sizes, **drop)
    tc = TrainConfig(**{k: v for k, v in dict(iters=args.iters, batch_size=args.batch_size, lr=args.lr,
                                              min_lr=args.min_lr, warmup=args.warmup, seed=args.seed,
                                              eval_interval=args.eval_interval).items() if v is not None})
    log = train(args.data, args.out, config, tc, resume=args.resume)
    if log["evals"]:
        last = log["evals"][-1]
        print(f"done: step {last['step']}, val loss {last['val_loss']:.4f} nats/token, "
              f"{log['seconds']:.0f} s; checkpoint in {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2mha", description="GPT-2 multi-head attention, exact and fast.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt (streams tokens as they are sampled)")
    g.add_argument("prompt", metavar="PROMPT")
    _model_arg(g)
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--stop-at-eos", action="store_true", help="stop when <|endoftext|> is sampled")
    g.add_argument("--sliding-window", action="store_true",
                   help="allow prompt + new tokens beyond n_ctx by keeping only the last n_ctx tokens")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="loss, perplexity and bits per byte of a text file")
    p.add_argument("file", metavar="FILE")
    _model_arg(p)
    p.add_argument("--stride", type=int, default=None, help="window step in tokens (default n_ctx // 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_perplexity)

    t = sub.add_parser("train", help="train a GPT-2 on a text file (first 90%% train, last 10%% validation)")
    t.add_argument("--data", required=True, metavar="FILE", help="UTF-8 text file")
    t.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory (new, or ours with --resume)")
    t.add_argument("--preset", default="tiny", help="size preset (tiny, shakespeare, 124M, ...); the flags below override it")
    for flag in ("--n-layer", "--n-head", "--n-embd", "--n-ctx"):
        t.add_argument(flag, type=int, default=None)
    t.add_argument("--tokenizer", choices=["bytes", "gpt2"], default=None)
    t.add_argument("--iters", type=int, default=None)
    t.add_argument("--batch-size", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--min-lr", type=float, default=None)
    t.add_argument("--warmup", type=int, default=None)
    t.add_argument("--eval-interval", type=int, default=None)
    t.add_argument("--attn-pdrop", type=float, default=None, help="dropout on attention weights")
    t.add_argument("--resid-pdrop", type=float, default=None, help="dropout on residual branches and embeddings")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    t.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
