"""The coordinator: membership, planning, step commit, run records.

* Members join (servers with their address, workers with their measured FLOP/s) and
  heartbeat; one silent for ``dead_after_s`` is dead. A dead worker is removed and the
  worker->stage assignment repaired; a dead server leaves its stage vacant until a
  replacement joins, which restores the stage's newest checkpoint. Then every server
  rolls back to the newest version all stages can restore (a new *epoch*), and the run
  replays deterministically from there.
* Stages: layer ranges from the planner when it is installed (``shoal.plan``), else an
  even split; workers are assigned to stages in proportion to capacity. In a real run
  the planner sees what the members measured (the coordinator asks each member to
  measure once every stage has a server, waits for the reports before planning, and
  asks a worker again when its observed task or pull times drift from the planned
  ones; see :mod:`shoal.runtime.measure`); when the processes emulate a scenario, it
  sees that scenario's devices and network (see :mod:`shoal.runtime.roles.planning`). The
  scenario planned on is in ``shoal status`` and the run folder's ``scenario.json``.
* Step commit: each server reports its squared gradient norm (the last stage also its M
  losses); when all S stages have reported step t, the coordinator computes the global
  clip coefficient and the step's learning rate, answers them all, and writes the
  metrics record.
* Journal: the run spec, plan, epochs and committed steps go to the run's
  ``journal.jsonl`` (see :mod:`shoal.runtime.safety.journal`); a coordinator started with a
  journal's state (``--resume``) takes the run over: a new epoch, the same layer ranges,
  and a roll-back to the newest version every stage can restore.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import json_format

from shoal.errors import ShoalError
from shoal.model.profile import profile_model
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import (
    caller,
    check_caller,
    coordinator_identity,
    member_credential,
    new_member_id,
    run_public_key,
    server_token_ok,
)
from shoal.net.channel import ChannelFactory, advertised_address, bind, make_server
from shoal.net.stream import CONTROL_SLACK, fetch, receive
from shoal.net.traffic import BYTES_METHOD, merge_traffic
from shoal.net.wire import WireError, decode_tensor
from shoal.runtime.common import (
    DeafClock,
    Signal,
    assign_workers,
    ckpt_due,
    data_refusal,
    even_split,
    heartbeat_period,
    initial_scale,
    loss_scaling,
    model_config,
    new_run_id,
    optim_config,
    run_precision,
)
from shoal.runtime.measure import probe_reply
from shoal.runtime.roles.planning import (
    COORDINATOR_NODE,
    LOOPBACK_LINK,
    LOOPBACK_REGION,
    MEASURE_GAP_RETRIES,
    REMEASURE_AFTER_S,
    MemberFigures,
    PathFigures,
    distinct_servers,
    drifted,
    loopback_device,
    measured_scenario,
    memory_fits,
    missing_servers,
    planning_scenario,
    played_device,
    unplaced_reason,
)
from shoal.runtime.safety.guard import ban_undo_cap, keep_version, server_check_note, undo_target
from shoal.runtime.safety.journal import FINAL, JOURNAL, LINKED, Journal, point_link, run_dir
from shoal.runtime.safety.standby import decisions_since, planned_standby_stages
from shoal.runtime.sync.replicas import (
    assign_replica_workers,
    place_replica_servers,
    planned_assignment,
    replica_regions,
    slots_of_spec,
)
from shoal.runtime.transport.frames import WEIGHT_FRAMES
from shoal.train.metrics import JsonlWriter, step_record
from shoal.train.optim import clip_coefficient, lr_at, total_sq_norm
from shoal.train.outer import is_sync_step, sync_of_spec
from shoal.train.precision import next_loss_scale, overflowed

log = logging.getLogger("shoal.coordinator")

MEASURE_TIMEOUT_S = 60.0  # a member asked to measure that has not answered by then is planned as it joined
# Re-plans after joins, deaths and re-measurements: at most this share of the coordinator's
# time (a repair of a 1 000-member swarm takes about a second; a join storm coalesces into few).
REPLAN_SHARE = 0.2
# Most worker heartbeats a second the coordinator asks for: a beat costs it about 0.5 CPU-ms,
# nearly all of it gRPC's (bench/bench_coordinator.py, bench/results/coordinator.md), so
# 1 000 a second keep it near half a core at any swarm size.
BEATS_PER_S = 1000.0
BUSY_SHARE = 0.9  # a reaper tick with the loop computing this share of it or more excuses members' silence
FREE_REPLAN_S = 0.1  # a re-plan that took less than this is never put off (small swarms: at once)
# How long the run's end waits for a stage server to start sending its final weights before
# pulling them (it sends once its last checkpoint is written; one being received is waited for).
FINAL_WAIT_S = 30.0
FINAL_TRIES = 600  # pulls of a stage's final weights (0.1 s apart) before the run fails without them


@dataclass
class Member:
    member_id: str
    role: str
    name: str
    address: str = ""
    flops: float = 0.0
    device: str = ""  # emulated runs: the scenario device this member plays
    last_seen: float = field(default_factory=time.monotonic)
    will_measure: bool = False  # it answers measurement requests (real runs plan on its report)
    measure_req: int = 0  # newest measurement request sent to it (0: none yet)
    measure_done: int = 0  # newest request it answered
    asked_at: float = 0.0  # monotonic time of the newest request
    measured_at: float | None = None  # monotonic time of its newest report
    measure_gaps: int = 0  # reports in a row that lacked a stage server (asked again, up to MEASURE_GAP_RETRIES)
    pending_join: bool = False  # joined after the start; planned in once measured
    version: int = -1
    ckpt_version: int = -1
    epoch: int = 0
    stats: pb.MemberStats | None = None  # the newest figures from its heartbeats (dashboard)
    counter_id: str = ""  # id of its process's byte counters (dashboard: bytes per member)
    joined_s: float = field(default_factory=time.time)  # wall clock of the join
    ckpt_stage: int = -1  # server: the stage it served before re-joining (its disk holds that stage)
    standby: bool = False  # server: a hot standby (copies a stage's checkpoints until promoted)
    held: dict[int, int] = field(default_factory=dict)  # server without a stage: stage -> newest checkpoint it holds
    doing: str = ""  # what it said it was doing in its newest heartbeat (death reports)
    last_sign: str = "join"  # its newest sign of life: "heartbeat", or traffic a stage server saw
    death: str = ""  # once dropped: one line why (told to it if it calls again)
    ckpt_versions: list[int] = field(default_factory=list)  # server: every checkpoint version of its stage it holds
    told_done: bool = False  # a heartbeat of it was answered "done" (it ends; its byte counts are in)


def plan_stages(n_total_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layer ranges of the stages (even split by layer count)."""
    return even_split(n_total_layers, stages)


def keep_secret(path: Path, fresh: bytes, resumed: bool) -> bytes:
    """The run secret kept in ``path`` (mode 0600) so that a coordinator restarted with
    ``--resume`` checks the credentials its members already hold; ``fresh`` for a new run."""
    if resumed and path.exists():
        kept = path.read_bytes()
        if len(kept) == len(fresh):
            return kept
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(fresh)
    return fresh


