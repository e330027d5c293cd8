"""``--sync auto``: the planner's policy choice never leaves the quality budget, prefers the more
exact policy on a tie, and the CLI flags build the budget (shoal.plan.auto)."""

from __future__ import annotations

import math

import pytest

from shoal.errors import ShoalError
from shoal.plan import load_scenario
from shoal.plan.auto import TIE, QualityBudget, candidates, choose, parse_allowed_codecs, plan_auto
from shoal.plan.compression import KINDS
from shoal.plan.types import SyncPolicy

BUDGETS = [
    QualityBudget(),
    QualityBudget(max_sync_every=1),  # exact only
    QualityBudget(max_sync_every=8, codecs=("none", "int8")),
    QualityBudget(codecs=("none",), replicas=False),
    QualityBudget(max_sync_every=64, codecs=("int8", "topk-int8:0.05")),
    QualityBudget(pin_sync_every=4, pin_codecs=dict.fromkeys(KINDS, "int8")),
    QualityBudget(overlap=False),  # --no-overlap: no delayed application
    QualityBudget(lean=False),  # --no-lean: no lean workers
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["demo", "hetero-network"])
def test_auto_never_picks_a_policy_the_budget_excludes(name):
    s = load_scenario(name)
    for budget in BUDGETS:
        cands = candidates(s, budget)
        # every candidate it weighs is inside the budget, and so is its choice
        assert all(budget.allows(p.sync, bool(p.replicas)) for p, _ in cands), budget
        plan = choose(cands, s)
        assert budget.allows(plan.sync, bool(plan.replicas)), (budget, plan.sync)
        if budget.max_sync_every == 1:
            assert not plan.sync.local and not plan.replicas
        if not budget.replicas:
            assert not plan.replicas
        if not budget.overlap:
            assert not any(p.sync.local and p.sync.overlap for p, _ in cands)
        if not budget.lean:
            assert not any(p.sync.lean for p, _ in cands)
        elif budget.local and budget.sync_every_choices():
            assert any(p.sync.lean for p, _ in cands)  # weighed where the budget allows them
        if budget.pin_codecs:
            assert plan.sync.local is False or plan.sync.sync_every == 4 and plan.sync.push_codec == "int8"
        if plan.sync.local:
            assert plan.sync.sync_every <= budget.max_sync_every
            if not budget.pin_codecs:
                allowed = {c.split(":")[0] for c in budget.codecs} | {"none"}
                pol = plan.sync
                assert all(c.split(":")[0] in allowed for c in (pol.act_codec, pol.grad_codec, pol.push_codec,
                                                                 pol.pull_codec))


def test_budget_allows():
    b = QualityBudget(max_sync_every=16, codecs=("none", "int8"))
    assert b.allows(SyncPolicy())
    assert not b.allows(SyncPolicy(), replicas=True)  # replicas need local sync
    assert b.allows(SyncPolicy(mode="local", sync_every=16, push_codec="int8"))
    assert not b.allows(SyncPolicy(mode="local", sync_every=32))
    assert not b.allows(SyncPolicy(mode="local", sync_every=8, push_codec="sparse"))
    assert not QualityBudget(max_sync_every=1).allows(SyncPolicy(mode="local", sync_every=1))
    assert not QualityBudget(replicas=False).allows(SyncPolicy(mode="local", sync_every=8), replicas=True)
    assert not QualityBudget(lean=False).allows(SyncPolicy(mode="local", sync_every=8, lean=True))
    assert QualityBudget().allows(SyncPolicy(mode="local", sync_every=8, lean=True))
    # the fewest bytes the budget allows, per kind (sparse is never used for activations); lowrank's
    # bytes per weight fall with the model's width: sparse's fewer at 128, lowrank's at 768
    assert QualityBudget().codec_for("push", 2, 128) == "sparse" and QualityBudget().codec_for("act", 2) == "quad-pc"
    assert QualityBudget().codec_for("grad", 2) == "tern-dither"  # (gradients only)
    assert QualityBudget(codecs=("none", "int8", "sparse")).codec_for("act", 2) == "int8"
    assert QualityBudget().codec_for("push", 2, 768) == "lowrank"
    assert QualityBudget(codecs=("none", "int8", "lowrank:2:8")).codec_for("push", 2, 2048) == "lowrank:2:8"
    assert QualityBudget(codecs=("none",)).codec_for("push", 2) == "none"
    with pytest.raises(ShoalError):
        parse_allowed_codecs("zstd")


