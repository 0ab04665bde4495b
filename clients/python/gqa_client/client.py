"""``Client``: the blocking client over one channel (``Decode`` streams, ``Batch`` sessions, the
stateless ``DecodeStep``, server information, health).

Errors: a call the server ends with a gRPC status raises ``CallFailed`` (``.code``, a
``grpc.StatusCode``); what a stream raises is in ``gqa_client.stream``. Unary calls carry the
client's ``timeout``; long-lived ``Decode`` streams and ``Batch`` sessions carry no deadline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import grpc

from .api import gqa_pb2
from .channel import _Channel
from .errors import CallFailed
from .messages import (
    DecodeStepResult,
    _decode_step_request,
    _decode_step_result,
    _health_request,
    _health_status,
    open_message,
)
from .snapshot import Snapshot, as_snapshot
from .stream import DecodeStream

__all__ = ["Client"]


class Client(_Channel):
    """A blocking client over one channel.

    ``tls`` (or any certificate) selects TLS; ``root_certificates`` (PEM bytes or a path;
    default: the system's roots), ``certificate_chain`` and ``private_key`` for mutual TLS.
    ``token`` is sent as ``authorization: Bearer <token>`` on every call. ``max_message_bytes``
    sets both message limits of the channel; ``options`` adds or overrides channel options
    (e.g. ``("grpc.lb_policy_name", "round_robin")`` with a ``dns:///`` address). ``timeout``
    is the deadline of unary calls, in seconds (never of ``Decode`` streams or ``Batch`` sessions).
    """

    def _unary(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise CallFailed.from_rpc(exc) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel connects; ``CallFailed`` (UNAVAILABLE) if it does not in time."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"no server at {self.address} after {timeout:g} s") from None

    def server_info(self) -> gqa_pb2.GetServerInfoResponse:
        return self._unary(self.stub.GetServerInfo, gqa_pb2.GetServerInfoRequest())

    def health(self, service: str = "") -> str:
        """``SERVING`` or ``NOT_SERVING`` (``""``: the server; ``gqa.v1.AttentionService``)."""
        return _health_status(self._unary(self._health, _health_request(service)))

    def decode_step(
        self,
        query,
        new_key,
        new_value,
        key_cache,
        value_cache,
        *,
        num_query_heads: int = 0,
        num_kv_heads: int = 0,
        dtype=None,
    ) -> DecodeStepResult:
        """The stateless operation: query (B, Hq, D), new key/value (B, Hkv, D), caches
        (B, Hkv, S, D). Head counts default to the shapes' (query and new_key dim 1); ``dtype``
        to the query's, and every tensor must have it."""
        request = _decode_step_request(
            query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
        )
        return _decode_step_result(self._unary(self.stub.DecodeStep, request), query)

    def open(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        batch_size: int = 1,
        dtype="float32",
        policy: str = "none",
        window: int = 0,
        capacity: int | None = None,
        sink_tokens: int = 0,
        backend: str = "",
        prefill: Mapping[int, tuple[Any, Any]] | None = None,
    ) -> DecodeStream:
        """Opens a ``Decode`` stream (``CallFailed`` if the server refuses it).

        ``policy`` (docs/eviction.md): ``none`` keeps every token up to ``capacity`` (default
        ``DEFAULT_CAPACITY``); ``strict`` keeps the last ``window``; ``greedy`` attends the last
        ``window`` and keeps up to ``capacity`` (default: the window); ``sink`` keeps the first
        ``sink_tokens`` and the last ``window``. ``dtype`` is a name, a torch or a numpy dtype;
        ``backend`` ``""`` is the server's default. ``prefill`` maps a layer to its (keys,
        values), each (B, Hkv, n, D) of the stream's dtype.
        """
        message = open_message(
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            batch_size=batch_size,
            dtype=dtype,
            policy=policy,
            window=window,
            capacity=capacity,
            sink_tokens=sink_tokens,
            backend=backend,
            prefill=prefill,
        )
        return self.open_message(message)

    def open_message(self, message: gqa_pb2.OpenStream) -> DecodeStream:
        return DecodeStream(self.stub, [gqa_pb2.DecodeRequest(request_id=0, open=message)], self.metadata)

    def restore(self, snapshot: Snapshot | bytes | str | os.PathLike) -> DecodeStream:
        """Reopens a stream from a ``Snapshot``, its bytes, a file or its chunks, on this server."""
        chunks = as_snapshot(snapshot).chunks
        return DecodeStream(self.stub, [gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in chunks], self.metadata)

    def batch(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype="float32",
        backend: str = "",
    ):
        """Opens a ``Batch`` session (many sequences per message) on this client's channel, with
        its token: a ``gqa_client.BatchSession``."""
        from .batch import BatchSession

        return BatchSession(
            self.stub,
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            dtype=dtype,
            backend=backend,
            metadata=self.metadata,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
