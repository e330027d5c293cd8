"""Baseline planners, labelled as such and judged by shoal's cost model.

Each follows its own published assumptions (and its own cost model while searching); only the
final plan is judged by :func:`shoal.plan.cost.predict`. Stage servers do not exist in the
original systems, so every baseline places them by its own logic: topology-blind methods
(dapple, swarm, random) round-robin or draw them; DT-FM, which reasons about the network, places
each stage's server where its data-parallel group syncs fastest.

* ``dapple`` -- DAPPLE (Fan et al., PPoPP 2021) planning under its homogeneity assumption: every
  device and link equals the mean one; equal layer split, devices in listed order, equal counts.
* ``swarm`` -- SWARM parallelism (Ryabinin et al., ICML 2023): uniform layer split, peers join the
  stage with the least total throughput (throughput-proportional), topology-blind.
* ``dtfm`` -- DT-FM (Yuan et al., NeurIPS 2022): fixed equal stage sizes; data-parallel groups by
  balanced partition of the bandwidth graph; pipeline order by bottleneck matching between
  groups plus an open-path search over groups; a genetic algorithm over partitions, all with
  DT-FM's communication cost model.
* ``random`` -- random stage count, boundaries, assignment and servers (feasible).
* ``exhaustive`` -- the true optimum of shoal's cost model for tiny instances.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np

from shoal.errors import ShoalError
from shoal.model.profile import ModelProfile
from shoal.plan.common import build_plan, even_layer_split, place_servers, step_of
from shoal.plan.cost import CostOptions, scenario_profile, stage_server_memory
from shoal.plan.types import Device, Plan, Scenario, StagePlan, SyncPolicy


def _naive_step(prof: ModelProfile, scenario: Scenario, n_stages: int, n_devices: int) -> float:
    """Step time under the homogeneity assumption: every device is the mean device, every flow
    gets the mean access bandwidth, servers and paths are never the bottleneck."""
    ws = scenario.workers
    n_layers = len(prof.layers)
    flops = float(np.mean([d.flops for d in ws]))
    up = float(np.mean([d.up for d in ws]))
    down = float(np.mean([d.down for d in ws]))
    m = scenario.workload.micro_batches
    f = (prof.fwd_flops(0, n_layers) + prof.bwd_flops(0, n_layers)) / n_stages
    act = prof.layers[0].out_act_bytes
    tau = f / flops + 2 * act / up + 2 * act / down
    per_stage = max(1, n_devices // n_stages)
    x = min(per_stage, m) / tau
    p = prof.param_bytes(0, n_layers) / n_stages
    return (m - 1) / x + n_stages * tau + p / up + p / down


def _round_robin_hosts(scenario: Scenario, n: int) -> list[str]:
    hosts = scenario.server_hosts
    return [hosts[i % len(hosts)].id for i in range(n)]


def _finish(scenario: Scenario, method: str, layers: list[tuple[int, int]], groups: list[list[Device]],
            servers: list[str], sync: SyncPolicy | None, prof: ModelProfile) -> Plan | None:
    """A plan from groups, dropping devices whose memory cannot hold their stage; None if a stage is empty."""
    stages = []
    for (a, b), g, h in zip(layers, groups, servers, strict=True):
        need = prof.worker_memory(a, b)
        ws = [d.id for d in g if d.memory >= need and d.flops > 0]
        if not ws:
            return None
        stages.append(StagePlan((a, b), h, ws))
    return build_plan(scenario, method, stages, sync)


def _ranked_stage_counts(prof: ModelProfile, scenario: Scenario, stages: int | None) -> list[int]:
    n_layers, n = len(prof.layers), len(scenario.workers)
    if stages:
        return [stages]
    return sorted(range(1, min(n_layers, n) + 1), key=lambda s: _naive_step(prof, scenario, s, n))


def plan_dapple(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
                options: CostOptions | None = None) -> Plan:
    """DAPPLE-style baseline (homogeneous assumption; see module docstring)."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    ws = scenario.workers
    for s in _ranked_stage_counts(prof, scenario, stages):
        per = len(ws) // s
        groups = [ws[i * per:(i + 1) * per] for i in range(s)]
        plan = _finish(scenario, "dapple", even_layer_split(n_layers, s), groups, _round_robin_hosts(scenario, s), sync, prof)
        if plan is not None:
            return plan
    raise ShoalError(f"dapple: no feasible equal split for scenario {scenario.name}")


