"""The planner's time-cost model: small pure functions and one entry point, :func:`predict`.

Notation (see ``docs/planner-cost-model.md``): stage ``s`` holds layers ``[a_s, b_s)``, its server runs on
host ``h_s`` and its workers are ``W_s``; ``M`` micro-batches per step. All times in seconds,
sizes in bytes, rates in bytes/s and FLOP/s.

* per-task compute of worker ``d`` on stage ``s``: ``c = (F_s + G_s) / flops_d`` (forward and
  backward FLOPs of one micro-batch; ``+F_s`` again when backward recomputes the forward).
* a transfer of ``n`` bytes moves at ``bw = min(path, own link, server link / k_eff)`` where
  ``k_eff = link_share(N, k)`` counts the transfers expected in flight on the server's link
  (``N``; ``k`` = the workers that use it), found by a short fixed point in :func:`stage_costs`;
  sync bursts are simultaneous and share by ``k``.
* per-micro-batch time of ``d``: ``tau_d = c + (bytes of its activation transfers) / bw +
  n_tasks * 2 * L(d, h_s)``: input (and output-gradient) downloads from ``h_s``, output upload to
  ``h_{s+1}``, input-gradient upload to ``h_{s-1}``; each of its ``n_tasks`` tasks per micro-batch
  (2, or 1 on the last stage, which runs forward and backward at once) costs a lease round trip
  to its own server. Uploads are fire-and-forget: their latency delays the micro-batch, not the
  worker, so it only enters the fill/drain term.
* stage throughput ``X_s = sum over the min(M, |W_s|) fastest workers of 1 / tau_d``.
* pipeline: ``P = (M - 1) / min_s X_s + sum_s (tau_s* + L(d*, h_{s+1}) + L(d*, h_{s-1}))`` with
  ``d*`` the stage's fastest worker -- the bottleneck stage sets the rate, and one micro-batch
  must go forward through every stage and backward through every stage before the step can
  close (fill and drain).
* sync: every worker pushes its gradient, the server applies the update once all are in, then
  every worker pulls: ``(3 L_max + max_d g / bw_push,d + max_d g / bw_pull,d) / sync_every`` per
  stage with ``g = param_bytes_s * grad_compression``; the step waits for the slowest stage.
* step: ``P + sync`` or, with ``overlap_sync``, ``max(P, sync)``.
* churn (scenario churn enabled): availability ``a_d = S_d / (S_d + O)`` weights the stage
  throughput, and each step pays ``sum_d (T / S_d) leave_cost_d``; the result is
  ``expected_step_time_s`` (``step_time_s`` stays churn-free). See :func:`churn_step_time`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache

import numpy as np

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig
from shoal.model.profile import ModelProfile, profile_model
from shoal.plan.compression import (
    DENSE_ROUND_CODEC,
    act_codec_cpu_s,
    bytes_per_element,
    codec_cpu_s,
    codec_threaded,
    pull_compressed,
)
from shoal.plan.types import (
    MERGE_THREADS,
    SCREEN_REF_MBS,
    SCREEN_REF_TOKENS,
    SCREEN_SAMPLE,
    Device,
    FrameworkCpu,
    Plan,
    Replica,
    Scenario,
    SyncPolicy,
)


@dataclass(frozen=True)
class CostOptions:
    """Modelling choices of the cost model."""

    overlap_sync: bool = False  # parameter sync overlaps the next step's pipeline: step = max(P, sync)
    recompute: bool = False  # a backward task recomputes the forward (workers keep no activations)
    churn: bool = True  # add the expected cost of churn when the scenario's churn is enabled
    lease_timeout_s: float = 10.0  # seconds before a server notices a vanished worker (SimConfig's default)
    coordinator: bool = True  # the coordinator's CPU bounds the step (make_plan's search leaves it to fit_coordinator)


@lru_cache(maxsize=64)
def _profile(cfg: ModelConfig, seq_len: int, micro_batch_size: int, dtype_bytes: int) -> ModelProfile:
    return profile_model(cfg, seq_len, micro_batch_size, dtype_bytes)


def scenario_profile(scenario: Scenario, micro_batch_size: int | None = None) -> ModelProfile:
    """The model profile of ``scenario``'s workload (cached)."""
    w = scenario.workload
    return _profile(w.model_config(), w.seq_len, micro_batch_size or w.micro_batch_size, w.dtype_bytes)


# --------------------------------------------------------------------------- pure formulas


def compute_time(flops: float, device_flops: float) -> float:
    """Seconds for ``flops`` of work on a device sustaining ``device_flops`` FLOP/s."""
    if flops <= 0:
        return 0.0
    if device_flops <= 0:
        return math.inf
    return flops / device_flops


def flow_bandwidth(path_bw: float, src_up: float, dst_down: float, src_share: int = 1, dst_share: int = 1) -> float:
    """Bytes/s of one flow: the path, the sender's uplink and the receiver's downlink, each
    divided among the flows sharing it."""
    return min(path_bw, src_up / max(1, src_share), dst_down / max(1, dst_share))


