"""Check that a :class:`Plan` can run on a :class:`Scenario`."""

from __future__ import annotations

import dataclasses

from shoal.errors import ShoalError
from shoal.plan.cost import (
    scenario_profile,
    servers_memory,
    stage_server_memory,
    stage_worker_memory,
)
from shoal.plan.types import Plan, Scenario


def validate_plan(plan: Plan, scenario: Scenario) -> None:
    """Raise a one-line :class:`ShoalError` unless ``plan`` is runnable on ``scenario``.

    Checks: the stages cover every layer exactly once, contiguously and in order; every stage
    has at least one worker and a server; no device works for two stages; each worker's memory
    holds its stage; each server host may host and its host memory holds its servers;
    ``micro_batches * micro_batch_size`` equals the global batch.
    """
    if plan.replicas:
        _validate_replicas(plan, scenario)
        return
    w = scenario.workload
    if plan.model != w.model:
        raise ShoalError(f"plan is for model {plan.model} but scenario {scenario.name} trains {w.model}")
    if plan.micro_batches * plan.micro_batch_size != w.global_batch or plan.micro_batches <= 0:
        raise ShoalError(
            f"plan has {plan.micro_batches} micro-batches of {plan.micro_batch_size} but the global batch is {w.global_batch}"
        )
    prof = scenario_profile(scenario, plan.micro_batch_size)
    n_layers = len(prof.layers)
    if not plan.stages:
        raise ShoalError("plan has no stages")
    expect = 0
    for i, st in enumerate(plan.stages):
        a, b = st.layers
        if a != expect or b <= a:
            raise ShoalError(
                f"stage {i} has layers [{a}, {b}) but must start at {expect} and be non-empty: stages must cover layers contiguously"
            )
        expect = b
    if expect != n_layers:
        raise ShoalError(f"stages cover layers [0, {expect}) but the model has {n_layers} layers")
    devices = {d.id: d for d in scenario.devices}
    seen: dict[str, int] = {}
    server_need: dict[str, float] = {}
    for i, st in enumerate(plan.stages):
        if not st.workers:
            raise ShoalError(f"stage {i} has no workers")
        if st.server not in devices:
            raise ShoalError(f"stage {i}'s server host {st.server!r} is not a device of scenario {scenario.name}")
        host = devices[st.server]
        if not host.can_host_server:
            raise ShoalError(f"stage {i}'s server host {st.server} is not allowed to host servers (can_host_server is false)")
        server_need[st.server] = server_need.get(st.server, 0.0) + stage_server_memory(prof, *st.layers, plan.sync)
        need = stage_worker_memory(prof, *st.layers, plan.sync)
        for wid in st.workers:
            if wid not in devices:
                raise ShoalError(f"stage {i}'s worker {wid!r} is not a device of scenario {scenario.name}")
            if wid in seen:
                raise ShoalError(f"device {wid} works for stages {seen[wid]} and {i}; a device serves at most one stage")
            seen[wid] = i
            d = devices[wid]
            if d.flops <= 0:
                raise ShoalError(f"stage {i}'s worker {wid} cannot compute (flops 0)")
            if d.memory < need:
                raise ShoalError(
                    f"device {wid} has {d.memory / 1e9:.2f} GB but stage {i} (layers {st.layers[0]}-{st.layers[1]}) needs {need / 1e9:.2f} GB; use more stages or a smaller micro-batch"
                )
    for h, need in server_need.items():
        if devices[h].host_memory < need:
            raise ShoalError(
                f"server host {h} has {devices[h].host_memory / 1e9:.1f} GB but its stage servers need {need / 1e9:.1f} GB"
            )


def _validate_replicas(plan: Plan, scenario: Scenario) -> None:
    """A plan with pipeline replicas: local sync; ``stages`` is the first replica's; every replica is
    a valid pipeline of its own micro-batches (which sum to the plan's); no device works for two
    replicas; each host's memory holds the servers of every replica it runs."""
    from shoal.plan.cost import replica_plan, scenario_profile

    if not plan.sync.local:
        raise ShoalError("a plan with pipeline replicas needs local sync (replicas merge every H steps); "
                         "use --sync local or --sync auto")
    if plan.stages is not plan.replicas[0].stages and plan.stages != plan.replicas[0].stages:
        raise ShoalError("plan.stages must be the first replica's stages")
    w = scenario.workload
    if plan.micro_batches * plan.micro_batch_size != w.global_batch:
        raise ShoalError(f"plan has {plan.micro_batches} micro-batches of {plan.micro_batch_size} but the global batch "
                         f"is {w.global_batch}")
    total = sum(r.micro_batches for r in plan.replicas)
    if total != plan.micro_batches or any(r.micro_batches < 1 for r in plan.replicas):
        raise ShoalError(f"the replicas' micro-batches ({[r.micro_batches for r in plan.replicas]}) must be at least 1 "
                         f"each and sum to the plan's {plan.micro_batches}")
    seen: dict[str, int] = {}
    for i, r in enumerate(plan.replicas):
        sub = replica_plan(plan, r)
        # each replica on its own is a pipeline of the workload with its share of the batch
        sub_scn = dataclasses.replace(scenario, workload=type(w)(
            w.model, w.seq_len, r.micro_batches * plan.micro_batch_size, plan.micro_batch_size, w.dtype_bytes,
            w.optimizer))
        try:
            validate_plan(sub, sub_scn)
        except ShoalError as exc:
            raise ShoalError(f"replica {i}: {exc}") from None
        for st in r.stages:
            for wid in st.workers:
                if wid in seen:
                    raise ShoalError(f"device {wid} works for replicas {seen[wid]} and {i}; a device serves one stage")
                seen[wid] = i
    prof = scenario_profile(scenario, plan.micro_batch_size)
    need = servers_memory(plan.all_stages, prof, plan.sync)
    devices = {d.id: d for d in scenario.devices}
    for h, n in need.items():
        if devices[h].host_memory < n:
            raise ShoalError(f"server host {h} has {devices[h].host_memory / 1e9:.1f} GB but the stage servers of "
                             f"every replica it runs need {n / 1e9:.1f} GB")
