"""What the planner does about framework CPU: leave out the workers a saturated host cannot use.

The cost model charges shoal's own CPU per message (:class:`shoal.plan.types.FrameworkCpu`):
a stage server host whose cores are full caps its stages' throughput
(:func:`shoal.plan.cost.server_cpu_caps`), and a coordinator whose liveness work fills its cores
cannot keep the plan's members alive (:func:`shoal.plan.cost.coordinator_floor`). The search
already prefers plans whose servers do not saturate (their steps are shorter); these two passes
run on its result:

* :func:`shed_unfed_workers`: a stage whose workers could run more micro-batches per second than
  its server host's CPU lets through keeps only its fastest workers that reach that cap -- the
  others would wait for tasks -- when the step stays as short (the report then names the server
  as the reason they are idle);
* :func:`fit_coordinator`: a plan with more members than the coordinator can keep alive drops
  its slowest workers until it fits.
"""

from __future__ import annotations

import copy
import math

from shoal.plan.cost import (
    CostOptions,
    coordinator_member_limit,
    coordinator_members,
    predict,
    replica_plan,
    server_cpu_caps,
    stage_costs,
)
from shoal.plan.types import Plan, Scenario

KEEP = 1e-6  # a pass is kept when the step grows by at most this fraction


def unfed_workers(task_times: dict[str, float], cap: float, micro_batches: int) -> list[str]:
    """The workers of a stage its server's CPU cannot feed: with the fastest first, those after
    the shortest prefix whose task pool (``sum 1 / tau`` over at most ``M`` workers) reaches
    ``cap`` micro-batches per second. Empty when the cap does not bind (or is infinite)."""
    if not math.isfinite(cap) or cap <= 0:
        return []
    order = sorted((t, w) for w, t in task_times.items() if 0 < t < math.inf)
    rate = 0.0
    for k, (t, _w) in enumerate(order[:micro_batches]):
        rate += 1.0 / t
        if rate >= cap:
            keep = {w for _t, w in order[:k + 1]}
            return sorted(w for w in task_times if w not in keep)
    return []


def shed_unfed_workers(plan: Plan, scenario: Scenario, options: CostOptions | None = None) -> Plan:
    """``plan`` without the workers its CPU-bound server hosts cannot feed (:func:`unfed_workers`,
    every stage of every replica at once), if the predicted step stays as short; else ``plan``.
    Returns a predicted plan."""
    base = predict(plan, scenario, options)["step_time_s"]
    caps = server_cpu_caps(plan, scenario)
    drop: list[tuple[int, int, list[str]]] = []
    for r, (rep, cap) in enumerate(zip(plan.pipelines, caps, strict=True)):
        costs = stage_costs(replica_plan(plan, rep), scenario, options, None, cap)
        for i, c in enumerate(costs):
            if c.uncapped > c.cpu_cap * (1 + 1e-9):
                out = unfed_workers(c.task_times, c.cpu_cap, rep.micro_batches)
                if out:
                    drop.append((r, i, out))
    if not drop or not math.isfinite(base):
        return plan
    cand = copy.deepcopy(plan)
    for r, i, out in drop:
        st = cand.pipelines[r].stages[i]
        st.workers = [w for w in st.workers if w not in set(out)]
    if predict(cand, scenario, options)["step_time_s"] <= base * (1 + KEEP):
        return cand
    predict(plan, scenario, options)
    return plan


def fit_coordinator(plan: Plan, scenario: Scenario, options: CostOptions | None = None) -> Plan:
    """``plan`` with no more members than the coordinator can keep alive
    (:func:`shoal.plan.cost.coordinator_member_limit` at the plan's step): the slowest workers
    (least FLOP/s, then id) go first, each from the stage with the most workers, never a stage's
    last one. Returns a predicted plan (``plan`` itself when it fits)."""
    pred = predict(plan, scenario, options)
    reports = len(plan.all_stages)
    members = coordinator_members(plan)
    step = pred["pipeline_s"] + pred["sync_s"]  # the step without the coordinator's floor
    limit = coordinator_member_limit(reports, step, scenario.cpu)
    if members <= limit:
        return plan
    cand = copy.deepcopy(plan)
    flops = {d.id: d.flops for d in scenario.devices}
    stages = cand.all_stages
    while coordinator_members(cand) > limit:
        st = max((s for s in stages if len(s.workers) > 1), key=lambda s: len(s.workers), default=None)
        if st is None:
            break
        st.workers.remove(min(st.workers, key=lambda w: (flops[w], w)))
    predict(cand, scenario, options)
    return cand
