"""A worker's gradients of one step, summed in micro-batch order: exact sync's ordered pushes,
as a worker holds them until the step's flush, and local mode's sum for the inner step.

In exact sync (``ordered_grads``, the default of ``shoal launch``) the stage server sums a
step's parameter gradients in micro-batch order, ``((g_0 + g_1) + g_2) + ...``, what autograd
accumulation does in ``shoal train --local``, so the weights are the same bits. A worker can
pre-sum only a run of micro-batches from 0 (it is the start of the server's sum); every other
micro-batch's gradient goes to the server alone (docs/runtime-operations.md).

Kept apart until the flush, a step's gradients would be a whole-stage gradient per micro-batch
the worker ran: ``M`` copies on a stage's only worker (a gpt-1.3b stage of 4 at ``M = 64``:
85 GB). :class:`PrefixFold` adds each gradient of the run into the run's sum as it arrives, in
order (one that comes out of order waits for the gap), so a stage's only worker holds one sum;
a worker of a shared stage still holds one gradient per micro-batch outside the run, which it
must push alone. In local mode nothing is pushed per micro-batch: :class:`LocalFold` sums those
too as they come, so a local-mode worker holds a few gradients whatever the step's size.
"""

from __future__ import annotations

import threading

import torch

Grads = dict[str, torch.Tensor]


def ordered_groups(per_mb: dict[int, Grads]) -> list[tuple[list[int], Grads]]:
    """Pushes for per-micro-batch gradients that the server can sum in micro-batch order: the
    run ``0..k-1`` pre-summed in that order, then every other micro-batch alone (a
    :class:`PrefixFold` given them in micro-batch order)."""
    fold = PrefixFold()
    for mb in sorted(per_mb):
        fold.add(mb, per_mb[mb])
    return fold.groups()


class PrefixFold:
    """One step's ordered gradients of one worker, the run from micro-batch 0 summed as it grows.

    :meth:`add` takes each accepted micro-batch's gradient in any order; :meth:`groups` gives
    the pushes: the run's sum ``clone(g_0)``, then ``add_(g_1)``, ``add_(g_2)``, ... in order
    (whenever they arrived: the same bits), then every other micro-batch's gradient alone.
    A gradient is never changed in place: the first of the run is cloned before anything is
    added to it (a shadow worker's gradients are shared tensors).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (a worker adds a large stage's gradients in threads)
        self.run = 0  # micro-batches 0..run-1 are in the run's sum
        self.total: Grads | None = None  # their sum (g_0 itself while the run is one long)
        self.apart: dict[int, Grads] = {}  # every other micro-batch's gradient, by micro-batch

    def add(self, mb: int, grads: Grads) -> bool:
        """Take micro-batch ``mb``'s gradient; False (and nothing changes) if it is held already:
        in exact sync a micro-batch computed twice at the same weights gives the same bits, so
        the first one stays (as the sum it is already part of must)."""
        with self._lock:
            if mb < self.run or mb in self.apart:
                return False
            self.apart[mb] = grads
            while self.run in self.apart:
                g = self.apart.pop(self.run)
                if self.total is None:
                    self.total = g
                else:
                    if self.run == 1:
                        self.total = {n: t.clone() for n, t in self.total.items()}
                    for n, t in g.items():
                        self.total[n].add_(t)
                self.run += 1
            return True

    def held(self) -> int:
        """Whole-stage gradients held: the run's sum and every micro-batch apart."""
        with self._lock:
            return len(self.apart) + (self.total is not None)

    def groups(self) -> list[tuple[list[int], Grads]]:
        """The pushes, as :func:`ordered_groups` makes them."""
        with self._lock:
            out: list[tuple[list[int], Grads]] = []
            if self.total is not None:
                out.append((list(range(self.run)), self.total))
            return out + [([mb], self.apart[mb]) for mb in sorted(self.apart)]


# Gradients of micro-batches outside the run from 0 that a local-mode worker keeps apart, at least,
# before it adds the smallest into its second sum: a result acknowledged before the one just
# before it (a worker has WorkerOptions.uploads_in_flight = 2 results in flight) waits for it
# here, and the run stays in micro-batch order. A worker keeps more while its device has room
# (Worker._apart_room): a stalled upload overtaken by several others keeps the order too.
LOCAL_APART = 1


class LocalFold:
    """One step's gradients of one local-mode worker, summed as the server accepts them: at most
    ``apart + 2`` whole-stage gradients at any time (``room + 2`` where :meth:`add` is given
    more room), whatever the step's size.

    The inner step takes the sum over the worker's own micro-batches. In micro-batch order it is
    what autograd's accumulation gives ``shoal train --local``, which a stage's only worker
    matches bit for bit at ``H = 1`` (docs/sync-runtime.md, "Exactness"): its micro-batches are
    0, 1, 2, ..., summed as :class:`PrefixFold`'s run (one acknowledged early waits for the gap).
    A worker of a shared stage runs some of them (0, 3, 5, ...): its run stops at the first gap,
    so the others are kept apart until more than ``apart`` are, then the smallest goes into a
    second sum (the rest, in the order they leave). The step's sum is the run's, then the
    rest's, then those still apart in micro-batch order: deterministic for the order the server
    accepted them in, which a shared stage's timing decides anyway.

    (Keeping each micro-batch's gradient to the step's end would hold ``k`` whole-stage gradients
    on the device of a worker that ran ``k``: bench/results/worker-memory.md.)
    """

    def __init__(self, apart: int = LOCAL_APART) -> None:
        self._lock = threading.Lock()
        self.limit = max(0, apart)  # gradients kept apart before the smallest joins the rest
        self.prefix = PrefixFold()  # the run from micro-batch 0, and what is kept apart
        self.rest: Grads | None = None  # the sum of those that left the apart set (a fresh copy)
        self.rest_mbs: list[int] = []  # their micro-batches, in the order they were added

    def add(self, mb: int, grads: Grads, room: int = 0) -> bool:
        """Take micro-batch ``mb``'s gradient (any order), keeping up to ``max(apart, room)``
        apart; False if it is held already (the first stays, as :meth:`PrefixFold.add`)."""
        with self._lock:
            if mb in self.rest_mbs or not self.prefix.add(mb, grads):
                return False
            apart = self.prefix.apart
            while len(apart) > max(self.limit, room):
                low = min(apart)
                g = apart.pop(low)
                if self.rest is None:
                    self.rest = {n: t.clone() for n, t in g.items()}  # (shadow gradients are shared)
                else:
                    for n, t in g.items():
                        self.rest[n].add_(t)
                self.rest_mbs.append(low)
            return True

    def held(self) -> int:
        """Whole-stage gradients held: the run's sum, the rest's and each one apart."""
        with self._lock:
            return self.prefix.held() + (self.rest is not None)

    def total(self) -> Grads:
        """The step's sum (empty: no gradient), which the caller may add into: it is built in
        the fold's own sums, so the fold is spent (drop it after)."""
        with self._lock:
            groups = self.prefix.groups()
            run = groups[:1] if self.prefix.run else []
            parts = [g for _, g in run] + ([self.rest] if self.rest is not None else []) \
                + [g for _, g in groups[len(run):]]
            if not parts:
                return {}
            # the run's sum is the fold's own copy from its second gradient on, the rest's always;
            # a lone gradient is the task's own (a shadow worker's is shared): copied
            owned = self.prefix.run >= 2 if run else self.rest is not None
            out = parts[0] if owned else {n: t.clone() for n, t in parts[0].items()}
            for g in parts[1:]:
                for n, t in g.items():
                    out[n].add_(t)
            return out
