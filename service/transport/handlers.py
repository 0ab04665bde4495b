"""What the server's interceptors share about a ``grpc.RpcMethodHandler``.

``passes_bytes`` lets a handler write a reply it serialized itself (the ``Batch`` stream's
step replies, encoded around the output buffer).

An interceptor that wraps a handler's behaviour must rebuild a handler of the same kind (unary
or streaming, each side); ``handler_kind`` is the one place that says which behaviour a
handler carries and which factory rebuilds it. Used by the status-mapping interceptor
(``service.transport.security``) and the metrics interceptor (``service.metrics.rpc``).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

__all__ = ["handler_kind", "passes_bytes"]


def handler_kind(handler: grpc.RpcMethodHandler) -> tuple[Callable, Callable]:
    """``(behavior, factory)``: the handler's behaviour (``stream_stream``, ``stream_unary``,
    ``unary_stream`` or ``unary_unary``, by its two streaming flags) and the
    ``grpc.*_rpc_method_handler`` that builds a handler of the same kind around a wrapped
    behaviour (pass it the handler's deserializer and serializer)."""
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    if handler.response_streaming:
        return handler.unary_stream, grpc.unary_stream_rpc_method_handler
    return handler.unary_unary, grpc.unary_unary_rpc_method_handler


def passes_bytes(serializer: Callable | None) -> Callable | None:
    """``serializer``, except that a ``bytes`` reply (already serialized) goes out as it is."""
    if serializer is None:
        return None

    def serialize(message):
        return message if message.__class__ is bytes else serializer(message)

    return serialize