@pytest.mark.timeout(120)
def test_replica_candidates_pull_the_budgets_codec_of_fewest_bytes():
    """Replicas pull sparse like one pipeline (the runtime runs them: sparse deltas of the exact
    merged weights, shoal.runtime.sync.codecs.PullDeltas); a budget without sparse gives both
    the allowed codec of fewest bytes."""
    s = load_scenario("demo")
    for codecs, pull in ((("none", "int8", "sparse"), "sparse"), (("none", "int8"), "int8")):
        budget = QualityBudget(max_sync_every=8, codecs=codecs)
        cands = candidates(s, budget)
        reps = [p for p, r in cands if r]
        assert reps and any(p.sync.pull_codec == pull for p in reps), codecs
        assert any(p.sync.pull_codec == pull for p, r in cands if not r)
        assert all(budget.allows(p.sync, r) for p, r in cands)


@pytest.mark.timeout(300)
def test_auto_prefers_the_more_exact_policy_on_a_tie():
    s = load_scenario("demo")
    cands = candidates(s, QualityBudget())
    plan = choose(cands, s)
    best = max(c.predicted["expected_step_time_s"] for c, _ in cands if c is plan)
    # nothing more exact (exact sync, or a smaller H) is within the tie of the chosen one
    for c, _ in cands:
        more_exact = (not c.sync.local and plan.sync.local) or (
            c.sync.local and plan.sync.local and c.sync.sync_every < plan.sync.sync_every)
        if more_exact:
            assert c.predicted["expected_step_time_s"] > best / (1 - TIE) * (1 - 1e-9)


def test_auto_weighs_delayed_application_and_takes_waiting_steps_on_a_tie():
    """Every local candidate is also priced with the steps waiting for each round; where the
    overlap buys no speed (two otherwise equal plans) the one that waits wins: delayed
    application costs loss."""
    from dataclasses import replace

    s = load_scenario("demo")
    cands = candidates(s, QualityBudget())
    local = [c for c, _ in cands if c.sync.local]
    keys = {(c.sync.sync_every, c.sync.push_codec, c.sync.pull_codec, c.sync.overlap, len(c.replicas)) for c in local}
    assert all((h, a, b, False, r) in keys for h, a, b, _, r in keys)
    plan = choose(cands, s)
    assert plan.sync.local and plan.sync.overlap  # on the demo scenario overlap is priced faster
    waits = replace(plan, sync=replace(plan.sync, overlap=False))  # the same prediction, waiting
    assert choose([(plan, False), (waits, False)], s) is waits


def test_auto_takes_standard_workers_over_lean_ones_on_a_tie():
    """Lean workers (12 bytes a parameter) are weighed beside standard ones; where they buy no
    speed (two otherwise equal plans) the standard one wins: bf16 moments and sums in arrival
    order cost loss (bench/results/lean-workers.md)."""
    from dataclasses import replace

    s = load_scenario("demo")
    plan = choose(candidates(s, QualityBudget()), s)
    std = replace(plan, sync=replace(plan.sync, lean=False))
    lean = replace(plan, sync=replace(plan.sync, lean=True))
    assert choose([(lean, False), (std, False)], s) is std


def test_no_overlap_is_a_budget_for_auto_in_plan_and_demo(capsys):
    """``--no-overlap`` with ``--sync auto`` leaves delayed application out of the budget (the
    demo scenario's choice overlaps without it); ``shoal demo`` runs the overlap its choice
    has, and refuses ``--no-overlap`` only with exact sync."""
    from dataclasses import replace

    from shoal.cli import main
    from shoal.demo.cli import DemoConfig, choose_sync

    assert main(["plan", "--scenario", "demo"]) == 0
    assert "overlapped with the next round" in capsys.readouterr().out
    assert main(["plan", "--scenario", "demo", "--no-overlap"]) == 0
    out = capsys.readouterr().out
    assert "not overlapped" in out and "overlapped with the next round" not in out and "--no-overlap waits" not in out
    s = load_scenario("demo")
    cfg = DemoConfig()
    plan, got = choose_sync(cfg, s, None)
    assert plan.sync.local and plan.sync.overlap and got.overlap
    plan, got = choose_sync(replace(cfg, overlap=False), s, None)
    assert plan.sync.local and not plan.sync.overlap and not got.overlap
    with pytest.raises(ShoalError, match="--no-overlap applies to --sync local or auto"):
        DemoConfig(sync="exact", overlap=False).validate()


