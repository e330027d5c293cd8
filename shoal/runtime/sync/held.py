"""A merge round's pseudo-gradients as a stage server holds them until the merge.

A server merges once every contributor of the round has pushed, so it holds all of the round's
pseudo-gradients at once. Decoded, each is the whole stage in float32: 5.2 GB for a 1.3 G
parameter stage, 150 GB for the 29 workers of one of scale-4096's replica stages. Their wire
frames are a fraction of that (``lowrank`` about 1/1,300 of bf16 on a gpt-1.3b block, ``int8``
a quarter of float32). :class:`HeldPushes` keeps a push decoded while the round's decoded pushes
fit the server's memory budget and keeps only its frames beyond it, decoding them again, one
contributor at a time, where the screen and the merge read them; the merge's arithmetic is the
same bits either way (a frame decodes to the same tensors every time).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping

import torch

from shoal.errors import ShoalError
from shoal.runtime.measure import available_ram

DEFAULT_MERGE_MEMORY_SHARE = 0.25  # of the host's RAM a server's decoded pushes may take by default
DEFAULT_AVAILABLE_SHARE = 0.5  # and at most this share of the RAM free when a round starts
RESERVE_SHARE = 0.2  # a push is held decoded only while the host keeps this share of its RAM free after it


def host_memory_bytes() -> int:
    """This host's physical RAM in bytes (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_merge_memory() -> float:
    """Bytes of decoded pushes a stage server holds by default, read when a round starts: a
    quarter of the host's RAM, and at most half of what is free then (several servers may
    share a host; the planner sizes a host for the servers' weights and optimizer state,
    :meth:`shoal.model.profile.ModelProfile.server_memory`, not for a round of decoded pushes);
    1 GiB where the system says neither."""
    ram, free = host_memory_bytes(), available_ram()
    caps = [x for x in (DEFAULT_MERGE_MEMORY_SHARE * ram, DEFAULT_AVAILABLE_SHARE * free) if x > 0]
    return min(caps) if caps else float(1 << 30)


def merge_memory_bytes(gb: float | None) -> float | None:
    """``--merge-memory-gb`` in bytes (None: the server's default); a one-line error if negative."""
    if gb is None:
        return None
    if not (math.isfinite(gb) and gb >= 0):
        raise ShoalError(f"--merge-memory-gb must be a finite number of GB >= 0, got {gb}")
    return gb * 1e9


def tensors_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes the tensors take in memory."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HeldPushes(Mapping[str, Mapping[str, torch.Tensor]]):
    """Contributor -> its pseudo-gradient ``{name: tensor}``, decoded or decoded where read.

    :meth:`put` keeps ``dense`` while the decoded pushes held stay within ``budget`` bytes and
    the host keeps :data:`RESERVE_SHARE` of its RAM available beside it (read at each push:
    several stage servers may share a host and start their rounds at once, each with a budget
    of what was free then), and otherwise keeps ``decode`` (a function of the push's frames
    that returns the same tensors) when its frames are smaller than ``dense``. Reading a push held as frames decodes it for
    that read only, so a pass over the contributors (``items()``) holds one decoded push at a
    time. :meth:`snapshot` is a copy for a thread to read while the event loop edits this one.
    """

    def __init__(self, budget: float, available: Callable[[], float] = available_ram, ram: float | None = None):
        self.budget = budget  # bytes of decoded pushes to hold (beyond: frames)
        self.available = available  # bytes of RAM the host has available now
        self.reserve = RESERVE_SHARE * (host_memory_bytes() if ram is None else ram)  # what it must keep free
        self._dense: dict[str, dict[str, torch.Tensor]] = {}
        self._frames: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}
        self._dense_bytes = 0

    def put(self, wid: str, dense: dict[str, torch.Tensor], decode: Callable[[], dict[str, torch.Tensor]] | None = None,
            wire_bytes: int = 0) -> bool:
        """Hold ``wid``'s push; True when it is held as frames (``decode``), False when decoded."""
        self.pop(wid, None)
        nbytes = tensors_nbytes(dense)
        if decode is not None and not self.room(nbytes, wire_bytes):
            self._frames[wid] = decode
            return True
        self._dense[wid] = dense
        self._dense_bytes += nbytes
        return False

    def room(self, nbytes: int, wire_bytes: int) -> bool:
        """Whether a push of ``nbytes`` decoded (``wire_bytes`` as frames) is held decoded now:
        its frames are no smaller, or it fits the budget and the host's reserve."""
        return wire_bytes >= nbytes or (self._dense_bytes + nbytes <= self.budget
                                        and self.available() - nbytes >= self.reserve)

    @property
    def framed(self) -> int:
        """How many pushes are held as frames."""
        return len(self._frames)

    def __getitem__(self, wid: str) -> Mapping[str, torch.Tensor]:
        if wid in self._dense:
            return self._dense[wid]
        return self._frames[wid]()

    def __contains__(self, wid: object) -> bool:
        return wid in self._dense or wid in self._frames

    def __iter__(self) -> Iterator[str]:
        return iter(sorted([*self._dense, *self._frames]))

    def __len__(self) -> int:
        return len(self._dense) + len(self._frames)

    def pop(self, wid: str, default=None):
        """Drop ``wid``'s push (what it held, decoded or its frames' decoder; ``default`` if none)."""
        if wid in self._dense:
            d = self._dense.pop(wid)
            self._dense_bytes -= tensors_nbytes(d)
            return d
        return self._frames.pop(wid, default)

    def snapshot(self, only=None) -> HeldPushes:
        """A copy holding the same pushes (those of ``only`` where given), for a thread."""
        out = HeldPushes(self.budget, self.available)
        out.reserve = self.reserve
        for w, d in self._dense.items():
            if only is None or w in only:
                out._dense[w] = d
                out._dense_bytes += tensors_nbytes(d)
        out._frames = {w: f for w, f in self._frames.items() if only is None or w in only}
        return out
