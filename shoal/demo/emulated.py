"""Assembling an emulated swarm: which devices run, how fast, with which flags, and churn.

The demo runs a scenario's devices as local processes. This module holds the decisions
that connect a scenario (and a plan made for it) to ``shoal.runtime.processes.launch.Swarm``:

* :func:`emulation_spec` -- one worker process per scenario worker device, the common
  compute ``speedup`` (so the slowest device's whole-model task takes
  ``model_task_s``), the scaled scenario for the planner and simulator, and each
  worker's ``--emulate-*`` flags (``LaunchConfig.worker_args``);
* :func:`swarm_churn` -- a :class:`~shoal.emulate.churn.ChurnDriver` whose leave/join
  events SIGKILL and restart the swarm's worker processes, logged to ``churn.jsonl``
  in the run directory (merged into the report's events).

Usage sketch (the demo command)::

    spec = emulation_spec(scenario, "demo", stage_servers=[s.server for s in plan.stages])
    plan = plan_for(spec.emulated); sim = simulate(plan, spec.emulated)
    cfg = LaunchConfig(out=..., workers=len(spec.workers), worker_args=spec.worker_args, ...)
    with Swarm(cfg) as swarm:
        swarm.start()
        driver = swarm_churn(swarm, spec, churn_schedule(scenario, duration_s, seed), out).start()
        summary = swarm.wait(); driver.stop()
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.emulate.churn import ChurnDriver, Event
from shoal.emulate.hooks import EmulationConfig
from shoal.emulate.pacing import emulated_scenario, speedup_for
from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.model.profile import profile_model
from shoal.plan.types import Scenario


@dataclass
class EmulationSpec:
    """How a scenario is emulated by local processes."""

    scenario: Scenario  # the scenario as written (real device speeds)
    emulated: Scenario  # the same, scaled as the processes experience it (plan and simulate this)
    speedup: float  # compute time scale given to every worker's pacer
    latency_scale: float  # multiplies every latency
    bandwidth_scale: float  # multiplies every bandwidth
    workers: list[str]  # worker device ids; worker process i plays workers[i]
    worker_args: list[list[str]]  # --emulate-* flags of worker process i

    def index_of(self, device_id: str) -> int | None:
        """Worker process index of a device (None if it is not a worker)."""
        try:
            return self.workers.index(device_id)
        except ValueError:
            return None


def model_task_flops(scenario: Scenario) -> float:
    """Forward + backward FLOPs of the whole model for one micro-batch of the workload."""
    w = scenario.workload
    cfg = get_preset(w.model)
    prof = profile_model(cfg, w.seq_len, w.micro_batch_size, w.dtype_bytes)
    n = cfg.n_total_layers
    return prof.fwd_flops(0, n) + prof.bwd_flops(0, n)


def emulation_spec(scenario: Scenario, scenario_ref: str, *, model_task_s: float = 0.6,
                   latency_scale: float = 1.0, bandwidth_scale: float = 1.0, jitter_s: float = 0.0,
                   stage_servers: list[str] | None = None, default_peer: str | None = None,
                   seed: int = 0) -> EmulationSpec:
    """Emulation settings for every worker device of ``scenario``.

    ``scenario_ref`` is what the worker processes load (a built-in name or a file path).
    ``model_task_s``: seconds the slowest worker takes for a whole-model forward and
    backward of one micro-batch (a stage's tasks take their share of it); this sets the
    common ``speedup``. ``stage_servers``: server host device of each stage (from the
    plan); ``default_peer``: device assumed behind any other address (default: the first
    server host, so the coordinator's link is shaped too).
    """
    workers = [d for d in scenario.workers]
    if not workers:
        raise ShoalError(f"scenario {scenario.name} has no worker devices (flops > 0) to emulate")
    if model_task_s <= 0:
        raise ShoalError(f"model_task_s must be positive, got {model_task_s}")
    speedup = speedup_for(min(d.flops for d in workers), model_task_flops(scenario), model_task_s)
    stage_servers = list(stage_servers or [])
    if default_peer is None:
        hosts = stage_servers or [d.id for d in scenario.server_hosts]
        default_peer = hosts[0] if hosts else None
    args = [
        EmulationConfig(scenario_ref, d.id, speedup, latency_scale, bandwidth_scale, jitter_s,
                        seed=seed + i, stage_servers=stage_servers, default_peer=default_peer).to_args()
        for i, d in enumerate(workers)
    ]
    return EmulationSpec(scenario, emulated_scenario(scenario, speedup, latency_scale, bandwidth_scale),
                         speedup, latency_scale, bandwidth_scale, [d.id for d in workers], args)


class ChurnSkipped(Exception):
    """A churn event that was not applied (see :func:`swarm_churn`)."""


def churn_record(action: str, device: str, index: int | None, ok: bool, t0_unix: float) -> dict[str, Any]:
    """The ``churn.jsonl`` record of one replayed event (``kill`` for a leave)."""
    now = time.time()
    return {"time_s": round(now - t0_unix, 4), "unix_time": now,
            "event": "kill" if action == "leave" else "join", "device": device, "role": "worker",
            "worker": index, "ok": ok, "source": "churn"}


def swarm_churn(swarm, spec: EmulationSpec, schedule: list[Event], out: str | Path | None = None,
                time_scale: float = 1.0, t0_unix: float | None = None,
                on_record=None, min_live: int = 0) -> ChurnDriver:
    """A churn driver that kills (SIGKILL) and restarts ``swarm``'s worker processes.

    ``swarm`` is a ``shoal.runtime.processes.launch.Swarm`` (``kill_worker(i)``,
    ``start_worker(i)``; worker ``i`` plays ``spec.workers[i]`` and is restarted with
    its ``spec.worker_args[i]``). Each replayed event is passed to ``on_record`` and,
    with ``out``, appended to ``out/churn.jsonl`` (times since ``t0_unix``, default
    now) -- only needed with a launcher that does not log its kills in events.jsonl
    (the report reads it only then). Events for devices that are not workers are
    ignored. ``min_live``: a leave that would leave fewer live worker processes is
    skipped (and so is the device's later join); a join of a worker that is still
    running is skipped too (a second process for one index would escape the swarm's
    process table). Skipped events are replayed as failed (``ok`` False). Call
    ``.start()`` on the result.
    """
    t0 = time.time() if t0_unix is None else t0_unix
    path = Path(out) / "churn.jsonl" if out is not None else None

    def running(i: int) -> bool:
        procs = getattr(swarm, "workers", None)
        if procs is None:  # a stand-in without a process table
            return True
        return i < len(procs) and procs[i] is not None and procs[i].poll() is None

    def live_count() -> int:
        procs = getattr(swarm, "workers", None)
        return len(spec.workers) if procs is None else sum(1 for p in procs if p is not None and p.poll() is None)

    def kill(dev: str) -> None:
        i = spec.index_of(dev)
        if i is not None:
            if not running(i) or live_count() <= min_live:
                raise ChurnSkipped(f"leave of {dev} skipped (not running, or only {live_count()} workers live)")
            swarm.kill_worker(i)

    def start(dev: str) -> None:
        i = spec.index_of(dev)
        if i is not None:
            procs = getattr(swarm, "workers", None)
            if procs is not None and running(i):
                raise ChurnSkipped(f"join of {dev} skipped (still running)")
            swarm.start_worker(i)

    def on_event(_t: float, dev: str, action: str, ok: bool) -> None:
        if spec.index_of(dev) is None:
            return  # not a worker: nothing was done, nothing to log
        rec = churn_record(action, dev, spec.index_of(dev), ok, t0)
        if path is not None:
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        if on_record is not None:
            on_record(rec)

    return ChurnDriver(schedule, kill, start, time_scale=time_scale, on_event=on_event)
