"""Stages built separately and chained reproduce the full model's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.model.transformer import build_model, build_stage

CFG = get_preset("tiny")
N = CFG.n_total_layers  # 6 for tiny: embedding, 4 blocks, head
SEED = 3


def _batch(b: int = 2, t: int = 24):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (b, t), generator=gen)
    y = torch.randint(0, CFG.vocab_size, (b, t), generator=gen)
    return x, y


@pytest.fixture(scope="module")
def reference():
    model = build_model(CFG, SEED)
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, weights


@pytest.mark.parametrize("a, b", [(1, 2), (1, 5), (2, 4), (3, 5), (4, 5), (2, 3)])
def test_three_stages_match_full_model(reference, a, b):
    ref_loss, ref_grads, ref_weights = reference
    stages = [build_stage(CFG, 0, a, SEED), build_stage(CFG, a, b, SEED), build_stage(CFG, b, N, SEED)]
    x, y = _batch()
    # Forward across stage boundaries as the runtime does: detached tensors that need grad.
    h0 = stages[0](x)
    h0_in = h0.detach().requires_grad_(True)
    h1 = stages[1](h0_in)
    h1_in = h1.detach().requires_grad_(True)
    loss = stages[2](h1_in, y)
    loss.backward()
    h1.backward(h1_in.grad)
    h0.backward(h0_in.grad)
    assert abs(float(loss.detach()) - ref_loss) < 1e-6
    names = set()
    for st in stages:
        for name, p in st.named_parameters():
            names.add(name)
            assert torch.equal(p.detach(), ref_weights[name]), name
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)
    assert names == set(ref_grads)


def test_param_names_are_global_and_disjoint():
    a = dict(build_stage(CFG, 0, 2, SEED).named_parameters())
    b = dict(build_stage(CFG, 2, N, SEED).named_parameters())
    assert not set(a) & set(b)
    assert "layers.1.attn.wqkv.weight" in a and f"layers.{N - 1}.out.weight" in b


def test_other_seed_other_weights():
    w0 = build_stage(CFG, 1, 2, 0).layers["1"].attn.wqkv.weight
    w1 = build_stage(CFG, 1, 2, 1).layers["1"].attn.wqkv.weight
    assert not torch.equal(w0, w1)


@pytest.mark.parametrize("first, last", [(0, 0), (3, 2), (-1, 2), (0, N + 1)])
def test_bad_stage_range(first, last):
    with pytest.raises(ShoalError):
        build_stage(CFG, first, last)
