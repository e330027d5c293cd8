"""Local-update mode (``--sync local``) in the runtime: the stage server's and the worker's parts.

The task pool, relays, leases and the coordinator's per-step decision (learning rate and
global clip coefficient) are those of exact mode. What changes:

* a worker keeps its own replica of its stage and an inner AdamW (shoal.train.optim).
  When the server says ``flush`` it does not push its gradient: it reports the
  micro-batches it covered and the squared norm of its gradient (``local_done``), and
  once the server relays the step's decision (``LeaseReply.local_*``) it takes one inner
  AdamW step with it. A worker that covered no micro-batch of a step takes no step;
* the server counts micro-batches per worker for the round; at the commit of every
  H-th step (and the last) it asks each worker that covered micro-batches in the round
  for its pseudo-gradient (weights at the last merge minus its weights now), merges
  them weighted by micro-batches and applies an outer Nesterov step
  (shoal.train.outer) to its weights, which become the next published version;
* a backward task goes to the worker that ran the micro-batch's forward (its replica
  made that activation); only when that worker is gone does another recompute it.

The pure decisions are small functions here and in shoal.train.outer; the classes are
mixins of :class:`shoal.runtime.roles.server.StageServer` and :class:`shoal.runtime.roles.worker.Worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from shoal.memory import release_free
from shoal.net import shoal_pb2 as pb
from shoal.net.compress import ErrorFeedback
from shoal.net.stream import StreamStalled
from shoal.net.wire import (
    Framed,
    WireError,
    encode_frame,
    message_nbytes,
    message_pieces,
    serialize_framed,
    split_framed,
)
from shoal.plan.compression import DENSE_ROUND_CODEC
from shoal.plan.types import MERGE_THREADS, SCREEN_REF_MBS
from shoal.runtime.common import optim_config, tensors_digest
from shoal.runtime.safety.faults import poison, poisons
from shoal.runtime.sync.codecs import (
    STAGE_FRAME,
    UpdatePulls,
    compression_of_spec,
    dense_round,
    is_stage_frame,
    keeps_residual,
    residual_reweight,
    split_flat,
    split_stage_frame,
    stage_codec,
    stage_frame,
    uses_update_pulls,
)
from shoal.runtime.sync.held import HeldPushes, SpilledPush, default_merge_memory
from shoal.runtime.transport.frames import decode_grads
from shoal.threads import compute_pool
from shoal.train.optim import apply_update, make_optimizer, sq_sum64, total_sq_norm
from shoal.train.outer import (
    is_sync_step,
    merge_weights,
    merges_weights,
    outer_nesterov_step,
    outer_nesterov_update,
    round_closed_by,
    sync_of_spec,
    weighted_sum,
)

log = logging.getLogger("shoal.local")
MOVE_HOLD_IDLE_S = 2.0  # a held move goes ahead after dead_after_s plus this long without a task


def replica_sq_norm(counts_sq: dict[str, tuple[int, float]], micro_batches: int) -> float:
    """The squared gradient norm a stage reports in local mode: each replica's squared norm
    weighted by its share of the step's micro-batches (one replica: exactly its own)."""
    return sum((n / micro_batches) * sq for n, sq in counts_sq.values())


def mean_scale(micro_batches: int, covered: int) -> float:
    """Factor turning a replica's summed gradient (each micro-batch's loss divided by M) into
    the gradient of the mean loss over the micro-batches it covered."""
    return micro_batches / covered


def bwd_owner_free(owner_known: bool, owner_gen_same: bool, owner_alive: bool) -> bool:
    """Whether a backward task may go to a worker other than the one that ran its forward:
    only when that worker is gone (unknown, voided since, or silent)."""
    return not (owner_known and owner_gen_same and owner_alive)


_REF_POOL: ThreadPoolExecutor | None = None


def rebase_replica(params: dict[str, torch.Tensor], merged: dict[str, torch.Tensor],
                   anchor: dict[str, torch.Tensor]) -> None:
    """Delayed application's rebase, in place (pure but for its arguments; tested directly):
    the replica ``params`` moved on from ``anchor`` by its progress ``anchor - params`` (the
    pseudo-gradient it just copied out); it keeps that progress on top of the ``merged``
    weights (``params + (merged - anchor)``, i.e. ``merged - progress``) and the result becomes
    the next anchor (what its push leaves is added to it once framed: :func:`add_residual`)."""
    with torch.no_grad():
        for n, p in params.items():
            a = anchor[n]
            p.add_((merged[n] - a).to(p.device, p.dtype))
            a.copy_(p)


def shift_replica(params: dict[str, torch.Tensor], merged: dict[str, torch.Tensor],
                  anchor: dict[str, torch.Tensor]) -> None:
    """Delayed application mid-round, in place (pure but for its arguments): the replica and its
    anchor both move by ``merged - anchor``, so the anchor becomes the merge and the replica
    the merge less its pseudo-gradient since (``anchor - params``: its progress since the
    round's end and, where its push kept a residual, what the push left, which
    :func:`add_residual` put on the anchor). That is where a merge pulled at the round's end
    leaves a replica (:func:`rebase_replica`; and the steps that wait for the round: the merge
    less what the push left): the replica keeps training on what its push did not carry, and
    the next pseudo-gradient still carries it. (Moving the replica onto the merge plus its
    progress alone, dropping what the push left from its weights, cost ``lowrank`` runs 2-4 %
    of loss at H = 16: bench/results/sparse-sync.md.)"""
    with torch.no_grad():
        for n, p in params.items():
            a = anchor[n]
            d = merged[n] - a
            p.add_(d.to(p.device, p.dtype))
            a.add_(d)


def add_residual(anchor: dict[str, torch.Tensor], left: dict[str, torch.Tensor]) -> None:
    """Put what a push left (keeps_residual) onto a replica's anchor, in place, so that the next
    pseudo-gradient, anchor minus replica, carries it (in a thread)."""
    with torch.no_grad():
        for n, a in anchor.items():
            a.add_(left[n].to(a.device, a.dtype))


