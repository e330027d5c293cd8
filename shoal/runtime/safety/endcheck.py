"""The run's end check: each worker's most recent unverified push, recomputed before the last
step commits (the stage server's side, a mixin; docs/poisoning-undo.md, "The run's end check").

The last step's pushes are all recomputed, but a worker that takes no task of the last step
(a faster worker took them, or it stopped asking) would otherwise finish the run with its
unverified pushes unseen. So each stage server keeps, per worker, the gradient of its most
recent step with exact pushes that were not recomputed (their sum, with the micro-batches'
inputs and output gradients, and a copy of the stage's weights of that version), and at the
last step's commit, before the step is reported, recomputes it for every worker that pushed
nothing in the last step. A lie found bans the worker, and the ban rolls the run back past
all its unverified pushes as any ban does: a worker that lies on every push from some step
on cannot finish a run unseen, whether or not it works in the last step.

Cost: per worker, one summed gradient of the stage and (shared by the workers of a step) one
copy of the stage's weights, held until a newer unverified step of it replaces them; one
clone of the weights per commit with an unverified push; at the run's end the forward and
backward of those micro-batches for each such worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from shoal.model.transformer import build_stage
from shoal.runtime.safety.guard import ban_reason, rel_error
from shoal.runtime.safety.verify import recompute_grads, sq_diff, sq_norm

log = logging.getLogger("shoal.server")

Key = tuple[int, int, int, int, int]  # (epoch, stage, first layer, last layer, step)


@dataclass
class EndRecord:
    """A worker's most recent step with unverified exact pushes at this stage."""

    key: Key  # whose weights (version ``step`` of that epoch and stage) the pushes were computed on
    mbs: tuple[int, ...]  # its micro-batches of the step, in order
    grads: dict[str, torch.Tensor]  # the sum of its unverified pushes of the step
    inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None]]  # (mb, stage input, output gradient)
    loss_scale: float  # the step's loss scale (1 outside fp16)


