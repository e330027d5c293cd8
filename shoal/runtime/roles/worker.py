"""The worker: leases tasks of its stage, computes them, pushes gradients.

Loop: lease a task (long-poll), make sure its weights are the task's version (pull them
from the server if not), compute in a thread so that the asyncio loop keeps renewing the
leases, send the result in the background (a bounded number in flight, retried with the
same lease id) while the next task is leased and computed. Parameter gradients of accepted backward tasks are summed
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
import math
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
from shoal.net.compress import ErrorFeedback, sr_key
from shoal.net.stream import (
    CONTROL_SLACK,
    DEFAULT_CHUNK_BYTES,
    SendProgress,
    StreamStalled,
    fetch,
    send,
    transfer_timeout,
)
from shoal.net.traffic import Traffic, framed_frames, wire_frame_sizes
from shoal.net.wire import (
    Frame,
    Framed,
    WireError,
    decode_tensor,
    encode_frame,
    frame_size,
    serialize_framed,
    with_frame,
)
from shoal.runtime.common import (
    SCHEMA_VERSION,
    ewma,
    heartbeat_period,
    model_config,
    run_member,
    run_precision,
    set_threads,
    split_window,
    trace,
)
from shoal.runtime.measure import peak_rss_bytes
from shoal.runtime.safety.faults import poison, poisons
from shoal.runtime.sync.codecs import apply_pull, compression_of_spec
from shoal.runtime.sync.lean import LeanShare, LeanSum
from shoal.runtime.sync.local import LocalWorkerMixin
from shoal.runtime.sync.ordered import EXACT_APART, LocalFold, PrefixFold
from shoal.runtime.transport.frames import (
    TRANSIENT_CODES,
    WEIGHT_FRAMES,
    off_loop,
    payload_bytes,
    retry,
)
from shoal.runtime.transport.session import (
    SessionClient,
    result_on_session,
    serialised,
    unavailable,
)
from shoal.train.precision import (
    autocast,
    backward_loss,
    check_device_precision,
    resolve_device,
    to_device,
    to_host,
    wire_dtype,
)

log = logging.getLogger("shoal.worker")


@dataclass
class WorkerOptions:
    """Knobs of one worker process."""

    name: str = "worker"  # label in events and metrics
    flops: float | None = None  # FLOP/s to report (None: measure at start)
    heartbeat_s: float | None = None  # lease renewal / coordinator heartbeat period (None: heartbeat_period)
    lease_wait_s: float = 2.0  # long-poll time of one lease request (the server answers sooner on a task, flush or commit)
    inject: str = ""  # test faults, comma-separated: nan_grad, bad_shape, oom, push_fail, push_lost, push_abandon, pseudo_abandon (a local round's pseudo-gradient; once each), hang_* (see parse_hangs)
    codec: str = "raw"  # tensor codec for results and pushes
    graph_cache: bool = True  # keep forward graphs to skip the recompute in own backward tasks
    orphan_after_s: float = 120.0  # exit when the coordinator is unreachable this long
    slow_s: float = 0.0  # extra seconds per task (a crude stand-in for a slow device in tests)
    error_feedback: bool = True  # lossy codec: carry each gradient push's quantisation error into the next
    device: str = ""  # emulated runs: the scenario device this worker plays (the coordinator plans on it)
    region: str = ""  # declared network region ("": the coordinator clusters by latency)
    up_bps: float = 0.0  # declared uplink bytes/s (0: measured)
    down_bps: float = 0.0  # declared downlink bytes/s (0: measured)
    probe_bytes: int = 16 * 1024 * 1024  # bytes of the largest timed link transfer each way when measuring
    compute_device: str = "cpu"  # torch device the worker computes on (what it measures)
    push_attempts: int = 5  # tries of one gradient push before its micro-batches are released
    push_timeout_s: float = 60.0  # least deadline of one push attempt (a large push gets its size at 1 MB/s more)
    push_stall_s: float = 20.0  # a push attempt whose chunks stop leaving for this long is abandoned (a hung path)
    pull_stall_s: float = 60.0  # a weight pull that gets no chunk for this long is abandoned and asked again
    chunk_bytes: int = 0  # bytes per chunk of streamed uploads (0: the run's setting)
    torch_device: str = "auto"  # --device: where this worker computes (auto, cpu, cuda, cuda:N)
    precision: str | None = None  # --precision: refuse to work in a run of another precision (None: any)
    fault_poison: float = 1.0  # fault injection: push the true gradients times this (1: honest)
    fault_poison_kind: str = "scale"  # fault injection: scale, noise or bias (shoal.runtime.safety.faults.poison)
    fault_poison_from: int = 0  # fault injection: the first step whose pushes are poisoned (honest before)
    fault_slow: float = 1.0  # fault injection: every task takes this many times its compute time
    fault_stop_from: int = -1  # fault injection: leave the run at the first task of this step or later (-1: off)
    join_timeout_s: float = 30.0  # --join-timeout: seconds to keep retrying an unreachable coordinator at start
    uploads_in_flight: int = 2  # results sent in the background while the next task runs (0: await each)
    upload_attempts: int = 4  # tries of one result upload (same lease id) before its lease is left to expire
    prefetch: bool = False  # exact sync: ask for the next task while computing this one (on a session: within its credit)
    session: bool | None = None  # one session stream with the stage server (credit, take-backs); None: in exact sync (docs/runtime.md)
    shadow: bool = False  # emulation: run no model; wait the device's task time, send fixed tensors of true shapes
    memory: float = 0.0  # --memory-gb: bytes of its device this worker may use (0: all it has); reported for planning, bounds its forward graphs


SHADOW_JOINING = 8  # shadow workers of one process that join at once (the others wait their turn)
UNASSIGNED_HEARTBEAT_S = 0.2  # heartbeat period of a worker that has no stage yet (waits for its assignment)
HANG_KINDS = ("hang_fwd", "hang_bwd", "hang_before_push", "hang_mid_push")
BUSY_KINDS = ("busy_fwd", "busy_bwd")


def parse_busy(spec: str) -> dict[str, dict[str, str]]:
    """Test-only faults of ``--inject``: ``busy_<state>:secs=S[:step=N][:mark=PATH]`` -> {kind: options}.

    The first forward (``busy_fwd``) or backward (``busy_bwd``) task of step ``N`` or later
    that this worker computes spins the CPU in Python for ``S`` seconds inside the compute
    (holding the interpreter as a long model step would) and writes a JSON report to ``PATH``
    when it starts; then the task finishes normally. A test sees that the worker stays alive.
    """
    out: dict[str, dict[str, str]] = {}
    for item in spec.split(","):
        kind, *opts = item.split(":")
        if not kind.startswith("busy_"):
            continue
        if kind not in BUSY_KINDS or not all("=" in o for o in opts) or "secs" not in dict(
                o.split("=", 1) for o in opts):
            raise ShoalError(f"bad --inject item {item!r}; use {'|'.join(BUSY_KINDS)}:secs=S[:step=N][:mark=PATH]")
        out[kind] = dict(o.split("=", 1) for o in opts)
    return out


def spin(secs: float) -> int:
    """Keep this thread busy in Python for ``secs`` seconds (a compute that holds the interpreter)."""
    end = time.perf_counter() + secs
    n = 0
    while time.perf_counter() < end:
        n += sum(range(1000)) & 1
    return n


def parse_hangs(spec: str) -> dict[str, dict[str, str]]:
    """Test-only faults of ``--inject``: ``hang_<state>[:step=N][:only=FILE][:mark=PATH]`` -> {kind: options}.

    A worker reaching the state (in step ``N`` or later; only if its name is a line of
    ``FILE``, when given) writes a JSON report to ``PATH`` (the first worker to get there
    claims it; others carry on) and then stops
    working while its heartbeats go on, so a test can kill -9 it in exactly that state:
    ``hang_fwd`` / ``hang_bwd`` inside a leased forward / backward task, ``hang_before_push``
    holding accepted gradients it has not pushed, ``hang_mid_push`` after the first of its
    pushes for the step was answered (while armed, the worker pushes each micro-batch alone).
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


def idle_pull(rep: pb.LeaseReply, version: int, epoch: int) -> bool:
    """Whether a worker left without a task should pull weights now (exact mode).

    The server committed a version this worker does not hold and is serving it (its
    weight version equals the step it works on): pulling while idle takes the pull off
    the first task's critical path.
    """
    return rep.version >= 0 and rep.version == rep.step and (rep.version != version or rep.epoch != epoch)


def oom_message(stage: int, first: int, last: int, micro_batch_size: int, seq_len: int, device: str,
                precision: str) -> str:
    """The one-line error of a worker whose device ran out of memory on its stage."""
    return (f"out of memory on {device} computing stage {stage} (layers [{first}, {last})) at micro-batch size "
            f"{micro_batch_size} x {seq_len} tokens in {precision}; this worker left the run and its tasks were "
            f"re-queued; use a device with more memory, more --stages or a smaller --micro-batch-size")


