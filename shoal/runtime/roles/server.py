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
Gradient pushes are idempotent: a retried push (same worker, step, epoch, generation and
micro-batches) that already landed is acknowledged again and not counted twice. A worker
that cannot push releases its micro-batches with an empty push; one that neither pushes
nor releases within ``flush_grace_s`` of the step's backward pool completing is voided (unless
its renewals say it is still pushing that step).
So a computed gradient is never both dropped by its worker and awaited here.
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
import os
import time
from pathlib import Path

import grpc
import torch

from shoal.errors import ShoalError
from shoal.model.transformer import build_stage
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import caller, check_caller
from shoal.net.channel import ChannelFactory, advertised_address, bind, make_server
from shoal.net.compress import set_codec_threads
from shoal.net.stream import (
    CONTROL_SLACK,
    DEFAULT_CHUNK_BYTES,
    fetch,
    receive,
    send,
    split,
)
from shoal.net.traffic import Traffic
from shoal.net.wire import (
    Frame,
    Framed,
    WireError,
    encode_frame,
    encode_tensor,
    goes_framed,
    one_frame,
    with_frame,
)
from shoal.runtime.common import (
    SCHEMA_VERSION,
    DeafClock,
    Signal,
    ckpt_dir,
    ckpts_to_prune,
    clean_stray_temps,
    data_identity,
    ewma,
    initial_scale,
    lease_seconds,
    list_ckpts,
    load_stage_ckpt,
    model_config,
    open_data,
    optim_config,
    read_stage_ckpt,
    remove_abandoned_ckpts,
    run_member,
    run_precision,
    save_stage_ckpt,
    set_threads,
    stage_ckpt_loss_scale,
    token_window,
    trace,
)
from shoal.runtime.measure import peak_rss_bytes
from shoal.runtime.pool.grants import GrantBook
from shoal.runtime.pool.pool import (
    EMPTY_TALLY,
    Lease,
    LeaseTable,
    MbState,
    StepMbs,
    TodoPool,
    WorkerInfo,
    holding_work,
    leave_to_faster,
    pick_order,
    pool_figures,
    unpushed,
    wait_counts,
    yield_to_idle,
)
from shoal.runtime.safety.deferred import DeferredCheck, DeferredCheckMixin, defer_check
from shoal.runtime.safety.endcheck import EndCheckMixin
from shoal.runtime.safety.guard import (
    RECOMPUTE_ENV,
    SPOT_RATE_ENV,
    ban_reason,
    guard_config,
    keep_version,
    low_only,
    needs_verify,
    push_spot_checked,
    rel_error,
    robust_centre,
    screen,
    undo_version,
    verify_rate,
)
from shoal.runtime.safety.redundant import RedundantMixin
from shoal.runtime.safety.standby import StandbyMixin, kill_at_commit
from shoal.runtime.sync.codecs import (
    compressed_pull,
    compression_of_spec,
    received_activation,
)
from shoal.runtime.sync.local import LocalServerMixin, merge_threads
from shoal.runtime.sync.ordered import PushFold
from shoal.runtime.sync.replicas import ReplicaServerMixin
from shoal.runtime.transport.frames import (
    TASK_INPUT,
    TASK_OUT_GRAD,
    TRANSIENT_CODES,
    Grant,
    GrantReply,
    decode_grads,
    off_loop,
    retry,
    serialise_weights,
)
from shoal.runtime.transport.relays import RELAY_FRAMES, RELAY_KINDS, RelayLink
from shoal.runtime.transport.session import UP_KINDS, message_kind, read_messages, serialised
from shoal.runtime.ui.stats import StepTiming
from shoal.train.optim import apply_update, make_optimizer, param_sq_norms, total_sq_norm
from shoal.train.precision import unscale_grads, wire_dtype

log = logging.getLogger("shoal.server")


# GradPush's frames field: a streamed push's frames are read from the received bytes (split_framed).
GRAD_FRAMES = pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number
# A streamed result's frame stays a view of the received bytes: checked, then handed on in a
# relay as it came (one copy of it per server where a parsed message costs three).
RESULT_FRAME = pb.TaskResult.DESCRIPTOR.fields_by_name["output"].number


