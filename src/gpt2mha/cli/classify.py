"""``gpt2mha classify TEXT... | --file F``: a classifier's label and probabilities for each text
(:func:`gpt2mha.inference.classify.classify`)."""

from __future__ import annotations

import json

from .common import DTYPES, json_arg, model_arg, read_text, readable_file


def cmd_classify(args) -> int:
    import torch

    from ..api import GPT2
    from ..core.classifier import ClassifierConfig
    from ..io.formats import load_any

    texts = list(args.text)
    if args.file is not None:
        texts += [line for line in read_text(args.file).splitlines() if line.strip()]
    model = load_any(args.model, dtype=getattr(torch, DTYPES[args.dtype]),
                     book_config=json_arg(args.book_config, "--book-config"), model_cls=GPT2)
    if not isinstance(model.config, ClassifierConfig):
        raise ValueError(f"--model {args.model}: a language model (its head has n_vocab={model.config.n_vocab} "
                         f"outputs), not a classifier; give the book's chapter-6 checkpoint or a "
                         f"GPT2ForSequenceClassification directory")
    labels = [x.strip() for x in args.labels.split(",")] if args.labels is not None else None
    out = model.classify(texts, max_length=args.max_length, truncate=args.truncate, labels=labels,
                         batch_size=args.batch_size)
    names = labels or list(model.config.label_names)
    for i, text in enumerate(texts):
        probs = out.probs[i].tolist()
        if args.json:
            print(json.dumps({"index": i, "text": text, "label": out.labels[i], "probs": probs,
                              "labels": names, "num_classes": len(probs)}))
        else:
            print(f"{out.labels[i]}\t{max(probs):.4f}\t{text}")
    return 0


def check_classify_args(args) -> None:
    """``classify``: some text, a readable ``--file``, ``--book-config`` a JSON object, a
    ``--model`` given (there is no built-in classifier)."""
    if args.model is None:
        raise ValueError("classify needs --model: a classifier checkpoint (the book's chapter-6 .pth, with its config "
                         "JSON beside it, or a GPT2ForSequenceClassification directory); the built-in model is a "
                         "language model")
    if not args.text and args.file is None:
        raise ValueError("give the texts to classify: TEXT arguments or --file F (one text a line)")
    if args.file is not None:
        readable_file(args.file, "--file")
    json_arg(args.book_config, "--book-config")


def add_commands(sub) -> None:
    """The ``classify`` subcommand."""
    from .common import number

    c = sub.add_parser("classify", help="label texts with a classifier (the book's chapter-6 model, "
                                        "GPT2ForSequenceClassification)",
                       description="Print each text's predicted label, its probability and the text (tab-separated), "
                                   "or with --json one object per text (index, label, probs, labels). The model's "
                                   "head is read at the last token (the book's logits[:, -1, :]) or the last "
                                   "non-padding token (transformers'), as its checkpoint says.")
    c.add_argument("text", nargs="*", metavar="TEXT", help="texts to classify")
    model_arg(c)
    c.add_argument("--file", default=None, metavar="F", help="a UTF-8 file of texts, one a line (blank lines skipped)")
    c.add_argument("--labels", default=None, metavar="A,B,...",
                   help="label names, one per output (default: the checkpoint's id2label/labels, else LABEL_0 ...)")
    c.add_argument("--max-length", type=number(int, 1), default=None, metavar="N",
                   help="the book's padding: cut each text to N tokens and pad it to N with the pad id (50256), as "
                        "chapter 6's classify_review(max_length=train_dataset.max_length) does (default: the "
                        "checkpoint's max_length, else no padding)")
    c.add_argument("--truncate", type=number(int, 1), default=None, metavar="K",
                   help="keep each text's last K tokens (vLLM's truncate_prompt_tokens; default: a text longer "
                        "than the context is an error)")
    c.add_argument("--book-config", default=None, metavar="JSON",
                   help="the book's config dict (JSON or a JSON file), e.g. '{\"n_heads\": 12, \"labels\": "
                        "[\"not spam\", \"spam\"]}' (default: NAME.json beside NAME.pth)")
    c.add_argument("--batch-size", type=number(int, 1), default=16, help="texts per forward")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype")
    c.add_argument("--json", action="store_true", help="one JSON object per text")
    c.set_defaults(func=cmd_classify, check=check_classify_args)
