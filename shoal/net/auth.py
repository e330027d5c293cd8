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
        "LeaseStream", "Lease", "CompleteStream", "Complete", "PushGradsStream", "PushGrads", "Renew", "Leave")},
    "/shoal.v1.StageServer/GetWeightsStream": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/GetWeights": frozenset({"worker", COORDINATOR_ID}),
    "/shoal.v1.StageServer/SubmitRelayStream": frozenset({"server"}),
    "/shoal.v1.StageServer/SubmitRelay": frozenset({"server"}),
    "/shoal.v1.StageServer/StandbyCkptStream": frozenset({"server"}),
    "/shoal.v1.StageServer/Probe": frozenset({ANY}),
}


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


class AuthInterceptor(aio.ServerInterceptor):
    """Checks token or credential and role of every call before its handler reads anything.

    ``secret`` returns the run secret (empty until a stage server has joined: then only
    token methods pass).
    """

    def __init__(self, token: str, secret: Callable[[], bytes]):
        if not token:
            from shoal.errors import ShoalError

            raise ShoalError("empty join token: give every member the same non-empty token")
        self._token, self._secret = token, secret

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        code = decide(method, _metadata(handler_call_details.invocation_metadata), self._token, self._secret())
        if code is None:
            return await continuation(handler_call_details)
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
