"""Grants made ahead and taken back: the task pool's credit decisions, with no I/O.

On a worker's session stream (:meth:`shoal.runtime.roles.server.StageServer.Session`) a
stage server *grants* tasks: one the worker computes now, and, within its credit window,
tasks it will start when the current one ends, so that a fast worker never waits a round
trip between tasks. A grant made ahead is the risk prefetching had: a slow worker holding
a task it has not started keeps it from a faster one. So when a worker goes idle (asks
and finds nothing to do) and another worker holds an unstarted grant that the idle one
would finish sooner, the server takes that grant back and gives the task to the idle one.

:class:`GrantBook` keeps what this needs (which grants are ahead and unstarted, since when
each worker computes, each worker's pace) and makes the decisions; the server holds it
beside its leases and tells it the events: a grant, a start, an end (result, expiry,
re-queue), a worker dropped (ban, move, void). The leases themselves (deadlines,
exactly-once) stay in the server's task pool; a take-back is a lease ended early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_CREDIT = 4  # most tasks a worker holds at once (one computing, the rest granted ahead)


def credit_window(task_s: float | None, rtt_s: float | None, *, local: bool = False,
                  cap: int = MAX_CREDIT) -> int:
    """How many tasks a worker may hold at once: the one it computes and those granted ahead.

    A task granted when the worker starts its current one arrives a round trip later, so
    ``1 + ceil(rtt / task)`` tasks keep it busy (at least 2 once its pace is known). Before
    its first task time is known a worker gets 1 (no grant ahead for a device of unknown
    speed); local mode gets 1 (a backward there waits for its forward's worker: a forward
    held ahead would stall it). At most ``cap``.
    """
    if local or task_s is None:
        return 1
    if rtt_s is None or task_s <= 0:
        return min(cap, 2)
    return max(1, min(cap, 1 + max(1, math.ceil(rtt_s / task_s))))


@dataclass
class Pace:
    """What the book knows of one worker's speed."""

    task_s: float | None = None  # EWMA of its task time (grant to result)
    rtt_s: float | None = None  # EWMA of grant sent -> start heard for grants it got idle
    busy_since: float | None = None  # when it started the task it computes now (None: idle)


@dataclass
class AheadGrant:
    lease_id: int
    worker: str
    granted: float  # when it was granted


@dataclass
class GrantBook:
    """Grants made ahead and not started yet, and each worker's pace (pure state machine)."""

    ahead: dict[int, AheadGrant] = field(default_factory=dict)  # lease id -> unstarted grant made ahead
    paces: dict[str, Pace] = field(default_factory=dict)
    sent_idle: dict[int, float] = field(default_factory=dict)  # lease id -> when granted to an idle worker
    taken_back: int = 0  # grants taken back so far (reports)

    def pace(self, wid: str) -> Pace:
        return self.paces.setdefault(wid, Pace())

    def held_ahead(self, wid: str) -> int:
        """Unstarted grants ``wid`` holds."""
        return sum(g.worker == wid for g in self.ahead.values())

    def may_grant_ahead(self, wid: str, local: bool = False) -> bool:
        """Whether ``wid`` (computing one task) may get one more grant ahead."""
        p = self.pace(wid)
        return 1 + self.held_ahead(wid) < credit_window(p.task_s, p.rtt_s, local=local)

    def credit(self, wid: str, local: bool = False) -> int:
        """The window ``wid`` is told (how many tasks it may hold)."""
        p = self.pace(wid)
        return credit_window(p.task_s, p.rtt_s, local=local)

    def grant(self, lease_id: int, wid: str, now: float, ahead: bool) -> None:
        """A task was granted: ahead (the worker computes another) or to an idle worker."""
        if ahead:
            self.ahead[lease_id] = AheadGrant(lease_id, wid, now)
        else:
            self.sent_idle[lease_id] = now
            self.pace(wid).busy_since = now  # an idle worker starts at once (corrected by start())

    def start(self, lease_id: int, wid: str, now: float) -> None:
        """``wid`` says it starts computing ``lease_id`` now."""
        g = self.ahead.pop(lease_id, None)
        if g is not None and g.worker != wid:
            self.ahead[lease_id] = g  # not its grant: ignore
            return
        p = self.pace(wid)
        p.busy_since = now
        sent = self.sent_idle.pop(lease_id, None)
        if sent is not None:
            rtt = max(0.0, now - sent)
            p.rtt_s = rtt if p.rtt_s is None else 0.7 * p.rtt_s + 0.3 * rtt

    def end(self, lease_id: int, wid: str | None = None, task_s: float | None = None, idle: bool = False) -> None:
        """A grant ended (result taken, lease expired or re-queued, taken back). With ``task_s``
        (a result): the worker's pace learns it; ``idle``: it holds nothing else now."""
        self.ahead.pop(lease_id, None)
        self.sent_idle.pop(lease_id, None)
        if wid is not None:
            p = self.pace(wid)
            if task_s is not None and task_s > 0:
                p.task_s = task_s if p.task_s is None else 0.7 * p.task_s + 0.3 * task_s
            if idle:
                p.busy_since = None

    def drop_worker(self, wid: str) -> list[int]:
        """``wid`` is gone from the stage (banned, moved, voided, left): its unstarted grants,
        which the caller re-queues."""
        lids = [lid for lid, g in self.ahead.items() if g.worker == wid]
        for lid in lids:
            del self.ahead[lid]
        self.sent_idle = {lid: t for lid, t in self.sent_idle.items() if lid not in lids}
        p = self.paces.get(wid)
        if p is not None:
            p.busy_since = None
        return lids

    def take_back(self, idle: str, now: float, live=None) -> int | None:
        """The unstarted grant to take from its holder and give to ``idle`` (None: keep all).

        A holder starts its grant when its current task ends: ``busy_since + task_s`` (now,
        if unknown or overdue), and finishes it ``task_s`` later. ``idle`` would finish it
        ``task_s(idle)`` from now (0 if unknown: an idle worker is surely no later than a busy
        one). Taken: the grant whose holder would finish it last, if ``idle`` beats that.
        ``live(lease_id)``: whether the lease still stands (others are forgotten here).
        """
        best, best_end = None, -math.inf
        for lid, g in list(self.ahead.items()):
            if live is not None and not live(lid):
                del self.ahead[lid]
                continue
            if g.worker == idle:
                continue
            p = self.pace(g.worker)
            own = p.task_s or 0.0
            start = max(now, (p.busy_since + own) if p.busy_since is not None else now)
            end = start + own
            if end > best_end:
                best, best_end = lid, end
        if best is None:
            return None
        mine = self.pace(idle).task_s or 0.0
        if now + mine >= best_end:
            return None
        del self.ahead[best]
        self.taken_back += 1
        return best
