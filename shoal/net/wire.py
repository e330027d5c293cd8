"""Tensor frames: a tensor on the wire is (name, dtype, shape, codec, payload).

Nothing received is ever unpickled: a ``raw`` payload is read with
``numpy.frombuffer`` after its length has been checked against dtype x shape, and the
receiver states the shape and dtype it expects (from its stage spec) so a peer cannot
make it allocate or accept anything else. Gradients must also be finite.
Lossy codecs (``fp16``, ``int8``, ``topk-int8``) are delegated to :mod:`shoal.net.compress`; their
side data travels as a small JSON object in ``meta``. The chunks that carry streamed messages
(:class:`ChunkView`) are read and written here too, their payloads as views.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.net import shoal_pb2 as pb

# dtype name -> (torch dtype, numpy dtype used to view the little-endian payload)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),  # viewed as raw 16-bit words
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
}
_NAMES = {v[0]: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A frame is malformed or does not match what the receiver expects."""


@dataclass(slots=True)
class Frame:
    """A tensor frame held as Python values: :class:`pb.Tensor`'s fields without building one.

    A large message that is serialised whole (:func:`serialize_framed`: a push, a weight
    pull) takes these, so each payload is not copied into a protobuf message and out of it
    again (upb copies a bytes field both ways). :func:`frame_size`, :func:`serialize_framed`
    and the traffic counters take either kind."""

    name: str
    dtype: str
    shape: list[int]
    data: bytes | memoryview  # the payload; a view where split_framed or encode_frame(view=True) made it
    codec: str = "raw"
    meta: bytes = b""

    def to_pb(self) -> pb.Tensor:
        """The same frame as a :class:`pb.Tensor` (copies the payload in)."""
        return pb.Tensor(name=self.name, dtype=self.dtype, shape=self.shape, data=self.data, codec=self.codec,
                         meta=self.meta)


def payload_frame(frame: pb.Tensor) -> Frame:
    """A received ``frame`` as a :class:`Frame`, its payload read out of the message once (upb
    copies a bytes field on every read, so a server that sizes, checks and hands on a result
    reads it once, here).

    A server checks it with :func:`decode_tensor` (raw: ``copy=False``, the tensor a view of that
    one payload) and hands it on with :func:`put_frame`: the same bytes, without decoding and
    encoding them again (each a copy of the tensor: about 0.3 ms a copy of a 4 MB activation)."""
    return Frame(name=frame.name, dtype=frame.dtype, shape=list(frame.shape), data=frame.data,
                 codec=frame.codec or "raw", meta=frame.meta)


# Below this many payload bytes a result, relay or grant is parsed and built by protobuf: its
# compiled code then beats a Framed message's steps in Python, above it the copies into and out of
# a message cost more (bench/bench_result_copies.py: the two ways cross near 0.2 MB).
FRAMED_MIN_BYTES = 256 * 1024


def goes_framed(nbytes: int) -> bool:
    """Whether a result, relay or grant of ``nbytes`` of payload travels as a :class:`Framed`
    message (:data:`FRAMED_MIN_BYTES`)."""
    return nbytes >= FRAMED_MIN_BYTES


def with_frame(head, field: str, frame: Frame):
    """``head`` with ``frame`` as its singular Tensor field ``field``: a :class:`Framed` message
    (the payload copied once, as it is serialised) for a payload of :data:`FRAMED_MIN_BYTES`
    or more, else ``head`` with the frame put in (:func:`put_frame`)."""
    if goes_framed(len(frame.data)):
        return Framed(head, field, [frame])
    put_frame(getattr(head, field), frame)
    return head


def one_frame(msg, field: str) -> Frame:
    """The frame in ``msg``'s singular Tensor field ``field``, its payload read once: of a
    :class:`Framed` message (:func:`split_framed`: a view of the received bytes, no copy) or
    of a parsed one (:func:`payload_frame`). An absent field gives an empty frame, as reading
    an unset field does; a :class:`Framed` message that carries the field more than once
    (protobuf would merge them) raises :class:`WireError`."""
    if not isinstance(msg, Framed):
        return payload_frame(getattr(msg, field))
    if len(msg.frames) > 1:
        raise WireError(f"{len(msg.frames)} frames in the field {field!r}, which holds one")
    if not msg.frames:
        return Frame(name="", dtype="", shape=[], data=b"")
    frame = msg.frames[0]
    frame.codec = frame.codec or "raw"
    return frame


