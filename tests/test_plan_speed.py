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
    assert not any(d.can_host_server for d in s.workers)  # so the bound has its transfer and sync terms
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


def _dp_reference(est: list[dict], n_layers: int):
    """The layer-boundary DP written out loop by loop: smallest largest estimate, ties to the smallest a."""
    inf = float("inf")
    s_count = len(est)
    best = [[inf] * (n_layers + 1) for _ in range(s_count + 1)]
    arg = [[0] * (n_layers + 1) for _ in range(s_count + 1)]
    best[0][0] = 0.0
    for s in range(1, s_count + 1):
        for b in range(s, n_layers - (s_count - s) + 1):
            for a in range(s - 1, b):
                v = max(best[s - 1][a], est[s - 1][(a, b)])
                if v < best[s][b]:
                    best[s][b], arg[s][b] = v, a
    if best[s_count][n_layers] == inf:
        return inf, []
    out, b = [], n_layers
    for s in range(s_count, 0, -1):
        out.append((arg[s][b], b))
        b = arg[s][b]
    return best[s_count][n_layers], out[::-1]


def test_layer_dp_equals_the_loop_by_loop_reference():
    import numpy as np

    class Table:
        def __init__(self, est, n):
            self.dense = np.full((n + 1, n + 1), np.inf)
            for (a, b), v in est.items():
                self.dense[a, b] = v

    rng = np.random.default_rng(0)
    for n_layers in (1, 2, 5, 12, 26):
        for s_count in sorted({1, 2, min(3, n_layers), min(n_layers, 12)}):
            for values in (None, [1.0, 2.0, 3.0]):  # continuous, and full of ties
                est = []
                for _ in range(s_count):
                    e = {}
                    for a in range(n_layers):
                        for b in range(a + 1, n_layers + 1):
                            v = rng.random() * (b - a) if values is None else float(rng.choice(values))
                            e[(a, b)] = np.inf if rng.random() < 0.1 else v
                    est.append(e)
                want = _dp_reference(est, n_layers)
                got = allocator._dp([Table(e, n_layers) for e in est], n_layers)
                assert got == want, (n_layers, s_count)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["gaming-eu", "hetero-all"])
def test_step_bound_is_below_the_objective_of_every_move(name):
    """StepBound (local search's pruning) never exceeds what the cost model says, for the
    constructed plans and every move local search generates from them, under several exact-sync
    variants (I/O overlap, prefetch, overlapped sync, recompute, churn off)."""
    import random

    from shoal.plan.allocator import StepBound, _feasible, _neighbours, _objective

    s = load_scenario(name)
    prof = scenario_profile(s)
    dev = {d.id: d for d in s.devices}
    hosts = [h.id for h in s.server_hosts]
    variants = [(SyncPolicy(), CostOptions()), (SyncPolicy(overlap_uploads=True), CostOptions()),
                (SyncPolicy(overlap_uploads=True, prefetch=True), CostOptions(recompute=True)),
                (SyncPolicy(), CostOptions(overlap_sync=True, churn=False))]
    checked = pruned = 0
    for sync, options in variants:
        bound = StepBound(s, sync, options)
        for count in (2, 4):
            p = construct(s, count, sync, options)
            if p is None:
                continue
            step_of(p, s, options)
            rng = random.Random(count)
            used = {w for st in p.stages for w in st.workers}
            unused = [d.id for d in s.workers if d.id not in used]
            for cand in [p, *_neighbours(p, s, rng, unused, dev, hosts)]:
                if not _feasible(cand, s, prof, dev):
                    continue
                lb, t = bound(cand), _objective(cand, s, options)
                assert lb <= t * (1 + 1e-12), (count, cand.stages)
                assert bound(cand, tie_break=False) <= step_of(cand, s, options) * (1 + 1e-12)
                # construct's placement-free check is below the bound of this placement
                assert bound.any_servers(cand.stages) <= bound(cand, tie_break=False) * (1 + 1e-12)
                checked += 1
                pruned += lb >= _objective(p, s, options)
    assert checked > 30
    assert pruned > 0  # the bound is tight enough to skip some moves


@pytest.mark.timeout(180)
def test_pruned_search_keeps_the_plan(monkeypatch):
    s = load_scenario("gaming-world")
    fast = allocator.plan_shoal(s, budget_s=1e9)
    monkeypatch.setattr(allocator.StepBound, "__call__", lambda self, plan, tie_break=True: 0.0)
    monkeypatch.setattr(allocator.StepBound, "any_servers", lambda self, stages: 0.0)
    full = allocator.plan_shoal(s, budget_s=1e9)
    assert [(st.layers, st.server, st.workers) for st in fast.stages] == \
        [(st.layers, st.server, st.workers) for st in full.stages]
    assert fast.predicted == full.predicted


def test_irrelevant_above_is_the_fifth_best_other_stage_count():
    best = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 3.0}
    assert allocator.irrelevant_above(best, 6) == 5.0
    assert allocator.irrelevant_above(best, 1) == float("inf")  # only four other stage counts
    assert allocator.irrelevant_above({**best, 7: 0.5}, 1) == 4.0


def test_min_max_stage_bytes_is_the_best_contiguous_split():
    from itertools import combinations

    prof = scenario_profile(load_scenario("gaming-eu"))
    n = len(prof.layers)
    got = allocator.min_max_stage_bytes(prof)
    assert len(got) == n + 1 and got[0] == float("inf")
    for count in (1, 2, 3, 5, n):
        want = min(max(prof.param_bytes(a, b) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                   for cuts in combinations(range(1, n), count - 1))
        assert got[count] == want
