"""The command reference page (``docs/guides/command-reference.md``), made from the parser.

Every subcommand's usage and flags come from ``leantrain.cli.main.build_parser()``; the
settings of ``train`` and ``check`` come with their TOML keys from ``runconfig.FIELDS``
(the one table both are generated from). ``tests/test_docs.py`` checks that the page in
the tree is what this prints, so a new flag cannot leave the page behind.

Run: .venv/bin/python docs/cli_reference.py > docs/guides/command-reference.md
"""

from __future__ import annotations

import argparse
import functools

from leantrain.cli.main import build_parser
from leantrain.cli.runconfig import BY_NAME, FIELDS

PAGE = "docs/guides/command-reference.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
    if action.option_strings and action.nargs != 0:
        names += f" `{action.metavar or action.dest.upper()}`"
    return names


def _default(name: str) -> str:
    field = BY_NAME.get(name)
    if field is None or field.default is None or field.default is False:
        return ""
    return f"`{field.default}`"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    parser = build_parser()
    out = [
        "# Command reference",
        "",
        "Generated from the command's parser by `docs/cli_reference.py` (a test keeps this page",
        "equal to its output). [The command](command.md) explains what the subcommands do.",
        "`python -m leantrain` is the same command.",
        "",
    ]
    for name, sub in _subcommands(parser).items():
        sub.formatter_class = functools.partial(argparse.HelpFormatter, width=96)  # the same page on any terminal
        out += [f"## leantrain {name}", "", "```", sub.format_usage().strip().replace("usage: ", ""), "```", ""]
        rows = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        settings = name in ("train", "check")
        head = "| argument | TOML key | default | what |" if settings else "| argument | what |"
        out += [head, "|---|---|---|---|" if settings else "|---|---|"]
        for a in rows:
            field = settings and a.dest in BY_NAME  # a row of FIELDS: its default has a column
            text = _cell((a.help or "").split(" (default ")[0] if field else a.help or "")
            if a.choices and not field:
                text = (text + "; " if text else "") + "one of " + ", ".join(f"`{c}`" for c in a.choices)
            if settings:
                key = f"`{a.dest}`" if a.dest in BY_NAME else ""
                out.append(f"| {_flag(a)} | {key} | {_default(a.dest)} | {text} |")
            else:
                out.append(f"| {_flag(a)} | {text} |")
        out.append("")
    out += [
        "## TOML keys",
        "",
        "A TOML file given to `train` or `check` takes the settings above with underscores, at",
        "the top level or under `[train]`; an unknown key is refused with the list of known ones.",
        "Sources, later wins: the defaults, the TOML file, then the flags.",
        "",
        "| key | default | subcommands |",
        "|---|---|---|",
    ]
    for f in FIELDS:
        out.append(f"| `{f.name}` | {_default(f.name) or '(none)'} | {', '.join(f.commands)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
