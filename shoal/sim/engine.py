"""Discrete-event replay of the task-pool protocol (a hand-written heap loop).

One event heap holds tuples ``(time, seq, kind, a, b)``; ``seq`` breaks ties in the order
events were scheduled, which makes a run a pure function of (plan, scenario, seed).
Per step (synchronous mode, see DESIGN.md):

1. Stage 0's pool receives the step's M forward tasks.
2. A worker sends a lease request to its stage server (one-way latency). The server hands
   it the best task -- its own backward tasks first (it holds their saved activations),
   then orphaned backward tasks, then forward tasks -- or parks the request (long poll)
   until a task arrives. The task's input then flows server -> worker.
3. The worker computes (FLOPs / device FLOP/s, times a straggler factor), then sends its
   output to the next stage's server (forward) or the previous one (backward), where it
   becomes a task. The last stage runs forward and backward at once. A backward task on
   a worker that did not run the forward receives the stage input too and recomputes it.
   When the output has left, the worker asks for its next lease.
4. When all M backward tasks of a stage are in, its server asks each contributing worker
   to push its gradient (parameter bytes x ``sync.grad_compression``), applies the update
   when every micro-batch's gradient has arrived, and every worker of the stage pulls the
   new weights. The step closes when every stage has done so.

Churn: a leaving device drops its flows and its compute; its servers notice after
``lease_timeout_s`` and re-queue its lease, hand its backward tasks to others (who pay the
recompute) and re-run the backward of micro-batches whose gradients it still held. A
joining device is placed by the planner's ``repair`` and pulls the weights first.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque

from shoal.errors import ShoalError
from shoal.model.profile import profile_model
from shoal.plan.compression import wire_ratio
from shoal.plan.cost import (
    FASTER_BY,
    SYNC_CHUNK_MIN,
    SYNC_CHUNK_S,
    coordinator_floor,
    coordinator_members,
    merge_cores,
    merge_cpu_time,
    ordered_pushes,
    reference_cores,
    reference_cpu_time,
    result_handling,
    stage_codec_cpu,
    stage_result_decode,
)
from shoal.plan.standby import state_bytes, step_log_bytes
from shoal.plan.types import Plan, Replica, Scenario, StagePlan
from shoal.plan.validate import validate_plan
from shoal.sim.config import ServerFailure, SimConfig, Straggler
from shoal.sim.net import FLOW_DONE, FlowNet, Resource
from shoal.sim.result import SimResult

# event kinds (FLOW_DONE = 0 comes from net)
ARRIVE = 1  # a message reaches its destination: a = message kind, b = payload
COMPUTE = 2  # a worker finishes computing: a = worker, b = (epoch, task)
LEAVE = 3  # churn: a = device id
JOIN = 4  # churn: a = device id
DETECT = 5  # a server notices a vanished worker: a = worker, b = epoch of the incarnation
SRV_DOWN = 6  # a = host id, b = recovery seconds
SRV_UP = 7  # a = host id
RESEND = 8  # retry a message deferred by a down server: b = (src, dst, nbytes, kind, payload, worker)
APPLY = 9  # a stage server finished its optimizer step: a = stage
CPU_DONE = 10  # a server host's CPU has handled a message: a = message kind, b = payload (see _server_cpu)
STEP_END = 11  # the coordinator's CPU lets the step close now (see coordinator_floor)

BG_CHUNK_S = SYNC_CHUNK_S  # local-mode sync chunks last this long at the link's full rate
BG_CHUNK_MIN = SYNC_CHUNK_MIN  # bytes: no sync chunk is smaller (unless it is the rest)

# message kinds
M_LEASE = 0  # worker -> server: give me a task (payload: worker, epoch)
M_INPUT = 1  # server -> worker: a task and its input (worker, epoch, task)
M_RESULT = 2  # worker -> neighbouring server: a task's output (worker, task)
M_DONE = 3  # worker -> own server: a task without output is done, next lease please (worker, task)
M_PUSHREQ = 4  # server -> worker: push your gradient (worker, epoch, stage)
M_PUSH = 5  # worker -> server: gradient of micro-batches (worker, stage, step, mbs)
M_PULL = 6  # server -> worker: new weights (worker, epoch, stage)
M_JOINPULL = 7  # server -> joining worker: current weights (worker, epoch, stage)
M_LPUSH = 8  # local mode: worker -> server, pseudo-gradient of a sync round (worker, stage, round)
M_LPULL = 9  # local mode: server -> worker, merged weights of a sync round (worker, stage, round)
M_STANDBY = 10  # active server -> hot standby: the stage's state after a committed step (no reply)
M_LOG = 11  # exact sync, active server -> hot standby: the step's summed gradient, before the update (stage, step)
M_LOGACK = 12  # hot standby -> active server: the step's gradient is logged (stage, step, standby)
M_OUTER = 13  # replica plans, server -> server of the same layers in another replica: its merged pseudo-gradient (stage, round)
M_MERGED = 14  # local mode: a stage server's CPU has merged a round's pseudo-gradients (stage, round; no bytes)
M_REF = 15  # local mode: a stage server's CPU has its screen's reference gradient (stage, its number; no bytes)


class Task:
    """A micro-batch task of one stage and direction."""

    __slots__ = ("step", "stage", "m", "bwd", "grad_only", "recompute", "leased_at")

    def __init__(self, step: int, stage: int, m: int, bwd: bool, grad_only: bool = False):
        self.step = step
        self.stage = stage
        self.m = m  # micro-batch id
        self.bwd = bwd  # backward (True) or forward
        self.grad_only = grad_only  # a re-run for lost gradients: its output was already delivered
        self.recompute = False  # set when leased to a worker without the saved activations
        self.leased_at = 0.0  # when its lease was granted


class Worker:
    """A device's worker process (one incarnation per session; ``epoch`` tells them apart)."""

    __slots__ = ("id", "dev", "stage", "alive", "epoch", "saved", "lease", "flows", "busy",
                 "compute_t0", "slow", "joined_at", "held", "ready", "asking", "bg_push", "bg_pull",
                 "bg_up", "bg_down", "bg_round", "uploading", "deferred", "task_s")

    def __init__(self, dev):
        self.id = dev.id
        self.dev = dev
        self.stage: int | None = None  # stage it serves (None: unassigned)
        self.alive = True
        self.epoch = 0  # bumped when it leaves or is moved: stale events are dropped
        self.saved: set[tuple[int, int]] = set()  # (step, m) whose activations it keeps
        self.lease: Task | None = None  # task it holds (at most one)
        self.flows: dict[int, object] = {}  # flows it sends or receives
        self.busy = 0.0  # seconds spent computing
        self.compute_t0 = -1.0  # start of the current computation (-1: none)
        self.slow: list[tuple[float, float, float]] = []  # straggler windows (t0, t1, factor)
        self.joined_at = 0.0
        # overlapped I/O (SyncPolicy.overlap_uploads / prefetch): several tasks in hand at once
        self.held: list[Task] = []  # tasks leased and not yet delivered (requeued if it is written off)
        self.ready: deque[Task] = deque()  # prefetched tasks whose input has arrived
        self.asking = False  # a prefetch lease request (or its input) is on its way
        # local-mode sync traffic, sent in chunks when the link is otherwise idle
        self.bg_push = 0.0  # bytes of this round's pseudo-gradient not yet sent
        self.bg_pull = 0.0  # bytes of this round's merged weights not yet received
        self.bg_up = False  # a push chunk is in flight
        self.bg_down = False  # a pull chunk is in flight
        self.bg_round = (-1, 0)  # (stage, round id) the background bytes belong to
        # overlapped uploads: results leaving its uplink, and a result waiting for one of them to
        # leave (the runtime worker keeps at most SimConfig.uploads_in_flight results in flight)
        self.uploading = 0
        self.deferred: list[tuple] = []
        self.task_s: float | None = None  # its servers' estimate of its task time (lease to result), as the runtime's

    def reset_io(self) -> None:
        """A new incarnation or stage: nothing prefetched, nothing uploading, no sync bytes."""
        self.ready.clear()
        self.asking = False
        self.bg_push = self.bg_pull = 0.0
        self.bg_up = self.bg_down = False
        self.uploading = 0
        self.deferred.clear()


