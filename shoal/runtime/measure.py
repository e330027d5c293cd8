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
TRANSFER_REPEATS = 3  # timed transfers of the final size each way; their median rate counts
ASYMMETRY = 4.0  # one direction this many times the other is measured again before it is believed
RECHECKS = 2  # re-measurements of a link whose figures are implausible
FLOPS_BUDGET_S = 0.5  # seconds of timed layer runs (after one warm-up run)
MEASURE_BLOCKS = 1  # transformer blocks run by the compute measurement


@dataclass
class LinkFigures:
    """One measured path: round trip and one-way transfer rates."""

    target: str  # address probed
    rtt_s: float  # best round-trip time of an empty echo
    up_bps: float  # bytes/s uploaded to the target
    down_bps: float  # bytes/s downloaded from the target
    remeasured: str = ""  # why the first figures were not used ("": they were)

    def to_pb(self) -> pb.LinkProbe:
        return pb.LinkProbe(target=self.target, rtt_s=self.rtt_s, up_bps=self.up_bps, down_bps=self.down_bps)


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


def probe_reply(request: pb.ProbeRequest) -> pb.ProbeReply:
    """The answer to a ``Probe`` call: ``reply_bytes`` zero bytes (bounded)."""
    n = int(request.reply_bytes)
    if not 0 <= n <= MAX_PROBE_BYTES:
        raise ShoalError(f"probe asks for {n} bytes; at most {MAX_PROBE_BYTES} are sent")
    return pb.ProbeReply(payload=bytes(n))


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


async def _timed(call) -> float:
    t0 = time.perf_counter()
    await call
    return time.perf_counter() - t0


async def _direction_rate(stub, up: bool, rtt_s: float, max_bytes: int, repeats: int, timeout_s: float,
                          start_bytes: int = START_PROBE_BYTES) -> float:
    """Bytes/s one way: grow the transfer until it lasts long enough (:func:`next_probe_size`),
    then the median of ``repeats`` timed transfers of that size (:func:`rate_from` each)."""

    def call(n: int):
        req = pb.ProbeRequest(payload=bytes(n)) if up else pb.ProbeRequest(reply_bytes=n)
        return stub.Probe(req, timeout=timeout_s)

    n = max(1, min(start_bytes, max_bytes))
    times: list[float] = []
    for _ in range(8):
        t = await _timed(call(n))
        nxt = next_probe_size(n, t, rtt_s, max_bytes)
        if nxt == n:
            times.append(t)  # long enough: the first of the repeats
            break
        n = nxt
    while len(times) < max(1, repeats):
        times.append(await _timed(call(n)))
    return median([rate_from(n, t, rtt_s) for t in times])


async def probe_link(stub, target: str, probe_bytes: int = DEFAULT_PROBE_BYTES,
                     rtt_repeats: int = RTT_REPEATS, transfer_repeats: int = TRANSFER_REPEATS,
                     timeout_s: float = 60.0) -> LinkFigures:
    """Measure the path to ``target`` through ``stub`` (any stub with a ``Probe`` method).

    A first echo opens the connection (not timed); the round-trip time is the median of
    ``rtt_repeats`` empty echoes. Each way, transfers grow from 1 MiB (at most
    ``probe_bytes``) until one lasts at least ``MIN_TRANSFER_S`` and ``BDP_RTTS`` round
    trips, so the probe covers several bandwidth-delay products of the link; the rate is
    the median over ``transfer_repeats`` transfers of that size of bytes over (time less
    one round trip).
    """
    await stub.Probe(pb.ProbeRequest(), timeout=timeout_s)
    rtt = median([await _timed(stub.Probe(pb.ProbeRequest(), timeout=timeout_s)) for _ in range(max(1, rtt_repeats))])
    up = await _direction_rate(stub, True, rtt, probe_bytes, transfer_repeats, timeout_s)
    down = await _direction_rate(stub, False, rtt, probe_bytes, transfer_repeats, timeout_s)
    return LinkFigures(target=target, rtt_s=rtt, up_bps=up, down_bps=down)


async def checked_probe(stub, target: str, probe_bytes: int = DEFAULT_PROBE_BYTES,
                        limit_bps: float | None = None, retries: int = RECHECKS) -> LinkFigures:
    """:func:`probe_link`, measured again (with probes up to 4x larger each time, at most
    ``MAX_PROBE_BYTES``) while its figures are :func:`implausible`. After ``retries``
    re-measurements the last figures stand, a rate above ``limit_bps`` cut to it (a real
    asymmetric link keeps its asymmetry)."""
    figs = await probe_link(stub, target, probe_bytes)
    size = probe_bytes
    for _ in range(retries):
        why = implausible(figs.up_bps, figs.down_bps, limit_bps)
        if not why:
            return figs
        size = min(MAX_PROBE_BYTES, size * 4)
        log.info("link to %s: %s; measuring again with probes up to %.0f MB", target, why, size / 1e6)
        figs = await probe_link(stub, target, size)
        figs.remeasured = why
    if limit_bps:
        figs.up_bps, figs.down_bps = min(figs.up_bps, limit_bps), min(figs.down_bps, limit_bps)
    return figs


async def probe_links(open_stub, targets: list[str], probe_bytes: int = DEFAULT_PROBE_BYTES,
                      limit_bps: float | None = None) -> list[LinkFigures]:
    """Probe each distinct non-empty address in ``targets`` one after the other.

    ``open_stub(address)`` returns a stub with ``Probe``. One at a time, so the probes
    of one member do not share its uplink; a target that does not answer is tried once
    more, then skipped (the coordinator asks again when a stage server is missing).
    """
    import grpc

    out, seen = [], set()
    for t in targets:
        if not t or t in seen:
            continue
        seen.add(t)
        for attempt in range(2):
            try:
                out.append(await checked_probe(open_stub(t), t, probe_bytes, limit_bps))
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
    figures hold only training traffic. The channels are closed afterwards.
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
        return await probe_links(stub, ["coordinator", *servers], probe_bytes, interface_rate_bps())
    finally:
        for ch in opened:
            await ch.close()