class Coordinator(pbg.CoordinatorServicer):
    """Run state and RPC handlers of the coordinator."""

    def __init__(self, spec: pb.RunSpec, token: str, *, min_workers: int = 1, out: str | None = None,
                 emulated=None, stall_fail_s: float = 900.0, resume=None, options: dict | None = None,
                 tls=None, server_token: str = ""):
        if not spec.run_id:
            spec.run_id = new_run_id()  # names the servers' checkpoint folders
        self.spec, self.token, self.min_workers = spec, token, max(min_workers, 1)
        self.tls = tls  # run certificates (shoal.net.tls.TlsConfig; None: plain text on loopback)
        self.secret = secrets.token_bytes(32)  # signs the members' credentials (shoal.net.auth); never sent
        # Admits stage servers and standbys at Join (the join token admits workers only).
        self.server_token = server_token or secrets.token_hex(16)
        self.stall_fail_s = stall_fail_s  # fail the run after this long without a commit (0: never)
        self.stall_reported = False
        self.check_noted = False  # the spot checks' cost beside a GPU worker was said (server_check_note)
        self.error = ""  # one line: why the run failed ("" while it has not)
        self.emulated = emulated  # the scaled scenario the processes emulate (None: plain run)
        self.cfg = model_config(spec)
        self.layers = plan_stages(self.cfg.n_total_layers, spec.stages)
        self.costs = [float(b - a) for a, b in self.layers]
        # A replica plan (shoal.runtime.sync.replicas): its stages' layers are fixed, and a stage's
        # work is its layers times its replica's micro-batches.
        self.slots = slots_of_spec(spec, self.cfg.n_total_layers)
        if self.slots is not None:
            self.layers = [(s.first, s.last) for s in self.slots]
            self.costs = [float((s.last - s.first) * (s.mb_hi - s.mb_lo)) for s in self.slots]
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
        # A ban's roll-back: the restart version may be at most this (None: an ordinary roll-back).
        self.undo_cap: int | None = None
        # Worker member id -> the first committed step holding an unverified push of it at any
        # stage (from the servers' heartbeats; kept here so a replaced server's record survives).
        self.unverified: dict[str, int] = {}
        # The same by worker name, from the stages' step reports and journaled with each commit:
        # a restart gives every worker a new member id, and a resumed coordinator reads it back.
        self.unverified_names: dict[str, int] = {}
        self.committed = 0  # steps committed
        self.reports: dict[tuple[int, int], dict[int, pb.StepReport]] = {}
        self.decisions: dict[tuple[int, int], pb.StepDecision] = {}
        # fp16: (loss scale, consecutive good steps) at the start of each step; decided here
        # once per step and sent to every stage with the step's decision.
        self.scale_at: dict[int, tuple[float, int]] = {0: (initial_scale(spec), 0)}
        self.cond = Signal()  # notified when a step is decided
        self.done = False
        self.finished = asyncio.Event()
        # The final weights each stage server sent when asked (Assignment.send_final), by member
        # id; _finish pulls only a stage whose server has not sent them.
        self.final_in: dict[str, pb.WeightsReply] = {}
        self.final_signal = Signal()
        self.final_receiving: set[str] = set()  # servers whose final weights are arriving now
        self._final_bytes: int | None = None  # most bytes of a stage's final weights (max_bytes)
        self.out = Path(out) if out else None
        self.t0 = resume.t0 if resume is not None and resume.t0 else time.time()
        self.last_commit_t = time.time()
        # Seconds of committed work in no checkpoint (the time rule of ckpt_due). A coordinator
        # taking a run over does not know it: the first step it commits is checkpointed.
        self.unsaved_s = math.inf if resume is not None else 0.0
        self.written_steps: set[int] = set()
        self.names: dict[str, str] = {}  # member id -> name, kept after members leave
        self.history: list[dict] = []
        self.total_requeues = 0
        self.tasks_per_worker: dict[str, int] = {}
        self.peak_rss: dict[str, int] = {}  # member name -> the largest peak resident memory it reported (bytes)
        self.fixed_layers = False  # a resumed run keeps its layer ranges (its checkpoints hold them)
        self.resumed = False  # this coordinator took the run over from a journal
        self.banned_names: dict[str, str] = {}  # banned worker name -> why (journaled: kept across restarts)
        # A resumed run: stage -> name of the server that served it last (journal), kept for
        # that server until reserve_until, so a spare that joins first cannot take the stage.
        self.reserved: dict[int, str] = {}
        self.reserve_until = 0.0  # monotonic deadline of the reservations
        self.journaled_servers: list[str] = [""] * spec.stages  # newest `servers` journal record
        if resume is not None:
            self._take_over(resume)
        # Run-scoped files: OUT/runs/<run id>/..., linked from OUT (see shoal.runtime.safety.journal).
        self.run_dir = run_dir(self.out, spec.run_id) if self.out else None
        try:
            self.metrics = JsonlWriter(self.run_dir / "metrics.jsonl", self.t0,
                                       tensorboard=(options or {}).get("tensorboard")) if self.out else None
            self.events = JsonlWriter(self.run_dir / "events.jsonl", self.t0) if self.out else None
        except OSError as exc:
            raise ShoalError(f"cannot write the run folder {self.out}: {exc.strerror or exc}; "
                             f"give a writable --out") from None
        self.journal = None
        if self.out:
            try:
                self.secret = keep_secret(self.run_dir / "secret", self.secret, resume is not None)
                if not server_token:  # none given: the run's own, kept for --resume, read by its operator
                    self.server_token = keep_secret(self.run_dir / "server_token", self.server_token.encode(),
                                                    resume is not None).decode()
                self.journal = Journal(self.run_dir / JOURNAL)
                for name in LINKED:
                    point_link(self.out, name, spec.run_id)
                if resume is None:
                    self.journal.write("run", spec=json_format.MessageToDict(spec, preserving_proto_field_name=True),
                                       options=options or {}, t0=self.t0)
                else:
                    self.journal.write("resume", epoch=self.epoch, committed=self.committed, options=options or {})
            except OSError as exc:
                raise ShoalError(f"cannot write the run folder {self.out}: {exc.strerror or exc}; "
                                 f"give a writable --out") from None
        self.run_key = run_public_key(self.secret)  # sent to every member: checks credentials, makes none
        self.traffic: dict[str, tuple[str, list]] = {}  # process counter id -> (role, newest counts)
        self.gone: dict[str, tuple[Member, str, float]] = {}  # member id -> (member, why, wall time) once dropped
        self.recent: collections.deque = collections.deque(maxlen=500)  # newest events (dashboard)
        self.figures: dict[str, MemberFigures] = {}  # measured runs: member id -> what it measured
        self.unplaced: set[str] = set()  # workers told their memory holds no stage (said once each)
        # a replica plan file's placement: device id -> stage (the first assignment follows it)
        self.replica_workers: dict[str, int] = dict((options or {}).get("replica_workers") or {})
        self._profile = None  # the model's per-layer profile (stage memory needs), made on first use
        self.planned_on = None  # the scenario of the newest plan or repair
        self.guard_banned: dict[str, str] = {}  # member id -> why a stage server banned it (for the run)
        self.replan_why: list[str] = []  # membership changes since the last re-plan (put off: see replan_wait)
        self.replan_cost_s = 0.0  # CPU seconds the last re-plan took (the event loop's thread)
        self.replan_end = 0.0  # monotonic time it ended
        # Emulated runs: the scenario's device ids (a join names one).
        self.emulated_ids = frozenset(d.id for d in emulated.devices) if emulated is not None else frozenset()

    def _take_over(self, st) -> None:
        """Continue the run a journal describes (``st``: a :class:`~shoal.runtime.safety.journal.ResumeState`).

        The committed steps' records are kept; a new epoch fences off anything members
        still send for the old coordinator's epochs; once every stage has a server that
        reported its checkpoints, the run rolls back to the newest version all stages can
        restore (the usual roll-back), and the steps after it are run again.
        """
        if st.layers is not None:
            self.layers = list(st.layers)
            self.costs = [float(b - a) for a, b in self.layers]
            self.fixed_layers = True
        self.epoch = st.epoch + 1
        self.committed = st.committed
        self.banned_names = dict(st.bans)
        self.unverified_names = dict(st.unverified)
        if len(st.stage_servers) == self.spec.stages:
            self.journaled_servers = list(st.stage_servers)
            self.reserved = {k: n for k, n in enumerate(st.stage_servers) if n}
            self.reserve_until = time.monotonic() + resume_grace_s(self.spec.dead_after_s)
        self.scale_at.update(st.scale_at)
        # a standby promoted after this restart replays logged steps decided before it
        for (e, k), (lr, coef, skip, nls) in st.decisions.items():
            self.decisions[(e, k)] = pb.StepDecision(ready=True, lr=lr, coef=coef, skip=skip, next_loss_scale=nls,
                                                     checkpoint=(e, k) in st.checkpointed)
        for rec in st.records:
            self.written_steps.add(int(rec["step"]))
            self.history.append(rec)
            self.total_requeues += int(rec.get("requeues", 0))
            for w, n in rec.get("tasks_per_worker", {}).items():
                self.tasks_per_worker[w] = self.tasks_per_worker.get(w, 0) + n
        self.resumed = True
        log.info("resuming run %s: %d steps committed, epoch %d", self.spec.run_id, self.committed, self.epoch)

    def _journal(self, kind: str, **fields) -> None:
        """Append to the journal (no run folder: nothing); a write failure fails the run."""
        if self.journal is None:
            return
        try:
            self.journal.write(kind, **fields)
        except OSError as exc:
            if kind not in ("failed", "done"):
                self.fail(f"cannot write the coordinator journal {self.journal.path}: "
                          f"{exc.strerror or exc}; free space or give a writable --out")

    def event(self, name: str, **fields) -> None:
        log.info("event %s %s", name, fields)
        self.recent.append({"event": name, "time_s": round(time.time() - self.t0, 3), **fields})
        if self.events:
            self.events.event(name, **fields)

    # ------------------------------------------------------------------ membership
    async def Join(self, request, context):
        if request.schema and request.schema != 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"schema version {request.schema} not supported (want 1)")
        if request.role not in ("server", "worker"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be server or worker")
        if request.role == "server" and not server_token_ok(context, self.server_token):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "joining as a server needs the operator's server token (SHOAL_SERVER_TOKEN or "
                                "--server-token-file); the join token admits workers only")
        bad = join_numbers_error(request)
        if bad:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Join: {bad}")
        if self.emulated is not None and request.device not in self.emulated_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"this run emulates scenario {self.emulated.name}: join with "
                                f"--emulate-device set to one of its devices (got {request.device!r})")
        if self.done:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this run is {'failed' if self.error else 'finished'} "
                                f"({self.committed} of {self.spec.steps} steps committed); start a new run")
        if request.role == "server" and (why := data_refusal(self.spec.data, self.spec.data_hash,
                                                             request.data_hash)):
            self.event("refused", device=request.name or "server", role="server", why=why)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        banned = {**{self._name_of(mid): why for mid, why in self.guard_banned.items()}, **self.banned_names}
        if request.role == "worker" and (request.name or "worker") in banned:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"worker {request.name!r} is banned from this run: {banned[request.name or 'worker']}")
        name = unique_name(request.name or request.role,
                           {m.name for m in self.members.values()})
        if name != (request.name or request.role):
            log.warning("a second member named %r joined; it is called %r", request.name, name)
        mid = new_member_id(request.role, name)
        m = Member(mid, request.role, name, address=request.address,
                   flops=max(request.flops, 1.0), device=request.device, ckpt_stage=request.ckpt_stage,
                   standby=request.role == "server" and request.standby)
        if self.emulated is not None:
            self.plays[mid] = m.device
        elif request.will_measure and not self.fixed_layers:  # a resumed run's layers are fixed
            m.will_measure = True
            self.figures[mid] = MemberFigures(mid, request.role, flops=max(request.flops, 0.0),
                                              region=request.region, up=max(request.up_bps, 0.0),
                                              down=max(request.down_bps, 0.0))
        self.members[mid] = m
        self.names[mid] = m.name
        if m.role == "server":
            self.event("join", device=m.name, role="server")
            self._fill_vacancies()
        else:
            # FLOP/s only when the worker declared them (--flops); measured figures follow in `measured`.
            self.event("join", device=m.name, role="worker", **({"flops": request.flops} if request.flops > 0 else {}))
        self._ask_measure()
        if m.role == "worker" and self.ready:
            if self._settled(m):
                self._replan_soon("join")
            else:
                m.pending_join = True  # planned in once its measurement arrives
        self._check_ready()
        return pb.JoinReply(member_id=mid, spec=self.spec, role=m.role,
                            credential=member_credential(self.secret, mid, m.role), run_key=self.run_key)

    def _fill_vacancies(self) -> None:
        """Give each vacant stage a standby server (one without a stage), oldest first.

        A server taking over a stage after the run started restores that stage's newest
        checkpoint, and the whole run rolls back to a version every stage can restore.
        """
        started = self.ready or self.committed > 0 or self.epoch > 0
        # Hot standbys take a stage only once the run started (before, plain servers do).
        standby = [mid for mid, m in self.members.items()
                   if m.role == "server" and mid not in self.stage_server and (started or not m.standby)]
        hot = self._hot_standbys()
        reserved = self._reservations()
        for s in self._vacancy_order():
            if self.stage_server[s] or not standby:
                continue
            if s in reserved:
                # A resumed run: the server that served this stage holds its newest state.
                mid = next((c for c in standby if self.members[c].name == reserved[s]), None)
                if mid is None:
                    continue  # not joined again yet: wait for it (until the reservation ends)
                del self.reserved[s]
            else:
                free = [c for c in standby if self.members[c].name not in reserved.values()]
                copier = next((h for h, hs in hot.items() if hs == s and h in free), None)
                # The server holding the stage's newest checkpoint goes first, then the hot
                # standby that copies it (no deep roll-back), then any other.
                mid = pick_holder(s, [(c, self.members[c].held) for c in free], copier) or copier or pick_standby(
                    s, [(c, self.members[c].ckpt_stage) for c in free],
                    {k for k, v in enumerate(self.stage_server) if not v})
            if mid is None:
                continue
            standby.remove(mid)
            self.stage_server[s] = mid
            self.event("assign", device=self.members[mid].name, role="server", stage=s)
            if self.ready or self.committed > 0 or self.epoch > 0:
                self.pending_restore = True
                self.event("server_restart", device=self.members[mid].name, stage=s)
        self._journal_servers()

    def _reservations(self) -> dict[int, str]:
        """Stages kept for the server that served them before a coordinator restart; ended
        once it is back or after the grace (then the best holder among the others takes it)."""
        if not self.reserved:
            return {}
        if time.monotonic() < self.reserve_until:
            return dict(self.reserved)
        late = {k: n for k, n in self.reserved.items() if not self.stage_server[k]}
        self.reserved = {}
        if late:
            log.warning("server(s) %s did not join again; their stages go to the servers holding "
                        "the newest checkpoints", late)
            self.event("resume_servers_missing", stages={str(k): n for k, n in late.items()})
        return {}

    def _journal_servers(self) -> None:
        """Journal the server of each stage on a change (a vacant stage keeps its last server:
        that one holds the stage's newest state if it comes back)."""
        names = [self.members[sid].name if sid in self.members else old
                 for sid, old in zip(self.stage_server, self.journaled_servers, strict=True)]
        if names != self.journaled_servers:
            self.journaled_servers = names
            self._journal("servers", names=names, epoch=self.epoch)

    def _name_of(self, mid: str) -> str:
        """A member's name, also for an id a previous coordinator gave (``w9-w6``: ``w6``)."""
        if mid in self.names:
            return self.names[mid]
        parts = mid.split("-", 2)  # w-<random hex>-NAME
        if len(parts) == 3 and parts[0] in ("s", "w") and len(parts[1]) == 12:
            return parts[2]
        head, sep, name = mid.partition("-")  # an older coordinator's w9-NAME
        return name if sep and head[1:].isdigit() else mid

    def _hot_standbys(self) -> dict[str, int]:
        """Servers without a stage -> the stage whose checkpoints each copies.

        Hot standbys, and once the run started also spare plain servers (a standby promoted
        earlier leaves its stage without a copier otherwise). A spare's folder may be shared
        with active servers (it then holds their files already), so only a standby's own
        copies keep it on a stage.
        """
        started = self.ready or self.committed > 0 or self.epoch > 0
        mids = [mid for mid, m in self.members.items()
                if m.role == "server" and (m.standby or started) and mid not in self.stage_server]
        active = [self._host_of(self.members[sid]) if sid in self.members else "" for sid in self.stage_server]
        held = {mid: self.members[mid].held for mid in mids if self.members[mid].standby}
        # Emulated runs with a plan: the planner's placement for standbys holding no copies yet.
        placed = self._planned_standbys([mid for mid in mids if not any(
            0 <= k < self.spec.stages and v > 0 for k, v in held.get(mid, {}).items())])
        out = standby_stages([mid for mid in mids if mid not in placed], self.spec.stages, held,
                             hosts={mid: self._host_of(self.members[mid]) for mid in mids}, active_hosts=active)
        out.update(placed)
        return {mid: out[mid] for mid in mids}

    def _planned_standbys(self, mids: list[str]) -> dict[str, int]:
        """The planner's placement of hot standbys ``mids`` where the run has a plan on an
        emulated scenario (:func:`shoal.runtime.safety.standby.planned_standby_stages`; memoised)."""
        if self.emulated is None or self.plan is None or not mids or not all(self.stage_server) \
                or len(self.plan.stages) != len(self.layers):
            return {}
        actives = [self.members[sid].device if sid in self.members else "" for sid in self.stage_server]
        hosts = {mid: self.members[mid].device for mid in mids}
        key = (tuple(mids), tuple(actives), tuple(hosts.values()))
        memo = getattr(self, "_standby_memo", None)
        if memo is not None and memo[0] == key:
            return dict(memo[1])
        placed: dict[str, int] = {}
        if all(actives):
            from dataclasses import replace

            from shoal.model.profile import profile_model

            plan = replace(self.plan, stages=[replace(st, server=h, layers=tuple(self.layers[k]), standbys=[])
                                              for k, (st, h) in enumerate(zip(self.plan.stages, actives, strict=True))])
            prof = profile_model(self.cfg, self.spec.seq_len, self.spec.micro_batch_size, 4)
            placed = planned_standby_stages(mids, hosts, plan, self.emulated, prof)
        self._standby_memo = (key, placed)
        return dict(placed)

    @staticmethod
    def _host_of(m: Member) -> str:
        """The machine a member runs on: the scenario host it plays, else its address's host."""
        return m.device or m.address.rpartition(":")[0]

    def _vacancy_order(self) -> list[int]:
        """Stages in the order vacancies are filled: twice over, so a standby that waited for
        its old stage (filled meanwhile by another) still gets a stage left before it."""
        return [*range(self.spec.stages), *range(self.spec.stages)]

    # ------------------------------------------------------------------ measurement
    def _settled(self, m: Member) -> bool:
        """Whether member ``m`` can be planned: measured, not measuring, or given up on."""
        if not m.will_measure or m.measured_at is not None:
            return True
        return m.measure_req > 0 and time.monotonic() - m.asked_at > MEASURE_TIMEOUT_S

    def _ask_measure(self) -> None:
        """Ask members that never measured to do so, once every stage has a server to probe:
        one member at a time (in join order), so no two members' probes share a link and
        each measures the path alone; a member that does not answer holds the next ones for
        at most MEASURE_TIMEOUT_S."""
        if self.emulated is not None or not all(self.stage_server):
            return
        together = one_machine([self.members[s].address for s in self.stage_server if s in self.members])
        if not together and any(m.will_measure and m.measure_req > m.measure_done and not self._settled(m)
                                for m in self.members.values()):
            return  # a measurement is under way
        for m in self.members.values():
            if m.will_measure and m.measure_req == 0:
                m.measure_req, m.asked_at = 1, time.monotonic()
                if not together:
                    return

    def _path_target(self, target: str) -> str | None:
        """The node a probe went to: the coordinator, or the server member at that address."""
        if target == COORDINATOR_NODE:
            return COORDINATOR_NODE
        for mid, m in self.members.items():
            if m.role == "server" and m.address == target:
                return mid
        return None

    async def Measured(self, request, context):
        await check_caller(context, request.member_id)
        why = bad_number(request)
        if why:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Measured: {why}")
        m = self.members.get(request.member_id)
        f = self.figures.get(request.member_id)
        if m is None or f is None:
            return pb.Empty()
        f.kind = request.device_name or f.kind
        f.memory = request.memory if request.memory > 0 else f.memory
        if request.flops > 0:
            f.flops = request.flops
            m.flops = request.flops
        paths, how = [], {}
        for link in request.links:
            dst = self._path_target(link.target)
            if dst is not None and dst != m.member_id:
                # A same-host path has no measured rates: it is loopback, at loopback's rate.
                up, down = ((LOOPBACK_LINK.bandwidth,) * 2 if link.same_host else (link.up_bps, link.down_bps))
                paths.append(PathFigures(m.member_id, dst, link.rtt_s, up, down, link.same_host))
                how[dst] = link.method
        f.paths = paths
        missing = missing_servers({self.members[s].address: self.members[s].name for s in self.stage_server
                                   if s and s != m.member_id and s in self.members},
                                  [link.target for link in request.links])
        if missing and m.measure_gaps < MEASURE_GAP_RETRIES:
            # Every member probes every stage server before it is placed: ask again.
            m.measure_gaps += 1
            m.measure_req += 1
            m.asked_at = time.monotonic()
            self.event("remeasure", device=m.name, why=f"no link figures to {', '.join(missing)}")
            return pb.Empty()
        m.measure_gaps = 0
        again = m.measured_at is not None
        m.measured_at, m.measure_done = time.monotonic(), max(m.measure_done, request.request)
        if m.role == "worker" and not self.check_noted:
            note = server_check_note(sync_of_spec(self.spec).local, self.spec.guard_spot_check,
                                     run_precision(self.spec), f.kind)
            if note:
                self.check_noted = True  # once a run: every GPU worker would say the same
                log.warning("%s", note)
                self.event("notice", why=note)
        self.event("measured", device=m.name, role=m.role, kind=f.kind, flops=f.flops, memory=f.memory,
                   seconds=round(request.measure_s, 3),
                   links={(self.names.get(p.dst, p.dst)): {"rtt_ms": round(p.rtt_s * 1e3, 3),
                                                           "up_mbps": round(p.up * 8 / 1e6, 2),
                                                           "down_mbps": round(p.down * 8 / 1e6, 2),
                                                           **({"same_host": True} if p.same_host else
                                                              {"timed_by": how.get(p.dst, "")})}
                          for p in paths},
                   **({"missing": missing} if missing else {}))
        self._after_measure(m, again)
        self._ask_measure()  # the next member's turn
        return pb.Empty()

    def _after_measure(self, m: Member, again: bool) -> None:
        """Plan a member in once it is settled: the start, a late join, or a re-measurement."""
        if not self.ready:
            self._check_ready()
        elif m.pending_join:
            m.pending_join = False
            self._replan_soon("join")
        elif again and m.role == "worker" and m.member_id in self.planned:
            self._replan_soon("remeasure")

    def _check_drift(self, m: Member, r) -> None:
        """Ask worker ``m`` to measure again when its observed figures left the planned ones."""
        if (not self.ready or m.role != "worker" or not m.will_measure or m.measured_at is None
                or m.measure_req > m.measure_done
                or time.monotonic() - m.measured_at < REMEASURE_AFTER_S):
            return
        f = self.figures.get(m.member_id)
        why = None
        if f is not None and drifted(f.flops, r.observed_flops, r.observed_tasks):
            why = f"task FLOP/s {r.observed_flops:.3g} vs {f.flops:.3g} planned"
        elif r.observed_pulls and self.planned_on is not None:
            planned = self._planned_pull_s(m.member_id, r.observed_pull_bytes)
            if planned is not None and drifted(planned, r.observed_pull_s, r.observed_pulls):
                why = f"weight pull {r.observed_pull_s:.3g} s vs {planned:.3g} s planned"
        if why is not None:
            m.measure_req += 1
            m.asked_at = time.monotonic()
            self.event("remeasure", device=m.name, why=why)

    def _planned_pull_s(self, mid: str, nbytes: int) -> float | None:
        """Seconds the plan expects a weight pull of ``nbytes`` by ``mid`` to take."""
        stage = self.assign.get(mid, -1)
        if stage < 0 or not self.stage_server[stage]:
            return None
        devs = {d.id: d for d in self.planned_on.devices}
        w, h = devs.get(mid), devs.get(self.stage_server[stage])
        if w is None or h is None:
            return None
        link = self.planned_on.network.link(w, h)
        return link.latency + nbytes / min(link.bandwidth, w.down, h.up)

    async def Probe(self, request, context):
        return probe_reply(request, context.peer())

    def _check_ready(self) -> None:
        if self.ready:
            return
        workers = [m for m in self.members.values() if m.role == "worker"]
        if not all(self._settled(m) for m in self.members.values()):
            return  # plan on what every member measured
        if not self.ready and all(self.stage_server) and len(workers) >= self._worker_gate():
            self._initial_plan()
            self.ready = True
            self.last_commit_t = time.time()  # step 0's time starts when the swarm is complete

    def _worker_gate(self) -> int:
        """Workers to wait for before the first plan: ``--min-workers`` at a run's start; one
        per stage for a resumed run, whose workers may have died or been banned since the
        start (the rest join later and are planned in by repair)."""
        if self.resumed:
            return self.spec.stages
        return max(self.min_workers, self.spec.stages)

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
                            micro_batch_size=self.spec.micro_batch_size, dtype_bytes=4,
                            config=model_config(self.spec) if self.spec.model_config_json else None)
        # The members now and the devices of the plan being repaired (every member ever would
        # make each repair slower with every death and re-join).
        keep = self.planned | set(self.members)
        devices = {mid: d for mid, d in self.devices.items() if mid in keep}
        if self.emulated is None and self.figures:
            figs = {}
            for mid, d in devices.items():
                figs[mid] = self.figures.get(mid) or MemberFigures(
                    mid, "server" if d.can_host_server else "worker", kind="unmeasured", flops=d.flops)
            return measured_scenario(figs, workload)
        return planning_scenario(devices, workload, self.emulated, {m: d for m, d in self.plays.items() if m in keep})

    def _planned(self, scenario) -> None:
        """Keep the scenario a plan was made on and write it to the run folder (scenario.json)."""
        self.planned_on = scenario
        if self.out:
            from shoal.plan.scenario import scenario_to_dict

            try:
                tmp = self.out / "scenario.json.tmp"
                tmp.write_text(json.dumps(scenario_to_dict(scenario), indent=2) + "\n")
                tmp.replace(self.out / "scenario.json")
            except (OSError, KeyError, ValueError) as exc:
                log.warning("could not write scenario.json: %s", exc)

    def _initial_plan(self) -> None:
        """Plan the devices that actually joined: layer ranges, stage servers, workers."""
        for m in self.members.values():
            self.devices[m.member_id] = self._device(m)
        if self.fixed_layers:
            # A resumed run: the checkpoints hold these layer ranges, so only workers move.
            self.plan = None
            self._replan("resume", method="journal layers")
            return
        if self.slots is not None:
            # A replica plan: layers fixed by --replicas; workers kept to regions per replica, and
            # each replica's stage servers moved to hosts of its region where there are such.
            self.plan = None
            self._journal("plan", layers=[list(x) for x in self.layers], method="replicas", epoch=self.epoch)
            live = {mid: m for mid, m in self.members.items() if m.role == "worker" and not m.pending_join}
            regions = {mid: self._region_of(m) for mid, m in self.members.items()}
            fits = self._memory_fits(set(live))
            # A plan file's placement first, where memory allows: by the device a member plays
            # (emulated runs), else by its name (--name: a real host named as in the scenario).
            self.assign = planned_assignment(self.replica_workers,
                                             {mid: m.device or m.name for mid, m in live.items()},
                                             len(self.slots), fits)
            # (the assignment the re-plan below makes: the same rule on the same members)
            first = assign_replica_workers({mid: m.flops for mid, m in live.items()}, regions, self.slots,
                                           dict(self.assign), homes=list(self.spec.replica_regions), fits=fits)
            want = replica_regions(first, regions, self.slots)
            placed = place_replica_servers(list(self.stage_server), regions, [want[s.replica] for s in self.slots])
            if placed != self.stage_server:
                for k, (was, now) in enumerate(zip(self.stage_server, placed, strict=True)):
                    if was != now:
                        self.event("assign", device=self.members[now].name, role="server", stage=k)
                self.stage_server = placed
                self._journal_servers()
            self._replan("start", method="replicas")
            return
        try:
            from shoal.plan import make_plan
            from shoal.runtime.roles.planning import spec_sync_policy

            scenario = self._scenario()
            # priced as the run runs: its mode, H, codecs and pushes (spec_sync_policy)
            plan = make_plan(scenario, method="shoal", seed=int(self.spec.seed),
                             stages=self.spec.stages, sync=spec_sync_policy(self.spec))
            # Hot standbys stay out of the first assignment: they copy a stage until promoted.
            servers = sorted((mid for mid, m in self.members.items() if m.role == "server" and not m.standby),
                             key=lambda mid: (-self._server_rate(scenario, mid), mid))
            # A stage planned on a hot standby moves to a free plain server (as a repeat does).
            stage_server = distinct_servers([st.server if st.server in servers or not servers else servers[0]
                                             for st in plan.stages], servers)
            if len(set(stage_server)) < len(stage_server):
                raise ValueError("the plan puts two stages on one server process and no standby is free")
            for st, sid in zip(plan.stages, stage_server, strict=True):
                st.server = sid
            self._planned(scenario)
            self.layers = [tuple(st.layers) for st in plan.stages]
            for k, (was, now) in enumerate(zip(self.stage_server, stage_server, strict=True)):
                if was != now:  # the plan moved a stage to another server: say so, like a join does
                    self.event("assign", device=self.members[now].name, role="server", stage=k)
            self.stage_server = stage_server
            self._journal_servers()
            self.assign = {w: i for i, st in enumerate(plan.stages) for w in st.workers}
            self.plan, self.planned = plan, set(self.devices)
            method = "shoal"
        except Exception as exc:  # the even split always works; say why the planner did not
            log.warning("planner failed (%s); using an even split", exc)
            self.plan, method = None, f"even split ({exc})"
        self.costs = [float(b - a) for a, b in self.layers]
        self._journal("plan", layers=[list(x) for x in self.layers], method=method, epoch=self.epoch)
        self._replan("start", method=method)

    @staticmethod
    def _server_rate(scenario, mid: str) -> float:
        """The slower of a server's up/down rates in ``scenario`` (standbys are picked fastest first)."""
        d = next((d for d in scenario.devices if d.id == mid), None)
        return min(d.up, d.down) if d is not None else 0.0

    def _replan(self, why: str, method: str | None = None, changes: int = 1) -> None:
        """Repair the worker->stage assignment after a join, leave or re-measurement (layers stay fixed).

        After a re-measurement the repair's local search runs on the scenario with the
        worker's new figures. ``changes``: membership changes it answers (several when a
        re-plan was put off, see :meth:`_replan_soon`).
        """
        live = {mid for mid, m in self.members.items() if m.role == "worker" and not m.pending_join}
        before = dict(self.assign)  # what the workers run now: the event reports a change to it
        if method is None and self.plan is not None:
            for mid in live:
                if mid not in self.devices:
                    self.devices[mid] = self._device(self.members[mid])
            try:
                from shoal.plan.repair import repair

                scenario = self._scenario()  # a re-measured worker: its new figures
                servers = {mid for mid, m in self.members.items() if m.role == "server"}
                gone = [d for d in self.planned if d not in live and d not in servers]
                joined = [d for d in live if d not in self.planned]
                # The servers hold fixed layer ranges: a repair may move workers, never merge stages.
                plan = repair(self.plan, scenario, left=gone, joined=joined,
                              seed=int(self.spec.seed), keep_stages=True)
                if len(plan.stages) != self.spec.stages:
                    raise ValueError(f"repair changed the stage count to {len(plan.stages)}")
                # the plan no longer holds the members that left
                self.plan, self.planned = plan, (self.planned - set(gone)) | set(joined)
                self._planned(scenario)
                self.assign = {w: i for i, st in enumerate(plan.stages) for w in st.workers
                               if w in live}
                method = "repair"
            except ShoalError as exc:
                # A swarm the plan cannot fit (fewer workers than stages): a designed fallback.
                log.info("plan repair found no plan (%s); balancing by capacity", exc)
                method = f"balance ({exc})"
            except Exception as exc:
                log.warning("plan repair failed (%s); balancing by capacity", exc)
                method = f"balance ({exc})"
        flops = {mid: self.members[mid].flops for mid in live}
        fits = self._memory_fits(live)
        # Workers the plan left out still help: in a task pool an extra worker only takes
        # tasks when it is free, so it is placed where capacity per unit of work is lowest
        # (among the stages its memory holds).
        if self.slots is not None:
            # A replica plan: whole regions to replicas, so activations stay inside a region.
            regions = {mid: self._region_of(self.members[mid]) for mid in live}
            # A plan file places joiners too: a member no stage holds yet whose device it names
            # goes where the planner put that device (a worker that comes back: where it was).
            joiners = {mid: self.members[mid].device or self.members[mid].name for mid in live if mid not in self.assign}
            current = {**planned_assignment(self.replica_workers, joiners, len(self.slots), fits), **self.assign}
            new = assign_replica_workers(flops, regions, self.slots, current, homes=list(self.spec.replica_regions),
                                         fits=fits)
        else:
            new = assign_workers(flops, self.costs, self.assign, fits)
        changed = new != before or why == "start"
        self.assign = new
        if changed:
            self.event("replan", why=why, method=method or "balance", **({"changes": changes} if changes > 1 else {}),
                       **({"replicas": {"stages": list(self.spec.replica_stages),
                                        "micro_batches": list(self.spec.replica_mbs)}} if self.slots is not None else {}),
                       layers=[list(x) for x in self.layers],
                       assignment={self.members[w].name: s for w, s in new.items()})
        empty = [s for s in range(self.spec.stages) if s not in new.values()]
        if empty:
            # Nothing to take a worker from (every other stage has one): wait for a join.
            self.event("waiting", stages_without_workers=empty, workers=len(live))

    def _memory_fits(self, live: set[str]) -> dict[str, list[int]]:
        """The stages each live worker's memory holds: the scenario device it plays (emulated
        runs) or the memory it measured (any stage when it reported none). Says once per worker
        when none does."""
        memory = {}
        for mid in live:
            if self.emulated is not None:
                d = self.devices.get(mid) or self._device(self.members[mid])
                memory[mid] = d.memory
            elif mid in self.figures:
                memory[mid] = self.figures[mid].memory
        if self._profile is None:
            self._profile = profile_model(self.cfg, self.spec.seq_len, self.spec.micro_batch_size, 4)
        prof, sync = self._profile, sync_of_spec(self.spec)
        local, lean = sync.local, sync.local and sync.lean
        fits = memory_fits(memory, self.layers, prof, local, lean)
        for mid, stages in sorted(fits.items()):
            if not stages and mid not in self.unplaced:
                self.unplaced.add(mid)
                why = unplaced_reason(memory[mid], self.layers, prof, local, lean)
                log.warning("%s: %s", self.members[mid].name, why)
                self.event("unplaced", device=self.members[mid].name, why=why)
        return fits

    def _region_of(self, m: Member) -> str:
        """A member's network region: the scenario device's it plays (emulated runs), else the one
        it declared or was clustered into when measured, else loopback's."""
        if self.emulated is not None:
            return self._device(m).region
        f = self.figures.get(m.member_id)
        return (f.region if f is not None and f.region else "") or LOOPBACK_REGION

    def _replan_soon(self, why: str) -> None:
        """Re-plan for a membership change: now, or once :func:`replan_wait` allows (the reaper
        looks every tick). A stage left without a worker is repaired at once."""
        self.replan_why.append(why)
        self._replan_flush(urgent=stage_without_worker(self.assign, self.spec.stages))

    def _replan_flush(self, urgent: bool = False) -> None:
        """Run the re-plan the membership changes since the last one call for, when due."""
        if not self.replan_why or not self.ready:
            return
        if not urgent and replan_wait(time.monotonic(), self.replan_end, self.replan_cost_s) > 0:
            return
        whys = list(dict.fromkeys(self.replan_why))
        changes, self.replan_why = len(self.replan_why), []
        # Its CPU, not its wall time: on a starved host the wall time would put re-plans off longer.
        t0 = time.thread_time()
        self._replan(", ".join(whys), changes=changes)
        self.replan_cost_s = time.thread_time() - t0
        self.replan_end = time.monotonic()

    def _stage_of(self, m: Member) -> int:
        if not self.ready:
            return -1  # stages are fixed by the plan made when the run starts
        if m.role == "server":
            return self.stage_server.index(m.member_id) if m.member_id in self.stage_server else -1
        return self.assign.get(m.member_id, -1) if self.ready else -1

    def _servers(self) -> list[str]:
        return [self.members[sid].address if sid in self.members else "" for sid in self.stage_server]

    async def Heartbeat(self, request, context):
        await check_caller(context, request.member_id)
        why = bad_number(request)
        if why:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Heartbeat: {why}")
        if request.counter_id:
            # Cumulative per process: the newest snapshot replaces the older one, and one
            # that outlives its member (killed, or re-joined under a new id) still counts.
            self.traffic[request.counter_id] = (request.role or "?", list(request.traffic))
        if request.member_id in self.guard_banned:
            # Not "unknown" (that would make it join again): told it is banned, it exits.
            return pb.Assignment(known=True, done=True, guard_banned=self.guard_banned[request.member_id])
        m = self.members.get(request.member_id)
        if m is None:
            gone = self.gone.get(request.member_id)
            return pb.Assignment(known=False, done=self.done, forgotten=gone[0].death if gone else "")
        m.last_seen = time.monotonic()
        m.last_sign = "heartbeat"
        m.doing = request.doing
        m.counter_id = request.counter_id or m.counter_id
        if m.role == "server":
            self._heard_via(m, request.alive)
        if request.HasField("stats"):
            m.stats = pb.MemberStats()
            m.stats.CopyFrom(request.stats)
            if request.stats.peak_rss > self.peak_rss.get(m.name, 0):
                self.peak_rss[m.name] = request.stats.peak_rss
        if request.fatal:
            self.fail(request.fatal)
        if m.role == "server":
            m.ckpt_versions = list(request.ckpt_versions)
            if request.epoch == self.epoch and not self.pending_restore:  # not a record the roll-back dropped
                for u in request.guard_unverified:
                    self.unverified[u.worker] = min(int(u.step), self.unverified.get(u.worker, int(u.step)))
        for ban in request.guard_bans:
            self._guard_ban(ban, m)
        if m.role == "server":
            m.version, m.ckpt_version, m.epoch = request.version, request.ckpt_version, request.epoch
            held = {h.stage: h.version for h in request.standby_held}
            if held != m.held:
                m.held = held
                if m.member_id not in self.stage_server and not all(self.stage_server):
                    self._fill_vacancies()  # it may hold a vacant stage's newest checkpoint
            if (not self.pending_restore and m.epoch == self.epoch and m.version < 0
                    and 0 <= m.ckpt_version < self.restart_version and m.member_id in self.stage_server):
                # It cannot restore the roll-back target (a checkpoint failed its checks):
                # roll back again, to a version every stage can restore.
                self.event("checkpoint_fallback", device=m.name, stage=self.stage_server.index(m.member_id),
                           wanted=self.restart_version, has=m.ckpt_version)
                self.pending_restore = True
            self._maybe_restore()
        stage = self._stage_of(m)
        self._check_drift(m, request)
        m.told_done = m.told_done or self.done
        a = pb.Assignment(known=True, stage=stage, servers=self._servers(),
                          ready=self.ready and not self.pending_restore, epoch=self.epoch,
                          restart_version=self.restart_version, done=self.done, measure=m.measure_req,
                          beat_floor_s=beat_floor_s(len(self.members), self.spec.dead_after_s))
        if m.role == "server" and stage >= 0:
            a.send_final = asks_final(self.committed, self.spec.steps, self.done,
                                      self._final_of(m.member_id) is not None)
        if stage >= 0:
            a.first, a.last = self.layers[stage]
            if m.role == "server" and self.slots is not None:
                a.server_ids.extend(self.stage_server)  # replica parts are taken only from these
            if m.role == "server":
                a.standby_peers.extend(self._standby_peers(stage))
                keep = keep_version([self.unverified, self.unverified_names],
                                    set(self.guard_banned) | set(self.banned_names))
                a.guard_keep = 0 if keep is None else keep + 1
            elif m.stats is not None and m.stats.stage != stage:  # a move under way: look at the others
                a.move_now = move_is_urgent(stage, m.member_id, self._stages_at_work())
        elif m.role == "server" and self.layers:
            shadow = self._hot_standbys().get(m.member_id, -1)
            if shadow >= 0 and self.stage_server[shadow]:
                a.standby_for = shadow + 1
                a.standby_first, a.standby_last = self.layers[shadow]
                a.standby_source = self.stage_server[shadow]
        if request.standby_decisions_from > 0:
            # A standby's step log: the decisions it replays if promoted (shoal.runtime.safety.standby).
            a.standby_decisions.extend(decisions_since(self.decisions, self.epoch, self.committed,
                                                       request.standby_decisions_from - 1))
        return a

    def _final_of(self, member_id: str) -> pb.WeightsReply | None:
        """The final weights ``member_id`` sent, if they are of this epoch's last version."""
        rep = self.final_in.get(member_id)
        ok = rep is not None and rep.epoch == self.epoch and rep.version >= self.spec.steps
        return rep if ok else None

    def max_bytes(self, what: str = "grads") -> int:
        """Request sizes the coordinator resolves (:data:`shoal.net.auth.GRADS`): a stage's final
        weights are at most the whole model's float32 weights and a message's slack (no stage
        holds more than the whole model)."""
        if self._final_bytes is None:
            prof = profile_model(self.cfg, self.spec.seq_len, self.spec.micro_batch_size, 4)
            self._final_bytes = 4 * prof.params(0, self.cfg.n_total_layers) + 512 * 4096 + CONTROL_SLACK
        return self._final_bytes

    async def FinalWeights(self, request_iterator, context):
        member = caller(context)[0] if context is not None else ""
        self.final_receiving.add(member)
        try:
            rep = await receive(request_iterator, pb.WeightsReply, self.max_bytes(), frames_field=WEIGHT_FRAMES)
        except WireError as exc:
            log.warning("refused the final weights of %s: %s", self._name_of(member), exc)
            return pb.FinalWeightsReply(accepted=False, reason=f"rejected: {exc}")
        finally:
            self.final_receiving.discard(member)
            self.final_signal.notify_all()
        m = self.members.get(member)
        stage = self._stage_of(m) if m is not None and m.role == "server" else -1
        why = final_refusal(stage, list(self.layers[stage]) if stage >= 0 else None, [rep.first, rep.last],
                            rep.epoch, self.epoch, rep.version, self.spec.steps)
        if why:
            return pb.FinalWeightsReply(accepted=False, reason=why)
        self.final_in[member] = rep
        self.final_signal.notify_all()
        return pb.FinalWeightsReply(accepted=True)

    def _stages_at_work(self) -> dict[str, int]:
        """Each live worker's stage as it last reported it (where it works, not where it is
        assigned: a worker in local mode holds a move until its round's end)."""
        return {mid: mm.stats.stage for mid, mm in self.members.items()
                if mm.role == "worker" and mm.stats is not None}

    def _standby_peers(self, stage: int) -> list[str]:
        """Addresses of the hot standbys copying ``stage`` (its active server sends them each step)."""
        return [self.members[mid].address for mid, k in self._hot_standbys().items()
                if k == stage and self.members[mid].address]

    def _guard_ban(self, ban: pb.GuardBan, server: Member) -> None:
        """A stage server banned a worker: drop it for the run, refuse it, re-plan without it."""
        if ban.worker in self.guard_banned:
            return
        self.guard_banned[ban.worker] = ban.reason
        name = self._name_of(ban.worker)
        if name in self.banned_names and ban.worker not in self.members:
            return  # a server re-reporting a ban to a restarted coordinator: journaled already
        if name not in self.banned_names:
            # Journaled by name: a restarted or resumed coordinator refuses it too.
            self.banned_names[name] = ban.reason
            self._journal("ban", name=name, member=ban.worker, why=ban.reason, stage=ban.stage, step=ban.step,
                          epoch=self.epoch)
        log.error("worker %s banned by %s (stage %d, step %d): %s", name, server.name, ban.stage, ban.step,
                  ban.reason)
        self.event("ban", device=name, role="worker", stage=ban.stage, step=ban.step, by=server.name,
                   why=ban.reason)
        self._undo(ban, name)
        m = self.members.pop(ban.worker, None)
        if m is not None:
            self._drop(m, "banned")

    def _undo(self, ban: pb.GuardBan, name: str) -> None:
        """Roll the whole run back past the banned worker's unverified pushes (docs/poisoning-undo.md,
        "A ban undoes its work"): to the newest version none of them reached, at every stage,
        since later steps of every stage were computed from the weights they changed."""
        firsts = [ban.undo_from - 1] if ban.undo_from > 0 else []
        firsts += [self.unverified[ban.worker]] if ban.worker in self.unverified else []
        # under its name too: pushes it made under an earlier member id, before a restart
        firsts += [self.unverified_names[name]] if name in self.unverified_names else []
        cap = ban_undo_cap(firsts, self.committed)
        if cap is None:
            return  # every committed push of it was recomputed: nothing to undo
        self.undo_cap = cap if self.undo_cap is None else min(self.undo_cap, cap)
        log.error("undoing worker %s's unverified pushes: every stage rolls back to v%d at most (committed: %d)",
                  name, self.undo_cap, self.committed)
        self.event("undo", device=name, version=self.undo_cap, committed=self.committed)
        self.pending_restore = True

    def _maybe_restore(self) -> None:
        """Once every stage has a server that reported its checkpoints, roll back."""
        if not self.pending_restore or not all(self.stage_server):
            return
        servers = [self.members[sid] for sid in self.stage_server]
        if any(s.ckpt_version < 0 for s in servers):
            return
        target = min(s.ckpt_version for s in servers)
        undo = self.undo_cap is not None
        if undo:
            target = min(target, undo_target(self.undo_cap, [s.ckpt_versions for s in servers]))
            self.undo_cap = None
            # The undone steps are committed again: their records are the redone ones.
            self.written_steps = {k for k in self.written_steps if k < target}
            self.history = [r for r in self.history if int(r["step"]) < target]
        self.epoch += 1
        self.restart_version = target
        self.pending_restore = False
        self.reports.clear()
        self.unverified = {w: s for w, s in self.unverified.items() if s < target}  # later steps are redone
        self.unverified_names = {w: s for w, s in self.unverified_names.items() if s < target}
        self._journal("epoch", epoch=self.epoch, version=target, **({"undo": True} if undo else {}))
        self.event("rollback", epoch=self.epoch, version=target, committed=self.committed,
                   **({"why": "undo"} if undo else {}))
        self.committed = target
        self.last_commit_t = time.time()
        self.unsaved_s = 0.0  # every stage restarts from a checkpoint
        if self.committed >= self.spec.steps:
            # A coordinator resumed after the last commit: only the final weights are left.
            self._spawn_finish()

    async def Leave(self, request, context):
        await check_caller(context, request.member_id)
        m = self.members.pop(request.member_id, None)
        if m:
            self._drop(m, "leave", reason=request.leave_reason[:500])
        return pb.Empty()

    def _heard_via(self, server: Member, alive) -> None:
        """Workers a stage server heard from since its last heartbeat are alive: traffic on a
        member's channels is a sign of life (a worker deep in a long push may miss beats here)."""
        now = time.monotonic()
        for wid in alive:
            w = self.members.get(wid)
            if w is not None and w.role == "worker":
                w.last_seen = now
                w.last_sign = f"traffic at server {server.name}"

    def _drop(self, m: Member, why: str, reason: str = "", **detail) -> None:
        """Remove member ``m``: ``why`` the kind of end, ``reason`` the member's own one line
        (a Leave on an error), ``detail`` what the coordinator saw (a silent member)."""
        m.death = death_line(m.name, why, detail) + (f": {reason}" if reason else "")
        self.gone[m.member_id] = (m, f"{why}: {reason}" if reason else why, time.time())
        self.event("leave", device=m.name, role=m.role, why=why, stage=self._stage_of_dropped(m), **detail,
                   **({"reason": reason} if reason else {}))
        if m.role == "server":
            for s, sid in enumerate(self.stage_server):
                if sid == m.member_id:
                    self.stage_server[s] = ""
            self._fill_vacancies()
        else:
            self.assign.pop(m.member_id, None)
            if self.ready:
                self._replan_soon(why)
        if not self.ready:
            # The start may have been waiting for this member's measurement alone.
            self._check_ready()

    def _stage_of_dropped(self, m: Member) -> int:
        if m.role == "server":
            return self.stage_server.index(m.member_id) if m.member_id in self.stage_server else -1
        return self.assign.get(m.member_id, -1)

    def fail(self, why: str) -> None:
        """Fail the run with a one-line reason: members see ``done`` and exit."""
        if self.error or self.done:
            return
        self.error = why.splitlines()[0] if why else "unknown failure"
        log.error("the run failed: %s", self.error)
        self.event("failed", why=self.error, committed=self.committed)
        self._journal("failed", why=self.error, epoch=self.epoch)
        self.done = True
        # Long enough for the members' heartbeats to see "done".
        asyncio.get_running_loop().call_later(max(1.0, 3 * 0.2), self.finished.set)

    def waiting_for(self) -> list[str]:
        """What keeps the run from making progress now (empty: nothing)."""
        why = []
        vacant = [s for s, sid in enumerate(self.stage_server) if not sid or sid not in self.members]
        waits = {k: n for k, n in self.reserved.items() if k in vacant}
        if waits:
            left = max(0.0, self.reserve_until - time.monotonic())
            why.append(f"stage(s) {sorted(waits)} wait up to {left:.0f} s for their server(s) "
                       f"{sorted(set(waits.values()))} to join again (they hold the newest checkpoints)")
        elif vacant:
            why.append(f"stage(s) {vacant} have no server: start `shoal server --join`")
        workers = sum(1 for m in self.members.values() if m.role == "worker")
        need = self._worker_gate()
        if not self.ready:
            if workers < need:
                why.append(f"{workers} of {need} workers joined")
        else:
            empty = [s for s in range(self.spec.stages) if s not in self.assign.values()]
            if empty:
                why.append(f"stage(s) {empty} have no worker: start `shoal worker --join`")
        if self.pending_restore and not vacant:
            why.append("servers are reporting their checkpoints for a roll-back")
        return why

    def _watch(self) -> None:
        """Report a stall once (log, event, status); fail the run when it lasts too long."""
        if not self.ready or self.done:
            return
        idle = time.time() - self.last_commit_t
        limit = max(30.0, 10 * self.spec.dead_after_s)
        if idle < limit:
            self.stall_reported = False
            return
        why = "; ".join(self.waiting_for()) or self._missing_reports()
        if not self.stall_reported:
            self.stall_reported = True
            log.warning("no step committed for %.0f s: %s", idle, why)
            self.event("stall", idle_s=round(idle, 1), step=self.committed, why=why)
        if self.stall_fail_s > 0 and idle > self.stall_fail_s:
            self.fail(f"no step committed for {idle:.0f} s (step {self.committed}): {why}")

    def _missing_reports(self) -> str:
        got = self.reports.get((self.epoch, self.committed), {})
        missing = [s for s in range(self.spec.stages) if s not in got]
        return f"stage(s) {missing} have not finished step {self.committed} (see their server logs)"

    async def reap(self) -> None:
        """Declare members dead after ``dead_after_s`` of silence; watch for stalls."""
        clock = DeafClock(0.1, time.monotonic())
        busy_s, cpu_prev, wall_prev = 0.0, time.thread_time(), time.monotonic()
        while not self.finished.is_set():
            await asyncio.sleep(0.1)
            self._watch()
            now = time.monotonic()
            deaf = clock.tick(now)
            cpu = time.thread_time()
            # A loop busy the whole tick (a join storm) may leave beats unread in its transport
            # although the tick came on time: that stretch is not the members' silence either.
            busy = busy_excuse(cpu - cpu_prev, now - wall_prev)
            cpu_prev, wall_prev = cpu, now
            if busy > deaf:
                busy_s += busy - deaf
                deaf = busy
            for mid, m in list(self.members.items()):
                # A late tick: messages of that stretch may still wait unread, so it is not their silence.
                m.last_seen += deaf
                # A false server death costs a roll-back, so servers get twice the grace.
                limit = self.spec.dead_after_s * (2 if m.role == "server" else 1)
                if now - m.last_seen > limit:
                    del self.members[mid]
                    detail = dict(silent_s=round(now - m.last_seen, 2), last_sign=m.last_sign,
                                  doing=m.doing or "unknown", deaf_s=round(clock.deaf_s + busy_s, 2))
                    log.warning("%s", death_line(m.name, "missed heartbeats", detail))
                    self._drop(m, "missed heartbeats", **detail)
            if self.reserved and time.monotonic() >= self.reserve_until:
                self._fill_vacancies()  # the reservations end: other servers may take those stages
            self._replan_flush()  # membership changes whose re-plan was put off
            self._ask_measure()
            for m in list(self.members.values()):
                if m.will_measure and m.measured_at is None and m.measure_req and self._settled(m):
                    m.measured_at = now  # gave up waiting: planned on what it declared
                    self.event("measure_timeout", device=m.name, role=m.role)
                    self._after_measure(m, again=False)

    # ------------------------------------------------------------------ steps
    async def ReportStep(self, request, context):
        r = request
        await check_caller(context, r.member_id)
        if r.epoch != self.epoch:
            return pb.StepDecision(stale=True)
        if not 0 <= r.stage < self.spec.stages or self.stage_server[r.stage] != r.member_id:
            # Only the server the coordinator assigned to a stage speaks for it.
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{r.member_id} does not serve stage {r.stage}")
        last = self.layers[r.stage][1] == self.cfg.n_total_layers
        why = report_error(self.spec, r, last, self.slots[r.stage].mb_hi - self.slots[r.stage].mb_lo
                           if self.slots is not None else None)
        if why:
            # Only the stage's own server gets here: a number no honest step gives (a diverged
            # run, or a broken server) ends the run with the reason, never a committed step.
            self.fail(f"stage {r.stage} reported step {r.step} with {why}; the run cannot go on "
                      "(a non-finite loss or norm: lower the learning rate)")
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"ReportStep: {why}")
        if r.HasField("last_step") and r.member_id in self.members:
            m = self.members[r.member_id]  # (the step record's split: _step_figures)
            if m.stats is None:
                m.stats = pb.MemberStats()
            m.stats.last_step.CopyFrom(r.last_step)
        key = (r.epoch, r.step)
        if key in self.decisions:
            return self.decisions[key]
        self.reports.setdefault(key, {})[r.stage] = r
        if len(self.reports[key]) == self.spec.stages:
            self._decide(key)
            async with self.cond:
                self.cond.notify_all()
        else:
            deadline = time.monotonic() + 5.0
            while key not in self.decisions and self.epoch == key[0] and time.monotonic() < deadline:
                await self.cond.wait(deadline - time.monotonic())
        if self.epoch != r.epoch:
            return pb.StepDecision(stale=True)
        return self.decisions.get(key, pb.StepDecision(ready=False))

    def _decide(self, key: tuple[int, int]) -> None:
        reps = self.reports.pop(key)
        step = key[1]
        if all(r.param_sq_norms for r in reps.values()):  # exact sync: the local trainer's sum, bitwise
            total = total_sq_norm(x for r in reps.values() for x in r.param_sq_norms)
        else:
            total = total_sq_norm(r.sq_norm for r in reps.values())
        ocfg = optim_config(self.spec)
        coef = clip_coefficient(total, ocfg.grad_clip) if math.isfinite(total) else 0.0
        lr = lr_at(step, self.spec.steps, ocfg)
        fp16 = run_precision(self.spec) == "fp16"
        skip = fp16 and overflowed(total)
        scale, good = self.scale_at.get(step, (initial_scale(self.spec), 0))
        if fp16:
            self.scale_at[step + 1] = next_loss_scale(scale, good, skip, loss_scaling(self.spec))
        ckpt = self._ckpt_decision(step)
        self.decisions[key] = pb.StepDecision(ready=True, coef=coef, lr=lr, skip=skip,
                                              next_loss_scale=self.scale_at[step + 1][0] if fp16 else 0.0,
                                              checkpoint=ckpt)
        # the last stage's losses (a replica plan: every replica's last stage's, in stage order)
        losses = [x for k in sorted(reps) if self.layers[k][1] == self.cfg.n_total_layers for x in reps[k].losses]
        loss = sum(losses) / max(len(losses), 1)
        tpw: dict[str, int] = {}
        for r in reps.values():
            for w, n in r.tasks_per_worker.items():
                name = self.names.get(w, w)
                tpw[name] = tpw.get(name, 0) + n
        requeues = sum(r.requeues for r in reps.values())
        # Workers with an unverified push in this step, at any stage: durable with the commit.
        unverified = sorted({self._name_of(w) for r in reps.values() for w in r.unverified})
        for r in reps.values():
            for w in r.unverified:
                self.unverified[w] = min(step, self.unverified.get(w, step))
        for name in unverified:
            self.unverified_names[name] = min(step, self.unverified_names.get(name, step))
        now = time.time()
        tokens = self.spec.micro_batches * self.spec.micro_batch_size * self.spec.seq_len
        rec = step_record(step, loss, lr, None if skip else math.sqrt(total), tokens, now - self.last_commit_t,
                          now - self.t0)
        if fp16:
            rec["loss_scale"], rec["skipped"] = scale, skip
        rec["tasks_per_worker"] = tpw
        rec["requeues"] = requeues
        rec["epoch"] = key[0]
        rec.update(self._step_figures(rec["tokens_per_s"]))
        self.last_commit_t = now
        # Durable before any stage hears the decision (and checkpoints the step).
        d = self.decisions[key]
        self._journal("commit", step=step, epoch=key[0], record=rec,
                      scale=list(self.scale_at[step + 1]) if fp16 else None,
                      decision=[d.lr, d.coef, bool(d.skip), d.next_loss_scale], **({"ckpt": True} if ckpt else {}),
                      **({"unverified": unverified} if unverified else {}))
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

    def _ckpt_decision(self, step: int) -> bool:
        """Whether every stage checkpoints the version step ``step`` makes (``ckpt_due``; local
        mode checkpoints merged weights only, so there it is decided at merges)."""
        self.unsaved_s += max(0.0, time.time() - self.last_commit_t)
        if sync_of_spec(self.spec).local and not is_sync_step(step, self.spec.sync_every, self.spec.steps):
            return False
        due = ckpt_due(step + 1, self.spec.ckpt_every, self.unsaved_s, self.spec.ckpt_every_s)
        if due:
            self.unsaved_s = 0.0
        return due

    def _step_figures(self, tokens_per_s: float) -> dict:
        """What a step record adds for viewers (metrics.jsonl, TensorBoard): each stage server's
        newest step-time split, the wire bytes all members sent so far by traffic kind, and the
        step's tokens/s as a share of the planned swarm's FLOP limit."""
        out: dict = {}
        split = {}
        for s, sid in enumerate(self.stage_server):
            st = self.members[sid].stats if sid in self.members else None
            if st is not None and st.HasField("last_step"):
                ls = st.last_step
                split[str(s)] = {"total_s": ls.total_s, "compute_s": ls.compute_s, "transfer_s": ls.transfer_s,
                                 "sync_s": ls.sync_s, "waiting_s": ls.waiting_s}
        if split:
            out["split"] = split
        by_kind: dict[str, int] = {}
        for _, counts in self.traffic.values():
            for c in counts:
                by_kind[c.kind] = by_kind.get(c.kind, 0) + int(c.wire)
        if by_kind:
            out["bytes_by_kind"] = by_kind
        if self.planned_on is not None:
            if getattr(self, "_flop_limit", (None, 0.0))[0] is not self.planned_on:
                from shoal.plan.cost import swarm_flop_limit

                self._flop_limit = (self.planned_on, swarm_flop_limit(self.planned_on))
            if self._flop_limit[1] > 0:
                out["flop_share"] = tokens_per_s / self._flop_limit[1]
        return out

    def _spawn_finish(self) -> None:
        if not getattr(self, "_finishing", False):
            self._finishing = True
            asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        """Collect the final weights from every server, write them, then say done.

        Each server sends its stage's when its heartbeat reply asks (``send_final``), on the
        connection its heartbeats keep open; a stage whose weights have not come within
        :data:`FINAL_WAIT_S` (a server that left, or a send that failed) is pulled instead,
        on a new connection (which a flood at the server's connection cap can hold up until
        the flood's connections time out)."""
        channels = ChannelFactory(self.token, tls=self.tls, identity=coordinator_identity(self.token, self.secret))
        cap = self.max_bytes()
        loop = asyncio.get_running_loop()
        until = loop.time() + FINAL_WAIT_S
        while not self.error and any(sid and sid in self.members and self._final_of(sid) is None
                                     and (loop.time() < until or sid in self.final_receiving)
                                     for sid in self.stage_server):
            await self.final_signal.wait(0.5)
        parts: dict[int, tuple[str, dict]] = {}  # stage -> (how its weights came, them decoded)
        for _ in range(FINAL_TRIES):
            try:
                for s in range(self.spec.stages):
                    if s in parts:
                        continue
                    sid = self.stage_server[s]
                    rep = self._final_of(sid)
                    how = "sent" if rep is not None else "pulled"
                    if rep is None:
                        stub = pbg.StageServerStub(channels.open(self._servers()[s]))
                        while True:
                            # (frames kept as views of the received bytes, decoded in a thread: a
                            # whole stage parsed or decoded on the loop held it for seconds)
                            rep = await fetch(stub.GetWeightsStream, pb.WeightsRequest(worker="coordinator"),
                                              pb.WeightsReply, cap, frames_field=WEIGHT_FRAMES)
                            if rep.version >= self.spec.steps or self.error:
                                break
                            await asyncio.sleep(0.05)
                    # (views of the received bytes, copy=False: they are only compared and written)
                    parts[s] = (how, await loop.run_in_executor(
                        None, lambda r=rep: {f.name: decode_tensor(f, dtype="float32", copy=False) for f in r.params}))
                    if how == "sent":  # keep only the head the heartbeats' asks read (the frames live on in parts)
                        self.final_in[sid] = pb.WeightsReply(version=rep.version, epoch=rep.epoch, first=rep.first,
                                                             last=rep.last)
                    del rep
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # its last checkpoint write failed
                    self.fail(exc.details() or "a server could not write its last checkpoint")
                if self.error:
                    break
                await asyncio.sleep(0.1)
            except (IndexError, ValueError):  # WireError is a ValueError
                await asyncio.sleep(0.1)
        missing = [s for s in range(self.spec.stages) if s not in parts]
        if missing and not self.error:
            # (nothing committed is lost: `--resume` redoes the steps after the newest checkpoint and
            # then collects and writes the final weights)
            self.fail(f"could not collect the final weights of stage(s) {missing}; resume the run (--resume) "
                      "to write them")
        if self.error:  # failed meanwhile (a member's fatal error): the journal says so, not "done"
            return
        by_stage = [parts[s][1] for s in sorted(parts)]
        weights: dict = {}
        for stage_weights in by_stage:
            for name, t in stage_weights.items():
                weights.setdefault(name, t)  # a replica plan: the first replica's copy
        final_how = {k: sum(how == k for how, _ in parts.values()) for k in ("sent", "pulled")}
        if self.slots is not None and by_stage:
            # every replica's copy of each layer must be the first replica's, bit for bit
            import torch

            differ = await asyncio.get_running_loop().run_in_executor(None, lambda: sorted(
                {n for st in by_stage for n, t in st.items() if not torch.equal(t, weights[n])}))
            self.replicas_differ = differ
            if differ:
                log.error("the replicas' final weights differ in %d parameters (%s ...)", len(differ), differ[0])
        if self.out:
            from shoal.runtime.roles.artifacts import write_final

            # (in a thread: the members keep being answered while the whole model is written)
            await asyncio.get_running_loop().run_in_executor(None, write_final, self.run_dir, weights, self.cfg,
                                                             self.spec, self.summary())
            for name in FINAL:
                if (self.run_dir / name).exists():
                    point_link(self.out, name, self.spec.run_id)
        self.final_weights = weights
        self.done = True
        self.final_in.clear()  # (final_weights holds the frames' bytes it needs)
        self._journal("done", epoch=self.epoch)
        self.event("done", steps=self.committed, final_weights=final_how)
        # Let members see done in a heartbeat (servers beat every 0.2 s, workers every
        # heartbeat_period), which also brings their last byte counts: until each has been told,
        # or three of a worker's beat periods at most (a member that died meanwhile never beats).
        loop = asyncio.get_running_loop()
        until = loop.time() + max(1.0, 3 * heartbeat_period(self.spec.dead_after_s, self.spec.min_lease_s))
        while loop.time() < until and not all(m.told_done for m in self.members.values()):
            await asyncio.sleep(0.02)
        if self.out and (self.run_dir / "summary.json").exists():
            # The members' heartbeats since the commit carried their last byte counts.
            path = self.run_dir / "summary.json"
            summary = json.loads(path.read_text())
            summary.update(merge_traffic(self.traffic))
            summary["peak_rss_bytes"] = dict(self.peak_rss)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(summary, indent=1, sort_keys=True))
            tmp.replace(path)
        self.finished.set()

    def write_final_page(self) -> Path | None:
        """Save the dashboard with the run's final state as ``RUN/dashboard.html`` (linked from
        ``OUT/dashboard.html``): a static page that stays viewable after the run."""
        if self.run_dir is None:
            return None
        from shoal.runtime.ui.dashboard import snapshot, write_page

        try:
            path = write_page(self.run_dir / "dashboard.html", snapshot(self))
            point_link(self.out, "dashboard.html", self.spec.run_id)
        except OSError as exc:
            log.warning("could not save the final dashboard: %s", exc)
            return None
        log.info("the run's final state: %s", self.out / "dashboard.html")
        return path

    def summary(self) -> dict:
        losses = [r["loss"] for r in sorted(self.history, key=lambda r: r["step"])]
        times = [r["step_time_s"] for r in self.history]
        tokens = sum(r["tokens"] for r in self.history)
        return {
            "steps": self.committed, "losses": losses, "final_loss": losses[-1] if losses else None,
            "stages": self.spec.stages, "layers": self.layers, "epochs": self.epoch + 1,
            "run_id": self.spec.run_id,
            "requeues": self.total_requeues, "tasks_per_worker": self.tasks_per_worker,
            "tokens": tokens, "train_time_s": sum(times),
            "tokens_per_s": tokens / sum(times) if times and sum(times) > 0 else 0.0,
            "wall_time_s": time.time() - self.t0,
            **merge_traffic(self.traffic),
            "bytes_method": BYTES_METHOD,
            "peak_rss_bytes": dict(self.peak_rss),  # per member name, as its heartbeats last said
            # the member name of each stage's server at the end (names need not follow stage order)
            "stage_servers": [getattr(self.members.get(mid), "name", "") for mid in self.stage_server],
            **({"dashboard": "dashboard.html"} if self.run_dir is not None else {}),
            **({"replicas": {"stages": list(self.spec.replica_stages), "micro_batches": list(self.spec.replica_mbs),
                             "final_weights_differ": getattr(self, "replicas_differ", None)}}
               if self.slots is not None else {}),
        }

    async def Status(self, request, context):
        waiting = self.waiting_for()
        state = ("failed" if self.error else "done") if self.done else ("waiting" if waiting else "running")
        st = {
            "ready": self.ready and state == "running", "state": state, "waiting_for": waiting,
            "error": self.error, "run_id": self.spec.run_id,
            "committed": self.committed, "epoch": self.epoch, "done": self.done,
            "banned": {**{self._name_of(mid): why for mid, why in self.guard_banned.items()}, **self.banned_names},
            "servers": self._servers(),
            "workers": {m.name: self.assign.get(mid, -1) for mid, m in self.members.items() if m.role == "worker"},
            "plans_on": ("emulated" if self.emulated is not None else "measured" if self.figures else "loopback"),
            "scenario": self._scenario_view(),
        }
        from shoal.runtime.ui.dashboard import snapshot

        st["dashboard"] = snapshot(self)
        return pb.StatusReply(json=json.dumps(st))


    def _scenario_view(self) -> dict | None:
        """The scenario of the newest plan in file form, device ids shown with member names."""
        if self.planned_on is None:
            return None
        from shoal.plan.scenario import scenario_to_dict

        d = scenario_to_dict(self.planned_on)
        for dev in d["devices"]:
            dev["name"] = self.names.get(dev["id"], dev["id"])
        return d


