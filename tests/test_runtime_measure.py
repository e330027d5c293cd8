"""Members measure themselves and the coordinator plans real runs on it: the pure rules
(latency clustering, drift, rates, the measured scenario), the probes through a real
shaped link, and the coordinator's measure -> plan -> re-measure cycle in-process."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time

import pytest

from shoal.emulate.links import LinkShaper
from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import Identity, run_public_key
from shoal.net.channel import make_server, open_channel
from shoal.plan.scenario import load_scenario, scenario_from_dict, scenario_to_dict
from shoal.plan.types import Workload
from shoal.runtime.measure import (
    TcpCounters,
    _counted,
    checked_probe,
    host_id,
    implausible,
    interface_rate_bps,
    kernel_rate,
    measure_blocks,
    measure_stage_flops,
    median,
    next_probe_size,
    parse_peer,
    parse_tcp_info,
    probe_link,
    probe_reply,
    rate_from,
    tcp_connections,
)
from shoal.runtime.roles import coordinator as coordinator_mod
from shoal.runtime.roles.coordinator import Coordinator, one_machine
from shoal.runtime.roles.planning import (
    COORDINATOR_NODE,
    MemberFigures,
    PathFigures,
    cluster_regions,
    distinct_servers,
    drifted,
    measured_scenario,
)
from shoal.train.metrics import read_jsonl

WL = Workload(model="tiny", seq_len=16, global_batch=4, micro_batch_size=2, dtype_bytes=4)
MS = 1e-3


# ---------------------------------------------------------------------------- pure rules


def test_latency_clusters_become_regions():
    nodes = ["a", "b", "c", "d", "e"]
    rtts = {("a", "b"): 5 * MS, ("c", "d"): 4 * MS, ("a", "c"): 80 * MS, ("d", "b"): 90 * MS}
    assert cluster_regions(nodes, rtts, {}) == {"a": "auto-0", "b": "auto-0", "c": "auto-1", "d": "auto-1",
                                                "e": "auto-2"}  # e measured nothing: alone
    # a declared member names its cluster; the other cluster stays automatic
    got = cluster_regions(nodes, rtts, {"c": "us"})
    assert got["c"] == got["d"] == "us" and got["a"] == got["b"] == "auto-0"
    # single linkage: a chain of near pairs is one region even if its ends are far apart
    chain = {("a", "b"): 15 * MS, ("b", "c"): 15 * MS, ("a", "c"): 30 * MS}
    assert len(set(cluster_regions(["a", "b", "c"], chain, {}).values())) == 1
    assert len(set(cluster_regions(["a", "b", "c"], chain, {}, threshold_s=10 * MS).values())) == 3
    # two declared regions in one cluster: an undeclared member joins the nearer one
    near = {("a", "b"): 3 * MS, ("b", "c"): 15 * MS}
    assert cluster_regions(["a", "b", "c"], near, {"a": "eu", "c": "us"}) == {"a": "eu", "b": "eu", "c": "us"}


def test_drift_rule():
    assert not drifted(1e9, 1e9, 10)
    assert not drifted(1e9, 0.5e9, 10)  # within the factor
    assert drifted(1e9, 0.2e9, 10) and drifted(1.0, 5.0, 10)  # slower or faster by > 3x
    assert not drifted(1e9, 0.2e9, 3)  # too few observations yet
    assert not drifted(0.0, 1e9, 10) and not drifted(1e9, 0.0, 10)  # unknown figures never drift
    assert drifted(1e9, 0.45e9, 10, factor=2.0) and not drifted(1e9, 0.45e9, 10, factor=2.5)


def test_rates_from_timings():
    assert rate_from(1_000_000, 1.1, 0.1) == pytest.approx(1e6)
    assert rate_from(1_000_000, 0.05, 0.1) == pytest.approx(1e6 / 0.005)  # noise: a tenth of the time
    assert median([3.0, 1.0, 100.0]) == 3.0 and median([1.0, 2.0, 4.0, 100.0]) == 3.0


def test_a_direction_counts_its_fastest_kernel_timed_transfer():
    """Kernel-timed rates only read low (a starved process keeps data in flight slowly), so the
    fastest counts; call-timed ones err either way and count by their median."""
    from shoal.runtime.measure import transfer_rate

    assert transfer_rate([(30e6, True), (50e6, True), (40e6, True)]) == (50e6, "kernel")
    assert transfer_rate([(30e6, False), (90e6, False), (40e6, False)]) == (40e6, "call")
    assert transfer_rate([(30e6, True), (90e6, False), (40e6, True)]) == (40e6, "mixed")


def test_probe_sizes_grow_to_cover_the_bandwidth_delay_product():
    mib = 1 << 20
    assert next_probe_size(mib, 0.5, 0.001, 16 * mib) == mib  # lasted long enough
    assert next_probe_size(mib, 0.01, 0.001, 16 * mib) == 16 * mib  # 20x too short: at most 16x larger
    assert next_probe_size(mib, 0.1, 0.001, 16 * mib) == int(mib * 2.5)  # 1.25 x 0.2 / 0.1
    assert next_probe_size(mib, 0.3, 0.05, 64 * mib) == 2 * mib  # 8 round trips of 50 ms: 0.4 s; at least 2x
    assert next_probe_size(8 * mib, 0.01, 0.001, 8 * mib) == 8 * mib  # at the cap


def test_implausible_figures_are_named():
    mbit = 1e6 / 8
    assert implausible(380 * mbit, 390 * mbit, 1000 * mbit) == ""
    assert "interface rate" in implausible(1937 * mbit, 380 * mbit, 1000 * mbit)
    assert "differ" in implausible(1937 * mbit, 380 * mbit, None)  # no interface speed known: asymmetry
    assert implausible(100 * mbit, 30 * mbit, None) == ""  # a 3.3:1 access link is believed
    assert interface_rate_bps(root="/nonexistent") is None


def test_one_server_process_per_stage():
    assert distinct_servers(["s1", "s1", "s2"], ["s3", "s1", "s2"]) == ["s1", "s3", "s2"]
    assert distinct_servers(["s1", "s2"], ["s1", "s2"]) == ["s1", "s2"]
    assert distinct_servers(["s1", "s1"], ["s1"]) == ["s1", "s1"]  # nothing free: the caller refuses


def _figures() -> dict[str, MemberFigures]:
    """Two workers and two servers in one place, a third worker far away (seen via the coordinator)."""
    C = COORDINATOR_NODE
    f = {
        "s0": MemberFigures("s0", "server", kind="cpu", memory=32e9, paths=[
            PathFigures("s0", C, 2 * MS, 100e6, 100e6), PathFigures("s0", "s1", 1 * MS, 90e6, 80e6)]),
        "s1": MemberFigures("s1", "server", kind="cpu", memory=32e9, paths=[
            PathFigures("s1", C, 2 * MS, 100e6, 100e6), PathFigures("s1", "s0", 1.2 * MS, 70e6, 95e6)]),
        "w0": MemberFigures("w0", "worker", kind="gpu", flops=5e12, memory=8e9, paths=[
            PathFigures("w0", C, 4 * MS, 2e6, 10e6), PathFigures("w0", "s0", 4 * MS, 2.2e6, 9e6),
            PathFigures("w0", "s1", 5 * MS, 1.8e6, 11e6)]),
        "w1": MemberFigures("w1", "worker", kind="gpu", flops=1e12, memory=8e9, up=50e6, paths=[
            PathFigures("w1", C, 3 * MS, 8e6, 20e6), PathFigures("w1", "s0", 3 * MS, 8e6, 20e6)]),
        "w2": MemberFigures("w2", "worker", kind="gpu", flops=2e12, memory=8e9, paths=[
            PathFigures("w2", C, 120 * MS, 5e6, 5e6)]),
    }
    return f


def test_measured_scenario_devices_links_and_regions():
    sc = measured_scenario(_figures(), WL)
    dev = {d.id: d for d in sc.devices}
    assert dev["w0"].up == pytest.approx(2e6) and dev["w0"].down == pytest.approx(10e6)  # medians of 3 paths
    assert dev["w1"].up == 50e6  # --up-mbps wins over the measured 8e6
    assert dev["s0"].can_host_server and dev["s0"].flops == 0 and dev["s0"].host_memory == 32e9
    assert dev["w0"].flops == 5e12 and dev["w0"].memory == 8e9 and dev["w0"].kind == "gpu"
    # regions: everything near the coordinator is one, w2 (120 ms away) another
    assert {dev[m].region for m in ("s0", "s1", "w0", "w1")} == {"auto-0"} and dev["w2"].region == "auto-1"
    # a measured pair: half the best round trip, the faster direction
    link = sc.network.link(dev["w0"], dev["s0"])
    assert link.latency == pytest.approx(2 * MS) and link.bandwidth == pytest.approx(9e6)
    assert sc.network.link(dev["s0"], dev["s1"]).latency == pytest.approx(0.5 * MS)
    # w2 was only measured to the coordinator: its region link goes through it (2 + 120 ms round trips)
    far = sc.network.link(dev["w2"], dev["s0"])
    assert far.latency == pytest.approx((2 + 120) * MS / 2)


def test_same_host_paths_are_loopback_not_a_slow_link():
    C = COORDINATOR_NODE
    f = _figures()
    # s0 shares its host with the coordinator and s1: those paths carry no rates
    f["s0"].paths = [PathFigures("s0", C, 0.05 * MS, 0.0, 0.0, same_host=True),
                     PathFigures("s0", "s1", 0.05 * MS, 0.0, 0.0, same_host=True),
                     PathFigures("s0", "w9", 1 * MS, 40e6, 60e6)]
    f["s1"].paths = [PathFigures("s1", "s0", 0.05 * MS, 0.0, 0.0, same_host=True)]
    sc = measured_scenario(f, WL)
    dev = {d.id: d for d in sc.devices}
    assert dev["s0"].up == 40e6 and dev["s0"].down == 60e6  # its access link: the one path that crosses it
    assert dev["s1"].up == dev["s1"].down == 1e9  # only same-host paths: loopback's rate, not "unmeasured"
    assert sc.network.link(dev["s0"], dev["s1"]).bandwidth == 1e9


def test_scenario_json_round_trip(tmp_path):
    sc = measured_scenario(_figures(), WL)
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario_to_dict(sc)))
    back = load_scenario(str(path))
    assert [d.id for d in back.devices] == [d.id for d in sc.devices]
    for a, b in zip(back.devices, sc.devices, strict=True):
        for key in ("flops", "memory", "up", "down", "host_memory"):
            assert math.isclose(getattr(a, key), getattr(b, key), rel_tol=1e-12), (a.id, key)
        assert (a.region, a.kind, a.can_host_server) == (b.region, b.kind, b.can_host_server)
    for x in sc.devices:
        for y in sc.devices:
            la, lb = back.network.link(x, y), sc.network.link(x, y)
            assert math.isclose(la.latency, lb.latency, rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(la.bandwidth, lb.bandwidth, rel_tol=1e-12)
    assert scenario_to_dict(scenario_from_dict(scenario_to_dict(back))) == scenario_to_dict(back)


# ---------------------------------------------------------------------------- measuring


def test_compute_measurement_runs_the_models_blocks_briefly():
    cfg = get_preset("tiny")
    assert measure_blocks(cfg.n_total_layers) == (1, 2)  # the first block after the embedding
    assert measure_blocks(3, blocks=5) == (1, 2)
    t0 = time.perf_counter()
    flops = measure_stage_flops(cfg, 32, 2, budget_s=0.1)
    assert 1e6 < flops < 1e13
    assert time.perf_counter() - t0 < 30  # one warm-up run + ~0.1 s (a loaded box is slow)


def test_compute_measurement_runs_in_the_runs_precision(monkeypatch):
    """bf16 is measured under autocast with bf16 activations, as the worker computes."""
    import torch

    import shoal.model.transformer as tr

    seen = []
    real = tr.build_stage

    def spy(*a, **kw):
        module = real(*a, **kw)
        module.register_forward_hook(
            lambda m, i, o: seen.append((i[0].dtype, torch.is_autocast_enabled("cpu"))))
        return module

    monkeypatch.setattr(tr, "build_stage", spy)
    flops = measure_stage_flops(get_preset("tiny"), 16, 1, budget_s=0.05, precision="bf16")
    assert 1e6 < flops < 1e13
    assert seen and set(seen) == {(torch.bfloat16, True)}


def test_kernel_rate_counts_only_what_the_link_carried():
    assert kernel_rate(0, 0.0, 10_000_000, 0.25, 10_000_000) == pytest.approx(40e6)
    assert kernel_rate(0, 0.0, 5_000_000, 0.25, 10_000_000) is None  # another connection carried it
    assert kernel_rate(0, 0.0, 10_000_000, 0.01, 10_000_000) is None  # a few clock ticks: no figure
    # the connection that acknowledged the most bytes carried the transfer
    before = {"a": (100, 1.0), "b": (0, 0.0)}
    after = {"a": (200, 1.5), "b": (4_000_000, 0.1), "c": (9_000_000, 1.0)}  # c: opened meanwhile, unknown
    assert _counted(before, after, 4_000_000) == (pytest.approx(40e6), pytest.approx(0.1))
    assert _counted({}, after, 1) == (None, 0.0)


def test_peer_strings_and_tcp_info():
    assert parse_peer("ipv4:10.0.0.3:5123") == ("10.0.0.3", 5123)
    assert parse_peer("ipv6:[::1]:7") == ("::1", 7)
    assert parse_peer("ipv6:%5B::ffff:10.0.0.3%5D:80") == ("10.0.0.3", 80)
    assert parse_peer("unix:/tmp/x") is None
    assert parse_tcp_info(b"\0" * 100) is None  # an old kernel's short struct: no figures
    assert len(host_id()) in (0, 16) and host_id() == host_id()


def test_tcp_counters_of_a_real_connection():
    import socket

    if not sys.platform.startswith("linux"):
        pytest.skip("kernel TCP counters are read on Linux only")
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    n = 3_000_000
    try:
        before = tcp_connections({"127.0.0.1"}, srv.getsockname()[1])
        assert len(before) == 1
        cli.sendall(bytes(n))
        got = 0
        while got < n:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"k")
        cli.recv(1)  # the far side had everything, so the kernel has its acknowledgements
        (c,) = tcp_connections({"127.0.0.1"}, srv.getsockname()[1]).values()
        (c0,) = before.values()
        assert isinstance(c, TcpCounters)
        assert c.acked - c0.acked >= n and c.busy_s >= c0.busy_s and 0 < c.min_rtt_s < 1
    finally:
        for s_ in (cli, conn, srv):
            s_.close()


def test_probe_reply_is_bounded():
    assert len(probe_reply(pb.ProbeRequest(reply_bytes=1000)).payload) == 1000
    with pytest.raises(ShoalError, match="at most"):
        probe_reply(pb.ProbeRequest(reply_bytes=10**12))


class _Echo(pbg.CoordinatorServicer):
    async def Probe(self, request, context):
        return probe_reply(request, context.peer())


@pytest.mark.timeout(60)
def test_probes_through_a_shaped_link_measure_its_rates():
    up, down = 0.5e6, 1.5e6  # bytes/s of the shaped access link (slow: one busy process does it all)

    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(b"s"))
        pbg.add_CoordinatorServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with LinkShaper(up=up, down=down) as shaper:
            relay = shaper.proxy_for(f"127.0.0.1:{port}", latency_s=0.005)
            async with open_channel(relay, "tok", identity=Identity.joined("tok", b"s", "w1", "worker")) as ch:
                figs = await probe_link(pbg.CoordinatorStub(ch), "coordinator", probe_bytes=1 << 19)
        await server.stop(0)
        return figs

    figs = asyncio.run(main())
    print(figs)
    assert figs.method == "call"  # through a relay: the kernel's counters would see loopback
    assert abs(figs.up_bps - up) <= 0.2 * up and abs(figs.down_bps - down) <= 0.2 * down
    assert 0.009 <= figs.rtt_s < 0.5  # two 5 ms one-way delays


def test_a_probe_call_waits_for_its_bytes_at_the_floor_rate_and_no_longer():
    from shoal.runtime.measure import PROBE_CALL_S, PROBE_FLOOR_BPS, probe_timeout_s

    assert probe_timeout_s(0, 60.0) == PROBE_CALL_S
    assert probe_timeout_s(4_000_000, 60.0) == pytest.approx(PROBE_CALL_S + 4_000_000 / PROBE_FLOOR_BPS)
    assert probe_timeout_s(10**9, 60.0) == 60.0  # never past the caller's own bound


@pytest.mark.timeout(60)
def test_a_probe_on_a_connection_that_went_silent_fails_within_its_deadline(monkeypatch):
    """The path drops every byte once the connection is open (a NAT or Wi-Fi drop without a
    reset): the probe fails at its call deadline, not after the minute it once waited."""
    import grpc

    import shoal.runtime.measure as measure

    monkeypatch.setattr(measure, "PROBE_CALL_S", 1.0)  # the deadline's fixed part, shortened to keep the test short
    silent = asyncio.Event()

    async def pump(reader, writer):
        while data := await reader.read(65536):
            if silent.is_set():
                await asyncio.Event().wait()  # swallowed: nothing arrives, nothing is reset
            writer.write(data)
            await writer.drain()

    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(b"s"))
        pbg.add_CoordinatorServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

        async def relay(reader, writer):
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.gather(pump(reader, up_w), pump(up_r, writer), return_exceptions=True)

        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        addr = f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
        try:
            async with open_channel(addr, "tok", identity=Identity.joined("tok", b"s", "w1", "worker")) as ch:
                stub = pbg.CoordinatorStub(ch)
                await stub.Probe(pb.ProbeRequest())  # the connection is up
                silent.set()
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await probe_link(stub, "coordinator", probe_bytes=1 << 20)
                return err.value.code(), time.monotonic() - t0
        finally:
            proxy.close()
            await server.stop(0)

    code, waited = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert waited < 30.0, waited  # its own deadline (about 1 s here), not the old bound of 60 s


@pytest.mark.timeout(60)
def test_a_rate_above_the_interface_is_measured_again_then_cut_to_it():
    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(b"s"))
        pbg.add_CoordinatorServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with open_channel(f"127.0.0.1:{port}", "tok", identity=Identity.joined("tok", b"s", "w1", "worker")) as ch:
            # an "interface" of 1 kB/s: loopback beats it every time
            figs = await checked_probe(pbg.CoordinatorStub(ch), "coordinator", probe_bytes=1 << 18,
                                       limit_bps=1000.0, retries=1)
        await server.stop(0)
        return figs

    figs = asyncio.run(main())
    assert "interface rate" in figs.remeasured  # measured again, not used as first measured
    assert figs.up_bps == figs.down_bps == 1000.0  # then the last figures stand, cut to the interface


@pytest.mark.timeout(60)
def test_a_probe_to_its_own_host_reports_loopback_and_the_reply_carries_counters():
    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(b"s"))
        pbg.add_CoordinatorServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        addr = f"127.0.0.1:{port}"
        async with open_channel(addr, "tok", identity=Identity.joined("tok", b"s", "w1", "worker")) as ch:
            stub = pbg.CoordinatorStub(ch)
            same = await probe_link(stub, "coordinator", probe_bytes=1 << 20, address=addr)
            await stub.Probe(pb.ProbeRequest(reply_bytes=1 << 20))
            reply = await stub.Probe(pb.ProbeRequest(tcp_stats=True))
        await server.stop(0)
        return same, reply

    same, reply = asyncio.run(main())
    assert same.same_host and same.up_bps == same.down_bps == 0.0
    assert reply.host == host_id()
    if sys.platform.startswith("linux"):  # the answering side's counters of this connection
        assert reply.HasField("tcp") and reply.tcp.bytes_acked >= 1 << 20


# ---------------------------------------------------------------------------- the coordinator

SPEC = pb.RunSpec(model="tiny", stages=2, steps=3, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                  lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=30.0,
                  min_lease_s=1.0, data="synthetic", ordered_grads=True)


def _report(mid: str, request: int, flops: float, links: dict[str, tuple[float, float, float]],
            memory: float = 16e9) -> pb.MeasureReport:
    return pb.MeasureReport(member_id=mid, request=request, device_name="cpu: test", memory=memory, flops=flops,
                            links=[pb.LinkProbe(target=t, rtt_s=r, up_bps=u, down_bps=d)
                                   for t, (r, u, d) in links.items()])


def test_coordinator_measures_plans_and_remeasures(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_mod, "REMEASURE_AFTER_S", 0.0)

    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        join = [pb.JoinRequest(role="worker", name="w0", will_measure=True),
                pb.JoinRequest(role="worker", name="w1", will_measure=True, region="home", up_bps=1e6),
                pb.JoinRequest(role="server", name="s0", address="10.0.0.1:7071", will_measure=True)]
        w0, w1, s0 = [(await c.Join(r, None)).member_id for r in join]
        a = await c.Heartbeat(pb.MemberRequest(member_id=w0), None)
        assert a.measure == 0  # nothing to probe yet: stage 1 has no server
        s1 = (await c.Join(pb.JoinRequest(role="server", name="s1", address="10.0.0.2:7071", will_measure=True),
                           None)).member_id
        hb = {m: await c.Heartbeat(pb.MemberRequest(member_id=m), None) for m in (w0, w1, s0, s1)}
        # Asked one at a time, in join order, so no two members' probes share a link (servers on
        # other machines; a run all on loopback measures at once).
        assert [hb[m].measure for m in (w0, w1, s0, s1)] == [1, 0, 0, 0] and not any(h.ready for h in hb.values())
        near = {"coordinator": (1e-3, 50e6, 50e6), "10.0.0.1:7071": (1e-3, 40e6, 60e6),
                "10.0.0.2:7071": (1e-3, 40e6, 60e6)}
        await c.Measured(_report(w0, 1, 4e9, near), None)
        assert (await c.Heartbeat(pb.MemberRequest(member_id=w1), None)).measure == 1
        assert (await c.Heartbeat(pb.MemberRequest(member_id=s0), None)).measure == 0
        await c.Measured(_report(w1, 1, 1e9, near), None)
        await c.Measured(_report(s0, 1, 0.0, {"coordinator": near["coordinator"], "10.0.0.2:7071": near["10.0.0.2:7071"]}), None)
        assert not c.ready  # s1 has not reported
        await c.Measured(_report(s1, 1, 0.0, {"coordinator": near["coordinator"], "10.0.0.1:7071": near["10.0.0.1:7071"]}), None)
        assert c.ready and c.plan is not None
        st = json.loads((await c.Status(pb.Empty(), None)).json)
        assert st["plans_on"] == "measured"
        shown = {d["name"]: d for d in st["scenario"]["devices"]}
        assert shown["w0"]["tflops"] == pytest.approx(4e-3)
        assert shown["w0"]["region"] == "home"  # w0 is near w1, which declared its region
        assert shown["w1"]["region"] == "home" and shown["w1"]["up_mbps"] == pytest.approx(8.0)  # declared
        assert shown["s0"]["can_host_server"] and shown["s0"]["host_memory_gb"] == pytest.approx(16.0)
        on_disk = load_scenario(str(tmp_path / "scenario.json"))
        assert sorted(d.id for d in on_disk.devices) == sorted((w0, w1, s0, s1))
        assert len({c.stage_server[0], c.stage_server[1]}) == 2  # one server process per stage

        # w0's tasks run at a tenth of what it measured: asked to measure again, then repaired
        slow = pb.MemberRequest(member_id=w0, observed_flops=4e8, observed_tasks=6)
        assert (await c.Heartbeat(slow, None)).measure == 2
        assert (await c.Heartbeat(slow, None)).measure == 2  # asked once until it answers
        ok = pb.MemberRequest(member_id=w1, observed_flops=0.9e9, observed_tasks=6)
        assert (await c.Heartbeat(ok, None)).measure == 1  # w1 runs as planned
        await c.Measured(_report(w0, 2, 4e8, near), None)
        assert c.planned_on.device(w0).flops == 4e8  # the repair ran on the new figures
        assert load_scenario(str(tmp_path / "scenario.json")).device(w0).flops == pytest.approx(4e8)
        ev = read_jsonl(tmp_path / "events.jsonl")
        assert [e["why"] for e in ev if e["event"] == "remeasure"] == ["task FLOP/s 4e+08 vs 4e+09 planned"]

    asyncio.run(main())


def test_members_measure_at_once_only_on_one_machine():
    assert one_machine(["127.0.0.1:7071", "[::1]:7072", "localhost:7073"])
    assert not one_machine(["127.0.0.1:7071", "10.0.0.2:7071"])
    assert not one_machine([])


def test_a_member_that_never_reports_is_planned_as_it_joined(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_mod, "MEASURE_TIMEOUT_S", 0.05)

    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", name=f"s{i}", address=f"127.0.0.1:{i + 1}",
                                        will_measure=True), None)
        for i in range(2):
            await c.Join(pb.JoinRequest(role="worker", name=f"w{i}", will_measure=True, flops=1e9), None)
        assert not c.ready
        reaper = asyncio.create_task(c.reap())
        await asyncio.sleep(0.5)
        reaper.cancel()
        assert c.ready and c.plan is not None
        ev = read_jsonl(tmp_path / "events.jsonl")
        assert sum(e["event"] == "measure_timeout" for e in ev) == 4

    asyncio.run(main())


@pytest.mark.parametrize("flags,says", [(["--up-mbps", "-1"], "--up-mbps must be >= 0"),
                                        (["--probe-mb", "100"], "--probe-mb must be in (0, 64]")])
def test_bad_measurement_flags_are_one_line_errors(flags, says, capsys, monkeypatch):
    from shoal.runtime.processes.cli import main

    monkeypatch.setenv("SHOAL_TOKEN", "tok")
    assert main(["worker", "--join", "127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_memory_fits_by_the_planners_rule():
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.types import SyncPolicy
    from shoal.runtime.roles.planning import memory_fits, unplaced_reason

    prof = profile_model(get_preset("tiny"), 32, 2, 4)
    layers = [(0, 2), (2, 6)]
    exact = [stage_worker_memory(prof, a, b) for a, b in layers]
    local = [stage_worker_memory(prof, a, b, SyncPolicy(mode="local")) for a, b in layers]
    assert exact[0] != exact[1] and all(x < y for x, y in zip(exact, local, strict=True))
    small, big = sorted(exact)
    memory = {"none": small / 2, "one": small, "both": 2 * big, "unknown": 0.0}
    got = memory_fits(memory, layers, prof, local=False)
    assert got == {"none": [], "one": [exact.index(small)], "both": [0, 1]}  # unknown: any stage
    # local mode adds the inner optimizer: the card that held one stage holds none
    assert memory_fits({"one": small}, layers, prof, local=True) == {"one": []}
    # lean workers hold 12 bytes a parameter: a card that takes a stage of standard local mode
    # with nothing to spare takes it lean too, and one that takes it lean only is told so
    lean = [stage_worker_memory(prof, a, b, SyncPolicy(mode="local", lean=True)) for a, b in layers]
    assert all(x < y for x, y in zip(lean, local, strict=True))
    k = lean.index(min(lean))
    assert memory_fits({"lean": lean[k]}, layers, prof, local=True, lean=True)["lean"] == [k]
    assert memory_fits({"lean": lean[k]}, layers, prof, local=True) == {"lean": []}
    assert f"needs {lean[k] / 1e9:.3g} GB" in unplaced_reason(lean[k] / 2, layers, prof, local=True, lean=True)
    why = unplaced_reason(small / 2, layers, prof, local=False)
    k = exact.index(small)
    assert f"stage {k} (layers {layers[k][0]}-{layers[k][1]})" in why and "\n" not in why
