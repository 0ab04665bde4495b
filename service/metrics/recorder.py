"""Every Prometheus metric of the service, declared here and nowhere else.

Three parts, bundled by ``ServiceMetrics`` (one per server, on its own registry):

- ``MetricsRecorder``: the engine's observer. The engine hands it plain stats (a stream opened,
  a step's report, a refusal); it turns them into ``gqa_*`` updates. Gauges that describe the
  engine's state (active streams, cache bytes, the budget) are read from the engine at scrape
  time, so they can never drift from it.
- ``GrpcServerMetrics`` (``service.metrics.rpc``): a grpc.aio server interceptor exporting the ``grpc_server_*`` families
  under the names and labels of go-grpc-prometheus, for unary and streaming RPCs alike, message
  counts included.
- ``serve_http`` (``service.metrics.listener``): the exposition on its own port, one thread and a
  bounded number of connections, with the process and platform collectors.

Labels take bounded values only (backend, dtype, policy, outcome, reason, gRPC method and code);
never a stream id. Names carry their unit (``_seconds``, ``_bytes``) and counters end in
``_total``. Histogram buckets are explicit.
"""

from __future__ import annotations

import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import __version__
from ..engine.engine import Engine, Stream
from ..engine.report import EngineObserver
from .listener import MetricsHttpServer, serve_http
from .rpc import FlushOnCollect, GrpcServerMetrics

__all__ = [
    "ServiceMetrics",
    "MetricsRecorder",
    "ObserverFanOut",
    "LATENCY_BUCKETS",
    "LIFETIME_BUCKETS",
    "BATCH_BUCKETS",
    "OPEN_REFUSAL_REASONS",
    "STEP_REFUSAL_CODES",
]

# A decode step on a CPU takes tens of microseconds for a small head, milliseconds for a long
# window, and a queued step can wait up to seconds under overload: 10 us .. 10 s, ~2.5x apart.
LATENCY_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
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
)
LIFETIME_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0)

# Steps per batched computation and sequences per Batch message: powers of two up to the
# largest batch a stream may send (--max-batch-size 256) times a few streams.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Why ``Engine.open`` refuses a stream (the reasons it passes to ``open_refused``).
OPEN_REFUSAL_REASONS = ("budget", "streams", "draining", "backend", "invalid", "memory")
# Codes a step is refused with in-band; pre-created so the first refusal shows in ``rate()``.
STEP_REFUSAL_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL")
STREAM_LABELS = ("backend", "dtype", "policy")


