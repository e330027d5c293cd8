"""A run's metrics as TensorBoard event files (``--tensorboard DIR`` on every training command).

Each step record that a run writes to ``metrics.jsonl`` (see :mod:`shoal.train.metrics`) is
also written as scalars through ``tensorboardX``'s ``SummaryWriter``, so TensorBoard and the
tools that read its event files show a shoal run like any other. :func:`scalars_of` names
the scalars:

=============================  ==============================================================
``train/loss``                 mean training loss of the step's micro-batches
``val/loss``                   validation loss (evaluation steps)
``train/lr``                   learning rate
``train/grad_norm``            global gradient norm before clipping
``train/loss_scale``           fp16 dynamic loss scale
``speed/tokens_per_s``         tokens of the step over its wall time
``speed/flop_share``           that rate as a share of the swarm's FLOP limit (distributed)
``time/step_s``                wall time of the step
``time/stage<s>/<part>_s``     stage ``s``'s step split: compute, transfer, sync, waiting
``faults/requeues``            tasks re-queued in the step (distributed)
``bytes/<kind>``               wire bytes sent by all members so far, by traffic kind
=============================  ==============================================================

The step of every scalar is the run's 0-based optimizer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

# Plain numeric fields of a step record -> scalar tag.
_TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "speed/tokens_per_s",
    "flop_share": "speed/flop_share",
    "step_time_s": "time/step_s",
    "requeues": "faults/requeues",
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one step record (fields it lacks are left out)."""
    out = {tag: float(record[k]) for k, tag in _TAGS.items() if _number(record.get(k))}
    for stage, split in sorted((record.get("split") or {}).items()):
        for part, v in split.items():
            if part.endswith("_s") and _number(v):
                out[f"time/stage{stage}/{part}"] = float(v)
    for kind, n in sorted((record.get("bytes_by_kind") or {}).items()):
        if _number(n):
            out[f"bytes/{kind}"] = float(n)
    return out


class TensorBoardWriter:
    """Writes step records' scalars as TensorBoard event files in ``logdir``."""

    def __init__(self, logdir: str | Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ShoalError("--tensorboard needs tensorboardX: pip install tensorboardX==2.6.5") from None
        path = Path(logdir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ShoalError(f"cannot write TensorBoard files to {str(path)!r}: {exc.strerror or exc}; "
                             "give a writable --tensorboard DIR") from None
        self.logdir = path
        self._w = SummaryWriter(logdir=str(path), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        """Add the scalars of a step record (one with a ``step``); flushed, so a viewer sees it now."""
        if not _number(record.get("step")):
            return
        step = int(record["step"])
        for tag, value in scalars_of(record).items():
            self._w.add_scalar(tag, value, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()