class StageServer(LocalServerMixin, ReplicaServerMixin, StandbyMixin, RedundantMixin, EndCheckMixin,
                  DeferredCheckMixin, pbg.StageServerServicer):
    """State and RPC handlers of one stage server."""

    def __init__(self, coord: str, listen: str, token: str, ckpt_root: str, *,
                 name: str = "server", dial=None, heartbeat_s: float = 0.2, device: str = "",
                 region: str = "", up_bps: float = 0.0, down_bps: float = 0.0,
                 probe_bytes: int = 16 * 1024 * 1024, advertise: str | None = None,
                 chunk_bytes: int = 0, tls=None, data: str = "", server_token: str = "",
                 merge_memory: float | None = None):
        self.coord_addr, self.listen, self.token = coord, listen, token
        # Bytes of decoded pseudo-gradients a local-mode merge holds; beyond, pushes wait as their
        # frames (shoal.runtime.sync.held). None: default_merge_memory(), read at each round.
        self.merge_memory = merge_memory
        # Prepared data folder this server reads the first stage's tokens and the last stage's
        # targets from ("": the run trains on the bundled corpus or synthetic tokens).
        self.data = str(Path(data).expanduser().resolve()) if data else ""
        self.data_hash = data_identity(self.data)  # its manifest's content_hash, checked at Join
        self._windows: dict[tuple[int, int], pb.Tensor] = {}  # (step, mb) -> token windows sent with tasks
        self.tls = tls  # run certificates (shoal.net.tls.TlsConfig; None: plain text on loopback)
        self.advertise = advertise  # address peers dial (None: the listen address)
        self.chunk_bytes_opt = chunk_bytes  # bytes per streamed chunk (0: the run's setting)
        self._wcache: tuple[tuple[int, int, int], bytes] | None = None  # (version, epoch, stage) -> bytes
        self._wlock = asyncio.Lock()  # weights are not updated while they are being serialised
        self.ckpt_root, self.name, self.heartbeat_s = ckpt_root, name, heartbeat_s
        self.device = device  # emulated runs: the scenario host this server plays
        self.region = region  # declared network region ("": clustered by latency)
        self.up_bps, self.down_bps = up_bps, down_bps  # declared link capacities, bytes/s (0: measured)
        self.probe_bytes = probe_bytes  # bytes of each timed link transfer when measuring
        self.measure_done = 0  # newest measurement request answered
        self.measuring = False  # a measurement is under way
        self.final_sending = False  # the final weights are being sent to the coordinator
        self.final_sent: tuple | None = None  # (member id, epoch, published version) whose final weights were taken
        self.orphan_after_s = 120.0  # exit when the coordinator is unreachable this long
        self.traffic = Traffic()  # bytes of every call this server makes (relays, coordinator)
        self.channels = ChannelFactory(token, dial=dial, traffic=self.traffic, tls=tls)
        self.channels.identity.server_token = server_token  # the operator's: admits it at Join as a server
        self.member_id = ""
        self.spec: pb.RunSpec | None = None
        self.stage = -1
        self.first = self.last = 0
        self.servers: list[str] = []
        self.epoch = 0
        self.version = -1  # weights hold this many committed steps (-1: not loaded)
        self.step = 0  # step being worked on (== version once loaded)
        self.steps: dict[int, StepMbs] = {}  # step -> its micro-batches (with their state counts)
        self.todo = TodoPool()  # todo tasks of self.steps, so a lease pick is no scan
        # Accepted results by lease id: (worker, epoch, step, gen), so a retried upload is acknowledged again.
        self.completed: dict[int, tuple[str, int, int, int]] = {}
        # accepted pushes of the step: (first micro-batch, gradients, worker, micro-batches)
        self.pushes: list[tuple[int, dict[str, torch.Tensor], str, tuple[int, ...]]] = []
        self.fold = PushFold()  # their sum in the commit's order, made as they come (a new one with each list)
        self._fold_lock = asyncio.Lock()  # one push added at a time
        self.leases = LeaseTable()  # lease id -> Lease (and each worker's count)
        self.idle_asking: dict[str, int] = {}  # worker -> its lease requests parked while it has nothing to do
        self.grants = GrantBook()  # session grants made ahead, the workers' paces, take-backs
        self.sessions: dict[str, asyncio.Queue] = {}  # worker -> what its session stream sends next
        self.relay_streams = 0  # peer servers' relay streams open into this one
        self.workers: dict[str, WorkerInfo] = {}
        self.left: set[str] = set()  # workers that left this server (Leave) and sent nothing since
        # worker -> (step, monotonic time) of its newest renewal that said it is pushing that step
        self.pushing: dict[str, tuple[int, float]] = {}
        self.next_lease = 1
        self.loading = False
        self.ready = False
        self.done = False
        self.committing = False
        self.cond = Signal()  # notified on every change of the task pool
        self.ckpt_signal = Signal()  # notified when a checkpoint file is complete (standby long-polls)
        self.tasks_per_worker: dict[str, int] = {}
        self.requeues = 0
        self.stats = {"messages": 0, "bytes_in": 0, "results_on_session": 0, "results_by_call": 0,
                      "sums_folded": 0, "sums_anew": 0}  # exact steps summed by PushFold or at commit
        self._bg: set[asyncio.Task] = set()
        self.on_servers = None  # callback(list of stage server addresses), e.g. emulation
        self._stubs: dict[str, pbg.StageServerStub] = {}
        self._links: dict[str, RelayLink] = {}  # peer server address -> its relay stream
        self.timing = StepTiming()  # where the current step's time goes (dashboard only)
        self.last_split: dict | None = None  # that split for the last committed step
        # Identities (worker, epoch, step, gen, mbs) of pushes counted, for idempotent retries.
        self.pushed: set[tuple] = set()
        self.flush_since: float | None = None  # when the step's backward pool became complete
        self.progress_t = time.monotonic()  # last commit (or load): the stall watchdog's clock
        self.stall_warned = False
        self.fatal = ""  # a one-line reason this server cannot go on (sent to the coordinator)
        self.ckpt_ok: set[tuple] = set()  # (stage, version, size, mtime) of checkpoints known good
        # Push screening (shoal.runtime.safety.guard): banned workers, and what the screen keeps.
        self.guard_banned: dict[str, str] = {}  # worker member id -> why it was banned
        self.guard_bans: list[pb.GuardBan] = []  # reported to the coordinator with every heartbeat
        self.guard_bans_told = 0  # how many of them a heartbeat the coordinator read has carried
        self.guard_norms: list[float] = []  # norms of recent honest pushes (the robust centre)
        self.guard_seen: set[str] = set()  # workers whose first push here was screened
        self.guard_strikes: dict[str, int] = {}  # worker -> consecutive flagged pushes
        self.guard_ref: dict[str, torch.Tensor] | None = None  # the last committed gradient (direction)
        self._guard_ref_norm: tuple[dict, float] | None = None  # (guard_ref, its norm): computed once per reference
        self.guard_checks = 0  # pushes recomputed here
        self.guard_ok: dict[str, int] = {}  # worker -> its pushes whose recomputation matched (its record)
        self.guard_flags: dict[str, int] = {}  # worker -> its pushes the screen flagged (even if cleared)
        # worker -> the first committed step holding a push of it that was never recomputed (exact
        # runs), or the first of its current run of flagged pushes (others): a ban rolls back to it.
        self.guard_unverified: dict[str, int] = {}
        self.step_unverified: set[str] = set()  # workers with an unverified push counted in this step
        # Spot-check draws also hash this server's own secret: a worker cannot predict them.
        self.guard_salt = os.urandom(8).hex()
        self.guard_keep: int | None = None  # the oldest version a ban may roll back to (from the coordinator)
        self.guard_cfg = guard_config(os.environ)  # the screen's thresholds (safety.guard.GuardConfig)
        if not self.guard_cfg.recompute:
            log.warning("%s: %s=0: no push will be recomputed (a bench hook; never train this way)", name,
                        RECOMPUTE_ENV)
        self._dup_init()  # redundant checks and the drift test (shoal.runtime.safety.redundant)
        self._end_init()  # the run's end check (shoal.runtime.safety.endcheck)
        self._deferred_init()  # recomputations beside the steps (shoal.runtime.safety.deferred)
        self.standby = False  # a hot standby: copies a stage's checkpoints until promoted
        self.standby_copying = False  # a checkpoint copy is under way
        self.copy_failing: tuple | None = None  # (stage, source, why) of the failing copy already warned about
        self.ckpt_task: asyncio.Task | None = None  # the checkpoint being written in a thread

    # ------------------------------------------------------------------ setup
    @property
    def is_last(self) -> bool:
        return self.last == self.cfg.n_total_layers

    @property
    def is_first(self) -> bool:
        return self.first == 0

    def _make(self, stage: int, first: int, last: int, version: int):
        """Build stage weights + optimizer at ``version`` (CPU work, run off the event loop);
        also the outer momentum (local mode) the checkpoint holds."""
        spec = self.spec
        cfg = model_config(spec)
        if first == 0 or last == cfg.n_total_layers:
            open_data(spec)  # open the data now, off the event loop (tasks carry its tokens)
        module = build_stage(cfg, first, last, seed=spec.seed)
        opt = make_optimizer(module.named_parameters(), optim_config(spec))
        scale = initial_scale(spec)
        outer_m: dict[str, torch.Tensor] = {}
        pull_ef: dict[str, torch.Tensor] = {}
        if version > 0:
            outer_m, pull_ef = load_stage_ckpt(self.ckpt_root, stage, version, module, opt, run_id=spec.run_id,
                                      layers=(first, last))
            scale = stage_ckpt_loss_scale(self.ckpt_root, stage, version, scale, run_id=spec.run_id)
        elif spec.init_from:
            from shoal.hf.convert import load_hf_dir

            _, state = load_hf_dir(spec.init_from, names={n for n, _ in module.named_parameters()})
            module.load_state_dict(state, strict=True)
        return cfg, module, opt, scale, outer_m, pull_ef

    async def _load(self, stage: int, first: int, last: int, version: int, epoch: int) -> None:
        """(Re)load the stage at ``version`` for ``epoch``, keeping heartbeats going meanwhile."""
        self.version = -1
        self.loading = True
        try:
            await self._ckpt_written()  # our own write under way ends first: it is not a stray file
            if clean_stray_temps(self.ckpt_root, stage, self.spec.run_id):
                log.info("%s removed half-written checkpoint files of stage %d", self.name, stage)
            cfg, module, opt, scale, outer_m, pull_ef = await asyncio.get_running_loop().run_in_executor(
                None, self._make, stage, first, last, version)
        except ShoalError as exc:
            # A checkpoint that fails its checks at load: set it aside, so the next
            # heartbeat reports an older one and the coordinator rolls back to that.
            log.error("%s cannot restore stage %d v%d: %s; falling back to the previous checkpoint",
                      self.name, stage, version, exc)
            self._set_aside(stage, version)
            return
        finally:
            self.loading = False
        # The swap under the weights lock: a recomputation, serialisation or update that holds
        # it works on one version whole (a rollback's load once swapped the module under a
        # recomputation of an older step's push, which then failed and banned an honest worker).
        async with self._wlock:
            if (stage, epoch) != (self.stage, self.epoch):
                return  # superseded while loading
            self._swap(cfg, module, opt, scale, outer_m, pull_ef, version, stage, first, last, epoch)
        async with self.cond:
            self.cond.notify_all()

    def _swap(self, cfg, module, opt, scale, outer_m, pull_ef, version: int, stage: int, first: int, last: int,
              epoch: int) -> None:
        """Make the loaded stage the one served (under ``_wlock``; see :meth:`_load`)."""
        self.cfg, self.module, self.opt = cfg, module, opt
        self.loss_scale = scale  # fp16: the scale of the step being worked on (1 otherwise)
        self.params = dict(module.named_parameters())
        self.version = version
        self.step = version
        # Steps from ``version`` on are redone: only unverified pushes baked into it remain.
        self.guard_unverified = {w: s for w, s in self.guard_unverified.items() if s < version}
        self._end_forget(version, stage, first, last)
        # Redone steps would add their deviations twice (not independent): the drift test starts over.
        self._drift_reset()
        self.guard_ref = None  # the direction of a step that is redone now
        self._local_reset(version)
        if self.local:
            self.outer_m = outer_m  # local mode: the outer momentum saved with the version
            if self.update_pulls is not None and pull_ef:
                self.update_pulls.ef.load(pull_ef)  # what the pulls before the stop still owe
        self.steps = {}
        self.todo.clear()
        self.completed.clear()
        self.pushes = []
        self.fold = PushFold()
        self.committing = False
        self.leases.clear()
        for w in self.workers.values():
            w.gen += 1
        self.act_shape = (self.spec.micro_batch_size, self.spec.seq_len, cfg.d_model)
        # Activations and their gradients travel in the compute dtype. In fp16 a gradient
        # may overflow: that is not a fault but a skipped step (the coordinator sees the
        # non-finite norm), so backward tensors are then accepted with inf/NaN.
        self.act_dtype = wire_dtype(run_precision(self.spec))
        self.grads_finite = run_precision(self.spec) != "fp16"
        self._open_step(self.step)
        log.info("%s serves stage %d [%d,%d) from version %d (epoch %d)%s", self.name, stage, first, last,
                 version, epoch, (" with the saved outer momentum" if self.local and outer_m else "")
                 + (" and pull residual" if self.local and pull_ef and self.update_pulls is not None else ""))

    def _open_step(self, step: int) -> None:
        mbs = self.steps.setdefault(step, StepMbs())
        for mb in self._mb_range():  # (a replica plan: this stage's replica's micro-batches)
            st = mbs.setdefault(mb, MbState())
            if self.is_first:
                if self.is_last:
                    if st.grad == "wait":
                        st.grad = "todo"
                        self.todo.add(step, "grad", mb)
                elif st.fwd == "wait":
                    st.fwd = "todo"
                    self.todo.add(step, "fwd", mb)
        self.completed = {k: v for k, v in self.completed.items() if v[2] >= step - 1}
        self.tasks_per_worker = {}
        self.requeues = 0
        self.timing = StepTiming(step, time.monotonic())
        self.flush_since = None
        self.progress_t = time.monotonic()
        self.stall_warned = False
        self.pushed = {k for k in self.pushed if k[2] >= step - 1}
        self.step_unverified = set()
        self.end_ids = set()
        self._dup_clear()

    @property
    def flush_grace_s(self) -> float:
        """How long the server waits for a computed gradient once every micro-batch is computed."""
        return max(10.0, 4 * self.spec.dead_after_s) if self.spec else 10.0

    @property
    def stall_s(self) -> float:
        """No commit for this long: log what the step waits for (once per stall)."""
        return max(30.0, 10 * self.spec.dead_after_s) if self.spec else 30.0

    def _flush_repair(self, now: float) -> bool:
        """Void workers that hold computed gradients long after the pool completed (but for
        those whose renewals say they are still pushing this step: :func:`flush_voids`)."""
        mbs = self.steps.get(self.step)
        if not mbs or self.committing or not mbs.tally.all_in("computed", "counted"):
            self.flush_since = None
            return False
        if self.flush_since is None:
            self.flush_since = now
            return False
        if now - self.flush_since < self.flush_grace_s:
            return False
        holders = flush_voids(set(mbs.tally.computed_by), self.pushing, self.step,
                              now, self.spec.dead_after_s if self.spec else 3.0)
        if not holders:
            return False  # each holder is still pushing: looked at again on the next tick
        for wid in holders:
            self._void_worker(wid, f"held computed gradients {self.flush_grace_s:.0f} s without pushing")
        self.flush_since = None
        return bool(holders)

    def describe_wait(self) -> str:
        """One line: what the current step is waiting for (for stall reports)."""
        mbs = self.steps.get(self.step)
        # (from the step's counts, kept as states change: no scan over its micro-batches)
        counts = wait_counts(mbs.tally, self.is_last) if mbs else {}
        holders = holding_work(mbs.tally) if mbs else []
        state = "loading" if self.loading else ("not ready" if not self.ready else
                                                 ("committing" if self.committing else "working"))
        return (f"stage {self.stage} step {self.step} ({state}): "
                f"{', '.join(f'{k}={v}' for k, v in sorted(counts.items())) or 'no micro-batches'}; "
                f"{len(self.leases)} leases, workers holding work: {', '.join(holders) or 'none'}")

    def _ckpt_version(self) -> int:
        """Newest checkpoint of our stage that passes its checks (0: none, -1: no stage).

        A file is checked once (this server's own writes are known good); one that fails
        is reported in the log and set aside, and the previous one is used.
        """
        if self.stage < 0 or self.loading:
            return -1
        d = ckpt_dir(self.ckpt_root, self.stage, self.spec.run_id)
        for v in reversed(list_ckpts(self.ckpt_root, self.stage, self.spec.run_id)):
            path = d / f"v{v}.safetensors"
            try:
                st = path.stat()
            except OSError:
                continue
            key = (self.stage, v, st.st_size, st.st_mtime_ns)
            if key not in self.ckpt_ok:
                try:
                    read_stage_ckpt(self.ckpt_root, self.stage, v, run_id=self.spec.run_id,
                                    layers=(self.first, self.last))
                except ShoalError as exc:
                    log.error("%s: %s; using the previous checkpoint", self.name, exc)
                    self._set_aside(self.stage, v)
                    continue
                self.ckpt_ok.add(key)
            return v
        return 0

    def _ckpt_version_known(self) -> int | None:
        """:meth:`_ckpt_version` when no file needs checking (no stage, no checkpoint, or the
        newest one known good); None when one does (the caller checks it in a thread)."""
        if self.stage < 0 or self.loading:
            return -1
        vs = list_ckpts(self.ckpt_root, self.stage, self.spec.run_id)
        if not vs:
            return 0
        path = ckpt_dir(self.ckpt_root, self.stage, self.spec.run_id) / f"v{vs[-1]}.safetensors"
        try:
            st = path.stat()
        except OSError:
            return None
        return vs[-1] if (self.stage, vs[-1], st.st_size, st.st_mtime_ns) in self.ckpt_ok else None

    def _ckpt_versions(self) -> list[int]:
        """Every checkpoint version of our stage on disk (a ban's roll-back picks among them)."""
        if self.stage < 0 or self.loading or self.spec is None:
            return []
        return list_ckpts(self.ckpt_root, self.stage, self.spec.run_id)

    def _held(self) -> list[pb.StandbyHeld]:
        """Without a stage: the newest checkpoint of each stage in our folder (the coordinator
        gives a vacant stage to the server holding its newest state)."""
        if self.stage >= 0 or self.spec is None:
            return []
        held = []
        for k in range(self.spec.stages):
            vs = list_ckpts(self.ckpt_root, k, self.spec.run_id)
            top = max(vs[-1] if vs else 0, self.standby_replayable() if k == self.sb_stage else 0)
            if top:
                held.append(pb.StandbyHeld(stage=k, version=top))  # with the step log: what a promotion reaches
        return held

    def _set_aside(self, stage: int, version: int) -> None:
        """Rename a bad checkpoint to ``v<N>.safetensors.bad`` (kept for inspection, never loaded)."""
        path = ckpt_dir(self.ckpt_root, stage, self.spec.run_id) / f"v{version}.safetensors"
        with contextlib.suppress(OSError):
            os.replace(path, path.with_name(path.name + ".bad"))

    async def start_rpc(self) -> grpc.aio.Server:
        """Start listening (sets ``self.address``); the caller stops the returned server."""
        # Credentials are checked with the run secret this server learns when it joins.
        server = make_server(self.token, run_key=lambda: self.channels.identity.run_key, resolve=self.max_bytes)
        pbg.add_StageServerServicer_to_server(self, server)
        port = bind(server, self.listen, self.tls)
        self.address = advertised_address(self.listen, self.advertise, port)
        await server.start()
        return server

    async def run(self) -> None:
        """Serve until the coordinator says the run is done."""
        server = await self.start_rpc()
        coord = pbg.CoordinatorStub(self.channels.open(self.coord_addr))
        self.coord = coord
        try:
            reply = await retry(lambda: coord.Join(self._join_request()), codes=TRANSIENT_CODES)
        except BaseException:
            await server.stop(None)  # a refused join ends the process with one line, no teardown noise
            raise
        self.member_id, self.spec = reply.member_id, reply.spec
        if self.data:
            self.spec.data = self.data  # the same data (the coordinator checked its hash) at this host's path
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
            log.info("%s took %d results on sessions and %d by call", self.name, self.stats["results_on_session"],
                     self.stats["results_by_call"])
            if not self.local:
                log.info("%s summed %d steps' pushes as they came and %d anew at commit", self.name,
                         self.stats["sums_folded"], self.stats["sums_anew"])
            if self.guard_checks or self.deferred_skipped:
                log.info("%s recomputed %d pushes, %d of them beside the steps; %d drawn while its deferred checks "
                         "were full", self.name, self.guard_checks, self.deferred_done, self.deferred_skipped)
            reaper.cancel()
            for t in list(self._bg):
                t.cancel()
            self._deferred_close()
            for link in self._links.values():
                link.close()
            await self._end_streams(self.heartbeat_s + 1.0)
            await server.stop(0.5)

    async def _end_streams(self, within_s: float) -> None:
        """End the open worker sessions with an OK status and give the peer servers (told of the
        run's end at their own next heartbeat) ``within_s`` to close their relay streams, so that
        stopping the gRPC server aborts no stream (grpc logs each abort as a WARNING)."""
        for out in list(self.sessions.values()):
            out.put_nowait(None)
        deadline = time.monotonic() + within_s
        while (self.sessions or self.relay_streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _join_request(self) -> pb.JoinRequest:
        return pb.JoinRequest(role="server", address=self.address, name=self.name, schema=SCHEMA_VERSION,
                              ckpt_version=-1, ckpt_stage=-1, device=self.device, will_measure=True,
                              region=self.region, up_bps=self.up_bps, down_bps=self.down_bps,
                              standby=self.standby, data_hash=self.data_hash)

    async def _measure(self, request: int) -> None:
        """Measure host memory and the links to the coordinator and the other stage servers."""
        from shoal.runtime.measure import available_ram, device_name, probe_peers

        t0 = time.perf_counter()
        try:
            others = [s for s in self.servers if s and s != self.address]
            links = await probe_peers(self.channels, self.coord_addr, others, self.probe_bytes)
            await self.coord.Measured(pb.MeasureReport(
                member_id=self.member_id, request=request, device_name=device_name("cpu"),
                memory=available_ram(), links=[lf.to_pb() for lf in links],
                measure_s=time.perf_counter() - t0, address=self.address), timeout=30)
            self.measure_done = request
        except grpc.aio.AioRpcError as exc:
            log.warning("%s: measurement failed (%s); the next heartbeat asks again", self.name, exc.code())
        finally:
            self.measuring = False

    async def Probe(self, request, context):
        from shoal.runtime.measure import probe_reply

        return probe_reply(request, context.peer())

    def _heard_since(self, since: float) -> list[str]:
        """Workers this server heard from (any call or chunk) since ``since``: the coordinator
        counts that traffic as their sign of life."""
        return [wid for wid, info in self.workers.items() if info.last_seen >= since]

    async def _heartbeat(self) -> None:
        sent = time.monotonic()
        alive = self._heard_since(getattr(self, "_alive_sent", 0.0))
        # Checking a checkpoint file another server wrote reads it whole: in a thread (a
        # newest file known good needs only a listing and a stat: here, no thread hop).
        ckpt = self._ckpt_version_known()
        if ckpt is None:
            ckpt = await asyncio.get_running_loop().run_in_executor(None, self._ckpt_version)
        n_bans = len(self.guard_bans)
        try:
            a = await self.coord.Heartbeat(pb.MemberRequest(
                member_id=self.member_id, version=self.version, ckpt_version=ckpt,
                epoch=self.epoch, counter_id=self.traffic.id, role="server",
                traffic=self.traffic.snapshot(), stats=self.stats_snapshot(), fatal=self.fatal,
                guard_bans=self.guard_bans, standby_held=self._held(),
                standby_decisions_from=self.standby_decisions_from(), alive=alive,
                doing=self.describe_wait() if self.stage >= 0 else "waiting for a stage",
                ckpt_versions=self._ckpt_versions(),
                # (a stage being loaded for a roll-back reports none: its record is pruned at the load)
                guard_unverified=[pb.GuardUnverified(worker=w, step=s) for w, s in sorted(self.guard_unverified.items())
                                  if s < self.version]),
                timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat failed: %s", exc.code())
            return
        self._alive_sent = sent
        self.last_coord_ok = time.monotonic()
        if a.known:  # an unknown member's heartbeat is not read: its bans are not told yet
            self.guard_bans_told = max(self.guard_bans_told, n_bans)
        if a.done:
            self.done = True
            self.cond.notify_all()  # long-polled leases answer now: the run is over
            return
        if not a.known:
            # Declared dead (e.g. starved of CPU): join again as a fresh server.
            # (Or it was restarted with --resume.) Ask for our stage back: our checkpoint
            # folder holds it.
            log.warning("%s: the coordinator forgot us; joining again", self.name)
            had = self.stage
            self.stage, self.version, self.ready = -1, -1, False
            join = self._join_request()
            join.ckpt_stage = had
            try:
                reply = await self.coord.Join(join, timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.warning("%s: joining again failed (%s); retrying", self.name, exc.code())
                self.stage = had  # still ours to ask for on the next try
                return
            self.member_id = reply.member_id
            self.measure_done = 0
            return
        self.servers = list(a.servers)
        self.server_ids = list(a.server_ids)  # replica plans: who serves each stage
        self.guard_keep = a.guard_keep - 1 if a.guard_keep > 0 else None
        self.standby_heard(a)
        if self.on_servers is not None:
            self.on_servers(self.servers)
        if a.measure > self.measure_done and not self.measuring:
            self.measuring = True
            self._spawn(self._measure(a.measure))
        if a.stage < 0:
            if a.standby_for > 0 and not self.standby_copying:
                self.standby_copying = True
                self._spawn(self._standby_copy(a.standby_for - 1, a.standby_first, a.standby_last,
                                               a.servers[a.standby_for - 1]))
            return
        if self.stage != a.stage or a.epoch != self.epoch:
            self._assigned(a)
            return
        if a.ready and not self.ready and self.version >= 0:
            self.ready = True
            # The epoch's restart version is final now (a load while the coordinator still
            # collects checkpoint reports is provisional): newer files of the stage are from
            # the history the run rolled back from, never to be restored or copied.
            gone = remove_abandoned_ckpts(self.ckpt_root, self.stage, self.spec.run_id, self.version)
            if gone:
                log.info("%s removed checkpoints v%s of stage %d: the run restarted from v%d", self.name,
                         ",".join(map(str, gone)), self.stage, self.version)
        if (a.send_final and not self.final_sending and self.published_version() >= self.spec.steps
                and self.final_sent != self._final_key()):
            self.final_sending = True
            self._spawn(self._send_final())
        async with self.cond:
            self.cond.notify_all()

    def _final_key(self) -> tuple[str, int, int]:
        """What a sent copy of the final weights is of: (member id, epoch, published version); by
        member id too, so a coordinator restarted after the last commit, which this server joins
        again, is sent them again."""
        return self.member_id, self.epoch, self.published_version()

    async def _send_final(self) -> None:
        """Send this stage's final weights to the coordinator (its heartbeat reply asked), on the
        channel the heartbeats keep open, once the last checkpoint is written: a run's end then
        needs no new connection. A send that fails is tried again at the next ask."""
        try:
            await self._ckpt_written()
            await asyncio.sleep(0)  # the write's done callback (_bg_done) sets self.fatal
            if self.fatal:
                return  # the heartbeats carry it: the run fails
            key = self._final_key()
            data = await self._weights_bytes()
            if data is None or self._final_key() != key:
                return
            rep = await send(self.coord.FinalWeights, pb.WeightsReply(), self.chunk_bytes, data=data,
                             sender=self.member_id)
            if rep.accepted:
                self.final_sent = key
            else:
                log.warning("%s: the coordinator refused its final weights: %s", self.name, rep.reason)
        except grpc.aio.AioRpcError as exc:
            log.warning("%s: sending its final weights failed (%s); the coordinator asks again", self.name,
                        exc.code())
        finally:
            self.final_sending = False

    def _assigned(self, a: pb.Assignment) -> None:
        """A new stage or epoch (a re-plan or a rollback): load it (a logging standby replays first)."""
        promote = self.stage < 0 and self.sb_log is not None  # a logging standby: replay its log first
        self.stage, self.first, self.last = a.stage, a.first, a.last
        self.epoch = a.epoch
        # Nothing is served as this epoch's until the load: the weights held are the old
        # epoch's, and after an undo the same version number names other weights.
        self.version = -1
        self.ready = False
        if promote:
            self.loading = True  # no checkpoint is reported until the replay is on disk
            self._spawn(self.standby_promote(a.stage, a.first, a.last, a.restart_version, a.epoch))
        else:
            self._spawn(self._load(a.stage, a.first, a.last, a.restart_version, a.epoch))

    def stats_snapshot(self) -> pb.MemberStats:
        """What this server reports for the dashboard: pool, leases, the last step's split."""
        mbs = self.steps.get(self.step) if self.version >= 0 else None
        # The pool's figures come from the step's counts, kept as states change (no scan
        # over its M micro-batches 5 times a second).
        tally = mbs.tally if mbs else EMPTY_TALLY
        fig = pool_figures(tally, bool(mbs) and self.stage >= 0 and self.is_last)
        todo, waiting = fig["todo"], fig["waiting"]
        live = self.spec.dead_after_s if self.spec else 3.0
        now = time.monotonic()
        s = pb.MemberStats(stage=self.stage, step=self.step, pool_todo=todo, pool_waiting=waiting,
                           leases=len(self.leases), peak_rss=peak_rss_bytes(),
                           workers=sum(now - w.last_seen <= live for w in self.workers.values()))
        if self.last_split is not None:
            s.last_step.CopyFrom(pb.StepSplit(**self.last_split))
        # What the step waits for: lease holders, inputs and gradients from the neighbours, pushes.
        held: dict[str, list[float]] = {}
        for lease in self.leases.values():
            held.setdefault(lease.worker, []).append(now - lease.started)
        s.held.extend(pb.HeldLease(worker=w, tasks=len(ages), oldest_s=max(ages)) for w, ages in sorted(held.items()))
        s.wait_input, s.wait_grad = fig["wait_input"], fig["wait_grad"]
        s.unpushed.extend(unpushed(tally))
        s.committing = self.committing
        s.step_s = now - self.progress_t
        self.standby_stats(s)
        return s

    # ------------------------------------------------------------------ pool
    def _worker(self, wid: str) -> WorkerInfo:
        info = self.workers.get(wid)
        if info is None:
            # a message of a worker that left (a move to another stage) may still land after its
            # Leave, from the session it is closing: if nothing follows, the reaper forgets it
            # without calling it dead (_reaper)
            info = self.workers[wid] = WorkerInfo(after_leave=wid in self.left)
            self.left.discard(wid)
        info.last_seen = time.monotonic()
        return info

    def _requeue(self, step: int, mb: int, direction: int) -> None:
        st = self.steps.get(step, {}).get(mb)
        if st is None:
            return
        if direction == pb.FWD:
            if st.fwd == "leased":
                st.fwd = "todo"
                self.todo.add(step, "fwd", mb)
        elif st.grad in ("leased", "computed"):
            st.grad, st.holder = "todo", ""
            self.todo.add(step, "grad", mb)
        self.requeues += 1

    def _void_worker(self, wid: str, why: str, verb: str = "voided") -> None:
        """Drop a worker's leases and un-pushed gradients; its micro-batches are redone."""
        info = self.workers.get(wid)
        if info is None:
            return
        info.gen += 1
        self.grants.drop_worker(wid)
        for lid, lease in list(self.leases.items()):
            if lease.worker == wid:
                del self.leases[lid]
                self._requeue(lease.step, lease.mb, lease.direction)
        for step, mbs in self.steps.items():
            for mb, st in mbs.items():
                if st.grad == "computed" and st.holder == wid:
                    self._requeue(step, mb, pb.BWD)
        self._local_forget(wid)
        self._dup_forget(wid, why)
        log.info("%s %s worker %s (%s)", self.name, verb, wid, why)

    def _holding(self, wid: str) -> str:
        """What a worker holds here, in words (death reports)."""
        leases = [f"{pb.Direction.Name(ls.direction)} step {ls.step} mb {ls.mb}"
                  for ls in self.leases.values() if ls.worker == wid]
        computed = [mb for mbs in self.steps.values() for mb, st in mbs.items()
                    if st.grad == "computed" and st.holder == wid]
        parts = ([f"leases {', '.join(leases)}"] if leases else []) + (
            [f"unpushed gradients of mbs {computed}"] if computed else [])
        return "; ".join(parts) or "nothing"

    async def _reaper(self) -> None:
        clock = DeafClock(0.1, time.monotonic())
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            deaf = clock.tick(now)
            if deaf:
                # This loop was held (or the process starved): renewals and chunks of that
                # stretch may still wait unread, so it counts as nobody's silence.
                for lease in self.leases.values():
                    lease.deadline += deaf
                for info in self.workers.values():
                    info.last_seen += deaf
            changed = False
            for lid, lease in list(self.leases.items()):
                if lease.deadline < now:
                    del self.leases[lid]
                    self._requeue(lease.step, lease.mb, lease.direction)
                    changed = True
            changed |= self._reap_silent(now)
            if self.version >= 0 and self.spec is not None:
                changed |= self._flush_repair(now)
                if self._dup_reap(now):
                    self._maybe_commit()
                    changed = True
                if now - self.progress_t > self.stall_s and not self.stall_warned and not self.done:
                    self.stall_warned = True
                    log.warning("%s: no progress for %.0f s; %s", self.name, now - self.progress_t,
                                self.describe_wait())
            if changed:
                async with self.cond:
                    self.cond.notify_all()

    def _reap_silent(self, now: float) -> bool:
        """Void every worker silent for over the run's ``dead_after_s`` (whether any was). One whose
        entry only a message after its Leave made, and that holds nothing, is forgotten, not
        called dead: it moved to another stage and that message was its old session's last."""
        reaped = False
        for wid, info in list(self.workers.items()):
            if self.spec and now - info.last_seen > self.spec.dead_after_s:
                held = self._holding(wid)
                if info.after_leave and held == "nothing":
                    self._void_worker(wid, "it had left; a late message, then nothing", verb="forgot")
                else:
                    self._void_worker(wid, f"silent for {now - info.last_seen:.1f} s; it held {held}")
                del self.workers[wid]
                reaped = True
        return reaped

    def _open_tasks(self) -> int:
        """Tasks of the current step any worker may take: forwards, and gradients except local
        mode's at a non-last stage (each waits for the worker that ran its forward)."""
        mbs = self.steps.get(self.step)
        if not mbs:
            return 0
        t = mbs.tally
        n = 0 if self.is_last else t.count(lambda f, g: f == "todo")
        return n + (t.grad.get("todo", 0) if self.is_last or not self.local else 0)

    def _yields(self, wid: str) -> bool:
        """Whether idle ``wid`` leaves the open tasks to faster idle workers now (:func:`leave_to_faster`):
        only in a one-stage pipeline, where every task of a step is open when it starts; a deeper
        pipeline's tasks come one at a time and go to the workers asking, in turn (the cost
        model's idle queue, ``shoal.plan.cost.idle_queue_wait``)."""
        if not (self.is_first and self.is_last) or len(self.idle_asking) < 2:
            return False
        idle = {w: (self.workers[w].ewma_s if w in self.workers else None) for w in self.idle_asking}
        return leave_to_faster(idle, wid, self._open_tasks())

    def _pick(self, wid: str, open_ok: bool = True) -> Grant | None:
        """Lease the next task of the current step to ``wid``: forwards first (see :func:`pick_order`);
        ``open_ok`` False: only a task no other worker may take (local mode's own gradients)."""
        if not self.ready or self.committing or self.version != self.step:
            return None
        if self.dup_checks:
            task = self._dup_pick(wid)  # a check holds the step's commit: first
            if task is not None:
                return task
        mbs = self.steps.get(self.step, {})
        ok = (lambda mb: self._local_bwd_ok(mbs[mb], wid)) if self.local and not self.is_last else None
        if not open_ok and ok is None:
            return None
        mb, direction = None, pb.FWD
        for kind in pick_order(self.is_last) if open_ok else ("grad",):
            if kind == "fwd":
                mb = self.todo.pick(self.step, "fwd", lambda mb: mb in mbs and mbs[mb].fwd == "todo")
                direction = pb.FWD
            else:
                mb = self.todo.pick(self.step, "grad", lambda mb: mb in mbs and mbs[mb].grad == "todo", ok)
                direction = pb.FWDBWD if self.is_last else pb.BWD
            if mb is not None:
                break
        if mb is None:
            return None
        st = mbs[mb]
        info = self._worker(wid)
        info.after_leave = False  # back at work here
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
                       epoch=self.epoch, lease_id=lid, deadline_s=secs, loss_scale=self.loss_scale)
        if self.is_first or self.is_last:
            task.tokens.CopyFrom(self._window(self.step, mb))
        return self._granted(task, st, out_grad=direction == pb.BWD)

    def _granted(self, task: pb.Task, st: MbState, out_grad: bool) -> Grant:
        """``task`` as granted: with micro-batch ``st``'s input (where the stage has one) and,
        ``out_grad``, its output gradient, the frames as this server received them."""
        frames = {}
        if st.input is not None:
            frames[TASK_INPUT] = st.input_frame if st.input_frame is not None else encode_frame("input", st.input)
        if out_grad:
            frames[TASK_OUT_GRAD] = (st.out_grad_frame if st.out_grad_frame is not None
                                     else encode_frame("grad", st.out_grad))
        return Grant(task, frames)

    def _window(self, step: int, mb: int) -> pb.Tensor:
        """The token windows of micro-batch ``mb`` (inputs and targets; workers hold no data),
        kept for the step's other tasks of that micro-batch."""
        key = (step, mb)
        frame = self._windows.get(key)
        if frame is None:
            if len(self._windows) >= 4 * max(1, self.spec.micro_batches):
                self._windows = {k: v for k, v in self._windows.items() if k[0] >= step}
            frame = self._windows[key] = encode_tensor("tokens", token_window(self.spec, step, mb))
        return frame

    def _should_flush(self, wid: str) -> bool:
        """Whether ``wid`` should push now: every gradient of the step is computed and it holds one."""
        mbs = self.steps.get(self.step)
        return bool(mbs) and mbs.tally.all_in("computed", "counted") and mbs.tally.holds_computed(wid)

    # ------------------------------------------------------------------ RPCs from workers
    async def Lease(self, request, context):
        await check_caller(context, request.worker)
        reply = await self._lease_reply(request, session=False)
        return reply.message() if isinstance(reply, GrantReply) else reply

    def _may_grant(self, wid: str, ahead: bool, session: bool) -> bool:
        """Whether a request may take a task now: one made ahead (during a compute) never takes
        it from a worker that waits idle (prefetching must not starve the stage's others), and
        on a session only within the worker's credit window."""
        if not ahead:
            return True
        if yield_to_idle(self.idle_asking, wid):
            return False
        return not session or self.grants.may_grant_ahead(wid, self.local)

    def _take_back_for(self, wid: str) -> bool:
        """``wid`` asks idle and nothing is todo: take back a grant made ahead that it would
        finish sooner than its holder (see :meth:`GrantBook.take_back`); True if one was."""
        if not self.ready or self.committing or self.version != self.step or self.local:
            return False  # nothing could be granted now: leave the holders their tasks
        lid = self.grants.take_back(wid, time.monotonic(), live=lambda lid: lid in self.leases and (
            self.leases[lid].worker in self.sessions))
        if lid is None:
            return False
        lease = self.leases.pop(lid)
        st = self.steps.get(lease.step, {}).get(lease.mb)
        if st is not None:  # back to todo; not a re-queue (nothing failed)
            if lease.direction == pb.FWD and st.fwd == "leased":
                st.fwd = "todo"
                self.todo.add(lease.step, "fwd", lease.mb)
            elif lease.direction != pb.FWD and st.grad == "leased":
                st.grad, st.holder = "todo", ""
                self.todo.add(lease.step, "grad", lease.mb)
        q = self.sessions.get(lease.worker)
        if q is not None:
            q.put_nowait(pb.TakeBack(lease_ids=[lid]))
        log.info("%s took back lease %d (%s step %d mb %d) from %s, unstarted, for idle %s", self.name, lid,
                 pb.Direction.Name(lease.direction), lease.step, lease.mb, lease.worker, wid)
        return True

    async def _lease_reply(self, request: pb.LeaseRequest, session: bool, on_wait=None) -> pb.LeaseReply | GrantReply:
        """The reply to one lease request (long-polled up to its ``wait_s``, 2 s at most).

        ``on_wait()``: called once if the request has to wait (a session then sends the
        verdict on the result that carried the request at once instead of with this reply)."""
        info = self._worker(request.worker)
        wid, ahead = request.worker, request.ahead
        if request.started:
            self.grants.start(request.started, wid, time.monotonic())
        if request.worker in self.guard_banned:
            return pb.LeaseReply(has_task=False, version=self.version, gen=info.gen, epoch=self.epoch,
                                 step=self.step, ask_id=request.ask_id)
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 2.0)
        asked_at = (self.version, self.epoch)  # a commit meanwhile answers an idle worker at once (it pulls)
        if not ahead:
            self.idle_asking[wid] = self.idle_asking.get(wid, 0) + 1
        yield_until = None  # a request leaves open tasks to faster idle workers for one own task time at most
        try:
            while True:
                open_ok = True
                if not ahead and info.ewma_s is not None and self._yields(wid):
                    now = time.monotonic()
                    if yield_until is None:
                        yield_until = now + info.ewma_s
                    open_ok = now >= yield_until
                task = self._pick(wid, open_ok) if self._may_grant(wid, ahead, session) else None
                if task is None and session and not ahead and self._take_back_for(wid):
                    task = self._pick(wid)
                if task is not None and session:
                    self.grants.grant(task.lease_id, wid, time.monotonic(), ahead)
                flush = self._should_flush(wid)
                moved = not ahead and (self.version, self.epoch) != asked_at
                if (task is not None or flush or moved or time.monotonic() >= deadline or self.done
                        or self._local_wants(wid)):
                    break
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                await self.cond.wait((deadline if open_ok else min(deadline, yield_until)) - time.monotonic())
        finally:
            if not ahead:
                self.idle_asking[wid] -= 1
                if not self.idle_asking[wid]:
                    del self.idle_asking[wid]
        if not ahead and task is not None and session and self.idle_asking.get(wid, 0) == 0:
            # No longer idle: requests made ahead that yielded to it may take a task now.
            async with self.cond:
                self.cond.notify_all()
        reply = pb.LeaseReply(has_task=task is not None, version=self.version, gen=info.gen,
                              flush=flush, epoch=self.epoch, step=self.step, ask_id=request.ask_id,
                              credit=self.grants.credit(wid, self.local) if session else 0)
        if task is not None:
            reply.task.CopyFrom(task.task)
            trace(self.name, "grant", w=wid, step=task.step, mb=task.mb, d=task.direction)
        elif flush:
            trace(self.name, "flush", w=wid, step=self.step)
        self._local_fill(reply, request.worker)
        if task is None or not task.frames:
            return reply
        grant = GrantReply(reply, task.frames)
        return grant if goes_framed(sum(len(f.data) for f in task.frames.values())) else grant.message()

    def _check_lease(self, r) -> tuple[Lease | None, str]:
        lease = self.leases.get(r.lease_id)
        if r.epoch != self.epoch or r.step != self.step:
            return None, "stale step or epoch"
        if lease is None or lease.worker != r.worker or lease.mb != r.mb or lease.direction != r.direction:
            return None, "no such lease (expired or duplicate)"
        return lease, ""

    async def Complete(self, request, context):
        r = request
        await check_caller(context, r.worker)
        info = self._worker(r.worker)
        self.stats["messages"] += 1
        try:
            frame = one_frame(r, "output")  # (each read of a parsed payload copies it: read once)
        except WireError as exc:
            return pb.CompleteReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        size = len(frame.data)
        self.stats["bytes_in"] += size
        self.stats["results_by_call" if context is not None else "results_on_session"] += 1
        prev = self.completed.get(r.lease_id)
        if prev is not None and prev[:3] == (r.worker, r.epoch, r.step):
            # A retried upload whose first attempt landed (its reply was lost): taken once already.
            return pb.CompleteReply(accepted=True, reason="duplicate of an accepted result", gen=prev[3])
        lease, why = self._check_lease(r)
        if r.worker in self.guard_banned:
            lease, why = None, "banned from this run"
        if lease is None:
            return pb.CompleteReply(accepted=False, reason=why, gen=info.gen)
        try:
            kept = None
            if r.direction == pb.FWD or not self.is_first:
                _, kept = await off_loop(size, self._decode_act, frame,
                                         r.direction == pb.FWD or self.grads_finite,
                                         "act" if r.direction == pb.FWD else "grad")
            if r.direction == pb.FWDBWD and not math.isfinite(r.loss):
                raise WireError(f"loss {r.loss} is not finite")
        except WireError as exc:
            if self.leases.get(r.lease_id) is lease:
                del self.leases[r.lease_id]
                self._requeue(r.step, r.mb, r.direction)
            log.warning("%s rejected a result of %s: %s", self.name, r.worker, exc)
            async with self.cond:
                self.cond.notify_all()
            return pb.CompleteReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        if self.leases.get(r.lease_id) is not lease or r.epoch != self.epoch or r.step != self.step:
            # It ran out (or the step moved on) while the result was checked in a thread.
            prev = self.completed.get(r.lease_id)
            if prev is not None and prev[:3] == (r.worker, r.epoch, r.step):
                return pb.CompleteReply(accepted=True, reason="duplicate of an accepted result", gen=prev[3])
            return pb.CompleteReply(accepted=False, reason="lease ended while its result was checked", gen=info.gen)
        st = self.steps[r.step][r.mb]
        del self.leases[r.lease_id]
        self.grants.end(r.lease_id, r.worker, task_s=r.compute_s,
                        idle=not self.leases.held(r.worker))
        self.completed[r.lease_id] = (r.worker, r.epoch, r.step, info.gen)
        info.ewma_s = ewma(info.ewma_s, max(r.compute_s, time.monotonic() - lease.started))
        self.timing.task(r.worker, r.compute_s, time.monotonic() - lease.started)
        self.tasks_per_worker[r.worker] = self.tasks_per_worker.get(r.worker, 0) + 1
        if r.direction == pb.FWD:
            st.fwd = "done"
            st.fwd_by, st.fwd_gen = r.worker, info.gen
            msg = with_frame(pb.Relay(step=r.step, mb=r.mb, epoch=self.epoch, direction=pb.FWD), "tensor", kept)
            self._spawn(self._relay(self.stage + 1, msg))
        else:
            st.grad, st.holder = "computed", r.worker
            if r.direction == pb.FWDBWD:
                st.loss = r.loss
            if not self.is_first and not st.relayed_back:
                st.relayed_back = True
                msg = with_frame(pb.Relay(step=r.step, mb=r.mb, epoch=self.epoch, direction=pb.BWD), "tensor", kept)
                self._spawn(self._relay(self.stage - 1, msg))
            if self.timing.all_computed is None and self.steps[r.step].tally.all_in("computed", "counted"):
                self.timing.all_computed = time.monotonic()
        trace(self.name, "result", w=r.worker, step=r.step, mb=r.mb, d=r.direction)
        async with self.cond:
            self.cond.notify_all()
        return pb.CompleteReply(accepted=True, gen=info.gen)

    def _decode_act(self, frame: Frame, finite: bool, name: str, checked: bool = False):
        """An activation or activation gradient checked against this stage's shape and dtype:
        (its tensor, the frame to hand on as ``name``; sync.codecs.received_activation; ``checked``:
        a peer server's relay, a lossy one kept undecoded)."""
        return received_activation(frame, name, shape=self.act_shape, dtype=self.act_dtype, finite=finite,
                                   checked=checked)

    async def PushGrads(self, request, context):
        r = request
        await check_caller(context, r.worker)
        info = self._worker(r.worker)
        trace(self.name, "push_in", w=r.worker, step=r.step, mbs=list(r.mbs))
        self.stats["messages"] += 1
        self.stats["bytes_in"] += sum(len(g.data) for g in r.grads)
        if r.local_done or r.local_round:
            return await self._local_push(r, info)
        mbs = self.steps.get(r.step, {})
        ids = list(r.mbs)
        identity = (r.worker, r.epoch, r.step, r.gen, tuple(ids))
        if ids and identity in self.pushed:
            # A retry of a push that landed (its reply was lost): counted once already.
            return pb.PushReply(accepted=True, reason="duplicate of a counted push", gen=info.gen)
        if r.worker in self.guard_banned:
            return pb.PushReply(accepted=False, reason=f"banned: {self.guard_banned[r.worker]}", gen=info.gen)
        if r.check_id:
            return await self._dup_push(r, info, decode_grads)
        if r.epoch != self.epoch or r.step != self.step or r.gen != info.gen:
            return pb.PushReply(accepted=False, reason="stale push (step, epoch or generation)", gen=info.gen)
        if not ids:
            # An empty push releases the worker's un-pushed gradients: it could not push them.
            self._void_worker(r.worker, "released its gradients (its push could not land)")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=True, reason="released", gen=info.gen)
        ok = len(ids) == len(set(ids)) and ids and all(
            mb in mbs and mbs[mb].grad == "computed" and mbs[mb].holder == r.worker for mb in ids)
        if not ok:
            self._void_worker(r.worker, "push for micro-batches it does not hold")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason="push covers micro-batches not held", gen=info.gen)
        try:
            # Checked in a thread: a stage's gradients can be hundreds of MB, and the loop
            # must keep answering leases and heartbeats meanwhile.
            grads = await asyncio.get_running_loop().run_in_executor(None, decode_grads, r, self.params,
                                                                self.grads_finite)
        except WireError as exc:
            log.warning("%s rejected a gradient push of %s: %s", self.name, r.worker, exc)
            self._void_worker(r.worker, f"bad push: {exc}")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        if not self._still_held(r, ids, info):
            return pb.PushReply(accepted=False, reason="stale push (the step moved on while it was checked)",
                                gen=info.gen)
        banned = await self._guard_push(r, ids, grads)
        if banned:
            return pb.PushReply(accepted=False, reason=f"banned: {banned}", gen=info.gen)
        if not self._still_held(r, ids, info):
            return pb.PushReply(accepted=False, reason="stale push (the step moved on while it was screened)",
                                gen=info.gen)
        # Summed at commit, ordered by micro-batch id: with one micro-batch per push this is
        # exactly the local trainer's sequential sum.
        self.pushes.append((min(ids), grads, r.worker, tuple(ids)))
        self.pushed.add(identity)
        self._spawn(self._fold_pushes())  # summed now where its place in the order is sure
        return await self._count(self.steps[r.step], ids, info)

    async def _fold_pushes(self) -> None:
        """Add to the step's :class:`PushFold` every push whose place in the commit's order is
        sure, one at a time in a thread (a stage's gradient can be hundreds of MB)."""
        async with self._fold_lock:
            fold = self.fold
            while fold is self.fold:
                push = fold.ready(self.pushes)
                if push is None:
                    return
                await asyncio.get_running_loop().run_in_executor(None, fold.take, push)

    async def _count(self, mbs: dict, ids, info) -> pb.PushReply:
        """Mark ``ids`` counted; once the whole step is counted, start its commit."""
        for mb in ids:
            mbs[mb].grad = "counted"
        trace(self.name, "push_counted", mbs=list(ids))
        self._maybe_commit()
        async with self.cond:
            self.cond.notify_all()
        return pb.PushReply(accepted=True, gen=info.gen)

    def _maybe_commit(self) -> None:
        """Start the step's commit once every micro-batch is counted and no check of it is open."""
        mbs = self.steps.get(self.step)
        # (version == step: loaded and current. Between a rollback's heartbeat and its load the
        # steps held are the old epoch's; a commit started then would report them as the new one's.)
        if (mbs and self.version == self.step and mbs.tally.all_in("counted") and not self.committing
                and not self._dup_pending()):
            self.committing = True
            self.timing.all_counted = time.monotonic()
            self._spawn(self._commit(self.step, self.epoch))

    def _still_held(self, r: pb.GradPush, ids, info) -> bool:
        """Whether the push's micro-batches are still computed by its worker in this step."""
        mbs = self.steps.get(r.step, {})
        return (r.epoch == self.epoch and r.step == self.step and r.gen == info.gen
                and all(mb in mbs and mbs[mb].grad == "computed" and mbs[mb].holder == r.worker for mb in ids))

    def _guard_measure(self, grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor] | None
                       ) -> tuple[float, float | None]:
        """A push's norm and its cosine to the last committed gradient (runs in a thread), in one
        read of the push (``push_norm_and_dot``: the floats of ``sq_norm`` and ``dot``)."""
        from shoal.runtime.safety.verify import push_norm_and_dot, sq_norm

        sq, product = push_norm_and_dot(grads, ref or None)
        norm = math.sqrt(sq)
        if not ref or norm == 0:
            return norm, None
        cached = self._guard_ref_norm
        if cached is None or cached[0] is not ref:  # the reference changes once a step
            cached = self._guard_ref_norm = (ref, math.sqrt(sq_norm(ref)))
        ref_norm = cached[1]
        return norm, (product / (norm * ref_norm) if ref_norm > 0 else None)

    def _guard_recompute(self, module: torch.nn.Module, step: int,
                         inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None]],
                         grads: dict[str, torch.Tensor], first: bool, last: bool, loss_scale: float) -> float:
        """Relative error of a push against this server's recomputation (runs in a thread).

        ``inputs``: (micro-batch, stage input, output gradient) of each micro-batch of the push.
        ``module`` and the stage's shape are taken on the event loop under ``_wlock``, with the
        inputs' epoch checked: the recomputation never mixes in weights a rollback loaded.
        """
        from shoal.runtime.safety.verify import recompute_sum, sq_diff, sq_norm

        mine = recompute_sum(module, self.spec, step, inputs, first=first, last=last, loss_scale=loss_scale)
        return rel_error(sq_diff(grads, mine), sq_norm(mine))

    async def _guard_push(self, r, ids: list[int], grads: dict[str, torch.Tensor]) -> str:
        """Screen one push (see :mod:`shoal.runtime.safety.guard`); bans its worker and returns why, or "".

        Exact runs (fp32, raw frames) recompute a flagged push, a worker's first push here
        and a seeded ``guard_spot_check`` fraction; only a mismatch bans there.
        """
        if not self.guard_cfg.enabled or self.spec.shadow:
            return ""  # (a shadow emulation's fixed gradients would fail any screen)
        loop = asyncio.get_running_loop()
        norm, cosine = await loop.run_in_executor(None, self._guard_measure, grads, self.guard_ref)
        centre = robust_centre(self.guard_norms)
        flag = screen(norm, cosine, centre, self.guard_cfg)
        # Compressed pulls: the worker computed on the reconstruction, not these weights.
        exact = (run_precision(self.spec) == "fp32" and all(g.codec in ("", "raw") for g in r.grads)
                 and compression_of_spec(self.spec).pull == "none")
        # A check of its pushes still held beside the steps (safety/deferred.py) counts as passed
        # here, as an inline one would have: if it fails, the ban undoes every step from that
        # push on, this push's included, so checking this one too would only spend the server's
        # CPU on what the held check decides anyway.
        held = self._deferred_held(r.worker)
        first = r.worker not in self.guard_seen and not held
        # Adaptive spot checks: new workers and workers with flags in their record are drawn
        # more often (guard.verify_rate); the run's last step is recomputed whole.
        forced = os.environ.get(SPOT_RATE_ENV)
        rate = verify_rate(self.guard_ok.get(r.worker, 0) + held, self.guard_flags.get(r.worker, 0),
                           self.spec.guard_spot_check, self.guard_cfg, float(forced) if forced else None)
        suspect = r.worker in self.drift_suspects
        if suspect and self.spec.guard_spot_check > 0:
            rate = 1.0  # its drift made it a suspect (guard.drift_suspect): every push is checked
        last = self.guard_cfg.verify_last_step and r.step == self.spec.steps - 1 and self.spec.guard_spot_check > 0
        spot = last or push_spot_checked(self.spec.seed, f"{self.spec.run_id}/{self.guard_salt}", self.stage, r.step,
                                         ids, rate)
        err = None
        checker = ""
        # (The epoch too: after an undo a version number names other weights than before it.)
        current = r.epoch == self.epoch and r.step == self.step and self.version == r.step
        # A drawn push is computed again by another worker of the stage (its compute, not the
        # server's; the server recomputes only if the two disagree). First, flagged, last-step
        # and suspects' pushes the server recomputes itself in fp32 (a colluder could be drawn
        # to check them); bf16 has no recomputation that could clear a push, so there every
        # drawn push is checked this way.
        dup_able = self._dup_able(r, compression_of_spec(self.spec).pull == "none")
        if spot and current and dup_able and (not exact or not (flag or first or last or suspect)):
            checker = self._dup_start(r, ids, grads, exact)
        # bf16 (raw frames, plain pulls): a drawn push no other worker can check (a stage's
        # only worker) is recomputed by the server in fp32 and judged within lowp_rel_tol.
        lowp = (run_precision(self.spec) == "bf16" and not self.local and all(g.codec in ("", "raw") for g in r.grads)
                and compression_of_spec(self.spec).pull == "none")
        need = not checker and current and (needs_verify(flag, first, spot, exact, self.guard_cfg) or (lowp and spot))
        deferred = False
        # (A push flagged only as small is no sign of a lie: guard.low_only.)
        small = bool(flag) and low_only(norm, cosine, centre, self.guard_cfg)
        if need and defer_check(flag, small, last, suspect, self.guard_cfg):
            # Routine: judged beside the steps (safety/deferred.py); the push counts unverified now.
            mbs = self.steps[r.step]
            deferred = await self._defer(DeferredCheck(
                r.worker, r.step, r.epoch, tuple(ids), grads,
                [(mb, mbs[mb].input, mbs[mb].out_grad) for mb in sorted(ids)], (self.stage, self.first, self.last),
                (self.is_first, self.is_last), self.loss_scale, lowp,
                "flagged as small" if flag else "its first" if first else f"spot check at rate {rate:.2f}"))
            need = False
        if need:
            self.guard_checks += 1
            mbs = self.steps[r.step]
            inputs = [(mb, mbs[mb].input, mbs[mb].out_grad) for mb in sorted(ids)]
            # Under the weights lock: no commit or rollback changes the weights while they are
            # used, and the inputs taken above are of the weights' epoch.
            async with self._wlock:
                if self.version == r.step and self.epoch == r.epoch:
                    err = await loop.run_in_executor(None, self._guard_recompute, self.module, r.step, inputs,
                                                     grads, self.is_first, self.is_last, self.loss_scale)
        if err is not None:
            log.info("%s: recomputed the push of %s (step %d mbs %s%s): relative error %.3g", self.name,
                     r.worker, r.step, ids, ", its first" if first else ", flagged" if flag else
                     f", spot check at rate {rate:.2f}", err)
        # Consecutive flagged pushes (an unflagged one clears them): one odd micro-batch never adds up.
        # A push flagged only as small is no strike (guard.low_only).
        strike = bool(flag) and not small
        self.guard_strikes[r.worker] = self.guard_strikes.get(r.worker, 0) + 1 if strike else 0
        if flag:
            self.guard_flags[r.worker] = self.guard_flags.get(r.worker, 0) + 1
            # A flag its recomputation clears is a suspicion resolved (honest micro-batches do
            # this): logged at INFO. Only a flag that stands is a WARNING.
            cleared = err is not None and ban_reason("", err, 0, self.guard_cfg, lowp) == ""
            log.log(logging.INFO if cleared or small else logging.WARNING,
                    "%s: push of %s (step %d mbs %s) flagged: %s; %s", self.name, r.worker, r.step, ids, flag,
                    f"recomputed: relative error {err:.3g}" if err is not None else
                    "to be recomputed beside the steps" if deferred else "not recomputed")
        # Exact runs ban only on a failed recomputation, never on flags alone.
        reason = ban_reason(flag, err, 0 if exact else self.guard_strikes.get(r.worker, 0), self.guard_cfg, lowp)
        if reason:
            async with self.cond:  # _guard_ban wakes the waiters: notify needs the lock
                self._guard_ban(r.worker, r.step, reason)
            return reason
        if err is not None:
            self.guard_ok[r.worker] = self.guard_ok.get(r.worker, 0) + 1
        if exact:
            if err is None:
                self.step_unverified.add(r.worker)  # a ban of it later rolls back past this step
                self._end_note(r.worker, ids)  # the run's end check may recompute it
        elif strike:
            # No push is verified here (bf16/fp16, lossy codecs): the undo record holds what the
            # screen flagged, and keeps it (an unflagged push after it takes nothing back).
            self.step_unverified.add(r.worker)
        if deferred:
            self.step_unverified.add(r.worker)  # until its deferred check clears it (or bans and undoes it)
        if err is not None or not exact:
            self.guard_seen.add(r.worker)  # else its first push is still to be recomputed
        if not flag or err is not None or small:
            # Honest (or cleared by its recomputation, or only small): part of the stage's robust centre.
            self.guard_norms = (self.guard_norms + [norm])[-self.guard_cfg.history:]
        return ""

    def _guard_ban(self, wid: str, step: int, reason: str) -> None:
        """Ban ``wid`` for the run: drop its uncounted and counted work of the step (redone by others)."""
        self.guard_banned[wid] = reason
        log.error("%s banned worker %s at stage %d step %d: %s", self.name, wid, self.stage, step, reason)
        mbs = self.steps.get(self.step, {})
        dropped = [mb for p in self.pushes if p[2] == wid for mb in p[3]]
        self.pushes = [p for p in self.pushes if p[2] != wid]
        self.fold = PushFold()  # (its sum may hold a push taken back: the commit sums them anew)
        for mb in dropped:
            if mb in mbs and mbs[mb].grad == "counted":
                mbs[mb].grad, mbs[mb].holder = "todo", ""
                self.todo.add(self.step, "grad", mb)
                self.requeues += 1
        self.pushed = {k for k in self.pushed if k[0] != wid}
        self.step_unverified.discard(wid)
        self.end_records.pop(wid, None)
        self._void_worker(wid, f"banned: {reason}")
        undo = undo_version(self.guard_unverified, wid)
        if undo is not None:
            log.error("%s: worker %s has unverified pushes committed since step %d: the run rolls back to v%d",
                      self.name, wid, undo, undo)
        self.guard_bans.append(pb.GuardBan(worker=wid, reason=reason, stage=self.stage, step=step,
                                           undo_from=0 if undo is None else undo + 1))
        self.cond.notify_all()

    async def Renew(self, request, context):
        await check_caller(context, request.worker)
        info = self._worker(request.worker)
        now = time.monotonic()
        secs = lease_seconds(info.ewma_s, self.spec.min_lease_s) if self.spec else 1.0
        if request.pushing > 0:
            self.pushing[request.worker] = (request.pushing - 1, now)
        for lid in request.lease_ids:
            lease = self.leases.get(lid)
            if lease is not None and lease.worker == request.worker:
                lease.deadline = now + secs
            elif lid in self.dup_leases:
                self._dup_renew(request.worker, lid, secs)
        return pb.RenewReply(version=self.version, epoch=self.epoch)

    async def GetWeights(self, request, context):
        await check_caller(context, request.worker)
        if request.worker != "coordinator":
            self._worker(request.worker)
        if self.version < 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage not loaded yet")
        reply = pb.WeightsReply(version=self.published_version(), epoch=self.epoch, first=self.first,
                                last=self.last)
        for name, p in self.params.items():
            reply.params.append(encode_tensor(name, p.detach()))
        return reply

    # ------------------------------------------------------------------ streamed RPCs
    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk this server sends: its own setting, else the run's, else the default."""
        spec_chunk = self.spec.chunk_bytes if self.spec is not None else 0
        return self.chunk_bytes_opt or spec_chunk or DEFAULT_CHUNK_BYTES

    def max_bytes(self, what: str) -> int:
        """Most bytes a streamed message of kind ``what`` ("act" or "grads") may have here."""
        if self.spec is None:
            return CONTROL_SLACK
        if what == "grads":
            if self.version < 0:
                return self._sb_max_bytes()  # a hot standby: the gradient of the stage it copies
            numel = sum(p.numel() for p in self.params.values())
            return 4 * numel + 512 * len(self.params) + CONTROL_SLACK
        cfg = model_config(self.spec)
        return 4 * self.spec.micro_batch_size * self.spec.seq_len * cfg.d_model + CONTROL_SLACK

    async def Session(self, request_iterator, context):
        """A worker's session (:mod:`shoal.runtime.transport.session`): its lease requests,
        results and renewals come in on one stream, answered by the same handlers as the
        calls; replies and take-backs go out on it. Every message must name the caller."""
        member = caller(context)[0] if context is not None else ""
        out: asyncio.Queue = asyncio.Queue()
        old = self.sessions.get(member)
        if old is not None:
            old.put_nowait(None)  # a reconnect replaces the old session
        self.sessions[member] = out
        log.info("%s: session of %s opened", self.name, member)
        refused: list[tuple] = []  # (status code, one line) that ends the session
        jobs: set[asyncio.Task] = set()
        reader = asyncio.create_task(self._session_read(request_iterator, member, out, jobs, refused))
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                data = await serialised(msg)
                for chunk in split(message_kind(msg), data, self.chunk_bytes):
                    yield chunk
        finally:
            reader.cancel()
            for t in list(jobs):
                t.cancel()
            if self.sessions.get(member) is out:
                del self.sessions[member]
        if refused and context is not None:
            await context.abort(*refused[0])

    def _session_limit(self, kind: str) -> int:
        return self.max_bytes("act") if kind == "TaskResult" else CONTROL_SLACK

    async def _session_read(self, chunks, member: str, out: asyncio.Queue, jobs: set, refused: list) -> None:
        """Read a session's messages and answer each (in its own task: a lease request
        long-polls while results keep coming)."""
        try:
            async for kind, msg in read_messages(chunks, UP_KINDS, self._session_limit, self._alive,
                                                 frames={"TaskResult": RESULT_FRAME}):
                if msg.worker != member:
                    refused.append((grpc.StatusCode.PERMISSION_DENIED,
                                    f"session message names member {msg.worker!r}, but the caller is {member!r}"))
                    break
                if kind == "RenewRequest":
                    await self.Renew(msg, None)
                    continue
                job = asyncio.create_task(self._session_answer(kind, msg, out))
                jobs.add(job)
                job.add_done_callback(jobs.discard)
        except WireError as exc:
            log.warning("%s refused a session message of %s: %s", self.name, member, exc)
            refused.append((grpc.StatusCode.INVALID_ARGUMENT, f"rejected: {exc}"))
        except grpc.aio.AioRpcError:
            pass  # the worker went away: its leases run out as after any broken call
        finally:
            out.put_nowait(None)

    async def _session_answer(self, kind: str, msg, out: asyncio.Queue) -> None:
        try:
            if kind == "LeaseRequest":
                out.put_nowait(await self._lease_reply(msg, session=True))
                return
            reply = await self.Complete(msg, None)
            reply.lease_id = msg.lease_id
            if not msg.HasField("next"):
                out.put_nowait(reply)
                return
            # The result carried the worker's next lease request: one message answers both,
            # unless the request waits (then the verdict goes now, the task when there is one).
            sent = []

            def verdict_now() -> None:
                out.put_nowait(reply)
                sent.append(True)

            nxt = msg.next
            nxt.worker = msg.worker  # the caller's own request (checked on the result)
            lease = await self._lease_reply(nxt, session=True, on_wait=verdict_now)
            if not sent:
                lease.result.CopyFrom(reply)
            out.put_nowait(lease)
        except Exception:
            log.exception("%s: a session %s of %s failed", self.name, kind, msg.worker)
            out.put_nowait(None)

    async def LeaseStream(self, request, context):
        await check_caller(context, request.worker)
        reply = await self._lease_reply(request, session=False)
        for chunk in split("LeaseReply", await serialised(reply), self.chunk_bytes):
            yield chunk

    def _alive(self, chunk: pb.Chunk) -> None:
        """A chunk from a known worker shows it alive (a long upload is not silence)."""
        info = self.workers.get(chunk.sender)
        if info is not None:
            info.last_seen = time.monotonic()

    async def CompleteStream(self, request_iterator, context):
        try:
            msg = await receive(request_iterator, pb.TaskResult, self.max_bytes("act"), self._alive,
                                frames_field=RESULT_FRAME)
        except WireError as exc:
            log.warning("%s refused a streamed result: %s", self.name, exc)
            return pb.CompleteReply(accepted=False, reason=f"rejected: {exc}")
        return await self.Complete(msg, context)

    async def PushGradsStream(self, request_iterator, context):
        trace(self.name, "push_begin")
        try:
            # Its frames stay views of the received bytes until decoded (split_framed): two
            # fewer copies of a stage's gradients, and no long protobuf call holding the loop.
            # A local round's large pseudo-gradient is received into a file (page cache, not
            # this process's memory): a dense round's pushes all arrive at once.
            msg = await receive(request_iterator, pb.GradPush, self.max_bytes("grads"), self._alive,
                                frames_field=GRAD_FRAMES, spool=self._pushes_folder() if self.local else None)
        except WireError as exc:
            log.warning("%s refused a streamed gradient push: %s", self.name, exc)
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}")
        return await self.PushGrads(msg, context)

    async def RelayStream(self, request_iterator, context):
        """A peer server's relays on one stream (:mod:`shoal.runtime.transport.relays`), each
        answered in turn by :meth:`SubmitRelay`; its reply names the relay's ``relay_id``."""
        refused = ""
        self.relay_streams += 1
        try:
            async for _, msg in read_messages(request_iterator, RELAY_KINDS, lambda _kind: self.max_bytes("act"),
                                              frames=RELAY_FRAMES):
                rep = await self.SubmitRelay(msg, None)
                rep.relay_id = msg.relay_id
                for chunk in split("RelayReply", rep.SerializeToString(), self.chunk_bytes):
                    yield chunk
        except WireError as exc:
            log.warning("%s refused a relay stream: %s", self.name, exc)
            refused = f"rejected: {exc}"
        finally:
            self.relay_streams -= 1
        if refused and context is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)

    async def SubmitRelayStream(self, request_iterator, context):
        try:
            msg = await receive(request_iterator, pb.Relay, self.max_bytes("act"),
                                frames_field=RELAY_FRAMES["Relay"])
        except WireError as exc:
            return pb.RelayReply(accepted=False, reason=f"rejected: {exc}")
        return await self.SubmitRelay(msg, context)

    async def _weights_bytes(self) -> bytes | None:
        """The serialised WeightsReply of the current version, made once and shared by all pullers
        (None while the stage is being loaded).

        Made in a thread (the loop keeps serving); the commit and a rollback's load wait for it
        (``_wlock``), so the bytes are exactly the weights of the version they are labelled with.
        """
        async with self._wlock:
            if self.version < 0:
                return None
            key = (self.published_version(), self.epoch, self.stage)
            if self._wcache is None or self._wcache[0] != key:
                self._wcache = None  # drop the old bytes before making the new
                head = pb.WeightsReply(version=key[0], epoch=self.epoch, first=self.first, last=self.last)
                data = await asyncio.get_running_loop().run_in_executor(
                    None, serialise_weights, head, dict(self.params))
                self._wcache = (key, data)
            return self._wcache[1]

    async def GetWeightsStream(self, request, context):
        await check_caller(context, request.worker)
        if request.worker != "coordinator":
            self._worker(request.worker)
        if self.version < 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage not loaded yet")
        if request.worker == "coordinator" and self.spec is not None and self.version >= self.spec.steps:
            # The final pull: the run is done only once the last checkpoint write has ended, so
            # a write that fails after the last commit still fails the run instead of passing unseen.
            await self._ckpt_written()
            await asyncio.sleep(0)  # the write's done callback (_bg_done) sets self.fatal
            if self.fatal:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.fatal)
        # Every chunk is a slice of the one shared serialisation; a puller holds a chunk at a time.
        if request.worker != "coordinator" and compression_of_spec(self.spec).pull != "none":
            data = await compressed_pull(self, request)  # a delta against what the worker holds
        else:
            data = await self._weights_bytes()
        if data is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage being loaded")
        trace(self.name, "pull_begin", w=request.worker)
        for chunk in split("WeightsReply", data, self.chunk_bytes):
            info = self.workers.get(request.worker)
            if info is not None:
                info.last_seen = time.monotonic()  # a long download is not silence
            yield chunk

    async def StandbyCkptStream(self, request, context):
        """Send a hot standby this stage's newest checkpoint file if newer than it holds."""
        await check_caller(context, request.member_id)
        data, version = b"", 0
        # A long poll: with nothing new, wait (bounded) for the next checkpoint file, so a
        # standby has each commit's state one transfer after the write, not a heartbeat and a
        # coordinator round trip later: a kill right after a commit then rarely costs that step.
        deadline = time.monotonic() + STANDBY_POLL_S
        send = 0
        while request.stage == self.stage and self.spec is not None:
            send = standby_send_version(list_ckpts(self.ckpt_root, self.stage, self.spec.run_id),
                                        request.have, self.loading)
            if send or self.done or time.monotonic() >= deadline:
                break
            await self.ckpt_signal.wait(deadline - time.monotonic())
        if send:
            path = ckpt_dir(self.ckpt_root, self.stage, self.spec.run_id) / f"v{send}.safetensors"
            with contextlib.suppress(OSError):  # pruned meanwhile: nothing sent, the standby asks again
                data, version = await asyncio.get_running_loop().run_in_executor(None, path.read_bytes), send
        reply = pb.StandbyCkpt(version=version, data=data).SerializeToString()
        for chunk in split("StandbyCkpt", reply, self.chunk_bytes):
            yield chunk

    @property
    def copier_label(self) -> str:
        """How a server copying another's checkpoints names itself in logs: a hot standby
        (``--standby``) or a plain spare server waiting for a stage."""
        return "standby" if self.standby else "spare"

    def _copy_failed(self, stage: int, source: str, why: str) -> None:
        """A failed copy is retried at every heartbeat (5 a second): warn once per stage, source
        and reason (a dead source fails the same way until the coordinator names another)."""
        key = (stage, source, why)
        if self.copy_failing == key:
            log.debug("%s (%s): %s; retrying", self.name, self.copier_label, why)
            return
        self.copy_failing = key
        log.warning("%s (%s): %s; retrying at every heartbeat (said once until it changes)", self.name,
                    self.copier_label, why)

    async def _standby_copy(self, stage: int, first: int, last: int, source: str) -> None:
        """Copy the active server's newest checkpoint of ``stage`` into our own folder.

        Written under a temporary name and renamed, then verified like any checkpoint
        (run id, stage, layers, checksum): a bad copy is removed and fetched again later.
        Promotion restores from these files, so it needs no shared disk.
        """
        try:
            if not source or self.spec is None:
                return
            have = max(list_ckpts(self.ckpt_root, stage, self.spec.run_id), default=0)
            msg = await fetch(self._stub(source).StandbyCkptStream,
                              pb.StandbyCkptRequest(member_id=self.member_id, stage=stage, have=have),
                              pb.StandbyCkpt, STANDBY_MAX_BYTES, timeout=300, traffic=self.traffic)
            if msg.version <= 0 or msg.version == have or self.stage >= 0:
                return
            d = ckpt_dir(self.ckpt_root, stage, self.spec.run_id)
            if msg.version < have:
                # The active server's newest is older: the run rolled back, and our newer
                # copies belong to the history it left (never to be promoted from).
                gone = remove_abandoned_ckpts(self.ckpt_root, stage, self.spec.run_id, msg.version)
                log.info("%s (%s) removed copies v%s of stage %d: the run rolled back to v%d",
                         self.name, self.copier_label, ",".join(map(str, gone)), stage, msg.version)
                if (d / f"v{msg.version}.safetensors").exists():
                    return
            # Its own temp name: in a shared folder the active server may be writing .v<N>.tmp.
            tmp, path = d / f".v{msg.version}.copy-{os.getpid()}.tmp", d / f"v{msg.version}.safetensors"

            def write_and_check() -> None:  # in a thread: a checkpoint is weights and AdamW state
                d.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(msg.data)
                os.replace(tmp, path)
                read_stage_ckpt(self.ckpt_root, stage, msg.version, run_id=self.spec.run_id, layers=(first, last))

            try:
                await asyncio.get_running_loop().run_in_executor(None, write_and_check)
            except ShoalError as exc:
                log.error("%s: copied checkpoint of stage %d failed its checks (%s); fetching again",
                          self.name, stage, exc)
                path.unlink(missing_ok=True)
                return
            for v in ckpts_to_prune(list_ckpts(self.ckpt_root, stage, self.spec.run_id), msg.version, 4):
                (d / f"v{v}.safetensors").unlink(missing_ok=True)  # keep the last few, like the active
            log.info("%s (%s) holds stage %d v%d", self.name, self.copier_label, stage, msg.version)
            self.copy_failing = None
            self._sb_tidy()  # the step log keeps only the steps after the newest copy
        except grpc.aio.AioRpcError as exc:
            self._copy_failed(stage, source, f"copying stage {stage} from {source} failed ({exc.code()})")
        except OSError as exc:
            # e.g. a server loading the stage in a shared folder removed our temp file
            self._copy_failed(stage, source, f"writing the copy of stage {stage} failed ({exc})")
        finally:
            self.standby_copying = False

    async def Leave(self, request, context):
        await check_caller(context, request.member_id)
        self._void_worker(request.member_id, "left")
        self.workers.pop(request.member_id, None)
        self.left.add(request.member_id)
        async with self.cond:
            self.cond.notify_all()
        return pb.Empty()

    # ------------------------------------------------------------------ relay
    def _relay_verdict(self, r: pb.Relay) -> pb.RelayReply | None:
        """The reply to a relay this server cannot take now (None: it can)."""
        if self.version < 0 or r.epoch > self.epoch:
            return pb.RelayReply(accepted=False, retry=True, reason="not ready")
        if r.epoch < self.epoch or r.step < self.step:
            return pb.RelayReply(accepted=True, reason="old; dropped")
        if r.step > self.step + 1:
            return pb.RelayReply(accepted=False, retry=True, reason="too far ahead")
        return None

    async def SubmitRelay(self, request, context):
        r = request
        self.stats["messages"] += 1
        try:
            frame = one_frame(r, "tensor")  # (each read of a parsed payload copies it: read once)
        except WireError as exc:
            return pb.RelayReply(accepted=False, reason=f"rejected: {exc}")
        size = len(frame.data)
        self.stats["bytes_in"] += size
        verdict = self._relay_verdict(r)
        if verdict is not None:
            return verdict
        try:
            t, kept = await off_loop(size, self._decode_act, frame, r.direction == pb.FWD or self.grads_finite,
                                     "input" if r.direction == pb.FWD else "grad", True)
        except WireError as exc:
            return pb.RelayReply(accepted=False, reason=f"rejected: {exc}")
        verdict = self._relay_verdict(r)  # checked in a thread: the step may have moved on meanwhile
        if verdict is not None:
            return verdict
        mbs = self.steps.setdefault(r.step, StepMbs())
        if r.mb not in self._mb_range():
            return pb.RelayReply(accepted=False, reason="micro-batch id out of range")
        st = mbs.setdefault(r.mb, MbState())
        if r.direction == pb.FWD:
            if st.input is None:
                st.input, st.input_frame = t, kept
                if self.is_last:
                    if st.grad == "wait":
                        st.grad = "todo"
                        self.todo.add(r.step, "grad", r.mb)
                elif st.fwd == "wait":
                    st.fwd = "todo"
                    self.todo.add(r.step, "fwd", r.mb)
        else:
            if st.out_grad is None:
                st.out_grad, st.out_grad_frame = t, kept
                if st.grad == "wait":
                    st.grad = "todo"
                    self.todo.add(r.step, "grad", r.mb)
        trace(self.name, "relay_in", step=r.step, mb=r.mb, d=r.direction)
        async with self.cond:
            self.cond.notify_all()
        return pb.RelayReply(accepted=True)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg_done)

    def _bg_done(self, t: asyncio.Task) -> None:
        """No background task fails unseen: log it and fail the run through the coordinator."""
        self._bg.discard(t)
        if t.cancelled() or t.exception() is None:
            return
        exc = t.exception()
        if isinstance(exc, ShoalError):
            log.error("%s: %s", self.name, exc)
            why = str(exc)
        else:
            log.error("%s: background task %s failed", self.name, t.get_coro().__qualname__,
                      exc_info=(type(exc), exc, exc.__traceback__))
            why = f"{type(exc).__name__}: {exc}"
        if not self.fatal:
            self.fatal = f"server {self.name} (stage {self.stage}): {why}".splitlines()[0]

    def _stub(self, addr: str) -> pbg.StageServerStub:
        if addr not in self._stubs:
            self._stubs[addr] = pbg.StageServerStub(self.channels.open(addr))
        return self._stubs[addr]

    def _relay_link(self, addr: str) -> RelayLink:
        """The open relay stream to the server at ``addr`` (a broken one is replaced)."""
        link = self._links.get(addr)
        if link is None or not link.alive:
            link = self._links[addr] = RelayLink(self._stub(addr).RelayStream, self.chunk_bytes,
                                                 traffic=self.traffic)
        return link

    async def _relay(self, stage: int, msg: pb.Relay | Framed) -> None:
        """Send ``msg`` to ``stage``'s server until it is taken or the epoch moves on."""
        trace(self.name, "relay_out", step=msg.step, mb=msg.mb, d=msg.direction)
        while msg.epoch == self.epoch and not self.done:
            addr = self.servers[stage] if stage < len(self.servers) else ""
            if addr:
                try:
                    rep = await self._relay_link(addr).relay(msg)
                    trace(self.name, "relay_ack", step=msg.step, mb=msg.mb, d=msg.direction, ok=rep.accepted)
                    if rep.accepted or not rep.retry:
                        if not rep.accepted:
                            log.warning("relay refused: %s", rep.reason)
                        return
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ step commit
    def _start_ckpt(self) -> None:
        """Write the checkpoint of the version just committed in a thread; the loop goes on.

        The next commit waits for it (:meth:`_ckpt_written`) before it changes the weights or
        the optimizer state, so the file holds exactly this version. A failed write is not
        lost: :meth:`_bg_done` logs it and fails the run through the coordinator, as a write
        on the loop did; only a write whose stage moved on meanwhile (another server or a
        roll-back took it over) is abandoned with a warning.
        """
        # (local mode: the version of the merged weights the file holds; with overlap the
        # merge published at this commit is the previous round's)
        stage, version, module, opt, epoch = self.stage, self.published_version(), self.module, self.opt, self.epoch
        kw = dict(run_id=self.spec.run_id, layers=(self.first, self.last), loss_scale=self.loss_scale,
                  outer_m=self.outer_m if self.local else None, keep_at=self._keep_at(),
                  pull_ef=self.update_pulls.ef.state() if self.local and self.update_pulls is not None else None)

        async def write() -> None:
            try:
                path = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: save_stage_ckpt(self.ckpt_root, stage, version, module, opt, **kw))
            except ShoalError as exc:
                if (self.stage, self.epoch) == (stage, epoch):
                    raise
                # The stage moved on while it was written (another server serves it now, or a
                # roll-back reloaded it): that server's own checkpoints count, not this one.
                log.warning("%s: the checkpoint of stage %d v%d was abandoned: the stage moved on (%s)",
                            self.name, stage, version, exc)
                return
            st = path.stat()
            self.ckpt_ok.add((stage, version, st.st_size, st.st_mtime_ns))
            self.ckpt_signal.notify_all()  # a standby waiting in StandbyCkptStream takes it now

        self.ckpt_task = asyncio.create_task(write())
        self._bg.add(self.ckpt_task)
        self.ckpt_task.add_done_callback(self._bg_done)

    def _keep_at(self) -> int | None:
        """The oldest version a ban may roll back to, for pruning: the coordinator's (every
        stage's record, a heartbeat late) or this server's own record, whichever is older (its
        own unverified pushes are known at once; a ban right after a prune must find the file)."""
        own = keep_version([self.guard_unverified], set(self.guard_banned))
        return min((v for v in (own, self.guard_keep) if v is not None), default=None)

    async def _ckpt_written(self) -> None:
        """Wait for the checkpoint write under way, if any (its failure is handled by _bg_done)."""
        t = self.ckpt_task
        if t is not None and not t.done():
            await asyncio.wait([t])

    def _sum_pushes(self, pushes: list, summed: dict[str, torch.Tensor] | None = None) -> list[float]:
        """Sum the step's pushes into the parameters' gradients in micro-batch order (``pushes``
        sorted by first micro-batch: the local trainer's sum, bitwise; ``summed``: that sum made
        already, :class:`PushFold`), unscale them (fp16), keep them as the screen's reference;
        returns each parameter's squared norm (exact sync; the coordinator adds every stage's
        with math.fsum) (runs in a thread)."""
        # A rollback may load new parameters while this thread runs: it sums into the ones it began with.
        params = self.params
        for p in params.values():
            p.grad = None
        if summed is not None:
            for name, g in summed.items():
                params[name].grad = g
        else:
            for _, grads, *_ in pushes:
                for name, g in grads.items():
                    p = params[name]
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.add_(g)
        # The direction the screen compares the next step's pushes with (honest work only).
        if params is self.params:  # (not after a rollback loaded other weights: its history is gone)
            self.guard_ref = {n: p.grad for n, p in params.items() if p.grad is not None}
        if not self.local:
            self._drift_update(self.step, pushes)
        # fp16: the pushes hold gradients of the loss times the step's scale.
        unscale_grads(params.values(), self.loss_scale)
        return [] if self.local else param_sq_norms(params.values())

    async def _commit(self, step: int, epoch: int) -> None:
        trace(self.name, "commit_start", step=step)
        try:
            mbs = self.steps[step]
            pushes = sorted(self.pushes, key=lambda x: x[0])
            # Unverified pushes in this step: a later ban of their worker rolls back to version ``step``.
            # Recorded before the sum: a deferred check may ban while the sum runs, and its undo
            # must then cover this step, whose sum holds the push.
            unverified = sorted({p[2] for p in pushes} & self.step_unverified)
            for wid in unverified:
                self.guard_unverified.setdefault(wid, step)
            # Summed, unscaled and measured in a thread: a stage's gradients can be hundreds of MB.
            # Most of the sum is made as the pushes came (PushFold); the rest is added now.
            fold = self.fold
            await self._fold_pushes()
            summed = fold.result(pushes)
            self.stats["sums_folded" if summed is not None else "sums_anew"] += 1
            parts = await asyncio.get_running_loop().run_in_executor(None, self._sum_pushes, pushes, summed)
            report = pb.StepReport(member_id=self.member_id, stage=self.stage, step=step, epoch=epoch,
                                   sq_norm=self._local_sq_norm() if self.local else total_sq_norm(parts),
                                   requeues=self.requeues,
                                   param_sq_norms=self._local_sq_parts() if self.local else parts,
                                   unverified=unverified)  # journaled with the commit
            if self.is_last:
                report.losses.extend(mbs[mb].loss for mb in sorted(mbs))
            if self.last_split is not None:
                report.last_step.CopyFrom(pb.StepSplit(**self.last_split))
            for w, n in self.tasks_per_worker.items():
                report.tasks_per_worker[w] = n
            # Every standby of the stage logs the step before any decision on it can exist.
            await self.standby_send_step(step, epoch)
            if step == self.spec.steps - 1:
                await self._deferred_drain(epoch)  # no run ends with a deferred check undecided
                if self.epoch != epoch:
                    return
            if step == self.spec.steps - 1 and self._end_active():
                # The newest unverified pushes of workers absent from the last step (safety/endcheck.py).
                await self._end_checks(step, epoch)
            # A ban made in this step reaches the coordinator before the step's report: else the
            # run's last step could commit and finish first, and the ban's undo would come too late.
            while len(self.guard_bans) > self.guard_bans_told and self.epoch == epoch:
                await self._heartbeat()
                if len(self.guard_bans) > self.guard_bans_told:
                    await asyncio.sleep(0.1)
            while True:
                if self.epoch != epoch:
                    return
                trace(self.name, "report", step=step)
                try:
                    d = await self.coord.ReportStep(report, timeout=10)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
                    continue
                if self.epoch != epoch or d.stale:
                    return
                if d.ready:
                    break
            kill_at_commit(self.stage, step, self.standby)
            trace(self.name, "decided", step=step)
            self.timing.decided = time.monotonic()
            await self._ckpt_written()  # the weights it reads change only after it is on disk
            merged = False
            if self.local:
                # Workers apply the decision to their replicas; the weights here change only by merges.
                merged = await self._local_commit(step, epoch, d)
                if merged is None:
                    return
            async with self._wlock:
                if self.epoch != epoch:
                    # A rollback came while the checkpoint write or the lock was awaited: its load
                    # owns the stage now (this step's update must not land on the loaded weights).
                    return
                if not self.local and step < self.spec.steps - 1:
                    await self._end_record(step, epoch)  # before the update: the weights it was computed on
                if self.local:
                    pass
                elif d.skip:
                    # fp16 overflow at some stage: every stage skips the update of this step.
                    self.opt.zero_grad(set_to_none=True)
                else:
                    await asyncio.get_running_loop().run_in_executor(None, apply_update, self.opt, d.lr, d.coef)
                if d.next_loss_scale > 0:
                    self.loss_scale = d.next_loss_scale
                self._wcache = None  # the serialised weights of the old version
                self.version = step + 1
            self.last_split = self.timing.split(time.monotonic())
            trace(self.name, "committed", step=step)
            # d.checkpoint: the coordinator's time rule (ckpt_due), the same at every stage.
            if (self._local_ckpt_due(merged, d.checkpoint) if self.local else
                    d.checkpoint or self.spec.ckpt_every > 0 and self.version % self.spec.ckpt_every == 0):
                self._start_ckpt()
            self.steps.pop(step, None)
            self.todo.drop_step(step)
            self.pushes = []
            self.fold = PushFold()
            self.step = step + 1
            if self.step < self.spec.steps:
                self._open_step(self.step)
                if not self.local and compression_of_spec(self.spec).pull == "none":
                    # Serialise the new version now: the workers' pulls come a lease round trip
                    # later and find the bytes made (or being made) instead of starting them.
                    self._spawn(self._weights_bytes())
        finally:
            if self.epoch == epoch:
                self.committing = False
            async with self.cond:
                self.cond.notify_all()


