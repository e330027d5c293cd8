"""Members measure themselves: device, compute speed at the run's shapes, and links.

A member of a real (non-emulated) run is asked by the coordinator (``Assignment.measure``)
to measure, and answers with a ``MeasureReport``:

* its device: a name and its memory (the accelerator's total memory when it computes on
  one, else the host's available RAM), through torch so any device type works;
* workers: FLOP/s of transformer blocks of the run's model run forward + backward at the
  run's micro-batch size and sequence length, the time converted with the model
  profile's FLOPs of those blocks (what the planner charges a task), bounded in time;
* its links: towards the coordinator and each stage server it may be given, the
  round-trip time of an empty echo and short timed transfers each way (``Probe`` RPC,
  :func:`probe_link`).

Everything here is a plain function; the worker and server call them from their join
and heartbeat paths, and the coordinator builds the planning scenario from the reports
(:mod:`shoal.runtime.roles.planning`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import struct
import time
from dataclasses import dataclass

import torch

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.auth import PROBE_BYTES

log = logging.getLogger("shoal.measure")

DEFAULT_PROBE_BYTES = 16 * 1024 * 1024  # largest timed transfer each way (--probe-mb)
MAX_PROBE_BYTES = PROBE_BYTES  # largest transfer a Probe call may carry or ask for (auth.METHOD_LIMITS)
START_PROBE_BYTES = 1024 * 1024  # first timed transfer each way; grown until it lasts long enough
MIN_TRANSFER_S = 0.2  # a counted transfer lasts at least this long (timer and scheduling noise small)
BDP_RTTS = 8.0  # ... and at least this many round trips (several bandwidth-delay products)
RTT_REPEATS = 5  # empty echoes per link; their median is the round-trip time
TRANSFER_REPEATS = 3  # timed transfers of the final size each way (transfer_rate: the fastest kernel-timed one)
ASYMMETRY = 4.0  # one direction this many times the other is measured again before it is believed
RECHECKS = 2  # re-measurements of a link whose figures are implausible
PROBE_CALL_S = 10.0  # a probe call's deadline beyond its bytes' time at PROBE_FLOOR_BPS
PROBE_FLOOR_BPS = 1e6  # slowest transfer a probe waits for (bytes/s): one hung on a dropped link fails soon
FLOPS_BUDGET_S = 0.5  # seconds of timed layer runs (after one warm-up run)
MEASURE_BLOCKS = 1  # transformer blocks run by the compute measurement


@dataclass
class LinkFigures:
    """One measured path: round trip and one-way transfer rates."""

    target: str  # address probed
    rtt_s: float  # round trip: the kernel's smallest on the connection, else the median empty echo
    up_bps: float  # bytes/s uploaded to the target
    down_bps: float  # bytes/s downloaded from the target
    remeasured: str = ""  # why the first figures were not used ("": they were)
    same_host: bool = False  # the target is on this host (loopback): no rates measured
    method: str = ""  # how transfers were timed: "kernel" (TCP counters), "call", "mixed"

    def to_pb(self) -> pb.LinkProbe:
        return pb.LinkProbe(target=self.target, rtt_s=self.rtt_s, up_bps=self.up_bps, down_bps=self.down_bps,
                            same_host=self.same_host, method=self.method)


# ---------------------------------------------------------------------------- device


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """A torch device from a name ("cpu", "cuda", "cuda:1", "auto"); None or "" means CPU.

    ``auto`` is the first CUDA device when there is one, else the CPU.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device or "cpu")


