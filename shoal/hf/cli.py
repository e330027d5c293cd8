"""``shoal export RUN_DIR --format hf --out DIR``."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand."""
    p = subparsers.add_parser("export", help="export a run's newest committed weights (Hugging Face Llama)",
                              description="Write the newest committed step of a local or distributed run as a "
                                          "transformers-loadable Llama model: config.json, model.safetensors, tokenizer files.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run folder (--out of shoal train --local or shoal launch)")
    p.add_argument("--format", default="hf", choices=("hf",), help="output format (default hf)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Entry of ``shoal export``."""
    from shoal.hf.export import export_hf

    r = export_hf(args.run_dir, args.out)
    note = "" if r["tokenizer"] else " (no tokenizer.json in the run: weights and config only)"
    print(f"exported step {r['step']} ({r['parameters']} parameters) to {r['out']}{note}")
    if r["caveat"]:
        print(f"note: {r['caveat']}", file=sys.stderr)
    return 0
