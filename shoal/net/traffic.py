"""Byte accounting of the runtime's RPCs, per traffic kind and codec.

Every RPC is counted once, by its caller (a worker or a stage server), request and reply
both: the serialized protobuf size of the message (what gRPC puts in its HTTP/2 DATA
frames, less gRPC's 5-byte prefix and HTTP/2 framing). A message's tensor frames are
counted under their traffic kind; the rest of the message (ids, step numbers, flags) is
``control``. "raw" is the same message with every float payload at fp32, so
``raw / wire`` is what the codec saved. Each process keeps cumulative counters and sends
them with its coordinator heartbeats; the coordinator keeps the newest snapshot of each
process (a killed process's last heartbeat stays) and sums them (:func:`merge_traffic`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable

from shoal.net import shoal_pb2 as pb
from shoal.net.compress import WireCounter
from shoal.net.wire import Framed, field_lengths, field_spans, frame_size

KINDS = ("activations", "activation_grads", "grad_push", "weight_pull", "replica_merge", "control")
_FLOATS = ("float32", "float16", "bfloat16")


def frame_raw_bytes(frame: pb.Tensor) -> int:
    """Serialized size the frame would have with its payload as plain fp32 (ints: as is)."""
    if frame.dtype not in _FLOATS:
        return frame_size(frame)
    numel = math.prod(frame.shape) if len(frame.shape) else 1
    raw = pb.Tensor(name=frame.name, dtype="float32", shape=list(frame.shape), codec="raw")
    # Size of the payload field at fp32: tag + length varint + bytes.
    return raw.ByteSize() + 1 + _varint_len(4 * numel) + 4 * numel


def _varint_len(n: int) -> int:
    k = 1
    while n >= 0x80:
        n >>= 7
        k += 1
    return k


def _grad_or_act(direction: int) -> str:
    return "activations" if direction == pb.FWD else "activation_grads"


# Messages whose repeated frames are all of one traffic kind: (that kind, their field's name).
# A replica plan's per-layer merges between stage servers are ReplicaParts.
FRAME_KINDS = {pb.GradPush: ("grad_push", "grads"), pb.WeightsReply: ("weight_pull", "params"),
               pb.ReplicaPart: ("replica_merge", "tensors")}


def frames_of(msg) -> list[tuple[str, pb.Tensor]]:
    """The tensor frames of a runtime message with their traffic kinds (pure)."""
    if isinstance(msg, pb.TaskResult):
        return [(_grad_or_act(msg.direction), msg.output)] if msg.HasField("output") else []
    if isinstance(msg, pb.LeaseReply):
        out = []
        if msg.has_task and msg.task.HasField("input"):
            out.append(("activations", msg.task.input))
        if msg.has_task and msg.task.HasField("out_grad"):
            out.append(("activation_grads", msg.task.out_grad))
        return out
    if isinstance(msg, pb.Relay):
        return [(_grad_or_act(msg.direction), msg.tensor)] if msg.HasField("tensor") else []
    if type(msg) in FRAME_KINDS:
        kind, field = FRAME_KINDS[type(msg)]
        return [(kind, t) for t in getattr(msg, field)]
    return []


def framed_frames(msg: Framed) -> list[tuple[str, object]]:
    """The frames of a :class:`~shoal.net.wire.Framed` message with their traffic kinds (pure;
    as :func:`frames_of` for the message they were kept out of)."""
    head = msg.head
    if isinstance(head, (pb.Relay, pb.TaskResult)):
        return [(_grad_or_act(head.direction), f) for f in msg.frames]
    return [(FRAME_KINDS[type(head)][0], f) for f in msg.frames]


# Messages whose frames are one top-level field, by type: their frames' sizes can be read from
# the serialised message (shoal.net.wire.field_spans) instead of each payload being copied out.
FRAME_FIELDS = {cls: cls.DESCRIPTOR.fields_by_name[name].number for cls, name in
                ((pb.TaskResult, "output"), (pb.GradPush, "grads"), (pb.WeightsReply, "params"),
                 (pb.Relay, "tensor"), (pb.ReplicaPart, "tensors"))}


def wire_frame_sizes(msg, n_frames: int, spans) -> list[int] | None:
    """The serialised sizes of ``msg``'s ``n_frames`` frames from ``spans`` (the top-level
    fields of its serialised form, :func:`shoal.net.wire.field_spans`), or None where its
    frames are not one top-level field or the count differs (pure)."""
    number = FRAME_FIELDS.get(type(msg))
    if number is None or spans is None:
        return None
    sizes = field_lengths(spans, number)
    return sizes if len(sizes) == n_frames else None


class Traffic:
    """Cumulative byte counters of one process (thread-safe through :class:`WireCounter`)."""

    def __init__(self) -> None:
        self.counter = WireCounter()
        self.id = uuid.uuid4().hex  # one per process: a re-joined member keeps its counters

    def count(self, msg, frames: Iterable[tuple[str, pb.Tensor]] | None = None, total: int | None = None,
              data=None, spans=None) -> None:
        """Count one message: each ``(kind, frame)`` under its kind and codec, the rest as control.

        ``frames`` defaults to :func:`frames_of` (the runtime's messages by type); ``total``:
        the message's serialised size when the caller knows it (sizing a large message
        costs as much as serialising it). ``data`` (the serialised message) or ``spans`` (its
        top-level fields): where the frames' sizes are read instead of copying each payload
        out of its frame to measure it (:func:`wire_frame_sizes`).
        """
        if isinstance(msg, Framed):  # frames kept out of the message (shoal.net.wire.split_framed)
            if frames is None:
                frames = framed_frames(msg)
            msg = msg.head
        frames = list(frames_of(msg) if frames is None else frames)
        if total is None:
            total = msg.ByteSize()
        if spans is None and data is not None and type(msg) in FRAME_FIELDS:
            spans = field_spans(memoryview(data))
        sizes = wire_frame_sizes(msg, len(frames), spans)
        framed = 0
        for i, (kind, frame) in enumerate(frames):
            size = frame_size(frame) if sizes is None else sizes[i]
            framed += size
            self.counter.add_bytes(f"{kind}/{frame.codec or 'raw'}", frame_raw_bytes(frame), size)
        rest = total - framed
        self.counter.add_bytes("control/raw", rest, rest)

    def snapshot(self) -> list[pb.ByteCount]:
        """The counters as heartbeat fields."""
        out = []
        for key, c in self.counter.as_dict().items():
            kind, codec = key.split("/", 1)
            out.append(pb.ByteCount(kind=kind, codec=codec, raw=int(c["raw"]), wire=int(c["wire"]),
                                    messages=int(c["messages"])))
        return out


def merge_traffic(snapshots: dict[str, tuple[str, list]]) -> dict:
    """Sum per-process snapshots ``{process id: (role, [ByteCount or dict])}`` (pure).

    Returns ``{"bytes": {kind: {raw, wire, messages}}, "bytes_by_codec": {kind: {codec:
    {...}}}, "bytes_by_role": {role: {kind: {...}}}}``.
    """
    by_kind: dict[str, dict[str, int]] = {}
    by_codec: dict[str, dict[str, dict[str, int]]] = {}
    by_role: dict[str, dict[str, dict[str, int]]] = {}

    def add(d: dict, c: dict) -> None:
        for f in ("raw", "wire", "messages"):
            d[f] = d.get(f, 0) + int(c[f])

    for role, counts in snapshots.values():
        for c in counts:
            if not isinstance(c, dict):
                c = {"kind": c.kind, "codec": c.codec, "raw": c.raw, "wire": c.wire, "messages": c.messages}
            add(by_kind.setdefault(c["kind"], {}), c)
            add(by_codec.setdefault(c["kind"], {}).setdefault(c["codec"], {}), c)
            add(by_role.setdefault(role, {}).setdefault(c["kind"], {}), c)
    return {"bytes": dict(sorted(by_kind.items())), "bytes_by_codec": dict(sorted(by_codec.items())),
            "bytes_by_role": dict(sorted(by_role.items()))}


BYTES_METHOD = ("counted: serialized size of every RPC request and reply, once, by the calling worker or "
                "server, from each process's last heartbeat (gRPC and HTTP/2 framing not included)")
