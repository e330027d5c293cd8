"""Fair-share flow network: each device's uplink and downlink shared by its transfers.

Model (documented in ``docs/simulator.md``): a transfer (a *flow*) from device ``a`` to
device ``b`` moves ``nbytes`` at rate

    rate = min(path_bw(a, b), up(a) / n_up(a), down(b) / n_down(b))

where ``n_up(a)`` is the number of flows currently leaving ``a`` and ``n_down(b)`` the
number arriving at ``b`` ("equal share per resource"). Rates are recomputed whenever a
flow starts or ends, and only for flows whose rate can change: when a resource's share
drops, only flows faster than the new share; when it rises, only flows that were limited
by that resource. A flow's bytes finish at the time its remaining bytes run out at its
current rate; the message then arrives one path latency later. A device talking to
itself (a worker on its own stage server's host) uses no shared resource.

Equal share does not hand a flow's unused share to the others (max-min fairness would),
so it is pessimistic when a busy server's NIC is shared by workers with unequal links;
see the docs for when that matters.

The network shares the engine's event heap: a flow's completion is an event
``(time, seq, FLOW_DONE, flow, version)``; a rescheduled flow bumps its version so the
old entry is skipped when popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

INF = float("inf")
FLOW_DONE = 0  # event kind of a flow's last byte leaving the bottleneck


class Resource:
    """One direction of one device's network interface."""

    __slots__ = ("cap", "flows", "max_rate", "n_lim")

    def __init__(self, cap: float):
        self.cap = cap  # bytes/s shared by the flows on it
        self.flows: dict[int, Flow] = {}  # active flows, in start order (deterministic)
        self.max_rate = 0.0  # an upper bound of the rates of the flows on it
        self.n_lim = 0  # flows whose rate equals this resource's share


class Flow:
    """One transfer in progress."""

    __slots__ = ("fid", "src", "dst", "path", "lat", "rem", "rate", "t", "ver", "lim_s",
                 "lim_d", "nbytes", "t0", "msg", "active", "a", "b")

    def __init__(self, fid, src, dst, path, lat, nbytes, now, msg, a, b):
        self.fid = fid
        self.src: Resource | None = src  # sender's uplink (None on loopback)
        self.dst: Resource | None = dst  # receiver's downlink (None on loopback)
        self.path = path  # bytes/s of the path alone
        self.lat = lat  # one-way latency added after the last byte
        self.rem = float(nbytes)  # bytes left at time self.t
        self.rate = 0.0  # current bytes/s
        self.t = now  # time self.rem was last brought up to date
        self.ver = 0  # bumped on every reschedule
        self.lim_s = False  # rate set by the sender's uplink share
        self.lim_d = False  # rate set by the receiver's downlink share
        self.nbytes = nbytes  # total bytes
        self.t0 = now  # start time (for the timeline)
        self.msg = msg  # what arrives when it completes (engine-defined)
        self.active = True
        self.a = a  # sender device id
        self.b = b  # receiver device id


