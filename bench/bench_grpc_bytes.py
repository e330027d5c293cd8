"""What a byte costs to send and to receive over gRPC's asyncio API, against a bare socket.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/bench_grpc_bytes.py [--mb 200] [--chunk-mb 1] [--repeat 2]

A sender streams ``--mb`` MB in ``--chunk-mb`` messages to a receiver in another process (one
client-streaming call per 10 messages, as shoal's chunked transfers are), over loopback, and
each end's process CPU time is read around the transfer. Four ways: gRPC aio in plain text and
with mutual TLS (keys made by ``shoal.net.tls.make_keys``, as ``shoal launch`` makes them), and
an asyncio socket carrying the same bytes in plain text and with TLS: the floor the transport
itself sets. Both processes tune glibc's allocator as every shoal process does
(``shoal.memory.tune_malloc``: a 1 MB buffer is reused, not mapped afresh). Prints CPU ms per MB at each end and the wall time per MB (the best of
``--repeat``). The per-byte part of a stage server's CPU per task
(``FrameworkCpu.server_task_byte_s``) is this cost, paid once per received and once per sent
byte at each of the two servers on an activation's way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
GROUP = 10  # messages a call carries


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tls_files(folder: str) -> tuple[bytes, bytes, bytes]:
    from shoal.net.tls import CA_FILE, CERT_FILE, KEY_FILE

    d = Path(folder)
    return (d / CA_FILE).read_bytes(), (d / CERT_FILE).read_bytes(), (d / KEY_FILE).read_bytes()


def _ssl_contexts(folder: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from shoal.net.tls import CA_FILE, CERT_FILE, KEY_FILE

    d = Path(folder)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(d / CA_FILE))
    server.load_cert_chain(d / CERT_FILE, d / KEY_FILE)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(cafile=str(d / CA_FILE))
    client.load_cert_chain(d / CERT_FILE, d / KEY_FILE)
    return server, client


# ------------------------------------------------------------------ receiver (its own process)


async def _receive_grpc(port_file: str, tls: str) -> None:
    import grpc

    async def up(requests, _ctx):
        n = 0
        async for msg in requests:
            n += len(msg)
        return b"%d" % n

    async def cpu(_req, _ctx):
        return repr(_cpu()).encode()

    handler = grpc.method_handlers_generic_handler("bench.Bytes", {
        "Up": grpc.stream_unary_rpc_method_handler(up), "Cpu": grpc.unary_unary_rpc_method_handler(cpu)})
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
    server.add_generic_rpc_handlers((handler,))
    if tls:
        ca, cert, key = _tls_files(tls)
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


async def _receive_socket(port_file: str, tls: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readexactly(8)
            except asyncio.IncompleteReadError:  # the sender is done
                return
            size = int.from_bytes(head, "big")
            if size == 0:  # a CPU query
                writer.write(repr(_cpu()).encode().ljust(32))
                await writer.drain()
                continue
            await reader.readexactly(size)

    ctx = _ssl_contexts(tls)[0] if tls else None
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx, limit=4 << 20)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    await server.serve_forever()


# ------------------------------------------------------------------ sender


async def _send_grpc(port: int, tls: str, payload: bytes, n: int) -> tuple[float, float, float]:
    import grpc

    opts = [("grpc.max_send_message_length", 256 << 20)]
    if tls:
        ca, cert, key = _tls_files(tls)
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=opts)
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    async with channel:
        up, cpu = channel.stream_unary("/bench.Bytes/Up"), channel.unary_unary("/bench.Bytes/Cpu")

        async def group(k: int):
            for _ in range(k):
                yield payload

        await up(group(GROUP))  # warm: connection, handshake, buffers
        r0, c0, t0 = float(await cpu(b"")), _cpu(), time.perf_counter()
        for _ in range(n // GROUP):
            await up(group(GROUP))
        t1, c1, r1 = time.perf_counter(), _cpu(), float(await cpu(b""))
    return c1 - c0, r1 - r0, t1 - t0


async def _send_socket(port: int, tls: str, payload: bytes, n: int) -> tuple[float, float, float]:
    ctx = _ssl_contexts(tls)[1] if tls else None
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    head = len(payload).to_bytes(8, "big")

    async def their_cpu() -> float:
        writer.write((0).to_bytes(8, "big"))
        await writer.drain()
        return float((await reader.readexactly(32)).decode())

    for _ in range(GROUP):
        writer.write(head + payload)
    await writer.drain()
    r0, c0, t0 = await their_cpu(), _cpu(), time.perf_counter()
    for _ in range(n):
        writer.write(head)
        writer.write(payload)
        await writer.drain()
    r1 = await their_cpu()  # after every byte before it was read
    t1, c1 = time.perf_counter(), _cpu()
    writer.close()
    return c1 - c0, r1 - r0, t1 - t0


def _run(way: str, tls: str, mb: float, chunk_mb: float) -> tuple[float, float, float]:
    """(sender, receiver, wall) seconds per MB for one way."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = str(Path(tmp) / "port")
        receiver = subprocess.Popen([sys.executable, __file__, "--receive", way, "--port-file", port_file,
                                     "--tls-dir", tls])
        try:
            while not Path(port_file).exists() or not Path(port_file).read_text():
                if receiver.poll() is not None:
                    raise SystemExit(f"the {way} receiver exited ({receiver.returncode})")
                time.sleep(0.05)
            port = int(Path(port_file).read_text())
            payload = os.urandom(int(chunk_mb * 2**20))
            n = max(GROUP, int(mb / chunk_mb) // GROUP * GROUP)
            send = _send_grpc if way == "grpc" else _send_socket
            s, r, w = asyncio.run(send(port, tls, payload, n))
            total = n * chunk_mb
            return s / total, r / total, w / total
        finally:
            receiver.kill()
            receiver.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="MB sent per measurement")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="MB per message (shoal's chunks: 1)")
    ap.add_argument("--repeat", type=int, default=2, help="measurements per way (the best is kept)")
    ap.add_argument("--receive", choices=("grpc", "socket"), help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    ap.add_argument("--tls-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from shoal.memory import tune_malloc

    tune_malloc()
    if args.receive:
        asyncio.run((_receive_grpc if args.receive == "grpc" else _receive_socket)(args.port_file, args.tls_dir))
        return
    from shoal.net.tls import make_keys

    with tempfile.TemporaryDirectory() as keys:
        make_keys(keys)
        print(f"{args.mb:g} MB in {args.chunk_mb:g} MB messages over loopback, best of {args.repeat}\n")
        print("| way | sender CPU ms/MB | receiver CPU ms/MB | wall ms/MB |")
        print("|---|---|---|---|")
        for way, tls, label in (("socket", "", "asyncio socket, plain"), ("socket", keys, "asyncio socket, TLS"),
                                ("grpc", "", "gRPC aio, plain"), ("grpc", keys, "gRPC aio, mutual TLS")):
            runs = [_run(way, tls, args.mb, args.chunk_mb) for _ in range(args.repeat)]
            s, r, w = (min(x[i] for x in runs) for i in range(3))
            print(f"| {label} | {s * 1e3:.2f} | {r * 1e3:.2f} | {w * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
