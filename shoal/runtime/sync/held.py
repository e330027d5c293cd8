"""A merge round's pseudo-gradients as a stage server holds them until the merge.

A server merges once every contributor of the round has pushed, so it holds all of the round's
pseudo-gradients at once. Decoded, each is the whole stage in float32: 5.2 GB for a 1.3 G
parameter stage, 150 GB for the 29 workers of one of scale-4096's replica stages. Their wire
frames are a fraction of that (``lowrank`` about 1/1,300 of bf16 on a gpt-1.3b block, ``int8``
a quarter of float32). :class:`HeldPushes` keeps a push decoded while the round's decoded pushes
fit the server's memory budget and keeps only its frames beyond it, decoding them again, one
contributor at a time, where the screen and the merge read them; the merge's arithmetic is the
same bits either way (a frame decodes to the same tensors every time).

Large frames beyond the budget (``int8``, ``bf16`` or raw: the run's dense last round, or a
policy without a sparse codec) go to disk (:class:`SpilledPush`): held in memory they would
grow the server by a quarter to a whole copy of its stage per worker (34 workers of a
scale-4096 replica: 44 GB of ``int8`` frames of gpt-1.3b), which the planner's figure for a
server (:meth:`shoal.model.profile.ModelProfile.server_memory`) does not hold.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from shoal.errors import ShoalError
from shoal.runtime.measure import available_ram

DEFAULT_MERGE_MEMORY_SHARE = 0.25  # of the host's RAM a server's decoded pushes may take by default
DEFAULT_AVAILABLE_SHARE = 0.5  # and at most this share of the RAM free when a round starts
RESERVE_SHARE = 0.2  # a push is held decoded only while the host keeps this share of its RAM free after it
SPILL_SHARE = 1 / 16  # frames of at least this share of the decoded push's bytes go to disk beyond the budget

log = logging.getLogger(__name__)


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


class SpilledPush:
    """A push held on disk: calling it returns the push's tensors (the same bits every time),
    ``read()`` decoding them from the file. ``path``: the file :meth:`written` wrote (it goes
    when this object does); None for a push received into a file (:class:`shoal.net.stream.Spool`),
    whose mapping ``read`` decodes."""

    def __init__(self, read: Callable[[], dict[str, torch.Tensor]], path: str | None = None):
        self._read = read  # () -> tensors
        self.path = path  # the file this object wrote, if any

    @classmethod
    def written(cls, data: bytes | memoryview | list, decode: Callable[[bytes], dict[str, torch.Tensor]],
                folder: str | Path) -> SpilledPush:
        """A push's serialised message (``data``: its bytes, or a list of pieces that
        concatenate to them, written one by one: no joined copy) written to a new file in
        ``folder``, decoded by ``decode(bytes)`` where read."""
        out = cls(lambda: decode(Path(path).read_bytes()))
        path = out.path = spill_file(out, data if isinstance(data, list) else [data], folder, "push-")
        return out

    def __call__(self) -> dict[str, torch.Tensor]:
        return self._read()


def spill_file(owner: object, pieces, folder: str | Path, prefix: str) -> str:
    """Write ``pieces`` (bytes-like, in order) to a new file in ``folder`` and return its path;
    the file goes when ``owner`` does (or now, if the write fails)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".pb", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
    except BaseException:
        _unlink(path)
        raise
    weakref.finalize(owner, _unlink, path)
    return path


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class HeldPushes(Mapping[str, Mapping[str, torch.Tensor]]):
    """Contributor -> its pseudo-gradient ``{name: tensor}``, decoded or decoded where read.

    :meth:`put` keeps ``dense`` while the decoded pushes held stay within ``budget`` bytes and
    the host keeps :data:`RESERVE_SHARE` of its RAM available beside it (read at each push:
    several stage servers may share a host and start their rounds at once, each with a budget
    of what was free then), and otherwise keeps ``decode`` (a function of the push's frames
    that returns the same tensors) when its frames are smaller than ``dense``. Frames of at
    least :data:`SPILL_SHARE` of ``dense``'s bytes that the budget does not hold either (decoded
    and framed pushes counted together) go to disk where the caller writes them
    (:meth:`should_spill`, :class:`SpilledPush`), raw frames included. Reading a push held as
    frames decodes it for that read only, so a pass over the contributors (``items()``) holds
    one decoded push at a time. :meth:`snapshot` is a copy for a thread to read while the event
    loop edits this one.
    """

    def __init__(self, budget: float, available: Callable[[], float] = available_ram, ram: float | None = None):
        self.budget = budget  # bytes of pushes held in memory, decoded or as frames (beyond: frames, or disk)
        self.available = available  # bytes of RAM the host has available now
        self.reserve = RESERVE_SHARE * (host_memory_bytes() if ram is None else ram)  # what it must keep free
        self._dense: dict[str, dict[str, torch.Tensor]] = {}
        self._frames: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}
        self._frame_bytes: dict[str, int] = {}  # wid -> bytes of its frames held in memory
        self._dense_bytes = 0

    def put(self, wid: str, dense: dict[str, torch.Tensor], decode: Callable[[], dict[str, torch.Tensor]] | None = None,
            wire_bytes: int = 0, spilled: Callable[[], dict[str, torch.Tensor]] | None = None) -> bool:
        """Hold ``wid``'s push; True when it is held as frames (``decode`` in memory, or
        ``spilled``: the decoder of its frames on disk, see :meth:`should_spill`), False when decoded."""
        self.pop(wid, None)
        nbytes = tensors_nbytes(dense)
        if decode is not None and not self._fits(nbytes):
            if spilled is not None:
                self._frames[wid] = spilled
                return True
            if wire_bytes < nbytes:
                self._frames[wid] = decode
                self._frame_bytes[wid] = wire_bytes
                return True
        self._dense[wid] = dense
        self._dense_bytes += nbytes
        return False

    def should_spill(self, nbytes: int, wire_bytes: int) -> bool:
        """Whether a push of ``nbytes`` decoded and ``wire_bytes`` as frames goes to disk: the
        budget holds it neither decoded nor as frames, and its frames are large (at least
        :data:`SPILL_SHARE` of ``nbytes``: ``int8``, ``bf16``, raw)."""
        return wire_bytes >= SPILL_SHARE * nbytes and not self._fits(nbytes) and not self._fits(wire_bytes)

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget beside what is held in memory, with the host's reserve kept."""
        held = self._dense_bytes + sum(self._frame_bytes.values())
        return held + nbytes <= self.budget and self.available() - nbytes >= self.reserve

    def room(self, nbytes: int, wire_bytes: int) -> bool:
        """Whether a push of ``nbytes`` decoded (``wire_bytes`` as frames) is held decoded now:
        its frames are no smaller, or it fits the budget and the host's reserve."""
        return wire_bytes >= nbytes or self._fits(nbytes)

    @property
    def framed(self) -> int:
        """How many pushes are held as frames."""
        return len(self._frames)

    @property
    def spilled(self) -> int:
        """How many of them are on disk (:class:`SpilledPush`)."""
        return sum(isinstance(f, SpilledPush) for f in self._frames.values())

    @property
    def spooled(self) -> int:
        """How many of those were received into a file (no file of their own written)."""
        return sum(isinstance(f, SpilledPush) and f.path is None for f in self._frames.values())

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
        self._frame_bytes.pop(wid, None)
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
        out._frame_bytes = {w: b for w, b in self._frame_bytes.items() if w in out._frames}
        return out
