"""The one place an exception becomes an RPC's status (issue #26): ``status_of``.

Handlers do not catch and abort: they raise, and the status interceptor
(``service.transport.security.SafeStatusInterceptor``) ends the call with ``status_of``'s answer. A
``ServiceError`` (``service.errors``) keeps its own code and message; anything else is INTERNAL
with a fixed message (the method's ``internal_message`` when its behaviour carries one, e.g.
"the stream was closed" for ``Decode``), the traceback going to the log only. In-band statuses
(a refused step, sequence or snapshot inside a stream) are the replies' ``Status`` fields,
built from the same ``ServiceError``'s ``code_number`` and ``message``.
"""

from __future__ import annotations

import logging

import grpc

from ..errors import ServiceError

__all__ = ["INTERNAL_MESSAGE", "status_of", "abort"]

log = logging.getLogger("gqa.status")

INTERNAL_MESSAGE = "internal error"


def status_of(exc: BaseException, internal: str = INTERNAL_MESSAGE) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``exc``."""
    if isinstance(exc, ServiceError):
        return getattr(grpc.StatusCode, exc.code), exc.message
    return grpc.StatusCode.INTERNAL, internal


async def abort(context, exc: BaseException, where: str, internal: str = INTERNAL_MESSAGE):
    """Ends the call with ``status_of(exc)``; an exception that is not a ``ServiceError`` is
    logged with its traceback first (``where``: the method)."""
    if not isinstance(exc, ServiceError):
        log.error("%s failed", where, exc_info=(type(exc), exc, exc.__traceback__))
    code, message = status_of(exc, internal)
    await context.abort(code, message)