class FlowNet:
    """The set of active flows and their rates; schedules completions on ``heap``."""

    def __init__(self, heap: list, seq: Callable[[], int]):
        self.heap = heap
        self.seq = seq  # tie-breaking counter shared with the engine
        self._fid = 0
        self.rate_updates = 0  # how many flows were rescheduled (a cost measure)

    def _rate(self, f: Flow) -> float:
        r = f.path
        s = f.src
        lim_s = lim_d = False
        if s is not None:
            x = s.cap / len(s.flows)
            if x <= r:
                r = x
                lim_s = True
        d = f.dst
        if d is not None:
            x = d.cap / len(d.flows)
            if x < r:
                r = x
                lim_s = False
                lim_d = True
            elif x == r:
                lim_d = True
        # keep the per-resource counts of flows that resource limits
        if lim_s != f.lim_s:
            s.n_lim += 1 if lim_s else -1
            f.lim_s = lim_s
        if lim_d != f.lim_d:
            d.n_lim += 1 if lim_d else -1
            f.lim_d = lim_d
        return r

    def _reschedule(self, f: Flow, now: float) -> None:
        new = self._rate(f)
        if new != f.rate:
            if f.rate > 0.0:
                f.rem -= f.rate * (now - f.t)
                if f.rem < 0.0:
                    f.rem = 0.0
            f.t = now
            f.rate = new
            f.ver += 1
            self.rate_updates += 1
            heapq.heappush(self.heap, (now + f.rem / new, self.seq(), FLOW_DONE, f, f.ver))
            if f.src is not None and new > f.src.max_rate:
                f.src.max_rate = new
            if f.dst is not None and new > f.dst.max_rate:
                f.dst.max_rate = new

    def _pass(self, res: Resource, now: float, skip: Flow | None = None, rose: bool = False) -> None:
        """Recompute the flows on ``res`` that its new share can change; tighten its ``max_rate``.

        The hot loop of big runs: :meth:`_rate` and :meth:`_reschedule` inlined, and the
        share of ``res`` (the same for every flow here) computed once. When the share
        dropped, a flow already at or below it keeps its rate; when it ``rose``, only the
        flows ``res`` was limiting can speed up.
        """
        m = 0.0
        share = res.cap / len(res.flows)
        heap, seq, push = self.heap, self.seq, heapq.heappush
        for g in res.flows.values():
            if g is not skip:
                src, dst = g.src, g.dst
                if rose:
                    if not (g.lim_s if src is res else g.lim_d):
                        if g.rate > m:
                            m = g.rate
                        continue
                elif g.rate <= share:
                    if g.rate > m:
                        m = g.rate
                    continue
                r = g.path
                lim_s = lim_d = False
                xs = share if src is res else src.cap / len(src.flows)
                if xs <= r:
                    r = xs
                    lim_s = True
                if dst is not None:
                    xd = share if dst is res else dst.cap / len(dst.flows)
                    if xd < r:
                        r = xd
                        lim_s = False
                        lim_d = True
                    elif xd == r:
                        lim_d = True
                if lim_s != g.lim_s:
                    src.n_lim += 1 if lim_s else -1
                    g.lim_s = lim_s
                if lim_d != g.lim_d:
                    dst.n_lim += 1 if lim_d else -1
                    g.lim_d = lim_d
                if r != g.rate:
                    if g.rate > 0.0:
                        rem = g.rem - g.rate * (now - g.t)
                        g.rem = rem if rem > 0.0 else 0.0
                    g.t = now
                    g.rate = r
                    g.ver += 1
                    self.rate_updates += 1
                    push(heap, (now + g.rem / r, seq(), FLOW_DONE, g, g.ver))
                    if r > src.max_rate:
                        src.max_rate = r
                    if r > dst.max_rate:
                        dst.max_rate = r
            if g.rate > m:
                m = g.rate
        res.max_rate = m

    def start(self, a: str, b: str, src: Resource | None, dst: Resource | None, path: float,
              lat: float, nbytes: float, now: float, msg) -> Flow:
        """Start moving ``nbytes`` from ``a`` to ``b``; returns the flow."""
        self._fid += 1
        f = Flow(self._fid, src, dst, path, lat, nbytes, now, msg, a, b)
        for res in (src, dst):
            if res is not None:
                res.flows[f.fid] = f
                # its share dropped: only flows faster than the new share slow down
                if res.max_rate > res.cap / len(res.flows):
                    self._pass(res, now, skip=f)
        if nbytes <= 0:
            f.rate = INF
            f.ver += 1
            heapq.heappush(self.heap, (now, self.seq(), FLOW_DONE, f, f.ver))
        else:
            self._reschedule(f, now)
        return f

    def finish(self, f: Flow, now: float) -> None:
        """Remove ``f`` (completed or aborted) and speed up the flows it was holding back."""
        f.active = False
        for res, lim in ((f.src, f.lim_s), (f.dst, f.lim_d)):
            if res is None:
                continue
            del res.flows[f.fid]
            if lim:
                res.n_lim -= 1
            if not res.flows:
                res.max_rate = 0.0
                res.n_lim = 0
            elif res.n_lim > 0:
                # its share rose: the flows it limited can go faster
                self._pass(res, now, rose=True)
        f.lim_s = f.lim_d = False

    def progress(self, f: Flow, now: float) -> float:
        """Bytes of ``f`` moved so far."""
        if f.rate == INF:
            return f.nbytes
        return f.nbytes - max(0.0, f.rem - f.rate * (now - f.t))
