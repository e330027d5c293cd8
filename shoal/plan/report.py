"""How much of the swarm a plan turns into training: the figures ``shoal plan``, ``shoal simulate``
and ``--compare`` report first.

The physical limit of a swarm is its **FLOP limit**: the sum of every worker's FLOP/s (all the
scenario's devices that can compute, used or not) divided by the model's training FLOPs per
token (forward + backward of every layer, from shoal's own profile; recomputation is not
useful work and is not counted). A plan's tokens/s as a share of that limit is the headline
figure; the busy share of the devices a plan uses (``utilisation`` in the cost model) is kept
as a secondary figure because it says nothing about the devices left out.

Pure functions of (plan, scenario, step time): no planning, no simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.model.profile import ModelProfile
from shoal.plan.cost import (
    replica_plan,
    scenario_profile,
    server_cpu_caps,
    server_cpu_per_step,
    servers_memory,
    stage_costs,
    stage_server_memory,
    stage_worker_memory,
    swarm_flop_limit,
)
from shoal.plan.types import Device, Plan, Scenario

# Reasons an available device does no work in a plan (``SwarmReport.idle`` values).
IDLE_MEMORY = "memory"  # it cannot hold any stage of the plan
IDLE_LINKS = "links"  # it fits, but its links, not its GPU, would set its pace
IDLE_NO_BENEFIT = "no benefit"  # it fits and its links keep up, but the planner found no faster step with it
IDLE_SERVER_CPU = "server CPU"  # it fits and its links keep up, but the server host of its stage has no CPU left
IDLE_REASONS = (IDLE_MEMORY, IDLE_LINKS, IDLE_NO_BENEFIT, IDLE_SERVER_CPU)

def cpu_bound_servers(plan: Plan, scenario: Scenario, step_s: float) -> dict[str, str]:
    """Server host id -> one line, for each host whose CPU caps a stage: its workers could run
    more micro-batches per second than its cores handle (:func:`shoal.plan.cost.server_cpu_caps`),
    so the host, not its workers, sets that stage's pace."""
    dev = {d.id: d for d in scenario.devices}
    per_step = server_cpu_per_step(plan, scenario)
    out = {}
    for rep, caps in zip(plan.pipelines, server_cpu_caps(plan, scenario), strict=True):
        for st, c in zip(rep.stages, stage_costs(replica_plan(plan, rep), scenario, None, None, caps), strict=True):
            if st.server not in out and c.uncapped >= c.cpu_cap * (1 - 1e-9):
                h = st.server
                step = f" of a {step_s:.2f} s step" if 0 < step_s < math.inf else " a step"
                out[h] = (f"server host {h} is CPU-bound: its {dev[h].cores} cores handle {c.cpu_cap:.1f} "
                          f"micro-batches/s of layers [{st.layers[0]}, {st.layers[1]}), its workers could run "
                          f"{c.uncapped:.1f}; its stage servers' CPU is busy {per_step[h]:.2f} s{step}")
    return dict(sorted(out.items()))


def training_flops_per_token(prof: ModelProfile) -> float:
    """Forward + backward FLOPs of the whole model per trained token."""
    n = len(prof.layers)
    return (prof.fwd_flops(0, n) + prof.bwd_flops(0, n)) / prof.tokens_per_micro_batch


def flop_limit_tokens_per_s(scenario: Scenario) -> float:
    """The swarm's FLOP limit in tokens/s: sum of all workers' FLOP/s / training FLOPs per token."""
    return swarm_flop_limit(scenario)


def tokens_per_step(plan: Plan, scenario: Scenario) -> int:
    """Tokens one optimizer step trains: every replica's micro-batches together."""
    return plan.micro_batches * plan.micro_batch_size * scenario.workload.seq_len