async def run_coordinator(spec: pb.RunSpec, token: str, listen: str, *, min_workers: int = 1,
                          out: str | None = None, address_file: str | None = None,
                          emulated=None, dashboard: str | None = None, stall_fail_s: float = 900.0,
                          advertise: str | None = None, resume=None, options: dict | None = None,
                          tls=None, server_token: str = "") -> dict:
    """Serve until the run is done; returns the run summary (a failed run: ShoalError).

    ``emulated``: the scaled scenario the processes emulate, planned on instead of loopback;
    ``advertise``: the address members dial (written to ``address_file``; default: listen).
    ``dashboard``: HOST:PORT for the live web dashboard (None: none), see
    :mod:`shoal.runtime.ui.dashboard`; its URL goes to ``address_file + ".dashboard"``.
    ``resume``: the :class:`~shoal.runtime.safety.journal.ResumeState` of the run to take over
    (``spec`` is then that run's); ``options``: the settings the journal keeps for a
    later ``--resume`` (see :func:`shoal.runtime.processes.cli.run_coordinator_cmd`).
    """
    coord = Coordinator(spec, token, min_workers=min_workers, out=out, emulated=emulated,
                        stall_fail_s=stall_fail_s, resume=resume, options=options, tls=tls,
                        server_token=server_token)
    # Only control messages, link probes and stage servers' final weights (in chunks, each
    # checked) reach the coordinator: replies much smaller than a stage server's (the largest is
    # a probe's, at most MAX_PROBE_BYTES).
    from shoal.runtime.measure import MAX_PROBE_BYTES

    server = make_server(token, max_message_bytes=MAX_PROBE_BYTES + (1 << 20), run_key=lambda: coord.run_key,
                         resolve=coord.max_bytes)
    pbg.add_CoordinatorServicer_to_server(coord, server)
    port = bind(server, listen, tls)
    address = advertised_address(listen, advertise, port)
    await server.start()
    web = None
    if dashboard:
        from shoal.runtime.ui.dashboard import Dashboard

        web = Dashboard(coord, dashboard, token)
        await web.start()
        log.info("dashboard at %s", web.url)
        if address_file:
            Path(address_file + ".dashboard").write_text(web.url)
    coord._journal("listen", address=address, listen=f"{listen.rpartition(':')[0]}:{port}", epoch=coord.epoch)  # where members will look for it
    if address_file:
        # The run's clock (events' and metrics' time_s) for the launcher's kill events and
        # its id (to restart this coordinator with --resume); written before the address,
        # so they exist once the address does.
        Path(address_file + ".t0").write_text(repr(coord.t0))
        Path(address_file + ".run_id").write_text(spec.run_id)
        tmp = Path(address_file + ".tmp")
        tmp.write_text(address)
        tmp.replace(address_file)
    log.info("coordinator listening on %s (run %s)", address, spec.run_id)
    if coord.resumed:
        coord.event("resume", run_id=spec.run_id, committed=coord.committed, epoch=coord.epoch)
    else:
        coord.event("run", run_id=spec.run_id, steps=spec.steps, stages=spec.stages)
    reaper = asyncio.create_task(coord.reap())
    await coord.finished.wait()
    reaper.cancel()
    coord.write_final_page()
    if web is not None:
        await web.stop()
    await server.stop(0.5)
    if coord.error:
        raise ShoalError(f"the run failed: {coord.error}")
    return coord.summary()