def plan_swarm(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
               options: CostOptions | None = None) -> Plan:
    """SWARM-style baseline (throughput-balanced peers, uniform split, topology-blind)."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    for s in _ranked_stage_counts(prof, scenario, stages):
        layers = even_layer_split(n_layers, s)
        need = [prof.worker_memory(*r) for r in layers]
        load = [0.0] * s
        groups: list[list[Device]] = [[] for _ in range(s)]
        for d in sorted(scenario.workers, key=lambda d: -d.flops):
            ok = [i for i in range(s) if d.memory >= need[i]]
            if not ok:
                continue
            i = min(ok, key=lambda i: (load[i], i))
            groups[i].append(d)
            load[i] += d.flops
        plan = _finish(scenario, "swarm", layers, groups, _round_robin_hosts(scenario, s), sync, prof)
        if plan is not None:
            return plan
    raise ShoalError(f"swarm: no feasible assignment for scenario {scenario.name}")


def plan_random(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
                options: CostOptions | None = None) -> Plan:
    """Random feasible plan (seeded)."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    rng = random.Random(seed)
    ws = list(scenario.workers)
    hosts = [h.id for h in scenario.server_hosts]
    for _ in range(200):
        s = stages or rng.randint(1, min(n_layers, len(ws)))
        cuts = sorted(rng.sample(range(1, n_layers), s - 1))
        bounds = [0, *cuts, n_layers]
        layers = [(bounds[i], bounds[i + 1]) for i in range(s)]
        groups: list[list[Device]] = [[] for _ in range(s)]
        order = ws[:]
        rng.shuffle(order)
        for i, d in enumerate(order):
            groups[i if i < s else rng.randrange(s)].append(d)
        plan = _finish(scenario, "random", layers, groups, [rng.choice(hosts) for _ in range(s)], sync, prof)
        if plan is not None and math.isfinite(step_of(plan, scenario, options)):
            return plan
    return plan_dapple(scenario, seed, stages, sync, options)


# --------------------------------------------------------------------------- DT-FM


