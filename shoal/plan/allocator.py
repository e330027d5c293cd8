"""shoal's allocator: cluster on the network graph, cut into stages, split layers, place servers,
refine by local search, over several stage counts ``S``. See ``docs/planner.md``.

Outline for one ``S``:

1. *Cluster and order.* Regions are the graph's natural dense clusters (every pair of devices in
   a region shares one link). Regions are clustered hierarchically (average linkage, distance =
   latency + reference stage bytes / bandwidth) and laid out in the dendrogram's optimal leaf
   order, so neighbouring regions in the order are close. Devices are listed region by region.
2. *Cut.* The list is cut into ``S`` contiguous groups of balanced capacity, snapping a cut to a
   region boundary when one is near; each group becomes a stage, so a stage's parameter sync
   stays inside a region (or a pair of neighbouring regions) and only activations cross between
   neighbouring groups.
3. *Servers.* Each group's server goes on the allowed host where its slowest worker syncs fastest.
4. *Layers and device selection.* A DP over layer boundaries minimises the largest per-stage
   estimate ``(M-1)/X_s + sync_s``; for every candidate range it also picks the prefix of the
   stage's workers (ordered by sync cost) that minimises the estimate, which drops devices whose
   sync would dominate.
5. *Local search* on the full cost model: shift boundaries, move / swap / add / drop devices,
   move servers.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

import numpy as np

from shoal.errors import ShoalError
from shoal.model.profile import ModelProfile
from shoal.plan.cluster import leaf_order
from shoal.plan.common import SyncTable, build_plan, place_servers, step_of
from shoal.plan.cost import (
    CostOptions,
    _policy_key,
    availability,
    compute_time,
    scenario_profile,
    servers_memory,
    stage_server_memory,
    stage_sync_time,
    stage_worker_memory,
    step_time,
    task_period,
)
from shoal.plan.types import Device, Plan, Scenario, StagePlan, SyncPolicy


def region_matrices(scenario: Scenario) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Regions of the workers with the latency and bandwidth between every pair of them."""
    regions = sorted({d.region for d in scenario.workers})
    rep = {}
    for d in scenario.workers:
        rep.setdefault(d.region, d)
    n = len(regions)
    lat = np.zeros((n, n))
    bw = np.full((n, n), np.inf)
    for i in range(n):
        for j in range(i + 1, n):
            link = scenario.network.link(rep[regions[i]], rep[regions[j]])
            lat[i, j] = lat[j, i] = link.latency
            bw[i, j] = bw[j, i] = link.bandwidth
    return regions, lat, bw


def region_order(scenario: Scenario, ref_bytes: float, matrices: tuple | None = None) -> list[str]:
    """Regions of the workers in a path order where neighbours are close: average-linkage
    clustering on ``latency + ref_bytes / bandwidth``, leaves in optimal order."""
    regions, lat, bw = matrices or region_matrices(scenario)
    if len(regions) <= 2:
        return regions
    dist = lat + ref_bytes / bw
    np.fill_diagonal(dist, 0.0)
    return [regions[i] for i in leaf_order(dist)]


def _device_rate(d: Device, prof: ModelProfile, n_stages: int) -> float:
    """Rough micro-batches/s of ``d`` on a 1/S share of the model: compute plus activations over
    its own access links (capacity used to balance the cut)."""
    n_layers = len(prof.layers)
    flops = (prof.fwd_flops(0, n_layers) + prof.bwd_flops(0, n_layers)) / n_stages
    act = prof.layers[0].out_act_bytes
    t = flops / d.flops + 2 * act / d.up + 2 * act / d.down
    return 1.0 / t


def cut_groups(ordered: list[Device], rates: list[float], n_stages: int, snap: float) -> list[list[Device]]:
    """Cut the ordered device list into ``n_stages`` contiguous groups of about equal total rate,
    moving a cut to a region boundary within ``snap`` x (one group's rate)."""
    total = sum(rates)
    target = total / n_stages
    cum = np.cumsum(rates)
    cuts = [0]
    boundaries = [i for i in range(1, len(ordered)) if ordered[i].region != ordered[i - 1].region]
    for k in range(1, n_stages):
        pos = int(np.searchsorted(cum, k * target)) + 1
        lo = cuts[-1] + 1
        hi = len(ordered) - (n_stages - k)
        pos = min(max(pos, lo), hi)
        if snap > 0:
            near = [b for b in boundaries if lo <= b <= hi and abs(cum[b - 1] - k * target) <= snap * target]
            if near:
                pos = min(near, key=lambda b: abs(cum[b - 1] - k * target))
        cuts.append(pos)
    cuts.append(len(ordered))
    return [ordered[cuts[i]:cuts[i + 1]] for i in range(n_stages)]