def device_name(device: str | torch.device | None = None) -> str:
    """A human label of the device, e.g. ``cpu: Intel Xeon`` or ``cuda: NVIDIA H200``."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    if dev.type == "cpu":
        model = _cpu_model()
        return f"cpu: {model}" if model else "cpu"
    return dev.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def available_ram() -> float:
    """Bytes of host RAM available to a new allocation (``MemAvailable``; else total)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def peak_rss_bytes(status: str = "/proc/self/status") -> int:
    """This process's peak resident memory so far in bytes (``VmHWM``: since its own start or
    fork, so a member forked from the fork server counts only itself); 0 where the system does
    not say."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def warm_device(device: str | torch.device | None = None) -> float:
    """Start an accelerator's context and matrix library now; the seconds it took (0 on a CPU).

    A worker calls this before it joins a run, so that the first touch of its GPU (a CUDA
    context, cuBLAS handles, the first kernels: 0.4-0.5 s on an H200, longer on slower hosts)
    falls before the coordinator counts its heartbeats and is not part of its device measurement.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    torch.cuda.init()
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    with torch.cuda.device(dev):
        for dtype in dtypes:
            a = torch.ones(64, 64, device=dev, dtype=dtype)
            (a @ a).sum().item()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def device_memory(device: str | torch.device | None = None) -> float:
    """Bytes of memory for training on ``device``: total accelerator memory, or available RAM."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    return available_ram()


# ---------------------------------------------------------------------------- compute


def measure_blocks(n_total_layers: int, blocks: int = MEASURE_BLOCKS) -> tuple[int, int]:
    """Layer range ``[first, last)`` of the blocks the compute measurement runs.

    Layer 0 is the embedding and the last layer the head; the blocks right after the
    embedding are what every stage mostly consists of. Models with no block (never the
    case for the presets) measure the head alone.
    """
    n_blocks = n_total_layers - 2
    if n_blocks < 1:
        return n_total_layers - 1, n_total_layers
    return 1, 1 + max(1, min(blocks, n_blocks))


def measure_stage_flops(cfg, seq_len: int, micro_batch_size: int, *, device: str | torch.device | None = None,
                        budget_s: float = FLOPS_BUDGET_S, blocks: int = MEASURE_BLOCKS,
                        seed: int = 0, precision: str = "fp32") -> float:
    """FLOP/s of ``blocks`` transformer blocks of ``cfg``, forward + backward, at the run's shapes
    and precision (bf16/fp16: under autocast, activations in the compute dtype, as workers run).

    One warm-up run, then timed runs until ``budget_s`` has passed (at least one). The
    time is converted with the model profile's forward + backward FLOPs of those layers
    for one micro-batch of ``micro_batch_size`` x ``seq_len``, the figure the planner
    divides by a device's FLOP/s to cost a task.
    """
    from shoal.model.profile import profile_model
    from shoal.model.transformer import build_stage
    from shoal.train.precision import autocast, compute_dtype

    dev = resolve_device(device)
    first, last = measure_blocks(cfg.n_total_layers, blocks)
    prof = profile_model(cfg, seq_len, micro_batch_size, 4)
    flops = prof.fwd_flops(first, last) + prof.bwd_flops(first, last)
    module = build_stage(cfg, first, last, seed=seed).to(dev)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(micro_batch_size, seq_len, cfg.d_model, generator=gen).to(dev, compute_dtype(precision))

    def once() -> None:
        inp = x.detach().requires_grad_(True)
        with autocast(dev, precision):
            out = module(inp)
        out.float().sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    once()  # warm-up: allocator, kernels, caches
    reps, t0 = 0, time.perf_counter()
    while True:
        once()
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s:
            break
    return flops * reps / max(elapsed, 1e-9)


# ---------------------------------------------------------------------------- links

TCP_INFO_BYTES = 192  # struct tcp_info up to tcpi_sndbuf_limited (Linux 4.10+); shorter: no kernel figures
MIN_BUSY_S = 0.05  # kernel busy time below this (a dozen 4 ms ticks) gives no rate (the call time counts)


@dataclass(frozen=True)
class TcpCounters:
    """Kernel counters of one TCP connection, as its sending side sees them."""

    acked: int  # bytes the peer acknowledged
    busy_s: float  # seconds the connection had unacknowledged or unsent data
    min_rtt_s: float  # smallest round trip the kernel measured on it (0: none yet)


def parse_tcp_info(raw: bytes) -> TcpCounters | None:
    """The counters in a Linux ``struct tcp_info`` (``getsockopt(TCP_INFO)``); None when
    the kernel's struct is too short to hold them."""
    if len(raw) < TCP_INFO_BYTES:
        return None
    (acked,) = struct.unpack_from("=Q", raw, 120)  # tcpi_bytes_acked
    (min_rtt_us,) = struct.unpack_from("=I", raw, 148)  # tcpi_min_rtt
    (busy_us,) = struct.unpack_from("=Q", raw, 168)  # tcpi_busy_time
    return TcpCounters(acked=acked, busy_s=busy_us / 1e6, min_rtt_s=min_rtt_us / 1e6)


def _plain_ip(ip: str) -> str:
    ip = ip.strip("[]")
    return ip[7:] if ip.lower().startswith("::ffff:") and "." in ip else ip


