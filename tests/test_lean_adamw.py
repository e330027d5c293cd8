"""LeanAdamW (bf16 moments, shoal.train.optim): torch.optim.AdamW's rule in 4 bytes a parameter."""

from __future__ import annotations

import copy

import pytest
import torch

from shoal.errors import ShoalError
from shoal.train.optim import MOMENT_BYTES, LeanAdamW, OptimConfig, apply_update, make_optimizer

pytestmark = pytest.mark.timeout(60)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def _run(model, opt, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        apply_update(opt, 3e-3 * (1 + i % 3), 0.5 if i % 4 == 0 else 1.0)


def _gap(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_lean_adamw_follows_torch_adamw():
    ref, lean = _model(), _model()
    cfg = OptimConfig(weight_decay=0.1)
    _run(ref, make_optimizer(ref.named_parameters(), cfg), 30)
    _run(lean, make_optimizer(lean.named_parameters(), cfg, "bf16"), 30)
    start = _model()
    moved = _gap(ref, start)  # how far 30 steps move the weights
    assert _gap(ref, lean) < 0.01 * moved  # bf16 moments: within 1 % of the move
    # a rule that left out the bias correction or the weight decay would not be
    wrong = _model()
    opt = make_optimizer(wrong.named_parameters(), OptimConfig(weight_decay=0.0), "bf16")
    _run(wrong, opt, 30)
    assert _gap(ref, wrong) > 0.01 * moved


def test_lean_adamw_keeps_its_moments_in_four_bytes_a_parameter():
    m = _model()
    opt = make_optimizer(m.named_parameters(), OptimConfig(), "bf16")
    assert isinstance(opt, LeanAdamW)
    _run(m, opt, 2)
    n = sum(p.numel() for p in m.parameters())
    state = [opt.state[p] for p in m.parameters()]
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in state)
    held = sum(t.numel() * t.element_size() for s in state for t in (s["exp_avg"], s["exp_avg_sq"]))
    assert held == MOMENT_BYTES["bf16"] * n and MOMENT_BYTES["fp32"] == 8
    assert all(p.dtype == torch.float32 and p.grad is None for p in m.parameters())  # apply_update cleared them


def test_lean_adamw_state_round_trip_continues_bitwise():
    a = _model()
    oa = make_optimizer(a.named_parameters(), OptimConfig(), "bf16")
    _run(a, oa, 5)
    b = copy.deepcopy(a)
    ob = make_optimizer(b.named_parameters(), OptimConfig(), "bf16")
    ob.load_state_dict(oa.state_dict())
    _run(a, oa, 4, seed=9)
    _run(b, ob, 4, seed=9)
    assert _gap(a, b) == 0.0


def test_unknown_moments_are_a_clear_error():
    with pytest.raises(ShoalError, match="moments must be one of fp32, bf16"):
        make_optimizer(_model().named_parameters(), OptimConfig(), "fp8")
