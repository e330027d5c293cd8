"""Configuration of a simulation run and of the faults injected into it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulated protocol that are not part of the scenario or the plan."""

    lease_timeout_s: float = 10.0  # a vanished device's servers notice (and re-queue its work) this long after it left
    server_update_s: float = 0.0  # time a stage server takes to apply AdamW once all gradients are in
    steal_backward: bool = False  # idle workers may take a backward task whose owner is alive (paying the recompute)
    blocking_sends: bool = False  # a worker waits until its output has arrived before its next lease (an ablation: the cost model's view)
    uploads_in_flight: int = 2  # overlapped uploads: results a worker may have leaving at once before it waits (the runtime worker's default)
    max_sim_time_s: float = 1e7  # give up (result marked stalled) after this much simulated time
    max_events: int = 200_000_000  # give up (stalled) after this many events
    timeline_max_devices: int = 64  # record a timeline only when the plan has at most this many workers


@dataclass(frozen=True)
class Straggler:
    """A device that computes ``factor`` times slower during a window."""

    device: str  # device id
    start_s: float  # simulated time the slowdown begins
    duration_s: float  # how long it lasts
    factor: float = 10.0  # compute time multiplier (10 = ten times slower)


@dataclass(frozen=True)
class ServerFailure:
    """A stage server that dies and is restored (checkpoint + standby) after a while."""

    time_s: float  # simulated time of the failure
    stage: int  # stage whose server host fails (every stage on that host is affected)
    recovery_s: float = 30.0  # seconds until the standby has taken over