def tcp_connections(peer_ips: set[str], peer_port: int | None = None) -> dict[tuple, TcpCounters]:
    """Kernel counters of this process's TCP connections to ``peer_ips`` (and ``peer_port``),
    keyed by (local address, peer address). Linux only (``/proc/self/fd``, ``TCP_INFO``);
    elsewhere, or when nothing matches, empty. The sockets are gRPC's: each is looked at
    through a duplicate descriptor, closed at once."""
    import socket

    out: dict[tuple, TcpCounters] = {}
    if not hasattr(socket, "TCP_INFO"):
        return out
    peers = {_plain_ip(ip) for ip in peer_ips}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            far = sock.getpeername()
            if _plain_ip(far[0]) not in peers or (peer_port is not None and far[1] != peer_port):
                continue
            figs = parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
            if figs is not None:
                out[(sock.getsockname()[:2], far[:2])] = figs
        except OSError:
            pass
        finally:
            sock.close()
    return out


def parse_peer(peer: str) -> tuple[str, int] | None:
    """(ip, port) of a gRPC peer string (``ipv4:10.0.0.3:5123``, ``ipv6:[::1]:5123``,
    percent-encoded too); None for other kinds (unix sockets)."""
    from urllib.parse import unquote

    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    return _plain_ip(host), int(port)


def peer_tcp_stats(peer: str) -> pb.TcpStats | None:
    """This process's kernel counters of its connection to the gRPC ``peer`` (the caller
    of a handler): what the answering side of a download sends back to the prober."""
    where = parse_peer(peer)
    if where is None:
        return None
    conns = tcp_connections({where[0]}, where[1])
    if len(conns) != 1:
        return None
    (figs,) = conns.values()
    return pb.TcpStats(bytes_acked=figs.acked, busy_us=int(round(figs.busy_s * 1e6)))


def kernel_rate(acked0: int, busy0_s: float, acked1: int, busy1_s: float, nbytes: int) -> float | None:
    """Bytes/s of the link from the sending side's kernel counters before and after a transfer
    of ``nbytes``: bytes acknowledged over the time the connection had data in flight or
    queued. Time the sending or receiving process spent off the CPU (the queue empty, nothing
    in flight) is not in it, so a starved process does not slow the figure; it never counts
    more than the link delivered. None when the counters did not see the transfer (fewer
    bytes acknowledged than sent, another connection) or it kept the link busy too briefly
    for the kernel's clock ticks."""
    acked, busy = acked1 - acked0, busy1_s - busy0_s
    if acked < 0.9 * nbytes or busy < MIN_BUSY_S:
        return None
    return acked / busy


_HOST_ID: str | None = None


def host_id() -> str:
    """An opaque id of this host as the network sees it: the kernel's boot id and this
    process's network namespace, hashed; ``""`` when unknown (never matches). Two processes
    with the same id talk over loopback."""
    global _HOST_ID
    if _HOST_ID is None:
        import hashlib

        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            ns = os.readlink("/proc/self/ns/net")
            _HOST_ID = hashlib.sha256(f"{boot}/{ns}".encode()).hexdigest()[:16]
        except OSError:
            _HOST_ID = ""
    return _HOST_ID


def probe_reply(request: pb.ProbeRequest, peer: str = "") -> pb.ProbeReply:
    """The answer to a ``Probe`` call: ``reply_bytes`` zero bytes (bounded), this host's id,
    and, when asked, this side's kernel counters of its connection to ``peer`` (the gRPC
    peer string of the caller)."""
    n = int(request.reply_bytes)
    if not 0 <= n <= MAX_PROBE_BYTES:
        raise ShoalError(f"probe asks for {n} bytes; at most {MAX_PROBE_BYTES} are sent")
    reply = pb.ProbeReply(payload=bytes(n), host=host_id())
    if request.tcp_stats and peer:
        stats = peer_tcp_stats(peer)
        if stats is not None:
            reply.tcp.CopyFrom(stats)
    return reply


def rate_from(nbytes: int, seconds: float, rtt_s: float) -> float:
    """Bytes/s of one timed transfer: its time less one round trip (the request/reply turn).

    The transfer is never credited with less than a tenth of its time, so a timing
    smaller than the round trip (clock noise) does not give an absurd rate.
    """
    return nbytes / max(seconds - rtt_s, 0.1 * seconds, 1e-9)


