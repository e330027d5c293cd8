"""Generate the CLI reference (docs/cli.md) from the argparse definitions.

    python docs/gen_cli.py > docs/cli.md      # regenerate
    python docs/gen_cli.py --check            # exit 1 if docs/cli.md differs

It walks ``shoal.cli.build_parser()`` and every subparser, so the reference always lists
the flags the code accepts; ``tests/test_docs.py`` fails when the committed file drifts.
The output does not depend on the terminal width or on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLI_MD = ROOT / "docs" / "cli.md"
WIDTH = 88  # fixed usage width, so the output is the same on every terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in registration order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias points to a parser already listed
                    continue
                seen.add(id(sub))
                out.append((name, helps.get(name, ""), sub))
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    fmt = argparse.HelpFormatter(prog=parser.prog, width=WIDTH)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return fmt.format_help().strip()


def _help_text(action: argparse.Action) -> str:
    """The action's help with argparse's %-placeholders expanded, on one line."""
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a literal % stays as written
            text = text % params
    return " ".join(text.split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    if action.metavar is not None:
        meta = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        meta = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        meta = action.dest.upper()
    if action.nargs in ("*", "+"):
        meta = f"{meta} ..."
    elif action.nargs == "?":
        meta = f"[{meta}]"
    return ", ".join(f"`{o} {meta}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d == [] or d == ():
        return ""
    return '`""`' if d == "" else f"`{d}`"


def _section(name: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    lines += ["```", _usage(parser), "```", ""]
    if parser.description and parser.description != summary:
        lines += [" ".join(parser.description.split()), ""]
    rows = [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and a.help is not argparse.SUPPRESS]
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        for a in rows:
            lines.append(f"| {_flags(a)} | {_default(a)} | {_help_text(a)} |")
        lines.append("")
    for sub_name, sub_help, sub in _subcommands(parser):
        lines += _section(sub_name, sub_help, sub, level + 1)
    return lines


def generate() -> str:
    """The whole CLI reference as markdown."""
    from shoal.cli import build_parser

    parser = build_parser()
    lines = [
        "# CLI reference",
        "",
        "Generated from the argparse definitions by `python docs/gen_cli.py > docs/cli.md`;",
        "`tests/test_docs.py` checks that this file matches the code. Do not edit it by hand.",
        "",
        "Every command prints `--help`. Bad input gives one line `error: ...` on stderr and",
        "exit status 2.",
        "",
        "```",
        _usage(parser),
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    subs = _subcommands(parser)
    for name, help_text, _ in subs:
        lines.append(f"| [`shoal {name}`](#shoal-{name}) | {' '.join(help_text.split())} |")
    lines.append("")
    for name, help_text, sub in subs:
        lines += _section(name, help_text, sub, 2)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate docs/cli.md from shoal's argparse definitions.")
    ap.add_argument("--check", action="store_true",
                    help="compare with the committed docs/cli.md instead of printing; exit 1 if it differs")
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        if not CLI_MD.is_file() or CLI_MD.read_text() != text:
            print("docs/cli.md is out of date: run `python docs/gen_cli.py > docs/cli.md`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
