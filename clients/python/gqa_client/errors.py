"""What the client raises: refusals in-band (the stream or session goes on) and failed calls.

Every error carries ``code`` (a ``grpc.StatusCode``) and ``message`` (the server's words). A
tensor of the wrong dtype or kind never reaches the server: it raises ``TypeError`` before
anything is sent.
"""

from __future__ import annotations

import grpc

from .api import gqa_pb2

__all__ = [
    "GqaError",
    "Refused",
    "InvalidArgument",
    "NotFound",
    "CacheFull",
    "InexactRollback",
    "ServerFault",
    "CallFailed",
    "refusal",
]


class GqaError(Exception):
    """Anything this client raises about a call; ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Refused(GqaError):
    """Refused in-band: the stream (or session, or sequence) is still open and its caches are
    exactly as before. ``id`` is the ``Batch`` sequence it concerns, else None."""

    def __init__(self, code: grpc.StatusCode, message: str, id: int | None = None):
        super().__init__(code, message)
        self.id = id


class InvalidArgument(Refused):
    """A shape, dtype or byte length the server refused, a layer out of range, a bad policy
    configuration, a ``Batch`` sequence id already in use (INVALID_ARGUMENT)."""


class NotFound(Refused):
    """A ``Batch`` sequence id that is not in the session (NOT_FOUND)."""


class CacheFull(Refused):
    """No room left: a full cache under policy ``none``, or the server's byte budget or stream
    limit when adding a ``Batch`` sequence (RESOURCE_EXHAUSTED)."""


class InexactRollback(Refused):
    """The rollback would need evicted tokens back (FAILED_PRECONDITION); the message says how
    far back an exact rollback is possible."""


class ServerFault(Refused):
    """A fault in the server while computing this request (INTERNAL)."""


class CallFailed(GqaError):
    """The RPC ended with a gRPC status (a refused open, the server draining, a lost connection,
    the idle timeout...). For a ``Decode`` stream or ``Batch`` session, it and its caches are
    gone: UNAVAILABLE means reopen (or restore) elsewhere."""

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "CallFailed":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_REFUSALS: dict[int, type[Refused]] = {
    3: InvalidArgument,
    5: NotFound,
    8: CacheFull,
    9: InexactRollback,
    13: ServerFault,
}


def refusal(status: gqa_pb2.Status, id: int | None = None) -> Refused:
    """The typed ``Refused`` for an in-band ``Status``."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _REFUSALS.get(status.code, Refused)(code, status.message, id)
