"""A worker's session with its stage server: one long-lived bidirectional stream.

Instead of a gRPC call per lease request, result and renewal (each a fresh HTTP/2 stream,
0.6-1.5 CPU-ms on a small box), a worker opens one ``StageServer.Session`` stream and
sends typed messages on it: up ``LeaseRequest``, ``TaskResult``, ``RenewRequest``; down
``LeaseReply``, ``CompleteReply``, ``TakeBack``. Each message travels as
:class:`pb.Chunk` s (one for a small message), so every message is size-checked as it is
assembled (:func:`read_messages`) and nothing is ever unpickled; the stream is
authenticated like any call (credential metadata, the caller bound to every message's
worker id). Requests are answered out of order (a lease request long-polls while a result
is taken), so replies carry the request's ``ask_id`` or the result's ``lease_id``.

The semantics are those of the calls (:mod:`shoal.runtime.roles.server`): the same
handlers answer, leases and exactly-once checks are unchanged; a broken session fails
what waits on it with ``UNAVAILABLE``, and the worker retries as it retries a call (a
result with the same lease id, recognised as a duplicate if it had landed).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from shoal.net import shoal_pb2 as pb
from shoal.net.stream import CONTROL_SLACK, Assembler, split
from shoal.net.wire import Framed, WireError, goes_framed, serialize_message
from shoal.runtime.transport.frames import GrantReply, grant_reply_bytes, off_loop, payload_bytes

# The largest result a worker sends on its session. A session is one stream: a message
# queued behind a large result (the next lease request, a renewal) waits for all of it, which
# on a slow uplink costs the overlap of the upload with the next task. Larger results go by a
# call of their own (their own HTTP/2 stream) and the session keeps the control messages.
SESSION_RESULT_BYTES = 128 * 1024  # most bytes of a result on the session when the uplink's rate is not known
SESSION_HOLD_S = 0.01  # longest a result may hold the session at the uplink's measured rate


def result_on_session(nbytes: int, chunk_bytes: int, up_bps: float | None = None) -> bool:
    """Whether a result of ``nbytes`` serialised bytes goes on the session (pure).

    A session is one stream: a lease request or renewal behind a result waits for all of it,
    so a result goes there only when it is one chunk and its upload takes at most
    :data:`SESSION_HOLD_S` at the worker's measured uplink to the server (``up_bps``;
    ``math.inf``: the same host), else (rate not known) when it is at most
    :data:`SESSION_RESULT_BYTES`. Larger results go by a call of their own, which costs the
    server about a third more CPU than a session message (bench/results/stream.md)."""
    if nbytes > chunk_bytes:
        return False
    if up_bps is None or up_bps <= 0:
        return nbytes <= SESSION_RESULT_BYTES
    return nbytes <= up_bps * SESSION_HOLD_S


UP_KINDS = {"LeaseRequest": pb.LeaseRequest, "TaskResult": pb.TaskResult, "RenewRequest": pb.RenewRequest}
DOWN_KINDS = {"LeaseReply": pb.LeaseReply, "CompleteReply": pb.CompleteReply, "TakeBack": pb.TakeBack}


def unavailable(details: str) -> grpc.aio.AioRpcError:
    """The error a worker's retry logic expects from a call whose transport failed."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=details)


async def read_messages(chunks, kinds: dict[str, type], limit, on_chunk=None, sizes: list | None = None,
                        frames: dict[str, int] | None = None):
    """Yield ``(kind, message)`` from a stream of chunks that carries whole messages one after
    another. ``kinds``: the message types allowed; ``limit(kind)``: most bytes of one; a
    chunk of another type, a message over its limit or chunks out of order raise
    :class:`WireError`. Large messages are parsed in a thread. ``sizes``: a one-item list
    that holds the serialised size of the message just yielded (for traffic counts: sizing
    a parsed message costs as much as serialising it). ``frames``: kind -> the number of its
    Tensor field to keep out of protobuf: such a message comes as a
    :class:`~shoal.net.wire.Framed`, its frames views of the received bytes, when it is
    :data:`~shoal.net.wire.FRAMED_MIN_BYTES` or more (a smaller one is parsed whole, faster)."""
    fields = frames or {}
    asm: Assembler | None = None
    cls = None
    async for c in chunks:
        if asm is None:
            cls = kinds.get(c.kind)
            if cls is None:
                raise WireError(f"unexpected {c.kind!r} on a session")
            asm = Assembler(c.kind, limit(c.kind))
        asm.add(c)
        if on_chunk is not None:
            on_chunk(c)
        if asm.got >= asm.total:
            field = fields.get(c.kind) if goes_framed(asm.total) else None
            msg = await off_loop(asm.total, asm.finish, cls, None, field)
            if sizes is not None:
                sizes[0] = asm.total
            asm = None
            yield c.kind, msg


