"""The coordinator's planning scenario: loopback for plain runs, the emulated scenario's
devices and links (per member) when the processes emulate one."""

from __future__ import annotations

import asyncio

from shoal.emulate.pacing import emulated_scenario
from shoal.net import shoal_pb2 as pb
from shoal.plan.types import Device, Link, Network, Scenario, Workload
from shoal.runtime.roles.coordinator import Coordinator
from shoal.runtime.roles.planning import (
    LOOPBACK_REGION,
    loopback_device,
    member_network,
    planning_scenario,
    played_device,
)

WL = Workload(model="tiny", seq_len=16, global_batch=4, micro_batch_size=2, dtype_bytes=4)
FAR = Link(latency=0.05, bandwidth=1e6)
NEAR = Link(latency=0.001, bandwidth=1e8)
PAIR = Link(latency=0.2, bandwidth=1e5)


def scenario() -> Scenario:
    devs = [Device("h", "server", 0.0, 0.0, "eu", 1e9, 1e9, can_host_server=True),
            Device("a", "gpu", 1e12, 24e9, "eu", 1e8, 1e8),
            Device("b", "gpu", 1e12, 24e9, "eu", 1e8, 1e8),
            Device("c", "gpu", 5e11, 24e9, "us", 1e7, 1e7, can_host_server=True)]
    net = Network(intra={"eu": NEAR, "us": NEAR}, inter={("eu", "us"): FAR}, overrides={("a", "b"): PAIR})
    return Scenario(name="two-regions", devices=devs, network=net, workload=WL)


def test_plain_run_plans_on_loopback():
    devs = {"w0": loopback_device("w0", "worker", 2e9), "s0": loopback_device("s0", "server", 5.0)}
    sc = planning_scenario(devs, WL)
    assert {d.region for d in sc.devices} == {LOOPBACK_REGION}
    assert devs["s0"].flops == 0.0 and devs["s0"].can_host_server and devs["w0"].flops == 2e9
    assert sc.network.link(devs["w0"], devs["s0"]).bandwidth == 1e9


def test_members_take_their_played_devices_and_links():
    em = emulated_scenario(scenario(), speedup=1e-3, latency_scale=2.0, bandwidth_scale=0.5)
    plays = {"w0-a": "a", "w1-b": "b", "w2-c": "c", "s0-h": "h", "s1-h": "h"}
    roles = {"w0-a": "worker", "w1-b": "worker", "w2-c": "worker", "s0-h": "server", "s1-h": "server"}
    devs = {m: played_device(em, m, roles[m], d) for m, d in plays.items()}
    assert devs["w2-c"].flops == 5e11 * 1e-3 and not devs["w2-c"].can_host_server  # a worker never serves
    assert devs["s0-h"].flops == 0.0 and devs["s0-h"].can_host_server
    sc = planning_scenario(devs, WL, em, plays)
    link = sc.network.link
    assert link(devs["w2-c"], devs["s0-h"]) == Link(0.1, 5e5)  # scaled eu-us link
    assert link(devs["w0-a"], devs["s0-h"]) == Link(0.002, 5e7)  # scaled eu link
    assert link(devs["w0-a"], devs["w1-b"]) == Link(0.4, 5e4)  # the a-b override, moved to members
    assert link(devs["s0-h"], devs["s1-h"]) == em.network.loopback  # one host, two processes


def test_coordinator_plans_on_the_emulated_scenario(tmp_path):
    em = emulated_scenario(scenario(), speedup=1e-3)
    spec = pb.RunSpec(model="tiny", stages=2, steps=3, micro_batches=2, micro_batch_size=2, seq_len=16,
                      seed=0, lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                      dead_after_s=0.3, min_lease_s=1.0, data="synthetic", ordered_grads=True)

    async def main():
        c = Coordinator(spec, "tok", min_workers=3, out=str(tmp_path), emulated=em)
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}",
                                        device="h"), None)
        ws = [(await c.Join(pb.JoinRequest(role="worker", flops=1.0, name=f"w{i}", device=d), None)).member_id
              for i, d in enumerate("abc")]
        assert c.ready and c.plan is not None  # the planner ran (not the even split)
        sc = c._scenario()
        assert sc.name == "two-regions"
        by_id = {d.id: d for d in sc.devices}
        assert by_id[ws[2]].region == "us" and by_id[ws[2]].flops == 5e11 * 1e-3  # not the reported 1.0
        server = next(d for d in sc.devices if d.can_host_server)
        assert sc.network.link(by_id[ws[2]], server) == FAR
        assert sorted(set(c.assign.values())) == [0, 1]
        # a killed worker rejoins as a new member playing the same device: repaired on it
        await c.Leave(pb.MemberRequest(member_id=ws[0]), None)
        back = (await c.Join(pb.JoinRequest(role="worker", flops=1.0, name="w0", device="a"), None)).member_id
        assert c.plays[back] == "a" and back in c.assign
        assert c._scenario().network.link(c.devices[back], c.devices[ws[1]]) == PAIR

    asyncio.run(main())


def _member_network_by_pairs(emulated: Scenario, plays: dict[str, str]) -> dict:
    """member_network's overrides the plain way: every pair of members looked at."""
    net, out, members = emulated.network, {}, sorted(plays)
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            da, db = plays[a], plays[b]
            if da == db:
                out[(a, b)] = net.loopback
            elif (pair := (da, db) if da < db else (db, da)) in net.overrides:
                out[(a, b)] = net.overrides[pair]
    return out


def test_member_network_moves_exactly_the_pair_links_to_members():
    """Only members sharing a device (loopback) and members on a listed device pair get a
    link of their own, in pair order; the same as looking at every pair of members."""
    import random

    em = scenario()
    rng = random.Random(3)
    for n in (0, 1, 2, 7, 40):
        # ids chosen so that member order and device order disagree
        plays = {f"m{rng.randrange(10**6):06d}-{k}": rng.choice("abch") for k in range(n)}
        got = member_network(em, plays).overrides
        want = _member_network_by_pairs(em, plays)
        assert got == want and list(got) == list(want), n
    plays = {"w9-a": "a", "w1-b": "b", "w5-c": "c", "s0-h": "h", "s1-h": "h"}
    assert member_network(em, plays).overrides == {("s0-h", "s1-h"): em.network.loopback, ("w1-b", "w9-a"): PAIR}