@dataclass
class SwarmReport:
    """What share of a swarm a plan (or a simulation of it) turns into training."""

    tokens_per_s: float  # tokens trained per second at the given step time
    flop_limit_tokens_per_s: float  # the swarm's FLOP limit (all workers, used or not)
    flop_share: float  # tokens_per_s / flop_limit_tokens_per_s
    devices_used: int  # devices that work for the plan
    devices_available: int  # devices of the scenario that can compute
    busy_share: float  # secondary: mean over the used devices of the fraction of a step spent computing
    idle: dict[str, str] = field(default_factory=dict)  # idle device id -> one of IDLE_REASONS
    why: dict[str, str] = field(default_factory=dict)  # idle device id -> one line with the figures behind it
    cpu_bound: dict[str, str] = field(default_factory=dict)  # CPU-bound server host id -> one line (cpu_bound_servers)
    short_of_host_memory: list[str] = field(default_factory=list)  # idle devices no host has server memory for (host_short)

    def idle_counts(self) -> dict[str, int]:
        """Idle devices per reason (every reason listed, zeros included)."""
        out = dict.fromkeys(IDLE_REASONS, 0)
        for r in self.idle.values():
            out[r] += 1
        return out

    def summary(self) -> str:
        """One line: tokens/s, the share of the FLOP limit, devices used and why the rest are idle."""
        counts = ", ".join(f"{n} {r}" for r, n in self.idle_counts().items() if n)
        idle = f" (idle: {counts})" if counts else ""
        cpu = f"; CPU-bound server hosts: {', '.join(self.cpu_bound)}" if self.cpu_bound else ""
        return (f"{self.tokens_per_s:,.0f} tokens/s = {self.flop_share:.1%} of the swarm's FLOP limit "
                f"({self.flop_limit_tokens_per_s:,.0f} tokens/s); {self.devices_used}/{self.devices_available} "
                f"devices used{idle}; busy share of the used devices {self.busy_share:.0%}{cpu}")

    def to_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "flop_limit_tokens_per_s": self.flop_limit_tokens_per_s,
                "flop_share": self.flop_share, "devices_used": self.devices_used,
                "devices_available": self.devices_available, "busy_share": self.busy_share,
                "idle_counts": self.idle_counts(), "idle": dict(self.idle), "why": dict(self.why),
                "cpu_bound": dict(self.cpu_bound)}


def server_room(plan: Plan, scenario: Scenario, prof, device: Device | None = None) -> float:
    """The most host memory a server host has left beside the plan's stage servers (pure). With
    ``device``, only the hosts of its network cluster count (a replica's servers live in its
    cluster: the plan's replicas name theirs), unless no replica's cluster holds its region."""
    need = servers_memory(plan.all_stages, prof, plan.sync)
    hosts = [h for h in scenario.devices if h.can_host_server]
    if device is not None:
        clusters = [set(r.cluster.split("+")) for r in plan.replicas]
        mine = set().union(*(c for c in clusters if device.region in c))
        if mine:
            hosts = [h for h in hosts if h.region in mine]
    return max((h.host_memory - need.get(h.id, 0.0) for h in hosts), default=0.0)


# A what-if plan (MemoryWhatIf) counts as faster only by more than this share: the planner's own
# search moves a plan's prediction by about that much (gaming-world with hosts of ample memory
# and 8x their cores: +0.1 %, a plan no user would buy memory for).
WHAT_IF_GAIN = 0.01


@dataclass(frozen=True)
class MemoryWhatIf:
    """The planner's replica plan for the same swarm with server hosts of ample memory
    (:func:`shoal.plan.replicas.memory_what_if`): whether host memory is what keeps devices idle."""

    used: frozenset[str]  # the devices that plan uses
    tokens_per_s: float  # its predicted tokens/s
    host_memory: float  # the bytes each server host had in it (a replica's servers per worker)


def host_short(d: Device, plan: Plan, scenario: Scenario) -> tuple[int, float, float] | None:
    """``(k, room, whole)`` when ``d`` holds none of replica plan ``plan``'s stages but a
    ``k``-stage replica of its own, whose stage servers need ``whole`` bytes while the server
    hosts of its network cluster have at most ``room`` left; None otherwise (pure)."""
    if not plan.replicas:
        return None
    prof = scenario_profile(scenario, plan.micro_batch_size)
    if any(d.memory >= stage_worker_memory(prof, *st.layers, plan.sync) for st in plan.all_stages):
        return None
    from shoal.plan.replicas import stages_needed

    k = stages_needed(prof, d, plan.sync)
    room = server_room(plan, scenario, prof, d)
    whole = stage_server_memory(prof, 0, len(prof.layers), plan.sync)
    return (k, room, whole) if k and room < whole else None


