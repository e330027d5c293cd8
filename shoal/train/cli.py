"""``shoal train --local`` (the reference trainer) and ``shoal generate`` (sample a run)."""

from __future__ import annotations

import argparse

from shoal.errors import ShoalError

# Flags that map one to one onto TrainConfig fields (argparse dest == field name).
_TRAIN_FIELDS = (
    "model", "steps", "micro_batches", "micro_batch_size", "seq_len", "seed", "lr", "min_lr", "warmup",
    "weight_decay", "grad_clip", "eval_every", "eval_batches", "checkpoint_every", "data", "init_from",
    "val_fraction", "cache_dir", "out", "stop_after", "log_every", "device", "precision", "loss_scale",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` and ``generate`` subcommands."""
    from shoal.train.config import TrainConfig
    from shoal.train.flags import (
        add_data_args,
        add_device_args,
        add_tensorboard_arg,
        add_workload_args,
    )

    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a model in this process (--local): the reference for distributed runs",
        description=(
            "Train a model on one machine with the exact step semantics of distributed shoal runs: "
            "M micro-batches per step, summed gradients, global-norm clipping, AdamW."
        ),
    )
    p.add_argument("--local", action="store_true", help="train in this process (required)")
    add_workload_args(p)
    add_device_args(p)
    p.add_argument("--eval-every", type=int, metavar="N", help=f"validation every K steps, 0 = at the end (default {d.eval_every})")
    p.add_argument("--eval-batches", type=int, metavar="N", help=f"validation micro-batches (default {d.eval_batches})")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every K steps, 0 = at the end (default 0)")
    add_data_args(p, runtime=False)
    p.add_argument("--val-fraction", type=float, metavar="X", help=f"last fraction of tokens for validation (default {d.val_fraction})")
    p.add_argument("--cache-dir", metavar="DIR", help="tokenizer cache (default $SHOAL_CACHE_DIR or ~/.cache/shoal)")
    p.add_argument("--out", metavar="DIR", help=f"run folder (default {d.out})")
    p.add_argument("--resume", metavar="DIR", help="continue the run checkpointed in DIR")
    p.add_argument("--stop-after", type=int, metavar="N", help="stop (and checkpoint) after this many steps, as if interrupted")
    p.add_argument("--log-every", type=int, metavar="N", help=f"without a terminal, print every N steps (default {d.log_every})")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    add_tensorboard_arg(p)
    p.set_defaults(func=run_train)

    g = subparsers.add_parser("generate", help="sample text from a trained run's checkpoint",
                              description="Print a prompt and its sampled continuation from a run folder.")
    g.add_argument("--from", dest="run_dir", required=True, metavar="DIR", help="run folder (the --out of shoal train)")
    g.add_argument("--prompt", default="", metavar="TEXT", help="text to continue (default: empty)")
    g.add_argument("--tokens", type=int, default=200, metavar="N", help="tokens to sample (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, metavar="X", help="softmax temperature, 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the k likeliest tokens, 0 = all (default 0)")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (default 0)")
    g.set_defaults(func=run_generate)


def _given(args: argparse.Namespace) -> dict:
    out = {}
    for name in _TRAIN_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            out[name] = tuple(v) if name == "data" else v
    return out


def run_train(args: argparse.Namespace) -> int:
    """Entry of ``shoal train``."""
    from shoal.train.config import TrainConfig
    from shoal.train.local import resume_config, train_local

    if not args.local:
        raise ShoalError("shoal train runs in this process only with --local; distributed runs use the runtime commands (see shoal --help)")
    given = _given(args)
    if "init_from" in given and "model" in given:
        raise ShoalError("--init-from sets the model shape from its config.json; drop --model")
    if args.resume:
        if "out" in given and given.pop("out") != args.resume:
            raise ShoalError("--out and --resume name different folders; --resume DIR continues the run in DIR")
        cfg = resume_config(args.resume, **given)
    else:
        cfg = TrainConfig(**given)
    res = train_local(cfg, resume=bool(args.resume), quiet=args.quiet, tensorboard=args.tensorboard)
    if res.interrupted:
        print(f"interrupted after step {res.steps_done}/{cfg.steps}; checkpoint saved, continue with: "
              f"shoal train --local --resume {res.out}", flush=True)
        return 130
    if not args.quiet and res.records:
        last = res.records[-1]
        vals = [r for r in res.records if "val_loss" in r]
        val = f", val loss {vals[-1]['val_loss']:.4f}" if vals else ""
        print(f"done: {res.steps_done}/{cfg.steps} steps, loss {last['loss']:.4f}{val}; run folder {res.out}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """Entry of ``shoal generate``."""
    from shoal.train.generate import generate_text
    from shoal.train.local import cpu_cores, set_torch_threads

    set_torch_threads(default=min(4, cpu_cores()))  # sampling is not a training step: any threads
    print(generate_text(args.run_dir, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0