class _StageTable:
    """Vectorised per-stage estimates for every layer range ``[a, b)`` of one device group."""

    def __init__(self, group: list[Device], host: Device, share: int, scenario: Scenario, prof: ModelProfile,
                 sync: SyncPolicy, m: int, overlap: bool, pairs: np.ndarray, pair_flops: np.ndarray,
                 pair_pbytes: np.ndarray, pair_mem: np.ndarray, n_layers: int, table: SyncTable | None = None):
        net = scenario.network
        flops = np.array([d.flops for d in group])
        mem = np.array([d.memory for d in group])
        hidden = prof.layers[0].out_act_bytes * sync.ratio("act", prof.dtype_bytes, *prof.act_shape)
        hidden_grad = prof.layers[0].out_act_bytes * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)
        tokens = prof.tokens_per_micro_batch * 8
        n = len(group)
        if table is not None and not table.exact:
            hi = table.h_index[host.id]
            rid = np.array([table.rid[d.region] for d in group])
            path, lat = table.path[hi, rid], table.lat[hi, rid].copy()
            up = np.minimum(np.minimum(path, np.array([d.up for d in group])), host.down / share)
            down = np.minimum(np.minimum(path, host.up / share), np.array([d.down for d in group]))
            t_up, t_down = 1.0 / up, 1.0 / down
            own = np.array([d.id == host.id for d in group], dtype=bool)
            t_up[own] = t_down[own] = lat[own] = 0.0  # loopback
        else:
            t_up, t_down, lat = np.zeros(n), np.zeros(n), np.zeros(n)
            for j, d in enumerate(group):
                if d.id == host.id:
                    continue
                link = net.link(d, host)
                t_up[j] = 1.0 / min(link.bandwidth, d.up, host.down / share)
                t_down[j] = 1.0 / min(link.bandwidth, host.up / share, d.down)
                lat[j] = link.latency
        # sync seconds per parameter byte, per step (a round every H steps)
        spb = (sync.ratio("push", prof.dtype_bytes, *prof.act_shape) * t_up
               + sync.ratio("pull", prof.dtype_bytes, *prof.act_shape) * t_down) \
            / max(1, sync.sync_every)
        a, b = pairs[:, 0], pairs[:, 1]
        first = (a == 0)[:, None]
        last = (b == n_layers)[:, None]
        # bytes in / out per micro-batch (see cost.stage_costs)
        in_b = np.where(first, tokens, hidden) + np.where(last, tokens, 0.0)
        down_b = in_b + np.where(last, 0.0, hidden_grad)
        up_b = np.where(last, 0.0, hidden) + np.where(first, 0.0, hidden_grad)
        n_msgs = np.where(last, 2, 4)  # lease round trips to the own server: 2 per task, 2 tasks (1 on the last stage)
        comp = pair_flops[:, None] / flops[None, :]
        fetch = down_b * t_down[None, :] + n_msgs * lat[None, :]
        upload = up_b * t_up[None, :]
        if sync.prefetch and sync.overlap_uploads:  # see cost.task_period
            tau = np.maximum(np.maximum(comp, fetch), upload)
        elif sync.prefetch:
            tau = np.maximum(comp + upload, fetch)
        elif sync.overlap_uploads:
            tau = np.maximum(comp + fetch, upload)
        else:
            tau = comp + fetch + upload
        tau = np.where(mem[None, :] >= pair_mem[:, None], tau, np.inf)
        sync_t = 3 * lat[None, :] / max(1, sync.sync_every) + pair_pbytes[:, None] * spb[None, :]
        sync_t = np.where(spb[None, :] > 0, sync_t, 0.0)
        # Prefixes in order of sync cost; a worker that cannot fit is skipped (rate 0).
        order = np.argsort(spb, kind="stable")
        with np.errstate(divide="ignore"):
            inv = np.where(np.isfinite(tau[:, order]), 1.0 / tau[:, order], 0.0)
        x = np.cumsum(inv, axis=1)
        s_run = np.maximum.accumulate(np.where(inv > 0, sync_t[:, order], 0.0), axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # (0 / 0 where x = 0 and m = 1: not taken)
            pipe = np.where(x > 0, (m - 1) / x, np.inf)
        est = np.maximum(pipe, s_run) if overlap else pipe + s_run
        k = np.argmin(est, axis=1)
        self.est = est[np.arange(len(pairs)), k]
        self.keep = k + 1
        self.order = order
        self.group = group
        dense = np.full((n_layers + 1, n_layers + 1), math.inf)  # est over [a, b], inf where a >= b
        dense[a, b] = self.est
        self.dense = dense


def _pairs(n_layers: int) -> np.ndarray:
    return np.array([(a, b) for a in range(n_layers) for b in range(a + 1, n_layers + 1)])


_PAIR_CACHE: dict[tuple, tuple] = {}


def _pair_arrays(prof: ModelProfile, recompute: bool, sync: SyncPolicy | None = None) -> tuple:
    """Every layer range [a, b) with its FLOPs per micro-batch, parameter bytes and worker memory."""
    # (the worker memory depends on the policy through these three: stage_worker_memory)
    local = sync is not None and sync.local
    uploads = sync is not None and sync.overlap_uploads
    lean = local and sync.lean
    key = (prof.cfg, prof.seq_len, prof.micro_batch_size, prof.dtype_bytes, recompute, local, uploads, lean)
    if key not in _PAIR_CACHE:
        n_layers = len(prof.layers)
        pairs = _pairs(n_layers)
        pair_index = {(int(a), int(b)): i for i, (a, b) in enumerate(pairs)}
        pf = np.array([prof.fwd_flops(a, b) + prof.bwd_flops(a, b)
                       + (prof.fwd_flops(a, b) if recompute and b < n_layers else 0) for a, b in pairs])
        pp = np.array([prof.param_bytes(a, b) for a, b in pairs], dtype=float)
        pm = np.array([stage_worker_memory(prof, a, b, sync) for a, b in pairs], dtype=float)
        _PAIR_CACHE[key] = (pairs, pair_index, pf, pp, pm)
    return _PAIR_CACHE[key]


def _dp(tables: list[_StageTable], n_layers: int) -> tuple[float, list[tuple[int, int]]]:
    """Boundaries minimising the largest per-stage estimate: ``best[s][b]`` = the smallest
    largest estimate of the first ``s`` stages covering layers ``[0, b)``, one numpy pass per
    stage over every ``(a, b)``; a tie goes to the smallest ``a``."""
    s_count = len(tables)
    inf = math.inf
    size = n_layers + 1
    best = np.full(size, inf)
    best[0] = 0.0
    args = []
    for s in range(1, s_count + 1):
        cand = np.maximum(best[:, None], tables[s - 1].dense)  # [a, b]
        # b runs over s .. n_layers - (S - s): every stage keeps at least one layer
        cand[:, :s] = inf
        cand[:, n_layers - (s_count - s) + 1:] = inf
        arg = np.argmin(cand, axis=0)  # the first minimum: the smallest a
        best = cand[arg, np.arange(size)]
        args.append(arg)
    if best[n_layers] == inf:
        return inf, []
    out, b = [], n_layers
    for s in range(s_count, 0, -1):
        a = int(args[s - 1][b])
        out.append((a, b))
        b = a
    return float(best[n_layers]), out[::-1]


def construct(scenario: Scenario, n_stages: int, sync: SyncPolicy, options: CostOptions,
              snap: float = 0.35, table: SyncTable | None = None, order: list[str] | None = None,
              act_aware: bool = False, memo: dict | None = None, bound: StepBound | None = None,
              threshold: float = math.inf) -> Plan | None:
    """Steps 1-4 for one stage count; None if no feasible plan was found. ``memo``: the cost
    model's memo for this scenario (see :func:`shoal.plan.cost.stage_costs`); ``bound``: a
    :class:`StepBound` for it, to skip evaluating candidates that cannot be the best one or
    whose step would exceed ``threshold`` (then None may come back although a plan exists: the
    caller passes a threshold above which a candidate cannot matter, see :func:`plan_shoal`)."""
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    workers = scenario.workers
    if n_stages > min(n_layers, len(workers)):
        return None
    ref_bytes = prof.param_bytes(0, n_layers) / n_stages
    order = order or region_order(scenario, ref_bytes)
    rank = {r: i for i, r in enumerate(order)}
    rates = {d.id: _device_rate(d, prof, n_stages) for d in workers}
    ordered = sorted(workers, key=lambda d: (rank[d.region], -rates[d.id], d.id))
    groups = cut_groups(ordered, [rates[d.id] for d in ordered], n_stages, snap)
    if any(not g for g in groups):
        return None
    even = [(round(i * n_layers / n_stages), round((i + 1) * n_layers / n_stages)) for i in range(n_stages)]
    table = table or SyncTable(scenario)
    act = prof.layers[0].out_act_bytes * sync.act_compression
    m = scenario.workload.micro_batches
    hosts = place_servers(scenario, groups, [prof.param_bytes(*r) for r in even],
                          [stage_server_memory(prof, *r, sync) for r in even], table, act if act_aware else 0.0, m)
    share: dict[str, int] = {}
    for g, h in zip(groups, hosts, strict=True):
        share[h] = share.get(h, 0) + len(g)
    pairs, pair_index, pf, pp, pm = _pair_arrays(prof, options.recompute, sync)
    m = scenario.workload.micro_batches
    dev = {d.id: d for d in scenario.devices}
    # local mode with delayed application: a step costs max(P, R / H), the same shape as overlap_sync
    overlap = options.overlap_sync or (sync.local and sync.overlap)
    memo = {} if memo is None else memo
    tables = []
    for g, h in zip(groups, hosts, strict=True):
        # the two snaps and neighbouring stage counts often cut the same group
        key = ("table", tuple(d.id for d in g), h, share[h], _policy_key(sync), m, overlap, options.recompute)
        t = memo.get(key)
        if t is None:
            t = memo[key] = _StageTable(g, dev[h], share[h], scenario, prof, sync, m, overlap, pairs, pf, pp, pm,
                                        n_layers, table)
        tables.append(t)
    _, dp_bounds = _dp(tables, n_layers)
    # The DP minimises the largest per-stage (pipeline + sync) estimate, while the step adds the
    # largest pipeline term to the largest sync term; the even split is kept as a second
    # candidate because it is often the better compromise when stages are alike.
    best, best_t = None, math.inf
    for bounds in (dp_bounds, even):
        if not bounds:
            continue
        stages = []
        for t, h, (a, b) in zip(tables, hosts, bounds, strict=True):
            k = int(t.keep[pair_index[(a, b)]])
            need = stage_worker_memory(prof, a, b, sync)
            chosen = [t.group[j] for j in t.order[:k] if t.group[j].memory >= need]
            if not chosen:
                break
            stages.append(StagePlan(layers=(a, b), server=h, workers=[d.id for d in chosen]))
        if len(stages) < n_stages:
            continue
        if bound is not None and bound.any_servers(stages) > min(best_t, threshold) * (1 + 1e-9):
            continue  # every placement's bound is above: the three candidates below would all be skipped
        # Re-place servers for the final layer ranges and worker sets, by sync alone and by sync
        # plus activation traffic; keep whichever placement predicts the shortest step.
        groups2 = [[dev[w] for w in st.workers] for st in stages]
        pb = [prof.param_bytes(*st.layers) for st in stages]
        mem = [stage_server_memory(prof, *st.layers, sync) for st in stages]
        plans = [build_plan(scenario, "shoal", stages, sync)]
        for a_bytes in (0.0, act):
            hs = place_servers(scenario, groups2, pb, mem, table, a_bytes, m)
            plans.append(build_plan(scenario, "shoal", [StagePlan(st.layers, h, list(st.workers))
                                                        for st, h in zip(stages, hs, strict=True)], sync))
        for cand in plans:
            if bound is not None and bound(cand, tie_break=False) > min(best_t, threshold) * (1 + 1e-9):
                continue  # t >= bound > best_t (it cannot be kept) or > threshold (it cannot matter)
            t = step_of(cand, scenario, options, memo)
            if t < best_t:
                best, best_t = cand, t
    return best


# --------------------------------------------------------------------------- local search


def _copy(plan: Plan) -> Plan:
    return Plan(plan.scenario, plan.model, plan.method,
                [StagePlan(tuple(s.layers), s.server, list(s.workers)) for s in plan.stages],
                plan.micro_batch_size, plan.micro_batches, plan.sync, dict(plan.predicted), plan.planning_time_s)


def _feasible(plan: Plan, scenario: Scenario, prof: ModelProfile, dev: dict[str, Device]) -> bool:
    for st in plan.stages:
        if not st.workers or st.layers[1] <= st.layers[0]:
            return False
        need = stage_worker_memory(prof, *st.layers, plan.sync)
        if any(dev[w].memory < need for w in st.workers):
            return False
    return all(dev[h].host_memory >= n for h, n in servers_memory(plan.stages, prof, plan.sync).items())


def _neighbours(plan: Plan, scenario: Scenario, rng: random.Random, unused: list[str], dev: dict[str, Device],
                host_ids: list[str]):
    """Candidate modifications of ``plan`` (generator of new plans)."""
    n = len(plan.stages)
    pred = plan.predicted
    b = int(pred.get("bottleneck_stage", 0))
    # 1. shift boundaries by one layer
    for i in range(n - 1):
        for delta in (-1, 1):
            p = _copy(plan)
            a0, b0 = p.stages[i].layers
            a1, b1 = p.stages[i + 1].layers
            nb = b0 + delta
            if a0 < nb < b1:
                p.stages[i].layers = (a0, nb)
                p.stages[i + 1].layers = (nb, b1)
                yield p
    # 2. add an unused device to the bottleneck stage (or any stage)
    for w in rng.sample(unused, min(len(unused), 6)):
        for s in {b, rng.randrange(n)}:
            p = _copy(plan)
            p.stages[s].workers.append(w)
            yield p
    # 3. move a device into the bottleneck stage from a neighbour / swap with it
    for s in {max(0, b - 1), min(n - 1, b + 1), rng.randrange(n)} - {b}:
        src = plan.stages[s].workers
        if len(src) > 1:
            for w in rng.sample(src, min(len(src), 4)):
                p = _copy(plan)
                p.stages[s].workers.remove(w)
                p.stages[b].workers.append(w)
                yield p
        if src and plan.stages[b].workers:
            w1 = rng.choice(src)
            w2 = min(plan.stages[b].workers, key=lambda x: dev[x].flops)
            p = _copy(plan)
            p.stages[s].workers[p.stages[s].workers.index(w1)] = w2
            p.stages[b].workers[p.stages[b].workers.index(w2)] = w1
            yield p
    # 4. drop the device with the slowest sync / compute from a stage
    for s in {b, rng.randrange(n)}:
        ws = plan.stages[s].workers
        if len(ws) > 1:
            # an ordered de-duplication: iterating a set of strings follows the per-process hash seed
            for w in dict.fromkeys((min(ws, key=lambda x: dev[x].up), min(ws, key=lambda x: dev[x].flops))):
                p = _copy(plan)
                p.stages[s].workers.remove(w)
                yield p
                # compound move: dropping a device can make another server host the better one
                for h in rng.sample(host_ids, min(len(host_ids), 3)):
                    if h != p.stages[s].server:
                        q = _copy(p)
                        q.stages[s].server = h
                        yield q
    # 5. move a server
    for s in {b, rng.randrange(n)}:
        for h in rng.sample(host_ids, min(len(host_ids), 4)):
            if h != plan.stages[s].server:
                p = _copy(plan)
                p.stages[s].server = h
                yield p


TIE_BREAK = 1e-3  # weight of the mean stage time in local search: lets non-bottleneck stages improve
TOP_K = 3  # best constructed candidates refined by local search
TOP_K_OTHER = 2  # plus the best candidate of this many other stage counts


def _objective(plan: Plan, scenario: Scenario, options: CostOptions, memo: dict | None = None) -> float:
    """Step time, plus a small pull towards faster non-bottleneck stages (breaks plateaus where
    only the bottleneck counts)."""
    t = step_of(plan, scenario, options, memo)
    return t + TIE_BREAK * plan.predicted.get("mean_stage_time_s", 0.0) if math.isfinite(t) else t


class StepBound:
    """A lower bound on :func:`_objective` that needs no link-sharing fixed point, so local search
    can skip candidates that cannot beat the incumbent without evaluating them (exact sync only).

    The cost model's step is ``step_time(P, sync)`` with ``P = (M - 1) / min_s X_s + fill`` and,
    under churn, ``step_time(P^a, sync) + churn`` with ``X^a_s = sum over the used workers of
    a_d / tau_d`` (``churn >= 0``). A worker's ``tau_d`` is smallest when no server link is shared
    (``k_eff = 1``): call that ``t_d``. So ``X^a_s <= `` the sum of the ``M`` largest ``a_d / t_d``
    (``a_d = 1`` without churn), each stage's fill share ``>= min_d t_d``, and the tie-break's
    ``(M - 1) / X_s >= (M - 1) / (sum of the M largest 1 / t_d)``; the sync term is the cost
    model's own (it does not depend on the fixed point). Per-stage figures are memoised: a move
    changes one or two stages. ``tests/test_plan_speed.py`` checks the bound against the cost
    model on every move of several scenarios."""

    def __init__(self, scenario: Scenario, sync: SyncPolicy, options: CostOptions,
                 micro_batch_size: int | None = None):
        self.scenario = scenario
        self.sync = sync
        self.options = options
        self.prof = scenario_profile(scenario, micro_batch_size)
        self.dev = {d.id: d for d in scenario.devices}
        self.m = scenario.workload.micro_batches if micro_batch_size is None else \
            scenario.workload.global_batch // micro_batch_size
        churn = options.churn and scenario.churn.enabled
        off = scenario.churn.mean_offline_s
        self.avail = {d.id: availability(d.mean_session_s, off) if churn else 1.0 for d in scenario.devices}
        prof = self.prof
        self.tokens = prof.tokens_per_micro_batch * 8
        self.hidden = prof.layers[0].out_act_bytes * sync.ratio("act", prof.dtype_bytes, *prof.act_shape)
        self.hidden_grad = prof.layers[0].out_act_bytes * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)
        self.rates: dict[tuple, tuple[float, float, float]] = {}  # per stage and context
        self.syncs: dict[tuple, float] = {}
        self.per_worker: dict[tuple, dict[str, float]] = {}  # stage context -> worker -> t_d
        self.per_worker_sync: dict[tuple, dict] = {}  # (layers, host, k) -> worker -> (lat, push s, pull s)
        self.flops: dict[tuple, float] = {}
        self.best_links: dict[str, tuple[float, float, float]] = {}  # see _best_links

    def _rates(self, st: StagePlan, wt: tuple, first: bool, last: bool, nxt: str | None, prv: str | None) -> tuple:
        """``(sum of the M largest a_d / t_d, the same without a_d, min_d t_d)`` of one stage
        (``wt``: its workers as a tuple)."""
        key = (st.layers, first, last, st.server, nxt, prv, wt)
        got = self.rates.get(key)
        if got is not None:
            return got
        # t_d depends on the worker and the stage's context only: a move that adds or drops a
        # worker reuses the others' figures
        ctx_key = key[:6]
        per = self.per_worker.get(ctx_key)
        if per is None:
            per = self.per_worker[ctx_key] = {}
        times = []
        for wid in st.workers:
            t = per.get(wid)
            if t is None:
                t = per[wid] = self._task_time(wid, st.layers, first, last, st.server, nxt, prv)
            if 0 < t < math.inf:
                times.append(t)
        avail = self.avail
        if len(st.workers) <= self.m:
            x = sum(1.0 / per[w] for w in st.workers if 0 < per[w] < math.inf)
            xa = sum(avail[w] / per[w] for w in st.workers if 0 < per[w] < math.inf)
        else:
            ts = sorted(times)[:self.m]
            x = sum(1.0 / t for t in ts)
            xa = sum(sorted((avail[w] / per[w] for w in st.workers if 0 < per[w] < math.inf),
                            reverse=True)[:self.m])
        got = self.rates[key] = (xa, x, min(times) if times else math.inf)
        return got

    def _flops(self, layers: tuple[int, int], last: bool) -> float:
        """FLOPs of one micro-batch's forward and backward on ``layers`` (with the recomputed
        forward where the options recompute)."""
        key = (*layers, last)
        fl = self.flops.get(key)
        if fl is None:
            fwd, bwd = self.prof.fwd_flops(*layers), self.prof.bwd_flops(*layers)
            if self.options.recompute and not last:
                bwd += fwd
            fl = self.flops[key] = fwd + bwd
        return fl

    def _task_time(self, wid: str, layers: tuple[int, int], first: bool, last: bool, server: str,
                   nxt: str | None, prv: str | None) -> float:
        """``t_d``: the cost model's per-micro-batch time of ``wid`` with no server link shared."""
        net, dev, sync = self.scenario.network, self.dev, self.sync
        fl = self._flops(layers, last)
        dl_bytes = (self.tokens if first else self.hidden) + (self.tokens if last else self.hidden_grad)
        out_bytes = 0.0 if last else self.hidden
        in_grad_bytes = 0.0 if first else self.hidden_grad
        d = dev[wid]
        c = compute_time(fl, d.flops)
        fetch = upload = 0.0
        if wid != server:
            host = dev[server]
            link = net.link(d, host)
            fetch = (1 if last else 2) * 2 * link.latency + dl_bytes / min(link.bandwidth, d.down, host.up)
        if nxt is not None and wid != nxt and out_bytes > 0:
            hn = dev[nxt]
            upload += out_bytes / min(net.link(d, hn).bandwidth, d.up, hn.down)
        if prv is not None and wid != prv and in_grad_bytes > 0:
            hp = dev[prv]
            upload += in_grad_bytes / min(net.link(d, hp).bandwidth, d.up, hp.down)
        if sync.overlap_uploads or sync.prefetch:
            return task_period(c, fetch, upload, sync.overlap_uploads, sync.prefetch)
        return c + fetch + upload

    def _sync(self, st: StagePlan, wt: tuple, k_sync: int) -> float:
        """The cost model's per-step sync seconds of one stage (exact sync)."""
        key = (st.layers, st.server, wt, k_sync)
        got = self.syncs.get(key)
        if got is not None:
            return got
        ctx_key = (st.layers, st.server, k_sync)
        per = self.per_worker_sync.get(ctx_key)
        if per is None:
            prof, sync = self.prof, self.sync
            pbytes = prof.param_bytes(*st.layers)
            per = self.per_worker_sync[ctx_key] = {
                "": (pbytes * sync.ratio("push", prof.dtype_bytes, *prof.act_shape),
                     pbytes * sync.ratio("pull", prof.dtype_bytes, *prof.act_shape))}
        g_push, g_pull = per[""]
        max_lat = max_push = max_pull = 0.0
        if g_push > 0 or g_pull > 0:
            host = self.dev[st.server]
            h_up, h_down = host.up / k_sync, host.down / k_sync
            for wid in st.workers:
                if wid == host.id:
                    continue
                w = per.get(wid)
                if w is None:
                    d = self.dev[wid]
                    link = self.scenario.network.link(d, host)
                    w = per[wid] = (link.latency, g_push / min(link.bandwidth, d.up, h_down),
                                    g_pull / min(link.bandwidth, h_up, d.down))
                max_lat = max(max_lat, w[0])
                max_push = max(max_push, w[1])
                max_pull = max(max_pull, w[2])
        got = self.syncs[key] = stage_sync_time(max_lat, max_push, max_pull, self.sync.sync_every)
        return got

    def _best_links(self, wid: str) -> tuple[float, float, float]:
        """``(smallest latency, largest download rate, largest upload rate)`` of ``wid`` to any
        allowed server host, each taken on its own (0, inf, inf where it may host a server
        itself and so talk over loopback)."""
        got = self.best_links.get(wid)
        if got is None:
            d = self.dev[wid]
            if d.can_host_server:
                got = (0.0, math.inf, math.inf)
            else:
                links = [(h, self.scenario.network.link(d, h)) for h in self.scenario.server_hosts]
                got = (min((ln.latency for _, ln in links), default=0.0),
                       max((min(ln.bandwidth, d.down, h.up) for h, ln in links), default=math.inf),
                       max((min(ln.bandwidth, d.up, h.down) for h, ln in links), default=math.inf))
            self.best_links[wid] = got
        return got

    def any_servers(self, stages: list[StagePlan]) -> float:
        """A number <= ``self(plan, tie_break=False)`` for every plan with these layer ranges and
        workers, wherever its servers are: each worker's fetch, uploads and sync are priced on
        its best link to any server host (taken term by term), with no server link shared.
        ``construct`` uses it to skip placing the servers of worker sets that cannot matter."""
        prof, sync, n, m1 = self.prof, self.sync, len(stages), self.m - 1
        g_push_b = sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
        g_pull_b = sync.ratio("pull", prof.dtype_bytes, *prof.act_shape)
        xa_min, fill, sync_s = math.inf, 0.0, 0.0
        for i, st in enumerate(stages):
            first, last = i == 0, i == n - 1
            fl = self._flops(st.layers, last)
            dl_bytes = (self.tokens if first else self.hidden) + (self.tokens if last else self.hidden_grad)
            ul_bytes = (0.0 if last or n == 1 else self.hidden) + (0.0 if first else self.hidden_grad)
            pbytes = prof.param_bytes(*st.layers)
            times, avails = [], []
            max_lat = max_push = max_pull = 0.0
            for wid in st.workers:
                lat, down, up = self._best_links(wid)
                fetch = (1 if last else 2) * 2 * lat + dl_bytes / down
                upload = ul_bytes / up
                c = compute_time(fl, self.dev[wid].flops)
                if sync.overlap_uploads or sync.prefetch:
                    t = task_period(c, fetch, upload, sync.overlap_uploads, sync.prefetch)
                else:
                    t = c + fetch + upload
                if 0 < t < math.inf:
                    times.append(t)
                    avails.append(self.avail[wid] / t)
                max_lat = max(max_lat, lat)
                max_push = max(max_push, pbytes * g_push_b / up)
                max_pull = max(max_pull, pbytes * g_pull_b / down)
            if not times:
                return math.inf
            xa = sum(sorted(avails, reverse=True)[:self.m])
            xa_min = min(xa_min, xa)
            fill += min(times)
            sync_s = max(sync_s, stage_sync_time(max_lat, max_push, max_pull, sync.sync_every))
        pipe = (m1 / xa_min if xa_min > 0 else math.inf) + fill
        return step_time(pipe, sync_s, self.options.overlap_sync)

    def __call__(self, plan: Plan, tie_break: bool = True) -> float:
        """A number <= ``_objective(plan, ...)`` (0 where the bound does not apply); with
        ``tie_break=False``, <= the step time alone (``step_of``)."""
        if plan.sync.local or any(st.standbys for st in plan.stages):
            return 0.0
        n = len(plan.stages)
        n_sync: dict[str, int] = {}
        for st in plan.stages:
            h = st.server
            n_sync[h] = n_sync.get(h, 0) + len(st.workers) - (h in st.workers)  # loopback not counted
        xa_min, x_inv, fill, sync_s = math.inf, 0.0, 0.0, 0.0
        m1 = self.m - 1
        for i, st in enumerate(plan.stages):
            nxt = plan.stages[i + 1].server if i < n - 1 else None
            prv = plan.stages[i - 1].server if i > 0 else None
            wt = tuple(st.workers)
            xa, x, t_min = self._rates(st, wt, i == 0, i == n - 1, nxt, prv)
            if x <= 0:
                return math.inf  # a stage without a worker that can run: the cost model says inf
            xa_min = min(xa_min, xa)
            x_inv += m1 / x
            fill += t_min
            sync_s = max(sync_s, self._sync(st, wt, max(1, n_sync.get(st.server, 1))))
        pipe = (m1 / xa_min if xa_min > 0 else math.inf) + fill
        step = step_time(pipe, sync_s, self.options.overlap_sync)
        return step + TIE_BREAK * x_inv / n if tie_break else step


