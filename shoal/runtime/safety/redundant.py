"""Redundant computation and the drift test: the stage server's side (a mixin).

* **Redundant computation** (exact sync, fp32 or bf16, raw frames): a push drawn for a
  random check (:func:`shoal.runtime.safety.guard.verify_rate`) is computed again by another
  worker of the stage (:func:`~shoal.runtime.safety.guard.pick_checker`) instead of by the
  server: the checker gets the push's micro-batches as *check tasks* (``Task.check_id``),
  computes each from the inputs and output gradients the server holds, and sends each
  parameter gradient back alone (``GradPush.check_id``). The server sums them in micro-batch
  order, as the checked worker did, and compares (:func:`~shoal.runtime.safety.guard.dup_disagree`:
  bitwise in fp32, within a tolerance in bf16). Only a disagreement costs the server a
  recomputation, which decides who lied, if anyone (:func:`~shoal.runtime.safety.guard.dup_verdict`);
  a liar is banned through the usual path (its work dropped, the run rolled back past its
  unverified pushes). The step commits only once its checks are decided; a check whose
  checker goes silent, leaves or never asks for it is abandoned (the push stays unverified,
  as an undrawn push is).
* **Drift test** (every exact-sync run): at each commit, each worker's pushes of the step are
  compared with the other workers' mean at a few thousand coordinates drawn with the server's
  secret (:func:`shoal.runtime.safety.verify.drift_deviations`); per worker the deviations
  and their squares are summed over its pushes, and :func:`~shoal.runtime.safety.guard.drift_z`
  turns them into one statistic. A worker above ``GuardConfig.drift_z`` becomes a suspect:
  every push of it is recomputed by the server (bf16: checked by another worker) until the
  statistic falls back. A suspicion never bans by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import WireError
from shoal.runtime.common import lease_seconds, run_precision
from shoal.runtime.safety.guard import (
    drift_suspect,
    drift_z,
    dup_disagree,
    dup_verdict,
    pick_checker,
    rel_error,
)
from shoal.runtime.safety.verify import (
    DupCheck,
    compare_pushes,
    drift_deviations,
    drift_indices,
    drift_sample,
    recompute_sum,
    sq_diff,
    sq_norm,
    sum_in_order,
)

log = logging.getLogger("shoal.server")


class RedundantMixin:
    """Redundant checks and the drift test of a :class:`~shoal.runtime.roles.server.StageServer`."""

    def _dup_init(self) -> None:
        self.dup_checks: dict[int, DupCheck] = {}  # redundant checks under way, by id
        self.dup_leases: dict[int, tuple[int, float]] = {}  # check lease id -> (check id, deadline)
        self.dup_next = 1  # the next check id
        self.dup_counts = {"made": 0, "agreed": 0, "disagreed": 0, "abandoned": 0}
        self.drift_stage = -1  # the stage the drift statistics are of
        self.drift_idx: dict[str, torch.Tensor] = {}  # sampled flat coordinates per tensor
        self.drift_sum: dict[str, torch.Tensor] = {}  # worker -> summed deviations
        self.drift_sq: dict[str, torch.Tensor] = {}  # worker -> summed squared deviations
        self.drift_n: dict[str, int] = {}  # worker -> steps its deviation was taken in
        self.drift_zs: dict[str, float] = {}  # worker -> its latest statistic
        self.drift_suspects: set[str] = set()  # workers every push of which is checked

    # ------------------------------------------------------------------ redundant checks
    def _dup_able(self, r: pb.GradPush, raw_pulls: bool) -> bool:
        """Whether a push can be checked by another worker: raw frames, uncompressed weight pulls
        (``raw_pulls``: both workers computed on the server's weights), fp32 or bf16, and the run
        did not leave its checks to the servers (``--server-checks``)."""
        return (self.guard_cfg.redundant and not self.spec.guard_server_checks and not self.local and raw_pulls
                and run_precision(self.spec) in ("fp32", "bf16") and all(g.codec in ("", "raw") for g in r.grads))

    def _dup_start(self, r: pb.GradPush, ids: list[int], grads: dict[str, torch.Tensor], exact: bool) -> str:
        """Give ``r``'s micro-batches to another worker of the stage to compute again; returns
        the checker ("": none fits, the caller recomputes or leaves the push unverified)."""
        min_ok = self.guard_cfg.verify_first_n if exact else 0
        # Workers that computed tasks of this step here: serving the stage now (a worker that
        # moved to another stage still renews here for a while, and would never ask for it).
        live = {w: self.guard_ok.get(w, 0) for w in self.workers if self.tasks_per_worker.get(w, 0) > 0}
        checker = pick_checker(live, r.worker, self.spec.seed, f"{self.spec.run_id}/{self.guard_salt}",
                               r.step, min(ids), self.guard_banned, min_ok)
        if checker is None:
            return ""
        cid = self.dup_next
        self.dup_next += 1
        self.dup_checks[cid] = DupCheck(cid, r.step, r.epoch, r.worker, tuple(sorted(ids)), grads, checker,
                                        todo=sorted(ids), created=time.monotonic(), exact=exact)
        self.dup_counts["made"] += 1
        log.info("%s: the push of %s (step %d mbs %s) is computed again by %s (check %d)", self.name, r.worker,
                 r.step, sorted(ids), checker, cid)
        return checker

    def _dup_pending(self) -> bool:
        return bool(self.dup_checks)

    def _dup_pick(self, wid: str):
        """A check task for ``wid`` (its next micro-batch of a check it was drawn for), as the
        server grants it (``StageServer._granted``), or None."""
        for chk in self.dup_checks.values():
            if chk.checker != wid or not chk.todo or chk.step != self.step or chk.epoch != self.epoch:
                continue
            st = self.steps.get(chk.step, {}).get(chk.todo[0])
            if st is None or (not self.is_first and st.input is None) or (not self.is_last and st.out_grad is None):
                continue
            mb = chk.todo.pop(0)
            info = self._worker(wid)
            secs = lease_seconds(info.ewma_s, self.spec.min_lease_s)
            lid = self.next_lease
            self.next_lease += 1
            chk.leased[lid] = mb
            chk.created = time.monotonic()  # (the checker's pace is what the reaper waits on)
            self.dup_leases[lid] = (chk.check_id, time.monotonic() + secs)
            task = pb.Task(step=chk.step, mb=mb, stage=self.stage, direction=pb.FWDBWD if self.is_last else pb.BWD,
                           epoch=self.epoch, lease_id=lid, deadline_s=secs, loss_scale=self.loss_scale,
                           check_id=chk.check_id)
            if self.is_first or self.is_last:
                task.tokens.CopyFrom(self._window(chk.step, mb))
            return self._granted(task, st, out_grad=not self.is_last)
        return None

    def _dup_renew(self, wid: str, lid: int, secs: float) -> None:
        got = self.dup_leases.get(lid)
        if got is not None and self.dup_checks.get(got[0]) is not None and self.dup_checks[got[0]].checker == wid:
            self.dup_leases[lid] = (got[0], time.monotonic() + secs)

    def _dup_drop(self, cid: int, why: str) -> None:
        """Abandon check ``cid``: its push stays unverified (as an undrawn push is)."""
        chk = self.dup_checks.pop(cid, None)
        if chk is None:
            return
        for lid in chk.leased:
            self.dup_leases.pop(lid, None)
            self.grants.end(lid, chk.checker)
        self.dup_counts["abandoned"] += 1
        log.info("%s: check %d of %s's push (step %d mbs %s) by %s abandoned: %s", self.name, cid, chk.target,
                 chk.step, list(chk.mbs), chk.checker, why)
        self._maybe_commit()  # it may have been the last thing the step waited for

    def _dup_forget(self, wid: str, why: str) -> None:
        """Abandon the checks ``wid`` computes or is the target of (it was voided or banned)."""
        for cid in [c for c, chk in self.dup_checks.items() if wid in (chk.checker, chk.target)]:
            if self.dup_checks[cid].checker == wid or wid in self.guard_banned:
                self._dup_drop(cid, f"{wid} {why}")

    def _dup_clear(self) -> None:
        """A new step or epoch: no check of the old one can matter."""
        for cid in list(self.dup_checks):
            chk = self.dup_checks[cid]
            if chk.step != self.step or chk.epoch != self.epoch:
                self._dup_drop(cid, "the stage moved on")

    def _dup_reap(self, now: float) -> bool:
        """Abandon checks whose lease ran out, or that their checker never asked for in time."""
        changed = False
        for lid, (cid, deadline) in list(self.dup_leases.items()):
            if deadline < now and cid in self.dup_checks:
                self._dup_drop(cid, f"its lease {lid} ran out")
                changed = True
        wait = max(2.0, self.spec.dead_after_s)
        for cid, chk in list(self.dup_checks.items()):
            if chk.todo and not chk.leased and now - chk.created > wait:
                self._dup_drop(cid, f"{chk.checker} did not ask for it within {wait:.1f} s")
                changed = True
        return changed

    async def _dup_push(self, r: pb.GradPush, info, decode_grads) -> pb.PushReply:
        """A checker's gradient of one micro-batch of a check (``decode_grads``: the server's
        checked decoding of a push's frames)."""
        chk = self.dup_checks.get(r.check_id)
        lid = next((lid for lid, mb in (chk.leased.items() if chk else ()) if list(r.mbs) == [mb]), None)
        if chk is None or chk.checker != r.worker or r.epoch != chk.epoch or r.step != chk.step or lid is None:
            return pb.PushReply(accepted=False, reason="no such check (abandoned or decided)", gen=info.gen)
        try:
            grads = await asyncio.get_running_loop().run_in_executor(None, decode_grads, r, self.params,
                                                                self.grads_finite)
        except WireError as exc:
            self._dup_drop(chk.check_id, f"bad check result: {exc}")
            await self._dup_done()
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}", gen=info.gen)
        if self.dup_checks.get(r.check_id) is not chk or lid not in chk.leased:
            return pb.PushReply(accepted=False, reason="check abandoned while its result was read", gen=info.gen)
        mb = chk.leased.pop(lid)
        self.dup_leases.pop(lid, None)
        self.grants.end(lid, r.worker)
        chk.results[mb] = grads
        chk.created = time.monotonic()
        if not chk.todo and not chk.leased and not chk.judging:
            chk.judging = True
            self._spawn(self._dup_judge(chk))
        return pb.PushReply(accepted=True, gen=info.gen)

    def _dup_recompute(self, chk: DupCheck, theirs: dict[str, torch.Tensor], module: torch.nn.Module,
                       inputs: list, first: bool, last: bool, loss_scale: float) -> dict[str, float]:
        """Both results' relative errors against the server's own fp32 recomputation (in a thread).

        ``module`` and ``inputs`` (micro-batch, input, output gradient) are taken on the event
        loop under ``_wlock`` for the check's epoch and step: a rollback meanwhile changes neither."""
        mine = recompute_sum(module, self.spec, chk.step, inputs, first=first, last=last, loss_scale=loss_scale)
        ref = sq_norm(mine)
        return {chk.target: rel_error(sq_diff(chk.grads, mine), ref),
                chk.checker: rel_error(sq_diff(theirs, mine), ref)}

    async def _dup_judge(self, chk: DupCheck) -> None:
        """Compare the checker's results with the checked push; on a disagreement the server
        recomputes, and whoever is off its recomputation is banned."""
        try:
            await self._dup_decide(chk)
        except Exception as exc:  # a check must never fail the run: it is dropped, the push stays unverified
            log.warning("%s: check %d could not be decided (%s: %s)", self.name, chk.check_id, type(exc).__name__, exc)
        finally:
            if self.dup_checks.get(chk.check_id) is chk:
                self.dup_checks.pop(chk.check_id)
            await self._dup_done()

    async def _dup_decide(self, chk: DupCheck) -> None:
        """The comparison and, on a disagreement, the server's arbitration (see :meth:`_dup_judge`)."""
        loop = asyncio.get_running_loop()
        theirs = await loop.run_in_executor(None, sum_in_order, chk.results)
        equal, rel = await loop.run_in_executor(None, compare_pushes, chk.grads, theirs)
        if self.dup_checks.get(chk.check_id) is not chk:
            return
        if not dup_disagree(equal, rel, chk.exact, self.guard_cfg):
            self.dup_counts["agreed"] += 1
            self.guard_ok[chk.target] = self.guard_ok.get(chk.target, 0) + 1
            log.info("%s: check %d: %s and %s agree on step %d mbs %s (%s)", self.name, chk.check_id,
                     chk.target, chk.checker, chk.step, list(chk.mbs),
                     "bitwise" if equal else f"relative difference {rel:.3g}")
            return
        self.dup_counts["disagreed"] += 1
        errors = None
        async with self._wlock:  # no commit changes the weights meanwhile (none can: the step waits)
            if self.version == chk.step and self.epoch == chk.epoch and chk.step in self.steps:
                mbs = self.steps[chk.step]
                inputs = [(mb, mbs[mb].input, mbs[mb].out_grad) for mb in chk.mbs]
                errors = await loop.run_in_executor(None, self._dup_recompute, chk, theirs, self.module, inputs,
                                                    self.is_first, self.is_last, self.loss_scale)
        if errors is None or self.dup_checks.get(chk.check_id) is not chk:
            return
        self.guard_checks += 1
        verdict = dup_verdict(errors, chk.exact, {chk.target: chk.checker, chk.checker: chk.target},
                              chk.step, chk.mbs, self.guard_cfg)
        log.info("%s: check %d: %s and %s disagree on step %d mbs %s (relative difference %.3g); the "
                 "server's recomputation: %s", self.name, chk.check_id, chk.target, chk.checker, chk.step,
                 list(chk.mbs), rel, ", ".join(f"{w} {e:.3g}" for w, e in sorted(errors.items())))
        self.dup_checks.pop(chk.check_id, None)
        async with self.cond:
            for w, why in verdict.items():
                if w not in self.guard_banned:
                    self._guard_ban(w, chk.step, why)
        if chk.target not in verdict:
            self.guard_ok[chk.target] = self.guard_ok.get(chk.target, 0) + 1

    async def _dup_done(self) -> None:
        """A check ended: the step may commit now (and parked lease requests may go on)."""
        async with self.cond:
            self._maybe_commit()
            self.cond.notify_all()

    # ------------------------------------------------------------------ drift
    def _drift_reset(self) -> None:
        self.drift_sum, self.drift_sq, self.drift_n, self.drift_zs = {}, {}, {}, {}
        self.drift_suspects = set()

    def _drift_update(self, step: int, pushes: list) -> None:
        """Add the step's deviations to each worker's drift statistics (in a thread, at commit)."""
        cfg = self.guard_cfg
        if (not cfg.enabled or self.local or self.spec.shadow or cfg.drift_coords <= 0
                or len({p[2] for p in pushes}) < 2):
            return
        if self.drift_stage != self.stage:
            self._drift_reset()
            self.drift_stage = self.stage
            self.drift_idx = drift_indices(self.params, cfg.drift_coords, f"{self.guard_salt}/{self.stage}")
        # This runs in a thread: a rollback on the event loop may reset the statistics meanwhile
        # (_drift_reset binds new dicts), so it works on the ones it started with, which a reset
        # leaves to be dropped, instead of reading a half-reset state.
        sums, sqs, counts, zs_all, suspects = (self.drift_sum, self.drift_sq, self.drift_n, self.drift_zs,
                                               self.drift_suspects)
        samples = [(w, len(mbs), drift_sample(grads, self.drift_idx)) for _, grads, w, mbs in pushes]
        zs: dict[str, float] = {}
        for w, d in drift_deviations(samples):
            if not bool(torch.isfinite(d).all()):
                continue
            sums[w] = d if w not in sums else sums[w] + d
            sqs[w] = d * d if w not in sqs else sqs[w] + d * d
            counts[w] = counts.get(w, 0) + 1
            z = drift_z(sums[w].tolist(), sqs[w].tolist())
            zs_all[w] = z
            was = w in suspects
            if drift_suspect(z, counts[w], cfg):
                suspects.add(w)
            else:
                suspects.discard(w)
            zs[w] = z
            if was != (w in suspects):
                log.info("%s: drift of %s after step %d: z %.2f over %d steps: %s", self.name, w, step, z,
                         counts[w], "a suspect, every push of it is checked" if not was else "no longer a suspect")
        if zs:
            log.info("%s: drift after step %d: %s", self.name, step,
                     json.dumps({w: [round(z, 2), counts[w]] for w, z in sorted(zs.items())}))