class Undecoded:
    """A lossy tensor frame kept as received and decoded on first use (:func:`tensor_of`), from
    any thread, once: what a stage server holds of a lossy activation or activation gradient
    relayed by a peer server, which decoded and checked the same bytes when its worker's
    result came (``shoal.runtime.sync.codecs.received_activation``). Only a check that
    recomputes a task reads it; decoding every relay again would only spend the receiver's
    CPU (a gpt-1.3b activation in ``quad-pc``: about 42 ms) and hold the decoded copy."""

    __slots__ = ("frame", "shape", "dtype", "_tensor", "_lock")

    def __init__(self, frame: pb.Tensor | Frame, shape: Sequence[int], dtype: str) -> None:
        self.frame = frame  # as received (and handed on with every grant)
        self.shape = tuple(shape)  # the receiver's expected shape and dtype, checked when decoded
        self.dtype = dtype
        self._tensor: torch.Tensor | None = None
        self._lock = threading.Lock()

    def tensor(self) -> torch.Tensor:
        """The decoded tensor (decoded on the first call, checked against shape and dtype)."""
        with self._lock:
            if self._tensor is None:
                self._tensor = decode_tensor(self.frame, shape=self.shape, dtype=self.dtype)
            return self._tensor


def tensor_of(x: torch.Tensor | Undecoded | None) -> torch.Tensor | None:
    """``x`` as a tensor: an :class:`Undecoded` frame decoded (on the caller's thread, once)."""
    return x.tensor() if isinstance(x, Undecoded) else x


def check_header(frame: pb.Tensor | Frame, *, shape: Sequence[int] | None = None, dtype: str | None = None,
                 max_elements: int = 1 << 28) -> tuple[int, ...]:
    """Check ``frame``'s header without its payload: a known dtype and codec, no negative
    dimension, the expected ``shape`` and ``dtype`` (where given), at most ``max_elements``.
    Returns its shape; raises :class:`WireError` (what :func:`decode_tensor` checks first)."""
    if frame.dtype not in _DTYPES:
        raise WireError(f"tensor {frame.name!r}: unknown dtype {frame.dtype!r}")
    got_shape = tuple(int(d) for d in frame.shape)
    if any(d < 0 for d in got_shape):
        raise WireError(f"tensor {frame.name!r}: negative dimension in {got_shape}")
    if shape is not None and got_shape != tuple(shape):
        raise WireError(f"tensor {frame.name!r}: shape {got_shape}, expected {tuple(shape)}")
    if dtype is not None and frame.dtype != dtype:
        raise WireError(f"tensor {frame.name!r}: dtype {frame.dtype}, expected {dtype}")
    numel = math.prod(got_shape)
    if numel > max_elements:
        raise WireError(f"tensor {frame.name!r}: {numel} elements exceed the limit {max_elements}")
    codec = frame.codec or "raw"
    if codec != "raw":
        from shoal.net import compress  # (lossy codecs live beside us)

        if codec not in compress.ALL_CODECS:
            raise WireError(f"tensor {frame.name!r}: unknown codec {codec!r}")
    return got_shape


def frame_capacity(frame: pb.Tensor | Frame) -> int:
    """The bytes ``frame``'s shape and dtype take raw, read without its payload (an upper bound
    of a compressed frame's; 0 for an unknown dtype): what sizes a transfer's timeout or decides
    whether its work goes to a thread, where reading ``len(frame.data)`` would copy the payload."""
    known = _DTYPES.get(frame.dtype)
    return math.prod(frame.shape) * known[1].itemsize if known else 0


def put_frame(dst: pb.Tensor, src: pb.Tensor | Frame) -> None:
    """Make the message field ``dst`` the frame ``src`` (as ``dst.CopyFrom(src)``; a
    :class:`Frame`'s payload is copied in once, not through a :class:`pb.Tensor` of its own)."""
    if not isinstance(src, Frame):
        dst.CopyFrom(src)
        return
    dst.Clear()
    dst.name, dst.dtype, dst.codec = src.name, src.dtype, src.codec
    dst.shape.extend(src.shape)
    dst.data = src.data if isinstance(src.data, bytes) else bytes(src.data)
    if src.meta:
        dst.meta = src.meta


