"""Fair-share flow network: each device's uplink and downlink shared by its transfers.

Model (documented in ``docs/simulator.md``): a transfer (a *flow*) from device ``a`` to
device ``b`` moves ``nbytes`` at rate

    rate = min(path_bw(a, b), up(a) / n_up(a), down(b) / n_down(b))

where ``n_up(a)`` is the number of flows currently leaving ``a`` and ``n_down(b)`` the
number arriving at ``b`` ("equal share per resource"). A device talking to itself (a worker
on its own stage server's host) uses no shared resource.

Every flow belongs to the *group* of the term that sets its rate: the sender's uplink, the
receiver's downlink, or its own path. All flows in a resource's group move at the same
rate, its share, so the resource keeps a virtual clock ``V`` (bytes moved by each of its
group's flows since the run began) and its group in a heap by *virtual finish*
(``V`` at join + bytes left). Only the group's head has a completion event; a share change
advances the clock and reschedules that one event, whatever the group's size.

A flow start or end changes the shares of the two resources it uses, so flows may change
group there: when a share drops, non-members faster than the new share join; when it rises,
members whose other limit (path, other end's share) is below it leave. A *hub* (the engine
marks stage server hosts) finds those flows in two heaps (members by their other limit,
non-members by their rate), kept current by the flows' other ends, which are not hubs and
rescan their few flows at each of their own changes. A flow between two hubs is rescanned
at each change of either. Cost per flow start or end: O(flows at the non-hub ends + log of
the hub's flows), plus O(log) per flow that changes group.

The network shares the engine's event heap: a flow's completion is an event
``(time, seq, FLOW_DONE, flow, version)``; rescheduling bumps the flow's version so the
old entry is skipped when popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

INF = float("inf")
FLOW_DONE = 0  # event kind of a flow's last byte leaving the bottleneck


class Resource:
    """One direction of one device's network interface."""

    __slots__ = ("cap", "flows", "share", "V", "T", "heap", "head", "ev_share", "hub", "olim", "nm", "cross")

    def __init__(self, cap: float, hub: bool = False):
        self.cap = cap  # bytes/s shared by the flows on it
        self.flows: dict[int, Flow] = {}  # active flows, in start order (deterministic)
        self.share = cap  # cap / len(flows): the rate of every flow in its group
        self.V = 0.0  # virtual clock: bytes each group member has moved since time 0, at time T
        self.T = 0.0  # time V was last brought up to date
        self.heap: list = []  # group members: (virtual finish, fid, group stamp, flow); stale entries skipped
        self.head: Flow | None = None  # the member whose completion event is scheduled
        self.ev_share = 0.0  # the share that event was computed with
        self.hub = hub  # find group changes by heaps (many flows) instead of rescanning its flows
        self.olim: list = []  # hub: members by their other limit (olim, fid, key stamp, flow)
        self.nm: list = []  # hub: non-members by their rate (-rate, fid, key stamp, flow)
        self.cross: dict[int, Flow] = {}  # hub: flows whose other end is a hub too (rescanned)


class Flow:
    """One transfer in progress."""

    __slots__ = ("fid", "src", "dst", "path", "lat", "rem", "t", "ver", "grp", "gst", "vf", "kst",
                 "nbytes", "t0", "msg", "active", "a", "b", "inf")

    def __init__(self, fid, src, dst, path, lat, nbytes, now, msg, a, b):
        self.fid = fid
        self.src: Resource | None = src  # sender's uplink (None on loopback)
        self.dst: Resource | None = dst  # receiver's downlink (None on loopback)
        self.path = path  # bytes/s of the path alone
        self.lat = lat  # one-way latency added after the last byte
        self.rem = float(nbytes)  # path group: bytes left at time self.t
        self.t = now  # path group: time self.rem was last brought up to date
        self.ver = 0  # bumped on every (re)schedule or group change: older events are skipped
        self.grp: Resource | None = None  # the resource whose share is its rate (None: its path)
        self.gst = 0  # bumped on every group change: older group-heap entries are skipped
        self.vf = 0.0  # in a resource's group: that resource's V when its last byte leaves
        self.kst = 0  # bumped on every key pushed to a hub's olim / nm heap: older keys are skipped
        self.nbytes = nbytes  # total bytes
        self.t0 = now  # start time (for the timeline)
        self.msg = msg  # what arrives when it completes (engine-defined)
        self.active = True
        self.a = a  # sender device id
        self.b = b  # receiver device id
        self.inf = False  # a zero-byte flow: done at once

    @property
    def rate(self) -> float:
        """Current bytes/s."""
        if self.inf:
            return INF
        g = self.grp
        return self.path if g is None else g.share


