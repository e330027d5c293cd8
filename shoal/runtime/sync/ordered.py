"""Exact sync's ordered gradient pushes, as a worker holds them until the step's flush.

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
must push alone.
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
