"""Deterministic micro-batch sampling: a pure function of (seed, split, step, micro-batch).

The token stream is an in-memory tensor or a :class:`shoal.data.shards.TokenStream` over
memory-mapped shards; both give the same batch for the same tokens (the offsets are drawn
the same way, only the gather differs). Every process -- the local trainer, any stage-0 server, a re-run after a crash -- gets
the same token ids for the same task, because the random offsets come from a private
generator seeded by those four values, never from the global RNG.
"""

from __future__ import annotations

import hashlib

import torch

from shoal.errors import ShoalError

SPLITS = ("train", "val")


def batch_seed(seed: int, split: str, step: int, micro_batch: int) -> int:
    """63-bit seed of the generator for one micro-batch (stable across processes and versions)."""
    digest = hashlib.sha256(f"shoal-batch:{seed}:{split}:{step}:{micro_batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _split_tokens(data, split: str) -> torch.Tensor:
    if split not in SPLITS:
        raise ShoalError(f"unknown data split {split!r}; use 'train' or 'val'")
    tokens = data.train if split == "train" else data.val
    if isinstance(tokens, torch.Tensor) or hasattr(tokens, "windows"):
        return tokens  # a tensor, or a shoal.data.shards.TokenStream read on demand
    return torch.as_tensor(tokens, dtype=torch.int64)


def check_batch_shape(data, split: str, micro_batch_size: int, seq_len: int) -> None:
    """Raise :class:`ShoalError` if micro-batches of this shape cannot be drawn from ``split``."""
    if micro_batch_size <= 0:
        raise ShoalError(f"micro-batch size must be positive, got {micro_batch_size}")
    if seq_len <= 0:
        raise ShoalError(f"sequence length must be positive, got {seq_len}")
    n = int(_split_tokens(data, split).numel())
    if seq_len + 1 > n:
        raise ShoalError(
            f"sequence length {seq_len} is too long for the {split} split ({n} tokens); "
            "use a shorter --seq-len or more text"
        )


def get_window(
    data, split: str, seed: int, step: int, micro_batch: int, micro_batch_size: int, seq_len: int
) -> torch.Tensor:
    """The ``B`` token windows of micro-batch ``micro_batch`` of step ``step``: ``(B, T + 1)``
    int64, each ``T + 1`` consecutive tokens from a uniformly drawn offset of the split (inputs
    are ``[:, :-1]``, targets ``[:, 1:]``; :func:`get_micro_batch` splits them)."""
    if step < 0 or micro_batch < 0:
        raise ShoalError(f"step and micro-batch index must be >= 0, got step={step}, micro_batch={micro_batch}")
    check_batch_shape(data, split, micro_batch_size, seq_len)
    tokens = _split_tokens(data, split)
    n_starts = int(tokens.numel()) - seq_len  # valid starts: 0 .. n - T - 1
    gen = torch.Generator().manual_seed(batch_seed(seed, split, step, micro_batch))
    starts = torch.randint(0, n_starts, (micro_batch_size,), generator=gen)
    if isinstance(tokens, torch.Tensor):
        return tokens[starts[:, None] + torch.arange(seq_len + 1)[None, :]].to(torch.int64)
    return tokens.windows(starts, seq_len + 1)  # memory-mapped shards: read only the B windows


def get_micro_batch(
    data, split: str, seed: int, step: int, micro_batch: int, micro_batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro_batch`` of step ``step``: ``(inputs, targets)``, both ``(B, T)`` int64.

    Each of the ``B`` rows is a window of ``T + 1`` consecutive tokens starting at a
    uniformly drawn offset of the split; targets are the inputs shifted by one token.
    """
    window = get_window(data, split, seed, step, micro_batch, micro_batch_size, seq_len)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()
