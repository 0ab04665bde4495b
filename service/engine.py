"""The stream engine: opens streams, admits them against the budget, steps, closes, reaps.

No gRPC here: the servicer translates protobuf to the calls below and ``ServiceError`` codes
back to statuses, and the engine is tested without a server. Stats go to one observer
(``service.metrics`` turns them into Prometheus updates), so nothing here imports
``prometheus_client`` either.

Threading: ``open``/``close``/``reap_idle`` take the engine lock; a stream's steps are issued
one at a time by its own handler, so a ``Stream`` needs no lock of its own. Steps of different
streams run concurrently on the compute pool (torch releases the GIL).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends import registry
from backends.base import CacheSpec, LayerCache, StepOutcome
from backends.errors import BackendUnavailable, CacheFullError, RollbackError
from backends.policy import EvictionPolicy, PolicyError

from .config import ServerConfig, load_snapshot_key
from .errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

__all__ = [
    "Engine",
    "Stream",
    "StreamConfig",
    "StepReport",
    "EngineObserver",
    "DTYPES",
]

log = logging.getLogger("gqa.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StreamConfig:
    backend: str
    dtype: str
    batch_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    policy: EvictionPolicy

    def spec(self, device: str) -> CacheSpec:
        return CacheSpec(
            batch_size=self.batch_size,
            num_query_heads=self.num_query_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=DTYPES[self.dtype],
            policy=self.policy,
            device=device,
        )


@dataclass(frozen=True)
class StepReport:
    """What the servicer sends back for one step, and what the metrics record."""

    outcome: StepOutcome
    compute_ns: int
    rollback_reach: int


class EngineObserver:
    """Receives plain stats; the default does nothing. ``service.metrics`` implements it."""

    def stream_opened(self, stream: "Stream") -> None: ...

    def stream_closed(self, stream: "Stream", reason: str) -> None: ...

    def open_refused(self, reason: str) -> None: ...

    def step_done(self, stream: "Stream", report: StepReport, queue_seconds: float) -> None: ...

    def step_refused(self, stream: "Stream", code: str) -> None: ...

    def batch_done(self, backend: str, dtype: str, size: int) -> None:
        """One batched computation of ``size`` steps (of one kernel) finished."""

    def batch_message(self, backend: str, dtype: str, sequences: int) -> None:
        """A ``Batch`` RPC step message for ``sequences`` sequences was answered."""


@dataclass(eq=False)
class Stream:
    """One open stream: its configuration, one cache per layer, its reservation."""

    id: str
    config: StreamConfig
    caches: list[LayerCache]
    bytes_reserved: int
    opened_at: float
    last_active: float
    closed: bool = False
    close_reason: str | None = None
    # Set by whoever closes a stream out from under its handler (idle reaper, drain), so the
    # handler can end the RPC with the right status.
    on_forced_close: Callable[[ServiceError], None] | None = field(default=None, repr=False)

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.config.backend, self.config.dtype, self.config.policy.kind.value

    def bytes_in_use(self) -> int:
        return sum(c.resident_length * c.row_bytes for c in self.caches)

    def _layer(self, layer: int) -> LayerCache:
        if not 0 <= layer < len(self.caches):
            raise InvalidArgument(f"layer: {layer} is out of range; the stream has num_layers={len(self.caches)}")
        return self.caches[layer]

    def step(self, layer: int, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor) -> StepReport:
        """One decode step on one layer; ``ServiceError`` on refusal, cache unchanged."""
        if self.closed:
            raise Unavailable(f"stream {self.id} is closed ({self.close_reason})")
        cache = self._layer(layer)
        t0 = time.perf_counter_ns()
        try:
            outcome = cache.step(query, new_key, new_value)
        except CacheFullError as exc:
            raise ResourceExhausted(str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(str(exc)) from None
        except ServiceError:
            raise
        except Exception:
            log.exception("stream %s: step on layer %d failed", self.id, layer)
            raise Internal() from None
        compute_ns = time.perf_counter_ns() - t0
        return StepReport(outcome, compute_ns, cache.policy.rollback_reach(outcome.tokens_seen))

    def step_cost_bytes(self, layer: int) -> int:
        """Cache bytes the next step on ``layer`` will read (to pick inline or pooled compute)."""
        if not 0 <= layer < len(self.caches):
            return 0
        cache = self.caches[layer]
        attended = sum(len(r) for r in cache.policy.attended(cache.tokens_seen + 1))
        return attended * cache.row_bytes

    def rollback(self, count: int, layer: int | None) -> None:
        """Drops the last ``count`` tokens of one layer or all; all-or-nothing."""
        targets = self.caches if layer is None else [self._layer(layer)]
        for cache in targets:
            reach = cache.policy.rollback_reach(cache.tokens_seen)
            if count > reach:
                where = "" if layer is None else f" of layer {layer}"
                raise FailedPrecondition(
                    f"rollback: dropping {count} tokens{where} is not exact at T={cache.tokens_seen}; "
                    f"at most {reach} can be rolled back exactly"
                )
        for cache in targets:
            try:
                cache.rollback(count)
            except RollbackError as exc:  # checked above; kept as a guard
                raise FailedPrecondition(str(exc)) from None

    def touch(self, now: float) -> None:
        self.last_active = now


class Engine:
    """All open streams of one server, with their admission and limits."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.monotonic,
                 observer: EngineObserver | None = None):
        self.config = config
        self.clock = clock
        self.observer = observer or EngineObserver()
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._reserved = 0
        self._ids = itertools.count(1)
        self.draining = False
        # Signs and checks snapshots (service.snapshot); None: snapshots carry a CRC only.
        self.snapshot_key: bytes | None = load_snapshot_key(config)
        # Kept by service.batch_rpc on the event loop: sequences open in Batch sessions.
        self.batch_sequences = 0

    # -- views ----------------------------------------------------------------------------
    @property
    def active_streams(self) -> int:
        return len(self._streams)

    # Saturation, read at scrape time by ``service.metrics``; the batcher keeps them.
    @property
    def steps_waiting(self) -> int:
        """Steps accepted and waiting for a compute worker."""
        return 0

    @property
    def steps_in_flight(self) -> int:
        """Steps being computed right now."""
        return 0

    @property
    def compute_busy_seconds(self) -> float:
        """Seconds the compute workers have spent computing, summed over workers, since start."""
        return 0.0

    @property
    def compute_workers(self) -> int:
        return self.config.compute_workers

    @property
    def batch_sequences_open(self) -> int:
        """Sequences open in ``Batch`` sessions."""
        return self.batch_sequences

    @property
    def bytes_reserved(self) -> int:
        return self._reserved

    def bytes_in_use(self) -> int:
        with self._lock:
            streams = list(self._streams.values())
        return sum(s.bytes_in_use() for s in streams)

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    # -- configuration ----------------------------------------------------------------------
    def stream_config(self, *, backend: str, dtype: str, batch_size: int, num_query_heads: int,
                      num_kv_heads: int, head_dim: int, num_layers: int, policy: str,
                      window: int, capacity: int, sink_tokens: int) -> StreamConfig:
        """Validates an open request against the limits; ``InvalidArgument`` names the field."""
        c = self.config
        backend = backend or c.backend
        dtype = dtype or c.dtype
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        for name, value, limit in (
            ("batch_size", batch_size, c.max_batch_size),
            ("num_query_heads", num_query_heads, c.max_heads),
            ("num_kv_heads", num_kv_heads, c.max_heads),
            ("head_dim", head_dim, c.max_head_dim),
            ("num_layers", num_layers, c.max_layers),
        ):
            if value <= 0:
                raise InvalidArgument(f"{name}: must be positive, got {value}")
            if value > limit:
                raise InvalidArgument(f"{name}: {value} exceeds the server's limit of {limit}")
        if num_query_heads % num_kv_heads:
            raise InvalidArgument(
                f"num_query_heads ({num_query_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        try:
            pol = EvictionPolicy.create(policy, window=window, capacity=capacity, sinks=sink_tokens)
        except PolicyError as exc:
            raise InvalidArgument(f"policy: {exc}") from None
        if pol.capacity > c.max_capacity:
            raise InvalidArgument(f"capacity: {pol.capacity} rows exceed the server's limit of {c.max_capacity}")
        return StreamConfig(backend, dtype, batch_size, num_query_heads, num_kv_heads, head_dim, num_layers, pol)

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self, config: StreamConfig,
             prefill: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
             restore: list[tuple[int, dict]] | None = None) -> Stream:
        """Admits, allocates and prefills (or restores) a stream; on failure nothing stays reserved.

        ``restore`` holds, per layer, ``(tokens_seen, state)`` as ``LayerCache.export_state``
        returns it (a snapshot).
        """
        prefill = prefill or {}
        if restore is not None and len(restore) != config.num_layers:
            self.observer.open_refused("invalid")
            raise InvalidArgument(f"restore: the snapshot has {len(restore)} layers, its configuration {config.num_layers}")
        try:
            backend = registry.get_backend(config.backend)
            spec = config.spec(backend.default_device)
            backend.check(spec)
        except BackendUnavailable as exc:
            self.observer.open_refused("backend")
            raise FailedPrecondition(f"backend {config.backend!r} cannot serve this stream: {exc}") from None
        for layer in prefill:
            if not 0 <= layer < config.num_layers:
                self.observer.open_refused("invalid")
                raise InvalidArgument(f"prefill.layer: {layer} is out of range; num_layers={config.num_layers}")
        need = backend.cache_nbytes(spec) * config.num_layers
        with self._lock:
            if self.draining:
                self.observer.open_refused("draining")
                raise Unavailable("the server is shutting down; open the stream on another replica")
            if len(self._streams) >= self.config.max_streams:
                self.observer.open_refused("streams")
                raise ResourceExhausted(f"the server holds its limit of {self.config.max_streams} streams")
            if self._reserved + need > self.config.max_cache_bytes:
                self.observer.open_refused("budget")
                raise ResourceExhausted(
                    f"the stream needs {need} cache bytes but only "
                    f"{self.config.max_cache_bytes - self._reserved} of the server's {self.config.max_cache_bytes} are free"
                )
            self._reserved += need
            stream_id = f"s{next(self._ids)}"
        try:
            caches = [backend.create_cache(spec) for _ in range(config.num_layers)]
            for layer, (keys, values) in prefill.items():
                try:
                    caches[layer].prefill(keys, values)
                except CacheFullError as exc:
                    raise InvalidArgument(f"prefill.layer {layer}: {exc}") from None
                except (TypeError, ValueError) as exc:
                    raise InvalidArgument(f"prefill.layer {layer}: {exc}") from None
            for layer, (tokens_seen, state) in enumerate(restore or []):
                try:
                    caches[layer].load_state(tokens_seen, state)
                except (TypeError, ValueError, KeyError) as exc:
                    raise InvalidArgument(f"restore: layer {layer}: {exc}") from None
        except BaseException as exc:
            with self._lock:
                self._reserved -= need
            if isinstance(exc, ServiceError):
                self.observer.open_refused("invalid")
                raise
            if isinstance(exc, MemoryError):
                self.observer.open_refused("memory")
                raise ResourceExhausted("the server could not allocate the stream's caches") from None
            log.exception("opening a stream failed")
            raise Internal("opening the stream failed") from None
        now = self.clock()
        stream = Stream(stream_id, config, caches, need, now, now)
        with self._lock:
            self._streams[stream_id] = stream
        self.observer.stream_opened(stream)
        return stream

    def close(self, stream: Stream, reason: str = "closed") -> bool:
        """Frees a stream's caches and reservation; idempotent."""
        with self._lock:
            if stream.closed or self._streams.pop(stream.id, None) is None:
                return False
            stream.closed = True
            stream.close_reason = reason
            self._reserved -= stream.bytes_reserved
        stream.caches = []
        self.observer.stream_closed(stream, reason)
        return True

    def reap_idle(self) -> list[Stream]:
        """Closes every stream silent for longer than the idle timeout; returns them."""
        deadline = self.clock() - self.config.idle_timeout_s
        with self._lock:
            idle = [s for s in self._streams.values() if s.last_active < deadline]
        reaped = []
        for stream in idle:
            if self.close(stream, "idle"):
                reaped.append(stream)
                if stream.on_forced_close is not None:
                    stream.on_forced_close(DeadlineExceeded(
                        f"stream idle for more than {self.config.idle_timeout_s:g} s; its caches were freed"
                    ))
        return reaped

    def start_draining(self) -> None:
        with self._lock:
            self.draining = True

    def close_all(self, error: ServiceError, reason: str) -> int:
        """Ends every stream (shutdown); their handlers get ``error``."""
        closed = 0
        for stream in self.streams():
            if self.close(stream, reason):
                closed += 1
                if stream.on_forced_close is not None:
                    stream.on_forced_close(error)
        return closed
