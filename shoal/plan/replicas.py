"""Pipeline replicas inside network clusters (local mode): shoal's planner for replica plans.

A replica plan runs several pipelines of the model at once. Each replica's stages, workers and
stage-server hosts lie inside one network cluster, so activations never cross a slow path
between clusters; replicas may split the layers differently (a 24 GB card holds the whole model,
8-12 GB cards need two or three stages). Every ``H`` steps each worker pushes its
pseudo-gradient to its own replica's server, the servers of the same layers merge theirs over
the server-to-server links (per layer, in the push codec's bytes), and the workers pull.

Batch semantics: a step is still the workload's global batch of ``M`` micro-batches for the
whole swarm. Replica ``r`` runs ``M_r`` of them, ``M_r`` in proportion to its pipeline's rate
(:func:`split_micro_batches`), so the replicas finish a step together; between merges each
worker trains its own copy as in local mode, and a merge averages all workers of all replicas.

Construction (:func:`plan_replicas`): cluster the regions (:func:`network_clusters`); inside
each cluster group the workers by the fewest stages they can hold (:func:`stages_needed`); plan
each group as a pipeline of that many stages with shoal's allocator on the group's own devices
and the cluster's hosts; split ``M`` by the replicas' rates and price the whole plan with
:func:`shoal.plan.cost.predict`; drop the replicas of a depth whose outer-merge cost outweighs
their compute (:func:`drop_depths`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, replace

import numpy as np

from shoal.errors import ShoalError
from shoal.model.profile import ModelProfile
from shoal.plan.cluster import average_linkage
from shoal.plan.common import even_layer_split
from shoal.plan.cost import (
    CostOptions,
    _landing_times,
    _pipeline_terms,
    flush_time,
    list_schedule_curve,
    predict,
    replica_plan,
    scenario_profile,
    server_cpu_caps,
    servers_memory,
    stage_costs,
    stage_server_memory,
    stage_worker_memory,
)
from shoal.plan.report import MemoryWhatIf, SwarmReport, host_memory_idle, swarm_report
from shoal.plan.types import Device, Plan, Replica, Scenario, SyncPolicy

MAX_REPLICA_STAGES = 4  # deepest replica the planner builds (gpt-1.3b: 8 GB cards need 3)
REPLICA_EVALS = 40  # cost-model evaluations of local search per replica (the groups are small)
# A single-stage replica's predicted end (shoal.plan.cost.list_schedule_end) is within 1 % of the
# simulated one; a multi-stage replica's is mostly long (its pinned-backward terms, 1.0-1.5x) but
# up to 7 % short (gaming-eu's 2-stage replica of 176 micro-batches: 0.93x), and varies from step
# to step with the round's chunks. The step is the latest replica's end, so the split plans every
# multi-stage replica to end this share before it (rebalance).
DEEP_END_MARGIN = 0.05
# The replicas of a depth stay only if the plan without them is predicted this share slower:
# a multi-stage replica's end is the model's least certain figure (above), so one that adds
# less than that is as likely to end the step late as to shorten it (scale-1024: one 2-stage
# replica beside 31 single-stage ones added 0.05 % predicted and cost 5.8 % simulated).
DEPTH_GAIN_MIN = 0.01


@dataclass(frozen=True)
class Cluster:
    """A set of regions close to each other that holds at least one stage-server host."""

    name: str  # its regions joined by "+"
    regions: tuple[str, ...]  # the regions in it
    hosts: tuple[str, ...]  # ids of the server hosts in it


def region_distances(scenario: Scenario, ref_bytes: float) -> tuple[list[str], np.ndarray]:
    """Every region of the scenario (workers' and hosts') and the distance ``latency + ref_bytes /
    bandwidth`` between each pair (0 on the diagonal)."""
    rep: dict[str, Device] = {}
    for d in scenario.devices:
        rep.setdefault(d.region, d)
    regions = sorted(rep)
    n = len(regions)
    dist = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            link = scenario.network.link(rep[regions[i]], rep[regions[j]])
            dist[i, j] = dist[j, i] = link.latency + ref_bytes / link.bandwidth
    return regions, dist


def cut_clusters(z: list[tuple[int, int, float, int]], n: int, has_host: list[bool],
                 viable: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """The finest cut of an average-linkage tree (``z``, ``n`` points) in which every cluster holds
    a point with ``has_host`` (and, if given, is ``viable``): from the root, a cluster splits into
    its two children when both qualify. Returns the clusters as sorted lists of point ids."""
    if n == 1:
        return [[0]]
    children = {n + i: (a, b) for i, (a, b, _, _) in enumerate(z)}

    def leaves(node: int) -> list[int]:
        out, todo = [], [node]
        while todo:
            x = todo.pop()
            if x < n:
                out.append(x)
            else:
                todo.extend(children[x])
        return sorted(out)

    def hosted(node: int) -> bool:
        pts = leaves(node)
        return any(has_host[i] for i in pts) and (viable is None or viable(pts))

    out = []
    todo = [n + len(z) - 1]
    while todo:
        node = todo.pop()
        if node >= n and all(hosted(c) for c in children[node]):
            todo.extend(children[node])
        else:
            out.append(leaves(node))
    return sorted(out)


def network_clusters(scenario: Scenario, ref_bytes: float = 0.0, prof: ModelProfile | None = None,
                     sync: SyncPolicy | None = None) -> list[Cluster]:
    """Clusters of regions for replicas: average-linkage clustering of the regions on
    ``latency + ref_bytes / bandwidth`` (:mod:`shoal.plan.cluster`), cut as finely as possible
    while every cluster keeps a server host and, given ``prof`` and ``sync``, devices enough to
    form one replica (some ``k`` with at least ``k`` devices that hold ``k`` stages)
    (:func:`cut_clusters`)."""
    hosts = scenario.server_hosts
    if not hosts:
        raise ShoalError(f"scenario {scenario.name} has no device that may host a stage server (can_host_server)")
    regions, dist = region_distances(scenario, ref_bytes)
    hosted = [any(h.region == r for h in hosts) for r in regions]
    viable = None
    if prof is not None and sync is not None:
        need = {}
        for d in scenario.workers:
            need.setdefault(d.region, []).append(stages_needed(prof, d, sync))

        def viable(pts: list[int]) -> bool:
            ks = [k for i in pts for k in need.get(regions[i], []) if k]
            return any(sum(1 for x in ks if x <= k) >= k for k in set(ks))

    groups = cut_clusters(average_linkage(dist), len(regions), hosted, viable)
    out = []
    for g in groups:
        rs = tuple(regions[i] for i in g)
        out.append(Cluster("+".join(rs), rs, tuple(h.id for h in hosts if h.region in rs)))
    return out


def stages_needed(prof: ModelProfile, device: Device, sync: SyncPolicy, max_stages: int = MAX_REPLICA_STAGES) -> int:
    """The fewest stages of an even layer split whose every stage ``device`` can hold (0: none up
    to ``max_stages``)."""
    n = len(prof.layers)
    for k in range(1, min(max_stages, n) + 1):
        if all(device.memory >= stage_worker_memory(prof, a, b, sync) for a, b in even_layer_split(n, k)):
            return k
    return 0


def split_micro_batches(rates: list[float], total: int) -> list[int]:
    """``total`` micro-batches split in proportion to ``rates`` (largest remainders), at least 1
    each; raises if there are more replicas than micro-batches."""
    n = len(rates)
    if n > total:
        raise ShoalError(f"{n} replicas cannot share {total} micro-batches; use fewer replicas or a larger batch")
    s = sum(max(0.0, r) for r in rates)
    want = [max(0.0, r) / s * total if s > 0 else total / n for r in rates]
    out = [max(1, math.floor(w)) for w in want]
    while sum(out) > total:  # the floors of 1 overshot: take from the largest
        i = max(range(n), key=lambda j: out[j] - want[j] if out[j] > 1 else -math.inf)
        out[i] -= 1
    order = sorted(range(n), key=lambda j: out[j] - want[j])
    k = 0
    while sum(out) < total:
        out[order[k % n]] += 1
        k += 1
    return out


def device_groups(scenario: Scenario, clusters: list[Cluster], prof: ModelProfile,
                  sync: SyncPolicy) -> list[tuple[Cluster, int, list[Device]]]:
    """Per cluster, its workers grouped by the fewest stages they can hold; a group with fewer
    devices than stages joins the next deeper group of its cluster (its devices hold those
    smaller stages too). Devices that hold no split up to MAX_REPLICA_STAGES are left out."""
    out = []
    for c in clusters:
        by_k: dict[int, list[Device]] = {}
        for d in scenario.workers:
            if d.region in c.regions:
                k = stages_needed(prof, d, sync)
                if k:
                    by_k.setdefault(k, []).append(d)
        ks = sorted(by_k)
        carry: list[Device] = []
        for i, k in enumerate(ks):
            devs = by_k[k] + carry
            carry = []
            if len(devs) >= k:
                out.append((c, k, devs))
            elif i + 1 < len(ks):
                carry = devs  # too few for k stages: they hold the deeper group's stages too
            elif out and out[-1][0] is c:
                out[-1][2].extend(devs)  # the deepest group is too small: join the previous one
    return out


SPEED_CLASS = 0.1  # devices within this share of a class's fastest FLOP/s form one single-stage replica
SPEED_CLASS_MIN = 4  # a smaller class joins the next slower one (a replica is a server and a merge member more)


def speed_classes(devices: list[Device], tol: float = SPEED_CLASS, least: int = SPEED_CLASS_MIN) -> list[list[Device]]:
    """``devices`` split into classes of like speed, fastest first: a class starts at its fastest
    device and holds every next one with at least ``1 - tol`` of its FLOP/s; a class of fewer
    than ``least`` devices joins the next slower one (the slowest, the one before it).

    A single-stage replica's task pool goes to whichever worker is free, so in a pool of RTX
    4090s (0.148 s a micro-batch on scale-1024) and 3090s (0.323 s) a 3090 free at 1.615 s takes a
    sixth task before a 4090 its twelfth and the step jumps to 1.94 s
    (:func:`shoal.plan.cost.list_schedule_end`); as two replicas, each gets its own share of the
    step (``rebalance``) and the 4090s run twelve while the 3090s stop at five."""
    out: list[list[Device]] = []
    for d in sorted(devices, key=lambda d: (-d.flops, d.id)):
        if out and (d.flops >= (1 - tol) * out[-1][0].flops or len(out[-1]) < least):
            out[-1].append(d)
        else:
            out.append([d])
    if len(out) > 1 and len(out[-1]) < least:
        out[-2].extend(out.pop())
    return out


def replica_capacity(hosts: list[Device], whole: float) -> int:
    """How many replicas' stage servers ``hosts`` hold, each replica's servers needing ``whole``
    bytes (the whole model, whatever its depth) on one host: at least 1."""
    return max(1, sum(int(h.host_memory // whole) for h in hosts)) if whole > 0 else len(hosts) or 1


def fitted_classes(classes: list[list[Device]], most: int) -> list[list[Device]]:
    """Speed ``classes`` (fastest first) cut to at most ``most``: the slower classes beyond
    join the slowest one kept (their devices then share its replica's pool and server)."""
    if most <= 0 or len(classes) <= most:
        return classes
    kept = [list(c) for c in classes[:most]]
    for extra in classes[most:]:
        kept[-1].extend(extra)
    return kept


def _sub_scenario(scenario: Scenario, devices: list[Device], hosts: tuple[str, ...], micro_batches: int,
                  micro_batch_size: int, host_left: dict[str, float] | None = None) -> Scenario:
    """``scenario`` restricted to ``devices`` and the server hosts ``hosts``, with a batch of
    ``micro_batches`` micro-batches (one replica's share); ``host_left``: each host's memory
    that earlier replicas' stage servers left (default: all of it)."""
    keep = {d.id for d in devices} | set(hosts)
    w = scenario.workload
    left = host_left or {}
    return replace(scenario, devices=[replace(d, host_memory=left[d.id]) if d.id in left else d
                                      for d in scenario.devices if d.id in keep],
                   workload=replace(w, global_batch=micro_batches * micro_batch_size))


def equal_finish_split(pipes: list[float], rates: list[float], current: list[int], total: int) -> list[int]:
    """Micro-batches per replica so that the replicas' pipelines end together: replica ``r`` with
    ``current[r]`` micro-batches takes ``pipes[r]`` seconds and ``1 / rates[r]`` per further one,
    so at a common end ``T`` it runs ``current[r] + (T - pipes[r]) rates[r]``; ``T`` is chosen so
    they sum to ``total``. A replica that would run less than one micro-batch gets 0 (its fill
    and drain alone outlast the others' step: no benefit). Integers by largest remainders."""
    live = [i for i in range(len(pipes)) if rates[i] > 0 and math.isfinite(pipes[i])]
    while live:
        x = sum(rates[i] for i in live)
        t = (total - sum(current[i] - pipes[i] * rates[i] for i in live)) / x
        want = {i: current[i] + (t - pipes[i]) * rates[i] for i in live}
        short = [i for i in live if want[i] < 1]
        if not short:
            break
        live.remove(min(short, key=lambda i: want[i]))
    out = [0] * len(pipes)
    if not live:
        return out
    ints = split_micro_batches([want[i] for i in live], total)
    for i, m in zip(live, ints, strict=True):
        out[i] = m
    return out


def min_max_split(curves: list[list[float]], total: int) -> list[int] | None:
    """Micro-batches per replica that minimise the latest replica's end: ``curves[r][m - 1]`` is
    replica ``r``'s pipeline with ``m`` micro-batches (``m = 1 .. len``, nondecreasing; 0
    micro-batches end at 0 and drop the replica). The smallest end ``T`` at which the replicas
    can take ``total`` between them (each ``r`` takes ``cap_r(T)``, its most micro-batches ending
    by ``T``), then the surplus comes off the replicas that end latest, one at a time. ``None``
    if the curves cannot take ``total`` at all.

    Unlike :func:`equal_finish_split` (a line through each replica's current point) this follows
    the steps of a curve: a single-stage replica's end stays put while its slow workers have no
    further task to take, then jumps by one of their tasks (:func:`shoal.plan.cost.list_schedule_end`)."""
    if total <= 0:
        return [0] * len(curves)
    if sum(len(c) for c in curves) < total:
        return None
    ends = sorted({x for c in curves for x in c})

    def caps(t: float) -> list[int]:
        out = []
        for c in curves:  # nondecreasing: count the values <= t
            lo, hi = 0, len(c)
            while lo < hi:
                mid = (lo + hi) // 2
                if c[mid] <= t:
                    lo = mid + 1
                else:
                    hi = mid
            out.append(lo)
        return out

    lo, hi = 0, len(ends) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(caps(ends[mid])) >= total:
            hi = mid
        else:
            lo = mid + 1
    got = caps(ends[lo])
    for _ in range(sum(got) - total):
        r = max((i for i in range(len(got)) if got[i] > 0), key=lambda i: (curves[i][got[i] - 1], -i))
        got[r] -= 1
    return got


def pipeline_curves(plan: Plan, scenario: Scenario, options: CostOptions | None, most: list[int]) -> list[list[float]]:
    """Per replica of ``plan``, its predicted pipeline with ``m = 1 .. most[r]`` micro-batches (made
    nondecreasing), from its stage costs at its current share: a single-stage replica's greedy
    schedule (:func:`shoal.plan.cost.list_schedule_curve`) plus the server's handling of the last
    result and the flush, as :func:`shoal.plan.cost._pipeline_terms` prices it, which a deeper
    (or CPU-capped) one takes at each ``m``."""
    out = []
    for r, cap, hi in zip(plan.replicas, server_cpu_caps(plan, scenario), most, strict=True):
        costs = stage_costs(replica_plan(plan, r), scenario, options, None, cap)
        c = costs[0]
        if len(costs) == 1 and c.uncapped <= c.throughput * (1 + 1e-9):
            # _pipeline_terms' one-stage end at every m at once (a CPU-capped pool takes the general path)
            tail = c.task_handling + flush_time(costs)
            curve = [e + tail for e in list_schedule_curve(list(c.task_times.values()), _landing_times(c), hi)]
        else:
            curve = [_pipeline_terms(costs, m, True)[0] for m in range(1, hi + 1)]
        for i in range(1, len(curve)):
            curve[i] = max(curve[i], curve[i - 1])
        out.append(curve)
    return out


def rebalance(plan: Plan, scenario: Scenario, options: CostOptions | None = None, rounds: int = 3,
              margin: float = DEEP_END_MARGIN) -> Plan:
    """Re-split the step's micro-batches so the replicas' pipelines end together: first
    :func:`equal_finish_split` on each replica's predicted pipeline and rate, ``rounds`` times,
    keeping the split with the shortest predicted step; then, from the stage costs at that split,
    :func:`min_max_split` along the replicas' pipeline curves (:func:`pipeline_curves`, up to
    twice each replica's share), a multi-stage replica's curve taken ``1 + margin`` times
    (``DEEP_END_MARGIN``), kept unless its whole predicted step is more than ``1 + margin`` times
    the first split's. Replicas left with no micro-batch are dropped (their devices stay idle)."""
    reps = list(plan.replicas)
    best = [r.micro_batches for r in reps]
    best_t = predict(plan, scenario, options)["step_time_s"]
    current = list(best)
    for _ in range(rounds):
        pipes, rates = [], []
        for r, m in zip(reps, current, strict=True):
            if m <= 0:
                pipes.append(math.inf)
                rates.append(0.0)
                continue
            r.micro_batches = m
            sub = replica_plan(plan, r)
            costs = stage_costs(sub, scenario, options)
            pipes.append(predict(sub, scenario, options)["pipeline_s"])
            rates.append(min(c.throughput for c in costs))
        split = equal_finish_split(pipes, rates, current, plan.micro_batches)
        if split == current or not any(split):
            break
        current = split
        _set_split(plan, reps, current)
        t = predict(plan, scenario, options)["step_time_s"]
        if t < best_t:
            best, best_t = list(current), t
    _set_split(plan, reps, best)
    total = plan.micro_batches
    live = [r for r, m in zip(reps, best, strict=True) if m > 0]
    curves = pipeline_curves(plan, scenario, options, [min(total, 2 * r.micro_batches + 8) for r in live])
    curves = [c if len(r.stages) == 1 else [x * (1 + margin) for x in c] for r, c in zip(live, curves, strict=True)]
    split = min_max_split(curves, total)
    if split is not None and any(split):
        trial = [0] * len(reps)
        for r, m in zip(live, split, strict=True):
            trial[reps.index(r)] = m
        _set_split(plan, reps, trial)
        # curves come from the costs at the first split: a split far from it is checked whole
        if predict(plan, scenario, options)["step_time_s"] <= best_t * (1 + margin):
            best = trial
    _set_split(plan, reps, best)
    predict(plan, scenario, options)
    return plan


def _set_split(plan: Plan, reps: list[Replica], split: list[int]) -> None:
    """Give ``reps`` the micro-batches ``split``; the plan keeps those with at least one."""
    for r, m in zip(reps, split, strict=True):
        r.micro_batches = m
    plan.replicas = [r for r in reps if r.micro_batches > 0]
    plan.stages = plan.replicas[0].stages


def plan_replicas(scenario: Scenario, seed: int = 0, sync: SyncPolicy | None = None,
                  options: CostOptions | None = None, max_evals: int = REPLICA_EVALS) -> Plan:
    """shoal's replica plan for ``scenario`` under local-mode policy ``sync`` (see the module
    docstring); the plan is priced (``plan.predicted``) but not validated."""
    sync = sync or SyncPolicy(mode="local", sync_every=32)
    if not sync.local:
        raise ShoalError("pipeline replicas need local sync (--sync local or --sync auto)")
    prof = scenario_profile(scenario)
    n = len(prof.layers)
    push_bytes = prof.param_bytes(0, n) * sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
    clusters = network_clusters(scenario, push_bytes, prof, sync)
    groups = device_groups(scenario, clusters, prof, sync)
    judge = dataclasses.replace(options or CostOptions(), coordinator=True)  # plans compared with every member served

    def faster(a: Plan | None, b: Plan) -> bool:
        return a is not None and predict(a, scenario, judge)["tokens_per_s"] > predict(b, scenario, judge)["tokens_per_s"]

    # Single-stage groups are split into speed classes. Where the cluster's hosts hold fewer
    # replicas' servers than there are classes, the classes beyond find no host memory and
    # stay idle; cut to what the hosts hold (fitted_classes), their devices work in the
    # slowest replica kept, but may slow it more than they add. Both are planned where they
    # differ; the faster plan stays.
    whole = stage_server_memory(prof, 0, n, sync)
    hosts = {d.id: d for d in scenario.server_hosts}
    split = [(c, k, speed_classes(devs) if k == 1 else [devs]) for c, k, devs in groups]
    apart = [(c, k, sub) for c, k, subs in split for sub in subs]
    fitted = [(c, k, sub) for c, k, subs in split
              for sub in (fitted_classes(subs, replica_capacity([hosts[h] for h in c.hosts], whole))
                          if k == 1 else subs)]
    best = trim_for_rounds(_plan_groups(scenario, apart, seed, sync, options, max_evals, faster), scenario, options)
    if len(fitted) < len(apart):
        try:
            other = trim_for_rounds(_plan_groups(scenario, fitted, seed, sync, options, max_evals, faster),
                                    scenario, options)
        except ShoalError:
            other = None
        if faster(other, best):
            best = other
            predict(best, scenario, options)
    return best


def memory_what_if(plan: Plan, scenario: Scenario, seed: int = 0,
                   options: CostOptions | None = None) -> MemoryWhatIf | None:
    """The replica plan the planner makes for ``scenario`` under ``plan``'s sync policy when
    every server host has the memory for a replica's servers per worker (so none is left out
    for host memory), as the devices it uses and its predicted tokens/s; None for a plan
    without replicas.

    A device that no host has the server memory for is not therefore idle *for* memory: a
    replica of 8 GB cards in three stages may slow the plan it joins (each replica adds
    servers to every merge, and its micro-batches cross two home uplinks), and the planner
    drops it when it has that memory (gaming-world, scale-1024: the same tokens/s with twice
    the host memory). :func:`shoal.plan.report.swarm_report` takes the result to tell the two apart.
    None also where no plan is made with that memory."""
    if not plan.replicas:
        return None
    prof = scenario_profile(scenario)
    whole = stage_server_memory(prof, 0, len(prof.layers), plan.sync)
    ample = max((d.host_memory for d in scenario.server_hosts), default=0.0) + whole * len(scenario.workers)
    roomy = replace(scenario, devices=[replace(d, host_memory=ample) if d.can_host_server else d
                                       for d in scenario.devices])
    from shoal.plan.api import make_plan  # (api imports this module)

    try:
        other = make_plan(roomy, seed=seed, sync=plan.sync, options=options, replicas=True)
    except ShoalError:  # (no plan there: the report keeps its memory reasons as they are)
        return None
    tps = other.predicted["tokens_per_s"]
    return MemoryWhatIf(used=frozenset(w for st in other.all_stages for w in st.workers), tokens_per_s=tps,
                        host_memory=ample)


def judged_report(plan: Plan, scenario: Scenario, step_s: float | None = None, busy_share: float | None = None,
                  seed: int = 0, what_if: MemoryWhatIf | None = None) -> tuple[SwarmReport, MemoryWhatIf | None]:
    """:func:`shoal.plan.report.swarm_report` of ``plan``, with devices idle for lack of server-host
    memory put to the test of :func:`memory_what_if` (planned once, only when there are such
    devices; pass the returned what-if back to judge another step time of the same plan)."""
    rep = swarm_report(plan, scenario, step_s, busy_share, what_if)
    if what_if is None and host_memory_idle(rep):
        what_if = memory_what_if(plan, scenario, seed)
        if what_if is not None:
            rep = swarm_report(plan, scenario, step_s, busy_share, what_if)
    return rep, what_if


def _plan_groups(scenario: Scenario, groups: list[tuple[Cluster, int, list[Device]]], seed: int, sync: SyncPolicy,
                 options: CostOptions | None, max_evals: int, faster: Callable[[Plan | None, Plan], bool]) -> Plan:
    """The replica plan of ``groups`` (cluster, stage count, devices): each placed in what the
    groups before it left of their hosts' memory, balanced, and its depths dropped where
    that is faster (:func:`plan_replicas`)."""
    from shoal.plan.allocator import plan_shoal  # the allocator plans each replica

    prof = scenario_profile(scenario)
    if not groups:
        raise ShoalError(f"no device of scenario {scenario.name} holds the model in {MAX_REPLICA_STAGES} stages or fewer")
    w = scenario.workload
    m_total = w.micro_batches
    if len(groups) > m_total:
        groups = sorted(groups, key=lambda g: -sum(d.flops for d in g[2]))[:m_total]

    def place(shares: list[int]) -> tuple[Plan, list[int]]:
        """Each group's replica placed for its share of the micro-batches, then balanced; and
        the group each replica came from."""
        replicas, made = [], []
        # Stage servers of several replicas share their cluster's hosts: each replica is planned
        # in what the earlier ones left of that memory, and one whose servers no longer fit is
        # left out. Every replica's servers hold the whole model whatever its depth, so the
        # shallowest groups go first (no activation crosses a link there), the largest first
        # among them.
        left = {d.id: d.host_memory for d in scenario.devices if d.can_host_server}
        order = sorted(range(len(groups)), key=lambda g: (groups[g][1], -sum(d.flops for d in groups[g][2])))
        for g in order:
            (c, k, devs), m_r = groups[g], shares[g]
            if m_r <= 0:
                continue
            sub = _sub_scenario(scenario, devs, c.hosts, m_r, w.micro_batch_size, left)
            try:
                p = plan_shoal(sub, seed=seed, stages=min(k, len(devs)), sync=sync, options=options,
                               max_evals=max_evals)
            except ShoalError:
                continue
            need = servers_memory(p.stages, prof, p.sync)
            if any(left.get(h, 0.0) < n for h, n in need.items()):
                continue
            for h, n in need.items():
                left[h] -= n
            replicas.append(Replica(stages=p.stages, micro_batches=m_r, cluster=c.name))
            made.append(g)
        if not replicas:
            raise ShoalError(f"no replica of scenario {scenario.name} could be planned")
        split = split_micro_batches([r.micro_batches for r in replicas], m_total)
        for r, m_r in zip(replicas, split, strict=True):
            r.micro_batches = m_r
        plan = Plan(scenario=scenario.name, model=w.model, method="shoal", stages=replicas[0].stages,
                    micro_batch_size=w.micro_batch_size, micro_batches=m_total, sync=sync, replicas=replicas)
        group = {id(r): g for r, g in zip(replicas, made, strict=True)}
        _balance(plan, scenario, options)  # (may drop replicas)
        return plan, [group.get(id(r), -1) for r in plan.replicas]

    plan, made = place(split_micro_batches([sum(d.flops for d in g[2]) for g in groups], m_total))
    # A replica placed for its FLOP share of the micro-batches may run more or fewer after
    # balancing (links slow some groups). With a round's fixed costs (the merge, the screen's
    # reference gradient), one placed for too few looks too fast to hide them behind its
    # steps and keeps fewer workers. Placed once more for the balanced shares; the better plan stays.
    shares = [0] * len(groups)
    for g, r in zip(made, plan.replicas, strict=True):
        if g >= 0:
            shares[g] = r.micro_batches
    # Each placement is judged once its unprofitable depths are dropped: with host memory to
    # spare, 3-stage replicas of 8 GB cards are placed in both and slow both, and judged with
    # them a placement can win that is the slower without them (gaming-world with 192 GB server
    # hosts: 103 k tokens/s against 121 k).
    best = drop_depths(plan, scenario, options)
    if any(x > 0 for x in shares):
        try:
            placed = place(shares)[0]
            again = drop_depths(placed, scenario, options)
        except ShoalError:
            again = None
        if faster(again, best):
            plan, best = placed, again
    # The replicas of a dropped depth held host memory and shares of the micro-batches that the
    # others could not have: planned once more without those groups (placed for their FLOP
    # shares, then for their balanced ones), the memory and the shares go to replicas that stay.
    # Without this, more host memory could make a slower plan (scale-1024 with 192 GB hosts:
    # 1.00 M tokens/s against 1.07 M with 128 GB, whose hosts never held the deep replicas).
    gone = {len(r.stages) for r in plan.replicas} - {len(r.stages) for r in best.replicas}
    keep = [groups[g] for g in range(len(groups)) if groups[g][1] not in gone]
    if gone and keep:
        try:
            third = _plan_groups(scenario, keep, seed, sync, options, max_evals, faster)
        except ShoalError:
            third = None
        if faster(third, best):
            best = third
        predict(best, scenario, options)
    return best


def _balance(plan: Plan, scenario: Scenario, options: CostOptions | None) -> None:
    """Rebalance the replicas' micro-batches, drop their slow workers, and rebalance again if
    any was dropped."""
    rebalance(plan, scenario, options)
    if prune_slow(plan, scenario, options):
        rebalance(plan, scenario, options)


def drop_depths(plan: Plan, scenario: Scenario, options: CostOptions | None = None,
                gain_min: float = DEPTH_GAIN_MIN) -> Plan:
    """``plan`` without the replicas of a stage count whose removal raises the predicted
    tokens/s or (two stages or more) lowers it by less than ``gain_min`` of it (default
    :data:`DEPTH_GAIN_MIN`), deepest first (the others take their micro-batches).

    Every replica adds its stage servers to the outer merge, which is one barrier over all of
    them, and the deep replicas of small cards run few micro-batches on many servers: on
    scale-1024 with ``tern`` activations, 3-stage replicas made the merge 8.2 s instead of 2.6 s
    and the rounds no longer hid behind the steps (15 % of the FLOP limit with them, 39 %
    without). Rebalancing alone cannot see that, since it only moves micro-batches. Plans are
    compared with the coordinator's CPU floor counted even when ``options`` leave it out (the
    search's options do): every replica's servers and workers are members it serves."""
    judge = dataclasses.replace(options or CostOptions(), coordinator=True)

    def tps(p: Plan) -> float:
        return predict(p, scenario, judge)["tokens_per_s"]

    best, best_tps = plan, tps(plan)
    for k in sorted({len(r.stages) for r in plan.replicas}, reverse=True):
        keep = [r for r in best.replicas if len(r.stages) != k]
        if not keep or len(keep) == len(best.replicas):
            continue
        trial = deepcopy(best)
        trial.replicas = [r for r in trial.replicas if len(r.stages) != k]
        for r, m_r in zip(trial.replicas, split_micro_batches([r.micro_batches for r in trial.replicas],
                                                               trial.micro_batches), strict=True):
            r.micro_batches = m_r
        trial.stages = trial.replicas[0].stages
        _balance(trial, scenario, options)
        t = tps(trial)
        if t > best_tps * (1 - (gain_min if k > 1 else 0.0)):  # (single-stage replicas: the surest)
            best, best_tps = trial, t
    predict(best, scenario, options)
    return best


TRIM_ROUNDS = 200  # at most this many workers trimmed from each replica (trim_for_rounds)


def trim_for_rounds(plan: Plan, scenario: Scenario, options: CostOptions | None = None,
                    most: int = TRIM_ROUNDS) -> Plan:
    """``plan`` with fewer workers where its rounds do not hide behind its steps: while the
    round is exposed (``sync_s > 0``), each single-stage replica of more than one worker drops
    its slowest, the micro-batches are rebalanced, and the trial stays if the plan is faster.

    Each worker pushes and pulls its stage at every round through its replica's server host,
    and every replica's server exchanges parts with its peers over the same links. The
    allocator places a replica's workers against that replica alone, so it keeps workers whose
    compute the whole plan's round then waits for: on scale-4096 a round took 109 s for 32
    steps of 2.3 s. Trimmed, fewer workers make a shorter round and a faster plan (compared as
    :func:`drop_depths` compares, the coordinator's CPU counted)."""
    judge = dataclasses.replace(options or CostOptions(), coordinator=True)

    def tps(p: Plan) -> float:
        return predict(p, scenario, judge)["tokens_per_s"]

    best, best_tps = plan, tps(plan)
    for _ in range(most):
        if predict(best, scenario, options)["sync_s"] <= 0:
            break
        trial = deepcopy(best)
        trimmed = False
        for r in trial.replicas:
            st = r.stages[0]
            if len(r.stages) != 1 or len(st.workers) <= 1:
                continue
            times = stage_costs(replica_plan(trial, r), scenario, options)[0].task_times
            slow = max(st.workers, key=lambda w: (times[w], w))
            st.workers = [w for w in st.workers if w != slow]
            trimmed = True
        if not trimmed:
            break
        rebalance(trial, scenario, options)
        t = tps(trial)
        if t <= best_tps:
            break
        best, best_tps = trial, t
    predict(best, scenario, options)
    return best


SLOW_SHARE = 0.5  # a worker whose micro-batch takes more than this share of its replica's step is dropped


def prune_slow(plan: Plan, scenario: Scenario, options: CostOptions | None = None, share: float = SLOW_SHARE) -> bool:
    """Drop from each replica's stages the workers whose one micro-batch takes longer than
    ``share`` of the replica's pipeline (keeping at least one per stage and at most the replica's
    micro-batches per stage, fastest first). With a few micro-batches per worker, such a worker's
    last task ends the step late: every worker leases a task when the step starts, and a
    backward task waits for the worker that ran its forward. Returns whether any was dropped."""
    dropped = False
    for r in plan.replicas:
        sub = replica_plan(plan, r)
        pipe = predict(sub, scenario, options)["pipeline_s"]
        for st, c in zip(r.stages, stage_costs(sub, scenario, options), strict=True):
            order = sorted(st.workers, key=lambda w: c.task_times[w])
            keep = [w for w in order if c.task_times[w] <= share * pipe] or order[:1]
            keep = keep[:max(1, r.micro_batches)]
            if len(keep) < len(st.workers):
                st.workers = [w for w in st.workers if w in keep]
                dropped = True
    return dropped
