"""gRPC contexts for handlers driven in process (no sockets), as the server sees a member's call."""

from __future__ import annotations


class MemberCall:
    """The context of a call (or session) opened by member ``wid``: its member header; an
    abort fails the test with the status and reason."""

    def __init__(self, wid: str) -> None:
        self.wid = wid

    def invocation_metadata(self):
        from shoal.net.auth import MEMBER_HEADER

        return [(MEMBER_HEADER, self.wid)]

    async def abort(self, code, details):
        raise AssertionError(f"call aborted: {code} {details}")
