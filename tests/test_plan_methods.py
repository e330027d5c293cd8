"""Every planner yields valid plans; shoal matches the exhaustive optimum on tiny instances;
repair keeps plans valid; plans round-trip through JSON; the CLI works end to end."""

import json

import pytest

from shoal.cli import main
from shoal.errors import ShoalError
from shoal.plan import (
    BUILTIN_SCENARIOS,
    METHODS,
    load_scenario,
    make_plan,
    repair,
    scenario_from_dict,
    validate_plan,
)
from shoal.plan.types import Plan, StagePlan

# scale-1024 / scale-4096 are benchmark sizes; scale-100 stands in for them here.
SCENARIOS = [n for n in BUILTIN_SCENARIOS if n not in ("scale-1024", "scale-4096", "scale-256")] + ["scale-100"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_method_plans_every_builtin_validly(name):
    s = load_scenario(name)
    for method in METHODS:
        if method == "exhaustive":
            continue
        p = make_plan(s, method=method, seed=1)
        validate_plan(p, s)
        assert p.method == method
        assert p.predicted["step_time_s"] > 0 and p.planning_time_s > 0
        assert p.predicted["memory_headroom"] >= 0


def tiny_instance(kinds, hosts=1, up_slow=False, inter_mbps=100):
    devices = []
    for i, kind in enumerate(kinds):
        tflops, region, mem, up = (*kind, 4, None)[:4] if len(kind) < 4 else kind
        up = up or (5 if (up_slow and i == 0) else 200)
        devices.append({"id": f"d{i}", "tflops": tflops, "memory_gb": mem, "region": region,
                        "up_mbps": up, "down_mbps": 500})
    for h in range(hosts):
        devices.append({"id": f"h{h}", "tflops": 0, "memory_gb": 0, "region": "a" if h == 0 else "b",
                        "up_gbps": 1, "down_gbps": 1, "can_host_server": True})
    return scenario_from_dict({
        "name": "tiny-instance",
        "workload": {"model": "tiny", "seq_len": 128, "global_batch": 32, "micro_batch_size": 4, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 2, "bandwidth_gbps": 1}, "b": {"latency_ms": 2, "bandwidth_gbps": 1}},
                    "inter": [{"regions": ["a", "b"], "latency_ms": 60, "bandwidth_mbps": inter_mbps}]},
        "devices": devices,
    })


@pytest.mark.parametrize("instance", [
    lambda: tiny_instance([(0.5, "a"), (0.5, "a"), (0.1, "b"), (0.1, "b")]),
    lambda: tiny_instance([(0.2, "a"), (0.05, "a"), (0.2, "b")], hosts=2),
    lambda: tiny_instance([(0.3, "a"), (0.3, "a"), (0.3, "b"), (0.02, "b")], up_slow=True),
    # needs a compound move (drop a device and move its stage's server) to reach the optimum
    lambda: tiny_instance([(0.02, "a", 0.06, 5), (0.3, "b", 0.03, 500), (0.02, "a", 4, 5), (0.02, "b", 0.06, 5)],
                          hosts=2, inter_mbps=20),
])
def test_shoal_is_within_five_percent_of_exhaustive(instance):
    s = instance()
    best = make_plan(s, method="exhaustive")
    ours = make_plan(s, method="shoal")
    assert best.predicted["step_time_s"] <= ours.predicted["step_time_s"] * (1 + 1e-9)
    assert ours.predicted["step_time_s"] <= 1.05 * best.predicted["step_time_s"]


def test_exhaustive_refuses_big_instances():
    with pytest.raises(ShoalError, match="tiny instances"):
        make_plan(load_scenario("hetero-all"), method="exhaustive")


def test_forced_stage_count():
    s = load_scenario("demo")
    for method in ("shoal", "dtfm", "swarm", "dapple", "random"):
        assert make_plan(s, method=method, stages=3).n_stages == 3


@pytest.mark.parametrize("stages", [1, 3])
def test_repair_after_removing_any_single_device_is_valid(stages):
    s = load_scenario("demo")
    p = make_plan(s, stages=stages)
    for d in s.devices:
        q = repair(p, s, left=[d.id])
        live = [x for x in s.devices if x.id != d.id]
        assert all(w != d.id for st in q.stages for w in st.workers)
        assert all(st.server != d.id for st in q.stages)
        assert {w for st in q.stages for w in st.workers} <= {x.id for x in live}
        from shoal.plan.repair import live_scenario
        validate_plan(q, live_scenario(s, [d.id]))


def test_repair_handles_a_stage_losing_all_workers_and_its_server():
    s = load_scenario("gaming-eu")
    p = make_plan(s, stages=3)
    left = list(p.stages[1].workers) + [p.stages[1].server]
    q = repair(p, s, left=left)
    from shoal.plan.repair import live_scenario
    validate_plan(q, live_scenario(s, left))
    assert not set(left) & {w for st in q.stages for w in st.workers}


