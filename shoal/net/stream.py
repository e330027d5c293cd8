"""Streamed transfers: one protobuf message sent as a stream of :class:`pb.Chunk`.

A weight pull, gradient push, task result, relay or lease reply can be larger than any
gRPC message limit (a ``gpt-1.3b`` embedding alone is 412 MB), so the runtime sends the
serialised message in chunks of ``chunk_bytes`` (1 MB by default) and the receiver puts them
together:

* the receiver states the message type and the most bytes it accepts (from its stage
  spec: parameter and activation sizes), so a peer cannot make it allocate more;
* chunks must arrive in order and add up to exactly the announced ``total``;
* only a complete message is parsed and handed on, where the tensor frames are then
  checked as usual (dtype, shape, codec, finiteness; nothing is ever unpickled). A
  stream cut mid-way raises (:class:`~shoal.net.wire.WireError` for a short stream, or
  the gRPC error of the broken call) and nothing of it is applied.

The sender serialises a message once and slices it: a stage server keeps the serialised
bytes of its current weight version and serves every puller from them, so concurrent
pulls cost one chunk each, not a copy of the weights each.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from shoal.net import shoal_pb2 as pb
from shoal.net.auth import MAX_CHUNK_BYTES
from shoal.net.wire import (
    JOIN_RELEASE_BYTES,
    ChunkView,
    WireError,
    empty_bytes,
    field_spans,
    split_framed,
)

DEFAULT_CHUNK_BYTES = 1024 * 1024  # 1 MB: on loopback a 5 MB transfer in 1 MB chunks takes a third of the time 4 MB chunks do
MIN_CHUNK_BYTES = 4 * 1024  # smaller chunks only add per-message overhead
CONTROL_SLACK = 64 * 1024  # bytes of a message besides its tensor payloads (ids, names, shapes)

log = logging.getLogger(__name__)


def chunk_bytes_from_mb(mb: float | None, default: int = DEFAULT_CHUNK_BYTES) -> int:
    """Chunk size in bytes from a ``--chunk-mb`` value (None or 0: ``default``)."""
    if mb is None or mb == 0:
        return default
    if not mb > 0:
        from shoal.errors import ShoalError

        raise ShoalError(f"--chunk-mb must be positive, got {mb}")
    if mb * 1024 * 1024 > MAX_CHUNK_BYTES:
        from shoal.errors import ShoalError

        raise ShoalError(f"--chunk-mb must be at most {MAX_CHUNK_BYTES // (1024 * 1024)} (the largest message "
                         f"a shoal server reads), got {mb}")
    return max(MIN_CHUNK_BYTES, int(mb * 1024 * 1024))


def split(kind: str, data: bytes, chunk_bytes: int, sender: str = "") -> Iterator[ChunkView]:
    """The chunks of the serialised message ``data`` (one empty chunk for an empty message),
    each a view of ``data``: its bytes are copied once, when the chunk is serialised for gRPC
    (:func:`shoal.net.wire.serialize_chunk`) as it is sent."""
    total = len(data)
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    if total == 0:
        yield ChunkView(kind, 0, 0, b"", sender)
        return
    view = memoryview(data)
    for off in range(0, total, chunk_bytes):
        yield ChunkView(kind, total, off, view[off:off + chunk_bytes], sender)


def chunks_of(msg, chunk_bytes: int) -> Iterator[ChunkView]:
    """Serialise ``msg`` once and yield its chunks (kind: the message's type name)."""
    return split(type(msg).__name__, msg.SerializeToString(), chunk_bytes)


class Assembler:
    """Puts the chunks of one message together, checking each against what is expected."""

    def __init__(self, kind: str, max_bytes: int, spool: str | Path | None = None):
        self.kind, self.max_bytes = kind, int(max_bytes)
        self.spool = spool  # a folder a message of spool_bytes() or more is received into (None: memory)
        self.total = -1
        self.got = 0
        self.buf: bytearray | bytes | memoryview | None = None
        self.arr: np.ndarray | None = None  # a large message's buffer (``buf`` is a view of it)
        self.file: Spool | None = None  # the file a spooled message is written to

    def add(self, chunk: pb.Chunk) -> None:
        """Take the next chunk; raises :class:`WireError` if it does not fit the message."""
        if chunk.kind != self.kind:
            raise WireError(f"chunk of a {chunk.kind!r}, expected a {self.kind!r}")
        if self.total < 0:
            if not 0 <= chunk.total <= self.max_bytes:
                raise WireError(f"{self.kind} of {chunk.total} bytes, more than the {self.max_bytes} "
                                "this stage can expect")
            self.total = chunk.total
            data = chunk.data
            if chunk.offset == 0 and len(data) == chunk.total:
                # The whole message in one chunk (most are): parsed from the chunk's own bytes.
                self.buf, self.got = data, chunk.total
                return
            if self.spool is not None and self.total >= spool_bytes():
                self.file = Spool.create(self.spool, self.total)
            elif self.total < JOIN_RELEASE_BYTES:
                self.buf = bytearray(self.total)
            if self.buf is None and self.file is None:
                # Not ``bytearray(n)``: zeroing a 350 MB pull in one call held the event loop
                # (and the heartbeats) for up to a second on a loaded 2-core box.
                self.arr = empty_bytes(self.total)
                self.buf = memoryview(self.arr)
        if chunk.total != self.total:
            raise WireError(f"{self.kind}: chunk says {chunk.total} bytes in all, first said {self.total}")
        data = chunk.data
        n = len(data)
        if chunk.offset != self.got:
            raise WireError(f"{self.kind}: chunk at byte {chunk.offset}, expected byte {self.got}")
        if self.got + n > self.total:
            raise WireError(f"{self.kind}: chunks run past the announced {self.total} bytes")
        if n:
            if self.file is not None:
                try:
                    self.file.write(data)
                except OSError as exc:
                    self._unspool(exc)
                    self.arr[self.got:self.got + n] = np.frombuffer(data, dtype=np.uint8)
            elif self.arr is not None:
                self.arr[self.got:self.got + n] = np.frombuffer(data, dtype=np.uint8)
            else:
                self.buf[self.got:self.got + n] = data
            self.got += n

    def finish(self, msg_cls, spans: list | None = None, frames_field: int | None = None):
        """The whole message, parsed; raises :class:`WireError` if any byte is missing.
        ``spans``: a list to fill with the message's top-level fields
        (:func:`shoal.net.wire.field_spans`: how large its frames are, read for free).
        ``frames_field``: the number of its repeated Tensor field to keep out of protobuf: a
        :class:`~shoal.net.wire.Framed` comes back (:func:`~shoal.net.wire.split_framed`)."""
        if self.total < 0:
            raise WireError(f"{self.kind}: the stream ended before its first chunk")
        if self.got != self.total:
            raise WireError(f"{self.kind}: transfer cut after {self.got} of {self.total} bytes")
        if self.file is not None:
            if frames_field is None:
                raise ValueError("a spooled message is read with its frames kept out (frames_field)")
            self.buf = self.file.mapped()
        try:
            if frames_field is not None:
                msg = split_framed(self.buf, msg_cls, frames_field)
                if self.file is not None:
                    msg.spool = self.file  # (its frames are views of the file's mapping)
            elif self.total > PIECE_BYTES:
                msg = parse_in_pieces(self.buf, msg_cls)
            else:
                msg = msg_cls.FromString(self.buf)
            if spans is not None:
                spans.extend(field_spans(memoryview(self.buf)))
        except Exception as exc:  # protobuf's DecodeError; never anything but parsing
            raise WireError(f"{self.kind}: the assembled bytes do not parse: {exc}") from None
        self.buf = self.arr = self.file = None  # (a Framed message keeps its frames' bytes alive itself)
        return msg

    def _unspool(self, exc: OSError) -> None:
        """Go on in memory with what the spool file holds (a full or failing disk)."""
        log.warning("%s of %d bytes received in memory: cannot write it to %s: %s", self.kind, self.total,
                    self.spool, exc)
        self.arr = empty_bytes(self.total)
        self.buf = memoryview(self.arr)
        self.arr[:self.got] = np.frombuffer(self.file.read(self.got), dtype=np.uint8)
        self.file.close()
        self.file = None


SPOOL_BYTES = 16 << 20  # a message at least this large is received into its spool folder, where given


def spool_bytes() -> int:
    """:data:`SPOOL_BYTES`, or ``SHOAL_SPOOL_MB`` MB where the environment sets it (tests spool
    a small model's pushes with it)."""
    mb = os.environ.get("SHOAL_SPOOL_MB")
    return SPOOL_BYTES if not mb else int(float(mb) * 2**20)


class Spool:
    """A received message's bytes in a file of their own, written in order as the chunks come,
    so that they take the host's page cache (which the kernel writes back and reclaims under
    pressure) rather than the process's memory. The file is unlinked as soon as it is open:
    nothing is left behind by a crash, and the bytes go when the last view of them does."""

    def __init__(self, f):
        self.f = f  # the open, already unlinked file
        self.nbytes = 0  # bytes written so far
        self.map: mmap.mmap | None = None  # the file mapped, once the message is whole

    @classmethod
    def create(cls, folder: str | Path, total: int) -> Spool | None:
        """A new spool of ``total`` bytes in ``folder``; None where the folder cannot take it
        (not writable, or less than twice ``total`` free): the message is received in memory."""
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(folder).free < 2 * total:
                return None
            # (unbuffered: what a failed write leaves is exactly the chunks written before it)
            f = tempfile.TemporaryFile(dir=folder, prefix="recv-", buffering=0)  # noqa: SIM115 (lives as long as the spool)
        except OSError as exc:
            log.warning("receiving a message of %d bytes in memory: cannot write to %s: %s", total, folder, exc)
            return None
        return cls(f)

    def write(self, data) -> None:
        """Append ``data`` (the next chunk's bytes)."""
        view = memoryview(data)
        while view:
            view = view[self.f.write(view):]
        self.nbytes += len(data)

    def read(self, n: int) -> bytes:
        """The first ``n`` bytes written."""
        return os.pread(self.f.fileno(), n, 0)

    def mapped(self) -> memoryview:
        """A read-only view of the whole file (page cache, not the process's memory); the file
        is closed (the mapping keeps its bytes for as long as a view of them lives)."""
        try:
            if self.nbytes:
                self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
            return memoryview(self.map if self.nbytes else b"")
        finally:
            self.close()

    def close(self) -> None:
        """Close the file (a mapping of it stays)."""
        self.f.close()

    def release(self) -> None:
        """Unmap the pages read so far: they stay in the page cache (read again from there, or
        the disk, where next read), and leave this process's resident memory."""
        if self.map is not None:
            self.map.madvise(mmap.MADV_DONTNEED)


PIECE_BYTES = 4 << 20  # a large message is parsed in pieces of about this size (one field at least)


def field_ends(buf) -> list[int]:
    """Where each top-level field of the serialised message ``buf`` ends (pure; a malformed
    field raises ValueError)."""
    return [end for _, _, end in field_spans(buf)]


def parse_in_pieces(buf, msg_cls, piece_bytes: int = PIECE_BYTES):
    """``msg_cls`` parsed from ``buf`` by merging runs of whole top-level fields of about
    ``piece_bytes`` (a large tensor frame alone), each a separate call: the same message as
    ``FromString``, but the interpreter lock is let go between pieces, so a thread parsing a
    400 MB weight pull never holds up the event loop (and its heartbeats) for long."""
    msg = msg_cls()
    view = memoryview(buf)
    start = 0
    for end in field_ends(view):
        if end - start >= piece_bytes:
            msg.MergeFromString(view[start:end])
            start = end
    if start < len(view):
        msg.MergeFromString(view[start:])
    return msg


def assemble(chunks: Iterable[pb.Chunk], msg_cls, max_bytes: int):
    """Assemble a message of type ``msg_cls`` from an iterable of chunks (see :class:`Assembler`)."""
    asm = Assembler(msg_cls.__name__, max_bytes)
    for c in chunks:
        asm.add(c)
    return asm.finish(msg_cls)


PARSE_OFF_LOOP_BYTES = 1 << 20  # larger messages are parsed in a thread, off the event loop
YIELD_EVERY_S = 0.05  # a receive lets the event loop turn at least this often


async def receive(chunks: AsyncIterator[pb.Chunk], msg_cls, max_bytes: int, on_chunk=None,
                  spans: list | None = None, progress: dict | None = None, frames_field: int | None = None,
                  spool: str | Path | None = None):
    """Assemble a message from an async stream of chunks (a gRPC request or reply stream).

    A broken call raises its gRPC error while iterating; a stream that ends short raises
    :class:`WireError`. Either way the caller gets no message and applies nothing.
    ``on_chunk(chunk)`` runs for every chunk (e.g. to keep its sender counted as alive);
    ``spans`` and ``frames_field``: see :meth:`Assembler.finish`; ``progress``: a dict whose
    ``got``, ``total`` and ``last`` (monotonic time) are set after every chunk; ``spool``: a
    folder a message of :func:`spool_bytes` or more is received into (:class:`Spool`; with
    ``frames_field`` only), its frames views of the file.
    """
    asm = Assembler(msg_cls.__name__, max_bytes, spool)
    turned = time.monotonic()
    loop = asyncio.get_running_loop()
    async for c in chunks:
        if asm.file is not None:
            # (a write to the page cache may wait for the disk when much is dirty: not on the loop)
            await loop.run_in_executor(spool_pool(), asm.add, c)
        else:
            asm.add(c)
        now = time.monotonic()
        if progress is not None:
            progress.update(got=asm.got, total=asm.total, last=now)
        if on_chunk is not None:
            on_chunk(c)
        if now - turned > YIELD_EVERY_S:
            # Chunks gRPC has buffered come without a pause: a large transfer on a loaded
            # box held the loop for 0.3 s at a time (shoal.runtime.loopwatch); let it turn.
            await asyncio.sleep(0)
            turned = time.monotonic()
    if asm.total > PARSE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, asm.finish, msg_cls, spans, frames_field)
    return asm.finish(msg_cls, spans, frames_field)