def push_decoder(r, params: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """The decoder of a pseudo-gradient push's frames against this stage's ``params``: the same
    tensors at every call (``sparse``/``lowrank`` pushes are one frame of the whole stage)."""
    if is_stage_frame(r.grads):
        return lambda: split_stage_frame(r.grads[0], params, True)
    return lambda: decode_grads(r, params, True)


def released(decode: Callable[[], dict[str, torch.Tensor]], spool) -> Callable[[], dict[str, torch.Tensor]]:
    """``decode`` of a push received into ``spool`` (:class:`shoal.net.stream.Spool`), letting
    go of the file's pages it read once it is done (they stay in the page cache)."""
    def read() -> dict[str, torch.Tensor]:
        try:
            return decode()
        finally:
            spool.release()
    return read


GRADS_FIELD = pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number
DECODE_SLOTS = 2  # pseudo-gradients a server decodes at once on arrival (each a float32 copy of its stage)


def parse_push(data) -> Framed:
    """A push read back from its spilled file (``message_pieces(push, GRADS_FIELD)`` joined; its
    raw frames views of ``data``)."""
    return split_framed(data, pb.GradPush, GRADS_FIELD)


def reference_pool() -> ThreadPoolExecutor:
    """The threads the screen's reference gradients run on (one a micro-batch, at most
    :data:`~shoal.plan.types.SCREEN_REF_MBS`), apart from the event loop's executor so that
    decodes and merges never queue behind them."""
    global _REF_POOL
    if _REF_POOL is None:
        _REF_POOL = compute_pool(SCREEN_REF_MBS, "shoal-reference")
    return _REF_POOL


_MERGE_POOL: ThreadPoolExecutor | None = None


def merge_threads() -> int:
    """Threads a merge runs on: :data:`~shoal.plan.types.MERGE_THREADS`, at most this process's CPUs."""
    from shoal.train.local import cpu_cores

    return max(1, min(MERGE_THREADS, cpu_cores()))


def merge_pool() -> ThreadPoolExecutor:
    """The threads a merge's weighted sum and the screen's norms run on (:func:`merge_threads`;
    the same bits on any number: ``shoal.train.outer.weighted_sum``), apart from the event
    loop's executor, which the merge itself occupies."""
    global _MERGE_POOL
    if _MERGE_POOL is None:
        _MERGE_POOL = compute_pool(merge_threads(), "shoal-merge")
    return _MERGE_POOL


class LocalServerMixin:
    """Stage-server state and handlers of local mode (no effect in exact mode)."""

    local_merged = -1  # until the first load (see _local_reset)
    update_pulls = None  # sparse pulls (UpdatePulls), made at each load
    local_presum = None  # (shares, their weighted sum of the round's pushes) the screen took (_presummed)
    local_presum_taken = False  # the last merge took that sum (logged with it)
    local_decision = None
    local_expect = None
    local_ref_key = None
    local_ref_job = None

    @property
    def local(self) -> bool:
        return self.spec is not None and sync_of_spec(self.spec).local

    def _local_reset(self, version: int) -> None:
        """A (re)load at ``version``: the weights are the merged weights of that version."""
        old = getattr(self, "local_job", None)
        if old is not None and not old.done():
            # a merge of the old epoch in the background: it ends at its next check (None);
            # a failure of it still fails the run
            old.add_done_callback(self._bg_done)
        self.local_merged = version  # version of the merged weights served
        self.local_round_mbs: dict[str, int] = {}  # micro-batches counted per worker this round
        self.local_round_lr: dict[str, float] = {}  # sum of the learning rates of each worker's inner steps this round
        self.local_collect: int | None = None  # version the merge in progress will publish (its round's end + 1)
        self.local_collect_mbs: dict[str, int] = {}  # that round's micro-batches per worker (the merge's counts)
        self.local_collect_lr: dict[str, float] = {}  # that round's learning-rate sums (the screen's)
        self.local_job: asyncio.Future | None = None  # overlap: the merge running while the next round computes
        self.local_wait_since: float | None = None  # when a step began to wait for that merge (monotonic)
        self.local_lr_total: dict[str, float] = {}  # that sum over every earlier round since this load
        self.local_sq: dict[str, tuple[int, float]] = {}  # worker -> (mbs, squared norm) this step
        self.local_sq_parts: dict[str, list[float]] = {}  # worker -> its per-parameter squared norms this step
        self.local_decision: tuple[int, float, float, bool] | None = None  # (step, lr, coef, skip)
        self.local_expect: set[str] | None = None  # workers whose pseudo-gradient the merge awaits
        self.local_got = self._new_round_pushes()  # pseudo-gradients received
        self.local_ref_key: tuple[int, int] | None = None  # (epoch, merged version) of the reference gradient started
        self.local_ref_job: asyncio.Future | None = None  # that gradient: (grads, step, tokens, seconds)
        self.local_ref_inputs: tuple | None = None  # (epoch, step, inputs, tokens) of a round's first step, kept for it
        if not hasattr(self, "median_secret"):  # seeds the screen's coordinate sample of a large stage
            self.median_secret = secrets.randbits(62)
        self.local_replicas: dict[str, dict[str, torch.Tensor]] = {}  # replicas' weights received (merges_weights)
        self.outer_m: dict[str, torch.Tensor] = {}  # outer Nesterov momentum (checkpointed with the merged weights)
        self.local_ckpt_last = version
        self._replica_reset()  # replica plans: no peer's part yet (shoal.runtime.sync.replicas)
        # Sparse pulls: the merges' encoded updates (a fresh chain and residual at every load).
        self.update_pulls = UpdatePulls(compression_of_spec(self.spec).pull) if uses_update_pulls(self.spec) else None

    def _new_round_pushes(self) -> HeldPushes:
        """An empty round of held pseudo-gradients, within this server's ``merge_memory``."""
        budget = getattr(self, "merge_memory", None)
        return HeldPushes(default_merge_memory() if budget is None else budget)

    def _decode_slots(self) -> asyncio.Semaphore:
        """Pseudo-gradients decoded at once as they arrive (:data:`DECODE_SLOTS`): each is the
        whole stage in float32 until it is held or dropped, and a round's pushes may all arrive
        together."""
        slots = getattr(self, "_decode_sem", None)
        if slots is None:
            slots = self._decode_sem = asyncio.Semaphore(DECODE_SLOTS)
        return slots

    def _pushes_folder(self) -> Path:
        """Where this server writes pseudo-gradients beyond its merge memory (its checkpoints'
        disk); what an earlier process of its name left there goes at the first use."""
        folder = Path(getattr(self, "ckpt_root", "") or tempfile.gettempdir()) / "pushes" / self.name
        if not getattr(self, "_pushes_swept", False):
            shutil.rmtree(folder, ignore_errors=True)
            self._pushes_swept = True
        return folder

    def published_version(self) -> int:
        """Version label of the weights this server serves (local: the last merge)."""
        return self.local_merged if self.local else self.version

    def _local_bwd_ok(self, st, wid: str) -> bool:
        """Local mode: a backward task waits for the worker that ran its forward, while it lives."""
        if not self.local or self.is_last or not st.fwd_by or st.fwd_by == wid:
            return True
        owner = self.workers.get(st.fwd_by)
        alive = owner is not None and time.monotonic() - owner.last_seen <= self.spec.dead_after_s
        return bwd_owner_free(owner is not None, owner is not None and owner.gen == st.fwd_gen, alive)

    def _local_forget(self, wid: str) -> None:
        """A voided worker loses its un-merged progress: it drops out of the round in progress
        and out of the merge being collected.

        Unless its pseudo-gradient for that merge is already in: that progress is delivered
        (a worker moved to another stage at the round's end leaves right after sending it),
        so its micro-batch count and learning-rate sum stay for the merge to weigh it.
        """
        if not self.local or not hasattr(self, "local_round_mbs"):
            return
        self.local_round_mbs.pop(wid, None)
        self.local_round_lr.pop(wid, None)
        self.local_sq.pop(wid, None)
        self.local_sq_parts.pop(wid, None)
        if wid not in self.local_got:
            self.local_collect_mbs.pop(wid, None)
            self.local_collect_lr.pop(wid, None)
            if self.local_expect is not None:
                self.local_expect.discard(wid)

    def _local_wants(self, wid: str) -> bool:
        """Whether the merge awaits ``wid``'s pseudo-gradient (wakes its long-poll)."""
        return (self.local and self.local_expect is not None and wid in self.local_expect
                and wid not in self.local_got)

    def _local_fill(self, reply: pb.LeaseReply, wid: str) -> None:
        """The local-mode fields of a lease reply: the newest decision, sync request, merged version."""
        if not self.local:
            return
        reply.local_merged = self.local_merged
        reply.local_step = -1
        if self.local_decision is not None:
            reply.local_step, reply.local_lr, reply.local_coef, reply.local_skip = self.local_decision
        reply.local_sync = self._local_wants(wid)

    def _local_sq_norm(self) -> float:
        return replica_sq_norm(self.local_sq, self.spec.micro_batches)

    def _local_sq_parts(self) -> list[float]:
        """Per-parameter squared norms for the coordinator's exact sum: those of the one replica
        that covered all the step's micro-batches (its norm is then the stage's); else none."""
        if len(self.local_sq) != 1:
            return []
        (w, (n, _)), = self.local_sq.items()
        return self.local_sq_parts.get(w, []) if n == self.spec.micro_batches else []

    async def _local_push(self, r: pb.GradPush, info) -> pb.PushReply:
        """A ``local_done`` report or a pseudo-gradient (``local_round``) from a worker."""
        if r.local_round:
            return await self._local_pseudo(r, info)
        mbs = self.steps.get(r.step, {})
        ids = list(r.mbs)
        identity = (r.worker, r.epoch, r.step, r.gen, tuple(ids))
        if ids and identity in self.pushed:
            return pb.PushReply(accepted=True, reason="duplicate of a counted report", gen=info.gen)
        if r.worker in self.guard_banned:
            return pb.PushReply(accepted=False, reason=f"banned: {self.guard_banned[r.worker]}", gen=info.gen)
        if r.epoch != self.epoch or r.step != self.step or r.gen != info.gen:
            return pb.PushReply(accepted=False, reason="stale report (step, epoch or generation)", gen=info.gen)
        ok = (ids and len(ids) == len(set(ids)) and math.isfinite(r.local_sq_norm) and r.local_sq_norm >= 0
              and all(math.isfinite(x) and x >= 0 for x in r.local_param_sq)
              and all(mb in mbs and mbs[mb].grad == "computed" and mbs[mb].holder == r.worker for mb in ids))
        if not ok:
            self._void_worker(r.worker, "bad local report (micro-batches not held or bad norm)")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason="report covers micro-batches not held", gen=info.gen)
        self.pushed.add(identity)
        n_before = self.local_sq.get(r.worker, (0, 0.0))[0]
        # The worker's norm covers everything it holds of the step (a second report adds mbs).
        self.local_sq[r.worker] = (n_before + len(ids), float(r.local_sq_norm))
        self.local_sq_parts[r.worker] = list(r.local_param_sq)
        self.local_round_mbs[r.worker] = self.local_round_mbs.get(r.worker, 0) + len(ids)
        return await self._count(mbs, ids, info)

    async def _local_pseudo(self, r: pb.GradPush, info) -> pb.PushReply:
        round_v = self.local_collect
        if r.worker in self.guard_banned:
            return pb.PushReply(accepted=False, reason=f"banned: {self.guard_banned[r.worker]}", gen=info.gen)
        if r.epoch == self.epoch and r.local_round == round_v and r.worker in self.local_got:
            return pb.PushReply(accepted=True, reason="duplicate pseudo-gradient", gen=info.gen)
        if r.epoch != self.epoch or r.local_round != round_v or not self._local_wants(r.worker):
            return pb.PushReply(accepted=False, reason="no merge awaits this pseudo-gradient; pull the "
                                                       "merged weights", gen=info.gen)
        if r.local_withdraw:
            await self._local_withdraw(r.worker, round_v, "it could not send its pseudo-gradient")
            return pb.PushReply(accepted=True, reason="withdrawn from the merge", gen=info.gen)

        params = dict(self.params)
        decode = push_decoder(r, params)
        spool = getattr(r, "spool", None)  # the file it was received into, if any
        if spool is not None:
            decode = released(decode, spool)
        wire = message_nbytes(r)
        # Large frames the merge memory does not hold go to disk (shoal.runtime.sync.held).
        spill = not r.local_weights and self.local_got.should_spill(4 * sum(p.numel() for p in params.values()), wire)
        folder = self._pushes_folder()

        def check():
            deltas = decode()
            if not spill:
                return deltas, None
            if spool is not None:  # on disk already
                return deltas, SpilledPush(decode)
            try:
                return deltas, SpilledPush.written(message_pieces(r, GRADS_FIELD),
                                                   lambda data: push_decoder(parse_push(data), params)(),
                                           folder)
            except OSError as exc:  # (a full or read-only disk: held in memory, as before)
                log.warning("%s keeps %s's pseudo-gradient in memory: cannot write it to %s: %s", self.name,
                            r.worker, folder, exc)
                return deltas, None

        try:
            async with self._decode_slots():
                deltas, spilled = await asyncio.get_running_loop().run_in_executor(None, check)
        except WireError as exc:
            log.warning("%s rejected a pseudo-gradient of %s: %s", self.name, r.worker, exc)
            self._void_worker(r.worker, f"bad pseudo-gradient: {exc}")
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        except Exception as exc:  # (a fault of this server's, not the push's: said, and the merge goes on)
            log.error("%s could not take %s's pseudo-gradient for v%d", self.name, r.worker, round_v,
                      exc_info=True)
            await self._local_withdraw(r.worker, round_v, f"this server could not take it: {exc!r}")
            return pb.PushReply(accepted=False, reason=f"the server could not take it ({exc!r}); pull the "
                                                       "merged weights", gen=info.gen)
        if r.epoch != self.epoch or r.local_round != self.local_collect or not self._local_wants(r.worker):
            return pb.PushReply(accepted=False, reason="the merge moved on while it was checked", gen=info.gen)
        # The worker's own count can only lower the server's: a worker that missed a step's
        # decision dropped that gradient (its replica never took the step), so it covered
        # fewer micro-batches than it reported; one that covered none has nothing to merge
        # (a zero pseudo-gradient, not a suspect one).
        covered = min(self.local_collect_mbs.get(r.worker, 0), max(0, int(r.local_mbs)))
        self.local_collect_mbs[r.worker] = covered
        if covered == 0:
            if self.local_expect is not None:
                self.local_expect.discard(r.worker)
            async with self.cond:
                self.cond.notify_all()
            return pb.PushReply(accepted=True, reason="covers no micro-batch: nothing to merge", gen=info.gen)
        if r.local_weights:
            # The replica's weights: the merge averages them; the screen judges anchor minus them,
            # the pseudo-gradient the worker would have sent.
            self.local_replicas[r.worker] = deltas
            deltas = await asyncio.get_running_loop().run_in_executor(None, self._anchor_minus, deltas)
            self.local_got.put(r.worker, deltas)
        else:
            # beyond the server's merge memory, kept as its frames (in memory or on disk) and
            # decoded again where read
            self.local_got.put(r.worker, deltas, decode, wire, spilled)
        del deltas
        async with self.cond:
            self.cond.notify_all()
        return pb.PushReply(accepted=True, gen=info.gen)

    async def _local_withdraw(self, wid: str, round_v: int, why: str) -> None:
        """The merge of ``round_v`` stops waiting for ``wid``'s pseudo-gradient, which will not
        come (the worker resyncs from the merged weights; it is neither voided nor banned):
        instead of the flush grace, the merge goes on at once without it."""
        if self.local_expect is not None and wid in self.local_expect and wid not in self.local_got:
            self.local_expect.discard(wid)
            log.warning("%s: %s withdrew from the merge of v%d: %s", self.name, wid, round_v, why)
        async with self.cond:
            self.cond.notify_all()

    @property
    def local_overlap(self) -> bool:
        """Delayed application: a round's merge runs while the next round's steps compute."""
        return sync_of_spec(self.spec).overlap

    async def _local_commit(self, step: int, epoch: int, d: pb.StepDecision) -> bool | None:
        """After the coordinator's decision: publish it to the workers and, at the end of a
        round, collect the round's pseudo-gradients and merge them (:meth:`_local_round`).

        Without overlap the step waits for that merge. With overlap (delayed application) it
        first waits for the previous round's merge, started at the last round's end and run
        while this round computed, so the workers find those merged weights published with
        this decision; this round's merge then runs in the background while the next round
        computes (the run's last round is merged before its step ends). True: merged weights
        were published at this commit; False: none; None: the epoch moved on."""
        sync_step = is_sync_step(step, self.spec.sync_every, self.spec.steps)
        published = False
        if sync_step and self.local_overlap and self.local_job is not None:
            job, self.local_job = self.local_job, None
            t0 = time.perf_counter()
            self.local_wait_since = time.monotonic()  # (the flush grace runs from here: _local_round)
            published = await job
            if published is None or self.epoch != epoch:
                return None
            waited = time.perf_counter() - t0
            if waited > 0.001:
                log.info("%s: the commit of step %d waited %.3f s for the merge of v%d (it outlasted the round after it)",
                         self.name, step, waited, self.local_merged)
        self.local_decision = (step, d.lr, d.coef, bool(d.skip))
        if not d.skip:
            # every worker that reported micro-batches of this step takes an inner step at d.lr
            for w in self.local_sq:
                self.local_round_lr[w] = self.local_round_lr.get(w, 0.0) + d.lr
        self.local_sq = {}
        self.local_sq_parts = {}
        self._local_reference_keep(step, epoch)  # (a round's first step)
        if not sync_step:
            return False
        # The round's counts move to the merge; the next round counts afresh meanwhile.
        self.local_collect = step + 1
        self.local_collect_mbs, self.local_round_mbs = self.local_round_mbs, {}
        self.local_collect_lr, self.local_round_lr = self.local_round_lr, {}
        self.local_expect = {w for w, n in self.local_collect_mbs.items() if n > 0}
        self.local_got = self._new_round_pushes()
        self.local_replicas = {}
        async with self.cond:
            self.cond.notify_all()
        job = asyncio.ensure_future(self._local_round(step, epoch))
        if not self.local_overlap or step + 1 >= self.spec.steps:
            self.local_wait_since = time.monotonic()
            return await job
        self.local_wait_since = None
        self.local_job = job
        return published

    async def _local_round(self, step: int, epoch: int) -> bool | None:
        """Collect the pseudo-gradients of the round that ends at ``step``, screen them and
        merge them into the weights, published as version ``step + 1``. True: merged; None:
        the epoch moved on.

        A worker whose pseudo-gradient has not come within the flush grace of a step waiting for
        this merge is voided (a dead one is voided sooner, by the reaper): with delayed
        application none waits before the next round's end, so a push may take that long
        (framed and sent beside the next round's compute)."""
        while self.local_expect - set(self.local_got):
            if self.epoch != epoch:
                return None
            since = self.local_wait_since
            if since is not None and time.monotonic() - since > self.flush_grace_s:
                for wid in sorted(self.local_expect - set(self.local_got)):
                    self._void_worker(wid, f"sent no pseudo-gradient {self.flush_grace_s:.0f} s into the merge")
                break
            await self.cond.wait(0.5)
        if self.epoch != epoch:
            return None
        framed = self.local_got.framed  # pushes held as frames (over the merge memory)
        spilled = self.local_got.spilled  # of which on disk (large frames)
        spooled = self.local_got.spooled  # of which received into a file (not written again)
        # the screen and the merge (cost.merge_cpu_time prices them; a replica plan waits for its peers too)
        merge_t0 = time.perf_counter()
        self.local_presum_taken = False
        screened = await self._local_screen(step)
        if self.epoch != epoch:
            return None
        await self._ckpt_written()  # (overlap: the last commit's file holds the weights merged before)
        if self.epoch != epoch:
            return None
        counts = {w: self.local_collect_mbs.get(w, 0) for w in self.local_got}
        replicas = None
        if self.spec.replica_stages:
            # A replica plan: this stage's part, merged per layer with the other replicas' parts.
            merged = await self._replica_merge(counts, step + 1, epoch)
            if merged is None:
                return None
            digest, replicas = merged
            shares = merge_weights({w: counts.get(w, 0) for w in self.local_got})
        else:
            async with self._wlock:
                if self.epoch != epoch:
                    return None
                digest, shares = await asyncio.get_running_loop().run_in_executor(None, self._local_merge, counts,
                                                                                  step + 1)
                self._wcache = None
                self.local_merged = step + 1
        log.info("%s local merge %s", self.name, json.dumps({
            "stage": self.stage, "version": step + 1, "epoch": epoch, "contributors": counts,
            "shares": {w: round(x, 9) for w, x in shares.items()}, "digest": digest, "screen": screened,
            "screen_sum": self.local_presum_taken,
            **({"framed": framed} if framed else {}), **({"spilled": spilled} if spilled else {}),
            **({"spooled": spooled} if spooled else {}),
            "merge_s": round(time.perf_counter() - merge_t0, 4),
            **({"overlap": True} if self.local_overlap else {}),
            **({"replicas": replicas} if replicas is not None else {})}, sort_keys=True))
        self._local_reference_start(epoch)  # (delayed application: the next round's first step may be in)
        for w, x in self.local_collect_lr.items():
            self.local_lr_total[w] = self.local_lr_total.get(w, 0.0) + x
        self.local_collect_mbs = {}
        self.local_collect_lr = {}
        self.local_expect = None
        self.local_got = self._new_round_pushes()
        self.local_replicas = {}
        await asyncio.get_running_loop().run_in_executor(None, release_free)  # (the merge's copies, freed in threads)
        async with self.cond:
            self.cond.notify_all()
        return True

    async def _local_screen(self, step: int) -> dict[str, list]:
        """Screen the round's pseudo-gradients (shoal.runtime.safety.guard.screen_round) before the
        merge: a contributor that fails is banned and its pseudo-gradient left out.

        Returns each contributor's [norm per unit of learning rate, cosine to the round's
        median] for the merge's log line (the figures honest runs are judged by).
        """
        self.local_presum = None
        if not self.guard_cfg.enabled or not self.local_got:
            return {}
        from shoal.runtime.safety.guard import direction_holds, round_verdict
        from shoal.runtime.safety.verify import screen_measures

        lrs = {w: self.local_collect_lr.get(w, 0.0) for w in self.local_got}
        # The run's last round where replicas keep their residuals (dense_round) carries what
        # every earlier round left: its norms are per unit of the learning rate since the
        # worker's first round here, judged by the AdamW bound over that and by the round
        # itself, never by the sparse rounds' history (a sent 1 % is a few per cent of the norm).
        dense = dense_round(step + 1, self.spec.steps, compression_of_spec(self.spec).push)
        per = {w: x + self.local_lr_total.get(w, 0.0) for w, x in lrs.items()} if dense else lrs
        # the reference gradient first (it ran during the round), so that one read of each push
        # gives its norm, its sample for the median, its cosine to the reference gradient and,
        # with the round's shares, its term of the merge's weighted sum (kept for the merge
        # where the screen leaves every contributor in: _presummed)
        ref = await self._local_reference(step, lrs)
        shares = merge_weights({w: self.local_collect_mbs.get(w, 0) for w in self.local_got})
        norms, cosines, ref_cos, summed = await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(screen_measures, self.local_got.snapshot(), per, self.guard_cfg.local_quorum,
                                    ref=ref, sum_weights=shares, seed=self.median_secret ^ step, pool=merge_pool()))
        self.local_presum = (tuple(shares.items()), summed) if summed is not None else None
        refs = {w: c for w, c in ref_cos.items() if lrs.get(w, 0.0) > 0}
        history = [] if dense else getattr(self, "local_guard_norms", [])
        bound = await asyncio.get_running_loop().run_in_executor(None, self._local_move_bound, dense)
        bounds = {w: bound for w in norms if bound is not None and per.get(w, 0.0) > 0}
        if bound is not None:
            log.info("%s round screen: AdamW move bound %.6g per unit of learning rate (x%g flags)", self.name,
                     bound, self.guard_cfg.local_bound_margin)
        n_params = sum(p.numel() for p in self.params.values())
        # (sparse and lowrank pushes carry what earlier rounds left: a norm flag below a quorum
        # holds one out, and bans at the worker's strikes_to_ban-th flagged round in a row)
        strikes = getattr(self, "local_norm_strikes", {})
        carried = keeps_residual(compression_of_spec(self.spec).push) and not dense
        bans, norm_held = round_verdict(norms, cosines, history, self.guard_cfg, bounds, refs, n_params,
                                        carried=carried, strikes=strikes)
        self.local_norm_strikes = {**{w: n for w, n in strikes.items() if w not in norms},
                                   **{w: strikes.get(w, 0) + 1 for w in norm_held}}
        for wid, why in sorted(bans.items()):
            self.local_got.pop(wid, None)
            async with self.cond:
                self._guard_ban(wid, step, why)
        held = {**norm_held, **direction_holds(refs, len(norms), self.guard_cfg, n_params, banned=bans)}
        for wid, why in sorted(held.items()):
            self.local_got.pop(wid, None)
            log.info("%s holds %s's pseudo-gradient out of the merge of step %d: %s", self.name, wid, step, why)
        honest = [norms[w] for w in sorted(norms) if w not in bans and w not in held]
        if not dense:
            self.local_guard_norms = (history + honest)[-self.guard_cfg.history:]
        return {w: [round(norms[w], 8), None if cosines[w] is None else round(cosines[w], 4),
                    None if refs.get(w) is None else round(refs[w], 4)] for w in norms}

    def _local_reference_keep(self, step: int, epoch: int) -> None:
        """At the commit of a round's first step, keep its micro-batches for the screen's
        reference gradient, and start it if that round's starting merge is published
        (:meth:`_local_reference_start`)."""
        cfg = self.guard_cfg
        if not cfg.enabled or cfg.local_ref_mbs <= 0 or cfg.local_ref_tokens <= 0:
            return
        if not (step == 0 or step == self.local_merged or is_sync_step(step - 1, self.spec.sync_every, self.spec.steps)):
            return
        from shoal.runtime.safety.verify import reference_inputs

        mbs = self.steps.get(step, {})
        held = [(mb, st.input, st.out_grad) for mb, st in sorted(mbs.items())
                if (self.is_first or st.input is not None) and (self.is_last or st.out_grad is not None)]
        inputs = reference_inputs(held, self.spec.micro_batch_size, self.spec.seq_len, cfg.local_ref_mbs,
                                  cfg.local_ref_tokens)
        if inputs:
            tokens = sum(self.spec.micro_batch_size * (self.spec.seq_len if p is None else p) for *_, p in inputs)
            self.local_ref_inputs = (epoch, step, inputs, tokens)
        self._local_reference_start(epoch)

    def _local_reference_start(self, epoch: int) -> None:
        """Start the screen's reference gradient at merged version ``v`` on step ``v``'s
        micro-batches (the first step of the round that starts from those weights, kept by
        :meth:`_local_reference_keep`) once both are there: at that step's commit, or with
        delayed application where the merge is published later, at its publication. It runs
        in threads while the round's other steps run (the weights change only at the next
        merge, which waits for it; a load changes the epoch and its result is dropped). The
        round's first step, not the one just merged, which the merged weights have learned
        (honest replicas' cosines to its gradient fall to about 0), nor the round's last,
        which the replicas took far from those weights (-0.06..0.11 on the demo scenario
        against 0.02..0.2 on its first step). The planner prices it
        (``shoal.plan.cost.reference_cpu_time``)."""
        kept, key = self.local_ref_inputs, (epoch, self.local_merged)
        if kept is None or kept[:2] != key or self.local_ref_key == key:
            return
        from shoal.runtime.safety.verify import reference_gradient

        _, step, inputs, tokens = kept
        self.local_ref_inputs = None

        def reference() -> dict[str, torch.Tensor]:
            # one thread a micro-batch, summed as autograd makes each parameter's gradient
            ref = reference_gradient(self.module, self.spec, step, inputs, first=self.is_first, last=self.is_last,
                                     pool=reference_pool())
            release_free()  # (what the threads' autograd freed, kept in their malloc arenas)
            return ref

        async def run():
            t0 = time.perf_counter()
            ref = await asyncio.get_running_loop().run_in_executor(None, reference)
            return ref, step, tokens, time.perf_counter() - t0

        self.local_ref_key = key
        self.local_ref_job = asyncio.ensure_future(run())

    async def _local_reference(self, step: int, lrs: dict[str, float]) -> dict[str, torch.Tensor] | None:
        """This server's own gradient at the round's starting weights, for each contributor's
        cosine to it (:func:`shoal.runtime.safety.verify.screen_measures`; from
        :meth:`_local_reference_start`, awaited here); None when off or when no contributor
        took an inner step. Also with a quorum: colluders that are most of a round set its
        median, not this gradient."""
        if not any(lrs.get(w, 0.0) > 0 for w in self.local_got):
            return None
        self._local_reference_start(self.epoch)  # (delayed application: a merge published just now)
        job = self.local_ref_job
        if job is None or self.local_ref_key != (self.epoch, self.local_merged):
            return None
        t0 = time.perf_counter()
        ref, ref_step, tokens, took = await job
        # read once, by this round's screen: not kept through the merge (a float32 copy of the stage)
        self.local_ref_job = None
        waited = time.perf_counter() - t0
        log.info("%s screen's reference gradient: step %d, %d tokens, %.3f s in threads (the merge waited %.3f s)",
                 self.name, ref_step, tokens, took, waited)
        return ref

    def _local_move_bound(self, dense: bool = False) -> float | None:
        """How far inner AdamW steps can move this stage per unit of learning rate
        (:func:`shoal.runtime.safety.guard.adamw_move_bound`, on the merged weights the round started
        from); None where pushes are top-k (error feedback carries residuals across rounds) unless
        ``dense`` (the last round of kept residuals, judged per unit of the lr of every round)."""
        from shoal.runtime.safety.guard import adamw_move_bound
        from shoal.runtime.safety.verify import sq_norm
        from shoal.runtime.sync.codecs import compression_of_spec

        # (a pass over the stage's weights: runs in a thread)
        if not dense and compression_of_spec(self.spec).wire("push").startswith(("topk", "sparse", "lowrank")):
            return None
        cfg = optim_config(self.spec)  # the workers' inner AdamW
        weights = {name: p.detach() for name, p in self.params.items()}
        n = sum(t.numel() for t in weights.values())
        return adamw_move_bound(n, math.sqrt(sq_norm(weights)), cfg.weight_decay, cfg.beta1, cfg.beta2)

    def _anchor_minus(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pseudo-gradient of a replica's weights: the merged weights minus them (in a thread)."""
        return {n: self.params[n].detach() - w for n, w in weights.items()}

    def _presummed(self, shares: dict[str, float]) -> dict[str, torch.Tensor] | None:
        """The weighted sum the screen took of this round's pushes with exactly ``shares`` (the
        same bits as :func:`shoal.train.outer.weighted_sum`; None: another set of contributors or
        shares, e.g. after a ban). Taken once."""
        pre, self.local_presum = self.local_presum, None
        self.local_presum_taken = pre is not None and pre[0] == tuple(shares.items())
        return pre[1] if self.local_presum_taken else None

    def _local_merge(self, counts: dict[str, int], version: int) -> tuple[str, dict[str, float]]:
        """Merge the received pseudo-gradients into the weights (in a thread): the merged
        weights' digest and the share each contributor was weighted by in the sum (its
        micro-batches over the round's: logged with the merge, checked on real swarms).

        With sparse pulls the weights move by the encoded update the workers will pull
        (:class:`shoal.runtime.sync.codecs.UpdatePulls`), not by the exact outer step."""
        shares = merge_weights({w: counts.get(w, 0) for w in self.local_got})
        delta = self._presummed(shares)
        if delta is None:
            delta = weighted_sum(self.local_got, shares, merge_pool())
        # The run's last round is dense (dense_round): merged exactly, then what the pulls still owe.
        last = self.update_pulls is not None and dense_round(version, self.spec.steps,
                                                             compression_of_spec(self.spec).push)
        if self.update_pulls is not None and not last:
            update = None if delta is None else outer_nesterov_update(
                delta, self.outer_m, self.spec.outer_lr, self.spec.outer_momentum)
            delta = None  # (a copy of the stage the pull's encode need not sit beside)
            self.update_pulls.merge({n: p.data for n, p in self.params.items()}, update,
                                    (self.local_merged, self.epoch, self.stage), (version, self.epoch, self.stage),
                                    self.first, self.last)
        elif (delta is not None and merges_weights(self.spec.outer_lr, self.spec.outer_momentum)
              and set(self.local_got) <= set(self.local_replicas)):
            # the replicas' weighted mean itself: one replica's weights bit for bit
            mean = weighted_sum({w: self.local_replicas[w] for w in shares}, shares, merge_pool())
            with torch.no_grad():
                for n, p in self.params.items():
                    p.data.copy_(mean[n])
        elif delta is not None:
            outer_nesterov_step({n: p.data for n, p in self.params.items()}, delta, self.outer_m,
                                self.spec.outer_lr, self.spec.outer_momentum)
        if last:
            self.update_pulls.flush({n: p.data for n, p in self.params.items()})
        return tensors_digest({n: p.detach() for n, p in self.params.items()}), shares

    def _local_ckpt_due(self, merged: bool, decided: bool = False) -> bool:
        """Local mode checkpoints merged weights only, at the first merge past each K steps
        and at the merges the coordinator's time rule marks (``decided``)."""
        k, v = self.spec.ckpt_every, self.local_merged
        if not merged or k <= 0 or (v // k <= self.local_ckpt_last // k and not decided):
            return False
        self.local_ckpt_last = v
        return True


class LocalWorkerMixin:
    """Worker state and steps of local mode (no effect in exact mode)."""

    @property
    def local(self) -> bool:
        return sync_of_spec(self.spec).local

    @property
    def lean(self) -> bool:
        """A lean worker (``--lean-workers``): backward sums the step's gradients in ``.grad``
        and the inner AdamW keeps bf16 moments (shoal.runtime.sync.lean)."""
        return self.local and sync_of_spec(self.spec).lean and not self.opts.shadow

    @property
    def local_overlap(self) -> bool:
        """Delayed application: the replica moves onto a merge while the next round computes."""
        return sync_of_spec(self.spec).overlap

    def _local_reset(self) -> None:
        """A new stage: a fresh inner AdamW over the replica; nothing pending."""
        self.inner_opt = (make_optimizer(self.module.named_parameters(), optim_config(self.spec),
                                         moments="bf16" if self.lean else "fp32") if self.local else None)
        if self.lean:
            log.info("%s is a lean worker: bf16 inner AdamW moments, each step's gradients summed by backward in "
                     "the order its tasks come (12 bytes a parameter)", self.opts.name)
        self.anchor: dict[str, torch.Tensor] = {}  # the weights the replica started the round from (host memory)
        self.local_round_mbs = 0  # micro-batches applied to the replica since the anchor
        self.local_reported = 0  # micro-batches the server counted for it since then (some may have missed their step)
        self.pending: tuple[int, int, dict[str, torch.Tensor], int] | None = None  # (epoch, step, sum, mbs)
        self.local_gen: int | None = None  # server generation the replica belongs to
        self.local_sent: tuple[int, int] | None = None  # (epoch, round) of the last pseudo-gradient sent
        self.local_delivered = False  # the round's pseudo-gradient was taken (until the merged weights are pulled)
        # Compressed pseudo-gradients: what a round's push did not carry goes with the next one.
        push = compression_of_spec(self.spec).wire("push") if self.local else "raw"
        self.pseudo_ef = ErrorFeedback(push) if push != "raw" else None
        # keeps_residual: (epoch, round, {name: tensor}, micro-batches) the last push did not
        # carry and the micro-batches of its round, taken off the replica when it pulls that
        # round's merge
        self.pseudo_kept: tuple[int, int, dict[str, torch.Tensor], int] | None = None
        # (micro-batches, {name: tensor}): the kept residual this round's replica carries, for
        # its push to re-weight to the share it was made at (residual_reweight)
        self.pseudo_carried: tuple[int, dict[str, torch.Tensor]] | None = None
        self.pseudo_reweight = 1.0  # the factor the last push re-weighted its kept residual by
        # Delayed application (overlap): the merged weights pulled last, in host memory (the base
        # of the next pull's delta), and the last round closed, as (epoch, version).
        self.merged: dict[str, torch.Tensor] = {}
        self.local_closed: tuple[int, int] | None = None
        self.local_applied: tuple[int, int] | None = None  # (epoch, version) of a merge applied mid-round
        self.local_sending: asyncio.Future | None = None  # a closed round's pseudo-gradient on its way
        self.local_fetch: asyncio.Future | None = None  # a merge published mid-round, pulled in the background
        self.local_framing: asyncio.Future | None = None  # done once the last pseudo-gradient sent is framed
        self.local_close_t0 = 0.0  # when the round being closed began to close (perf_counter)

    def _hold_move(self) -> bool:
        """Whether to keep training on the current stage instead of moving to ``self.want`` now.

        Local mode only: a worker moved mid-round would drop its replica's un-merged progress
        (a re-plan after a join or a death moves live workers), so while it holds some, it
        stays until its round's pseudo-gradient is sent and the merged weights pulled, then
        moves. It goes at once when the coordinator says no other worker is at work on the
        wanted stage (``Assignment.move_now``: a round cannot end without that stage), when its
        own stage's server changed, and once its stage has had no task for it for
        ``dead_after_s + MOVE_HOLD_IDLE_S`` (a backstop: tasks pinned to a worker that died
        come back after ``dead_after_s``, its death noticed).
        """
        want = self.want
        hold = (self.local and want is not None and self.stage >= 0 and want[0] != self.stage and not self.move_now
                and (self.local_round_mbs > 0 or self.pending is not None) and not self.local_delivered
                and self.stage < len(self.servers_seen) and self.servers_seen[self.stage] == self.server_addr
                and time.monotonic() - self.last_task_t < self.spec.dead_after_s + MOVE_HOLD_IDLE_S)
        if hold and self.move_held != want:
            log.info("%s holds its move to stage %d until its round's pseudo-gradient is sent "
                     "(%d micro-batches not merged yet)", self.opts.name, want[0], self.local_round_mbs)
        self.move_held = want if hold else None
        return hold

    def _local_check_gen(self, rep: pb.LeaseReply) -> None:
        """Voided by the server (or a roll-back): the replica's un-merged progress is dropped."""
        if self.local_gen is not None and rep.gen != self.local_gen:
            log.info("%s: voided by the server; dropping the replica's un-merged progress", self.opts.name)
            self.version = -1
            self.pending = None
            self.pseudo_kept = self.pseudo_carried = None
            if self.pseudo_ef is not None:
                self.pseudo_ef.reset()
        self.local_gen = rep.gen

    def _local_needs_pull(self, rep: pb.LeaseReply, task: pb.Task) -> bool:
        """Whether the replica starts over from the merged weights before ``task``: without
        overlap at every new merge; with overlap only when it holds none of this epoch (a
        joiner, a resync, a roll-back): merges otherwise reach it mid-round or at its rounds' ends."""
        if self.local_overlap:
            return self.version < 0 or self.weights_epoch != task.epoch
        return self.version < 0 or self.version != rep.local_merged or self.weights_epoch != task.epoch

    async def _local_pull(self) -> None:
        """Pull the merged weights; they become the anchor of the replica's round."""
        await self._pull()
        # Copied and hashed in a thread: a whole stage (hundreds of MB at gpt-125m) held the
        # event loop, and with it the heartbeats, for 0.3-0.5 s on a loaded 2-core box.
        copies = await asyncio.get_running_loop().run_in_executor(None, self._anchor_copies)
        self._local_restart(*copies)

    def _anchor_copies(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, str]:
        """Host copies of the weights just pulled (the anchor, and with overlap the merged weights)
        and their digest (pure but for reading the parameters; runs in a thread)."""
        # (in host memory: a device holds the replica, its gradients and its AdamW state, which is
        # what the planner's memory need counts, shoal.plan.cost.stage_worker_memory)
        anchor = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        merged = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()} if self.local_overlap else None
        return anchor, merged, tensors_digest(anchor)

    def _local_restart(self, anchor: dict[str, torch.Tensor], merged: dict[str, torch.Tensor] | None,
                       digest: str) -> None:
        """The weights just pulled (``anchor``: :meth:`_anchor_copies`) become the anchor of the
        replica's round; the replica keeps what its push for that merge did not carry (keeps_residual)."""
        self.anchor = anchor
        self.local_reported = 0
        if merged is not None:
            self.merged = merged
        self.local_round_mbs = 0
        self.local_delivered = False
        self.pending = None
        log.info("%s pulled merged weights v%d digest %s", self.opts.name, self.version, digest)
        kept, self.pseudo_kept = self.pseudo_kept, None
        self.pseudo_carried = None
        if kept is not None and kept[:2] == (self.weights_epoch, self.version):
            # the merge of the round it pushed for: the replica keeps what that push did not carry
            with torch.no_grad():
                for n, p in self.params.items():
                    p.sub_(kept[2][n].to(p.device, p.dtype))
            self.pseudo_carried = (kept[3], kept[2])
            self.graphs.clear()  # graphs of the weights as pulled

    def _local_sum(self) -> tuple[dict[str, torch.Tensor], int]:
        """The accumulated gradient of the step in micro-batch order (plus any earlier report)."""
        # (ordered: summed as the results were accepted, in micro-batch order where it can: LocalFold;
        # lean: summed by backward in .grad, the order the tasks came)
        if self.lean:
            total = {n: p.grad for n, p in self.params.items()}
        else:
            total = self.acc_local.total() if self.spec.ordered_grads else self.acc
        n = len(self.acc_mbs)
        epoch, step, _ = self.acc_key
        if self.pending is not None and self.pending[:2] == (epoch, step):
            for name, g in self.pending[2].items():
                total[name].add_(g)
            n += self.pending[3]
        return total, n

    def _local_report(self) -> tuple[dict[str, torch.Tensor], int, list[float]]:
        total, n = self._local_sum()
        scale = mean_scale(self.spec.micro_batches, n)
        parts = [sq_sum64(g * scale if scale != 1.0 else g) for g in total.values()]
        return total, n, parts

    async def _local_done(self) -> None:
        """Report the step's micro-batches (no tensors); keep the gradient for the inner step."""
        epoch, step, gen = self.acc_key
        mbs = sorted(self.acc_mbs)
        if self.lean and not self.lean_sum.holds(epoch, step):
            # (spoiled since: lean_sum drops the bookkeeping too, so this is a guard)
            self._drop_acc()
            await self._release(epoch, step, gen, "dropped its lean sum of")
            self.lean_sum.released(epoch, step)
            return
        try:
            total, n, parts = await asyncio.get_running_loop().run_in_executor(None, self._local_report)
            msg = pb.GradPush(worker=self.member_id, step=step, epoch=epoch, gen=gen, mbs=mbs, local_done=True,
                              local_sq_norm=total_sq_norm(parts), local_param_sq=parts)
            rep = await self._send_push(msg, msg.SerializeToString())
            if rep is None:
                await self._release(epoch, step, gen)
            elif rep.accepted:
                self.pending = (epoch, step, total, n)
                self.local_reported += len(mbs)
            else:
                log.info("%s: local report refused: %s", self.opts.name, rep.reason)
        finally:
            self._drop_acc()

    def _inner_step(self, total: dict[str, torch.Tensor], n: int, lr: float, coef: float, skip: bool) -> None:
        """One inner AdamW step on the replica with the mean gradient of its micro-batches."""
        scale = mean_scale(self.spec.micro_batches, n)
        for name, p in self.params.items():
            g = total[name]
            p.grad = g.mul_(scale) if scale != 1.0 else g
        if skip:
            self.inner_opt.zero_grad(set_to_none=True)
        else:
            apply_update(self.inner_opt, lr, coef)

    async def _local_tick(self, rep: pb.LeaseReply) -> None:
        """Apply a pending inner step once its decision arrives; send the pseudo-gradient when asked."""
        if self.pending is not None:
            pe, ps, total, n = self.pending
            if rep.epoch != pe or rep.local_step > ps or rep.step > ps + 1:
                log.info("%s: missed the decision of step %d; its gradient is dropped", self.opts.name, ps)
                self.pending = None
            elif rep.local_step == ps:
                self.pending = None
                await asyncio.get_running_loop().run_in_executor(
                    None, self._inner_step, total, n, rep.local_lr, rep.local_coef, rep.local_skip)
                self.local_round_mbs += n
                self.graphs.clear()  # graphs of the old replica weights
                if self.local_overlap:
                    await self._local_apply_arrived(rep)
        if self.local_overlap:
            self._local_prefetch(rep)
            await self._local_close(rep)
            return
        round_v = rep.local_step + 1
        if (rep.local_sync and self.pending is None and self.local_sent != (rep.epoch, round_v) and self.version < 0
                and self.local_reported > 0):
            self.local_sent = (rep.epoch, round_v)
            await self._local_given_up(rep, round_v)
        if (rep.local_sync and self.pending is None and self.local_sent != (rep.epoch, round_v)
                and self.version >= 0 and self.weights_epoch == rep.epoch and self.anchor):
            self.local_sent = (rep.epoch, round_v)
            msg, data, frames = await asyncio.get_running_loop().run_in_executor(
                None, self._pseudo_message, rep.epoch, rep.step, rep.gen, round_v)
            res = await self._send_push(msg, data, frames)
            if res is not None and res.accepted:
                self.local_delivered = True
                log.info("%s sent its pseudo-gradient for v%d covering %d micro-batches%s", self.opts.name, round_v,
                         self.local_round_mbs, f" (kept residual x{self.pseudo_reweight:.3g})"
                         if self.pseudo_reweight != 1.0 else "")
            else:
                log.info("%s: pseudo-gradient for v%d not taken (%s); resyncing", self.opts.name, round_v,
                         "lost" if res is None else res.reason)
                if res is None:
                    await self._local_withdraw(msg, self.server)
                self.version = -1
                self.pseudo_kept = self.pseudo_carried = None
                if self.pseudo_ef is not None:
                    self.pseudo_ef.reset()  # nothing of it was merged: its residual means nothing
            del msg, data, frames
            await asyncio.get_running_loop().run_in_executor(None, release_free)  # (as after an overlapped send)

    async def _local_close(self, rep: pb.LeaseReply) -> None:
        """Delayed application: once the decision of a round's last step is out (and applied),
        close the round: copy its pseudo-gradient out, rebase the replica onto the previous
        round's merge unless that reached it mid-round (:meth:`_local_apply_arrived`), then
        frame and send the pseudo-gradient in the background while the next round computes. The
        pull comes before the send, so the merge pulled never holds this round's own
        pseudo-gradient."""
        v = round_closed_by(rep.local_step, self.spec.sync_every, self.spec.steps)
        key = (rep.epoch, v)
        if self.local_closed is None or self.local_closed[0] != rep.epoch or self.version < 0 or not self.anchor:
            # nothing trained on a replica of this epoch before this round; or the replica was given
            # up mid-round (resynced), its micro-batches the server counted lost with it: withdrawn
            given_up = (self.version < 0 and self.local_reported > 0 and self.local_closed is not None
                        and self.local_closed[0] == rep.epoch and self.local_closed[1] < v)
            self.local_closed = key
            if given_up:
                await self._local_given_up(rep, v)
            return
        if self.local_closed[1] >= v or (self.pending is not None and self.pending[1] < v):
            return  # closed already; or an inner step of the round still awaits its decision
        self.local_closed = key
        loop = asyncio.get_running_loop()
        self.local_close_t0 = time.perf_counter()
        fetching, self.local_fetch = self.local_fetch, None
        if fetching is not None:
            with contextlib.suppress(Exception):  # (one that failed: pulled again below)
                await fetching
        snap = None
        if self.local_round_mbs > 0 or self.local_reported > 0:
            # (also one that covers nothing: its steps missed their decisions, but the server
            # counted them and its merge waits for it, as a request to push would without overlap)
            framing = self.local_framing
            if framing is not None and not framing.done():
                await asyncio.wait([framing])  # the last round's framing first: its error feedback
            snap = await loop.run_in_executor(None, self._pseudo_deltas, rep.epoch, rep.step, rep.gen, v)
        self.local_reported = 0
        if v < self.spec.steps:  # (after the run's last round there is nothing to train on)
            try:
                if self.version != rep.local_merged or self.weights_epoch != rep.epoch:
                    await self._pull(merged_only=True)
                await loop.run_in_executor(None, self._local_rebase)
            except (WireError, StreamStalled, grpc.aio.AioRpcError) as exc:
                # The pseudo-gradient still goes (its round is in it once); the replica starts
                # over from the newest merge at its next task, the rest of its progress lost.
                log.info("%s: no merged weights to rebase onto at the end of round v%d (%s); resyncing",
                         self.opts.name, v, exc)
                self.version = -1
                self.pseudo_kept = self.pseudo_carried = None
        if snap is not None:
            self.local_delivered = True
            self.local_sent = key  # (its merge is applied once pulled: _local_apply_arrived)
            self._local_send(snap, v)

    def _local_prefetch(self, rep: pb.LeaseReply) -> None:
        """Delayed application: a merge published mid-round is pulled in the background while
        the round computes, applied after the next inner step (one pull at a time)."""
        if (self.version < 0 or self.weights_epoch != rep.epoch or rep.local_merged <= self.version
                or (self.local_fetch is not None and not self.local_fetch.done()) or self.opts.shadow
                or self.local_closed is None or self.local_closed[1] >= self.spec.steps):  # (the run's rounds are over)
            return
        self.local_fetch = asyncio.ensure_future(self._pull(merged_only=True))
        # (awaited at the round's end; one left behind by a move must not log as never retrieved)
        self.local_fetch.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _local_apply_arrived(self, rep: pb.LeaseReply) -> None:
        """Delayed application as soon as the merge is here: right after an inner step, once the
        merge of the round this replica closed last has been pulled (in the background), the
        replica moves onto it (:func:`shift_replica`) instead of waiting for its round's end,
        so it trains on its peers' last round for the rest of this one."""
        key = (self.weights_epoch, self.version)
        if (self.version < 0 or key != self.local_sent or self.local_applied == key or rep.epoch != key[0]
                or not self.anchor or not self.merged):
            return
        self.local_applied = key

        def shift() -> str:  # (in a thread: a pass over the stage, and its digest for the log)
            shift_replica(self.params, self.merged, self.anchor)
            return tensors_digest(self.merged)

        digest = await asyncio.get_running_loop().run_in_executor(None, shift)
        self.graphs.clear()  # graphs of the replica before the shift
        log.info("%s pulled merged weights v%d digest %s (applied mid-round, after step %d)", self.opts.name,
                 self.version, digest, rep.local_step)

    def _local_rebase(self) -> None:
        """The replica's progress since its anchor, moved onto the merged weights just pulled:
        ``w = w + (merged - anchor)``, and ``w`` becomes the anchor of the next round (in a
        thread). Where that merge was applied mid-round already, ``w`` only becomes the anchor."""
        self.local_round_mbs = 0
        if self.local_applied == (self.weights_epoch, self.version):
            with torch.no_grad():
                for n, a in self.anchor.items():
                    a.copy_(self.params[n])
            log.info("%s closed its round on merged weights v%d, applied mid-round (the round's end took %.3f s)",
                     self.opts.name, self.version, time.perf_counter() - self.local_close_t0)
            return
        rebase_replica(self.params, self.merged, self.anchor)
        self.graphs.clear()  # graphs of the replica before the rebase
        log.info("%s pulled merged weights v%d digest %s (its replica rebased onto them; the round's end took "
                 "%.3f s)", self.opts.name, self.version, tensors_digest(self.merged),
                 time.perf_counter() - self.local_close_t0)

    def _local_send(self, snap: tuple, round_v: int) -> None:
        """Frame and send a closed round's pseudo-gradient (:meth:`_pseudo_deltas`' ``snap``) in
        the background, to the server of the stage it was made on; what a keeps_residual push
        left goes onto the replica's new anchor (the next pseudo-gradient carries it). One not
        taken resyncs the replica, as without overlap."""
        server, stage, anchor, gen = self.server, self.stage, self.anchor, self.local_gen
        msg, deltas, codec, keep, dense = snap
        n = msg.local_mbs
        loop = asyncio.get_running_loop()
        framed = self.local_framing = loop.create_future()

        async def go() -> None:
            t0 = time.perf_counter()
            try:
                try:
                    data, kept, frames = await loop.run_in_executor(None, self._pseudo_frames, msg, deltas, codec,
                                                                    keep, dense, round_v)
                except Exception as exc:  # e.g. a non-finite replica: nothing of this round can be sent
                    log.warning("%s: its pseudo-gradient for v%d cannot be framed (%s); resyncing", self.opts.name,
                                round_v, exc)
                    if self.stage == stage:
                        self.version = -1
                        self.pseudo_kept = self.pseudo_carried = None
                        if self.pseudo_ef is not None:
                            self.pseudo_ef.reset()
                    data = None
                else:
                    took = time.perf_counter() - t0
                    if self.local_gen != gen and self.pseudo_ef is not None:
                        self.pseudo_ef.reset()  # voided while it was framed: its residual means nothing
                    if self.anchor is anchor and self.stage == stage:  # (not after a resync or a move)
                        if kept is not None:
                            await loop.run_in_executor(None, add_residual, anchor, kept[2])
                        self.pseudo_carried = None if kept is None else (kept[3], kept[2])
            finally:
                framed.set_result(None)
            if data is None:
                await self._local_withdraw(msg, server)
                return
            res = await self._send_push(msg, data, frames, server=server)
            if res is not None and res.accepted:
                log.info("%s sent its pseudo-gradient for v%d covering %d micro-batches%s (framed in %.3f s beside "
                         "the next round)", self.opts.name, round_v, n,
                         f" (kept residual x{self.pseudo_reweight:.3g})" if self.pseudo_reweight != 1.0 else "", took)
                return
            log.info("%s: pseudo-gradient for v%d not taken (%s); resyncing", self.opts.name, round_v,
                     "lost" if res is None else res.reason)
            if res is None:
                await self._local_withdraw(msg, server)
            if self.stage == stage:
                self.version = -1
                self.pseudo_kept = self.pseudo_carried = None
                if self.pseudo_ef is not None:
                    self.pseudo_ef.reset()

        async def sent() -> None:
            try:
                await go()
            finally:
                # the round's copies of the stage (its pseudo-gradient, frames, residual), freed on
                # threads, go back to the system before the next round makes them again
                await loop.run_in_executor(None, release_free)

        self.local_sending = asyncio.ensure_future(sent())
        self.local_sending.add_done_callback(self._local_sent)

    async def _local_given_up(self, rep: pb.LeaseReply, round_v: int) -> None:
        """The replica was given up mid-round (resynced): what the server counted of it for the
        merge of ``round_v`` is lost with it, so it withdraws from that merge."""
        self.local_reported = 0
        await self._local_withdraw(pb.GradPush(step=rep.step, epoch=rep.epoch, gen=rep.gen, local_round=round_v),
                                   self.server)

    async def _local_withdraw(self, msg: pb.GradPush, server) -> None:
        """Tell ``server`` that the pseudo-gradient ``msg`` was for will not come (it was lost, could
        not be framed, or the replica it was made on was given up), so that its merge goes on
        without it now rather than after the flush grace (best effort: a server this cannot
        reach waits the grace out, as it would have)."""
        note = pb.GradPush(worker=self.member_id, step=msg.step, epoch=msg.epoch, gen=msg.gen,
                           local_round=msg.local_round, local_withdraw=True)
        try:
            rep = await server.PushGrads(note, timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.info("%s: could not withdraw from the merge of v%d either (%s)", self.opts.name, msg.local_round,
                     exc.code().name)
            return
        log.info("%s: withdrew from the merge of v%d (%s)", self.opts.name, msg.local_round, rep.reason)

    def _local_sent(self, t: asyncio.Future) -> None:
        """A background send that failed outside its retries (a refused credential): said here,
        not lost; the merge goes on without it after its flush grace."""
        if not t.cancelled() and t.exception() is not None:
            log.warning("%s: a pseudo-gradient could not be sent: %s", self.opts.name, t.exception())

    def _pseudo_message(self, epoch: int, step: int, gen: int, round_v: int) -> tuple[pb.GradPush, bytes, list]:
        """The replica's pseudo-gradient (anchor minus weights now), framed raw fp32 or with the run's
        push codec plus error feedback (``--compression push=...``): its head, bytes and frames."""
        msg, deltas, codec, keep, dense = self._pseudo_deltas(epoch, step, gen, round_v)
        data, kept, frames = self._pseudo_frames(msg, deltas, codec, keep, dense, round_v)
        if stage_codec(codec) and keep:
            self.pseudo_kept = kept
        return msg, data, frames

    def _pseudo_deltas(self, epoch: int, step: int, gen: int,
                       round_v: int) -> tuple[pb.GradPush, dict[str, torch.Tensor], str, bool, bool]:
        """The pseudo-gradient's head and tensors, a copy in host memory (the replica may train
        on while they are framed), with its codec and whether it keeps a residual
        (keeps_residual) or is the run's dense last round."""
        msg = pb.GradPush(worker=self.member_id, step=step, epoch=epoch, gen=gen, local_round=round_v,
                          local_mbs=self.local_round_mbs)
        codec = self.pseudo_ef.codec if self.pseudo_ef is not None else "raw"
        keep = keeps_residual(codec)
        dense = dense_round(round_v, self.spec.steps, codec)
        if dense:
            codec = DENSE_ROUND_CODEC  # the run's last round: the whole pseudo-gradient, what the replica kept included
        # Raw pushes at outer lr 1, momentum 0: the weights themselves (the merge is their mean, exactly).
        # (not with overlap: a replica's weights hold its previous round, which that merge lacks)
        msg.local_weights = (codec == "raw" and merges_weights(self.spec.outer_lr, self.spec.outer_momentum)
                             and not self.local_overlap)
        # The residual this replica carries was made at its last round's share: re-weighted to it.
        carried = self.pseudo_carried if keep else None
        self.pseudo_reweight = residual_reweight(carried[0], self.local_round_mbs) if carried is not None else 1.0
        reweight = self.pseudo_reweight - 1.0
        deltas = {}
        # Fault injection keys on the round's last step, not on ``step`` (the server's step when
        # it asked for the round: its last or the one after, as the timing fell).
        last, o = round_v - 1, self.opts
        poisoned = poisons(o.fault_poison_kind, o.fault_poison, o.fault_poison_from, last)
        for name, p in self.params.items():
            w = p.detach().to("cpu")  # (the anchor is in host memory)
            delta = self.anchor[name] - w
            if reweight:
                delta.add_(carried[1][name].to(delta.device, delta.dtype), alpha=reweight)
            if poisoned:
                delta = poison(delta, name, last, o.fault_poison_kind, o.fault_poison)  # a dishonest replica
            if msg.local_weights:
                delta = w.clone() if not poisoned else self.anchor[name] - delta
            deltas[name] = delta.cpu()
        return msg, deltas, codec, keep, dense

    def _pseudo_frames(self, msg: pb.GradPush, deltas: dict[str, torch.Tensor], codec: str, keep: bool, dense: bool,
                       round_v: int) -> tuple[bytes, tuple | None, list]:
        """Frame :meth:`_pseudo_deltas`' tensors (in a thread): the push serialised (``msg`` is its
        head, the frames follow it), with a stage codec that keeps its residual ``(epoch, round,
        {name: what the push left}, micro-batches)`` (None: nothing left), and the frames.

        Serialised by concatenation (:func:`serialize_framed`), not by ``SerializeToString`` of
        a message holding the frames: upb holds the interpreter lock for the whole of that, and
        a 400 MB pseudo-gradient framed that way kept a worker's heartbeats from running for
        over 3 s (bench/results/gpu-runtime.md)."""
        kept = None
        if stage_codec(codec) and keep:
            # The pseudo-gradient already holds what the last push left (the replica kept it): no
            # residual is added; what this push leaves is taken off the replica at the pull.
            ef = ErrorFeedback(codec)
            frames = [stage_frame(deltas, codec, ef)]
            left = ef.residual(STAGE_FRAME)
            kept = None if left is None else (msg.epoch, round_v, split_flat(left, deltas), msg.local_mbs)
        elif stage_codec(codec):  # the whole stage in one frame
            frames = [stage_frame(deltas, codec, self.pseudo_ef)]
        else:
            frames = [encode_frame(name, delta, codec, ef=None if dense else self.pseudo_ef, view=True)
                      for name, delta in deltas.items()]
        return serialize_framed(msg, pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number, frames), kept, frames
