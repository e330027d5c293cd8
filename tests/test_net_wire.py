"""Wire safety: tensor frames, the join-token interceptor, and the runtime's pure decisions."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.channel import load_token, make_server, open_channel
from shoal.net.wire import (
    WireError,
    all_finite,
    decode_tensor,
    encode_frame,
    encode_tensor,
    frame_size,
    serialize_framed,
)
from shoal.runtime.common import assign_workers, even_split, lease_seconds


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_frame_roundtrip_exact(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    frame = encode_tensor("x", t)
    back = decode_tensor(pb.Tensor.FromString(frame.SerializeToString()), shape=(3, 5))
    assert back.dtype == dtype and torch.equal(back, t)


def test_serialize_framed_parses_to_the_same_message_at_the_same_size():
    frames = [encode_tensor("a", torch.randn(300, 7)), encode_tensor("b", torch.zeros(0)),
              encode_tensor("c", torch.randn(5).to(torch.bfloat16)), encode_tensor("d", torch.randn(4, 4), "int8"),
              encode_tensor("e", torch.arange(200, dtype=torch.int64))]
    head = pb.GradPush(worker="w-1", step=3, epoch=2, gen=1, mbs=[0, 2])
    data = serialize_framed(head, pb.GradPush.DESCRIPTOR.fields_by_name["grads"].number, frames)
    whole = pb.GradPush(worker="w-1", step=3, epoch=2, gen=1, mbs=[0, 2], grads=frames)
    assert pb.GradPush.FromString(data) == whole
    assert data == whole.SerializeToString()
    assert [frame_size(f) for f in frames] == [f.ByteSize() for f in frames]
    back = decode_tensor(pb.GradPush.FromString(data).grads[0], shape=(300, 7), dtype="float32")
    assert torch.equal(back, decode_tensor(frames[0]))


def test_view_frames_serialise_to_the_same_bytes_without_a_copy():
    """encode_frame(view=True), what pushes and weight pulls are framed with: the raw payload is
    a view of the tensor's memory (no copy), a codec payload is bytes as before, and the
    serialised message is byte for byte the one built from copied payloads (fp32, bf16, empty,
    0-d, int64, int8)."""
    import numpy as np

    tensors = {"a": torch.randn(300, 7), "b": torch.zeros(0, 3), "c": torch.randn(5).to(torch.bfloat16),
               "d": torch.tensor(2.5), "e": torch.arange(200, dtype=torch.int64), "f": torch.randn(4, 4)}
    codecs = {"f": "int8"}
    copied = [encode_frame(n, t, codecs.get(n, "raw")) for n, t in tensors.items()]
    viewed = [encode_frame(n, t, codecs.get(n, "raw"), view=True) for n, t in tensors.items()]
    a = viewed[0].data
    assert isinstance(a, memoryview) and np.shares_memory(np.frombuffer(a, np.uint8), tensors["a"].numpy())
    assert isinstance(viewed[5].data, bytes) and viewed[1].data == b""
    head = pb.WeightsReply(version=3)
    field = pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number
    assert serialize_framed(head, field, viewed) == serialize_framed(head, field, copied)
    assert [frame_size(f) for f in viewed] == [frame_size(f) for f in copied]


def test_a_large_framed_message_is_the_same_bytes_joined_without_the_interpreter_lock():
    """Above JOIN_RELEASE_BYTES serialize_framed joins by numpy copies (which let threads run)
    into a read-only view: the same bytes as protobuf's own serialisation, parsed the same;
    below it, plain bytes."""
    from shoal.net.wire import JOIN_RELEASE_BYTES, join_pieces

    tensors = {"emb": torch.randn(700, 512), "b": torch.randn(512), "h": torch.randn(3).to(torch.bfloat16)}
    frames = [encode_frame(n, t, view=True) for n, t in tensors.items()]
    head = pb.WeightsReply(version=7, epoch=1, first=0, last=2)
    field = pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number
    data = serialize_framed(head, field, frames)
    assert len(data) > JOIN_RELEASE_BYTES and isinstance(data, memoryview) and data.readonly
    whole = pb.WeightsReply(version=7, epoch=1, first=0, last=2, params=[encode_tensor(n, t) for n, t in tensors.items()])
    assert data == whole.SerializeToString()
    assert pb.WeightsReply.FromString(data) == whole
    pieces = [b"ab", memoryview(torch.arange(5, dtype=torch.int32).numpy()), b"", bytearray(b"z")]
    small = join_pieces(pieces)
    assert isinstance(small, bytes) and small == b"".join(bytes(memoryview(p)) for p in pieces)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_torch(dtype):
    t = torch.randn(64, 9).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[17, 3] = bad
        assert not all_finite(u)
        assert not all_finite(u[17:18, 2:5])  # a non-contiguous view


def test_all_finite_finds_a_bad_entry_in_any_block(monkeypatch):
    import shoal.net.wire as wire

    monkeypatch.setattr(wire, "FINITE_BLOCK", 7)  # many blocks and a short last one in 64 x 9
    t = torch.randn(64, 9)
    assert all_finite(t)
    for at in (0, 6, 7, 300, 575):  # first, end of a block, start of one, middle, last element
        u = t.clone().reshape(-1)
        u[at] = float("nan")
        assert not all_finite(u.reshape(64, 9)), at
    assert all_finite(torch.empty(0))


def test_a_raw_frame_decoded_without_a_copy_is_a_view_of_its_payload():
    from shoal.net.wire import Frame

    t = torch.randn(5, 7)
    payload = bytearray(b"\0" * 3 + t.numpy().tobytes())  # at an odd offset, as in a received message
    frame = Frame(name="w", dtype="float32", shape=[5, 7], data=memoryview(payload)[3:], codec="raw", meta=b"")
    view = decode_tensor(frame, shape=(5, 7), dtype="float32", finite=True, copy=False)
    assert torch.equal(view, t) and torch.equal(decode_tensor(frame, shape=(5, 7)), t)
    payload[3:7] = torch.tensor([2.5]).numpy().tobytes()  # the view reads the payload's bytes
    assert float(view[0, 0]) == 2.5 and float(decode_tensor(frame)[0, 0]) == 2.5
    nan = bytearray(payload)
    nan[3 + 4 * 9:3 + 4 * 10] = torch.tensor([float("nan")]).numpy().tobytes()
    bad = Frame(name="w", dtype="float32", shape=[5, 7], data=memoryview(nan)[3:], codec="raw", meta=b"")
    with pytest.raises(WireError, match="inf or NaN"):
        decode_tensor(bad, finite=True, copy=False)


def test_frame_checks_shape_dtype_length_and_finite():
    frame = encode_tensor("g", torch.ones(2, 3))
    with pytest.raises(WireError, match="shape"):
        decode_tensor(frame, shape=(3, 2))
    with pytest.raises(WireError, match="dtype"):
        decode_tensor(frame, dtype="float16")
    bad = pb.Tensor(name="g", dtype="float32", shape=[2, 3], data=b"\0" * 23, codec="raw")
    with pytest.raises(WireError, match="payload"):
        decode_tensor(bad)
    with pytest.raises(WireError, match="unknown dtype"):
        decode_tensor(pb.Tensor(name="g", dtype="object", shape=[1], data=b"\0" * 8))
    with pytest.raises(WireError, match="limit"):
        decode_tensor(pb.Tensor(name="g", dtype="float32", shape=[1 << 20, 1 << 20], data=b""))
    nan = torch.ones(4)
    nan[2] = float("nan")
    assert torch.isnan(decode_tensor(encode_tensor("g", nan))).any()  # allowed unless asked
    with pytest.raises(WireError, match="inf or NaN"):
        decode_tensor(encode_tensor("g", nan), finite=True)


def test_frame_lossy_codec_goes_through_compress():
    t = torch.randn(4, 64)
    frame = encode_tensor("a", t, codec="fp16")
    assert frame.codec == "fp16" and len(frame.data) < t.numel() * 4
    back = decode_tensor(frame, shape=(4, 64), dtype="float32")
    assert torch.allclose(back, t, atol=1e-2)
    with pytest.raises(WireError, match="codec"):
        decode_tensor(pb.Tensor(name="a", dtype="float32", shape=[1], data=b"\0" * 4, codec="zip"))


class _Coord(pbg.CoordinatorServicer):
    def __init__(self):
        self.joins = 0

    async def Join(self, request, context):
        self.joins += 1
        return pb.JoinReply(member_id="m1")


def test_wrong_token_is_refused_before_the_handler():
    async def main():
        svc = _Coord()
        server = make_server("right-token")
        pbg.add_CoordinatorServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{port}", "wrong-token") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pbg.CoordinatorStub(ch).Join(pb.JoinRequest(role="worker"), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "token" in err.value.details()
            # No token at all (a plain channel): refused the same way; shoal refuses to send an empty one.
            with pytest.raises(ShoalError, match="empty join token"):
                open_channel(f"127.0.0.1:{port}", "")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pbg.CoordinatorStub(ch).Join(pb.JoinRequest(role="worker"), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert svc.joins == 0
            async with open_channel(f"127.0.0.1:{port}", "right-token") as ch:
                rep = await pbg.CoordinatorStub(ch).Join(pb.JoinRequest(role="worker"), timeout=5)
            assert rep.member_id == "m1" and svc.joins == 1
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_dial_hook_reroutes_the_channel():
    seen = []

    def dial(addr):
        seen.append(addr)
        return addr

    async def main():
        ch = open_channel("127.0.0.1:9", "t", dial=dial)
        await ch.close()

    asyncio.run(main())
    assert seen == ["127.0.0.1:9"]


def test_load_token(tmp_path, monkeypatch):
    monkeypatch.delenv("SHOAL_TOKEN", raising=False)
    from shoal.errors import ShoalError

    with pytest.raises(ShoalError, match="SHOAL_TOKEN"):
        load_token()
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert load_token(token_file=str(f)) == "abc"
    monkeypatch.setenv("SHOAL_TOKEN", "env")
    assert load_token() == "env"


def test_even_split_and_assignment():
    assert even_split(6, 2) == [(0, 3), (3, 6)]
    assert even_split(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    flops = {"a": 4.0, "b": 1.0, "c": 1.0, "d": 1.0}
    a = assign_workers(flops, [1.0, 1.0])
    assert a["a"] != a["b"] and sorted(a.values()).count(a["a"]) == 1  # the fast one alone
    # keep assignments; an emptied stage takes a worker from a stage that has two or more
    a2 = assign_workers({"b": 1.0, "c": 1.0, "d": 1.0}, [1.0, 1.0], {"b": 1, "c": 1, "d": 1})
    assert set(a2.values()) == {0, 1}
    # a late joiner goes to the stage with the least capacity per unit of work
    a3 = assign_workers({"x": 1.0, "y": 1.0, "z": 1.0}, [1.0, 3.0], {"x": 0, "y": 1})
    assert a3["z"] == 1


def test_assignment_keeps_workers_to_stages_their_memory_holds():
    from shoal.runtime.common import assign_workers

    flops = {"big": 4.0, "small": 1.0, "tiny": 1.0}
    fits = {"big": [0, 1], "small": [1], "tiny": []}  # stage 0 is the larger one
    got = assign_workers(flops, [3.0, 1.0], None, fits)
    assert got == {"big": 0, "small": 1}  # "tiny" fits nowhere: left out
    # a kept assignment that does not fit is dropped and made again where it fits
    assert assign_workers(flops, [1.0, 1.0], {"small": 0, "big": 1}, fits) == {"small": 1, "big": 0}
    # an emptied stage only takes a worker that fits it: here none can leave stage 1 for 0
    got = assign_workers({"s1": 1.0, "s2": 1.0}, [1.0, 1.0], {"s1": 1, "s2": 1}, {"s1": [1], "s2": [1]})
    assert got == {"s1": 1, "s2": 1}
    # a worker with no memory figure may take any stage
    assert assign_workers({"x": 1.0, "y": 1.0}, [1.0, 1.0], None, {"x": [1]}) == {"x": 1, "y": 0}


def test_lease_seconds():
    assert lease_seconds(None, 2.0) == 2.0
    assert lease_seconds(0.1, 2.0) == 2.0
    assert lease_seconds(1.0, 2.0) == 4.0


def test_heartbeat_period_leaves_four_beats_before_death_or_lease_expiry():
    from shoal.runtime.common import heartbeat_period

    assert heartbeat_period(3.0, 2.0) == 0.5  # the defaults
    assert heartbeat_period(30.0, 20.0) == 1.0  # at most 1 s
    assert heartbeat_period(0.3, 2.0) == 0.2  # at least 0.2 s
    for dead, lease in ((3.0, 2.0), (1.2, 5.0), (8.0, 2.4)):
        assert 4 * heartbeat_period(dead, lease) <= min(dead, lease)


def test_ordered_groups_presum_only_the_prefix_bitwise():
    from shoal.runtime.sync.ordered import ordered_groups

    g = {mb: {"w": torch.randn(50) * 10 ** (mb % 3)} for mb in range(6)}
    groups = ordered_groups({mb: g[mb] for mb in (0, 1, 2, 4)})
    assert [ids for ids, _ in groups] == [[0, 1, 2], [4]]
    seq = g[0]["w"].clone()
    for mb in (1, 2):
        seq += g[mb]["w"]
    assert torch.equal(groups[0][1]["w"], seq)
    assert [ids for ids, _ in ordered_groups({mb: g[mb] for mb in (1, 2, 5)})] == [[1], [2], [5]]


# ---------------------------------------------------------------------------- chunks as views

def test_a_chunk_view_serialises_to_the_chunk_and_parses_as_a_view_of_its_bytes():
    from google.protobuf.message import DecodeError

    from shoal.net.stream import split
    from shoal.net.wire import ChunkView, parse_chunk, serialize_chunk

    whole = bytes(range(256)) * 40  # 10240 bytes: three chunks of 4096
    sent = list(split("Relay", whole, 4096, sender="s1"))
    assert [type(c) for c in sent] == [ChunkView] * 3 and isinstance(sent[0].data, memoryview)
    for c in sent:
        wire = serialize_chunk(c)
        ref = pb.Chunk.FromString(wire)  # what protobuf reads from the bytes shoal writes
        assert (ref.kind, ref.total, ref.offset, ref.data, ref.sender) == ("Relay", len(whole), c.offset,
                                                                           bytes(c.data), "s1")
        got = parse_chunk(pb.Chunk(kind="Relay", total=len(whole), offset=c.offset, data=bytes(c.data),
                                   sender="s1").SerializeToString())
        assert (got.kind, got.total, got.offset, bytes(got.data), got.sender) == (ref.kind, ref.total, ref.offset,
                                                                                 ref.data, ref.sender)
        buf = bytearray(wire)
        view = parse_chunk(buf)
        buf[-1] ^= 0xFF  # the data is the received bytes themselves, not a copy of them
        assert view.data[-1] == buf[-1]
    assert b"".join(bytes(parse_chunk(serialize_chunk(c)).data) for c in sent) == whole
    empty = list(split("Relay", b"", 4096))
    assert len(empty) == 1 and serialize_chunk(empty[0]) == pb.Chunk(kind="Relay").SerializeToString()
    assert serialize_chunk(pb.Chunk(kind="x", data=b"ab")) == pb.Chunk(kind="x", data=b"ab").SerializeToString()
    with pytest.raises(DecodeError):
        parse_chunk(serialize_chunk(sent[0])[:-10])  # cut inside the payload
    with pytest.raises(DecodeError):
        parse_chunk(b"\x0a\xff\xff")  # a string field whose length runs past the end