def _expire(fut: asyncio.Future, details: str) -> None:
    if not fut.done():
        fut.set_exception(grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                               grpc.aio.Metadata(), details=details))


async def reply_within(fut: asyncio.Future, timeout: float, details: str):
    """The result of the reply future ``fut`` (set by a stream's reader), or DEADLINE_EXCEEDED
    after ``timeout`` seconds. ``fut`` has this one waiter, so the timeout fails it directly:
    a timer handle instead of ``asyncio.wait_for(asyncio.shield(fut))`` (a waiter future, an
    outer future and their callbacks, for every message)."""
    timer = asyncio.get_running_loop().call_later(timeout, _expire, fut, details)
    try:
        return await fut
    finally:
        timer.cancel()


async def serialised(msg) -> bytes | memoryview:
    """``msg``'s bytes, made in a thread when large (a task's input, a result); a
    :class:`~shoal.net.wire.Framed` one (a result, a relay handing on the frame a server received) with
    its frames put in as they are serialised (:func:`~shoal.net.wire.serialize_message`)."""
    if isinstance(msg, Framed):
        return await off_loop(payload_bytes(msg), serialize_message, msg)
    if isinstance(msg, GrantReply):
        return await off_loop(payload_bytes(msg), grant_reply_bytes, msg)
    return await off_loop(payload_bytes(msg), msg.SerializeToString)


def message_kind(msg) -> str:
    """The type name a message travels under (a wrapper's: its head's)."""
    return type(msg.head if isinstance(msg, (Framed, GrantReply)) else msg).__name__


class StreamEnd:
    """The calling end of a long-lived bidirectional stream: ``(kind, bytes)`` items put on
    :attr:`out` go up in chunks (None ends the stream); a subclass's ``_read`` handles what
    comes down and sets :attr:`error` when the stream ends."""

    def __init__(self, method, chunk_bytes: int, sender: str, traffic=None):
        self.chunk_bytes, self.sender, self.traffic = chunk_bytes, sender, traffic
        self.out: asyncio.Queue = asyncio.Queue()
        self.error: grpc.aio.AioRpcError | None = None
        self.call = method(self._requests())
        self.reader = asyncio.create_task(self._read())
        # However the stream ends, end the request generator too: left waiting on the queue,
        # gRPC's task that drains it was destroyed pending once the session was dropped
        # ("Task was destroyed but it is pending!" in a worker's log at every lost connection).
        self.reader.add_done_callback(lambda _t: self.out.put_nowait(None))

    @property
    def alive(self) -> bool:
        return self.error is None and not self.reader.done()

    async def _requests(self):
        while True:
            item = await self.out.get()
            if item is None:
                return
            kind, data = item
            for c in split(kind, data, self.chunk_bytes, self.sender):
                yield c

    async def _read(self) -> None:
        raise NotImplementedError


