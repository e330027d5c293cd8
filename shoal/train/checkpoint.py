"""Checkpoints: model weights, AdamW state and run state in one folder, written atomically.

A checkpoint folder holds

* ``model.safetensors`` -- the state dict, keyed by global parameter names
  (``layers.3.attn.wqkv.weight``); a stage server saves only its stage's parameters, and
  the checkpoints of all stages together form the full model's state dict;
* ``optimizer.safetensors`` -- the AdamW state by parameter name:
  ``<name>.exp_avg``, ``<name>.exp_avg_sq`` and ``<name>.step`` (a 0-d float tensor);
* ``state.json`` -- JSON: at least ``step`` (optimizer steps completed), plus whatever the
  writer adds (the local trainer: ``config``, ``model_config``, ``metrics``).

The folder is first written under a temporary name beside the target and then renamed
into place (the previous checkpoint is moved aside first and deleted last), so a crash at
any instant leaves a complete checkpoint: either the new one or the old one.
Nothing here unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shoal.errors import ShoalError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
# AdamW's per-parameter state entries that a checkpoint carries.
ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns."""

    model_state: dict[str, torch.Tensor]  # parameter name -> tensor
    optimizer_state: dict[str, torch.Tensor]  # "<param name>.<exp_avg|exp_avg_sq|step>" -> tensor
    state: dict[str, Any]  # the JSON run state (``step`` and the writer's fields)


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]]
) -> dict[str, torch.Tensor]:
    """AdamW state as flat tensors keyed ``<param name>.<entry>`` (params never stepped are absent)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named_params:
        st = optimizer.state.get(p)
        if not st:
            continue
        for key in ADAMW_KEYS:
            v = st[key]
            out[f"{name}.{key}"] = (v if isinstance(v, torch.Tensor) else torch.tensor(float(v))).detach().clone()
    return out


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Restore AdamW state written by :func:`optimizer_state_by_name` (exact, bit for bit)."""
    named = list(named_params)
    known = {f"{n}.{k}" for n, _ in named for k in ADAMW_KEYS}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ShoalError(f"optimizer state has entries for unknown parameters (e.g. {unknown[0]!r}); wrong checkpoint?")
    for name, p in named:
        present = [f"{name}.{k}" in tensors for k in ADAMW_KEYS]
        if not any(present):
            continue
        if not all(present):
            raise ShoalError(f"optimizer state of {name!r} is incomplete in the checkpoint")
        exp_avg, exp_avg_sq = tensors[f"{name}.exp_avg"], tensors[f"{name}.exp_avg_sq"]
        if exp_avg.shape != p.shape or exp_avg_sq.shape != p.shape:
            raise ShoalError(f"optimizer state of {name!r} has shape {tuple(exp_avg.shape)}, parameter has {tuple(p.shape)}")
        optimizer.state[p] = {
            "step": tensors[f"{name}.step"].clone().to(torch.float32),
            "exp_avg": exp_avg.clone().to(device=p.device, dtype=p.dtype),
            "exp_avg_sq": exp_avg_sq.clone().to(device=p.device, dtype=p.dtype),
        }


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as safetensors takes them: contiguous, on the CPU, no two sharing storage.

    Only a tensor that is not so already is copied (a tied weight's second name, a view): the
    callers write synchronously, so the others are written from where they are. Copying every
    tensor would be a transient copy of the weights and both AdamW moments (12 bytes a
    parameter) on each checkpoint of the local trainer and on the launcher's final weights."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in tensors.items():
        t = v.detach().cpu().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def save_checkpoint(
    path: str | Path,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor],
    state: dict[str, Any],
) -> Path:
    """Write a checkpoint folder at ``path`` atomically (replacing an older one); return it."""
    path = Path(path)
    if "step" not in state:
        raise ValueError("checkpoint state needs a 'step'")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        save_file(_plain(model_state), str(tmp / MODEL_FILE))
        save_file(_plain(optimizer_state), str(tmp / OPTIMIZER_FILE))
        with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        # mkdtemp and safetensors create owner-only modes; use the usual ones (umask applies).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.rmdir(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _find(path: Path) -> Path:
    if (path / STATE_FILE).exists():
        return path
    # A crash between moving the old checkpoint aside and renaming the new one in.
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(olds):
        if (old / STATE_FILE).exists():
            return old
    raise ShoalError(f"no checkpoint at {str(path)!r}")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint folder written by :func:`save_checkpoint`."""
    where = _find(Path(path))
    try:
        state = json.loads((where / STATE_FILE).read_text(encoding="utf-8"))
        model_state = load_file(str(where / MODEL_FILE))
        opt_file = where / OPTIMIZER_FILE
        optimizer_state = load_file(str(opt_file)) if opt_file.exists() else {}
    except (OSError, ValueError, SafetensorError) as exc:
        raise ShoalError(f"checkpoint at {str(where)!r} is unreadable: {exc}") from None
    return Checkpoint(model_state, optimizer_state, state)
