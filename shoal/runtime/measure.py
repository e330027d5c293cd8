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

import math
import os
import platform
import time
from dataclasses import dataclass

import torch

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.auth import PROBE_BYTES

DEFAULT_PROBE_BYTES = 2 * 1024 * 1024  # bytes of the larger timed transfer each way ("a few MB")
MAX_PROBE_BYTES = PROBE_BYTES  # largest transfer a Probe call may carry or ask for (auth.METHOD_LIMITS)
RTT_REPEATS = 3  # empty echoes per link; the fastest is the round-trip time
TRANSFER_REPEATS = 2  # timed transfers of each size and direction; the fastest counts
FLOPS_BUDGET_S = 0.5  # seconds of timed layer runs (after one warm-up run)
MEASURE_BLOCKS = 1  # transformer blocks run by the compute measurement


@dataclass
class LinkFigures:
    """One measured path: round trip and one-way transfer rates."""

    target: str  # address probed
    rtt_s: float  # best round-trip time of an empty echo
    up_bps: float  # bytes/s uploaded to the target
    down_bps: float  # bytes/s downloaded from the target

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


def slope_rate(small: int, t_small: float, large: int, t_large: float, rtt_s: float) -> float:
    """Bytes/s from two timed transfers of different sizes: the extra bytes over the extra time.

    Every cost a call pays whatever its size (the round trip, call set-up, scheduling)
    cancels out; what is left is the per-byte cost, i.e. the path's rate. When the
    timings are too noisy for that (the larger one not slower), :func:`rate_from` of the
    larger transfer is used.
    """
    if large > small and t_large > t_small:
        return (large - small) / (t_large - t_small)
    return rate_from(large, t_large, rtt_s)


async def _timed(call) -> float:
    t0 = time.perf_counter()
    await call
    return time.perf_counter() - t0


async def probe_link(stub, target: str, probe_bytes: int = DEFAULT_PROBE_BYTES,
                     rtt_repeats: int = RTT_REPEATS, transfer_repeats: int = TRANSFER_REPEATS,
                     timeout_s: float = 60.0) -> LinkFigures:
    """Measure the path to ``target`` through ``stub`` (any stub with a ``Probe`` method).

    A first echo opens the connection (not timed); then the best of ``rtt_repeats``
    empty echoes is the round-trip time. Each way, transfers of a quarter of
    ``probe_bytes`` and of all of it, ``transfer_repeats`` times each, give the rate
    (:func:`slope_rate` of the fastest time of each size: scheduling delays only ever
    add time, so the fastest is the one least disturbed).
    """
    await stub.Probe(pb.ProbeRequest(), timeout=timeout_s)
    rtt = min([await _timed(stub.Probe(pb.ProbeRequest(), timeout=timeout_s)) for _ in range(max(1, rtt_repeats))])
    small = max(1, probe_bytes // 4)
    sizes = (small, probe_bytes)
    t_up = {n: math.inf for n in sizes}
    t_down = {n: math.inf for n in sizes}
    for _ in range(max(1, transfer_repeats)):
        for n in sizes:
            t_up[n] = min(t_up[n], await _timed(stub.Probe(pb.ProbeRequest(payload=bytes(n)), timeout=timeout_s)))
        for n in sizes:
            t_down[n] = min(t_down[n], await _timed(stub.Probe(pb.ProbeRequest(reply_bytes=n), timeout=timeout_s)))
    return LinkFigures(target=target, rtt_s=rtt,
                       up_bps=slope_rate(small, t_up[small], probe_bytes, t_up[probe_bytes], rtt),
                       down_bps=slope_rate(small, t_down[small], probe_bytes, t_down[probe_bytes], rtt))


async def probe_links(open_stub, targets: list[str], probe_bytes: int = DEFAULT_PROBE_BYTES) -> list[LinkFigures]:
    """Probe each distinct non-empty address in ``targets`` one after the other.

    ``open_stub(address)`` returns a stub with ``Probe``. One at a time, so the probes
    of one member do not share its uplink; a target that does not answer is skipped.
    """
    import grpc

    out, seen = [], set()
    for t in targets:
        if not t or t in seen:
            continue
        seen.add(t)
        try:
            out.append(await probe_link(open_stub(t), t, probe_bytes))
        except grpc.aio.AioRpcError:
            continue
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
        return await probe_links(stub, ["coordinator", *servers], probe_bytes)
    finally:
        for ch in opened:
            await ch.close()
