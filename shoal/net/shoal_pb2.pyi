from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FWD: _ClassVar[Direction]
    BWD: _ClassVar[Direction]
    FWDBWD: _ClassVar[Direction]
FWD: Direction
BWD: Direction
FWDBWD: Direction

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "codec", "meta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    codec: str
    meta: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., codec: _Optional[str] = ..., meta: _Optional[bytes] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("version", "model", "stages", "steps", "micro_batches", "micro_batch_size", "seq_len", "seed", "lr", "min_lr", "warmup", "weight_decay", "grad_clip", "ckpt_every", "dead_after_s", "min_lease_s", "max_message_bytes", "data", "ordered_grads", "chunk_bytes", "run_id", "precision", "loss_scale_init", "init_from", "model_config_json", "sync_mode", "sync_every", "outer_lr", "outer_momentum", "sync_overlap", "sync_lean", "guard_spot_check", "guard_server_checks", "shadow", "compress_act", "compress_grad", "compress_push", "compress_pull", "data_hash", "ckpt_every_s", "replica_stages", "replica_mbs", "replica_layers", "replica_regions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    CKPT_EVERY_FIELD_NUMBER: _ClassVar[int]
    DEAD_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    MIN_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ORDERED_GRADS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    SYNC_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    SYNC_LEAN_FIELD_NUMBER: _ClassVar[int]
    GUARD_SPOT_CHECK_FIELD_NUMBER: _ClassVar[int]
    GUARD_SERVER_CHECKS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_ACT_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_GRAD_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_PUSH_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_PULL_FIELD_NUMBER: _ClassVar[int]
    DATA_HASH_FIELD_NUMBER: _ClassVar[int]
    CKPT_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_MBS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_REGIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    model: str
    stages: int
    steps: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    seed: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    grad_clip: float
    ckpt_every: int
    dead_after_s: float
    min_lease_s: float
    max_message_bytes: int
    data: str
    ordered_grads: bool
    chunk_bytes: int
    run_id: str
    precision: str
    loss_scale_init: float
    init_from: str
    model_config_json: str
    sync_mode: str
    sync_every: int
    outer_lr: float
    outer_momentum: float
    sync_overlap: bool
    sync_lean: bool
    guard_spot_check: float
    guard_server_checks: bool
    shadow: bool
    compress_act: str
    compress_grad: str
    compress_push: str
    compress_pull: str
    data_hash: str
    ckpt_every_s: float
    replica_stages: _containers.RepeatedScalarFieldContainer[int]
    replica_mbs: _containers.RepeatedScalarFieldContainer[int]
    replica_layers: _containers.RepeatedScalarFieldContainer[int]
    replica_regions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., model: _Optional[str] = ..., stages: _Optional[int] = ..., steps: _Optional[int] = ..., micro_batches: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., seed: _Optional[int] = ..., lr: _Optional[float] = ..., min_lr: _Optional[float] = ..., warmup: _Optional[int] = ..., weight_decay: _Optional[float] = ..., grad_clip: _Optional[float] = ..., ckpt_every: _Optional[int] = ..., dead_after_s: _Optional[float] = ..., min_lease_s: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., data: _Optional[str] = ..., ordered_grads: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ..., run_id: _Optional[str] = ..., precision: _Optional[str] = ..., loss_scale_init: _Optional[float] = ..., init_from: _Optional[str] = ..., model_config_json: _Optional[str] = ..., sync_mode: _Optional[str] = ..., sync_every: _Optional[int] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., sync_overlap: _Optional[bool] = ..., sync_lean: _Optional[bool] = ..., guard_spot_check: _Optional[float] = ..., guard_server_checks: _Optional[bool] = ..., shadow: _Optional[bool] = ..., compress_act: _Optional[str] = ..., compress_grad: _Optional[str] = ..., compress_push: _Optional[str] = ..., compress_pull: _Optional[str] = ..., data_hash: _Optional[str] = ..., ckpt_every_s: _Optional[float] = ..., replica_stages: _Optional[_Iterable[int]] = ..., replica_mbs: _Optional[_Iterable[int]] = ..., replica_layers: _Optional[_Iterable[int]] = ..., replica_regions: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("role", "address", "flops", "name", "ckpt_version", "ckpt_stage", "schema", "device", "will_measure", "region", "up_bps", "down_bps", "standby", "data_hash")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CKPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CKPT_STAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WILL_MEASURE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    UP_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWN_BPS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    DATA_HASH_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    flops: float
    name: str
    ckpt_version: int
    ckpt_stage: int
    schema: int
    device: str
    will_measure: bool
    region: str
    up_bps: float
    down_bps: float
    standby: bool
    data_hash: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., flops: _Optional[float] = ..., name: _Optional[str] = ..., ckpt_version: _Optional[int] = ..., ckpt_stage: _Optional[int] = ..., schema: _Optional[int] = ..., device: _Optional[str] = ..., will_measure: _Optional[bool] = ..., region: _Optional[str] = ..., up_bps: _Optional[float] = ..., down_bps: _Optional[float] = ..., standby: _Optional[bool] = ..., data_hash: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("member_id", "spec", "credential", "run_secret", "role", "run_key")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    RUN_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    spec: RunSpec
    credential: str
    run_secret: bytes
    role: str
    run_key: bytes
    def __init__(self, member_id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., credential: _Optional[str] = ..., run_secret: _Optional[bytes] = ..., role: _Optional[str] = ..., run_key: _Optional[bytes] = ...) -> None: ...

class MemberRequest(_message.Message):
    __slots__ = ("member_id", "version", "ckpt_version", "epoch", "counter_id", "traffic", "role", "observed_flops", "observed_tasks", "observed_pull_s", "observed_pull_bytes", "observed_pulls", "stats", "fatal", "guard_bans", "standby_held", "standby_decisions_from", "doing", "alive", "ckpt_versions", "guard_unverified", "leave_reason")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CKPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COUNTER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FLOPS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TASKS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_PULL_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_PULLS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    GUARD_BANS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_HELD_FIELD_NUMBER: _ClassVar[int]
    STANDBY_DECISIONS_FROM_FIELD_NUMBER: _ClassVar[int]
    DOING_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CKPT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GUARD_UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    LEAVE_REASON_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    version: int
    ckpt_version: int
    epoch: int
    counter_id: str
    traffic: _containers.RepeatedCompositeFieldContainer[ByteCount]
    role: str
    observed_flops: float
    observed_tasks: int
    observed_pull_s: float
    observed_pull_bytes: int
    observed_pulls: int
    stats: MemberStats
    fatal: str
    guard_bans: _containers.RepeatedCompositeFieldContainer[GuardBan]
    standby_held: _containers.RepeatedCompositeFieldContainer[StandbyHeld]
    standby_decisions_from: int
    doing: str
    alive: _containers.RepeatedScalarFieldContainer[str]
    ckpt_versions: _containers.RepeatedScalarFieldContainer[int]
    guard_unverified: _containers.RepeatedCompositeFieldContainer[GuardUnverified]
    leave_reason: str
    def __init__(self, member_id: _Optional[str] = ..., version: _Optional[int] = ..., ckpt_version: _Optional[int] = ..., epoch: _Optional[int] = ..., counter_id: _Optional[str] = ..., traffic: _Optional[_Iterable[_Union[ByteCount, _Mapping]]] = ..., role: _Optional[str] = ..., observed_flops: _Optional[float] = ..., observed_tasks: _Optional[int] = ..., observed_pull_s: _Optional[float] = ..., observed_pull_bytes: _Optional[int] = ..., observed_pulls: _Optional[int] = ..., stats: _Optional[_Union[MemberStats, _Mapping]] = ..., fatal: _Optional[str] = ..., guard_bans: _Optional[_Iterable[_Union[GuardBan, _Mapping]]] = ..., standby_held: _Optional[_Iterable[_Union[StandbyHeld, _Mapping]]] = ..., standby_decisions_from: _Optional[int] = ..., doing: _Optional[str] = ..., alive: _Optional[_Iterable[str]] = ..., ckpt_versions: _Optional[_Iterable[int]] = ..., guard_unverified: _Optional[_Iterable[_Union[GuardUnverified, _Mapping]]] = ..., leave_reason: _Optional[str] = ...) -> None: ...

class StandbyHeld(_message.Message):
    __slots__ = ("stage", "version")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    stage: int
    version: int
    def __init__(self, stage: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class GuardBan(_message.Message):
    __slots__ = ("worker", "reason", "stage", "step", "undo_from")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    UNDO_FROM_FIELD_NUMBER: _ClassVar[int]
    worker: str
    reason: str
    stage: int
    step: int
    undo_from: int
    def __init__(self, worker: _Optional[str] = ..., reason: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., undo_from: _Optional[int] = ...) -> None: ...

class GuardUnverified(_message.Message):
    __slots__ = ("worker", "step")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker: str
    step: int
    def __init__(self, worker: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class MemberStats(_message.Message):
    __slots__ = ("stage", "tasks_done", "compute_s", "step", "pool_todo", "pool_waiting", "leases", "workers", "last_step", "standby_logging", "standby_lagging", "held", "wait_input", "wait_grad", "unpushed", "committing", "step_s", "peak_rss")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POOL_TODO_FIELD_NUMBER: _ClassVar[int]
    POOL_WAITING_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STANDBY_LOGGING_FIELD_NUMBER: _ClassVar[int]
    STANDBY_LAGGING_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    WAIT_INPUT_FIELD_NUMBER: _ClassVar[int]
    WAIT_GRAD_FIELD_NUMBER: _ClassVar[int]
    UNPUSHED_FIELD_NUMBER: _ClassVar[int]
    COMMITTING_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    tasks_done: int
    compute_s: float
    step: int
    pool_todo: int
    pool_waiting: int
    leases: int
    workers: int
    last_step: StepSplit
    standby_logging: _containers.RepeatedScalarFieldContainer[str]
    standby_lagging: _containers.RepeatedScalarFieldContainer[str]
    held: _containers.RepeatedCompositeFieldContainer[HeldLease]
    wait_input: int
    wait_grad: int
    unpushed: _containers.RepeatedScalarFieldContainer[str]
    committing: bool
    step_s: float
    peak_rss: int
    def __init__(self, stage: _Optional[int] = ..., tasks_done: _Optional[int] = ..., compute_s: _Optional[float] = ..., step: _Optional[int] = ..., pool_todo: _Optional[int] = ..., pool_waiting: _Optional[int] = ..., leases: _Optional[int] = ..., workers: _Optional[int] = ..., last_step: _Optional[_Union[StepSplit, _Mapping]] = ..., standby_logging: _Optional[_Iterable[str]] = ..., standby_lagging: _Optional[_Iterable[str]] = ..., held: _Optional[_Iterable[_Union[HeldLease, _Mapping]]] = ..., wait_input: _Optional[int] = ..., wait_grad: _Optional[int] = ..., unpushed: _Optional[_Iterable[str]] = ..., committing: _Optional[bool] = ..., step_s: _Optional[float] = ..., peak_rss: _Optional[int] = ...) -> None: ...

class HeldLease(_message.Message):
    __slots__ = ("worker", "tasks", "oldest_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_S_FIELD_NUMBER: _ClassVar[int]
    worker: str
    tasks: int
    oldest_s: float
    def __init__(self, worker: _Optional[str] = ..., tasks: _Optional[int] = ..., oldest_s: _Optional[float] = ...) -> None: ...

class StepSplit(_message.Message):
    __slots__ = ("step", "total_s", "compute_s", "transfer_s", "sync_s", "waiting_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_s: float
    compute_s: float
    transfer_s: float
    sync_s: float
    waiting_s: float
    def __init__(self, step: _Optional[int] = ..., total_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., sync_s: _Optional[float] = ..., waiting_s: _Optional[float] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("target", "rtt_s", "up_bps", "down_bps", "same_host", "method")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    UP_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWN_BPS_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    target: str
    rtt_s: float
    up_bps: float
    down_bps: float
    same_host: bool
    method: str
    def __init__(self, target: _Optional[str] = ..., rtt_s: _Optional[float] = ..., up_bps: _Optional[float] = ..., down_bps: _Optional[float] = ..., same_host: _Optional[bool] = ..., method: _Optional[str] = ...) -> None: ...

class MeasureReport(_message.Message):
    __slots__ = ("member_id", "request", "device_name", "memory", "flops", "links", "measure_s", "address")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    MEASURE_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    request: int
    device_name: str
    memory: float
    flops: float
    links: _containers.RepeatedCompositeFieldContainer[LinkProbe]
    measure_s: float
    address: str
    def __init__(self, member_id: _Optional[str] = ..., request: _Optional[int] = ..., device_name: _Optional[str] = ..., memory: _Optional[float] = ..., flops: _Optional[float] = ..., links: _Optional[_Iterable[_Union[LinkProbe, _Mapping]]] = ..., measure_s: _Optional[float] = ..., address: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes", "tcp_stats")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TCP_STATS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    tcp_stats: bool
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ..., tcp_stats: _Optional[bool] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("payload", "host", "tcp")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    host: str
    tcp: TcpStats
    def __init__(self, payload: _Optional[bytes] = ..., host: _Optional[str] = ..., tcp: _Optional[_Union[TcpStats, _Mapping]] = ...) -> None: ...

class TcpStats(_message.Message):
    __slots__ = ("bytes_acked", "busy_us")
    BYTES_ACKED_FIELD_NUMBER: _ClassVar[int]
    BUSY_US_FIELD_NUMBER: _ClassVar[int]
    bytes_acked: int
    busy_us: int
    def __init__(self, bytes_acked: _Optional[int] = ..., busy_us: _Optional[int] = ...) -> None: ...

class ByteCount(_message.Message):
    __slots__ = ("kind", "codec", "raw", "wire", "messages")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    codec: str
    raw: int
    wire: int
    messages: int
    def __init__(self, kind: _Optional[str] = ..., codec: _Optional[str] = ..., raw: _Optional[int] = ..., wire: _Optional[int] = ..., messages: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("known", "stage", "first", "last", "servers", "ready", "epoch", "restart_version", "done", "measure", "move_now", "guard_banned", "guard_keep", "standby_for", "standby_first", "standby_last", "standby_source", "standby_decisions", "standby_peers", "forgotten", "beat_floor_s", "server_ids", "send_final")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTART_VERSION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    MOVE_NOW_FIELD_NUMBER: _ClassVar[int]
    GUARD_BANNED_FIELD_NUMBER: _ClassVar[int]
    GUARD_KEEP_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FOR_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIRST_FIELD_NUMBER: _ClassVar[int]
    STANDBY_LAST_FIELD_NUMBER: _ClassVar[int]
    STANDBY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STANDBY_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_PEERS_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    BEAT_FLOOR_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_IDS_FIELD_NUMBER: _ClassVar[int]
    SEND_FINAL_FIELD_NUMBER: _ClassVar[int]
    known: bool
    stage: int
    first: int
    last: int
    servers: _containers.RepeatedScalarFieldContainer[str]
    ready: bool
    epoch: int
    restart_version: int
    done: bool
    measure: int
    move_now: bool
    guard_banned: str
    guard_keep: int
    standby_for: int
    standby_first: int
    standby_last: int
    standby_source: str
    standby_decisions: _containers.RepeatedCompositeFieldContainer[StandbyDecision]
    standby_peers: _containers.RepeatedScalarFieldContainer[str]
    forgotten: str
    beat_floor_s: float
    server_ids: _containers.RepeatedScalarFieldContainer[str]
    send_final: bool
    def __init__(self, known: _Optional[bool] = ..., stage: _Optional[int] = ..., first: _Optional[int] = ..., last: _Optional[int] = ..., servers: _Optional[_Iterable[str]] = ..., ready: _Optional[bool] = ..., epoch: _Optional[int] = ..., restart_version: _Optional[int] = ..., done: _Optional[bool] = ..., measure: _Optional[int] = ..., move_now: _Optional[bool] = ..., guard_banned: _Optional[str] = ..., guard_keep: _Optional[int] = ..., standby_for: _Optional[int] = ..., standby_first: _Optional[int] = ..., standby_last: _Optional[int] = ..., standby_source: _Optional[str] = ..., standby_decisions: _Optional[_Iterable[_Union[StandbyDecision, _Mapping]]] = ..., standby_peers: _Optional[_Iterable[str]] = ..., forgotten: _Optional[str] = ..., beat_floor_s: _Optional[float] = ..., server_ids: _Optional[_Iterable[str]] = ..., send_final: _Optional[bool] = ...) -> None: ...

class StandbyDecision(_message.Message):
    __slots__ = ("epoch", "step", "lr", "coef", "skip", "next_loss_scale", "checkpoint")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    COEF_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    NEXT_LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    lr: float
    coef: float
    skip: bool
    next_loss_scale: float
    checkpoint: bool
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., lr: _Optional[float] = ..., coef: _Optional[float] = ..., skip: _Optional[bool] = ..., next_loss_scale: _Optional[float] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class StandbyStep(_message.Message):
    __slots__ = ("member_id", "stage", "epoch", "step", "grads", "first", "last")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    stage: int
    epoch: int
    step: int
    grads: _containers.RepeatedCompositeFieldContainer[Tensor]
    first: int
    last: int
    def __init__(self, member_id: _Optional[str] = ..., stage: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., grads: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class StandbyStepAck(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StandbyCkptRequest(_message.Message):
    __slots__ = ("member_id", "stage", "have")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    stage: int
    have: int
    def __init__(self, member_id: _Optional[str] = ..., stage: _Optional[int] = ..., have: _Optional[int] = ...) -> None: ...

class StandbyCkpt(_message.Message):
    __slots__ = ("version", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("member_id", "stage", "step", "epoch", "sq_norm", "losses", "tasks_per_worker", "requeues", "param_sq_norms", "unverified", "last_step")
    class TasksPerWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    TASKS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEUES_FIELD_NUMBER: _ClassVar[int]
    PARAM_SQ_NORMS_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    stage: int
    step: int
    epoch: int
    sq_norm: float
    losses: _containers.RepeatedScalarFieldContainer[float]
    tasks_per_worker: _containers.ScalarMap[str, int]
    requeues: int
    param_sq_norms: _containers.RepeatedScalarFieldContainer[float]
    unverified: _containers.RepeatedScalarFieldContainer[str]
    last_step: StepSplit
    def __init__(self, member_id: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., sq_norm: _Optional[float] = ..., losses: _Optional[_Iterable[float]] = ..., tasks_per_worker: _Optional[_Mapping[str, int]] = ..., requeues: _Optional[int] = ..., param_sq_norms: _Optional[_Iterable[float]] = ..., unverified: _Optional[_Iterable[str]] = ..., last_step: _Optional[_Union[StepSplit, _Mapping]] = ...) -> None: ...

class StepDecision(_message.Message):
    __slots__ = ("ready", "coef", "lr", "stale", "skip", "next_loss_scale", "checkpoint")
    READY_FIELD_NUMBER: _ClassVar[int]
    COEF_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    NEXT_LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    coef: float
    lr: float
    stale: bool
    skip: bool
    next_loss_scale: float
    checkpoint: bool
    def __init__(self, ready: _Optional[bool] = ..., coef: _Optional[float] = ..., lr: _Optional[float] = ..., stale: _Optional[bool] = ..., skip: _Optional[bool] = ..., next_loss_scale: _Optional[float] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinalWeightsReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("step", "mb", "stage", "direction", "epoch", "lease_id", "input", "out_grad", "deadline_s", "loss_scale", "tokens", "check_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MB_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUT_GRAD_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    mb: int
    stage: int
    direction: Direction
    epoch: int
    lease_id: int
    input: Tensor
    out_grad: Tensor
    deadline_s: float
    loss_scale: float
    tokens: Tensor
    check_id: int
    def __init__(self, step: _Optional[int] = ..., mb: _Optional[int] = ..., stage: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., out_grad: _Optional[_Union[Tensor, _Mapping]] = ..., deadline_s: _Optional[float] = ..., loss_scale: _Optional[float] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., check_id: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("worker", "wait_s", "ahead", "started", "ask_id")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ASK_ID_FIELD_NUMBER: _ClassVar[int]
    worker: str
    wait_s: float
    ahead: bool
    started: int
    ask_id: int
    def __init__(self, worker: _Optional[str] = ..., wait_s: _Optional[float] = ..., ahead: _Optional[bool] = ..., started: _Optional[int] = ..., ask_id: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("has_task", "task", "version", "gen", "flush", "epoch", "step", "wrong_stage", "credit", "ask_id", "result", "local_step", "local_lr", "local_coef", "local_skip", "local_sync", "local_merged")
    HAS_TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WRONG_STAGE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    ASK_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_COEF_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SKIP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SYNC_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MERGED_FIELD_NUMBER: _ClassVar[int]
    has_task: bool
    task: Task
    version: int
    gen: int
    flush: bool
    epoch: int
    step: int
    wrong_stage: bool
    credit: int
    ask_id: int
    result: CompleteReply
    local_step: int
    local_lr: float
    local_coef: float
    local_skip: bool
    local_sync: bool
    local_merged: int
    def __init__(self, has_task: _Optional[bool] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., version: _Optional[int] = ..., gen: _Optional[int] = ..., flush: _Optional[bool] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., wrong_stage: _Optional[bool] = ..., credit: _Optional[int] = ..., ask_id: _Optional[int] = ..., result: _Optional[_Union[CompleteReply, _Mapping]] = ..., local_step: _Optional[int] = ..., local_lr: _Optional[float] = ..., local_coef: _Optional[float] = ..., local_skip: _Optional[bool] = ..., local_sync: _Optional[bool] = ..., local_merged: _Optional[int] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("worker", "step", "mb", "direction", "epoch", "lease_id", "output", "loss", "compute_s", "next")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MB_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    worker: str
    step: int
    mb: int
    direction: Direction
    epoch: int
    lease_id: int
    output: Tensor
    loss: float
    compute_s: float
    next: LeaseRequest
    def __init__(self, worker: _Optional[str] = ..., step: _Optional[int] = ..., mb: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., compute_s: _Optional[float] = ..., next: _Optional[_Union[LeaseRequest, _Mapping]] = ...) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ("accepted", "reason", "gen", "lease_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    gen: int
    lease_id: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., gen: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class GradPush(_message.Message):
    __slots__ = ("worker", "step", "epoch", "gen", "mbs", "grads", "local_done", "local_sq_norm", "local_round", "local_mbs", "local_weights", "local_param_sq", "local_withdraw", "check_id")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    MBS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DONE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MBS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PARAM_SQ_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    CHECK_ID_FIELD_NUMBER: _ClassVar[int]
    worker: str
    step: int
    epoch: int
    gen: int
    mbs: _containers.RepeatedScalarFieldContainer[int]
    grads: _containers.RepeatedCompositeFieldContainer[Tensor]
    local_done: bool
    local_sq_norm: float
    local_round: int
    local_mbs: int
    local_weights: bool
    local_param_sq: _containers.RepeatedScalarFieldContainer[float]
    local_withdraw: bool
    check_id: int
    def __init__(self, worker: _Optional[str] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., gen: _Optional[int] = ..., mbs: _Optional[_Iterable[int]] = ..., grads: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., local_done: _Optional[bool] = ..., local_sq_norm: _Optional[float] = ..., local_round: _Optional[int] = ..., local_mbs: _Optional[int] = ..., local_weights: _Optional[bool] = ..., local_param_sq: _Optional[_Iterable[float]] = ..., local_withdraw: _Optional[bool] = ..., check_id: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason", "gen")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    gen: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., gen: _Optional[int] = ...) -> None: ...

class TakeBack(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("worker", "lease_ids", "pushing")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSHING_FIELD_NUMBER: _ClassVar[int]
    worker: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    pushing: int
    def __init__(self, worker: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ..., pushing: _Optional[int] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("version", "epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("worker", "compress_chain", "compress_version")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_CHAIN_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker: str
    compress_chain: str
    compress_version: int
    def __init__(self, worker: _Optional[str] = ..., compress_chain: _Optional[str] = ..., compress_version: _Optional[int] = ...) -> None: ...

class WeightsReply(_message.Message):
    __slots__ = ("version", "epoch", "first", "last", "params", "compress_delta", "compress_chain", "compress_base")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_DELTA_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_CHAIN_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_BASE_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    first: int
    last: int
    params: _containers.RepeatedCompositeFieldContainer[Tensor]
    compress_delta: bool
    compress_chain: str
    compress_base: int
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ..., first: _Optional[int] = ..., last: _Optional[int] = ..., params: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., compress_delta: _Optional[bool] = ..., compress_chain: _Optional[str] = ..., compress_base: _Optional[int] = ...) -> None: ...

class Relay(_message.Message):
    __slots__ = ("step", "mb", "epoch", "direction", "tensor", "relay_id")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    step: int
    mb: int
    epoch: int
    direction: Direction
    tensor: Tensor
    relay_id: int
    def __init__(self, step: _Optional[int] = ..., mb: _Optional[int] = ..., epoch: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., relay_id: _Optional[int] = ...) -> None: ...

class RelayReply(_message.Message):
    __slots__ = ("accepted", "reason", "retry", "relay_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    retry: bool
    relay_id: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., retry: _Optional[bool] = ..., relay_id: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("kind", "total", "offset", "data", "sender")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    total: int
    offset: int
    data: bytes
    sender: str
    def __init__(self, kind: _Optional[str] = ..., total: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sender: _Optional[str] = ...) -> None: ...

class ReplicaPart(_message.Message):
    __slots__ = ("member_id", "epoch", "round", "stage", "mbs", "weights", "tensors")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    epoch: int
    round: int
    stage: int
    mbs: int
    weights: bool
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, member_id: _Optional[str] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., stage: _Optional[int] = ..., mbs: _Optional[int] = ..., weights: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...