def graph_room(memory: float, need: float, held_bytes: float, per_graph: float, most: int) -> int:
    """Forward graphs a worker may keep for its own backward tasks (pure; tested directly).

    The planner gives a worker a stage whose weights, gradient and one micro-batch's saved
    activations fit its device (``need``, :func:`shoal.plan.cost.stage_worker_memory`); each kept
    graph is another micro-batch's activations (``per_graph``), and the gradients the worker
    holds for its step (``held_bytes``: its folds') take room too. It keeps what the rest of
    ``memory`` holds, at most ``most``: beyond, a backward task recomputes its forward (exact,
    a third more compute) instead of running the device out of memory. ``per_graph`` 0: ``most``.
    """
    if per_graph <= 0:
        return most
    return max(0, min(most, int((memory - need - held_bytes) // per_graph)))


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


class Worker(LocalWorkerMixin):
    """One worker process's state."""

    def __init__(self, coord: str, token: str, opts: WorkerOptions, *, dial=None, pacer=None, tls=None):
        self.coord_addr, self.opts, self.pacer = coord, opts, pacer
        self.torch_device = resolve_device(opts.torch_device)  # a bad --device fails before joining
        self.fatal = ""  # set when the worker must leave the run with an error (out of memory)
        self.traffic = Traffic()  # bytes of every call this worker makes
        self.channels = ChannelFactory(token, dial=dial, traffic=self.traffic, tls=tls)
        self.inject = {f for f in opts.inject.split(",") if f and not f.startswith(("hang_", "busy_"))}
        self.hangs = parse_hangs(opts.inject)  # test faults: stop in a given state (tests kill -9)
        self.busy = parse_busy(opts.inject)  # test faults: one long compute in a given state
        self._doing = ("starting", time.monotonic())  # what this worker does now, since when (liveness reports)
        self.stage = -1
        self.first = self.last = 0
        self.want: tuple[int, int, int, str] | None = None  # assignment from the last heartbeat
        self.server_addr = ""
        self.uplinks: dict[str, float | None] = {}  # server address -> measured uplink bytes/s (inf: same host)
        self.done = False
        self.held: set[int] = set()
        self.version = -1
        self.weights_epoch = -1
        # accumulated gradient: (epoch, step, gen) it belongs to, sum, micro-batches
        self.acc_key: tuple[int, int, int] | None = None
        self.acc: dict[str, torch.Tensor] = {}
        self.acc_mbs: list[int] = []
        self.acc_pushed: set[int] = set()  # exact sync: micro-batches pushed alone before the flush (_push_apart)
        self.grad_uploads = 0  # results carrying gradients on their way (_upload)
        # (a real worker's task gradients are its own to add into; a shadow worker's are shared)
        self.acc_fold = self._new_fold()  # ordered_grads, exact sync: the run from micro-batch 0 summed as it grows
        self.acc_local = LocalFold(owned=not opts.shadow)  # ordered_grads, local mode: the step's sum as it comes
        self.lean_sum = LeanSum()  # lean local mode (--lean-workers): which results the .grad sum counts
        self.tasks_done = 0
        self.compute_s = 0.0  # compute seconds of the accepted tasks (dashboard)
        self.graphs: dict[tuple[int, int, int], tuple] = {}  # (epoch, step, mb) -> (input, output)
        self.graph_hits = 0  # backward tasks that reused this worker's forward graph
        self.shadow_fwd: dict = {}  # shadow mode: forwards this worker ran (its "graph cache", for the FLOPs charged)
        self.join_gate: asyncio.Semaphore | None = None  # shadow groups: bounds the members joining at once
        self.on_servers = None  # callback(list of stage server addresses), e.g. emulation
        # Gradient pushes with a lossy codec: one residual per parameter name (None: raw or off).
        self.ef = ErrorFeedback(opts.codec) if opts.codec != "raw" and opts.error_feedback else None
        self.measure_want = 0  # newest measurement request from the coordinator
        self.measure_done = 0  # newest request answered
        self.servers_seen: list[str] = []  # stage server addresses from the newest heartbeat
        self.uploads: set[asyncio.Task] = set()  # results being sent while the next task runs
        self.last_task_t = time.monotonic()  # when the last lease brought a task (local mode: move holds)
        self.move_held = None  # local mode: the move being held until the round's pseudo-gradient is sent
        self.move_now = False  # the coordinator: nobody else works on the wanted stage (hold no move)
        self.upload_error: BaseException | None = None  # an unexpected failure of one, raised by the task loop
        self.ahead: tuple[object, asyncio.Task] | None = None  # (server stub, lease request made during a compute)
        self.sessions: dict[int, SessionClient] = {}  # id(server stub) -> its open session
        self.session_ok = bool(opts.session)  # set at the join (sessions_for); False once a server offers none: calls
        self.credit = 1  # tasks the server lets this worker hold (session; 2+: ask ahead)
        self.pushing = 0  # 1 + the step whose gradients are being framed or sent (told with each renewal)
        self.push_progress = SendProgress()  # the current push attempt's progress (renewals say "pushing" only while it moves)
        self.beat_floor_s = 0.0  # the coordinator's floor on the heartbeat period (a large swarm spreads its beats)
        self._reset_observed()

    def _reset_observed(self) -> None:
        """Start new observations (after a measurement): what the coordinator checks for drift."""
        self.obs_flops: float | None = None  # EWMA of task FLOPs / task seconds
        self.obs_tasks = 0
        self.obs_pull_s: float | None = None  # EWMA of weight-pull seconds
        self.obs_pull_bytes = 0  # bytes of the newest pull
        self.obs_pulls = 0

    def _do(self, what: str) -> None:
        """Say what this worker is doing now (reported with every heartbeat; a death report names it)."""
        self._doing = (what, time.monotonic())

    def doing_line(self) -> str:
        """What this worker is doing and for how long, in one line."""
        what, since = self._doing
        return f"{what} for {time.monotonic() - since:.1f} s"

    def _join_request(self) -> pb.JoinRequest:
        return pb.JoinRequest(role="worker", flops=self.opts.flops or 0.0, name=self.opts.name,
                              schema=SCHEMA_VERSION, device=self.opts.device, will_measure=True,
                              region=self.opts.region, up_bps=self.opts.up_bps, down_bps=self.opts.down_bps)

    async def _measure(self) -> None:
        """Measure compute (unless --flops was given) and links; report to the coordinator."""
        from shoal.runtime.measure import (
            device_memory,
            device_name,
            measure_stage_flops,
            probe_peers,
        )

        want = self.measure_want
        await self._drain()  # no upload competes with the link probes
        self._do("measuring its device and links")
        t0 = time.perf_counter()
        flops = self.opts.flops or 0.0
        if not flops:
            flops = await asyncio.get_running_loop().run_in_executor(
                None, lambda: measure_stage_flops(self.cfg, self.spec.seq_len, self.spec.micro_batch_size,
                                                  device=self.opts.compute_device, seed=int(self.spec.seed),
                                                  precision=self.precision))
        self.flops = flops
        links = await probe_peers(self.channels, self.coord_addr, self.servers_seen, self.opts.probe_bytes)
        await self.coord.Measured(pb.MeasureReport(
            member_id=self.member_id, request=want, device_name=device_name(self.opts.compute_device),
            memory=self.opts.memory or device_memory(self.opts.compute_device), flops=flops,
            links=[lf.to_pb() for lf in links], measure_s=time.perf_counter() - t0), timeout=30)
        self.measure_done = want
        # each server's uplink rate, for which results fit on a session (result_on_session)
        self.uplinks = {lf.target: math.inf if lf.same_host else (lf.up_bps or None) for lf in links}
        self._reset_observed()
        log.info("%s measured: %.3g FLOP/s, %s", self.opts.name, flops,
                 ", ".join(f"{lf.target} rtt {lf.rtt_s * 1e3:.1f} ms up {lf.up_bps / 1e6:.2f} MB/s "
                           f"down {lf.down_bps / 1e6:.2f} MB/s" for lf in links))

    async def run(self) -> None:
        from shoal.runtime.measure import warm_device

        set_threads()
        self.flops = self.opts.flops or 0.0
        # Before joining: no heartbeat is due yet while the GPU's context starts.
        warm = warm_device(self.torch_device)
        if warm:
            log.info("%s: %s ready in %.1f s", self.opts.name, self.torch_device, warm)
        async with self.join_gate or contextlib.nullcontext():
            # (Opening the channel makes an emulated link's relays: in a shadow group, a few
            # members at a time, so those joined keep heartbeating while the rest join.)
            self.coord = pbg.CoordinatorStub(self.channels.open(self.coord_addr))
            reply = await retry(lambda: self.coord.Join(self._join_request()), budget_s=self.opts.join_timeout_s,
                                codes=TRANSIENT_CODES)
        self.member_id, self.spec = reply.member_id, reply.spec
        self.session_ok = sessions_for(self.opts.session, self.local)
        self.cfg = model_config(self.spec)
        push = self._codec("push")
        self.ef = ErrorFeedback(push) if push != "raw" and self.opts.error_feedback else None
        try:
            if self.opts.shadow and not self.spec.shadow:
                raise ShoalError(f"--shadow: the run at {self.coord_addr} is not a shadow emulation (its losses "
                                 "count); start its coordinator with --shadow or drop --shadow here")
            if self.opts.precision and self.opts.precision != self.precision:
                raise ShoalError(f"--precision {self.opts.precision}: the run at {self.coord_addr} computes in "
                                 f"{self.precision}; drop --precision or join another run")
            check_device_precision(self.torch_device, self.precision)
        except ShoalError as exc:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.coord.Leave(pb.MemberRequest(member_id=self.member_id, leave_reason=str(exc)), timeout=2)
            raise
        log.info("%s joined as %s", self.opts.name, self.member_id)
        hb = asyncio.create_task(self._heartbeats())
        try:
            while not self.done:
                # With a task leased ahead in hand, the measurement waits for the next moment
                # without one (the step's end, at the latest): the task would stall meanwhile.
                if self.measure_want > self.measure_done and self.ahead is None:
                    try:
                        await self._measure()  # between tasks: nothing else competes for the device
                    except grpc.aio.AioRpcError as exc:
                        log.info("%s: measurement failed (%s); retrying", self.opts.name, exc.code())
                        await asyncio.sleep(0.5)
                    continue
                if self.want is not None and self.want != (self.stage, self.first, self.last,
                                                           self.server_addr) and not self._hold_move():
                    await self._drain()  # results of the old assignment land (or fail) first
                    await self._apply_assignment(*self.want)
                if self.stage < 0 or not self.server_addr:
                    await asyncio.sleep(0.05)
                    continue
                try:
                    await self._one()
                except grpc.aio.AioRpcError as exc:
                    log.info("%s: server call failed (%s); retrying", self.opts.name, exc.code())
                    await asyncio.sleep(0.2)
                except WireError as exc:
                    # A transfer that came short or did not check out: nothing of it was
                    # applied; a task we hold meanwhile runs out its lease and is redone.
                    log.warning("%s: bad transfer from the server (%s); retrying", self.opts.name, exc)
                    await asyncio.sleep(0.2)
        finally:
            self._drop_ahead()
            self._close_sessions()
            hb.cancel()

    @property
    def precision(self) -> str:
        """The run's compute precision (from the run spec)."""
        return run_precision(self.spec)

    @property
    def act_dtype(self) -> str:
        """Wire dtype of activations and their gradients: the compute dtype."""
        return wire_dtype(self.precision)

    @property
    def grads_finite(self) -> bool:
        """Whether received gradients must be finite (fp16: an overflow skips the step instead)."""
        return self.precision != "fp16"

    def _beat_period(self) -> float:
        period = self.opts.heartbeat_s or heartbeat_period(self.spec.dead_after_s, self.spec.min_lease_s)
        if self.stage < 0 and self.join_gate is None:
            # Idle until assigned: ask often, so a worker starts with the others at step 0
            # (in local mode a replica that misses the first round leaves it unscreened).
            # Not in a shadow group: hundreds of members asking 5 times a second while the
            # rest join would hold the coordinator's loop.
            period = min(period, UNASSIGNED_HEARTBEAT_S)
        return period

    async def _renewals(self) -> None:
        """Renew the held leases with the stage server, on their own clock: a slow server never
        delays the coordinator's heartbeats, nor a slow coordinator the renewals."""
        while not self.done:
            if self.server_addr and self.stage >= 0:
                # Also with no lease held: while a large push is framed, the server must
                # not take this worker's silence for death and void its gradients.
                req = pb.RenewRequest(worker=self.member_id, lease_ids=list(self.held),
                                      pushing=pushing_report(self.pushing, self.push_progress,
                                                             time.monotonic(), self.opts.push_stall_s))
                sess = self.sessions.get(id(self.server))
                if sess is not None and sess.alive:
                    sess.renew(req)  # one message on the open stream
                else:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.server.Renew(req, timeout=5)
            await asyncio.sleep(self._beat_period())

    async def _heartbeats(self) -> None:
        renew = asyncio.create_task(self._renewals())
        try:
            await self._coordinator_beats()
        finally:
            renew.cancel()

    async def _coordinator_beats(self) -> None:
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
                    traffic=self.traffic.snapshot(), observed_flops=self.obs_flops or 0.0,
                    observed_tasks=self.obs_tasks, observed_pull_s=self.obs_pull_s or 0.0,
                    observed_pull_bytes=self.obs_pull_bytes, observed_pulls=self.obs_pulls,
                    stats=self.stats_snapshot(), doing=self.doing_line()), timeout=5)
                last_ok = time.monotonic()
                if a.guard_banned:
                    self.fatal = f"{self.opts.name} is banned from the run: {a.guard_banned}"
                    log.error("%s", self.fatal)
                    self.done = True
                    return
                if a.done:
                    self.done = True
                    return
                if not a.known:
                    # Declared dead (e.g. starved of CPU): join again as a new member.
                    log.warning("%s: the coordinator dropped us (%s); joining again", self.opts.name,
                                a.forgotten or "it does not know this member id")
                    reply = await self.coord.Join(self._join_request())
                    self.member_id = reply.member_id
                    self._close_sessions()  # bound to the old member id
                    self.measure_want = self.measure_done = 0
                    self.want = None
                    self.stage, self.server_addr = -1, ""
                    self._drop_acc()
                    continue
                self.beat_floor_s = a.beat_floor_s
                if self.on_servers is not None and a.known:
                    self.on_servers(list(a.servers))
                self.servers_seen = list(a.servers)
                if a.measure > self.measure_done:
                    self.measure_want = a.measure  # the task loop measures between tasks
                if a.known and a.ready and a.stage >= 0 and a.servers[a.stage]:
                    # Applied by the task loop between tasks, never under a running task.
                    self.want = (a.stage, a.first, a.last, a.servers[a.stage])
                    self.move_now = a.move_now
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(max(self._beat_period(), self.beat_floor_s))

    def stats_snapshot(self) -> pb.MemberStats:
        """What this worker reports for the dashboard: its stage and the work it got accepted."""
        return pb.MemberStats(stage=self.stage, tasks_done=self.tasks_done, compute_s=self.compute_s,
                              peak_rss=peak_rss_bytes())

    async def _apply_assignment(self, stage: int, first: int, last: int, addr: str) -> None:
        self._drop_ahead()  # a task leased ahead from the old assignment runs out its lease there
        if stage != self.stage:
            if self.server_addr and self.stage >= 0:
                # Tell the old server at once, so our tasks there are redone now.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.server.Leave(pb.MemberRequest(member_id=self.member_id), timeout=2)
            self._do(f"building stage {stage}")
            # Built in a thread (a large stage takes seconds): the heartbeats go on.
            module = await asyncio.get_running_loop().run_in_executor(None, self._build, first, last)
            self._switch(stage, first, last, module)
        self.server_addr = addr
        self.server = self.channels_stub(addr)
        for key in [k for k in self.sessions if k != id(self.server)]:
            self.sessions.pop(key).close()

    def channels_stub(self, addr: str) -> pbg.StageServerStub:
        if not hasattr(self, "_stubs_by_addr"):
            self._stubs_by_addr = {}
        if addr not in self._stubs_by_addr:
            self._stubs_by_addr[addr] = pbg.StageServerStub(self.channels.open(addr))
        return self._stubs_by_addr[addr]

    def _build(self, first: int, last: int) -> torch.nn.Module:
        """The stage's module, uninitialised (its weights come from the server); a shadow
        worker's holds only shapes (meta tensors: no memory)."""
        with torch.device("meta" if self.opts.shadow else self.torch_device):  # allocated where it computes
            return build_stage(self.cfg, first, last, seed=self.spec.seed, init=False)

    def _switch(self, stage: int, first: int, last: int, module: torch.nn.Module | None = None) -> None:
        log.info("%s works on stage %d [%d,%d)", self.opts.name, stage, first, last)
        self.stage, self.first, self.last = stage, first, last
        self.module = module if module is not None else self._build(first, last)
        self.params = dict(self.module.named_parameters())
        self.n_params = sum(p.numel() for p in self.params.values())
        self.version = -1
        self.pull_held: tuple[str, int] = ("", -1)  # compressed pulls: (chain, version) of the weights held
        self._drop_acc()
        self._local_reset()
        if self.ef is not None:
            self.ef.reset()  # residuals of the old stage's parameters

    def _new_fold(self) -> PrefixFold:
        """An empty fold for a step's ordered gradients. While the test fault ``hang_mid_push`` is
        armed, nothing is pre-summed, so a worker holding two micro-batches of a step pushes twice
        and reaches "between pushes" however the step's tasks fell (a run 0..k would be one push)."""
        return PrefixFold(not self.opts.shadow, prefix="hang_mid_push" not in self.hangs)

    def _drop_acc(self) -> None:
        self.acc_key, self.acc, self.acc_mbs = None, {}, []
        self.lean_sum.drop()  # (lean: the .grad sum is not to be reported)
        self.acc_pushed = set()
        self.acc_fold = self._new_fold()
        self.acc_local = LocalFold(owned=not self.opts.shadow)

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk of this worker's uploads: its own setting, else the run's."""
        return self.opts.chunk_bytes or self.spec.chunk_bytes or DEFAULT_CHUNK_BYTES

    def _act_bytes(self) -> int:
        return 4 * self.spec.micro_batch_size * self.spec.seq_len * self.cfg.d_model

    def _lease_cap(self) -> int:
        """Most bytes of a lease reply: a task's input and output gradient, ids and tokens."""
        return 2 * self._act_bytes() + CONTROL_SLACK

    async def _pull(self, merged_only: bool = False) -> None:
        """Fetch the server's weights in chunks; apply them only when all arrived and check out.

        ``merged_only`` (local mode with overlap): they become the merged weights the replica
        moves onto (after its next inner step, or at its round's end), not the replica itself
        (dropped if the worker moved to another stage meanwhile: it may run beside the stage's
        tasks)."""
        server, stage = self.server, self.stage
        numel = sum(p.numel() for p in self.params.values())
        cap = 4 * numel + 512 * len(self.params) + CONTROL_SLACK
        t0 = time.perf_counter()
        chain, held = getattr(self, "pull_held", ("", -1))
        req = pb.WeightsRequest(worker=self.member_id)
        self._do(f"pulling the weights of stage {self.stage}")
        if chain:  # compressed pulls: say which reconstruction we hold (a delta against it will do)
            req.compress_chain, req.compress_version = chain, held
        trace(self.opts.name, "pull")
        spans: list = []
        # The frames stay views of the received bytes (split_framed): two fewer copies of the
        # stage, and no long parse holding the interpreter lock from the heartbeats.
        rep = await fetch(server.GetWeightsStream, req, pb.WeightsReply, cap, traffic=self.traffic, spans=spans,
                          stall_s=self.opts.pull_stall_s, frames_field=WEIGHT_FRAMES)
        trace(self.opts.name, "pulled", v=rep.version)
        self.obs_pull_s = ewma(self.obs_pull_s, time.perf_counter() - t0)
        sizes = wire_frame_sizes(rep.head, len(rep.params), spans)
        self.obs_pull_bytes = sum(sizes) if sizes is not None else sum(frame_size(f) for f in rep.params)
        self.obs_pulls += 1
        from shoal.runtime.roles.shadow import raw_full_pull, shadow_pull_ok

        if self.opts.shadow and raw_full_pull(rep):
            # Computes nothing with them: a shadow worker checks only that the pull is this
            # stage's tensors at their sizes (decoding each costs its process CPU that the
            # worker it plays would spend on its own machine, not the servers').
            if not shadow_pull_ok(rep, self.params):
                raise WireError(f"weights of stage [{rep.first},{rep.last}): not this stage's tensors")
        elif merged_only:
            base = self.merged if rep.compress_delta else None

            def merged_copy() -> dict[str, torch.Tensor]:  # (a pass over the stage: off the loop)
                new = apply_pull(rep, self.params, base, self.pull_held)
                return {name: t.detach().to("cpu", torch.float32, copy=True) for name, t in new.items()}

            try:
                merged = await asyncio.get_running_loop().run_in_executor(None, merged_copy)
            except WireError:
                self.pull_held = ("", -1)  # the next pull is a full one
                raise
            if (self.stage, self.server) != (stage, server):
                return
            self.merged = merged
            self.pull_held = (rep.compress_chain, rep.version) if rep.compress_chain else ("", -1)
        else:
            # Checked and copied in a thread: the loop keeps heartbeating meanwhile.
            await asyncio.get_running_loop().run_in_executor(None, self._apply_weights, rep)
        self.version, self.weights_epoch = rep.version, rep.epoch
        trace(self.opts.name, "applied", v=rep.version)
        if merged_only:
            return  # (the replica's own weights and graphs are untouched until it moves onto them)
        self.graphs.clear()  # graphs of older weights must not be back-propagated
        self.shadow_fwd.clear()

    def _apply_weights(self, rep: pb.WeightsReply) -> None:
        """Check every frame of a weight pull, then copy them in: all of them or none.

        A compressed pull is a delta against the weights the worker pulled last (in local mode
        its replica's anchor, or with overlap the merged weights kept apart, where the replica
        itself has moved on since)."""
        base = None
        if rep.compress_delta:
            base = (self.merged if self.local_overlap else self.anchor) if self.local else self.params
        try:
            new = apply_pull(rep, self.params, base, self.pull_held)
        except WireError:
            self.pull_held = ("", -1)  # the next pull is a full one
            raise
        if self.opts.shadow:
            return  # (not reached: a shadow worker's pull is checked by shadow_pull_ok)
        with torch.no_grad():
            for name, t in new.items():
                self.params[name].copy_(to_device(t, self.torch_device))
        self.pull_held = (rep.compress_chain, rep.version) if rep.compress_chain else ("", -1)

    def _codec(self, kind: str) -> str:
        """Runtime codec of traffic ``kind`` this worker sends: the run's setting, else its own --codec."""
        c = compression_of_spec(self.spec).wire(kind)
        return c if c != "raw" else self.opts.codec

    def _push_message(self, epoch: int, step: int, gen: int, mbs: list[int],
                      grads: dict[str, torch.Tensor], check_id: int = 0) -> tuple[pb.GradPush, list[Frame], bytes]:
        """One push: its head (no gradients), its frames, and the whole push serialised
        (runs in a thread: it can be hundreds of MB). ``check_id``: the result of a redundant
        check, always in raw frames (it is compared with another worker's raw push)."""
        msg = pb.GradPush(worker=self.member_id, step=step, epoch=epoch, gen=gen, mbs=mbs, check_id=check_id)
        honest = not poisons(self.opts.fault_poison_kind, self.opts.fault_poison, self.opts.fault_poison_from, step)
        if self.opts.shadow and not check_id and honest and "nan_grad" not in self.inject and self.ef is None:
            # A shadow push is the sum of len(mbs) fixed gradients: the same frames every time.
            from shoal.runtime.roles.shadow import shadow_frames

            frames = shadow_frames(grads, len(mbs), self._codec("push"), bool(self.spec.ordered_grads))
            return msg, frames, serialize_framed(msg, pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number, frames)
        frames = []
        for name, g in grads.items():
            if poisons(self.opts.fault_poison_kind, self.opts.fault_poison, self.opts.fault_poison_from, step):
                g = poison(g, name, step, self.opts.fault_poison_kind, self.opts.fault_poison)  # a dishonest worker
            if "nan_grad" in self.inject:
                self.inject.discard("nan_grad")
                g = g.clone()
                g.view(-1)[0] = float("nan")
            # (views of the gradients' bytes: serialize_framed below copies each once)
            if check_id:
                frames.append(encode_frame(name, to_host(g), "raw", view=True))
            else:
                frames.append(encode_frame(name, to_host(g), self._codec("push"), ef=self.ef, view=True))
        return msg, frames, serialize_framed(msg, pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number, frames)

    async def _push(self) -> None:
        """Push the accumulated gradients: one sum, or one push per micro-batch (ordered).

        Each push is retried (:meth:`_send_push`) with the same identity, which the server
        recognises when an earlier attempt landed. A push that cannot land is released
        (:meth:`_release`) so the server redoes its micro-batches instead of waiting.
        """
        epoch, step, gen = self.acc_key
        loop = asyncio.get_running_loop()
        # Told with every renewal: the server does not void a holder that is still pushing
        # (summing, framing and sending a large push can outlast its flush grace).
        self.pushing = step + 1
        # "sent": no chunk is due while the sums and frames are made (in a thread, seconds for a
        # large stage): only a send whose chunks stop leaving ends the sparing.
        self.push_progress.last, self.push_progress.sent = time.monotonic(), True
        try:
            if self.spec.ordered_grads:
                groups = self.acc_fold.groups()  # (the run from micro-batch 0 summed as its gradients came)
            else:
                groups = [(self.acc_mbs, self.acc)]
            done: set[int] = set(self.acc_pushed)
            for mbs, grads in groups:
                self._do(f"pushing the gradients of step {step} mbs {mbs}")
                done.update(mbs)
                trace(self.opts.name, "push_make", step=step, mbs=mbs)
                msg, frames, data = await loop.run_in_executor(None, self._push_message, epoch, step, gen, mbs,
                                                               grads)
                trace(self.opts.name, "push_send", step=step, bytes=len(data))
                rep = await self._send_push(msg, data, frames, self.push_progress)
                trace(self.opts.name, "push_ack", step=step)
                unpushed = sorted(set(self.acc_mbs) - done)
                # "Mid push" needs a push still to come: a worker whose step's gradients
                # go in one push (a run 0..k pre-summed) is not in that state.
                if self.hangs and rep is not None and rep.accepted and unpushed and self._claim_hang(
                        "hang_mid_push", step, pushed=sorted(done), unpushed=unpushed):
                    while True:
                        await asyncio.sleep(3600)
                if rep is None:
                    await self._release(epoch, step, gen)
                    break
                if not rep.accepted:
                    log.info("%s: push refused: %s", self.opts.name, rep.reason)
                    if self.ef is not None:
                        # The residual now holds part of a voided gradient: never send it.
                        self.ef.reset()
                    break
        finally:
            self.pushing = 0
            self._drop_acc()

    async def _push_apart(self, key: tuple[int, int, int]) -> None:
        """Exact sync, ordered: push alone at once the gradients held apart from the run (a
        shared stage's micro-batches after another worker's gap) that the device has no room
        for beyond its plan (:meth:`_apart_room`), instead of holding one a micro-batch to the
        step's flush. The server sums pushes in micro-batch order whenever they land, so the
        step's bits are the same; a push that fails gives the step's gradients up as the flush's
        push does (:meth:`_release`)."""
        out = self.acc_fold.take_apart(max(EXACT_APART, self._apart_room() - self.grad_uploads))
        if not out:
            return
        epoch, step, gen = key
        loop = asyncio.get_running_loop()
        for mb, grads in out:
            if self.acc_key != key:
                return  # given up meanwhile (a failed push, a new step or generation)
            msg, frames, data = await loop.run_in_executor(None, self._push_message, epoch, step, gen, [mb], grads)
            rep = await self._send_push(msg, data, frames)
            if rep is not None and rep.accepted:
                log.info("%s pushed the gradient of step %d mb %d at once (no room beyond its plan to hold it)",
                         self.opts.name, step, mb)
                if self.acc_key == key:
                    self.acc_pushed.add(mb)
            else:
                if rep is None:
                    await self._release(epoch, step, gen)
                else:
                    log.info("%s: push refused: %s", self.opts.name, rep.reason)
                    if self.ef is not None:
                        self.ef.reset()  # (as the flush's push: the residual holds part of a voided gradient)
                if self.acc_key == key:
                    self._drop_acc()
                return

    async def _send_check(self, task: pb.Task, grads: dict[str, torch.Tensor]) -> None:
        """Send the parameter gradient of a check task (a micro-batch another worker computed,
        computed again here) alone, tagged with its check id; nothing is accumulated."""
        try:
            msg, frames, data = await asyncio.get_running_loop().run_in_executor(
                None, self._push_message, task.epoch, task.step, 0, [task.mb], grads, task.check_id)
            rep = await self._send_push(msg, data, frames)
            if rep is not None and not rep.accepted:
                log.info("%s: check result refused: %s", self.opts.name, rep.reason)
        finally:
            self.held.discard(task.lease_id)

    async def _send_push(self, msg: pb.GradPush, data: bytes, frames: list[Frame] | None = None,
                         progress: SendProgress | None = None, server=None) -> pb.PushReply | None:
        """Stream one push (``data``: it serialised; ``frames``: its gradients when ``msg``
        is only its head) to ``server`` (default: this worker's), retrying transport
        failures; None when every attempt failed."""
        server = server or self.server
        delay = 0.1
        for attempt in range(1, self.opts.push_attempts + 1):
            try:
                if "push_abandon" in self.inject or (msg.local_round and "pseudo_abandon" in self.inject):
                    raise _injected("push_abandon: this push never leaves the worker")
                if "push_fail" in self.inject:
                    self.inject.discard("push_fail")
                    raise _injected("push_fail: the first attempt is lost before it is sent")
                rep = await send(server.PushGradsStream, msg, self.chunk_bytes, traffic=self.traffic,
                                 data=data, sender=self.member_id,
                                 timeout=max(self.opts.push_timeout_s, transfer_timeout(len(data))),
                                 frames=None if frames is None else [("grad_push", f) for f in frames],
                                 stall_s=self.opts.push_stall_s, progress=progress)
                if "push_lost" in self.inject:
                    self.inject.discard("push_lost")
                    raise _injected("push_lost: the push landed but its reply is lost")
                return rep
            except (grpc.aio.AioRpcError, StreamStalled) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _FINAL_CODES:
                    raise
                why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.info("%s: push of step %d mbs %s failed (%s, attempt %d of %d)", self.opts.name,
                         msg.step, list(msg.mbs), why, attempt, self.opts.push_attempts)
                if attempt < self.opts.push_attempts:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)
        self.inject.discard("push_abandon")
        if msg.local_round:
            self.inject.discard("pseudo_abandon")
        return None

    async def _release(self, epoch: int, step: int, gen: int, why: str = "could not push") -> None:
        """Tell the server we no longer hold our un-pushed gradients of ``step``.

        An empty push means "release": the server puts the micro-batches back to ``todo``.
        If even this cannot land, the server asks again: its next ``Lease`` reply says
        ``flush`` while we hold nothing, and :meth:`_one` releases then.
        """
        log.warning("%s: %s the gradients of step %d; releasing them to be redone", self.opts.name, why, step)
        if self.ef is not None:
            self.ef.reset()  # the residual of a push that never landed must not be carried on
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.server.PushGrads(pb.GradPush(worker=self.member_id, step=step, epoch=epoch, gen=gen),
                                        timeout=10)

    def _session(self, server) -> SessionClient | None:
        """The open session with ``server`` (opened now if needed); None: use the calls."""
        if not self.session_ok:
            return None
        sess = self.sessions.get(id(server))
        if sess is not None and not sess.alive:
            if sess.error is not None and sess.error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("%s: the server offers no sessions; using calls", self.opts.name)
                self.session_ok = False
                self.sessions.pop(id(server), None)
                return None
            sess = None
        if sess is None:
            sess = self.sessions[id(server)] = SessionClient(
                server.Session, self.member_id, self.chunk_bytes, 2 * self._act_bytes() + CONTROL_SLACK,
                traffic=self.traffic)
        return sess

    def _close_sessions(self) -> None:
        for sess in self.sessions.values():
            sess.close()
        self.sessions.clear()

    async def _ask(self, server, ahead: bool = False, started: int = 0) -> pb.LeaseReply:
        """One lease request (long-polled by the server); a task it brings is held from here on.

        ``started``: the lease id this worker starts computing now (a session's server then
        knows the grants it still may take back)."""
        req = pb.LeaseRequest(worker=self.member_id, wait_s=self.opts.lease_wait_s, ahead=ahead, started=started)
        sess = self._session(server)
        if sess is not None:
            rep = await sess.lease(req, timeout=10)
            self.credit = max(1, rep.credit)
        elif self._lease_cap() <= self.chunk_bytes:
            # Any reply fits one chunk: a unary call (about half the CPU of a streamed one at
            # both ends), counted by the channel like every unary call.
            rep = await server.Lease(req, timeout=10)
        else:
            rep = await fetch(server.LeaseStream, req, pb.LeaseReply, self._lease_cap(),
                              timeout=10, traffic=self.traffic)
        if rep.has_task:
            self.held.add(rep.task.lease_id)  # renewed by the heartbeats until its result is sent
        return rep

    async def _lease(self, server) -> pb.LeaseReply:
        """The next lease reply: the one asked for ahead during the last compute, else a new one."""
        if self.ahead is not None and self.ahead[0] is not server:
            self._drop_ahead()  # asked of a server this worker has left
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            try:
                rep = await ahead[1]
            except grpc.aio.AioRpcError as exc:
                log.info("%s: lease asked ahead failed (%s); asking again", self.opts.name, exc.code())
            else:
                sess = self.sessions.get(id(server))
                if rep.has_task and sess is not None and rep.task.lease_id in sess.taken_back:
                    # Granted ahead, then given to a worker that went idle: not ours to start.
                    sess.taken_back.discard(rep.task.lease_id)
                    self.held.discard(rep.task.lease_id)
                    rep.has_task = False
                    rep.ClearField("task")
                return rep
        return await self._ask(server)

    def _ask_ahead(self, server, started: int = 0) -> None:
        """Ask for the next task now, while this one computes (exact sync, ``--prefetch``).

        On a session only within the server's credit window (credit >= 2), and a task held
        ahead unstarted is taken back for a worker that goes idle and would finish it sooner.
        Opt-in: on the 2-core box asking ahead over sessions made ``launch`` S=2 W=2 steps
        30-40 % longer in an A/B of one run (bench/results/stream.md); without sessions it
        shortened steps by 6-15 % on the emulated demo scenario but lengthened them 22 % on
        the demo's own workload (bench/results/bench_runtime.md). Local mode never asks
        ahead: a backward task there is pinned to the worker that ran its forward.
        """
        on_session = self.sessions.get(id(server)) is not None and self.session_ok
        wanted = self.opts.prefetch and (self.credit >= 2 or not on_session)
        if wanted and not self.local and self.ahead is None:
            self.ahead = (server, asyncio.create_task(self._ask(server, ahead=True, started=started)))

    def _drop_ahead(self) -> None:
        """Forget the lease asked ahead: a task it brought is no longer renewed, so it runs out
        at the server and is redone."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        t = ahead[1]
        if not t.done():
            t.cancel()
        elif not t.cancelled() and t.exception() is None and t.result().has_task:
            self.held.discard(t.result().task.lease_id)

    async def _one(self) -> None:
        server = self.server
        self._do(f"waiting for a task of stage {self.stage}")
        trace(self.opts.name, "ask")
        rep = await self._lease(server)
        trace(self.opts.name, "reply", task=rep.has_task, flush=rep.flush, v=rep.version)
        if self.acc_key is not None and self.acc_key != (rep.epoch, rep.step, rep.gen):
            self._drop_acc()  # voided by the server, or a roll-back
        if self.local:
            self._local_check_gen(rep)
        if rep.flush and self.uploads:
            # The server counts our results as computed once they land; wait for the replies
            # so that the gradients they carry are in what we push (or release).
            await self._drain()
            if self.acc_key is not None and self.acc_key != (rep.epoch, rep.step, rep.gen):
                self._drop_acc()
        if rep.flush and self.acc_key is not None:
            if self.hangs and self._claim_hang("hang_before_push", rep.step, held=sorted(self.acc_mbs)):
                while True:
                    await asyncio.sleep(3600)
            await (self._local_done() if self.local else self._push())
        elif rep.flush:
            # The server awaits gradients we do not hold (a push or a result reply was
            # lost): release them so they are redone rather than awaited forever.
            spoiled = self.lean_sum.spoiled == (rep.epoch, rep.step)
            await self._release(rep.epoch, rep.step, rep.gen, "dropped its lean sum of" if spoiled else "could not push")
            self.lean_sum.released(rep.epoch, rep.step)
        if self.local:
            await self._local_tick(rep)
        if not rep.has_task:
            if not self.local and idle_pull(rep, self.version, self.weights_epoch):
                await self._pull()  # nothing to do yet: fetch the new weights before a task needs them
            return
        if 0 <= self.opts.fault_stop_from <= rep.task.step:
            # fault injection: a worker that takes no task of this step or later leaves the run
            # (its lease is voided at once and redone by the others; a stage it served alone is
            # re-planned, where an idle worker that stayed would stall it)
            self.held.discard(rep.task.lease_id)
            why = f"fault injection: takes no task of step {rep.task.step} or later"
            log.info("%s: %s; leaving the run", self.opts.name, why)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await server.Leave(pb.MemberRequest(member_id=self.member_id), timeout=2)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.coord.Leave(pb.MemberRequest(member_id=self.member_id, leave_reason=why), timeout=2)
            self.done = True
            return
        self.last_task_t = time.monotonic()
        task = rep.task  # held since _ask received it
        handed = False  # once the upload owns the lease it stops holding it
        try:
            if self.local:
                if self._local_needs_pull(rep, task):
                    await self._local_pull()
                if self._local_needs_pull(rep, task):
                    return  # a newer merge came meanwhile; the lease will be dropped
            elif self.version != task.step or self.weights_epoch != task.epoch:
                await self._pull()
            if not self.local and self.version != task.step:
                return  # the server moved on; the lease will be dropped
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            self._ask_ahead(server, task.lease_id)
            self._do(f"computing {pb.Direction.Name(task.direction)} step {task.step} mb {task.mb}")
            try:
                if self.opts.shadow:
                    out, loss, grads, recomputed = self._shadow_compute(task)
                    await self._shadow_wait(self._task_flops(task.direction, recomputed), t0)
                else:
                    out, loss, grads, recomputed = await loop.run_in_executor(None, self._compute, task)
            except torch.OutOfMemoryError:
                await self._out_of_memory()
                return
            elapsed = time.perf_counter() - t0
            trace(self.opts.name, "computed", step=task.step, mb=task.mb, d=task.direction)
            if self.opts.fault_slow > 1.0:
                await asyncio.sleep((self.opts.fault_slow - 1.0) * elapsed)  # fault injection: a slow device
            if self.opts.slow_s > 0:
                await asyncio.sleep(self.opts.slow_s)
            if self.pacer is not None and not self.opts.shadow:
                await loop.run_in_executor(None, self.pacer.pad,
                                           self._task_flops(task.direction, recomputed), elapsed)
            if task.check_id:
                handed = True
                await self._send_check(task, grads)
                return
            task_s = time.perf_counter() - t0
            if task_s > 0:
                self.obs_flops = ewma(self.obs_flops, self._task_flops(task.direction, recomputed) / task_s)
                self.obs_tasks += 1
            result = pb.TaskResult(worker=self.member_id, step=task.step, mb=task.mb,
                                   direction=task.direction, epoch=task.epoch, lease_id=task.lease_id,
                                   loss=loss, compute_s=task_s)
            if out is not None:
                if "bad_shape" in self.inject:
                    self.inject.discard("bad_shape")
                    out = out[..., :-1]
                codec = self._codec("act" if task.direction == pb.FWD else "grad")
                # a stochastic codec's rounding: fixed by the task, so a retried task sends the same bytes
                key = sr_key(self.spec.seed, self.stage, task.step, task.mb, task.direction)
                # a large output's frame is a view of its bytes, copied once, as the message is
                # serialised; a small one goes into the message, where protobuf is faster
                # (wire.with_frame)
                frame = await off_loop(out.numel() * out.element_size(), encode_frame, "out", out, codec, None, key,
                                       None, True)
                result = with_frame(result, "output", frame)
            if self.upload_error is not None:
                raise self.upload_error
            handed = True
            via = self._ask_with_result(server, result)
            await self._upload(server, task, result, grads, via)
        finally:
            if not handed:
                self.held.discard(task.lease_id)

    def _ask_with_result(self, server, result: pb.TaskResult) -> SessionClient | None:
        """On a session, send the next lease request with this result (the worker is idle once
        its result is out): one message up per task instead of two, and the server answers
        both with one message when it has a task (:meth:`SessionClient.ask_with`). The reply
        is awaited as a lease asked ahead (:meth:`_lease`). Returns the session the request
        is registered with (None: not attached; local mode and prefetch ask on their own)."""
        if self.local or self.ahead is not None or not self.session_ok:
            return None
        if not result_on_session(payload_bytes(result) + 1024, self.chunk_bytes, self.uplinks.get(self.server_addr)):
            return None  # the result goes by a call of its own; the request on the session, alone
        sess = self.sessions.get(id(server))
        if sess is None or not sess.alive:
            return None
        req = pb.LeaseRequest(worker=self.member_id, wait_s=self.opts.lease_wait_s)
        ask_id, fut = sess.ask_with(result, req)
        timeout = 10 + transfer_timeout(payload_bytes(result))  # the result goes up first
        self.ahead = (server, asyncio.create_task(self._next_reply(sess, ask_id, fut, timeout)))
        return sess

    async def _next_reply(self, sess: SessionClient, ask_id: int, fut: asyncio.Future,
                          timeout: float) -> pb.LeaseReply:
        """The reply to the lease request sent with a result; a task it brings is held from here on."""
        rep = await sess.next_reply(ask_id, fut, timeout)
        self.credit = max(1, rep.credit)
        if rep.has_task:
            self.held.add(rep.task.lease_id)  # renewed by the heartbeats until its result is sent
        return rep

    async def _upload(self, server, task: pb.Task, result: pb.TaskResult, grads,
                      via: SessionClient | None = None) -> None:
        """Send a task's result: in the background while the next task is leased and computed.

        At most ``uploads_in_flight`` results are on their way at once (each holds one
        activation-sized message and its gradients); with 0 the result is awaited here. A
        result's parameter gradient stays on the device until the server accepts it (then it
        joins the step's sum), so one that carries gradients goes in the background only while
        the device has room for it beyond the plan (:meth:`_grad_upload_room`), else it is
        awaited too. ``via``: the session the result's attached lease request belongs to.
        """
        carries = grads is not None and not isinstance(grads, LeanShare)  # (a lean share is in .grad already)
        if self.opts.uploads_in_flight <= 0 or (carries and self._grad_upload_room() < 1):
            await self._send_result(server, task, result, grads, via)
            return
        while len(self.uploads) >= self.opts.uploads_in_flight:
            await asyncio.wait(set(self.uploads), return_when=asyncio.FIRST_COMPLETED)
        t = asyncio.create_task(self._send_result(server, task, result, grads, via))
        self.uploads.add(t)
        t.add_done_callback(self._upload_done)
        if carries:
            self.grad_uploads += 1
            t.add_done_callback(self._grad_upload_done)

    def _grad_upload_done(self, _t: asyncio.Task) -> None:
        self.grad_uploads -= 1

    def _grad_upload_room(self) -> int:
        """Results carrying gradients that may be on their way now: the gradients the device
        holds beyond its plan (:meth:`_apart_room`) less those already on their way and those
        waiting apart from the step's sum."""
        fold = self.acc_local if self.local else self.acc_fold
        apart = max(0, fold.held() - 1) if self.spec.ordered_grads else 0
        return self._apart_room() - self.grad_uploads - apart

    def _upload_done(self, t: asyncio.Task) -> None:
        """An upload ended: an unexpected failure is logged here and raised by the task loop."""
        self.uploads.discard(t)
        if not t.cancelled() and t.exception() is not None and self.upload_error is None:
            exc = t.exception()
            log.error("%s: a result upload failed", self.opts.name, exc_info=(type(exc), exc, exc.__traceback__))
            self.upload_error = exc

    async def _drain(self) -> None:
        """Wait until every result upload has been answered (or has given up)."""
        while self.uploads:
            await asyncio.wait(set(self.uploads))
        if self.upload_error is not None:
            raise self.upload_error

    async def _send_result(self, server, task: pb.Task, result: pb.TaskResult, grads,
                           via: SessionClient | None = None) -> None:
        """:meth:`_send_result_once`; a lean share whose result was never answered spoils its
        step's sum (the server may count the task; the sum cannot say)."""
        try:
            await self._send_result_once(server, task, result, grads, via)
        finally:
            if isinstance(grads, LeanShare) and not grads.settled:
                said = self.lean_sum.spoiled == (task.epoch, task.step)
                self.lean_sum.spoil(task.epoch, task.step)
                self._lean_spoiled(task, None if said else "its result got no answer")

    def _lean_spoiled(self, task: pb.Task, why: str | None) -> None:
        """A lean sum of ``task``'s step that may not be reported: said (unless ``why`` is None:
        said already), and its bookkeeping dropped (the step's flush then releases what the
        server holds of it: redone)."""
        if why is not None:
            log.info("%s drops its gradient sum of step %d (lean worker: %s); the step's micro-batches it ran "
                     "are redone", self.opts.name, task.step, why)
        if self.acc_key is not None and self.acc_key[:2] == (task.epoch, task.step):
            self.acc_key, self.acc_mbs = None, []

    async def _send_result_once(self, server, task: pb.Task, result: pb.TaskResult, grads,
                                via: SessionClient | None = None) -> None:
        """Stream one result, retrying transport failures with the same lease id (the server
        acknowledges a retry whose first attempt landed); keep its gradients once accepted.

        While it is on its way the lease stays in ``held`` (renewed by the heartbeats); an
        upload that cannot land is given up and its lease runs out: the task is redone.
        """
        delay = 0.1
        try:
            data = await serialised(result)
            for attempt in range(1, self.opts.upload_attempts + 1):
                try:
                    sess = (self._session(server) if result_on_session(len(data), self.chunk_bytes,
                                                                       self.uplinks.get(self.server_addr)) else None)
                    if result.HasField("next") and sess is not via:
                        # The attached lease request belongs to a session that is gone (or to
                        # none): it fails there and is asked again; the result goes alone.
                        if via is not None:
                            via.abandon(result.next.ask_id, unavailable("the session ended before the result"))
                        result.ClearField("next")
                        data = await serialised(result)
                    if sess is not None:
                        done = await sess.complete(result, data, timeout=transfer_timeout(len(data)))
                    elif len(data) <= self.chunk_bytes:
                        # One chunk's worth: a unary call (about half the CPU of a streamed one).
                        msg = pb.TaskResult.FromString(data) if isinstance(result, Framed) else result
                        done = await server.Complete(msg, timeout=transfer_timeout(len(data)))
                    elif isinstance(result, Framed):
                        done = await send(server.CompleteStream, result.head, self.chunk_bytes, traffic=self.traffic,
                                          sender=self.member_id, data=data, frames=framed_frames(result))
                    else:
                        done = await send(server.CompleteStream, result, self.chunk_bytes, traffic=self.traffic,
                                          sender=self.member_id, data=data)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in _FINAL_CODES or attempt == self.opts.upload_attempts:
                        log.info("%s: result of step %d mb %d not sent (%s); its lease runs out", self.opts.name,
                                 task.step, task.mb, exc.code().name)
                        return
                    if result.HasField("next"):
                        # The attached request went (or failed) with this attempt: a retry
                        # carries the result alone (a second copy would be granted twice).
                        result.ClearField("next")
                        data = await serialised(result)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 1.0)
        finally:
            self.held.discard(task.lease_id)
        trace(self.opts.name, "result_ack", step=task.step, mb=task.mb, ok=done.accepted, grads=grads is not None)
        if isinstance(grads, LeanShare):
            self._lean_answered(task, result, grads, done)
            return
        if not done.accepted:
            log.info("%s: result refused: %s", self.opts.name, done.reason)
            return
        self.tasks_done += 1
        self.compute_s += result.compute_s
        if grads is not None:
            key = (task.epoch, task.step, done.gen)
            if self.acc_key != key:
                self._drop_acc()
                self.acc_key = key
            self.acc_mbs.append(task.mb)
            if self.spec.ordered_grads:
                # one sum for a run from 0 (local mode: one for all once the order is given up),
                # not a copy a micro-batch; a large stage's sum in a thread (this upload ends
                # after it, and a push or the step's report drains the uploads first)
                nbytes = sum(g.numel() * g.element_size() for g in grads.values())
                if self.local:
                    ordered = self.acc_local.rest is None
                    await off_loop(nbytes, self.acc_local.add, task.mb, grads, self._apart_room() - self.grad_uploads)
                    if ordered and self.acc_local.rest is not None:
                        log.info("%s sums step %d's gradients as they are accepted from micro-batch %d on "
                                 "(no room beyond its plan to keep them apart)", self.opts.name, task.step, task.mb)
                else:
                    await off_loop(nbytes, self.acc_fold.add, task.mb, grads)
                    await self._push_apart(key)
            else:
                for name, g in grads.items():
                    if name in self.acc:
                        self.acc[name].add_(g)
                    else:
                        self.acc[name] = g.clone() if self.opts.shadow else g  # shadow tensors are shared

    def _lean_answered(self, task: pb.Task, result: pb.TaskResult, share: LeanShare, done) -> None:
        """A lean worker's result answered: its gradient, in the step's ``.grad`` sum already,
        counts if the server accepted it and the sum is still the step's (:class:`LeanSum`)."""
        if done.accepted:
            self.tasks_done += 1
            self.compute_s += result.compute_s
        else:
            log.info("%s: result refused: %s", self.opts.name, done.reason)
        key = (task.epoch, task.step, done.gen)
        said = self.lean_sum.spoiled == (task.epoch, task.step)  # (dropped already: said once)
        if done.accepted and self.acc_key is not None and self.acc_key != key:
            if self.acc_key[:2] == key[:2]:  # a new generation: the server dropped what we ran before
                self.lean_sum.spoil(task.epoch, task.step)
            self.acc_key, self.acc_mbs = None, []  # (an older step's leftovers: the server moved on)
        if not self.lean_sum.settle(share, done.accepted):
            self._lean_spoiled(task, None if said else "a result it holds was refused" if not done.accepted else
                               "the server's generation or step changed under it")
            return
        self.acc_key = key
        self.acc_mbs.append(task.mb)

    async def _out_of_memory(self) -> None:
        """Leave the run with a one-line error: the server re-queues our tasks at once."""
        self.fatal = oom_message(self.stage, self.first, self.last, self.spec.micro_batch_size, self.spec.seq_len,
                                 str(self.torch_device), self.precision)
        log.error("%s: %s", self.opts.name, self.fatal)
        self.graphs.clear()
        self._drop_acc()
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.server.Leave(pb.MemberRequest(member_id=self.member_id), timeout=2)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.coord.Leave(pb.MemberRequest(member_id=self.member_id, leave_reason=self.fatal), timeout=2)
        self.done = True

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

    def _maybe_busy(self, kind: str, task: pb.Task) -> None:
        """Test fault ``busy_*``: one long compute that holds the interpreter (see :func:`parse_busy`)."""
        opts = self.busy.get(kind)
        if opts is None or task.step < int(opts.get("step", 0)):
            return
        del self.busy[kind]
        secs = float(opts["secs"])
        log.warning("%s: injected %s: computing step %d mb %d for %.1f s more", self.opts.name, kind, task.step,
                    task.mb, secs)
        mark = opts.get("mark")
        if mark:
            with open(mark + ".tmp", "w") as f:
                f.write(json.dumps({"kind": kind, "step": task.step, "mb": task.mb, "worker": self.opts.name,
                                    "member_id": self.member_id, "secs": secs}))
            os.replace(mark + ".tmp", mark)
        spin(secs)

    def _graph_room(self) -> int:
        """Forward graphs this worker may keep now (:func:`graph_room`): its device memory
        (``--memory-gb``, else what the device has) beyond its stage's planned need and the
        gradients it holds."""
        memory, need, per_graph, grad = self._stage_memory()
        spec = self.spec
        held = (self.acc_local if self.local else self.acc_fold).held() if spec.ordered_grads else (1 if self.acc else 0)
        # (the planned need counts one sum of the step's gradients: WORKER_BYTES_PER_PARAM)
        return graph_room(memory, need, max(0, held - 1) * grad, per_graph, 2 * spec.micro_batches)

    def _apart_room(self) -> int:
        """Gradients this worker may keep apart from its sum (local mode: :class:`LocalFold`;
        exact sync: :meth:`_push_apart`):
        the whole-stage gradients its device holds beyond its stage's planned need (which counts
        the task's gradient and the sum) and the forward graphs it keeps now
        (:meth:`_graph_room` counts the ones apart in turn)."""
        memory, need, per_graph, grad = self._stage_memory()
        free = memory - need - len(self.graphs) * per_graph
        return max(0, int(free // grad)) if grad > 0 else 0

    def _stage_memory(self) -> tuple[float, float, float, float]:
        """(device memory, the stage's planned need, one forward graph, one gradient) in bytes:
        worked out once a stage, in float32 as the planner's figures, and logged with the graphs
        it may keep."""
        spec = self.spec
        if getattr(self, "_room_for", None) != (self.first, self.last):
            from shoal.model.profile import profile_model
            from shoal.plan.cost import stage_worker_memory
            from shoal.plan.types import SyncPolicy
            from shoal.runtime.measure import device_memory

            prof = profile_model(self.cfg, spec.seq_len, spec.micro_batch_size, 4)
            a, b = self.first, self.last
            self._room = (self.opts.memory or device_memory(self.opts.compute_device),
                          stage_worker_memory(prof, a, b, SyncPolicy(mode="local", lean=self.lean) if self.local else None),
                          float(prof.saved_act_bytes(a, b)), 4.0 * prof.params(a, b))
            self._room_for = (a, b)
            memory, need, per_graph, _ = self._room
            log.info("%s keeps at most %d forward graphs of stage [%d, %d) (%.3g MB each; device memory %.3g GB, "
                     "the stage's planned need %.3g GB)", self.opts.name,
                     graph_room(memory, need, 0.0, per_graph, 2 * spec.micro_batches), a, b, per_graph / 1e6,
                     memory / 1e9, need / 1e9)
        return self._room

    def _task_flops(self, direction: int, recomputed: bool) -> float:
        """FLOPs of one task from the analytic profile (see :func:`task_flops`)."""
        from shoal.model.profile import profile_model

        if getattr(self, "_flops_for", None) != (self.first, self.last):
            prof = profile_model(self.cfg, self.spec.seq_len, self.spec.micro_batch_size, 4)
            self._flops = prof.fwd_flops(self.first, self.last), prof.bwd_flops(self.first, self.last)
            self._flops_for = (self.first, self.last)
        fwd, bwd = self._flops
        return task_flops(direction, fwd, bwd, recomputed)

    def _shadow_compute(self, task: pb.Task):
        """A shadow task: no model, fixed tensors of the true shapes and dtypes (see
        :mod:`shoal.runtime.roles.shadow`); the same return as :meth:`_compute`."""
        from shoal.runtime.roles.shadow import shadow_grads, shadow_loss, shadow_tensor

        shape = (self.spec.micro_batch_size, self.spec.seq_len, self.cfg.d_model)
        key = (task.epoch, task.step, task.mb)
        if task.direction == pb.FWD:
            self.shadow_fwd[key] = None
            while len(self.shadow_fwd) > 2 * self.spec.micro_batches:
                self.shadow_fwd.pop(next(iter(self.shadow_fwd)))
            return shadow_tensor(shape, self.act_dtype), 0.0, None, False
        recomputed = task.direction == pb.BWD and key not in self.shadow_fwd
        self.shadow_fwd.pop(key, None)
        out = None if self.first == 0 else shadow_tensor(shape, self.act_dtype)
        loss = shadow_loss(self.cfg.vocab_size) if task.direction == pb.FWDBWD else 0.0
        return out, loss, shadow_grads(self.params), recomputed

    async def _shadow_wait(self, flops: float, t0: float) -> None:
        """Wait the emulated device's time for a task of ``flops`` (its pacer, else --flops)."""
        elapsed = time.perf_counter() - t0
        if self.pacer is not None:
            await self.pacer.apad(flops, elapsed)
        elif self.flops > 0:
            await asyncio.sleep(max(0.0, flops / self.flops - elapsed))

    def _compute(self, task: pb.Task):
        """Run one task; returns (output or None, loss, parameter grads or None, recomputed).

        ``recomputed`` says whether a ``BWD`` task ran the stage forward again (no cached
        graph of this worker's own forward), so the pacer charges that forward only then.
        """
        spec = self.spec
        dev, prec = self.torch_device, self.precision
        if "oom" in self.inject:
            self.inject.discard("oom")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected by --inject oom)")
        first_stage = self.first == 0
        shape = (spec.micro_batch_size, spec.seq_len, self.cfg.d_model)
        # The stage servers own the data: a first- or last-stage task carries its tokens.
        tokens = None
        if first_stage or task.direction == pb.FWDBWD:
            window = decode_tensor(task.tokens, shape=(spec.micro_batch_size, spec.seq_len + 1), dtype="int32")
            tokens = split_window(window, self.cfg.vocab_size)
        if first_stage:
            x, targets = tokens
        else:
            # A view of the payload (read-only here: the forward and backward only read it).
            x = decode_tensor(task.input, shape=shape, dtype=self.act_dtype, finite=True, copy=False)
            targets = tokens[1] if tokens is not None else None
        x = to_device(x, dev)
        targets = None if targets is None else to_device(targets, dev)
        key = (task.epoch, task.step, task.mb)
        if self.busy:
            self._maybe_busy("busy_fwd" if task.direction == pb.FWD else "busy_bwd", task)
        if self.hangs and self._claim_hang("hang_fwd" if task.direction == pb.FWD else "hang_bwd", task.step,
                                           mb=task.mb, direction=pb.Direction.Name(task.direction)):
            while True:
                time.sleep(3600)
        if task.direction == pb.FWD:
            room = self._graph_room() if self.opts.graph_cache else 0
            if room <= 0:
                self.graphs.clear()  # (kept while there was room: the gradients held since take it)
                with torch.no_grad(), autocast(dev, prec):
                    return to_host(self.module(x).contiguous()), 0.0, None, False
            # Keep the graph: if this worker also gets the micro-batch's backward, it skips
            # the recomputation. Dropping an entry is always safe (BWD recomputes).
            if not first_stage:
                x = x.requires_grad_(True)
            with autocast(dev, prec):
                out = self.module(x)
            self.graphs[key] = (x, out)
            while len(self.graphs) > room:
                self.graphs.pop(next(iter(self.graphs)))
            return to_host(out.detach().contiguous()), 0.0, None, False
        # A lean worker's backward adds into the step's sum in .grad (shoal.runtime.sync.lean;
        # redundant checks, whose gradient goes alone, are exact sync's: safety.redundant).
        share = None
        if self.lean:
            clear, share = self.lean_sum.begin(task.epoch, task.step)
        if share is None or clear:
            for p in self.params.values():
                p.grad = None
        cached = self.graphs.pop(key, None) if task.direction == pb.BWD else None
        if cached is not None:
            x = cached[0]
        elif not first_stage:
            x = x.requires_grad_(True)
        if task.direction == pb.FWDBWD:
            with autocast(dev, prec):
                loss = self.module(x, targets)
            backward_loss(loss, spec.micro_batches, task.loss_scale or 1.0)
            loss_v = float(loss.detach())
        else:
            g = decode_tensor(task.out_grad, shape=shape, dtype=self.act_dtype, finite=self.grads_finite, copy=False)
            if cached is not None:
                out = cached[1]
            else:
                with autocast(dev, prec):
                    out = self.module(x)
            self.graph_hits += cached is not None
            out.backward(to_device(g, dev))
            loss_v = 0.0
        if share is not None:
            grads = share
        else:
            grads = {n: p.grad for n, p in self.params.items()}
            for p in self.params.values():
                p.grad = None
        recomputed = task.direction == pb.BWD and cached is None
        return (None if first_stage else to_host(x.grad.contiguous())), loss_v, grads, recomputed


# Refusals that a retry cannot change (wrong token, malformed message).
def sessions_for(asked: bool | None, local: bool) -> bool:
    """Whether a worker talks to its stage server on a session stream (pure; tested directly):
    as asked (``--session`` / ``--no-session``), else in exact sync and not in local mode.

    In exact sync a result carries the worker's next lease request and one message on the
    stream answers both; measured (bench/results/stream.md) the servers then spend less CPU
    per task and the step is as fast. In local mode a result carries no request, a session
    only replaces each call by a message, and ``shoal demo`` stepped slower on one.
    """
    return (not local) if asked is None else bool(asked)


def pushing_report(pushing: int, progress: SendProgress, now: float, stall_s: float) -> int:
    """What a renewal says of the worker's push (pure; tested directly): ``pushing`` (1 + the
    step) while the push is being summed or framed, or its chunks are still leaving or all
    left (the server is taking it in), 0 once its chunks stopped leaving for ``stall_s``.

    The server spares a holder that says it is pushing from the flush check; a push over a
    hung path must not be spared through every retry (minutes) but lose it after one stall.
    """
    return 0 if pushing and progress.stalled(now, stall_s) else pushing


_FINAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.INVALID_ARGUMENT)


