"""Every gRPC channel and server of shoal is made here.

* :func:`open_channel` is the one place an outbound channel is created, so link
  emulation can reroute a connection through a local shaping proxy with the ``dial``
  hook (``dial(address) -> address``) without touching the runtime.
* The join token rides in the ``x-shoal-token`` metadata of every call (a client
  interceptor adds it); servers install :class:`TokenInterceptor`, which refuses a
  call without the right token with ``UNAUTHENTICATED`` before any handler runs, so an
  unauthenticated peer changes nothing.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from shoal.errors import ShoalError

TOKEN_HEADER = "x-shoal-token"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a gpt-125m stage of fp32 weights fits


def load_token(token: str | None = None, token_file: str | None = None) -> str:
    """The join token: explicit value, else ``token_file``, else env ``SHOAL_TOKEN``."""
    if token:
        return token
    if token_file:
        p = Path(token_file)
        if not p.is_file():
            raise ShoalError(f"token file {p} does not exist; create it or set SHOAL_TOKEN")
        token = p.read_text().strip()
        if not token:
            raise ShoalError(f"token file {p} is empty; put the swarm's join token in it")
        return token
    env = os.environ.get("SHOAL_TOKEN", "")
    if env:
        return env
    raise ShoalError("no join token: set SHOAL_TOKEN or pass --token-file FILE (the same for every member)")


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options: message size limit both ways, quick reconnects."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.min_reconnect_backoff_ms", 100),
    ]


class _AddToken(aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._md = (TOKEN_HEADER, token)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        md = list(client_call_details.metadata or [])
        md.append(self._md)
        details = client_call_details._replace(metadata=md) if hasattr(
            client_call_details, "_replace") else aio.ClientCallDetails(
            client_call_details.method, client_call_details.timeout, md,
            client_call_details.credentials, client_call_details.wait_for_ready)
        return await continuation(details, request)


def _with_token(details, md_item):
    md = list(details.metadata or [])
    md.append(md_item)
    if hasattr(details, "_replace"):
        return details._replace(metadata=md)
    return aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                 details.wait_for_ready)


# grpc files an interceptor under the first call shape it implements, so one class per shape.
class _AddTokenUnaryStream(aio.UnaryStreamClientInterceptor):
    """The join token on server-streaming calls (chunked downloads)."""

    def __init__(self, token: str):
        self._md = (TOKEN_HEADER, token)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._md), request)


class _AddTokenStreamUnary(aio.StreamUnaryClientInterceptor):
    """The join token on client-streaming calls (chunked uploads)."""

    def __init__(self, token: str):
        self._md = (TOKEN_HEADER, token)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self._md), request_iterator)


class _Count(aio.UnaryUnaryClientInterceptor):
    """Counts every request and reply of the channel's calls in a ``Traffic``."""

    def __init__(self, traffic):
        self._traffic = traffic

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        self._traffic.count(request)
        call = await continuation(client_call_details, request)
        reply = await call
        self._traffic.count(reply)
        return reply


@dataclass
class ChannelFactory:
    """Opens channels with one token, size limit and optional ``dial`` reroute hook."""

    token: str  # join token sent with every call
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # wire message size limit
    dial: Callable[[str], str] | None = None  # address -> address to connect to (emulation proxy)
    traffic: object | None = None  # shoal.net.traffic.Traffic counting every call (None: no counting)

    def open(self, address: str) -> aio.Channel:
        return open_channel(address, self.token, dial=self.dial, max_message_bytes=self.max_message_bytes,
                            traffic=self.traffic)


def open_channel(
    address: str,
    token: str,
    *,
    dial: Callable[[str], str] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    traffic=None,
) -> aio.Channel:
    """An asyncio gRPC channel to ``address`` that sends ``token`` with every call.

    ``dial`` may rewrite the address (e.g. to a local proxy that shapes the link);
    ``traffic`` (a :class:`shoal.net.traffic.Traffic`) counts each request and reply.
    """
    target = dial(address) if dial else address
    # Streamed (chunked) calls are counted by shoal.net.stream's callers, per whole message.
    interceptors = [_AddToken(token), _AddTokenUnaryStream(token), _AddTokenStreamUnary(token)] + (
        [_Count(traffic)] if traffic is not None else [])
    return aio.insecure_channel(target, options=grpc_options(max_message_bytes), interceptors=interceptors)


class TokenInterceptor(aio.ServerInterceptor):
    """Refuses every call whose ``x-shoal-token`` metadata is not the join token."""

    def __init__(self, token: str):
        self._token = token.encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong join token: set SHOAL_TOKEN to the swarm's token")

        async def deny_stream(request, context):
            await deny(request, context)
            yield  # pragma: no cover  (abort raises first)

        # One refusal per call shape: a streamed method needs a streamed handler.
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    async def intercept_service(self, continuation, handler_call_details):
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                got = value
        if isinstance(got, str):
            got = got.encode()
        if not hmac.compare_digest(got, self._token):
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return await continuation(handler_call_details)


def make_server(token: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> aio.Server:
    """An asyncio gRPC server that checks the join token on every call."""
    return aio.server(interceptors=[TokenInterceptor(token)], options=grpc_options(max_message_bytes))


_ANY_HOSTS = {"0.0.0.0", "::", "[::]", "", "*"}


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); raises ShoalError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ShoalError(f"address {address!r} is not HOST:PORT (e.g. 10.0.0.5:7070)")
    return host, int(port)


def _split_advertise(advertise: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` -> (host, port or None)."""
    tail = advertise.split("]")[-1] if advertise.startswith("[") else advertise
    if ":" not in tail:
        return advertise, None
    host, _, port = advertise.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ShoalError(f"--advertise {advertise!r} is not HOST or HOST:PORT (e.g. 203.0.113.7:7070)")
    return host, int(port)


def check_listen(listen: str, advertise: str | None, flag: str = "--listen") -> None:
    """Refuse a wildcard ``listen`` without ``advertise``: peers cannot dial ``0.0.0.0``."""
    host, port = split_address(listen)
    if advertise:
        ahost, _ = _split_advertise(advertise)
        if ahost in _ANY_HOSTS:
            raise ShoalError(f"--advertise {advertise!r} must name this machine as others reach it "
                             "(e.g. --advertise 203.0.113.7:7070)")
        return
    if host in _ANY_HOSTS:
        raise ShoalError(f"{flag} {listen} listens on every interface, but peers cannot dial {host or '*'}: "
                         f"also pass --advertise HOST:{port or 'PORT'} with the address other machines "
                         "reach this one at")


def advertised_address(listen: str, advertise: str | None, bound_port: int) -> str:
    """The address peers are told to dial (pure).

    ``advertise`` as given (``HOST``, or ``HOST:0``, takes the bound port), else the
    listen host with the port the server really bound (``listen`` port 0: any free port).
    """
    if advertise:
        host, port = _split_advertise(advertise)
        return f"{host}:{port or bound_port}"
    host, _ = split_address(listen)
    return f"{host}:{bound_port}"