def idle_reason(d: Device, plan: Plan, scenario: Scenario, step_s: float,
                cpu_bound: dict[str, str] | None = None, what_if: MemoryWhatIf | None = None,
                tokens_per_s: float = 0.0) -> tuple[str, str]:
    """``(reason, one line)`` for a device the plan leaves idle.

    * ``memory``: it cannot hold any of the plan's stages (under the plan's sync policy), or
      the replica it could hold needs stage servers no server host of its cluster has the
      memory left for, nor, in a replica plan, every stage of an even split into at most
      :data:`~shoal.plan.replicas.MAX_REPLICA_STAGES` (one that can is ``no benefit``: the
      planner could have built a replica of its depth). With ``what_if`` (the planner's plan
      where the hosts have that memory) a device it leaves idle there too, or one of a what-if
      plan not :data:`WHAT_IF_GAIN` faster than this one (``tokens_per_s``), is ``no benefit``:
      host memory is not what keeps it out;
    * ``links``: on the stage it fits best, moving one micro-batch's bytes over its own access
      links (and its lease round trips) takes longer than computing it, or its share of the
      parameter sync (a step's in exact sync, a round's in local mode, at its own link rate)
      takes longer than the steps it would run beside;
    * ``server CPU``: it fits and its links keep up, but the server host of a stage it fits is
      CPU-bound (``cpu_bound``, from :func:`cpu_bound_servers`): that stage cannot take more tasks;
    * ``no benefit``: otherwise -- it fits and its links keep up, but the planner found no
      shorter step with it (e.g. the stage already has more workers than micro-batches, or a
      slow device's last task would end the step later).
    """
    prof = scenario_profile(scenario, plan.micro_batch_size)
    stages = plan.all_stages
    fitting = [st for st in stages if d.memory >= stage_worker_memory(prof, *st.layers, plan.sync)]
    if not fitting:
        need = min(stage_worker_memory(prof, *st.layers, plan.sync) for st in stages)
        if plan.replicas:
            from shoal.plan.replicas import stages_needed

            k = stages_needed(prof, d, plan.sync)
            short = host_short(d, plan, scenario)
            if short is not None:  # a replica of its size needs servers no host has the memory for
                _, room, whole = short
                lacks = (f"has {d.memory / 1e9:.1f} GB, enough for a {k}-stage replica, but the stage servers of "
                         f"another replica need {whole / 1e9:.0f} GB of host memory and the server hosts of its "
                         f"network cluster have at most {room / 1e9:.0f} GB left")
                if what_if is None:
                    return IDLE_MEMORY, lacks
                ample = "with server hosts of ample memory (this sync policy)"
                if d.id in what_if.used and what_if.tokens_per_s > (1 + WHAT_IF_GAIN) * tokens_per_s:
                    return IDLE_MEMORY, (f"{lacks}; {ample} the planner uses it, at {what_if.tokens_per_s:,.0f} "
                                         f"tokens/s against {tokens_per_s:,.0f}")
                if d.id in what_if.used:
                    return IDLE_NO_BENEFIT, (f"{lacks}; {ample} the planner's plan uses it but is not "
                                             f"{WHAT_IF_GAIN:.0%} faster "
                                             f"({what_if.tokens_per_s:,.0f} tokens/s against {tokens_per_s:,.0f})")
                return IDLE_NO_BENEFIT, (f"{lacks}; {ample} the planner still leaves it idle (that plan: "
                                         f"{what_if.tokens_per_s:,.0f} tokens/s against {tokens_per_s:,.0f})")
            if k:  # the planner could have built a replica of its size: it chose not to
                return IDLE_NO_BENEFIT, (f"has {d.memory / 1e9:.1f} GB, too little for this plan's stages "
                                         f"(the smallest needs {need / 1e9:.1f} GB) but enough for a {k}-stage "
                                         "replica, which the planner found no faster with (each replica adds "
                                         "stage servers to every merge and reports to the coordinator)")
        return IDLE_MEMORY, f"has {d.memory / 1e9:.1f} GB, the smallest stage of this plan needs {need / 1e9:.1f} GB"
    n = len(prof.layers)
    hosts = {h.id: h for h in scenario.devices}
    best = None
    for st in fitting:
        a, b = st.layers
        compute = (prof.fwd_flops(a, b) + prof.bwd_flops(a, b)) / d.flops
        host = hosts[st.server]
        link = scenario.network.link(d, host)
        up = min(link.bandwidth, d.up)
        down = min(link.bandwidth, d.down)
        act = prof.layers[0].out_act_bytes
        up_bytes = (0 if b == n else act * plan.sync.ratio("act", prof.dtype_bytes, *prof.act_shape)) + \
            (0 if a == 0 else act * plan.sync.ratio("grad", prof.dtype_bytes, *prof.act_shape))
        down_bytes = (prof.tokens_per_micro_batch * 8 if a == 0 else act * plan.sync.ratio("act", prof.dtype_bytes, *prof.act_shape)) + \
            (prof.tokens_per_micro_batch * 8 if b == n else act * plan.sync.ratio("grad", prof.dtype_bytes, *prof.act_shape))
        lease = (1 if b == n else 2) * 2 * link.latency
        io = up_bytes / up + down_bytes / down + lease
        pb = prof.param_bytes(a, b)
        sync = (pb * plan.sync.ratio("push", prof.dtype_bytes, *prof.act_shape) / up
                + pb * plan.sync.ratio("pull", prof.dtype_bytes, *prof.act_shape) / down)
        window = step_s * (plan.sync.sync_every if plan.sync.local else 1)
        # (a stage of only the embedding has no FLOPs in the profile: its transfers are all it does)
        per_compute = io / compute if compute > 0 else (math.inf if io > 0 else 0.0)
        cand = (max(per_compute, sync / window if window > 0 and math.isfinite(window) else 0.0), io, compute, sync,
                window, st)
        if best is None or cand[0] < best[0]:
            best = cand
    ratio, io, compute, sync, window, st = best
    where = f"layers [{st.layers[0]}, {st.layers[1]})"
    if io > compute:
        return IDLE_LINKS, (f"on {where} a micro-batch's transfers and leases take {io:.2f} s over its links, "
                            f"its compute {compute:.2f} s")
    if math.isfinite(window) and sync > window:
        what = "a round" if plan.sync.local else "a step"
        return IDLE_LINKS, f"on {where} its sync of {what} takes {sync:.1f} s at its link rate, {what} lasts {window:.1f} s"
    if cpu_bound is None:
        cpu_bound = cpu_bound_servers(plan, scenario, step_s)
    for cand in fitting:
        if cand.server in cpu_bound:
            return IDLE_SERVER_CPU, (f"fits layers [{cand.layers[0]}, {cand.layers[1]}) but "
                                     f"{cpu_bound[cand.server]}")
    return IDLE_NO_BENEFIT, (f"fits {where} (compute {compute:.2f} s, transfers {io:.2f} s per micro-batch) "
                             "but the planner found no shorter step with it")


