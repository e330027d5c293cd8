"""Emulation flags -> dial + pacer hooks for runtime processes."""

import argparse

import pytest

from shoal.emulate.hooks import (
    EmulationConfig,
    add_emulation_args,
    config_from_args,
    hooks_from_args,
)
from shoal.errors import ShoalError
from shoal.plan.types import Device, Link, Network, Scenario, Workload


def _scenario():
    devs = [Device(id="eu-0", kind="rtx3060", flops=10e12, memory=12e9, region="eu", up=2.5e6, down=12.5e6),
            Device(id="host-us", kind="server", flops=0.0, memory=0.0, region="us", up=1.25e9,
                   down=1.25e9, can_host_server=True)]
    return Scenario(name="h", devices=devs,
                    network=Network(intra={"eu": Link(0.01, 1e8), "us": Link(0.01, 1e8)},
                                    inter={("eu", "us"): Link(0.045, 1e8)}),
                    workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2))


def _parser():
    p = argparse.ArgumentParser()
    add_emulation_args(p)
    return p


def test_flags_round_trip():
    cfg = EmulationConfig("demo", "eu-0", speedup=1e-3, latency_scale=2.0, bandwidth_scale=0.5,
                          jitter_s=0.002, peers={"127.0.0.1:5000": "host-us"}, seed=4,
                          stage_servers=["host-eu", "host-us"], default_peer="host-eu")
    assert config_from_args(_parser().parse_args(cfg.to_args())) == cfg
    assert config_from_args(_parser().parse_args([])) is None


@pytest.mark.parametrize("argv,match", [
    (["--emulate-scenario", "demo"], "emulate-device"),
    (["--emulate-scenario", "demo", "--emulate-device", "x", "--emulate-speedup", "0"], "speedup"),
    (["--emulate-scenario", "demo", "--emulate-device", "x", "--emulate-peers", "[1]"], "JSON object"),
    (["--emulate-scenario", "demo", "--emulate-device", "x", "--emulate-peers", "{"], "JSON"),
])
def test_bad_flags_are_one_line_errors(argv, match):
    with pytest.raises(ShoalError, match=match):
        config_from_args(_parser().parse_args(argv))


def test_hooks_for_worker_and_server_host():
    args = _parser().parse_args(EmulationConfig("h", "eu-0", speedup=0.5).to_args())
    seen = []

    def resolve(address):
        seen.append(address)
        return "host-us" if address == "127.0.0.1:7" else None

    emu = hooks_from_args(args, scenario=_scenario(), resolve=resolve)
    try:
        assert emu.pacer is not None and emu.pacer.target(1e12) == pytest.approx(0.2)
        assert emu.dial.link_for("127.0.0.1:7").latency == 0.045
        relay = emu.dial("127.0.0.1:7")
        assert relay.startswith("127.0.0.1:") and relay != "127.0.0.1:7"
        assert emu.dial("127.0.0.1:8") == "127.0.0.1:8"  # unknown: not shaped
        assert "127.0.0.1:8" in seen
        st = emu.stats()
        assert st["device"] == "eu-0" and "pacing" in st and len(st["links"]["proxies"]) == 1
    finally:
        emu.close()
    host = hooks_from_args(_parser().parse_args(EmulationConfig("h", "host-us").to_args()),
                           scenario=_scenario())
    try:
        assert host.pacer is None  # a server host has no compute to pace
    finally:
        host.close()
    with pytest.raises(ShoalError, match="no device"):
        hooks_from_args(_parser().parse_args(EmulationConfig("h", "nope").to_args()), scenario=_scenario())


def test_builtin_demo_scenario_devices_can_be_emulated():
    from shoal.plan.scenario import load_scenario

    sc = load_scenario("demo")
    dev = sc.workers[0].id
    emu = hooks_from_args(_parser().parse_args(EmulationConfig("demo", dev).to_args()))
    try:
        assert emu.device.id == dev and emu.pacer is not None
    finally:
        emu.close()


def test_stage_servers_and_default_peer():
    sc = _scenario()
    args = _parser().parse_args(EmulationConfig("h", "eu-0", stage_servers=["host-us", "eu-0"],
                                                default_peer="eu-0").to_args())
    emu = hooks_from_args(args, scenario=sc)
    try:
        d = emu.dial
        assert d.link_for("127.0.0.1:9").latency == 0.0  # default peer is this device: loopback
        d.set_stage_address(0, "127.0.0.1:9")
        assert d.link_for("127.0.0.1:9").latency == 0.045  # now known as stage 0's server host
        d.set_stage_address(5, "127.0.0.1:10")  # unknown stage: ignored
        assert "127.0.0.1:10" not in d.peers
        first = d("127.0.0.1:9")
        d.set_peer("127.0.0.1:9", "host-us")  # unchanged: the relay is kept
        assert d("127.0.0.1:9") == first
    finally:
        emu.close()
    with pytest.raises(ShoalError, match="no device"):
        hooks_from_args(_parser().parse_args(EmulationConfig("h", "eu-0", stage_servers=["x"]).to_args()),
                        scenario=sc)