def local_search(plan: Plan, scenario: Scenario, options: CostOptions, budget_s: float, seed: int = 0,
                 max_rounds: int = 200, max_evals: int = 400, memo: dict | None = None,
                 bound: StepBound | None = None) -> Plan:
    """First-improvement local search on the full cost model until no move helps, ``max_evals``
    candidates were considered (deterministic budget) or ``budget_s`` passed (safety net). A
    candidate whose :class:`StepBound` is no better than the incumbent counts as considered but
    is not evaluated (it could not be accepted); ``bound`` may be shared across calls on one
    scenario and policy (built here when not given)."""
    prof = scenario_profile(scenario)
    dev = {d.id: d for d in scenario.devices}
    host_ids = [h.id for h in scenario.server_hosts]
    rng = random.Random(seed)
    best = _copy(plan)
    memo = {} if memo is None else memo
    best_t = _objective(best, scenario, options, memo)
    if bound is None and not plan.sync.local:
        bound = StepBound(scenario, plan.sync, options, plan.micro_batch_size)
    deadline = time.perf_counter() + budget_s
    evals = 0
    for _ in range(max_rounds):
        used = {w for st in best.stages for w in st.workers}
        unused = [d.id for d in scenario.workers if d.id not in used]
        improved = False
        for cand in _neighbours(best, scenario, rng, unused, dev, host_ids):
            if time.perf_counter() > deadline or evals >= max_evals:
                return best
            if not _feasible(cand, scenario, prof, dev):
                continue
            evals += 1
            if bound is not None and bound(cand) >= best_t:
                continue  # cannot be accepted (t >= bound >= best_t): counted, not evaluated
            t = _objective(cand, scenario, options, memo)
            if t < best_t * (1 - 1e-9):
                best, best_t, improved = cand, t, True
                break
        if not improved:
            break
    step_of(best, scenario, options, memo)
    return best


