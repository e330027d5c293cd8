"""The training step checked against a reference that shares no code with
``shoal/train/optim.py``: hand-computed schedule values, ``torch.nn.utils.clip_grad_norm_``,
``torch.optim.AdamW`` with its own parameter groups (chosen by name: no decay on norm
gains), and a plain PyTorch training loop over several steps compared with
``train_local``. Runtime parity tests compare with ``train_local``; these make that
parity mean parity with plain PyTorch training."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.data import DataConfig, get_micro_batch, load_data
from shoal.model.config import get_preset
from shoal.model.transformer import build_stage
from shoal.train.checkpoint import load_checkpoint
from shoal.train.config import TrainConfig
from shoal.train.local import train_local
from shoal.train.optim import (
    OptimConfig,
    apply_update,
    clip_coefficient,
    grad_sq_norm,
    lr_at,
    make_optimizer,
    sq_sum64,
)

# ---------------------------------------------------------------- schedule, by hand

SCHED = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=4)


@pytest.mark.parametrize("step,expected", [
    (0, 2.5e-3),  # warm-up: lr * (step + 1) / warmup
    (1, 5.0e-3),
    (3, 1.0e-2),  # last warm-up step reaches the peak
    (4, 1.0e-2),  # cosine progress 0
    (6, 1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * 2 / 8))),  # progress 0.25: 8.682e-3
    (8, 5.5e-3),  # progress 0.5: halfway between lr and min_lr
    (12, 1e-3),  # progress 1: the floor
    (30, 1e-3),  # past the end: stays at the floor
])
def test_lr_schedule_hand_values(step, expected):
    assert lr_at(step, 12, SCHED) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_lr_schedule_without_warmup_and_floor_is_reached_not_zero():
    cfg = OptimConfig(lr=2e-3, min_lr=5e-4, warmup_steps=0)
    assert lr_at(0, 10, cfg) == pytest.approx(2e-3, rel=1e-12)
    assert lr_at(5, 10, cfg) == pytest.approx(1.25e-3, rel=1e-12)
    assert lr_at(9, 10, cfg) == pytest.approx(5e-4 + 0.75e-3 * (1 + math.cos(math.pi * 0.9)), rel=1e-12)
    assert lr_at(10, 10, cfg) == pytest.approx(5e-4, rel=1e-12)
    # the schedule never goes below the floor anywhere
    assert min(lr_at(s, 10, cfg) for s in range(20)) == pytest.approx(5e-4, rel=1e-12)


def test_lr_schedule_with_one_warmup_step():
    # one warm-up step: step 0 already runs at the peak, then the cosine starts from it
    cfg = OptimConfig(lr=2e-3, min_lr=5e-4, warmup_steps=1)
    assert lr_at(0, 11, cfg) == pytest.approx(2e-3, rel=1e-12)
    assert lr_at(1, 11, cfg) == pytest.approx(2e-3, rel=1e-12)
    assert lr_at(6, 11, cfg) == pytest.approx(1.25e-3, rel=1e-12)


# ---------------------------------------------------------------- clipping


def _toy_params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g)),
          torch.nn.Parameter(torch.randn(3, 4, generator=g))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


def test_defaults_are_the_documented_ones():
    """The defaults the local trainer and the servers inherit (betas, eps are not flags)."""
    d = OptimConfig()
    assert (d.lr, d.min_lr, d.warmup_steps, d.weight_decay) == (3e-3, 3e-4, 10, 0.1)
    assert (d.beta1, d.beta2, d.eps, d.grad_clip) == (0.9, 0.95, 1e-8, 1.0)
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):  # one config shared by every stage
        d.lr = 1.0


def test_config_validation():
    from shoal.errors import ShoalError

    OptimConfig(lr=1e-3, min_lr=1e-3, warmup_steps=0, grad_clip=0.0).validate()  # edges are fine
    OptimConfig(lr=1e-3, min_lr=0.0).validate()  # decay to zero is allowed
    for bad in (dict(lr=0.0), dict(lr=0.0, min_lr=0.0), dict(min_lr=-1e-9), dict(lr=1e-3, min_lr=2e-3),
                dict(warmup_steps=-1), dict(grad_clip=-0.5)):
        with pytest.raises(ShoalError):
            OptimConfig(**bad).validate()
    with pytest.raises(ShoalError, match="not finite"):
        clip_coefficient(math.inf, 1.0)
    assert clip_coefficient(math.inf, 0.0) == 1.0  # clipping off: the norm is not looked at


def test_clip_coefficient_hand_values():
    assert clip_coefficient(25.0, 1.0) == pytest.approx(1.0 / (5.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(0.25, 1.0) == 1.0  # norm 0.5 under the clip
    assert clip_coefficient(16.0, 2.0) == pytest.approx(2.0 / (4.0 + 1e-6), rel=1e-12)
    assert clip_coefficient(1e6, 0.0) == 1.0  # clipping off


@pytest.mark.parametrize("scale,clip", [(3.0, 1.0), (0.01, 1.0), (1.0, 0.5)])
def test_clipping_matches_torch_clip_grad_norm(scale, clip):
    ours, ref = _toy_params(1, scale), _toy_params(1, scale)
    sq = grad_sq_norm(ours)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, clip)
    assert math.sqrt(sq) == pytest.approx(float(ref_norm), rel=1e-6)
    coef = clip_coefficient(sq, clip)
    for p in ours:
        p.grad.mul_(coef)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_squared_sums_in_fp64_by_chunks():
    """A tensor up to SQ_CHUNK elements: one fp64 sum (the bits of squaring it whole); a larger
    one: its chunks' fp64 sums added in order, within fp64 rounding of an exact sum."""
    from shoal.train.optim import SQ_CHUNK

    gen = torch.Generator().manual_seed(3)
    small = torch.randn(SQ_CHUNK, generator=gen) * 3
    assert sq_sum64(small) == float(small.double().pow(2).sum())
    big = torch.randn(1031, 2057, generator=gen) * 1e-3  # a matrix of many chunks and a part
    flat = big.reshape(-1)
    by_chunks = 0.0
    for c in range(0, flat.numel(), SQ_CHUNK):
        by_chunks += float(flat[c:c + SQ_CHUNK].double().pow(2).sum())
    assert sq_sum64(big) == by_chunks
    assert sq_sum64(big) == pytest.approx(float(big.double().pow(2).sum()), rel=1e-12)
    assert sq_sum64(big.to(torch.bfloat16)) == pytest.approx(float(big.to(torch.bfloat16).double().pow(2).sum()),
                                                             rel=1e-12)


