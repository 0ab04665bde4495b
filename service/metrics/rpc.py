"""The go-grpc-prometheus server families (``grpc_server_*``) for a grpc.aio server.

``GrpcServerMetrics`` is a server interceptor measuring unary and streaming RPCs alike, message
counts included, under go-grpc-prometheus' names, labels and Go's spelling of the codes, so
its dashboards and alerts work unchanged. Part of ``service.metrics.recorder`` (which re-exports it).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..transport.handlers import handler_kind

__all__ = ["GrpcServerMetrics", "GRPC_CODE_NAMES", "RPC_BUCKETS", "FlushOnCollect"]

# RPC handling time: a unary step is sub-millisecond, a Decode stream lasts as long as its
# client's generation (minutes).
RPC_BUCKETS = (
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)


def _go_code_name(code: grpc.StatusCode) -> str:
    # The names of Go's codes.Code.String(), which the go-grpc-prometheus dashboards filter on.
    if code is grpc.StatusCode.OK:
        return "OK"
    if code is grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(part.capitalize() for part in code.name.split("_"))


GRPC_CODE_NAMES = {code: _go_code_name(code) for code in grpc.StatusCode}


# -- gRPC server metrics --------------------------------------------------------------------------
_RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")


def _rpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming:
        return "bidi_stream" if response_streaming else "client_stream"
    return "server_stream" if response_streaming else "unary"


@dataclass(slots=True)
class _MethodSeries:
    """One method's children. Its messages are counted in plain ints on the event loop
    (``received_n``, ``sent_n``: a locked increment per message before) and added to the
    counters at scrape time (``GrpcServerMetrics.flush``)."""

    labels: tuple[str, str, str]
    started: object
    received: object
    sent: object
    handling: object
    handled_family: object
    handled: dict = field(default_factory=dict)
    received_n: int = 0
    sent_n: int = 0
    received_flushed: int = 0
    sent_flushed: int = 0

    def handled_child(self, code: grpc.StatusCode):
        child = self.handled.get(code)
        if child is None:
            child = self.handled[code] = self.handled_family.labels(*self.labels, GRPC_CODE_NAMES[code])
        return child


class _Call:
    """One RPC in flight: counts its messages and remembers the status its handler set."""

    __slots__ = ("series", "code")

    def __init__(self, series: _MethodSeries):
        self.series = series
        self.code: grpc.StatusCode | None = None


class _CountingContext:
    """The handler's context, counting what it reads and writes and the code it aborts with."""

    __slots__ = ("_context", "_call")

    def __init__(self, context, call: _Call):
        self._context = context
        self._call = call

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def read(self):
        message = await self._context.read()
        if message is not grpc.aio.EOF:
            self._call.series.received_n += 1
        return message

    async def write(self, message) -> None:
        await self._context.write(message)
        self._call.series.sent_n += 1

    async def abort(self, code, details="", trailing_metadata=()):
        self._call.code = code
        await self._context.abort(code, details, trailing_metadata)

    def set_code(self, code) -> None:
        self._call.code = code
        self._context.set_code(code)


async def _counted(requests, series: _MethodSeries):
    async for message in requests:
        series.received_n += 1
        yield message


