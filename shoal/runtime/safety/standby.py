"""Hot standbys' step log: a stage's standby reaches the newest committed version on promotion.

A hot standby copies its stage's checkpoint files from the active server (a long poll,
:meth:`shoal.runtime.roles.server.StageServer.StandbyCkptStream`), one transfer after each file is
written. That alone leaves a window: an active server killed after the coordinator decided
step ``v`` but before its standby holds the file of version ``v + 1`` costs the committed
step too. The step log closes it in exact mode:

* before the active server reports step ``v`` (``ReportStep``), it sends each standby of its
  stage the step's summed gradient, exactly what the optimizer will apply (fp32, unscaled
  in fp16 runs), and waits for the acknowledgement (bounded: a standby that does not answer
  is logged as lagging and the step goes on without it; a dead standby never stops the run);
* the standby keeps the gradients of the steps after its newest full copy, and the
  coordinator's decisions of those steps (lr, clip coefficient, skip, next loss scale) come
  with its heartbeats;
* promoted, it loads its newest full copy and replays the logged steps with their
  decisions through the same :func:`shoal.train.optim.apply_update`, in step order, and
  writes the checkpoint files: it holds the newest committed version, bitwise.

Every decided step was reported by every stage, so every standby that acknowledged it has
its gradient: a kill at any moment loses at most the step in flight. Full copies still
arrive by the long poll and bound the log. Local mode (``--sync local``) keeps the copies
alone (its servers change weights only by merges).

The decisions (which steps to replay, what a roll-back drops, when to send) are small pure
functions, tested directly (``tests/test_standby.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterable

import grpc
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.auth import check_caller
from shoal.net.stream import CONTROL_SLACK, receive, send
from shoal.net.wire import WireError, decode_tensor, encode_tensor
from shoal.runtime.common import list_ckpts, model_config, run_precision, save_stage_ckpt

log = logging.getLogger("shoal.server")

Key = tuple[int, int]  # (epoch, step)

STANDBY_ACK_S = 10.0  # longest an active server waits for a standby to log a step
STANDBY_LAG_S = 30.0  # a standby that timed out logging a step is skipped this long (full copies still go)
STANDBY_LOG_STEPS = 64  # most steps a standby logs beyond its newest full copy (memory bound)
KILL_AT_COMMIT_ENV = "SHOAL_TEST_KILL_AT_COMMIT"  # fault hook "STAGE:N": see kill_at_commit


def replay_plan(base: int, logged: Iterable[Key], decided: Iterable[Key]) -> list[Key]:
    """The logged steps a standby replays on top of its full copy at version ``base``, in order.

    Steps ``base, base + 1, ...`` as long as each has a logged gradient and a committed
    decision of the same epoch (the newest such epoch); the first gap ends the replay.
    """
    both: dict[int, int] = {}
    for e, k in set(logged) & set(decided):
        both[k] = max(both.get(k, -1), e)
    out: list[Key] = []
    k = base
    while k in both:
        out.append((both[k], k))
        k += 1
    return out


def superseded(keys: Iterable[Key], new: Key) -> list[Key]:
    """Entries a newly arrived ``new`` (a logged step or a decision) makes stale.

    A step ``k`` of epoch ``e`` means the run rolled back at or below ``k`` when ``e`` began,
    so every entry of an older epoch at step ``k`` or later is from the history it left
    (its decision may never come, or its gradient may differ from the redone step's).
    """
    e, k = new
    return [key for key in keys if key[0] < e and key[1] >= k]


def covered(keys: Iterable[Key], base: int) -> list[Key]:
    """Entries a full copy at version ``base`` holds already (steps before ``base``)."""
    return [key for key in keys if key[1] < base]


def overflow(keys: Iterable[Key], most: int = STANDBY_LOG_STEPS) -> list[Key]:
    """The oldest entries beyond ``most`` (a standby whose copies stopped arriving)."""
    ordered = sorted(keys, key=lambda key: (key[1], key[0]))
    return ordered[:max(0, len(ordered) - most)]


def send_to(peers: Iterable[str], skip_until: dict[str, float], now: float) -> list[str]:
    """The standbys an active server sends a step to: all but those skipped until after ``now``."""
    return [p for p in peers if now >= skip_until.get(p, 0.0)]


def lag_seconds(timed_out: bool) -> float:
    """How long to skip a standby that failed to log a step: one that timed out (hung or
    starved) would stall every step, so it is skipped a while; one that refused or is
    unreachable answers at once and is tried again with the next step."""
    return STANDBY_LAG_S if timed_out else 0.0


def decisions_since(decisions: dict[Key, pb.StepDecision], epoch: int, committed: int, since: int,
                    most: int = STANDBY_LOG_STEPS) -> list[pb.StandbyDecision]:
    """The coordinator's decisions of the committed steps ``since .. committed - 1`` (at most
    ``most``, the newest), each from the newest epoch that decided it (older epochs' decisions
    of a step were left by a roll-back)."""
    out = []
    for k in range(max(since, committed - most), committed):
        for e in range(epoch, -1, -1):
            d = decisions.get((e, k))
            if d is not None and d.ready:
                out.append(pb.StandbyDecision(epoch=e, step=k, lr=d.lr, coef=d.coef, skip=d.skip,
                                              next_loss_scale=d.next_loss_scale, checkpoint=d.checkpoint))
                break
    return out


def kill_at_commit(stage: int, step: int, standby: bool, env: str | None = None) -> bool:
    """Test hook: kill -9 this (non-standby) server of ``stage`` the moment the coordinator's
    decision of ``step`` lands, before the server applies or checkpoints it.

    ``SHOAL_TEST_KILL_AT_COMMIT=STAGE:N`` fires once N steps are committed, the worst moment
    for a standby that copies only checkpoint files.
    """
    spec = os.environ.get(KILL_AT_COMMIT_ENV, "") if env is None else env
    if not spec or standby:
        return False
    want_stage, _, n = spec.partition(":")
    if not (want_stage.isdigit() and n.isdigit() and int(want_stage) == stage and step + 1 == int(n)):
        return False
    log.warning("fault hook %s=%s: kill -9 of this server at the commit of step %d", KILL_AT_COMMIT_ENV, spec, step)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
    return True


class StandbyMixin:
    """Stage-server state and handlers of the step log (both sides: active and standby)."""

    sb_stage = -1  # standby: the stage it copies (-1: none)
    sb_layers = (0, 0)  # standby: that stage's layers [first, last)
    sb_log: dict[Key, dict[str, torch.Tensor]] | None = None  # standby: logged gradients
    sb_decided: dict[Key, pb.StandbyDecision] | None = None  # standby: committed decisions
    sb_shapes: dict[str, tuple[int, ...]] | None = None  # standby: parameter shapes of sb_stage
    sb_shaping = False  # standby: the shapes are being computed
    sb_source: tuple[int, str] = (-1, "")  # standby: (stage, member id of its active server) as last told
    sb_peers: tuple[str, ...] = ()  # active: addresses of its stage's standbys
    sb_lagging: dict[str, float] | None = None  # active: standby -> skipped until (monotonic s)
    sb_logged: tuple[str, ...] = ()  # active: the standbys that logged the last step sent

    # ------------------------------------------------------------ standby side
    def _sb_reset(self, stage: int, layers: tuple[int, int]) -> None:
        if (stage, layers) != (self.sb_stage, self.sb_layers) or self.sb_log is None:
            self.sb_stage, self.sb_layers = stage, layers
            self.sb_log, self.sb_decided, self.sb_shapes = {}, {}, None

    def _sb_base(self) -> int:
        """The version of the standby's newest full copy of its stage (0: the initial weights)."""
        return max(list_ckpts(self.ckpt_root, self.sb_stage, self.spec.run_id), default=0)

    def _sb_drop(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.sb_log.pop(key, None)
            self.sb_decided.pop(key, None)

    def _sb_tidy(self) -> None:
        """Drop what the newest full copy holds and what the log cannot keep."""
        if self.sb_log:
            self._sb_drop(covered(list(self.sb_log) + list(self.sb_decided), self._sb_base()))
            self._sb_drop(overflow(self.sb_log))

    def standby_decisions_from(self) -> int:
        """Heartbeat field: 1 + the oldest logged step whose decision the standby needs (0: none)."""
        if self.stage >= 0 or not self.sb_log:
            return 0
        return min(k for _, k in self.sb_log) + 1

    def standby_heard(self, a: pb.Assignment) -> None:
        """Take a heartbeat reply's step-log fields (both roles)."""
        self.sb_peers = tuple(a.standby_peers)
        if a.stage < 0 and a.standby_for > 0:
            self._sb_reset(a.standby_for - 1, (a.standby_first, a.standby_last))
            self.sb_source = (a.standby_for - 1, a.standby_source)
            if self.sb_shapes is None and not self.sb_shaping:
                self.sb_shaping = True  # ready before the first step arrives
                self._spawn(self._sb_shapes_ready())
        if self.sb_decided is None:
            return
        for d in a.standby_decisions:
            key = (d.epoch, d.step)
            if key not in self.sb_decided:
                self._sb_drop(superseded(list(self.sb_log) + list(self.sb_decided), key))
                self.sb_decided[key] = d

    def standby_replayable(self) -> int:
        """The version a promotion would reach: the newest full copy plus the replayable steps."""
        if not self.sb_log or self.spec is None:
            return 0
        base = self._sb_base()
        return base + len(replay_plan(base, self.sb_log, self.sb_decided))

    def _sb_build_shapes(self, layers: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Parameter shapes of the stage with ``layers`` (CPU work, run in a thread): built on the
        meta device, so no weight is allocated or initialised."""
        from shoal.model.transformer import build_stage

        with torch.device("meta"):
            module = build_stage(model_config(self.spec), *layers, seed=self.spec.seed)
        return {n: tuple(p.shape) for n, p in module.named_parameters()}

    async def _sb_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of the stage we copy (computed once per stage, off the event loop)."""
        while self.sb_shapes is None:
            layers = self.sb_layers
            shapes = await asyncio.get_running_loop().run_in_executor(None, self._sb_build_shapes, layers)
            if self.sb_log is None:
                return shapes  # promoted meanwhile: nothing to keep
            if layers == self.sb_layers:
                self.sb_shapes = shapes
        return self.sb_shapes

    async def _sb_shapes_ready(self) -> None:
        try:
            await self._sb_param_shapes()
        finally:
            self.sb_shaping = False

    def _sb_max_bytes(self) -> int:
        """Most bytes of a step sent to this standby: its stage's gradient, from the model's
        profile (before the coordinator named the stage: the whole model's, the bound of any)."""
        if self.spec is None:
            return CONTROL_SLACK
        from shoal.model.profile import profile_model

        cfg = model_config(self.spec)
        first, last = self.sb_layers if self.sb_stage >= 0 else (0, cfg.n_total_layers)
        numel = profile_model(cfg, seq_len=self.spec.seq_len or None).params(first, last)
        return 5 * numel + 1024 * 1024 + CONTROL_SLACK

    async def StandbyStepStream(self, request_iterator, context):
        """Log a step's summed gradient sent by the active server of the stage we copy."""
        try:
            msg = await receive(request_iterator, pb.StandbyStep, self._sb_max_bytes())
        except WireError as exc:
            return pb.StandbyStepAck(ok=False, reason=f"rejected: {exc}")
        await check_caller(context, msg.member_id)
        if self.stage >= 0 or self.spec is None or self.sb_stage not in (-1, msg.stage):
            return pb.StandbyStepAck(ok=False, reason=f"not a standby of stage {msg.stage}")
        src_stage, src = self.sb_source
        if src and src_stage == msg.stage and msg.member_id != src:
            # Only the stage's active server (as the coordinator last said) logs its steps here:
            # another server's log would be replayed into the stage on a promotion. Until the
            # coordinator has named it (the active learns of a new standby a heartbeat earlier),
            # a server naming the stage is taken.
            log.warning("%s: step log from %s refused: stage %d's active server is %s", self.name,
                        msg.member_id, msg.stage, src)
            return pb.StandbyStepAck(ok=False, reason=f"{msg.member_id} is not the active server of stage "
                                                      f"{msg.stage}")
        # The coordinator lists a new standby to the active server a heartbeat before it tells
        # the standby: the step names its stage and layers.
        self._sb_reset(msg.stage, (msg.first, msg.last))
        shapes = await self._sb_param_shapes()
        if self.stage >= 0 or self.sb_stage != msg.stage or self.sb_log is None:
            return pb.StandbyStepAck(ok=False, reason=f"not a standby of stage {msg.stage}")  # changed meanwhile
        finite = run_precision(self.spec) != "fp16"  # an fp16 overflow is a skipped step, not a fault

        def decode() -> dict:  # in a thread: a whole stage's gradient
            out = {}
            for g in msg.grads:
                if g.name not in shapes or g.name in out:
                    raise WireError(f"unexpected gradient {g.name!r}")
                out[g.name] = decode_tensor(g, shape=shapes[g.name], dtype="float32", finite=finite)
            return out

        try:
            grads = await asyncio.get_running_loop().run_in_executor(None, decode)
        except WireError as exc:
            return pb.StandbyStepAck(ok=False, reason=f"rejected: {exc}")
        if self.stage >= 0 or self.sb_stage != msg.stage or self.sb_log is None:
            return pb.StandbyStepAck(ok=False, reason=f"not a standby of stage {msg.stage}")  # changed meanwhile
        if len(grads) != len(shapes):
            return pb.StandbyStepAck(ok=False, reason=f"{len(grads)} of {len(shapes)} gradients")
        key = (msg.epoch, msg.step)
        self._sb_drop(superseded(list(self.sb_log) + list(self.sb_decided), key))
        self.sb_log[key] = grads
        self._sb_tidy()
        return pb.StandbyStepAck(ok=True)

    def _sb_replay(self, stage: int, first: int, last: int) -> int:
        """Load the newest full copy, replay the logged steps, write their checkpoints (CPU work,
        run off the event loop); returns the version reached."""
        base = self._sb_base()
        steps = replay_plan(base, self.sb_log, self.sb_decided)
        if not steps:
            return base
        _, module, opt, scale, *_ = self._make(stage, first, last, base)
        params = dict(module.named_parameters())
        every = max(1, self.spec.ckpt_every)
        for i, key in enumerate(steps):
            grads, d = self.sb_log[key], self.sb_decided[key]
            for name, p in params.items():
                p.grad = grads[name].clone()
            if d.skip:
                opt.zero_grad(set_to_none=True)
            else:
                from shoal.train.optim import apply_update

                apply_update(opt, d.lr, d.coef)
            if d.next_loss_scale > 0:
                scale = d.next_loss_scale
            version = key[1] + 1
            if version % every == 0 or d.checkpoint or i == len(steps) - 1:
                save_stage_ckpt(self.ckpt_root, stage, version, module, opt, run_id=self.spec.run_id,
                                layers=(first, last), loss_scale=scale)
        return steps[-1][1] + 1

    async def standby_promote(self, stage: int, first: int, last: int, version: int, epoch: int) -> None:
        """Promoted: replay the step log into checkpoint files, then load the stage as any server.

        ``self.loading`` is set by the caller, so no heartbeat reports a checkpoint meanwhile.
        """
        try:
            if self.sb_log is not None and stage == self.sb_stage and (first, last) == self.sb_layers:
                base = self._sb_base()
                reached = await asyncio.get_running_loop().run_in_executor(None, self._sb_replay, stage, first, last)
                log.info("%s (%s) promoted to stage %d: full copy v%d, %d logged step(s) replayed -> v%d",
                         self.name, self.copier_label, stage, base, reached - base, reached)
        except Exception as exc:  # noqa: BLE001 - a failed replay leaves the full copy (older, still exact)
            log.error("%s (%s): replaying the step log of stage %d failed (%s); using the full copy",
                      self.name, self.copier_label, stage, exc)
        finally:
            self.sb_log, self.sb_decided, self.sb_stage = None, None, -1
            self.loading = False
        await self._load(stage, first, last, version, epoch)

    # ------------------------------------------------------------ active side
    def standby_stats(self, s: pb.MemberStats) -> None:
        """Dashboard figures: the standbys that logged the last step, and those lagging."""
        s.standby_logging.extend(self.sb_logged)
        s.standby_lagging.extend(sorted(a for a in self.sb_peers if a not in self.sb_logged))

    async def standby_send_step(self, step: int, epoch: int) -> None:
        """Send the step's summed gradient (``p.grad`` of every parameter, as applied) to each
        standby of our stage and wait for their acknowledgements (bounded)."""
        if self.sb_lagging is None:
            self.sb_lagging = {}
        peers = send_to(self.sb_peers, self.sb_lagging, time.monotonic())
        if not peers or self.local:
            self.sb_logged = ()
            return
        msg = pb.StandbyStep(member_id=self.member_id, stage=self.stage, epoch=epoch, step=step,
                             first=self.first, last=self.last)

        def encode() -> bytes:  # a copy of every gradient: off the event loop
            for name, p in self.params.items():
                msg.grads.append(encode_tensor(name, p.grad))
            return msg.SerializeToString()

        data = await asyncio.get_running_loop().run_in_executor(None, encode)
        logged = set(peers)

        async def one(addr: str) -> None:
            try:
                ack = await send(self._stub(addr).StandbyStepStream, msg, self.chunk_bytes, timeout=STANDBY_ACK_S,
                                 traffic=self.traffic, data=data, sender=self.member_id)
                why, timed_out = ("" if ack.ok else ack.reason), False
            except grpc.aio.AioRpcError as exc:
                why, timed_out = exc.code().name, exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if why:
                lag = lag_seconds(timed_out)
                self.sb_lagging[addr] = time.monotonic() + lag
                logged.discard(addr)
                log.warning("%s: standby %s did not log step %d (%s); it lags (full copies only)%s",
                            self.name, addr, step, why, f", skipped for {lag:.0f} s" if lag else "")
            else:
                self.sb_lagging.pop(addr, None)

        await asyncio.gather(*(one(a) for a in peers))
        self.sb_logged = tuple(sorted(logged))


def planned_standby_stages(standbys: list[str], hosts: dict[str, str], plan, scenario, prof) -> dict[str, int]:
    """The stage each of ``standbys`` copies by the planner's placement, where the run has a
    plan on a scenario with hosts (emulated runs); standbys it does not place are left out
    (the caller gives them stages round robin).

    ``plan``: the run's stages with their current active hosts (``StagePlan.server``, a
    scenario host id); ``hosts``: standby -> the scenario host it plays. A round of
    ``len(standbys) // stages`` standbys per stage is placed by
    :func:`shoal.plan.standby.place_standbys` over the hosts that run a standby: each stage's
    on distinct hosts other than its active host, with host memory for the stage's state,
    least loaded first, then the fastest copy path from the active host. A host's standbys
    are used in join order; a host chosen more often than it runs standbys, or a placement
    the planner refuses (too few hosts or too little memory), leaves those standbys out.
    """
    from dataclasses import replace

    from shoal.errors import ShoalError
    from shoal.plan.standby import place_standbys

    stages = len(plan.stages)
    n = len(standbys) // stages if stages else 0
    if n == 0 or any(not hosts.get(mid) for mid in standbys):
        return {}
    run_standby = set(hosts.values())
    sub = replace(scenario, devices=[replace(d, can_host_server=d.id in run_standby) for d in scenario.devices])
    try:
        placed = place_standbys(plan, sub, prof, n)
    except (ShoalError, KeyError, ValueError):
        return {}
    free = {h: [mid for mid in standbys if hosts[mid] == h] for h in run_standby}
    out: dict[str, int] = {}
    for k, hs in enumerate(placed):
        for h in hs:
            if free.get(h):
                out[free[h].pop(0)] = k
    return out
