"""The run's end check: each worker's most recent unverified push, recomputed before the last
step commits (the stage server's side, a mixin; docs/poisoning-undo.md, "The run's end check").

The last step's pushes are all recomputed, but a worker that takes no task of the last step
(a faster worker took them, or it stopped asking) would otherwise finish the run with its
unverified pushes unseen. So each stage server keeps, per worker, a record of its most
recent step with exact pushes that were not recomputed (a sample of their sum, with the
micro-batches' inputs and output gradients, and a copy of the stage's weights of that
version), and at the last step's commit, before the step is reported, recomputes it for
every worker that pushed nothing in the last step. A lie found bans the worker, and the ban
rolls the run back past all its unverified pushes as any ban does: a worker that lies on
every push from some step on cannot finish a run unseen, whether or not it works in the
last step.

The sample. A record keeps, of every tensor of the summed gradient, ``ceil(n / k)`` of its
``n`` coordinates (``k`` = ``GuardConfig.end_sample_every``, 64), at positions drawn
uniformly from a seed the server draws from its own randomness at the commit, after the
pushes arrived, and never sends (tensors of at most ``end_sample_whole`` elements are kept
whole). The end check compares those coordinates of the worker's sum with the same
coordinates of the recomputation (relative L2 over them, the same ``rel_tol``). Why that
still catches a lie: the push was fixed before the positions existed, so each drawn position
lands on one of the ``m`` coordinates a lie changed with probability ``m / n``, independently;
the lie escapes only if every one misses, with probability ``(1 - m/n)^(n/k)``, about
``(1 - 1/k)^m`` (``exp(-m/k)``): 2e-7 for a lie touching 1 000 coordinates, never in practice
for the attacks of docs/poisoning.md (noise, bias, scaling, sign flip touch every coordinate).
A dense lie's relative error over the sample estimates its error over all coordinates (both
sums are means of n/k independent terms), so a lie above ``rel_tol`` stays above it. What can
escape: a lie confined to a few coordinates of a large tensor (about 1 - m/k for m << k);
one large enough to matter there makes the push's norm stand out to the screen
(docs/poisoning.md), which recomputes it whole.

Cost: memory per worker with a record, 1/k of the stage's gradient (+ at most 16 KiB per
small tensor kept whole) and its micro-batches' inputs; one copy of the stage's weights per
distinct step the records name (shared by the workers of a step, dropped when no record
names it); one clone of the weights per commit with an unverified push (needed: the
update overwrites them in place, and which workers will miss the last step is unknown until
then); at the run's end the forward and backward of those micro-batches for each such worker.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

import torch

from shoal.model.transformer import build_stage
from shoal.runtime.safety.guard import ban_reason, rel_error
from shoal.runtime.safety.verify import load_weights, recompute_sum, sq_diff, sq_norm

log = logging.getLogger("shoal.server")

Key = tuple[int, int, int, int, int]  # (epoch, stage, first layer, last layer, step)


@dataclass
class EndRecord:
    """A worker's most recent step with unverified exact pushes at this stage."""

    key: Key  # whose weights (version ``step`` of that epoch and stage) the pushes were computed on
    mbs: tuple[int, ...]  # its micro-batches of the step, in order
    grads: dict[str, torch.Tensor]  # a sample of the sum of its unverified pushes of the step (sample_index)
    seed: int  # the sample's positions (sample_index): the server's secret, drawn after the pushes
    numels: dict[str, int]  # each tensor's element count (the positions are drawn from it)
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