def _final_code(call: _Call, exc: BaseException | None) -> grpc.StatusCode:
    if exc is None:
        return call.code or grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        return call.code or grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc.aio answers an unhandled exception with


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """go-grpc-prometheus's server metrics for a grpc.aio server, streaming RPCs included.

    Wraps async handlers (coroutines and async generators); a synchronous handler on an aio
    server is passed through unmeasured.
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        # First in the registry: every collect adds the messages counted since the last one.
        r.register(FlushOnCollect(self.flush))
        self._flush_lock = threading.Lock()  # scrapes may run at once
        self.started = Counter(
            "grpc_server_started_total", "Total number of RPCs started on the server.", _RPC_LABELS, registry=r
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            _RPC_LABELS + ("grpc_code",),
            registry=r,
        )
        self.received = Counter(
            "grpc_server_msg_received_total",
            "Total number of RPC stream messages received on the server.",
            _RPC_LABELS,
            registry=r,
        )
        self.sent = Counter(
            "grpc_server_msg_sent_total",
            "Total number of gRPC stream messages sent by the server.",
            _RPC_LABELS,
            registry=r,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
            _RPC_LABELS,
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self._methods: dict[str, _MethodSeries] = {}

    def _series(self, full_method: str, request_streaming: bool, response_streaming: bool) -> _MethodSeries:
        series = self._methods.get(full_method)
        if series is None:
            service, _, method = full_method.lstrip("/").rpartition("/")
            labels = (_rpc_type(request_streaming, response_streaming), service, method)
            series = _MethodSeries(
                labels,
                self.started.labels(*labels),
                self.received.labels(*labels),
                self.sent.labels(*labels),
                self.handling.labels(*labels),
                self.handled,
            )
            self._methods[full_method] = series
        return series

    def flush(self) -> None:
        """Adds the messages counted since the last flush to the message counters (any thread:
        the loop only ever raises ``received_n`` / ``sent_n``, this only their watermarks)."""
        with self._flush_lock:
            for series in list(self._methods.values()):
                received, sent = series.received_n, series.sent_n
                if received != series.received_flushed:
                    series.received.inc(received - series.received_flushed)
                    series.received_flushed = received
                if sent != series.sent_flushed:
                    series.sent.inc(sent - series.sent_flushed)
                    series.sent_flushed = sent

    def initialize(self, service: "object") -> None:
        """Creates every series of a service's methods at 0 (a ``ServiceDescriptor``), every code
        included, so a rate over the first RPCs or the first error is not lost."""
        for m in service.methods:
            series = self._series(f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming)
            for code in grpc.StatusCode:
                series.handled_child(code)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        series = self._series(handler_call_details.method, handler.request_streaming, handler.response_streaming)
        behavior, factory = handler_kind(handler)
        if inspect.isasyncgenfunction(behavior):
            wrapped = self._wrap_generator(behavior, series, handler.request_streaming)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = self._wrap_coroutine(behavior, series, handler.request_streaming, handler.response_streaming)
        else:
            return handler
        return factory(
            wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    @staticmethod
    def _begin(series: _MethodSeries, request_or_iterator, request_streaming: bool):
        series.started.inc()
        if request_streaming:
            return _counted(request_or_iterator, series)
        series.received_n += 1
        return request_or_iterator

    @staticmethod
    def _end(series: _MethodSeries, call: _Call, exc: BaseException | None, t0: float) -> None:
        series.handled_child(_final_code(call, exc)).inc()
        series.handling.observe(time.perf_counter() - t0)

    def _wrap_coroutine(
        self, behavior: Callable, series: _MethodSeries, request_streaming: bool, response_streaming: bool
    ):
        begin, end = self._begin, self._end

        async def handler(request_or_iterator, context):
            t0 = time.perf_counter()
            call = _Call(series)
            request = begin(series, request_or_iterator, request_streaming)
            try:
                response = await behavior(request, _CountingContext(context, call))
            except BaseException as exc:
                end(series, call, exc, t0)
                raise
            if not response_streaming and (call.code is None or call.code is grpc.StatusCode.OK):
                series.sent_n += 1
            end(series, call, None, t0)
            return response

        return handler

    def _wrap_generator(self, behavior: Callable, series: _MethodSeries, request_streaming: bool):
        begin, end = self._begin, self._end

        async def handler(request_or_iterator, context):
            t0 = time.perf_counter()
            call = _Call(series)
            request = begin(series, request_or_iterator, request_streaming)
            responses = behavior(request, _CountingContext(context, call))
            failure: BaseException | None = None
            try:
                async for response in responses:
                    yield response
                    series.sent_n += 1  # resumed: the server wrote it and asks for the next
            except BaseException as exc:
                failure = exc
                raise
            finally:
                try:
                    await responses.aclose()
                finally:
                    end(series, call, failure, t0)

        return handler


class FlushOnCollect:
    """A collector of no family of its own: registered before the families that ``flush`` fills
    (plain numbers the hot path added since the last collect), it runs ``flush`` first on every
    collect of the registry (a scrape, ``get_sample_value``)."""

    def __init__(self, flush: Callable[[], None]):
        self._flush = flush

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self._flush()
        return []
