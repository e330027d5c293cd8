"""Pieces every runtime role shares: the run spec, batches, stage splits, checkpoints.

Small pure functions here hold the decisions (layer split, worker assignment, lease
deadlines) so they can be unit-tested without processes.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Coroutine
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
    if spec.model_config_json:
        import json

        return ModelConfig.from_dict(json.loads(spec.model_config_json))
    return get_preset(spec.model)


def optim_config(spec: pb.RunSpec) -> OptimConfig:
    """The optimizer settings a run spec carries."""
    return OptimConfig(lr=spec.lr, min_lr=spec.min_lr, warmup_steps=spec.warmup,
                       weight_decay=spec.weight_decay, grad_clip=spec.grad_clip)


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
    flops: dict[str, float], costs: list[float], current: dict[str, int] | None = None
) -> dict[str, int]:
    """Worker -> stage, keeping ``current`` assignments, balancing FLOP/s per unit of cost.

    New workers (fastest first) go to the stage whose capacity per unit of work is lowest;
    a stage left without workers takes one from the stage with the most spare capacity
    (only stages with two or more workers give one up). Deterministic for equal inputs.
    """
    stages = len(costs)
    out = {w: s for w, s in (current or {}).items() if w in flops and 0 <= s < stages}

    def load(s: int) -> float:
        return sum(flops[w] for w, st in out.items() if st == s) / max(costs[s], 1e-12)

    for w in sorted((w for w in flops if w not in out), key=lambda w: (-flops[w], w)):
        out[w] = min(range(stages), key=lambda s: (load(s), s))
    for s in range(stages):
        if any(st == s for st in out.values()):
            continue
        donors = [d for d in range(stages) if sum(1 for st in out.values() if st == d) >= 2]
        if not donors:
            continue
        donor = max(donors, key=lambda d: (load(d), -d))
        w = min((w for w, st in out.items() if st == donor), key=lambda w: (flops[w], w))
        out[w] = s
    return out


def lease_seconds(ewma_task_s: float | None, min_lease_s: float, factor: float = 4.0) -> float:
    """How long a lease lasts without renewal: max(min_lease, factor x EWMA task time)."""
    if ewma_task_s is None:
        return min_lease_s
    return max(min_lease_s, factor * ewma_task_s)


def ewma(prev: float | None, x: float, alpha: float = 0.3) -> float:
    """Exponentially weighted moving average update."""
    return x if prev is None else (1 - alpha) * prev + alpha * x


# ---------------------------------------------------------------------------- batches

_DATA_CACHE: dict[tuple, object] = {}


def data_available() -> bool:
    """Whether the corpus pipeline (shoal.data) is installed in this tree."""
    try:
        from shoal.data import get_micro_batch, load_data  # noqa: F401
    except ImportError:
        return False
    return True


def synthetic_micro_batch(seed: int, step: int, mb: int, batch: int, seq_len: int,
                          vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens keyed by (seed, step, mb): a stand-in when no corpus is wanted."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + mb * 101 + 17) % (2**62))
    seq = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def micro_batch(spec: pb.RunSpec, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of micro-batch ``mb`` of ``step``: the same in every process."""
    vocab = model_config(spec).vocab_size
    if spec.data == "synthetic":
        return synthetic_micro_batch(spec.seed, step, mb, spec.micro_batch_size, spec.seq_len, vocab)
    from shoal.data import DataConfig, get_micro_batch, load_data

    key = (spec.data, vocab)
    if key not in _DATA_CACHE:
        # "corpus": the bundled text; otherwise a prepared folder, read from its memory-mapped
        # shards (only the B windows of each micro-batch are read).
        _DATA_CACHE[key] = load_data(DataConfig(paths=() if spec.data == "corpus" else (spec.data,)), vocab)
    return get_micro_batch(_DATA_CACHE[key], "train", spec.seed, step, mb, spec.micro_batch_size,
                           spec.seq_len)


# ---------------------------------------------------------------------------- checkpoints

_CKPT_RE = re.compile(r"^v(\d+)\.safetensors$")


def ckpt_dir(root: str | Path, stage: int) -> Path:
    return Path(root) / f"stage{stage}"


def list_ckpts(root: str | Path, stage: int) -> list[int]:
    """Versions checkpointed for ``stage`` under ``root``, ascending."""
    d = ckpt_dir(root, stage)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _CKPT_RE.match(p.name)))


def save_stage_ckpt(root: str | Path, stage: int, version: int, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, keep: int = 4) -> Path:
    """Write weights + AdamW state of a stage at ``version`` (atomic rename), keep the last few."""
    from safetensors.torch import save_file

    d = ckpt_dir(root, stage)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        tensors[f"param/{name}"] = p.detach().contiguous().clone()
        st = optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq", "step"):
            if k in st:
                v = st[k]
                tensors[f"{k}/{name}"] = (v if torch.is_tensor(v) else torch.tensor(float(v))).detach().clone().reshape(
                    v.shape if torch.is_tensor(v) else ())
    tmp = d / f".v{version}.tmp"
    save_file(tensors, str(tmp), metadata={"version": str(version), "stage": str(stage)})
    path = d / f"v{version}.safetensors"
    os.replace(tmp, path)
    for old in list_ckpts(root, stage)[:-keep]:
        (d / f"v{old}.safetensors").unlink(missing_ok=True)
    return path


def load_stage_ckpt(root: str | Path, stage: int, version: int, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Restore weights + AdamW state written by :func:`save_stage_ckpt`."""
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt_dir(root, stage) / f"v{version}.safetensors"))
    params = dict(module.named_parameters())
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


def measure_flops(seconds: float = 0.2) -> float:
    """This process's matmul throughput in FLOP/s (fp32, one thread), measured briefly."""
    import time

    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / max(time.perf_counter() - t0, 1e-9)


def finite(x: float) -> bool:
    return math.isfinite(x)


def run_member(main: Coroutine, coord: str) -> None:
    """Run a server's or worker's main loop; a refused join becomes a one-line error."""
    try:
        asyncio.run(main)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ShoalError(f"the coordinator at {coord} refused to let us join: {exc.details()}") from None
        raise
