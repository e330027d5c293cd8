"""The worker: leases tasks of its stage, computes them, pushes gradients.

Loop: lease a task (long-poll), make sure its weights are the task's version (pull them
from the server if not), compute in a thread so that the asyncio loop keeps renewing the
leases, return the result. Parameter gradients of accepted backward tasks are summed
locally and pushed, with the micro-batch ids they cover, when the server says the step's
backward pool is complete (``flush``). The server's *generation* number for this worker
tells it when its un-pushed gradients were voided (it was thought dead), so it never
mixes them into a later push.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass

import grpc
import torch

from shoal.errors import ShoalError
from shoal.model.transformer import build_stage
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.channel import ChannelFactory
from shoal.net.compress import ErrorFeedback
from shoal.net.traffic import Traffic
from shoal.net.wire import decode_tensor, encode_tensor
from shoal.runtime.common import (
    SCHEMA_VERSION,
    measure_flops,
    micro_batch,
    model_config,
    run_member,
    set_threads,
)

log = logging.getLogger("shoal.worker")


@dataclass
class WorkerOptions:
    """Knobs of one worker process."""

    name: str = "worker"  # label in events and metrics
    flops: float | None = None  # FLOP/s to report (None: measure at start)
    heartbeat_s: float = 0.2  # lease renewal / coordinator heartbeat period
    lease_wait_s: float = 0.5  # long-poll time of one lease request
    inject: str = ""  # test faults, comma-separated: "nan_grad", "bad_shape" (once each), hang_* (see parse_hangs)
    codec: str = "raw"  # tensor codec for results and pushes
    graph_cache: bool = True  # keep forward graphs to skip the recompute in own backward tasks
    orphan_after_s: float = 120.0  # exit when the coordinator is unreachable this long
    slow_s: float = 0.0  # extra seconds per task (a crude stand-in for a slow device in tests)
    error_feedback: bool = True  # lossy codec: carry each gradient push's quantisation error into the next
    device: str = ""  # emulated runs: the scenario device this worker plays (the coordinator plans on it)


HANG_KINDS = ("hang_fwd", "hang_bwd", "hang_before_push", "hang_mid_push")


def parse_hangs(spec: str) -> dict[str, dict[str, str]]:
    """Test-only faults of ``--inject``: ``hang_<state>[:step=N][:only=FILE][:mark=PATH]`` -> {kind: options}.

    A worker reaching the state (in step ``N`` or later; only if its name is a line of
    ``FILE``, when given) writes a JSON report to ``PATH`` (the first worker to get there
    claims it; others carry on) and then stops
    working while its heartbeats go on, so a test can kill -9 it in exactly that state:
    ``hang_fwd`` / ``hang_bwd`` inside a leased forward / backward task, ``hang_before_push``
    holding accepted gradients it has not pushed, ``hang_mid_push`` after the first of its
    pushes for the step was answered.
    """
    out: dict[str, dict[str, str]] = {}
    for item in spec.split(","):
        kind, *opts = item.split(":")
        if not kind.startswith("hang_"):
            continue
        if kind not in HANG_KINDS or not all("=" in o for o in opts):
            raise ShoalError(f"bad --inject item {item!r}; use {'|'.join(HANG_KINDS)}[:step=N][:only=FILE][:mark=PATH]")
        out[kind] = dict(o.split("=", 1) for o in opts)
    return out


def ordered_groups(per_mb: dict[int, dict[str, torch.Tensor]]) -> list[tuple[list[int], dict]]:
    """Pushes for per-micro-batch gradients that the server can sum in micro-batch order.

    The server computes ``((g_0 + g_1) + g_2) + ...``. A run of micro-batches starting
    at 0 can be pre-summed here in that same order (it is the beginning of the server's
    sum, bitwise), so a worker holding 0..k sends one push for them; every other
    micro-batch goes alone.
    """
    mbs = sorted(per_mb)
    k = 0
    while k < len(mbs) and mbs[k] == k:
        k += 1
    groups: list[tuple[list[int], dict]] = []
    if k > 1:
        total = {n: g.clone() for n, g in per_mb[0].items()}
        for mb in range(1, k):
            for n, g in per_mb[mb].items():
                total[n].add_(g)
        groups.append((list(range(k)), total))
        rest = mbs[k:]
    else:
        rest = mbs
    groups += [([mb], per_mb[mb]) for mb in rest]
    return groups


def task_flops(direction: int, fwd: float, bwd: float, recomputed: bool) -> float:
    """FLOPs a task costs on a device: what the pacer pads it to.

    ``FWD`` is the stage forward, ``FWDBWD`` forward + backward; a ``BWD`` task adds the
    forward only when it was really recomputed (its worker had no cached graph of its own
    forward), which is what the simulator charges.
    """
    if direction == pb.FWD:
        return fwd
    if direction == pb.FWDBWD:
        return fwd + bwd
    return (2 * fwd + bwd) if recomputed else (fwd + bwd)


class Worker:
    """One worker process's state."""

    def __init__(self, coord: str, token: str, opts: WorkerOptions, *, dial=None, pacer=None):
        self.coord_addr, self.opts, self.pacer = coord, opts, pacer
        self.traffic = Traffic()  # bytes of every call this worker makes
        self.channels = ChannelFactory(token, dial=dial, traffic=self.traffic)
        self.inject = {f for f in opts.inject.split(",") if f and not f.startswith("hang_")}
        self.hangs = parse_hangs(opts.inject)  # test faults: stop in a given state (tests kill -9)
        self.stage = -1
        self.first = self.last = 0
        self.want: tuple[int, int, int, str] | None = None  # assignment from the last heartbeat
        self.server_addr = ""
        self.done = False
        self.held: set[int] = set()
        self.version = -1
        self.weights_epoch = -1
        # accumulated gradient: (epoch, step, gen) it belongs to, sum, micro-batches
        self.acc_key: tuple[int, int, int] | None = None
        self.acc: dict[str, torch.Tensor] = {}
        self.acc_mbs: list[int] = []
        self.acc_per_mb: dict[int, dict[str, torch.Tensor]] = {}  # ordered_grads: kept apart
        self.tasks_done = 0
        self.graphs: dict[tuple[int, int, int], tuple] = {}  # (epoch, step, mb) -> (input, output)
        self.graph_hits = 0  # backward tasks that reused this worker's forward graph
        self.on_servers = None  # callback(list of stage server addresses), e.g. emulation
        # Gradient pushes with a lossy codec: one residual per parameter name (None: raw or off).
        self.ef = ErrorFeedback(opts.codec) if opts.codec != "raw" and opts.error_feedback else None

    async def run(self) -> None:
        set_threads()
        flops = self.flops = self.opts.flops or measure_flops()
        self.coord = pbg.CoordinatorStub(self.channels.open(self.coord_addr))
        from shoal.runtime.server import _retry

        reply = await _retry(lambda: self.coord.Join(pb.JoinRequest(
            role="worker", flops=flops, name=self.opts.name, schema=SCHEMA_VERSION,
            device=self.opts.device)))
        self.member_id, self.spec = reply.member_id, reply.spec
        self.cfg = model_config(self.spec)
        log.info("%s joined as %s (%.2g FLOP/s)", self.opts.name, self.member_id, flops)
        hb = asyncio.create_task(self._heartbeats())
        try:
            while not self.done:
                if self.want is not None and self.want != (self.stage, self.first, self.last,
                                                           self.server_addr):
                    await self._apply_assignment(*self.want)
                if self.stage < 0 or not self.server_addr:
                    await asyncio.sleep(0.05)
                    continue
                try:
                    await self._one()
                except grpc.aio.AioRpcError as exc:
                    log.info("%s: server call failed (%s); retrying", self.opts.name, exc.code())
                    await asyncio.sleep(0.2)
        finally:
            hb.cancel()

    async def _heartbeats(self) -> None:
        last_ok = time.monotonic()
        while not self.done:
            if time.monotonic() - last_ok > self.opts.orphan_after_s:
                log.warning("%s: coordinator unreachable for %.0f s; exiting", self.opts.name,
                            self.opts.orphan_after_s)
                self.done = True
                return
            try:
                a = await self.coord.Heartbeat(pb.MemberRequest(
                    member_id=self.member_id, counter_id=self.traffic.id, role="worker",
                    traffic=self.traffic.snapshot()), timeout=5)
                last_ok = time.monotonic()
                if a.done:
                    self.done = True
                    return
                if not a.known:
                    # Declared dead (e.g. starved of CPU): join again as a new member.
                    reply = await self.coord.Join(pb.JoinRequest(
                        role="worker", flops=self.flops, name=self.opts.name, schema=SCHEMA_VERSION,
                        device=self.opts.device))
                    self.member_id = reply.member_id
                    self.want = None
                    self.stage, self.server_addr = -1, ""
                    self._drop_acc()
                    continue
                if self.on_servers is not None and a.known:
                    self.on_servers(list(a.servers))
                if a.known and a.ready and a.stage >= 0 and a.servers[a.stage]:
                    # Applied by the task loop between tasks, never under a running task.
                    self.want = (a.stage, a.first, a.last, a.servers[a.stage])
            except grpc.aio.AioRpcError:
                pass
            if self.held and self.server_addr:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.server.Renew(pb.RenewRequest(worker=self.member_id,
                                                            lease_ids=list(self.held)), timeout=5)
            await asyncio.sleep(self.opts.heartbeat_s)

    async def _apply_assignment(self, stage: int, first: int, last: int, addr: str) -> None:
        if stage != self.stage:
            if self.server_addr and self.stage >= 0:
                # Tell the old server at once, so our tasks there are redone now.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.server.Leave(pb.MemberRequest(member_id=self.member_id), timeout=2)
            self._switch(stage, first, last)
        self.server_addr = addr
        self.server = self.channels_stub(addr)

    def channels_stub(self, addr: str) -> pbg.StageServerStub:
        if not hasattr(self, "_stubs_by_addr"):
            self._stubs_by_addr = {}
        if addr not in self._stubs_by_addr:
            self._stubs_by_addr[addr] = pbg.StageServerStub(self.channels.open(addr))
        return self._stubs_by_addr[addr]

    def _switch(self, stage: int, first: int, last: int) -> None:
        log.info("%s works on stage %d [%d,%d)", self.opts.name, stage, first, last)
        self.stage, self.first, self.last = stage, first, last
        self.module = build_stage(self.cfg, first, last, seed=self.spec.seed, init=False)
        self.params = dict(self.module.named_parameters())
        self.n_params = sum(p.numel() for p in self.params.values())
        self.version = -1
        self._drop_acc()
        if self.ef is not None:
            self.ef.reset()  # residuals of the old stage's parameters

    def _drop_acc(self) -> None:
        self.acc_key, self.acc, self.acc_mbs, self.acc_per_mb = None, {}, [], {}

    async def _pull(self) -> None:
        rep = await self.server.GetWeights(pb.WeightsRequest(worker=self.member_id), timeout=30)
        with torch.no_grad():
            for frame in rep.params:
                p = self.params[frame.name]
                p.copy_(decode_tensor(frame, shape=tuple(p.shape), dtype="float32"))
        self.version, self.weights_epoch = rep.version, rep.epoch
        self.graphs.clear()  # graphs of older weights must not be back-propagated

    async def _push(self) -> None:
        """Push the accumulated gradients: one sum, or one push per micro-batch (ordered)."""
        epoch, step, gen = self.acc_key
        if self.spec.ordered_grads:
            groups = ordered_groups(self.acc_per_mb)
        else:
            groups = [(self.acc_mbs, self.acc)]
        try:
            for mbs, grads in groups:
                msg = pb.GradPush(worker=self.member_id, step=step, epoch=epoch, gen=gen, mbs=mbs)
                for name, g in grads.items():
                    if "nan_grad" in self.inject:
                        self.inject.discard("nan_grad")
                        g = g.clone()
                        g.view(-1)[0] = float("nan")
                    msg.grads.append(encode_tensor(name, g, self.opts.codec, ef=self.ef))
                rep = await self.server.PushGrads(msg, timeout=60)
                if self.hangs and rep.accepted and self._claim_hang(
                        "hang_mid_push", step, pushed=list(mbs),
                        unpushed=sorted(set(self.acc_mbs) - set(mbs))):
                    while True:
                        await asyncio.sleep(3600)
                if not rep.accepted:
                    log.info("%s: push refused: %s", self.opts.name, rep.reason)
                    if self.ef is not None:
                        # The residual now holds part of a voided gradient: never send it.
                        self.ef.reset()
                    break
        finally:
            self._drop_acc()

    async def _one(self) -> None:
        server = self.server
        rep = await server.Lease(pb.LeaseRequest(worker=self.member_id, wait_s=self.opts.lease_wait_s),
                                 timeout=10)
        if self.acc_key is not None and self.acc_key != (rep.epoch, rep.step, rep.gen):
            self._drop_acc()  # voided by the server, or a roll-back
        if rep.flush and self.acc_key is not None:
            if self.hangs and self._claim_hang("hang_before_push", rep.step, held=sorted(self.acc_mbs)):
                while True:
                    await asyncio.sleep(3600)
            await self._push()
        if not rep.has_task:
            return
        task = rep.task
        self.held.add(task.lease_id)
        try:
            if self.version != task.step or self.weights_epoch != task.epoch:
                await self._pull()
            if self.version != task.step:
                return  # the server moved on; the lease will be dropped
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            out, loss, grads, recomputed = await loop.run_in_executor(None, self._compute, task)
            elapsed = time.perf_counter() - t0
            if self.opts.slow_s > 0:
                await asyncio.sleep(self.opts.slow_s)
            if self.pacer is not None:
                await loop.run_in_executor(None, self.pacer.pad,
                                           self._task_flops(task.direction, recomputed), elapsed)
            result = pb.TaskResult(worker=self.member_id, step=task.step, mb=task.mb,
                                   direction=task.direction, epoch=task.epoch, lease_id=task.lease_id,
                                   loss=loss, compute_s=time.perf_counter() - t0)
            if out is not None:
                if "bad_shape" in self.inject:
                    self.inject.discard("bad_shape")
                    out = out[..., :-1]
                result.output.CopyFrom(encode_tensor("out", out, self.opts.codec))
            done = await server.Complete(result, timeout=60)
        finally:
            self.held.discard(task.lease_id)
        if not done.accepted:
            log.info("%s: result refused: %s", self.opts.name, done.reason)
            return
        self.tasks_done += 1
        if grads is not None:
            key = (task.epoch, task.step, done.gen)
            if self.acc_key != key:
                self._drop_acc()
                self.acc_key = key
            if self.spec.ordered_grads:
                self.acc_per_mb[task.mb] = grads
            else:
                for name, g in grads.items():
                    if name in self.acc:
                        self.acc[name].add_(g)
                    else:
                        self.acc[name] = g
            self.acc_mbs.append(task.mb)

    def _claim_hang(self, kind: str, step: int, **info) -> bool:
        """True if this worker should hang now in state ``kind`` (test faults; reports first)."""
        opts = self.hangs.get(kind)
        if opts is None or step < int(opts.get("step", 0)):
            return False
        if "only" in opts:
            try:
                with open(opts["only"]) as f:
                    if self.opts.name not in f.read().split():
                        return False
            except FileNotFoundError:
                return False
        del self.hangs[kind]
        mark = opts.get("mark")
        if mark:
            try:
                os.close(os.open(mark + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return False  # another worker got there first
            report = {"kind": kind, "step": step, "worker": self.opts.name, "member_id": self.member_id,
                      "stage": self.stage, **info}
            with open(mark + ".tmp", "w") as f:
                f.write(json.dumps(report))
            os.replace(mark + ".tmp", mark)
        log.warning("%s: injected %s at step %d %s: hanging", self.opts.name, kind, step, info)
        return True

    def _task_flops(self, direction: int, recomputed: bool) -> float:
        """FLOPs of one task from the analytic profile (see :func:`task_flops`)."""
        from shoal.model.profile import profile_model

        if getattr(self, "_flops_for", None) != (self.first, self.last):
            prof = profile_model(self.cfg, self.spec.seq_len, self.spec.micro_batch_size, 4)
            self._flops = prof.fwd_flops(self.first, self.last), prof.bwd_flops(self.first, self.last)
            self._flops_for = (self.first, self.last)
        fwd, bwd = self._flops
        return task_flops(direction, fwd, bwd, recomputed)

    def _compute(self, task: pb.Task):
        """Run one task; returns (output or None, loss, parameter grads or None, recomputed).

        ``recomputed`` says whether a ``BWD`` task ran the stage forward again (no cached
        graph of this worker's own forward), so the pacer charges that forward only then.
        """
        spec = self.spec
        first_stage = self.first == 0
        if first_stage:
            x, targets = micro_batch(spec, task.step, task.mb)
        else:
            x = decode_tensor(task.input, shape=(spec.micro_batch_size, spec.seq_len, self.cfg.d_model),
                              dtype="float32", finite=True)
            targets = micro_batch(spec, task.step, task.mb)[1] if task.direction == pb.FWDBWD else None
        key = (task.epoch, task.step, task.mb)
        if self.hangs and self._claim_hang("hang_fwd" if task.direction == pb.FWD else "hang_bwd", task.step,
                                           mb=task.mb, direction=pb.Direction.Name(task.direction)):
            while True:
                time.sleep(3600)
        if task.direction == pb.FWD:
            if not self.opts.graph_cache:
                with torch.no_grad():
                    return self.module(x).contiguous(), 0.0, None, False
            # Keep the graph: if this worker also gets the micro-batch's backward, it skips
            # the recomputation. Dropping an entry is always safe (BWD recomputes).
            if not first_stage:
                x = x.requires_grad_(True)
            out = self.module(x)
            self.graphs[key] = (x, out)
            while len(self.graphs) > 2 * spec.micro_batches:
                self.graphs.pop(next(iter(self.graphs)))
            return out.detach().contiguous(), 0.0, None, False
        for p in self.params.values():
            p.grad = None
        cached = self.graphs.pop(key, None) if task.direction == pb.BWD else None
        if cached is not None:
            x = cached[0]
        elif not first_stage:
            x = x.requires_grad_(True)
        if task.direction == pb.FWDBWD:
            loss = self.module(x, targets)
            (loss / spec.micro_batches).backward()
            loss_v = float(loss.detach())
        else:
            g = decode_tensor(task.out_grad, shape=(spec.micro_batch_size, spec.seq_len, self.cfg.d_model),
                              dtype="float32", finite=True)
            out = cached[1] if cached is not None else self.module(x)
            self.graph_hits += cached is not None
            out.backward(g)
            loss_v = 0.0
        grads = {n: p.grad for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None
        recomputed = task.direction == pb.BWD and cached is None
        return (None if first_stage else x.grad.contiguous()), loss_v, grads, recomputed


def work(coord: str, token: str, opts: WorkerOptions, *, dial=None, pacer=None, on_servers=None) -> None:
    """Run a worker process until the run is done (hooks: see :class:`Worker`)."""
    set_threads()
    w = Worker(coord, token, opts, dial=dial, pacer=pacer)
    w.on_servers = on_servers
    run_member(w.run(), coord)
