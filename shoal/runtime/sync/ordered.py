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
a worker of a shared stage gets micro-batches outside the run, which it must push alone: it
holds them to the flush while its device has room beyond the plan, else pushes them at once. In
local mode nothing is pushed per micro-batch: :class:`LocalFold` sums those too as they come, so
a local-mode worker on a tight device holds one sum whatever the step's size.
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
    A gradient is not changed in place unless ``owned`` (a real worker's task gradients are its
    own): else the first of the run is cloned before anything is added to it (a shadow worker's
    gradients are shared tensors). Owned, the run's sum is built in its first gradient: no copy
    of the stage beyond the gradients themselves (``g_0 + g_1`` is the same bits either way).
    With ``prefix=False`` no run is summed: every micro-batch is pushed alone (the server's sum
    is the same bits); a test's ``hang_mid_push`` fault uses it so that any worker holding two
    micro-batches of a step has a second push to come.
    """

    def __init__(self, owned: bool = False, prefix: bool = True) -> None:
        self._lock = threading.Lock()  # (a worker adds a large stage's gradients in threads)
        self.owned = owned  # the gradients added are the fold's to add into
        self.prefix = prefix  # the run from micro-batch 0 is summed into one push (else all apart)
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
            while self.prefix and self.run in self.apart:
                g = self.apart.pop(self.run)
                if self.total is None:
                    self.total = g
                else:
                    if self.run == 1 and not self.owned:
                        self.total = {n: t.clone() for n, t in self.total.items()}
                    for n, t in g.items():
                        self.total[n].add_(t)
                self.run += 1
            return True

    def take_apart(self, keep: int) -> list[tuple[int, Grads]]:
        """Remove and return the gradients apart beyond the ``keep`` smallest micro-batches,
        largest first (exact sync pushes them alone at once: a worker whose device has no room
        to hold them to the flush; the smallest are the likeliest to join the run)."""
        with self._lock:
            out = []
            for mb in sorted(self.apart, reverse=True)[:max(0, len(self.apart) - max(0, keep))]:
                out.append((mb, self.apart.pop(mb)))
            return out

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


# Gradients apart from the run that an exact-sync worker keeps to the flush, at least, before it
# pushes them alone at once (Worker._push_apart): one, so that a backward task that comes before
# the one just before it (the next stage's workers finish them out of order) waits for its gap
# and the run goes on; without it a stage's only worker would push every later micro-batch of
# the step alone (the server can only take a run from 0 pre-summed). One gradient beyond the plan.
EXACT_APART = 1

# Gradients of micro-batches outside the run from 0 that a local-mode worker keeps apart, at least:
# none. A result acknowledged before the one just before it (a worker has
# WorkerOptions.uploads_in_flight = 2 results in flight) waits for its gap only while the
# worker's device has room beyond its plan (Worker._apart_room); on a tight device the step's
# sum gives up the micro-batch order instead of holding a gradient the plan did not count.
LOCAL_APART = 0


class LocalFold:
    """One step's gradients of one local-mode worker, summed as the server accepts them: the sum
    and at most ``max(apart, room)`` gradients waiting for their gap (``room`` as :meth:`add`
    is given it), whatever the step's size.

    The inner step takes the sum over the worker's own micro-batches. In micro-batch order it is
    what autograd's accumulation gives ``shoal train --local``, which a stage's only worker
    matches bit for bit at ``H = 1`` (docs/sync-runtime.md, "Exactness"): its micro-batches are
    0, 1, 2, ..., summed as :class:`PrefixFold`'s run (one acknowledged early waits for the gap).
    A worker of a shared stage runs some of them (0, 3, 5, ...): its run stops at the first gap,
    so the others wait apart; once more wait than its device has room for, the order is given
    up: the run's sum and those apart (in micro-batch order) become one sum, and every gradient
    after them is added into it as it comes. Deterministic for the order the server accepted
    them in, which a shared stage's timing decides anyway; a tight device holds one sum, what
    the plan counts (:data:`shoal.model.profile.WORKER_BYTES_PER_PARAM`).

    (Keeping each micro-batch's gradient to the step's end would hold ``k`` whole-stage gradients
    on the device of a worker that ran ``k``: bench/results/worker-memory.md.)
    """

    def __init__(self, apart: int = LOCAL_APART, owned: bool = False) -> None:
        self._lock = threading.Lock()
        self.limit = max(0, apart)  # gradients kept apart, at least, before the order is given up
        self.owned = owned  # the gradients added are the fold's to add into (PrefixFold.owned)
        self.prefix = PrefixFold(owned)  # the run from micro-batch 0, and what is kept apart
        self.rest: Grads | None = None  # the one sum once the order is given up (then the prefix is empty)
        self.rest_mbs: list[int] = []  # its micro-batches, in the order they were added

    def add(self, mb: int, grads: Grads, room: int = 0) -> bool:
        """Take micro-batch ``mb``'s gradient (any order), keeping up to ``max(apart, room)``
        apart; False if it is held already (the first stays, as :meth:`PrefixFold.add`)."""
        with self._lock:
            if self.rest is not None:
                if mb in self.rest_mbs:
                    return False
                for n, t in grads.items():
                    self.rest[n].add_(t)
                self.rest_mbs.append(mb)
                return True
            if not self.prefix.add(mb, grads):
                return False
            if len(self.prefix.apart) > max(self.limit, room):
                groups = self.prefix.groups()  # the run's sum first, then those apart in order
                first = groups[0][1]
                owned = self.owned or self.prefix.run >= 2  # (else the first is a task's own)
                self.rest = first if owned else {n: t.clone() for n, t in first.items()}
                for _, g in groups[1:]:
                    for n, t in g.items():
                        self.rest[n].add_(t)
                self.rest_mbs = [m for mbs, _ in groups for m in mbs]
                self.prefix = PrefixFold(self.owned)
            return True

    def held(self) -> int:
        """Whole-stage gradients held: the sum, and each one apart while the order is kept."""
        with self._lock:
            return 1 if self.rest is not None else self.prefix.held()

    def total(self) -> Grads:
        """The step's sum (empty: no gradient), which the caller may add into: it is built in
        the fold's own sums, so the fold is spent (drop it after)."""
        with self._lock:
            if self.rest is not None:
                return self.rest
            groups = self.prefix.groups()
            if not groups:
                return {}
            # the run's sum is the fold's own from its second gradient on; a lone gradient is
            # the task's own (a shadow worker's is shared): copied unless owned
            first = groups[0][1]
            owned = self.owned or (self.prefix.run >= 2)
            out = first if owned else {n: t.clone() for n, t in first.items()}
            for _, g in groups[1:]:
                for n, t in g.items():
                    out[n].add_(t)
            return out


