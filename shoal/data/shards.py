"""Read a prepared data folder (see :mod:`shoal.data.prepare`) without loading it.

The shards are memory-mapped; a micro-batch reads only its ``B`` windows of ``T + 1``
tokens. The token stream of all shards in order is split like an in-memory corpus: the
last ``val_fraction`` of the tokens is the validation split (:func:`shoal.data.tokens.split_ids`
semantics), so the same tokens give the same batches whichever way they are held.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shoal.data.prepare import INDEX_FILE, MANIFEST_FILE, TOKENIZER_FILE, is_prepared
from shoal.errors import ShoalError

__all__ = ["TokenStream", "is_prepared", "load_prepared"]


class TokenStream:
    """Tokens ``[start, start + length)`` of the concatenated shards, read on demand."""

    def __init__(self, maps: list[np.ndarray], start: int, length: int):
        self.maps = maps
        self.bounds = np.cumsum([0] + [len(m) for m in maps])  # global offset of each shard
        self.start, self.length = start, length

    def numel(self) -> int:
        return self.length

    def __len__(self) -> int:
        return self.length

    def read(self, offset: int, n: int) -> np.ndarray:
        """``n`` tokens from ``offset`` (relative to this stream), as int64."""
        if offset < 0 or offset + n > self.length:
            raise IndexError(f"tokens [{offset}, {offset + n}) outside a stream of {self.length}")
        g = self.start + offset
        out = np.empty(n, dtype=np.int64)
        k = int(np.searchsorted(self.bounds, g, side="right")) - 1
        pos = 0
        while pos < n:
            local = g + pos - int(self.bounds[k])
            take = min(n - pos, len(self.maps[k]) - local)
            out[pos : pos + take] = self.maps[k][local : local + take]
            pos += take
            k += 1
        return out

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """``(len(starts), length)`` int64 tensor of the windows at ``starts``."""
        return torch.from_numpy(np.stack([self.read(int(s), length) for s in starts.tolist()]))

    def to_numpy(self) -> np.ndarray:
        """All tokens of the stream (small data and tests only)."""
        return self.read(0, self.length)


def load_prepared(path: str | Path, vocab_size: int, val_fraction: float = 0.05):
    """A :class:`~shoal.data.tokens.TokenData` over the shards of a prepared folder."""
    from tokenizers import Tokenizer

    from shoal.data.tokens import TokenData

    root = Path(path).expanduser()
    if not is_prepared(root):
        raise ShoalError(f"{str(path)!r} is not a prepared data folder (no {MANIFEST_FILE}); "
                         "make one with: shoal data prepare INPUT... --out DIR")
    try:
        manifest = json.loads((root / MANIFEST_FILE).read_text())
        index = json.loads((root / INDEX_FILE).read_text())
        tok = Tokenizer.from_file(str(root / TOKENIZER_FILE))
    except (OSError, ValueError) as exc:
        raise ShoalError(f"prepared data folder {str(root)!r} is damaged: {exc}") from None
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if vocab > vocab_size:
        raise ShoalError(f"the data in {str(root)!r} uses a {vocab}-token vocabulary but the model has {vocab_size}; "
                         f"use a model with a larger vocabulary or prepare with --vocab {vocab_size}")
    dtype = np.dtype(manifest["dtype"])
    maps = []
    for sh in index["shards"]:
        f = root / sh["file"]
        if not f.is_file() or f.stat().st_size != sh["tokens"] * dtype.itemsize:
            raise ShoalError(f"shard {str(f)!r} is missing or has the wrong size; prepare the folder again")
        maps.append(np.memmap(f, dtype=dtype, mode="r", shape=(sh["tokens"],)))
    n = sum(len(m) for m in maps)
    n_val = max(2, int(round(n * val_fraction)))
    if n - n_val < 2:
        raise ShoalError(f"the prepared data has only {n} tokens: too few to split into training and validation")
    return TokenData(
        train=TokenStream(maps, 0, n - n_val), val=TokenStream(maps, n - n_val, n_val), tokenizer=tok,
        vocab_size=vocab_size, corpus_hash=manifest["content_hash"], cache_path=str(root),
        extra={"tokens": n, "prepared": str(root)},
    )