async def _abort(context, code: grpc.StatusCode, why: str) -> None:
    """Refuse the call with ``why`` (``context`` None, an in-process call: a ShoalError)."""
    if context is None:
        raise ShoalError(why)
    await context.abort(code, why)


def bad_number(msg, nonfinite_ok: frozenset[str] = frozenset(), path: str = "") -> str | None:
    """The first number in protobuf message ``msg`` out of range, as ``"field = value: why"``
    (None: all fine; pure, tested directly).

    Every number a member reports is a count, a version, a size, a rate, a time or a norm:
    floats must be finite and >= 0 (fields named in ``nonfinite_ok`` may also be inf or NaN:
    an fp16 overflow), integers >= -1 (-1 is "none").
    """
    from google.protobuf.descriptor import FieldDescriptor as F

    floats = (F.TYPE_DOUBLE, F.TYPE_FLOAT)
    ints = (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_UINT32, F.TYPE_UINT64)
    for fd, value in msg.ListFields():
        name = f"{path}{fd.name}"
        repeated = fd.is_repeated
        if fd.type == F.TYPE_MESSAGE:
            if fd.message_type.GetOptions().map_entry:  # map<string, int64> (tasks per worker)
                for k, v in value.items():
                    if isinstance(v, int) and v < 0:
                        return f"{name}[{k}] = {v}: must be >= 0"
                continue
            for i, sub in enumerate(value if repeated else [value]):
                why = bad_number(sub, nonfinite_ok, f"{name}[{i}]." if repeated else f"{name}.")
                if why:
                    return why
        elif fd.type in floats:
            for v in (value if repeated else [value]):
                if not math.isfinite(v):
                    if fd.name in nonfinite_ok and not (v < 0):
                        continue
                    return f"{name} = {v}: must be finite"
                if v < 0:
                    return f"{name} = {v}: must be >= 0"
        elif fd.type in ints:
            for v in (value if repeated else [value]):
                if v < -1:
                    return f"{name} = {v}: must be >= -1"
    return None


