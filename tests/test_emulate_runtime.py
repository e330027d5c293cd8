"""An emulated worker (shaped links + compute pacing) in a real swarm, with a worker
killed mid-run: the run completes with exactly the local trainer's losses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shoal.demo.emulated import EmulationSpec, swarm_churn
from shoal.demo.report import write_report
from shoal.emulate.hooks import Emulation, EmulationConfig
from shoal.plan.types import Device, Link, Network, Scenario, Workload
from shoal.runtime.processes.launch import LaunchConfig, Swarm
from shoal.runtime.roles.worker import Worker, WorkerOptions
from shoal.train.local import TrainConfig, train_local
from shoal.train.metrics import read_jsonl

pytestmark = pytest.mark.integration

RUN = dict(model="tiny", steps=4, micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


def _scenario() -> Scenario:
    home = Device(id="home", kind="rtx3060", flops=1e10, memory=12e9, region="eu", up=5e6, down=20e6)
    host = Device(id="host", kind="server", flops=0.0, memory=0.0, region="us", up=1e9, down=1e9,
                  can_host_server=True)
    return Scenario(name="emu-test", devices=[home, host],
                    network=Network(intra={"eu": Link(0.005, 1e9), "us": Link(0.005, 1e9)},
                                    inter={("eu", "us"): Link(0.030, 10e6)}),
                    workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2))


@pytest.mark.timeout(240)
def test_emulated_worker_with_a_kill_matches_local_losses(tmp_path):
    ref = train_local(TrainConfig(**RUN, out=str(tmp_path / "local"), eval_every=0, eval_batches=1),
                      quiet=True)
    ref_losses = [r["loss"] for r in ref.records]

    cfg = LaunchConfig(**RUN, out=str(tmp_path / "run"), stages=2, workers=2, min_workers=3,
                       dead_after_s=3.0, min_lease_s=1.5, timeout_s=200)
    emu = Emulation(EmulationConfig("emu-test", "home", default_peer="host"), scenario=_scenario())
    with Swarm(cfg) as sw:
        sw.start()
        worker = Worker(sw.address, sw.token, WorkerOptions(name="emulated", flops=1e10),
                        dial=emu.dial, pacer=emu.pacer, tls=sw.tls)
        errors: list[BaseException] = []

        def run_worker():
            try:
                asyncio.run(worker.run())
            except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
                errors.append(exc)

        t = threading.Thread(target=run_worker, daemon=True)
        t.start()
        deadline = time.time() + 150
        while not read_jsonl(tmp_path / "run" / "metrics.jsonl") and time.time() < deadline:
            time.sleep(0.1)
        # kill -9 process worker 0 once the first step committed, through the churn driver
        spec = EmulationSpec(_scenario(), _scenario(), 1.0, 1.0, 1.0, ["p0", "p1"], [[], []])
        driver = swarm_churn(swarm=sw, spec=spec, schedule=[(0.0, "p0", "leave")], out=tmp_path / "run")
        driver.start().join(timeout=30)
        sw.wait()
        t.join(timeout=30)
    try:
        assert not errors, errors
        recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in recs] == list(range(RUN["steps"]))
        for r, want in zip(recs, ref_losses, strict=True):
            assert abs(r["loss"] - want) <= 1e-5, (r["loss"], want)
        assert driver.done and driver.done[0][3]  # the kill was replayed without error
        # the report is built from the runtime's real run directory
        folder = write_report(tmp_path / "run")
        for name in ("loss.png", "throughput.png", "report.md", "report.json"):
            assert (folder / name).stat().st_size > 0
        md = (folder / "report.md").read_text()
        assert "steps: 4" in md and "- failures survived: 1 (workers lost: 1)" in md
        st = emu.stats()
        # the emulated worker's traffic went through its shaped relays, and it was paced
        assert st["links"]["up_bytes"] > 0 and st["links"]["down_bytes"] > 0
        pace = st["pacing"]
        assert pace["tasks"] > 0 and pace["target_s"] > 0
        # padded, unless this host was slower than the emulated device on every task (a loaded box)
        assert pace["slept_s"] > 0 or pace["overruns"] == pace["tasks"], pace
    finally:
        emu.close()