def transfer_time(nbytes: float, latency: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes``: one latency plus serialisation (0 if nothing to send)."""
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / bandwidth


def stage_throughput(task_times: list[float], micro_batches: int) -> float:
    """Micro-batches per second of a stage's task pool: the ``min(M, n)`` fastest workers each
    complete ``1 / tau`` micro-batches per second (a worker beyond ``M`` gets no task)."""
    times = sorted(t for t in task_times if t < math.inf)[:micro_batches]
    return sum(1.0 / t for t in times if t > 0) if times else 0.0


def pipeline_time(micro_batches: int, throughputs: list[float], latencies: list[float]) -> float:
    """``(M - 1) / min X + sum of per-stage latencies`` (fill and drain, forward and backward)."""
    x = min(throughputs)
    if x <= 0:
        return math.inf
    return (micro_batches - 1) / x + sum(latencies)


def sync_time(param_bytes: float, compression: float, latency: float, push_bw: float, pull_bw: float,
              sync_every: int = 1) -> float:
    """Per-step seconds of a stage's sync with one worker: push request and push, the update,
    then pull request and pull (``3 latency``); see :func:`stage_sync_time` for many workers."""
    g = param_bytes * compression
    if g <= 0:
        return 0.0
    return stage_sync_time(latency, g / push_bw, g / pull_bw, sync_every)


def stage_sync_time(max_latency: float, max_push_s: float, max_pull_s: float, sync_every: int = 1) -> float:
    """Per-step sync seconds of a stage: the update waits for the slowest push, then every worker
    pulls, so the slowest push and the slowest pull add up (they may be different workers)."""
    if max_push_s <= 0 and max_pull_s <= 0:
        return 0.0
    return (3 * max_latency + max_push_s + max_pull_s) / max(1, sync_every)


def link_share(expected_flows: float, users: int) -> float:
    """Flows a transfer expects to share a server link with, itself included.

    ``N`` = expected number of transfers in flight on the link (sum over its ``k`` users of the
    fraction of time each spends on it); a transfer that starts sees, on average, the others'
    share of that: ``k_eff = 1 + N (k - 1) / k`` (Schweitzer's approximation of mean-value
    analysis), clipped to ``[1, k]``. ``N = k`` (everyone always transferring) gives the worst
    case ``k``; compute-bound workers (``N`` near 0) get the whole link.
    """
    if users <= 1:
        return 1.0
    return min(float(users), max(1.0, 1.0 + expected_flows * (users - 1) / users))


def availability(mean_session_s: float | None, mean_offline_s: float) -> float:
    """Long-run fraction of time a device is online: ``a = S / (S + O)`` for mean session ``S``
    and mean time away ``O`` (alternating renewal process); 1 for a device that never leaves."""
    if mean_session_s is None:
        return 1.0
    return mean_session_s / (mean_session_s + max(0.0, mean_offline_s))


def late_task_delay(delay_s: float, pipeline_s: float) -> float:
    """Expected delay of the step's end when a task that leaves at a uniform time ``u`` in
    ``[0, P]`` comes back ``D`` later and then runs to the end: ``E[max(0, u + D - P)]`` =
    ``D^2 / (2P)`` if ``D <= P``, else ``D - P / 2``."""
    if delay_s <= 0:
        return 0.0
    if pipeline_s <= 0:
        return delay_s
    if delay_s <= pipeline_s:
        return delay_s * delay_s / (2 * pipeline_s)
    return delay_s - pipeline_s / 2


def leave_cost(tau: float, stage_rate: float, micro_batches: int, pipeline_s: float, fill_s: float,
               lease_timeout_s: float, pull_s: float) -> float:
    """Expected seconds a step loses when one worker (per-micro-batch time ``tau``) of a stage
    with throughput ``X_s = stage_rate`` leaves at a uniform time in the pipeline ``P``:

    * its leased task comes back after the lease timeout and must still run through the
      pipeline: ``late_task_delay(timeout + tau + fill, P)``;
    * the gradients it held (half of its share ``M_d = M / (tau X_s)`` on average) are re-run
      by the stage's other workers: ``(M_d / 2) / (X_s - 1 / tau)``;
    * if it was the stage's only worker, a replacement must first be found (the timeout) and
      pull the stage's weights (``pull_s``), then re-run at the same speed: ``(M / 2) tau``.
    """
    if not 0 < tau < math.inf or stage_rate <= 0:
        return 0.0
    own = 1.0 / tau
    share = micro_batches * own / stage_rate
    rest = stage_rate - own
    late = late_task_delay(lease_timeout_s + tau + fill_s, pipeline_s)
    if rest > 1e-12 * stage_rate:
        return late + 0.5 * share / rest
    return late + lease_timeout_s + pull_s + 0.5 * share * tau


def granular_pipeline_time(fill: float, stages: list[tuple[float, float]]) -> float:
    """A floor under the pipeline when a stage's slowest worker holds a whole micro-batch: every
    used worker leases a task when the step starts, so some micro-batch spends ``slow_s`` (the
    slowest used worker's time) in stage ``s`` instead of the fastest worker's ``lat_s``, and
    still has to go through the other stages: ``max_s (fill - lat_s + slow_s)``. It binds when
    ``M`` is small against the workers (a few slow tasks end the step), not in the fluid regime.
    ``stages`` holds ``(lat_s, slow_s)`` per stage."""
    return max((fill - lat + slow for lat, slow in stages), default=0.0)


def expected_max_residual(times: list[float]) -> float:
    """``E[max_d U_d tau_d]`` for independent uniform ``U_d`` in [0, 1]: how long after the task
    pool empties the last of the workers' in-flight tasks ends (each is at a uniform point of
    its ``tau_d``). ``P(max <= x) = prod_d min(1, x / tau_d)``, integrated piecewise between the
    sorted ``tau`` in closed form (``x^j / prod`` over the ``j`` workers slower than ``x``)."""
    ts = sorted(t for t in times if 0 < t < math.inf)
    if not ts:
        return 0.0
    n = len(ts)
    logs = [math.log(t) for t in ts]
    suffix = [0.0] * (n + 1)  # suffix[k] = sum of log tau over ts[k:]
    for k in range(n - 1, -1, -1):
        suffix[k] = suffix[k + 1] + logs[k]
    below = 0.0  # integral of P(max <= x) over [0, tau_max]
    lo = 0.0
    for k in range(n):
        hi = ts[k]
        j = n - k  # workers with tau > x on (lo, hi)
        if hi > lo:
            top = math.exp((j + 1) * logs[k] - suffix[k])
            bottom = math.exp((j + 1) * math.log(lo) - suffix[k]) if lo > 0 else 0.0
            below += (top - bottom) / (j + 1)
        lo = hi
    return ts[-1] - below


def tail_pipeline_time(micro_batches: int, stage_times: list[float], throughput: float, fill: float,
                       latency: float) -> float:
    """The pipeline with the bottleneck stage's step end resolved: its ``n`` used workers take
    tasks until the pool is empty, at ``T_e = (M - n / 2) / X`` (each has half a task in flight on
    average), and the step ends when the last of their in-flight tasks does,
    :func:`expected_max_residual` later; the other stages add their fill (``fill - latency``,
    ``latency`` being the bottleneck stage's share of it)."""
    used = sorted(t for t in stage_times if 0 < t < math.inf)[:micro_batches]
    if throughput <= 0 or not used:
        return math.inf
    return (micro_batches - len(used) / 2) / throughput + expected_max_residual(used) + fill - latency


# In a one-stage pipeline a slower idle worker leaves an open task to an idle one this much faster
# (task time), so a step's tasks go to its fastest workers as list_schedule_end assumes; workers of
# about one speed keep first-come order (their tasks stay spread over them: redundant checks and
# the drift test compare workers that share steps). The runtime's pool and the simulator use it.
FASTER_BY = 1.25


def list_schedule_end(micro_batches: int, periods: list[float], lands: list[float] | None = None) -> float:
    """When the last of ``micro_batches`` tasks lands if every worker takes the next task of the
    pool as soon as its previous one is done, all starting at 0 (a single-stage pipeline in local
    mode: every task's input is there when the step starts). Worker ``d`` leases every
    ``periods[d]`` (``tau_d``) and its output lands ``lands[d]`` (default ``tau_d``) after its
    lease; only the ``M`` fastest take tasks, as in :func:`tail_pipeline_time`.

    The ``M``-th lease is at ``S``, the smallest ``t`` with ``sum_d (floor(t / tau_d) + 1) >= M``;
    every worker's last lease is its last one at or before ``S`` (of the workers whose last lease
    falls exactly at ``S``, the fastest take the tasks left, the earliest-landing first), and the
    end is the latest ``lease + land``. With few tasks per worker this is a staircase in ``M``:
    on scale-1024 a replica of seven RTX 4090s and nine 3090s ends at 1.63 s
    with 120 micro-batches and at 1.94 s with 125, when some 3090 takes a sixth; the expected
    tail of :func:`tail_pipeline_time` (1.79 and 1.86 s) smooths that over, while the simulator,
    like a swarm whose task times hold still, follows the stairs."""
    lands = list(periods) if lands is None else list(lands)
    pairs = sorted((t, x) for t, x in zip(periods, lands, strict=True)
             if 0 < t < math.inf)[:max(0, micro_batches)]
    if not pairs:
        return math.inf if micro_batches > 0 else 0.0
    tau = np.array([t for t, _ in pairs])
    land = np.array([x for _, x in pairs])
    m = micro_batches

    def leases(t: float) -> np.ndarray:  # per worker, its leases at or before t
        return np.floor(t / tau * (1 + 1e-12)) + 1

    lo, hi = 0.0, (m - 1) * tau[0]  # the fastest alone leases M times by then
    if leases(lo).sum() >= m:
        hi = lo
    for _ in range(200):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if leases(mid).sum() >= m:
            hi = mid
        else:
            lo = mid
    k = leases(hi)
    last = (k - 1) * tau
    top = last.max()
    tied = np.flatnonzero(last >= top * (1 - 1e-9) - 1e-12)
    spare = int(k.sum()) - m  # leases at S beyond the M-th: those workers stop one lease earlier
    end = last + land
    if spare > 0 and len(tied) > spare:
        drop = tied[np.lexsort((-land[tied], -tau[tied]))[:spare]]  # the slowest of them step back
        end[drop] -= tau[drop]
    return float(end.max())


def list_schedule_curve(periods: list[float], lands: list[float] | None, most: int) -> list[float]:
    """:func:`list_schedule_end` for ``M = 1 .. most`` at once (one pass over the leases in time
    order; ties go to the faster worker, ``end[M - 1]`` is the end with ``M`` tasks)."""
    import heapq

    lands = list(periods) if lands is None else list(lands)
    pairs = sorted((t, x) for t, x in zip(periods, lands, strict=True) if 0 < t < math.inf)
    heap = [(0.0, t, x, 0) for t, x in pairs[:max(0, most)]]
    heapq.heapify(heap)
    out, end = [], 0.0
    while heap and len(out) < most:
        start, t, x, k = heapq.heappop(heap)
        end = max(end, start + x)
        out.append(end)
        heapq.heappush(heap, ((k + 1) * t, t, x, k + 1))  # k tau, not a running sum: ties stay exact
    return out


# Results a worker with overlapped uploads keeps on its uplink at once; a further result waits
# (and the worker with it). The runtime worker's ``uploads_in_flight`` default, and the simulator's.
UPLOADS_IN_FLIGHT = 2


def upload_backlog(tau: float, upload_s: float, in_flight: int = UPLOADS_IN_FLIGHT) -> float:
    """Seconds by which a worker's last output of the step lands later than ``tau`` after its
    lease, with overlapped uploads (``upload_s``: one output's serialisation on its uplink). An
    upload-bound worker keeps ``in_flight`` outputs on its uplink and leases its next task once
    one has left, so a new output queues behind the ``in_flight`` uploads in flight (on average
    ``in_flight - 1/2`` of them left to send) and lands ``(in_flight + 1/2) upload_s`` after the
    lease, not ``tau``; a compute-bound worker's uplink is idle more often, and the backlog fades
    to 0 once its output queues behind nothing: ``max(0, (in_flight + 1/2) upload_s - tau)``."""
    if not 0 < tau < math.inf or upload_s <= 0:
        return 0.0
    return max(0.0, (in_flight + 0.5) * upload_s - tau)


def pinned_pipeline_time(micro_batches: int, throughput: float, stage_times: list[float], round_trip: float,
                         fwd_share: float, before: float) -> float:
    """The step end set by a non-last stage whose backward tasks are pinned to the worker that ran
    the forward (local mode). A worker takes forwards whenever none of its own backward tasks is
    waiting, so its tasks come in convoys: the forwards it ran during one round trip
    ``RT`` (its output through the later stages and the gradient back) come back as a backlog of
    backward tasks that only it may run. When the stage's forward pool empties, at
    ``(M - n / 2) / X`` as in :func:`tail_pipeline_time`, each worker is somewhere in such a
    commitment: its task, the wait for the round trip and the backlog (``RT / c_f`` backward
    tasks of ``c_b``, ``tau_d + RT / fwd_share`` in all, but never more backward tasks than
    the ``M (1 / tau_d) / sum_j (1 / tau_j)`` forwards the worker runs in the whole step); the
    stage ends when the last commitment does (:func:`expected_max_residual`), and its last gradient still
    goes back through the earlier stages (``before``, their fill)."""
    used = sorted(t for t in stage_times if 0 < t < math.inf)[:micro_batches]
    if throughput <= 0 or not used or fwd_share <= 0:
        return math.inf
    # The backlog is at most the forwards the worker runs in the whole step, its 1 / tau_d share
    # of M: a short step (a deep replica's few micro-batches) has them all in one convoy.
    rate = sum(1.0 / t for t in used)
    ends = [t + round_trip + min(round_trip / (fwd_share * t), micro_batches / (t * rate)) * (1.0 - fwd_share) * t
            for t in used]
    return (micro_batches - len(used) / 2) / throughput + expected_max_residual(ends) + before


def idle_queue_wait(times: list[float], rate: float) -> float:
    """Seconds ``W`` each worker of a stage that is not the bottleneck waits for its next task.

    Tasks arrive at the pipeline's ``rate``, slower than the stage could take them; an idle
    worker's lease is parked until one arrives, and parked leases are served in turn, so every
    worker's cycle is ``tau_d + W`` with the same ``W``: ``sum_d 1 / (tau_d + W) = rate``
    (``W = 0`` when the stage is the bottleneck). Worker ``d`` then runs a ``1 / ((tau_d + W)
    rate)`` share of the micro-batches -- more even than ``1 / tau_d``: a slow worker is not kept
    waiting as long as a fast one is. Newton's method from ``W = 0`` (the sum is convex and
    decreasing in ``W``, so the iterates rise monotonically to the root)."""
    ts = [t for t in times if 0 < t < math.inf]
    if not ts or rate <= 0:
        return 0.0
    w = 0.0
    for _ in range(100):
        f = sum(1.0 / (t + w) for t in ts) - rate
        if f <= 1e-12 * rate:
            break
        w += f / sum(1.0 / (t + w) ** 2 for t in ts)
    return w


def capped_queue_wait(cycles: list[float], floors: list[float], rate: float) -> float:
    """:func:`idle_queue_wait` for workers whose uploads run behind their next task: worker
    ``d`` is back in the queue ``cycles[d]`` after its lease (compute and fetch), but takes no
    more than one task per ``floors[d]`` (its upload) over a step, so its cycle is
    ``max(cycles[d] + W, floors[d])``; ``W`` solves ``sum_d 1 / max(c_d + W, f_d) = rate``
    (bisection: the sum is continuous and non-increasing in ``W``; 0 where the stage is the
    bottleneck)."""
    pairs = [(c, f) for c, f in zip(cycles, floors, strict=True) if 0 < max(c, f) < math.inf]
    if not pairs or rate <= 0:
        return 0.0

    def taken(w: float) -> float:
        return sum(1.0 / max(c + w, f) for c, f in pairs)

    if taken(0.0) <= rate:
        return 0.0
    lo, hi = 0.0, len(pairs) / rate  # at W = n / rate every term is below rate / n
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if taken(mid) > rate:
            lo = mid
        else:
            hi = mid
    return hi


def step_time(pipeline: float, sync: float, overlap_sync: bool = False) -> float:
    """Seconds per optimizer step."""
    return max(pipeline, sync) if overlap_sync else pipeline + sync


# Local mode: a worker's inner AdamW keeps two fp32 moments per parameter on the device.
LOCAL_OPTIMIZER_BYTES_PER_PARAM = 8
# A lean local-mode worker (SyncPolicy.lean, --lean-workers): fp32 weights (4), the step's gradient
# summed in place by backward (4: no task gradient apart, none awaiting its upload's
# acknowledgement) and bf16 inner moments (4: shoal.train.optim.LeanAdamW).
LEAN_WORKER_BYTES_PER_PARAM = 12


def stage_worker_memory(prof: ModelProfile, first: int, last: int, sync: SyncPolicy | None = None) -> float:
    """Bytes a worker of stage ``[first, last)`` needs: the profile's (weights, gradients, saved
    activations) plus, in local mode, its inner optimizer's state, and with overlapped uploads
    the fp32 gradients of the :data:`UPLOADS_IN_FLIGHT` results on their way (a result's
    gradient joins the step's sum once the server has accepted it; a worker without room for
    them awaits each result that carries one: ``shoal.runtime.roles.worker.Worker._upload``).
    A lean local-mode worker (``sync.lean``) holds :data:`LEAN_WORKER_BYTES_PER_PARAM` and its
    saved activations, whatever its uploads."""
    if sync is not None and sync.local and sync.lean:
        return LEAN_WORKER_BYTES_PER_PARAM * prof.params(first, last) + prof.saved_act_bytes(first, last)
    need = prof.worker_memory(first, last)
    if sync is not None and sync.local:
        need += LOCAL_OPTIMIZER_BYTES_PER_PARAM * prof.params(first, last)
    if sync is not None and sync.overlap_uploads:
        need += UPLOADS_IN_FLIGHT * 4 * prof.params(first, last)
    return need


def task_period(compute_s: float, fetch_s: float, upload_s: float, overlap_uploads: bool = False,
                prefetch: bool = False) -> float:
    """Seconds per micro-batch of one worker from its compute, its fetches (lease round trips and
    input downloads) and its uploads (outputs' serialisation on its uplink). Without overlap they
    follow one another; ``overlap_uploads`` runs the uploads while the next task is fetched and
    computed; ``prefetch`` fetches the next task while this one computes (and uploads); with both
    the slowest of the three resources sets the pace."""
    if prefetch and overlap_uploads:
        return max(compute_s, fetch_s, upload_s)
    if prefetch:
        return max(compute_s + upload_s, fetch_s)
    if overlap_uploads:
        return max(compute_s + fetch_s, upload_s)
    return compute_s + fetch_s + upload_s


def local_round_time(max_latency: float, max_push_s: float, max_pull_s: float) -> float:
    """Seconds of one local-mode sync round of a stage: push request, the slowest pseudo-gradient
    push, the merge, then the slowest pull of the merged weights (``3 L + push + pull``)."""
    if max_push_s <= 0 and max_pull_s <= 0:
        return 0.0
    return 3 * max_latency + max_push_s + max_pull_s


def background_finish(start: float, work: float, fraction: float, window: float) -> float:
    """When ``work`` seconds of transfer (at a link's full rate) that start at ``start`` are done,
    if the link gives them a ``fraction`` of its rate until ``window`` (while the steps run and
    activations go first) and all of it after: ``start + work / fraction`` when that is within
    the window, else ``window`` plus the rest at full rate."""
    if start >= window:
        return start + work
    if start + work / fraction <= window:
        return start + work / fraction
    return window + work - (window - start) * fraction


def local_round_wait(links: list[tuple[float, float, float, float]], latency: float, sync_every: int,
                     pipeline_s: float, overlap: bool = True, merge_s: float = 0.0,
                     ref_s: float = 0.0) -> tuple[float, float]:
    """``(round seconds at full rate, seconds the steps wait for it per round)`` of one stage.

    ``links`` holds, per worker, ``(push_s, pull_s, up_busy_s, down_busy_s)``: its push and pull
    at its links' full rate, and the seconds per step its uplink and downlink carry activations.
    Sync traffic only uses idle link time (activations go first), so with overlap worker ``d``
    pushes at a fraction ``f_up = 1 - up_busy / P`` of its rate while the ``H`` steps of the next
    round run (a window of ``H P``), and at full rate once they are done and wait. The phases
    follow one another: the push request reaches the workers after ``L``, the merge waits for
    the last push to land, the pulls start at once (:func:`background_finish` for each worker):
    ``t_1 = L + max_d finish(L, push_d, f_up,d)``, ``E = L + max_d finish(t_1, pull_d,
    f_down,d)``, ``wait = max(0, E - H P)`` (``E = R`` when nothing else uses the links).
    Without overlap the steps wait for all of ``R = 3 L + max push + max pull``. ``merge_s``
    (:func:`merge_cpu_time`) sits between the last push and the first pull.

    ``ref_s`` (:func:`reference_cpu_time`): the screen's reference gradient, started at the
    first step the server commits after its previous merge, must be done before the merge.
    With overlap the merges then come at most every ``P + ref_s + merge_s``, so the steps wait
    at least ``P + ref_s + merge_s - H P`` a round; without overlap it has the round's other
    steps and its pushes (``2 L + max push`` after them) to run in."""
    window = max(1, sync_every) * pipeline_s
    ref_late = ref_s + pipeline_s + merge_s - window if ref_s > 0 and math.isfinite(pipeline_s) else -math.inf
    if not links:
        if overlap and 0 < pipeline_s < math.inf:
            return merge_s, max(0.0, merge_s - window, ref_late)
        return merge_s, merge_s + max(0.0, ref_late - merge_s)
    full = local_round_time(latency, max(x[0] for x in links), max(x[1] for x in links)) + merge_s
    if not overlap:
        pushed = 2 * latency + max(x[0] for x in links)
        return full, full + max(0.0, ref_late - merge_s - pushed)
    if pipeline_s <= 0 or not math.isfinite(pipeline_s):
        return full, full
    floor = 1e-3  # fill and drain leave every link some idle time

    def idle(busy: float) -> float:
        return max(floor, 1.0 - busy / pipeline_s)

    pushed = latency + max(background_finish(latency, x[0], idle(x[2]), window) for x in links) + merge_s
    end = latency + max(background_finish(pushed, x[1], idle(x[3]), window) for x in links)
    return full, max(0.0, end - window, ref_late)


def local_sync_per_step(round_s: float, sync_every: int, pipeline_s: float, overlap: bool = True) -> float:
    """Amortised sync seconds per step in local mode: a round of ``round_s`` every ``H`` steps.
    Without overlap the pipeline waits for it: ``R / H``. With overlap (delayed application) round
    ``r`` runs during the ``H`` steps of round ``r + 1`` and only the part that does not fit in
    them is waited for: ``max(0, R - H P) / H``."""
    h = max(1, sync_every)
    if round_s <= 0:
        return 0.0
    if not overlap:
        return round_s / h
    return max(0.0, round_s - h * pipeline_s) / h


# --------------------------------------------------------------------------- framework CPU


def merge_cpu_time(params: float, pushes: int, sync: SyncPolicy, cpu: FrameworkCpu, parallel: float = 1.0) -> float:
    """Seconds of one core a local-mode stage server's merge holds its round for, between the
    round's last push landing and the first pull (pure): that push's decode, the screen's
    measures and weighted-sum term of each of the round's ``pushes``
    (``FrameworkCpu.server_merge_param_s`` a parameter, ``server_screen_sample_s`` a coordinate
    of the screen's median, at most :data:`~shoal.plan.types.SCREEN_SAMPLE`) and the merged
    update the workers pull, encoded and decoded again (the server applies or keeps what the
    workers will decode; :data:`shoal.plan.compression.CODEC_CPU_S`, times ``server_codec_scale``;
    an uncompressed pull is only encoded).
    The round's other pushes are decoded on other cores as they land (the runtime decodes each
    in a thread); the norms, the weighted sum and a ``lowrank`` frame's matrices
    (:func:`~shoal.plan.compression.codec_threaded`) run on ``parallel`` cores
    (:func:`merge_cores`), ``cpu.server_merge_speedup`` (the codec: ``server_codec_speedup``)
    times faster on two or more than on one (memory-bound: more threads are not counted), the
    median's sample and other codecs on one.
    Times ``sync.grad_compression``, as the round's bytes are (a simulated round
    compressed to fewer steps carries that share of both). 0 outside local mode."""
    if not sync.local or pushes <= 0 or params <= 0:
        return 0.0
    share = min(1.0, max(0.0, parallel - 1.0))  # of the second core
    speedup = 1.0 + (cpu.server_merge_speedup - 1.0) * share
    threaded = 1.0 + (cpu.server_codec_speedup - 1.0) * share
    pull_enc, pull_dec = codec_cpu_s(sync.pull_codec)
    if not pull_compressed(sync.pull_codec):
        pull_dec = 0.0
    push = codec_cpu_s(sync.push_codec)[1] / (threaded if codec_threaded(sync.push_codec) else 1.0)
    pull = (pull_enc + pull_dec) / (threaded if codec_threaded(sync.pull_codec) else 1.0)
    codec = cpu.server_codec_scale * (push + pull)
    per_push = (params * cpu.server_merge_param_s / speedup
                + min(params, SCREEN_SAMPLE) * cpu.server_screen_sample_s)
    return (params * codec + pushes * per_push) * sync.grad_compression


def reference_tokens(tokens_per_micro_batch: int) -> int:
    """Tokens a local-mode screen's reference gradient is computed on: at most
    :data:`~shoal.plan.types.SCREEN_REF_MBS` micro-batches and at most
    :data:`~shoal.plan.types.SCREEN_REF_TOKENS` tokens (the runtime takes a causal prefix of each
    sequence beyond that: ``shoal.runtime.safety.verify.reference_inputs``)."""
    return min(SCREEN_REF_MBS * tokens_per_micro_batch, SCREEN_REF_TOKENS)


def reference_cpu_time(flops_per_token: float, tokens_per_micro_batch: int, sync: SyncPolicy,
                       cpu: FrameworkCpu, parallel: float = 1.0) -> float:
    """Seconds the screen's reference gradient takes each local-mode round (pure): forward and
    backward of :func:`reference_tokens` tokens through the stage (``flops_per_token``: its
    forward plus backward FLOPs a token) at ``cpu.server_flops`` a core, on ``parallel`` cores
    (its micro-batches run in threads of their own: :func:`reference_cores`).
    It runs in the background from the round's first step on (the merged weights are fixed
    until the merge; it needs that step's inputs), so a round waits only for what does not fit in its steps
    (:func:`local_round_wait`). Times ``sync.grad_compression``, as the merge's CPU is (a
    simulated round compressed to fewer steps carries that share). 0 outside local mode."""
    if not sync.local or flops_per_token <= 0:
        return 0.0
    work = reference_tokens(tokens_per_micro_batch) * flops_per_token / cpu.server_flops
    return work / max(1.0, parallel) * sync.grad_compression


def _server_core_shares(plan: Plan, scenario: Scenario) -> list[list[float]]:
    """Per replica, per stage: its server host's cores over the stage servers on that host."""
    count: dict[str, int] = {}
    for r in plan.pipelines:
        for st in r.stages:
            count[st.server] = count.get(st.server, 0) + 1
    cores = {d.id: d.cores for d in scenario.devices if d.id in count}
    return [[max(1.0, cores[st.server] / count[st.server]) for st in r.stages] for r in plan.pipelines]


def reference_cores(plan: Plan, scenario: Scenario) -> list[list[float]]:
    """Per replica, per stage: the cores its screen's reference gradient runs on (pure): one
    thread per micro-batch it takes (at most :data:`~shoal.plan.types.SCREEN_REF_MBS`, at most
    the replica's micro-batches), on its server host's cores shared by every stage server there."""
    return [[min(float(min(SCREEN_REF_MBS, max(1, r.micro_batches))), c) for c in row]
            for r, row in zip(plan.pipelines, _server_core_shares(plan, scenario), strict=True)]


def merge_cores(plan: Plan, scenario: Scenario) -> list[list[float]]:
    """Per replica, per stage: the cores its merge's weighted sum and norms run on (pure): at most
    :data:`~shoal.plan.types.MERGE_THREADS` (the runtime's ``merge_pool``), on its server host's
    cores shared by every stage server there."""
    return [[min(float(MERGE_THREADS), c) for c in row] for row in _server_core_shares(plan, scenario)]


def tasks_per_micro_batch(last: bool) -> int:
    """Tasks one micro-batch makes on a stage: forward and backward, or one on the last stage
    (which runs both at once). Each task's result is handled once by a stage server (the one it
    goes to), and the per-server counts come out the same: ``n_s`` per micro-batch at stage
    ``s``'s server."""
    return 1 if last else 2


def ordered_push_count(micro_batches: float, workers: int) -> float:
    """Whole-stage gradient pushes one worker sends a step in exact sync with ordered pushes
    (``SyncPolicy.ordered``, ``shoal launch``'s default for bitwise parity; pure). The server
    sums a step's gradients in micro-batch order and a worker can pre-sum only a run of them from
    micro-batch 0 (``shoal.runtime.sync.ordered``): a stage's only worker holds the whole run and
    pushes once; a worker of a shared stage takes its ``micro_batches`` interleaved with the
    others' and pushes each alone (a run from 0 longer than one is rare and not counted)."""
    if workers <= 1:
        return 1.0
    return max(1.0, micro_batches)


def ordered_pushes(mbs) -> int:
    """Pushes a worker holding the micro-batches ``mbs`` of a step sends with ordered pushes: the
    run from micro-batch 0 pre-summed as one, every other alone (pure; the count of
    ``shoal.runtime.sync.ordered.ordered_groups``, which the simulator charges)."""
    held = set(mbs)
    run = 0
    while run in held:
        run += 1
    return (1 if run else 0) + len(held) - run


def exact_server_cpu(params: float, workers: int, cpu: FrameworkCpu, cores: float) -> float:
    """Seconds an exact-sync step's pushes and pulls hold a stage server for (pure): one push and
    one pull of the stage's ``params`` for each of its ``workers`` (``cpu.server_push_param_s``
    and ``server_pull_param_s`` a parameter; decoded and sent in threads, each on one core, so
    ``ceil(workers / cores)`` of them in turn), then the step itself on one core between the last
    push and the pulls (``cpu.server_step_param_s``: the clipping norms, AdamW, the new version
    serialised). A worker's further ordered pushes: :func:`ordered_sync_time`."""
    if params <= 0 or workers <= 0:
        return 0.0
    per_worker = (cpu.server_push_param_s + cpu.server_pull_param_s) * params
    # A burst: each worker's push and pull on one core, the host's cores taking them in turns.
    return math.ceil(workers / max(1.0, cores)) * per_worker + cpu.server_step_param_s * params


def ordered_sync_time(times: list[float], rates: list[float], pipe_rate: float, micro_batches: int,
                      max_latency: float, max_pull_s: float, cpu_s: float, push_bytes: float,
                      push_cpu_s: float = 0.0) -> float:
    """Per-step sync seconds of a shared stage in exact sync with ordered pushes (pure): each
    worker pushes once per micro-batch it ran (:func:`ordered_push_count`), one after another at
    its push rate (``rates``), then the slowest pull, as :func:`stage_sync_time` (plus the server's
    CPU ``cpu_s``). Worker ``d``'s share of the ``M`` micro-batches: ``M / ((tau_d + W) X)`` at
    the pipeline's rate ``X`` (:func:`idle_queue_wait`: a stage that waits for its tasks gives
    them out more evenly than by speed, so a slow uplink holds more of them than ``1 / tau_d``);
    ``pipe_rate`` 0 (a stage whose tasks are all there at the start): by speed, ``1 / tau_d``.
    ``push_cpu_s``: the server's CPU for each push beyond a worker's first (``cpu_s`` holds one a
    worker: :func:`exact_server_cpu`)."""
    ts = [t for t in times if 0 < t < math.inf]
    if not ts:
        return stage_sync_time(max_latency, push_bytes / max(rates, default=math.inf), max_pull_s) + cpu_s
    total = sum(1.0 / t for t in ts)
    rate = pipe_rate if 0 < pipe_rate < total else total
    wait = idle_queue_wait(ts, rate)
    push = extra = 0.0
    for t, r in zip(times, rates, strict=True):
        if 0 < t < math.inf and r < math.inf:
            count = ordered_push_count(micro_batches / ((t + wait) * rate), len(times))
            push = max(push, count * push_bytes / r)
            extra += count - 1.0
    return stage_sync_time(max_latency, push, max_pull_s) + cpu_s + extra * push_cpu_s


def worker_task_compute(fwd_s: float, bwd_s: float, last: bool, cpu_s: float) -> float:
    """Seconds a worker's tasks of one micro-batch take when each task also costs ``cpu_s`` of
    the worker's framework CPU: compute runs off its event loop, so a task takes the longer of
    its compute and its CPU (``max(f, cpu) + max(b, cpu)``; one task on the last stage). The
    plain sum when the CPU binds nowhere (so figures without it stay bit for bit)."""
    if last:
        return max(fwd_s + bwd_s, cpu_s)
    if fwd_s >= cpu_s and bwd_s >= cpu_s:
        return fwd_s + bwd_s
    return max(fwd_s, cpu_s) + max(bwd_s, cpu_s)


def stage_result_bytes(prof: ModelProfile, sync: SyncPolicy, first: bool, last: bool) -> float:
    """Bytes the results of one micro-batch's tasks on a stage carry to stage servers, as sent
    (pure): its forward output unless it is the last stage (``act`` codec) and the gradient of
    its input unless it is the first (``grad`` codec)."""
    hidden = prof.layers[0].out_act_bytes
    out = 0.0 if last else hidden * sync.ratio("act", prof.dtype_bytes, *prof.act_shape)
    back = 0.0 if first else hidden * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)
    return out + back


def act_elements(prof: ModelProfile) -> float:
    """Elements of one micro-batch's activation between stages (pure)."""
    return prof.layers[0].out_act_bytes / prof.dtype_bytes


def stage_codec_cpu(prof: ModelProfile, sync: SyncPolicy, first: bool, last: bool,
                    cpu: FrameworkCpu) -> tuple[float, float]:
    """Seconds of a worker's CPU the activation codecs add to one micro-batch's (forward,
    backward) task on a stage (pure; ``compression.ACT_CODEC_CPU_S`` times
    ``cpu.act_codec_scale``), in series with its compute as the runtime runs them: a forward
    task decodes its input (``act`` codec; stage 0's are token ids) and encodes its output; a
    backward one decodes its output's gradient (``grad`` codec) and encodes its input's (none on
    stage 0). The last stage's one task decodes its input and encodes its input's gradient
    (backward: 0). A one-stage pipeline sends no activation: (0, 0)."""
    n = act_elements(prof) * cpu.act_codec_scale
    if n <= 0:
        return 0.0, 0.0
    act_enc, act_dec = act_codec_cpu_s(sync.act_codec)
    grad_enc, grad_dec = act_codec_cpu_s(sync.grad_codec)
    if last:
        return (0.0 if first else n * (act_dec + grad_enc)), 0.0
    return n * ((0.0 if first else act_dec) + act_enc), n * (grad_dec + (0.0 if first else grad_enc))


def _decoded_by_servers(codec: str) -> bool:
    """Whether a stage server decodes an activation frame of ``codec`` to check it (pure): every
    codec but raw, whose check reads the received bytes as they are (``server_task_byte_s``)."""
    return codec.split(":")[0] not in ("none", "raw")


def stage_result_decode(prof: ModelProfile, sync: SyncPolicy, first: bool, last: bool,
                        cpu: FrameworkCpu) -> float:
    """Stage-server CPU seconds the decoding of one micro-batch's results on a stage takes (pure):
    a lossy activation or gradient is decoded once, to be checked by the server it is sent to,
    at the codec's decode rate (``compression.ACT_CODEC_CPU_S`` times ``cpu.act_codec_scale``);
    the server it is relayed to keeps it undecoded (``sync.codecs.received_activation``,
    ``checked``) unless a check recomputes with it (the checks' own CPU is priced apart)."""
    n = act_elements(prof) * cpu.act_codec_scale
    out = 0.0 if last or not _decoded_by_servers(sync.act_codec) else n * act_codec_cpu_s(sync.act_codec)[1]
    back = 0.0 if first or not _decoded_by_servers(sync.grad_codec) else n * act_codec_cpu_s(sync.grad_codec)[1]
    return out + back


def result_handling(result_bytes: float, cpu: FrameworkCpu, decode_s: float = 0.0) -> float:
    """Server CPU seconds one task's result costs (pure): ``c + b B`` for a result of ``B``
    bytes, plus ``decode_s`` where its servers decode it (:func:`stage_result_decode`; what the
    simulator charges each result; :func:`micro_batch_handling` sums a stage's)."""
    return cpu.server_task_s + result_bytes * cpu.server_task_byte_s + decode_s


def micro_batch_handling(last: bool, result_bytes: float, cpu: FrameworkCpu, decode_s: float = 0.0) -> float:
    """Server CPU seconds one micro-batch's tasks on a stage cost (pure): ``n_s c + b B`` with
    ``n_s`` its tasks (:func:`tasks_per_micro_batch`), ``c`` = ``cpu.server_task_s``, ``B`` the
    bytes their results carry (:func:`stage_result_bytes`) and ``b`` = ``cpu.server_task_byte_s``
    (each such byte is received, checked and relayed by one server and received and granted by
    the next; both figures from ``bench_runtime_cpu.py`` at two activation sizes, of which gRPC
    with TLS is a third: ``bench/results/server-cpu.md``). All of it is charged to the stage's
    own server, as both terms are measured (both servers' CPU over the tasks); so is
    ``decode_s``, the decoding of its lossy results (:func:`stage_result_decode`)."""
    return tasks_per_micro_batch(last) * cpu.server_task_s + result_bytes * cpu.server_task_byte_s + decode_s


def server_task_demand(plan: Plan, scenario: Scenario) -> dict[str, float]:
    """Host id -> framework CPU seconds per step of the tasks through its stage servers:
    ``sum over its stages of M_r h_s`` (every replica's stages, each with its replica's
    micro-batches ``M_r``; ``h_s`` = :func:`micro_batch_handling`)."""
    cpu = scenario.cpu
    prof = (scenario_profile(scenario, plan.micro_batch_size)
            if cpu.server_task_byte_s > 0 or cpu.act_codec_scale > 0 else None)
    per: dict[tuple[bool, bool], float] = {}  # (first, last) -> h_s: the policy is the plan's, so four at most
    out: dict[str, float] = {}
    for r in plan.pipelines:
        n = len(r.stages)
        for i, st in enumerate(r.stages):
            key = (i == 0, i == n - 1)
            if key not in per:
                nbytes = stage_result_bytes(prof, plan.sync, *key) if prof is not None else 0.0
                dec = stage_result_decode(prof, plan.sync, *key, cpu) if prof is not None else 0.0
                per[key] = micro_batch_handling(key[1], nbytes, cpu, dec)
            out[st.server] = out.get(st.server, 0.0) + r.micro_batches * per[key]
    return out


def server_cpu_caps(plan: Plan, scenario: Scenario) -> list[list[float]]:
    """Per replica, per stage: the most micro-batches per second its server host's CPU lets
    through. The replicas run in lockstep, so replica ``r`` completes ``M_r / T`` micro-batches a
    step of ``T`` seconds and host ``h`` needs ``D_h / T`` cores (:func:`server_task_demand`);
    with ``cores_h`` of them, ``T >= D_h / cores_h``, i.e. stage ``s`` of replica ``r`` on ``h``
    runs at most ``M_r cores_h / D_h`` micro-batches per second (``inf`` without CPU cost)."""
    demand = server_task_demand(plan, scenario)
    cores = {d.id: d.cores for d in scenario.devices if d.id in demand}
    return [[r.micro_batches * cores[st.server] / demand[st.server] if demand[st.server] > 0 else math.inf
             for st in r.stages] for r in plan.pipelines]


def server_cpu_per_step(plan: Plan, scenario: Scenario) -> dict[str, float]:
    """Host id -> seconds per step its stage servers' framework CPU keeps all its cores busy:
    the tasks through it (:func:`server_task_demand`) plus, in exact sync, every remote worker's
    push and pull calls (``cpu.server_sync_s`` each) and every worker's push and pull and the
    update by the parameter (:func:`exact_server_cpu` on one core: ``server_push_param_s``,
    ``server_pull_param_s``, ``server_step_param_s``), per ``sync_every`` steps, over its cores.
    A step shorter than this saturates the host."""
    cpu = scenario.cpu
    out = server_task_demand(plan, scenario)
    if not plan.sync.local:
        prof = scenario_profile(scenario, plan.micro_batch_size)
        for st in plan.all_stages:
            remote = sum(1 for w in st.workers if w != st.server)
            busy = remote * cpu.server_sync_s + exact_server_cpu(prof.params(*st.layers), len(st.workers), cpu, 1.0)
            out[st.server] = out.get(st.server, 0.0) + busy / max(1, plan.sync.sync_every)
    cores = {d.id: d.cores for d in scenario.devices if d.id in out}
    return {h: v / cores[h] for h, v in out.items()}


def coordinator_members(plan: Plan) -> int:
    """Members the coordinator keeps alive for a plan: its workers, its server hosts and their
    standbys."""
    out = set(plan.workers)
    for st in plan.all_stages:
        out.add(st.server)
        out.update(st.standbys)
    return len(out)


def coordinator_floor(members: int, reports: int, cpu: FrameworkCpu) -> float:
    """The shortest step the coordinator's CPU allows: each second it spends ``members *
    coordinator_member_s`` on liveness, and each step ``reports * coordinator_report_s`` on the
    stage servers' step reports, on ``coordinator_cores``: ``T >= reports c_r / (cores - members
    c_m)``; ``inf`` once liveness alone needs every core (members would be declared dead)."""
    spare = cpu.coordinator_cores - members * cpu.coordinator_member_s
    if spare <= 0:
        return math.inf
    return reports * cpu.coordinator_report_s / spare


def coordinator_cores(members: int, reports: int, step_s: float, cpu: FrameworkCpu) -> float:
    """Cores the coordinator uses at a step of ``step_s`` seconds (liveness plus reports)."""
    per_step = reports * cpu.coordinator_report_s / step_s if 0 < step_s < math.inf else 0.0
    return members * cpu.coordinator_member_s + per_step


def coordinator_member_limit(reports: int, step_s: float, cpu: FrameworkCpu) -> int:
    """The most members the coordinator can keep alive beside ``reports`` step reports every
    ``step_s`` seconds: the largest ``n`` with :func:`coordinator_floor` ``<= step_s``."""
    if cpu.coordinator_member_s <= 0:
        return 1 << 62
    per_step = reports * cpu.coordinator_report_s / step_s if 0 < step_s < math.inf else 0.0
    return max(0, math.floor((cpu.coordinator_cores - per_step) / cpu.coordinator_member_s * (1 - 1e-9)))


def cpu_figures(plan: Plan, scenario: Scenario, step_s: float) -> dict[str, float]:
    """The framework-CPU keys of :func:`predict` at a step of ``step_s``: ``server_cpu_share``
    (the busiest server host's share of its cores, :func:`server_cpu_per_step` over the step; 1
    means saturated), ``coordinator_members`` and ``coordinator_cores`` (cores the coordinator
    uses, :func:`coordinator_cores`)."""
    per = server_cpu_per_step(plan, scenario)
    busiest = max(per.values(), default=0.0)
    members = coordinator_members(plan)
    ok = 0 < step_s < math.inf
    return {"server_cpu_share": busiest / step_s if ok else 0.0,
            "coordinator_members": float(members),
            "coordinator_cores": coordinator_cores(members, len(plan.all_stages), step_s, scenario.cpu)}


# --------------------------------------------------------------------------- the plan's cost


@dataclass
class StageCost:
    """Cost-model figures of one stage."""

    throughput: float  # micro-batches per second of the task pool (X_s)
    latency: float  # fastest worker's per-micro-batch time plus its uploads' latency (fill/drain share)
    compute_fraction: float  # throughput-weighted share of compute in tau
    sync: float  # per-step sync seconds of the stage (slowest push + slowest pull + 3 latencies; local mode: per round)
    task_times: dict[str, float]  # worker id -> tau_d
    memory_headroom: float  # min over workers of (memory - need) / memory
    pull: float = 0.0  # seconds for the slowest worker to pull the stage's weights (a replacement's start-up)
    compute_per_step: float = 0.0  # seconds its workers compute per step, summed over workers (M tasks' worth)
    round_links: tuple = ()  # local mode, per worker: (push s, pull s, uplink busy s/step, downlink busy s/step)
    round_latency: float = 0.0  # local mode: the largest one-way latency worker <-> server
    slowest: float = 0.0  # the slowest used worker's per-micro-batch time plus its uploads' latency
    fwd_share: float = 1.0  # forward FLOPs / (forward + backward FLOPs) of one micro-batch on this stage
    cpu_cap: float = math.inf  # micro-batches/s its server host's framework CPU lets through (server_cpu_caps)
    uncapped: float = 0.0  # its task pool's throughput before that cap (X_s of the workers alone)
    task_handling: float = 0.0  # seconds a server's CPU takes to handle one of its tasks' results, on average (on its micro-batch's path)
    upload_backlog: dict = field(default_factory=dict)  # worker id -> s its last output waits behind earlier uploads
    merge: float = 0.0  # local mode: seconds its server's merge CPU holds a round (merge_cpu_time)
    reference: float = 0.0  # local mode: seconds of a server core the screen's reference gradient takes a round (reference_cpu_time)


def _share_counts(plan: Plan, scenario: Scenario) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per host: workers downloading from it, uploading to it, and syncing with it (loopback excluded)."""
    downloaders: dict[str, set] = {}
    uploaders: dict[str, set] = {}
    syncers: dict[str, int] = {}
    n = len(plan.stages)
    for i, st in enumerate(plan.stages):
        h = st.server
        for w in st.workers:
            if w != h:
                downloaders.setdefault(h, set()).add(w)
                uploaders.setdefault(h, set()).add(w)
                syncers[h] = syncers.get(h, 0) + 1
            if i + 1 < n and w != plan.stages[i + 1].server:
                uploaders.setdefault(plan.stages[i + 1].server, set()).add(w)
            if i > 0 and w != plan.stages[i - 1].server:
                uploaders.setdefault(plan.stages[i - 1].server, set()).add(w)
    return ({h: len(v) for h, v in downloaders.items()}, {h: len(v) for h, v in uploaders.items()}, syncers)


SHARE_ITERATIONS = 4
DAMP = 0.5

_SYNC_FIELDS = tuple(f.name for f in fields(SyncPolicy))


def _policy_key(sync: SyncPolicy) -> tuple:
    """Every field of ``sync``, as a hashable memo key (SyncPolicy itself is mutable)."""
    return tuple(getattr(sync, f) for f in _SYNC_FIELDS)


def _stage_rows(st, first: bool, last: bool, nxt_id: str | None, prv_id: str | None, n_sync: dict[str, int],
                prof: ModelProfile, scenario: Scenario, dev: dict[str, Device], sync: SyncPolicy,
                options: CostOptions, memo: dict) -> tuple:
    """The pass-independent figures of one stage (see :func:`stage_costs`): per worker
    ``(wid, fixed, dl_bytes, dl_bw, ul_bytes_n, ul_bw_n, ul_bytes_p, ul_bw_p, compute, out_lat)``
    (fixed = compute + lease round trips; bandwidths before the server link's share), then the
    stage's largest latency, its sync seconds, its slowest pull, its memory headroom and, in
    local mode, each remote worker's ``(push s, pull s)`` of one round, and with ordered exact-sync
    pushes (``SyncPolicy.ordered``, a shared stage) ``(max latency, slowest pull, server CPU s,
    push bytes, each worker's push rate)`` for :func:`stage_costs` to price once it knows each
    worker's share of the step (else None). A function of the stage, its neighbours' servers and
    the workers syncing with its server, so callers may memoise it."""
    net = scenario.network
    tokens = prof.tokens_per_micro_batch * 8  # int64 ids (inputs of stage 0, targets of the last)
    exact = bool(net.overrides)
    paths = memo.setdefault("paths", {})

    def path(d: Device, host: Device):
        # Without per-pair overrides a path depends only on the worker's region.
        if exact:
            return net.link(d, host)
        key = (d.region, host.id)
        link = paths.get(key)
        if link is None:
            link = paths[key] = net.link(d, host)
        return link

    a, b = st.layers
    fwd, bwd = prof.fwd_flops(a, b), prof.bwd_flops(a, b)
    if options.recompute and not last:
        bwd += fwd
    hidden = prof.layers[0].out_act_bytes * sync.ratio("act", prof.dtype_bytes, *prof.act_shape)
    hidden_grad = prof.layers[0].out_act_bytes * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)
    in_bytes = tokens if first else hidden
    if last:
        in_bytes += tokens
    dl_bytes = in_bytes + (0.0 if last else hidden_grad)  # input, and the output gradient
    out_bytes = 0.0 if last else hidden
    in_grad_bytes = 0.0 if first else hidden_grad
    pbytes = prof.param_bytes(a, b)
    need = stage_worker_memory(prof, a, b, sync)
    host = dev[st.server]
    nxt = dev[nxt_id] if nxt_id is not None else None
    prv = dev[prv_id] if prv_id is not None else None
    max_lat = max_push = max_pull = 0.0
    headroom = math.inf
    k_sync = max(1, n_sync.get(host.id, 1))
    h_up_sync, h_down_sync = host.up / k_sync, host.down / k_sync
    flops = fwd + bwd
    g_push = pbytes * sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
    g_pull = pbytes * sync.ratio("pull", prof.dtype_bytes, *prof.act_shape)
    n_tasks = 1 if last else 2
    spread = sync.local
    background: dict[str, tuple[float, float]] = {}
    bg_rows = []  # per row: (push bytes, its own push rate, pull bytes, its own pull rate); zeros on loopback
    stage_rows = []
    wcpu = scenario.cpu.worker_task_s
    codec_f, codec_b = stage_codec_cpu(prof, sync, first, last, scenario.cpu)  # in series with the compute
    # exact sync, ordered pushes: a worker of a shared stage pushes once per micro-batch it takes
    ordered = sync.ordered and not sync.local and len(st.workers) > 1
    ordered_rates = []  # per row: its push rate (the server host's own worker: loopback)
    ordered_info = None
    for wid in st.workers:
        d = dev[wid]
        c = compute_time(flops, d.flops)
        if d.flops > 0:
            c += codec_f + codec_b
        if wcpu > 0 and d.flops > 0:
            # each task also costs the worker's framework CPU, beside its compute (off the event loop)
            f_s, b_s = fwd / d.flops + codec_f, bwd / d.flops + codec_b
            if (c < wcpu) if last else (min(f_s, b_s) < wcpu):
                c = worker_task_compute(f_s, b_s, last, wcpu)
        fixed, dlb, dlbw = c, 0.0, math.inf
        push_rate = math.inf
        bg_row = (0.0, math.inf, 0.0, math.inf)
        ulb_n = ulb_p = 0.0
        ulbw_n = ulbw_p = math.inf
        out_lat = 0.0
        if wid != host.id:
            link = path(d, host)
            fixed += n_tasks * 2 * link.latency
            dlb, dlbw = dl_bytes, min(link.bandwidth, d.down)
            if g_push > 0 or g_pull > 0:
                max_lat = max(max_lat, link.latency)
                push_rate = min(link.bandwidth, d.up, h_down_sync)
                push_s = g_push / push_rate
                pull_s = g_pull / min(link.bandwidth, h_up_sync, d.down)
                max_push = max(max_push, push_s)
                max_pull = max(max_pull, pull_s)
                if spread:
                    background[wid] = (push_s, pull_s)
                    bg_row = (g_push, min(link.bandwidth, d.up), g_pull, min(link.bandwidth, d.down))
        if nxt is not None and wid != nxt.id:
            link = path(d, nxt)
            ulb_n, ulbw_n = out_bytes, min(link.bandwidth, d.up)
            out_lat += link.latency
        if prv is not None and wid != prv.id:
            link = path(d, prv)
            ulb_p, ulbw_p = in_grad_bytes, min(link.bandwidth, d.up)
            out_lat += link.latency
        stage_rows.append((wid, fixed, dlb, dlbw, ulb_n, ulbw_n, ulb_p, ulbw_p, c, out_lat))
        bg_rows.append(bg_row)
        headroom = min(headroom, (d.memory - need) / d.memory if d.memory > 0 else -math.inf)
        if ordered:
            ordered_rates.append(push_rate)
    if sync.local:
        sync_s = local_round_time(max_lat, max_push, max_pull)
    else:
        sync_s = stage_sync_time(max_lat, max_push, max_pull, sync.sync_every)
        remote = sum(1 for wid in st.workers if wid != host.id)
        cpu_s = push_cpu = 0.0
        if sync_s > 0 and remote:
            # the server handles the pushes and pulls of a simultaneous burst on its cores
            cpu_s = remote * scenario.cpu.server_sync_s / host.cores / max(1, sync.sync_every)
        if st.workers:
            cpu_s += exact_server_cpu(prof.params(a, b), len(st.workers), scenario.cpu, host.cores) / max(1, sync.sync_every)
            push_cpu = scenario.cpu.server_push_param_s * prof.params(a, b) / host.cores / max(1, sync.sync_every)
        sync_s += cpu_s
        if ordered and g_push > 0:
            ordered_info = (max_lat, max_pull, cpu_s, g_push, ordered_rates, push_cpu)
    return stage_rows, max_lat, sync_s, max_lat + max_pull, headroom, background, bg_rows, ordered_info


def round_sync_flows(nbytes, own_bw, share_bw, window: float):
    """Expected sync transfers in flight per worker over the ``window`` of an overlapped round.

    A round's push (or pull) runs beside the worker's activations, not only in their gaps: the
    runtime sends it at once, and the simulator's chunks, sent when the worker's link is idle,
    keep their share of the server link while activations start beside them. At
    ``min(own_bw, share_bw)`` it lasts ``t = nbytes / rate``, so it is in flight for
    ``min(t, window) / window`` of the window and takes a share of the server link as an
    activation does. On scale-4096 this gives 680-710 transfers at once per stage-server
    downlink where the simulator shows 550-830 (450 counting activations alone). Returns
    ``(in-flight fraction, t)``, elementwise on numpy arrays; 0 where nothing is sent.
    """
    nbytes = np.asarray(nbytes, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(nbytes > 0, nbytes / np.minimum(own_bw, share_bw), 0.0)
    if window <= 0:
        return np.zeros_like(nbytes), t
    return np.minimum(t, window) / window, t


class RoundTraffic:
    """Overlapped local rounds in the link-sharing fixed point: per stage, its workers' round
    bytes and own rates (columns push bytes, push rate, pull bytes, pull rate, in row order),
    its server's downlink capacity, and ``H``. :meth:`add` adds the round's expected transfers
    in flight to the server links' loads: pushes over the window ``H P``, then pulls once the
    slowest push has landed (the merge waits for it), in what is left of the window."""

    def __init__(self, cols: list[np.ndarray], host_down: list[float], sync_every: int):
        self.cols, self.host_down, self.h = cols, host_down, max(1, sync_every)

    def add(self, i: int, idx, r, up_busy_s, pipeline_s: float, host: str, host_up: float,
            k_up: dict, k_down: dict, load_up: dict, load_down: dict) -> None:
        """Stage ``i``'s used workers ``idx`` (row indices), each completing ``r`` micro-batches
        per second, with ``up_busy_s`` seconds of activations per micro-batch on their uplink;
        the pipeline takes ``pipeline_s`` per step, so the round's window is ``H * pipeline_s``."""
        gp, bw_up, gl, bw_dn = (c[idx] for c in self.cols[i])
        if not len(gp):
            return
        window = self.h * pipeline_s
        push, t_push = round_sync_flows(gp, bw_up, self.host_down[i] / k_down.get(host, 1.0), window)
        load_down[host] = load_down.get(host, 0.0) + float(push.sum())
        # The merge waits for the slowest push; as local_round_wait has it, a push completes in
        # its link's idle time (activations go first), so the pulls start that much later.
        idle = np.maximum(1.0 - np.asarray(up_busy_s) * r, 1e-3)
        rest = window - float((t_push / idle).max())
        if rest > 0:
            pull, _ = round_sync_flows(gl, bw_dn, host_up / k_up.get(host, 1.0), rest)
            load_up[host] = load_up.get(host, 0.0) + float(pull.sum()) * rest / window


def stage_costs(plan: Plan, scenario: Scenario, options: CostOptions | None = None,
                memo: dict | None = None, cpu_caps: list[float] | None = None,
                ref_cores: list[float] | None = None, mrg_cores: list[float] | None = None) -> list[StageCost]:
    """Per-stage throughput, latency, sync and memory of ``plan`` on ``scenario``.

    ``ref_cores`` and ``mrg_cores`` (per stage; default :func:`reference_cores` and
    :func:`merge_cores` of ``plan``): the cores its server's reference gradient and merge run on.

    ``cpu_caps`` (per stage, micro-batches/s; default :func:`server_cpu_caps` of ``plan``) caps each
    stage's throughput by its server host's framework CPU, and each task's result costs its
    server ``server_task_s`` on the micro-batch's path (the fill/drain share).

    A server link is shared by the activation transfers *in flight* on it, not by every worker
    that uses it: ``k_eff = link_share(N, k)`` with ``N`` the expected number of transfers in
    flight (each worker's serialisation seconds on that link per micro-batch times the
    micro-batches it completes per second, ``X / X_s / tau_d`` at the pipeline rate ``X``).
    ``tau`` depends on ``k_eff`` and ``k_eff`` on ``tau``: the estimate starts from the worst
    case (``k_eff = k``) and takes at most ``SHARE_ITERATIONS`` passes, stopping early once no
    ``k_eff`` moves by more than 1 % (on the built-in scenarios it settles in 2-3 passes, without
    oscillation; damping only slowed it down). Sync bursts are simultaneous, so sync shares by ``k``.
    """
    options = options or CostOptions()
    prof = scenario_profile(scenario, plan.micro_batch_size)
    sync: SyncPolicy = plan.sync
    if cpu_caps is None:
        cpu_caps = server_cpu_caps(plan, scenario)[0]
    if ref_cores is None and plan.sync.local:
        ref_cores = reference_cores(plan, scenario)[0]
    if mrg_cores is None and plan.sync.local:
        mrg_cores = merge_cores(plan, scenario)[0]
    n_dl, n_ul, n_sync = _share_counts(plan, scenario)
    n = len(plan.stages)
    if memo is None:
        memo = {}
    dev = memo.get("dev")
    if dev is None:
        dev = memo["dev"] = {d.id: d for d in scenario.devices}
    # what the per-stage rows depend on besides the stage itself
    policy_key = (_policy_key(sync), options.recompute, plan.micro_batch_size)
    rows: list[list[tuple]] = []
    syncs: list[float] = []
    pulls: list[float] = []
    heads: list[float] = []
    hosts: list[tuple] = []  # (host, next host, previous host) ids or None
    # local mode: wid -> (push seconds, pull seconds) of one round at its links' full rate
    background: dict[str, tuple[float, float]] = {}
    lats: list[float] = []
    sync_rows: list[list[tuple]] = []  # per stage, per row: (push bytes, own push rate, pull bytes, own pull rate)
    ordered_push: list = []  # per stage: _stage_rows' ordered-push figures (None: one push a worker)
    spread = sync.local
    for i, st in enumerate(plan.stages):
        nxt_id = plan.stages[i + 1].server if i < n - 1 else None
        prv_id = plan.stages[i - 1].server if i > 0 else None
        hosts.append((st.server, nxt_id, prv_id))
        key = (st.layers, i == 0, i == n - 1, st.server, nxt_id, prv_id, tuple(st.workers),
               n_sync.get(st.server, 1), policy_key)
        got = memo.get(key)
        if got is None:
            got = memo[key] = _stage_rows(st, i == 0, i == n - 1, nxt_id, prv_id, n_sync, prof, scenario, dev,
                                          sync, options, memo)
        stage_rows, max_lat, sync_s, pull_s, headroom, bg, bg_rows, ordered_i = got
        ordered_push.append(ordered_i)
        rows.append(stage_rows)
        sync_rows.append(bg_rows)
        lats.append(max_lat)
        syncs.append(sync_s)
        pulls.append(pull_s)
        heads.append(headroom)
        if bg:
            background.update(bg)

    # Fixed point of the link sharing, from the worst case k_eff = k. Per stage, per-worker
    # figures are lists in the order of ``rows`` (a plan never lists a worker twice).
    k_up = {h: float(max(1, k)) for h, k in n_dl.items()}
    k_down = {h: float(max(1, k)) for h, k in n_ul.items()}
    m = plan.micro_batches
    overlap_up, prefetch = sync.overlap_uploads, sync.prefetch
    plain = not (overlap_up or prefetch)  # the exact-sync protocol: keep its arithmetic bit for bit
    settled = not n_dl and not n_ul
    inf = math.inf
    caps = [(dev[h].up, dev[hn].down if hn is not None else None, dev[hp].down if hp is not None else None)
            for h, hn, hp in hosts]
    # Overlapped local rounds: the round's pushes and pulls share the server links with the
    # activations while the next round's steps run (see round_sync_flows).
    rounds = None
    if sync.local and sync.overlap:
        rounds = RoundTraffic([_round_columns(r, memo) for r in sync_rows], [dev[h].down for h, _, _ in hosts],
                              sync.sync_every)
    if sum(len(r) for r in rows) >= VECTOR_MIN_WORKERS:
        all_times, busy = _share_fixed_point_np(rows, hosts, caps, k_up, k_down, n_dl, n_ul, m, overlap_up, prefetch,
                                                settled, memo, rounds)
    else:
        for it in range(SHARE_ITERATIONS + 1):
            all_times: list[list[float]] = []
            busy: list[list[tuple[float, float, float]]] = []  # per worker: seconds on (h up, nxt down, prv down)
            for i, stage_rows in enumerate(rows):
                h, hn, hp = hosts[i]
                cap_up, cap_n, cap_p = caps[i]
                up = cap_up / k_up.get(h, 1.0)
                dn = cap_n / k_down.get(hn, 1.0) if hn is not None else inf
                dp = cap_p / k_down.get(hp, 1.0) if hp is not None else inf
                times: list[float] = []
                bz: list[tuple[float, float, float]] = []
                for _wid, fixed, dlb, dlbw, ulb_n, ulbw_n, ulb_p, ulbw_p, c_w, _o in stage_rows:
                    s_dl = dlb / (dlbw if dlbw < up else up) if dlb > 0 else 0.0
                    s_n = ulb_n / (ulbw_n if ulbw_n < dn else dn) if ulb_n > 0 else 0.0
                    s_p = ulb_p / (ulbw_p if ulbw_p < dp else dp) if ulb_p > 0 else 0.0
                    if plain:
                        times.append(fixed + s_dl + s_n + s_p)
                    else:
                        times.append(task_period(c_w, fixed - c_w + s_dl, s_n + s_p, overlap_up, prefetch))
                    bz.append((s_dl, s_n, s_p))
                all_times.append(times)
                busy.append(bz)
            if it == SHARE_ITERATIONS or settled:
                break
            xs = [stage_throughput(t, m) for t in all_times]
            x = min(xs)
            load_up: dict[str, float] = {}
            load_down: dict[str, float] = {}
            for i, times in enumerate(all_times):
                if xs[i] <= 0 or x <= 0:
                    continue
                h, hn, hp = hosts[i]
                util = min(1.0, x / xs[i])  # a non-bottleneck stage's workers wait part of the time
                bz = busy[i]
                for j in (range(len(times)) if len(times) <= m else _fastest(times, m)):
                    t = times[j]
                    if not 0 < t < inf:
                        continue
                    s_dl, s_n, s_p = bz[j]
                    r = util / t
                    if s_dl:
                        load_up[h] = load_up.get(h, 0.0) + s_dl * r
                    if s_n:
                        load_down[hn] = load_down.get(hn, 0.0) + s_n * r
                    if s_p:
                        load_down[hp] = load_down.get(hp, 0.0) + s_p * r
            if rounds is not None and x > 0:
                for i, times in enumerate(all_times):  # x > 0, so every xs[i] >= x is too
                    idx = [j for j in (range(len(times)) if len(times) <= m else _fastest(times, m))
                           if 0 < times[j] < inf]
                    r = np.array([min(1.0, x / xs[i]) / times[j] for j in idx])
                    bz = np.array([busy[i][j] for j in idx], dtype=float).reshape(-1, 3)
                    rounds.add(i, np.array(idx, dtype=int), r, bz[:, 1] + bz[:, 2], m / x, hosts[i][0], caps[i][0],
                               k_up, k_down, load_up, load_down)
            new_up = {h: link_share(load_up.get(h, 0.0), n_dl[h]) for h in k_up}
            new_down = {h: link_share(load_down.get(h, 0.0), n_ul[h]) for h in k_down}
            settled = all(abs(new_up[h] - k) <= 0.01 * k for h, k in k_up.items()) and \
                all(abs(new_down[h] - k) <= 0.01 * k for h, k in k_down.items())
            k_up, k_down = new_up, new_down

    out = []
    pipe_rate = min(stage_throughput(t, m) for t in all_times) if (spread or any(ordered_push)) and all_times else 0.0
    for i, stage_rows in enumerate(rows):
        times = all_times[i]
        x = stage_throughput(times, m)
        used = _fastest(times, m)
        finite = [j for j in used if 0 < times[j] < inf]
        finite_set = set(finite)
        if finite:
            total = sum(1.0 / times[j] for j in finite)
            frac = sum(stage_rows[j][8] / times[j] / times[j] for j in finite) / total
            lat = times[finite[0]] + stage_rows[finite[0]][9]
            slow = max(times[j] + stage_rows[j][9] for j in finite)
            # each worker runs a 1 / (tau_d X_s) share of the M micro-batches
            busy_step = m * sum(stage_rows[j][8] / times[j] for j in finite) / total
        else:
            frac, lat, busy_step, total, slow = 1.0, inf, 0.0, 0.0, inf
        links = []
        if spread:
            # shares of the micro-batches: a stage faster than the pipeline waits for its tasks
            rate = pipe_rate
            cycles, floors = times, [0.0] * len(times)
            if overlap_up and finite and rate < total:
                # A worker waiting for tasks leases the next one as its output starts uploading:
                # its turn in the queue comes back after its compute and fetch, not its upload
                # (which runs on behind, up to its uploads in flight), so a fast card with a slow
                # uplink takes more tasks than its upload-bound period says, as many as its
                # uplink carries in the step, and has that much less idle time for the round's
                # push (gaming-world's stage 1: a 4080 on a 5 MB/s uplink took 32 of 512
                # micro-batches where a 3060 beside it took 23.5).
                cycles = [task_period(row[8], row[1] - row[8] + busy[i][j][0], 0.0, True, prefetch)
                          if j in finite_set else times[j] for j, row in enumerate(stage_rows)]
                floors = [busy[i][j][1] + busy[i][j][2] for j in range(len(stage_rows))]
                wait = capped_queue_wait([cycles[j] for j in finite], [floors[j] for j in finite], rate)
            else:
                wait = idle_queue_wait([cycles[j] for j in finite], rate) if finite and rate < total else 0.0
            for j, row in enumerate(stage_rows):
                wid = row[0]
                if wid not in background:
                    continue
                t = cycles[j]
                if wait > 0:
                    n_d = m / (max(t + wait, floors[j]) * rate) if 0 < t < inf and j in finite_set else 0.0
                else:
                    n_d = m / (t * total) if total > 0 and 0 < t < inf else 0.0  # its micro-batches per step
                s_dl, s_n, s_p = busy[i][j]
                links.append((*background[wid], n_d * (s_n + s_p), n_d * s_dl))
        if ordered_push[i] is not None:
            # (the first stage's forwards are all there when the step starts: its workers take
            # them as fast as they run, shares by speed, and each runs its own backwards)
            syncs[i] = ordered_sync_time([times[j] for j in finite], [ordered_push[i][4][j] for j in finite],
                                         pipe_rate if i > 0 else 0.0, m, *ordered_push[i][:4], ordered_push[i][5])
        task_times = {row[0]: t for row, t in zip(stage_rows, times, strict=True)}
        backlog = {}
        if overlap_up:
            for j, row in enumerate(stage_rows):
                u = busy[i][j][1] + busy[i][j][2]
                q = upload_backlog(times[j], u)
                if q > 0:
                    backlog[row[0]] = q
        a, b = plan.stages[i].layers
        fwd = prof.fwd_flops(a, b)
        flops = fwd + prof.bwd_flops(a, b)
        handling = micro_batch_handling(i == n - 1, stage_result_bytes(prof, plan.sync, i == 0, i == n - 1),
                                        scenario.cpu, stage_result_decode(prof, plan.sync, i == 0, i == n - 1,
                                                                          scenario.cpu))
        merge = merge_cpu_time(prof.params(a, b), len(plan.stages[i].workers), plan.sync, scenario.cpu,
                               mrg_cores[i] if plan.sync.local else 1.0)
        ref = reference_cpu_time(flops / prof.tokens_per_micro_batch, prof.tokens_per_micro_batch, plan.sync,
                                 scenario.cpu, ref_cores[i]) if plan.sync.local else 0.0
        out.append(StageCost(throughput=min(x, cpu_caps[i]), latency=lat + handling, compute_fraction=frac,
                             sync=syncs[i] + merge, merge=merge, task_times=task_times, memory_headroom=heads[i], pull=pulls[i],
                             compute_per_step=busy_step, round_links=tuple(links), round_latency=lats[i],
                             slowest=slow + handling, fwd_share=fwd / flops if flops > 0 else 1.0,
                             cpu_cap=cpu_caps[i], uncapped=x, task_handling=handling / tasks_per_micro_batch(i == n - 1),
                             upload_backlog=backlog, reference=ref))
    return out


# Plans with at least this many workers run the link-sharing fixed point on numpy arrays (one
# pass over 3000 workers in Python dominated planning scale-1024/4096); smaller plans keep the
# list arithmetic, whose sums are bit for bit those the reference tests pin.
VECTOR_MIN_WORKERS = 128


def _stage_arrays(stage_rows: list[tuple], memo: dict) -> tuple:
    """Columns of a stage's rows as float arrays (``fixed, dlb, dlbw, ulb_n, ulbw_n, ulb_p,
    ulbw_p, c``), memoised by the rows' identity (the rows themselves are memoised per stage)."""
    key = ("np", id(stage_rows))
    got = memo.get(key)
    if got is None or got[0] is not stage_rows:
        cols = np.array([r[1:9] for r in stage_rows], dtype=float).reshape(-1, 8).T.copy()
        got = memo[key] = (stage_rows, cols)
    return got[1]


def _round_columns(bg_rows: list[tuple], memo: dict) -> np.ndarray:
    """A stage's round rows (push bytes, push rate, pull bytes, pull rate) as four float
    columns, memoised by the rows' identity like :func:`_stage_arrays`."""
    key = ("round", id(bg_rows))
    got = memo.get(key)
    if got is None or got[0] is not bg_rows:
        got = memo[key] = (bg_rows, np.array(bg_rows, dtype=float).reshape(-1, 4).T.copy())
    return got[1]


def _share_fixed_point_np(rows, hosts, caps, k_up, k_down, n_dl, n_ul, m, overlap_up, prefetch, settled, memo,
                          rounds=None):
    """:func:`stage_costs`' link-sharing fixed point on arrays: the same passes, the same stopping
    rule, each stage's workers at once. Returns per stage the workers' ``tau`` and their
    ``(s_dl, s_n, s_p)`` seconds, as lists in the order of ``rows``."""
    inf = math.inf
    plain = not (overlap_up or prefetch)
    cols = [_stage_arrays(r, memo) for r in rows]
    for it in range(SHARE_ITERATIONS + 1):
        times_np = []
        busy_np = []
        with np.errstate(divide="ignore", invalid="ignore"):
            for i, (fixed, dlb, dlbw, ulb_n, ulbw_n, ulb_p, ulbw_p, c_w) in enumerate(cols):
                h, hn, hp = hosts[i]
                cap_up, cap_n, cap_p = caps[i]
                up = cap_up / k_up.get(h, 1.0)
                dn = cap_n / k_down.get(hn, 1.0) if hn is not None else inf
                dp = cap_p / k_down.get(hp, 1.0) if hp is not None else inf
                s_dl = np.where(dlb > 0, dlb / np.minimum(dlbw, up), 0.0)
                s_n = np.where(ulb_n > 0, ulb_n / np.minimum(ulbw_n, dn), 0.0)
                s_p = np.where(ulb_p > 0, ulb_p / np.minimum(ulbw_p, dp), 0.0)
                if plain:
                    t = fixed + s_dl + s_n + s_p
                else:
                    f = fixed - c_w + s_dl
                    u = s_n + s_p
                    if prefetch and overlap_up:
                        t = np.maximum(np.maximum(c_w, f), u)
                    elif prefetch:
                        t = np.maximum(c_w + u, f)
                    else:
                        t = np.maximum(c_w + f, u)
                times_np.append(t)
                busy_np.append((s_dl, s_n, s_p))
        if it == SHARE_ITERATIONS or settled:
            break
        used = []
        xs = []
        for t in times_np:
            ok = (t > 0) & (t < inf)
            idx = np.flatnonzero(ok)
            if len(idx) > m:
                idx = idx[np.argpartition(t[idx], m - 1)[:m]]
            used.append(idx)
            xs.append(float(np.sum(1.0 / t[idx])) if len(idx) else 0.0)
        x = min(xs)
        load_up: dict[str, float] = {}
        load_down: dict[str, float] = {}
        for i, t in enumerate(times_np):
            if xs[i] <= 0 or x <= 0:
                continue
            h, hn, hp = hosts[i]
            idx = used[i]
            r = min(1.0, x / xs[i]) / t[idx]
            s_dl, s_n, s_p = (b[idx] for b in busy_np[i])
            load_up[h] = load_up.get(h, 0.0) + float(s_dl @ r)
            if hn is not None:
                load_down[hn] = load_down.get(hn, 0.0) + float(s_n @ r)
            if hp is not None:
                load_down[hp] = load_down.get(hp, 0.0) + float(s_p @ r)
            if rounds is not None:
                rounds.add(i, idx, r, s_n + s_p, m / x, h, caps[i][0], k_up, k_down, load_up, load_down)
        new_up = {h: link_share(load_up.get(h, 0.0), n_dl[h]) for h in k_up}
        new_down = {h: link_share(load_down.get(h, 0.0), n_ul[h]) for h in k_down}
        settled = all(abs(new_up[h] - k) <= 0.01 * k for h, k in k_up.items()) and \
            all(abs(new_down[h] - k) <= 0.01 * k for h, k in k_down.items())
        k_up, k_down = new_up, new_down
    all_times = [t.tolist() for t in times_np]
    busy = [list(zip(*(b.tolist() for b in bz), strict=True)) for bz in busy_np]
    return all_times, busy


def _fastest(times: list[float], m: int) -> list[int]:
    """Indices of the ``m`` smallest of ``times``, smallest first (ties in list order)."""
    order = sorted(range(len(times)), key=times.__getitem__)
    return order[:m] if len(order) > m else order


def stage_server_memory(prof: ModelProfile, first: int, last: int, sync: SyncPolicy | None = None) -> float:
    """Bytes of host memory a stage server of ``[first, last)`` needs under ``sync`` (None: exact)."""
    return prof.server_memory(first, last, local=sync is not None and sync.local)


def servers_memory(stages, prof: ModelProfile, sync: SyncPolicy | None = None) -> dict[str, float]:
    """Bytes of host memory each server host gives the stage servers of ``stages`` under
    ``sync`` (None: exact) (pure)."""
    need: dict[str, float] = {}
    for st in stages:
        need[st.server] = need.get(st.server, 0.0) + stage_server_memory(prof, *st.layers, sync)
    return need


def server_memory_headroom(plan: Plan, scenario: Scenario) -> float:
    """Min over server hosts of (host memory - servers' memory) / host memory."""
    prof = scenario_profile(scenario, plan.micro_batch_size)
    need = servers_memory(plan.all_stages, prof, plan.sync)
    headroom = math.inf
    dev = {d.id: d for d in scenario.devices if d.id in need}
    for h, n in need.items():
        hm = dev[h].host_memory
        headroom = min(headroom, (hm - n) / hm if hm > 0 else -math.inf)
    return headroom


def churn_step_time(plan: Plan, scenario: Scenario, costs: list[StageCost], pipe: float, fill: float,
                    sync: float, step: float, options: CostOptions, floor: float = 0.0,
                    adjust: float = 0.0) -> tuple[float, float]:
    """``(expected step, churn seconds)`` of a plan under the scenario's churn.

    Long run, worker ``d`` is online ``a_d = availability(S_d, O)`` of the time, so stage ``s``
    runs at ``X_s^a = sum_d a_d / tau_d`` (the M fastest); pipeline ``P^a = (M - 1) / min X^a +
    fill``. Each step, ``d`` leaves with probability ``T / S_d`` (``T`` = churn-free step) and
    then costs ``leave_cost(...)``: ``churn = sum_d (T / S_d) leave_cost_d``. Expected step =
    ``step_time(P^a, sync) + churn``.
    """
    dev = {d.id: d for d in scenario.devices}
    off = scenario.churn.mean_offline_s
    m = plan.micro_batches
    xs_a = []
    churn = 0.0
    for c in costs:
        used = sorted(c.task_times, key=c.task_times.get)[:m]
        xa = 0.0
        for w in used:
            t = c.task_times[w]
            if not 0 < t < math.inf:
                continue
            sess = dev[w].mean_session_s
            xa += availability(sess, off) / t
            if sess:
                churn += step / sess * leave_cost(t, c.throughput, m, pipe, fill, options.lease_timeout_s, c.pull)
        xs_a.append(min(xa, c.cpu_cap))
    pipe_a = (m - 1) / min(xs_a) + fill if min(xs_a) > 0 else math.inf
    pipe_a = max(pipe_a + adjust, floor)  # local mode: tail_pipeline_time's correction, granular_pipeline_time
    return step_time(pipe_a, sync, options.overlap_sync) + churn, churn


def swarm_flop_limit(scenario: Scenario, memo: dict | None = None) -> float:
    """The swarm's FLOP limit in tokens/s: the sum of every worker's FLOP/s (used or not) over the
    model's training (forward + backward) FLOPs per token (see :mod:`shoal.plan.report`)."""
    if memo is not None and "flop_limit" in memo:
        return memo["flop_limit"]
    prof = scenario_profile(scenario)
    n = len(prof.layers)
    per_token = (prof.fwd_flops(0, n) + prof.bwd_flops(0, n)) / prof.tokens_per_micro_batch
    limit = sum(d.flops for d in scenario.devices if d.flops > 0) / per_token if per_token > 0 else 0.0
    if memo is not None:
        memo["flop_limit"] = limit
    return limit


def _landing_times(cost: StageCost) -> list[float]:
    """Per used worker of a stage, ``tau`` plus its :func:`upload_backlog`: from the lease of its
    last task to that task's output landing (what the step's end waits for)."""
    q = cost.upload_backlog
    return [t + q.get(w, 0.0) for w, t in cost.task_times.items()]


# How many of the step's last micro-batches the pinned drain's round trip takes the latest of
# (_late_latency). The exact end is E[max over the earlier stage's workers of (commitment +
# round trip)]; the pinned term already takes the max over the commitments, and adding the
# latest of all n round trips counts the tail twice (1.10x the simulated step on gaming-eu's
# 2-stage pipeline), the mean of one (k = 1) too little (0.83-0.94x on gaming-world's replicas);
# two is a calibrated middle that keeps every built-in within 4 % (bench/results/swarm-share.md).
LATE_DRAWS = 2


def _late_latency(cost: StageCost, m: int, draws: int) -> float:
    """A stage's share of the round trip of the step's last micro-batches. When the earlier
    stage's forward pool empties, its used workers each have one forward in flight, and each of
    those micro-batches goes to whichever of this stage's workers leases next: worker
    ``d`` with probability ``p_d = (1 / tau_d) / X`` (its share of the stage's tasks). Its output
    lands ``l_d = tau_d`` plus the worker's upload backlog later (:func:`_landing_times`); the
    step waits for the latest of ``draws`` of them (``LATE_DRAWS``), ``E[max] = sum_j l_(j)
    (F_j^k - F_(j-1)^k)`` over the sorted ``l`` with ``F`` the cumulative ``p`` and ``k = draws``. The fill counts the
    fastest worker's ``tau`` instead: with few micro-batches per worker the slow ones often take
    one of the last (a granular tail), with many the fast ones do."""
    q = cost.upload_backlog
    used = sorted((t, w) for w, t in cost.task_times.items() if 0 < t < math.inf)[:m]
    if not used:
        return cost.latency
    x = sum(1.0 / t for t, _ in used)
    k = max(1, draws)
    lands = sorted((t + q.get(w, 0.0), 1.0 / t / x) for t, w in used)
    e, f_prev = 0.0, 0.0
    for land, p in lands:
        f = min(1.0, f_prev + p)
        e += land * (f ** k - f_prev ** k)
        f_prev = f
    return cost.latency - used[0][0] + e


def flush_time(costs: list[StageCost]) -> float:
    """Local mode's step end after the last task (pure): the server tells every worker holding
    gradients of the step to take its inner optimizer step (the flush, on its lease reply) and
    closes the step when each has said it did, two one-way latencies to the farthest worker;
    the stages flush side by side."""
    return max((2.0 * c.round_latency for c in costs), default=0.0)


def _pipeline_terms(costs: list[StageCost], m: int, local: bool) -> tuple[float, float, int, float, float]:
    """``(pipeline s, fill s, bottleneck stage, granular floor, local-mode correction)`` of one
    pipeline of ``m`` micro-batches per step from its stages' costs (see :func:`predict`)."""
    xs = [c.throughput for c in costs]
    b = min(range(len(costs)), key=lambda i: xs[i])
    fill = sum(c.latency for c in costs)
    pipe = pipeline_time(m, xs, [c.latency for c in costs])
    floor = adjust = 0.0
    if local:
        floor = granular_pipeline_time(fill, [(c.latency, c.slowest) for c in costs])
        fluid = pipe
        # the step ends once the last task's result is handled: its server's CPU comes after the tail;
        # a worker's last output lands behind its overlapped uploads (upload_backlog)
        if len(costs) == 1:  # every task's input is there at the start: the greedy schedule itself,
            # unless the pool's throughput is capped below its workers' (the server host's CPU,
            # server_cpu_caps), which the per-worker schedule does not see
            tail = list_schedule_end(m, list(costs[0].task_times.values()), _landing_times(costs[0]))
            if costs[0].uncapped > xs[0] * (1 + 1e-9):
                tail = max(tail, tail_pipeline_time(m, _landing_times(costs[b]), xs[b], fill, costs[b].latency))
        else:
            tail = tail_pipeline_time(m, _landing_times(costs[b]), xs[b], fill, costs[b].latency)
        pipe = max(tail + costs[b].task_handling, floor)
        # another stage's slow workers may hold tasks landing later still (upload backlogs):
        # when the bottleneck's pool empties they are somewhere in theirs
        n_b = len(sorted(t for t in costs[b].task_times.values() if 0 < t < math.inf)[:m])
        for i, c in enumerate(costs):
            if i != b and xs[b] > 0:
                lands = sorted(t for t in _landing_times(c) if 0 < t < math.inf)[:m]
                pipe = max(pipe, (m - n_b / 2) / xs[b] + expected_max_residual(lands) + fill - c.latency
                           + c.task_handling)
        # a backward task waits for the worker that ran its forward (every stage but the last)
        for i in range(len(costs) - 1):
            rt = sum(c.latency for c in costs[i + 1:])
            before = sum(c.latency for c in costs[:i])
            draws = min(LATE_DRAWS, len([t for t in costs[i].task_times.values() if 0 < t < math.inf][:m]))
            late = sum(_late_latency(c, m, draws) for c in costs[i + 1:])
            pipe = max(pipe, pinned_pipeline_time(m, xs[b], _landing_times(costs[i]), rt,
                                                  costs[i].fwd_share, before) + late - rt)
        pipe += flush_time(costs)
        adjust = pipe - fluid
    return pipe, fill, b, floor, adjust


def replica_plan(plan: Plan, replica: Replica) -> Plan:
    """One replica of a replica plan as a single-pipeline :class:`Plan` (its own micro-batches)."""
    return Plan(plan.scenario, plan.model, plan.method, replica.stages, plan.micro_batch_size, replica.micro_batches,
                plan.sync)


def outer_merge_flows(plan: Plan, prof: ModelProfile) -> list[tuple[str, str, float]]:
    """``(source host, destination host, bytes)`` of one outer merge of a replica plan: every
    stage server sends its replica's merged pseudo-gradient of each layer it shares with a stage
    of another replica (the layers of the overlap, in the push codec's bytes) to that stage's
    server; a merge between two servers on one host moves nothing over the network."""
    ratio = plan.sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
    flat = [(r, st) for r, rep in enumerate(plan.pipelines) for st in rep.stages]
    out = []
    for r, st in flat:
        for q, other in flat:
            if q == r or st.server == other.server:
                continue
            lo, hi = max(st.layers[0], other.layers[0]), min(st.layers[1], other.layers[1])
            if lo < hi:
                out.append((st.server, other.server, prof.param_bytes(lo, hi) * ratio))
    return out


def outer_merge_time(plan: Plan, scenario: Scenario, prof: ModelProfile) -> float:
    """Seconds of one outer merge of a replica plan when every server starts sending at once: the
    slowest of :func:`outer_merge_flows`, each at ``min(path, sender's uplink / its flows,
    receiver's downlink / its flows)`` (equal share, as the simulator has it), plus its latency."""
    flows = outer_merge_flows(plan, prof)
    if not flows:
        return 0.0
    dev = {d.id: d for d in scenario.devices}
    n_up: dict[str, int] = {}
    n_down: dict[str, int] = {}
    for a, b, _ in flows:
        n_up[a] = n_up.get(a, 0) + 1
        n_down[b] = n_down.get(b, 0) + 1
    worst = 0.0
    for a, b, nbytes in flows:
        link = scenario.network.link(dev[a], dev[b])
        bw = flow_bandwidth(link.bandwidth, dev[a].up, dev[b].down, n_up[a], n_down[b])
        worst = max(worst, transfer_time(nbytes, link.latency, bw))
    return worst


def dense_round_time(plan: Plan, scenario: Scenario, prof: ModelProfile) -> float:
    """Seconds a sparse run's dense last round takes, once per run (pure): with ``sparse`` or ``lowrank`` pushes
    in local mode each worker keeps what its pushes left (``shoal.runtime.sync.codecs.
    keeps_residual``), so the run ends with every worker of a stage pushing its whole
    pseudo-gradient (in :data:`~shoal.plan.compression.DENSE_ROUND_CODEC`) to its stage server
    at once. Each flow at ``min(path, the worker's uplink, the server's downlink / its
    workers)``, plus its latency; the slowest. 0 for any other policy (the steady-state step the
    cost model predicts does not include it)."""
    pol = plan.sync
    if not pol.local or not pol.push_codec.startswith(("sparse", "lowrank")):
        return 0.0
    dev = {d.id: d for d in scenario.devices}
    worst = 0.0
    for st in plan.all_stages:
        nbytes = bytes_per_element(DENSE_ROUND_CODEC, 4) * prof.params(*st.layers)
        host = dev[st.server]
        for w in st.workers:
            link = scenario.network.link(dev[w], host)
            bw = flow_bandwidth(link.bandwidth, dev[w].up, host.down, 1, len(st.workers))
            worst = max(worst, transfer_time(nbytes, link.latency, bw))
    return worst


def local_round_push_end(links: list[tuple[float, float, float, float]], latency: float, window: float,
                         pipeline_s: float, overlap: bool = True) -> float:
    """Seconds from a stage's round start until its last push has landed (the first half of
    :func:`local_round_wait`, whose notation it uses); ``window`` = ``H P``."""
    if not links:
        return 0.0
    if not overlap or pipeline_s <= 0 or not math.isfinite(pipeline_s):
        return 2 * latency + max(x[0] for x in links)
    floor = 1e-3
    return latency + max(background_finish(latency, x[0], max(floor, 1.0 - x[2] / pipeline_s), window) for x in links)


def local_round_pull_end(links: list[tuple[float, float, float, float]], latency: float, start: float, window: float,
                         pipeline_s: float, overlap: bool = True) -> float:
    """Seconds from a stage's round start until its last pull has landed, when its pulls start at
    ``start`` (the second half of :func:`local_round_wait`)."""
    if not links:
        return start
    if not overlap or pipeline_s <= 0 or not math.isfinite(pipeline_s):
        return start + latency + max(x[1] for x in links)
    floor = 1e-3
    return latency + max(background_finish(start, x[1], max(floor, 1.0 - x[3] / pipeline_s), window) for x in links)


# Local-mode sync chunks (the simulator sends a round's bytes in chunks when a link is idle):
SYNC_CHUNK_S = 0.05  # a chunk lasts this long at the link's full rate
SYNC_CHUNK_MIN = 1 << 18  # bytes: no chunk is smaller (unless it is the rest)


def chunk_wait(nbytes: float, rate: float, pending: float) -> float:
    """Expected seconds an activation transfer loses to a round's chunk on the same link: the
    round sends ``nbytes`` at ``rate`` in chunks of ``max(SYNC_CHUNK_MIN, SYNC_CHUNK_S rate)``
    bytes whenever the link is idle, so while it is ``pending`` (that share of the time) a
    transfer that starts finds a chunk in flight and shares the link with it until it ends, half
    a chunk later on average."""
    if nbytes <= 0 or rate <= 0 or pending <= 0:
        return 0.0
    return pending * min(nbytes, max(SYNC_CHUNK_MIN, SYNC_CHUNK_S * rate)) / rate / 2


def round_chunk_delays(sub: Plan, scenario: Scenario, costs: list[StageCost], prof: ModelProfile,
                       window: float) -> float:
    """Seconds a replica's pipeline loses per step to its round's chunks (overlapped local mode).

    A worker's push is pending for ``push_s / (1 - up_busy / P)`` of the window ``H P`` (it only
    uses the uplink's idle time) and likewise its pull on the downlink; every activation upload
    (downloads: every task's input) that starts meanwhile waits :func:`chunk_wait`. Each worker's
    ``tau`` grows by that, and the replica's pipeline by ``M_r`` times the change of its slowest
    stage's ``1 / X_s``."""
    if window <= 0 or not math.isfinite(window):
        return 0.0
    dev = {d.id: d for d in scenario.devices}
    sync = sub.sync
    m = sub.micro_batches
    pipe = window / max(1, sync.sync_every)
    n = len(sub.stages)
    hidden = prof.layers[0].out_act_bytes
    x_old, x_new = [], []
    for i, (st, c) in enumerate(zip(sub.stages, costs, strict=True)):
        a, b = st.layers
        pb = prof.param_bytes(a, b)
        g_push = pb * sync.ratio("push", prof.dtype_bytes, *prof.act_shape)
        g_pull = pb * sync.ratio("pull", prof.dtype_bytes, *prof.act_shape)
        n_up = (i < n - 1) + (i > 0)
        up_bytes = ((i < n - 1) * sync.ratio("act", prof.dtype_bytes, *prof.act_shape) + (i > 0) * sync.ratio("grad", prof.dtype_bytes, *prof.act_shape)) \
            * hidden
        n_down = 2 if i < n - 1 else 1
        host = dev[st.server]
        times = []
        for wid, tau in c.task_times.items():
            if wid == host.id or not 0 < tau < math.inf:
                times.append(tau)
                continue
            d = dev[wid]
            link = scenario.network.link(d, host)
            up, down = min(link.bandwidth, d.up), min(link.bandwidth, d.down)
            share = m / (tau * c.throughput) if c.throughput > 0 else 0.0  # its micro-batches per step
            idle_up = max(1e-3, 1.0 - share * up_bytes / up / pipe)
            push_pending = min(1.0, g_push / up / idle_up / window)
            pull_pending = min(1.0, g_pull / down / window)
            extra = n_up * chunk_wait(g_push, up, push_pending) + n_down * chunk_wait(g_pull, down, pull_pending)
            times.append(tau + extra)
        x_old.append(c.throughput)
        x_new.append(stage_throughput(times, m))
    lo_old, lo_new = min(x_old), min(x_new)
    if lo_old <= 0 or lo_new <= 0:
        return 0.0
    return max(0.0, m / lo_new - m / lo_old)


def predict_replicas(plan: Plan, scenario: Scenario, options: CostOptions, memo: dict | None = None) -> dict[str, float]:
    """:func:`predict` of a plan with pipeline replicas (local mode only).

    Each replica is priced as its own pipeline of ``M_r`` micro-batches (:func:`stage_costs` of
    :func:`replica_plan`); the replicas run in lockstep, so a step takes the slowest replica's
    pipeline ``P = max_r P_r``. Every ``H`` steps a round runs: each stage's workers push to
    their own replica's server (as in a single pipeline), then the servers of the same layers
    exchange their merged pseudo-gradients (:func:`outer_merge_time`, once the last push of any
    replica has landed: the merge is one barrier over all replicas), then every worker pulls.
    With overlap the round runs beside the next ``H`` steps and the steps wait for what does not
    fit in them: ``max(0, end - H P)``, amortised over ``H``.
    """
    if not plan.sync.local:
        raise ShoalError("a plan with pipeline replicas needs local sync (replicas merge every H steps); "
                         "use --sync local or --sync auto")
    prof = scenario_profile(scenario, plan.micro_batch_size)
    h = max(1, plan.sync.sync_every)
    subs = [replica_plan(plan, r) for r in plan.replicas]
    caps = server_cpu_caps(plan, scenario)  # hosts may serve stages of several replicas
    refs = reference_cores(plan, scenario)  # ... and share their cores between those stages' references
    mrgs = merge_cores(plan, scenario)  # ... and merges
    per = []
    for sub, cap, ref, mrg in zip(subs, caps, refs, mrgs, strict=True):
        costs = stage_costs(sub, scenario, options, memo, cap, ref, mrg)
        per.append((sub, costs, *_pipeline_terms(costs, sub.micro_batches, True)))
    pipe = max(x[2] for x in per)
    overlap = plan.sync.overlap
    if overlap:
        # the round's chunks slow the activations on the workers' own links (round_chunk_delays)
        per = [(sub, costs, p_r + round_chunk_delays(sub, scenario, costs, prof, h * pipe), *rest)
               for sub, costs, p_r, *rest in per]
        pipe = max(x[2] for x in per)
    window = h * pipe
    pushed = 0.0
    full = 0.0
    for _, costs, *_ in per:
        for c in costs:
            links = list(c.round_links)
            pushed = max(pushed, local_round_push_end(links, c.round_latency, window, pipe, overlap) + c.merge)
            if c.reference > 0 and not overlap:
                # the screen's reference gradient, from the round's first step (local_round_wait)
                pushed = max(pushed, pipe + c.reference - window + c.merge)
            full = max(full, c.sync)
    outer = outer_merge_time(plan, scenario, prof)
    end = pushed + outer
    for _, costs, *_ in per:
        for c in costs:
            end = max(end, local_round_pull_end(list(c.round_links), c.round_latency, pushed + outer, window, pipe,
                                                overlap))
    wait = max(0.0, end - window) if overlap else end
    if overlap:
        # merges at most every P + reference + merge (local_round_wait)
        wait = max([wait] + [c.reference + pipe + c.merge - window for _, costs, *_ in per for c in costs
                             if c.reference > 0])
    sync = wait / h
    step = pipe + sync
    if options.coordinator:
        step = max(step, coordinator_floor(coordinator_members(plan), len(plan.all_stages), scenario.cpu))
    expected, churn_s = step, 0.0
    if options.churn and scenario.churn.enabled:
        exp_r = []
        for sub, costs, p_r, fill_r, _b, floor_r, adjust_r in per:
            e, c_s = churn_step_time(sub, scenario, costs, p_r, fill_r, sync, step, options, floor_r, adjust_r)
            exp_r.append((e + (pipe - p_r), c_s))
        expected, churn_s = max(exp_r)
    slow = max(range(len(per)), key=lambda i: per[i][2])
    sub, costs, p_s, fill_s, b_s, _, _ = per[slow]
    first = sum(len(r.stages) for r in plan.replicas[:slow])
    n_workers = sum(len(st.workers) for r in plan.replicas for st in r.stages)
    busy = sum(c.compute_per_step for _, costs_r, *_ in per for c in costs_r)
    util = busy / (n_workers * step) if n_workers and 0 < step < math.inf else 0.0
    frac = costs[b_s].compute_fraction
    limit = swarm_flop_limit(scenario, memo)
    tps = plan.micro_batches * plan.micro_batch_size * scenario.workload.seq_len / step if 0 < step < math.inf else 0.0
    headroom = min(min(c.memory_headroom for _, costs_r, *_ in per for c in costs_r),
                   server_memory_headroom(plan, scenario))
    all_x = [c.throughput for _, costs_r, *_ in per for c in costs_r]
    result = {
        "compute_s": pipe * frac,
        "transfer_s": pipe * (1.0 - frac),
        "sync_s": sync,
        "pipeline_s": pipe,
        "fill_drain_s": fill_s,
        "step_time_s": step,
        "churn_s": churn_s,
        "expected_step_time_s": expected,
        "bottleneck_stage": float(first + b_s),
        "throughput_mb_s": sum(min(c.throughput for c in costs_r) for _, costs_r, *_ in per),
        "mean_stage_time_s": sum((plan.micro_batches - 1) / x if x > 0 else math.inf for x in all_x) / len(all_x),
        "memory_headroom": headroom,
        "sync_round_s": full + outer,
        "outer_merge_s": outer,
        "utilisation": util,
        "tokens_per_s": tps,
        "flop_share": tps / limit if limit > 0 else 0.0,
        "devices_used": float(n_workers),
        "devices_available": float(len(scenario.workers)),
        "replicas": float(len(plan.replicas)),
        **cpu_figures(plan, scenario, step),
    }
    plan.predicted = result
    return result


def predict(plan: Plan, scenario: Scenario, options: CostOptions | None = None,
            memo: dict | None = None) -> dict[str, float]:
    """Cost-model prediction of one training step of ``plan``; also stored in ``plan.predicted``.

    Keys: ``compute_s`` and ``transfer_s`` (the pipeline time attributed to compute and to
    activation transfers at the bottleneck stage), ``sync_s``, ``pipeline_s``, ``step_time_s``,
    ``mean_stage_time_s`` (mean over stages of ``(M - 1) / X_s``), ``bottleneck_stage``, ``memory_headroom`` (min fraction of memory left over workers and
    server hosts; negative means it does not fit), ``throughput_mb_s`` (bottleneck micro-batches/s),
    ``fill_drain_s``, ``utilisation`` (secondary: mean over the plan's *used* workers of the
    fraction of a step spent computing), ``tokens_per_s`` (at ``step_time_s``), ``flop_share``
    (``tokens_per_s`` over the swarm's FLOP limit, :func:`swarm_flop_limit`), ``devices_used``,
    ``devices_available``, ``sync_round_s`` (local mode: seconds of one sync round, whose amortised
    share per step is ``sync_s``, see :func:`local_sync_per_step`); with churn (``scenario.churn.enabled``, ``options.churn``): ``churn_s``
    (expected seconds per step lost to leaves) and ``expected_step_time_s`` (the long-run step:
    availability-weighted pipeline + sync + ``churn_s``; equal to ``step_time_s`` without churn).
    ``step_time_s`` is always the churn-free steady state (what a churn-free simulation measures).
    """
    options = options or CostOptions()
    key = None
    if memo is not None:
        # the same plan again (placements often coincide): its prediction, a fresh copy
        key = ("plan", tuple((st.layers, st.server, tuple(st.workers)) for st in plan.stages), _policy_key(plan.sync),
               options, plan.micro_batches, plan.micro_batch_size,
               tuple((r.micro_batches, tuple((st.layers, st.server, tuple(st.workers)) for st in r.stages))
                     for r in plan.replicas))
        hit = memo.get(key)
        if hit is not None:
            plan.predicted = dict(hit)
            return plan.predicted
    if plan.replicas:
        result = predict_replicas(plan, scenario, options, memo)
        if key is not None:
            memo[key] = dict(result)
        return result
    costs = stage_costs(plan, scenario, options, memo)
    m = plan.micro_batches
    xs = [c.throughput for c in costs]
    headroom = min(min(c.memory_headroom for c in costs), server_memory_headroom(plan, scenario))
    round_s = 0.0
    pipe, fill, b, floor, adjust = _pipeline_terms(costs, m, plan.sync.local)
    frac = costs[b].compute_fraction
    if plan.sync.local:
        # per-stage rounds run in parallel; the step waits for the slowest one
        waits = [local_round_wait(list(c.round_links), c.round_latency, plan.sync.sync_every, pipe,
                                  plan.sync.overlap, c.merge, c.reference) for c in costs]
        round_s = max(w[0] for w in waits)
        sync = max(w[1] for w in waits) / max(1, plan.sync.sync_every)
        overlap = False  # already folded into the amortised sync
    else:
        sync = max(c.sync for c in costs)
        overlap = options.overlap_sync
    step = step_time(pipe, sync, overlap)
    if options.coordinator:
        step = max(step, coordinator_floor(coordinator_members(plan), len(plan.all_stages), scenario.cpu))
    expected, churn_s = step, 0.0
    if options.churn and scenario.churn.enabled:
        expected, churn_s = churn_step_time(plan, scenario, costs, pipe, fill, sync, step,
                                            CostOptions(overlap, options.recompute, options.churn,
                                                        options.lease_timeout_s, options.coordinator), floor, adjust)
    n_workers = sum(len(st.workers) for st in plan.stages)
    busy = sum(c.compute_per_step for c in costs)
    util = busy / (n_workers * step) if n_workers and step > 0 and math.isfinite(step) else 0.0
    limit = swarm_flop_limit(scenario, memo)
    tps = m * plan.micro_batch_size * scenario.workload.seq_len / step if 0 < step < math.inf else 0.0
    result = {
        "compute_s": pipe * frac,
        "transfer_s": pipe * (1.0 - frac),
        "sync_s": sync,
        "pipeline_s": pipe,
        "fill_drain_s": fill,
        "step_time_s": step,
        "churn_s": churn_s,
        "expected_step_time_s": expected,
        "bottleneck_stage": float(b),
        "throughput_mb_s": xs[b],
        "mean_stage_time_s": sum((m - 1) / x if x > 0 else math.inf for x in xs) / len(xs),
        "memory_headroom": headroom,
        "sync_round_s": round_s,
        "utilisation": util,
        "tokens_per_s": tps,
        "flop_share": tps / limit if limit > 0 else 0.0,
        "devices_used": float(n_workers),
        "devices_available": float(len(scenario.workers)),
        **cpu_figures(plan, scenario, step),
    }
    if any(st.standbys for st in plan.stages):
        # Hook: hot standbys' state copies share the active hosts' uplinks (shoal.plan.standby).
        from shoal.plan.standby import standby_costs

        extra = standby_costs(plan, scenario, scenario_profile(scenario, plan.micro_batch_size), step)
        result["expected_step_time_s"] += extra["step_time_s"] - step
        result.update(extra)
    plan.predicted = result
    if key is not None:
        memo[key] = dict(result)
    return result