def sample_index(numels: dict[str, int], seed: int, every: int, whole: int) -> dict[str, torch.Tensor | None]:
    """The positions a record keeps of each flattened tensor (pure, from ``seed``): None keeps a
    tensor of at most ``whole`` elements (or all when ``every`` <= 1) whole; else
    ``ceil(n / every)`` positions drawn uniformly, with replacement, among its ``n``."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor | None] = {}
    for name in sorted(numels):
        n = numels[name]
        out[name] = None if every <= 1 or n <= whole else torch.randint(n, (-(-n // every),), generator=gen)
    return out


def take_sample(grads: dict[str, torch.Tensor], index: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The coordinates ``index`` names of each tensor of ``grads`` (a copy: a 1-D tensor each)."""
    return {n: grads[n].detach().reshape(-1).clone() if i is None else grads[n].detach().reshape(-1)[i]
            for n, i in index.items()}


def sampled_error(sample: dict[str, torch.Tensor], numels: dict[str, int], seed: int, every: int, whole: int,
                  recomputed: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of a record's sample (of tensors of ``numels`` elements, positions from
    ``seed``) against the same coordinates of the recomputation (inf when a tensor of the
    record is missing there or has another size)."""
    if any(n not in recomputed or recomputed[n].numel() != k for n, k in numels.items()):
        return float("inf")
    ref = take_sample(recomputed, sample_index(numels, seed, every, whole))
    return rel_error(sq_diff(sample, ref), sq_norm(ref))


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

    def _end_active(self) -> bool:
        """Whether the run's last step has an end check (else no record is kept: no weight clones).
        Like the last step's full check it needs the guard and ``--spot-check`` > 0; exact runs only."""
        cfg = self.guard_cfg
        return (cfg.enabled and cfg.end_check and cfg.verify_last_step and self.spec.guard_spot_check > 0
                and not self.spec.shadow and not self.local)

    def _end_note(self, wid: str, ids: list[int]) -> None:
        """An exact push was counted without a recomputation (or a check by another worker)."""
        self.end_ids.add((wid, tuple(ids)))

    async def _end_record(self, step: int, epoch: int) -> None:
        """At a commit, under the weights lock and before the update: keep each worker's
        unverified pushes of the step (replacing its older record) and the weights they were
        computed on."""
        ids, self.end_ids = self.end_ids, set()
        if not ids or not self._end_active():
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
        every, whole = self.guard_cfg.end_sample_every, self.guard_cfg.end_sample_whole
        for wid, pushes in mine.items():
            seed = secrets.randbits(63)  # drawn now, after the pushes: no worker can aim a lie past it
            numels = {n: t.numel() for n, t in pushes[0][1].items()}

            def sample(pushes=pushes, seed=seed, numels=numels) -> dict[str, torch.Tensor]:
                index = sample_index(numels, seed, every, whole)
                return sum_grads([take_sample(g, index) for _, g in pushes])

            grads = await loop.run_in_executor(None, sample)
            mbs = tuple(mb for m, _ in pushes for mb in m)
            self.end_records[wid] = EndRecord(key, mbs, grads, seed, numels,
                                              [(mb, states[mb].input, states[mb].out_grad) for mb in mbs],
                                              self.loss_scale)
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
        on a fresh module loaded with the weights of the record's version, over the record's
        sample of coordinates."""
        module = build_stage(self.cfg, self.first, self.last, seed=self.spec.seed)
        errors: dict[str, float] = {}
        loaded = None
        for wid, rec in recs:
            if loaded != rec.key:
                load_weights(module, self.end_weights[rec.key])
                loaded = rec.key
            mine = recompute_sum(module, self.spec, rec.key[4], rec.inputs, first=self.is_first, last=self.is_last,
                                 loss_scale=rec.loss_scale)
            errors[wid] = sampled_error(rec.grads, rec.numels, rec.seed, self.guard_cfg.end_sample_every,
                                        self.guard_cfg.end_sample_whole, mine)
        return errors

    async def _end_checks(self, step: int, epoch: int) -> None:
        """At the last step's commit, before its report: recompute the newest unverified pushes of
        every worker that pushed nothing in this step (its pushes here were all recomputed);
        one that lied is banned (the ban's undo follows from the heartbeat sent before the report)."""
        if not self._end_active():
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