_SPOOL_POOL: ThreadPoolExecutor | None = None


def spool_pool() -> ThreadPoolExecutor:
    """The threads that write spooled chunks (apart from the loop's executor, where decodes
    may keep every thread busy for seconds)."""
    global _SPOOL_POOL
    if _SPOOL_POOL is None:
        _SPOOL_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shoal-spool")
    return _SPOOL_POOL


def tensor_bytes(numel: int, itemsize: int = 4) -> int:
    """Most payload bytes a frame of ``numel`` elements carries (fp32 raw is the largest codec)."""
    return numel * itemsize


def transfer_timeout(nbytes: int, base_s: float = 60.0, min_bytes_per_s: float = 1e6) -> float:
    """Deadline of one streamed call: ``base_s`` plus ``nbytes`` at a slow 1 MB/s link."""
    return base_s + nbytes / min_bytes_per_s


class StreamStalled(Exception):
    """A streamed send whose chunks stopped leaving (the peer or the path hangs): abandoned."""


class SendProgress:
    """When a streamed send last handed a chunk to gRPC, and whether all of them have left.

    gRPC takes the next chunk only when the previous one is written (HTTP/2 flow control),
    so a path that hangs, or a peer that stops reading, shows as chunks no longer taken.
    """

    def __init__(self) -> None:
        self.last = time.monotonic()  # the newest sign of progress
        self.sent = False  # every chunk handed over (the peer now processes the message)

    def stalled(self, now: float, stall_s: float) -> bool:
        """Chunks remain and none was taken for ``stall_s`` (pure but for the fields)."""
        return not self.sent and now - self.last > stall_s

    def paced(self, chunks: Iterable[pb.Chunk]) -> Iterator[pb.Chunk]:
        """``chunks``, noting each one gRPC takes."""
        for c in chunks:
            self.last = time.monotonic()
            yield c
        self.last, self.sent = time.monotonic(), True


