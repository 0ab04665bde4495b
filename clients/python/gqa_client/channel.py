"""A client's channel: the address, TLS, the token and the message limits, shared by the
blocking and the asyncio client.

The channel takes messages up to 64 MiB each way (the server's default limit; gRPC's own
default is 4 MiB). ``token`` travels as ``authorization: Bearer <token>`` on every call.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable
from typing import Any

import grpc

from ._version import __version__
from .api import gqa_pb2_grpc
from .messages import _HEALTH_METHOD, DEFAULT_MESSAGE_BYTES

__all__ = ["channel_options"]


def _read_bytes(value: bytes | str | os.PathLike | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return pathlib.Path(value).read_bytes()


def _credentials(tls: bool, root_certificates, certificate_chain, private_key):
    if not (tls or root_certificates or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(
        _read_bytes(root_certificates), _read_bytes(private_key), _read_bytes(certificate_chain)
    )


def channel_options(
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES, options: Iterable[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """Message limits both ways, a user agent, then ``options`` (which win)."""
    base = {
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.primary_user_agent": f"gqa-serve-python/{__version__}",
    }
    base.update(dict(options))
    return list(base.items())


class _Channel:
    """Connection settings and the channel, shared by both flavours; ``_grpc`` is the flavour's
    channel module (``grpc`` or ``grpc.aio``)."""

    _grpc = grpc

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        tls: bool = False,
        root_certificates=None,
        certificate_chain=None,
        private_key=None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        options: Iterable[tuple[str, Any]] = (),
        timeout: float | None = 30.0,
    ):
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._options = channel_options(max_message_bytes, options)
        self._credentials = _credentials(tls, root_certificates, certificate_chain, private_key)
        if self._credentials is None:
            self.channel = self._grpc.insecure_channel(address, options=self._options)
        else:
            self.channel = self._grpc.secure_channel(address, self._credentials, options=self._options)
        self.stub = gqa_pb2_grpc.AttentionServiceStub(self.channel)
        self._health = self.channel.unary_unary(_HEALTH_METHOD)
