"""The command-line reference, generated from ``gpt2mha.cli.build_parser()`` so it cannot drift.

An MkDocs hook (``hooks:`` in mkdocs.yml): a page holding the marker ``<!-- cli-reference -->``
gets it replaced by one section per subcommand: its help line, its description, its usage and a
table of every argument with its help (defaults as ``--help`` prints them). Hidden arguments
(``help=argparse.SUPPRESS``) are left out, as ``--help`` leaves them out.

``python docs_hooks/cli_reference.py`` prints the Markdown; tests/test_docs.py checks that every
subcommand and flag the parser has is in it.
"""

from __future__ import annotations

import argparse
import html

MARKER = "<!-- cli-reference -->"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """``{name: (subparser, its one-line help)}`` in the order ``gpt2mha --help`` lists them."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: (a.help or "").replace("%%", "%") for a in action._choices_actions}
            for name, sub in action.choices.items():
                out[name] = (sub, helps.get(name, ""))
    return out


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments ``--help`` shows (not ``-h`` itself, not hidden ones)."""
    return [a for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (pipes and angle brackets escaped, one line)."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _names(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`" + (" …" if action.nargs in ("*", "+", "...") else "")
    metavar = ""
    if action.nargs != 0:
        formatter = parser._get_formatter()
        metavar = " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"`{s}{metavar}`" for s in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.choices and not isinstance(action.choices, dict) and "{" not in _names(parser, action):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return _cell(text)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown reference of every ``gpt2mha`` subcommand."""
    if parser is None:
        from gpt2mha.cli import build_parser
        parser = build_parser()
    subs = subcommands(parser)
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`gpt2mha {name}`](#{name}) | {_cell(help_)} |" for name, (_, help_) in subs.items()]
    lines += ["", "Every command also takes `-h` / `--help`; `gpt2mha --version` prints the version.", ""]
    for name, (sub, help_) in subs.items():
        lines += [f"## gpt2mha {name} {{#{name}}}", "", _cell(help_[:1].upper() + help_[1:]) + ".", ""]
        if sub.description:
            lines += [html.escape(" ".join(sub.description.split()), quote=False), ""]
        lines += ["```text", sub.format_usage().strip(), "```", ""]
        args = arguments(sub)
        if args:
            lines += ["| argument | help |", "|---|---|"]
            lines += [f"| {_names(sub, a)} | {_help(sub, a)} |" for a in args]
            lines.append("")
        if sub.epilog:
            lines += [html.escape(" ".join(sub.epilog.split()), quote=False), ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page=None, config=None, files=None, **kwargs) -> str:
    """MkDocs hook: the marker becomes the generated reference."""
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown


if __name__ == "__main__":
    print(render())
