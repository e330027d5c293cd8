"""The task pool's plain data and decisions: micro-batch states, leases, todo queues.

No I/O here: the stage server (:mod:`shoal.runtime.roles.server`) holds these and does the
network and the optimizer around them.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch

from shoal.net import shoal_pb2 as pb


@dataclass
class MbState:
    """One micro-batch of one step at this stage."""

    input: torch.Tensor | None = None  # stage input (None at stage 0: tokens are rebuilt)
    out_grad: torch.Tensor | None = None  # gradient of the stage output (non-last stages)
    fwd: str = "wait"  # wait | todo | leased | done  (non-last stages only)
    grad: str = "wait"  # wait | todo | leased | computed | counted
    holder: str = ""  # worker holding the grad lease or the computed gradient
    loss: float | None = None  # last stage: the micro-batch loss
    relayed_back: bool = False  # the input gradient went to the previous stage
    fwd_by: str = ""  # local mode: the worker whose replica ran the forward (gets the backward)
    fwd_gen: int = 0  # that worker's generation then
    input_frame: pb.Tensor | None = None  # compressed runs: the input as received, handed on as is
    out_grad_frame: pb.Tensor | None = None  # compressed runs: the output gradient as received


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
