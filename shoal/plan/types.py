"""The two types every part of shoal speaks: :class:`Scenario` and :class:`Plan`.

Units inside the code are SI base units: seconds, bytes, bytes per second, FLOP/s.
Scenario files use human units (ms, Mbit/s, TFLOP/s, GB); :mod:`shoal.plan.scenario`
converts them on load and is the one place that validates user input.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig, get_preset
from shoal.plan.compression import wire_ratio


@functools.lru_cache(maxsize=256)
def _codec_ratio(codec: str, dtype_bytes: int, rows: int = 0, channels: int = 0) -> float:
    """``wire_ratio`` memoised: a pure function of a handful of (codec, dtype size, shape) keys."""
    return wire_ratio(codec, dtype_bytes, rows, channels)


@dataclass(frozen=True)
class Device:
    """One compute participant, or a reliable host that can run stage servers."""

    id: str  # unique name
    kind: str  # hardware label, e.g. "rtx3090", "v100", "server"
    flops: float  # effective training throughput in FLOP/s (0 for a host that only serves)
    memory: float  # accelerator memory in bytes usable for training
    region: str  # network region; links are looked up by region pair
    up: float  # uplink capacity in bytes/s
    down: float  # downlink capacity in bytes/s
    can_host_server: bool = False  # reliable enough to run a stage server
    mean_session_s: float | None = None  # mean time online before leaving (None: never leaves)
    host_memory: float = 64e9  # host RAM in bytes, for stage servers (master weights + AdamW)
    cores: int = 8  # CPU cores of the host, for its stage servers' framework CPU (FrameworkCpu)


@dataclass(frozen=True)
class Link:
    """A one-way network path: latency plus bandwidth."""

    latency: float  # one-way latency in seconds
    bandwidth: float  # bytes/s available to one flow on this path

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this path alone."""
        return self.latency + nbytes / self.bandwidth


@dataclass
class Network:
    """Latency and bandwidth between regions, with optional per-device-pair overrides."""

    intra: dict[str, Link]  # region -> link between two devices of that region
    inter: dict[tuple[str, str], Link]  # sorted (region_a, region_b) -> link between the regions
    overrides: dict[tuple[str, str], Link] = field(default_factory=dict)  # sorted device-id pair -> link
    loopback: Link = Link(latency=0.0, bandwidth=1e12)  # a device talking to itself

    def link(self, a: Device, b: Device) -> Link:
        """The path between devices ``a`` and ``b`` (symmetric)."""
        if a.id == b.id:
            return self.loopback
        pair = (a.id, b.id) if a.id < b.id else (b.id, a.id)
        if pair in self.overrides:
            return self.overrides[pair]
        if a.region == b.region:
            return self.intra[a.region]
        regions = (a.region, b.region) if a.region < b.region else (b.region, a.region)
        return self.inter[regions]


