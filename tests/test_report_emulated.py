"""Demo assembly: emulation spec for a scenario, churn driving a swarm, churn.jsonl in the report."""

import json
import time

import pytest

from shoal.demo.emulated import emulation_spec, model_task_flops, swarm_churn
from shoal.demo.report import build_report, load_run
from shoal.emulate.hooks import add_emulation_args, config_from_args
from shoal.emulate.pacing import pad_seconds
from shoal.plan.scenario import load_scenario
from shoal.train.metrics import JsonlWriter, step_record


def test_emulation_spec_for_builtin_demo():
    sc = load_scenario("demo")
    spec = emulation_spec(sc, "demo", model_task_s=0.6, latency_scale=2.0,
                          stage_servers=["host-eu", "host-us"])
    assert spec.workers == [d.id for d in sc.workers] and len(spec.worker_args) == len(spec.workers)
    slowest = min(d.flops for d in sc.workers)
    assert pad_seconds(model_task_flops(sc), slowest, spec.speedup) == pytest.approx(0.6)
    # the scaled scenario gives the same time without a pacer
    em_slowest = min(d.flops for d in spec.emulated.workers)
    assert model_task_flops(sc) / em_slowest == pytest.approx(0.6)
    # each worker's flags parse back to its device with the run's settings
    import argparse

    p = argparse.ArgumentParser()
    add_emulation_args(p)
    for dev, args in zip(spec.workers, spec.worker_args, strict=True):
        cfg = config_from_args(p.parse_args(args))
        assert cfg.device == dev and cfg.speedup == spec.speedup and cfg.latency_scale == 2.0
        assert cfg.stage_servers == ["host-eu", "host-us"] and cfg.default_peer == "host-eu"


class FakeSwarm:
    """Stands in for Swarm's process table: records which worker indices were killed/started."""

    def __init__(self):
        self.calls = []

    def kill_worker(self, i):
        self.calls.append(("kill", i))

    def start_worker(self, i):
        self.calls.append(("start", i))


def test_swarm_churn_maps_devices_to_workers_and_logs(tmp_path):
    sc = load_scenario("demo")
    spec = emulation_spec(sc, "demo")
    a, b = spec.workers[1], spec.workers[3]
    swarm = FakeSwarm()
    t0 = time.time()
    sched = [(0.0, a, "leave"), (0.02, "host-eu", "leave"), (0.04, a, "join"), (0.06, b, "leave")]
    drv = swarm_churn(swarm, spec, sched, out=tmp_path, t0_unix=t0).start()
    drv.join(timeout=10)
    assert swarm.calls == [("kill", 1), ("start", 1), ("kill", 3)]  # host-eu is no worker
    recs = [json.loads(line) for line in (tmp_path / "churn.jsonl").read_text().splitlines()]
    assert [(r["event"], r["device"]) for r in recs] == [("kill", a), ("join", a), ("kill", b)]
    # the report merges churn.jsonl, aligned on summary.t0_unix
    with JsonlWriter(tmp_path / "metrics.jsonl") as mw:
        mw.write(step_record(0, 4.0, 1e-3, 1.0, 100, 0.01, 0.01))
        mw.write(step_record(1, 3.9, 1e-3, 1.0, 100, 0.5, 0.51))
    (tmp_path / "summary.json").write_text(json.dumps({"t0_unix": t0 - 10.0}))
    metrics, events, summary = load_run(tmp_path)
    assert all(e["time_s"] >= 10.0 for e in events)  # re-timed onto the run's clock
    rep = build_report(metrics, events, summary)
    assert rep["workers_lost"] == 2 and rep["workers_joined"] == 1


def test_churn_file_is_ignored_when_the_launcher_logged_its_kills(tmp_path):
    with JsonlWriter(tmp_path / "events.jsonl") as ew:
        ew.write({"time_s": 5.0, "event": "kill", "device": "w0", "signal": "SIGKILL"})
        ew.write({"time_s": 6.0, "event": "leave", "device": "w0", "role": "worker"})
    (tmp_path / "churn.jsonl").write_text(json.dumps(
        {"time_s": 0.1, "event": "kill", "device": "eu-0", "role": "worker"}) + "\n")
    _, events, _ = load_run(tmp_path)
    assert [e["device"] for e in events] == ["w0", "w0"]
    assert build_report([], events, {})["workers_lost"] == 1