def median(xs: list[float]) -> float:
    """The median of a non-empty list (mean of the middle two for an even count)."""
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def next_probe_size(nbytes: int, seconds: float, rtt_s: float, max_bytes: int,
                    min_s: float = MIN_TRANSFER_S, rtts: float = BDP_RTTS) -> int:
    """The size of the next timed transfer: ``nbytes`` when a transfer of it lasted long
    enough (at least ``min_s`` and ``rtts`` round trips, i.e. several bandwidth-delay
    products, so TCP's and HTTP/2's windows are open for most of it and the round trip
    is small against it), else larger (at most ``max_bytes``), scaled by how short it was."""
    need = max(min_s, rtts * rtt_s)
    if seconds >= need or nbytes >= max_bytes:
        return nbytes
    grow = min(16.0, max(2.0, 1.25 * need / max(seconds, 1e-6)))
    return min(max_bytes, int(nbytes * grow))


def implausible(up_bps: float, down_bps: float, limit_bps: float | None,
                asymmetry: float = ASYMMETRY) -> str:
    """Why a link's figures cannot be used as measured (``""``: they can): a rate above the
    host's fastest interface (``limit_bps``; None: unknown), or one direction more than
    ``asymmetry`` times the other."""
    if limit_bps and max(up_bps, down_bps) > 1.1 * limit_bps:
        return (f"{max(up_bps, down_bps) * 8 / 1e6:.0f} Mbit/s is more than this host's interface rate "
                f"({limit_bps * 8 / 1e6:.0f} Mbit/s)")
    lo, hi = min(up_bps, down_bps), max(up_bps, down_bps)
    if lo > 0 and hi > asymmetry * lo:
        return f"up {up_bps * 8 / 1e6:.1f} and down {down_bps * 8 / 1e6:.1f} Mbit/s differ more than {asymmetry:g}x"
    return ""


def interface_rate_bps(root: str = "/sys/class/net") -> float | None:
    """Bytes/s of this host's fastest network interface that is up and reports a speed
    (``/sys/class/net/*/speed``, Mbit/s); None when none does (loopback, most virtual ones)."""
    best = 0.0
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        if name == "lo":
            continue
        try:
            with open(os.path.join(root, name, "operstate")) as f:
                if f.read().strip() not in ("up", "unknown"):
                    continue
            with open(os.path.join(root, name, "speed")) as f:
                mbit = float(f.read().strip())
        except (OSError, ValueError):
            continue
        best = max(best, mbit * 1e6 / 8)
    return best or None


def probe_timeout_s(nbytes: int, most_s: float) -> float:
    """Deadline of one Probe call carrying ``nbytes`` (pure): :data:`PROBE_CALL_S` plus the
    bytes at :data:`PROBE_FLOOR_BPS`, at most ``most_s``. A call on a connection that died
    under it then fails in seconds (the probe is tried again, then skipped, and the
    coordinator asks again) instead of holding every later member's measurement for
    minutes: the coordinator measures members one at a time."""
    return min(most_s, PROBE_CALL_S + nbytes / PROBE_FLOOR_BPS)


async def _timed(call) -> float:
    t0 = time.perf_counter()
    await call
    return time.perf_counter() - t0


def _counted(before: dict, after: dict, nbytes: int) -> tuple[float | None, float]:
    """(kernel rate, busy seconds) of a transfer from the counters of the connections seen
    before and after it: the connection that acknowledged the most bytes carried it."""
    best = None
    for key, c1 in after.items():
        c0 = before.get(key)
        if c0 is not None and (best is None or c1[0] - c0[0] > best[1][0] - best[0][0]):
            best = (c0, c1)
    if best is None:
        return None, 0.0
    (a0, b0), (a1, b1) = best
    return kernel_rate(a0, b0, a1, b1, nbytes), b1 - b0


async def _direction_rate(stub, up: bool, rtt_s: float, max_bytes: int, repeats: int, timeout_s: float,
                          start_bytes: int = START_PROBE_BYTES, counters=None) -> tuple[float, str]:
    """Bytes/s one way and how they were timed (``"kernel"``, ``"call"`` or ``"mixed"``).

    Grow the transfer until it lasts long enough (:func:`next_probe_size`), then take the
    median of ``repeats`` transfers of that size. ``counters(up)`` (None: none) returns
    the sending side's kernel counters ``{connection: (bytes acked, busy seconds)}``; a
    transfer they saw counts as :func:`kernel_rate` and its busy time, else as
    :func:`rate_from` of the call's time.
    """
    zeros = b""

    def call(n: int):
        nonlocal zeros
        if up and len(zeros) != n:
            zeros = bytes(n)  # built once per size, not per call
        req = pb.ProbeRequest(payload=zeros) if up else pb.ProbeRequest(reply_bytes=n)
        return stub.Probe(req, timeout=probe_timeout_s(n, timeout_s))

    async def once(n: int) -> tuple[float, float, bool]:
        c0 = await counters(up) if counters else {}
        t = await _timed(call(n))
        c1 = await counters(up) if counters else {}
        k, busy = _counted(c0, c1, n)
        return (k, busy, True) if k is not None else (rate_from(n, t, rtt_s), t, False)

    n = max(1, min(start_bytes, max_bytes))
    done: list[tuple[float, float, bool]] = []
    for _ in range(8):
        r = await once(n)
        nxt = next_probe_size(n, r[1], rtt_s, max_bytes)
        if nxt == n:
            done.append(r)  # long enough: the first of the repeats
            break
        n = nxt
    while len(done) < max(1, repeats):
        done.append(await once(n))
    return transfer_rate([(r, k) for r, _, k in done])


