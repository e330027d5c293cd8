"""Who may call what: the join token, per-member credentials and the role table.

* The **join token** admits a *worker* to ``Join`` (and anyone holding it to ``Status``)
  and nothing else. A stage server (or standby) joins with the operator's **server token**
  as well (``x-shoal-server-token``, :data:`SERVER_TOKEN_HEADER`): a second secret that only
  the operator's server processes hold, so the join token cannot make a server.
* At ``Join`` the coordinator gives each member a **credential**: its Ed25519 signature of
  ``member id + role`` under the run's signing key, which only the coordinator holds. Every
  member gets the matching *public* key (``JoinReply.run_key``), so stage servers check
  credentials themselves, and no member holds anything from which another member's
  credential could be made. Member ids are random. A member sends ``x-shoal-member``,
  ``x-shoal-role`` and ``x-shoal-cred`` with every call (a client interceptor adds them,
  learning them from the ``Join`` reply), so no runtime code handles them.
* :class:`AuthInterceptor` checks the metadata **before the request is read**: a call
  without a valid credential, or from a role the method is not for (:data:`METHOD_ROLES`),
  is answered by a handler that never reads the request, so an unauthenticated peer costs
  the server no more than gRPC's flow-control window. A checked credential is remembered,
  so a member's calls cost one signature check in all.
* Handlers then bind the request to the caller with :func:`check_caller`: a member can
  lease, push, report and leave only as itself.
* Every request has a size limit by method *and* role (:data:`METHOD_LIMITS`): gRPC itself
  refuses any message over :data:`REQUEST_CAP` from its length prefix, before reading it;
  the interceptor refuses a message over its method's limit for the caller's role (a
  control call gets kilobytes, a worker's gradient upload the stage's gradient bytes) with
  ``RESOURCE_EXHAUSTED`` before any handler sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc import aio

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import parse_chunk, serialize_chunk

TOKEN_HEADER = "x-shoal-token"
MEMBER_HEADER = "x-shoal-member"
ROLE_HEADER = "x-shoal-role"
CRED_HEADER = "x-shoal-cred"
SERVER_TOKEN_HEADER = "x-shoal-server-token"

TOKEN = "token"  # pseudo-role: the join token is enough for the method
ANY = "any"  # pseudo-role: any member with a valid credential
COORDINATOR_ID = "coordinator"  # member id and role of the coordinator's own calls

# method name -> roles allowed to call it. A method not listed needs a valid credential of any role.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "/shoal.v1.Coordinator/Join": frozenset({TOKEN}),
    "/shoal.v1.Coordinator/Status": frozenset({TOKEN}),
    "/shoal.v1.Coordinator/Heartbeat": frozenset({"server", "worker"}),
    "/shoal.v1.Coordinator/Leave": frozenset({"server", "worker"}),
    "/shoal.v1.Coordinator/Measured": frozenset({"server", "worker"}),
    "/shoal.v1.Coordinator/ReportStep": frozenset({"server"}),
    "/shoal.v1.Coordinator/FinalWeights": frozenset({"server"}),
    "/shoal.v1.Coordinator/Probe": frozenset({ANY}),
    **{f"/shoal.v1.StageServer/{m}": frozenset({"worker"}) for m in (
        "LeaseStream", "Lease", "CompleteStream", "Complete", "PushGradsStream", "PushGrads", "Renew", "Leave",
        "Session")},
    "/shoal.v1.StageServer/GetWeightsStream": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/GetWeights": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/SubmitRelayStream": frozenset({"server"}),
    "/shoal.v1.StageServer/SubmitRelay": frozenset({"server"}),
    "/shoal.v1.StageServer/RelayStream": frozenset({"server"}),
    "/shoal.v1.StageServer/StandbyCkptStream": frozenset({"server"}),
    "/shoal.v1.StageServer/StandbyStepStream": frozenset({"server"}),
    "/shoal.v1.StageServer/ReplicaPartStream": frozenset({"server"}),
    "/shoal.v1.StageServer/Probe": frozenset({ANY}),
}


KIB, MIB = 1024, 1024 * 1024
CONTROL_BYTES = 256 * KIB  # a control request: ids, counters, a few names; far above any honest one
REPORT_BYTES = 4 * MIB  # requests carrying per-run lists (losses per micro-batch, link probes, traffic)
PROBE_BYTES = 64 * MIB  # largest probe transfer (a timed link measurement; --probe-mb is at most 64)
MAX_CHUNK_BYTES = 64 * MIB  # largest chunk of a streamed transfer (--chunk-mb is at most 64)
CHUNK_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * KIB  # one Chunk message: its data plus kind, offsets, sender
GRADS = "grads"  # a size the receiver resolves: a stage server its stage's gradient, the coordinator the model (bytes + slack)
ACT = "act"  # a size the stage server resolves: one micro-batch's activation (or its gradient)


@dataclass(frozen=True)
class SizeLimit:
    """Most bytes a request may have: an int, or :data:`GRADS` / :data:`ACT` (resolved by the server)."""

    message: int | str  # one request message (a unary request, or each chunk of a stream)
    stream: int | str | None = None  # request streams: the whole message the chunks announce and carry


_CHUNKED = SizeLimit(CHUNK_MESSAGE_BYTES, GRADS)
# method -> caller's role (or TOKEN / ANY, as in METHOD_ROLES) -> its request size limit.
# One table for every process: gRPC's own limit is REQUEST_CAP, the largest entry that is a
# number; everything smaller is checked by AuthInterceptor.
METHOD_LIMITS: dict[str, dict[str, SizeLimit]] = {
    "/shoal.v1.Coordinator/Join": {TOKEN: SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.Coordinator/Status": {TOKEN: SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.Coordinator/Heartbeat": {"server": SizeLimit(REPORT_BYTES), "worker": SizeLimit(REPORT_BYTES)},
    "/shoal.v1.Coordinator/Leave": {"server": SizeLimit(CONTROL_BYTES), "worker": SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.Coordinator/Measured": {"server": SizeLimit(REPORT_BYTES), "worker": SizeLimit(REPORT_BYTES)},
    "/shoal.v1.Coordinator/ReportStep": {"server": SizeLimit(REPORT_BYTES)},
    # (GRADS at the coordinator: the whole model's float32 weights and slack)
    "/shoal.v1.Coordinator/FinalWeights": {"server": _CHUNKED},
    "/shoal.v1.Coordinator/Probe": {ANY: SizeLimit(PROBE_BYTES + 64 * KIB)},
    **{f"/shoal.v1.StageServer/{m}": {"worker": SizeLimit(CONTROL_BYTES)} for m in (
        "LeaseStream", "Lease", "Renew", "Leave")},
    "/shoal.v1.StageServer/Complete": {"worker": SizeLimit(ACT)},
    "/shoal.v1.StageServer/CompleteStream": {"worker": SizeLimit(CHUNK_MESSAGE_BYTES, ACT)},
    # A long-lived session: each chunk is checked here, each message it carries by the server
    # as it is assembled (a result at most an activation, the rest control sizes).
    "/shoal.v1.StageServer/Session": {"worker": SizeLimit(CHUNK_MESSAGE_BYTES)},
    "/shoal.v1.StageServer/PushGrads": {"worker": SizeLimit(GRADS)},
    "/shoal.v1.StageServer/PushGradsStream": {"worker": _CHUNKED},
    "/shoal.v1.StageServer/GetWeightsStream": {"worker": SizeLimit(CONTROL_BYTES),
                                               COORDINATOR_ID: SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.StageServer/GetWeights": {"worker": SizeLimit(CONTROL_BYTES), COORDINATOR_ID: SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.StageServer/SubmitRelay": {"server": SizeLimit(ACT)},
    "/shoal.v1.StageServer/SubmitRelayStream": {"server": SizeLimit(CHUNK_MESSAGE_BYTES, ACT)},
    # Long-lived like a session: each chunk checked here, each relay (at most an activation)
    # by the server as it is assembled.
    "/shoal.v1.StageServer/RelayStream": {"server": SizeLimit(CHUNK_MESSAGE_BYTES)},
    "/shoal.v1.StageServer/StandbyCkptStream": {"server": SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.StageServer/StandbyStepStream": {"server": _CHUNKED},
    "/shoal.v1.StageServer/ReplicaPartStream": {"server": _CHUNKED},
    "/shoal.v1.StageServer/Probe": {ANY: SizeLimit(PROBE_BYTES + 64 * KIB)},
}
# gRPC's per-message receive limit of every shoal server: larger messages are refused from
# their length prefix, before a byte of them is buffered.
REQUEST_CAP = max(lim.message for roles in METHOD_LIMITS.values() for lim in roles.values()
                  if isinstance(lim.message, int))


def request_limit(method: str, role: str, resolve: Callable[[str], int] | None = None
                  ) -> tuple[int, int | None]:
    """(most bytes of one request message, most bytes of a streamed request's whole) for
    ``role`` calling ``method`` (pure; tested directly).

    ``resolve`` turns :data:`GRADS` / :data:`ACT` into bytes (a stage server's sizes;
    None: :data:`REQUEST_CAP`). A method or role the table does not list gets
    :data:`CONTROL_BYTES`; no message exceeds :data:`REQUEST_CAP`.
    """
    roles = METHOD_LIMITS.get(method, {})
    lim = roles.get(role) or roles.get(ANY) or SizeLimit(CONTROL_BYTES)

    def size(v: int | str | None) -> int | None:
        if v is None or isinstance(v, int):
            return v
        return int(resolve(v)) if resolve is not None else REQUEST_CAP

    msg = size(lim.message)
    return min(msg, REQUEST_CAP), size(lim.stream)


def _signing_key(secret: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(secret).digest())


def run_public_key(secret: bytes) -> bytes:
    """The public key (raw Ed25519, 32 bytes) that checks credentials made with ``secret``."""
    from cryptography.hazmat.primitives import serialization

    return _signing_key(secret).public_key().public_bytes(serialization.Encoding.Raw,
                                                          serialization.PublicFormat.Raw)


def member_credential(secret: bytes, member: str, role: str) -> str:
    """The credential of ``member`` in ``role``: the run signing key's signature (hex) of both.

    ``secret`` is the coordinator's signing secret; no member ever receives it.
    """
    return _signing_key(secret).sign(f"{member}\0{role}".encode()).hex()


_CHECKED: dict[tuple[bytes, str, str, str], bool] = {}  # credentials already found valid
_CHECKED_MAX = 65536


def credential_ok(run_key: bytes, member: str, role: str, cred: str) -> bool:
    """Whether ``cred`` is the run's signature of ``member`` in ``role`` (``run_key``: the
    run's public key). Valid ones are remembered, so each member costs one check."""
    key = (run_key, member, role, cred)
    if key in _CHECKED:
        return True
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(run_key).verify(bytes.fromhex(cred), f"{member}\0{role}".encode())
    except (InvalidSignature, ValueError):
        return False
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = True
    return True


def new_member_id(role: str, name: str) -> str:
    """A random member id (``w-3f9c2a61b0d4-NAME``): nobody can guess another member's id."""
    return f"{role[0]}-{secrets.token_hex(6)}-{name}"


@dataclass
class Identity:
    """What a process sends with its calls; filled in from its ``Join`` reply."""

    token: str  # join token (sent on every call; only Join and Status accept it alone)
    member: str = ""  # member id given at join
    role: str = ""  # "server", "worker" or "coordinator"
    credential: str = ""  # the run's signature of (member, role)
    run_key: bytes = b""  # the run's public key: checks the credentials of callers (servers, coordinator)
    server_token: str = ""  # stage servers: the operator's server token, sent with Join only

    @classmethod
    def joined(cls, token: str, secret: bytes, member: str, role: str) -> Identity:
        """The identity ``member`` gets when it joins in ``role`` under signing secret ``secret``
        (for tests and tools)."""
        return cls(token, member, role, member_credential(secret, member, role), run_public_key(secret))

    def metadata(self, method: str = "") -> list[tuple[str, str]]:
        md = [(TOKEN_HEADER, self.token)]
        if self.server_token and method == JOIN_METHOD:
            md.append((SERVER_TOKEN_HEADER, self.server_token))
        if self.credential:
            md += [(MEMBER_HEADER, self.member), (ROLE_HEADER, self.role), (CRED_HEADER, self.credential)]
        return md

    def learn(self, reply) -> None:
        """Take member id, role, credential and the run's public key from a ``JoinReply``."""
        if reply.credential:
            self.member, self.role, self.credential = reply.member_id, reply.role, reply.credential
        if reply.run_key:
            self.run_key = bytes(reply.run_key)


JOIN_METHOD = "/shoal.v1.Coordinator/Join"


def coordinator_identity(token: str, secret: bytes) -> Identity:
    """The coordinator's own identity (it pulls the final weights as ``coordinator``)."""
    return Identity(token, COORDINATOR_ID, COORDINATOR_ID, member_credential(secret, COORDINATOR_ID, COORDINATOR_ID),
                    run_public_key(secret))


def _metadata(details) -> dict[str, str]:
    out = {}
    for key, value in details or ():
        out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def decide(method: str, md: dict[str, str], token: str, run_key: bytes) -> grpc.StatusCode | None:
    """None if the call may proceed, else the status to refuse it with (pure; tested directly).

    ``run_key``: the run's public key (empty: no credential passes, only token methods)."""
    allowed = METHOD_ROLES.get(method, frozenset({ANY}))
    if TOKEN in allowed:
        if token and hmac.compare_digest(md.get(TOKEN_HEADER, "").encode(), token.encode()):
            return None
        return grpc.StatusCode.UNAUTHENTICATED
    member, role, cred = md.get(MEMBER_HEADER, ""), md.get(ROLE_HEADER, ""), md.get(CRED_HEADER, "")
    if not run_key or not member or not role or not cred:
        return grpc.StatusCode.UNAUTHENTICATED
    if not credential_ok(run_key, member, role, cred):
        return grpc.StatusCode.UNAUTHENTICATED
    if ANY not in allowed and role not in allowed:
        return grpc.StatusCode.PERMISSION_DENIED
    return None


def _refusal(code: grpc.StatusCode, method: str):
    """Handlers (by call shape) that refuse with ``code`` without reading the request.

    Every shape is served by a request-*streaming* handler: gRPC reads a unary request
    in full before a unary handler runs, a stream is read only when iterated, and this
    one never is.
    """
    if code != grpc.StatusCode.UNAUTHENTICATED:
        why = f"{method}: not allowed for this member's role"
    elif TOKEN in METHOD_ROLES.get(method, ()):
        why = f"{method}: missing or wrong join token (set SHOAL_TOKEN to the swarm's token)"
    else:
        why = f"{method}: no valid member credential (join the run first)"

    async def refuse(request_iterator, context):
        await context.abort(code, why)

    async def refuse_stream(request_iterator, context):
        await context.abort(code, why)
        yield  # pragma: no cover  (abort raises first)

    return {False: grpc.stream_unary_rpc_method_handler(refuse),
            True: grpc.stream_stream_rpc_method_handler(refuse_stream)}


class _Oversize:
    """What the size-checking deserializer hands on instead of a request over its limit."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def _too_big(method: str, role: str, nbytes: int, limit: int, what: str = "request") -> str:
    return (f"{method}: {what} of {nbytes} bytes, more than the {limit} a {role or 'caller'} may send "
            "(shoal.net.auth.METHOD_LIMITS)")


def _sized(handler, method: str, role: str, limits: tuple[int, int | None]):
    """``handler`` with every request message checked against ``limits`` (see :func:`request_limit`).

    The deserializer measures each message (gRPC has read it, at most REQUEST_CAP bytes) and
    hands on an :class:`_Oversize` in place of one over the limit; the wrapped behaviour then
    aborts with RESOURCE_EXHAUSTED before the method's handler sees anything. A request
    stream of chunks is also stopped once a chunk announces, or the chunks carry, more than
    the stream limit.
    """
    per_msg, whole = limits
    deser = handler.request_deserializer
    if deser == pb.Chunk.FromString:  # chunk streams: payloads as views (shoal.net.wire.ChunkView)
        deser = parse_chunk
    response_serializer = handler.response_serializer
    if response_serializer == pb.Chunk.SerializeToString:
        response_serializer = serialize_chunk

    def checked(data: bytes):
        if len(data) > per_msg:
            return _Oversize(len(data))
        return deser(data) if deser is not None else data

    async def refuse(context, nbytes: int, limit: int, what: str = "request"):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _too_big(method, role, nbytes, limit, what))

    if handler.request_streaming:
        async def requests(request_iterator, context):
            carried = 0
            async for msg in request_iterator:
                if isinstance(msg, _Oversize):
                    await refuse(context, msg.nbytes, per_msg, "chunk")
                if whole is not None:
                    carried += len(getattr(msg, "data", b""))  # (a ChunkView's: no copy)
                    announced = max(int(getattr(msg, "total", 0)), carried)
                    if announced > whole:
                        await refuse(context, announced, whole, "streamed message")
                yield msg

        if handler.response_streaming:  # sessions: a long-lived stream each way
            async def stream_stream(request_iterator, context):
                async for item in handler.stream_stream(requests(request_iterator, context), context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=checked,
                                                         response_serializer=response_serializer)

        async def stream_unary(request_iterator, context):
            return await handler.stream_unary(requests(request_iterator, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=checked,
                                                    response_serializer=response_serializer)
    if handler.response_streaming:
        async def unary_stream(request, context):
            if isinstance(request, _Oversize):
                await refuse(context, request.nbytes, per_msg)
            out = handler.unary_stream(request, context)
            if hasattr(out, "__aiter__"):
                async for item in out:
                    yield item
            else:
                await out

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=checked,
                                                    response_serializer=response_serializer)

    async def unary_unary(request, context):
        if isinstance(request, _Oversize):
            await refuse(context, request.nbytes, per_msg)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=checked,
                                               response_serializer=response_serializer)


class AuthInterceptor(aio.ServerInterceptor):
    """Checks token or credential and role of every call before its handler reads anything,
    then the size of every request message against :data:`METHOD_LIMITS`.

    ``run_key`` returns the run's public key (empty until a stage server has joined: then
    only token methods pass); ``resolve`` turns :data:`GRADS` / :data:`ACT` into this
    server's sizes (None: only :data:`REQUEST_CAP` bounds them).
    """

    def __init__(self, token: str, run_key: Callable[[], bytes], resolve: Callable[[str], int] | None = None):
        if not token:
            from shoal.errors import ShoalError

            raise ShoalError("empty join token: give every member the same non-empty token")
        self._token, self._run_key, self._resolve = token, run_key, resolve

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        md = _metadata(handler_call_details.invocation_metadata)
        code = decide(method, md, self._token, self._run_key())
        if code is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            role = TOKEN if TOKEN in METHOD_ROLES.get(method, ()) else md.get(ROLE_HEADER, "")
            return _sized(handler, method, role, request_limit(method, role, self._resolve))
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _refusal(code, method)[bool(handler.response_streaming)]


def server_token_ok(context, server_token: str) -> bool:
    """Whether a ``Join`` call carries the operator's server token (``context`` None: an
    in-process call, as tests drive handlers)."""
    if context is None:
        return True
    given = _metadata(context.invocation_metadata()).get(SERVER_TOKEN_HEADER, "")
    return bool(server_token) and hmac.compare_digest(given.encode(), server_token.encode())


def caller(context) -> tuple[str, str]:
    """(member id, role) of the call, as checked by :class:`AuthInterceptor`."""
    md = _metadata(context.invocation_metadata())
    return md.get(MEMBER_HEADER, ""), md.get(ROLE_HEADER, "")


async def check_caller(context, claimed: str) -> None:
    """Abort with PERMISSION_DENIED unless the request's member id is the caller's own.

    ``context`` None is a direct in-process call (tests drive handlers that way): no RPC, no caller.
    """
    if context is None:
        return
    member, _ = caller(context)
    if claimed != member:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"request names member {claimed!r}, but the caller is {member!r}")
