"""Lean local-mode workers (``--lean-workers``, ``SyncPolicy.lean``): 12 bytes a parameter.

A local-mode worker keeps each task's parameter gradient apart from the step's sum until the
server has accepted the task's result (:class:`shoal.runtime.sync.ordered.LocalFold`), so that
a refused result never enters the inner step; with its inner AdamW's two fp32 moments that is
20 bytes a parameter (``shoal.plan.cost.stage_worker_memory``), which keeps a whole gpt-1.3b
off a 24 GB card. A lean worker lets backward add each task's gradient straight into the
parameters' ``.grad`` -- the step's sum, in the order its tasks come -- and keeps its inner
moments in bf16 (:class:`shoal.train.optim.LeanAdamW`): fp32 weights, the sum and the moments
are 4 + 4 + 4 bytes (``shoal.plan.cost.LEAN_WORKER_BYTES_PER_PARAM``), with no gradient held
for a result on its way.

A task's gradient is in the sum before its result is answered, so the sum is all or nothing:
:class:`LeanSum` decides which accepted results it counts. A result refused (or one that never
lands) spoils the step's sum: the sum is not reported; the worker drops it, counts nothing more
of that step, and at the step's flush releases what the server holds of it, which the pool
then redoes (the path of a lost push, docs/runtime-operations.md). Nothing is counted that the
sum does not hold, and nothing is in a reported sum that the server did not accept. Refusals
come from faults (a lease that ran out, a ban, a roll-back), so the redone work is rare.

The sum is cleared on the compute thread only (:meth:`LeanSum.begin`, before a backward task),
never while a backward adds into it; the event loop only bumps the sum's identity.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class LeanShare:
    """What one backward task added to a lean sum: the sum it went into (``token``), and
    whether its result's answer has been settled (:meth:`LeanSum.settle` or a spoil)."""

    token: tuple[int, int, int]  # (the sum's number, epoch, step) when the task began
    settled: bool = False


class LeanSum:
    """Which gradients the parameters' ``.grad`` holds for a lean worker, and which count.

    ``number`` names the sum: it changes whenever the sum held may not be reported any more
    (it was reported, the server moved on, or it is spoiled); the next backward task clears the
    gradients first. ``spoiled`` is the ``(epoch, step)`` whose results count no more until the
    worker has released what the server holds of it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (begin runs on the compute thread, the rest on the loop)
        self.number = 0  # the current sum's number
        self.held: tuple[int, int, int] | None = None  # (number, epoch, step) the gradients hold now
        self.spoiled: tuple[int, int] | None = None  # the step whose results count no more

    def begin(self, epoch: int, step: int) -> tuple[bool, LeanShare]:
        """A backward task of ``step`` starts: whether to clear the gradients first (they hold
        another sum), and its share."""
        with self._lock:
            token = (self.number, epoch, step)
            clear = self.held != token
            self.held = token
            return clear, LeanShare(token)

    def settle(self, share: LeanShare, accepted: bool) -> bool:
        """The answer to a share's result: whether it counts (accepted, and its sum is still
        the one the gradients hold, not spoiled). Anything else spoils its step's sum."""
        with self._lock:
            share.settled = True
            _, epoch, step = share.token
            if accepted and self.held == share.token == (self.number, epoch, step) and self.spoiled != (epoch, step):
                return True
            self._spoil(epoch, step)
            return False

    def spoil(self, epoch: int, step: int) -> None:
        """The sum of ``step`` may not be reported (a result it holds is not the server's, or
        one the server counts is not in it): nothing of that step counts until :meth:`released`."""
        with self._lock:
            self._spoil(epoch, step)

    def _spoil(self, epoch: int, step: int) -> None:
        # (a step the gradients no longer hold was cleared with its sum: nothing to spoil, and
        # the step they hold now stays as it is)
        if self.held is not None and self.held[1:] == (epoch, step):
            self.spoiled = (epoch, step)
            self.number += 1

    def drop(self) -> None:
        """The sum held is not to be reported (it was, or the server moved on): a new one starts."""
        with self._lock:
            self.number += 1

    def released(self, epoch: int, step: int) -> None:
        """The worker released what the server holds of ``step``: its redone tasks count again."""
        with self._lock:
            if self.spoiled == (epoch, step):
                self.spoiled = None
            self.number += 1

    def holds(self, epoch: int, step: int) -> bool:
        """Whether the gradients are the sum of ``step``'s counted results (to report)."""
        with self._lock:
            return self.held == (self.number, epoch, step) and self.spoiled != (epoch, step)
