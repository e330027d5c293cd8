"""Compute pacing: pads to the device time, never shortens, scales consistently."""

import asyncio
import time

import pytest

from shoal.emulate.pacing import ComputePacer, emulated_scenario, pad_seconds, speedup_for
from shoal.plan.types import Device, Link, Network, Scenario, Workload


def test_pad_seconds_formula():
    assert pad_seconds(2e12, 1e12) == pytest.approx(2.0)
    assert pad_seconds(2e12, 1e12, speedup=4.0) == pytest.approx(0.5)
    assert pad_seconds(2e12, 1e12, speedup=4.0, slowdown=10.0) == pytest.approx(5.0)
    for bad in ((1.0, 0.0), (1.0, -1.0)):
        with pytest.raises(ValueError):
            pad_seconds(*bad)
    with pytest.raises(ValueError):
        pad_seconds(1.0, 1.0, speedup=0.0)


def test_speedup_for_scales_slowest_device_to_target():
    s = speedup_for(slowest_device_flops=25e12, largest_task_flops=5e9, slowest_task_s=0.2)
    assert pad_seconds(5e9, 25e12, s) == pytest.approx(0.2)
    # a device 4x faster keeps its ratio
    assert pad_seconds(5e9, 100e12, s) == pytest.approx(0.05)


def test_pad_sleeps_up_to_target():
    p = ComputePacer(device_flops=1e9)
    t0 = time.monotonic()
    total = p.pad(flops=5e7, elapsed_s=0.01)  # target 0.05 s
    slept = time.monotonic() - t0
    assert total == pytest.approx(0.05)
    assert slept >= 0.04 - 1e-3  # sleeps at least the missing time
    assert p.stats.tasks == 1 and p.stats.slept_s == pytest.approx(0.04)
    assert p.stats.overruns == 0


def test_pad_never_shortens():
    p = ComputePacer(device_flops=1e12, speedup=1.0)
    total = p.pad(flops=1e9, elapsed_s=0.3)  # target 1 ms, already took 300 ms
    assert total == 0.3
    assert p.stats.overruns == 1 and p.stats.slept_s == 0.0


def test_slowdown_makes_a_straggler():
    p = ComputePacer(device_flops=1e9)
    assert p.target(1e7) == pytest.approx(0.01)
    p.slowdown = 10.0
    assert p.target(1e7) == pytest.approx(0.1)


def test_apad():
    p = ComputePacer(device_flops=1e9)
    total = asyncio.run(p.apad(2e7, 0.0))
    assert total == pytest.approx(0.02) and p.stats.tasks == 1


def test_emulated_scenario_scales_everything_consistently():
    d = Device(id="a", kind="rtx3060", flops=25e12, memory=12e9, region="eu", up=2.5e6, down=12.5e6)
    sc = Scenario(name="s", devices=[d, Device(**{**d.__dict__, "id": "b", "region": "us"})],
                  network=Network(intra={"eu": Link(0.005, 1e8), "us": Link(0.005, 1e8)},
                                  inter={("eu", "us"): Link(0.04, 5e6)}),
                  workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2))
    e = emulated_scenario(sc, speedup=1e-3, latency_scale=2.0, bandwidth_scale=0.5)
    a, b = e.device("a"), e.device("b")
    assert a.flops == pytest.approx(25e9) and a.up == pytest.approx(1.25e6)
    lk = e.network.link(a, b)
    assert lk.latency == pytest.approx(0.08) and lk.bandwidth == pytest.approx(2.5e6)
    assert sc.device("a").flops == 25e12  # the original is untouched
    # the pacer's target equals the scaled device's plain compute time
    p = ComputePacer(25e12, speedup=1e-3)
    assert p.target(5e9) == pytest.approx(5e9 / a.flops)
