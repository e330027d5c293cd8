"""Streamed (chunked) transfers: assembly checks, and a transfer cut mid-way is never applied.

The RPC tests run a real stage server (``StageServer`` handlers on a real gRPC port) in
this process and talk to it over loopback with real chunk streams.
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
from shoal.net.stream import Assembler, assemble, chunk_bytes_from_mb, chunks_of, fetch, send, split
from shoal.net.wire import WireError, encode_tensor
from shoal.runtime.common import model_config
from shoal.runtime.roles.server import StageServer
from shoal.runtime.roles.worker import Worker, WorkerOptions
from shoal.runtime.safety.guard import GuardConfig

TOKEN = "chunk-test-token"
SECRET = b"chunk-test-secret"
W_ID = Identity.joined(TOKEN, SECRET, "w", "worker")  # the credential worker "w" gets at join
CHUNK = 4096


def _spec() -> pb.RunSpec:
    return pb.RunSpec(version=1, run_id="chunk-test", model="tiny", stages=2, steps=3, micro_batches=2, micro_batch_size=1,
                      seq_len=16, seed=0, lr=1e-3, min_lr=1e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                      ckpt_every=0, dead_after_s=30.0, min_lease_s=5.0, data="synthetic", ordered_grads=True,
                      chunk_bytes=CHUNK)


# ---------------------------------------------------------------------------- pure assembly
def _msg() -> pb.GradPush:
    g = torch.arange(3000, dtype=torch.float32).reshape(30, 100)
    return pb.GradPush(worker="w", step=1, mbs=[0, 1], grads=[encode_tensor("a", g), encode_tensor("b", -g)])


@pytest.mark.parametrize("chunk", [1000, 4096, 12_000, 1 << 20])
def test_split_and_assemble_round_trip(chunk):
    msg = _msg()
    chunks = list(chunks_of(msg, chunk))
    total = msg.ByteSize()
    assert len(chunks) == -(-total // chunk)
    assert all(c.total == total and c.kind == "GradPush" for c in chunks)
    assert max(len(c.data) for c in chunks) <= chunk
    assert assemble(chunks, pb.GradPush, total) == msg
    assert assemble(list(chunks_of(pb.GradPush(), chunk)), pb.GradPush, 10) == pb.GradPush()


def test_a_large_message_is_assembled_in_an_uninitialised_buffer_and_framed_from_it():
    """Above JOIN_RELEASE_BYTES the Assembler fills a numpy block chunk by chunk (no zeroing
    of the whole message, no reallocation): the same message, parsed whole or split into
    frames that are views of that block."""
    import numpy as np

    from shoal.net.wire import JOIN_RELEASE_BYTES, decode_tensor

    g = torch.randn(700, 800)
    msg = pb.WeightsReply(version=3, params=[encode_tensor("emb", g), encode_tensor("b", g[0])])
    data = msg.SerializeToString()
    assert len(data) > JOIN_RELEASE_BYTES
    assert assemble(split("WeightsReply", data, 256 << 10), pb.WeightsReply, len(data)) == msg
    asm = Assembler("WeightsReply", len(data))
    for c in split("WeightsReply", data, 300_001):
        asm.add(c)
    block = asm.arr
    got = asm.finish(pb.WeightsReply, frames_field=pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number)
    assert np.shares_memory(np.frombuffer(got.params[0].data, np.uint8), block)
    assert torch.equal(decode_tensor(got.params[0]), g) and got.version == 3


def test_a_spooled_message_goes_on_in_memory_when_its_disk_fills(tmp_path, monkeypatch):
    """A message received into a file whose disk fills mid-way (a real 1 MB tmpfs, filled by
    another file after the spool opened) goes on in memory with what the file held: the same
    message, and the spool folder holds nothing of it."""
    import subprocess

    from shoal.net.wire import split_framed
    from shoal.runtime.sync.local import GRADS_FIELD

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        msg = pb.GradPush(worker="w", grads=[encode_tensor("g", torch.randn(100_000))])  # 400 kB
        data = msg.SerializeToString()
        monkeypatch.setenv("SHOAL_SPOOL_MB", "0.1")
        asm = Assembler("GradPush", 10 * len(data), spool=disk)
        chunks = list(split("GradPush", data, 64 * 1024))
        asm.add(chunks[0])
        assert asm.file is not None
        (disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 128 * 1024))  # the disk is full after one more chunk
        for c in chunks[1:]:
            asm.add(c)
        assert asm.file is None
        got = asm.finish(pb.GradPush, frames_field=GRADS_FIELD)
        assert got.spool is None and bytes(got.grads[0].data) == msg.grads[0].data
        assert split_framed(data, pb.GradPush, GRADS_FIELD).head == got.head
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_assembler_refuses_what_does_not_fit():
    msg = _msg()
    chunks = list(chunks_of(msg, 1000))
    total = msg.ByteSize()
    with pytest.raises(WireError, match="cut after"):
        assemble(chunks[:-1], pb.GradPush, total)  # the last chunk never came
    with pytest.raises(WireError, match="before its first chunk"):
        assemble([], pb.GradPush, total)
    with pytest.raises(WireError, match="more than"):
        assemble(chunks, pb.GradPush, total - 1)  # bigger than this stage can expect
    with pytest.raises(WireError, match="expected a 'Relay'"):
        assemble(chunks, pb.Relay, total)
    with pytest.raises(WireError, match="expected byte"):
        assemble([chunks[0], chunks[2]], pb.GradPush, total)  # a gap
    with pytest.raises(WireError, match="expected byte"):
        assemble([chunks[0], chunks[0]], pb.GradPush, total)  # a repeat
    bad = pb.Chunk(kind="GradPush", total=total, offset=0, data=b"x" * (total + 1))
    with pytest.raises(WireError, match="run past"):
        assemble([bad], pb.GradPush, total)
    changed = pb.Chunk(kind="GradPush", total=total + 5, offset=len(chunks[0].data), data=bytes(chunks[1].data))
    with pytest.raises(WireError, match="first said"):
        assemble([chunks[0], changed], pb.GradPush, total + 5)
    junk = list(split("GradPush", b"\xff" * 50, 16))
    with pytest.raises(WireError, match="do not parse"):
        assemble(junk, pb.GradPush, 100)
    asm = Assembler("GradPush", total)
    asm.add(chunks[0])
    assert asm.got == len(chunks[0].data)
    # A message whole in one chunk is parsed from that chunk; anything after it is refused.
    (whole,) = chunks_of(msg, total)
    assert assemble([whole], pb.GradPush, total) == msg
    with pytest.raises(WireError, match="run past"):
        assemble([whole, pb.Chunk(kind="GradPush", total=total, offset=total, data=b"x")], pb.GradPush, total)
    with pytest.raises(WireError, match="expected byte"):
        assemble([whole, whole], pb.GradPush, total)
    with pytest.raises(WireError, match="first said"):
        assemble([whole, pb.Chunk(kind="GradPush", total=total + 1, offset=total, data=b"x")], pb.GradPush, total + 1)


def test_chunk_mb_flag_values():
    assert chunk_bytes_from_mb(None) == 1024 * 1024
    assert chunk_bytes_from_mb(1) == 1024 * 1024
    assert chunk_bytes_from_mb(0, default=0) == 0
    from shoal.errors import ShoalError

    with pytest.raises(ShoalError, match="--chunk-mb"):
        chunk_bytes_from_mb(-1)


# ---------------------------------------------------------------------------- real server
class _Server(StageServer):
    """A real stage server whose weight stream can be made to stop after ``cut_after`` chunks."""

    cut_after: int | None = None
    cut_abort = False
    cut_hang = False  # after cut_after chunks send nothing more and never end (a path gone silent)

    async def GetWeightsStream(self, request, context):
        n = 0
        async for chunk in super().GetWeightsStream(request, context):
            if self.cut_after is not None and n >= self.cut_after:
                if self.cut_abort:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "link dropped")
                if self.cut_hang:
                    await asyncio.sleep(3600)
                return
            n += 1
            yield chunk


async def _start(tmp_path) -> tuple[_Server, grpc.aio.Server, str]:
    """Stage 0 [0, 3) of tiny at version 0, serving on a loopback port (no coordinator)."""
    srv = _Server("127.0.0.1:9", "127.0.0.1:0", TOKEN, str(tmp_path), name="s-test")
    srv.spec = _spec()
    srv.stage, srv.epoch = 0, 0
    srv.guard_cfg = GuardConfig(enabled=False)  # the pushes here are made up
    await srv._load(0, 0, 3, 0, 0)
    srv.ready = True
    srv.channels.identity.run_key = run_public_key(SECRET)  # what joining would have given it
    rpc = await srv.start_rpc()
    return srv, rpc, srv.address


def _push_msg(srv: StageServer, mb: int, nan: bool = False) -> pb.GradPush:
    gen = torch.Generator().manual_seed(mb)
    msg = pb.GradPush(worker="w", step=0, epoch=0, gen=srv._worker("w").gen, mbs=[mb])
    for name, p in srv.params.items():
        g = torch.randn(p.shape, generator=gen)
        if nan:
            g.view(-1)[0] = float("nan")
        msg.grads.append(encode_tensor(name, g))
    return msg


@pytest.mark.timeout(60)
def test_a_push_cut_mid_way_is_not_applied(tmp_path):
    async def main():
        srv, rpc, addr = await _start(tmp_path)
        try:
            for mb in (0, 1):
                st = srv.steps[0][mb]
                st.grad, st.holder = "computed", "w"
            msg = _push_msg(srv, 0)
            chunks = list(chunks_of(msg, CHUNK))
            assert len(chunks) > 10
            async with open_channel(addr, TOKEN, identity=W_ID) as ch:
                stub = pbg.StageServerStub(ch)
                # 1. The stream ends early (the sender stopped): refused, nothing applied.
                rep = await stub.PushGradsStream(iter(chunks[: len(chunks) // 2]), timeout=10)
                assert not rep.accepted and "cut after" in rep.reason
                assert srv.pushes == [] and srv.steps[0][0].grad == "computed"

                # 2. The call breaks mid-way (the sender's side cancels it after half the chunks).
                sent = asyncio.Event()

                async def half_then_hang():
                    for c in chunks[: len(chunks) // 2]:
                        yield c
                    sent.set()
                    await asyncio.sleep(30)

                call = stub.PushGradsStream(half_then_hang(), timeout=20)
                await asyncio.wait_for(sent.wait(), 10)
                await asyncio.sleep(0.3)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                await asyncio.sleep(0.3)
                assert srv.pushes == [] and srv.steps[0][0].grad == "computed"

                # 3. A whole stream with a NaN gradient: assembled, then refused by the frame checks.
                bad = _push_msg(srv, 1, nan=True)
                rep = await send(stub.PushGradsStream, bad, CHUNK)
                assert not rep.accepted and "inf or NaN" in rep.reason
                assert srv.pushes == []

                # 4. A whole stream: accepted and applied once (the NaN push voided the worker,
                # so its micro-batches are held again under its new generation).
                for mb in (0, 1):
                    st = srv.steps[0][mb]
                    st.grad, st.holder = "computed", "w"
                msg = _push_msg(srv, 0)
                rep = await send(stub.PushGradsStream, msg, CHUNK)
                assert rep.accepted, rep.reason
                assert len(srv.pushes) == 1 and srv.steps[0][0].grad == "counted"
                name = next(iter(srv.params))
                assert torch.equal(srv.pushes[0][1][name], torch.randn(
                    srv.params[name].shape, generator=torch.Generator().manual_seed(0)))
        finally:
            await rpc.stop(0)

    asyncio.run(main())


def _zeroed_worker(opts: WorkerOptions) -> Worker:
    """Worker "w" on stage 0 [0, 3) of the test spec, every weight zero (a pull must change them)."""
    w = Worker("127.0.0.1:9", TOKEN, opts)
    w.spec, w.member_id = _spec(), "w"
    w.cfg = model_config(w.spec)
    w._switch(0, 0, 3)
    with torch.no_grad():
        for p in w.params.values():
            p.zero_()
    return w


@pytest.mark.timeout(60)
def test_a_weight_pull_cut_mid_way_leaves_the_worker_weights_alone(tmp_path):
    async def main():
        srv, rpc, addr = await _start(tmp_path)
        try:
            w = _zeroed_worker(WorkerOptions(name="w"))
            async with open_channel(addr, TOKEN, identity=W_ID) as ch:
                w.server = pbg.StageServerStub(ch)
                for abort in (False, True):
                    srv.cut_after, srv.cut_abort = 5, abort
                    with pytest.raises(WireError if not abort else grpc.aio.AioRpcError):
                        await w._pull()
                    assert w.version == -1
                    assert all(float(p.detach().abs().max()) == 0.0 for p in w.params.values())
                srv.cut_after = None
                await w._pull()
                assert w.version == 0
                for name, p in srv.params.items():
                    assert torch.equal(w.params[name], p.detach())
        finally:
            await rpc.stop(0)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_weight_pull_whose_chunks_stop_coming_is_abandoned_at_the_stall_limit(tmp_path):
    """The server's chunks stop after 5 and the call never ends (a silent path): the worker's
    pull gives up once no chunk came for ``pull_stall_s``, not at the call's deadline (a
    minute plus the weights at 1 MB/s), applies nothing, and the next pull completes."""
    import time

    async def main():
        srv, rpc, addr = await _start(tmp_path)
        try:
            w = _zeroed_worker(WorkerOptions(name="w", pull_stall_s=1.0))
            async with open_channel(addr, TOKEN, identity=W_ID) as ch:
                w.server = pbg.StageServerStub(ch)
                srv.cut_after, srv.cut_hang = 5, True
                t0 = time.monotonic()
                with pytest.raises(WireError, match="no chunk came for 1 s"):
                    await w._pull()
                waited = time.monotonic() - t0
                assert w.version == -1
                assert all(float(p.detach().abs().max()) == 0.0 for p in w.params.values())
                srv.cut_after = None
                await w._pull()
                assert w.version == 0
        finally:
            await rpc.stop(0)
        return waited

    waited = asyncio.run(main())
    assert waited >= 1.0, waited  # the stall limit, not the call's deadline: the error says which


@pytest.mark.timeout(60)
def test_weights_are_serialised_once_and_served_to_every_puller(tmp_path):
    async def main():
        srv, rpc, addr = await _start(tmp_path)
        try:
            first = await srv._weights_bytes()
            assert (await srv._weights_bytes()) is first  # no new copy for the next puller
            numel = sum(p.numel() for p in srv.params.values())
            async with open_channel(addr, TOKEN, identity=W_ID) as ch:
                stub = pbg.StageServerStub(ch)
                reps = await asyncio.gather(*[
                    fetch(stub.GetWeightsStream, pb.WeightsRequest(worker="w"), pb.WeightsReply,
                          4 * numel + 100_000) for i in range(3)])
            assert (await srv._weights_bytes()) is first
            for rep in reps:
                assert rep.SerializeToString() == first
                assert [f.name for f in rep.params] == list(srv.params)
            # A new version is serialised anew (the old bytes are dropped).
            with torch.no_grad():
                next(iter(srv.params.values())).add_(1.0)
            srv.version = srv.step = 1
            srv._wcache = None
            assert (await srv._weights_bytes()) != first
        finally:
            await rpc.stop(0)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_streamed_calls_need_the_token(tmp_path):
    async def main():
        srv, rpc, addr = await _start(tmp_path)
        try:
            async with open_channel(addr, "wrong-token") as ch:
                stub = pbg.StageServerStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await fetch(stub.GetWeightsStream, pb.WeightsRequest(worker="x"), pb.WeightsReply, 1 << 30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                srv.steps[0][0].grad, srv.steps[0][0].holder = "computed", "w"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await send(stub.PushGradsStream, _push_msg(srv, 0), CHUNK)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert srv.pushes == [] and "x" not in srv.workers
        finally:
            await rpc.stop(0)

    asyncio.run(main())


def test_a_large_message_parsed_in_pieces_equals_one_parse():
    """parse_in_pieces (what Assembler.finish uses above PIECE_BYTES) gives exactly FromString's
    message, with any piece size, and refuses bytes that are not a message."""
    import pytest
    import torch

    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import field_ends, parse_in_pieces
    from shoal.net.wire import WireError, encode_tensor

    g = torch.Generator().manual_seed(0)
    push = pb.GradPush(worker="w1", step=3, epoch=1, gen=2, mbs=[0, 1, 5], local_sq_norm=0.25)
    for i, n in enumerate((1, 700, 40000, 3)):
        push.grads.append(encode_tensor(f"p{i}", torch.randn(n, generator=g)))
    pull = pb.WeightsReply(version=7, epoch=1, first=0, last=3, compress_chain="c", compress_base=6)
    pull.params.extend(push.grads)
    for msg in (push, pull):
        data = msg.SerializeToString()
        assert field_ends(data)[-1] == len(data)
        for piece in (1, 100, 5000, 1 << 30):
            assert parse_in_pieces(data, type(msg), piece) == msg
            assert parse_in_pieces(bytearray(data), type(msg), piece).SerializeToString() == data
    with pytest.raises(ValueError):
        field_ends(b"\x0a\xff\xff\xff\x7f")  # a length past the end
    from shoal.net.stream import Assembler
    asm = Assembler("GradPush", 1 << 30)
    bad = b"\x0a\x05abc"  # field 1, 5 bytes announced, 3 there
    asm.add(pb.Chunk(kind="GradPush", total=len(bad), offset=0, data=bad))
    with pytest.raises(WireError):
        asm.finish(pb.GradPush)


def test_frames_split_from_the_received_bytes_equal_the_parsed_message():
    """split_framed (what a worker's weight pull and a server's streamed push use): assembled
    from chunks, the head is the message without its frames, each frame has the parsed frame's
    fields, a raw payload is a view of the received buffer (not a copy) that decodes to the
    same tensor, a codec frame decodes the same, its size is the bytes received, and the
    traffic counters count the split message as the whole one. Bytes that are not a message
    are refused."""
    import numpy as np

    from shoal.net.traffic import Traffic
    from shoal.net.wire import Framed, decode_tensor, message_nbytes, serialize_framed, split_framed

    g = torch.Generator().manual_seed(0)
    pull = pb.WeightsReply(version=7, epoch=1, first=0, last=3, compress_chain="c", compress_base=6)
    pull.params.extend([encode_tensor("a", torch.randn(3, 700, generator=g)),
                        encode_tensor("b", torch.randn(5, generator=g).to(torch.bfloat16)),
                        encode_tensor("c", torch.randn(40000, generator=g), "int8"),
                        encode_tensor("d", torch.zeros(0))])
    number = pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number
    head = pb.WeightsReply()
    head.CopyFrom(pull)
    del head.params[:]
    for data in (pull.SerializeToString(), serialize_framed(head, number, list(pull.params))):
        asm = Assembler("WeightsReply", 1 << 30)
        for c in split("WeightsReply", data, 1000):
            asm.add(c)
        buf = asm.buf
        spans: list = []
        got = asm.finish(pb.WeightsReply, spans, frames_field=number)
        assert isinstance(got, Framed) and got.head == head and got.version == 7 and got.compress_chain == "c"
        assert message_nbytes(got) == len(data) == message_nbytes(pull)
        assert [(f.name, f.dtype, list(f.shape), f.codec or "raw") for f in got.params] == \
            [(f.name, f.dtype, list(f.shape), f.codec or "raw") for f in pull.params]
        raw_a = got.params[0].data
        assert isinstance(raw_a, memoryview) and np.shares_memory(np.frombuffer(raw_a, np.uint8),
                                                                   np.frombuffer(buf, np.uint8))
        for mine, theirs in zip(got.params, pull.params, strict=True):
            assert torch.equal(decode_tensor(mine), decode_tensor(theirs))
        whole, parts = Traffic(), Traffic()
        whole.count(pull, total=len(data), spans=spans)
        parts.count(got, total=len(data), spans=spans)
        assert parts.counter.as_dict() == whole.counter.as_dict()
        assert set(parts.counter.as_dict()) == {"weight_pull/raw", "weight_pull/int8", "control/raw"}
    for bad in (b"\x2a\x05abc", b"\x2a\x03\x22\x09x"):  # a frame past the end; a payload past its frame
        with pytest.raises(ValueError):
            split_framed(bad, pb.WeightsReply, number)
    asm = Assembler("WeightsReply", 1 << 30)
    asm.add(pb.Chunk(kind="WeightsReply", total=5, offset=0, data=b"\x2a\x05abc"))
    with pytest.raises(WireError):
        asm.finish(pb.WeightsReply, frames_field=number)
