"""Figures the dashboard and ``shoal status`` show, as small pure functions.

Nothing here decides anything in the run: a stage server times its steps with
:class:`StepTiming`, the coordinator collects what members report in their heartbeats,
and :func:`bottleneck`, :func:`achieved_step_time` and :func:`member_state` turn that
into what is displayed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StepTiming:
    """Where one step's time went at one stage server (monotonic clock seconds)."""

    step: int = 0  # the step being timed
    opened: float = 0.0  # when the step opened at this server
    compute: dict[str, float] = field(default_factory=dict)  # worker -> compute seconds of its accepted tasks
    busy: dict[str, float] = field(default_factory=dict)  # worker -> lease-to-result seconds of those tasks
    all_computed: float | None = None  # when the last micro-batch's gradient was computed
    all_counted: float | None = None  # when the last gradient push arrived (the commit starts)
    decided: float | None = None  # when the coordinator answered (every stage had reported)

    def task(self, worker: str, compute_s: float, leased_s: float) -> None:
        """Count one accepted task: its reported compute time and its whole lease time."""
        self.compute[worker] = self.compute.get(worker, 0.0) + max(compute_s, 0.0)
        self.busy[worker] = self.busy.get(worker, 0.0) + max(leased_s, compute_s, 0.0)

    def split(self, now: float) -> dict[str, float]:
        """The step's time at this stage split into compute / transfer / sync / waiting.

        Workers of a stage run side by side, so compute and transfer are means over the
        workers that completed tasks: a worker's transfer is its lease time minus its
        compute time (fetching the input and weights, sending the result). Sync is the
        gradient pushes (last gradient computed -> last push counted) plus applying the
        optimizer step after the coordinator's answer. Waiting is what is left: workers
        idle until inputs arrive from the neighbouring stages, and the server waiting for
        the other stages to report the step. The four add up to ``total_s``.
        """
        total = max(now - self.opened, 0.0)
        workers = list(self.busy)
        compute = statistics.fmean(self.compute[w] for w in workers) if workers else 0.0
        transfer = statistics.fmean(max(self.busy[w] - self.compute[w], 0.0) for w in workers) if workers else 0.0
        sync = 0.0
        if self.all_computed is not None:
            pushed = self.all_counted if self.all_counted is not None else now
            sync = max(pushed - self.all_computed, 0.0)
            if self.all_counted is not None:
                sync += max(now - (self.decided if self.decided is not None else self.all_counted), 0.0)
        # Clamp so the parts never exceed the total (a worker's tasks can straddle the step).
        compute = min(compute, total)
        transfer = min(transfer, total - compute)
        sync = min(sync, total - compute - transfer)
        return {"step": self.step, "total_s": total, "compute_s": compute, "transfer_s": transfer,
                "sync_s": sync, "waiting_s": max(total - compute - transfer - sync, 0.0)}


def bottleneck(splits: list[dict | None]) -> int | None:
    """The stage the others wait on: the one whose workers were busiest (compute + transfer).

    In a synchronous pipeline every stage's step lasts about as long; the bottleneck is
    the stage with the least idle time. ``None`` when no stage has timed a step yet.
    """
    best, best_busy = None, -1.0
    for s, sp in enumerate(splits):
        if not sp:
            continue
        busy = sp.get("compute_s", 0.0) + sp.get("transfer_s", 0.0)
        if busy > best_busy:
            best, best_busy = s, busy
    return best


def achieved_step_time(step_times: list[float]) -> float | None:
    """Mean committed step time, step 0 left out (it includes start-up) when there are more."""
    body = step_times[1:] if len(step_times) > 1 else step_times
    return statistics.fmean(body) if body else None


def member_state(present: bool, silent_s: float, dead_after_s: float) -> str:
    """``active``, ``silent`` (missed heartbeats, not yet declared dead) or ``gone``."""
    if not present:
        return "gone"
    return "silent" if silent_s > max(dead_after_s / 3, 1.0) else "active"


ETA_WINDOW = 10  # recent committed steps whose mean time predicts the rest of the run


def eta_seconds(steps: int, committed: int, step_times: list[float], window: int = ETA_WINDOW) -> float | None:
    """Seconds to the last step: the steps left times the mean of the newest ``window`` step
    times (step 0 left out: it includes start-up). None before a step was timed; 0 when done."""
    left = max(steps - committed, 0)
    if not left:
        return 0.0
    body = step_times[1:] if len(step_times) > 1 else step_times
    recent = body[-window:]
    return left * statistics.fmean(recent) if recent else None


def stage_waits_for(stage: dict) -> dict | None:
    """What stage ``stage`` (a dashboard stage row) is waiting for now and for how long:
    ``{"who": text, "for_s": seconds}``, or None when the server reports nothing.

    In order: the coordinator's decision once every push is in; workers holding leases
    (the one with the oldest lease first, its age as the time); workers holding computed
    gradients not yet pushed; inputs from the previous stage; output gradients from the
    next stage; a worker to take the ready tasks; else the other stages.
    """
    if stage.get("step") is None:
        return None
    k, since = stage["stage"], stage.get("step_s") or 0.0
    if stage.get("committing"):
        return {"who": "the coordinator's step decision (all pushes in)", "for_s": since}
    held = sorted(stage.get("held") or [], key=lambda h: -h["oldest_s"])
    if held:
        names = ", ".join(f"{h['worker']} ({h['tasks']} task{'s' if h['tasks'] != 1 else ''}, "
                          f"leased {h['oldest_s']:.1f} s ago)" for h in held[:3])
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        return {"who": names + more, "for_s": held[0]["oldest_s"]}
    if stage.get("unpushed"):
        return {"who": f"gradient pushes from {', '.join(stage['unpushed'])}", "for_s": since}
    if stage.get("wait_input"):
        return {"who": f"inputs from stage {k - 1} ({stage['wait_input']} micro-batches)", "for_s": since}
    if stage.get("wait_grad"):
        return {"who": f"gradients from stage {k + 1} ({stage['wait_grad']} micro-batches)", "for_s": since}
    if stage.get("pool_todo"):
        return {"who": f"a worker to take {stage['pool_todo']} ready tasks (none is asking)", "for_s": since}
    return {"who": "the other stages (this stage's step is done)", "for_s": since}