@dataclass(frozen=True)
class Workload:
    """What is trained: model, batch shape, precision."""

    model: str  # model preset name (see shoal.model.config.PRESETS), or a run's label for ``config``
    seq_len: int  # tokens per sequence
    global_batch: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per micro-batch (task)
    dtype_bytes: int = 2  # bytes per element of weights/activations on devices (2 = fp16/bf16)
    optimizer: str = "adamw"  # optimizer on the stage servers
    config: ModelConfig | None = None  # the model's shape where ``model`` names no preset (a model folder)

    def model_config(self) -> ModelConfig:
        """The model trained: ``config``, else the preset ``model`` names."""
        return self.config if self.config is not None else get_preset(self.model)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (M)."""
        return self.global_batch // self.micro_batch_size


@dataclass(frozen=True)
class ChurnModel:
    """How devices come and go."""

    enabled: bool = False  # whether devices leave and rejoin at all
    mean_offline_s: float = 600.0  # mean time a device that left stays away
    trace: tuple[tuple[float, str, str], ...] = ()  # explicit (time_s, device_id, "leave"|"join")


SCREEN_SAMPLE = 1 << 22  # coordinates a local-mode screen's median is taken over at most (runtime: round_measures)
SCREEN_REF_MBS = 4  # micro-batches a local-mode screen's reference gradient is computed on at most (runtime: GuardConfig)
SCREEN_REF_TOKENS = 512  # tokens that reference gradient is computed on at most (each sequence's causal prefix)
MERGE_THREADS = 4  # threads a local-mode stage server's merge adds pushes and takes their norms on at most (runtime: merge_pool)


@dataclass(frozen=True)
class FrameworkCpu:
    """CPU seconds shoal's own protocol costs on each kind of host (not the model's compute).

    Defaults are today's Python runtime as measured in ``bench/``; a scenario may override them
    (``framework_cpu`` in its file, in ms). The cost model and the simulator charge them
    (``docs/planner-cost.md``, "Framework CPU").
    """

    server_task_s: float = 2.0e-3  # stage server, per task through it (grant, input, result, relays), beside its bytes: bench/results/server-cpu.md 2026-12-07, bench_runtime_cpu.py's servers' CPU per further task at two activation sizes (tiny: 2.3-3.3 CPU-ms with 87 kB of results a task), less their bytes' share
    server_task_byte_s: float = 12e-9  # stage server, per byte a task's result carries (activation or its gradient, as sent), received, checked and relayed by one server and received and granted by the next: the same runs (d512xL2 B=4 T=256, 1.4 MB a task: 15-25 CPU-ms), 10-16 ns; gRPC with mutual TLS alone takes 4 (bench_grpc_bytes.py)
    worker_task_s: float = 3.5e-3  # worker, per task beyond its compute (lease, input, result): the same runs, workers' CPU beyond the local trainer's, 3.5 CPU-ms
    server_sync_s: float = 1.0e-3  # stage server, per worker per exact-sync step (its push and its pull): bench_rpc_cost.py server ends, 0.53 + 0.44 CPU-ms
    server_push_param_s: float = 15.5e-9  # stage server, per parameter of each exact-sync push it takes (received, decoded, checked finite, measured by the screen, summed): bench/results/server-cpu.md 2026-12-06, least squares of bench_runtime_cpu.py --models, 15.5 ns
    server_pull_param_s: float = 5.2e-9  # stage server, per parameter of each exact-sync pull it serves (the version's bytes framed, encrypted and sent): the same fit, 5.2 ns
    server_step_param_s: float = 7.7e-9  # stage server, per parameter once an exact-sync step, on one core between its last push and its pulls (clipping norms, AdamW, the new version serialised): the same bench, timed apart, 7.7 ns
    coordinator_member_s: float = 0.8e-3  # coordinator, per member per second (heartbeats, liveness): fit of stream.md's shadow swarms, 0.03 / 0.06 cores at 18 / 66 members
    coordinator_report_s: float = 14e-3  # coordinator, per stage server's step report: the same fit
    coordinator_cores: float = 1.0  # cores the coordinator can use (one Python event loop)
    server_codec_scale: float = 1.0  # stage server: multiplies the per-element encode/decode CPU of a local-mode round's codecs (shoal.plan.compression.CODEC_CPU_S)
    act_codec_scale: float = 1.0  # worker and stage server: multiplies the per-element encode/decode CPU of activations and their gradients (shoal.plan.compression.ACT_CODEC_CPU_S; 0: free)
    server_merge_param_s: float = 1.2e-9  # stage server, per parameter of each local-mode pseudo-gradient: the screen's norm, its cosine to the reference gradient and its weighted-sum term (one read), on one merge thread after the round's last push (bench/results/merge-threads.md 2026-12-04 09:03: 0.91-1.10 ns)
    server_merge_speedup: float = 1.4  # stage server: how much faster the merge's norms, cosines and weighted sum run on its threads (>= 2 cores) than on one (bench/results/merge-threads.md 2026-12-04 09:03: 1.32-1.57x on 2 cores; more threads not counted)
    server_codec_speedup: float = 1.4  # stage server: the same for a lowrank frame's encode and decode (bench/results/codec-threads.md 2026-12-04: 1.33-1.55x on 2 cores)
    server_screen_sample_s: float = 52e-9  # stage server, per coordinate of each pseudo-gradient the screen's median is taken over (at most SCREEN_SAMPLE; the same runs: 0.22 s a push of a 4 M sample)
    server_flops: float = 50e9  # stage server, FLOP/s of the one core its screen's reference gradient runs on (fp32 torch, one thread: bench/results/screen-reference.md, 49-59 GFLOP/s)


@dataclass
class Scenario:
    """A set of devices, the network between them, the workload and the churn model."""

    name: str  # scenario name
    devices: list[Device]  # every participant, workers and server hosts
    network: Network  # latency and bandwidth between them
    workload: Workload  # what is trained
    churn: ChurnModel = field(default_factory=ChurnModel)  # how devices come and go
    description: str = ""  # one paragraph: what this scenario models
    source: str = ""  # where its figures come from
    cpu: FrameworkCpu = field(default_factory=FrameworkCpu)  # the framework's CPU per message on each host

    def device(self, device_id: str) -> Device:
        """The device called ``device_id``."""
        for d in self.devices:
            if d.id == device_id:
                return d
        raise ShoalError(f"scenario {self.name}: no device {device_id!r}")

    @property
    def workers(self) -> list[Device]:
        """Devices that can compute (flops > 0)."""
        return [d for d in self.devices if d.flops > 0]

    @property
    def server_hosts(self) -> list[Device]:
        """Devices allowed to run stage servers."""
        return [d for d in self.devices if d.can_host_server]


@dataclass
class StagePlan:
    """One pipeline stage: its layers, its server host and its workers."""

    layers: tuple[int, int]  # [first, last) global layer indices
    server: str  # id of the device that runs this stage's server
    workers: list[str]  # ids of the devices that lease this stage's tasks
    standbys: list[str] = field(default_factory=list)  # hosts of its hot standby servers (shoal.plan.standby)


@dataclass
class Replica:
    """One pipeline replica of the model inside one network cluster (see ``docs/planner.md``)."""

    stages: list[StagePlan]  # its pipeline stages, in order; their layers cover the model
    micro_batches: int  # its share of the step's micro-batches (the replicas' shares sum to M)
    cluster: str = ""  # the network cluster it lives in (its regions joined by "+")


@dataclass
class SyncPolicy:
    """How each worker's parameters are synchronised with its stage server, and what is compressed.

    ``mode="sync"`` is exact synchronous training. ``mode="local"`` is DiLoCo inside each stage:
    every worker applies its own gradient each step (inner AdamW) and every ``sync_every`` steps
    pushes a pseudo-gradient and pulls the server's merged weights. See ``docs/sync-policies.md``.
    """

    mode: str = "sync"  # "sync" (exact), "async" (bounded staleness) or "local" (DiLoCo-style)
    grad_compression: float = 1.0  # extra factor on push & pull bytes (on top of push_codec/pull_codec)
    act_compression: float = 1.0  # extra factor on activation and activation-gradient bytes (on top of the codecs)
    sync_every: int = 1  # steps between parameter syncs ("local" mode: H)
    act_codec: str = "none"  # codec of activations sent forward (see shoal.plan.compression)
    grad_codec: str = "none"  # codec of activation gradients sent backward
    push_codec: str = "none"  # codec of gradient / pseudo-gradient pushes
    pull_codec: str = "none"  # codec of weight pulls (local mode: deltas against the worker's version)
    overlap: bool = True  # local mode: round r's sync runs while round r+1 computes (delayed application)
    overlap_uploads: bool = False  # a worker leases and computes its next task while its output uploads
    prefetch: bool = False  # a worker asks for its next task when it starts computing (lease + input during compute)
    lean: bool = False  # local mode: a worker holds 12 B a parameter (backward sums the step's gradients; bf16 inner moments): cost.stage_worker_memory
    ordered: bool = False  # exact sync: pushes as `shoal launch` sends them by default (ordered_grads, bitwise parity): a worker of a shared stage pushes each micro-batch's gradient alone (cost.ordered_push_count); False: one summed push a worker a step (--unordered-grads, shoal demo)

    @property
    def local(self) -> bool:
        """Whether workers train local replicas between syncs."""
        return self.mode == "local"

    def ratio(self, kind: str, dtype_bytes: int, rows: int = 0, channels: int = 0) -> float:
        """Wire bytes / raw bytes of traffic ``kind`` (act, grad, push, pull) under this policy;
        ``rows`` x ``channels``: the activation's shape (``ModelProfile.act_shape``), which sets
        what ``quad-pc`` costs per element (0: a 128-channel tensor of many rows) and, by the
        width, what ``lowrank`` pushes and pulls cost."""
        # The cost model asks this several times per stage of every candidate plan: no dict
        # built per call, and the codec's ratio memoised (see _codec_ratio).
        if kind == "act":
            return _codec_ratio(self.act_codec, dtype_bytes, rows, channels) * self.act_compression
        if kind == "grad":
            return _codec_ratio(self.grad_codec, dtype_bytes, rows, channels) * self.act_compression
        if kind == "push":  # (lowrank's rate depends on the width: channels)
            return _codec_ratio(self.push_codec, dtype_bytes, 0, channels) * self.grad_compression
        if kind == "pull":
            return _codec_ratio(self.pull_codec, dtype_bytes, 0, channels) * self.grad_compression
        raise KeyError(kind)


@dataclass
class Plan:
    """An allocation of a model over a scenario's devices."""

    scenario: str  # name of the scenario planned for
    model: str  # model preset
    method: str  # planner that made it: shoal, dtfm, swarm, dapple, random, exhaustive
    stages: list[StagePlan]  # pipeline stages, in order
    micro_batch_size: int  # sequences per micro-batch
    micro_batches: int  # micro-batches per step (M)
    sync: SyncPolicy = field(default_factory=SyncPolicy)  # parameter sync policy
    predicted: dict[str, float] = field(default_factory=dict)  # cost-model times in seconds
    planning_time_s: float = 0.0  # wall time the planner took
    standby_every: int = 1  # steps between a standby's state copies (the run's --ckpt-every)
    replicas: list[Replica] = field(default_factory=list)  # pipeline replicas; empty: one pipeline, ``stages``

    @property
    def pipelines(self) -> list[Replica]:
        """Every pipeline replica of the plan: ``replicas``, or ``stages`` as the one replica."""
        if self.replicas:
            return self.replicas
        return [Replica(stages=self.stages, micro_batches=self.micro_batches)]

    @property
    def all_stages(self) -> list[StagePlan]:
        """The stages of every replica, replica by replica."""
        return [st for r in self.pipelines for st in r.stages]

    @property
    def workers(self) -> list[str]:
        """Every device that works for the plan."""
        return [w for st in self.all_stages for w in st.workers]

    @property
    def predicted_step_time_s(self) -> float | None:
        return self.predicted.get("step_time_s")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["predicted_step_time_s"] = self.predicted_step_time_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        try:
            def stage_list(items: list[dict]) -> list[StagePlan]:
                return [StagePlan(layers=tuple(s["layers"]), server=s["server"], workers=list(s["workers"]),
                                  standbys=list(s.get("standbys", []))) for s in items]

            replicas = [Replica(stages=stage_list(r["stages"]), micro_batches=int(r["micro_batches"]),
                                cluster=str(r.get("cluster", ""))) for r in d.get("replicas", [])]
            stages = replicas[0].stages if replicas else stage_list(d["stages"])
            return cls(
                scenario=d["scenario"],
                model=d["model"],
                method=d.get("method", "file"),
                stages=stages,
                micro_batch_size=int(d["micro_batch_size"]),
                micro_batches=int(d["micro_batches"]),
                sync=SyncPolicy(**d.get("sync", {})),
                predicted=dict(d.get("predicted", {})),
                planning_time_s=float(d.get("planning_time_s", 0.0)),
                standby_every=int(d.get("standby_every", 1)),
                replicas=replicas,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShoalError(f"malformed plan: {exc!r}; expected the JSON written by `shoal plan --json`") from exc

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise ShoalError(f"plan file {p} does not exist; write one with `shoal plan --json {p}`")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ShoalError(f"plan file {p} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)