class _DtfmModel:
    """DT-FM's communication cost model over a device set (pairwise latency/bandwidth matrices)."""

    def __init__(self, scenario: Scenario, devices: list[Device], prof: ModelProfile, n_stages: int):
        net = scenario.network
        regions = sorted({d.region for d in devices})
        rid = np.array([regions.index(d.region) for d in devices])
        rep = {}
        for d in devices:
            rep.setdefault(d.region, d)
        r_lat = np.zeros((len(regions), len(regions)))
        r_bw = np.zeros((len(regions), len(regions)))
        for i, a in enumerate(regions):
            for j, b in enumerate(regions):
                link = net.intra[a] if a == b else net.link(rep[a], rep[b])
                r_lat[i, j], r_bw[i, j] = link.latency, link.bandwidth
        up = np.array([d.up for d in devices])
        down = np.array([d.down for d in devices])
        self.lat = r_lat[np.ix_(rid, rid)]
        self.bw = np.minimum(np.minimum(r_bw[np.ix_(rid, rid)], np.minimum(up[:, None], down[None, :])),
                             np.minimum(up[None, :], down[:, None]))
        index = {d.id: i for i, d in enumerate(devices)}
        for (x, y), link in net.overrides.items():
            if x in index and y in index:
                i, j = index[x], index[y]
                bw = min(link.bandwidth, up[i], down[j], up[j], down[i])
                self.lat[i, j] = self.lat[j, i] = link.latency
                self.bw[i, j] = self.bw[j, i] = bw
        np.fill_diagonal(self.bw, np.inf)
        np.fill_diagonal(self.lat, 0.0)
        self.inv = np.where(np.isfinite(self.bw), 1.0 / self.bw, 0.0)
        self.region = [d.region for d in devices]
        n_layers = len(prof.layers)
        self.stage_params = prof.param_bytes(0, n_layers) / n_stages
        self.act = prof.layers[0].out_act_bytes
        self.m = scenario.workload.micro_batches

    def dp_cost(self, group: np.ndarray) -> float:
        """Ring all-reduce of the stage's gradients inside a data-parallel group."""
        d = len(group)
        if d <= 1:
            return 0.0
        sub_bw = self.bw[np.ix_(group, group)]
        sub_lat = self.lat[np.ix_(group, group)]
        return 2 * (d - 1) * (sub_lat.max() + self.stage_params / d / sub_bw.min())

    def pp_cost(self, g1: np.ndarray, g2: np.ndarray) -> float:
        """Activation exchange between consecutive groups: each of the D pipelines carries M/D
        micro-batches forward and backward; devices are matched one to one (min-sum assignment,
        then the slowest pair counts -- DT-FM's bottleneck matching)."""
        from scipy.optimize import linear_sum_assignment  # lazy: keeps `import shoal.plan` light

        per = self.m / max(1, len(g1))
        cost = 2 * per * (self.lat[np.ix_(g1, g2)] + self.act / self.bw[np.ix_(g1, g2)])
        r, c = linear_sum_assignment(cost)
        return float(cost[r, c].max())

    def total(self, groups: list[np.ndarray]) -> tuple[float, list[int]]:
        """DP cost (slowest group) plus PP cost along the best open path over the groups."""
        s = len(groups)
        dp = max(self.dp_cost(g) for g in groups)
        if s == 1:
            return dp, [0]
        pp = np.zeros((s, s))
        for i in range(s):
            for j in range(i + 1, s):
                pp[i, j] = pp[j, i] = self.pp_cost(groups[i], groups[j])
        order, cost = _open_path(pp)
        return dp + cost, order


def _open_path(cost: np.ndarray) -> tuple[list[int], float]:
    """Cheapest Hamiltonian path (exact Held-Karp for <= 8 nodes, else nearest neighbour + 2-opt)."""
    n = len(cost)
    if n <= 8:
        best: dict[tuple[int, int], tuple[float, int]] = {(1 << i, i): (0.0, -1) for i in range(n)}
        for mask in range(1, 1 << n):
            for last in range(n):
                if (mask, last) not in best:
                    continue
                c0 = best[(mask, last)][0]
                for nxt in range(n):
                    if mask & (1 << nxt):
                        continue
                    key = (mask | (1 << nxt), nxt)
                    c = c0 + cost[last, nxt]
                    if key not in best or c < best[key][0]:
                        best[key] = (c, last)
        full = (1 << n) - 1
        last = min(range(n), key=lambda i: best[(full, i)][0])
        total = best[(full, last)][0]
        path, mask = [], full
        while last != -1:
            path.append(last)
            prev = best[(mask, last)][1]
            mask ^= 1 << last
            last = prev
        return path[::-1], total
    paths = []
    for start in range(n):
        path, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda j: cost[path[-1], j])
            path.append(nxt)
            left.remove(nxt)
        paths.append(path)

    def length(p: list[int]) -> float:
        return float(sum(cost[p[i], p[i + 1]] for i in range(len(p) - 1)))

    best_path = min(paths, key=length)
    improved = True
    while improved:
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                cand = best_path[:i] + best_path[i:j + 1][::-1] + best_path[j + 1:]
                if length(cand) < length(best_path) - 1e-12:
                    best_path, improved = cand, True
    return best_path, length(best_path)


