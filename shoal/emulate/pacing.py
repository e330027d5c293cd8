"""Compute pacing: make a worker take as long as its scenario device would.

A worker computes each task for real (the small model, on the CPU) and then calls
``pacer.pad(flops, elapsed_s)``, which sleeps until the task has taken

    target_s = slowdown * flops / (device_flops * speedup)

where ``flops`` is the task's FLOPs (from :mod:`shoal.model.profile`), ``device_flops``
the scenario device's throughput, ``speedup`` a time-scale factor shared by every
device of the run, and ``slowdown`` a per-worker straggler factor (1 = normal). The
padding never shortens a task: if the real compute already took longer than the
target, the pacer returns at once and counts an *overrun* (the emulation is then too
fast for the host and the ``speedup`` should be lowered).

Time scaling. The tiny model's stage FLOPs on a real GPU take microseconds, far
below a process's scheduling noise, so a run emulates its devices *slowed down*:
:func:`speedup_for` picks ``speedup`` so that the slowest device's largest task takes
``slowest_task_s`` (e.g. 0.2 s); every other device keeps its speed ratio to it. The
simulator and cost model must see the same scaled world: :func:`emulated_scenario`
multiplies device FLOP/s by ``speedup`` (and link figures by their own scales) so a
prediction for the scaled scenario is directly comparable with the emulated run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace

from shoal.plan.types import Link, Network, Scenario


def pad_seconds(flops: float, device_flops: float, speedup: float = 1.0,
                slowdown: float = 1.0) -> float:
    """The time a task of ``flops`` should take on the emulated device."""
    if device_flops <= 0:
        raise ValueError(f"device_flops must be positive, got {device_flops!r}")
    if speedup <= 0 or slowdown <= 0:
        raise ValueError("speedup and slowdown must be positive")
    return slowdown * flops / (device_flops * speedup)


def speedup_for(slowest_device_flops: float, largest_task_flops: float,
                slowest_task_s: float) -> float:
    """The ``speedup`` that makes the slowest device's largest task take ``slowest_task_s``."""
    if slowest_device_flops <= 0 or largest_task_flops <= 0 or slowest_task_s <= 0:
        raise ValueError("flops and target time must be positive")
    return largest_task_flops / (slowest_device_flops * slowest_task_s)


@dataclass
class PacerStats:
    """What a pacer did so far."""

    tasks: int = 0  # tasks padded
    compute_s: float = 0.0  # real compute time reported by the worker
    target_s: float = 0.0  # emulated device time of those tasks
    slept_s: float = 0.0  # padding added
    overruns: int = 0  # tasks whose real compute exceeded the target


class ComputePacer:
    """Pads each task of a worker to the time its scenario device would take.

    ``device_flops`` is the emulated device's FLOP/s, ``speedup`` the run's time-scale
    factor (see the module docstring), ``slowdown`` a straggler factor that may be
    changed while running. Thread-safe; :meth:`pad` sleeps, :meth:`apad` awaits.
    """

    def __init__(self, device_flops: float, speedup: float = 1.0, slowdown: float = 1.0):
        pad_seconds(1.0, device_flops, speedup, slowdown)  # validates
        self.device_flops = device_flops  # emulated device throughput, FLOP/s
        self.speedup = speedup  # time-scale factor of the whole run
        self.slowdown = slowdown  # straggler factor of this worker (1 = normal)
        self.stats = PacerStats()
        self._lock = threading.Lock()

    def target(self, flops: float) -> float:
        """Seconds a task of ``flops`` should take."""
        return pad_seconds(flops, self.device_flops, self.speedup, self.slowdown)

    def _book(self, flops: float, elapsed_s: float) -> tuple[float, float]:
        target = self.target(flops)
        wait = max(0.0, target - elapsed_s)
        with self._lock:
            s = self.stats
            s.tasks += 1
            s.compute_s += elapsed_s
            s.target_s += target
            s.slept_s += wait
            s.overruns += wait == 0.0 and elapsed_s > target
        return wait, max(target, elapsed_s)

    def pad(self, flops: float, elapsed_s: float) -> float:
        """Sleep so the task (``elapsed_s`` so far) takes its target; returns its total time.

        The return value is ``max(target, elapsed_s)``: padding never shortens a task.
        """
        wait, total = self._book(flops, elapsed_s)
        if wait > 0:
            time.sleep(wait)
        return total

    async def apad(self, flops: float, elapsed_s: float) -> float:
        """:meth:`pad` for asyncio workers."""
        wait, total = self._book(flops, elapsed_s)
        if wait > 0:
            await asyncio.sleep(wait)
        return total


def emulated_scenario(scenario: Scenario, speedup: float = 1.0, latency_scale: float = 1.0,
                      bandwidth_scale: float = 1.0) -> Scenario:
    """The scenario as the emulated run experiences it, for the planner and simulator.

    Device FLOP/s are multiplied by ``speedup`` (a ``speedup`` below 1 slows every device
    down by the same factor), latencies by ``latency_scale`` and bandwidths (links and
    device up/down) by ``bandwidth_scale`` -- the same factors given to
    :class:`ComputePacer` and :class:`~shoal.emulate.links.ScenarioDial`.
    """

    def link(lk: Link) -> Link:
        return Link(latency=lk.latency * latency_scale, bandwidth=lk.bandwidth * bandwidth_scale)

    net = scenario.network
    network = Network(
        intra={k: link(v) for k, v in net.intra.items()},
        inter={k: link(v) for k, v in net.inter.items()},
        overrides={k: link(v) for k, v in net.overrides.items()},
        loopback=net.loopback,
    )
    devices = [
        replace(d, flops=d.flops * speedup, up=d.up * bandwidth_scale, down=d.down * bandwidth_scale)
        for d in scenario.devices
    ]
    # The name stays: plans made for the scaled scenario still name the scenario they model.
    return replace(scenario, devices=devices, network=network)
