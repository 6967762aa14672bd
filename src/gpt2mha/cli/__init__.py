"""The ``gpt2mha`` command: a thin argparse layer over the Python API.

Building the parser imports nothing heavy (no torch): each command imports what it uses when it
runs. :mod:`.common` holds what the commands share, :mod:`.checks` what each command's line alone
decides (checked before torch is imported), :mod:`.generation` the commands that run the model,
:mod:`.tools` the others.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import classify, explain, generation, ray_serve, tools
from .common import DTYPES, Parser, is_rank0, read_text
from .generation import read_prompt_file
from .tools import BENCH_SECTIONS, add_bench_arguments

__all__ = ["main", "build_parser", "read_text", "read_prompt_file", "BENCH_SECTIONS", "add_bench_arguments", "DTYPES"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="gpt2mha", description="GPT-2 multi-head attention, exact and fast.")
    parser.add_argument("--version", action="version", version=f"gpt2mha {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    generation.add_commands(sub)
    tools.add_commands(sub)
    ray_serve.add_arguments(sub.choices["serve"])
    classify.add_commands(sub)
    explain.add_commands(sub)
    return parser


#: PyTorch's switch for 2 MiB pages (``c10``'s CPU allocator: allocations of 2 MiB and more are
#: ``madvise(MADV_HUGEPAGE)``d, so the whole 2 MiB stretches inside them get huge pages; torch 2.13 aligns
#: them to 4 KiB only), read once, when torch makes its first tensor. A decode step
#: streams every weight once; with 4 KiB pages the TLB misses slow float32 and int8 decode (measured:
#: docs/how-to/choose-configuration.md, "2 MiB pages"). The command turns it on
#: before it imports torch unless the environment says otherwise (``THP_MEM_ALLOC_ENABLE=0``).
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def main(argv: list[str] | None = None) -> int:
    """Run the ``gpt2mha`` command line ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Sets :data:`HUGE_PAGES_ENV` to ``1`` unless it is set (effective where torch is not imported
    yet: the ``gpt2mha`` command, not a program that imported torch before calling this)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    args = build_parser().parse_args(argv)
    try:                                      # what the command line alone decides: before torch is
        if getattr(args, "check", None):      # imported and torchrun's process group joined, and said
            args.check(args)                  # once (by rank 0), as argparse does (cli/checks.py)
    except ValueError as e:
        if is_rank0():
            print(f"error: {e}", file=sys.stderr)
        return 2
    from ..distributed import launched
    try:
        with launched(args.command):          # joins torchrun's process group for generate/train/perplexity
            return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:                 # a model whose logits went NaN: one line, not a traceback
        from ..inference.sampling import NonFiniteLogitsError
        if not isinstance(e, NonFiniteLogitsError):
            raise
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:                   # e.g. `gpt2mha generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
