"""``shoal demo``: an emulated internet swarm on this machine, trained end to end, with a report.

What it does, in order:

1. loads the scenario (built-in ``demo`` by default) and picks the devices to run: every
   worker device (or ``--workers N`` of them, spread over the regions) plus the server
   hosts; the workload is the scenario's if its model is small enough for a CPU,
   otherwise the ``tiny`` model with a short sequence (:func:`demo_workload`);
2. writes that scenario to ``<out>/scenario.json`` (every process loads it from there)
   and derives the emulation (:func:`shoal.demo.emulated.emulation_spec`): the common
   compute time scale, so the slowest device's whole-model task takes ``model_task_s``;
3. plans the emulated scenario with shoal's planner (shown before the run): under ``--sync
   auto`` without ``--stages`` the planner's choice of everything it weighs -- one pipeline of
   any depth, or pipeline replicas -- and the swarm runs that plan (:func:`choose_sync`);
4. launches the swarm (:class:`shoal.runtime.processes.launch.Swarm`): coordinator, one stage
   server per stage, one worker process per device, each shaping its links and pacing
   its compute as its device; the churn model's leave/join events SIGKILL and restart
   workers once step 0 has committed;
5. shows a live display (rich; one line per step when stdout is not a terminal);
6. afterwards predicts the step time of the plan the runtime actually ran with the cost
   model and the simulator on the same emulated scenario (with the churn that happened
   replayed as a trace), samples text from the final checkpoint, adds all that to
   ``summary.json`` and writes ``<out>/report/``.

Every child process is killed on every exit path (normal end, error, Ctrl-C, SIGTERM);
the run folder keeps the logs and whatever was written so far, and a partial report is
written when the run fails midway.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

# Models a 2-core CPU can train in a few minutes; other scenarios' models are replaced.
CPU_MODELS = ("tiny", "small")
CODECS = {"none": "raw", "fp16": "fp16", "int8": "int8"}  # one-codec --compression -> runtime wire codec


@dataclass
class DemoConfig:
    """One ``shoal demo`` run."""

    scenario: str = "demo"  # built-in scenario name or scenario file
    steps: int = 40  # optimizer steps
    workers: int | None = None  # worker processes (None: every worker device, at most max_workers)
    churn: bool = True  # replay the scenario's churn (SIGKILL + restart of workers)
    compression: str = "none"  # --compression: codecs per traffic kind in the run spec (shoal.runtime.sync.codecs)
    out: str | None = None  # run folder (None: runs/demo-YYYYmmdd-HHMMSS)
    seed: int = 0  # weights, data, churn and sampling seed
    quiet: bool = False  # no live display (the summary is still printed)
    stages: int | None = None  # --stages: pipeline stages (None: --sync auto's choice; DEFAULT_STAGES otherwise)
    model_task_s: float = 1.2  # seconds the slowest device takes for a whole-model fwd+bwd task
    bandwidth_scale: float = 4.0  # every scenario bandwidth times this (4: the tiny model's weight sync over home uplinks in ~1 s)
    max_workers: int = 12  # default cap on worker processes for big scenarios (2-core host)
    sample_tokens: int = 120  # tokens of the generated sample
    timeout_s: float = 1200.0  # give up on the run after this long
    churn_after_step: int = 0  # churn starts once this step has committed (start-up joins are not churn)
    schedule: list | None = None  # explicit [(s after churn start, device, "leave"|"join")] (benchmarks)
    data: tuple[str, ...] = ("corpus",)  # --data: "corpus", "synthetic", a prepared folder or raw text
    workload: dict | None = None  # shared workload flags given (shoal.train.flags); the rest: the scenario's
    dashboard: str | None = "127.0.0.1:0"  # HOST:PORT of the live web dashboard (None: none)
    tensorboard: str | None = None  # folder for TensorBoard event files of the step metrics (None: none)
    sync: str = "auto"  # --sync: auto (the planner's choice, shoal.plan.auto), exact, or local (DiLoCo inside each stage)
    sync_every: int | None = None  # --sync-every: local mode's steps between merges H (None: auto's choice, local 32)
    outer_lr: float = 1.0  # --outer-lr: local mode's outer Nesterov learning rate
    outer_momentum: float = 0.0  # --outer-momentum: local mode's outer Nesterov momentum
    overlap: bool = True  # --no-overlap (False): local mode's steps wait for each round's merge
    lean: bool = False  # --lean-workers: local mode's workers hold 12 B a parameter (auto: the planner's choice)
    shadow: bool = False  # --shadow: workers run no model, only wait their device's task time (losses meaningless)
    replicas: str = ""  # --replicas: pipeline replicas given by hand (stages per replica; shoal.runtime.sync.replicas)

    def validate(self) -> None:
        """Raise :class:`ShoalError` on a bad value."""
        if self.steps < 1:
            raise ShoalError(f"--steps must be at least 1, got {self.steps}")
        if self.workers is not None and self.workers < 1:
            raise ShoalError(f"--workers must be at least 1, got {self.workers}")
        from shoal.runtime.sync.codecs import parse_run_compression

        parse_run_compression(self.compression)
        if self.stages is not None and self.stages < 1:
            raise ShoalError(f"--stages must be at least 1, got {self.stages}")
        if not self.model_task_s > 0:
            raise ShoalError(f"--task-time must be positive, got {self.model_task_s}")
        if not (self.bandwidth_scale > 0 and math.isfinite(self.bandwidth_scale)):
            raise ShoalError(f"--bandwidth-scale must be a positive number, got {self.bandwidth_scale}")
        from shoal.train.outer import SyncConfig

        if self.sync not in ("auto", "exact", "local"):
            raise ShoalError(f"--sync must be one of auto, exact, local, got {self.sync!r}")
        if self.sync == "exact" and self.sync_every not in (None, 1):
            raise ShoalError("--sync-every only applies to --sync local or auto (exact sync syncs every step)")
        SyncConfig("local" if self.sync == "auto" else self.sync, self.sync_every or DEFAULT_SYNC_EVERY,
                   self.outer_lr, self.outer_momentum, self.overlap,
                   self.lean and self.sync == "local").validate()
        if self.lean and self.sync != "local":
            raise ShoalError("--lean-workers applies to --sync local (exact sync's workers hold no optimizer; "
                             "--sync auto weighs lean workers by itself)")
        if not self.overlap and self.sync == "exact":
            raise ShoalError("--no-overlap applies to --sync local or auto (exact sync has no rounds)")
        if self.replicas and self.sync == "exact":
            raise ShoalError("--replicas needs --sync local (replicas merge at the rounds of local mode)")
        from shoal.runtime.roles.shadow import check_shadow_sync

        check_shadow_sync(self.shadow, self.sync == "local")
        if self.dashboard:
            from shoal.runtime.ui.dashboard import parse_bind

            parse_bind(self.dashboard)


# --------------------------------------------------------------------------- pure decisions


def demo_workload(workload):
    """The workload the demo trains: the scenario's, or ``tiny`` when its model is too big.

    A scenario written for a 1.3B model keeps its devices, network and churn, but the
    processes train the tiny model (sequence <= 128, micro-batch <= 4, M <= 8) -- the
    pacer pads every task to the time the scenario device takes for *that* model's
    FLOPs, and the planner and simulator see the same workload, so the comparison stays
    like for like. Returns ``(workload, substituted)``.
    """
    from shoal.model.config import get_preset

    if workload.model in CPU_MODELS:
        return replace(workload, dtype_bytes=4), False
    cfg = get_preset("tiny")
    mbs = min(workload.micro_batch_size * 4, 4)
    m = max(2, min(workload.micro_batches, 8))
    return replace(workload, model="tiny", seq_len=min(workload.seq_len, 128, cfg.max_seq_len),
                   micro_batch_size=mbs, global_batch=mbs * m, dtype_bytes=4), True


def pick_workers(devices: list, n: int) -> list:
    """``n`` worker devices spread over the regions: round-robin over regions, in scenario order."""
    by_region: dict[str, list] = {}
    for d in devices:
        by_region.setdefault(d.region, []).append(d)
    picked, queues = [], [list(v) for v in by_region.values()]
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    chosen = {d.id for d in picked}
    return [d for d in devices if d.id in chosen]  # scenario order, so worker i is stable


def demo_scenario(scenario, n_workers: int | None, max_workers: int, overrides: dict | None = None):
    """The scenario the processes emulate: the chosen workers, every server host, the demo workload.

    ``overrides`` are the shared workload flags the user gave (model, micro_batches,
    micro_batch_size, seq_len); they replace the scenario's workload as written, before
    the CPU substitution of :func:`demo_workload`. Returns ``(scenario, notes)``; notes say
    what was changed from the scenario as written.
    """
    notes = []
    ov = {k: v for k, v in (overrides or {}).items()
          if k in ("model", "micro_batches", "micro_batch_size", "seq_len")}
    if ov:
        wl = scenario.workload
        mbs = ov.get("micro_batch_size", wl.micro_batch_size)
        m = ov.get("micro_batches", wl.micro_batches)
        scenario = replace(scenario, workload=replace(
            wl, model=ov.get("model", wl.model), seq_len=ov.get("seq_len", wl.seq_len), micro_batch_size=mbs,
            global_batch=mbs * m))
        notes.append("workload from the command line: " + ", ".join(f"{k}={v}" for k, v in sorted(ov.items())))
    workers = scenario.workers
    if not workers or not scenario.server_hosts:
        raise ShoalError(f"scenario {scenario.name} needs worker devices (flops > 0) and a server host "
                         "(can_host_server) to run as a demo")
    if n_workers is None:
        n = min(len(workers), max_workers)
        if n < len(workers):
            notes.append(f"{n} of the scenario's {len(workers)} workers run (spread over regions); "
                         "pass --workers to change")
    else:
        if n_workers > len(workers):
            raise ShoalError(f"--workers {n_workers}: scenario {scenario.name} has only {len(workers)} "
                             "worker devices")
        n = n_workers
    chosen = pick_workers(workers, n)
    keep = {d.id for d in chosen} | {d.id for d in scenario.server_hosts}
    workload, substituted = demo_workload(scenario.workload)
    if substituted:
        notes.append(f"model {scenario.workload.model} replaced by tiny (seq {workload.seq_len}, "
                     f"micro-batch {workload.micro_batch_size}, M={workload.micro_batches}) to fit this CPU")
    trace = tuple(e for e in scenario.churn.trace if e[1] in keep)
    return replace(scenario, devices=[d for d in scenario.devices if d.id in keep], workload=workload,
                   churn=replace(scenario.churn, trace=trace)), notes


def runtime_plan(events: list[dict], workers: list[str], hosts: list[str], model: str, scenario: str,
                 micro_batch_size: int, micro_batches: int):
    """The plan the runtime ran (the coordinator's first ``replan``), in scenario device ids.

    Worker process ``w{i}`` plays ``workers[i]``; server process ``s{i}`` plays
    ``hosts[i % len(hosts)]`` (as :class:`shoal.runtime.processes.launch.Swarm` starts them).
    None if no replan with layers was logged.
    """
    from shoal.plan.types import Plan, StagePlan

    first = next((e for e in events if e.get("event") == "replan" and e.get("layers")), None)
    if first is None:
        return None

    servers = {}
    for e in events[:events.index(first)]:  # the newest assignment of each stage before the plan ran
        name = str(e.get("device", ""))
        if e.get("event") == "assign" and e.get("role") == "server" and e.get("stage") is not None \
                and name[1:].isdigit():
            servers[int(e["stage"])] = hosts[int(name[1:]) % len(hosts)]
    assignment = first.get("assignment") or {}
    stages = []
    for i, (a, b) in enumerate(first["layers"]):
        ws = [_device_of(w, workers) for w, s in sorted(assignment.items(), key=lambda kv: _worker_index(kv[0])) if int(s) == i]
        stages.append(StagePlan((int(a), int(b)), servers.get(i, hosts[i % len(hosts)]), ws))
    shapes = first.get("replicas")
    replicas = []
    if shapes:  # a replica plan: its stages in replica order (shoal.runtime.sync.replicas)
        from shoal.plan.types import Replica

        at = 0
        for n, m in zip(shapes["stages"], shapes["micro_batches"], strict=True):
            replicas.append(Replica(stages=stages[at:at + n], micro_batches=int(m)))
            at += n
    return Plan(scenario=scenario, model=model, method="runtime (" + str(first.get("method", "?")) + ")",
                stages=replicas[0].stages if replicas else stages, micro_batch_size=micro_batch_size,
                micro_batches=micro_batches, replicas=replicas)


def hand_replica_plan(scenario, spec: str, seed: int = 0):
    """The plan of ``--replicas SPEC`` on ``scenario`` as the coordinator makes it (pure): each
    replica's layers split evenly, stage servers on the server hosts in turn (as
    :class:`shoal.runtime.processes.launch.Swarm` starts them) then moved to hosts of their
    replica's region, whole regions to replicas and workers balanced inside them
    (:func:`shoal.runtime.sync.replicas.assign_replica_workers`). No sync policy is set."""
    from shoal.model.config import get_preset
    from shoal.plan.types import Plan, Replica, StagePlan
    from shoal.runtime.sync.replicas import (
        assign_replica_workers,
        parse_replica_plan,
        parse_replica_regions,
        place_replica_servers,
        replica_regions,
        replica_slots,
    )

    w = scenario.workload
    n_layers = get_preset(w.model).n_total_layers
    counts, mbs, layers = parse_replica_plan(spec, w.micro_batches, n_layers)
    slots = replica_slots(counts, mbs, n_layers, layers)
    hosts = [d.id for d in scenario.server_hosts]
    flops = {d.id: d.flops for d in scenario.workers}
    regions = {d.id: d.region for d in scenario.workers}
    assign = assign_replica_workers(flops, regions, slots, homes=parse_replica_regions(spec))
    # server process s{k} joins for stage k and plays host k mod hosts; then each replica's
    # servers move to hosts of its region (shoal.runtime.sync.replicas.place_replica_servers)
    region_of = {d.id: d.region for d in scenario.server_hosts}
    current = [f"s{k}" for k in range(len(slots))]
    want = replica_regions(assign, regions, slots)
    placed = place_replica_servers(current, {sid: region_of[hosts[int(sid[1:]) % len(hosts)]] for sid in current},
                                   [want[s.replica] for s in slots])
    stages = [StagePlan((s.first, s.last), hosts[int(placed[k][1:]) % len(hosts)],
                        sorted(d for d, j in assign.items() if j == k)) for k, s in enumerate(slots)]
    replicas, at = [], 0
    for n, m in zip(counts, mbs, strict=True):
        replicas.append(Replica(stages=stages[at:at + n], micro_batches=m))
        at += n
    return Plan(scenario=scenario.name, model=w.model, method=f"replicas by hand ({spec})", stages=replicas[0].stages,
                micro_batch_size=w.micro_batch_size, micro_batches=w.micro_batches, replicas=replicas)


def _device_of(name: str, workers: list[str]) -> str:
    """Scenario device played by worker process ``name`` (``w{i}`` -> ``workers[i]``)."""
    i = _worker_index(name)
    return workers[i] if i < len(workers) else name


def _worker_index(name: str) -> int:
    return int(name[1:]) if name[1:].isdigit() else 1 << 30


def churn_trace(done: list[tuple[float, str, str, bool]], offset_s: float) -> tuple:
    """The churn that happened, as a scenario trace: driver times shifted by ``offset_s``.

    Only events that took effect (``ok``) are kept; per device they alternate.
    """
    return tuple((round(t + offset_s, 3), dev, action) for t, dev, action, ok in done if ok)


def traffic_bytes(metrics: list[dict], plan, tokens_per_mb: int, d_model: int, stage_params: list[int],
                  codec: str, block: int = 128) -> dict[str, dict[str, int]]:
    """Bytes sent by the workers, per traffic class: fp32-equivalent ("raw") and on the wire.

    Computed from the run's committed steps, not counted on sockets (the runtime has no
    byte counters yet): every committed micro-batch sends one activation and one
    activation gradient across each of the S - 1 stage boundaries (worker -> server,
    encoded with ``codec``); each worker that took tasks in a step pulls its stage's
    weights once (server -> worker, raw fp32 in the runtime) and pushes one gradient of
    its stage (``--unordered-grads``: one push per worker per step, ``codec``).
    Re-sent results of re-queued tasks are not included, so this is a lower bound.
    """
    from shoal.net.compress import encoded_nbytes

    n_stages = len(plan.stages) if plan is not None else 1
    stage_of = {}
    if plan is not None:
        for s, sp in enumerate(plan.stages):
            for w in sp.workers:
                stage_of[w] = s
    out = {k: {"raw": 0, "wire": 0} for k in ("activations", "activation_grads", "grad_push", "weight_pull")}

    def add(kind: str, numel: int, c: str, channels: int = 1) -> None:
        out[kind]["raw"] += 4 * numel
        # channels: quad-pc's size depends on them (a (tokens, d_model) activation has d_model)
        out[kind]["wire"] += 4 * numel if c == "raw" else encoded_nbytes(c, numel, block, channels=channels)

    act_numel = tokens_per_mb * d_model
    for m in metrics:
        mbs = int(m.get("tokens", 0)) // max(1, tokens_per_mb)
        for _ in range(n_stages - 1):
            for _ in range(mbs):
                add("activations", act_numel, codec, d_model)
                add("activation_grads", act_numel, codec, d_model)
        for w, n in (m.get("tasks_per_worker") or {}).items():
            s = stage_of.get(w)
            if n and s is not None and s < len(stage_params):
                add("weight_pull", stage_params[s], "raw")
                add("grad_push", stage_params[s], codec)
    return out


def sync_policy(codec: str, compression=None):
    """The planner's view of the demo's wire codecs. ``compression`` (a
    :class:`shoal.runtime.sync.codecs.RunCompression`, the run's per-kind setting) gives each
    kind its codec; without it, ``codec`` stands for what workers upload (activations, their
    gradients, gradient pushes) with weights pulled raw, so the parameter traffic factor is
    the larger of the two (fp32), as
    :meth:`shoal.net.compress.CompressionConfig.sync_fractions` defines it."""
    from shoal.net.compress import CompressionConfig
    from shoal.plan.types import SyncPolicy

    if compression is not None:
        return SyncPolicy(act_codec=compression.act, grad_codec=compression.grad, push_codec=compression.push,
                          pull_codec=compression.pull)
    act, grad = CompressionConfig(activations=codec, act_grads=codec, grad_push=codec,
                                  weight_pull="raw").sync_fractions()
    return SyncPolicy(act_compression=act, grad_compression=grad)


DEFAULT_SYNC_EVERY = 32  # --sync local's H when --sync-every is not given (launch's default)


def run_policy(cfg: DemoConfig, compression):
    """The planner's view of an explicit ``--sync exact`` / ``local`` run (:func:`sync_policy`
    of its codecs, in local mode with its H)."""
    from dataclasses import replace as dc_replace

    pol = sync_policy(compression.wire("act"), compression)
    if cfg.sync == "local":
        pol = dc_replace(pol, mode="local", sync_every=cfg.sync_every or DEFAULT_SYNC_EVERY, overlap=cfg.overlap,
                         lean=cfg.lean)
    return pol


DEFAULT_STAGES = 2  # pipeline stages of --sync exact / local when --stages is not given


def choose_sync(cfg: DemoConfig, scenario, stages: int | None):
    """The plan the demo runs and its config with a concrete policy and shape: ``(plan, cfg)``;
    the config's ``stages`` is the run's stage count (all replicas' stages with replicas).

    ``--sync auto`` (the default): the planner's choice (:func:`shoal.plan.auto.plan_auto`) on
    the emulated ``scenario`` -- exact or local mode, H and the codec of each traffic kind,
    under the default quality budget (``--sync-every`` pins H, ``--compression`` pins the
    codecs; int8 rather than sparse pushes and pulls where sparse is no faster,
    :func:`shoal.plan.auto.lighter`) -- and, with ``stages`` None (no ``--stages``), the shape:
    one pipeline of the depth it chooses, or pipeline replicas. A replica plan is passed on as
    the ``--replicas`` SPEC of its layer splits and micro-batch shares
    (:func:`shoal.runtime.sync.replicas.replicas_of_plan`, as a plan file is). The returned config
    carries that mode, H, ``--compression`` and replicas. With ``stages`` given: one pipeline
    of that many stages. ``exact`` / ``local``: the plan of that policy on ``stages`` (default
    :data:`DEFAULT_STAGES`) stages, the config otherwise unchanged.
    """
    from dataclasses import replace as dc_replace

    from shoal.plan.api import make_plan
    from shoal.plan.auto import DEFAULT_MAX_SYNC_EVERY, QualityBudget, plan_auto
    from shoal.plan.compression import parse_compression
    from shoal.runtime.sync.codecs import RunCompression, parse_run_compression

    if cfg.replicas:
        # Replicas given by hand run in local mode (auto does not choose them): the plan is theirs.
        cfg = dc_replace(cfg, sync="local")
        from shoal.plan.cost import predict

        plan = hand_replica_plan(scenario, cfg.replicas, cfg.seed)
        plan.sync = run_policy(cfg, parse_run_compression(cfg.compression))
        predict(plan, scenario)
        return plan, dc_replace(cfg, stages=sum(len(r.stages) for r in plan.replicas))
    if cfg.sync != "auto":
        pol = run_policy(cfg, parse_run_compression(cfg.compression))
        stages = stages or min(DEFAULT_STAGES, len(scenario.workers))
        return make_plan(scenario, stages=stages, seed=cfg.seed, sync=pol), dc_replace(cfg, stages=stages)
    pinned = cfg.compression.strip() not in ("", "none")
    budget = QualityBudget(max_sync_every=max(DEFAULT_MAX_SYNC_EVERY, cfg.sync_every or 0),
                           replicas=stages is None, pin_sync_every=cfg.sync_every,
                           pin_codecs=parse_compression(cfg.compression) if pinned else None, overlap=cfg.overlap)
    plan = plan_auto(scenario, budget, seed=cfg.seed, stages=stages)
    pol = plan.sync
    codecs = RunCompression(act=pol.act_codec, grad=pol.grad_codec, push=pol.push_codec, pull=pol.pull_codec)
    cfg = dc_replace(cfg, sync="local" if pol.local else "exact", sync_every=pol.sync_every if pol.local else None,
                     compression=codecs.text(), stages=len(plan.stages), overlap=pol.overlap or not pol.local,
                     lean=pol.local and pol.lean)
    if len(plan.replicas) > 1:
        from shoal.model.config import get_preset
        from shoal.runtime.sync.replicas import replicas_of_plan

        spec = replicas_of_plan(plan.to_dict(), plan.micro_batches, get_preset(plan.model).n_total_layers)
        cfg = dc_replace(cfg, replicas=spec, stages=sum(len(r.stages) for r in plan.replicas))
    elif plan.replicas:  # one replica is one pipeline: the runtime runs it as one
        plan.replicas = []
    return plan, cfg


def default_out(now: float | None = None) -> str:
    """``runs/demo-YYYYmmdd-HHMMSS`` (a fresh folder per run)."""
    return time.strftime("runs/demo-%Y%m%d-%H%M%S", time.localtime(now))


def fidelity(achieved: float | None, reference: float | None) -> float | None:
    """``achieved / reference`` (None if either is missing)."""
    return achieved / reference if achieved is not None and reference else None


# --------------------------------------------------------------------------- the run


class _Terminate(Exception):
    """SIGTERM/SIGHUP received: unwind like Ctrl-C so every child is killed."""


def _raise_terminate(signum, _frame):
    raise _Terminate(f"signal {signum}")


def _stage_params(model: str, layers: list[tuple[int, int]]) -> list[int]:
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model

    prof = profile_model(get_preset(model), 8, 1, 4)
    return [int(prof.param_bytes(a, b) // 4) for a, b in layers]


class _Display:
    """The live display: rich Live on a terminal, a line per step otherwise, nothing when quiet."""

    def __init__(self, state, console, quiet: bool):
        self.state, self.console, self.quiet = state, console, quiet
        self.tty = console.is_terminal and not quiet
        self.live = None

    def __enter__(self):
        if self.tty:
            from rich.live import Live

            self.live = Live(get_renderable=self.state.table, console=self.console, refresh_per_second=4,
                             transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None

    def record(self, rec: dict) -> None:
        self.state.update(rec)
        if self.tty or self.quiet:
            return
        st, ev = self.state, rec.get("event", "step")
        if ev == "step" and "step" in rec:
            per = " ".join(f"s{i}:{n}" for i, n in enumerate(st.workers_per_stage()))
            self.console.print(
                f"step {rec['step'] + 1}/{st.total_steps}  loss {rec.get('loss', float('nan')):.4f}  "
                f"{rec.get('tokens_per_s', 0):.0f} tok/s  workers {per}  re-queued {st.requeued}  "
                f"lost {st.workers_lost}  joined {st.workers_joined}", highlight=False, soft_wrap=True)
        elif ev in ("kill", "join", "leave") and st.step is not None:
            self.console.print(f"  {ev} {rec.get('device')}", highlight=False, soft_wrap=True)


def _optim_overrides(given: dict | None) -> dict:
    """The optimizer flags the user gave (shared workload flags), as LaunchConfig fields."""
    return {k: v for k, v in (given or {}).items() if k in ("lr", "min_lr", "warmup", "weight_decay", "grad_clip")}


def run_demo(cfg: DemoConfig, console=None) -> Path:
    """Run the demo; return the report folder. See the module docstring."""
    import resource

    from rich.console import Console

    from shoal.demo.emulated import emulation_spec, swarm_churn
    from shoal.demo.live import LiveState
    from shoal.demo.report import build_report, load_run, print_summary, write_report
    from shoal.emulate.churn import churn_schedule
    from shoal.plan.scenario import load_scenario, save_scenario
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    cfg.validate()
    console = console or Console()
    written = load_scenario(cfg.scenario)
    sc, notes = demo_scenario(written, cfg.workers, cfg.max_workers, cfg.workload)
    stages = min(cfg.stages, len(sc.workers)) if cfg.stages else None  # None: --sync auto chooses
    if cfg.replicas:
        from dataclasses import replace as dc_replace

        from shoal.model.config import get_preset
        from shoal.runtime.sync.replicas import parse_replicas, resolve_replicas

        n_layers = get_preset(sc.workload.model).n_total_layers
        cfg = dc_replace(cfg, replicas=resolve_replicas(cfg.replicas, sc.workload.micro_batches, n_layers))
        stages = sum(parse_replicas(cfg.replicas, sc.workload.micro_batches, n_layers)[0])
        if stages > len(sc.workers):
            raise ShoalError(f"--replicas {cfg.replicas} has {stages} stages and the scenario {len(sc.workers)} "
                             "workers: every stage needs a worker")
    out = Path(cfg.out or default_out())
    if out.exists() and any(out.iterdir()):
        raise ShoalError(f"run folder {out} exists and is not empty; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    scen_path = out / "scenario.json"
    save_scenario(sc, scen_path)
    spec = emulation_spec(sc, str(scen_path), model_task_s=cfg.model_task_s, bandwidth_scale=cfg.bandwidth_scale,
                          seed=cfg.seed)
    w = sc.workload
    from shoal.runtime.sync.codecs import parse_run_compression

    asked, by_hand = cfg.sync, bool(cfg.replicas)
    plan, cfg = choose_sync(cfg, spec.emulated, stages)
    stages = cfg.stages
    from shoal.plan.auto import act_note, lean_note, overlap_note, quality_note

    for note in (quality_note(plan.sync), act_note(plan.sync), lean_note(plan.sync), overlap_note(plan.sync)):
        if note is not None:
            notes.append(note)  # what the chosen codecs and delayed application measurably cost
    if stages > len(sc.workers):
        raise ShoalError(f"the plan has {stages} stages and the scenario {len(sc.workers)} workers: every "
                         "stage needs a worker")
    sync_text = _sync_text(cfg, asked, by_hand)
    compression = parse_run_compression(cfg.compression)
    codec = compression.wire("act")  # the computed byte estimate's codec (the counted bytes are exact)
    if not cfg.quiet:
        console.print(f"[bold]shoal demo[/bold]: scenario {written.name} -- {len(sc.workers)} workers in "
                      f"{len({d.region for d in sc.workers})} regions, {len(sc.server_hosts)} server hosts; "
                      f"model {w.model}, {stages} stages, {cfg.steps} steps, churn {'on' if cfg.churn else 'off'}, "
                      f"sync {sync_text}, compression {cfg.compression}; run folder {out}",
                      highlight=False, soft_wrap=True)
        for n in notes:
            console.print(f"  note: {n}", highlight=False, soft_wrap=True)
        console.print(f"  planner: {_plan_line(plan)}; predicted step {plan.predicted_step_time_s:.2f} s "
                      f"(time scale: devices x{spec.speedup:.2e}, bandwidth x{cfg.bandwidth_scale:g}); "
                      f"{plan.predicted.get('flop_share', 0.0):.1%} of the emulated swarm's FLOP limit, "
                      f"{int(plan.predicted.get('devices_used', 0))}/{int(plan.predicted.get('devices_available', 0))} "
                      "devices used", highlight=False, soft_wrap=True)
    lc = LaunchConfig(
        out=str(out), model=w.model, stages=stages, workers=len(sc.workers), steps=cfg.steps,
        micro_batches=w.micro_batches, micro_batch_size=w.micro_batch_size, seq_len=w.seq_len, seed=cfg.seed,
        **{"warmup": max(1, min(10, cfg.steps // 5)), **_optim_overrides(cfg.workload)}, data=tuple(cfg.data), ordered_grads=False, ckpt_every=CKPT_EVERY,
        dead_after_s=DEAD_AFTER_S,
        compression=compression.text(), timeout_s=cfg.timeout_s, scenario=str(scen_path),
        emulate_speedup=spec.speedup, bandwidth_scale=cfg.bandwidth_scale, dashboard=cfg.dashboard,
        tensorboard=cfg.tensorboard,
        sync=cfg.sync, sync_every=cfg.sync_every or DEFAULT_SYNC_EVERY, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
        overlap=cfg.overlap, lean=cfg.lean, shadow=cfg.shadow, replicas=_replica_plan_file(plan, out) if cfg.replicas else "")
    state = LiveState(total_steps=cfg.steps)
    display = _Display(state, console, cfg.quiet)
    if not cfg.churn:
        schedule = []
    elif cfg.schedule is not None:
        schedule = list(cfg.schedule)
    else:
        schedule = churn_schedule(sc, 3600.0, seed=cfg.seed)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    old = {s: signal.signal(s, _raise_terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C stops the demo even when started with SIGINT ignored (a shell's background job
    # inherits that), as it stops `shoal train --local`.
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    driver, t_churn, failed = None, None, None
    t_start = time.time()
    try:
        with Swarm(lc, on_event=display.record) as swarm, display:
            try:
                swarm.start()
                if swarm.dashboard_url:
                    console.print(f"  dashboard: {swarm.dashboard_url}", highlight=False, soft_wrap=True)
                deadline = time.time() + cfg.timeout_s
                while swarm.coord.poll() is None:
                    if time.time() > deadline:
                        raise ShoalError(f"the run did not finish within {cfg.timeout_s:.0f} s; see {out / 'logs'}")
                    swarm.poll_records()
                    if driver is None and schedule and state.step is not None \
                            and state.step >= cfg.churn_after_step:
                        t_churn = time.time()
                        driver = swarm_churn(swarm, spec, schedule, out, t0_unix=swarm.t0,
                                             min_live=stages).start()
                    time.sleep(0.2)
            finally:
                if driver is not None:
                    driver.stop()  # before the processes go: no restart after the kill-all
            swarm.wait(timeout_s=60)
    except (KeyboardInterrupt, _Terminate) as exc:
        failed = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"terminated ({exc})"
    except ShoalError as exc:
        failed = str(exc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    host_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    metrics, events, _ = load_run(out)
    extra = _analyse(cfg, sc, spec, plan, metrics, events, driver, t_churn, codec)
    extra.update(host_cpu_s=host_cpu, demo_wall_s=time.time() - t_start,
                 notes=notes, failed=failed, sync_choice={
                     "asked": asked, "ran": sync_text, "compression": cfg.compression, "replicas": cfg.replicas,
                     "by": "hand" if by_hand else "auto" if asked == "auto" else "flags"})
    if failed is None:
        try:
            from shoal.train.generate import generate_text

            extra["sample_text"] = generate_text(out, "", cfg.sample_tokens, 0.8, 0, cfg.seed)
        except Exception as exc:  # noqa: BLE001 -- a missing sample must not lose the report
            extra["sample_text"] = f"(no sample: {exc})"
    runtime_summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    extra = prefer_measured_bytes(runtime_summary, extra)
    _merge_summary(out / "summary.json", extra)
    folder = write_report(out)
    rep = build_report(*load_run(out))
    print_summary(rep, None, console=console)
    # The path on a line of its own, never wrapped or cut, so it can be copied (and parsed).
    print(f"report: {folder}", flush=True)
    if failed is not None:
        raise ShoalError(f"the demo stopped early ({failed}); what ran is in {out} (logs in {out / 'logs'}), "
                         f"partial report in {folder}")
    return folder


DEAD_AFTER_S = 3.0  # LaunchConfig.dead_after_s (the runtime's default): a killed worker's tasks return after this
CKPT_EVERY = 5  # stage servers checkpoint every 5 steps (the demo kills workers, not servers)


def _replica_plan_file(plan, out: Path) -> str:
    """The replica plan as a plan file in the run folder (``--replicas`` reads its shape and the
    coordinator its worker placement: the devices the planner put on each stage)."""
    import json

    path = out / "replica_plan.json"
    path.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return str(path)


def _sync_text(cfg: DemoConfig, asked: str, by_hand: bool = False) -> str:
    """The policy and shape that run, e.g. ``local H=4, replicas 1:3,1:5 (auto: the planner's choice)``."""
    text = f"local H={cfg.sync_every or DEFAULT_SYNC_EVERY}" if cfg.sync == "local" else cfg.sync
    text += f", replicas {cfg.replicas}" if cfg.replicas else \
        f", one pipeline of {cfg.stages} stage{'s' if cfg.stages != 1 else ''}"
    text += ", lean workers" if cfg.lean and cfg.sync == "local" else ""
    if by_hand:
        return f"{text} (replicas given by hand)"
    return f"{text} (auto: the planner's choice)" if asked == "auto" else text


def _plan_line(plan) -> str:
    if plan.replicas:
        return "; ".join(f"replica {r} ({rep.micro_batches} micro-batches): " + ", ".join(
            f"layers [{s.layers[0]},{s.layers[1]}) server {s.server} {len(s.workers)} workers" for s in rep.stages)
            for r, rep in enumerate(plan.replicas))
    return "; ".join(f"stage {i} layers [{s.layers[0]},{s.layers[1]}) server {s.server} {len(s.workers)} workers"
                     for i, s in enumerate(plan.stages))


def prefer_measured_bytes(runtime_summary: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Keep the runtime's counted bytes in ``bytes`` when it has them (pure).

    The runtime counts every RPC's serialized bytes (``bytes_method`` starting with
    "counted"); the demo's computed estimate then moves to ``bytes_computed`` (with its
    method in ``bytes_computed_method``) instead of overwriting the measurement.
    """
    if not str(runtime_summary.get("bytes_method", "")).startswith("counted") or not runtime_summary.get("bytes"):
        return extra
    out = dict(extra)
    if "bytes" in out:
        out["bytes_computed"] = out.pop("bytes")
        out["bytes_computed_method"] = out.pop("bytes_method", None)
    out.pop("bytes_method", None)
    if isinstance(out.get("codecs"), dict):
        out["codecs"] = {**out["codecs"], "control": "raw"}
    return out


def _merge_summary(path: Path, extra: dict[str, Any]) -> None:
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update({k: v for k, v in extra.items() if v is not None or k not in summary})
    path.write_text(json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")


def _analyse(cfg: DemoConfig, sc, spec, demo_plan, metrics, events, driver, t_churn, codec) -> dict[str, Any]:
    """Predictions for the plan that ran (cost model, simulator without and with the churn that happened)."""
    from dataclasses import replace as dc_replace

    from shoal.demo.report import achieved_step_time
    from shoal.plan.cost import predict
    from shoal.sim.config import SimConfig
    from shoal.sim.engine import simulate

    w = sc.workload
    hosts = [d.id for d in sc.server_hosts]
    plan = runtime_plan(events, spec.workers, hosts, w.model, sc.name, w.micro_batch_size, w.micro_batches) \
        or demo_plan
    from shoal.runtime.sync.codecs import parse_run_compression

    plan.sync = demo_plan.sync if demo_plan.sync.local == (cfg.sync == "local") else run_policy(
        cfg, parse_run_compression(cfg.compression))
    res: dict[str, Any] = {"scenario": sc.name, "model": w.model, "codecs": {}, "compression": cfg.compression,
                           "demo_plan": demo_plan.to_dict(), "speedup": spec.speedup,
                           "bandwidth_scale": cfg.bandwidth_scale, "model_task_s": cfg.model_task_s}
    try:
        predict(plan, spec.emulated)
    except Exception as exc:  # noqa: BLE001 -- the report shows n/a
        res["predict_error"] = repr(exc)
    res["plan"] = plan.to_dict()
    res["predicted_step_time_s"] = plan.predicted_step_time_s
    n = max(2, len(metrics) or cfg.steps)
    # As the runtime behaves: a worker awaits the server's reply to each result before it
    # leases again (blocking sends), and a silent worker's tasks go back after dead_after_s.
    simcfg = SimConfig(lease_timeout_s=DEAD_AFTER_S, blocking_sends=True)
    try:
        base = simulate(plan, spec.emulated, steps=n, seed=cfg.seed, config=simcfg)
        sim_plain = _sim_step(base.step_times_s)
        res["simulated_no_churn_step_time_s"] = sim_plain
        res["simulated_step_time_s"] = sim_plain
        done = [e for e in (driver.done if driver is not None else []) if e[3]]
        res["churn"] = {"replayed": len(done), "kills": sum(1 for e in done if e[2] == "leave"),
                        "joins": sum(1 for e in done if e[2] == "join")} if cfg.churn else "off"
        if done:
            # Driver time 0 = step 0 committed (observed), which is the simulator's step-0 end.
            trace = churn_trace(driver.done, base.step_times_s[0])
            churned = dc_replace(spec.emulated, churn=dc_replace(spec.emulated.churn, enabled=True, trace=trace))
            with_churn = simulate(plan, churned, steps=n, churn=True, seed=cfg.seed, config=simcfg)
            res["simulated_step_time_s"] = _sim_step(with_churn.step_times_s)
    except Exception as exc:  # noqa: BLE001
        res["simulate_error"] = repr(exc)
    achieved = achieved_step_time(metrics)
    res["achieved_step_time_s"] = achieved
    res["fidelity"] = {"achieved_over_simulated": fidelity(achieved, res.get("simulated_step_time_s")),
                       "achieved_over_predicted": fidelity(achieved, res.get("predicted_step_time_s"))}
    if plan is not None and metrics:
        from shoal.model.config import get_preset

        layers = [tuple(s.layers) for s in plan.stages]
        # metrics name workers by process (w3); the plan by the device that process plays
        named = [{**m, "tasks_per_worker": {_device_of(k, spec.workers): v
                                            for k, v in (m.get("tasks_per_worker") or {}).items()}}
                 for m in metrics]
        traffic = traffic_bytes(named, plan, w.micro_batch_size * w.seq_len, get_preset(w.model).d_model,
                                _stage_params(w.model, layers), codec)
        res["bytes"] = traffic
        res["bytes_method"] = "computed from committed steps and task counts (lower bound), exact codec sizes"
        comp = parse_run_compression(cfg.compression)
        res["codecs"] = {"activations": comp.wire("act"), "activation_grads": comp.wire("grad"),
                         "grad_push": comp.wire("push"), "weight_pull": comp.wire("pull")}
    return res


def _sim_step(times: list[float]) -> float | None:
    """Mean simulated step time with step 0 left out, as the achieved time is measured."""
    body = times[1:] if len(times) > 1 else times
    return statistics.fmean(body) if body else None


# --------------------------------------------------------------------------- command line


def register(subparsers) -> None:
    """Add ``shoal demo``."""
    from shoal.train.flags import Workload as FlagWorkload
    from shoal.train.flags import add_data_args, add_tensorboard_arg, add_workload_args

    d = DemoConfig()
    p = subparsers.add_parser(
        "demo", help="train on an emulated internet swarm on this machine and write a report",
        description="Run a built-in (or given) scenario of home GPUs as local processes that emulate their "
                    "links and speeds, with churn; show live progress; write a report folder.")
    p.add_argument("--scenario", default=d.scenario, metavar="NAME_OR_FILE",
                   help=f"built-in scenario or scenario file (default {d.scenario})")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help=f"worker processes (default: every worker device, at most {d.max_workers})")
    p.add_argument("--no-churn", action="store_true", help="no worker kills/restarts")
    p.add_argument("--compression", default=d.compression, metavar="SPEC",
                   help="wire codecs in the run spec: one for every kind (none, fp16, int8) or per kind, e.g. "
                        "act=int8,grad=int8,push=topk-int8:0.1,pull=int8; sparse or lowrank: sparse or low-rank pushes "
                        "and pulls for --sync local (docs/sync-codecs.md)")
    p.add_argument("--out", default=None, metavar="DIR", help="run folder (default runs/demo-YYYYmmdd-HHMMSS)")
    scen = "the scenario's workload"
    add_workload_args(p, defaults=FlagWorkload(steps=d.steps), shown={
        "model": scen, "micro_batches": scen, "micro_batch_size": scen, "seq_len": scen,
        "warmup": "steps/5, at most 10"})
    add_data_args(p, runtime=True, init_from=False)
    add_tensorboard_arg(p)
    p.add_argument("--quiet", action="store_true", help="no live display; print only the summary")
    p.add_argument("--dashboard", default=d.dashboard, metavar="HOST:PORT",
                   help="where the coordinator serves the live web dashboard (default: loopback, any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="no web dashboard")
    p.add_argument("--stages", type=int, default=None, metavar="S",
                   help="one pipeline of S stages (default: under --sync auto the planner's choice of one pipeline "
                        f"of any depth or pipeline replicas; under exact or local {DEFAULT_STAGES})")
    p.add_argument("--replicas", default="", metavar="SPEC",
                   help="run pipeline replicas given by hand in local mode (each replica's stage count, e.g. 1,2; "
                        "sets the stages; --sync auto then runs local mode; docs/replicas.md)")
    p.add_argument("--task-time", type=float, default=d.model_task_s, metavar="S",
                   help="emulated seconds the slowest device takes for a whole-model forward+backward "
                        f"of one micro-batch (default {d.model_task_s}); sets the time scale")
    p.add_argument("--bandwidth-scale", type=float, default=d.bandwidth_scale, metavar="X",
                   help=f"multiply every scenario bandwidth by X (default {d.bandwidth_scale:g}: the tiny model's "
                        "weight sync over home uplinks in about a second; 1: the scenario's links as written)")
    p.add_argument("--shadow", action="store_true",
                   help="shadow workers (exact sync; --sync auto becomes exact): run no model, wait each "
                        "device's task time and send fixed tensors of the true shapes (the servers and coordinator do their real work; losses are meaningless)")
    from shoal.train.outer import add_sync_args

    add_sync_args(p, auto=True)
    p.set_defaults(func=run_demo_cmd)


def run_demo_cmd(args: argparse.Namespace) -> int:
    """Entry of ``shoal demo``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shoal.train.flags import given_workload

    given = given_workload(args)
    d = DemoConfig()
    cfg = DemoConfig(scenario=args.scenario, steps=given.pop("steps", d.steps), workers=args.workers,
                     churn=not args.no_churn, compression=args.compression, out=args.out,
                     seed=given.pop("seed", d.seed), quiet=args.quiet, stages=args.stages,
                     model_task_s=args.task_time, bandwidth_scale=args.bandwidth_scale, workload=given or None,
                     dashboard=None if args.no_dashboard else args.dashboard,
                     data=tuple(args.data or ("corpus",)), sync=args.sync, sync_every=args.sync_every,
                     outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, overlap=args.overlap,
                     lean=args.lean, tensorboard=args.tensorboard,
                     shadow=args.shadow, replicas=args.replicas)
    if cfg.shadow and cfg.sync == "auto":
        cfg.sync = "exact"  # (shadow workers hold no weights to keep local mode's replicas)
    run_demo(cfg)
    sys.stdout.flush()
    return 0
