"""The task pool's plain data and decisions: micro-batch states, leases, todo queues.

No I/O here: the stage server (:mod:`shoal.runtime.roles.server`) holds these and does the
network and the optimizer around them.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch

from shoal.plan.cost import FASTER_BY


class StepTally:
    """Counts over one step's micro-batches, kept by their :class:`MbState` s as they change:
    how many are in each gradient state and in each (forward, gradient) pair of states, and
    how many leased or computed gradients each worker holds. The per-task questions (is every
    gradient computed, does this worker hold one, is the step all counted) and the
    per-heartbeat figures (:func:`pool_figures`, :func:`wait_counts`) are then answered
    without a scan over the step's M micro-batches."""

    __slots__ = ("grad", "pairs", "computed_by", "leased_by", "n")

    def __init__(self) -> None:
        self.grad: dict[str, int] = {}  # gradient state -> micro-batches in it
        self.pairs: dict[tuple[str, str], int] = {}  # (forward state, gradient state) -> micro-batches
        self.computed_by: dict[str, int] = {}  # worker -> its computed (un-pushed) gradients
        self.leased_by: dict[str, int] = {}  # worker -> the gradient tasks it holds leased
        self.n = 0  # micro-batches of the step

    def _move(self, state: str, holder: str, d: int) -> None:
        self.grad[state] = self.grad.get(state, 0) + d
        if state == "computed" or state == "leased":
            by = self.computed_by if state == "computed" else self.leased_by
            n = by.get(holder, 0) + d
            if n:
                by[holder] = n
            else:
                del by[holder]

    def _pair(self, fwd: str, grad: str, d: int) -> None:
        key = (fwd, grad)
        n = self.pairs.get(key, 0) + d
        if n:
            self.pairs[key] = n
        else:
            del self.pairs[key]

    def all_in(self, *states: str) -> bool:
        """Whether the step has micro-batches and every one's gradient is in ``states``."""
        return self.n > 0 and sum(self.grad.get(s, 0) for s in states) == self.n

    def holds_computed(self, wid: str) -> bool:
        """Whether ``wid`` holds a computed gradient of the step."""
        return self.computed_by.get(wid, 0) > 0

    def count(self, pred) -> int:
        """Micro-batches whose (forward, gradient) states satisfy ``pred(fwd, grad)`` (a look
        at the at most 20 pairs present, not at the M micro-batches)."""
        return sum(n for (f, g), n in self.pairs.items() if pred(f, g))


class MbState:
    """One micro-batch of one step at this stage.

    ``fwd``, ``grad`` and ``holder`` are kept in the step's :class:`StepTally` once the state
    is in a :class:`StepMbs` (every assignment updates the counts)."""

    __slots__ = ("input", "out_grad", "_fwd", "_grad", "_holder", "loss", "relayed_back", "fwd_by", "fwd_gen",
                 "input_frame", "out_grad_frame", "_tally")

    def __init__(self) -> None:
        # stage input (None at stage 0: tokens are rebuilt); raw, a view of input_frame's bytes;
        # a lossy relay, a wire.Undecoded (decoded only by a check: wire.tensor_of)
        self.input: torch.Tensor | None = None
        self.out_grad: torch.Tensor | None = None  # gradient of the stage output (non-last stages); as input
        self._fwd = "wait"  # wait | todo | leased | done  (non-last stages only)
        self._grad = "wait"  # wait | todo | leased | computed | counted
        self._holder = ""  # worker holding the grad lease or the computed gradient
        self.loss: float | None = None  # last stage: the micro-batch loss
        self.relayed_back = False  # the input gradient went to the previous stage
        self.fwd_by = ""  # local mode: the worker whose replica ran the forward (gets the backward)
        self.fwd_gen = 0  # that worker's generation then
        self.input_frame = None  # the input as received (a wire.Frame), handed on as is with each grant
        self.out_grad_frame = None  # the output gradient as received (a wire.Frame)
        self._tally: StepTally | None = None  # the step's counts (set when put in a StepMbs)

    @property
    def fwd(self) -> str:
        return self._fwd

    @fwd.setter
    def fwd(self, state: str) -> None:
        t = self._tally
        if t is not None:
            t._pair(self._fwd, self._grad, -1)
            t._pair(state, self._grad, 1)
        self._fwd = state

    @property
    def grad(self) -> str:
        return self._grad

    @grad.setter
    def grad(self, state: str) -> None:
        t = self._tally
        if t is not None:
            t._move(self._grad, self._holder, -1)
            t._move(state, self._holder, 1)
            t._pair(self._fwd, self._grad, -1)
            t._pair(self._fwd, state, 1)
        self._grad = state

    @property
    def holder(self) -> str:
        return self._holder

    @holder.setter
    def holder(self, wid: str) -> None:
        t = self._tally
        if t is not None and (self._grad == "computed" or self._grad == "leased"):
            t._move(self._grad, self._holder, -1)
            t._move(self._grad, wid, 1)
        self._holder = wid

    def __repr__(self) -> str:
        return f"MbState(fwd={self._fwd!r}, grad={self._grad!r}, holder={self._holder!r})"


