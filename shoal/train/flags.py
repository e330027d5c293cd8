"""The one definition of the flags that describe *what is trained*.

``shoal train --local``, ``shoal launch``, ``shoal coordinator`` and ``shoal demo`` all
take the model, batch, sequence, seed and optimizer flags from here, with the same names,
meanings and defaults, so "the same flags" always mean the same run. Importable without
torch (the CLI builds ``--help`` from it).

Every flag is added with ``default=None`` so a command can tell "given" from "not given"
(``--resume`` keeps the run's own values; ``shoal demo`` falls back to its scenario's
workload); :func:`workload_from_args` fills the gaps from :data:`DEFAULTS`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Workload:
    """Model, batch, sequence, seed and optimizer settings shared by every training command."""

    model: str = "tiny"  # model preset name (shoal.model.config.PRESETS)
    steps: int = 200  # optimizer steps in the run (sets the learning-rate schedule)
    micro_batches: int = 4  # M: micro-batches per step
    micro_batch_size: int = 8  # B: sequences per micro-batch
    seq_len: int = 128  # T: tokens per sequence
    seed: int = 0  # seeds the weights (per layer) and the data order (per micro-batch)
    lr: float = 3e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate of the cosine decay; None = lr / 10
    warmup: int = 10  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW weight decay on matrices (never on norm gains)
    grad_clip: float = 1.0  # global gradient-norm clip (0 = off)


DEFAULTS = Workload()

# (field, type, metavar, help) of each flag; the flag is "--" + field with "-" for "_".
_FLAGS: tuple[tuple[str, type, str, str], ...] = (
    ("model", str, "PRESET", "model preset"),
    ("steps", int, "N", "optimizer steps; sets the LR schedule"),
    ("micro_batches", int, "N", "M, micro-batches per step"),
    ("micro_batch_size", int, "N", "B, sequences per micro-batch"),
    ("seq_len", int, "N", "T, tokens per sequence"),
    ("seed", int, "N", "seed of weights and data order"),
    ("lr", float, "X", "peak learning rate"),
    ("min_lr", float, "X", "final learning rate of the cosine decay"),
    ("warmup", int, "N", "linear warm-up steps"),
    ("weight_decay", float, "X", "AdamW weight decay"),
    ("grad_clip", float, "X", "global gradient-norm clip, 0 = off"),
)

WORKLOAD_FIELDS = tuple(f.name for f in fields(Workload))


def add_workload_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                      defaults: Workload = DEFAULTS, shown: dict[str, str] | None = None) -> None:
    """Add ``--model --steps --micro-batches --micro-batch-size --seq-len --seed --lr --min-lr
    --warmup --weight-decay --grad-clip`` to ``p``.

    ``defaults`` and ``shown`` (field -> text) only change what ``--help`` says the default
    is (``shoal demo`` runs its own step count and its scenario's batch shape).
    """
    shown = shown or {}
    for name, typ, metavar, text in _FLAGS:
        value = getattr(defaults, name)
        if name in shown:
            default = shown[name]
        elif name == "min_lr" and value is None:
            default = "lr/10"
        else:
            default = str(value)
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, metavar=metavar,
                       help=f"{text} (default {default})")


def given_workload(args: argparse.Namespace) -> dict:
    """The workload flags the user actually passed (dest -> value)."""
    return {n: getattr(args, n) for n in WORKLOAD_FIELDS if getattr(args, n, None) is not None}


def workload_from_args(args: argparse.Namespace, base: Workload = DEFAULTS) -> Workload:
    """``base`` with every workload flag the user passed applied."""
    return replace(base, **given_workload(args))


def add_device_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, device: bool = True,
                    precision: bool = True, loss_scale: bool = True, precision_help: str | None = None) -> None:
    """Add ``--device``, ``--precision`` and ``--loss-scale`` (see :mod:`shoal.train.precision`).

    ``--device`` is where a process computes; ``--precision`` and ``--loss-scale`` belong to
    the run (``shoal train --local``, ``shoal launch``, ``shoal coordinator``). Every flag
    defaults to None so a command can tell "given" from "not given".
    """
    from shoal.train.precision import PRECISIONS, LossScaleConfig

    if device:
        p.add_argument("--device", default=None, metavar="DEV",
                       help="auto, cpu, cuda or cuda:N; auto = the first CUDA device, else the CPU (default auto)")
    if precision:
        p.add_argument("--precision", default=None, choices=PRECISIONS,
                       help=precision_help or "compute precision: fp32, or bf16/fp16 under autocast with fp32 "
                                              "master weights (default fp32)")
    if loss_scale:
        p.add_argument("--loss-scale", type=float, default=None, metavar="X",
                       help=f"fp16: initial dynamic loss scale (default {LossScaleConfig().init_scale:g})")


def add_tensorboard_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add ``--tensorboard DIR``: also write the run's step metrics as TensorBoard event files."""
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write the step metrics (loss, tokens/s, step-time split, FLOP share, re-queues, "
                        "bytes by kind) as TensorBoard event files in DIR (view: tensorboard --logdir DIR)")


def add_data_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, runtime: bool,
                  init_from: bool = True) -> None:
    """Add ``--data`` (and ``--init-from``): what every training command trains on and starts from.

    ``--data`` takes a prepared folder (``shoal data prepare``) or raw text files, folders
    and globs; the runtime commands also take ``corpus`` (bundled Shakespeare, the default)
    or ``synthetic`` (random tokens).
    """
    if runtime:
        text = ("DATA_DIR from shoal data prepare, raw text files/folders/globs (prepared into the run folder), "
                "'corpus' (bundled Shakespeare) or 'synthetic' (default corpus)")
    else:
        text = "DATA_DIR from shoal data prepare, or text files, folders or globs (default: bundled Shakespeare)"
    p.add_argument("--data", nargs="+", metavar="DATA", default=None, help=text)
    if init_from:
        p.add_argument("--init-from", metavar="HF_DIR", default=None,
                       help="start from this Hugging Face Llama model folder (e.g. from shoal export); "
                            "its config.json sets the model shape, so --model is not given")