def encode_tensor(name: str, tensor: torch.Tensor, codec: str = "raw", ef=None, key: int = 0,
                  layout=None) -> pb.Tensor:
    """Frame ``tensor`` (any supported dtype) as a :class:`pb.Tensor` (see :func:`encode_frame`)."""
    return encode_frame(name, tensor, codec, ef, key, layout).to_pb()


def encode_frame(name: str, tensor: torch.Tensor, codec: str = "raw", ef=None, key: int = 0,
                 layout=None, view: bool = False) -> Frame:
    """Frame ``tensor`` (any supported dtype) as a :class:`Frame`.

    ``view``: a raw frame's payload is a view of the tensor's own bytes, not a copy (for
    :func:`serialize_framed`, which copies it once into the message: a 400 MB stage then costs
    half the CPU). Such a frame must be serialised before the tensor changes, and
    :meth:`Frame.to_pb` does not take it.

    ``key``: the draw key of a stochastic codec (``tern-sr``, ``tern-dither``; see :func:`shoal.net.compress.encode`).
    ``layout``: the shapes a flat ``lowrank`` tensor holds (the receiver passes the same to
    :func:`decode_tensor`; they never travel).

    ``ef`` (a :class:`shoal.net.compress.ErrorFeedback` of the same lossy codec) adds the
    residual it keeps for ``name`` before encoding and keeps the new one.
    """
    t = tensor.detach().contiguous().cpu()
    if t.dtype not in _NAMES:
        raise WireError(f"tensor {name}: dtype {t.dtype} cannot be sent")
    dtype = _NAMES[t.dtype]
    if codec == "raw":
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy().astype("<i2", copy=False)
        else:
            arr = t.numpy().astype(_DTYPES[dtype][1], copy=False)
        data = memoryview(arr.reshape(-1)).cast("B") if view and arr.size else arr.tobytes()
        return Frame(name=name, dtype=dtype, shape=list(t.shape), data=data, codec="raw")
    from shoal.net import compress  # lossy codecs live beside us, written separately

    if ef is not None:
        if ef.codec != codec:
            raise WireError(f"tensor {name}: error feedback is for {ef.codec}, not {codec}")
        data, meta = ef.encode(name, t, layout=layout)
    else:
        data, meta = compress.encode(t, codec, key=key, layout=layout)
    return Frame(name=name, dtype=dtype, shape=list(t.shape), data=bytes(data), codec=meta["codec"],
                 meta=json.dumps(meta, sort_keys=True).encode())