class Stage:
    """A stage server's state: task pool, leases, gradient bookkeeping."""

    def __init__(self, idx: int, sp: StagePlan, host):
        self.idx = idx
        self.first, self.last = sp.layers
        self.host = host
        self.members: dict[str, Worker] = {}  # workers the server believes alive
        self.waiting: dict[str, Worker] = {}  # parked lease requests, oldest first
        self.fwd_pool: deque[Task] = deque()
        self.orphans: deque[Task] = deque()  # backward tasks anyone may take (with recompute)
        self.own: dict[str, deque[Task]] = {}  # backward tasks kept for the worker that ran the forward
        # local-mode sync round in flight: 0 none, 1 pushing pseudo-gradients, 5 every push in and
        # the screen's reference gradient not yet done, 4 merging on the server's CPU, 3 waiting
        # for the other replicas' parts, 2 pulling merged weights
        self.round_phase = 0
        self.round_n = 0  # pseudo-gradients the round's merge takes (its live members at the round's start)
        self.params = 0  # parameters of the stage (the merge's CPU is per parameter)
        self.reference = 0.0  # s of a server core the screen's reference gradient takes a round (cost.reference_cpu_time)
        self.ref_state = 0  # that gradient for the next merge: 0 not started, 1 on the server's CPU, 2 done
        self.ref_n = 0  # reference gradients started (tells a stale one's CPU_DONE apart)
        self.ref_from = 0.0  # when the next one could start: the last merge's end (the run's start)
        self.round_id = 0
        self.round_push: set[str] = set()  # workers whose push of the current round is awaited
        self.round_pull: set[str] = set()  # workers whose pull of the current round is in flight
        # pipeline replicas: neighbours inside its replica (flat stage indices), its replica's
        # micro-batches per step, and the stages of other replicas it merges layers with
        self.nxt: int | None = None
        self.prv: int | None = None
        self.M = 0
        self.peers: list[tuple[int, float]] = []  # (flat stage index, bytes of the shared layers' merged pseudo-gradient)
        self.outer_got: dict[int, int] = {}  # round id -> peers' merged pseudo-gradients received
        self.reset(-1)

    def reset(self, step: int) -> None:
        self.step = step
        self.fwd_done: set[int] = set()
        self.bwd_done: set[int] = set()
        self.fwd_owner: dict[int, str] = {}
        self.contrib: dict[str, set[int]] = {}  # accepted backward results whose gradients a worker holds
        self.asked: set[str] = set()  # workers asked to push this round
        self.grads_in: set[int] = set()
        self.grad_count: dict[int, int] = {}
        self.fwd_count: dict[int, int] = {}
        self.phase = 0  # 0 computing, 1 applying, 2 pulling, 3 closed
        self.t_drained = 0.0  # seconds into the step when all M backward tasks were in
        self.t_closed = 0.0  # seconds into the step when the stage closed
        self.pending_pulls: set[str] = set()
        self.blocked = False  # local mode: the stage may not close until a sync round is done
        self.launch_after = False  # local mode: start this step's round once the previous one is done
        self.log_wait: set[str] | None = None  # exact sync: standbys whose step-log acknowledgement is awaited
        self.fwd_pool.clear()
        self.orphans.clear()
        self.own.clear()


def _ewma(prev: float | None, x: float, alpha: float = 0.3) -> float:
    """The runtime's task-time estimate update (``shoal.runtime.common.ewma``; sim never imports runtime)."""
    return x if prev is None else (1 - alpha) * prev + alpha * x


def _as_straggler(s) -> Straggler:
    return s if isinstance(s, Straggler) else Straggler(*s)


def _as_failure(s) -> ServerFailure:
    return s if isinstance(s, ServerFailure) else ServerFailure(*s)


def check_plan(plan: Plan, scenario: Scenario) -> None:
    """Raise :class:`ShoalError` if ``plan`` cannot run on ``scenario``.

    The planner's :func:`validate_plan` is the one check of a plan; the simulator
    accepts exactly the plans it accepts.
    """
    validate_plan(plan, scenario)


def _fallback_repair(plan: Plan, original: dict[str, int], left=(), joined=()) -> Plan:
    """Minimal repair used when the planner's is not available (or the plan has pipeline
    replicas, which the planner's repair does not know): rejoin the original stage.
    ``original`` maps a device to its flat stage index (replica by replica)."""
    stages = [StagePlan(sp.layers, sp.server, [w for w in sp.workers if w not in left], list(sp.standbys))
              for sp in plan.all_stages]
    for d in joined:
        s = original.get(d)
        if s is not None and d not in stages[s].workers:
            stages[s].workers.append(d)
    replicas = []
    i = 0
    for r in plan.replicas:
        replicas.append(Replica(stages[i:i + len(r.stages)], r.micro_batches, r.cluster))
        i += len(r.stages)
    return Plan(plan.scenario, plan.model, plan.method, replicas[0].stages if replicas else stages,
                plan.micro_batch_size, plan.micro_batches, plan.sync, dict(plan.predicted), plan.planning_time_s,
                plan.standby_every, replicas)


def _planner_repair():
    try:
        from shoal.plan.repair import repair
    except ImportError:
        return None
    return repair