# -- the engine's observer ----------------------------------------------------------------------
class _Pending:
    """Observations of one histogram child not yet added to it: a count per bucket (the last
    one +Inf) and their sum. The hot path adds plain numbers under the recorder's one lock;
    ``flush_into`` hands them to the child's own value holders at scrape time, which leaves
    the child as that many ``observe`` calls would (tests/test_metrics.py)."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int):
        self.counts = [0] * buckets
        self.total = 0.0

    def add(self, i: int, value: float, n: int) -> None:
        self.counts[i] += n
        self.total += value * n

    def flush_into(self, child) -> None:
        """Adds these observations to ``child`` (a holder ``_taken`` from the hot path's)."""
        if not any(self.counts):
            return
        child._sum.inc(self.total)
        for i, n in enumerate(self.counts):
            if n:
                child._buckets[i].inc(n)


@dataclass(slots=True)
class _StreamSeries:
    """The children of one (backend, dtype, policy), bound once so a step does no label lookup,
    and what its steps added since the last scrape (``MetricsRecorder.flush``)."""

    queue: object
    compute: object
    duration: object
    ok: object
    evicted: object
    evictions: object
    moved: object
    written: object
    pending: tuple  # _Pending of queue, compute, duration
    counts: list  # ok steps, evicted tokens, eviction events, bytes written, not yet added


class MetricsRecorder(EngineObserver):
    """Turns the engine's plain stats into ``gqa_*`` metrics; reads its state at scrape time."""

    def __init__(self, registry: CollectorRegistry):
        # First in the registry, so every collect (a scrape, ``get_sample_value``) flushes the
        # pending observations before the families below are read.
        registry.register(FlushOnCollect(self.flush))
        self._step_families(registry)
        self._stream_families(registry)
        self._cache_families(registry)
        self._batch_families(registry)
        info = Gauge(
            "gqa_build_info", "Always 1; the version of gqa-serve in a label.", ("version",), registry=registry
        )
        info.labels(__version__).set(1)
        for reason in OPEN_REFUSAL_REASONS:
            self.open_refusals.labels(reason)
        self._series: dict[tuple[str, str, str], _StreamSeries] = {}
        self._series_lock = threading.Lock()
        # (backend, dtype) -> (bound child, its pending observations): a message's counts do
        # no label lookup
        self._batch_children: dict[tuple[str, str], tuple[object, _Pending]] = {}
        self._message_children: dict[tuple[str, str], tuple[object, _Pending]] = {}
        # The hot path's observations wait in plain numbers under this one lock (a step paid
        # eight locked increments before) until a scrape flushes them into the families.
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # scrapes may run at once
        self._engine: Engine | None = None
        registry.register(_EngineStateCollector(self))

    def _step_families(self, r: CollectorRegistry) -> None:
        """A decode step's times and outcomes."""
        stream = STREAM_LABELS
        self.step_queue = Histogram(
            "gqa_step_queue_seconds",
            "Time a decode step waited between its arrival at the server and the start of its compute.",
            stream,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_compute = Histogram(
            "gqa_step_compute_seconds",
            "Time a decode step spent computing: cache append, eviction and attention.",
            stream,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "gqa_step_duration_seconds",
            "Server-side latency of a decode step that succeeded: queue wait plus compute.",
            stream,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter(
            "gqa_steps_total",
            "Decode steps on streams by outcome: ok, or the lower-case status code it was refused with.",
            stream + ("outcome",),
            registry=r,
        )

    def _stream_families(self, r: CollectorRegistry) -> None:
        """Streams opened, refused and closed."""
        stream = STREAM_LABELS
        self.opened = Counter("gqa_streams_opened_total", "Streams opened.", stream, registry=r)
        self.open_refusals = Counter(
            "gqa_stream_open_refusals_total",
            "Stream opens the engine refused, by reason: budget (cache bytes), streams (stream limit), "
            "draining (shutting down), backend (cannot serve it), invalid (bad prefill), memory (allocation).",
            ("reason",),
            registry=r,
        )
        self.lifetime = Histogram(
            "gqa_stream_lifetime_seconds",
            "Time from a stream's open to its close, by why it closed (client, forced, idle, shutdown).",
            stream + ("reason",),
            buckets=LIFETIME_BUCKETS,
            registry=r,
        )

    def _cache_families(self, r: CollectorRegistry) -> None:
        """What steps did to the caches: tokens evicted, bytes moved and written."""
        stream = STREAM_LABELS
        self.evicted = Counter(
            "gqa_evicted_tokens_total",
            "Tokens that stopped being resident in a cache because of eviction.",
            stream,
            registry=r,
        )
        self.evictions = Counter(
            "gqa_eviction_events_total", "Decode steps that evicted at least one token.", stream, registry=r
        )
        self.moved = Counter(
            "gqa_cache_moved_bytes_total",
            "Bytes copied inside caches to evict (0 for ring layouts): the cost that separates strict from greedy.",
            stream,
            registry=r,
        )
        self.written = Counter(
            "gqa_cache_written_bytes_total", "Bytes stored into caches for new tokens.", stream, registry=r
        )

    def _batch_families(self, r: CollectorRegistry) -> None:
        """How many steps a batched computation took, how many sequences a Batch message held."""
        self.batch_size = Histogram(
            "gqa_batch_size",
            "Steps computed together in one batched computation (one kernel call).",
            ("backend", "dtype"),
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_message_sequences = Histogram(
            "gqa_batch_message_sequences",
            "Sequences in one Batch RPC step message that was answered.",
            ("backend", "dtype"),
            buckets=BATCH_BUCKETS,
            registry=r,
        )

    def bind(self, engine: Engine) -> None:
        """The engine whose state the scrape-time gauges read."""
        self._engine = engine

    def _bound(self, labels: tuple[str, str, str]) -> _StreamSeries:
        series = self._series.get(labels)
        if series is None:
            with self._series_lock:
                series = self._series.get(labels)
                if series is None:
                    for code in STEP_REFUSAL_CODES:
                        self.steps.labels(*labels, code.lower())
                    # Present (at zero) from the first stream, so rate() works from the start.
                    self.batch_size.labels(*labels[:2])
                    self.batch_message_sequences.labels(*labels[:2])
                    queue = self.step_queue.labels(*labels)
                    buckets = len(queue._upper_bounds)
                    series = _StreamSeries(
                        queue=queue,
                        compute=self.step_compute.labels(*labels),
                        duration=self.step_duration.labels(*labels),
                        ok=self.steps.labels(*labels, "ok"),
                        evicted=self.evicted.labels(*labels),
                        evictions=self.evictions.labels(*labels),
                        moved=self.moved.labels(*labels),
                        written=self.written.labels(*labels),
                        pending=(_Pending(buckets), _Pending(buckets), _Pending(buckets)),
                        counts=[0, 0, 0, 0],
                    )
                    self._series[labels] = series
        return series

    def seen_labels(self) -> list[tuple[str, str, str]]:
        with self._series_lock:
            return list(self._series)

    # -- EngineObserver ---------------------------------------------------------------------
    def stream_opened(self, stream: Stream) -> None:
        self._bound(stream.labels)
        self.opened.labels(*stream.labels).inc()

    def stream_closed(self, stream: Stream, reason: str) -> None:
        now = self._engine.clock() if self._engine is not None else time.monotonic()
        self.lifetime.labels(*stream.labels, reason).observe(max(0.0, now - stream.opened_at))

    def open_refused(self, reason: str) -> None:
        self.open_refusals.labels(reason).inc()

    def steps_done(
        self,
        labels: tuple[str, str, str],
        n: int,
        queue_seconds: float,
        compute_seconds: float,
        evicted_tokens: int,
        evictions: int,
        bytes_written: int,
    ) -> None:
        """``n`` steps of one message (and label set) at once: three bucket searches and a
        few additions under one lock, whatever ``n`` is; a scrape adds them to the families."""
        s = self._series.get(labels) or self._bound(labels)
        bounds = s.queue._upper_bounds  # the three latency histograms' (+Inf last)
        duration = queue_seconds + compute_seconds
        iq, ic, idur = (
            bisect_left(bounds, queue_seconds),
            bisect_left(bounds, compute_seconds),
            bisect_left(bounds, duration),
        )
        queue, compute, total = s.pending
        with self._pending_lock:
            queue.add(iq, queue_seconds, n)
            compute.add(ic, compute_seconds, n)
            total.add(idur, duration, n)
            counts = s.counts
            counts[0] += n
            if evicted_tokens:
                counts[1] += evicted_tokens
                counts[2] += evictions
            if bytes_written:
                counts[3] += bytes_written

    def steps_refused(self, labels: tuple[str, str, str], code: str, n: int = 1) -> None:
        self._bound(labels)
        self.steps.labels(*labels, code.lower()).inc(n)

    def batch_done(self, backend: str, dtype: str, size: int) -> None:
        self._observe_batch(self._batch_children, self.batch_size, backend, dtype, size)

    def batch_message(self, backend: str, dtype: str, sequences: int) -> None:
        self._observe_batch(self._message_children, self.batch_message_sequences, backend, dtype, sequences)

    def _observe_batch(self, children: dict, family, backend: str, dtype: str, value: int) -> None:
        """One observation of ``value`` by the (backend, dtype) child of ``family``, pending."""
        entry = children.get((backend, dtype))
        if entry is None:
            child = family.labels(backend, dtype)
            entry = children.setdefault((backend, dtype), (child, _Pending(len(child._upper_bounds))))
        child, pending = entry
        i = bisect_left(child._upper_bounds, value)
        with self._pending_lock:
            pending.add(i, value, 1)

    # -- scrape time ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Adds every pending observation to its family; a collect of the registry does it first."""
        with self._flush_lock:
            with self._series_lock:
                series = list(self._series.values())
            batches = [*self._batch_children.values(), *self._message_children.values()]
            with self._pending_lock:  # take them: the hot path goes on into fresh holders
                taken = []
                for s in series:
                    counts = s.counts
                    if any(counts):
                        s.counts = [0, 0, 0, 0]
                    taken.append((s, counts, [_taken(p) for p in s.pending]))
                batch_taken = [(child, _taken(p)) for child, p in batches]
            for s, counts, (queue, compute, duration) in taken:
                queue.flush_into(s.queue)
                compute.flush_into(s.compute)
                duration.flush_into(s.duration)
                for child, n in zip((s.ok, s.evicted, s.evictions, s.written), counts):
                    if n:
                        child.inc(n)
            for child, pending in batch_taken:
                pending.flush_into(child)


def _taken(pending: _Pending) -> _Pending:
    """``pending``'s numbers moved into a new holder (call under the pending lock)."""
    taken = _Pending(0)
    taken.counts, taken.total = pending.counts, pending.total
    pending.counts, pending.total = [0] * len(taken.counts), 0.0
    return taken


def _cuda_memory() -> list[tuple[str, int, int]]:
    """(device, allocated, reserved) bytes per CUDA device, or nothing while CUDA is not in use.

    Reads torch only if something else imported it and initialised CUDA (the cuda backend):
    a scrape must never be what imports torch or creates a CUDA context.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        if not torch.cuda.is_initialized():
            return []
        return [
            (str(i), torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
            for i in range(torch.cuda.device_count())
        ]
    except Exception:  # a scrape must not fail because a device went away
        return []


class _EngineStateCollector:
    """Gauges read from the engine when Prometheus scrapes, not kept up to date by hand."""

    def __init__(self, recorder: MetricsRecorder):
        self._recorder = recorder

    @staticmethod
    def _families() -> tuple:
        return (
            GaugeMetricFamily("gqa_active_streams", "Streams open now.", labels=STREAM_LABELS),
            GaugeMetricFamily(
                "gqa_cache_reserved_bytes",
                "Cache bytes reserved by open streams (each reserves its full capacity at open).",
            ),
            GaugeMetricFamily("gqa_cache_in_use_bytes", "Cache bytes holding resident tokens now."),
            GaugeMetricFamily(
                "gqa_cache_budget_bytes", "The server's cache budget (--max-cache-bytes); opens past it are refused."
            ),
            GaugeMetricFamily("gqa_streams_limit", "Streams the server holds at most (--max-streams)."),
            GaugeMetricFamily("gqa_steps_waiting", "Steps accepted and waiting for a compute worker."),
            GaugeMetricFamily("gqa_steps_in_flight", "Steps being computed now."),
            CounterMetricFamily(
                "gqa_compute_busy_seconds",
                "Seconds the compute workers spent computing, summed over workers; "
                "rate() / gqa_compute_workers is their busy fraction.",
            ),
            GaugeMetricFamily("gqa_compute_workers", "Compute workers (threads that run steps)."),
            GaugeMetricFamily("gqa_batch_sequences_open", "Sequences open in Batch sessions."),
        )

    @staticmethod
    def _cuda_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "gqa_cuda_memory_allocated_bytes",
                "CUDA memory held by tensors (torch.cuda.memory_allocated), per device.",
                labels=("device",),
            ),
            GaugeMetricFamily(
                "gqa_cuda_memory_reserved_bytes",
                "CUDA memory held by torch's caching allocator (torch.cuda.memory_reserved), "
                "per device: what the process takes from the GPU.",
                labels=("device",),
            ),
        )

    def describe(self) -> Iterable:
        return self._families()

    def collect(self) -> Iterable:
        engine = self._recorder._engine
        if engine is None:
            return []
        active, reserved, in_use, budget, limit, waiting, in_flight, busy, workers, batch_open = self._families()
        counts = dict.fromkeys(self._recorder.seen_labels(), 0)  # gone to 0, not gone
        for stream in engine.streams():
            counts[stream.labels] = counts.get(stream.labels, 0) + 1
        for labels, n in sorted(counts.items()):
            active.add_metric(list(labels), n)
        reserved.add_metric([], engine.bytes_reserved)
        in_use.add_metric([], engine.bytes_in_use())
        budget.add_metric([], engine.config.max_cache_bytes)
        limit.add_metric([], engine.config.max_streams)
        waiting.add_metric([], engine.steps_waiting)
        in_flight.add_metric([], engine.steps_in_flight)
        busy.add_metric([], engine.compute_busy_seconds)
        workers.add_metric([], engine.compute_workers)
        batch_open.add_metric([], engine.batch_sequences_open)
        families = [active, reserved, in_use, budget, limit, waiting, in_flight, busy, workers, batch_open]
        devices = _cuda_memory()
        if devices:
            allocated, held = self._cuda_families()
            for device, alloc, res in devices:
                allocated.add_metric([device], alloc)
                held.add_metric([device], res)
            families += [allocated, held]
        return families


class ObserverFanOut(EngineObserver):
    """Passes each stat to several observers in turn (the recorder and, say, a test's)."""

    def __init__(self, *observers: EngineObserver):
        self.observers = observers

    def stream_opened(self, stream):
        for o in self.observers:
            o.stream_opened(stream)

    def stream_closed(self, stream, reason):
        for o in self.observers:
            o.stream_closed(stream, reason)

    def open_refused(self, reason):
        for o in self.observers:
            o.open_refused(reason)

    def steps_done(self, labels, n, queue_seconds, compute_seconds, evicted_tokens, evictions, bytes_written):
        for o in self.observers:
            o.steps_done(labels, n, queue_seconds, compute_seconds, evicted_tokens, evictions, bytes_written)

    def steps_refused(self, labels, code, n=1):
        for o in self.observers:
            o.steps_refused(labels, code, n)

    def batch_done(self, backend, dtype, size):
        for o in self.observers:
            o.batch_done(backend, dtype, size)

    def batch_message(self, backend, dtype, sequences):
        for o in self.observers:
            o.batch_message(backend, dtype, sequences)


class ServiceMetrics:
    """A server's metrics: the registry, the engine's recorder, the gRPC interceptor, /metrics."""

    def __init__(self) -> None:
        # The *_created series double every counter's series for a value no dashboard reads;
        # go-grpc-prometheus has none. (Process-wide in prometheus_client.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.recorder = MetricsRecorder(self.registry)
        self.interceptor = GrpcServerMetrics(self.registry)
        self.http: MetricsHttpServer | None = None

    def bind(self, engine: Engine) -> None:
        self.recorder.bind(engine)

    def start_http(self, host: str, port: int, routes: dict | None = None) -> MetricsHttpServer:
        """/metrics on ``host:port``, with ``routes`` (``listener.Route``) beside it."""
        self.http = serve_http(self.registry, host, port, routes=routes)
        return self.http

    def stop_http(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's value (0 when absent), for tests and the benchmark."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