def join_numbers_error(request) -> str | None:
    """Why a ``JoinRequest``'s numbers are out of range (None: fine)."""
    return bad_number(request)


def report_error(spec, r, last: bool, n_losses: int | None = None) -> str | None:
    """Why a ``StepReport`` cannot count (None: it can; pure, tested directly).

    ``n_losses``: the losses a last stage reports (None: every micro-batch's; a replica plan's
    last stage reports its replica's).

    fp16 runs may report an infinite or NaN norm (an overflow: the step is skipped) and
    infinite losses; any other run's numbers must all be finite.
    """
    fp16 = (spec.precision or "fp32") == "fp16"
    why = bad_number(r, frozenset({"sq_norm", "param_sq_norms", "losses"}) if fp16 else frozenset())
    if why:
        return why
    if not 0 <= r.step < spec.steps:
        return f"step = {r.step}: the run has steps 0..{spec.steps - 1}"
    want = spec.micro_batches if n_losses is None else n_losses
    if last and len(r.losses) != want:
        return f"losses: {len(r.losses)} values, the {'run' if n_losses is None else 'stage'} has {want} micro-batches"
    if not last and r.losses:
        return "losses: only the last stage reports losses"
    return None


def replan_wait(now: float, last_end: float, last_cost_s: float, share: float = REPLAN_SHARE,
                free_s: float = FREE_REPLAN_S) -> float:
    """Seconds to put off a re-plan so that re-plans take at most ``share`` of the time: the
    last one took ``last_cost_s`` and ended at ``last_end`` (pure; tested directly). 0 when
    the last one took under ``free_s`` (a small swarm re-plans at every change)."""
    if last_cost_s < free_s:
        return 0.0
    return max(0.0, last_end + last_cost_s * (1.0 - share) / share - now)


