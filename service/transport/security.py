"""Who may call the gRPC server (TLS credentials, the bearer token).

- ``server_credentials``: TLS from a certificate chain and key, and mutual TLS (client
  certificates checked against a CA bundle), from ``ServerConfig``; ``None`` means plaintext.
- ``BearerTokenInterceptor``: every RPC except ``grpc.health.v1.Health`` must carry
  ``authorization: Bearer <token>``; a missing or wrong token gets UNAUTHENTICATED. Tokens are
  compared as SHA-256 digests with ``hmac.compare_digest`` (constant time, whatever the length)
  and are never logged. Reflection is *not* exempt: it describes the whole API, and tools that
  use it (grpcurl, buf curl) can send the header.

Where a refused or failed call's status comes from: ``service.transport.statuses``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import grpc

from ..config import ConfigError, ServerConfig
from .handlers import handler_kind

__all__ = [
    "server_credentials",
    "load_token",
    "BearerTokenInterceptor",
    "EXEMPT_SERVICES",
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
