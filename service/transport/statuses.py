"""How a call's failure becomes its status (``status_of``, applied by ``SafeStatusInterceptor``).

Handlers do not catch and abort: they raise, and the status interceptor
(``SafeStatusInterceptor``, below) ends the call with ``status_of``'s answer. A
``ServiceError`` (``service.errors``) keeps its own code and message; anything else is INTERNAL
with a fixed message (the method's ``internal_message`` when its behaviour carries one, e.g.
"the stream was closed" for ``Decode``), the traceback going to the log only. In-band statuses
(a refused step, sequence or snapshot inside a stream) are the replies' ``Status`` fields,
built from the same ``ServiceError``'s ``code_number`` and ``message``. Bytes that do not parse as
the method's request message get INVALID_ARGUMENT (``malformed_request``) instead of grpc's
"Unexpected <class ...>" text.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable

import grpc

from ..errors import InvalidArgument, ServiceError
from .handlers import handler_kind, passes_bytes

__all__ = ["INTERNAL_MESSAGE", "status_of", "abort", "SafeStatusInterceptor", "malformed_request"]

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


class _Malformed:
    """What a request that does not parse deserializes to; the handler's wrapper refuses it."""

    __slots__ = ()


_MALFORMED = _Malformed()


def _tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:
            return _MALFORMED

    return deserialize


class _GuardedContext:
    """The handler's context, refusing a streamed request that did not parse."""

    __slots__ = ("_context", "_method")

    def __init__(self, context, method: str):
        self._context = context
        self._method = method

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def read(self):
        # Raised, not aborted: the read may happen on a task other than the handler's (the
        # servicer's read-ahead), and only the handler may end the call.
        message = await self._context.read()
        if message is _MALFORMED:
            raise malformed_request(self._method)
        return message


def malformed_request(method: str) -> InvalidArgument:
    """The refusal of a request message that does not parse (``method``: its name or path)."""
    return InvalidArgument(f"a request message of {method.rpartition('/')[2]} is not valid protobuf for its type")


async def _refuse_malformed(context, method: str):
    await abort(context, malformed_request(method), method)


async def _guarded_iterator(requests, method: str):
    async for message in requests:
        if message is _MALFORMED:
            raise malformed_request(method)
        yield message


class SafeStatusInterceptor(grpc.aio.ServerInterceptor):
    """Makes every status a client sees safe to show: no traceback, path or class name."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        behavior, factory = handler_kind(handler)
        method = handler_call_details.method
        # A behaviour marked ``raw_requests`` reads its requests' bytes and parses them itself:
        # nothing to refuse as malformed on the way, so its reads go to the context unguarded.
        raw = getattr(behavior, "raw_requests", False)
        guard = handler.request_streaming and not raw
        if inspect.isasyncgenfunction(behavior):
            wrapped = self._wrap_generator(behavior, method, guard)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = self._wrap_coroutine(behavior, method, guard)
        else:
            return handler
        return factory(
            wrapped,
            request_deserializer=None if raw else _tolerant(handler.request_deserializer),
            response_serializer=passes_bytes(handler.response_serializer),
        )

    @staticmethod
    async def _prepare(request, context, method: str, guard: bool):
        """The request (iterator) and context the behaviour gets: with ``guard``, a streamed
        request that did not parse is refused where it is read."""
        if guard:
            return _guarded_iterator(request, method), _GuardedContext(context, method)
        if request is _MALFORMED:
            await _refuse_malformed(context, method)
        return request, context

    def _wrap_coroutine(self, behavior, method: str, guard: bool):
        internal = getattr(behavior, "internal_message", INTERNAL_MESSAGE)

        async def handler(request, context):
            request, guarded = await self._prepare(request, context, method, guard)
            try:
                return await behavior(request, guarded)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await abort(context, exc, method, internal)

        return handler

    def _wrap_generator(self, behavior, method: str, guard: bool):
        internal = getattr(behavior, "internal_message", INTERNAL_MESSAGE)

        async def handler(request, context):
            request, guarded = await self._prepare(request, context, method, guard)
            responses = behavior(request, guarded)
            try:
                async for response in responses:
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:
                await abort(context, exc, method, internal)
            finally:
                await responses.aclose()

        return handler
