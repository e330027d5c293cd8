"""The planner's front door: ``METHODS`` and :func:`make_plan`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from shoal.errors import ShoalError
from shoal.plan.allocator import plan_shoal, plan_shoal_tuned
from shoal.plan.cost import CostOptions, predict, scenario_profile
from shoal.plan.types import Plan, Scenario, SyncPolicy
from shoal.plan.validate import validate_plan

# name -> planner(scenario, seed=..., stages=..., sync=..., options=...) -> Plan.
# Everything except "shoal" is a baseline, judged by the same cost model.
METHODS: dict[str, Callable[..., Plan]] = {"shoal": plan_shoal}


def make_plan(scenario: Scenario, method: str = "shoal", seed: int = 0, stages: int | None = None,
              sync: SyncPolicy | None = None, options: CostOptions | None = None,
              tune_micro_batch: bool = False, standbys: int = 0, standby_every: int = 1,
              replicas: bool = False) -> Plan:
    """Plan ``scenario`` with ``method``; ``stages=S`` forces S stages. The plan is validated and
    carries ``planning_time_s`` and ``predicted`` (see :func:`shoal.plan.cost.predict`).
    ``tune_micro_batch`` (shoal only) also chooses the micro-batch size; otherwise every method
    keeps the workload's. ``standbys=N`` places N hot standbys per stage, copied every
    ``standby_every`` steps, and counts their copies (:mod:`shoal.plan.standby`).
    ``replicas=True`` (shoal, local sync) plans pipeline replicas inside network clusters
    (:mod:`shoal.plan.replicas`)."""
    if standbys < 0 or standby_every < 1:
        raise ShoalError(f"--standbys must be >= 0 and --ckpt-every >= 1, got {standbys} and {standby_every}")
    if method not in METHODS:
        raise ShoalError(f"unknown planning method {method!r}; choose one of: {', '.join(METHODS)}")
    if stages is not None:
        n_layers = len(scenario_profile(scenario).layers)
        limit = min(n_layers, len(scenario.workers))
        if not 1 <= stages <= limit:
            raise ShoalError(
                f"--stages must be in [1, {limit}] for scenario {scenario.name} "
                f"({n_layers} model layers, {len(scenario.workers)} workers), got {stages}"
            )
    t0 = time.perf_counter()
    if replicas:
        if method != "shoal" or stages is not None or tune_micro_batch or standbys:
            raise ShoalError("--replicas is only implemented for method shoal, without --stages, "
                             "--tune-micro-batch or --standbys")
        if sync is None or not sync.local:
            raise ShoalError("--replicas needs local sync (replicas merge every H steps): add --sync local")
        from shoal.plan.replicas import plan_replicas

        plan = _fit_cpu(plan_replicas(scenario, seed=seed, sync=sync, options=_search(options)), scenario, options)
        plan.planning_time_s = time.perf_counter() - t0
        validate_plan(plan, scenario)
        predict(plan, scenario, options)
        return plan
    if tune_micro_batch and method != "shoal":
        raise ShoalError("--tune-micro-batch is only implemented for method shoal")
    planner = plan_shoal_tuned if tune_micro_batch else METHODS[method]
    if method == "shoal":
        plan = _fit_cpu(planner(scenario, seed=seed, stages=stages, sync=sync, options=_search(options)), scenario,
                        options)
    else:
        plan = planner(scenario, seed=seed, stages=stages, sync=sync, options=options)
    plan.planning_time_s = time.perf_counter() - t0
    plan.method = method
    validate_plan(plan, scenario)
    if standbys:
        from shoal.plan.standby import place_standbys

        placed = place_standbys(plan, scenario, scenario_profile(scenario, plan.micro_batch_size), standbys)
        for st, hosts in zip(plan.stages, placed, strict=True):
            st.standbys = hosts
        plan.standby_every = standby_every
    predict(plan, scenario, options)
    return plan


def _search(options: CostOptions | None) -> CostOptions:
    """The cost options of shoal's search: the coordinator's CPU floor left out (a plan with too
    many members would be infinite, and the search could not tell two such plans apart);
    :func:`_fit_cpu` fits the coordinator afterwards."""
    return dataclasses.replace(options or CostOptions(), coordinator=False)


def _fit_cpu(plan: Plan, scenario: Scenario, options: CostOptions | None) -> Plan:
    """The framework-CPU passes of :mod:`shoal.plan.saturation` on a shoal plan: fit the
    coordinator's membership, then leave out the workers a CPU-bound server cannot feed."""
    from shoal.plan.saturation import fit_coordinator, shed_unfed_workers

    return shed_unfed_workers(fit_coordinator(plan, scenario, options), scenario, options)


def _register_baselines() -> None:
    from shoal.plan import baselines

    METHODS.update({
        "dtfm": baselines.plan_dtfm,
        "swarm": baselines.plan_swarm,
        "dapple": baselines.plan_dapple,
        "random": baselines.plan_random,
        "exhaustive": baselines.plan_exhaustive,
    })


_register_baselines()
