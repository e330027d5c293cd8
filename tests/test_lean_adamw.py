"""LeanAdamW (shoal.train.optim): torch.optim.AdamW's rule with both moments in bfloat16,
4 bytes a parameter instead of 8, checked against the torch.optim.AdamW that
``make_optimizer(..., "fp32")`` builds, on identical copies fed identical gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from shoal.errors import ShoalError
from shoal.train.optim import MOMENT_BYTES, LeanAdamW, OptimConfig, apply_update, make_optimizer

pytestmark = pytest.mark.timeout(60)

CFG = OptimConfig(lr=1e-2, weight_decay=0.5, beta1=0.9, beta2=0.95)


def _model() -> torch.nn.Module:
    """Matrices (decayed) and vectors (not): two Linear layers and a LayerNorm."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def _run(model: torch.nn.Module, opt, steps: int, seed: int = 1) -> None:
    """``steps`` apply_update calls with hand-set random gradients of changing scale, a
    changing learning rate and a clip coefficient now and then."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * (0.1 + i % 5)
        apply_update(opt, CFG.lr * (1 + i % 3) / 3, 0.5 if i % 4 == 0 else 1.0)


def _rel_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest over parameters of max |a - b| / max |b|."""
    return max(float((p.detach() - q.detach()).abs().max() / q.detach().abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _pair(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, LeanAdamW]:
    ref, lean = _model(), _model()
    ref_opt = make_optimizer(ref.named_parameters(), CFG, "fp32")
    lean_opt = make_optimizer(lean.named_parameters(), CFG, "bf16")
    assert type(ref_opt) is torch.optim.AdamW and type(lean_opt) is LeanAdamW
    assert ref_opt.defaults["foreach"] is False and ref_opt.defaults["fused"] is False
    _run(ref, ref_opt, steps)
    _run(lean, lean_opt, steps)
    return ref, ref_opt, lean, lean_opt


@torch.no_grad()
def test_first_step_equals_torch_adamw_bitwise():
    """From a fresh state the step uses the fp32 moments it just computed: torch's result,
    bit for bit, weight decay and both bias corrections included (the step moves every
    parameter, so a dropped term would show)."""
    ref, _, lean, _ = _pair(1)
    for (n, a), b, s in zip(lean.named_parameters(), ref.parameters(), _model().parameters(), strict=True):
        assert not torch.equal(b, s), n
        assert torch.equal(a, b), n


@torch.no_grad()
def test_thirty_steps_stay_close_to_torch_adamw():
    """Rounding the moments to bfloat16 (8 significant bits) each step: after 30 steps the
    weights are within 1.5e-2 of torch's, relative to each weight's scale (measured 4.5e-3,
    2e-3 to 6e-3 over 8 gradient seeds; without the weight decay 9e-2, without either bias
    correction 0.4 or more), and the moments within 2e-2 of torch's (measured 7.4e-3)."""
    ref, ref_opt, lean, lean_opt = _pair(30)
    assert 0 < _rel_gap(lean, ref) < 1.5e-2
    for (n, a), b in zip(lean.named_parameters(), ref.parameters(), strict=True):
        sa, sb = lean_opt.state[a], ref_opt.state[b]
        assert sa["step"] == int(sb["step"]) == 30, n
        for key in ("exp_avg", "exp_avg_sq"):
            err = float((sa[key].float() - sb[key]).abs().max() / sb[key].abs().max())
            assert err < 2e-2, (n, key, err)


def test_moments_are_bfloat16_four_bytes_a_parameter():
    m = _model()
    opt = make_optimizer(m.named_parameters(), CFG, "bf16")
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]  # matrices / vectors
    assert [g["weight_decay"] for g in opt.param_groups] == [CFG.weight_decay, 0.0]
    _run(m, opt, 2)
    n = sum(p.numel() for p in m.parameters())
    states = [opt.state[p] for p in m.parameters()]
    assert len(states) == 6
    for p, s in zip(m.parameters(), states, strict=True):
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16
        assert s["exp_avg"].shape == s["exp_avg_sq"].shape == p.shape
        assert s["exp_avg"].device == p.device and p.dtype == torch.float32
    held = sum(t.element_size() * t.numel() for s in states for t in (s["exp_avg"], s["exp_avg_sq"]))
    assert held == 4 * n == MOMENT_BYTES["bf16"] * n
    assert MOMENT_BYTES == {"fp32": 8, "bf16": 4}
    # what the fp32 optimizer holds, by the same count
    r = _model()
    ropt = make_optimizer(r.named_parameters(), CFG, "fp32")
    _run(r, ropt, 1)
    assert sum(ropt.state[p][k].element_size() * ropt.state[p][k].numel()
               for p in r.parameters() for k in ("exp_avg", "exp_avg_sq")) == MOMENT_BYTES["fp32"] * n


@torch.no_grad()
def test_apply_update_sets_lr_scales_grads_and_clears_them():
    """apply_update's learning rate reaches the step, its coefficient scales the gradient
    the moments see, and the gradients are gone afterwards. A parameter without a gradient
    is skipped: no state, not moved."""
    m = _model()
    opt = make_optimizer(m.named_parameters(), CFG, "bf16")
    frozen = m[1].bias  # a LayerNorm bias: no weight decay
    before = frozen.detach().clone()
    gen = torch.Generator().manual_seed(5)
    grads = {}
    for p in m.parameters():
        if p is not frozen:
            grads[p] = torch.randn(p.shape, generator=gen)
            p.grad = grads[p].clone()
    w = m[0].weight
    w0 = w.detach().clone()
    apply_update(opt, 0.25, 0.5)
    assert all(g["lr"] == 0.25 for g in opt.param_groups)
    assert all(p.grad is None for p in m.parameters())
    assert frozen not in opt.state and torch.equal(frozen, before)
    for p, g in grads.items():  # first step: m = (1 - b1) coef g, v = (1 - b2) (coef g)^2, in bf16
        torch.testing.assert_close(opt.state[p]["exp_avg"], ((1 - CFG.beta1) * 0.5 * g).bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ((1 - CFG.beta2) * (0.5 * g) ** 2).bfloat16(),
                                   rtol=0, atol=0)
    # first step of Adam: p (1 - lr wd) - lr g / (|g| + eps'), about lr (1 - lr wd) away from the decayed p
    moved = (w - w0 * (1 - 0.25 * CFG.weight_decay)).abs()
    torch.testing.assert_close(moved, torch.full_like(moved, 0.25), rtol=1e-4, atol=0)
    # a second call at another lr
    for p in grads:
        p.grad = grads[p].clone()
    w1 = w.detach().clone()
    apply_update(opt, 1e-3, 1.0)
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    assert all(p.grad is None for p in m.parameters())
    step = (w - w1 * (1 - 1e-3 * CFG.weight_decay)).abs()
    assert float(step.max()) <= 1e-3 * 1.5 and float(step.max()) > 1e-4
    assert opt.state[w]["step"] == 2


def test_state_dict_round_trip_continues_bitwise():
    """An optimizer loaded from another's state (after 5 steps) takes the next 4 steps
    exactly as the original does; the loaded moments stay bfloat16 and are its own copies."""
    a = _model()
    oa = make_optimizer(a.named_parameters(), CFG, "bf16")
    _run(a, oa, 5)
    b = copy.deepcopy(a)
    ob = make_optimizer(b.named_parameters(), CFG, "bf16")
    ob.load_state_dict(oa.state_dict())
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert ob.state[q][key].dtype == torch.bfloat16
            assert torch.equal(ob.state[q][key], oa.state[p][key])
            assert ob.state[q][key].data_ptr() != oa.state[p][key].data_ptr()
        assert ob.state[q]["step"] == oa.state[p]["step"] == 5
    _run(a, oa, 4, seed=9)  # the original first: shared tensors would show in b's run
    _run(b, ob, 4, seed=9)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[p][key], ob.state[q][key])
    assert _rel_gap(a, _model()) > 1e-3  # the steps did move the weights


