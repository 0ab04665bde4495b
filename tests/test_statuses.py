"""service.transport.statuses: the one mapping of an exception to the status a client reads."""

from __future__ import annotations

import grpc

from service.errors import InvalidArgument, ResourceExhausted
from service.transport.statuses import INTERNAL_MESSAGE, status_of


def test_a_service_error_keeps_its_code_and_message():
    assert status_of(InvalidArgument("step.layer: 9 is out of range")) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "step.layer: 9 is out of range",
    )
    assert status_of(ResourceExhausted("full"), "ignored")[0] is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_anything_else_is_internal_with_a_fixed_message_that_names_nothing_of_it():
    code, message = status_of(ZeroDivisionError("/secret/path.py line 3"))
    assert (code, message) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    assert (
        status_of(KeyError("x"), "internal error; the stream was closed")[1] == "internal error; the stream was closed"
    )
