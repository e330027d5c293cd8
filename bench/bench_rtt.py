"""Does a long round trip cap a gRPC stream below its link? A streamed pull through a delay relay.

    PYTHONPATH=. python bench/bench_rtt.py [--rtt-ms 0,40,100,200] [--mb 64] [--repeat 3]

HTTP/2 sends at most a flow-control window per round trip, so with a fixed 64 KiB window a
stream over a 100 ms path would move 0.6 MB/s whatever its link. gRPC's core grows the window
from the bandwidth-delay product it measures (BDP probing). This bench checks that with shoal's
own channel and server options (``shoal.net.channel``): a server streams ``--mb`` chunks of 1 MB
(a weight pull's shape) to a client through a relay on loopback that holds every byte for half
the round trip each way (netem does not work on this box; the relay reads at once, so TCP's own
window never binds, only HTTP/2's). Each row: one call's megabits per second, the first call on
a fresh connection and the later ones after the window grew.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import grpc
from grpc import aio

from shoal.net.channel import grpc_options, server_options

CHUNK = b"\x5a" * (1 << 20)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward what ``reader`` gets to ``writer``, each piece ``delay`` seconds after it came."""
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                writer.close()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 20):
            queue.put_nowait((time.monotonic() + delay, data))
    finally:
        queue.put_nowait((0.0, None))
        await asyncio.gather(sender, return_exceptions=True)


async def _relay(upstream: int, delay: float) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        with contextlib.suppress(asyncio.CancelledError):  # (the loop ends with the relay's connections open)
            await asyncio.gather(_pipe(r, uw, delay), _pipe(ur, w, delay), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def run(rtt_ms: float, mb: int, repeat: int) -> list[float]:
    """Megabits per second of ``repeat`` calls, each streaming ``mb`` MB through the relay."""

    async def pull(request, context):
        for _ in range(mb):
            yield CHUNK

    server = aio.server(options=server_options())
    handler = grpc.method_handlers_generic_handler("bench.Rtt", {"Pull": grpc.unary_stream_rpc_method_handler(pull)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    relay = await _relay(port, rtt_ms / 2000.0)
    out = []
    try:
        async with aio.insecure_channel(f"127.0.0.1:{relay.sockets[0].getsockname()[1]}",
                                        options=grpc_options()) as channel:
            call = channel.unary_stream("/bench.Rtt/Pull")
            for _ in range(repeat):
                t0, n = time.monotonic(), 0
                async for chunk in call(b""):
                    n += len(chunk)
                out.append(n * 8 / (time.monotonic() - t0) / 1e6)
    finally:
        relay.close()
        await server.stop(None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", default="0,40,100,200", help="round trips to try, in ms")
    ap.add_argument("--mb", type=int, default=64, help="MB a call streams")
    ap.add_argument("--repeat", type=int, default=3, help="calls on one connection")
    args = ap.parse_args()
    print(f"| round trip | call 1 Mbit/s | later calls Mbit/s | 64 KiB window's cap Mbit/s |  ({args.mb} MB a call)")
    print("|---|---|---|---|")
    for rtt in (float(x) for x in args.rtt_ms.split(",")):
        rates = asyncio.run(run(rtt, args.mb, args.repeat))
        cap = f"{65536 * 8 / (rtt / 1000) / 1e6:.1f}" if rtt > 0 else "-"
        print(f"| {rtt:.0f} ms | {rates[0]:.0f} | {', '.join(f'{r:.0f}' for r in rates[1:])} | {cap} |", flush=True)


if __name__ == "__main__":
    main()