def stage_count_bound(scenario: Scenario, sync: SyncPolicy, prof: ModelProfile | None = None,
                      options: CostOptions | None = None):
    """A function ``S -> seconds`` below which no plan with ``S`` stages can step (the cost
    model's step time, churn-free or expected), used to skip stage counts that cannot matter.

    The cost model's step is at least its pipeline, ``(M - 1) / min_s X_s``, and a worker's
    ``tau_d`` is at least its lease round trips (to the nearest server host) plus its activation
    bytes over its own access links (a server link only slows a transfer further), combined as
    :func:`shoal.plan.cost.task_period` combines them; so ``X_s <= sum over W_s of r_d(pos)``
    with ``r_d = 1 / that`` for the stage's position (first, middle, last). Every worker is in
    one stage, so for weights ``w`` on the first and last stage and 1 on each middle one,
    ``X (2 w + S - 2) <= sum_d max(w r_d(first), w r_d(last), r_d(middle))``; compute alone gives
    ``X <= sum_d flops_d / (forward + backward FLOPs)``. The smallest of these bounds ``X``.
    A worker that may host a server could talk to itself over loopback: then only compute bounds.

    Exact sync adds a sync term (:func:`shoal.plan.cost.step_time` combines the two): some stage
    holds at least :func:`min_max_stage_bytes` of the parameters, and each of its workers pushes
    and pulls them at no more than the fastest worker's access link and the fastest server
    host's, so its sync is at least that with no latency. More stages shrink it while the
    pipeline bound grows, which is what lets ``shoal plan`` skip the many-stage counts of a
    slow-uplink scenario."""
    prof = prof or scenario_profile(scenario)
    options = options or CostOptions()
    workers = scenario.workers
    n_layers = len(prof.layers)
    m = scenario.workload.micro_batches
    x_compute = sum(d.flops for d in workers) / (prof.fwd_flops(0, n_layers) + prof.bwd_flops(0, n_layers))
    hosts = scenario.server_hosts
    if not workers or not hosts or any(d.can_host_server for d in workers):
        rates = None
    else:
        hidden = prof.layers[0].out_act_bytes * sync.ratio("act", prof.dtype_bytes, *prof.act_shape)
        hidden_grad = prof.layers[0].out_act_bytes * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)
        tokens = prof.tokens_per_micro_batch * 8
        down = np.array([d.down for d in workers])
        up = np.array([d.up for d in workers])
        lat = np.array([min(scenario.network.link(d, h).latency for h in hosts) for d in workers])

        def rate(dl_bytes: float, ul_bytes: float, n_tasks: int) -> np.ndarray:
            fetch = dl_bytes / down + n_tasks * 2 * lat
            upload = ul_bytes / up
            if sync.prefetch or sync.overlap_uploads:  # task_period with no compute: the larger one
                tau = np.maximum(fetch, upload)
            else:
                tau = fetch + upload
            with np.errstate(divide="ignore"):
                return np.where(tau > 0, 1.0 / tau, np.inf)

        rates = {"only": rate(2 * tokens, 0.0, 1), "first": rate(tokens + hidden_grad, hidden, 2),
                 "middle": rate(hidden + hidden_grad, hidden + hidden_grad, 2),
                 "last": rate(hidden + 2 * tokens, hidden_grad, 1)}

    sync_bound = None
    if rates is not None and not sync.local:
        push_bw = min(float(up.max()), max(h.down for h in hosts))
        pull_bw = min(float(down.max()), max(h.up for h in hosts))
        g_push = sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
        g_pull = sync.ratio("pull", prof.dtype_bytes, *prof.act_shape)

        floor = min_max_stage_bytes(prof)

        def sync_bound(n_stages: int) -> float:
            b = floor[n_stages] if n_stages < len(floor) else math.inf
            return stage_sync_time(0.0, b * g_push / push_bw, b * g_pull / pull_bw, sync.sync_every)

    def bound(n_stages: int) -> float:
        x = x_compute
        if rates is not None:
            if n_stages == 1:
                x = min(x, float(rates["only"].sum()))
            else:
                ends = np.maximum(rates["first"], rates["last"])
                for w in (0.25, 0.5, 1.0, 2.0):
                    if n_stages == 2:
                        x = min(x, float((w * ends).sum()) / (2 * w))
                    else:
                        x = min(x, float(np.maximum(w * ends, rates["middle"]).sum()) / (2 * w + n_stages - 2))
        if x <= 0:
            return math.inf
        pipe = (m - 1) / x
        if sync_bound is not None:
            return step_time(pipe, sync_bound(n_stages), options.overlap_sync) * (1 - 1e-9)
        return pipe * (1 - 1e-9)  # a hair below, against rounding

    return bound


