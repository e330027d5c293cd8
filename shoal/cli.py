"""The ``shoal`` command line.

Each subcommand lives beside the code it drives, in a module that defines
``register(subparsers)`` (adds its parser and sets ``func`` to a callable taking the
parsed arguments and returning an exit code). This file only collects them, so the
sub-packages can grow their commands without touching each other.

The parser is built lazily: when the first argument names a known command, only the module
that defines it is imported (``shoal plan`` never imports torch); ``shoal --help``, an unknown
command or a command missing from ``COMMAND_OWNERS`` builds the full parser.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shoal import __version__
from shoal.errors import ShoalError

# Modules that contribute subcommands, in the order `shoal --help` lists them.
COMMAND_MODULES = (
    "shoal.demo.cli",
    "shoal.train.cli",
    "shoal.data.cli",
    "shoal.hf.cli",
    "shoal.plan.cli",
    "shoal.sim.cli",
    "shoal.runtime.processes.cli",
)

# command name -> the module that registers it (lets `shoal CMD` import only that module).
COMMAND_OWNERS = {
    "demo": "shoal.demo.cli",
    "train": "shoal.train.cli",
    "generate": "shoal.train.cli",
    "data": "shoal.data.cli",
    "plan": "shoal.plan.cli",
    "simulate": "shoal.sim.cli",
    "coordinator": "shoal.runtime.processes.cli",
    "server": "shoal.runtime.processes.cli",
    "worker": "shoal.runtime.processes.cli",
    "status": "shoal.runtime.processes.cli",
    "launch": "shoal.runtime.processes.cli",
    "keys": "shoal.runtime.processes.cli",
}


def modules_for(argv: list[str] | None) -> tuple[str, ...]:
    """The command modules to import for ``argv``: the owner of its command when known, else all."""
    first = argv[0] if argv else None
    owner = COMMAND_OWNERS.get(first) if first else None
    return (owner,) if owner else COMMAND_MODULES


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``shoal`` parser; with ``argv`` only the module of its command is imported (see above)."""
    parser = argparse.ArgumentParser(
        prog="shoal",
        description=(
            "Train transformer language models on a shoal of heterogeneous, unreliable devices: "
            "plan, simulate and run pipeline-parallel training with stage servers and task pools."
        ),
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (modules_for(argv) if argv is not None else COMMAND_MODULES):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A sub-package that has no commands yet; any other missing module is a bug.
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shoal`` console script."""
    from shoal.memory import tune_malloc

    tune_malloc()  # (large buffers reused, not faulted in afresh: shoal/memory.py)
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `shoal ... | head` closed the pipe: not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
