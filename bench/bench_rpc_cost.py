"""CPU cost of one gRPC aio exchange on loopback, by call shape (what a call per task costs).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rpc_cost.py [--calls 3000] [--bytes 1024]

A bare grpc.aio server (no shoal handler, no auth, raw bytes) runs in a child process and
echoes; the client makes ``--calls`` exchanges of each shape and prints the client's and the
server's CPU microseconds per exchange: a unary call, a server-streaming call and a
client-streaming call of one message each (how shoal's streamed calls look when the payload
fits one chunk), and one message each way on an open bidirectional stream (what one stream
per worker would pay per task). The floor under shoal's per-task cost, not shoal's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

import grpc


def _ident(b: bytes) -> bytes:
    return b


def _handlers() -> grpc.GenericRpcHandler:
    async def unary(req, ctx):
        return req

    async def server_stream(req, ctx):
        yield req

    async def client_stream(it, ctx):
        last = b""
        async for m in it:
            last = m
        return last

    async def bidi(it, ctx):
        async for m in it:
            yield m

    return grpc.method_handlers_generic_handler("bench.Echo", {
        "U": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
        "S": grpc.unary_stream_rpc_method_handler(server_stream, _ident, _ident),
        "C": grpc.stream_unary_rpc_method_handler(client_stream, _ident, _ident),
        "D": grpc.stream_stream_rpc_method_handler(bidi, _ident, _ident),
    })


def _serve(q) -> None:
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")  # loopback only
        await server.start()
        q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(port: int, calls: int, payload: bytes, server_pid: int) -> list[tuple[str, float, float]]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    u = ch.unary_unary("/bench.Echo/U", _ident, _ident)
    s = ch.unary_stream("/bench.Echo/S", _ident, _ident)
    c = ch.stream_unary("/bench.Echo/C", _ident, _ident)
    d = ch.stream_stream("/bench.Echo/D", _ident, _ident)
    await u(payload)  # connect first

    async def one():
        yield payload

    async def drain(call):
        async for _ in call:
            pass

    shapes = {"unary call": lambda: u(payload), "server-streaming call, 1 message": lambda: drain(s(payload)),
              "client-streaming call, 1 message": lambda: c(one())}
    rows = []
    for name, f in shapes.items():
        c0, s0 = time.process_time(), _cpu_s(server_pid)
        for _ in range(calls):
            await f()
        rows.append((name, (time.process_time() - c0) / calls, (_cpu_s(server_pid) - s0) / calls))
    call = d()
    c0, s0 = time.process_time(), _cpu_s(server_pid)
    for _ in range(calls):
        await call.write(payload)
        await call.read()
    rows.append(("open bidirectional stream, 1 message each way", (time.process_time() - c0) / calls,
                 (_cpu_s(server_pid) - s0) / calls))
    await call.done_writing()
    await ch.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="exchanges per call shape")
    ap.add_argument("--bytes", type=int, default=1024, help="payload bytes each way")
    args = ap.parse_args(argv)
    q = mp.Queue()
    proc = mp.Process(target=_serve, args=(q,), daemon=True)
    proc.start()
    try:
        rows = asyncio.run(_measure(q.get(timeout=60), args.calls, b"x" * args.bytes, proc.pid))
    finally:
        proc.kill()
    print(f"gRPC aio on loopback, {args.bytes} B each way, {args.calls} exchanges per shape, "
          f"grpcio {grpc.__version__}, {os.cpu_count()} cores\n")
    print("| exchange | client CPU us | server CPU us | total us |")
    print("|---|---|---|---|")
    for name, cl, sv in rows:
        print(f"| {name} | {cl * 1e6:.0f} | {sv * 1e6:.0f} | {(cl + sv) * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