class StepMbs(dict):
    """One step's micro-batches (``mb -> MbState``) with their :class:`StepTally` (``tally``).

    Only insertion is tallied (a step's micro-batches are never removed, only the whole
    step); a state put in keeps reporting its changes here."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = StepTally()

    def __setitem__(self, mb: int, st: MbState) -> None:
        old = self.get(mb)
        if old is st:
            return
        if old is not None:
            self.tally._move(old._grad, old._holder, -1)
            self.tally._pair(old._fwd, old._grad, -1)
            old._tally = None
            self.tally.n -= 1
        st._tally = self.tally
        self.tally._move(st._grad, st._holder, 1)
        self.tally._pair(st._fwd, st._grad, 1)
        self.tally.n += 1
        super().__setitem__(mb, st)

    def setdefault(self, mb: int, st: MbState) -> MbState:  # type: ignore[override]
        got = self.get(mb)
        if got is None:
            self[mb] = got = st
        return got


EMPTY_TALLY = StepTally()  # the figures of a step with no micro-batches (never changed)


def pool_figures(t: StepTally, is_last: bool) -> dict[str, int]:
    """A step's pool figures for the dashboard, from its counts (no scan over the step):

    ``todo``: tasks to lease (forwards and gradients); ``waiting``: micro-batches with a
    task that waits on its input (at a non-last stage a forward or a gradient waits);
    ``wait_input``: ones whose first task waits for its input; ``wait_grad`` (non-last
    stages): forwards done whose gradient from the next stage has not come.
    """
    return {
        "todo": t.count(lambda f, g: f == "todo") + t.grad.get("todo", 0),
        "waiting": t.count(lambda f, g: g == "wait" or (not is_last and f == "wait")),
        "wait_input": t.grad.get("wait", 0) if is_last else t.count(lambda f, g: f == "wait"),
        "wait_grad": 0 if is_last else t.count(lambda f, g: f == "done" and g == "wait"),
    }


def wait_counts(t: StepTally, is_last: bool) -> dict[str, int]:
    """``grad:<state>`` (and at a non-last stage ``fwd:<state>``) -> micro-batches in it,
    only states some micro-batch is in (the stall report's figures)."""
    out = {f"grad:{g}": n for g, n in t.grad.items() if n}
    if not is_last:
        for (f, _), n in t.pairs.items():
            out[f"fwd:{f}"] = out.get(f"fwd:{f}", 0) + n
    return out


def unpushed(t: StepTally) -> list[str]:
    """Workers holding computed gradients of the step not pushed yet, sorted (no empty name)."""
    return sorted(w for w in t.computed_by if w)


def holding_work(t: StepTally) -> list[str]:
    """Workers holding a gradient task of the step, leased or computed, sorted."""
    return sorted(set(t.leased_by) | set(t.computed_by))


@dataclass
class Lease:
    lease_id: int
    step: int
    mb: int
    direction: int
    worker: str
    deadline: float
    started: float


def yield_to_idle(idle_asking: dict[str, int], wid: str) -> bool:
    """Whether a lease request ``wid`` made ahead must leave the next task to another worker:
    one whose own request waits while it has nothing to do (``idle_asking``: worker -> such
    parked requests)."""
    return any(n > 0 for w, n in idle_asking.items() if w != wid)


def leave_to_faster(idle_task_s: dict[str, float | None], wid: str, free: int) -> bool:
    """Whether idle worker ``wid`` leaves the step's ``free`` open tasks (ones any worker may
    take) to faster workers that wait idle too: at least ``free`` other idle workers have a
    measured task time ``FASTER_BY`` times below ``wid``'s (``idle_task_s``: idle worker -> its
    task-time estimate, None before its first task). The step ends when its slowest task
    does, so when there are fewer open tasks than idle workers the fastest should take them,
    as the cost model assumes (``shoal.plan.cost``: a stage's tasks go to its fastest ``M``
    workers). A worker of unknown speed neither yields nor is yielded to."""
    mine = idle_task_s.get(wid)
    if mine is None or free <= 0:
        return False
    faster = sum(1 for w, s in idle_task_s.items() if w != wid and s is not None and s * FASTER_BY < mine)
    return faster >= free


def pick_order(is_last: bool) -> tuple[str, ...]:
    """Which kind of task a stage leases first: forwards, then gradients.

    A forward feeds the next stage, whose whole chain of tasks waits on it; a backward
    feeds only the previous stage's backward and this stage's push, which wait for the
    last micro-batch anyway. Forwards first keeps the later stages busy (GPipe's order);
    the worker's graph cache (at most 2M forward graphs) bounds what it holds either way.
    The last stage has only gradient tasks (forward and backward in one).
    """
    return ("grad",) if is_last else ("fwd", "grad")


class TodoPool:
    """Micro-batch ids whose task is ``todo``, per (step, kind), lowest id first.

    Every path that makes a task ``todo`` adds it here; the pick pops the lowest id and
    checks it against the task's state (``is_todo``), so entries made stale by another
    transition (leased, done, a roll-back) are dropped when met: a lease costs O(log M)
    instead of a scan over the step's micro-batches. A duplicate entry is harmless.
    """

    def __init__(self) -> None:
        self._heaps: dict[tuple[int, str], list[int]] = {}

    def add(self, step: int, kind: str, mb: int) -> None:
        """``mb``'s ``kind`` task ("fwd" or "grad") of ``step`` became todo."""
        heapq.heappush(self._heaps.setdefault((step, kind), []), mb)

    def pick(self, step: int, kind: str, is_todo, ok=None) -> int | None:
        """The lowest todo micro-batch of ``(step, kind)`` that ``ok(mb)`` allows (None: none).

        ``is_todo(mb)``: whether the task is really todo (stale entries are dropped). With
        ``ok`` (local mode: a backward waits for its forward's worker), entries it refuses
        stay for other workers, so only then the todo entries are looked through.
        """
        h = self._heaps.get((step, kind))
        while h and not is_todo(h[0]):
            heapq.heappop(h)
        if not h:
            return None
        if ok is None or ok(h[0]):
            return heapq.heappop(h)
        for mb in sorted(set(h)):
            if is_todo(mb) and ok(mb):
                return mb  # left in the heap: dropped as stale once it is leased
        return None

    def drop_step(self, step: int) -> None:
        """Forget a committed step."""
        for kind in ("fwd", "grad"):
            self._heaps.pop((step, kind), None)

    def clear(self) -> None:
        self._heaps.clear()


@dataclass
class WorkerInfo:
    gen: int = 1  # bumped when the server voids this worker's un-pushed gradients
    last_seen: float = field(default_factory=time.monotonic)
    ewma_s: float | None = None  # task time estimate for lease deadlines
    after_leave: bool = False  # made by a message after the worker left, and no lease since


class LeaseTable(dict):
    """The stage's leases by lease id, with how many each worker holds (:meth:`held`), kept
    on every insertion and removal: whether a worker holds nothing else is asked at every
    result, and is no scan over the leases."""

    def __init__(self) -> None:
        super().__init__()
        self.per_worker: dict[str, int] = {}  # worker -> its leases here

    def _add(self, wid: str, d: int) -> None:
        n = self.per_worker.get(wid, 0) + d
        if n:
            self.per_worker[wid] = n
        else:
            del self.per_worker[wid]

    def __setitem__(self, lid: int, lease: Lease) -> None:
        old = self.get(lid)
        if old is not None:
            self._add(old.worker, -1)
        super().__setitem__(lid, lease)
        self._add(lease.worker, 1)

    def __delitem__(self, lid: int) -> None:
        lease = self[lid]
        super().__delitem__(lid)
        self._add(lease.worker, -1)

    _MISSING = object()

    def pop(self, lid: int, default=_MISSING):  # type: ignore[override]
        if lid in self:
            lease = self[lid]
            del self[lid]
            return lease
        if default is LeaseTable._MISSING:
            raise KeyError(lid)
        return default

    def setdefault(self, lid: int, lease: Lease) -> Lease:  # type: ignore[override]
        if lid not in self:
            self[lid] = lease
        return self[lid]

    def popitem(self):
        raise TypeError("LeaseTable: remove leases by id (del or pop)")

    def update(self, *args, **kw):
        for lid, lease in dict(*args, **kw).items():
            self[lid] = lease

    def clear(self) -> None:
        super().clear()
        self.per_worker.clear()

    def held(self, wid: str) -> int:
        """How many leases ``wid`` holds."""
        return self.per_worker.get(wid, 0)
