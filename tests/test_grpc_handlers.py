"""service.transport.handlers: each of the four handler kinds maps to its behaviour and factory."""

from __future__ import annotations

import grpc
import pytest

from service.transport.handlers import handler_kind


def _behavior(request, context):  # never called
    raise AssertionError


@pytest.mark.parametrize(
    "factory, attribute",
    [
        (grpc.unary_unary_rpc_method_handler, "unary_unary"),
        (grpc.unary_stream_rpc_method_handler, "unary_stream"),
        (grpc.stream_unary_rpc_method_handler, "stream_unary"),
        (grpc.stream_stream_rpc_method_handler, "stream_stream"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_handler_kind_rebuilds_the_same_kind(factory, attribute):
    handler = factory(_behavior)
    behavior, rebuild = handler_kind(handler)
    assert behavior is _behavior and getattr(handler, attribute) is _behavior
    rebuilt = rebuild(behavior)
    assert (rebuilt.request_streaming, rebuilt.response_streaming) == (
        handler.request_streaming,
        handler.response_streaming,
    )
