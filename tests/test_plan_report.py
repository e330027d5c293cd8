"""The swarm figures (shoal.plan.report): tokens/s against the swarm's FLOP limit, devices used,
and why each idle device is idle, on hand-built cases; and that the CLIs print them."""

from __future__ import annotations

import json

import pytest

from shoal.plan import predict, scenario_from_dict
from shoal.plan.cost import scenario_profile
from shoal.plan.report import (
    IDLE_LINKS,
    IDLE_MEMORY,
    IDLE_NO_BENEFIT,
    IDLE_SERVER_CPU,
    flop_limit_tokens_per_s,
    swarm_report,
    training_flops_per_token,
)
from shoal.plan.types import Plan, StagePlan

# tiny model: forward FLOPs per token 2260992 (see test_plan_cost.py), forward + backward 3x
TINY_TRAIN_FLOPS_PER_TOKEN = 3 * 2260992


def _scenario():
    def dev(i, tflops, mem_gb, up_mbps):
        return {"id": i, "tflops": tflops, "memory_gb": mem_gb, "region": "a", "up_mbps": up_mbps, "down_mbps": 200}

    devices = [dev("w0", 1, 8, 20),  # works
               dev("slow", 0.001, 8, 20),  # fits, good links, 1000x slower: no benefit
               dev("small", 1, 0.001, 20),  # 1 MB: holds no stage
               dev("thin", 0.001, 8, 0.001)]  # fits, but its sync push at 125 B/s outlasts any step
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10, "down_gbps": 10,
                    "can_host_server": True})
    return scenario_from_dict({
        "name": "hand-swarm",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices,
    })


def test_flop_limit_counts_every_worker_used_or_not():
    s = _scenario()
    assert training_flops_per_token(scenario_profile(s)) == pytest.approx(TINY_TRAIN_FLOPS_PER_TOKEN)
    # 1 + 0.001 + 1 + 0.001 TFLOP/s; the server host (0 FLOP/s) adds nothing
    assert flop_limit_tokens_per_s(s) == pytest.approx(2.002e12 / TINY_TRAIN_FLOPS_PER_TOKEN)


def test_report_of_a_hand_plan():
    s = _scenario()
    plan = Plan("hand-swarm", "tiny", "test", [StagePlan((0, 6), "h", ["w0"])], micro_batch_size=2, micro_batches=4)
    pred = predict(plan, s)
    rep = swarm_report(plan, s)
    tokens = 8 * 64  # global batch x sequence length
    assert rep.tokens_per_s == pytest.approx(tokens / pred["step_time_s"])
    assert pred["tokens_per_s"] == pytest.approx(rep.tokens_per_s)
    assert rep.flop_share == pytest.approx(rep.tokens_per_s / flop_limit_tokens_per_s(s))
    assert pred["flop_share"] == pytest.approx(rep.flop_share)
    assert (rep.devices_used, rep.devices_available) == (1, 4)
    assert rep.idle == {"slow": IDLE_NO_BENEFIT, "small": IDLE_MEMORY, "thin": IDLE_LINKS}
    assert rep.idle_counts() == {IDLE_MEMORY: 1, IDLE_LINKS: 1, IDLE_NO_BENEFIT: 1, IDLE_SERVER_CPU: 0}
    assert "GB" in rep.why["small"] and "round" not in rep.why["thin"] and "step" in rep.why["thin"]
    # the busy share of the used devices stays, as a secondary figure
    assert rep.busy_share == pred["utilisation"]
    # a step twice as long halves tokens/s and the share
    slow = swarm_report(plan, s, step_s=2 * pred["step_time_s"])
    assert slow.flop_share == pytest.approx(rep.flop_share / 2)
    assert "of the swarm's FLOP limit" in rep.summary() and "1/4 devices used" in rep.summary()


def test_an_idle_device_beside_a_stage_of_only_the_embedding_gets_a_reason():
    """A stage holding only layer 0 (the embedding: no FLOPs in the profile) once divided a
    device's transfers by its compute of 0 (the planner made such a plan for `demo` with exact
    sync's ordered pushes)."""
    s = _scenario()
    plan = Plan("hand-swarm", "tiny", "test", [StagePlan((0, 1), "h", ["w0"]), StagePlan((1, 6), "h", ["slow"])],
                micro_batch_size=2, micro_batches=4)
    predict(plan, s)
    rep = swarm_report(plan, s)
    assert rep.idle["thin"] == IDLE_LINKS and "layers [1, 6)" in rep.why["thin"]  # (the stage it could help)
    assert rep.idle["small"] == IDLE_MEMORY


