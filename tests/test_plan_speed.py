"""The planner's shortcuts change nothing but its speed: the cost model's memo returns what a
fresh evaluation returns, the stage-count bound is below every plan the allocator builds, and
skipping hopeless stage counts leaves the chosen plan as it was."""

import pytest

import shoal.plan.allocator as allocator
from shoal.plan import load_scenario, make_plan, predict
from shoal.plan.allocator import construct, stage_count_bound, stage_count_hopeless
from shoal.plan.common import SyncTable, step_of
from shoal.plan.compression import parse_compression
from shoal.plan.cost import CostOptions, scenario_profile
from shoal.plan.types import Plan, StagePlan, SyncPolicy


def local32():
    c = parse_compression("int8")
    return SyncPolicy(mode="local", sync_every=32, act_codec=c["act"], grad_codec=c["grad"], push_codec=c["push"],
                      pull_codec=c["pull"], overlap_uploads=True)


@pytest.mark.parametrize("sync", [SyncPolicy(), local32()], ids=["exact", "local"])
def test_memoised_prediction_equals_a_fresh_one(sync):
    s = load_scenario("gaming-eu")
    p = make_plan(s, sync=sync)
    memo: dict = {}
    fresh = predict(p, s)
    assert predict(p, s, memo=memo) == fresh  # filled the memo
    assert predict(p, s, memo=memo) == fresh  # served from it
    # a neighbouring plan sharing all but one stage's rows with the memoised one
    q = Plan(p.scenario, p.model, p.method, [StagePlan(st.layers, st.server, list(st.workers)) for st in p.stages],
             p.micro_batch_size, p.micro_batches, p.sync)
    q.stages[0].workers = q.stages[0].workers[:-1] or q.stages[0].workers
    assert predict(q, s, memo=memo) == predict(q, s)


def test_hopeless_needs_five_cheaper_stage_counts():
    assert not stage_count_hopeless({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}, 10.0)
    assert stage_count_hopeless({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}, 10.0)
    assert not stage_count_hopeless({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 10.0}, 10.0)  # strictly cheaper
    assert not stage_count_hopeless({1: 1.0, 2: float("inf"), 3: 3.0, 4: 4.0, 5: 5.0}, 10.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", [SyncPolicy(), local32()], ids=["exact", "local"])
def test_stage_count_bound_is_below_every_constructed_plan(sync):
    s = load_scenario("gaming-eu")
    prof = scenario_profile(s)
    n = len(prof.layers)
    bound = stage_count_bound(s, sync, prof)
    table = SyncTable(s)
    seen = 0
    for count in range(1, n + 1, 3):
        for snap in (0.35, 0.0):
            p = construct(s, count, sync, CostOptions(), snap, table)
            if p is not None:
                seen += 1
                assert step_of(p, s) >= bound(count)
    assert seen > 5
    # the bound grows with the stage count: past some count it exceeds the chosen plan's step
    best = make_plan(s, sync=sync).predicted["expected_step_time_s"]
    assert bound(n) > best


@pytest.mark.timeout(120)
def test_skipping_hopeless_stage_counts_keeps_the_plan(monkeypatch):
    s = load_scenario("gaming-world")
    sync = local32()
    # no wall-clock cut of the local search (its safety net), so a loaded machine cannot differ
    fast = allocator.plan_shoal(s, sync=sync, budget_s=1e9)
    monkeypatch.setattr(allocator, "stage_count_bound", lambda *a, **k: (lambda count: 0.0))
    full = allocator.plan_shoal(s, sync=sync, budget_s=1e9)
    assert [(st.layers, st.server, st.workers) for st in fast.stages] == \
        [(st.layers, st.server, st.workers) for st in full.stages]
    assert fast.predicted == full.predicted
