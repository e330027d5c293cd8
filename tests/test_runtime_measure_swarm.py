"""A real (non-emulated) run planned on what its members measured: two workers behind
shaped links (the emulation link shaper on their side only; the coordinator plans as
for any real run) are measured near their shaped rates, and the coordinator's plan is
the planner's plan for the measured scenario it shows (and writes to the run folder)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import pytest

from shoal.errors import ShoalError
from shoal.plan import make_plan
from shoal.plan.cost import predict
from shoal.plan.scenario import MBIT, load_scenario, save_scenario, scenario_from_dict
from shoal.plan.types import Device, Link, Network, Plan, Scenario, Workload
from shoal.runtime.processes.launch import LaunchConfig, Swarm
from shoal.train.metrics import read_jsonl

pytestmark = pytest.mark.integration

# device -> (up, down) in Mbit/s: different uplinks; rates a starved 2-core box can still relay
SHAPED = {"slow": (8.0, 24.0), "fast": (32.0, 24.0)}


def _links_file(path) -> str:
    """The scenario the workers' link shapers emulate: their access links, nothing else."""
    host = Device(id="host", kind="server", flops=0.0, memory=0.0, region="lan", up=10e9, down=10e9,
                  can_host_server=True)
    workers = [Device(id=d, kind="cpu", flops=1e15, memory=16e9, region="lan", up=up * MBIT, down=down * MBIT)
               for d, (up, down) in SHAPED.items()]
    sc = Scenario(name="shaped", devices=[host, *workers],
                  network=Network(intra={"lan": Link(latency=0.0, bandwidth=10e9)}, inter={}),
                  workload=Workload(model="tiny", seq_len=32, global_batch=4, micro_batch_size=2))
    save_scenario(sc, path)
    return str(path)


@pytest.mark.timeout(300)
def test_shaped_workers_are_measured_and_planned_as_the_planner_would(tmp_path):
    links = _links_file(tmp_path / "links.json")
    worker_args = [["--emulate-scenario", links, "--emulate-device", d, "--emulate-default-peer", "host",
                    "--probe-mb", "1", "--name", d] for d in SHAPED]
    cfg = LaunchConfig(out=str(tmp_path / "run"), model="tiny", stages=2, workers=2, steps=2, micro_batches=2,
                       micro_batch_size=2, seq_len=32, warmup=1, data="synthetic", timeout_s=250,
                       worker_args=worker_args)
    with Swarm(cfg) as sw:
        sw.start()
        deadline = time.time() + 150
        status = {"ready": False}
        while not status["ready"] and time.time() < deadline:
            time.sleep(0.5)
            with contextlib.suppress(ShoalError):  # a starved coordinator may miss the 5 s deadline
                status = sw.status()
        assert status["ready"] and status["plans_on"] == "measured"
        summary = sw.wait()
    assert summary["steps"] == 2

    out = tmp_path / "run"
    # The scenario the first plan was made on, as `shoal status` showed it (a worker whose
    # observed times drift later is measured again, and scenario.json follows the newest).
    shown = status["scenario"]
    names = {d["id"]: d.pop("name") for d in shown["devices"]}
    sc = scenario_from_dict(shown)
    by_name = {names[d.id]: d for d in sc.devices}
    for name, (up, down) in SHAPED.items():
        d = by_name[name]
        print(f"{name}: up {d.up / MBIT:.1f} Mbit/s (shaped {up}), down {d.down / MBIT:.1f} (shaped {down})")
        assert abs(d.up / MBIT - up) <= 0.25 * up, (name, d.up / MBIT, up)
        assert abs(d.down / MBIT - down) <= 0.25 * down, (name, d.down / MBIT, down)
    assert {d.region for d in sc.devices} == {"auto-0"}  # one host: one latency cluster

    # The coordinator's start plan is the planner's plan for the scenario it showed.
    start = next(e for e in read_jsonl(out / "events.jsonl") if e.get("event") == "replan")
    assert start["why"] == "start" and start["method"] == "shoal"
    plan = make_plan(sc, method="shoal", seed=0, stages=2)
    planner = {names[w]: i for i, st in enumerate(plan.stages) for w in st.workers}
    assert start["assignment"] == planner
    assert start["layers"] == [list(st.layers) for st in plan.stages]
    # ... and the placement matters: the other way round predicts a step at least as slow.
    swapped = Plan.from_dict(plan.to_dict())
    swapped.stages[0].workers, swapped.stages[1].workers = plan.stages[1].workers, plan.stages[0].workers
    assert predict(swapped, sc)["step_time_s"] >= predict(plan, sc)["step_time_s"]

    # The run folder's scenario.json (the newest) plans with the CLI as it is.
    assert {d.id for d in load_scenario(str(out / "scenario.json")).devices} == set(names)
    cli = subprocess.run([sys.executable, "-m", "shoal.cli", "plan", "--scenario", str(out / "scenario.json"),
                          "--stages", "2"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads((out / "scenario.json").read_text())["name"] == "measured"
