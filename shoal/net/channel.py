"""Every gRPC channel and server of shoal is made here.

* :func:`open_channel` is the one place an outbound channel is created, so link
  emulation can reroute a connection through a local shaping proxy with the ``dial``
  hook (``dial(address) -> address``) without touching the runtime.
* The join token, and after ``Join`` the member's credential, ride in the metadata of
  every call (client interceptors add them); servers install
  :class:`shoal.net.auth.AuthInterceptor`, which refuses a call without a valid token or
  credential, or from the wrong role, before its request is read.
* Channels and servers use mutual TLS with the run's certificates
  (:mod:`shoal.net.tls`); plain text only on loopback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpc import aio

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.auth import REQUEST_CAP, TOKEN_HEADER, AuthInterceptor, Identity
from shoal.net.tls import TlsConfig, check_plaintext
from shoal.net.wire import parse_chunk, serialize_chunk

__all__ = ["TOKEN_HEADER", "ChannelFactory", "bind", "load_token", "make_server", "open_channel"]
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


def load_server_token(token_file: str | None = None, required: bool = True) -> str:
    """The operator's server token (stage servers and standbys join with it): ``token_file``,
    else env ``SHOAL_SERVER_TOKEN``; "" when neither is given and not ``required``."""
    if token_file:
        p = Path(token_file)
        if not p.is_file():
            raise ShoalError(f"server token file {p} does not exist; give the file the coordinator wrote "
                             "(RUN/server_token) or set SHOAL_SERVER_TOKEN")
        token = p.read_text().strip()
        if not token:
            raise ShoalError(f"server token file {p} is empty; put the run's server token in it")
        return token
    token = os.environ.get("SHOAL_SERVER_TOKEN", "")
    if token or not required:
        return token
    raise ShoalError("no server token: a stage server joins with the operator's server token, not the join token; "
                     "set SHOAL_SERVER_TOKEN or pass --server-token-file FILE (the coordinator writes "
                     "RUN/server_token)")


# gRPC core takes grpc.min_reconnect_backoff_ms as its MIN_CONNECT_TIMEOUT: the time a connection
# attempt has for its TCP, TLS and HTTP/2 set-up before the calls waiting on it fail. At 100 ms
# a first call over a 600 ms round trip failed every time ("connection attempt timed out before
# receiving SETTINGS frame"), and on a loaded box even on loopback (tests/test_connect_timeout.py).
CONNECT_TIMEOUT_MS = 10_000


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options: message size limit both ways; quick reconnects after a refused
    connection (backoff from 100 ms to 1 s), and :data:`CONNECT_TIMEOUT_MS` for an attempt's set-up."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ]


def _with_metadata(details, items):
    md = list(details.metadata or [])
    md.extend(items)
    if hasattr(details, "_replace"):
        return details._replace(metadata=md)
    return aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                 details.wait_for_ready)


_JOIN = "/shoal.v1.Coordinator/Join"


class _AddIdentity(aio.UnaryUnaryClientInterceptor):
    """Join token and member credential on every unary call; learns the credential from Join."""

    def __init__(self, identity):
        self._id = identity

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        call = await continuation(_with_metadata(client_call_details, self._id.metadata(method)), request)
        if method != _JOIN:
            return call
        reply = await call
        self._id.learn(reply)
        return reply


# grpc files an interceptor under the first call shape it implements, so one class per shape.
class _AddIdentityUnaryStream(aio.UnaryStreamClientInterceptor):
    """Token and credential on server-streaming calls (chunked downloads)."""

    def __init__(self, identity):
        self._id = identity

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_metadata(client_call_details, self._id.metadata()), request)


class _AddIdentityStreamUnary(aio.StreamUnaryClientInterceptor):
    """Token and credential on client-streaming calls (chunked uploads)."""

    def __init__(self, identity):
        self._id = identity

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_metadata(client_call_details, self._id.metadata()), request_iterator)


class _AddIdentityStreamStream(aio.StreamStreamClientInterceptor):
    """Token and credential on bidirectional streams (worker sessions)."""

    def __init__(self, identity):
        self._id = identity

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_metadata(client_call_details, self._id.metadata()), request_iterator)


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
    """Opens channels with one identity, TLS setting, size limit and optional ``dial`` hook."""

    token: str  # join token sent with every call
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # wire message size limit
    dial: Callable[[str], str] | None = None  # address -> address to connect to (emulation proxy)
    traffic: object | None = None  # shoal.net.traffic.Traffic counting every call (None: no counting)
    tls: TlsConfig | None = None  # run CA and member certificate (None: plain text, loopback only)
    identity: Identity | None = None  # member credential, shared by every channel (None: token only)

    def __post_init__(self):
        if self.identity is None:
            self.identity = Identity(self.token)

    def open(self, address: str) -> ChunkChannel:
        return open_channel(address, self.token, dial=self.dial, max_message_bytes=self.max_message_bytes,
                            traffic=self.traffic, tls=self.tls, identity=self.identity)


def open_channel(
    address: str,
    token: str,
    *,
    dial: Callable[[str], str] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    traffic=None,
    tls: TlsConfig | None = None,
    identity: Identity | None = None,
) -> ChunkChannel:
    """An asyncio gRPC channel to ``address`` that sends ``token`` (and the member's
    credential, once ``identity`` has joined) with every call.

    ``tls``: mutual TLS with the run's certificates; None is plain text, refused unless
    ``address`` is loopback. ``dial`` may rewrite the address (e.g. to a local proxy that
    shapes the link); ``traffic`` (a :class:`shoal.net.traffic.Traffic`) counts each
    request and reply.
    """
    if not token:
        raise ShoalError("empty join token: give every member the same non-empty token")
    if tls is None:
        check_plaintext(address, "peer")
    identity = identity or Identity(token)
    target = dial(address) if dial else address
    # Streamed (chunked) calls are counted by shoal.net.stream's callers, per whole message.
    interceptors = [_AddIdentity(identity), _AddIdentityUnaryStream(identity),
                    _AddIdentityStreamUnary(identity), _AddIdentityStreamStream(identity)] + ([_Count(traffic)] if traffic is not None else [])
    if tls is None:
        return ChunkChannel(aio.insecure_channel(target, options=grpc_options(max_message_bytes),
                                                 interceptors=interceptors))
    return ChunkChannel(aio.secure_channel(target, tls.channel_credentials(), options=grpc_options(max_message_bytes),
                                           interceptors=interceptors))


class ChunkChannel:
    """An aio channel whose stubs send and read :class:`pb.Chunk` streams as
    :class:`shoal.net.wire.ChunkView` s (payloads as views, copied once into gRPC's bytes),
    as shoal's servers do (``shoal.net.auth``); everything else is the channel's own."""

    __slots__ = ("_channel",)

    def __init__(self, channel: aio.Channel):
        self._channel = channel

    def __getattr__(self, name: str):
        return getattr(self._channel, name)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._channel.__aexit__(*exc)

    @staticmethod
    def _codec(kw: dict) -> dict:
        if kw.get("request_serializer") == pb.Chunk.SerializeToString:
            kw["request_serializer"] = serialize_chunk
        if kw.get("response_deserializer") == pb.Chunk.FromString:
            kw["response_deserializer"] = parse_chunk
        return kw

    def unary_unary(self, method, **kw):
        return self._channel.unary_unary(method, **self._codec(kw))

    def unary_stream(self, method, **kw):
        return self._channel.unary_stream(method, **self._codec(kw))

    def stream_unary(self, method, **kw):
        return self._channel.stream_unary(method, **self._codec(kw))

    def stream_stream(self, method, **kw):
        return self._channel.stream_stream(method, **self._codec(kw))


# Connection limits of every shoal server (docs/security.md, "Connection limits"): what a
# peer that never authenticates, or a member that leaves a connection unused, can hold open.
HANDSHAKE_TIMEOUT_S = 20.0  # TLS and HTTP/2 set-up must be done this soon after the TCP accept
IDLE_CLOSE_S = 60.0  # a connection with no call for this long is closed (members reconnect on their next call)
_GRPC_INT_MAX = 2**31 - 1  # channel arguments are C ints


def connection_cap(fd_limit: int) -> int | None:
    """Most connections a server holds at once, from its file-descriptor limit (pure).

    A quarter of the limit (at least 128) stays for everything else the process opens:
    checkpoint and journal files, its own channels to peers, pipes. gRPC closes a
    connection over the cap as soon as it is accepted, so a flood of connections can
    never take the descriptors a checkpoint write needs. None: no cap (no finite limit).
    """
    if fd_limit <= 0 or fd_limit >= _GRPC_INT_MAX:
        return None
    return max(16, fd_limit - max(128, fd_limit // 4))


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                   handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, idle_close_s: float = IDLE_CLOSE_S,
                   fd_limit: int | None = None) -> list[tuple[str, int]]:
    """The options of a shoal gRPC server (pure but for reading the process's fd limit when
    ``fd_limit`` is None): requests capped at :data:`~shoal.net.auth.REQUEST_CAP`, no
    SO_REUSEPORT, a connection closed when its TLS and HTTP/2 set-up (the client's SETTINGS
    frame included) take longer than ``handshake_timeout_s`` or when it carries no call for
    ``idle_close_s``, and at most :func:`connection_cap` connections at once."""
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    options = [(k, REQUEST_CAP if k == "grpc.max_receive_message_length" else v)
               for k, v in grpc_options(max_message_bytes)] + [("grpc.so_reuseport", 0)]
    options += [("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout_s * 1000))),
                ("grpc.max_connection_idle_ms", max(1, int(idle_close_s * 1000)))]
    cap = connection_cap(fd_limit)
    if cap is not None:
        options.append(("grpc.max_allowed_incoming_connections", cap))
    return options


def make_server(token: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                run_key: Callable[[], bytes] | None = None, resolve: Callable[[str], int] | None = None, *,
                handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, idle_close_s: float = IDLE_CLOSE_S
                ) -> aio.Server:
    """An asyncio gRPC server that checks token or member credential (and role) of every
    call before reading it (:class:`shoal.net.auth.AuthInterceptor`); ``run_key`` returns
    the run's public key (None: only token methods pass). Ports are bound exclusively.

    ``max_message_bytes`` bounds replies; requests are bounded by method and role
    (:data:`shoal.net.auth.METHOD_LIMITS`, ``resolve`` giving a stage server's sizes) and
    never exceed :data:`shoal.net.auth.REQUEST_CAP`, which gRPC checks before reading.
    Connections are limited as :func:`server_options` says (``handshake_timeout_s``,
    ``idle_close_s``: its pre-authentication and idle limits).
    """
    interceptor = AuthInterceptor(token, run_key or (lambda: b""), resolve)
    options = server_options(max_message_bytes, handshake_timeout_s=handshake_timeout_s,
                             idle_close_s=idle_close_s)
    return aio.server(interceptors=[interceptor], options=options)


def _check_port_free(listen: str) -> None:
    """One-line error when another process holds ``listen``'s port (gRPC would log a
    multi-line failure first); port 0 is always free."""
    import socket

    host, port = split_address(listen)
    if port == 0:
        return
    host = host.strip("[]") or "0.0.0.0"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            probe.bind(addr)
    except OSError as exc:
        raise ShoalError(f"cannot listen on {listen}: {exc.strerror or exc}; another process may hold it "
                         "(pick another port; port 0: any free one)") from None


def bind(server: aio.Server, listen: str, tls: TlsConfig | None) -> int:
    """Bind ``listen`` (TLS, or plain text on loopback only); returns the port.

    A port another process holds is a one-line error (the server sets no SO_REUSEPORT).
    """
    if tls is None:
        check_plaintext(listen, "--listen")
    _check_port_free(listen)
    try:
        port = (server.add_insecure_port(listen) if tls is None
                else server.add_secure_port(listen, tls.server_credentials()))
    except RuntimeError:
        port = 0
    if not port:
        raise ShoalError(f"cannot listen on {listen}: the address is in use or not this machine's; "
                         "pick another port (port 0: any free one)")
    return port


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