# Largest checkpoint a hot standby accepts from its stage's active server (weights + AdamW state).
STANDBY_MAX_BYTES = 16 * 1024**3
# Longest a StandbyCkptStream call waits for a newer checkpoint (the standby asks again after).
STANDBY_POLL_S = 2.0


def flush_voids(holders: set[str], pushing: dict[str, tuple[int, float]], step: int, now: float,
                fresh_s: float) -> list[str]:
    """The workers holding computed gradients of ``step`` past the flush grace to void
    (pure; tested directly): all of ``holders`` but those whose renewal within ``fresh_s``
    said they are framing or sending their push of ``step`` (``pushing``: worker -> (step,
    time)). A large push on a loaded host takes longer than the grace; a worker stops saying
    so once its push's chunks stop leaving for its ``push_stall_s`` (a hung path), so such a
    holder is voided then, not after every retry of the push."""
    return sorted(w for w in holders
                  if not (w in pushing and pushing[w][0] == step and now - pushing[w][1] <= fresh_s))


def standby_send_version(versions: list[int], have: int, loading: bool) -> int:
    """The checkpoint version to send a standby that holds ``have`` (0: nothing to send).

    The newest file (``versions`` ascending) when it differs from the standby's newest, also
    an older one: the run rolled back and the standby's newer copies are from the history it
    left. Nothing while the stage is loading (its files are being sorted out).
    """
    if not versions or loading or versions[-1] == have:
        return 0
    return versions[-1]


