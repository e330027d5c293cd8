"""The demo's live display: run state folded from the swarm's records, rendered with rich.

:class:`LiveState` consumes the records ``Swarm.poll_records()`` / ``on_event`` yield
(metrics records carry ``event: "step"``; coordinator events ``join``, ``leave``,
``replan``, ``assign``, ``done``; the launcher's and churn driver's ``kill``) and keeps
what the display shows: step, loss, tokens/s, live workers per stage, tasks re-queued,
workers lost and joined. :meth:`LiveState.table` renders it; use it with
``rich.live.Live``. Pure state, testable without a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.demo.report import _is_worker


@dataclass
class LiveState:
    """What the live display shows, updated record by record."""

    total_steps: int | None = None  # steps of the run (for "step 3/40")
    step: int | None = None  # last committed step
    loss: float | None = None  # its loss
    val_loss: float | None = None  # last validation loss
    tokens_per_s: float | None = None  # its throughput
    requeued: int = 0  # tasks re-queued so far
    workers_lost: int = 0  # workers killed (or left, when no kill was logged)
    workers_joined: int = 0  # workers that joined after the first step
    live: set[str] = field(default_factory=set)  # live worker names
    stage_of: dict[str, int] = field(default_factory=dict)  # worker name -> stage
    n_stages: int = 0  # stages seen so far
    last_events: list[str] = field(default_factory=list)  # recent notable events, newest last
    _killed: set[str] = field(default_factory=set)

    def update(self, rec: dict[str, Any]) -> None:
        """Fold one record into the state."""
        ev = rec.get("event", "step")
        dev = rec.get("device")
        if ev == "step" and "step" in rec:
            self.step = rec["step"]
            self.loss = rec.get("loss", self.loss)
            self.tokens_per_s = rec.get("tokens_per_s", self.tokens_per_s)
            if rec.get("val_loss") is not None:
                self.val_loss = rec["val_loss"]
            self.requeued += int(rec.get("requeues", 0))
        elif ev == "join" and dev and _is_worker(rec):
            if self.step is not None:
                self.workers_joined += 1
                self._note(f"{dev} joined")
            self.live.add(dev)
            self._killed.discard(dev)
        elif ev == "leave" and dev and _is_worker(rec):
            self.live.discard(dev)
            if dev not in self._killed:  # a kill already counted this loss
                self.workers_lost += 1
                self._note(f"{dev} left ({rec.get('why', '?')})")
        elif ev == "kill" and dev and _is_worker(rec):
            self.live.discard(dev)
            self._killed.add(dev)
            self.workers_lost += 1
            self._note(f"{dev} killed")
        elif ev == "replan":
            self.stage_of = {k: int(v) for k, v in (rec.get("assignment") or {}).items()}
            self._note(f"re-plan ({rec.get('why', '?')})")
        elif ev == "requeue":
            self.requeued += int(rec.get("count", 1))
        if self.stage_of:
            self.n_stages = max(self.n_stages, max(self.stage_of.values()) + 1)
        if ev == "assign" and rec.get("stage") is not None:
            self.n_stages = max(self.n_stages, int(rec["stage"]) + 1)

    def _note(self, text: str) -> None:
        self.last_events = (self.last_events + [text])[-5:]

    def workers_per_stage(self) -> list[int]:
        """Live workers assigned to each stage."""
        counts = [0] * self.n_stages
        # Copies (atomic under the GIL): rich's refresh thread renders while records arrive.
        stage_of = dict(self.stage_of)
        for w in list(self.live):
            s = stage_of.get(w)
            if s is not None and 0 <= s < len(counts):
                counts[s] += 1
        return counts

    def table(self):
        """A rich renderable of the state."""
        from rich.table import Table

        t = Table(show_header=False, box=None, title="shoal demo")
        t.add_column(style="bold")
        t.add_column()
        step = "-" if self.step is None else f"{self.step + 1}" + (f"/{self.total_steps}" if self.total_steps else "")
        t.add_row("step", step)
        t.add_row("loss", "-" if self.loss is None else f"{self.loss:.4f}"
                  + ("" if self.val_loss is None else f"  (val {self.val_loss:.4f})"))
        t.add_row("tokens/s", "-" if self.tokens_per_s is None else f"{self.tokens_per_s:.0f}")
        per = self.workers_per_stage()
        t.add_row("workers/stage", " ".join(f"s{i}:{n}" for i, n in enumerate(per)) or f"{len(self.live)} live")
        t.add_row("re-queued", str(self.requeued))
        t.add_row("lost / joined", f"{self.workers_lost} / {self.workers_joined}")
        if self.last_events:
            t.add_row("events", "; ".join(self.last_events))
        return t
