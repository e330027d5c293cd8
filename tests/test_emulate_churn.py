"""Churn schedules (pure) and the driver replaying them on real processes."""

import statistics
import subprocess
import sys
import threading

import pytest

from shoal.emulate.churn import (
    ChurnDriver,
    ProcessTable,
    churn_schedule,
    initially_offline,
    kill_fraction_schedule,
    online_at,
    validate_trace,
)
from shoal.errors import ShoalError
from shoal.plan.types import ChurnModel, Device, Link, Network, Scenario, Workload


def _dev(i, session=None):
    return Device(id=f"w{i}", kind="rtx3060", flops=25e12, memory=12e9, region="eu",
                  up=2.5e6, down=12.5e6, mean_session_s=session)


def _scenario(devices, churn):
    return Scenario(name="c", devices=devices, network=Network(intra={"eu": Link(0.005, 1e8)}, inter={}),
                    workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2),
                    churn=churn)


def test_schedule_is_deterministic_by_seed():
    devs = [_dev(i, session=60.0) for i in range(6)]
    a = churn_schedule(devs, 600.0, seed=1, mean_offline_s=30.0)
    b = churn_schedule(devs, 600.0, seed=1, mean_offline_s=30.0)
    c = churn_schedule(devs, 600.0, seed=2, mean_offline_s=30.0)
    assert a == b and a != c
    assert a == sorted(a, key=lambda e: (e[0], e[1]))
    assert all(0 <= t < 600.0 for t, _, _ in a)
    # adding a device leaves the others' events unchanged
    more = churn_schedule(devs + [_dev(9, session=60.0)], 600.0, seed=1, mean_offline_s=30.0)
    assert [e for e in more if e[1] != "w9"] == a


def test_each_device_alternates_leave_join():
    devs = [_dev(i, session=50.0) for i in range(4)]
    sched = churn_schedule(devs, 2000.0, seed=3, mean_offline_s=20.0)
    validate_trace(sched)  # raises if a device leaves twice in a row
    for d in devs:
        acts = [a for _, dev, a in sched if dev == d.id]
        assert acts[0] == "leave"
        assert all(x != y for x, y in zip(acts, acts[1:], strict=False))


def test_rates_match_the_means_over_many_samples():
    session, offline, duration = 100.0, 50.0, 200_000.0
    sched = churn_schedule([_dev(0, session=session)], duration, seed=7, mean_offline_s=offline)
    leaves = [t for t, _, a in sched if a == "leave"]
    joins = [t for t, _, a in sched if a == "join"]
    expected = duration / (session + offline)
    assert abs(len(leaves) - expected) <= 0.1 * expected
    sessions = [leaves[0]] + [lv - j for j, lv in zip(joins, leaves[1:], strict=False)]
    offs = [j - lv for lv, j in zip(leaves, joins, strict=False)]
    assert statistics.mean(sessions) == pytest.approx(session, rel=0.1)
    assert statistics.mean(offs) == pytest.approx(offline, rel=0.1)


def test_devices_without_session_never_leave_and_disabled_churn_is_empty():
    devs = [_dev(0, session=10.0), _dev(1, session=None)]
    sched = churn_schedule(_scenario(devs, ChurnModel(enabled=True, mean_offline_s=5.0)), 500.0, seed=0)
    assert sched and {d for _, d, _ in sched} == {"w0"}
    assert churn_schedule(_scenario(devs, ChurnModel(enabled=False)), 500.0) == []


def test_trace_replay_sorted_cut_and_checked():
    trace = ((30.0, "w1", "join"), (10.0, "w0", "leave"), (10.0, "w1", "leave"), (99.0, "w0", "join"))
    sc = _scenario([_dev(0), _dev(1)], ChurnModel(enabled=True, trace=trace))
    sched = churn_schedule(sc, 50.0)
    assert sched == [(10.0, "w0", "leave"), (10.0, "w1", "leave"), (30.0, "w1", "join")]
    assert online_at(["w0", "w1"], sched, 20.0) == set()
    assert online_at(["w0", "w1"], sched, 31.0) == {"w1"}
    assert initially_offline([(5.0, "w2", "join"), (9.0, "w2", "leave")]) == {"w2"}
    with pytest.raises(ShoalError, match="twice"):
        validate_trace([(1, "w0", "leave"), (2, "w0", "leave")])
    with pytest.raises(ShoalError, match="unknown device"):
        churn_schedule(_scenario([_dev(0)], ChurnModel(trace=((1.0, "zz", "leave"),))), 10.0)
    with pytest.raises(ShoalError, match="action"):
        validate_trace([(1, "w0", "explode")])


def test_kill_fraction_schedule():
    ids = [f"w{i}" for i in range(8)]
    s = kill_fraction_schedule(ids, 0.25, at_s=5.0, rejoin_after_s=10.0, seed=1)
    leaves = [d for _, d, a in s if a == "leave"]
    assert len(leaves) == 2 and set(leaves) <= set(ids)
    assert sorted(d for _, d, a in s if a == "join") == sorted(leaves)
    assert kill_fraction_schedule(ids, 0.25, 5.0, seed=1)[0][1] == leaves[0]


def test_driver_replays_in_order_and_survives_failing_callbacks():
    calls = []
    lock = threading.Lock()

    def kill(d):
        with lock:
            calls.append(("leave", d))
        if d == "bad":
            raise RuntimeError("boom")

    def start(d):
        with lock:
            calls.append(("join", d))

    seen = []
    sched = [(0.06, "a", "join"), (0.0, "a", "leave"), (0.03, "bad", "leave"), (0.09, "b", "leave")]
    drv = ChurnDriver(sched, kill, start, on_event=lambda *e: seen.append(e)).start()
    drv.join(timeout=10)
    assert drv.finished
    assert calls == [("leave", "a"), ("leave", "bad"), ("join", "a"), ("leave", "b")]
    assert [ok for *_, ok in drv.done] == [True, False, True, True]
    assert len(drv.errors) == 1 and "boom" in drv.errors[0]
    assert len(seen) == 4
    # events never fire early
    for (t_wall, _, _, _), (t_sched, _, _) in zip(drv.done, sorted(sched), strict=True):
        assert t_wall >= t_sched - 1e-3


def test_driver_stop_skips_remaining_events():
    calls = []
    drv = ChurnDriver([(0.0, "a", "leave"), (30.0, "b", "leave")], calls.append, calls.append).start()
    drv.join(timeout=0.5)
    drv.stop()
    assert calls == ["a"] and drv.finished


def test_process_table_kills_with_sigkill():
    spawned = []

    def spawn(dev):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        spawned.append((dev, p))
        return p

    table = ProcessTable(spawn)
    try:
        drv = ChurnDriver([(0.0, "w0", "join"), (0.0, "w1", "join"), (0.2, "w0", "leave"),
                           (0.3, "w0", "join")], table.kill, table.start).start()
        procs = []
        drv.join(timeout=30)
        assert drv.finished and not drv.errors
        first_w0 = next(p for d, p in spawned if d == "w0")
        assert first_w0.returncode == -9  # killed by the leave event, not by close()
        assert table.alive() == ["w0", "w1"]
        assert table.started == 3 and table.killed == 1
        procs = list(table.procs.values())
    finally:
        table.close()
    assert all(p.returncode == -9 for p in procs)
