"""Pieces every runtime role shares: the run spec, batches, stage splits, checkpoints.

Small pure functions here hold the decisions (layer split, worker assignment, lease
deadlines) so they can be unit-tested without processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import re
from collections.abc import Collection, Coroutine, Mapping
from pathlib import Path

import grpc
import torch

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig, get_preset
from shoal.net import shoal_pb2 as pb
from shoal.train.optim import OptimConfig

SCHEMA_VERSION = 1


def set_threads() -> None:
    """One torch thread per process: the machines we test on have two cores."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ.get("SHOAL_TORCH_THREADS", "1")))


def model_config(spec: pb.RunSpec) -> ModelConfig:
    """The model of a run: its preset, or the shape it carries (a model started from a HF folder)."""
    return _model_config(spec.model, spec.model_config_json)


@functools.lru_cache(maxsize=64)
def _model_config(model: str, config_json: str) -> ModelConfig:
    # Cached: servers size every streamed message by it (a frozen config, safe to share).
    if config_json:
        import json

        return ModelConfig.from_dict(json.loads(config_json))
    return get_preset(model)


def optim_config(spec: pb.RunSpec) -> OptimConfig:
    """The optimizer settings a run spec carries."""
    return OptimConfig(lr=spec.lr, min_lr=spec.min_lr, warmup_steps=spec.warmup,
                       weight_decay=spec.weight_decay, grad_clip=spec.grad_clip)


def run_precision(spec: pb.RunSpec) -> str:
    """The compute precision of a run ("fp32" when the spec leaves it empty)."""
    return spec.precision or "fp32"


def loss_scaling(spec: pb.RunSpec):
    """The fp16 dynamic loss-scaling rule of a run (:class:`LossScaleConfig`)."""
    from shoal.train.precision import LossScaleConfig

    if spec.loss_scale_init > 0:
        return LossScaleConfig(init_scale=spec.loss_scale_init)
    return LossScaleConfig()


def initial_scale(spec: pb.RunSpec) -> float:
    """Loss scale of step 0 of a run (1 unless the run is fp16)."""
    from shoal.train.precision import initial_loss_scale

    return initial_loss_scale(run_precision(spec), loss_scaling(spec))