def busy_excuse(cpu_s: float, wall_s: float, share: float = BUSY_SHARE) -> float:
    """Seconds of a reaper tick (``wall_s`` long) not to count as members' silence because
    the coordinator's event loop computed for at least ``share`` of it (``cpu_s``: its
    thread's CPU): all of them then, else 0 (pure; tested directly)."""
    return wall_s if wall_s > 0 and cpu_s >= share * wall_s else 0.0


def beat_floor_s(members: int, dead_after_s: float, beats_per_s: float = BEATS_PER_S) -> float:
    """The shortest heartbeat period the coordinator asks of its workers: ``members`` beats
    spread to come at most ``beats_per_s`` a second, but three at least in every
    ``dead_after_s`` (pure; tested directly). A worker beats at the longer of this and its
    own period; a worker at work is also kept alive by its stage server's reports of its traffic."""
    return min(members / beats_per_s, dead_after_s / 3.0)


def asks_final(committed: int, steps: int, done: bool, sent: bool) -> bool:
    """Whether a stage server's heartbeat reply asks for its final weights (pure): the last
    step is committed, the run not yet done, and this epoch's final weights not yet in."""
    return committed >= steps and not done and not sent


def final_refusal(stage: int, layers: list[int] | None, got_layers: list[int], epoch: int, run_epoch: int,
                  version: int, steps: int) -> str:
    """Why final weights a server sent are refused ("" if taken; pure): it serves no stage now,
    they are of other layers, of a rolled-back epoch, or of a version before the last step."""
    if stage < 0 or layers is None:
        return "the sender serves no stage"
    if list(got_layers) != list(layers):
        return f"layers {list(got_layers)} are not its stage's {list(layers)}"
    if epoch != run_epoch:
        return f"epoch {epoch} is not the run's {run_epoch}"
    if version < steps:
        return f"version {version} is before the last step ({steps})"
    return ""