def min_max_stage_bytes(prof: ModelProfile) -> list[float]:
    """``out[S]``: the smallest possible largest stage, in parameter bytes, over every split of
    the layers into ``S`` contiguous non-empty ranges, for ``S`` in ``1..n_layers`` (``out[0]``
    is inf); one DP over layer boundaries, each stage count built on the previous one."""
    n = len(prof.layers)
    cum = [0.0]
    for i in range(n):
        cum.append(cum[-1] + prof.param_bytes(i, i + 1))
    out = [math.inf]
    best = cum[:]  # best[b]: the smallest largest stage of the first S stages covering [0, b)
    out.append(best[n])
    for s in range(2, n + 1):
        best = [math.inf] * s + [min(max(best[a], cum[b] - cum[a]) for a in range(s - 1, b))
                                 for b in range(s, n + 1)]
        out.append(best[n])
    return out


def stage_count_hopeless(best_by_count: dict[int, float], lower_bound: float) -> bool:
    """Whether a stage count whose plans cost at least ``lower_bound`` can be skipped: when
    ``TOP_K + TOP_K_OTHER`` other stage counts already have a cheaper candidate, none of its
    candidates could be among those :func:`plan_shoal` refines (the ``TOP_K`` best overall and
    the best of ``TOP_K_OTHER`` further stage counts)."""
    return sum(1 for v in best_by_count.values() if v < lower_bound) >= TOP_K + TOP_K_OTHER