def transfer_rate(samples: list[tuple[float, bool]]) -> tuple[float, str]:
    """The rate of a direction from its timed transfers ``(bytes/s, timed by the kernel's
    counters)``, and how they were timed (``"kernel"``, ``"call"`` or ``"mixed"``; pure).

    A kernel-timed rate counts the time the connection had data in flight, so it is never more
    than the link delivered (:func:`kernel_rate`), but a sender or receiver short of CPU keeps
    data in flight at a lower rate and reads low: the 400 Mbit/s shaped link of
    tests/test_runtime_measure_netns.py read 308 and 295 Mbit/s over the median of three on the
    2-core box beside other jobs. So the fastest kernel-timed transfer counts; a call's time holds
    everything around it and may err either way, so transfers timed by calls alone count by
    their median."""
    kernel = [r for r, by_kernel in samples if by_kernel]
    kinds = {by_kernel for _, by_kernel in samples}
    how = "mixed" if len(kinds) > 1 else "kernel" if True in kinds else "call"
    return (max(kernel) if kernel else median([r for r, _ in samples])), how


async def probe_link(stub, target: str, probe_bytes: int = DEFAULT_PROBE_BYTES,
                     rtt_repeats: int = RTT_REPEATS, transfer_repeats: int = TRANSFER_REPEATS,
                     timeout_s: float = 60.0, address: str | None = None) -> LinkFigures:
    """Measure the path to ``target`` through ``stub`` (any stub with a ``Probe`` method);
    each call's deadline is :func:`probe_timeout_s` of its bytes, at most ``timeout_s``.

    A first echo opens the connection (not timed); the round-trip time is the median of
    ``rtt_repeats`` empty echoes. ``address`` (``HOST:PORT`` the stub connects to
    directly; None: through a proxy or unknown) enables two things:

    * a target whose reply names this host (:func:`host_id`) is on the same host: the
      figures say so (``same_host``) and no transfer is timed, loopback being no link;
    * transfers are timed by the sending side's kernel counters (:func:`kernel_rate`): this
      process's own connection for uploads, the target's (``ProbeRequest.tcp_stats``) for
      downloads; the round trip is then the kernel's smallest on the connection.

    Each way, transfers grow from 1 MiB (at most ``probe_bytes``) until one keeps the link
    busy at least ``MIN_TRANSFER_S`` and ``BDP_RTTS`` round trips (several
    bandwidth-delay products); of ``transfer_repeats`` transfers of that size the rate is
    :func:`transfer_rate`'s. Without kernel counters a transfer counts as bytes over (call
    time less one round trip).
    """
    echo_s = probe_timeout_s(0, timeout_s)
    first = await stub.Probe(pb.ProbeRequest(), timeout=echo_s)
    rtt = median([await _timed(stub.Probe(pb.ProbeRequest(), timeout=echo_s)) for _ in range(max(1, rtt_repeats))])
    if address is not None and first.host and first.host == host_id():
        return LinkFigures(target=target, rtt_s=rtt, up_bps=0.0, down_bps=0.0, same_host=True)
    counters = None
    ips: set[str] = set()
    if address is not None:
        from shoal.net.channel import split_address

        host, port = split_address(address)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), port)
            ips = {i[4][0] for i in infos}
        except OSError:
            ips = set()

        async def counters(up: bool) -> dict:
            if up:
                return {k: (c.acked, c.busy_s) for k, c in tcp_connections(ips, port).items()}
            reply = await stub.Probe(pb.ProbeRequest(tcp_stats=True), timeout=echo_s)
            return {"far": (reply.tcp.bytes_acked, reply.tcp.busy_us / 1e6)} if reply.HasField("tcp") else {}

    up, how_up = await _direction_rate(stub, True, rtt, probe_bytes, transfer_repeats, timeout_s, counters=counters)
    down, how_down = await _direction_rate(stub, False, rtt, probe_bytes, transfer_repeats, timeout_s,
                                           counters=counters)
    if ips:
        kernel_rtts = [c.min_rtt_s for c in tcp_connections(ips, port).values() if c.min_rtt_s > 0]
        if kernel_rtts and how_up == "kernel":
            rtt = min(kernel_rtts)
    method = how_up if how_up == how_down else "mixed"
    return LinkFigures(target=target, rtt_s=rtt, up_bps=up, down_bps=down, method=method)


