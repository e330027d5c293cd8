"""Helpers shared by shoal's allocator and the baselines: layer splits, host placement, plans."""

from __future__ import annotations

import math

import numpy as np

from shoal.model.profile import ModelProfile
from shoal.plan.cost import CostOptions, predict, scenario_profile
from shoal.plan.types import Device, Plan, Scenario, StagePlan, SyncPolicy


def even_layer_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` layers into ``n_stages`` contiguous ranges of (almost) equal length."""
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def balanced_layer_split(weights: list[float], capacities: list[float]) -> list[tuple[int, int]]:
    """Split layers with costs ``weights`` into ``len(capacities)`` contiguous ranges minimising
    ``max_s sum(weights in s) / capacities[s]`` (dynamic programming, O(S L^2))."""
    n, s_count = len(weights), len(capacities)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(s_count + 1)]
    arg = [[0] * (n + 1) for _ in range(s_count + 1)]
    best[0][0] = 0.0
    for s in range(1, s_count + 1):
        cap = capacities[s - 1]
        for b in range(s, n - (s_count - s) + 1):
            for a in range(s - 1, b):
                if best[s - 1][a] == inf:
                    continue
                load = (prefix[b] - prefix[a]) / cap if cap > 0 else inf
                v = max(best[s - 1][a], load)
                if v < best[s][b]:
                    best[s][b], arg[s][b] = v, a
    out, b = [], n
    for s in range(s_count, 0, -1):
        a = arg[s][b]
        out.append((a, b))
        b = a
    return out[::-1]


def layer_weights(prof: ModelProfile) -> list[float]:
    """Compute cost (forward + backward FLOPs) of each layer for one micro-batch."""
    return [prof.fwd_flops(i, i + 1) + prof.bwd_flops(i, i + 1) for i in range(len(prof.layers))]


def fits(prof: ModelProfile, layers: tuple[int, int], device: Device) -> bool:
    """Whether ``device`` can hold a worker of stage ``layers``."""
    return device.flops > 0 and device.memory >= prof.worker_memory(*layers)


def build_plan(scenario: Scenario, method: str, stages: list[StagePlan], sync: SyncPolicy | None = None) -> Plan:
    """A :class:`Plan` with the scenario's batch shape."""
    w = scenario.workload
    return Plan(scenario=scenario.name, model=w.model, method=method, stages=stages,
                micro_batch_size=w.micro_batch_size, micro_batches=w.micro_batches,
                sync=sync or SyncPolicy())


def step_of(plan: Plan, scenario: Scenario, options: CostOptions | None = None) -> float:
    """Predicted step time (inf if the plan cannot run)."""
    try:
        t = predict(plan, scenario, options)["step_time_s"]
    except (KeyError, ZeroDivisionError):
        return math.inf
    return t if math.isfinite(t) else math.inf


def host_sync_cost(host: Device, workers: list[Device], scenario: Scenario, share: int) -> float:
    """Seconds per byte for the slowest of ``workers`` to push and pull one byte via ``host``."""
    worst = 0.0
    for d in workers:
        if d.id == host.id:
            continue
        link = scenario.network.link(d, host)
        push = min(link.bandwidth, d.up, host.down / max(1, share))
        pull = min(link.bandwidth, host.up / max(1, share), d.down)
        worst = max(worst, 1.0 / push + 1.0 / pull)
    return worst


def place_servers(scenario: Scenario, groups: list[list[Device]], param_bytes: list[float],
                  memory_need: list[float], candidates: list[Device] | None = None) -> list[str]:
    """Greedy server placement: biggest traffic first, each on the allowed host where its slowest
    worker's sync is cheapest given the workers already served by that host (host memory permitting)."""
    hosts = candidates or scenario.server_hosts
    load: dict[str, int] = {}
    mem_left = {h.id: h.host_memory for h in hosts}
    out: list[str | None] = [None] * len(groups)
    order = sorted(range(len(groups)), key=lambda i: -param_bytes[i] * max(1, len(groups[i])))
    for i in order:
        best, best_cost = None, math.inf
        for h in hosts:
            if mem_left[h.id] < memory_need[i]:
                continue
            k = load.get(h.id, 0) + len(groups[i])
            c = param_bytes[i] * host_sync_cost(h, groups[i], scenario, k)
            # Tie-break towards idle hosts so servers spread when links are equal.
            c += 1e-9 * load.get(h.id, 0)
            if c < best_cost:
                best, best_cost = h, c
        if best is None:  # nothing has memory left: take the host with the most
            best = max(hosts, key=lambda h: mem_left[h.id])
        out[i] = best.id
        load[best.id] = load.get(best.id, 0) + len(groups[i])
        mem_left[best.id] -= memory_need[i]
    return out  # type: ignore[return-value]


def profile_of(scenario: Scenario) -> ModelProfile:
    return scenario_profile(scenario)