def even_split(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Cut ``n_layers`` layers into ``stages`` contiguous ranges differing by at most one."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    out, first = [], 0
    for s in range(stages):
        last = first + base + (1 if s < extra else 0)
        out.append((first, last))
        first = last
    return out


def assign_workers(
    flops: dict[str, float], costs: list[float], current: dict[str, int] | None = None,
    fits: Mapping[str, Collection[int]] | None = None,
) -> dict[str, int]:
    """Worker -> stage, keeping ``current`` assignments, balancing FLOP/s per unit of cost.

    New workers (fastest first) go to the stage whose capacity per unit of work is lowest;
    a stage left without workers takes one from the stage with the most spare capacity
    (only stages with two or more workers give one up). Deterministic for equal inputs.

    ``fits``: the stages each worker's memory can hold (a worker not named: any). A worker is
    never put (or kept) on a stage outside its set; one that fits none is left out.
    """
    stages = len(costs)

    def ok(w: str, s: int) -> bool:
        return fits is None or w not in fits or s in fits[w]

    out = {w: s for w, s in (current or {}).items() if w in flops and 0 <= s < stages and ok(w, s)}

    def load(s: int) -> float:
        return sum(flops[w] for w, st in out.items() if st == s) / max(costs[s], 1e-12)

    for w in sorted((w for w in flops if w not in out), key=lambda w: (-flops[w], w)):
        room = [s for s in range(stages) if ok(w, s)]
        if room:
            out[w] = min(room, key=lambda s: (load(s), s))
    for s in range(stages):
        if any(st == s for st in out.values()):
            continue
        donors = [d for d in range(stages) if sum(1 for st in out.values() if st == d) >= 2
                  and any(st == d and ok(w, s) for w, st in out.items())]
        if not donors:
            continue
        donor = max(donors, key=lambda d: (load(d), -d))
        w = min((w for w, st in out.items() if st == donor and ok(w, s)), key=lambda w: (flops[w], w))
        out[w] = s
    return out


def lease_seconds(ewma_task_s: float | None, min_lease_s: float, factor: float = 4.0) -> float:
    """How long a lease lasts without renewal: max(min_lease, factor x EWMA task time)."""
    if ewma_task_s is None:
        return min_lease_s
    return max(min_lease_s, factor * ewma_task_s)


def heartbeat_period(dead_after_s: float, min_lease_s: float) -> float:
    """Seconds between a worker's heartbeats (each also renews its leases).

    A quarter of the shorter of the silence that declares it dead and the shortest lease,
    so four beats are missed before either runs out; at least 0.2 s and at most 1 s. Each
    beat is two RPCs that the coordinator and the stage server answer on the CPU that
    also computes (0.5 s at the defaults of 3 s and 2 s).
    """
    return min(1.0, max(0.2, min(dead_after_s, min_lease_s) / 4))


class DeafClock:
    """Time a process could not listen, so that it is never counted as its peers' silence.

    A reaper loop calls :meth:`tick` every ``period`` seconds. When a tick comes late (the
    event loop was held by something else, or the process was starved of CPU), the peers'
    messages of that stretch may still wait unread in the transport: the lateness beyond
    ``period`` is what :meth:`tick` returns, and the caller moves every peer's last sign of
    life forward by it. Only a peer silent for ``dead_after`` seconds of *listening* is dead.
    """

    def __init__(self, period: float, now: float, slack: float = 0.05):
        self.period, self.slack = period, slack  # expected tick spacing; lateness ignored below slack
        self.prev = now  # time of the previous tick
        self.deaf_s = 0.0  # total lateness excused so far (reports)

    def tick(self, now: float) -> float:
        """Seconds of this tick's lateness to excuse (0 when on time)."""
        late = now - self.prev - self.period
        self.prev = now
        if late <= self.slack:
            return 0.0
        self.deaf_s += late
        return late


def ewma(prev: float | None, x: float, alpha: float = 0.3) -> float:
    """Exponentially weighted moving average update."""
    return x if prev is None else (1 - alpha) * prev + alpha * x


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


class Signal:
    """Wakes every waiter on ``notify_all``; a wait has a timeout and is safe to cancel.

    Used where handlers long-poll for a state change. An ``asyncio.Condition`` wait that
    times out can be cancelled while it re-acquires its lock, which leaves the lock
    released under the waiter ("Lock is not acquired" on a loaded machine); everything
    here runs on one event loop, so no lock is needed: check, then wait for the next
    change. ``async with`` is accepted (a no-op) so notifiers read like a condition's.
    """

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    async def __aenter__(self) -> Signal:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    def notify_all(self) -> None:
        # Plain futures and a timer handle (no task per wait, as asyncio.wait_for makes):
        # handlers notify several times per task, and each long-poll waits here.
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)

    async def wait(self, timeout: float) -> bool:
        """Wait for the next ``notify_all`` up to ``timeout`` seconds; True if it came."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(max(timeout, 0.0), _time_out, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            with contextlib.suppress(ValueError):  # (a notified future has left the list already)
                self._waiters.remove(fut)


# ---------------------------------------------------------------------------- step traces

_TRACE: list = []  # [pid, open file] of this process's trace (SHOAL_TRACE); [] until the first event


def trace(who: str, event: str, **fields) -> None:
    """With ``SHOAL_TRACE=DIR``: append one JSON line (wall clock ``t``, member ``who``,
    ``event``, ``fields``) to ``DIR/trace-PID.jsonl``, to follow a step across processes
    (``bench/trace_step.py`` reads them; the folder is made if missing). Without it: nothing (one
    dictionary lookup). A trace that cannot be written is given up with one warning, never a
    member's life."""
    folder = os.environ.get("SHOAL_TRACE")
    if not folder:
        return
    import json
    import time

    if not _TRACE or _TRACE[0] != os.getpid():  # a forked member opens its own file
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            out = open(Path(folder) / f"trace-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        except OSError as exc:
            logging.getLogger("shoal").warning("SHOAL_TRACE=%s: cannot write the trace (%s); not tracing", folder, exc)
            out = None
        _TRACE[:] = [os.getpid(), out]
    if _TRACE[1] is not None:
        _TRACE[1].write(json.dumps({"t": time.time(), "who": who, "ev": event, **fields}) + "\n")


# ---------------------------------------------------------------------------- batches

_DATA_CACHE: dict[tuple, object] = {}


def data_available() -> bool:
    """Whether the corpus pipeline (shoal.data) is installed in this tree."""
    try:
        from shoal.data import get_micro_batch, load_data  # noqa: F401
    except ImportError:
        return False
    return True


def synthetic_window(seed: int, step: int, mb: int, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Random token windows ``(batch, seq_len + 1)`` keyed by (seed, step, mb): a stand-in when
    no corpus is wanted (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + mb * 101 + 17) % (2**62))
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)