async def send(method, msg, chunk_bytes: int, *, timeout: float | None = None, traffic=None,
               data: bytes | None = None, sender: str = "", frames=None, stall_s: float | None = None,
               progress: SendProgress | None = None):
    """Call the client-streaming ``method`` with ``msg`` in chunks; returns its reply.

    ``data``: ``msg`` already serialised (e.g. in a thread, for a large message);
    ``traffic`` (a :class:`shoal.net.traffic.Traffic`) counts the whole message and the
    reply, as the unary interceptor counts a unary call; ``sender`` goes in every chunk.
    ``frames``: the ``(kind, frame)`` pairs ``data`` carries when ``msg`` is only its head
    (see :func:`shoal.net.wire.serialize_framed`); counted with ``msg``.
    ``stall_s``: cancel the call and raise :class:`StreamStalled` when chunks remain and
    none left for that long (a hung connection then fails in ``stall_s``, not at the
    deadline, which a large message over a slow link must have long); ``progress`` (a
    :class:`SendProgress`) lets the caller see the send's progress as it goes.
    """
    if data is None:
        data = msg.SerializeToString()
    if traffic is not None:
        traffic.count(msg, frames, total=len(data), data=data)
    if timeout is None:
        timeout = transfer_timeout(len(data))
    chunks = split(type(msg).__name__, data, chunk_bytes, sender)
    if stall_s is None and progress is None:
        reply = await method(chunks, timeout=timeout)
    else:
        progress = progress or SendProgress()
        progress.last, progress.sent = time.monotonic(), False
        call = method(progress.paced(chunks), timeout=timeout)
        if stall_s is not None:
            waiter = asyncio.ensure_future(_await(call))
            try:
                while True:
                    done, _ = await asyncio.wait({waiter}, timeout=stall_s / 4)
                    if done:
                        break
                    if progress.stalled(time.monotonic(), stall_s):
                        call.cancel()
                        raise StreamStalled(f"{type(msg).__name__}: no chunk left for {stall_s:.0f} s")
            finally:
                if not waiter.done():
                    # not awaited here (that could swallow this task's own cancellation); its
                    # outcome is read so that nothing is reported as never retrieved
                    waiter.add_done_callback(lambda t: t.cancelled() or t.exception())
                    waiter.cancel()
            reply = waiter.result()
        else:
            reply = await call
    if traffic is not None:
        traffic.count(reply)
    return reply


