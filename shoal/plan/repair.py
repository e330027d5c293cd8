"""Online repair: adjust a running plan after devices leave or join, without solving from scratch.

Order of operations (each step judged by the cost model):

1. drop the devices that left from their stages;
2. move the server of every stage whose host left to the live allowed host where its workers
   sync fastest (host memory permitting);
3. a stage left without workers first gets joined devices, else either steals one device from
   the stage with the most spare throughput or is merged into a neighbouring stage -- whichever
   predicts the shorter step (``keep_stages``: only steals; a running swarm cannot merge
   stages, its servers hold fixed layers);
4. each joined device goes to the stage where it shortens the step most (or stays idle);
5. a short local search (boundary shifts, moves, swaps, server moves) polishes the result.

Only if no repair is feasible (e.g. nothing fits the memory) does it fall back to a full plan
(``keep_stages``: one with the plan's stage count, or a ShoalError saying why there is none).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable

from shoal.errors import ShoalError
from shoal.plan.allocator import _copy, _feasible, local_search, plan_shoal
from shoal.plan.common import host_sync_cost, step_of
from shoal.plan.cost import (
    CostOptions,
    predict,
    scenario_profile,
    stage_costs,
    stage_server_memory,
    stage_worker_memory,
)
from shoal.plan.types import Plan, Scenario
from shoal.plan.validate import validate_plan


def live_scenario(scenario: Scenario, gone: Iterable[str]) -> Scenario:
    """``scenario`` without the devices in ``gone``."""
    gone = set(gone)
    return dataclasses.replace(scenario, devices=[d for d in scenario.devices if d.id not in gone])


def _best_host(plan: Plan, i: int, scenario: Scenario) -> str | None:
    prof = scenario_profile(scenario)
    dev = {d.id: d for d in scenario.devices}
    load: dict[str, int] = {}
    mem: dict[str, float] = {}
    for j, st in enumerate(plan.stages):
        if j != i and st.server in dev:
            load[st.server] = load.get(st.server, 0) + len(st.workers)
            mem[st.server] = mem.get(st.server, 0.0) + stage_server_memory(prof, *st.layers, plan.sync)
    st = plan.stages[i]
    need = stage_server_memory(prof, *st.layers, plan.sync)
    workers = [dev[w] for w in st.workers]
    pbytes = prof.param_bytes(*st.layers)
    best, best_c = None, math.inf
    for h in scenario.server_hosts:
        if h.host_memory - mem.get(h.id, 0.0) < need:
            continue
        c = pbytes * host_sync_cost(h, workers, scenario, load.get(h.id, 0) + len(workers)) + 1e-9 * load.get(h.id, 0)
        if c < best_c:
            best, best_c = h.id, c
    return best


def _fill_empty(plan: Plan, i: int, scenario: Scenario, options: CostOptions, merge: bool = True) -> Plan | None:
    """Best of: steal one device for stage ``i`` from another stage, or (``merge``) merge ``i``
    into a neighbour."""
    prof = scenario_profile(scenario)
    dev = {d.id: d for d in scenario.devices}
    need = stage_worker_memory(prof, *plan.stages[i].layers, plan.sync)
    options_out = []
    # steal: from the stages with the most workers, the device that fits and is fastest
    donors = sorted((j for j, st in enumerate(plan.stages) if j != i and len(st.workers) > 1),
                    key=lambda j: -len(plan.stages[j].workers))[:3]
    for j in donors:
        fit = [w for w in plan.stages[j].workers if dev[w].memory >= need]
        for w in sorted(fit, key=lambda w: -dev[w].flops)[:2]:
            p = _copy(plan)
            p.stages[j].workers.remove(w)
            p.stages[i].workers.append(w)
            options_out.append(p)
    # merge into the previous or next stage
    for j in (i - 1, i + 1) if merge else ():
        if 0 <= j < len(plan.stages):
            p = _copy(plan)
            a = min(p.stages[i].layers[0], p.stages[j].layers[0])
            b = max(p.stages[i].layers[1], p.stages[j].layers[1])
            p.stages[j].layers = (a, b)
            del p.stages[i]
            options_out.append(p)
    best, best_t = None, math.inf
    for p in options_out:
        if not all(st.workers for st in p.stages) or not _feasible(p, scenario, prof, dev):
            continue
        t = step_of(p, scenario, options)
        if t < best_t:
            best, best_t = p, t
    return best


def repair(plan: Plan, scenario: Scenario, left: Iterable[str] = (), joined: Iterable[str] = (),
           options: CostOptions | None = None, budget_s: float | None = None, seed: int = 0,
           keep_stages: bool = False) -> Plan:
    """A valid plan for ``scenario`` minus ``left`` (plus ``joined``, which must be devices of
    ``scenario``), derived from ``plan`` incrementally; ``planning_time_s`` is the repair time.
    ``keep_stages``: the result has the plan's stage count (a stage left without workers steals
    one, never merges), or a ShoalError says why no such plan exists.

    As :func:`shoal.plan.make_plan`, the search leaves the coordinator's CPU floor out (a plan
    over its member limit is infinite, and no move could tell two such plans apart), and the
    framework-CPU passes of :mod:`shoal.plan.saturation` fit the result afterwards."""
    from shoal.plan.saturation import fit_coordinator, shed_unfed_workers

    t0 = time.perf_counter()
    options = options or CostOptions()
    p = _repair(plan, scenario, left, joined, dataclasses.replace(options, coordinator=False), budget_s, seed, t0,
                keep_stages)
    live = live_scenario(scenario, left)
    p = shed_unfed_workers(fit_coordinator(p, live, options), live, options)
    predict(p, live, options)
    p.planning_time_s = time.perf_counter() - t0
    return p


def _repair(plan: Plan, scenario: Scenario, left: Iterable[str], joined: Iterable[str], options: CostOptions,
            budget_s: float | None, seed: int, t0: float, keep_stages: bool = False) -> Plan:
    left, joined = set(left), [j for j in joined if j not in set(left)]
    known = {d.id for d in scenario.devices}
    for d in [*left, *joined]:
        if d not in known:
            raise ShoalError(f"repair: device {d!r} is not in scenario {scenario.name}")
    live = live_scenario(scenario, left)
    if not live.workers or not live.server_hosts:
        raise ShoalError(f"repair: scenario {scenario.name} has no live worker or server host left")
    dev = {d.id: d for d in live.devices}
    p = _copy(plan)
    for st in p.stages:
        st.workers = [w for w in st.workers if w in dev]
    for i, st in enumerate(p.stages):
        if st.server not in dev:
            host = _best_host(p, i, live)
            if host is None:
                return _fallback(live, plan, t0, seed, options, keep_stages)
            st.server = host
    prof = scenario_profile(live)
    pending = [j for j in joined if dev[j].flops > 0 and all(j not in st.workers for st in p.stages)]
    # empty stages: joined devices first, then steal or merge
    for st in p.stages:
        if not st.workers:
            need = stage_worker_memory(prof, *st.layers, p.sync)
            fit = [j for j in pending if dev[j].memory >= need]
            if fit:
                w = max(fit, key=lambda j: dev[j].flops)
                st.workers.append(w)
                pending.remove(w)
    while any(not st.workers for st in p.stages):
        i = next(i for i, st in enumerate(p.stages) if not st.workers)
        q = _fill_empty(p, i, live, options, merge=not keep_stages)
        if q is None:
            return _fallback(live, plan, t0, seed, options, keep_stages)
        p = q
    # joined devices: where they help most -- among the slowest stages and the stages served
    # from the device's own region (a full scan would cost S predictions per device)
    for j in pending:
        base = step_of(p, live, options)
        xs = stage_costs(p, live, options)
        slow = sorted(range(len(p.stages)), key=lambda s: xs[s].throughput)[:3]
        near = [s for s, st in enumerate(p.stages) if dev[st.server].region == dev[j].region][:2]
        best, best_t = None, base
        for s in dict.fromkeys(slow + near):
            if dev[j].memory < stage_worker_memory(prof, *p.stages[s].layers, p.sync):
                continue
            q = _copy(p)
            q.stages[s].workers.append(j)
            t = step_of(q, live, options)
            if t < best_t:
                best, best_t = q, t
        if best is not None:
            p = best
    if not _feasible(p, live, prof, dev):
        return _fallback(live, plan, t0, seed, options, keep_stages)
    if budget_s is None:
        budget_s = 0.05 + 0.0001 * len(live.workers)
    p = local_search(p, live, options, budget_s, seed=seed, max_rounds=20, max_evals=40)
    validate_plan(p, live)
    predict(p, live, options)
    p.planning_time_s = time.perf_counter() - t0
    return p


def _fallback(live: Scenario, plan: Plan, t0: float, seed: int, options: CostOptions,
              keep_stages: bool = False) -> Plan:
    """Plan from scratch (the repair could not keep the plan's shape); ``keep_stages``: with
    the plan's stage count, which needs a worker per stage."""
    if keep_stages and len(live.workers) < len(plan.stages):
        raise ShoalError(f"repair: {len(live.workers)} live worker(s) cannot serve {len(plan.stages)} stages; "
                         "a stage waits for a worker to join")
    p = plan_shoal(live, seed=seed, stages=len(plan.stages) if keep_stages else None, sync=plan.sync,
                   options=options)
    p.method = plan.method
    validate_plan(p, live)
    predict(p, live, options)
    p.planning_time_s = time.perf_counter() - t0
    return p


__all__ = ["live_scenario", "repair"]