def irrelevant_above(best_by_count: dict[int, float], n_stages: int) -> float:
    """A step time above which a new candidate with ``n_stages`` stages cannot change what
    :func:`plan_shoal` does: the ``TOP_K + TOP_K_OTHER``-th smallest best candidate of the other
    stage counts (inf while there are fewer). Such a candidate has at least that many cheaper
    candidates of distinct other stage counts, so it is neither among the ``TOP_K`` best nor the
    best of a further stage count that gets refined; and every later :func:`stage_count_hopeless`
    test gives the same answer with or without it (if it were below a bound, those other stage
    counts already are)."""
    others = sorted(v for k, v in best_by_count.items() if k != n_stages)
    k = TOP_K + TOP_K_OTHER
    return others[k - 1] if len(others) >= k else math.inf


def stage_counts(n_layers: int, n_workers: int) -> list[int]:
    """Stage counts worth trying: every S up to ``min(n_layers, n_workers)``."""
    return list(range(1, min(n_layers, n_workers) + 1))


def plan_shoal(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
               options: CostOptions | None = None, budget_s: float | None = None, max_evals: int = 100) -> Plan:
    """shoal's allocator (see the module docstring); ``max_evals`` cost-model evaluations of local
    search per refined candidate."""
    sync = sync or SyncPolicy()
    options = options or CostOptions()
    prof = scenario_profile(scenario)
    n_layers = len(prof.layers)
    counts = [stages] if stages else stage_counts(n_layers, len(scenario.workers))
    candidates = []
    table = SyncTable(scenario)
    matrices = region_matrices(scenario)
    memo: dict = {}  # the cost model's per-stage figures, shared by every candidate of this scenario
    bound = stage_count_bound(scenario, sync, prof, options) if len(counts) > 1 else None
    step_bound = None if sync.local else StepBound(scenario, sync, options)
    best_by_count: dict[int, float] = {}
    for s in counts:
        if bound is not None and stage_count_hopeless(best_by_count, bound(s)):
            continue
        order = region_order(scenario, prof.param_bytes(0, n_layers) / s, matrices)
        for snap in (0.35, 0.0):
            p = construct(scenario, s, sync, options, snap, table, order, memo=memo, bound=step_bound,
                          threshold=irrelevant_above(best_by_count, s))
            if p is not None:
                t = step_of(p, scenario, options, memo)
                candidates.append((t, s, p))
                best_by_count[s] = min(t, best_by_count.get(s, math.inf))
    if not candidates:
        raise ShoalError(f"no feasible plan for scenario {scenario.name} with {stages or 'any number of'} stages; "
                         "the stages do not fit the devices' memory")
    candidates.sort(key=lambda c: c[0])
    if budget_s is None:
        budget_s = 5.0 + 0.01 * len(scenario.workers)  # safety net only; evaluations bound the search
    # Refine the TOP_K best candidates plus the best of TOP_K_OTHER further stage counts
    # (diverse starting points: local search is greedy and path-dependent).
    top = candidates[:TOP_K]
    seen_s = {c[1] for c in top}
    for c in candidates[TOP_K:]:
        if len(top) >= TOP_K + TOP_K_OTHER:
            break
        if c[1] not in seen_s:
            seen_s.add(c[1])
            top.append(c)
    best = None
    for i, (_, _, p) in enumerate(top):
        refined = local_search(p, scenario, options, budget_s / len(top), seed=seed + i, max_evals=max_evals,
                               memo=memo, bound=step_bound)
        if best is None or step_of(refined, scenario, options, memo) < step_of(best, scenario, options, memo):
            best = refined
    step_of(best, scenario, options, memo)
    return best