async def checked_probe(stub, target: str, probe_bytes: int = DEFAULT_PROBE_BYTES,
                        limit_bps: float | None = None, retries: int = RECHECKS,
                        address: str | None = None) -> LinkFigures:
    """:func:`probe_link`, measured again (with probes up to 4x larger each time, at most
    ``MAX_PROBE_BYTES``) while its figures are :func:`implausible`. After ``retries``
    re-measurements the last figures stand, a rate above ``limit_bps`` cut to it (a real
    asymmetric link keeps its asymmetry). A same-host path has no rates to check."""
    figs = await probe_link(stub, target, probe_bytes, address=address)
    size = probe_bytes
    for _ in range(retries):
        why = "" if figs.same_host else implausible(figs.up_bps, figs.down_bps, limit_bps)
        if not why:
            return figs
        size = min(MAX_PROBE_BYTES, size * 4)
        log.info("link to %s: %s; measuring again with probes up to %.0f MB", target, why, size / 1e6)
        figs = await probe_link(stub, target, size, address=address)
        figs.remeasured = why
    if limit_bps:
        figs.up_bps, figs.down_bps = min(figs.up_bps, limit_bps), min(figs.down_bps, limit_bps)
    return figs


async def probe_links(open_stub, targets: list[str], probe_bytes: int = DEFAULT_PROBE_BYTES,
                      limit_bps: float | None = None, direct: dict[str, str] | None = None) -> list[LinkFigures]:
    """Probe each distinct non-empty address in ``targets`` one after the other.

    ``open_stub(address)`` returns a stub with ``Probe``; ``direct`` maps a target to the
    ``HOST:PORT`` its stub connects to straight (no proxy), for kernel timing and same-host
    detection (:func:`probe_link`). One at a time, so the probes of one member do not
    share its uplink; a target that does not answer is tried once more, then skipped (the
    coordinator asks again when a stage server is missing).
    """
    import grpc

    out, seen = [], set()
    for t in targets:
        if not t or t in seen:
            continue
        seen.add(t)
        for attempt in range(2):
            try:
                out.append(await checked_probe(open_stub(t), t, probe_bytes, limit_bps,
                                               address=(direct or {}).get(t)))
                break
            except grpc.aio.AioRpcError as exc:
                log.info("probe of %s failed (%s)%s", t, exc.code().name, "; trying again" if not attempt else "")
                if not attempt:
                    await asyncio.sleep(0.5)
    return out


async def probe_peers(channels, coordinator: str, servers: list[str],
                      probe_bytes: int = DEFAULT_PROBE_BYTES) -> list[LinkFigures]:
    """Probe the coordinator (reported as target ``"coordinator"``) and each server address.

    ``channels`` is the member's :class:`~shoal.net.channel.ChannelFactory`; the probes
    use channels of their own through the same ``dial`` hook (so an emulated link is
    measured as the run sees it) but without its byte counters, so the run's traffic
    figures hold only training traffic. The channels are closed afterwards. Without a
    ``dial`` hook the connections are direct: transfers are timed by the kernel's TCP
    counters and a peer on this host is reported as such (:func:`probe_link`).
    """
    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.channel import ChannelFactory

    plain = ChannelFactory(channels.token, max_message_bytes=channels.max_message_bytes, dial=channels.dial,
                           tls=channels.tls, identity=channels.identity)
    opened = []

    def stub(address: str):
        ch = plain.open(coordinator if address == "coordinator" else address)
        opened.append(ch)
        return pbg.CoordinatorStub(ch) if address == "coordinator" else pbg.StageServerStub(ch)

    try:
        targets = ["coordinator", *servers]
        direct = None if channels.dial else {t: coordinator if t == "coordinator" else t for t in targets}
        return await probe_links(stub, targets, probe_bytes, interface_rate_bps(), direct)
    finally:
        for ch in opened:
            await ch.close()
