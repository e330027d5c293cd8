"""Run records shared by the local trainer and the distributed runtime.

A run directory holds:

* ``metrics.jsonl`` -- one JSON object per optimizer step, written when the step
  commits: ``step`` (0-based), ``loss`` (mean training loss over the step's M
  micro-batches), ``lr``, ``grad_norm`` (global, before clipping), ``tokens`` (tokens in
  the step), ``step_time_s``, ``tokens_per_s``, ``time_s`` (since the run started) and,
  on evaluation steps, ``val_loss``.
* ``events.jsonl`` -- one JSON object per notable event (distributed runs): ``time_s``,
  ``event`` (``join``, ``leave``, ``kill``, ``requeue``, ``replan``, ``server_restart``,
  ...), and event-specific fields such as ``device`` and ``stage``.

Both files are appended line by line and flushed, so a crash loses at most the line
being written, and :func:`read_jsonl` skips a torn last line. With ``--tensorboard DIR``
the metrics writer also writes every step record as TensorBoard scalars
(:mod:`shoal.train.tensorboard`): the one place every training command's steps pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class JsonlWriter:
    """Appends JSON objects as lines to a file, flushing each one; with ``tensorboard`` (a
    folder) also writes each step record there as TensorBoard scalars."""

    def __init__(self, path: str | Path, t0: float | None = None, tensorboard: str | Path | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time() if t0 is None else t0
        self.tensorboard = None
        if tensorboard:
            from shoal.train.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(tensorboard)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def event(self, event: str, **fields: Any) -> None:
        """Write an event record stamped with the seconds since ``t0``."""
        self.write({"time_s": round(time.time() - self.t0, 4), "event": event, **fields})

    def close(self) -> None:
        self._f.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn last line is skipped)."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def step_record(
    step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, step_time_s: float, time_s: float,
    val_loss: float | None = None,
) -> dict[str, Any]:
    """The metrics.jsonl record of one committed step."""
    rec: dict[str, Any] = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "step_time_s": step_time_s,
        "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0,
        "time_s": time_s,
    }
    if val_loss is not None:
        rec["val_loss"] = val_loss
    return rec