def sum_grads(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sum of pushes (the one push itself when there is one: no copy)."""
    if len(parts) == 1:
        return parts[0]
    out = {n: t.clone() for n, t in parts[0].items()}
    for g in parts[1:]:
        for n, t in g.items():
            out[n].add_(t)
    return out


def end_targets(keys: dict[str, Key], pushers: set[str], banned: set[str], here: tuple[int, int, int]) -> list[str]:
    """Whose records the last step's commit recomputes (pure): workers with a record of this
    stage and layers ``here`` (stage, first, last) that pushed nothing in the last step (their
    pushes there were all recomputed) and are not banned already."""
    return sorted(w for w, k in keys.items() if w not in pushers and w not in banned and k[1:4] == here)


def kept_after_load(keys: dict[str, Key], version: int, here: tuple[int, int, int]) -> set[str]:
    """Whose records survive a (re)load at ``version`` of ``here`` (pure): those of this stage
    and layers from steps before ``version`` (their pushes are still in the weights; later
    steps are redone, other layers are other weights)."""
    return {w for w, k in keys.items() if k[1:4] == here and k[4] < version}


class EndCheckMixin:
    """The end check of a :class:`~shoal.runtime.roles.server.StageServer`."""

    def _end_init(self) -> None:
        self.end_ids: set[tuple[str, tuple[int, ...]]] = set()  # this step's exact pushes left unverified
        self.end_records: dict[str, EndRecord] = {}  # worker -> its most recent unverified step here
        self.end_weights: dict[Key, dict[str, torch.Tensor]] = {}  # the weights the records were computed on

    def _end_note(self, wid: str, ids: list[int]) -> None:
        """An exact push was counted without a recomputation (or a check by another worker)."""
        self.end_ids.add((wid, tuple(ids)))

    async def _end_record(self, step: int, epoch: int) -> None:
        """At a commit, under the weights lock and before the update: keep each worker's
        unverified pushes of the step (replacing its older record) and the weights they were
        computed on."""
        ids, self.end_ids = self.end_ids, set()
        if not ids or self.local or not self.guard_cfg.end_check:
            return
        mine: dict[str, list] = {}
        for _, grads, wid, mbs in sorted(self.pushes, key=lambda p: p[0]):
            if (wid, mbs) in ids and wid not in self.guard_banned:
                mine.setdefault(wid, []).append((mbs, grads))
        if not mine:
            return
        loop = asyncio.get_running_loop()
        key = (epoch, self.stage, self.first, self.last, step)
        states = self.steps[step]
        for wid, pushes in mine.items():
            grads = await loop.run_in_executor(None, sum_grads, [g for _, g in pushes])
            mbs = tuple(mb for m, _ in pushes for mb in m)
            self.end_records[wid] = EndRecord(key, mbs, grads, [(mb, states[mb].input, states[mb].out_grad)
                                                                for mb in mbs], self.loss_scale)
        self.end_weights[key] = await loop.run_in_executor(
            None, lambda: {n: p.detach().clone() for n, p in self.params.items()})
        self._end_prune()

    def _end_prune(self) -> None:
        used = {r.key for r in self.end_records.values()}
        self.end_weights = {k: w for k, w in self.end_weights.items() if k in used}

    def _end_forget(self, version: int, stage: int, first: int, last: int) -> None:
        """A (re)load at ``version``: records of steps it redoes, or of another stage, go."""
        self.end_ids = set()
        keep = kept_after_load({w: r.key for w, r in self.end_records.items()}, version, (stage, first, last))
        self.end_records = {w: r for w, r in self.end_records.items() if w in keep}
        self._end_prune()

    def _end_recompute(self, recs: list[tuple[str, EndRecord]]) -> dict[str, float]:
        """Each record's relative error against this server's fp32 recomputation (in a thread),
        on a fresh module loaded with the weights of the record's version."""
        module = build_stage(self.cfg, self.first, self.last, seed=self.spec.seed)
        errors: dict[str, float] = {}
        loaded = None
        for wid, rec in recs:
            if loaded != rec.key:
                weights = self.end_weights[rec.key]
                with torch.no_grad():
                    for n, p in module.named_parameters():
                        p.copy_(weights[n])
                loaded = rec.key
            mine: dict[str, torch.Tensor] = {}
            for mb, inp, og in rec.inputs:
                g = recompute_grads(module, self.spec, rec.key[4], mb, first=self.is_first, last=self.is_last,
                                    inp=None if inp is None else inp.float(), out_grad=None if og is None else og.float(),
                                    loss_scale=rec.loss_scale)
                for n, t in g.items():
                    mine[n] = t if n not in mine else mine[n] + t
            errors[wid] = rel_error(sq_diff(rec.grads, mine), sq_norm(mine))
        return errors

    async def _end_checks(self, step: int, epoch: int) -> None:
        """At the last step's commit, before its report: recompute the newest unverified pushes of
        every worker that pushed nothing in this step (its pushes here were all recomputed);
        one that lied is banned (the ban's undo follows from the heartbeat sent before the report)."""
        if not self.guard_cfg.end_check or self.local:
            return
        due = end_targets({w: r.key for w, r in self.end_records.items() if r.key in self.end_weights},
                          {p[2] for p in self.pushes}, set(self.guard_banned), (self.stage, self.first, self.last))
        recs = [(w, self.end_records[w]) for w in due]
        if not recs:
            return
        errors = await asyncio.get_running_loop().run_in_executor(None, self._end_recompute, recs)
        if self.epoch != epoch:
            return
        self.guard_checks += len(recs)
        for wid, rec in recs:
            err = errors[wid]
            log.info("%s: end check: recomputed %s's unverified push of step %d mbs %s: relative error %.3g",
                     self.name, wid, rec.key[4], list(rec.mbs), err)
            reason = ban_reason("", err, 0, self.guard_cfg)
            self.end_records.pop(wid, None)
            if reason:
                async with self.cond:
                    self._guard_ban(wid, step, f"the run's end check of its push of step {rec.key[4]}: {reason}")
            else:
                self.guard_ok[wid] = self.guard_ok.get(wid, 0) + 1
        self._end_prune()
