"""Byte accounting: frame classification, fp32-equivalent sizes, merging snapshots, and
the counting interceptor on a real loopback gRPC call."""

from __future__ import annotations

import asyncio

import torch

from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import Identity, run_public_key
from shoal.net.channel import ChannelFactory, make_server
from shoal.net.traffic import Traffic, frame_raw_bytes, frames_of, merge_traffic
from shoal.net.wire import encode_tensor


def test_raw_size_is_the_fp32_frame_size():
    t = torch.randn(3, 50)
    raw = encode_tensor("act", t)
    assert frame_raw_bytes(raw) == raw.ByteSize()
    q = encode_tensor("act", t, "int8")
    assert frame_raw_bytes(q) > q.ByteSize()
    assert abs(frame_raw_bytes(q) - raw.ByteSize()) <= 2  # same fields but codec name


def test_frames_are_classified_by_message_and_direction():
    a = encode_tensor("x", torch.ones(4))
    assert frames_of(pb.TaskResult(direction=pb.FWD, output=a))[0][0] == "activations"
    assert frames_of(pb.TaskResult(direction=pb.BWD, output=a))[0][0] == "activation_grads"
    assert frames_of(pb.TaskResult(direction=pb.FWDBWD)) == []
    lease = pb.LeaseReply(has_task=True, task=pb.Task(input=a, out_grad=a))
    assert [k for k, _ in frames_of(lease)] == ["activations", "activation_grads"]
    assert [k for k, _ in frames_of(pb.GradPush(grads=[a, a]))] == ["grad_push", "grad_push"]
    assert [k for k, _ in frames_of(pb.WeightsReply(params=[a]))] == ["weight_pull"]
    assert frames_of(pb.Relay(direction=pb.BWD, tensor=a))[0][0] == "activation_grads"
    assert frames_of(pb.MemberRequest(member_id="w")) == []


def test_count_splits_frames_and_control_and_merge_sums_processes():
    tr = Traffic()
    push = pb.GradPush(worker="w1", step=3, grads=[encode_tensor("p", torch.ones(256), "int8")])
    tr.count(push)
    snap = tr.snapshot()
    got = {(c.kind, c.codec): c for c in snap}
    assert got[("grad_push", "int8")].wire + got[("control", "raw")].wire == push.ByteSize()
    assert got[("grad_push", "int8")].raw > got[("grad_push", "int8")].wire
    other = [{"kind": "grad_push", "codec": "raw", "raw": 10, "wire": 10, "messages": 1}]
    m = merge_traffic({tr.id: ("worker", snap), "x": ("server", other)})
    gp = m["bytes"]["grad_push"]
    assert gp["wire"] == got[("grad_push", "int8")].wire + 10
    assert set(m["bytes_by_codec"]["grad_push"]) == {"int8", "raw"}
    assert m["bytes_by_role"]["server"]["grad_push"]["wire"] == 10


def test_sizes_read_from_the_wire_count_what_the_frames_count():
    """Counting a message from its serialised bytes (the frames' sizes read from the keys and
    lengths, no payload copied out) gives the same counters as sizing every frame, for each
    message kind whose frames are one top-level field, for a head serialised with its frames
    apart (serialize_framed), and when frames are nested (a lease reply: sized one by one)."""
    from shoal.net.wire import field_lengths, field_spans, serialize_framed

    frames = [encode_tensor("a", torch.randn(300)), encode_tensor("b", torch.randn(7, 5), "int8"),
              encode_tensor("c", torch.zeros(0))]
    msgs = [pb.GradPush(worker="w", step=2, mbs=[0, 1], grads=frames),
            pb.WeightsReply(version=4, params=frames),
            pb.TaskResult(worker="w", step=1, direction=pb.BWD, output=frames[0]),
            pb.Relay(step=1, direction=pb.FWD, tensor=frames[1]),
            pb.ReplicaPart(tensors=frames),
            pb.LeaseReply(has_task=True, task=pb.Task(step=0, input=frames[0]))]
    for msg in msgs:
        data = msg.SerializeToString()
        by_frame, by_wire, by_spans = Traffic(), Traffic(), Traffic()
        by_frame.count(msg, total=len(data))
        by_wire.count(msg, total=len(data), data=data)
        by_spans.count(msg, total=len(data), spans=field_spans(data))
        assert by_frame.counter.as_dict() == by_wire.counter.as_dict() == by_spans.counter.as_dict(), msg
    head = pb.GradPush(worker="w", step=2, mbs=[0, 1])
    number = pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number
    data = serialize_framed(head, number, frames)
    assert field_lengths(field_spans(data), number) == [f.ByteSize() for f in frames]
    pairs = [("grad_push", f) for f in frames]
    a, b = Traffic(), Traffic()
    a.count(head, pairs, total=len(data))
    b.count(head, pairs, total=len(data), data=data)
    assert a.counter.as_dict() == b.counter.as_dict()


SECRET = b"traffic-test-secret"


class _Echo(pbg.StageServerServicer):
    async def GetWeights(self, request, context):
        return pb.WeightsReply(version=1, params=[encode_tensor("w", torch.ones(1000))])


def test_interceptor_counts_request_and_reply_of_a_real_call():
    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(SECRET))
        pbg.add_StageServerServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            tr = Traffic()
            stub = pbg.StageServerStub(ChannelFactory("tok", traffic=tr, identity=Identity.joined("tok", SECRET, "w7", "worker")).open(f"127.0.0.1:{port}"))
            req = pb.WeightsRequest(worker="w7")
            rep = await stub.GetWeights(req, timeout=10)
            assert rep.version == 1
            return tr, req, rep
        finally:
            await server.stop(0)

    tr, req, rep = asyncio.run(main())
    d = tr.counter.as_dict()
    assert d["weight_pull/raw"]["wire"] == rep.params[0].ByteSize()
    assert d["control/raw"]["wire"] == req.ByteSize() + rep.ByteSize() - rep.params[0].ByteSize()
    assert d["control/raw"]["messages"] == 2


def test_a_failed_call_still_raises_the_grpc_error():
    import grpc
    import pytest

    async def main():
        server = make_server("tok", run_key=lambda: run_public_key(SECRET))
        pbg.add_StageServerServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            tr = Traffic()
            stub = pbg.StageServerStub(ChannelFactory("tok", traffic=tr, identity=Identity.joined("tok", SECRET, "w7", "worker")).open(f"127.0.0.1:{port}"))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Lease(pb.LeaseRequest(worker="w7"), timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
            bad = pbg.StageServerStub(ChannelFactory("wrong", traffic=tr).open(f"127.0.0.1:{port}"))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await bad.GetWeights(pb.WeightsRequest(worker="w"), timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0)

    asyncio.run(main())