def serve(coord: str, listen: str, token: str, ckpt_root: str, name: str = "server", *, dial=None,
          on_servers=None, device: str = "", region: str = "", up_bps: float = 0.0, down_bps: float = 0.0,
          probe_bytes: int = 16 * 1024 * 1024, advertise: str | None = None, chunk_bytes: int = 0,
          tls=None, standby: bool = False, data: str = "", server_token: str = "",
          merge_memory: float | None = None) -> None:
    """Run a stage server process until the run is done (``standby``: as a hot standby).

    ``data``: the prepared data folder (a copy of the run's) this server reads tokens from.
    ``device``: scenario host it plays; ``region``/``up_bps``/``down_bps``: declared
    figures that win over measured ones; ``advertise``: the address peers dial (default:
    the listen address); ``chunk_bytes``: bytes per streamed chunk (0: the run's setting);
    ``merge_memory``: bytes of decoded pseudo-gradients a merge holds (None:
    :func:`shoal.runtime.sync.held.default_merge_memory`).
    """
    set_threads()
    # a local-mode round's lowrank decode and encode hold its merge: on the merge's threads
    # (the same bits on any number; shoal.plan.cost.merge_cpu_time prices them so)
    set_codec_threads(merge_threads())
    srv = StageServer(coord, listen, token, ckpt_root, name=name, dial=dial, device=device, region=region,
                      up_bps=up_bps, down_bps=down_bps, probe_bytes=probe_bytes, advertise=advertise,
                      chunk_bytes=chunk_bytes, tls=tls, data=data, server_token=server_token,
                      merge_memory=merge_memory)
    srv.on_servers = on_servers
    srv.standby = standby
    run_member(srv.run(), coord, name)