def _best(f: Flow) -> tuple[Resource | None, float]:
    """The group ``f`` belongs in and its rate: min(path, sender's share, receiver's share)."""
    r, g = f.path, None
    s, d = f.src, f.dst
    if s is not None:
        if s.share <= r:
            r, g = s.share, s
        if d.share < r:
            r, g = d.share, d
    return g, r


class FlowNet:
    """The set of active flows and their rates; schedules completions on ``heap``."""

    def __init__(self, heap: list, seq: Callable[[], int]):
        self.heap = heap
        self.seq = seq  # tie-breaking counter shared with the engine
        self._fid = 0
        self.rate_updates = 0  # completion events pushed (a cost measure)

    # ------------------------------------------------------------ group membership
    def _move(self, f: Flow, g: Resource | None, now: float, dirty: list) -> None:
        """Put ``f`` in group ``g`` (None: its path) at ``now``; ``dirty`` collects the
        resources whose head event must be rescheduled."""
        old = f.grp
        if old is None:
            rem = f.rem - f.path * (now - f.t)
        else:
            if now != old.T:
                old.V += old.share * (now - old.T)
                old.T = now
            rem = f.vf - old.V
            if old.head is f:
                old.head = None
            dirty.append(old)
        if rem < 0.0:
            rem = 0.0
        f.ver += 1  # its pending event (if any) no longer holds
        f.gst += 1
        f.grp = g
        if g is None:
            f.rem = rem
            f.t = now
            self.rate_updates += 1
            heapq.heappush(self.heap, (now + rem / f.path, self.seq(), FLOW_DONE, f, f.ver))
        else:
            if now != g.T:
                g.V += g.share * (now - g.T)
                g.T = now
            f.vf = vf = g.V + rem
            q = g.heap
            heapq.heappush(q, (vf, f.fid, f.gst, f))
            if len(q) > 4 * len(g.flows) + 64:
                q[:] = [e for e in q if e[3].grp is g and e[3].gst == e[2] and e[3].active]
                heapq.heapify(q)
            dirty.append(g)
        s, d = f.src, f.dst
        if s is not None and s.hub is not d.hub:
            # the hub end learns the flow's new key
            if s.hub:
                self._key(f, s, d)
            else:
                self._key(f, d, s)

    def _key(self, f: Flow, h: Resource | None, o: Resource | None) -> None:
        """Push ``f``'s current key to its end ``h`` if ``h`` is a hub and ``o`` (the other end) is not."""
        if h is None or not h.hub or o.hub:
            return
        f.kst += 1
        if f.grp is h:
            x = o.share
            q = h.olim
            heapq.heappush(q, (x if x < f.path else f.path, f.fid, f.kst, f))
        else:
            q = h.nm
            heapq.heappush(q, (-(f.path if f.grp is None else f.grp.share), f.fid, f.kst, f))
        if len(q) > 4 * len(h.flows) + 64:
            # drop stale keys so the heap stays proportional to the hub's flows
            q[:] = [e for e in q if e[3].kst == e[2] and e[3].active]
            heapq.heapify(q)

    def _schedule(self, r: Resource) -> None:
        """(Re)schedule the completion event of the head of ``r``'s group."""
        h = r.heap
        f = r.head
        if f is not None and r.ev_share == r.share and h[0][3] is f and h[0][2] == f.gst:
            return  # same head, same rate: its event still holds
        while h:
            vf, _, gst, f = h[0]
            if f.grp is r and f.gst == gst and f.active:
                break
            heapq.heappop(h)
        if not h:
            r.head = None
            return
        f = h[0][3]
        if f is r.head and r.ev_share == r.share:
            return  # same head, same rate: its event still holds
        old = r.head
        if old is not None and old is not f:
            old.ver += 1  # still a member, no longer the head
        r.head = f
        r.ev_share = r.share
        f.ver += 1
        left = f.vf - r.V
        if left <= f.vf * 1e-13:
            left = 0.0  # the clock's rounding: a flow due now completes now, not an ulp of V later
        self.rate_updates += 1
        heapq.heappush(self.heap, (r.T + left / r.share, self.seq(), FLOW_DONE, f, f.ver))

    # ------------------------------------------------------------ share changes
    def _changed(self, r: Resource, now: float, rose: bool, dirty: list, skip: Flow | None = None) -> None:
        """``r``'s share changed: move the flows whose group that changes."""
        dirty.append(r)
        share = r.share
        if not r.hub:
            # few flows: rescan them (rate = min(path, sender's share, receiver's share));
            # tell their hub ends the new keys
            for f in r.flows.values():
                if f is skip:
                    continue
                g = f.grp
                p = f.path
                cur = p if g is None else g.share
                s, d = f.src, f.dst
                best, ng = p, None
                x = s.share
                if x <= best:
                    best, ng = x, s
                x = d.share
                if x < best:
                    best, ng = x, d
                if best < cur:
                    self._move(f, ng, now, dirty)
                else:
                    o = d if s is r else s
                    if o.hub:
                        self._key(f, o, r)  # its other limit or its rate changed with our share
            return
        # a key can lag behind within one start or finish (the other end, not yet rescanned,
        # changed too): recompute the best group of each popped flow
        if rose:
            h = r.olim
            while h and h[0][0] < share:
                _, _, kst, f = heapq.heappop(h)
                if f.kst == kst and f.active and f.grp is r:
                    ng, _ = _best(f)
                    if ng is r:
                        self._key(f, r, f.dst if f.src is r else f.src)
                    else:
                        self._move(f, ng, now, dirty)
        else:
            h = r.nm
            while h and -h[0][0] > share:
                _, _, kst, f = heapq.heappop(h)
                if f.kst == kst and f.active and f is not skip and f.grp is not r:
                    ng, _ = _best(f)
                    if ng is f.grp:
                        self._key(f, r, f.dst if f.src is r else f.src)
                    else:
                        self._move(f, ng, now, dirty)
        if r.cross:
            for f in list(r.cross.values()):
                if f is skip:
                    continue
                g = f.grp
                cur = f.path if g is None else g.share
                ng, best = _best(f)
                if best < cur:
                    self._move(f, ng, now, dirty)

    # ------------------------------------------------------------ public
    def start(self, a: str, b: str, src: Resource | None, dst: Resource | None, path: float,
              lat: float, nbytes: float, now: float, msg) -> Flow:
        """Start moving ``nbytes`` from ``a`` to ``b``; returns the flow."""
        self._fid += 1
        fid = self._fid
        f = Flow(fid, src, dst, path, lat, nbytes, now, msg, a, b)
        dirty: list = []
        if src is not None:
            for r in (src, dst):
                fl = r.flows
                if now != r.T:
                    if fl:
                        r.V += r.share * (now - r.T)
                    r.T = now
                fl[fid] = f
                r.share = r.cap / len(fl)
            if src.hub and dst.hub:
                src.cross[fid] = f
                dst.cross[fid] = f
            # shares dropped: flows faster than the new share join its group
            self._changed(src, now, False, dirty, f)
            self._changed(dst, now, False, dirty, f)
        if nbytes <= 0:
            f.inf = True
            f.rem = 0.0
            f.ver += 1
            self.rate_updates += 1
            heapq.heappush(self.heap, (now, self.seq(), FLOW_DONE, f, f.ver))
        else:
            g, _ = _best(f)
            self._move(f, g, now, dirty)
        for r in dirty:
            self._schedule(r)
        return f

    def finish(self, f: Flow, now: float) -> None:
        """Remove ``f`` (completed or aborted) and speed up the flows it was holding back."""
        f.active = False
        g = f.grp
        dirty: list = []
        if g is not None:
            if g.head is f:
                g.head = None
            dirty.append(g)
        f.grp = None
        f.ver += 1
        s, d = f.src, f.dst
        if s is not None:
            fid = f.fid
            for r in (s, d):
                fl = r.flows
                if now != r.T:
                    r.V += r.share * (now - r.T)
                    r.T = now
                del fl[fid]
                if r.cross:
                    r.cross.pop(fid, None)
                r.share = r.cap / len(fl) if fl else r.cap
            # shares rose: members whose other limit is now lower leave
            if s.flows:
                self._changed(s, now, True, dirty)
            if d.flows:
                self._changed(d, now, True, dirty)
        for r in dirty:
            self._schedule(r)

    def progress(self, f: Flow, now: float) -> float:
        """Bytes of ``f`` moved so far."""
        if f.inf:
            return f.nbytes
        g = f.grp
        rem = f.rem - f.path * (now - f.t) if g is None else f.vf - (g.V + g.share * (now - g.T))
        return f.nbytes - max(0.0, rem)