def decode_tensor(
    frame: pb.Tensor | Frame,
    *,
    shape: Sequence[int] | None = None,
    dtype: str | None = None,
    finite: bool = False,
    max_elements: int = 1 << 28,
    layout=None,
    copy: bool = True,
) -> torch.Tensor:
    """Check ``frame`` against the expected ``shape``/``dtype`` and return a tensor
    (``layout``: the receiver's shapes of a flat ``lowrank`` frame's tensors).

    ``copy=False``: a raw frame's tensor is a view of its payload (possibly read-only and not
    aligned), for a caller that only reads it or copies it before writing: a weight pull's
    tensors are copied into the parameters, and a stage server keeps a relayed activation only
    to read it, so a fresh tensor would be one more copy (its pages faulted in afresh each time).

    Raises :class:`WireError` on an unknown dtype or codec, a shape or dtype other than
    the expected one, a payload of the wrong length, or (``finite=True``) inf/NaN.
    """
    got_shape = check_header(frame, shape=shape, dtype=dtype, max_elements=max_elements)
    numel = math.prod(got_shape)
    tdtype, npdtype = _DTYPES[frame.dtype]
    codec = frame.codec or "raw"
    if codec == "raw":
        data = frame.data  # (upb makes a new bytes object, a copy of the payload, on every read)
        if len(data) != numel * npdtype.itemsize:
            raise WireError(
                f"tensor {frame.name!r}: payload of {len(data)} bytes, expected "
                f"{numel * npdtype.itemsize} for {frame.dtype}{list(got_shape)}"
            )
        arr = np.frombuffer(data, dtype=npdtype)
        if copy:
            arr = arr.copy()
            t = torch.from_numpy(arr)
        else:
            with warnings.catch_warnings():  # (a read-only view: the caller copies it, see above)
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(arr)
        t = t.view(torch.bfloat16) if frame.dtype == "bfloat16" else t
        t = t.reshape(got_shape)
    else:
        from shoal.net import compress  # (a known codec: check_header)

        try:
            meta = json.loads(frame.meta.decode() or "{}")
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
            t = compress.decode(frame.data, meta, shape=got_shape, dtype=frame.dtype, layout=layout)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError(f"tensor {frame.name!r}: bad {codec} payload: {exc}") from exc
        t = t.to(tdtype).reshape(got_shape)
    if finite and t.is_floating_point() and not all_finite(t):
        raise WireError(f"tensor {frame.name!r}: holds inf or NaN")
    return t


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of floating-point ``t`` is finite.

    On the CPU through numpy for the dtypes it has: the same answer as
    ``torch.isfinite(t).all()`` at a fraction of the time (one pass, no bool tensor).
    """
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.float16):
        flat = t.detach().reshape(-1).numpy()
        # A block at a time: one bool array of a large tensor's size was fresh pages each call.
        return all(bool(np.isfinite(flat[c:c + FINITE_BLOCK]).all()) for c in range(0, flat.size, FINITE_BLOCK))
    return bool(torch.isfinite(t).all())


FINITE_BLOCK = 1 << 20  # elements all_finite checks at a time


_DATA_TAG = b"\x22"  # Tensor.data: field 4, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _frame_head(frame: pb.Tensor | Frame) -> pb.Tensor:
    """``frame`` without its payload (small: serialised or sized at no cost)."""
    return pb.Tensor(name=frame.name, dtype=frame.dtype, shape=frame.shape, codec=frame.codec, meta=frame.meta)


def frame_size(frame: pb.Tensor | Frame) -> int:
    """``frame.ByteSize()`` without encoding the payload (upb's ByteSize serialises the message).

    Reading ``frame.data`` still copies the payload (upb hands out a new bytes object on every
    access): where the serialised message is at hand, :func:`field_spans` and
    :func:`field_lengths` read the frames' sizes from it for free."""
    return _sized(frame, len(frame.data))


def _sized(frame: pb.Tensor | Frame, n: int) -> int:
    """``frame``'s serialised size when its payload is ``n`` bytes long."""
    return _frame_head(frame).ByteSize() + (1 + len(_varint(n)) + n if n else 0)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``buf[pos]``."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf) -> list[tuple[int, int, int, int]]:
    """``(field number, key start, start, end)`` of each top-level field of the serialised
    message ``buf``; ``start`` as in :func:`field_spans` (pure; a malformed field raises
    ValueError)."""
    spans, pos, n = [], 0, len(buf)
    while pos < n:
        key_at = at = pos
        key, pos = _read_varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            at = pos
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire} not used by shoal's messages")
        if pos > n:
            raise ValueError("field runs past the message")
        spans.append((key >> 3, key_at, at, pos))
    return spans


def field_spans(buf) -> list[tuple[int, int, int]]:
    """``(field number, start, end)`` of each top-level field of the serialised message
    ``buf``, ``start`` where a length-delimited field's bytes begin (after its length), else
    where its key begins (pure; reads only the keys and lengths, never a payload; a malformed
    field raises ValueError)."""
    return [(number, at, end) for number, _, at, end in _fields(buf)]


@dataclass(slots=True)
class Framed:
    """A received message whose tensor frames were not parsed into it (:func:`split_framed`):
    reading the frames' field gives :class:`Frame` s whose raw payloads are views of the
    received bytes; every other attribute is the head's (the message without its frames)."""

    head: object  # the message without its frames
    field: str  # the name of the frames' field
    frames: list  # the frames, in order
    spool: object = None  # the file the frames' bytes are a mapping of (shoal.net.stream.Spool), if any

    def __getattr__(self, name: str):
        if name == self.field:
            return self.frames
        return getattr(self.head, name)


_TENSOR_DATA = 4  # pb.Tensor's payload field


def message_nbytes(msg) -> int:
    """Serialised size of a message, or of a :class:`Framed` one (its frames sized from their
    lengths: no payload is copied to size it)."""
    if not isinstance(msg, Framed):
        return msg.ByteSize()
    sizes = (frame_size(f) for f in msg.frames)
    return msg.head.ByteSize() + sum(1 + len(_varint(n)) + n for n in sizes)


