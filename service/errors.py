"""Domain errors with their status codes, mapped to gRPC in one place (``service.transport.statuses``).

Codes are the canonical gRPC names as strings, so the engine needs no ``grpc`` import.
Messages are safe to show a client: they name fields and shapes, never paths or traces.
"""

from __future__ import annotations

__all__ = [
    "ServiceError",
    "InvalidArgument",
    "ResourceExhausted",
    "FailedPrecondition",
    "Unavailable",
    "Internal",
    "DeadlineExceeded",
    "CODE_NUMBERS",
]

# Canonical gRPC status numbers, for in-band statuses in stream replies.
CODE_NUMBERS = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}


class ServiceError(Exception):
    code = "UNKNOWN"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @property
    def code_number(self) -> int:
        return CODE_NUMBERS[self.code]


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Internal(ServiceError):
    code = "INTERNAL"

    def __init__(self, message: str = "internal error; the stream's caches are unchanged"):
        super().__init__(message)
