"""Transport security, authentication and safe statuses for the gRPC server.

- ``server_credentials``: TLS from a certificate chain and key, and mutual TLS (client
  certificates checked against a CA bundle), from ``ServerConfig``; ``None`` means plaintext.
- ``BearerTokenInterceptor``: every RPC except ``grpc.health.v1.Health`` must carry
  ``authorization: Bearer <token>``; a missing or wrong token gets UNAUTHENTICATED. Tokens are
  compared as SHA-256 digests with ``hmac.compare_digest`` (constant time, whatever the length)
  and are never logged. Reflection is *not* exempt: it describes the whole API, and tools that
  use it (grpcurl, buf curl) can send the header.
- ``SafeStatusInterceptor``: where a handler's exception becomes the call's status
  (``service.transport.statuses.status_of``, the one mapping): ``ServiceError`` gets its own code and
  message; any other exception becomes INTERNAL with a fixed message (a behaviour's
  ``internal_message`` attribute, else "internal error") while the traceback goes to the log;
  bytes that do not parse as the method's request message get INVALID_ARGUMENT instead of
  grpc's "Unexpected <class ...>" text.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
from collections.abc import Callable

import grpc

from ..config import ConfigError, ServerConfig
from ..errors import InvalidArgument
from .handlers import handler_kind, passes_bytes
from .statuses import INTERNAL_MESSAGE, abort

__all__ = [
    "server_credentials",
    "load_token",
    "BearerTokenInterceptor",
    "SafeStatusInterceptor",
    "EXEMPT_SERVICES",
    "malformed_request",
]

log = logging.getLogger("gqa.security")

# Probes (kubelet's native grpc probe, grpc_health_probe) cannot send a token.
EXEMPT_SERVICES = ("grpc.health.v1.Health",)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"--{flag}: cannot read {path!r}: {exc.strerror}") from None


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS) credentials for the gRPC port, or None for plaintext."""
    if not config.tls:
        return None
    cert = _read(config.tls_cert_file, "tls-cert-file")
    key = _read(config.tls_key_file, "tls-key-file")
    ca = _read(config.tls_client_ca_file, "tls-client-ca-file") if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def load_token(config: ServerConfig) -> str | None:
    """The bearer token the server requires, or None when no token source is configured.

    A configured source that holds no token is an error, never "authentication off": an empty
    Kubernetes Secret must stop the pod, not open the service (``ServerConfig.validate`` says
    so first; this re-reads the file, which may have changed since).
    """
    if config.auth_token_file:
        token = _read(config.auth_token_file, "auth-token-file").decode("utf-8", "replace").strip()
        where = "--auth-token-file"
    elif config.auth_token:
        token, where = config.auth_token.strip(), "GQA_AUTH_TOKEN"
    else:
        return None
    if not token:
        raise ConfigError(f"{where}: set but empty; refusing to start without authentication")
    if any(c.isspace() for c in token):
        raise ConfigError(f"{where}: the token must not contain whitespace")
    return token


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without ``authorization: Bearer <token>``, health excepted.

    A refused call is answered by a handler of the same kind as the real one that aborts with
    UNAUTHENTICATED without parsing the request, so an outer metrics interceptor counts it
    under its method with that code.
    """

    def __init__(self, token: str, exempt: tuple[str, ...] = EXEMPT_SERVICES):
        self._expected = _digest(token.encode())
        self._exempt = tuple(f"/{name}/" for name in exempt)

    def _authorized(self, metadata) -> bool:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) != 1:
            return False
        value = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
        scheme, _, token = value.partition(b" ")
        # Always compare, so a wrong scheme costs the same time as a wrong token.
        same = hmac.compare_digest(_digest(token.strip()), self._expected)
        return same and scheme.lower() == b"bearer"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        log.info("refused %s: missing or wrong bearer token", handler_call_details.method)
        _, factory = handler_kind(handler)

        async def refuse(request_or_iterator, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid bearer token (metadata `authorization: Bearer <token>`)",
            )

        if handler.response_streaming:

            async def refuse_stream(request_or_iterator, context):
                await refuse(request_or_iterator, context)
                yield  # pragma: no cover - abort raised above

            return factory(refuse_stream, request_deserializer=None, response_serializer=handler.response_serializer)
        return factory(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


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
        if inspect.isasyncgenfunction(behavior):
            wrapped = self._wrap_generator(behavior, method, handler.request_streaming)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = self._wrap_coroutine(behavior, method, handler.request_streaming)
        else:
            return handler
        # A behaviour marked ``raw_requests`` reads its requests' bytes and parses them itself.
        raw = getattr(behavior, "raw_requests", False)
        return factory(
            wrapped,
            request_deserializer=None if raw else _tolerant(handler.request_deserializer),
            response_serializer=passes_bytes(handler.response_serializer),
        )

    @staticmethod
    async def _prepare(request, context, method: str, request_streaming: bool):
        if request_streaming:
            return _guarded_iterator(request, method), _GuardedContext(context, method)
        if request is _MALFORMED:
            await _refuse_malformed(context, method)
        return request, _GuardedContext(context, method)

    def _wrap_coroutine(self, behavior, method: str, request_streaming: bool):
        internal = getattr(behavior, "internal_message", INTERNAL_MESSAGE)

        async def handler(request, context):
            request, guarded = await self._prepare(request, context, method, request_streaming)
            try:
                return await behavior(request, guarded)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await abort(context, exc, method, internal)

        return handler

    def _wrap_generator(self, behavior, method: str, request_streaming: bool):
        internal = getattr(behavior, "internal_message", INTERNAL_MESSAGE)

        async def handler(request, context):
            request, guarded = await self._prepare(request, context, method, request_streaming)
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