def micro_batch_candidates(scenario: Scenario) -> list[int]:
    """Micro-batch sizes worth trying: the workload's, halved and doubled up to 8x, dividing the
    global batch."""
    w = scenario.workload
    sizes = {w.micro_batch_size * f for f in (1, 2, 4, 8)} | {max(1, w.micro_batch_size // 2)}
    return sorted(b for b in sizes if w.global_batch % b == 0 and b <= w.global_batch)


def plan_shoal_tuned(scenario: Scenario, seed: int = 0, stages: int | None = None, sync: SyncPolicy | None = None,
                     options: CostOptions | None = None) -> Plan:
    """shoal's allocator with the micro-batch size as one more decision variable (DESIGN.md lists
    it): plan each candidate size and keep the fastest. Opt-in, because it changes the batch shape
    the workload asked for (the global batch, hence the training semantics, stays the same)."""
    best, best_t = None, math.inf
    for b in micro_batch_candidates(scenario):
        w = scenario.workload
        variant = dataclasses.replace(
            scenario, workload=type(w)(w.model, w.seq_len, w.global_batch, b, w.dtype_bytes, w.optimizer))
        try:
            p = plan_shoal(variant, seed=seed, stages=stages, sync=sync, options=options)
        except ShoalError:
            continue  # this size does not fit the memory
        t = step_of(p, scenario, options)
        if t < best_t:
            best, best_t = p, t
    if best is None:
        raise ShoalError(f"no feasible plan for scenario {scenario.name} at any micro-batch size")
    return best