def _balanced_partition(model: _DtfmModel, n: int, s: int, rng: random.Random, deadline: float,
                        shuffle: int = 0) -> list[list[int]]:
    """Balanced partition into ``s`` groups of ``n // s`` devices maximising intra-group bandwidth:
    start from devices grouped by region (the clusters a graph partitioner finds first), perturb
    with ``shuffle`` random swaps, then Kernighan-Lin style swaps."""
    per = n // s
    idx = sorted(range(n), key=lambda i: (model.region[i], i))
    groups = [idx[i * per:(i + 1) * per] for i in range(s)]
    for _ in range(shuffle):
        gi, gj = rng.sample(range(s), 2) if s > 1 else (0, 0)
        a, b = rng.randrange(per), rng.randrange(per)
        groups[gi][a], groups[gj][b] = groups[gj][b], groups[gi][a]
    return _kl(model, groups, rng, deadline)


def _kl(model: _DtfmModel, groups: list[list[int]], rng: random.Random, deadline: float) -> list[list[int]]:
    """One pass of pairwise swaps that lower the summed inverse bandwidth inside groups."""
    inv = model.inv
    s = len(groups)
    if s == 1 or len(groups[0]) <= 1:
        return groups
    for gi in range(s):
        for pos in range(len(groups[gi])):
            if time.perf_counter() > deadline:
                return groups
            g = groups[gi]
            a = g[pos]
            gj = rng.randrange(s - 1)
            gj += gj >= gi
            h = groups[gj]
            ga, hh = np.array(g), np.array(h)
            # gain of swapping a with each b in h: a leaves g for h, b leaves h for g
            a_g = inv[a, ga].sum()
            a_h = inv[a, hh].sum() - inv[a, hh]
            b_h = inv[hh][:, hh].sum(axis=1)
            b_g = inv[hh][:, ga].sum(axis=1) - inv[hh, a]
            gain = (a_g + b_h) - (a_h + b_g)
            k = int(np.argmax(gain))
            if gain[k] > 1e-12:
                g[pos], h[k] = h[k], g[pos]
    return groups