def stage_without_worker(assign: dict[str, int], stages: int) -> bool:
    """Whether a stage has no worker in ``assign`` (worker -> stage): its tasks wait for a re-plan."""
    return len(set(assign.values()) & set(range(stages))) < stages


def move_is_urgent(stage: int, member_id: str, at_work: dict[str, int]) -> bool:
    """Whether worker ``member_id``, assigned to ``stage``, must move there at once (pure).

    True when no other worker reports working on ``stage``: the stage's tasks wait for it, so
    a local-mode worker must not hold the move until its round ends (a round that cannot end
    without that stage). ``at_work`` maps workers to the stage they last reported.
    """
    return not any(s == stage for mid, s in at_work.items() if mid != member_id)


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3``... when a live member already uses it."""
    if name not in taken:
        return name
    k = 2
    while f"{name}-{k}" in taken:
        k += 1
    return f"{name}-{k}"


def pick_standby(stage: int, standby: list[tuple[str, int]], vacant: set[int]) -> str | None:
    """The standby server (``(member id, stage it served before)``, oldest first) for ``stage``.

    A server re-joining a restarted coordinator gets its old stage back (its checkpoint
    folder holds that stage); one that served another still-vacant stage waits for it.
    """
    for mid, had in standby:
        if had == stage:
            return mid
    for mid, had in standby:
        if had < 0 or had not in vacant:
            return mid
    return None


def standby_stages(standbys: list[str], stages: int, held: dict[str, dict[int, int]] | None = None,
                   hosts: dict[str, str] | None = None, active_hosts: list[str] | None = None) -> dict[str, int]:
    """The stage each hot standby (member ids, oldest first) copies.

    A standby that holds copies (``held``: stage -> newest version, e.g. one that joined a
    restarted coordinator) keeps copying the stage it holds the newest copy of; the others
    go round robin to the stages with the fewest standbys. Within a round a standby goes to a
    stage whose active server runs on another host where the round allows it (``hosts``:
    standby -> host, ``active_hosts``: stage -> its active server's host; "" is unknown and
    never the same): a copy on the active server's own machine dies with it.
    """
    if stages <= 0:
        return {}
    out: dict[str, int] = {}
    count = [0] * stages
    for mid in standbys:
        own = max(((v, k) for k, v in (held or {}).get(mid, {}).items() if 0 <= k < stages and v > 0),
                  default=None)
        if own is not None:
            out[mid] = own[1]
            count[own[1]] += 1
    rest = [mid for mid in standbys if mid not in out]
    hosts, active_hosts = hosts or {}, active_hosts or []

    def same_host(mid: str, k: int) -> bool:
        h = hosts.get(mid, "")
        return bool(h) and k < len(active_hosts) and h == active_hosts[k]

    slots = []  # the stages round robin fills, in order: the fewest standbys first, then one on another host
    for mid in rest:
        k = min(range(stages), key=lambda k: (count[k], same_host(mid, k), k))
        slots.append(k)
        count[k] += 1
    out.update(spread_hosts(rest, slots, hosts, active_hosts))
    return {mid: out[mid] for mid in standbys}


def spread_hosts(standbys: list[str], slots: list[int], hosts: dict[str, str],
                 active_hosts: list[str]) -> dict[str, int]:
    """Give each of ``standbys`` one of ``slots`` (stages, as many as standbys): as many as
    possible on a host other than the stage's active server's (a maximum matching), the
    rest, and all of them when no host differs, in order."""
    def apart(mid: str, k: int) -> bool:
        h = hosts.get(mid, "")
        return not h or k >= len(active_hosts) or not active_hosts[k] or h != active_hosts[k]

    owner: dict[int, str] = {}  # slot index -> standby

    def place(mid: str, seen: set[int]) -> bool:
        # A free slot first (keeps the plain round-robin order), then move another standby.
        for i, k in enumerate(slots):
            if i not in owner and apart(mid, k):
                owner[i] = mid
                return True
        for i, k in enumerate(slots):
            if i not in seen and apart(mid, k):
                seen.add(i)
                if place(owner[i], seen):
                    owner[i] = mid
                    return True
        return False

    for mid in standbys:
        place(mid, set())
    out = {mid: slots[i] for i, mid in owner.items()}
    free = [k for i, k in enumerate(slots) if i not in owner]
    for mid in standbys:
        if mid not in out:
            out[mid] = free.pop(0)
    return out


def pick_holder(stage: int, candidates: list[tuple[str, dict[int, int]]], copier: str | None) -> str | None:
    """The candidate server (``(member id, stage -> newest checkpoint it holds)``, oldest
    first) holding the newest checkpoint of ``stage``; on a tie the stage's hot standby
    ``copier``, else the oldest. None when none holds any."""
    best = max((held.get(stage, 0) for _, held in candidates), default=0)
    if best <= 0:
        return None
    tied = [mid for mid, held in candidates if held.get(stage, 0) == best]
    return copier if copier in tied else tied[0]


def one_machine(server_addresses: list[str]) -> bool:
    """Whether the whole run is on one machine: every stage server listens on loopback, so
    every member dials loopback. Its members then measure at once (no network link to share);
    otherwise one at a time."""
    from shoal.net.tls import is_loopback

    return bool(server_addresses) and all(is_loopback(a.rpartition(":")[0]) for a in server_addresses)


def death_line(name: str, why: str, detail: dict) -> str:
    """One line: why a member was dropped, with its last sign of life and what it was doing."""
    if not detail:
        return f"{name} dropped: {why}"
    return (f"{name} declared dead: {why} (silent {detail['silent_s']:.1f} s, last sign of life: "
            f"{detail['last_sign']}, it was {detail['doing']})")


def resume_grace_s(dead_after_s: float) -> float:
    """How long a resumed coordinator keeps a stage for the server that served it: members
    join again within a few heartbeats of the restart; one that does not is dead."""
    return max(15.0, 3 * dead_after_s)