# ---------------------------------------------------------------- one AdamW update


def _ref_adamw(named, cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW with groups chosen by *name*: norm gains and biases get no decay."""
    no_decay = [p for n, p in named if "norm" in n or n.endswith(".bias")]
    decay = [p for n, p in named if not ("norm" in n or n.endswith(".bias"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _assert_close_scaled(a: torch.Tensor, b: torch.Tensor, rel: float, what: str) -> None:
    """max |a - b| <= rel * max |b|: entries near zero (sums that cancel) carry the
    rounding of the larger ones, so the bound is set by the tensor's scale."""
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    assert scale > 0 and err <= rel * scale, (what, err, scale)


def _tiny_model():
    mc = get_preset("tiny")
    return build_stage(mc, 0, mc.n_total_layers, 0)


def test_weight_decay_skips_norm_gains_by_hand():
    """A zero gradient leaves only the decoupled decay: matrices shrink by (1 - lr*wd),
    norm gains do not move at all."""
    cfg = OptimConfig(lr=0.5, weight_decay=0.1)
    model = _tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model.named_parameters(), cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    apply_update(opt, 0.5, 1.0)
    n_norm = 0
    for n, p in model.named_parameters():
        if "norm" in n:
            n_norm += 1
            assert torch.equal(p.detach(), before[n]), n
        else:
            torch.testing.assert_close(p.detach(), before[n] * (1 - 0.5 * 0.1), rtol=1e-6, atol=0)
    assert n_norm == 2 * get_preset("tiny").n_layers + 1


def test_one_update_matches_torch_adamw_with_clip():
    """Gradient larger than the clip: parameters and AdamW moments equal torch's
    AdamW after clip_grad_norm_ (the moments see the clipped gradient)."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    ours, ref = _tiny_model(), _tiny_model()
    g = torch.Generator().manual_seed(3)
    for (_, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        grad = torch.randn(a.shape, generator=g) * 0.05
        a.grad, b.grad = grad.clone(), grad.clone()
    opt = make_optimizer(ours.named_parameters(), cfg)
    ropt = _ref_adamw(list(ref.named_parameters()), cfg)
    for step in range(3):
        sq = grad_sq_norm(ours.parameters())
        assert math.sqrt(sq) > 2.0  # the clip really acts
        apply_update(opt, 1e-2 * (step + 1), clip_coefficient(sq, cfg.grad_clip))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
        for group in ropt.param_groups:
            group["lr"] = 1e-2 * (step + 1)
        ropt.step()
        ropt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in ours.parameters())
        for (_, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
            grad = torch.randn(a.shape, generator=g) * 0.05 * (step + 2)
            a.grad, b.grad = grad.clone(), grad.clone()
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7, msg=n)
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close_scaled(opt.state[a][key], ropt.state[b][key], 1e-5, f"{n}.{key}")


# ---------------------------------------------------------------- train_local vs plain PyTorch

RUN = dict(model="tiny", steps=5, micro_batches=2, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3,
           min_lr=1e-3, warmup=2, weight_decay=0.1, grad_clip=0.5, eval_every=0, eval_batches=1)


def _hand_lr(step: int) -> float:
    # warm-up 2 steps to 3e-3, then cosine over 3 steps down to 1e-3
    if step < 2:
        return 3e-3 * (step + 1) / 2
    return 1e-3 + 1e-3 * (1 + math.cos(math.pi * (step - 2) / 3))


def test_train_local_matches_plain_pytorch_training(tmp_path):
    res = train_local(TrainConfig(**RUN, out=str(tmp_path / "run")), quiet=True)
    mc = get_preset("tiny")
    data = load_data(DataConfig(), mc.vocab_size)
    model = build_stage(mc, 0, mc.n_total_layers, 0)
    model.train()
    named = list(model.named_parameters())
    # betas and eps written out: the reference must not inherit OptimConfig's defaults
    no_decay = [p for n, p in named if "norm" in n]
    decay = [p for n, p in named if "norm" not in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for step in range(RUN["steps"]):
        step_losses = []
        for mb in range(2):
            x, y = get_micro_batch(data, "train", 0, step, mb, 2, 32)
            loss = model(x, y)
            (loss / 2).backward()
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / 2)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        for group in opt.param_groups:
            group["lr"] = _hand_lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    recs = res.records
    assert [r["step"] for r in recs] == list(range(5))
    assert max(norms) > 0.5  # the clip acts in this run
    for r, loss, norm, step in zip(recs, losses, norms, range(5), strict=True):
        assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=0)
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert r["lr"] == pytest.approx(_hand_lr(step), rel=1e-12)
    ours = dict(res.model.named_parameters())
    # the weights moved (a no-op trainer would fail) and equal the plain loop's
    moved = max(float((ours[n].detach() - p0).abs().max()) for n, p0 in
                build_stage(mc, 0, mc.n_total_layers, 0).state_dict().items())
    assert moved > 1e-3
    # Entries agree to 1e-6, except a handful of embedding entries whose gradients are
    # ~eps, where AdamW's update g / (sqrt(v) + eps) turns last-bit differences of the
    # clip (fp64 vs fp32 norm) into visible ones; those stay under 1 % of one step.
    for n, p in named:
        diff = (ours[n].detach() - p.detach()).abs()
        assert int((diff > 1e-6).sum()) <= max(1, diff.numel() // 10_000), n
        assert float(diff.max()) <= 0.01 * 3e-3, (n, float(diff.max()))
    # AdamW moments as checkpointed equal torch's
    ck = load_checkpoint(tmp_path / "run" / "checkpoint").optimizer_state
    for n, p in named:
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close_scaled(ck[f"{n}.{key}"], opt.state[p][key], 1e-3, f"{n}.{key}")


def test_updates_are_bitwise_torch_adamw_per_tensor_loop():
    """Five steps of make_optimizer + apply_update equal torch's single-tensor AdamW loop bit
    for bit (the runtime's exact mode relies on every process doing exactly this update; the
    fused kernel, for one, rounds differently)."""
    torch.manual_seed(0)
    init = {"w": torch.randn(64, 33), "g": torch.randn(33)}
    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=0, weight_decay=0.1)
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = make_optimizer(ours.items(), cfg)
    ref_opt = torch.optim.AdamW([{"params": [ref["w"]], "weight_decay": 0.1}, {"params": [ref["g"]], "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for k in init:
            ours[k].grad = torch.randn(init[k].shape, generator=gen)
            ref[k].grad = ours[k].grad.clone()
        apply_update(opt, 3e-3, 1.0)
        ref_opt.step()
        assert all(torch.equal(ours[k], ref[k]) for k in init)