def plan_dtfm(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
              options: CostOptions | None = None, budget_s: float | None = None) -> Plan:
    """DT-FM-style baseline: balanced partition + bottleneck matching/open path + genetic search."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    devs = list(scenario.workers)
    n = len(devs)
    rng = random.Random(seed)
    flops = float(np.mean([d.flops for d in devs]))
    m = scenario.workload.micro_batches
    f_total = prof.fwd_flops(0, n_layers) + prof.bwd_flops(0, n_layers)
    if budget_s is None:
        budget_s = 5.0 + 0.02 * n  # safety net; generations bound the search
    deadline = time.perf_counter() + budget_s
    # Choose S with DT-FM's model on one balanced partition per S (compute is homogeneous for
    # DT-FM, so it only enters through the pipeline's shape).
    model = _DtfmModel(scenario, devs, prof, 1)
    counts = [stages] if stages else list(range(1, min(n_layers, n) + 1))
    scored = []
    for s in counts:
        model.stage_params = prof.param_bytes(0, n_layers) / s
        per = n // s
        groups = _balanced_partition(model, n, s, rng, time.perf_counter() + budget_s / 4 / len(counts))
        comm, _ = model.total([np.array(g) for g in groups])
        compute = (m + s - 1) * f_total / s / flops / min(per, m)
        scored.append((comm + compute, s, groups))
    scored.sort(key=lambda x: x[0])
    _, s, first = scored[0]
    model.stage_params = prof.param_bytes(0, n_layers) / s
    # Genetic search over partitions: elitism, swap mutations, KL repair, DT-FM's cost as fitness.
    pop = [first] + [_balanced_partition(model, n, s, rng, deadline, shuffle=max(1, n // 8)) for _ in range(5)]
    fitness = [model.total([np.array(g) for g in p])[0] for p in pop]
    generation = 0
    while time.perf_counter() < deadline and generation < 20 and s > 1:
        generation += 1
        ranked = sorted(range(len(pop)), key=lambda i: fitness[i])
        parents = [pop[i] for i in ranked[:3]]
        children = []
        for p in parents:
            child = [g[:] for g in p]
            for _ in range(max(1, n // 16)):
                gi, gj = rng.sample(range(s), 2)
                a, b = rng.randrange(len(child[gi])), rng.randrange(len(child[gj]))
                child[gi][a], child[gj][b] = child[gj][b], child[gi][a]
            children.append(_kl(model, child, rng, deadline))
        pop = parents + children
        fitness = [model.total([np.array(g) for g in p])[0] for p in pop]
    best = pop[min(range(len(pop)), key=lambda i: fitness[i])]
    _, order = model.total([np.array(g) for g in best])
    layers = even_layer_split(n_layers, s)
    groups = [[devs[i] for i in best[k]] for k in order]
    servers = place_servers(scenario, groups, [prof.param_bytes(*r) for r in layers],
                            [stage_server_memory(prof, *r, sync) for r in layers])
    plan = _finish(scenario, "dtfm", layers, groups, servers, sync, prof)
    if plan is None:
        raise ShoalError(f"dtfm: equal stages of {n_layers}/{s} layers do not fit the devices of {scenario.name}")
    return plan


# --------------------------------------------------------------------------- exhaustive

EXHAUSTIVE_MAX_EVALS = 200_000  # refuse instances whose search space is larger


def _compositions(k: int, bins: int):
    """All ways to put ``k`` identical items into ``bins`` bins."""
    for cuts in itertools.combinations(range(k + bins - 1), bins - 1):
        prev, out = -1, []
        for c in cuts:
            out.append(c - prev - 1)
            prev = c
        out.append(k + bins - 1 - prev - 1)
        yield out


def plan_exhaustive(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
                    options: CostOptions | None = None) -> Plan:
    """The optimum of shoal's cost model by enumeration (devices with identical attributes are
    interchangeable, which shrinks the space); refuses instances above ``EXHAUSTIVE_MAX_EVALS``."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    hosts = [h.id for h in scenario.server_hosts]
    classes: dict[tuple, list[Device]] = {}
    for d in scenario.workers:
        key = (d.kind, d.flops, d.memory, d.region, d.up, d.down, d.id if d.can_host_server else "")
        classes.setdefault(key, []).append(d)
    members = list(classes.values())
    counts = [stages] if stages else list(range(1, min(n_layers, len(scenario.workers)) + 1))
    total = 0
    for s in counts:
        per_assign = math.prod(math.comb(len(c) + s, s) for c in members)
        total += math.comb(n_layers - 1, s - 1) * len(hosts) ** s * per_assign
    if total > EXHAUSTIVE_MAX_EVALS:
        raise ShoalError(
            f"exhaustive: {total} candidate plans for {scenario.name} (limit {EXHAUSTIVE_MAX_EVALS}); use it on tiny instances only"
        )
    best, best_t = None, math.inf
    for s in counts:
        for cuts in itertools.combinations(range(1, n_layers), s - 1):
            bounds = [0, *cuts, n_layers]
            layers = [(bounds[i], bounds[i + 1]) for i in range(s)]
            need = [prof.worker_memory(*r) for r in layers]
            per_class = [list(_compositions(len(c), s + 1)) for c in members]
            for combo in itertools.product(*per_class):
                groups: list[list[str]] = [[] for _ in range(s)]
                ok = True
                for c, split in zip(members, combo, strict=True):
                    pos = 0
                    for st in range(s):
                        for d in c[pos:pos + split[st]]:
                            if d.memory < need[st]:
                                ok = False
                            groups[st].append(d.id)
                        pos += split[st]
                if not ok or any(not g for g in groups):
                    continue
                for hs in itertools.product(hosts, repeat=s):
                    plan = build_plan(scenario, "exhaustive",
                                      [StagePlan(r, h, list(g)) for r, h, g in zip(layers, hs, groups, strict=True)], sync)
                    host_need: dict[str, float] = {}
                    for r, h in zip(layers, hs, strict=True):
                        host_need[h] = host_need.get(h, 0.0) + stage_server_memory(prof, *r, sync)
                    if any(scenario.device(h).host_memory < v for h, v in host_need.items()):
                        continue
                    t = step_of(plan, scenario, options)
                    if t < best_t:
                        best, best_t = plan, t
    if best is None:
        raise ShoalError(f"exhaustive: no feasible plan for {scenario.name}")
    return best
