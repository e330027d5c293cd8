"""A decoder-only transformer that can be built one stage (layer range) at a time.

Layers are indexed globally: 0 is the embedding, 1..n_layers the blocks, n_layers + 1
the head. :func:`build_stage` builds any contiguous range ``[first, last)``; each layer
is initialised from a generator seeded by ``(seed, layer index)``, so a stage built in
another process holds exactly the weights the full model would. Parameter names carry
the global layer index (``layers.3.attn.wqkv.weight``), so the state dicts of the stages
of one model never collide and together form the full model's state dict.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig, layer_kind


def layer_seed(seed: int, index: int) -> int:
    """Seed of the generator that initialises layer ``index`` of a model seeded ``seed``."""
    return (seed * 1_000_003 + index * 7_919 + 0x5EED) % (2**63 - 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even when the residual stream is bf16/fp16: the backward of
        # rsqrt of a small mean square overflows fp16. A no-op for fp32 inputs.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@lru_cache(maxsize=8)
def _rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Always on the CPU (even under a ``torch.device("meta")`` context): real values, cached.
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


_ROPE_ON_DEVICE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_tables(head_dim: int, max_seq_len: int, base: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) rotary tables on ``device``: computed once on the CPU in float64 (the same
    values on every device), copied to each device the first time it asks."""
    key = (head_dim, max_seq_len, base, device)
    if key not in _ROPE_ON_DEVICE:
        cos, sin = _rope_tables(head_dim, max_seq_len, base)
        _ROPE_ON_DEVICE[key] = (cos.to(device), sin.to(device)) if device.type != "cpu" else (cos, sin)
    return _ROPE_ON_DEVICE[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope = (cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        cos, sin = rope_tables(*self.rope, x.device)
        cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        # Under autocast the residual stream runs in the compute dtype (the lookup itself
        # is not autocast), so activations between stages are bf16/fp16 and the same in a
        # pipeline as in one process.
        if h.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))
        return h


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.out(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _init_layer(module: nn.Module, cfg: ModelConfig, seed: int, index: int) -> None:
    """Initialise one layer from its own generator, in a fixed parameter order."""
    gen = torch.Generator().manual_seed(layer_seed(seed, index))
    # Residual output projections are scaled down with depth (GPT-2 style).
    resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("wo.weight", "w_down.weight")) else cfg.init_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _make_layer(cfg: ModelConfig, index: int) -> nn.Module:
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return Embedding(cfg)
    if kind == "head":
        return Head(cfg)
    return Block(cfg)


class Stage(nn.Module):
    """Layers ``[first, last)`` of the model.

    Input: token ids ``(B, T)`` (int64) if the stage starts at the embedding, else hidden
    states ``(B, T, d_model)``. Output: hidden states, or if the stage ends with the head,
    the mean cross-entropy loss when ``targets`` is given and logits otherwise.
    """

    def __init__(self, cfg: ModelConfig, first: int, last: int, seed: int = 0, init: bool = True):
        super().__init__()
        if not 0 <= first < last <= cfg.n_total_layers:
            raise ShoalError(
                f"stage [{first}, {last}) is not a non-empty range inside [0, {cfg.n_total_layers})"
            )
        self.cfg, self.first, self.last = cfg, first, last
        self.layers = nn.ModuleDict()
        for i in range(first, last):
            layer = _make_layer(cfg, i)
            if init:
                _init_layer(layer, cfg, seed, i)
            self.layers[str(i)] = layer

    @property
    def takes_tokens(self) -> bool:
        return self.first == 0

    @property
    def has_head(self) -> bool:
        return self.last == self.cfg.n_total_layers

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, targets) if isinstance(layer, Head) else layer(x)
        return x


def build_stage(cfg: ModelConfig, first: int, last: int, seed: int = 0, init: bool = True) -> Stage:
    """Build layers ``[first, last)`` of model ``cfg`` with weights keyed by ``(seed, layer)``.

    ``init=False`` skips initialisation (use it with ``torch.device("meta")`` to count
    parameters of models too large to allocate).
    """
    return Stage(cfg, first, last, seed=seed, init=init)


def build_model(cfg: ModelConfig, seed: int = 0) -> Stage:
    """The whole model: one stage holding every layer."""
    return Stage(cfg, 0, cfg.n_total_layers, seed=seed)
