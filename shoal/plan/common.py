"""Helpers shared by shoal's allocator and the baselines: layer splits, host placement, plans."""

from __future__ import annotations

import math

import numpy as np

from shoal.model.profile import ModelProfile
from shoal.plan.cost import CostOptions, predict, scenario_profile, stage_worker_memory
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


def fits(prof: ModelProfile, layers: tuple[int, int], device: Device, sync: SyncPolicy | None = None) -> bool:
    """Whether ``device`` can hold a worker of stage ``layers`` (under ``sync``'s memory needs)."""
    return device.flops > 0 and device.memory >= stage_worker_memory(prof, *layers, sync)


def build_plan(scenario: Scenario, method: str, stages: list[StagePlan], sync: SyncPolicy | None = None) -> Plan:
    """A :class:`Plan` with the scenario's batch shape."""
    w = scenario.workload
    return Plan(scenario=scenario.name, model=w.model, method=method, stages=stages,
                micro_batch_size=w.micro_batch_size, micro_batches=w.micro_batches,
                sync=sync or SyncPolicy())


def step_of(plan: Plan, scenario: Scenario, options: CostOptions | None = None, memo: dict | None = None) -> float:
    """Predicted step time, the expected one under the scenario's churn (inf if the plan cannot run).
    ``memo``: a dict kept across calls on one scenario (see :func:`shoal.plan.cost.stage_costs`)."""
    try:
        t = predict(plan, scenario, options, memo)["expected_step_time_s"]  # = step_time_s without churn
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


class SyncTable:
    """Vectorised sync cost (seconds per byte pushed and pulled) between server hosts and
    devices, from region-level paths (per-pair overrides fall back to exact lookups)."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.hosts = scenario.server_hosts
        net = scenario.network
        regions = sorted({d.region for d in scenario.devices})
        self.rid = {r: i for i, r in enumerate(regions)}
        self.path = np.zeros((len(self.hosts), len(regions)))  # bytes/s host <-> region
        self.lat = np.zeros((len(self.hosts), len(regions)))  # seconds host <-> region
        for i, h in enumerate(self.hosts):
            for r, j in self.rid.items():
                link = net.intra[r] if r == h.region else net.inter[tuple(sorted((r, h.region)))]
                self.path[i, j], self.lat[i, j] = link.bandwidth, link.latency
        self.h_up = np.array([h.up for h in self.hosts])
        self.h_down = np.array([h.down for h in self.hosts])
        self.h_mem = np.array([h.host_memory for h in self.hosts])
        self.h_index = {h.id: i for i, h in enumerate(self.hosts)}
        self.exact = bool(net.overrides)
        self._groups: dict[tuple[str, ...], tuple[np.ndarray, ...]] = {}  # see _group_arrays

    def cost(self, group: list[Device], share: np.ndarray) -> np.ndarray:
        """Per host: the slowest worker of ``group``'s push + pull seconds per byte, when the
        host's links are shared by ``share[h]`` workers."""
        if self.exact:
            return np.array([host_sync_cost(h, group, self.scenario, int(k)) for h, k in zip(self.hosts, share, strict=True)])
        if not group:
            return np.zeros(len(self.hosts))
        return self._per_byte(group, share)[0].max(axis=1)

    def _per_byte(self, group: list[Device], share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(host x worker) push + pull seconds per byte and one-way latency, with each host's
        links shared by ``share[h]`` workers; a worker on its own server host uses loopback."""
        rid, up, down, own_h, own_w = self._group_arrays(group)
        path = self.path[:, rid]
        lat = self.lat[:, rid].copy()
        k = np.maximum(share, 1)[:, None]
        push = np.minimum(np.minimum(path, up[None, :]), self.h_down[:, None] / k)
        pull = np.minimum(np.minimum(path, self.h_up[:, None] / k), down[None, :])
        c = 1.0 / push + 1.0 / pull
        if len(own_h):
            c[own_h, own_w] = 0.0
            lat[own_h, own_w] = 0.0
        return c, lat

    def _group_arrays(self, group: list[Device]) -> tuple[np.ndarray, ...]:
        """A group's region indices, uplinks, downlinks and (host, worker) pairs of workers on a
        server host; memoised by the group's device ids (the planner prices the same groups
        on many placements: this was a third of ``shoal plan``'s server placement time)."""
        key = tuple(d.id for d in group)
        got = self._groups.get(key)
        if got is None:
            own = [(self.h_index[d.id], j) for j, d in enumerate(group) if d.id in self.h_index]
            got = (np.array([self.rid[d.region] for d in group]), np.array([d.up for d in group]),
                   np.array([d.down for d in group]), np.array([i for i, _ in own], dtype=int),
                   np.array([j for _, j in own], dtype=int))
            self._groups[key] = got
        return got

    def stage_cost(self, group: list[Device], share: np.ndarray, param_bytes: float, act_bytes: float,
                   micro_batches: int) -> np.ndarray:
        """Per host: the slowest worker's per-step sync seconds plus the average worker's per-step
        activation seconds (``M / |group|`` tasks of two uploads and two downloads, each paying
        the path latency) if the group's server ran there."""
        if not group:
            return np.zeros(len(self.hosts))
        if self.exact:
            return param_bytes * self.cost(group, share)
        c, lat = self._per_byte(group, share)
        sync = (param_bytes * c + 3 * lat).max(axis=1)
        act = (micro_batches / len(group)) * (4 * lat + 2 * act_bytes * c).mean(axis=1)
        return sync + act


def place_servers(scenario: Scenario, groups: list[list[Device]], param_bytes: list[float],
                  memory_need: list[float], table: SyncTable | None = None, act_bytes: float = 0.0,
                  micro_batches: int = 0) -> list[str]:
    """Greedy server placement: biggest traffic first, each on the allowed host where its
    slowest worker's sync (plus, if ``act_bytes`` is given, its workers' activation traffic) is
    cheapest given the workers already served by that host (host memory permitting)."""
    table = table or SyncTable(scenario)
    n_h = len(table.hosts)
    load = np.zeros(n_h)
    mem_left = table.h_mem.astype(float).copy()
    out: list[str] = [""] * len(groups)
    order = sorted(range(len(groups)), key=lambda i: -param_bytes[i] * max(1, len(groups[i])))
    for i in order:
        if act_bytes > 0:
            c = table.stage_cost(groups[i], load + len(groups[i]), param_bytes[i], act_bytes, micro_batches)
        else:
            c = param_bytes[i] * table.cost(groups[i], load + len(groups[i]))
        c = c + 1e-9 * load  # tie-break towards idle hosts so servers spread when links are equal
        c = np.where(mem_left >= memory_need[i], c, np.inf)
        j = int(np.argmin(c)) if np.isfinite(c).any() else int(np.argmax(mem_left))
        out[i] = table.hosts[j].id
        load[j] += len(groups[i])
        mem_left[j] -= memory_need[i]
    return out


def profile_of(scenario: Scenario) -> ModelProfile:
    return scenario_profile(scenario)
