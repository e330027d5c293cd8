"""Deferred checks: a stage server's routine recomputations run beside the steps, not in them
(the stage server's side, a mixin; docs/poisoning.md, "Deferred checks").

A push the server recomputes (a worker's first pushes, a random draw that no other worker
can check) would hold its step if it were judged before it counted: the server computes on
its CPU, and beside a GPU worker that is 37-70 s for one push of gpt-125m that the GPU
computed in 0.2 s (bench/results/gpu-runtime.md).

So routine checks are deferred: the push counts at once as an *unverified* push (the undo
record of docs/poisoning-undo.md holds its step), and the server recomputes it on a thread
of its own, from a copy of the weights the push was computed on. A match clears it as
before (the worker's record of passed checks grows); a mismatch bans the worker, and the
ban's undo rolls the run back past the step, as for any unverified push a ban finds. What
the screen flagged (but for a push flagged only as too small, no sign of a lie), a drift
suspect's pushes and the last step's stay inline (likely lies, or the run's end: caught
before they count); the last step's commit waits for the checks still under way, so no run
ends with a check undecided.

The server checks as fast as its CPU allows, not faster: at most ``deferred_pending``
checks are held (each holds the push, and a copy of the stage's weights shared by the checks
of one version: at most twice the stage's weights and twice its gradient); a push that would
be checked while they are full counts as unverified unchecked, like an undrawn push (the
last step's full check, the run's end check and later draws still see its worker).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shoal.model.transformer import build_stage
from shoal.runtime.safety.guard import ban_reason, rel_error
from shoal.runtime.safety.verify import load_weights, recompute_sum, sq_diff, sq_norm
from shoal.threads import compute_pool

log = logging.getLogger("shoal.server")

Shape = tuple[int, int, int]  # (stage, first layer, last layer)


@dataclass
class DeferredCheck:
    """One push to recompute beside the steps."""

    worker: str  # the pushing worker's member id
    step: int  # the step (and version of the weights) it was computed for
    epoch: int  # the epoch of that version
    mbs: tuple[int, ...]  # its micro-batches
    grads: dict[str, torch.Tensor]  # the push, decoded (never changed: the commit sums copies)
    inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None]]  # (mb, stage input, output gradient)
    shape: Shape  # the stage it was pushed to
    ends: tuple[bool, bool]  # (first stage, last stage) of the model
    loss_scale: float  # the step's loss scale (1 outside fp16)
    lowp: bool  # judged within the bf16 tolerance (an fp32 recomputation of a bf16 push)
    why: str  # what drew the check, for the log ("its first", "spot check at rate 0.67")
    weights: dict[str, torch.Tensor] | None = None  # copy of the stage's weights of that version


def deferred_room(pending: int, cfg) -> bool:
    """Whether a server holding ``pending`` deferred checks takes one more (pure)."""
    return pending < cfg.deferred_pending


def defer_check(flag: str, small: bool, last: bool, suspect: bool, cfg) -> bool:
    """Whether a push's server recomputation is deferred (pure): routine checks only. A screen
    flag (unless ``small``: flagged only as too small, guard.low_only, which honest pushes are
    whenever the norms fall fast early in training), a drift suspect and the run's last step
    are judged before the push counts."""
    return cfg.deferred_checks and (not flag or small) and not last and not suspect


class DeferredCheckMixin:
    """The deferred checks of a :class:`~shoal.runtime.roles.server.StageServer`."""

    def _deferred_init(self) -> None:
        self.deferred: list[DeferredCheck] = []  # held checks, the one under way first
        self.deferred_task: asyncio.Task | None = None  # the loop that works through them
        self.deferred_done = 0  # checks judged beside the steps
        self.deferred_skipped = 0  # pushes that would have been checked while the checks were full
        # One thread of its own: a recomputation (tens of seconds beside a GPU) never holds up
        # the default executor's commits, sums and serialisations.
        self._deferred_pool: ThreadPoolExecutor | None = None
        self._deferred_module: tuple[Shape, torch.nn.Module] | None = None

    async def _defer(self, chk: DeferredCheck) -> bool:
        """Hold ``chk`` and start the checks if idle; False (nothing held) when they are full.
        Called under no lock; takes the weights lock for the copy of the weights."""
        if not deferred_room(len(self.deferred), self.guard_cfg):
            self.deferred_skipped += 1
            return False
        loop = asyncio.get_running_loop()
        async with self._wlock:
            if self.version != chk.step or self.epoch != chk.epoch:
                return False  # (a commit or rollback came first: the push is stale anyway)
            # Checks of one version share one copy (a step's first pushes of several workers).
            same = next((c.weights for c in self.deferred if (c.epoch, c.step, c.shape) == (chk.epoch, chk.step,
                                                                                         chk.shape)), None)
            params = self.params
            chk.weights = same if same is not None else await loop.run_in_executor(
                None, lambda: {n: p.detach().clone() for n, p in params.items()})
        self.deferred.append(chk)
        if self.deferred_task is None:
            self.deferred_task = asyncio.create_task(self._deferred_run())
            self._bg.add(self.deferred_task)  # cancelled when the server stops
            self.deferred_task.add_done_callback(self._bg_done)  # a failure of its own is not lost
        return True

    def _deferred_held(self, worker: str) -> int:
        """How many of ``worker``'s pushes wait for their check here (the one under way included)."""
        return sum(1 for c in self.deferred if c.worker == worker)

    def _deferred_recompute(self, chk: DeferredCheck) -> float:
        """Relative error of ``chk``'s push against this server's recomputation (on its thread)."""
        cached = self._deferred_module
        if cached is None or cached[0] != chk.shape:
            cached = self._deferred_module = (chk.shape, build_stage(self.cfg, chk.shape[1], chk.shape[2],
                                                                     seed=self.spec.seed))
        module = load_weights(cached[1], chk.weights)
        mine = recompute_sum(module, self.spec, chk.step, chk.inputs, first=chk.ends[0], last=chk.ends[1],
                             loss_scale=chk.loss_scale)
        return rel_error(sq_diff(chk.grads, mine), sq_norm(mine))

    async def _deferred_run(self) -> None:
        """Work through the held checks, one at a time, and judge each."""
        loop = asyncio.get_running_loop()
        try:
            while self.deferred:
                chk = self.deferred[0]
                if chk.worker not in self.guard_banned:
                    if self._deferred_pool is None:
                        self._deferred_pool = compute_pool(1, "shoal-check")
                    try:
                        err = await loop.run_in_executor(self._deferred_pool, self._deferred_recompute, chk)
                    except Exception as exc:  # the push stays unverified (the end check may see it): no verdict
                        log.error("%s: the deferred check of %s's push of step %d failed: %s", self.name,
                                  chk.worker, chk.step, exc)
                    else:
                        await self._deferred_verdict(chk, err)
                self.deferred.pop(0)
        finally:
            self.deferred_task = None
            async with self.cond:
                self.cond.notify_all()

    async def _deferred_verdict(self, chk: DeferredCheck, err: float) -> None:
        """A match clears the push as an inline check would; a mismatch bans its worker (its
        undo rolls the run back past the push's step once committed)."""
        if chk.worker in self.guard_banned:
            return
        self.guard_checks += 1
        self.deferred_done += 1
        log.info("%s: recomputed the push of %s (step %d mbs %s, %s) beside the steps: relative error %.3g",
                 self.name, chk.worker, chk.step, list(chk.mbs), chk.why, err)
        reason = ban_reason("", err, 0, self.guard_cfg, chk.lowp)
        if reason:
            async with self.cond:  # _guard_ban wakes the waiters: notify needs the lock
                self._guard_ban(chk.worker, self.step, f"a deferred check of its push of step {chk.step}: {reason}")
            return
        self.guard_ok[chk.worker] = self.guard_ok.get(chk.worker, 0) + 1
        self.guard_seen.add(chk.worker)

    async def _deferred_drain(self, epoch: int) -> None:
        """Wait until no deferred check is held (the last step's commit: the run never ends with
        a check undecided), or until a rollback starts another epoch."""
        while self.deferred_task is not None and self.epoch == epoch:
            await self.cond.wait(1.0)

    def _deferred_close(self) -> None:
        if self._deferred_pool is not None:
            self._deferred_pool.shutdown(wait=False, cancel_futures=True)
            self._deferred_pool = None
