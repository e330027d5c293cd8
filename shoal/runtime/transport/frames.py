"""Framing of a stage's weights and gradients on the wire, and retries of calls to a peer
that may still be starting."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import (
    Framed,
    WireError,
    decode_tensor,
    encode_frame,
    frame_capacity,
    framed_pieces,
    join_pieces,
    nested_pieces,
    put_frame,
    serialize_framed,
)

# The field of a weight pull whose frames stay views of the received bytes (split_framed).
WEIGHT_FRAMES = pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number
# A granted task's tensors, by field number, and the reply's task field.
TASK_INPUT = pb.Task.DESCRIPTOR.fields_by_name["input"].number
TASK_OUT_GRAD = pb.Task.DESCRIPTOR.fields_by_name["out_grad"].number
REPLY_TASK = pb.LeaseReply.DESCRIPTOR.fields_by_name["task"].number


@dataclass(slots=True)
class Grant:
    """A task as a stage server grants it: the :class:`pb.Task` without its input and output
    gradient, and those as frames (``{field number: frame}``: the server's received frames,
    handed on as they are). Other attributes are the task's."""

    task: pb.Task  # the task, its input and out_grad not set
    frames: dict  # TASK_INPUT / TASK_OUT_GRAD -> wire.Frame or pb.Tensor

    def __getattr__(self, name: str):
        return getattr(self.task, name)


@dataclass(slots=True)
class GrantReply:
    """A :class:`pb.LeaseReply` whose task's frames are kept out of it (:class:`Grant`): put
    into the reply as it is serialised (:func:`grant_reply_bytes`), each payload copied once;
    put into the task and that into the reply, each would be copied twice more (about 1.3 ms a
    copy at 8 MB: bench/bench_result_copies.py). Other attributes are the reply's."""

    head: pb.LeaseReply  # the reply, its task without frames
    frames: dict  # as Grant.frames

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    def message(self) -> pb.LeaseReply:
        """The reply as one message (for a unary call): the frames copied into its task."""
        for number, frame in self.frames.items():
            put_frame(self.head.task.input if number == TASK_INPUT else self.head.task.out_grad, frame)
        self.frames = {}
        return self.head


def grant_reply_bytes(rep: GrantReply) -> bytes | memoryview:
    """``rep`` serialised: it parses to the reply with its task's frames set (pure)."""
    task = [rep.head.task.SerializeToString()]
    for number, frame in sorted(rep.frames.items()):
        task += framed_pieces(pb.Task(), number, [frame])
    head = pb.LeaseReply()
    head.CopyFrom(rep.head)  # (the task holds no frame: cheap)
    head.ClearField("task")
    return join_pieces(nested_pieces(head, REPLY_TASK, task))


def serialise_weights(head: pb.WeightsReply, params: dict[str, torch.Tensor]) -> bytes | memoryview:
    """``head`` with every parameter framed, serialised (runs in a thread; a large stage comes
    back as a read-only byte view: :func:`shoal.net.wire.join_pieces`)."""
    return serialize_framed(head, pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number,
                            [encode_frame(name, p.detach(), view=True) for name, p in params.items()])


def decode_grads(r: pb.GradPush, params: dict[str, torch.Tensor], finite: bool = True) -> dict[str, torch.Tensor]:
    """Every gradient of a push, checked against its parameter (shape, dtype and, unless an fp16
    run may overflow, finiteness); all or nothing."""
    grads = {}
    for g in r.grads:
        if g.name not in params or g.name in grads:
            raise WireError(f"unexpected gradient {g.name!r}")
        grads[g.name] = decode_tensor(g, shape=tuple(params[g.name].shape), dtype="float32", finite=finite)
    if len(grads) != len(params):
        raise WireError(f"push has {len(grads)} of {len(params)} gradients")
    return grads


# Work on larger payloads runs in a thread: the event loop keeps answering. A thread hop costs
# about 0.07 CPU-ms; decoding and checking 512 KiB about 0.08 ms, serialising it 0.03 ms, so
# below this the hop would cost more than the work it moves and hold the loop no shorter.
OFF_LOOP_BYTES = 512 * 1024


def payload_bytes(msg) -> int:
    """About the serialised size of a runtime message, from the tensor payloads that make it
    large (what :func:`off_loop` decides on), read from their shapes: upb's ``ByteSize``
    serialises the whole message to size it, as dear as the serialisation it is asked for (80 us
    for a 128 KiB task), and ``len(frame.data)`` copies the payload."""
    if isinstance(msg, Framed):
        return sum(frame_capacity(f) for f in msg.frames)
    if isinstance(msg, GrantReply):
        return sum(frame_capacity(f) for f in msg.frames.values()) + frame_capacity(msg.head.task.tokens)
    if isinstance(msg, pb.Relay):
        return frame_capacity(msg.tensor)
    if isinstance(msg, pb.TaskResult):
        return frame_capacity(msg.output)
    if isinstance(msg, pb.LeaseReply):
        t = msg.task
        return frame_capacity(t.input) + frame_capacity(t.out_grad) + frame_capacity(t.tokens)
    return msg.ByteSize()


async def off_loop(nbytes: int, fn, *args):
    """``fn(*args)``: in a thread when it handles ``nbytes`` >= :data:`OFF_LOOP_BYTES` (framing,
    decoding, checksums, sums), else right here (a thread hop costs more than a small decode).

    The event loop carries every member's liveness: what would hold it for more than a
    fraction of a millisecond goes to a thread, so heartbeats and stream traffic go on.
    """
    if nbytes < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# What a call that may simply come too early or in a storm fails with: the peer still
# starting (UNAVAILABLE), or a coordinator swamped by a join storm that cancelled, timed
# out or refused it. Anything else (a bad token, a refused request) is final.
TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED)


async def retry(fn, budget_s: float = 30.0, delay: float = 0.1,
                codes: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)):
    """Call ``fn`` until it succeeds or fails with a code not in ``codes`` (default: the peer
    may still be starting), for ``budget_s`` at most; the delay doubles up to 0.5 s."""
    end = time.monotonic() + budget_s
    while True:
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in codes or time.monotonic() > end:
                raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)