def test_loads_a_torch_adamw_state():
    """A torch.optim.AdamW state (fp32 moments, tensor step) loads as bf16 moments and an
    int step, and the next step runs."""
    r = _model()
    ropt = make_optimizer(r.named_parameters(), CFG, "fp32")
    _run(r, ropt, 3)
    lean = copy.deepcopy(r)
    lopt = make_optimizer(lean.named_parameters(), CFG, "bf16")
    lopt.load_state_dict(ropt.state_dict())
    for p, q in zip(r.parameters(), lean.parameters(), strict=True):
        assert lopt.state[q]["step"] == 3 and isinstance(lopt.state[q]["step"], int)
        for key in ("exp_avg", "exp_avg_sq"):
            assert lopt.state[q][key].dtype == torch.bfloat16
            torch.testing.assert_close(lopt.state[q][key], ropt.state[p][key].bfloat16(), rtol=0, atol=0)
    _run(r, ropt, 2, seed=4)
    _run(lean, lopt, 2, seed=4)
    assert 0 < _rel_gap(lean, r) < 1e-2


def test_step_runs_its_closure_with_grad_enabled():
    m = _model()
    opt = make_optimizer(m.named_parameters(), CFG, "bf16")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    w0 = m[0].weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss is not None and loss.requires_grad
    assert not torch.equal(m[0].weight, w0)


def test_unknown_moments_value_is_a_shoal_error():
    with pytest.raises(ShoalError, match="fp32, bf16.*'fp16'"):
        make_optimizer(_model().named_parameters(), CFG, "fp16")
    with pytest.raises(ShoalError):
        make_optimizer(_model().named_parameters(), CFG, "BF16")