def host_memory_idle(rep: SwarmReport) -> list[str]:
    """The devices ``rep`` leaves idle that no server host of their cluster has the memory for
    their replica's servers for (:func:`host_short`; what
    :func:`shoal.plan.replicas.memory_what_if` puts to the test, whichever reason that gave them)."""
    return rep.short_of_host_memory


def swarm_report(plan: Plan, scenario: Scenario, step_s: float | None = None,
                 busy_share: float | None = None, what_if: MemoryWhatIf | None = None) -> SwarmReport:
    """The swarm figures of ``plan`` at step time ``step_s`` (default: the cost model's churn-free
    ``step_time_s`` in ``plan.predicted``) and busy share (default: the cost model's ``utilisation``);
    ``what_if``: the planner's plan with ample server-host memory, which decides whether a device
    without host memory for its replica is idle for ``memory`` or for ``no benefit``."""
    if step_s is None:
        step_s = plan.predicted.get("step_time_s", math.inf)
    if busy_share is None:
        busy_share = plan.predicted.get("utilisation", 0.0)
    limit = flop_limit_tokens_per_s(scenario)
    tps = tokens_per_step(plan, scenario) / step_s if step_s and 0 < step_s < math.inf else 0.0
    used = set(plan.workers)
    idle: dict[str, str] = {}
    why: dict[str, str] = {}
    bound = cpu_bound_servers(plan, scenario, step_s)
    for d in scenario.workers:
        if d.id in used:
            continue
        idle[d.id], why[d.id] = idle_reason(d, plan, scenario, step_s, bound, what_if,
                                            plan.predicted.get("tokens_per_s", tps))
    short = sorted(d.id for d in scenario.workers if d.id in idle and host_short(d, plan, scenario) is not None)
    return SwarmReport(tokens_per_s=tps, flop_limit_tokens_per_s=limit, flop_share=tps / limit if limit > 0 else 0.0,
                       devices_used=len(used), devices_available=len(scenario.workers), busy_share=busy_share,
                       idle=idle, why=why, cpu_bound=bound, short_of_host_memory=short)