def split_framed(buf, msg_cls, field_number: int) -> Framed:
    """``msg_cls`` parsed from ``buf`` with its repeated Tensor field ``field_number`` kept out
    of protobuf: each frame's payload stays a view of ``buf``, so a 400 MB weight pull is
    not copied into the message and out again (upb copies a bytes field both ways, and holds
    the interpreter lock while it does), nor a stage's ``int8`` push out of the file it was
    received into (:class:`shoal.net.stream.Spool`).
    A malformed message raises ValueError or protobuf's DecodeError."""
    view = memoryview(buf)
    head, frames = [], []
    for number, key_at, at, end in _fields(view):
        if number != field_number:
            head.append(view[key_at:end])
            continue
        small, data = [], b""
        sub = view[at:end]
        for n, k, a, e in _fields(sub):
            if n == _TENSOR_DATA:
                data = sub[a:e]
            else:
                small.append(sub[k:e])
        t = pb.Tensor.FromString(b"".join(small))
        frames.append(Frame(name=t.name, dtype=t.dtype, shape=list(t.shape), data=data, codec=t.codec, meta=t.meta))
    return Framed(msg_cls.FromString(b"".join(head)), msg_cls.DESCRIPTOR.fields_by_number[field_number].name,
                  frames)


def field_lengths(spans, number: int) -> list[int]:
    """The serialised sizes of the top-level length-delimited fields numbered ``number`` among
    ``spans`` (:func:`field_spans` of a message), in order: for a repeated message field, each
    element's ``ByteSize()`` (pure)."""
    return [end - start for num, start, end in spans if num == number]


def serialize_framed(head, field_number: int, frames: Sequence[pb.Tensor | Frame]) -> bytes | memoryview:
    """``head`` serialised with ``frames`` as its repeated Tensor field ``field_number`` (< 16).

    Parses to the message ``head`` with the frames appended and has its serialised size
    (the bytes of ``SerializeToString`` when no field of ``head`` numbered above
    ``field_number`` is set). Built by concatenation, at one copy of each payload: upb
    serialises a message of many large nested frames several times slower than this.
    """
    return join_pieces(framed_pieces(head, field_number, frames))


def serialize_message(msg: Framed) -> bytes | memoryview:
    """A :class:`Framed` message serialised: its head with its frames as the field they were
    kept out of (:func:`serialize_framed`: one copy of each payload, where putting a frame
    into a message and serialising that costs two)."""
    return serialize_framed(msg.head, msg.head.DESCRIPTOR.fields_by_name[msg.field].number, msg.frames)


def framed_pieces(head, field_number: int, frames: Sequence[pb.Tensor | Frame]) -> list:
    """The pieces whose concatenation is :func:`serialize_framed`'s bytes (payloads not copied:
    a file can take them one by one)."""
    if not 0 < field_number < 16:
        raise ValueError("field_number must be 1..15")
    tag = bytes([(field_number << 3) | 2])
    pieces = [head.SerializeToString()]
    for f in frames:
        data = f.data  # (a pb.Tensor's payload: one copy of it; a Frame's: a view)
        # Fields in number order, as protobuf writes them: 1-3, the payload (4), then 5-6.
        before = pb.Tensor(name=f.name, dtype=f.dtype, shape=f.shape).SerializeToString()
        after = pb.Tensor(codec=f.codec, meta=f.meta).SerializeToString()
        pieces += [tag, _varint(_sized(f, len(data))), before]
        if data:
            pieces += [_DATA_TAG, _varint(len(data)), data]
        pieces.append(after)
    return pieces


def nested_pieces(head, field_number: int, pieces: Sequence) -> list:
    """The pieces whose concatenation is ``head`` serialised with the message that ``pieces``
    make (:func:`framed_pieces`) as its field ``field_number`` (< 16), which ``head`` must not
    set itself: parses to ``head`` with that field set (payloads not copied)."""
    if not 0 < field_number < 16:
        raise ValueError("field_number must be 1..15")
    n = sum(memoryview(p).nbytes for p in pieces)
    return [head.SerializeToString(), bytes([(field_number << 3) | 2]), _varint(n), *pieces]


def message_pieces(msg, field_number: int) -> list:
    """A message serialised as pieces whose concatenation parses back to it: a :class:`Framed`
    one's frames not copied (:func:`framed_pieces`, ``field_number`` its frames' field), any
    other whole."""
    if isinstance(msg, Framed):
        return framed_pieces(msg.head, field_number, msg.frames)
    return [msg.SerializeToString()]


