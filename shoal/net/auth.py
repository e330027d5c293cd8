"""Who may call what: the join token, per-member credentials and the role table.

* The **join token** admits a process to ``Join`` (and to ``Status``) and nothing else.
* At ``Join`` the coordinator gives each member a **credential**:
  ``HMAC-SHA256(run secret, member id + role)``. Stage servers also get the run secret, so
  they can check credentials themselves. A member sends ``x-shoal-member``,
  ``x-shoal-role`` and ``x-shoal-cred`` with every call (a client interceptor adds them,
  learning them from the ``Join`` reply), so no runtime code handles them.
* :class:`AuthInterceptor` checks the metadata **before the request is read**: a call
  without a valid credential, or from a role the method is not for (:data:`METHOD_ROLES`),
  is answered by a handler that never reads the request, so an unauthenticated peer costs
  the server no more than gRPC's flow-control window.
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
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc import aio

TOKEN_HEADER = "x-shoal-token"
MEMBER_HEADER = "x-shoal-member"
ROLE_HEADER = "x-shoal-role"
CRED_HEADER = "x-shoal-cred"

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
    "/shoal.v1.Coordinator/Probe": frozenset({ANY}),
    **{f"/shoal.v1.StageServer/{m}": frozenset({"worker"}) for m in (
        "LeaseStream", "Lease", "CompleteStream", "Complete", "PushGradsStream", "PushGrads", "Renew", "Leave",
        "Session")},
    "/shoal.v1.StageServer/GetWeightsStream": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/GetWeights": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/SubmitRelayStream": frozenset({"server"}),
    "/shoal.v1.StageServer/SubmitRelay": frozenset({"server"}),
    "/shoal.v1.StageServer/StandbyCkptStream": frozenset({"server"}),
    "/shoal.v1.StageServer/StandbyStepStream": frozenset({"server"}),
    "/shoal.v1.StageServer/Probe": frozenset({ANY}),
}


KIB, MIB = 1024, 1024 * 1024
CONTROL_BYTES = 256 * KIB  # a control request: ids, counters, a few names; far above any honest one
REPORT_BYTES = 4 * MIB  # requests carrying per-run lists (losses per micro-batch, link probes, traffic)
PROBE_BYTES = 64 * MIB  # largest probe transfer (a timed link measurement; --probe-mb is at most 64)
MAX_CHUNK_BYTES = 64 * MIB  # largest chunk of a streamed transfer (--chunk-mb is at most 64)
CHUNK_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * KIB  # one Chunk message: its data plus kind, offsets, sender
GRADS = "grads"  # a size the stage server resolves: its stage's gradient (parameter bytes + slack)
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
    "/shoal.v1.StageServer/StandbyCkptStream": {"server": SizeLimit(CONTROL_BYTES)},
    "/shoal.v1.StageServer/StandbyStepStream": {"server": _CHUNKED},
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


def member_credential(secret: bytes, member: str, role: str) -> str:
    """The credential of ``member`` in ``role`` under the run ``secret`` (hex HMAC-SHA256)."""
    return hmac.new(secret, f"{member}\0{role}".encode(), hashlib.sha256).hexdigest()


@dataclass
class Identity:
    """What a process sends with its calls; filled in from its ``Join`` reply."""

    token: str  # join token (sent on every call; only Join and Status accept it alone)
    member: str = ""  # member id given at join
    role: str = ""  # "server", "worker" or "coordinator"
    credential: str = ""  # member_credential(run secret, member, role)
    secret: bytes = b""  # servers and the coordinator: the run secret that checks credentials

    @classmethod
    def joined(cls, token: str, secret: bytes, member: str, role: str) -> Identity:
        """The identity ``member`` gets when it joins in ``role`` (for tests and tools)."""
        return cls(token, member, role, member_credential(secret, member, role))

    def metadata(self) -> list[tuple[str, str]]:
        md = [(TOKEN_HEADER, self.token)]
        if self.credential:
            md += [(MEMBER_HEADER, self.member), (ROLE_HEADER, self.role), (CRED_HEADER, self.credential)]
        return md

    def learn(self, reply) -> None:
        """Take member id, role, credential (and the run secret) from a ``JoinReply``."""
        if reply.credential:
            self.member, self.role, self.credential = reply.member_id, reply.role, reply.credential
        if reply.run_secret:
            self.secret = bytes(reply.run_secret)


def coordinator_identity(token: str, secret: bytes) -> Identity:
    """The coordinator's own identity (it pulls the final weights as ``coordinator``)."""
    return Identity(token, COORDINATOR_ID, COORDINATOR_ID, member_credential(secret, COORDINATOR_ID,
                                                                               COORDINATOR_ID), secret)


def _metadata(details) -> dict[str, str]:
    out = {}
    for key, value in details or ():
        out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def decide(method: str, md: dict[str, str], token: str, secret: bytes) -> grpc.StatusCode | None:
    """None if the call may proceed, else the status to refuse it with (pure; tested directly)."""
    allowed = METHOD_ROLES.get(method, frozenset({ANY}))
    if TOKEN in allowed:
        if token and hmac.compare_digest(md.get(TOKEN_HEADER, "").encode(), token.encode()):
            return None
        return grpc.StatusCode.UNAUTHENTICATED
    member, role, cred = md.get(MEMBER_HEADER, ""), md.get(ROLE_HEADER, ""), md.get(CRED_HEADER, "")
    if not secret or not member or not role or not cred:
        return grpc.StatusCode.UNAUTHENTICATED
    if not hmac.compare_digest(cred.encode(), member_credential(secret, member, role).encode()):
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
                    carried += len(getattr(msg, "data", b""))
                    announced = max(int(getattr(msg, "total", 0)), carried)
                    if announced > whole:
                        await refuse(context, announced, whole, "streamed message")
                yield msg

        if handler.response_streaming:  # sessions: a long-lived stream each way
            async def stream_stream(request_iterator, context):
                async for item in handler.stream_stream(requests(request_iterator, context), context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=checked,
                                                         response_serializer=handler.response_serializer)

        async def stream_unary(request_iterator, context):
            return await handler.stream_unary(requests(request_iterator, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=checked,
                                                    response_serializer=handler.response_serializer)
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
                                                    response_serializer=handler.response_serializer)

    async def unary_unary(request, context):
        if isinstance(request, _Oversize):
            await refuse(context, request.nbytes, per_msg)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=checked,
                                               response_serializer=handler.response_serializer)


class AuthInterceptor(aio.ServerInterceptor):
    """Checks token or credential and role of every call before its handler reads anything,
    then the size of every request message against :data:`METHOD_LIMITS`.

    ``secret`` returns the run secret (empty until a stage server has joined: then only
    token methods pass); ``resolve`` turns :data:`GRADS` / :data:`ACT` into this
    server's sizes (None: only :data:`REQUEST_CAP` bounds them).
    """

    def __init__(self, token: str, secret: Callable[[], bytes], resolve: Callable[[str], int] | None = None):
        if not token:
            from shoal.errors import ShoalError

            raise ShoalError("empty join token: give every member the same non-empty token")
        self._token, self._secret, self._resolve = token, secret, resolve

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        md = _metadata(handler_call_details.invocation_metadata)
        code = decide(method, md, self._token, self._secret())
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
