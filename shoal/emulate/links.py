"""Link emulation: an in-process TCP relay with latency, jitter and token buckets.

A process that wants to behave like a scenario device starts one :class:`LinkShaper`
(a background thread running an asyncio loop) and routes every outbound connection
through :meth:`LinkShaper.proxy_for`, which returns a ``127.0.0.1:port`` address that
relays bytes to the real target. The relay is a pure byte pipe, so gRPC/HTTP2 (or any
TCP protocol) runs through it unchanged. Each direction of each connection is a
two-stage pipeline:

1. *transmit*: a chunk read from the sender is charged to the token buckets of that
   direction -- the device's uplink (bytes it sends) or downlink (bytes it receives),
   shared by all its connections, plus an optional per-path bucket (the scenario
   link's per-flow bandwidth). The chunk's transmission ends at the latest completion
   time of those buckets; the relay does not read more from that socket until then,
   so TCP back-pressure reaches the sender as on a real bottleneck.
2. *propagate*: the chunk is delivered ``latency + jitter`` after its transmission
   ends, never before an earlier chunk of the same direction (byte order is kept).

So a message of ``n`` bytes over an idle link arrives ``n / rate + latency`` after it
was sent, and a bulk transfer runs at ``rate``: the two figures the cost model uses.

:class:`ScenarioDial` turns a scenario, this process's device id and a map from peer
address to peer device into a ``dial(address) -> address`` hook for the runtime:
latency and per-flow bandwidth come from ``scenario.network.link(me, peer)``, and the
device's ``up``/``down`` capacities set the shared buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

CHUNK = 16 * 1024  # fewest bytes read per relay step; smaller = finer pacing, more overhead
MAX_CHUNK = 1024 * 1024  # most bytes read per relay step (an unlimited link's read size)
PACE_S = 0.001  # a relay step reads at most this much of its link's transmission time
FRESH_S = 0.001  # a read that returns this fast found data already buffered
MAX_LAG_S = 0.05  # at most this much scheduler lag is made up by back-dating a chunk


class TokenBucket:
    """A byte-rate limiter in virtual time: a serial link of ``rate`` bytes/s.

    :meth:`reserve` books ``n`` bytes that are ready at time ``now`` and returns when
    their transmission ends: ``max(now, end of the previous booking) + n / rate``.
    No idle credit: a lone message after a quiet spell pays its full ``n / rate``, as
    on a real link. Not thread-safe: used from one event loop.
    """

    def __init__(self, rate: float | None):
        if rate is not None and not rate > 0:
            raise ValueError(f"bucket rate must be positive bytes/s or None, got {rate!r}")
        self.rate = rate  # bytes per second; None = unlimited
        self._tat = 0.0  # time at which everything booked so far is sent

    def reserve(self, n: int, now: float) -> float:
        """Book ``n`` bytes ready at ``now``; the time their transmission ends."""
        if self.rate is None:
            return now
        self._tat = max(self._tat, now) + n / self.rate
        return self._tat


@dataclass
class DirectionStats:
    """Counters of one relay direction, and the delays the relay itself accounted.

    The delays are the emulator's own books, not wall-clock measurements: for each chunk,
    the time from reading it to its scheduled delivery (transmission through the buckets
    plus latency and jitter, or waiting behind an earlier chunk). How late the host's
    scheduler let a delivery happen is counted apart (``late_max_s``): a loaded machine adds
    that to what a client measures, the emulated link does not.
    """

    bytes: int = 0  # payload bytes relayed
    chunks: int = 0  # relay steps
    delay_min_s: float | None = None  # least scheduled delay of a chunk (None: no chunk yet)
    delay_max_s: float = 0.0  # most scheduled delay of a chunk
    late_max_s: float = 0.0  # most a delivery was written after its scheduled time (host lag)
    first_ready_s: float | None = None  # loop time the first chunk was ready to send (None: no chunk yet)
    last_sent_s: float = 0.0  # loop time the booked transmission of every chunk so far ends
    idle_s: float = 0.0  # time the link stood idle between chunks, waiting for data (sender's pace, host lag)

    def count(self, n: int, delay_s: float, ready: float | None = None, sent: float | None = None) -> None:
        """One chunk of ``n`` bytes, to be delivered ``delay_s`` after it was read; ``ready``
        and ``sent``: when its transmission could start and when it ends, as booked."""
        self.bytes += n
        self.chunks += 1
        self.delay_min_s = delay_s if self.delay_min_s is None else min(self.delay_min_s, delay_s)
        self.delay_max_s = max(self.delay_max_s, delay_s)
        if ready is None or sent is None:
            return
        if self.first_ready_s is None:
            self.first_ready_s = ready
        else:
            self.idle_s += max(0.0, ready - self.last_sent_s)
        self.last_sent_s = max(self.last_sent_s, sent)

    @property
    def busy_s(self) -> float:
        """Time the link spent transmitting, as booked: from the first chunk ready to the last
        one sent, less the idle time (for one bucket, its bytes over its rate)."""
        return 0.0 if self.first_ready_s is None else self.last_sent_s - self.first_ready_s - self.idle_s


class _Proxy:
    """One listening relay towards one target, with its per-path buckets."""

    def __init__(self, shaper: LinkShaper, target: tuple[str, int], latency_s: float,
                 jitter_s: float, path_up: float | None, path_down: float | None):
        self.shaper = shaper
        self.target = target
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.path_up = TokenBucket(path_up)
        self.path_down = TokenBucket(path_down)
        self.up = DirectionStats()
        self.down = DirectionStats()
        self.server: asyncio.base_events.Server | None = None
        self.address = ""
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=MAX_CHUNK)
        port = self.server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        sh = self.shaper
        me = asyncio.current_task()
        if me is not None:
            sh._tasks.add(me)  # so that close() can cancel and await it
        try:
            await self._relay(c_reader, c_writer)
        finally:
            sh._tasks.discard(me)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target, limit=MAX_CHUNK)
        except OSError:
            c_writer.close()  # the target is down: the dialer sees a closed connection
            return
        self.connections += 1
        sh = self.shaper
        up = asyncio.create_task(_pump(
            c_reader, t_writer, (sh.up_bucket, self.path_up), self, self.up, sh.up_stats))
        down = asyncio.create_task(_pump(
            t_reader, c_writer, (sh.down_bucket, self.path_down), self, self.down, sh.down_stats))
        sh._tasks.update((up, down))
        try:
            # The first side to close ends the connection: a relay waiting for the other side
            # to close too would hold both sockets (CLOSE-WAIT) while a gRPC peer keeps its
            # half open, and a process relaying many members runs out of them.
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
            for t in (up, down):
                t.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            sh._tasks.difference_update((up, down))
            for w in (c_writer, t_writer):
                w.close()

    def delay(self) -> float:
        if self.jitter_s <= 0:
            return self.latency_s
        return max(0.0, self.shaper._rng.gauss(self.latency_s, self.jitter_s))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                buckets: tuple[TokenBucket, ...], proxy: _Proxy,
                stats: DirectionStats, total: DirectionStats) -> None:
    """Relay one direction: transmit through ``buckets``, then delay, keeping order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
    size = read_size([b.rate for b in buckets])

    async def deliver() -> None:
        while True:
            item = await queue.get()
            if item is None:
                if writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            at, data = item
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            late = loop.time() - at
            stats.late_max_s = max(stats.late_max_s, late)
            total.late_max_s = max(total.late_max_s, late)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    last = 0.0  # delivery time of the previous chunk (order is kept)
    prev_sent: float | None = None  # transmission end of the previous chunk
    woke = loop.time()
    try:
        while True:
            data = await reader.read(size)
            if not data:
                break
            now = loop.time()
            ready = now
            if prev_sent is not None and now - woke < FRESH_S:
                # The data was already waiting: on a real link it would have followed
                # the previous chunk back-to-back. Back-date it to then, so the time
                # this pump slept too long (scheduler lag) costs no throughput.
                ready = max(min(now, prev_sent), now - MAX_LAG_S)
            sent = max([ready] + [b.reserve(len(data), ready) for b in buckets])
            prev_sent = sent
            # A chunk never arrives before it was read plus the latency.
            last = max(last, max(sent, now) + proxy.delay())
            queue.put_nowait((last, data))
            stats.count(len(data), last - now, ready, sent)
            total.count(len(data), last - now, ready, sent)
            if sent > now:
                await asyncio.sleep(sent - now)  # back-pressure: read on when transmitted
            woke = loop.time()
    except (ConnectionError, OSError):
        pass
    except asyncio.CancelledError:
        sender.cancel()  # the other side closed: what is still queued here has nobody to go to
        raise
    finally:
        queue.put_nowait(None)
    with contextlib.suppress(ConnectionError, OSError):
        await sender


