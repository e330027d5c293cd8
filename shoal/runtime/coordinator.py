"""The coordinator: membership, planning, step commit, run records.

* Members join (servers with their address, workers with their measured FLOP/s) and
  heartbeat; one silent for ``dead_after_s`` is dead. A dead worker is removed and the
  worker->stage assignment repaired; a dead server leaves its stage vacant until a
  replacement joins, which restores the stage's newest checkpoint. Then every server
  rolls back to the newest version all stages can restore (a new *epoch*), and the run
  replays deterministically from there.
* Stages: layer ranges from the planner when it is installed (``shoal.plan``), else an
  even split; workers are assigned to stages in proportion to capacity. The planner
  sees loopback links and measured FLOP/s, or, when the processes emulate a scenario,
  that scenario's devices and network (see :mod:`shoal.runtime.planning`).
* Step commit: each server reports its squared gradient norm (the last stage also its M
  losses); when all S stages have reported step t, the coordinator computes the global
  clip coefficient and the step's learning rate, answers them all, and writes the
  metrics record.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.channel import ChannelFactory, make_server
from shoal.net.traffic import BYTES_METHOD, merge_traffic
from shoal.net.wire import decode_tensor
from shoal.runtime.common import (
    assign_workers,
    even_split,
    initial_scale,
    loss_scaling,
    model_config,
    optim_config,
    run_precision,
)
from shoal.runtime.planning import loopback_device, planning_scenario, played_device
from shoal.train.metrics import JsonlWriter, step_record
from shoal.train.optim import clip_coefficient, lr_at
from shoal.train.precision import next_loss_scale, overflowed

log = logging.getLogger("shoal.coordinator")


@dataclass
class Member:
    member_id: str
    role: str
    name: str
    address: str = ""
    flops: float = 0.0
    device: str = ""  # emulated runs: the scenario device this member plays
    last_seen: float = field(default_factory=time.monotonic)
    version: int = -1
    ckpt_version: int = -1
    epoch: int = 0


def plan_stages(n_total_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layer ranges of the stages (even split by layer count)."""
    return even_split(n_total_layers, stages)


