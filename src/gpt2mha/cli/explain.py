"""``gpt2mha explain``: the interactive attention explainer (:mod:`gpt2mha.learn.explain`).

``gpt2mha explain [PROMPT] [--model M] [--port P] [--open]`` serves the page on 127.0.0.1;
``--export DIR`` writes it with the prompt's numbers into a folder that opens from disk.
"""

from __future__ import annotations

import os

from .checks import at_least, nonempty
from .common import model_arg

#: The prompt when none is given (a line the built-in model was trained on).
DEFAULT_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
#: Where the app listens unless told otherwise.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765


def _loopback(host: str) -> bool:
    return host.strip("[]").lower() in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def check_explain_args(args) -> None:
    """``explain``: a non-empty PROMPT, ``--port`` in [0, 65535], ``--check-timeout`` > 0,
    ``--check-memory`` >= 64, a ``--model`` path that exists, an ``--export`` directory that is
    new, empty or an earlier export, and without ``--export`` an address that can be listened
    on now (:func:`gpt2mha.serving.address.check_address`: a port in use is one error line, exit
    2, before the model loads). No torch imported."""
    nonempty(args.prompt, "PROMPT")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535] (0: any free port)")
    if not (args.check_timeout > 0 and args.check_timeout < 1e6):
        raise ValueError(f"--check-timeout {args.check_timeout} must be a number of seconds > 0")
    at_least(args, 64, "check_memory")
    model = args.model
    if model is not None and model.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"--model {model!r}: no such file or directory")
    if args.export is not None:
        from ..learn.explain.export import check_export_dir      # imports no torch
        check_export_dir(args.export)
    else:
        from ..serving.address import check_address
        check_address(args.host, args.port)


def _load(name: str):
    """A model the page asks for; failures as ValueError (the page shows the message)."""
    from ..api import GPT2
    try:
        return GPT2.from_pretrained(name)
    except OSError as e:
        raise ValueError(f"model {name!r}: {e}") from None


def cmd_explain(args) -> int:
    """``gpt2mha explain``: load the model, then write the export (``--export``) or serve the page
    until Ctrl-C (the launch's prompt computed first, so the page paints at once)."""
    import sys

    from .. import DEFAULT_MODEL
    from ..learn.explain.app import Explain, serve
    from ..learn.explain.checker import CheckLimits
    from ..learn.explain.export import export
    from ..learn.explain.session import ModelEntry, Sequence
    from .common import load_model

    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.lora:                                             # merged: the page reads the weights it shows
        from ..api import GPT2
        model = GPT2.from_pretrained(args.model or DEFAULT_MODEL, lora=args.lora)
    else:
        model = load_model(args.model)
    entry = ModelEntry(model, args.model or DEFAULT_MODEL)
    if args.export is not None:
        info = export(Sequence(entry, entry.encode_prompt(prompt)), args.export, prompt)
        url = "file://" + os.path.abspath(info["index"])
        print(f"wrote {info['index']} ({info['files']} files, {info['bytes'] / 2**20:.1f} MB): open {url}")
        if args.open:
            import webbrowser
            webbrowser.open(url)
        return 0
    local = _loopback(args.host)
    limits = CheckLimits(timeout_s=args.check_timeout, memory_mb=args.check_memory) if local else None
    note = "" if local else (f"the app listens on {args.host}, beyond this machine's loopback: whoever reaches it could "
                             f"run code, so the checker is off (restart without --host to use it)")
    if not local:
        print(f"warning: listening on {args.host}: other machines can reach this page; {note}", file=sys.stderr)
    state = Explain(entry, prompt, limits=limits, checker_note=note, load=_load)
    state.warm()
    serve(state, args.host, args.port, args.open)
    return 0


def add_commands(sub) -> None:
    """The ``explain`` parser."""
    p = sub.add_parser("explain", help="an interactive page: every step of the multi-head attention, with the model's "
                                       "numbers, in the browser",
                       description="Serve a local page (127.0.0.1) that shows, for PROMPT and the model, the pipeline "
                                   "(tokens, embeddings, blocks, LM head), every step of one layer's multi-head "
                                   "attention with the real tensors, every head's pattern and role, next-token "
                                   "sampling on the KV cache, head ablation and the logit lens, and a checker for your "
                                   "own attention module (it runs the code you paste, in a subprocess with a time and "
                                   "memory limit). --export DIR writes the page with PROMPT's numbers into a folder "
                                   "that opens from disk with no server.")
    p.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                   help="text to look at (default: a line of Romeo and Juliet); the page can change it")
    model_arg(p)
    p.add_argument("--lora", action="append", default=None, metavar="ADAPTER",
                   help="a LoRA adapter (a PEFT directory or the book's appendix-E .pth) merged into the model's "
                        "weights, which the page then shows; repeat to merge several")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to listen on (default 127.0.0.1). Any other address lets other machines reach the "
                        "page, so the checker is then off")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the page with PROMPT's numbers into DIR (index.html, static/, data/) and exit; it opens "
                        "from disk (file://), no server, no network")
    p.add_argument("--check-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a checked module may run (default 30)")
    p.add_argument("--check-memory", type=int, default=2048, metavar="MB",
                   help="memory a checked module may add, in MB (default 2048)")
    p.set_defaults(func=cmd_explain, check=check_explain_args)