async def _await(call):
    return await call


async def fetch(method, request, msg_cls, max_bytes: int, *, timeout: float | None = None, traffic=None,
                spans: list | None = None, stall_s: float | None = None, frames_field: int | None = None):
    """Call the server-streaming ``method`` and assemble its ``msg_cls`` reply (checked).
    ``spans``, ``frames_field``: see :meth:`Assembler.finish`.
    ``stall_s``: give up with :class:`~shoal.net.wire.WireError` once no chunk has come for
    that long while bytes are still due (a path that went silent: without it the call waits
    for its deadline, a minute plus the message at 1 MB/s); the parse after the last chunk
    is not timed."""
    if traffic is not None:
        traffic.count(request)
    call = method(request, timeout=transfer_timeout(max_bytes) if timeout is None else timeout)
    progress = {"got": 0, "total": -1, "last": time.monotonic()}
    spans = [] if spans is None and traffic is not None else spans
    try:
        receiving = receive(call, msg_cls, max_bytes, spans=spans, progress=progress, frames_field=frames_field)
        msg = await (receiving if stall_s is None else _watched(receiving, stall_s, progress, msg_cls.__name__))
    except BaseException:
        call.cancel()  # stop the sender; nothing received is used
        raise
    if traffic is not None:
        traffic.count(msg, total=progress["total"], spans=spans)
    return msg


async def _watched(coro, stall_s: float, progress: dict, what: str):
    """``await coro`` (a :func:`receive` filling ``progress``), or
    :class:`~shoal.net.wire.WireError` once bytes are still due and no chunk came for
    ``stall_s`` seconds."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=stall_s / 4)
            if done:
                return task.result()
            due = progress["got"] < progress["total"] or progress["total"] < 0
            if due and time.monotonic() - progress["last"] > stall_s:
                raise WireError(f"{what}: no chunk came for {stall_s:.0f} s (a hung path); abandoned")
    finally:
        if not task.done():
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, never reported
            task.cancel()