# Above this a message is joined by copies that let go of the interpreter lock.
JOIN_RELEASE_BYTES = 1 << 20


def empty_bytes(n: int) -> np.ndarray:
    """An uninitialised block of ``n`` bytes for a large message, filled by numpy copies (which
    let go of the interpreter lock, where ``b"".join`` of views and ``bytearray(n)``'s zeroing
    hold it). Its pages are touched only as it is filled. It comes from torch's allocator,
    which does not ask for huge pages (numpy's does: a first touch of such a block can stall
    for seconds in the kernel's compaction)."""
    return torch.empty(n, dtype=torch.uint8).numpy()


def join_pieces(pieces: Sequence) -> bytes | memoryview:
    """The concatenation of ``pieces`` (bytes or byte buffers): small ones as ``bytes``, large
    ones as a read-only byte ``memoryview`` of an :func:`empty_bytes` block. ``b"".join``
    holds the interpreter lock for the whole copy when any piece is a view (a frame's payload
    is one): a thread framing a 350 MB stage held its process's event loop, and with it the
    heartbeats, for 2.4 s on a loaded 2-core box (shoal.runtime.loopwatch)."""
    sizes = [memoryview(p).nbytes for p in pieces]
    total = sum(sizes)
    if total < JOIN_RELEASE_BYTES:
        return b"".join(pieces)
    out = empty_bytes(total)
    at = 0
    for p, n in zip(pieces, sizes, strict=True):
        if n:
            out[at:at + n] = np.frombuffer(p, dtype=np.uint8)
            at += n
    return memoryview(out).toreadonly()


def frame_nbytes(frame: pb.Tensor) -> int:
    """Bytes of payload carried by a frame (for traffic accounting)."""
    return len(frame.data) + len(frame.meta)


# ---------------------------------------------------------------------------- chunks

_CHUNK_DATA_KEY = 0x22  # pb.Chunk.data: field 4, length-delimited (one byte)


class ChunkView:
    """A :class:`pb.Chunk` whose payload is a view: of the whole serialised message a sender
    slices (``shoal.net.stream.split``), or of the bytes gRPC received. Every shoal channel and
    server reads and writes its chunk streams as these (:func:`parse_chunk`,
    :func:`serialize_chunk`): upb copies a bytes field into a message and out of it again, three
    copies of every byte of a transfer besides the one gRPC itself makes at each end."""

    __slots__ = ("kind", "total", "offset", "data", "sender")

    def __init__(self, kind: str, total: int, offset: int, data, sender: str = ""):
        self.kind, self.total, self.offset, self.data, self.sender = kind, total, offset, data, sender


def parse_chunk(buf) -> ChunkView:
    """The chunk serialised in ``buf``, its ``data`` a view of ``buf`` (the other fields parsed
    by protobuf, so they are checked as ever). A malformed chunk raises protobuf's DecodeError,
    as ``pb.Chunk.FromString`` does."""
    from google.protobuf.message import DecodeError

    view = memoryview(buf)
    head, data = [], view[0:0]
    try:
        for number, key_at, at, end in _fields(view):
            if number == 4 and view[key_at] == _CHUNK_DATA_KEY:
                data = view[at:end]  # (a repeated field: the last one counts, as in protobuf)
            else:
                head.append(view[key_at:end])
    except ValueError as exc:
        raise DecodeError(f"malformed chunk: {exc}") from None
    h = pb.Chunk.FromString(b"".join(head))
    if h.data:  # the payload under a key protobuf allows but shoal never writes
        data = memoryview(h.data)
    return ChunkView(h.kind, h.total, h.offset, data, h.sender)


def serialize_chunk(chunk) -> bytes:
    """``chunk`` (a :class:`ChunkView` or a :class:`pb.Chunk`) serialised: a view's payload is
    copied once, into the bytes handed to gRPC."""
    if not isinstance(chunk, ChunkView):
        return chunk.SerializeToString()
    head = pb.Chunk(kind=chunk.kind, total=chunk.total, offset=chunk.offset, sender=chunk.sender).SerializeToString()
    n = len(chunk.data)
    return b"".join((head, _DATA_TAG, _varint(n), chunk.data)) if n else head
