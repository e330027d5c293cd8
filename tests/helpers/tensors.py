"""Seeded test tensors shared by the codec tests."""

from __future__ import annotations

import torch


def seeded_randn(*shape, seed: int = 0) -> torch.Tensor:
    """Standard normal entries of ``shape`` from their own generator (the same for a seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)
