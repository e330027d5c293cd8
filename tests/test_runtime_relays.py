"""Relays between stage servers on one stream (``StageServer.RelayStream``, ``RelayLink``).

A real stage server serves on a loopback port in this process; a peer's relays reach it
over a real gRPC stream in chunks, with a server's credential.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import Identity, run_public_key
from shoal.net.channel import open_channel
from shoal.net.wire import decode_tensor, encode_tensor
from shoal.runtime.roles.server import StageServer
from shoal.runtime.safety.guard import GuardConfig
from shoal.runtime.transport.relays import RelayLink
from tests.helpers.contexts import MemberCall

TOKEN = "relay-test-token"
SECRET = b"relay-test-secret"
PEER = Identity.joined(TOKEN, SECRET, "s-peer", "server")  # the credential a peer server gets at join
WORKER = Identity.joined(TOKEN, SECRET, "w", "worker")
CHUNK = 4096  # an activation of this run (1 x 16 x 128 fp32: 8 KiB) travels in several chunks


def _spec() -> pb.RunSpec:
    return pb.RunSpec(version=1, run_id="relay-test", model="tiny", stages=2, steps=3, micro_batches=2,
                      micro_batch_size=1, seq_len=16, seed=0, lr=1e-3, min_lr=1e-4, warmup=1, weight_decay=0.1,
                      grad_clip=1.0, ckpt_every=0, dead_after_s=30.0, min_lease_s=5.0, data="synthetic",
                      ordered_grads=True, chunk_bytes=CHUNK)


async def _start(tmp_path) -> tuple[StageServer, grpc.aio.Server]:
    """Stage 0 of 2 at version 0 (its micro-batches wait for their output gradients)."""
    srv = StageServer("127.0.0.1:9", "127.0.0.1:0", TOKEN, str(tmp_path), name="s-test")
    srv.spec = _spec()
    srv.stage, srv.epoch = 0, 0
    srv.guard_cfg = GuardConfig(enabled=False)
    await srv._load(0, 0, 3, 0, 0)
    srv.ready = True
    srv.channels.identity.run_key = run_public_key(SECRET)
    return srv, await srv.start_rpc()


def _grad(mb: int, shape=(1, 16, 128)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + mb))


def _relay(mb: int, t: torch.Tensor) -> pb.Relay:
    return pb.Relay(step=0, mb=mb, epoch=0, direction=pb.BWD, tensor=encode_tensor("grad", t))


@pytest.mark.timeout(60)
def test_relays_on_one_stream_are_taken_once_and_answered_by_id(tmp_path):
    async def main():
        srv, rpc = await _start(tmp_path)
        try:
            assert [srv.steps[0][mb].grad for mb in (0, 1)] == ["wait", "wait"]
            async with open_channel(srv.address, TOKEN, identity=PEER) as ch:
                link = RelayLink(pbg.StageServerStub(ch).RelayStream, CHUNK)
                # Two relays in flight at once on the one stream: each reply finds its relay.
                reps = await asyncio.gather(link.relay(_relay(0, _grad(0))), link.relay(_relay(1, _grad(1))))
                assert all(r.accepted for r in reps), reps
                assert sorted(r.relay_id for r in reps) == [1, 2]
                for mb in (0, 1):
                    assert torch.equal(srv.steps[0][mb].out_grad, _grad(mb))
                    assert srv.steps[0][mb].grad == "todo"
                # A resend (the first reply was lost) is accepted and changes nothing.
                rep = await link.relay(_relay(0, -_grad(0)))
                assert rep.accepted and torch.equal(srv.steps[0][0].out_grad, _grad(0))
                # A relay of the wrong shape is refused; the stream carries on.
                rep = await link.relay(_relay(1, _grad(1, (1, 8, 128))))
                assert not rep.accepted and "shape" in rep.reason
                assert link.alive
                # One bigger than an activation may be: the stream is refused and ends; what
                # waits on it fails as a broken call, and a new link works again.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await link.relay(_relay(1, _grad(1, (64, 16, 128))))  # 512 KiB
                # (the client may see its write into the refused stream fail first)
                assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
                assert srv.steps[0][1].grad == "todo" and torch.equal(srv.steps[0][1].out_grad, _grad(1))
                assert not link.alive
                link = RelayLink(pbg.StageServerStub(ch).RelayStream, CHUNK)
                assert (await link.relay(_relay(1, _grad(1)))).accepted
                link.close()
        finally:
            await rpc.stop(0)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_only_servers_may_open_a_relay_stream(tmp_path):
    async def main():
        srv, rpc = await _start(tmp_path)
        try:
            for ident, code in ((WORKER, grpc.StatusCode.PERMISSION_DENIED), (None, grpc.StatusCode.UNAUTHENTICATED)):
                async with open_channel(srv.address, TOKEN, identity=ident) as ch:
                    link = RelayLink(pbg.StageServerStub(ch).RelayStream, CHUNK)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await link.relay(_relay(0, _grad(0)))
                    # (the client may see its write into the refused stream fail first)
                    assert err.value.code() in (code, grpc.StatusCode.INTERNAL)
                    assert not link.alive
            assert srv.steps[0][0].out_grad is None and srv.steps[0][0].grad == "wait"
        finally:
            await rpc.stop(0)

    asyncio.run(main())


def test_replies_are_awaited_with_a_deadline_and_sized_as_assembled():
    """A stream's reply future is awaited with a timer (no wait_for/shield per message): its
    result comes through, a reply that never comes fails with DEADLINE_EXCEEDED, and a
    cancelled waiter cancels its timer. Messages read off a stream report the size they
    were assembled from (traffic counts never re-serialise a large message to size it)."""
    from shoal.net.stream import split
    from shoal.runtime.transport.session import UP_KINDS, read_messages, reply_within

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_soon(fut.set_result, "reply")
        assert await reply_within(fut, 30, "x") == "reply"
        late = loop.create_future()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await reply_within(late, 0.01, "no reply on the test stream")
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "test stream" in exc.value.details()
        gone = loop.create_future()
        waiter = asyncio.create_task(reply_within(gone, 0.05, "x"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.1)  # its timer was cancelled: the (cancelled) future holds no deadline error
        assert gone.cancelled()

        msgs = [pb.LeaseRequest(worker="w", ask_id=1), pb.TaskResult(worker="w", lease_id=7, loss=2.0)]

        async def chunks():
            for m in msgs:
                for c in split(type(m).__name__, m.SerializeToString(), 4, "w"):
                    yield c

        size = [0]
        seen = []
        async for kind, msg in read_messages(chunks(), UP_KINDS, lambda _kind: 1 << 10, sizes=size):
            seen.append((kind, msg, size[0]))
        assert [(k, m, n) for k, m, n in seen] == [(type(m).__name__, m, len(m.SerializeToString())) for m in msgs]

    asyncio.run(main())


def test_payload_bytes_sizes_large_messages_without_serialising_them():
    """What decides whether a message is serialised in a thread: the tensor bytes of a relay,
    a result and a task (within a few bytes of the serialised size), a plain size otherwise."""
    from shoal.runtime.transport.frames import payload_bytes

    act = encode_tensor("act", torch.randn(2, 16, 128))
    task = pb.LeaseReply(has_task=True, task=pb.Task(step=3, mb=1, input=act, out_grad=act,
                                                     tokens=encode_tensor("tokens", torch.zeros(2, 17, dtype=torch.int32))))
    for msg in (pb.Relay(step=1, mb=2, tensor=act), pb.TaskResult(worker="w", output=act, lease_id=9), task):
        n = len(msg.SerializeToString())
        assert n - 256 <= payload_bytes(msg) <= n
    small = pb.CompleteReply(accepted=True, reason="fine", lease_id=4)
    assert payload_bytes(small) == len(small.SerializeToString())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framed", [True, False])
def test_a_relayed_frame_is_kept_as_received_and_granted_bit_for_bit(tmp_path, monkeypatch, framed):
    """The path an activation and its gradient take through a stage server, as members send
    them: a worker's session sends results whose frame is a view of its tensor (``Framed``, no
    copy into a message), a peer relays a gradient the same way over the relay stream; the
    server keeps each frame as a view of the received bytes, not a copy; the worker is granted
    the backward task with the relayed frame as its ``out_grad`` (a ``GrantReply``, the frame put
    in as it is serialised), and so is a worker on the streamed lease call; both decode to the
    relayed tensor bit for bit. This run's 8 KiB tensors go so with the size from which that
    holds set to 0 (``framed``); with the default, they go as parsed messages, to the same
    bits. A relay or result that carries its frame twice is refused with a reason, and its
    lease stands."""
    from shoal.net import wire

    if framed:
        monkeypatch.setattr(wire, "FRAMED_MIN_BYTES", 0)
    from shoal.net.stream import receive, split
    from shoal.net.wire import Frame, Framed, encode_frame, serialize_message
    from shoal.runtime.transport.session import DOWN_KINDS, read_messages

    async def main():
        srv, rpc = await _start(tmp_path)
        try:
            async with open_channel(srv.address, TOKEN, identity=PEER) as ch:
                link = RelayLink(pbg.StageServerStub(ch).RelayStream, CHUNK)
                for mb in (0, 1):
                    relay = Framed(pb.Relay(step=0, mb=mb, epoch=0, direction=pb.BWD), "tensor",
                                   [encode_frame("grad", _grad(mb), view=True)])
                    assert (await link.relay(relay)).accepted
                    assert relay.head.relay_id == mb + 1
                link.close()
            for mb in (0, 1):
                kept = srv.steps[0][mb].out_grad_frame
                assert isinstance(kept, Frame) and isinstance(kept.data, memoryview) == framed  # a view, not a copy
                assert torch.equal(srv.steps[0][mb].out_grad, _grad(mb))

            up: asyncio.Queue = asyncio.Queue()

            async def chunks():
                while (msg := await up.get()) is not None:
                    head = msg.head if isinstance(msg, Framed) else msg
                    data = serialize_message(msg) if isinstance(msg, Framed) else msg.SerializeToString()
                    for c in split(type(head).__name__, data, CHUNK, "w"):
                        yield c

            down = read_messages(srv.Session(chunks(), MemberCall("w")), DOWN_KINDS, lambda _kind: 1 << 26)

            async def reply():
                return (await asyncio.wait_for(down.__anext__(), 30))[1]

            up.put_nowait(pb.LeaseRequest(worker="w", wait_s=0, ask_id=1))
            task = (await reply()).task
            for ask in (2, 3):  # the two forwards, each result carrying the next request
                assert task.direction == pb.FWD
                act = torch.full((1, 16, 128), float(task.mb))
                res = Framed(pb.TaskResult(worker="w", step=0, mb=task.mb, direction=pb.FWD, epoch=0,
                                           lease_id=task.lease_id, compute_s=0.01), "output",
                             [encode_frame("out", act, view=True)])
                res.next.CopyFrom(pb.LeaseRequest(worker="w", wait_s=0, ask_id=ask))
                up.put_nowait(res)
                rep = await reply()
                assert rep.result.accepted, rep.result.reason
                assert srv.steps[0][task.mb].fwd == "done"
                task = rep.task
            assert rep.has_task and task.direction == pb.BWD
            assert task.tokens.dtype == "int32" and not task.HasField("input")  # stage 0: tokens, no input
            assert torch.equal(decode_tensor(task.out_grad, shape=(1, 16, 128), dtype="float32"), _grad(task.mb))
            up.put_nowait(None)

            streamed = await receive(srv.LeaseStream(pb.LeaseRequest(worker="v", wait_s=0), None), pb.LeaseReply,
                                     1 << 26)
            assert streamed.has_task and streamed.task.direction == pb.BWD and streamed.task.mb != task.mb
            assert torch.equal(decode_tensor(streamed.task.out_grad, shape=(1, 16, 128), dtype="float32"),
                               _grad(streamed.task.mb))

            frame = encode_frame("grad", _grad(0))
            twice = await srv.SubmitRelay(Framed(pb.Relay(step=0, mb=0, epoch=0, direction=pb.BWD), "tensor",
                                                 [frame, frame]), None)
            assert not twice.accepted and "2 frames in the field 'tensor'" in twice.reason
            res = Framed(pb.TaskResult(worker="w", step=0, mb=task.mb, direction=pb.BWD, epoch=0,
                                       lease_id=task.lease_id), "output", [frame, frame])
            verdict = await srv.Complete(res, None)
            assert not verdict.accepted and "2 frames in the field 'output'" in verdict.reason
            assert srv.steps[0][task.mb].grad == "leased"  # the lease still stands
        finally:
            await rpc.stop(0)

    asyncio.run(main())