def _injected(details: str) -> grpc.aio.AioRpcError:
    """A transport failure made by a test fault (``--inject push_*``)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=f"injected fault {details}")


def work(coord: str, token: str, opts: WorkerOptions, *, dial=None, pacer=None, on_servers=None,
         tls=None, count: int = 1) -> None:
    """Run a worker process until the run is done (hooks: see :class:`Worker`; ``tls``: the
    run's certificates, None for plain text on loopback). ``count`` > 1 (shadow workers
    only): that many workers named ``NAME-i`` in this one process, on one event loop, each
    with its own emulated link (``dial.sibling``) when ``dial`` shapes links."""
    set_threads()
    if count > 1:
        from dataclasses import replace

        # Each shadow worker plays its own copy of the device: its own link (buckets and
        # relays) where the emulation shapes links, all relayed by one thread.
        dials = [dial if i == 0 or not hasattr(dial, "sibling") else dial.sibling(dial.seed + i)
                 for i in range(count)]
        workers = [Worker(coord, token, replace(opts, name=f"{opts.name}-{i}"), dial=dials[i], pacer=pacer, tls=tls)
                   for i in range(count)]
    else:
        workers = [Worker(coord, token, opts, dial=dial, pacer=pacer, tls=tls)]
    for w in workers:
        w.on_servers = on_servers

    async def all_of() -> None:
        if len(workers) > 1:
            gate = asyncio.Semaphore(SHADOW_JOINING)
            for w in workers:
                w.join_gate = gate
        await asyncio.gather(*(w.run() for w in workers))

    run_member(all_of(), coord, ",".join(w.opts.name for w in workers))
    fatal = [w.fatal for w in workers if w.fatal]
    if fatal:
        raise ShoalError(fatal[0])
