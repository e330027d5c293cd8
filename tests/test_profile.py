"""The analytic profile equals what the real modules hold, output and save for backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shoal.model.config import PRESETS, get_preset
from shoal.model.profile import profile_model
from shoal.model.transformer import _rope_tables, build_stage

B, T = 2, 16


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_counts_per_layer(name):
    cfg = get_preset(name)
    prof = profile_model(cfg, min(128, cfg.max_seq_len), 1, 2)
    with torch.device("meta"):
        for i in range(cfg.n_total_layers):
            if 1 < i < cfg.n_layers:
                continue  # all blocks are alike; the first and last are enough
            layer = build_stage(cfg, i, i + 1, init=False)
            assert sum(p.numel() for p in layer.parameters()) == prof.layers[i].params, (name, i)
            assert prof.layers[i].param_bytes == 2 * prof.layers[i].params
        full = build_stage(cfg, 0, cfg.n_total_layers, init=False)
        assert sum(p.numel() for p in full.parameters()) == prof.params(0, cfg.n_total_layers)


def _input(cfg, i, dtype=torch.float32):
    if i == 0:
        return torch.randint(0, cfg.vocab_size, (B, T))
    return torch.randn(B, T, cfg.d_model, dtype=dtype, requires_grad=True)


def _targets(cfg):
    return torch.randint(0, cfg.vocab_size, (B, T))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_activation_shapes_and_bytes(name):
    cfg = get_preset(name)
    prof = profile_model(cfg, T, B, 4)
    n = cfg.n_total_layers
    for i in range(n):
        st = build_stage(cfg, i, i + 1)
        x = _input(cfg, i)
        out = st(x, _targets(cfg)) if i == n - 1 else st(x)
        assert prof.in_act_bytes(i, i + 1) == x.numel() * x.element_size()
        if i == n - 1:
            assert out.dim() == 0 and prof.out_act_bytes(i, i + 1) == 0
        else:
            assert out.shape == (B, T, cfg.d_model)
            assert prof.out_act_bytes(i, i + 1) == out.numel() * out.element_size()
            assert prof.layers[i].out_act_bytes == out.numel() * out.element_size()


def _saved_bytes(stage, x, y=None) -> int:
    """Bytes of the distinct storages autograd keeps, without parameters and rotary tables."""
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    cfg = stage.cfg
    skip |= {t.untyped_storage().data_ptr() for t in _rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x, y) if y is not None else stage(x)
    del out
    return sum(storages.values())


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_saved_activation_bytes_embedding_and_blocks(name):
    cfg = get_preset(name)
    prof = profile_model(cfg, T, B, 4)
    for i in range(cfg.n_layers + 1):
        assert _saved_bytes(build_stage(cfg, i, i + 1), _input(cfg, i)) == prof.layers[i].saved_act_bytes, i


def head_saved_bytes(cfg, b: int, t: int, dtype_bytes: int) -> int:
    """What autograd really keeps in the head: its input, the RMSNorm's rsqrt, the normed
    input, one fp32 log-softmax of the logits, the int64 targets, and the fp32 loss."""
    d, v = cfg.d_model, cfg.vocab_size
    # below fp32 the RMSNorm also keeps an fp32 copy of its input and an fp32 statistic
    return b * t * (dtype_bytes * (3 * d + 1) + 4 * v + 8 + (4 - dtype_bytes) * (d + 1)) + 4


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_saved_activation_bytes_head_measured(name):
    cfg = get_preset(name)
    head = cfg.n_layers + 1
    measured = _saved_bytes(build_stage(cfg, head, head + 1), _input(cfg, head), _targets(cfg))
    assert measured == head_saved_bytes(cfg, B, T, 4)
    half = build_stage(cfg, head, head + 1).to(torch.bfloat16)
    assert _saved_bytes(half, _input(cfg, head, torch.bfloat16), _targets(cfg)) == head_saved_bytes(cfg, B, T, 2)


@pytest.mark.parametrize("dtype, nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_saved_activation_bytes_head_profile(dtype, nbytes):
    cfg = get_preset("tiny")
    head = cfg.n_layers + 1
    stage = build_stage(cfg, head, head + 1).to(dtype)
    measured = _saved_bytes(stage, _input(cfg, head, dtype), _targets(cfg))
    assert measured == profile_model(cfg, T, B, nbytes).layers[head].saved_act_bytes


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_forward_flops_match_counter(name):
    cfg = get_preset(name)
    prof = profile_model(cfg, T, B, 4)
    for i in (1, cfg.n_layers + 1):
        st = build_stage(cfg, i, i + 1)
        with FlopCounterMode(display=False) as counter:
            st(_input(cfg, i)) if i <= cfg.n_layers else st(_input(cfg, i), _targets(cfg))
        # FlopCounterMode has no formula for the CPU attention kernel, so it sees only the
        # projections; attention's QK^T and AV over T keys are 2 * 2*T*d per token.
        attention = 4 * B * T * T * cfg.d_model if i <= cfg.n_layers else 0
        assert counter.get_total_flops() + attention == prof.fwd_flops(i, i + 1), i
