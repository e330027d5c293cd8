"""Hot standbys in the plan: where each stage's standby servers run and what their copies cost.

A hot standby of stage ``s`` holds a copy of the stage's state (fp32 weights and AdamW's two
moments, :func:`state_bytes`), fetched from the active server after every ``every``-th
committed step (the run's ``--ckpt-every``), so it can take the stage over without a shared
disk. The planner:

* places each standby on an allowed reliable host (``can_host_server``) other than the
  stage's active server host, with room for the stage's server memory beside what that host
  already runs, least loaded first, then the fastest copy path from the active host
  (:func:`place_standbys`);
* counts the copies on the active host's uplink: per step, that uplink carries the stage's
  activation downloads (and weight pulls) *and* ``state_bytes / every``; when the two
  together take longer than the step, the step stretches to the uplink's time
  (:func:`uplink_bound_step`). The simulator sends the same copies as real flows;
* under exact sync, counts the step log: before a stage reports a step, its active server
  sends every standby the step's summed fp32 gradient (:func:`step_log_bytes`) and waits for
  their acknowledgements, so the step grows by the slowest stage's log time
  (:func:`log_seconds_per_step`) and the uplink carries those bytes too. The simulator sends
  the log and waits for the acknowledgements the same way.

Small pure functions, tested directly (``tests/test_plan_standby.py``). No torch, no runtime.
"""

from __future__ import annotations

import math

from shoal.errors import ShoalError
from shoal.model.profile import ModelProfile
from shoal.plan.cost import stage_server_memory
from shoal.plan.types import Device, Plan, Scenario

STATE_BYTES_PER_PARAM = 12  # fp32 weight + AdamW's fp32 first and second moments
LOG_BYTES_PER_PARAM = 4  # the step log: the step's summed gradient in fp32


def state_bytes(prof: ModelProfile, first: int, last: int) -> float:
    """Bytes of one stage's state a standby copies (a stage checkpoint)."""
    return float(prof.params(first, last) * STATE_BYTES_PER_PARAM)


def step_log_bytes(prof: ModelProfile, first: int, last: int) -> float:
    """Bytes of one step's log entry a standby receives under exact sync (the summed gradient)."""
    return float(prof.params(first, last) * LOG_BYTES_PER_PARAM)


def copy_rate(scenario: Scenario, active: Device, standby: Device) -> float:
    """Bytes/s of the copy from ``active`` to ``standby``: path, sender's uplink, receiver's downlink."""
    return min(scenario.network.link(active, standby).bandwidth, active.up, standby.down)


def place_standbys(plan: Plan, scenario: Scenario, prof: ModelProfile, n: int) -> list[list[str]]:
    """``n`` standby hosts for each stage of ``plan`` (ShoalError when there are not enough).

    A stage's standbys are distinct reliable hosts, none of them its active server host,
    each with host memory left for the stage's server state. Stages are placed largest state
    first; a host is chosen by fewest servers already placed on it (active and standby),
    then fastest copy path from the active host, then id (deterministic).
    """
    if n <= 0:
        return [[] for _ in plan.stages]
    hosts = {d.id: d for d in scenario.server_hosts}
    load: dict[str, int] = {}
    used_mem: dict[str, float] = {}
    for st in plan.stages:
        load[st.server] = load.get(st.server, 0) + 1
        used_mem[st.server] = used_mem.get(st.server, 0.0) + stage_server_memory(prof, *st.layers, plan.sync)
    out: list[list[str]] = [[] for _ in plan.stages]
    order = sorted(range(len(plan.stages)), key=lambda i: (-prof.params(*plan.stages[i].layers), i))
    for i in order:
        st = plan.stages[i]
        active = scenario.device(st.server)
        need = stage_server_memory(prof, *st.layers, plan.sync)
        for _ in range(n):
            cands = [h for h in hosts.values() if h.id != st.server and h.id not in out[i]
                     and h.host_memory - used_mem.get(h.id, 0.0) >= need]
            if not cands:
                raise ShoalError(
                    f"--standbys {n}: stage {i} (server on {st.server}) needs {n} reliable host(s) besides its "
                    f"own with {need / 1e9:.2f} GB of host memory free; the scenario has "
                    f"{len(hosts)} server host(s): allow more (can_host_server) or ask for fewer standbys")
            best = min(cands, key=lambda h: (load.get(h.id, 0), -copy_rate(scenario, active, h), h.id))
            out[i].append(best.id)
            load[best.id] = load.get(best.id, 0) + 1
            used_mem[best.id] = used_mem.get(best.id, 0.0) + need
    return out


