"""``shoal data prepare``: turn text, JSONL or Parquet files into token shards."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``data`` command and its ``prepare`` subcommand."""
    from shoal.data.prepare import DEFAULT_SAMPLE_BYTES, DEFAULT_SHARD_TOKENS

    p = subparsers.add_parser("data", help="prepare training data (text, JSONL, Parquet -> token shards)",
                              description="Prepare training data once; every training command then reads it with --data DIR.")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    q = sub.add_parser("prepare", help="tokenize inputs into fixed-size token shards",
                       description="Stream text files, folders, globs, .jsonl and .parquet files into token shards "
                                   "with an index and a manifest. Memory stays bounded; re-running an interrupted "
                                   "preparation finishes it with identical shards.")
    q.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, folders, globs, .jsonl or .parquet files")
    q.add_argument("--out", required=True, metavar="DIR", help="data folder to write")
    q.add_argument("--tokenizer", default="train", metavar="PATH_OR_train",
                   help="'train' (byte-level BPE on a sample of the inputs) or a tokenizer.json (default train)")
    q.add_argument("--vocab", type=int, default=2048, metavar="N", help="vocabulary of a trained tokenizer (default 2048)")
    q.add_argument("--field", default="text", metavar="NAME", help="text field of JSONL records / Parquet column (default text)")
    q.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    q.add_argument("--sample-mb", type=float, default=DEFAULT_SAMPLE_BYTES / 2**20, metavar="MB",
                   help=f"text the tokenizer is trained on (default {DEFAULT_SAMPLE_BYTES >> 20})")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=run_prepare)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_prepare(args: argparse.Namespace) -> int:
    """Entry of ``shoal data prepare``."""
    from shoal.data.prepare import PrepareConfig, prepare

    m = prepare(PrepareConfig(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer,
                              vocab_size=args.vocab, field=args.field, shard_tokens=args.shard_tokens,
                              sample_bytes=int(args.sample_mb * 2**20), quiet=args.quiet))
    mb = sum(s["bytes"] for s in m["sources"]) / 2**20
    print(f"prepared {args.out}: {len(m['sources'])} files, {mb:.1f} MB, {m['documents']} documents, "
          f"{m['tokens']} tokens in {m['shards']} shards ({m['dtype']}), vocabulary {m['tokenizer']['vocab_size']}")
    if m.get("repaired"):
        print(f"{m['repaired']} characters that could not be encoded were replaced with U+FFFD "
              "(invalid UTF-8 bytes, lone surrogates)")
    return 0