@pytest.mark.timeout(300)
def test_gaming_world_auto_uses_replicas_on_every_server_host():
    """gaming-world's four 128 GB server hosts hold one replica's whole-model stage servers each
    (ModelProfile.server_memory, measured): auto runs a replica on every one of them."""
    s = load_scenario("gaming-world")
    plan = plan_auto(s)
    assert plan.sync.local and plan.replicas and plan.sync.sync_every <= 32
    hosts = {st.server for st in plan.all_stages}
    assert hosts == {d.id for d in s.devices if d.can_host_server}
    assert plan.predicted["flop_share"] >= 0.40 and plan.predicted["memory_headroom"] >= 0
    # its whole-model replicas are lean workers on 24 GB cards, and shoal plan says what they cost
    assert plan.sync.lean and min(len(r.stages) for r in plan.replicas) == 1
    from shoal.plan.auto import lean_note

    assert lean_note(plan.sync).startswith("quality: lean workers")


def test_quality_note_names_the_measured_cost_of_sparse_sync():
    from shoal.plan.auto import (
        LOWRANK_LONG_LOSS_COST,
        LOWRANK_LOSS_COST,
        SPARSE_LOSS_COST,
        quality_note,
    )

    note = quality_note(SyncPolicy(mode="local", sync_every=4, push_codec="sparse", pull_codec="int8"))
    assert note and f"{SPARSE_LOSS_COST[1]:.1%}" in note and "--allow-codecs none,int8" in note
    note = quality_note(SyncPolicy(mode="local", sync_every=4, push_codec="lowrank", pull_codec="lowrank"))
    assert note and note.startswith("quality: lowrank") and f"{LOWRANK_LOSS_COST[1]:.1%}" in note
    assert f"{LOWRANK_LONG_LOSS_COST[1]:.1%} after 600 steps" in note  # longer runs cost more
    assert quality_note(SyncPolicy(mode="local", sync_every=4, push_codec="int8", pull_codec="int8")) is None
    assert quality_note(SyncPolicy()) is None  # exact sync


def test_lighter_prices_int8_activations_where_theirs_are_lossier():
    """Where the budget's activation codecs of fewest bytes (quad-pc, tern-dither) are used,
    auto also prices int8 ones on the same placement (with every lighter push/pull codec), and
    among equally fast candidates takes the closer to exact training."""
    from dataclasses import replace

    from shoal.plan.auto import _lossy_rank, act_note, lighter

    q = SyncPolicy(mode="local", sync_every=4, push_codec="lowrank", pull_codec="lowrank", act_codec="quad-pc",
                   grad_codec="tern-dither")
    got = lighter(q, QualityBudget())
    i8 = dict(act_codec="int8", grad_codec="int8")
    assert got == [replace(q, push_codec="int8", pull_codec="int8"), replace(q, **i8),
                   replace(q, push_codec="int8", pull_codec="int8", **i8)]
    assert lighter(q, QualityBudget(codecs=("none", "lowrank", "quad-pc", "tern-dither"))) == []  # no int8 allowed
    assert lighter(replace(q, **i8), QualityBudget()) == [replace(q, push_codec="int8", pull_codec="int8", **i8)]
    assert _lossy_rank(replace(q, **i8)) < _lossy_rank(q)
    note = act_note(q)
    assert note and "compress_bench.md" in note and "+0.4% to +1.0%" in note and "+1.3% to +1.9% after 600" in note
    assert act_note(replace(q, **i8)) is None and act_note(SyncPolicy()) is None


def test_lean_note_names_the_measured_cost_of_lean_workers():
    from shoal.plan.auto import LEAN_LOSS_COST, lean_note

    note = lean_note(SyncPolicy(mode="local", sync_every=4, lean=True))
    lo, hi = LEAN_LOSS_COST
    assert f"{lo:+.1%} to {hi:+.1%}" in note and "--no-lean" in note and "lean-workers.md" in note
    assert lean_note(SyncPolicy(mode="local", sync_every=4)) is None and lean_note(SyncPolicy()) is None


