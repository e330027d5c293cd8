"""What a simulation reports, its JSON form and its timeline picture."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SimResult:
    """Outcome of one simulated run."""

    scenario: str  # scenario name
    method: str  # planner that made the plan
    steps: int  # steps completed
    step_times_s: list[float]  # simulated duration of each step
    mean_step_time_s: float  # mean of step_times_s
    tokens_per_s: float  # tokens trained per simulated second
    utilisation: dict[str, float]  # device id -> fraction of the run spent computing
    link_bytes: dict[str, float]  # "src->dst" -> bytes moved between the two devices
    requeued_tasks: int  # tasks put back into a pool after their worker vanished
    lost_micro_batches: int  # (step, micro-batch) pairs whose gradient missed a stage's update (must be 0)
    events: int  # events processed
    wall_time_s: float  # wall-clock seconds the simulation took
    sim_time_s: float = 0.0  # simulated seconds at the end
    cpu_time_s: float = 0.0  # CPU seconds of this process during the run (robust to a busy machine)
    predicted_step_time_s: float | None = None  # the plan's cost-model step time, if it has one
    recomputes: int = 0  # backward tasks run on a worker without the saved activations
    duplicates_dropped: int = 0  # late or repeated results the servers dropped
    leaves: int = 0  # devices that left
    joins: int = 0  # devices that (re)joined
    repairs: int = 0  # calls to the online repair
    moves: int = 0  # live workers the repair moved to another stage
    repair_wall_s: float = 0.0  # wall seconds of wall_time_s spent inside the planner's repair
    churn: bool = False  # whether churn was on
    stalled: bool = False  # the run stopped before finishing its steps (no progress possible / limits hit)
    passes: list[dict] = field(default_factory=list)  # per step: {"fwd": [per stage {m: n}], "grad": [...]}
    timeline: list[tuple[str, float, float, str]] | None = None  # (device, t0, t1, compute|send|recv)
    flow_reschedules: int = 0  # completion events the flow network pushed (a cost measure)
    stage_phases: list[list[tuple[float, float]]] = field(default_factory=list)  # per step, per stage: (s into the step when its backward drained, when it closed)

    @property
    def mean_pipeline_s(self) -> float:
        """Mean over steps of the time until the last stage's backward drained."""
        if not self.stage_phases:
            return math.nan
        return sum(max(d for d, _ in st) for st in self.stage_phases) / len(self.stage_phases)

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_time_s if self.wall_time_s > 0 else math.inf

    @property
    def events_per_cpu_s(self) -> float:
        return self.events / self.cpu_time_s if self.cpu_time_s > 0 else math.inf

    @property
    def ratio_to_prediction(self) -> float | None:
        """Predicted / simulated mean step time (1.0 = the cost model is exact)."""
        if not self.predicted_step_time_s or not self.mean_step_time_s:
            return None
        return self.predicted_step_time_s / self.mean_step_time_s

    def mean_utilisation(self) -> float:
        return sum(self.utilisation.values()) / len(self.utilisation) if self.utilisation else 0.0

    def to_dict(self, *, include_passes: bool = False) -> dict:
        """A JSON-ready summary (the conservation counts only on request: they are large)."""
        d = {
            "scenario": self.scenario,
            "method": self.method,
            "steps": self.steps,
            "step_times_s": self.step_times_s,
            "mean_step_time_s": self.mean_step_time_s,
            "predicted_step_time_s": self.predicted_step_time_s,
            "ratio_predicted_to_simulated": self.ratio_to_prediction,
            "tokens_per_s": self.tokens_per_s,
            "mean_utilisation": self.mean_utilisation(),
            "utilisation": self.utilisation,
            "link_bytes": self.link_bytes,
            "requeued_tasks": self.requeued_tasks,
            "lost_micro_batches": self.lost_micro_batches,
            "recomputes": self.recomputes,
            "duplicates_dropped": self.duplicates_dropped,
            "leaves": self.leaves,
            "joins": self.joins,
            "repairs": self.repairs,
            "repair_wall_s": self.repair_wall_s,
            "moves": self.moves,
            "churn": self.churn,
            "stalled": self.stalled,
            "events": self.events,
            "wall_time_s": self.wall_time_s,
            "events_per_s": self.events_per_s,
            "cpu_time_s": self.cpu_time_s,
            "events_per_cpu_s": self.events_per_cpu_s,
            "sim_time_s": self.sim_time_s,
            "flow_reschedules": self.flow_reschedules,
            "mean_pipeline_s": self.mean_pipeline_s,
            "stage_phases": self.stage_phases,
        }
        if include_passes:
            d["passes"] = [
                {k: [{str(m): n for m, n in per.items()} for per in v] for k, v in rec.items()}
                for rec in self.passes
            ]
        return d

    def to_json(self, path: str | Path) -> None:
        # NaN (no step finished) is written as null rather than invalid JSON
        d = self.to_dict()
        for k in ("mean_step_time_s", "tokens_per_s"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = None
        Path(path).write_text(json.dumps(d, indent=2) + "\n")


COLOURS = {"compute": "#2b8cbe", "send": "#e6550d", "recv": "#31a354"}


def plot_timeline(result: SimResult, path: str | Path) -> None:
    """Draw one row per device (compute / send / receive; white = idle) into a PNG."""
    from shoal.errors import ShoalError

    if result.timeline is None:
        raise ShoalError("this result has no timeline; simulate with record_timeline=True "
                         "(only small plans record one)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    devices = sorted({d for d, *_ in result.timeline} | set(result.utilisation))
    row = {d: i for i, d in enumerate(devices)}
    per: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for d, t0, t1, kind in result.timeline:
        per.setdefault((row[d], kind), []).append((t0, max(t1 - t0, 1e-9)))
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(devices) + 1.5))
    # transfers are drawn thinner so overlapping compute stays visible
    for (r, kind), spans in sorted(per.items()):
        h, off = (0.8, 0.1) if kind == "compute" else (0.35, 0.1 if kind == "send" else 0.55)
        ax.broken_barh(spans, (r + off, h), facecolors=COLOURS[kind], linewidth=0)
    t = 0.0
    for st in result.step_times_s:
        t += st
        ax.axvline(t, color="black", linewidth=0.6, linestyle="--")
    ax.set_yticks([i + 0.5 for i in range(len(devices))])
    ax.set_yticklabels(devices, fontsize=7)
    ax.set_ylim(0, len(devices))
    ax.set_xlabel("simulated time (s)")
    ax.set_title(f"{result.scenario} / {result.method}: {result.steps} steps, "
                 f"mean {result.mean_step_time_s:.3g} s per step")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()] + [Patch(color="white", label="idle")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