def test_one_device_at_its_flop_limit_is_its_share():
    """A plan whose only worker computed without any overhead would reach that worker's share of
    the limit: the share of the swarm is bounded by the used devices' FLOP/s."""
    s = _scenario()
    plan = Plan("hand-swarm", "tiny", "test", [StagePlan((0, 6), "h", ["w0"])], micro_batch_size=2, micro_batches=4)
    predict(plan, s)
    ideal = 8 * 64 * TINY_TRAIN_FLOPS_PER_TOKEN / 1e12  # seconds w0 needs for the step's FLOPs
    rep = swarm_report(plan, s, step_s=ideal)
    assert rep.flop_share == pytest.approx(1 / 2.002)
    assert swarm_report(plan, s).flop_share < rep.flop_share  # leases and transfers cost time


@pytest.mark.timeout(300)
def test_cli_prints_the_swarm_figures(tmp_path, capsys):
    from shoal.cli import main

    assert main(["plan", "--scenario", "hetero-compute"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "of the swarm's FLOP limit" in out and "devices used" in out
    out_json = tmp_path / "cmp.json"
    assert main(["plan", "--scenario", "hetero-network", "--sync", "exact", "--compare", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["methods"]
    shoal = next(r for r in rows if r["method"] == "shoal")
    assert 0 < shoal["predicted_flop_share"] < 1 and shoal["devices_available"] == 32
    assert shoal["devices_used"] + sum(shoal["idle_counts"].values()) == 32
    assert shoal["simulated_flop_share"] == pytest.approx(
        shoal["simulated_tokens_per_s"] / shoal["predicted_tokens_per_s"] * shoal["predicted_flop_share"])


def test_a_card_that_would_hold_a_deeper_replica_is_idle_for_no_benefit_not_memory():
    """In a replica plan a card too small for the plan's stages but big enough for every stage
    of a deeper replica was left out by the planner's choice (no benefit); one too small for any
    replica the planner builds is idle for memory."""
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.replicas import stages_needed
    from shoal.plan.scenario import scenario_to_dict
    from shoal.plan.types import Replica, SyncPolicy

    s = _scenario()
    pol = SyncPolicy(mode="local", sync_every=4)
    prof = scenario_profile(s)
    whole = stage_worker_memory(prof, 0, 6, pol)
    half = max(stage_worker_memory(prof, 0, 3, pol), stage_worker_memory(prof, 3, 6, pol))
    assert half < whole
    d = scenario_to_dict(s)
    for dev in d["devices"]:
        if dev["id"] == "small":
            dev["memory_gb"] = (half + whole) / 2 / 1e9  # holds a 2-stage split, not the whole model
    s = scenario_from_dict(d)
    small = next(x for x in s.devices if x.id == "small")
    assert stages_needed(prof, small, pol) == 2
    rep_stages = [StagePlan((0, 6), "h", ["w0"])]
    plan = Plan("hand-swarm", "tiny", "test", rep_stages, micro_batch_size=2, micro_batches=4, sync=pol,
                replicas=[Replica(stages=rep_stages, micro_batches=4)])
    rep = swarm_report(plan, s)
    assert rep.idle["small"] == IDLE_NO_BENEFIT and "2-stage replica" in rep.why["small"]
    # no server host with the memory for a second replica's servers: idle for host memory, unless
    # the planner's plan with that memory (MemoryWhatIf) leaves it out too or is no faster
    from shoal.plan.report import MemoryWhatIf, host_memory_idle

    server = prof.server_memory(0, 6, local=True)
    tight = scenario_to_dict(s)
    for dev in tight["devices"]:
        if dev["id"] == "h":
            dev["host_memory_gb"] = 1.5 * server / 1e9
    tight = scenario_from_dict(tight)
    bare = swarm_report(plan, tight)
    assert bare.idle["small"] == IDLE_MEMORY and "of host memory" in bare.why["small"]
    assert host_memory_idle(bare) == ["small"]
    mine = predict(plan, tight)["tokens_per_s"]  # (the figure the what-if is held against)
    assert mine > 0
    faster, level = 1.5 * mine, 1.005 * mine  # (within WHAT_IF_GAIN: the planner's own noise)
    uses = MemoryWhatIf(used=frozenset({"w0", "small"}), tokens_per_s=faster, host_memory=1e15)
    rep = swarm_report(plan, tight, what_if=uses)
    assert rep.idle["small"] == IDLE_MEMORY and "the planner uses it" in rep.why["small"]
    for other in (MemoryWhatIf(frozenset({"w0"}), faster, 1e15), MemoryWhatIf(frozenset({"w0", "small"}), level, 1e15)):
        rep = swarm_report(plan, tight, what_if=other)
        assert rep.idle["small"] == IDLE_NO_BENEFIT and "ample memory" in rep.why["small"], rep.why
    # one pipeline, no replicas: the same card is idle for memory, as before
    one = Plan("hand-swarm", "tiny", "test", rep_stages, micro_batch_size=2, micro_batches=4, sync=pol)
    assert swarm_report(one, s).idle["small"] == IDLE_MEMORY
    # a card below every split up to MAX_REPLICA_STAGES is idle for memory in a replica plan too
    for dev in d["devices"]:
        if dev["id"] == "small":
            dev["memory_gb"] = 0.001
    assert swarm_report(plan, scenario_from_dict(d)).idle["small"] == IDLE_MEMORY


def test_host_memory_counts_only_the_hosts_of_the_devices_own_cluster():
    """A replica's stage servers live in its network cluster: a card of region a, whose host is
    full, is short of host memory however much room region b's host has (scale-1024: one of 16
    hosts had room for a replica, and every other region's 8-16 GB cards were called idle for
    "no benefit" with a made-up reason instead of being put to the host-memory what-if)."""
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.report import host_short, server_room
    from shoal.plan.scenario import scenario_to_dict
    from shoal.plan.types import Replica, SyncPolicy

    pol = SyncPolicy(mode="local", sync_every=4)
    d = scenario_to_dict(_scenario())
    prof = scenario_profile(_scenario())
    server = prof.server_memory(0, 6, local=True)
    whole = stage_worker_memory(prof, 0, 6, pol)
    half = max(stage_worker_memory(prof, 0, 3, pol), stage_worker_memory(prof, 3, 6, pol))
    for dev in d["devices"]:
        if dev["id"] == "h":
            dev["host_memory_gb"] = 1.5 * server / 1e9  # room for one replica's servers
        if dev["id"] == "small":  # a 2-stage split fits it, the whole model does not
            dev["memory_gb"] = (half + whole) / 2 / 1e9
    d["devices"].append({"id": "hb", "tflops": 0, "memory_gb": 0, "region": "b", "up_gbps": 10, "down_gbps": 10,
                         "can_host_server": True, "host_memory_gb": 10 * server / 1e9})
    d["devices"].append({"id": "wb", "tflops": 1, "memory_gb": 8, "region": "b", "up_mbps": 20, "down_mbps": 200})
    d["network"]["intra"]["b"] = {"latency_ms": 5, "bandwidth_gbps": 1}
    d["network"]["inter"] = [{"regions": ["a", "b"], "latency_ms": 150, "bandwidth_mbps": 10}]
    s = scenario_from_dict(d)
    ra, rb = [StagePlan((0, 6), "h", ["w0"])], [StagePlan((0, 6), "hb", ["wb"])]
    plan = Plan("hand-swarm", "tiny", "test", ra, micro_batch_size=2, micro_batches=4, sync=pol,
                replicas=[Replica(stages=ra, micro_batches=2, cluster="a"), Replica(stages=rb, micro_batches=2, cluster="b")])
    small = next(x for x in s.devices if x.id == "small")
    assert server_room(plan, s, prof) == pytest.approx(9 * server)  # region b's host
    assert server_room(plan, s, prof, small) == pytest.approx(0.5 * server)  # its own region's
    k, room, whole = host_short(small, plan, s)
    assert k == 2 and room < whole
    assert "network cluster have at most" in swarm_report(plan, s).why["small"]