@pytest.mark.timeout(300)
def test_overlap_note_names_the_measured_cost_of_delayed_application():
    from shoal.plan.auto import OVERLAP_LOSS_COST, overlap_note

    note = overlap_note(SyncPolicy(mode="local", sync_every=4))
    lo, hi = OVERLAP_LOSS_COST
    assert f"{lo:+.1%} to {hi:+.1%}" in note and "--no-overlap" in note and "local-runtime.md" in note
    assert overlap_note(SyncPolicy(mode="local", sync_every=4, overlap=False)) is None
    assert overlap_note(SyncPolicy()) is None  # exact sync


def test_auto_on_gaming_eu_prints_the_quality_note_of_its_lossy_choice(capsys):
    """gpt-1.3b (width 2,048): lowrank is the fewest bytes and the least loss of the allowed
    push codecs; without it sparse, with its own note; without both none of them."""
    from shoal.cli import main

    assert main(["plan", "--scenario", "gaming-eu"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "push=lowrank" in out and "quality: lowrank pushes and pulls ended" in out
    assert "the run's last round is dense" in out
    assert main(["plan", "--scenario", "gaming-eu", "--allow-codecs", "none,int8,sparse"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert "push=sparse" in out and "quality: sparse pushes and pulls ended" in out
    assert main(["plan", "--scenario", "gaming-eu", "--allow-codecs", "none,int8"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    head = out.split("(quality budget")[0]
    assert "sparse" not in head and "lowrank" not in head and "pushes and pulls ended" not in out
    assert "quality: rounds overlapped" in out  # (delayed application's own note)


@pytest.mark.timeout(300)
def test_a_sparse_runs_dense_last_round_is_priced_once():
    """The dense last round of sparse and lowrank pushes: every worker's stage in int8, at least the largest
    stage (a byte per parameter) over its fastest worker's uplink; none for exact or int8 sync;
    the plan CLI says it."""
    from dataclasses import replace

    from shoal.plan.cost import dense_round_time, scenario_profile

    s = load_scenario("gaming-eu")
    plan = plan_auto(s)
    assert plan.sync.push_codec.startswith("lowrank")  # keeps residuals on the replicas, like sparse
    prof = scenario_profile(s, plan.micro_batch_size)
    t = dense_round_time(plan, s, prof)
    up = {d.id: d.up for d in s.devices}
    floor = max(prof.params(*st.layers) / max(up[w] for w in st.workers) for st in plan.all_stages)  # int8
    assert floor <= t < math.inf
    assert dense_round_time(replace(plan, sync=replace(plan.sync, push_codec="sparse")), s, prof) == t
    assert dense_round_time(replace(plan, sync=replace(plan.sync, push_codec="int8")), s, prof) == 0.0
    assert dense_round_time(replace(plan, sync=SyncPolicy()), s, prof) == 0.0


@pytest.mark.timeout(300)
def test_cli_budget_flags(capsys):
    from shoal.cli import main

    assert main(["plan", "--scenario", "demo", "--max-sync-every", "1"]) == 0
    assert "sync auto: exact sync" in capsys.readouterr().out.replace("\n", " ")
    assert main(["plan", "--scenario", "demo", "--sync", "exact", "--max-sync-every", "4"]) == 2
    assert main(["plan", "--scenario", "demo", "--sync-every", "64", "--max-sync-every", "8"]) == 2
    assert main(["plan", "--scenario", "demo", "--allow-codecs", "none,zstd"]) == 2
    assert main(["plan", "--scenario", "demo", "--replicas"]) == 2  # replicas need --sync local
    assert main(["plan", "--scenario", "demo", "--lean-workers"]) == 2  # an auto budget weighs them itself
    assert main(["plan", "--scenario", "demo", "--sync", "exact", "--no-lean"]) == 2  # auto's budget only
    capsys.readouterr()
    assert main(["plan", "--scenario", "demo", "--no-lean"]) == 0
    assert "lean workers excluded" in " ".join(capsys.readouterr().out.split())


def test_plan_auto_says_what_it_places_before_each_placement():
    seen: list[str] = []
    plan = plan_auto(load_scenario("hetero-network"), on_progress=seen.append)
    assert seen == ["placing exact sync", "placing one pipeline in local mode",
                    "placing pipeline replicas in local mode", "placing one pipeline of lean workers in local mode",
                    "placing pipeline replicas of lean workers in local mode"]
    again = plan_auto(load_scenario("hetero-network"))  # the same choice without it
    assert (plan.sync, plan.stages, plan.predicted) == (again.sync, again.stages, again.predicted)
