"""Churn: when emulated devices leave and join, and a driver that makes it happen.

:func:`churn_schedule` is a pure function from a scenario's churn model to a list of
``(time_s, device_id, "leave" | "join")`` events:

* an explicit trace (``scenario.churn.trace``) is replayed as given (sorted by time,
  stable for ties), cut at ``duration_s``; a device whose first event is ``join``
  starts offline (see :func:`initially_offline`);
* otherwise, if ``scenario.churn.enabled``, every device with a ``mean_session_s``
  starts online and alternates exponential online times (mean ``mean_session_s``)
  with exponential offline times (mean ``churn.mean_offline_s``): a memoryless
  renewal process, the usual model of peer churn. Devices without a session length
  never leave. Each device draws from its own generator seeded by ``(seed,
  device_id)``, so adding a device never changes another device's schedule.

:class:`ChurnDriver` replays a schedule in a background thread by calling
``kill(device_id)`` and ``start(device_id)``; :class:`ProcessTable` supplies those
callbacks for worker processes (kill is SIGKILL: no goodbye, like a pulled plug).
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from shoal.errors import ShoalError
from shoal.plan.types import Device, Scenario

Event = tuple[float, str, str]  # (time_s, device_id, "leave" | "join")
ACTIONS = ("leave", "join")


def _device_rng(seed: int, device_id: str) -> random.Random:
    return random.Random(f"shoal-churn:{seed}:{device_id}")


def session_events(device_id: str, mean_session_s: float, mean_offline_s: float,
                   duration_s: float, rng: random.Random) -> list[Event]:
    """Leave/join events of one device that starts online, up to ``duration_s``."""
    if mean_session_s <= 0 or mean_offline_s <= 0:
        raise ShoalError(f"device {device_id}: session and offline means must be positive")
    events: list[Event] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_session_s)
        if t >= duration_s:
            return events
        events.append((t, device_id, "leave"))
        t += rng.expovariate(1.0 / mean_offline_s)
        if t >= duration_s:
            return events
        events.append((t, device_id, "join"))


def validate_trace(trace: Iterable[Sequence], known: set[str] | None = None) -> list[Event]:
    """The trace as sorted, checked events: actions valid, per device alternating."""
    events: list[Event] = []
    for i, item in enumerate(trace):
        try:
            t, dev, action = float(item[0]), str(item[1]), str(item[2])
        except (TypeError, ValueError, IndexError) as exc:
            raise ShoalError(f"churn trace entry {i} {item!r} is not (time_s, device, action)") from exc
        if action not in ACTIONS:
            raise ShoalError(f"churn trace entry {i}: action {action!r} must be 'leave' or 'join'")
        if not math.isfinite(t) or t < 0:
            raise ShoalError(f"churn trace entry {i}: time {t!r} must be a finite number >= 0")
        if known is not None and dev not in known:
            raise ShoalError(f"churn trace entry {i}: unknown device {dev!r}")
        events.append((t, dev, action))
    events.sort(key=lambda e: e[0])  # stable: ties keep the trace's order
    last: dict[str, str] = {}
    for t, dev, action in events:
        if last.get(dev) == action:
            raise ShoalError(f"churn trace: device {dev!r} does {action!r} twice in a row (at {t:g} s)")
        last[dev] = action
    return events


def churn_schedule(scenario_or_devices: Scenario | Sequence[Device], duration_s: float,
                   seed: int = 0, mean_offline_s: float | None = None,
                   trace: Iterable[Sequence] | None = None) -> list[Event]:
    """Leave/join events in ``[0, duration_s)``, sorted by time.

    Pass a :class:`Scenario` (uses its churn model: trace, enabled flag, mean offline
    time) or a list of devices (then churn is on, with ``mean_offline_s`` defaulting to
    600 s). ``mean_offline_s`` and ``trace`` override the scenario's.
    """
    if duration_s < 0:
        raise ShoalError(f"churn duration must be >= 0, got {duration_s}")
    if isinstance(scenario_or_devices, Scenario):
        devices = list(scenario_or_devices.devices)
        churn = scenario_or_devices.churn
        enabled = churn.enabled
        offline = churn.mean_offline_s if mean_offline_s is None else mean_offline_s
        trace = churn.trace if trace is None else trace
    else:
        devices = list(scenario_or_devices)
        enabled = True
        offline = 600.0 if mean_offline_s is None else mean_offline_s
    if trace:
        known = {d.id for d in devices}
        return [e for e in validate_trace(trace, known) if e[0] < duration_s]
    if not enabled:
        return []
    events: list[Event] = []
    for d in devices:
        if d.mean_session_s is not None:
            events += session_events(d.id, d.mean_session_s, offline, duration_s, _device_rng(seed, d.id))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def kill_fraction_schedule(device_ids: Sequence[str], fraction: float, at_s: float,
                           rejoin_after_s: float | None = None, seed: int = 0) -> list[Event]:
    """Kill ``round(fraction * n)`` of the devices at ``at_s`` (optionally rejoin later).

    The benchmark fault: e.g. a quarter of the workers lost at once. Which devices is
    chosen by ``seed``.
    """
    if not 0 <= fraction <= 1:
        raise ShoalError(f"fraction must be in [0, 1], got {fraction}")
    k = round(fraction * len(device_ids))
    chosen = sorted(random.Random(seed).sample(sorted(device_ids), k))
    events: list[Event] = [(at_s, d, "leave") for d in chosen]
    if rejoin_after_s is not None:
        events += [(at_s + rejoin_after_s, d, "join") for d in chosen]
    return events


def initially_offline(schedule: Iterable[Event]) -> set[str]:
    """Devices whose first event is a join: they are not started at time 0."""
    first: dict[str, str] = {}
    for _, dev, action in schedule:
        first.setdefault(dev, action)
    return {d for d, a in first.items() if a == "join"}


def online_at(device_ids: Iterable[str], schedule: Sequence[Event], t: float) -> set[str]:
    """Devices online at time ``t`` under ``schedule``."""
    online = set(device_ids) - initially_offline(schedule)
    for time_s, dev, action in schedule:
        if time_s > t:
            break
        (online.discard if action == "leave" else online.add)(dev)
    return online


class ChurnDriver:
    """Replays a schedule in a background thread through ``kill`` and ``start`` callbacks.

    ``time_scale`` stretches the schedule (2.0: events happen twice as late).
    ``on_event(time_s, device_id, action, ok)`` is called after each event, e.g. to
    write ``events.jsonl``. A callback that raises is recorded as failed (``ok``
    False) and the replay goes on: one stuck worker must not stop the churn.
    """

    def __init__(self, schedule: Sequence[Event], kill: Callable[[str], object],
                 start: Callable[[str], object], time_scale: float = 1.0,
                 on_event: Callable[[float, str, str, bool], object] | None = None):
        self.schedule = sorted(schedule, key=lambda e: e[0])  # events to replay
        self.kill = kill  # called with a device id on "leave"
        self.start_device = start  # called with a device id on "join"
        self.time_scale = time_scale  # wall seconds per schedule second
        self.on_event = on_event  # observer of each replayed event
        self.done: list[tuple[float, str, str, bool]] = []  # (wall time since start, device, action, ok)
        self.errors: list[str] = []  # messages of failed callbacks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> ChurnDriver:
        """Start replaying now (time 0 of the schedule is now)."""
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="shoal-churn", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        for t, dev, action in self.schedule:
            wait = self._t0 + t * self.time_scale - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            if self._stop.is_set():
                return
            ok = True
            try:
                (self.kill if action == "leave" else self.start_device)(dev)
            except Exception as exc:  # noqa: BLE001 -- keep replaying, report below
                ok = False
                self.errors.append(f"{action} {dev}: {exc!r}")
            now = time.monotonic() - self._t0
            self.done.append((now, dev, action, ok))
            if self.on_event is not None:
                self.on_event(now, dev, action, ok)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop replaying (events not yet due are skipped)."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait until every event was replayed (or the driver stopped)."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def finished(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()


class ProcessTable:
    """Worker processes by device id, with SIGKILL/start callbacks for :class:`ChurnDriver`.

    ``spawn(device_id) -> subprocess.Popen`` starts the device's worker process.
    """

    def __init__(self, spawn: Callable[[str], subprocess.Popen]):
        self.spawn = spawn  # starts one device's worker process
        self.procs: dict[str, subprocess.Popen] = {}  # live processes by device id
        self.killed = 0  # processes killed with SIGKILL
        self.started = 0  # processes started
        self._lock = threading.Lock()

    def start(self, device_id: str) -> None:
        """Start the device's process (no-op if it is running)."""
        with self._lock:
            p = self.procs.get(device_id)
            if p is not None and p.poll() is None:
                return
            self.procs[device_id] = self.spawn(device_id)
            self.started += 1

    def kill(self, device_id: str, count: bool = True) -> None:
        """SIGKILL the device's process and reap it (no-op if it is not running)."""
        with self._lock:
            p = self.procs.pop(device_id, None)
            if p is None or p.poll() is not None:
                return
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
            self.killed += count

    def alive(self) -> list[str]:
        """Device ids whose process runs."""
        with self._lock:
            return sorted(d for d, p in self.procs.items() if p.poll() is None)

    def close(self) -> None:
        """SIGKILL every process this table started and still runs."""
        for dev in list(self.procs):
            self.kill(dev, count=False)