def test_a_repair_that_keeps_the_stage_count_steals_a_worker_instead_of_merging():
    # A running swarm cannot merge stages (its servers hold fixed layers): when the only worker
    # of a stage leaves, the coordinator's repair (keep_stages) moves a worker there.
    from shoal.plan.repair import live_scenario

    s = load_scenario("demo")
    p = make_plan(s, stages=3)
    lone = next(i for i, st in enumerate(p.stages) if len(st.workers) == 1)
    left = list(p.stages[lone].workers)
    assert repair(p, s, left=left).n_stages == 2  # free to merge, the planner's repair does
    q = repair(p, s, left=left, keep_stages=True)
    validate_plan(q, live_scenario(s, left))
    assert q.n_stages == 3 and all(st.workers for st in q.stages)
    assert not set(left) & {w for st in q.stages for w in st.workers}
    # Fewer live workers than stages: no such plan, and the error says why.
    keep = s.workers[0].id
    gone = [d.id for d in s.workers if d.id != keep]
    with pytest.raises(ShoalError, match="1 live worker.*cannot serve 3 stages"):
        repair(p, s, left=gone, keep_stages=True)


def test_repair_uses_joined_devices_when_they_help():
    s = load_scenario("hetero-compute")
    full = make_plan(s)
    used = [w for st in full.stages for w in st.workers]
    # Start from a plan that lacks half of the used devices, then let them join.
    gone = used[: len(used) // 2]
    partial = Plan(full.scenario, full.model, "shoal",
                   [StagePlan(st.layers, st.server, [w for w in st.workers if w not in gone] or [st.workers[0]])
                    for st in full.stages], full.micro_batch_size, full.micro_batches)
    for st in partial.stages:
        gone = [g for g in gone if g not in st.workers]
    validate_plan(partial, s)
    from shoal.plan.cost import predict
    before = predict(partial, s)["step_time_s"]
    q = repair(partial, s, joined=gone)
    validate_plan(q, s)
    assert q.predicted["step_time_s"] < before


def test_plan_json_round_trip(tmp_path):
    s = load_scenario("hetero-network")
    p = make_plan(s)
    p.to_json(tmp_path / "p.json")
    q = Plan.from_json(tmp_path / "p.json")
    assert json.loads(json.dumps(q.to_dict())) == json.loads(json.dumps(p.to_dict()))
    validate_plan(q, s)


def test_validate_plan_rejects_bad_plans():
    s = load_scenario("demo")
    p = make_plan(s, stages=2)
    w0 = p.stages[0].workers[0]
    bad = [
        (lambda q: setattr(q.stages[1], "layers", (q.stages[0].layers[1] + 1, 6)), "contiguous"),
        (lambda q: setattr(q.stages[0], "workers", []), "no workers"),
        (lambda q: q.stages[1].workers.append(w0), "at most one stage"),
        (lambda q: setattr(q.stages[0], "server", w0), "not allowed to host"),
        (lambda q: setattr(q, "micro_batches", 3), "global batch"),
    ]
    for mutate, message in bad:
        q = Plan.from_dict(p.to_dict())
        mutate(q)
        with pytest.raises(ShoalError, match=message):
            validate_plan(q, s)


def test_cli_plan_writes_json_and_compare(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--scenario", "demo", "--stages", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert len(d["stages"]) == 2 and d["predicted_step_time_s"] > 0
    assert all("layers" in st and "server" in st and "workers" in st for st in d["stages"])
    cmp_out = tmp_path / "cmp.json"
    assert main(["plan", "--compare", "--scenario", "demo", "--json", str(cmp_out)]) == 0
    rows = json.loads(cmp_out.read_text())["methods"]
    assert {r["method"] for r in rows} >= {"shoal", "dtfm", "swarm", "dapple", "random"}
    assert main(["plan", "--list"]) == 0
    assert "gaming-eu" in capsys.readouterr().out
    assert main(["plan", "--scenario", "no-such-scenario"]) == 2


def test_tuning_the_micro_batch_keeps_the_global_batch_and_never_hurts():
    s = load_scenario("demo")
    plain = make_plan(s)
    tuned = make_plan(s, tune_micro_batch=True)
    validate_plan(tuned, s)
    assert tuned.micro_batches * tuned.micro_batch_size == s.workload.global_batch
    assert tuned.predicted["step_time_s"] <= plain.predicted["step_time_s"] * (1 + 1e-9)
    with pytest.raises(ShoalError):
        make_plan(s, method="dapple", tune_micro_batch=True)


def test_impossible_stage_counts_are_user_errors():
    s = load_scenario("demo")
    for bad in (0, 7):
        with pytest.raises(ShoalError, match="--stages must be in"):
            make_plan(s, stages=bad)
    assert main(["plan", "--scenario", "demo", "--stages", "99"]) == 2


def test_a_chain_of_repairs_under_random_churn_stays_valid():
    import random

    from shoal.plan.repair import live_scenario
    s = load_scenario("demo")
    rng = random.Random(5)
    plan = make_plan(s, stages=3)
    gone: set[str] = set()
    for _ in range(25):
        online = [d.id for d in s.devices if d.id not in gone]
        live_workers = [d for d in s.workers if d.id not in gone]
        live_hosts = [d for d in s.server_hosts if d.id not in gone]
        can_leave = [d for d in online if not (
            (d in {w.id for w in live_workers} and len(live_workers) <= 2)
            or (d in {h.id for h in live_hosts} and len(live_hosts) <= 1))]
        if gone and (rng.random() < 0.4 or not can_leave):
            back = rng.choice(sorted(gone))
            gone.discard(back)
            plan = repair(plan, s, left=sorted(gone), joined=[back])
        else:
            leaving = rng.choice(can_leave)
            gone.add(leaving)
            plan = repair(plan, s, left=sorted(gone))
        validate_plan(plan, live_scenario(s, gone))
        assert plan.predicted["step_time_s"] > 0