class SessionClient(StreamEnd):
    """The worker's end of a session (see the module docstring)."""

    def __init__(self, method, member: str, chunk_bytes: int, reply_limit: int, traffic=None):
        self.member, self.reply_limit = member, reply_limit
        self.leases: dict[int, asyncio.Future] = {}  # ask id -> its reply
        self.results: dict[int, asyncio.Future] = {}  # lease id -> its reply
        self.taken_back: set[int] = set()  # grants the server took back (dropped unless started)
        self.next_ask = 1
        super().__init__(method, chunk_bytes, member, traffic)

    def _limit(self, kind: str) -> int:
        return self.reply_limit if kind == "LeaseReply" else CONTROL_SLACK

    async def _read(self) -> None:
        err = None
        try:
            size = [0]
            async for kind, msg in read_messages(self.call, DOWN_KINDS, self._limit, sizes=size):
                if self.traffic is not None:
                    self.traffic.count(msg, total=size[0])
                if kind == "LeaseReply":
                    if msg.HasField("result"):  # the verdict on the result that carried the request
                        done = self.results.pop(msg.result.lease_id, None)
                        if done is not None and not done.done():
                            done.set_result(msg.result)
                    fut = self.leases.pop(msg.ask_id, None)
                elif kind == "CompleteReply":
                    fut = self.results.pop(msg.lease_id, None)
                else:
                    self.taken_back.update(msg.lease_ids)
                    continue
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except grpc.aio.AioRpcError as exc:
            err = exc
        except WireError as exc:
            err = unavailable(f"bad message on the session: {exc}")
        except asyncio.CancelledError:
            err = unavailable("session closed")
        finally:
            self.error = err or unavailable("the server ended the session")
            for fut in [*self.leases.values(), *self.results.values()]:
                if not fut.done():
                    fut.set_exception(self.error)
            self.leases.clear()
            self.results.clear()

    def _send(self, msg, data: bytes | None = None) -> None:
        if self.error is not None:
            raise self.error
        if data is None:
            data = msg.SerializeToString()
        if self.traffic is not None:
            self.traffic.count(msg, total=len(data), data=data)
        self.out.put_nowait((message_kind(msg), data))

    async def _await(self, table: dict, key: int, timeout: float):
        fut = table.get(key)
        try:
            return await reply_within(fut, timeout, "no reply on the session")
        finally:
            if table.get(key) is fut:
                del table[key]

    async def lease(self, req: pb.LeaseRequest, timeout: float) -> pb.LeaseReply:
        """Ask for a task (long-polled by the server); its reply."""
        req.ask_id = self.next_ask
        self.next_ask += 1
        self.leases[req.ask_id] = asyncio.get_running_loop().create_future()
        self._send(req)
        return await self._await(self.leases, req.ask_id, timeout)

    async def complete(self, result: pb.TaskResult, data: bytes, timeout: float) -> pb.CompleteReply:
        """Send a task's result (``data``: it serialised); the server's verdict.

        A result carrying the next lease request (:meth:`ask_with`) fails that request too
        if it cannot be sent."""
        self.results[result.lease_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(result, data)
        except grpc.aio.AioRpcError as exc:
            self.results.pop(result.lease_id, None)
            if result.HasField("next"):
                self.abandon(result.next.ask_id, exc)
            raise
        return await self._await(self.results, result.lease_id, timeout)

    def ask_with(self, result: pb.TaskResult, req: pb.LeaseRequest) -> tuple[int, asyncio.Future]:
        """Attach the lease request ``req`` to ``result`` (one message up per task); returns its
        ask id and the future of its reply (:meth:`next_reply`). The server answers the two
        with one LeaseReply carrying the result's verdict, or the verdict first when the
        request has to wait."""
        if self.error is not None:
            raise self.error
        req.ask_id = self.next_ask
        self.next_ask += 1
        fut = self.leases[req.ask_id] = asyncio.get_running_loop().create_future()
        result.next.CopyFrom(req)
        return req.ask_id, fut

    async def next_reply(self, ask_id: int, fut: asyncio.Future, timeout: float) -> pb.LeaseReply:
        """The reply to a lease request sent with a result (:meth:`ask_with`)."""
        try:
            return await reply_within(fut, timeout, "no reply on the session")
        finally:
            if self.leases.get(ask_id) is fut:
                del self.leases[ask_id]

    def abandon(self, ask_id: int, exc: BaseException) -> None:
        """A request attached to a result that was not sent: what awaits it fails with ``exc``."""
        fut = self.leases.get(ask_id)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def renew(self, req: pb.RenewRequest) -> None:
        """Renew leases (no reply: a renewal is a sign of life and a deadline push)."""
        self._send(req)

    def close(self) -> None:
        """End the session (what waits on it fails with UNAVAILABLE)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.out.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()
