"""The optimizer step shared by the local trainer and the stage servers.

Both run exactly this, so distributed training reproduces local training:

1. every micro-batch's loss is divided by M and back-propagated; the gradients of the M
   micro-batches are summed (in any order), giving the gradient of the mean loss;
2. the global gradient norm is the 2-norm over *all* parameters of the model (the stage
   servers add up the squared norms of their stages, see :func:`clip_coefficient`);
3. gradients are scaled by ``min(1, grad_clip / (norm + 1e-6))``;
4. one AdamW update at the learning rate :func:`lr_at` gives for the step; weight
   decay applies to matrices (ndim >= 2) only, not to norm gains.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from shoal.errors import ShoalError


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay and global gradient-norm clipping."""

    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 10  # steps of linear warm-up from 0 to lr
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global gradient 2-norm (0 disables clipping)

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ShoalError(f"learning rates must satisfy 0 <= min_lr <= lr and lr > 0 (lr={self.lr}, min_lr={self.min_lr})")
        if self.warmup_steps < 0:
            raise ShoalError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.grad_clip < 0:
            raise ShoalError(f"grad_clip must be >= 0, got {self.grad_clip}")


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) in a run of ``total_steps`` steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


# Bytes a parameter of AdamW's two moments, by the dtype they are kept in (make_optimizer's `moments`).
MOMENT_BYTES = {"fp32": 8, "bf16": 4}
_MOMENTS = ("exp_avg", "exp_avg_sq")  # LeanAdamW's bfloat16 state tensors


class LeanAdamW(torch.optim.Optimizer):
    """AdamW whose two moments are kept in bfloat16: 4 bytes a parameter instead of 8.

    A lean local-mode worker's inner optimizer (``--lean-workers``, shoal.runtime.sync.lean):
    with fp32 weights and the step's gradient sum it holds 12 bytes a parameter, so a whole
    gpt-1.3b fits a 24 GB card. The update rule is torch.optim.AdamW's (decoupled weight
    decay ``p *= 1 - lr wd``, bias-corrected moments, a step count per parameter; no amsgrad),
    so the first step from a fresh state equals torch's bit for bit. Each parameter's step is
    computed in float32 from its upcast moments and written back rounded to bfloat16, one
    parameter at a time, so the transient memory is two fp32 copies of one parameter, never
    the model's; parameters keep their own dtype. What the rounding costs in loss is measured
    at equal tokens (bench/results/lean-workers.md).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        if not (lr >= 0.0 and eps >= 0.0 and weight_decay >= 0.0 and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid LeanAdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict) -> None:
        """Load a state (this class's or torch.optim.AdamW's) keeping the moments bfloat16.

        torch's loader would cast every floating state tensor to the parameter's dtype: all
        the moments at once in fp32, 8 bytes a parameter. Here it loads the state without
        them, then copies each moment to bfloat16 on its parameter's device, one at a time
        (a copy: the loaded optimizer never shares a tensor with the source), and the step
        count becomes an int.
        """
        saved = state_dict["state"]
        moments = {k: {key: v[key] for key in _MOMENTS if key in v} for k, v in saved.items()}
        rest = {k: {key: x for key, x in v.items() if key not in _MOMENTS} for k, v in saved.items()}
        super().load_state_dict({**state_dict, "state": rest})
        by_id = dict(zip((i for g in state_dict["param_groups"] for i in g["params"]),
                         (p for g in self.param_groups for p in g["params"]), strict=True))
        for k, ms in moments.items():
            p = by_id.get(k)
            if p is None:
                continue
            st = self.state[p]
            if "step" in st:
                st["step"] = int(st["step"])
            for key, x in ms.items():
                st[key] = x.to(device=p.device, dtype=torch.bfloat16, copy=True)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer.step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                g = p.grad.float()
                m = st["exp_avg"].float().lerp_(g, 1 - b1)
                st["exp_avg"].copy_(m)
                v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                st["exp_avg_sq"].copy_(v)
                p.mul_(1 - lr * wd)
                # torch's order of operations, in place: (sqrt(v) / sqrt(1 - b2^t)) + eps
                denom = v.sqrt_().div_((1 - b2 ** t) ** 0.5).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        return loss


def make_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                   moments: str = "fp32") -> torch.optim.Optimizer:
    """AdamW over ``named_params`` with decay on matrices only; ``moments="bf16"``: a
    :class:`LeanAdamW` (the same rule, moments in bfloat16).

    The update of each parameter depends only on that parameter, its gradient and the
    step's learning rate, so a stage server holding a subset of the parameters performs
    the same update as a single process holding them all.
    """
    if moments not in MOMENT_BYTES:
        raise ShoalError(f"optimizer moments must be one of {', '.join(MOMENT_BYTES)}, got {moments!r}")
    decay, no_decay = [], []
    for _, p in sorted(named_params, key=lambda kv: kv[0]):
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if moments == "bf16":
        return LeanAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False, fused=False
    )


SQ_CHUNK = 1 << 16  # elements squared and summed in fp64 at a time by sq_sum64 (512 KB of fp64: in cache)


def sq_sum64(t: torch.Tensor) -> float:
    """The sum of ``t``'s squared entries, taken in fp64 (deterministic for a given tensor).

    A tensor of up to :data:`SQ_CHUNK` elements in one sum; a larger one a chunk at a time, the
    chunks' sums added in order. Squaring a whole large gradient at once would make two fp64
    copies of it (16 bytes a parameter, fresh pages from the kernel above glibc's heap
    threshold): 1.3 s of a stage server's exact commit for an 85 M-parameter stage, on the
    step's critical path, and as much more peak memory."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= SQ_CHUNK:
        return float(flat.double().pow(2).sum())
    total = 0.0
    for c in range(0, flat.numel(), SQ_CHUNK):
        total += float(flat[c:c + SQ_CHUNK].double().pow(2).sum())
    return total


def param_sq_norms(params: Iterable[torch.nn.Parameter]) -> list[float]:
    """Each parameter's sum of squared gradient entries (fp64, :func:`sq_sum64`), in ``params``
    order (no grad: skipped)."""
    return [sq_sum64(p.grad) for p in params if p.grad is not None]


def grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Sum of squared gradient entries (fp64) of ``params``.

    The per-parameter sums are added with :func:`math.fsum` (correctly rounded), so the
    total does not depend on how parameters are grouped: the coordinator adding the
    per-parameter sums of every stage (:func:`total_sq_norm`) gets the local trainer's
    value bit for bit, whatever the layer split.
    """
    return total_sq_norm(param_sq_norms(params))


def total_sq_norm(parts: Iterable[float]) -> float:
    """The squared global norm from per-parameter squared norms, in any order or grouping."""
    parts = list(parts)
    if not all(math.isfinite(x) for x in parts):
        return math.nan if any(math.isnan(x) for x in parts) else math.inf
    try:
        return math.fsum(parts)
    except OverflowError:  # finite parts whose sum is beyond a double: an overflow, as fp16 sees it
        return math.inf


def clip_coefficient(total_sq_norm: float, grad_clip: float) -> float:
    """Factor to scale gradients by, given the squared global norm over all stages."""
    if grad_clip <= 0:
        return 1.0
    if not math.isfinite(total_sq_norm):
        raise ShoalError("gradient norm is not finite; lower the learning rate or check the data")
    return min(1.0, grad_clip / (math.sqrt(total_sq_norm) + 1e-6))


def apply_update(optimizer: torch.optim.Optimizer, lr: float, coef: float) -> None:
    """Scale gradients by ``coef``, run one AdamW step at ``lr``, clear the gradients."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        if coef != 1.0:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