def copy_seconds_per_step(plan: Plan, scenario: Scenario, prof: ModelProfile) -> list[float]:
    """Per stage: seconds per step its standby copies keep the active host's uplink busy
    (``state_bytes / every`` at the copy path's rate, summed over the stage's standbys)."""
    every = max(1, plan.standby_every)
    out = []
    for st in plan.stages:
        active = scenario.device(st.server)
        nbytes = state_bytes(prof, *st.layers) / every
        out.append(sum(nbytes / copy_rate(scenario, active, scenario.device(h)) for h in st.standbys))
    return out


def log_seconds_per_step(plan: Plan, scenario: Scenario, prof: ModelProfile) -> list[float]:
    """Per stage: seconds the step waits for its step log under exact sync (0 in local mode or
    without standbys): the gradient sent to every standby at once over the active host's
    uplink, then a small acknowledgement back (one latency each way)."""
    if plan.sync.local:
        return [0.0 for _ in plan.stages]
    out = []
    for st in plan.stages:
        hosts = [scenario.device(h) for h in st.standbys]
        if not hosts:
            out.append(0.0)
            continue
        active = scenario.device(st.server)
        nbytes = step_log_bytes(prof, *st.layers)
        wire = max(max(nbytes / copy_rate(scenario, active, h) for h in hosts), len(hosts) * nbytes / active.up)
        out.append(wire + 2 * max(scenario.network.link(active, h).latency for h in hosts))
    return out


def host_uplink_bytes_per_step(plan: Plan, scenario: Scenario, prof: ModelProfile) -> dict[str, float]:
    """Bytes per step each server host sends to workers on other devices: every micro-batch's
    input (and, but for the last stage, its output gradient) and the weight pulls."""
    pol = plan.sync
    db = scenario.workload.dtype_bytes
    shape = prof.act_shape
    act, grad, pull = pol.ratio("act", db, *shape), pol.ratio("grad", db, *shape), pol.ratio("pull", db, *shape)
    n_total = prof.cfg.n_total_layers
    out: dict[str, float] = {}
    for i, st in enumerate(plan.stages):
        a, b = st.layers
        off = [w for w in st.workers if w != st.server]
        if not st.workers or not off:
            continue
        share = len(off) / len(st.workers)  # micro-batches leased by workers off the host
        per_mb = prof.in_act_bytes(a, b) * (1.0 if a == 0 else act)
        if b == n_total:
            per_mb += prof.tokens_per_micro_batch * 8  # targets
        if i + 1 < len(plan.stages):
            per_mb += prof.out_act_bytes(a, b) * grad
        pulls = len(off) * prof.param_bytes(a, b) * pull / max(1, pol.sync_every)
        out[st.server] = out.get(st.server, 0.0) + plan.micro_batches * share * per_mb + pulls
    return out


def uplink_bound_step(step_s: float, busy_up_s: float) -> float:
    """The step when a host's uplink must be busy ``busy_up_s`` per step: never shorter than that."""
    return max(step_s, busy_up_s)


def standby_costs(plan: Plan, scenario: Scenario, prof: ModelProfile, step_s: float) -> dict[str, float]:
    """Cost-model figures of ``plan``'s standbys for a step of ``step_s`` seconds without them:
    ``standby_s`` (the largest per-step copy time of a stage), ``standby_log_s`` (the step
    log's wait, :func:`log_seconds_per_step`) and ``step_time_s`` (the step with the log's wait
    and with the copies and log on the active hosts' uplinks, :func:`uplink_bound_step`)."""
    copies = copy_seconds_per_step(plan, scenario, prof)
    logs = log_seconds_per_step(plan, scenario, prof)
    if not any(c > 0 for c in copies):
        return {"standby_s": 0.0, "standby_log_s": 0.0, "step_time_s": step_s}
    dev = {d.id: d for d in scenario.devices}
    busy = {h: nbytes / dev[h].up for h, nbytes in host_uplink_bytes_per_step(plan, scenario, prof).items()}
    for st, c in zip(plan.stages, copies, strict=True):
        log_up = 0.0 if plan.sync.local else len(st.standbys) * step_log_bytes(prof, *st.layers) / dev[st.server].up
        busy[st.server] = busy.get(st.server, 0.0) + c + log_up
    step = step_s + max(logs)
    for b in busy.values():
        step = uplink_bound_step(step, b)
    return {"standby_s": max(copies), "standby_log_s": max(logs),
            "step_time_s": step if math.isfinite(step) else step_s}
