"""A member's first call over a slow link connects: gRPC gives a connection attempt
``grpc.min_reconnect_backoff_ms`` to finish its TCP, TLS and HTTP/2 set-up before it fails
the call (gRPC's MIN_CONNECT_TIMEOUT), so that must be far above an internet round trip."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shoal.net.channel import CONNECT_TIMEOUT_MS, grpc_options, open_channel

DELAY_S = 0.3  # each way: a 600 ms round trip, a slow but real inter-continental path


async def _delayed_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Forward bytes after DELAY_S each, in order (a link's latency, not its rate)."""
    try:
        while data := await reader.read(65536):
            await asyncio.sleep(DELAY_S)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _slow_proxy(target_port: int) -> asyncio.Server:
    async def handle(r, w):
        ur, uw = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(_delayed_pipe(r, uw), _delayed_pipe(ur, w))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_the_connect_deadline_is_far_above_an_internet_round_trip():
    opts = dict(grpc_options())
    assert opts["grpc.min_reconnect_backoff_ms"] == CONNECT_TIMEOUT_MS >= 5000
    # reconnects after a refused connection stay quick: the backoff is not the deadline
    assert opts["grpc.initial_reconnect_backoff_ms"] <= 200


@pytest.mark.timeout(60)
def test_a_first_call_over_a_600_ms_round_trip_connects():
    async def main():
        server = grpc.aio.server()
        echo = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)  # raw bytes both ways
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"Echo": echo})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = await _slow_proxy(port)
        try:
            addr = f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
            async with open_channel(addr, "token") as ch:
                t0 = asyncio.get_running_loop().time()
                # no wait_for_ready: a connection attempt that times out fails the call at once
                reply = await ch.unary_unary("/t.T/Echo")(b"ping", timeout=30)
                took = asyncio.get_running_loop().time() - t0
            assert reply == b"ping"
            assert took >= 2 * DELAY_S  # the set-up really crossed the slow link
        finally:
            proxy.close()
            await server.stop(0)

    asyncio.run(main())