class Coordinator(pbg.CoordinatorServicer):
    """Run state and RPC handlers of the coordinator."""

    def __init__(self, spec: pb.RunSpec, token: str, *, min_workers: int = 1, out: str | None = None,
                 emulated=None):
        self.spec, self.token, self.min_workers = spec, token, max(min_workers, 1)
        self.emulated = emulated  # the scaled scenario the processes emulate (None: plain run)
        self.cfg = model_config(spec)
        self.layers = plan_stages(self.cfg.n_total_layers, spec.stages)
        self.costs = [float(b - a) for a, b in self.layers]
        self.members: dict[str, Member] = {}
        self.stage_server: list[str] = [""] * spec.stages  # member id per stage
        self.assign: dict[str, int] = {}
        self.devices: dict = {}  # member id -> scenario Device, every member ever planned
        self.plays: dict[str, str] = {}  # member id -> emulated device id, every member ever
        self.plan = None  # the planner's plan (None: even split)
        self.planned: set[str] = set()  # devices the plan has seen
        self.ids = itertools.count()
        self.ready = False
        self.epoch = 0
        self.restart_version = 0
        self.pending_restore = False
        self.committed = 0  # steps committed
        self.reports: dict[tuple[int, int], dict[int, pb.StepReport]] = {}
        self.decisions: dict[tuple[int, int], pb.StepDecision] = {}
        # fp16: (loss scale, consecutive good steps) at the start of each step; decided here
        # once per step and sent to every stage with the step's decision.
        self.scale_at: dict[int, tuple[float, int]] = {0: (initial_scale(spec), 0)}
        self.cond = asyncio.Condition()
        self.done = False
        self.finished = asyncio.Event()
        self.out = Path(out) if out else None
        self.t0 = time.time()
        self.last_commit_t = time.time()
        self.metrics = JsonlWriter(self.out / "metrics.jsonl", self.t0) if self.out else None
        self.events = JsonlWriter(self.out / "events.jsonl", self.t0) if self.out else None
        self.written_steps: set[int] = set()
        self.names: dict[str, str] = {}  # member id -> name, kept after members leave
        self.history: list[dict] = []
        self.total_requeues = 0
        self.tasks_per_worker: dict[str, int] = {}
        self.traffic: dict[str, tuple[str, list]] = {}  # process counter id -> (role, newest counts)

    def event(self, name: str, **fields) -> None:
        log.info("event %s %s", name, fields)
        if self.events:
            self.events.event(name, **fields)

    # ------------------------------------------------------------------ membership
    async def Join(self, request, context):
        if request.schema and request.schema != 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"schema version {request.schema} not supported (want 1)")
        if request.role not in ("server", "worker"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be server or worker")
        if self.emulated is not None and request.device not in {d.id for d in self.emulated.devices}:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"this run emulates scenario {self.emulated.name}: join with "
                                f"--emulate-device set to one of its devices (got {request.device!r})")
        mid = f"{request.role[0]}{next(self.ids)}-{request.name or request.role}"
        m = Member(mid, request.role, request.name or mid, address=request.address,
                   flops=max(request.flops, 1.0), device=request.device)
        if self.emulated is not None:
            self.plays[mid] = m.device
        self.members[mid] = m
        self.names[mid] = m.name
        if m.role == "server":
            self.event("join", device=m.name, role="server")
            self._fill_vacancies()
        else:
            self.event("join", device=m.name, role="worker", flops=m.flops)
            if self.ready:
                self._replan("join")
        self._check_ready()
        return pb.JoinReply(member_id=mid, spec=self.spec)

    def _fill_vacancies(self) -> None:
        """Give each vacant stage a standby server (one without a stage), oldest first.

        A server taking over a stage after the run started restores that stage's newest
        checkpoint, and the whole run rolls back to a version every stage can restore.
        """
        standby = [mid for mid, m in self.members.items()
                   if m.role == "server" and mid not in self.stage_server]
        for s, sid in enumerate(self.stage_server):
            if sid or not standby:
                continue
            mid = standby.pop(0)
            self.stage_server[s] = mid
            self.event("assign", device=self.members[mid].name, role="server", stage=s)
            if self.ready or self.committed > 0 or self.epoch > 0:
                self.pending_restore = True
                self.event("server_restart", device=self.members[mid].name, stage=s)

    def _check_ready(self) -> None:
        workers = [m for m in self.members.values() if m.role == "worker"]
        if not self.ready and all(self.stage_server) and len(workers) >= max(self.min_workers, self.spec.stages):
            self._initial_plan()
            self.ready = True
            self.last_commit_t = time.time()  # step 0's time starts when the swarm is complete

    def _device(self, m: Member):
        """The planner device of a member: the scenario device it plays, else loopback."""
        if self.emulated is not None:
            return played_device(self.emulated, m.member_id, m.role, m.device)
        return loopback_device(m.member_id, m.role, m.flops)

    def _scenario(self):
        """Every member ever planned, on the emulated network (or loopback), training the spec."""
        from shoal.plan.types import Workload

        workload = Workload(model=self.spec.model, seq_len=self.spec.seq_len,
                            global_batch=self.spec.micro_batches * self.spec.micro_batch_size,
                            micro_batch_size=self.spec.micro_batch_size, dtype_bytes=4)
        return planning_scenario(self.devices, workload, self.emulated, self.plays)

    def _initial_plan(self) -> None:
        """Plan the devices that actually joined: layer ranges, stage servers, workers."""
        for m in self.members.values():
            self.devices[m.member_id] = self._device(m)
        try:
            from shoal.plan import make_plan

            plan = make_plan(self._scenario(), method="shoal", seed=int(self.spec.seed),
                             stages=self.spec.stages)
            self.layers = [tuple(st.layers) for st in plan.stages]
            self.stage_server = [st.server for st in plan.stages]
            self.assign = {w: i for i, st in enumerate(plan.stages) for w in st.workers}
            self.plan, self.planned = plan, set(self.devices)
            method = "shoal"
        except Exception as exc:  # the even split always works; say why the planner did not
            log.warning("planner failed (%s); using an even split", exc)
            self.plan, method = None, f"even split ({exc})"
        self.costs = [float(b - a) for a, b in self.layers]
        self._replan("start", method=method)

    def _replan(self, why: str, method: str | None = None) -> None:
        """Repair the worker->stage assignment after a join or leave (layers stay fixed)."""
        live = {mid for mid, m in self.members.items() if m.role == "worker"}
        if method is None and self.plan is not None:
            for mid in live:
                self.devices.setdefault(mid, self._device(self.members[mid]))
            try:
                from shoal.plan.repair import repair

                servers = {mid for mid, m in self.members.items() if m.role == "server"}
                gone = [d for d in self.planned if d not in live and d not in servers]
                joined = [d for d in live if d not in self.planned]
                plan = repair(self.plan, self._scenario(), left=gone, joined=joined,
                              seed=int(self.spec.seed))
                if len(plan.stages) != self.spec.stages:
                    raise ValueError(f"repair changed the stage count to {len(plan.stages)}")
                self.plan, self.planned = plan, set(self.planned) | set(joined)
                self.assign = {w: i for i, st in enumerate(plan.stages) for w in st.workers
                               if w in live}
                method = "repair"
            except Exception as exc:
                log.warning("plan repair failed (%s); balancing by capacity", exc)
                method = f"balance ({exc})"
        flops = {mid: self.members[mid].flops for mid in live}
        # Workers the plan left out still help: in a task pool an extra worker only takes
        # tasks when it is free, so it is placed where capacity per unit of work is lowest.
        new = assign_workers(flops, self.costs, self.assign)
        changed = new != self.assign or why == "start"
        self.assign = new
        if changed:
            self.event("replan", why=why, method=method or "balance",
                       layers=[list(x) for x in self.layers],
                       assignment={self.members[w].name: s for w, s in new.items()})
        empty = [s for s in range(self.spec.stages) if s not in new.values()]
        if empty:
            # Nothing to take a worker from (every other stage has one): wait for a join.
            self.event("waiting", stages_without_workers=empty, workers=len(live))

    def _stage_of(self, m: Member) -> int:
        if not self.ready:
            return -1  # stages are fixed by the plan made when the run starts
        if m.role == "server":
            return self.stage_server.index(m.member_id) if m.member_id in self.stage_server else -1
        return self.assign.get(m.member_id, -1) if self.ready else -1

    def _servers(self) -> list[str]:
        return [self.members[sid].address if sid in self.members else "" for sid in self.stage_server]

    async def Heartbeat(self, request, context):
        if request.counter_id:
            # Cumulative per process: the newest snapshot replaces the older one, and one
            # that outlives its member (killed, or re-joined under a new id) still counts.
            self.traffic[request.counter_id] = (request.role or "?", list(request.traffic))
        m = self.members.get(request.member_id)
        if m is None:
            return pb.Assignment(known=False, done=self.done)
        m.last_seen = time.monotonic()
        if m.role == "server":
            m.version, m.ckpt_version, m.epoch = request.version, request.ckpt_version, request.epoch
            self._maybe_restore()
        stage = self._stage_of(m)
        a = pb.Assignment(known=True, stage=stage, servers=self._servers(),
                          ready=self.ready and not self.pending_restore, epoch=self.epoch,
                          restart_version=self.restart_version, done=self.done)
        if stage >= 0:
            a.first, a.last = self.layers[stage]
        return a

    def _maybe_restore(self) -> None:
        """Once every stage has a server that reported its checkpoints, roll back."""
        if not self.pending_restore or not all(self.stage_server):
            return
        servers = [self.members[sid] for sid in self.stage_server]
        if any(s.ckpt_version < 0 for s in servers):
            return
        target = min(s.ckpt_version for s in servers)
        self.epoch += 1
        self.restart_version = target
        self.pending_restore = False
        self.reports.clear()
        self.event("rollback", epoch=self.epoch, version=target, committed=self.committed)
        self.committed = target
        self.last_commit_t = time.time()

    async def Leave(self, request, context):
        m = self.members.pop(request.member_id, None)
        if m:
            self._drop(m, "leave")
        return pb.Empty()

    def _drop(self, m: Member, why: str) -> None:
        self.event("leave", device=m.name, role=m.role, why=why, stage=self._stage_of_dropped(m))
        if m.role == "server":
            for s, sid in enumerate(self.stage_server):
                if sid == m.member_id:
                    self.stage_server[s] = ""
            self._fill_vacancies()
        else:
            self.assign.pop(m.member_id, None)
            if self.ready:
                self._replan(why)

    def _stage_of_dropped(self, m: Member) -> int:
        if m.role == "server":
            return self.stage_server.index(m.member_id) if m.member_id in self.stage_server else -1
        return self.assign.get(m.member_id, -1)

    async def reap(self) -> None:
        """Declare members dead after ``dead_after_s`` of silence."""
        while not self.finished.is_set():
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for mid, m in list(self.members.items()):
                # A false server death costs a roll-back, so servers get twice the grace.
                limit = self.spec.dead_after_s * (2 if m.role == "server" else 1)
                if now - m.last_seen > limit:
                    del self.members[mid]
                    self._drop(m, "missed heartbeats")

    # ------------------------------------------------------------------ steps
    async def ReportStep(self, request, context):
        r = request
        if r.epoch != self.epoch:
            return pb.StepDecision(stale=True)
        key = (r.epoch, r.step)
        if key in self.decisions:
            return self.decisions[key]
        self.reports.setdefault(key, {})[r.stage] = r
        if len(self.reports[key]) == self.spec.stages:
            self._decide(key)
            async with self.cond:
                self.cond.notify_all()
        else:
            async with self.cond:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.cond.wait_for(lambda: key in self.decisions or self.epoch != key[0]), 5.0)
        if self.epoch != r.epoch:
            return pb.StepDecision(stale=True)
        return self.decisions.get(key, pb.StepDecision(ready=False))

    def _decide(self, key: tuple[int, int]) -> None:
        reps = self.reports.pop(key)
        step = key[1]
        total = sum(r.sq_norm for r in reps.values())
        ocfg = optim_config(self.spec)
        coef = clip_coefficient(total, ocfg.grad_clip) if math.isfinite(total) else 0.0
        lr = lr_at(step, self.spec.steps, ocfg)
        fp16 = run_precision(self.spec) == "fp16"
        skip = fp16 and overflowed(total)
        scale, good = self.scale_at.get(step, (initial_scale(self.spec), 0))
        if fp16:
            self.scale_at[step + 1] = next_loss_scale(scale, good, skip, loss_scaling(self.spec))
        self.decisions[key] = pb.StepDecision(ready=True, coef=coef, lr=lr, skip=skip,
                                              next_loss_scale=self.scale_at[step + 1][0] if fp16 else 0.0)
        last = reps[self.spec.stages - 1]
        loss = sum(last.losses) / max(len(last.losses), 1)
        tpw: dict[str, int] = {}
        for r in reps.values():
            for w, n in r.tasks_per_worker.items():
                name = self.names.get(w, w)
                tpw[name] = tpw.get(name, 0) + n
        requeues = sum(r.requeues for r in reps.values())
        now = time.time()
        tokens = self.spec.micro_batches * self.spec.micro_batch_size * self.spec.seq_len
        rec = step_record(step, loss, lr, None if skip else math.sqrt(total), tokens, now - self.last_commit_t,
                          now - self.t0)
        if fp16:
            rec["loss_scale"], rec["skipped"] = scale, skip
        rec["tasks_per_worker"] = tpw
        rec["requeues"] = requeues
        rec["epoch"] = key[0]
        self.last_commit_t = now
        self.committed = step + 1
        if step not in self.written_steps:
            self.written_steps.add(step)
            self.history.append(rec)
            self.total_requeues += requeues
            for w, n in tpw.items():
                self.tasks_per_worker[w] = self.tasks_per_worker.get(w, 0) + n
            if self.metrics:
                self.metrics.write(rec)
        log.info("step %d loss %.5f", step, loss)
        if self.committed >= self.spec.steps:
            self._spawn_finish()

    def _spawn_finish(self) -> None:
        if not getattr(self, "_finishing", False):
            self._finishing = True
            asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        """Collect the final weights from every server, write them, then say done."""
        channels = ChannelFactory(self.token)
        weights = {}
        for _ in range(600):
            try:
                weights = {}
                for s in range(self.spec.stages):
                    stub = pbg.StageServerStub(channels.open(self._servers()[s]))
                    while True:
                        rep = await stub.GetWeights(pb.WeightsRequest(worker="coordinator"), timeout=30)
                        if rep.version >= self.spec.steps:
                            break
                        await asyncio.sleep(0.05)
                    for f in rep.params:
                        weights[f.name] = decode_tensor(f, dtype="float32")
                break
            except (grpc.aio.AioRpcError, IndexError, ValueError):
                await asyncio.sleep(0.1)
        if self.out:
            from shoal.runtime.artifacts import write_final

            write_final(self.out, weights, self.cfg, self.spec, self.summary())
        self.final_weights = weights
        self.done = True
        self.event("done", steps=self.committed)
        await asyncio.sleep(max(1.0, 3 * 0.2))  # let members see done in a heartbeat
        if self.out and (self.out / "summary.json").exists():
            # The members' heartbeats since the commit carried their last byte counts.
            path = self.out / "summary.json"
            summary = json.loads(path.read_text())
            summary.update(merge_traffic(self.traffic))
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(summary, indent=1, sort_keys=True))
            tmp.replace(path)
        self.finished.set()

    def summary(self) -> dict:
        losses = [r["loss"] for r in sorted(self.history, key=lambda r: r["step"])]
        times = [r["step_time_s"] for r in self.history]
        tokens = sum(r["tokens"] for r in self.history)
        return {
            "steps": self.committed, "losses": losses, "final_loss": losses[-1] if losses else None,
            "stages": self.spec.stages, "layers": self.layers, "epochs": self.epoch + 1,
            "requeues": self.total_requeues, "tasks_per_worker": self.tasks_per_worker,
            "tokens": tokens, "train_time_s": sum(times),
            "tokens_per_s": tokens / sum(times) if times and sum(times) > 0 else 0.0,
            "wall_time_s": time.time() - self.t0,
            **merge_traffic(self.traffic),
            "bytes_method": BYTES_METHOD,
        }

    async def Status(self, request, context):
        st = {
            "ready": self.ready, "committed": self.committed, "epoch": self.epoch, "done": self.done,
            "servers": self._servers(),
            "workers": {m.name: self.assign.get(mid, -1) for mid, m in self.members.items() if m.role == "worker"},
        }
        return pb.StatusReply(json=json.dumps(st))


async def run_coordinator(spec: pb.RunSpec, token: str, listen: str, *, min_workers: int = 1,
                          out: str | None = None, address_file: str | None = None,
                          emulated=None) -> dict:
    """Serve until the run is done; returns the run summary.

    ``emulated``: the scaled scenario the processes emulate, planned on instead of loopback.
    """
    coord = Coordinator(spec, token, min_workers=min_workers, out=out, emulated=emulated)
    server = make_server(token)
    pbg.add_CoordinatorServicer_to_server(coord, server)
    port = server.add_insecure_port(listen)
    address = f"{listen.rsplit(':', 1)[0]}:{port}"
    await server.start()
    if address_file:
        # The run's clock (events' and metrics' time_s) for the launcher's kill events;
        # written before the address, so it exists once the address does.
        Path(address_file + ".t0").write_text(repr(coord.t0))
        tmp = Path(address_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(address_file)
    log.info("coordinator listening on %s", address)
    reaper = asyncio.create_task(coord.reap())
    await coord.finished.wait()
    reaper.cancel()
    await server.stop(0.5)
    return coord.summary()