class Simulator:
    """One simulation of ``plan`` on ``scenario``; call :meth:`run` once."""

    def __init__(self, plan: Plan, scenario: Scenario, *, churn: bool = False, seed: int = 0,
                 record_timeline: bool = False, stragglers=(), server_failures=(),
                 config: SimConfig | None = None):
        check_plan(plan, scenario)
        self.plan = plan
        self.scn = scenario
        self.cfg = config or SimConfig()
        self.churn = churn
        self.seed = seed
        # a plan with pipeline replicas is simulated as one flat list of stages, replica by
        # replica; each stage knows its neighbours inside its replica (see Stage.nxt / prv)
        self.flat = plan.all_stages
        self.S = len(self.flat)
        self.M = plan.micro_batches
        wl = scenario.workload
        self.prof = profile_model(wl.model_config(), wl.seq_len, plan.micro_batch_size, wl.dtype_bytes)
        self.heap: list = []
        self._seq = itertools.count()
        self.seq = self._seq.__next__
        self.net = FlowNet(self.heap, self.seq)
        self.now = 0.0
        self.devices = {d.id: d for d in scenario.devices}
        # stage server hosts carry many flows at once: the flow network tracks them by heaps
        hubs = {sp.server for sp in self.flat}
        self.up: dict[str, Resource] = {d.id: Resource(d.up, d.id in hubs) for d in scenario.devices}
        self.down: dict[str, Resource] = {d.id: Resource(d.down, d.id in hubs) for d in scenario.devices}
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        pol = plan.sync
        db = wl.dtype_bytes
        ac, gc = pol.ratio("act", db, *self.prof.act_shape), pol.ratio("grad", db, *self.prof.act_shape)
        push_r, pull_r = pol.ratio("push", db, *self.prof.act_shape), pol.ratio("pull", db, *self.prof.act_shape)
        # a joiner pulls whole weights, not a sparse delta: top-k pulls cost int8 there, local
        # mode's sparse and lowrank pulls fp32 (shoal.runtime.sync.codecs.dense_codec, UpdatePulls.reply)
        join_r = (4.0 / db if pol.local and pol.pull_codec.startswith(("sparse", "lowrank")) else
                  wire_ratio("int8", db) * pol.grad_compression if pol.pull_codec.startswith("topk") else pull_r)
        self.local = pol.local  # DiLoCo-style rounds every sync_every steps (see _applied)
        self.overlap = pol.local and pol.overlap  # round r runs during round r + 1
        self.overlap_up = pol.overlap_uploads  # lease the next task while the output uploads
        self.prefetch = pol.prefetch  # ask for the next task when computing starts
        self.ordered = pol.ordered and not pol.local  # exact sync: a push per micro-batch outside a run from 0
        self.stages = [Stage(i, sp, self.devices[sp.server]) for i, sp in enumerate(self.flat)]
        # the framework's own CPU (scenario.cpu): each server host's cores handle the messages
        # that cost CPU first come first served; the coordinator bounds the step from below
        self.fw_cpu = scenario.cpu
        self.cores_free: dict[str, list[float]] = {}  # host -> heap of the times its cores are free
        self.coord_floor = coordinator_floor(coordinator_members(plan), len(self.flat), scenario.cpu)
        ref_cores = [c for r in reference_cores(plan, scenario) for c in r]  # per flat stage
        self.merge_cores = [c for r in merge_cores(plan, scenario) for c in r]
        i = 0
        for r in plan.pipelines:
            for j in range(len(r.stages)):
                st = self.stages[i + j]
                st.M = r.micro_batches
                st.prv = i + j - 1 if j > 0 else None
                st.nxt = i + j + 1 if j + 1 < len(r.stages) else None
            i += len(r.stages)
        if plan.replicas:
            # replicas of the same layers merge their pseudo-gradients server to server, per layer
            for st in self.stages:
                for other in self.stages:
                    if other.idx == st.idx or self._replica_of(other.idx) == self._replica_of(st.idx):
                        continue
                    lo, hi = max(st.first, other.first), min(st.last, other.last)
                    if lo < hi:
                        st.peers.append((other.idx, self.prof.param_bytes(lo, hi) * push_r))
        for st in self.stages:
            a, b = st.first, st.last
            st.in_bytes = self.prof.in_act_bytes(a, b) * (1.0 if a == 0 else ac)  # stage input
            if b == self.prof.cfg.n_total_layers:
                # the loss needs the targets: token ids, never compressed
                st.in_bytes += self.prof.tokens_per_micro_batch * 8
            st.out_bytes = self.prof.out_act_bytes(a, b) * ac  # output activation
            st.outgrad_bytes = self.prof.out_act_bytes(a, b) * gc  # its gradient (a backward task's input)
            st.ingrad_bytes = 0.0 if a == 0 else self.prof.in_act_bytes(a, b) * gc  # gradient sent back
            st.fwd_flops = self.prof.fwd_flops(a, b)
            st.bwd_flops = self.prof.bwd_flops(a, b)
            first, last = st.prv is None, st.nxt is None
            # a worker's activation codecs, in series with its compute; its servers' decoding of a
            # lossy result (both decodes charged to the host it lands on, as its bytes are)
            st.fwd_codec_s, st.bwd_codec_s = stage_codec_cpu(self.prof, pol, first, last, self.fw_cpu)
            st.out_decode_s = stage_result_decode(self.prof, pol, True, last, self.fw_cpu)
            st.ingrad_decode_s = stage_result_decode(self.prof, pol, first, True, self.fw_cpu)
            pb = self.prof.param_bytes(a, b)
            st.params = self.prof.params(a, b)
            st.reference = reference_cpu_time((st.fwd_flops + st.bwd_flops) / self.prof.tokens_per_micro_batch,
                                              self.prof.tokens_per_micro_batch, pol, self.fw_cpu,
                                              ref_cores[st.idx]) if self.local else 0.0
            st.push_wire = pb * push_r  # a gradient / pseudo-gradient push
            st.pull_wire = pb * pull_r  # a weight pull (local mode: a delta against the worker's version)
            st.param_wire = pb * join_r  # a joiner's first pull
            st.standby_bytes = state_bytes(self.prof, a, b)  # a hot standby's copy of the stage's state
            st.log_bytes = step_log_bytes(self.prof, a, b)  # exact sync: a standby's log of the step's gradient
            st.last_stage = st.nxt is None
        self.workers: dict[str, Worker] = {}
        self.original_stage: dict[str, int] = {}
        for i, sp in enumerate(self.flat):
            for wid in sp.workers:
                w = Worker(self.devices[wid])
                w.stage = i
                self.workers[wid] = w
                self.original_stage[wid] = i
                self.stages[i].members[wid] = w
        self.plan_now = plan
        self.repair_fn = None if plan.replicas else _planner_repair()
        for s in stragglers:
            s = _as_straggler(s)
            if s.device not in self.workers:
                raise ShoalError(f"straggler {s.device!r} is not a worker of the plan")
            if s.factor <= 0:
                raise ShoalError(f"straggler factor must be positive, got {s.factor}")
            self.workers[s.device].slow.append((s.start_s, s.start_s + s.duration_s, s.factor))
        self.failures = [_as_failure(f) for f in server_failures]
        for f in self.failures:
            if not 0 <= f.stage < self.S:
                raise ShoalError(f"server failure names stage {f.stage}; the plan has {self.S} stages")
        self.down_until: dict[str, float] = {}
        self.timeline: list[tuple[str, float, float, str]] | None = (
            [] if record_timeline and len(self.workers) <= self.cfg.timeline_max_devices else None)
        # statistics
        self.events = 0
        self.requeued = 0
        self.recomputes = 0
        self.duplicates = 0
        self.leaves = 0
        self.joins = 0
        self.repairs = 0
        self.repair_wall = 0.0  # wall seconds spent in the planner's repair (part of wall_time_s)
        self.moves = 0
        self.server_failures_seen = 0
        self.link_bytes: dict[tuple[str, str], float] = {}
        self.step_times: list[float] = []
        self.step = -1
        self.step_start = 0.0
        self.closed = 0
        self.passes: list[dict] = []  # per step: conservation counts
        self.phases: list[list[tuple[float, float]]] = []  # per step, per stage: (backward done, closed)
        self.detect_at: dict[str, float] = {}  # device -> time its last leave is noticed
        self.rngs: dict[str, random.Random] = {}

    # ---------------------------------------------------------------- helpers
    def _replica_of(self, idx: int) -> int:
        """The replica (index into ``plan.pipelines``) flat stage ``idx`` belongs to."""
        i = 0
        for r, rep in enumerate(self.plan.pipelines):
            i += len(rep.stages)
            if idx < i:
                return r
        raise IndexError(idx)

    def _push(self, t: float, kind: int, a, b=None) -> None:
        heapq.heappush(self.heap, (t, self.seq(), kind, a, b))

    def _link(self, a: str, b: str) -> tuple[float, float]:
        key = (a, b)
        v = self._links.get(key)
        if v is None:
            ln = self.scn.network.link(self.devices[a], self.devices[b])
            v = self._links[key] = (ln.latency, ln.bandwidth)
        return v

    def _send(self, src: str, dst: str, nbytes: float, kind: int, payload, worker: Worker | None) -> None:
        """Send a message; ``worker`` is the worker end (its flows die with it)."""
        now = self.now
        if self.down_until:
            t = max(self.down_until.get(src, 0.0), self.down_until.get(dst, 0.0))
            if t > now:
                self._push(t, RESEND, None, (src, dst, nbytes, kind, payload, worker))
                return
        lat, bw = self._link(src, dst)
        if nbytes <= 0:
            self._push(now + lat, ARRIVE, kind, payload)
            return
        if src == dst:
            f = self.net.start(src, dst, None, None, bw, lat, nbytes, now, (kind, payload, worker))
        else:
            f = self.net.start(src, dst, self.up[src], self.down[dst], bw, lat, nbytes, now,
                               (kind, payload, worker))
        if worker is not None:
            worker.flows[f.fid] = f

    def _factor(self, w: Worker) -> float:
        for t0, t1, fac in w.slow:
            if t0 <= self.now < t1:
                return fac
        return 1.0

    # ---------------------------------------------------------------- task pool
    def _assign(self, st: Stage, w: Worker, task: Task) -> None:
        w.lease = task
        task.leased_at = self.now
        w.held.append(task)
        if task.bwd:
            has = (task.step, task.m) in w.saved
            task.recompute = not has
            if has:
                nbytes = st.outgrad_bytes
            elif task.grad_only and st.last_stage:
                nbytes = st.in_bytes
            else:
                nbytes = st.in_bytes + st.outgrad_bytes
        else:
            nbytes = st.in_bytes
        if not w.alive:
            return  # handed to a vanished worker: recovered when the server notices
        self._send(st.host.id, w.id, nbytes, M_INPUT, (w, w.epoch, task), w)

    def _next_task(self, st: Stage, w: Worker) -> Task | None:
        q = st.own.get(w.id)
        if q:
            return q.popleft()
        if st.orphans:
            return st.orphans.popleft()
        if st.fwd_pool:
            return st.fwd_pool.popleft()
        if self.cfg.steal_backward:
            for q in st.own.values():
                if q:
                    return q.pop()
        return None

    @staticmethod
    def _fastest_waiting(st: Stage) -> str:
        """The parked worker an open task goes to. In a one-stage pipeline: the oldest request of
        a worker that no parked worker beats by ``FASTER_BY`` in measured task time (the
        runtime's :func:`shoal.runtime.pool.pool.leave_to_faster`; one not measured yet never
        yields). In a deeper pipeline, where tasks come one at a time, the oldest request (the
        cost model's idle queue serves parked requests in turn)."""
        if st.prv is not None or st.nxt is not None:
            return next(iter(st.waiting))
        known = [w.task_s for w in st.waiting.values() if w.task_s is not None]
        if not known:
            return next(iter(st.waiting))
        bar = FASTER_BY * min(known)
        return next(wid for wid, w in st.waiting.items() if w.task_s is None or w.task_s <= bar)

    def _lease(self, st: Stage, w: Worker) -> None:
        task = self._next_task(st, w)
        if task is None:
            st.waiting[w.id] = w
        else:
            self._assign(st, w, task)

    def _offer(self, st: Stage, task: Task) -> None:
        """A new task at ``st``: give it to a parked worker or queue it."""
        if task.bwd and not task.grad_only:
            owner = st.fwd_owner.get(task.m)
            if owner is not None and owner in st.members:
                if owner in st.waiting:
                    del st.waiting[owner]
                    self._assign(st, st.members[owner], task)
                    return
                st.own.setdefault(owner, deque()).append(task)
                if self.cfg.steal_backward and st.waiting:
                    wid = self._fastest_waiting(st)
                    w = st.waiting.pop(wid)
                    self._assign(st, w, st.own[owner].pop())
                return
        if st.waiting:
            wid = self._fastest_waiting(st)
            w = st.waiting.pop(wid)
            self._assign(st, w, task)
        elif task.bwd:
            st.orphans.append(task)
        else:
            st.fwd_pool.append(task)

    def _requeue(self, st: Stage, task: Task) -> None:
        self.requeued += 1
        if task.bwd:
            if st.waiting:
                self._offer_orphan(st, task)
            else:
                st.orphans.append(task)
        else:
            if st.waiting:
                self._offer(st, task)
            else:
                st.fwd_pool.appendleft(task)

    def _offer_orphan(self, st: Stage, task: Task) -> None:
        wid = self._fastest_waiting(st)
        w = st.waiting.pop(wid)
        self._assign(st, w, task)

    # ---------------------------------------------------------------- steps
    def _start_step(self) -> None:
        self.step += 1
        self.step_start = self.now
        self.closed = 0
        for st in self.stages:
            st.reset(self.step)
        for st0 in self.stages:
            if st0.prv is None:  # the first stage of each replica gets its replica's micro-batches
                for m in range(st0.M):
                    self._offer(st0, Task(self.step, st0.idx, m, False))

    def _accept_fwd(self, st: Stage, w: Worker, task: Task) -> bool:
        if task.step != self.step or task.m in st.fwd_done:
            self.duplicates += 1
            return False
        st.fwd_done.add(task.m)
        st.fwd_count[task.m] = st.fwd_count.get(task.m, 0) + 1
        st.fwd_owner[task.m] = w.id
        return True

    def _accept_bwd(self, st: Stage, w: Worker, task: Task) -> bool:
        if task.step != self.step or task.m in st.bwd_done:
            self.duplicates += 1
            return False
        if not w.alive and w.id not in st.members:
            # the sender was written off before its output landed: the output counts (it is
            # forwarded once), but the parameter gradient it held is gone -- re-run it
            self._requeue(st, Task(self.step, st.idx, task.m, True, grad_only=True))
            return True
        st.bwd_done.add(task.m)
        c = st.contrib.get(w.id)
        if c is None:
            c = st.contrib[w.id] = set()
        c.add(task.m)
        if len(st.bwd_done) == st.M:
            self._begin_sync(st)
        return True

    def _sync_step(self) -> bool:
        k = max(1, self.plan.sync.sync_every)
        return (self.step + 1) % k == 0

    def _begin_sync(self, st: Stage) -> None:
        if st.phase != 0:
            return
        st.t_drained = self.now - self.step_start
        if not self.local and not self._sync_step():
            # gradients that stay on the workers (counted as applied there)
            for mbs in st.contrib.values():
                for m in mbs:
                    st.grad_count[m] = st.grad_count.get(m, 0) + 1
                st.grads_in |= mbs
            st.contrib = {}
            self._maybe_apply(st)
            return
        # Exact sync: every worker holding gradients of the step pushes them. Local mode: the
        # flush tells each of them to take its inner optimizer step, and the step closes when
        # every one has said it did (the runtime's flush and local-done round trip: no bytes,
        # two latencies).
        for wid, mbs in st.contrib.items():
            if mbs and wid not in st.asked:
                w = self.workers[wid]
                st.asked.add(wid)
                self._send(st.host.id, wid, 0, M_PUSHREQ, (w, w.epoch, st.idx), None)
        self._maybe_apply(st)

    def _maybe_apply(self, st: Stage) -> None:
        if st.phase == 0 and len(st.grads_in) == st.M and len(st.bwd_done) == st.M:
            if not self._logged(st):
                return
            st.phase = 1
            # the step itself on one server core: clipping, AdamW, the new version serialised
            update = self.cfg.server_update_s + (0.0 if self.local else self.fw_cpu.server_step_param_s * st.params)
            if update > 0 and not self.local:
                self._push(self.now + update, APPLY, st.idx)
            else:
                self._applied(st)

    def _logged(self, st: Stage) -> bool:
        """Exact sync with hot standbys: the summed gradient goes to every standby, and the
        update waits for their acknowledgements (the runtime's step log); True once they are in."""
        if self.local:
            return True
        if st.log_wait is None:
            standbys = self.flat[st.idx].standbys
            st.log_wait = {h for h in standbys if h in self.devices}
            for h in st.log_wait:
                self._send(st.host.id, h, st.log_bytes, M_LOG, (st.idx, self.step, h), None)
        return not st.log_wait

    def _applied(self, st: Stage) -> None:
        st.phase = 2
        standbys = self.flat[st.idx].standbys
        if standbys and (self.step + 1) % max(1, self.plan.standby_every) == 0:
            # hot standbys fetch the committed state: background flows on the active host's uplink
            for h in standbys:
                if h in self.devices:
                    self._send(st.host.id, h, st.standby_bytes, M_STANDBY, None, None)
        if self.local:
            self._start_reference(st)
            if self._sync_step():
                if st.round_phase:
                    # delayed application: the previous round must land before this one starts
                    st.blocked = st.launch_after = True
                else:
                    self._launch_round(st)
                    st.blocked = not self.overlap
        elif self._sync_step():
            for w in st.members.values():
                if w.alive:
                    st.pending_pulls.add(w.id)
                    self._send(st.host.id, w.id, st.param_wire, M_PULL, (w, w.epoch, st.idx), w)
        self._maybe_close(st)

    def _maybe_close(self, st: Stage) -> None:
        if st.phase == 2 and not st.pending_pulls and not st.blocked:
            st.phase = 3
            st.t_closed = self.now - self.step_start
            self.closed += 1
            if self.closed == self.S:
                self._close_step()

    # ---------------------------------------------------------------- local-mode sync rounds
    def _launch_round(self, st: Stage) -> None:
        """Every live member pushes its pseudo-gradient; the server merges once all are in
        (outer step), then every pusher pulls the merged weights (see docs/sync-policies.md)."""
        st.round_id += 1
        st.round_phase = 1
        st.round_push = set()
        for w in st.members.values():
            if w.alive:
                st.round_push.add(w.id)
                w.bg_round = (st.idx, st.round_id)
                w.bg_push = st.push_wire
                self._bg_kick(w)
        st.round_n = len(st.round_push)
        self._round_progress(st)

    def _start_reference(self, st: Stage) -> None:
        """The first step a stage commits after a merge starts the screen's reference gradient
        (the runtime's ``_local_reference_start``); the next merge waits for it. It runs in a
        thread of its own that the OS time-slices with the server's message handling, so it
        takes its seconds of one core without queueing the tasks' CPU behind it (a host's cores
        are assumed to have room for it, as in the cost model). In a round compressed to fewer
        steps (``grad_compression`` < 1: bench_local.compressed_round) the wait from the merge to
        that first commit is compressed as the round's other costs are: the reference ends that
        much sooner."""
        if st.reference > 0 and st.ref_state == 0:
            st.ref_state, st.ref_n = 1, st.ref_n + 1
            c = self.plan.sync.grad_compression
            took = st.reference if c >= 1.0 else max(0.0, st.reference - (1.0 - c) * (self.now - st.ref_from))
            self._push(self.now + took, CPU_DONE, M_REF, (st.idx, st.ref_n))

    def _round_progress(self, st: Stage) -> None:
        if st.round_phase in (1, 5) and not st.round_push:
            self._start_reference(st)  # no step committed since the last merge: the merge starts it (as the runtime)
            if st.ref_state == 1:
                st.round_phase = 5  # every push is in; the merge waits for the reference gradient
                return
            # the merge on one of the server's cores (cost.merge_cpu_time), then its pulls or parts
            st.round_phase = 4
            merge = merge_cpu_time(st.params, st.round_n, self.plan.sync, self.fw_cpu, self.merge_cores[st.idx])
            if not self._server_cpu(st.host.id, merge, M_MERGED, (st.idx, st.round_id)):
                self._merged(st)
            return
        self._round_rest(st)

    def _merged(self, st: Stage) -> None:
        """A round's merge is done: its merged pseudo-gradient goes to the peers or its pulls start."""
        if st.round_phase == 4:
            st.ref_state, st.ref_from = 0, self.now  # the next one: at the new merged weights, the next step's inputs
            if st.peers:
                # replica plans: the merged pseudo-gradient goes to every other replica's server
                # of the same layers; the pulls wait until theirs have all arrived
                st.round_phase = 3
                for j, nbytes in st.peers:
                    self._send(st.host.id, self.stages[j].host.id, nbytes, M_OUTER, (j, st.round_id), None)
            else:
                self._launch_pulls(st)
        self._round_rest(st)

    def _round_rest(self, st: Stage) -> None:
        if st.round_phase == 3 and st.outer_got.get(st.round_id, 0) >= len(st.peers):
            st.outer_got.pop(st.round_id, None)
            self._launch_pulls(st)
        if st.round_phase == 2 and not st.round_pull:
            st.round_phase = 0
            if st.launch_after:
                st.launch_after = False
                self._launch_round(st)
                st.blocked = not self.overlap
            else:
                st.blocked = False
            self._maybe_close(st)

    def _launch_pulls(self, st: Stage) -> None:
        """Every live member pulls the round's merged weights."""
        st.round_phase = 2
        st.round_pull = set()
        for w in st.members.values():
            if w.alive:
                st.round_pull.add(w.id)
                w.bg_round = (st.idx, st.round_id)
                w.bg_pull = st.pull_wire
                self._bg_kick(w)

    def _bg_kick(self, w: Worker) -> None:
        """Send the next chunk of ``w``'s sync traffic on each of its links that is idle: sync
        bytes only use time the activations leave free (a chunk lasts ~BG_CHUNK_S at full rate,
        so an activation that starts meanwhile shares the link only briefly)."""
        s, rid = w.bg_round
        if s < 0 or not w.alive:
            return
        host = self.stages[s].host.id
        if w.bg_push > 0 and not w.bg_up and (w.id == host or not self.up[w.id].flows):
            lat, bw = self._link(w.id, host)
            n = w.bg_push if w.id == host else min(w.bg_push, max(BG_CHUNK_MIN, BG_CHUNK_S * min(bw, w.dev.up)))
            w.bg_push -= n
            w.bg_up = True
            self._send(w.id, host, n, M_LPUSH, (w, s, rid, w.bg_push <= 0), w)
        if w.bg_pull > 0 and not w.bg_down and (w.id == host or not self.down[w.id].flows):
            lat, bw = self._link(host, w.id)
            n = w.bg_pull if w.id == host else min(w.bg_pull, max(BG_CHUNK_MIN, BG_CHUNK_S * min(bw, w.dev.down)))
            w.bg_pull -= n
            w.bg_down = True
            self._send(host, w.id, n, M_LPULL, (w, s, rid, w.bg_pull <= 0), w)

    def _round_drop(self, st: Stage, wid: str) -> None:
        """Worker ``wid`` is gone: the round stops waiting for it."""
        if st.round_phase and (wid in st.round_push or wid in st.round_pull):
            st.round_push.discard(wid)
            st.round_pull.discard(wid)
            self._round_progress(st)

    def _close_step(self) -> None:
        if self.now < self.step_start + self.coord_floor:
            # the coordinator's CPU cannot take the step's reports any sooner
            self._push(self.step_start + self.coord_floor, STEP_END, None)
            return
        self.step_times.append(self.now - self.step_start)
        self.passes.append({
            "fwd": [dict(st.fwd_count) for st in self.stages],
            "grad": [dict(st.grad_count) for st in self.stages],
        })
        self.phases.append([(st.t_drained, st.t_closed) for st in self.stages])
        if len(self.step_times) < self.target_steps:
            self._start_step()

    # ---------------------------------------------------------------- messages
    def _server_cpu(self, host: str, cost: float, kind: int, p) -> bool:
        """Queue ``cost`` seconds of framework CPU for message ``(kind, p)`` on ``host``'s cores
        (the earliest free core, first come first served); True when its handling was deferred
        to a CPU_DONE event (then the handler runs again with ``charged``)."""
        if cost <= 0:
            return False
        cores = self.cores_free.get(host)
        if cores is None:
            cores = self.cores_free[host] = [0.0] * max(1, self.devices[host].cores)
        end = max(self.now, cores[0]) + cost
        heapq.heapreplace(cores, end)
        self._push(end, CPU_DONE, kind, p)
        return True

    def _on_message(self, kind: int, p, charged: bool = False) -> None:
        if kind == M_RESULT:
            w, task = p
            st = self.stages[task.stage]
            if not charged:
                w.task_s = _ewma(w.task_s, self.now - task.leased_at)
            if w.lease is task:
                w.lease = None
            if task in w.held:
                w.held.remove(task)
            if not charged:
                # the server the result goes to handles it before the next task exists
                back = task.bwd or st.last_stage
                to = self.stages[st.prv if back else st.nxt].host.id
                cost = result_handling(st.ingrad_bytes if back else st.out_bytes, self.fw_cpu,
                                       st.ingrad_decode_s if back else st.out_decode_s)
                if self._server_cpu(to, cost, kind, p):
                    return
            if task.bwd:
                if self._accept_bwd(st, w, task):
                    self._offer(self.stages[st.prv], Task(task.step, st.prv, task.m, True))
            elif st.last_stage:
                # the last stage ran forward and backward; its output is the input gradient
                if self._accept_fwd(st, w, task) and self._accept_bwd(st, w, task):
                    self._offer(self.stages[st.prv], Task(task.step, st.prv, task.m, True))
            elif self._accept_fwd(st, w, task):
                self._offer(self.stages[st.nxt], Task(task.step, st.nxt, task.m, False))
        elif kind == M_LEASE:
            w, epoch = p
            if w.epoch != epoch or w.stage is None:
                return
            st = self.stages[w.stage]
            if w.id in st.members and w.id not in st.waiting:
                self._lease(st, w)
        elif kind == M_INPUT:
            w, epoch, task = p
            if w.epoch != epoch:
                return
            w.asking = False
            if self.prefetch and w.compute_t0 >= 0:
                w.ready.append(task)  # a prefetched input landed while the worker computes
                return
            self._start_compute(w, epoch, task)
        elif kind == M_DONE:
            w, epoch, task, want = p
            st = self.stages[task.stage]
            if not charged:
                w.task_s = _ewma(w.task_s, self.now - task.leased_at)
            if w.lease is task:
                w.lease = None
            if task in w.held:
                w.held.remove(task)
            if not charged and self.fw_cpu.server_task_s > 0:
                # its lease request is served at once; the task's handling waits for the CPU
                if want and w.epoch == epoch and w.alive and w.stage == task.stage:
                    self._on_message(M_LEASE, (w, epoch))
                self._server_cpu(st.host.id, self.fw_cpu.server_task_s, kind, (w, epoch, task, False))
                return
            if task.bwd:
                self._accept_bwd(st, w, task)
            elif self._accept_fwd(st, w, task):
                self._accept_bwd(st, w, task)  # single-stage plan: fwd + bwd in one task
            if want and w.epoch == epoch and w.alive and w.stage == task.stage:
                # the done report doubles as the next lease request
                self._on_message(M_LEASE, (w, epoch))
        elif kind == M_PUSHREQ:

            w, epoch, s = p
            if w.epoch != epoch or not w.alive:
                return
            st = self.stages[s]
            mbs = frozenset(st.contrib.get(w.id, ()))
            if mbs:
                n = 0.0 if self.local else float(ordered_pushes(mbs) if self.ordered else 1)
                self._send(w.id, st.host.id, n * st.param_wire, M_PUSH, (w, s, self.step, mbs), w)
        elif kind == M_PUSH:
            w, s, step, mbs = p
            st = self.stages[s]
            if step != self.step:
                return
            if not charged and not self.local:
                # the server handles a push (and its pull) on its cores: a remote one's calls, and
                # every parameter of each push and pull (cost.exact_server_cpu)
                n = float(ordered_pushes(mbs) if self.ordered else 1)
                cost = ((self.fw_cpu.server_sync_s if w.id != st.host.id else 0.0)
                        + (n * self.fw_cpu.server_push_param_s + self.fw_cpu.server_pull_param_s) * st.params)
                if self._server_cpu(st.host.id, cost, kind, p):
                    return
            c = st.contrib.get(w.id)
            mbs = mbs & c if c else frozenset()
            for m in mbs:
                st.grad_count[m] = st.grad_count.get(m, 0) + 1
            if c:
                c -= mbs
            st.grads_in |= mbs
            st.asked.discard(w.id)
            if c:
                # it finished more backward tasks after the request: ask again
                self._begin_sync(st)
            self._maybe_apply(st)
        elif kind == M_PULL:
            w, epoch, s = p
            st = self.stages[s]
            st.pending_pulls.discard(w.id)
            self._maybe_close(st)
        elif kind == M_JOINPULL:
            w, epoch, s = p
            if w.epoch == epoch and w.alive and w.stage == s:
                self._send(w.id, self.stages[s].host.id, 0, M_LEASE, (w, epoch), None)
        elif kind == M_LOG:
            s, step, h = p
            self._send(h, self.stages[s].host.id, 0, M_LOGACK, p, None)
        elif kind == M_LOGACK:
            s, step, h = p
            st = self.stages[s]
            if step == self.step and st.log_wait is not None and h in st.log_wait:
                st.log_wait.discard(h)
                self._maybe_apply(st)
        elif kind == M_MERGED:
            s, rid = p
            st = self.stages[s]
            if st.round_id == rid:
                self._merged(st)
        elif kind == M_REF:
            s, n = p
            st = self.stages[s]
            if st.ref_n == n and st.ref_state == 1:
                st.ref_state = 2
                if st.round_phase == 5:
                    self._round_progress(st)
        elif kind == M_OUTER:
            s, rid = p
            st = self.stages[s]
            st.outer_got[rid] = st.outer_got.get(rid, 0) + 1
            if st.round_phase == 3 and st.round_id == rid:
                self._round_progress(st)
        elif kind == M_LPUSH:
            w, s, rid, last = p
            st = self.stages[s]
            if last and st.round_phase == 1 and rid == st.round_id and w.id in st.round_push:
                st.round_push.discard(w.id)
                self._round_progress(st)
        elif kind == M_LPULL:
            w, s, rid, last = p
            st = self.stages[s]
            if last and st.round_phase == 2 and rid == st.round_id and w.id in st.round_pull:
                st.round_pull.discard(w.id)
                self._round_progress(st)

    def _start_compute(self, w: Worker, epoch: int, task: Task) -> None:
        st = self.stages[task.stage]
        if task.bwd:
            flops = st.bwd_flops
            if task.recompute:
                flops += st.fwd_flops
                self.recomputes += 1
        else:
            flops = st.fwd_flops + (st.bwd_flops if st.last_stage else 0.0)
        dt = flops / w.dev.flops
        if w.slow:
            dt *= self._factor(w)
        dt += st.bwd_codec_s if task.bwd else st.fwd_codec_s
        if dt < self.fw_cpu.worker_task_s:
            dt = self.fw_cpu.worker_task_s  # its framework CPU per task runs beside the compute
        w.compute_t0 = self.now
        self._push(self.now + dt, COMPUTE, w, (epoch, task))
        if self.prefetch and not w.asking and not w.ready and w.alive and w.stage is not None:
            # ask for the next task now: its lease and input travel while this one computes
            w.asking = True
            self._send(w.id, self.stages[w.stage].host.id, 0, M_LEASE, (w, epoch), None)

    def _after_compute(self, w: Worker) -> None:
        """Overlapped I/O: start a prefetched task, or ask for the next one right away (the
        output uploads meanwhile)."""
        if w.ready:
            self._start_compute(w, w.epoch, w.ready.popleft())
        elif not w.asking and w.alive and w.stage is not None:
            w.asking = self.prefetch
            self._send(w.id, self.stages[w.stage].host.id, 0, M_LEASE, (w, w.epoch), None)

    def _on_compute(self, w: Worker, epoch: int, task: Task) -> None:
        if w.epoch != epoch:
            return
        dt = self.now - w.compute_t0
        w.busy += dt
        if self.timeline is not None:
            self.timeline.append((w.id, w.compute_t0, self.now, "compute"))
        w.compute_t0 = -1.0
        st = self.stages[task.stage]
        io = self.overlap_up or self.prefetch
        # with overlapped I/O the worker itself decides when to ask for more (see _after_compute)
        done = (w, w.epoch, task, not io)
        if task.bwd:
            w.saved.discard((task.step, task.m))
            if st.prv is None or task.grad_only:
                self._send(w.id, st.host.id, 0, M_DONE, done, None)
                sent = False
            else:
                sent = self._send_result(w, self.stages[st.prv].host.id, st.ingrad_bytes, task)
        elif st.last_stage:
            if st.prv is None or task.grad_only:
                self._send(w.id, st.host.id, 0, M_DONE, done, None)
                sent = False
            else:
                sent = self._send_result(w, self.stages[st.prv].host.id, st.ingrad_bytes, task)
        else:
            w.saved.add((task.step, task.m))
            sent = self._send_result(w, self.stages[st.nxt].host.id, st.out_bytes, task)
        if sent is None:
            return  # held until one of its uploads has left (then it asks for more)
        if io and (self.overlap_up or not sent):
            self._after_compute(w)

    def _send_result(self, w: Worker, dst: str, nbytes: float, task: Task) -> bool | None:
        """Send a task's output; True once sent, None when overlapped uploads are at their cap
        (``SimConfig.uploads_in_flight``): it waits in ``w.deferred`` for an upload to leave."""
        if self.overlap_up and nbytes > 0:
            if w.uploading >= max(1, self.cfg.uploads_in_flight):
                w.deferred.append((dst, nbytes, task))
                return None
            w.uploading += 1
        self._send(w.id, dst, nbytes, M_RESULT, (w, task), w)
        return True

    def _on_flow_done(self, f) -> None:
        now = self.now
        self.net.finish(f, now)
        kind, payload, w = f.msg
        key = (f.a, f.b)
        self.link_bytes[key] = self.link_bytes.get(key, 0.0) + f.nbytes
        if w is not None:
            w.flows.pop(f.fid, None)
            if self.timeline is not None:
                self.timeline.append((w.id, f.t0, now, "send" if f.a == w.id else "recv"))
        self._push(now + f.lat, ARRIVE, kind, payload)
        if kind == M_LPUSH:
            w.bg_up = False
        elif kind == M_LPULL:
            w.bg_down = False
        if w is not None and (w.bg_push > 0 or w.bg_pull > 0):
            self._bg_kick(w)  # a link of w may have gone idle
        if kind == M_RESULT and self.overlap_up and w.uploading > 0:
            w.uploading -= 1
            if w.deferred and w.alive:
                # a held result starts uploading; the worker may now ask for its next task
                dst, nbytes, task = w.deferred.pop(0)
                w.uploading += 1
                self._send(w.id, dst, nbytes, M_RESULT, (w, task), w)
                if w.stage is not None:
                    self._after_compute(w)
        if kind == M_RESULT and w.alive and w.stage is not None:
            if self.overlap_up:
                pass  # the worker asked for its next task when the upload started
            elif self.prefetch:
                if w.compute_t0 < 0:
                    self._after_compute(w)  # the output has left: start the prefetched task
            # the output has left: ask for the next lease (travels while the output lands)
            elif self.cfg.blocking_sends:
                self._push(now + f.lat, RESEND, None, (w.id, self.stages[w.stage].host.id, 0, M_LEASE,
                                                       (w, w.epoch), None))
            else:
                self._send(w.id, self.stages[w.stage].host.id, 0, M_LEASE, (w, w.epoch), None)

    # ---------------------------------------------------------------- churn and faults
    def _rng(self, dev: str) -> random.Random:
        r = self.rngs.get(dev)
        if r is None:
            r = self.rngs[dev] = random.Random(f"shoal-sim:{self.seed}:{dev}")
        return r

    def _schedule_churn(self) -> None:
        trace = self.scn.churn.trace
        if trace:
            for t, dev, what in trace:
                if dev not in self.devices:
                    raise ShoalError(f"churn trace names unknown device {dev!r}")
                if what not in ("leave", "join"):
                    raise ShoalError(f"churn trace event must be 'leave' or 'join', got {what!r}")
                self._push(float(t), LEAVE if what == "leave" else JOIN, dev, "trace")
            return
        for wid, w in self.workers.items():
            if w.dev.mean_session_s:
                self._push(self._rng(wid).expovariate(1.0 / w.dev.mean_session_s), LEAVE, wid, "model")

    def _abort_flows(self, w: Worker) -> None:
        for f in list(w.flows.values()):
            if f.active:
                moved = self.net.progress(f, self.now)
                key = (f.a, f.b)
                self.link_bytes[key] = self.link_bytes.get(key, 0.0) + moved
                self.net.finish(f, self.now)
                kind, payload, _ = f.msg
                if kind == M_PULL:
                    st = self.stages[payload[2]]
                    st.pending_pulls.discard(w.id)
                    self._maybe_close(st)
                elif kind in (M_LPUSH, M_LPULL):
                    self._round_drop(self.stages[payload[1]], w.id)
        w.flows.clear()

    def _leave(self, dev: str, source: str) -> None:
        w = self.workers.get(dev)
        if w is None or not w.alive:
            return
        self.leaves += 1
        w.alive = False
        w.epoch += 1
        w.reset_io()
        if w.compute_t0 >= 0:
            w.busy += self.now - w.compute_t0
            if self.timeline is not None:
                self.timeline.append((w.id, w.compute_t0, self.now, "compute"))
            w.compute_t0 = -1.0
        self._abort_flows(w)
        t = self.now + self.cfg.lease_timeout_s
        self.detect_at[dev] = t
        self._push(t, DETECT, w, (w.epoch, w.stage))
        if source == "model":
            self._push(self.now + self._rng(dev).expovariate(1.0 / self.scn.churn.mean_offline_s), JOIN, dev, "model")

    def _forget(self, w: Worker, s: int | None) -> None:
        """Stage ``s``'s server writes off worker ``w``: re-queue and re-assign its work."""
        if s is None:
            return
        st = self.stages[s]
        st.members.pop(w.id, None)
        st.waiting.pop(w.id, None)
        if self.overlap_up or self.prefetch:
            # every task it holds and has not delivered: with overlapped I/O it may hold several
            for task in [t for t in w.held if t.stage == s]:
                w.held.remove(task)
                if task.step == self.step:
                    self._requeue(st, task)
            w.lease = None
        elif w.lease is not None and w.lease.stage == s:
            task, w.lease = w.lease, None
            if task.step == self.step:
                self._requeue(st, task)
        w.held.clear()
        w.ready.clear()
        w.asking = False
        self._round_drop(st, w.id)
        q = st.own.pop(w.id, None)
        if q:
            for task in q:
                self._requeue(st, task)
        lost = st.contrib.pop(w.id, None)
        st.asked.discard(w.id)
        if lost:
            st.bwd_done -= lost
            for m in sorted(lost):
                self._requeue(st, Task(self.step, s, m, True, grad_only=True))
        st.pending_pulls.discard(w.id)
        self._maybe_close(st)

    def _detect(self, w: Worker, epoch: int, s: int | None) -> None:
        if w.alive or w.epoch != epoch:
            return
        self._forget(w, s)
        w.stage = None
        w.saved.clear()
        self._replan(left=(w.id,))

    def _join(self, dev: str, source: str) -> None:
        w = self.workers.get(dev)
        if w is None:
            if dev not in self.devices or self.devices[dev].flops <= 0:
                return
            w = self.workers[dev] = Worker(self.devices[dev])
            w.alive = False
        if w.alive:
            return
        t = self.detect_at.get(dev, 0.0)
        if t >= self.now and w.stage is not None:
            # the servers have not written off the previous session yet
            self._push(t, JOIN, dev, source)
            return
        self.joins += 1
        w.alive = True
        w.epoch += 1
        w.reset_io()
        w.joined_at = self.now
        w.stage = None
        self._replan(joined=(dev,))
        if source == "model" and w.dev.mean_session_s:
            self._push(self.now + self._rng(dev).expovariate(1.0 / w.dev.mean_session_s), LEAVE, dev, "model")

    def _replan(self, left=(), joined=()) -> None:
        """Ask the planner's online repair for the new membership and apply it."""
        self.repairs += 1
        t0 = time.perf_counter()
        new = None
        if self.repair_fn is not None:
            # the repair sees every device that is away, not only this one
            gone = tuple(sorted(wid for wid, w in self.workers.items() if not w.alive))
            try:
                # no local-search budget: the simulator keeps the stage boundaries fixed; and, as
                # the runtime's coordinator (its servers hold fixed layers), the stage count
                new = self.repair_fn(self.plan_now, self.scn, left=gone, joined=tuple(joined), budget_s=0.0,
                                     seed=self.seed, keep_stages=True)
            except ShoalError:
                new = None
        if new is None or len(new.all_stages) != self.S or any(
                tuple(a.layers) != tuple(b.layers) for a, b in zip(new.all_stages, self.flat, strict=True)):
            new = _fallback_repair(self.plan_now, self.original_stage, left, joined)
        self.plan_now = new
        self.repair_wall += time.perf_counter() - t0
        target: dict[str, int] = {}
        for i, sp in enumerate(new.all_stages):
            for wid in sp.workers:
                target[wid] = i
        for wid in joined:
            w = self.workers[wid]
            s = target.get(wid)
            if s is not None and w.alive:
                self._enlist(w, s)
        # the repair may also move live workers (e.g. to refill an emptied stage)
        for wid, s in target.items():
            w = self.workers.get(wid)
            if w is None and wid in self.devices:
                # a device the original plan left idle is brought in
                w = self.workers[wid] = Worker(self.devices[wid])
                w.stage = None
                self._enlist(w, s)
                continue
            if w is None or not w.alive or wid in joined or w.stage == s:
                continue
            self.moves += 1
            old = w.stage
            w.epoch += 1
            w.reset_io()
            w.compute_t0 = -1.0
            self._abort_flows(w)
            self._forget(w, old)
            w.saved.clear()
            self._enlist(w, s)

    def _enlist(self, w: Worker, s: int) -> None:
        w.stage = s
        st = self.stages[s]
        st.members[w.id] = w
        self._send(st.host.id, w.id, st.param_wire, M_JOINPULL, (w, w.epoch, s), w)

    def _server_down(self, host: str, recovery: float) -> None:
        self.server_failures_seen += 1
        until = self.now + recovery
        self.down_until[host] = max(self.down_until.get(host, 0.0), until)
        # transfers to and from the host are cut; they are retried once the standby is up
        for w in self.workers.values():
            for f in list(w.flows.values()):
                if f.active and (f.a == host or f.b == host):
                    self.net.finish(f, self.now)
                    del w.flows[f.fid]
                    kind, payload, ww = f.msg
                    self._push(until, RESEND, None, (f.a, f.b, f.nbytes, kind, payload, ww))
        self._push(until, SRV_UP, host)

    # ---------------------------------------------------------------- main loop
    def run(self, steps: int) -> SimResult:
        if steps <= 0:
            raise ShoalError(f"steps must be positive, got {steps}")
        self.target_steps = steps
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        if self.churn:
            self._schedule_churn()
        for f in self.failures:
            self._push(f.time_s, SRV_DOWN, self.stages[f.stage].host.id, f.recovery_s)
        self._start_step()
        if self.overlap:
            # steady state of delayed application: the previous round's sync is in flight at t=0,
            # so a run of H steps pays what every round pays (simulate a multiple of H steps)
            for st in self.stages:
                self._launch_round(st)
        # initial lease requests (workers start with the weights: time 0 is after set-up)
        for w in self.workers.values():
            if w.stage is not None:
                self._send(w.id, self.stages[w.stage].host.id, 0, M_LEASE, (w, w.epoch), None)
        heap = self.heap
        pop = heapq.heappop
        max_t = self.cfg.max_sim_time_s
        max_ev = self.cfg.max_events
        events = 0
        stalled = False
        while len(self.step_times) < steps:
            if not heap:
                stalled = True
                break
            t, _, kind, a, b = pop(heap)
            if kind == FLOW_DONE:
                if b != a.ver or not a.active:
                    continue
                self.now = t
                self._on_flow_done(a)
            elif kind == ARRIVE:
                self.now = t
                self._on_message(a, b)
            elif kind == COMPUTE:
                self.now = t
                self._on_compute(a, b[0], b[1])
            elif kind == LEAVE:
                self.now = t
                self._leave(a, b)
            elif kind == JOIN:
                self.now = t
                self._join(a, b)
            elif kind == DETECT:
                self.now = t
                self._detect(a, b[0], b[1])
            elif kind == RESEND:
                self.now = t
                src, dst, nbytes, mk, payload, w = b
                if w is not None and not w.alive:
                    continue
                self._send(src, dst, nbytes, mk, payload, w)
            elif kind == SRV_DOWN:
                self.now = t
                self._server_down(a, b)
            elif kind == SRV_UP:
                self.now = t
            elif kind == APPLY:
                self.now = t
                self._applied(self.stages[a])
            elif kind == CPU_DONE:
                self.now = t
                self._on_message(a, b, charged=True)
            elif kind == STEP_END:
                self.now = t
                self._close_step()
            events += 1
            if events >= max_ev or self.now > max_t:
                stalled = True
                break
        self.events = events
        wall = time.perf_counter() - wall0
        self.cpu = time.process_time() - cpu0
        return self._result(wall, stalled)

    def _result(self, wall: float, stalled: bool) -> SimResult:
        total = sum(self.step_times)
        span = self.now if self.now > 0 else 1.0
        tokens = self.M * self.plan.micro_batch_size * self.scn.workload.seq_len
        lost = 0
        for rec in self.passes:
            for r0 in (st for st in self.stages if st.prv is None):
                chain = [r0.idx]
                while self.stages[chain[-1]].nxt is not None:
                    chain.append(self.stages[chain[-1]].nxt)
                for m in range(r0.M):
                    if any(rec["grad"][s].get(m, 0) != 1 for s in chain):
                        lost += 1
        util = {wid: w.busy / span for wid, w in sorted(self.workers.items())}
        predicted = self.plan.predicted.get("step_time_s")
        mean = total / len(self.step_times) if self.step_times else math.nan
        return SimResult(
            scenario=self.scn.name,
            method=self.plan.method,
            steps=len(self.step_times),
            step_times_s=list(self.step_times),
            mean_step_time_s=mean,
            tokens_per_s=tokens * len(self.step_times) / total if total > 0 else 0.0,
            utilisation=util,
            link_bytes={f"{a}->{b}": v for (a, b), v in sorted(self.link_bytes.items())},
            requeued_tasks=self.requeued,
            lost_micro_batches=lost,
            events=self.events,
            wall_time_s=wall,
            cpu_time_s=self.cpu,
            sim_time_s=self.now,
            predicted_step_time_s=predicted,
            recomputes=self.recomputes,
            duplicates_dropped=self.duplicates,
            leaves=self.leaves,
            joins=self.joins,
            repairs=self.repairs,
            repair_wall_s=self.repair_wall,
            moves=self.moves,
            churn=self.churn,
            stalled=stalled,
            passes=self.passes,
            timeline=self.timeline,
            flow_reschedules=self.net.rate_updates,
            stage_phases=self.phases,
        )


def simulate(plan: Plan, scenario: Scenario, *, steps: int = 3, churn: bool = False, seed: int = 0,
             record_timeline: bool = False, stragglers=(), server_failures=(),
             config: SimConfig | None = None) -> SimResult:
    """Replay ``steps`` training steps of ``plan`` on ``scenario`` event by event.

    ``churn`` turns on device sessions (``Device.mean_session_s`` / ``ChurnModel``) or the
    scenario's churn trace; ``stragglers`` is a sequence of :class:`Straggler` (or tuples
    ``(device, start_s, duration_s, factor)``); ``server_failures`` of :class:`ServerFailure`
    (or ``(time_s, stage, recovery_s)``). Raises :class:`ShoalError` if the plan does not
    fit the scenario.
    """
    sim = Simulator(plan, scenario, churn=churn, seed=seed, record_timeline=record_timeline,
                    stragglers=stragglers, server_failures=server_failures, config=config)
    return sim.run(steps)
