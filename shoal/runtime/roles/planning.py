"""The scenario the coordinator plans and repairs on, one device per member.

Planner devices are keyed by *member id* (a worker that is killed and rejoins is a new
member: the repair sees one device leave and another join). What a member's device
looks like depends on the run:

* plain run: the device each member measured and reported (:class:`MemberFigures`,
  :func:`measured_scenario`: regions by latency clustering, links from probes, declared
  figures winning); a member that reports nothing is a loopback device with the FLOP/s
  it joined with (:func:`loopback_device`);
* emulated run (the processes play devices of a scenario, see ``shoal.emulate``): a copy
  of the scenario device the member plays, in the scenario as the processes experience
  it (``shoal.emulate.pacing.emulated_scenario``: FLOP/s and links scaled), so the
  planner and the repair see the links the run really has (:func:`played_device`,
  :func:`member_network`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from shoal.plan.types import Device, Link, Network, Scenario, Workload

LOOPBACK_REGION = "local"  # region of every member of a plain run
LOOPBACK_LINK = Link(latency=1e-4, bandwidth=1e9)  # 127.0.0.1 as the planner sees it


def loopback_device(member_id: str, role: str, flops: float) -> Device:
    """A member of a plain run: loopback links, the measured FLOP/s (0 for a server)."""
    if role == "server":
        return Device(id=member_id, kind="server", flops=0.0, memory=0.0, region=LOOPBACK_REGION,
                      up=1e9, down=1e9, can_host_server=True)
    return Device(id=member_id, kind="worker", flops=flops, memory=64e9, region=LOOPBACK_REGION,
                  up=1e9, down=1e9)


def played_device(emulated: Scenario, member_id: str, role: str, device_id: str) -> Device:
    """The scenario device ``device_id`` as member ``member_id`` (ShoalError if unknown).

    A member does only its role: a server process computes nothing (FLOP/s 0) and a
    worker process never hosts a stage server, whatever else its device could do.
    """
    d = replace(emulated.device(device_id), id=member_id)
    if role == "server":
        return replace(d, flops=0.0, can_host_server=True)
    return replace(d, can_host_server=False)


def member_network(emulated: Scenario, plays: dict[str, str]) -> Network:
    """The emulated network with its per-device-pair links moved to member ids.

    ``plays`` maps member id -> scenario device id. Two members playing the same device
    (a replacement server on the same host) talk over the device's loopback.
    """
    net = emulated.network
    on: dict[str, list[str]] = {}  # device id -> the members playing it (sorted)
    for m in sorted(plays):
        on.setdefault(plays[m], []).append(m)
    overrides: dict[tuple[str, str], Link] = {}
    # Only pairs that get a link of their own are visited (a swarm of N members on N devices
    # has none): the members sharing a device, and those on a device pair the network lists.
    for ms in on.values():
        for i, a in enumerate(ms):
            for b in ms[i + 1:]:
                overrides[(a, b)] = net.loopback
    for (da, db), link in net.overrides.items():
        if da < db:  # a pair is listed with its device ids in order
            for a in on.get(da, ()):
                for b in on.get(db, ()):
                    overrides[(a, b) if a < b else (b, a)] = link
    return replace(net, overrides=dict(sorted(overrides.items())))


def planning_scenario(devices: dict[str, Device], workload: Workload, emulated: Scenario | None = None,
                      plays: dict[str, str] | None = None) -> Scenario:
    """The scenario of the members in ``devices`` (member id -> device) training ``workload``.

    Without ``emulated``: every member on loopback links. With it: the emulated network,
    ``plays`` (member id -> scenario device id) placing each member in it.
    """
    if emulated is None:
        network = Network(intra={LOOPBACK_REGION: LOOPBACK_LINK}, inter={})
        return Scenario(name="live", devices=list(devices.values()), network=network, workload=workload)
    return Scenario(name=emulated.name, devices=list(devices.values()),
                    network=member_network(emulated, plays or {}), workload=workload)


# ---------------------------------------------------------------------------- measured runs

COORDINATOR_NODE = "coordinator"  # node name of the coordinator in latency clustering
REGION_RTT_S = 0.02  # members whose round trip is at most this share a region (single linkage)
UNMEASURED_BPS = 1e9  # up/down of a member that reported no usable measurement (bytes/s)
DRIFT_FACTOR = 3.0  # observed vs planned figure ratio (either way) that counts as drift
DRIFT_MIN_SAMPLES = 4  # observations needed before drift is judged
REMEASURE_AFTER_S = 30.0  # shortest time between two measurements of one member
MEASURE_GAP_RETRIES = 2  # reports lacking a stage server's link that are answered by asking again


@dataclass(frozen=True)
class PathFigures:
    """One measured path from member ``src`` to node ``dst`` (a member id or the coordinator)."""

    src: str  # member that measured
    dst: str  # member id or COORDINATOR_NODE
    rtt_s: float  # round-trip time in seconds
    up: float  # bytes/s src -> dst
    down: float  # bytes/s dst -> src
    same_host: bool = False  # src and dst share a host: loopback, no rates measured


@dataclass
class MemberFigures:
    """What the coordinator knows about one member of a measured run."""

    member_id: str  # member id (the planner device id)
    role: str  # "worker" or "server"
    kind: str = "unmeasured"  # device label the member reported
    flops: float = 0.0  # measured (or --flops) FLOP/s; 0 for a server
    memory: float = 0.0  # bytes: accelerator memory or available RAM
    region: str = ""  # declared region ("": clustered)
    up: float = 0.0  # declared uplink bytes/s (0: measured)
    down: float = 0.0  # declared downlink bytes/s (0: measured)
    paths: list[PathFigures] = field(default_factory=list)  # paths this member measured


def cluster_regions(nodes: list[str], rtts: dict[tuple[str, str], float], declared: dict[str, str],
                    threshold_s: float = REGION_RTT_S) -> dict[str, str]:
    """Region of every node: declared ones keep theirs, the rest are clustered by latency.

    Single linkage: two nodes whose measured round trip (``rtts``, either key order) is
    at most ``threshold_s`` are in one cluster. An undeclared node takes the declared
    region of the nearest declared node of its cluster (measured round trip, then name);
    clusters with no declared node are named ``auto-0``, ``auto-1``, ... in the order of
    their smallest node name. Pure and deterministic.
    """
    parent = {n: n for n in nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def rtt(a: str, b: str) -> float | None:
        return rtts.get((a, b), rtts.get((b, a)))

    for (a, b), r in sorted(rtts.items()):
        if a in parent and b in parent and r <= threshold_s:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    clusters: dict[str, list[str]] = {}
    for n in sorted(nodes):
        clusters.setdefault(find(n), []).append(n)
    out: dict[str, str] = {}
    auto = 0
    for root in sorted(clusters, key=lambda r: min(clusters[r])):
        members = clusters[root]
        named = [n for n in members if declared.get(n)]
        if not named:
            for n in members:
                out[n] = f"auto-{auto}"
            auto += 1
            continue
        for n in members:
            if declared.get(n):
                out[n] = declared[n]
            else:
                near = min(named, key=lambda d: (rtt(n, d) if rtt(n, d) is not None else math.inf, d))
                out[n] = declared[near]
    return out


def missing_servers(expected: dict[str, str], probed: list[str]) -> list[str]:
    """Names of the stage servers (``expected``: address -> name) a member's measurement
    has no link figures for (``probed``: the addresses it reported), sorted."""
    got = set(probed)
    return sorted(name for address, name in expected.items() if address and address not in got)


def drifted(planned: float, observed: float, samples: int, factor: float = DRIFT_FACTOR,
            min_samples: int = DRIFT_MIN_SAMPLES) -> bool:
    """Whether an observed figure (a task's FLOP/s, a transfer's seconds) left the planned one.

    Drift: at least ``min_samples`` observations, both figures positive, and one more
    than ``factor`` times the other (slower or faster). Anything unknown is no drift.
    """
    if samples < min_samples or not planned > 0 or not observed > 0:
        return False
    return max(planned / observed, observed / planned) > factor


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def measured_device(f: MemberFigures, region: str) -> Device:
    """The planner device of a measured member: declared figures win over measured ones.

    Its up/down capacities are the median of the rates it measured on its paths: a
    member's own access link bounds every one of them, and the median is not thrown
    by one noisy or far-end-limited path. Paths to its own host do not cross that link
    and count only when there is no other (then it has loopback's rate).
    """
    ups = [p.up for p in f.paths if p.up > 0 and not p.same_host]
    downs = [p.down for p in f.paths if p.down > 0 and not p.same_host]
    local = LOOPBACK_LINK.bandwidth if any(p.same_host for p in f.paths) else UNMEASURED_BPS
    up = f.up or (_median(ups) if ups else local)
    down = f.down or (_median(downs) if downs else local)
    if f.role == "server":
        return Device(id=f.member_id, kind=f.kind, flops=0.0, memory=0.0, region=region, up=up, down=down,
                      can_host_server=True, host_memory=f.memory or 64e9)
    return Device(id=f.member_id, kind=f.kind, flops=max(f.flops, 1.0), memory=f.memory or 64e9,
                  region=region, up=up, down=down)


def measured_scenario(members: dict[str, MemberFigures], workload: Workload, *, name: str = "measured",
                      threshold_s: float = REGION_RTT_S, description: str = "") -> Scenario:
    """The scenario of a real run, built from what its members measured.

    * devices: one per member (:func:`measured_device`), regions declared or clustered
      (:func:`cluster_regions`, the coordinator is a node too);
    * a measured member-to-member path becomes a per-pair link: one-way latency half
      the best round trip, bandwidth the faster direction (each device's up/down then
      bounds its own direction in the cost model); a same-host path is loopback's rate;
    * region links: median one-way latency and median path rate of the measured pairs
      in (or between) the regions (same-host pairs not in the rate), pairs through the
      coordinator (sum of the two round trips) standing in for regions with no direct
      measurement; loopback figures when nothing was measured.
    """
    paths = [p for f in members.values() for p in f.paths]
    rtts: dict[tuple[str, str], float] = {}
    rates: dict[tuple[str, str], float] = {}
    local: set[tuple[str, str]] = set()  # same-host pairs: no network between them
    for p in paths:
        key = (p.src, p.dst) if p.src < p.dst else (p.dst, p.src)
        rtts[key] = min(rtts.get(key, math.inf), p.rtt_s)
        rates[key] = max(rates.get(key, 0.0), LOOPBACK_LINK.bandwidth if p.same_host else 0.0, p.up, p.down)
        if p.same_host:
            local.add(key)
    nodes = sorted(set(members) | {n for k in rtts for n in k})
    declared = {m: f.region for m, f in members.items() if f.region}
    region = cluster_regions(nodes, rtts, declared, threshold_s)
    devices = [measured_device(f, region[m]) for m, f in sorted(members.items())]

    overrides = {k: Link(latency=rtts[k] / 2, bandwidth=rates[k]) for k in rtts
                 if k[0] in members and k[1] in members and rates[k] > 0}
    # Round trips through the coordinator bound the ones never measured directly.
    via: dict[tuple[str, str], float] = dict(rtts)
    to_coord = {n: r for (a, b), r in rtts.items() for n in (a, b)
                if COORDINATOR_NODE in (a, b) and n != COORDINATOR_NODE}
    for a in to_coord:
        for b in to_coord:
            if a < b and (a, b) not in via:
                via[(a, b)] = to_coord[a] + to_coord[b]
    pair_lat: dict[tuple[str, str], list[float]] = {}
    pair_bw: dict[tuple[str, str], list[float]] = {}
    for (a, b), r in via.items():
        ra, rb = region.get(a), region.get(b)
        if ra is None or rb is None:
            continue
        key = (ra, rb) if ra <= rb else (rb, ra)
        pair_lat.setdefault(key, []).append(r / 2)
        if (a, b) in rates and rates[(a, b)] > 0 and (a, b) not in local:
            pair_bw.setdefault(key, []).append(rates[(a, b)])
    regions = sorted({d.region for d in devices})

    def region_link(key: tuple[str, str]) -> Link:
        lat = _median(pair_lat[key]) if key in pair_lat else LOOPBACK_LINK.latency
        bw = _median(pair_bw[key]) if key in pair_bw else LOOPBACK_LINK.bandwidth
        return Link(latency=lat, bandwidth=bw)

    intra = {r: region_link((r, r)) for r in regions}
    inter = {(a, b): region_link((a, b)) for i, a in enumerate(regions) for b in regions[i + 1:]}
    network = Network(intra=intra, inter=inter, overrides=overrides)
    return Scenario(name=name, devices=devices, network=network, workload=workload,
                    description=description or f"measured by the members of a live run ({len(members)} members)",
                    source="shoal runtime measurement: device memory, FLOP/s of the run's layers, probe RPCs")


def distinct_servers(stage_servers: list[str], servers: list[str]) -> list[str]:
    """One server member per stage: a stage whose planned server already serves an
    earlier stage gets an unused server member (in ``servers`` order) instead.

    The planner may put several stages on one host; a stage server process serves one
    stage, so each extra stage moves to a standby process. Stages with no unused server
    left keep their planned one (the caller falls back to an even split).
    """
    used: set[str] = set()
    free = [s for s in servers if s not in stage_servers]
    out = []
    for s in stage_servers:
        if s in used and free:
            s = free.pop(0)
        used.add(s)
        out.append(s)
    return out


def spec_sync_policy(spec):
    """The planner's :class:`~shoal.plan.types.SyncPolicy` of the run a spec describes (pure):
    its mode, H, delayed application and codecs, and in exact sync its pushes (one per
    micro-batch of a shared stage with ``ordered_grads``), so the coordinator's plan is priced
    as the runtime runs it."""
    from shoal.plan.types import SyncPolicy
    from shoal.runtime.sync.codecs import compression_of_spec
    from shoal.train.outer import sync_of_spec

    sync, c = sync_of_spec(spec), compression_of_spec(spec)
    codecs = dict(act_codec=c.act, grad_codec=c.grad, push_codec=c.push, pull_codec=c.pull)
    if sync.local:
        return SyncPolicy(mode="local", sync_every=sync.sync_every, overlap=sync.overlap, lean=sync.lean, **codecs)
    return SyncPolicy(ordered=bool(spec.ordered_grads), **codecs)


def memory_fits(memory: Mapping[str, float], layers: Sequence[tuple[int, int]], prof, local: bool,
                lean: bool = False) -> dict[str, list[int]]:
    """The stages (indices of ``layers``) each worker's memory (bytes) can hold, by the planner's
    rule (:func:`shoal.plan.cost.stage_worker_memory`: weights, gradients, one micro-batch's
    saved activations, and in local mode the inner optimizer's state; ``lean``: lean workers' 12
    bytes a parameter) (pure). A worker with no memory figure (0) is left out: it may take any stage."""
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.types import SyncPolicy

    sync = SyncPolicy(mode="local", lean=lean) if local else None
    need = [stage_worker_memory(prof, a, b, sync) for a, b in layers]
    return {mid: [k for k, n in enumerate(need) if mem >= n] for mid, mem in memory.items() if mem > 0}


def unplaced_reason(memory: float, layers: Sequence[tuple[int, int]], prof, local: bool, lean: bool = False) -> str:
    """Why a worker of ``memory`` bytes holds no stage: one line naming the smallest stage's need."""
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.types import SyncPolicy

    sync = SyncPolicy(mode="local", lean=lean) if local else None
    k, need = min(((k, stage_worker_memory(prof, a, b, sync)) for k, (a, b) in enumerate(layers)),
                  key=lambda x: (x[1], x[0]))
    return (f"its {memory / 1e9:.3g} GB hold no stage: the smallest, stage {k} (layers {layers[k][0]}-"
            f"{layers[k][1]}), needs {need / 1e9:.3g} GB; it waits until a re-plan gives it one")