class PushFold:
    """A stage server's sum of one exact step's pushes, made as they arrive in the order the
    commit sums them (by first micro-batch: the local trainer's order, bit for bit).

    A push is added once every micro-batch before its first is covered by pushes already added:
    no later push can then come before it in that order (the step's pushes cover disjoint
    micro-batches). So a step whose pushes arrive roughly in order is summed while its drain
    runs, not after its last push (a gpt-1.3b stage takes 2.6 ns a parameter a push:
    bench/results/server-cpu.md). Not thread-safe: the server adds one push at a time.
    :meth:`result` gives the sum only if the pushes added are exactly the commit's list, in its
    order (one taken back by a ban: None, and the commit sums them anew)."""

    def __init__(self) -> None:
        self.sums: Grads = {}  # the parameters' gradients summed so far
        self.taken: list[tuple] = []  # the pushes added, in order
        self._covered: set[int] = set()
        self.next = 0  # the least micro-batch no added push covers

    def ready(self, pushes: list[tuple]) -> tuple | None:
        """The push of ``pushes`` (``(first micro-batch, grads, worker, micro-batches)``) that
        comes next in the sum, if it is there (one added already covers its first micro-batch,
        which ``next`` never is)."""
        return next((p for p in pushes if p[0] == self.next), None)

    def take(self, push: tuple) -> None:
        """Add ``push`` (the one :meth:`ready` gave) into the sum."""
        for name, g in push[1].items():
            s = self.sums.get(name)
            if s is None:
                self.sums[name] = g.clone()
            else:
                s.add_(g)
        self.taken.append(push)
        self._covered.update(push[3])
        while self.next in self._covered:
            self.next += 1

    def result(self, pushes: list[tuple]) -> Grads | None:
        """The sum of ``pushes`` (sorted as the commit sums them) if it is the one made here."""
        if len(pushes) != len(self.taken) or any(a is not b for a, b in zip(pushes, self.taken, strict=True)):
            return None
        return self.sums