def read_size(rates: Sequence[float | None]) -> int:
    """Bytes a relay step reads on a direction shaped by buckets of ``rates`` (bytes/s, None
    = unlimited): ``PACE_S`` of transmission on the slowest, within [CHUNK, MAX_CHUNK].

    The relay's CPU is per step, not per byte: at 16 KiB a step a process relaying 1 Gb/s
    links spends most of a core on the relay alone, while the pacing a step of 1 ms of link
    time keeps is finer than any latency a scenario gives."""
    finite = [r for r in rates if r is not None]
    if not finite:
        return MAX_CHUNK
    return max(CHUNK, min(MAX_CHUNK, int(min(finite) * PACE_S)))


def _parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (also ``[v6]:port`` and gRPC's ``ipv4:``/``dns:///`` prefixes)."""
    a = address
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if a.startswith(prefix):
            a = a[len(prefix):]
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


class LinkShaper:
    """The emulated network interface of one device: shared up/down buckets and relays.

    ``up`` and ``down`` are the device's capacities in bytes/s (None = unlimited). All
    relays made by :meth:`proxy_for` share them, as the flows of one home connection
    share its uplink. Runs its own event loop in a daemon thread, so it works beside
    any other loop (grpc.aio) in the process. Call :meth:`close` when done.
    """

    def __init__(self, up: float | None = None, down: float | None = None, seed: int = 0,
                 share: LinkShaper | None = None):
        self.up_bucket = TokenBucket(up)
        self.down_bucket = TokenBucket(down)
        self.up_stats = DirectionStats()  # bytes this device sent through its relays
        self.down_stats = DirectionStats()  # bytes this device received through its relays
        self._rng = random.Random(seed)
        self._proxies: list[_Proxy] = []
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        # ``share``: another device's shaper whose loop thread relays this one's links too
        # (many emulated devices in one process: one thread, each with its own buckets).
        self._owner = share is None
        if share is not None:
            self._loop, self._thread = share._loop, share._thread
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="shoal-link-shaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def proxy_for(self, target_address: str, latency_s: float = 0.0, jitter_s: float = 0.0,
                  path_up: float | None = None, path_down: float | None = None) -> str:
        """Start a relay to ``target_address``; returns its ``127.0.0.1:port``.

        ``latency_s`` is the one-way delay added in each direction (so a round trip
        gains twice that), ``jitter_s`` the standard deviation of a normal variation of
        each chunk's delay (order is kept, so jitter only ever delays), and
        ``path_up``/``path_down`` optional per-path rates in bytes/s on top of the
        device's shared buckets. Thread-safe; may be called from any thread.
        """
        if self._closed:
            raise RuntimeError("LinkShaper is closed")
        if latency_s < 0 or jitter_s < 0:
            raise ValueError("latency and jitter must be >= 0")
        proxy = _Proxy(self, _parse_address(target_address), latency_s, jitter_s, path_up, path_down)
        fut = asyncio.run_coroutine_threadsafe(proxy.start(), self._loop)
        address = fut.result(timeout=10)
        self._proxies.append(proxy)
        return address

    def stats(self) -> dict:
        """Bytes relayed: totals per direction and per relay target."""
        return {
            "up_bytes": self.up_stats.bytes,
            "down_bytes": self.down_stats.bytes,
            "proxies": [
                {"target": f"{p.target[0]}:{p.target[1]}", "address": p.address,
                 "latency_s": p.latency_s, "up_bytes": p.up.bytes, "down_bytes": p.down.bytes,
                 "connections": p.connections}
                for p in self._proxies
            ],
        }

    def books(self) -> dict[str, DirectionStats]:
        """A copy of the relays' totals per direction (``up``, ``down``) with their accounted
        delays (:class:`DirectionStats`), read on the relay loop."""
        async def read() -> dict[str, DirectionStats]:
            return {"up": dataclasses.replace(self.up_stats), "down": dataclasses.replace(self.down_stats)}

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(timeout=10)

    def close(self) -> None:
        """Stop every relay and the loop thread (open relayed connections are dropped)."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            for p in self._proxies:
                if p.server is not None:
                    p.server.close()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        if not self._owner:
            return  # the loop thread is the sharing owner's to stop
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> LinkShaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScenarioDial:
    """A ``dial(address) -> address`` hook that makes this process a scenario device.

    ``peers`` maps each peer's address (as the runtime dials it) to the peer's device
    id. Dialling a known peer returns a relay with the one-way latency and per-flow
    bandwidth of ``scenario.network.link(me, peer)``, scaled by ``latency_scale`` and
    ``bandwidth_scale``; all relays share this device's up/down buckets
    (``device.up``/``device.down`` times ``bandwidth_scale``). Unknown addresses are
    returned unchanged (not shaped). One relay per address is made and reused.

    Peers that are only known at run time (servers on ephemeral ports) are found, in
    this order, by ``peers`` (add entries with :meth:`set_peer`, or
    :meth:`set_stage_address` once the address of stage ``s``'s server is known, when
    ``stage_servers[s]`` names its device), by ``resolve(address) -> device id | None``,
    and finally by ``default_peer`` (e.g. the host of the coordinator and servers).
    """

    def __init__(self, scenario, device_id: str, peers: Mapping[str, str] | None = None, *,
                 latency_scale: float = 1.0, bandwidth_scale: float = 1.0,
                 jitter_s: float = 0.0, per_flow: bool = True, seed: int = 0,
                 resolve: Callable[[str], str | None] | None = None,
                 default_peer: str | None = None, stage_servers: Sequence[str] = ()):
        self.scenario = scenario  # shoal.plan.types.Scenario
        self.device = scenario.device(device_id)  # this process's device
        self.peers: dict[str, str] = dict(peers or {})  # address -> peer device id
        self.latency_scale = latency_scale  # multiplies every scenario latency
        self.bandwidth_scale = bandwidth_scale  # multiplies every scenario bandwidth
        self.jitter_s = jitter_s  # std-dev of per-chunk delay variation, seconds
        self.per_flow = per_flow  # also cap each path at its scenario link bandwidth
        self.resolve = resolve  # address -> peer device id for addresses not in peers
        self.default_peer = default_peer  # device behind any other address (None: unshaped)
        self.stage_servers = list(stage_servers)  # stage index -> device id of its server host
        for dev in [*self.peers.values(), *self.stage_servers, *([default_peer] if default_peer else [])]:
            scenario.device(dev)  # fail now, with a clear message, on an unknown id
        self.seed = seed
        self.shaper = LinkShaper(up=self.device.up * bandwidth_scale,
                                 down=self.device.down * bandwidth_scale, seed=seed)
        self._relays: dict[str, str] = {}
        self._lock = threading.Lock()
        self._siblings: list[ScenarioDial] = []  # dials of other devices of this process (see sibling)

    def sibling(self, seed: int) -> ScenarioDial:
        """A dial for another device equal to this one, in this process (shadow workers: many
        members, each playing its own copy of the device): its own up/down buckets and relays,
        relayed by this dial's loop thread; the peers this dial learns it learns too."""
        other = copy.copy(self)
        other.seed = seed
        other.peers = dict(self.peers)
        other.shaper = LinkShaper(up=self.device.up * self.bandwidth_scale,
                                  down=self.device.down * self.bandwidth_scale, seed=seed, share=self.shaper)
        other._relays, other._lock, other._siblings = {}, threading.Lock(), []
        self._siblings.append(other)
        return other

    def set_peer(self, address: str, device_id: str) -> None:
        """Add or change the device behind ``address`` (e.g. after a re-plan)."""
        self.scenario.device(device_id)
        with self._lock:
            if self.peers.get(address) != device_id:
                self.peers[address] = device_id
                self._relays.pop(address, None)  # the next dial makes a relay for the new link
        for other in self._siblings:
            other.set_peer(address, device_id)

    def set_stage_address(self, stage: int, address: str) -> None:
        """Record that stage ``stage``'s server listens at ``address`` (needs ``stage_servers``)."""
        if 0 <= stage < len(self.stage_servers):
            self.set_peer(address, self.stage_servers[stage])

    def link_for(self, address: str):
        """The scenario :class:`~shoal.plan.types.Link` towards ``address`` (None: unknown)."""
        peer_id = self.peers.get(address)
        if peer_id is None and self.resolve is not None:
            peer_id = self.resolve(address)
        if peer_id is None:
            peer_id = self.default_peer
        if peer_id is None:
            return None
        return self.scenario.network.link(self.device, self.scenario.device(peer_id))

    def __call__(self, address: str) -> str:
        with self._lock:
            if address in self._relays:
                return self._relays[address]
            link = self.link_for(address)
            if link is None:
                return address
            rate = link.bandwidth * self.bandwidth_scale if self.per_flow else None
            relay = self.shaper.proxy_for(
                address, latency_s=link.latency * self.latency_scale, jitter_s=self.jitter_s,
                path_up=rate, path_down=rate)
            self._relays[address] = relay
            return relay

    def close(self) -> None:
        """Stop the relays (and its siblings' first: they run on this dial's loop thread)."""
        for other in self._siblings:
            other.close()
        self.shaper.close()