def synthetic_micro_batch(seed: int, step: int, mb: int, batch: int, seq_len: int,
                          vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens keyed by (seed, step, mb): a stand-in when no corpus is wanted."""
    seq = synthetic_window(seed, step, mb, batch, seq_len, vocab)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def open_data(spec: pb.RunSpec):
    """The run's token data, opened once per process (None for synthetic data)."""
    if spec.data == "synthetic":
        return None
    from shoal.data import DataConfig, load_data

    vocab = model_config(spec).vocab_size
    key = (spec.data, vocab)
    if key not in _DATA_CACHE:
        # "corpus": the bundled text; otherwise a prepared folder, read from its memory-mapped
        # shards (only the B windows of each micro-batch are read).
        _DATA_CACHE[key] = load_data(DataConfig(paths=() if spec.data == "corpus" else (spec.data,)), vocab)
    return _DATA_CACHE[key]


def micro_batch(spec: pb.RunSpec, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of micro-batch ``mb`` of ``step``: the same in every process."""
    if spec.data == "synthetic":
        vocab = model_config(spec).vocab_size
        return synthetic_micro_batch(spec.seed, step, mb, spec.micro_batch_size, spec.seq_len, vocab)
    from shoal.data import get_micro_batch

    return get_micro_batch(open_data(spec), "train", spec.seed, step, mb, spec.micro_batch_size, spec.seq_len)


def token_window(spec: pb.RunSpec, step: int, mb: int) -> torch.Tensor:
    """Micro-batch ``mb`` of ``step`` as int32 token windows ``(B, T+1)``: what a task carries.

    The sampler's rows are ``T + 1`` consecutive tokens (inputs ``[:, :-1]``, targets
    ``[:, 1:]``, the tokens :func:`micro_batch` gives), so one window tensor holds both;
    :func:`split_window` undoes it. Drawn as windows directly (a stage server makes one per
    task: no split into inputs and targets and back).
    """
    if spec.data == "synthetic":
        window = synthetic_window(spec.seed, step, mb, spec.micro_batch_size, spec.seq_len,
                                  model_config(spec).vocab_size)
    else:
        from shoal.data import get_window

        window = get_window(open_data(spec), "train", spec.seed, step, mb, spec.micro_batch_size, spec.seq_len)
    return window.to(torch.int32)


def split_window(window: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) int64 of a task's token windows; WireError for ids outside the vocabulary."""
    from shoal.net.wire import WireError

    if window.numel() and (int(window.min()) < 0 or int(window.max()) >= vocab):
        raise WireError(f"task tokens outside the vocabulary [0, {vocab})")
    w = window.long()
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def data_identity(data: str) -> str:
    """The identity of a run's data source: the prepared folder's manifest ``content_hash``,
    ``""`` for the bundled ``corpus`` and ``synthetic`` tokens (ShoalError: not a prepared folder)."""
    import json

    if data in ("", "corpus", "synthetic"):
        return ""
    manifest = Path(data).expanduser() / "manifest.json"
    try:
        return str(json.loads(manifest.read_text())["content_hash"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ShoalError(f"{data!r} is not a prepared data folder (no readable {manifest.name}); "
                         "make one with: shoal data prepare INPUT... --out DIR") from None


def data_refusal(run_data: str, run_hash: str, server_hash: str) -> str:
    """Why a stage server with data ``server_hash`` cannot serve a run on ``run_data`` (hash
    ``run_hash``), in one line; ``""`` when it can. Stage servers feed the first stage's tokens
    and the last stage's targets, so each must hold the run's prepared data (workers hold none)."""
    if server_hash == run_hash:
        return ""
    if not run_hash:
        return (f"this run trains on {run_data or 'corpus'!r}, not on a prepared data folder: "
                "start the server without --data")
    if not server_hash:
        return (f"this run trains on prepared data (content_hash {run_hash[:16]}, folder {run_data} on the "
                "coordinator's host): start the server with --data DIR, a copy of that folder")
    return (f"this server's --data (content_hash {server_hash[:16]}) is not the run's prepared data "
            f"(content_hash {run_hash[:16]}, folder {run_data} on the coordinator's host): copy that folder "
            "to this host and pass it with --data DIR")


# ---------------------------------------------------------------------------- checkpoints

_CKPT_RE = re.compile(r"^v(\d+)\.safetensors$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def new_run_id() -> str:
    """A fresh run id: UTC time plus random bits (sortable, unique across reused folders)."""
    import secrets
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def ckpt_dir(root: str | Path, stage: int, run_id: str) -> Path:
    """The checkpoint folder of ``stage`` of run ``run_id``: ``root/run-<id>/stage<s>``.

    Every run writes, prunes and restores only under its own ``run-<id>`` folder, so a
    reused ``--ckpt-dir`` (or ``--out``) never mixes runs.
    """
    return _ckpt_dir(str(root), stage, run_id)


@functools.lru_cache(maxsize=256)
def _ckpt_dir(root: str, stage: int, run_id: str) -> Path:
    # Cached: servers ask on every heartbeat (pathlib and the check cost more than the listing).
    if not _RUN_ID_RE.match(run_id or ""):
        raise ShoalError(f"run id {run_id!r} is not a plain name; the coordinator gives every run one")
    return Path(root) / f"run-{run_id}" / f"stage{stage}"


def list_ckpts(root: str | Path, stage: int, run_id: str) -> list[int]:
    """Versions checkpointed for ``stage`` of run ``run_id`` under ``root``, ascending."""
    try:  # (names only: servers list their folder on every heartbeat)
        names = os.listdir(ckpt_dir(root, stage, run_id))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := _CKPT_RE.match(name)))


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_writer(name: str) -> int | None:
    """The writer's pid in a temporary checkpoint name ``.v<N>.<pid>.tmp`` (None: an older
    ``.v<N>.tmp`` name without one)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None


def clean_stray_temps(root: str | Path, stage: int, run_id: str) -> int:
    """Remove half-written checkpoint files a crash left; returns how many.

    A temporary file names its writer's pid: one another live process on this host is still
    writing is left alone (a server that just gave this stage up may still be saving it: two
    servers of one run share the folder under ``shoal launch``); this process's own are
    stale, since a server waits for its own write before it cleans."""
    d = ckpt_dir(root, stage, run_id)
    n = 0
    if d.is_dir():
        for p in d.glob(".v*.tmp"):
            pid = temp_writer(p.name)
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                continue
            p.unlink(missing_ok=True)
            n += 1
    return n


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of ``tensors`` in name order."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # The array itself, not a copy of its bytes: hashlib reads the buffer and lets go of the
        # interpreter lock while it hashes (a 400 MB stage: 0.2 s against 0.4 s with the copy).
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def save_stage_ckpt(root: str | Path, stage: int, version: int, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *, run_id: str, layers: tuple[int, int],
                    keep: int = 4, loss_scale: float = 1.0, outer_m: dict[str, torch.Tensor] | None = None,
                    keep_at: int | None = None, pull_ef: dict[str, torch.Tensor] | None = None) -> Path:
    """Write weights + AdamW state of a stage at ``version``, keep this run's last few
    (and the newest at or before ``keep_at``: the version a ban may roll back to).

    ``outer_m``: local mode's outer Nesterov momentum per parameter name (stored as
    ``outer_m/<name>``, restored by :func:`load_stage_ckpt`); ``pull_ef``: the residual of its
    sparse pulls' error feedback (``pull_ef/<name>``), so a resumed server sends what the
    updates before the stop still owe instead of dropping it.

    The tensors are written from where they are, not copied first (a copy of a gpt-1.3b
    stage's weights and AdamW state is 12 bytes a parameter, about 16 GB): the caller must not
    change them until this returns. A stage server's next commit, merge and load wait for the
    write (``StageServer._ckpt_written``); should they change anyway, the file's digest no
    longer matches and a load falls back to the previous checkpoint.

    The file carries the run id, stage, layer range, version and a sha256 of its tensors
    (checked by :func:`load_stage_ckpt`); it is written to a temporary name, synced and
    renamed, so ``v<N>.safetensors`` exists only once complete. A disk that is full or
    read-only is a one-line :class:`ShoalError`; the checkpoints already written stay.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    d = ckpt_dir(root, stage, run_id)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        tensors[f"param/{name}"] = p.detach().contiguous()
        st = optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if k in st:
                v = st[k]
                tensors[f"{k}/{name}"] = (v.detach().contiguous() if torch.is_tensor(v) else
                                          torch.tensor(float(v)))
    for name, m in (outer_m or {}).items():
        tensors[f"outer_m/{name}"] = m.detach().contiguous()
    for name, r in (pull_ef or {}).items():
        tensors[f"pull_ef/{name}"] = r.detach().contiguous()
    meta = {"version": str(version), "stage": str(stage), "run_id": run_id, "first": str(layers[0]),
            "last": str(layers[1]), "sha256": tensors_digest(tensors), "loss_scale": repr(float(loss_scale))}
    # The writer's pid in the name: two servers writing one version (a stage that just moved)
    # never share a temporary file, and clean_stray_temps leaves a live writer's alone.
    tmp = d / f".v{version}.{os.getpid()}.tmp"
    path = d / f"v{version}.safetensors"
    try:
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ShoalError(f"cannot write the stage {stage} checkpoint in {d}: {_os_reason(exc)}; "
                         f"free space or give a writable --ckpt-dir") from None
    for old in ckpts_to_prune(list_ckpts(root, stage, run_id), version, keep, keep_at):
        (d / f"v{old}.safetensors").unlink(missing_ok=True)
    return path


# Default T of --ckpt-every-s: the servers also checkpoint once T seconds of committed work are
# in no checkpoint, so a total stop (every process killed) redoes at most about T s of it.
CKPT_EVERY_S = 60.0


def ckpt_due(version: int, every: int, unsaved_s: float, every_s: float) -> bool:
    """Whether every stage checkpoints the weight version a commit makes (pure).

    ``every``: the step rule, each K-th version (0: no checkpoints at all, the time rule
    included); ``unsaved_s``: seconds of committed work since the last checkpoint, the time
    between commits summed; ``every_s``: the time rule, due once that reaches T (0: off).
    Whichever comes first: a total stop redoes at most about K steps or T seconds of committed
    work, the lesser (plus the step that crossed the bound while its checkpoint is written).
    """
    if every <= 0:
        return False
    return version % every == 0 or (every_s > 0 and unsaved_s >= every_s)


def ckpts_to_prune(versions: list[int], written: int, keep: int, keep_at: int | None = None) -> list[int]:
    """Versions to delete after writing ``written``: those older than the ``keep`` newest
    up to ``written``. Never ``written`` itself nor a newer file: a stage that rolled back
    (or a shared folder another server wrote further ahead) must not lose the file it has
    just written (:func:`abandoned_ckpts` removes the newer ones at the roll-back). Nor the
    newest version at or before ``keep_at`` (None: none): a ban's roll-back may need it
    (docs/poisoning-undo.md, "A ban undoes its work")."""
    upto = sorted(v for v in versions if v <= written)
    gone = upto[:-keep] if keep > 0 else upto[:-1]
    if keep_at is not None:
        pinned = [v for v in versions if v <= keep_at]
        if pinned:
            gone = [v for v in gone if v != max(pinned)]
    return gone


def abandoned_ckpts(versions: list[int], restart: int) -> list[int]:
    """Checkpoints newer than the version a stage restarts from: written in a history the
    run rolled back from, so never to be restored or copied to a standby."""
    return [v for v in versions if v > restart]


def remove_abandoned_ckpts(root: str | Path, stage: int, run_id: str, restart: int) -> list[int]:
    """Delete ``stage``'s checkpoints newer than ``restart`` (see :func:`abandoned_ckpts`)."""
    gone = abandoned_ckpts(list_ckpts(root, stage, run_id), restart)
    d = ckpt_dir(root, stage, run_id)
    for v in gone:
        (d / f"v{v}.safetensors").unlink(missing_ok=True)
    return gone


def _os_reason(exc: Exception) -> str:
    """The OS's words for a failed write (safetensors wraps them in its own error text)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    m = re.search(r'message: "([^"]+)"', str(exc))
    return m.group(1) if m else str(exc).splitlines()[0]


def read_stage_ckpt(root: str | Path, stage: int, version: int, *, run_id: str,
                    layers: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The tensors of a stage checkpoint after checking it; a bad one is a one-line ShoalError.

    Checked: readable (not truncated), run id, stage, layer range and version as
    expected, and the sha256 of the tensors.
    """
    from safetensors import safe_open

    path = ckpt_dir(root, stage, run_id) / f"v{version}.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise ShoalError(f"checkpoint {path} is unreadable (truncated or damaged): {exc}") from None
    want = {"run_id": run_id, "stage": str(stage), "version": str(version), "first": str(layers[0]),
            "last": str(layers[1])}
    for key, value in want.items():
        if meta.get(key) != value:
            raise ShoalError(f"checkpoint {path} has {key}={meta.get(key)!r}, expected {value!r}")
    if meta.get("sha256") != tensors_digest(tensors):
        raise ShoalError(f"checkpoint {path} fails its checksum (corrupted)")
    return tensors


def load_stage_ckpt(root: str | Path, stage: int, version: int, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *, run_id: str,
                    layers: tuple[int, int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Restore weights + AdamW state written by :func:`save_stage_ckpt` (checked first);
    returns the outer momentum and the sparse pulls' residual it holds (local mode; empty if none)."""
    tensors = read_stage_ckpt(root, stage, version, run_id=run_id, layers=layers)
    params = dict(module.named_parameters())
    missing = [n for n in params if f"param/{n}" not in tensors]
    if missing:
        raise ShoalError(f"checkpoint of stage {stage} v{version} lacks parameter {missing[0]!r}")
    optimizer.state.clear()
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param/{name}"])
            if f"exp_avg/{name}" in tensors:
                optimizer.state[p] = {
                    "step": tensors[f"step/{name}"].clone(),
                    "exp_avg": tensors[f"exp_avg/{name}"].clone(),
                    "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].clone(),
                }
    def group(prefix: str) -> dict[str, torch.Tensor]:
        return {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}

    return group("outer_m/"), group("pull_ef/")


def stage_ckpt_loss_scale(root: str | Path, stage: int, version: int, default: float, *, run_id: str) -> float:
    """The loss scale of the step after ``version`` saved with that checkpoint (fp16 runs)."""
    from safetensors import safe_open

    with safe_open(str(ckpt_dir(root, stage, run_id) / f"v{version}.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        return float(meta.get("loss_scale", default))
    except ValueError:
        return default


def finite(x: float) -> bool:
    return math.isfinite(x)


def run_member(main: Coroutine, coord: str, name: str = "") -> None:
    """Run a server's or worker's main loop (``name`` in the loop watch's reports:
    shoal.runtime.loopwatch); a refused join becomes a one-line error."""
    from shoal.runtime.loopwatch import watched

    try:
        asyncio.run(watched(main, name or "member"))
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                          grpc.StatusCode.INVALID_ARGUMENT):
            raise ShoalError(f"the coordinator at {coord} refused to let us join: {exc.details()}") from None
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise ShoalError(f"cannot reach the coordinator at {coord} ({exc.code().name}): is the run "
                             f"still going, the address right and the TLS keys the run's?") from None
        raise
