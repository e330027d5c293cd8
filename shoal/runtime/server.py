"""The stage server: master weights + AdamW, task pool with leases, relay, aggregation.

One server owns one stage ``[first, last)``. For the step it is working on it keeps, per
micro-batch, the stage input (relayed by the previous server; stage 0 rebuilds tokens),
the output gradient (relayed by the next server) and the state of two tasks:

* ``fwd`` (non-last stages): ``wait`` (no input yet) -> ``todo`` -> ``leased`` -> ``done``;
* ``grad`` (``BWD`` on non-last stages, ``FWDBWD`` on the last): ``wait`` -> ``todo`` ->
  ``leased`` -> ``computed`` (a worker holds its parameter gradient, not pushed yet) ->
  ``counted`` (summed into the stage gradient, exactly once).

A lease not renewed before its deadline puts its task back to ``todo``; a worker silent
for ``dead_after_s`` loses its un-pushed gradients (its ``computed`` micro-batches go back
to ``todo``, and its *generation* is bumped so anything it still sends is refused).
When all M micro-batches are ``counted``, the server reports its squared gradient norm
to the coordinator, receives the global clip coefficient, applies the shared AdamW step
and starts the next step. Everything the server does happens on one asyncio loop, so
each handler is atomic with respect to the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import grpc
import torch

from shoal.model.transformer import build_stage
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.channel import ChannelFactory, make_server
from shoal.net.traffic import Traffic
from shoal.net.wire import WireError, decode_tensor, encode_tensor
from shoal.runtime.common import (
    SCHEMA_VERSION,
    ewma,
    lease_seconds,
    list_ckpts,
    load_stage_ckpt,
    model_config,
    optim_config,
    run_member,
    save_stage_ckpt,
    set_threads,
)
from shoal.train.optim import apply_update, grad_sq_norm, make_optimizer

log = logging.getLogger("shoal.server")


@dataclass
class MbState:
    """One micro-batch of one step at this stage."""

    input: torch.Tensor | None = None  # stage input (None at stage 0: tokens are rebuilt)
    out_grad: torch.Tensor | None = None  # gradient of the stage output (non-last stages)
    fwd: str = "wait"  # wait | todo | leased | done  (non-last stages only)
    grad: str = "wait"  # wait | todo | leased | computed | counted
    holder: str = ""  # worker holding the grad lease or the computed gradient
    loss: float | None = None  # last stage: the micro-batch loss
    relayed_back: bool = False  # the input gradient went to the previous stage


@dataclass
class Lease:
    lease_id: int
    step: int
    mb: int
    direction: int
    worker: str
    deadline: float
    started: float


@dataclass
class WorkerInfo:
    gen: int = 1  # bumped when the server voids this worker's un-pushed gradients
    last_seen: float = field(default_factory=time.monotonic)
    ewma_s: float | None = None  # task time estimate for lease deadlines


class StageServer(pbg.StageServerServicer):
    """State and RPC handlers of one stage server."""

    def __init__(self, coord: str, listen: str, token: str, ckpt_root: str, *,
                 name: str = "server", dial=None, heartbeat_s: float = 0.2, device: str = ""):
        self.coord_addr, self.listen, self.token = coord, listen, token
        self.ckpt_root, self.name, self.heartbeat_s = ckpt_root, name, heartbeat_s
        self.device = device  # emulated runs: the scenario host this server plays
        self.orphan_after_s = 120.0  # exit when the coordinator is unreachable this long
        self.traffic = Traffic()  # bytes of every call this server makes (relays, coordinator)
        self.channels = ChannelFactory(token, dial=dial, traffic=self.traffic)
        self.member_id = ""
        self.spec: pb.RunSpec | None = None
        self.stage = -1
        self.first = self.last = 0
        self.servers: list[str] = []
        self.epoch = 0
        self.version = -1  # weights hold this many committed steps (-1: not loaded)
        self.step = 0  # step being worked on (== version once loaded)
        self.steps: dict[int, dict[int, MbState]] = {}
        self.pushes: list[tuple[int, dict[str, torch.Tensor]]] = []  # accepted pushes of the step
        self.leases: dict[int, Lease] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.next_lease = 1
        self.loading = False
        self.ready = False
        self.done = False
        self.committing = False
        self.cond = asyncio.Condition()
        self.tasks_per_worker: dict[str, int] = {}
        self.requeues = 0
        self.stats = {"messages": 0, "bytes_in": 0}
        self._bg: set[asyncio.Task] = set()
        self.on_servers = None  # callback(list of stage server addresses), e.g. emulation
        self._stubs: dict[str, pbg.StageServerStub] = {}

    # ------------------------------------------------------------------ setup
    @property
    def is_last(self) -> bool:
        return self.last == self.cfg.n_total_layers

    @property
    def is_first(self) -> bool:
        return self.first == 0

    def _make(self, stage: int, first: int, last: int, version: int):
        """Build stage weights + optimizer at ``version`` (CPU work, run off the event loop)."""
        spec = self.spec
        cfg = model_config(spec)
        module = build_stage(cfg, first, last, seed=spec.seed)
        opt = make_optimizer(module.named_parameters(), optim_config(spec))
        if version > 0:
            load_stage_ckpt(self.ckpt_root, stage, version, module, opt)
        elif spec.init_from:
            from shoal.hf.convert import load_hf_dir

            _, state = load_hf_dir(spec.init_from, names={n for n, _ in module.named_parameters()})
            module.load_state_dict(state, strict=True)
        return cfg, module, opt

    async def _load(self, stage: int, first: int, last: int, version: int, epoch: int) -> None:
        """(Re)load the stage at ``version`` for ``epoch``, keeping heartbeats going meanwhile."""
        self.version = -1
        self.loading = True
        try:
            cfg, module, opt = await asyncio.get_running_loop().run_in_executor(
                None, self._make, stage, first, last, version)
        finally:
            self.loading = False
        if (stage, epoch) != (self.stage, self.epoch):
            return  # superseded while loading
        self.cfg, self.module, self.opt = cfg, module, opt
        self.params = dict(module.named_parameters())
        self.version = version
        self.step = version
        self.steps = {}
        self.pushes = []
        self.committing = False
        self.leases.clear()
        for w in self.workers.values():
            w.gen += 1
        self.act_shape = (self.spec.micro_batch_size, self.spec.seq_len, cfg.d_model)
        self._open_step(self.step)
        log.info("%s serves stage %d [%d,%d) from version %d (epoch %d)", self.name, stage, first, last,
                 version, epoch)
        async with self.cond:
            self.cond.notify_all()

    def _open_step(self, step: int) -> None:
        mbs = self.steps.setdefault(step, {})
        for mb in range(self.spec.micro_batches):
            st = mbs.setdefault(mb, MbState())
            if self.is_first:
                if self.is_last:
                    st.grad = "todo" if st.grad == "wait" else st.grad
                elif st.fwd == "wait":
                    st.fwd = "todo"
        self.tasks_per_worker = {}
        self.requeues = 0

    def _ckpt_version(self) -> int:
        if self.stage < 0:
            return -1
        v = list_ckpts(self.ckpt_root, self.stage)
        return v[-1] if v else 0

    async def start_rpc(self) -> grpc.aio.Server:
        """Start listening (sets ``self.address``); the caller stops the returned server."""
        server = make_server(self.token)
        pbg.add_StageServerServicer_to_server(self, server)
        port = server.add_insecure_port(self.listen)
        host = self.listen.rsplit(":", 1)[0]
        self.address = f"{host}:{port}"
        await server.start()
        return server

    async def run(self) -> None:
        """Serve until the coordinator says the run is done."""
        server = await self.start_rpc()
        coord = pbg.CoordinatorStub(self.channels.open(self.coord_addr))
        self.coord = coord
        reply = await _retry(lambda: coord.Join(pb.JoinRequest(
            role="server", address=self.address, name=self.name, schema=SCHEMA_VERSION,
            ckpt_version=-1, ckpt_stage=-1, device=self.device)))
        self.member_id, self.spec = reply.member_id, reply.spec
        log.info("%s joined as %s at %s", self.name, self.member_id, self.address)
        reaper = asyncio.create_task(self._reaper())
        self.last_coord_ok = time.monotonic()
        try:
            while not self.done:
                await self._heartbeat()
                if time.monotonic() - self.last_coord_ok > self.orphan_after_s:
                    log.warning("%s: coordinator unreachable for %.0f s; exiting", self.name,
                                self.orphan_after_s)
                    break
                await asyncio.sleep(self.heartbeat_s)
        finally:
            reaper.cancel()
            for t in list(self._bg):
                t.cancel()
            await server.stop(0.5)

    async def _heartbeat(self) -> None:
        try:
            a = await self.coord.Heartbeat(pb.MemberRequest(
                member_id=self.member_id, version=self.version, ckpt_version=self._ckpt_version(),
                epoch=self.epoch, counter_id=self.traffic.id, role="server",
                traffic=self.traffic.snapshot()), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat failed: %s", exc.code())
            return
        self.last_coord_ok = time.monotonic()
        if a.done:
            self.done = True
            return
        if not a.known:
            # Declared dead (e.g. starved of CPU): join again as a fresh server.
            log.warning("%s: the coordinator forgot us; joining again", self.name)
            self.stage, self.version, self.ready = -1, -1, False
            reply = await self.coord.Join(pb.JoinRequest(
                role="server", address=self.address, name=self.name, schema=SCHEMA_VERSION,
                device=self.device))
            self.member_id = reply.member_id
            return
        self.servers = list(a.servers)
        if self.on_servers is not None:
            self.on_servers(self.servers)
        if a.stage < 0:
            return
        if self.stage != a.stage or a.epoch != self.epoch:
            self.stage, self.first, self.last = a.stage, a.first, a.last
            self.epoch = a.epoch
            self.ready = False
            self._spawn(self._load(a.stage, a.first, a.last, a.restart_version, a.epoch))
            return
        if a.ready and not self.ready and self.version >= 0:
            self.ready = True
        async with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ pool
    def _worker(self, wid: str) -> WorkerInfo:
        info = self.workers.get(wid)
        if info is None:
            info = self.workers[wid] = WorkerInfo()
        info.last_seen = time.monotonic()
        return info

    def _requeue(self, step: int, mb: int, direction: int) -> None:
        st = self.steps.get(step, {}).get(mb)
        if st is None:
            return
        if direction == pb.FWD:
            if st.fwd == "leased":
                st.fwd = "todo"
        elif st.grad in ("leased", "computed"):
            st.grad, st.holder = "todo", ""
        self.requeues += 1

    def _void_worker(self, wid: str, why: str) -> None:
        """Drop a worker's leases and un-pushed gradients; its micro-batches are redone."""
        info = self.workers.get(wid)
        if info is None:
            return
        info.gen += 1
        for lid, lease in list(self.leases.items()):
            if lease.worker == wid:
                del self.leases[lid]
                self._requeue(lease.step, lease.mb, lease.direction)
        for step, mbs in self.steps.items():
            for mb, st in mbs.items():
                if st.grad == "computed" and st.holder == wid:
                    self._requeue(step, mb, pb.BWD)
        log.info("%s voided worker %s (%s)", self.name, wid, why)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            changed = False
            for lid, lease in list(self.leases.items()):
                if lease.deadline < now:
                    del self.leases[lid]
                    self._requeue(lease.step, lease.mb, lease.direction)
                    changed = True
            for wid, info in list(self.workers.items()):
                if self.spec and now - info.last_seen > self.spec.dead_after_s:
                    self._void_worker(wid, "silent")
                    del self.workers[wid]
                    changed = True
            if changed:
                async with self.cond:
                    self.cond.notify_all()

    def _pick(self, wid: str) -> pb.Task | None:
        """Lease the next task of the current step to ``wid``: gradients first."""
        if not self.ready or self.committing or self.version != self.step:
            return None
        mbs = self.steps.get(self.step, {})
        choice = None
        for mb in sorted(mbs):
            if mbs[mb].grad == "todo":
                choice = (mb, pb.FWDBWD if self.is_last else pb.BWD)
                break
        if choice is None:
            for mb in sorted(mbs):
                if mbs[mb].fwd == "todo":
                    choice = (mb, pb.FWD)
                    break
        if choice is None:
            return None
        mb, direction = choice
        st = mbs[mb]
        info = self._worker(wid)
        secs = lease_seconds(info.ewma_s, self.spec.min_lease_s)
        lid = self.next_lease
        self.next_lease += 1
        now = time.monotonic()
        self.leases[lid] = Lease(lid, self.step, mb, direction, wid, now + secs, now)
        if direction == pb.FWD:
            st.fwd = "leased"
        else:
            st.grad, st.holder = "leased", wid
        task = pb.Task(step=self.step, mb=mb, stage=self.stage, direction=direction,
                       epoch=self.epoch, lease_id=lid, deadline_s=secs)
        if st.input is not None:
            task.input.CopyFrom(encode_tensor("input", st.input))
        if direction == pb.BWD:
            task.out_grad.CopyFrom(encode_tensor("grad", st.out_grad))
        return task

    def _should_flush(self, wid: str) -> bool:
        mbs = self.steps.get(self.step, {})
        if not mbs or not all(st.grad in ("computed", "counted") for st in mbs.values()):
            return False
        return any(st.grad == "computed" and st.holder == wid for st in mbs.values())

    # ------------------------------------------------------------------ RPCs from workers
    async def Lease(self, request, context):
        info = self._worker(request.worker)
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 2.0)
        async with self.cond:
            while True:
                task = self._pick(request.worker)
                flush = self._should_flush(request.worker)
                if task is not None or flush or time.monotonic() >= deadline or self.done:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), deadline - time.monotonic())
        reply = pb.LeaseReply(has_task=task is not None, version=self.version, gen=info.gen,
                              flush=flush, epoch=self.epoch, step=self.step)
        if task is not None:
            reply.task.CopyFrom(task)
        return reply

    def _check_lease(self, r) -> tuple[Lease | None, str]:
        lease = self.leases.get(r.lease_id)
        if r.epoch != self.epoch or r.step != self.step:
            return None, "stale step or epoch"
        if lease is None or lease.worker != r.worker or lease.mb != r.mb or lease.direction != r.direction:
            return None, "no such lease (expired or duplicate)"
        return lease, ""

    async def Complete(self, request, context):
        r = request
        info = self._worker(r.worker)
        self.stats["messages"] += 1
        self.stats["bytes_in"] += len(r.output.data)
        lease, why = self._check_lease(r)
        if lease is None:
            return pb.CompleteReply(accepted=False, reason=why, gen=info.gen)
        st = self.steps[r.step][r.mb]
        try:
            out = None
            if r.direction == pb.FWD or not self.is_first:
                out = decode_tensor(r.output, shape=self.act_shape, dtype="float32", finite=True)
            if r.direction == pb.FWDBWD and not math.isfinite(r.loss):
                raise WireError(f"loss {r.loss} is not finite")
        except WireError as exc:
            del self.leases[r.lease_id]
            self._requeue(r.step, r.mb, r.direction)
            log.warning("%s rejected a result of %s: %s", self.name, r.worker, exc)
            async with self.cond:
                self.cond.notify_all()
            return pb.CompleteReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        del self.leases[r.lease_id]
        info.ewma_s = ewma(info.ewma_s, max(r.compute_s, time.monotonic() - lease.started))
        self.tasks_per_worker[r.worker] = self.tasks_per_worker.get(r.worker, 0) + 1
        if r.direction == pb.FWD:
            st.fwd = "done"
            self._spawn(self._relay(self.stage + 1, pb.Relay(
                step=r.step, mb=r.mb, epoch=self.epoch, direction=pb.FWD,
                tensor=encode_tensor("act", out))))
        else:
            st.grad, st.holder = "computed", r.worker
            if r.direction == pb.FWDBWD:
                st.loss = r.loss
            if not self.is_first and not st.relayed_back:
                st.relayed_back = True
                self._spawn(self._relay(self.stage - 1, pb.Relay(
                    step=r.step, mb=r.mb, epoch=self.epoch, direction=pb.BWD,
                    tensor=encode_tensor("grad", out))))
        async with self.cond:
            self.cond.notify_all()
        return pb.CompleteReply(accepted=True, gen=info.gen)

    async def PushGrads(self, request, context):
        r = request
        info = self._worker(r.worker)
        self.stats["messages"] += 1
        self.stats["bytes_in"] += sum(len(g.data) for g in r.grads)
        mbs = self.steps.get(r.step, {})
        if r.epoch != self.epoch or r.step != self.step or r.gen != info.gen:
            return pb.PushReply(accepted=False, reason="stale push (step, epoch or generation)", gen=info.gen)
        ids = list(r.mbs)
        ok = len(ids) == len(set(ids)) and ids and all(
            mb in mbs and mbs[mb].grad == "computed" and mbs[mb].holder == r.worker for mb in ids)
        if not ok:
            self._void_worker(r.worker, "push for micro-batches it does not hold")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason="push covers micro-batches not held", gen=info.gen)
        try:
            grads = {}
            for g in r.grads:
                if g.name not in self.params or g.name in grads:
                    raise WireError(f"unexpected gradient {g.name!r}")
                grads[g.name] = decode_tensor(g, shape=tuple(self.params[g.name].shape),
                                              dtype="float32", finite=True)
            if len(grads) != len(self.params):
                raise WireError(f"push has {len(grads)} of {len(self.params)} gradients")
        except WireError as exc:
            log.warning("%s rejected a gradient push of %s: %s", self.name, r.worker, exc)
            self._void_worker(r.worker, f"bad push: {exc}")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        # Summed at commit, ordered by micro-batch id: with one micro-batch per push this is
        # exactly the local trainer's sequential sum.
        self.pushes.append((min(ids), grads))
        for mb in ids:
            mbs[mb].grad = "counted"
        if all(st.grad == "counted" for st in mbs.values()) and not self.committing:
            self.committing = True
            self._spawn(self._commit(self.step, self.epoch))
        async with self.cond:
            self.cond.notify_all()
        return pb.PushReply(accepted=True, gen=info.gen)

    async def Renew(self, request, context):
        info = self._worker(request.worker)
        now = time.monotonic()
        secs = lease_seconds(info.ewma_s, self.spec.min_lease_s) if self.spec else 1.0
        for lid in request.lease_ids:
            lease = self.leases.get(lid)
            if lease is not None and lease.worker == request.worker:
                lease.deadline = now + secs
        return pb.RenewReply(version=self.version, epoch=self.epoch)

    async def GetWeights(self, request, context):
        if request.worker != "coordinator":
            self._worker(request.worker)
        if self.version < 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage not loaded yet")
        reply = pb.WeightsReply(version=self.version, epoch=self.epoch, first=self.first, last=self.last)
        for name, p in self.params.items():
            reply.params.append(encode_tensor(name, p.detach()))
        return reply

    async def Leave(self, request, context):
        self._void_worker(request.member_id, "left")
        self.workers.pop(request.member_id, None)
        async with self.cond:
            self.cond.notify_all()
        return pb.Empty()

    # ------------------------------------------------------------------ relay
    async def SubmitRelay(self, request, context):
        r = request
        self.stats["messages"] += 1
        self.stats["bytes_in"] += len(r.tensor.data)
        if self.version < 0 or r.epoch > self.epoch:
            return pb.RelayReply(accepted=False, retry=True, reason="not ready")
        if r.epoch < self.epoch or r.step < self.step:
            return pb.RelayReply(accepted=True, reason="old; dropped")
        if r.step > self.step + 1:
            return pb.RelayReply(accepted=False, retry=True, reason="too far ahead")
        try:
            t = decode_tensor(r.tensor, shape=self.act_shape, dtype="float32", finite=True)
        except WireError as exc:
            return pb.RelayReply(accepted=False, reason=f"rejected: {exc}")
        mbs = self.steps.setdefault(r.step, {})
        if not 0 <= r.mb < self.spec.micro_batches:
            return pb.RelayReply(accepted=False, reason="micro-batch id out of range")
        st = mbs.setdefault(r.mb, MbState())
        if r.direction == pb.FWD:
            if st.input is None:
                st.input = t
                if self.is_last:
                    st.grad = "todo" if st.grad == "wait" else st.grad
                elif st.fwd == "wait":
                    st.fwd = "todo"
        else:
            if st.out_grad is None:
                st.out_grad = t
                if st.grad == "wait":
                    st.grad = "todo"
        async with self.cond:
            self.cond.notify_all()
        return pb.RelayReply(accepted=True)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _stub(self, addr: str) -> pbg.StageServerStub:
        if addr not in self._stubs:
            self._stubs[addr] = pbg.StageServerStub(self.channels.open(addr))
        return self._stubs[addr]

    async def _relay(self, stage: int, msg: pb.Relay) -> None:
        """Send ``msg`` to ``stage``'s server until it is taken or the epoch moves on."""
        while msg.epoch == self.epoch and not self.done:
            addr = self.servers[stage] if stage < len(self.servers) else ""
            if addr:
                try:
                    rep = await self._stub(addr).SubmitRelay(msg, timeout=10)
                    if rep.accepted or not rep.retry:
                        if not rep.accepted:
                            log.warning("relay refused: %s", rep.reason)
                        return
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ step commit
    async def _commit(self, step: int, epoch: int) -> None:
        try:
            mbs = self.steps[step]
            for p in self.params.values():
                p.grad = None
            for _, grads in sorted(self.pushes, key=lambda x: x[0]):
                for name, g in grads.items():
                    p = self.params[name]
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.add_(g)
            report = pb.StepReport(member_id=self.member_id, stage=self.stage, step=step, epoch=epoch,
                                   sq_norm=grad_sq_norm(self.params.values()), requeues=self.requeues)
            if self.is_last:
                report.losses.extend(mbs[mb].loss for mb in sorted(mbs))
            for w, n in self.tasks_per_worker.items():
                report.tasks_per_worker[w] = n
            while True:
                if self.epoch != epoch:
                    return
                try:
                    d = await self.coord.ReportStep(report, timeout=10)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
                    continue
                if self.epoch != epoch or d.stale:
                    return
                if d.ready:
                    break
            apply_update(self.opt, d.lr, d.coef)
            self.version = step + 1
            if self.spec.ckpt_every > 0 and self.version % self.spec.ckpt_every == 0:
                save_stage_ckpt(self.ckpt_root, self.stage, self.version, self.module, self.opt)
            self.steps.pop(step, None)
            self.pushes = []
            self.step = step + 1
            if self.step < self.spec.steps:
                self._open_step(self.step)
        finally:
            if self.epoch == epoch:
                self.committing = False
            async with self.cond:
                self.cond.notify_all()


async def _retry(fn, tries: int = 200, delay: float = 0.1):
    """Call ``fn`` until it succeeds (the peer may still be starting)."""
    for i in range(tries):
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED or i == tries - 1:
                raise
            await asyncio.sleep(delay)
    raise RuntimeError("unreachable")


def serve(coord: str, listen: str, token: str, ckpt_root: str, name: str = "server", *, dial=None,
          on_servers=None, device: str = "") -> None:
    """Run a stage server process until the run is done (``device``: scenario host it plays)."""
    set_threads()
    srv = StageServer(coord, listen, token, ckpt_root, name=name, dial=dial, device=device)
    srv.on_servers = on_servers
    run_member(srv.run(), coord)
