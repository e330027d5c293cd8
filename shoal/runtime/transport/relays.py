"""Relays between stage servers on one long-lived stream per peer.

A stage server relays every forward result (an activation, to the next stage) and every
backward result past stage 0 (an input gradient, to the previous stage): two relays per
micro-batch and pair of stages. As a call each, a relay paid a fresh HTTP/2 stream, the
credential metadata and both ends' interceptors. A :class:`RelayLink` instead keeps one
``StageServer.RelayStream`` open to a peer: up ``Relay`` messages, down ``RelayReply``
messages that name the ``relay_id`` they answer, each message as :class:`pb.Chunk` s
(size-checked as assembled, never unpickled), authenticated like any call.

The semantics are those of ``SubmitRelayStream``: the receiver answers each relay with the
same handler (a relay it holds already is dropped there, so a resend after a broken link
is harmless); a broken link fails the relays waiting on it with ``UNAVAILABLE`` and the
sender opens a new one and sends them again, as it retried a failed call.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from shoal.net import shoal_pb2 as pb
from shoal.net.stream import CONTROL_SLACK, transfer_timeout
from shoal.net.wire import Framed, WireError
from shoal.runtime.transport.session import (
    StreamEnd,
    read_messages,
    reply_within,
    serialised,
    unavailable,
)

RELAY_KINDS = {"Relay": pb.Relay}  # what the receiver reads on the stream
# A relay's frame stays a view of the received bytes (shoal.net.wire.split_framed): the
# receiver checks it and hands it on with each grant without copying it out of a message.
RELAY_FRAMES = {"Relay": pb.Relay.DESCRIPTOR.fields_by_name["tensor"].number}
REPLY_KINDS = {"RelayReply": pb.RelayReply}  # what the sender reads back


class RelayLink(StreamEnd):
    """The sending end of one relay stream to a peer stage server."""

    def __init__(self, method, chunk_bytes: int, sender: str = "", traffic=None):
        self.waiting: dict[int, asyncio.Future] = {}  # relay id -> its reply
        self.next_id = 1
        super().__init__(method, chunk_bytes, sender, traffic)

    async def _read(self) -> None:
        err = None
        try:
            size = [0]
            async for _, msg in read_messages(self.call, REPLY_KINDS, lambda _kind: CONTROL_SLACK, sizes=size):
                if self.traffic is not None:
                    self.traffic.count(msg, total=size[0])
                fut = self.waiting.pop(msg.relay_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except grpc.aio.AioRpcError as exc:
            err = exc
        except WireError as exc:
            err = unavailable(f"bad message on the relay stream: {exc}")
        except asyncio.CancelledError:
            err = unavailable("relay stream closed")
        finally:
            self.error = err or unavailable("the peer ended the relay stream")
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(self.error)
            self.waiting.clear()

    async def relay(self, msg: pb.Relay | Framed) -> pb.RelayReply:
        """Send ``msg`` (its ``relay_id`` is set here; a :class:`~shoal.net.wire.Framed` relay:
        the received frame handed on as it is) and wait for the peer's verdict; raises the
        link's gRPC error when it breaks (or DEADLINE_EXCEEDED after the transfer's time)."""
        if self.error is not None:
            raise self.error
        (msg.head if isinstance(msg, Framed) else msg).relay_id = self.next_id
        self.next_id += 1
        fut = self.waiting[msg.relay_id] = asyncio.get_running_loop().create_future()
        data = await serialised(msg)
        if self.traffic is not None:
            self.traffic.count(msg, total=len(data), data=data)
        if self.error is not None:
            self.waiting.pop(msg.relay_id, None)
            raise self.error
        self.out.put_nowait(("Relay", data))
        try:
            return await reply_within(fut, transfer_timeout(len(data)), "no reply on the relay stream")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.close()  # a link that swallows a relay is not trusted with the next one
            raise
        finally:
            self.waiting.pop(msg.relay_id, None)

    def close(self) -> None:
        """End the stream (relays waiting on it fail with UNAVAILABLE)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.out.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()
