"""Devices and numeric precision: shared by ``shoal train --local``, workers and servers.

* ``--device auto|cpu|cuda|cuda:N``: where a process computes (``auto``: the first CUDA
  device if there is one, else the CPU). Stage servers always keep fp32 master weights
  and AdamW state on the CPU.
* ``--precision fp32|bf16|fp16``: the compute dtype of forward and backward. ``bf16`` and
  ``fp16`` run under ``torch.autocast``; parameters (and their gradients) stay fp32. The
  embedding casts its output to the compute dtype, so the residual stream, and with it
  every activation between stages, is in the compute dtype.
* ``fp16`` adds dynamic loss scaling: the loss of step ``t`` is multiplied by the scale
  ``S_t`` (a power of two) before backward, gradients are divided by ``S_t`` before the
  norm and the update, and a step whose gradients overflow (non-finite norm) is skipped
  (no AdamW update; the schedule still moves on). :func:`next_loss_scale` gives
  ``S_{t+1}`` from ``S_t`` and whether step ``t`` overflowed. In a swarm the coordinator
  computes it once per step and sends it with the step's decision, so every stage uses the
  same scale and skips the same steps.

Importable without torch at module level (the CLI builds ``--help`` from it).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.errors import ShoalError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling of fp16 runs (the usual grow-slowly / halve-on-overflow rule)."""

    init_scale: float = 2.0**16  # scale of step 0 (a power of two keeps scaling exact)
    growth_factor: float = 2.0  # the scale is multiplied by this after growth_interval good steps
    backoff_factor: float = 0.5  # and by this after a step whose gradients overflowed
    growth_interval: int = 200  # consecutive good steps before the scale grows
    min_scale: float = 1.0  # the scale never drops below this


def check_precision(name: str) -> str:
    """``name`` if it is a known precision, else a one-line :class:`ShoalError`."""
    if name not in PRECISIONS:
        raise ShoalError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}")
    return name


def wire_dtype(precision: str) -> str:
    """Name of the dtype activations travel in (``shoal.net.wire`` names) for ``precision``."""
    return _DTYPE_NAMES[check_precision(precision)]


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype forward and backward run in."""
    import torch

    return getattr(torch, wire_dtype(precision))


def resolve_device(name: str | None) -> torch.device:
    """The torch device for ``--device`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``).

    A CUDA device on a machine without one is a one-line :class:`ShoalError`.
    """
    import torch

    name = (name or "auto").strip()
    if name == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        index = 0
        if name != "cuda":
            try:
                index = int(name.split(":", 1)[1])
            except ValueError:
                raise ShoalError(f"--device {name}: expected cuda:N with N a device number") from None
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            raise ShoalError(f"--device {name}: {why}; use --device cpu (or auto)")
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ShoalError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    raise ShoalError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def check_device_precision(device: torch.device, precision: str) -> None:
    """Refuse combinations the hardware cannot run, with a one-line error."""
    import torch

    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ShoalError(f"{device} does not support bf16; use --precision fp16 (or fp32)")


def autocast(device: torch.device, precision: str):
    """Context of forward (and loss) computation: autocast for bf16/fp16, nothing for fp32."""
    import torch

    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(precision))


def initial_loss_scale(precision: str, cfg: LossScaleConfig = LossScaleConfig()) -> float:
    """Loss scale of step 0: ``cfg.init_scale`` in fp16, 1 (no scaling) otherwise."""
    return cfg.init_scale if precision == "fp16" else 1.0


def next_loss_scale(scale: float, good_steps: int, overflow: bool,
                    cfg: LossScaleConfig = LossScaleConfig()) -> tuple[float, int]:
    """(scale, consecutive good steps) after a step that did or did not overflow."""
    if overflow:
        return max(cfg.min_scale, scale * cfg.backoff_factor), 0
    good_steps += 1
    if good_steps >= cfg.growth_interval:
        return scale * cfg.growth_factor, 0
    return scale, good_steps


def overflowed(sq_norm: float) -> bool:
    """Whether a (sum of) squared gradient norm(s) says the step's gradients overflowed."""
    return not math.isfinite(sq_norm)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``: through pinned memory, without blocking, on CUDA."""
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``: a non-blocking copy into a pinned buffer on CUDA, then one sync."""
    import torch

    t = t.detach()
    if t.device.type != "cuda":
        return t
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return buf


def backward_loss(loss: torch.Tensor, micro_batches: int, scale: float) -> None:
    """Back-propagate one micro-batch's share of the step loss, times the loss scale.

    The one formula of the local trainer and of last-stage workers; without scaling
    (``scale == 1``) it is exactly ``(loss / M).backward()``.
    """
    scaled_share(loss, micro_batches, scale).backward()


def scaled_share(loss: torch.Tensor, micro_batches: int, scale: float) -> torch.Tensor:
    """``loss / M`` times the loss scale: what :func:`backward_loss` back-propagates."""
    out = loss / micro_batches
    if scale != 1.0:
        out = out * scale
    return out


def unscale_grads(params, scale: float) -> None:
    """Divide the gradients of ``params`` by the loss scale (exact: it is a power of two)."""
    if scale == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.div_(scale)
