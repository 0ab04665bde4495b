"""What a stream is: its configuration (validated against the server's limits), its caches, its
reservation, its step and rollback (``Stream``), from its admission on (``Admission``: counted,
not yet built).

The engine (``service.engine.engine``) creates, admits and closes them; a stream's steps are submitted
one at a time by its own handler, so a ``Stream`` needs no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends.base import LayerCache
from backends.contract import CacheSpec
from backends.errors import CacheFullError, RollbackError
from backends.policy import EvictionPolicy, PolicyError

from ..config import ServerConfig
from ..errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from ..vocab import TORCH_DTYPES
from .report import StepReport, classify_step_error

__all__ = ["StreamConfig", "Activity", "Stream", "Admission", "validate_config", "build_caches"]


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
            dtype=TORCH_DTYPES[self.dtype],
            policy=self.policy,
            device=device,
        )


class Activity:
    """When a stream, or a whole Batch session, was last active (``Engine.clock`` seconds): one
    per Decode stream, one shared by every sequence of a Batch session, so a session's request
    keeps all its sequences alive at the cost of one assignment."""

    __slots__ = ("last_active",)

    def __init__(self, now: float):
        self.last_active = now


@dataclass(eq=False)
class Stream:
    """One open stream: its configuration, one cache per layer, its reservation."""

    id: str
    config: StreamConfig
    caches: list[LayerCache]
    bytes_reserved: int
    opened_at: float
    activity: Activity
    closed: bool = False
    close_reason: str | None = None
    # Set by whoever closes a stream out from under its handler (idle reaper, drain), so the
    # handler can end the RPC with the right status.
    on_forced_close: Callable[[ServiceError], None] | None = field(default=None, repr=False)
    # Called by ``Engine.close`` (any thread, after the stream is marked closed): a Batch
    # session's data plane marks the sequence's slot dead, so its steps are refused.
    on_closed: Callable[["Stream"], None] | None = field(default=None, repr=False)

    @property
    def last_active(self) -> float:
        return self.activity.last_active

    @last_active.setter
    def last_active(self, now: float) -> None:
        self.activity.last_active = now

    def __post_init__(self) -> None:
        # (backend, dtype, policy): the metrics' labels of every step, made once
        self.labels: tuple[str, str, str] = (self.config.backend, self.config.dtype, self.config.policy.kind.value)
        # the most cache bytes one step of this stream can read (a full layer and its new row):
        # under a placement bound, no step's own cost needs computing (Placement.decide)
        self.step_bytes_bound: int = max(((c.spec.capacity + 1) * c.row_bytes for c in self.caches), default=0)

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
        except Exception as exc:
            raise classify_step_error(exc, f"stream {self.id}: step on layer {layer}") from None
        compute_ns = time.perf_counter_ns() - t0
        return StepReport(outcome, compute_ns, cache.policy.rollback_reach(outcome.tokens_seen))

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
        self.activity.last_active = now


@dataclass(eq=False)
class Admission:
    """A stream admitted and counted but not yet built: its id, slot and reserved bytes."""

    id: str
    config: StreamConfig
    need: int
    backend: object = field(repr=False)
    spec: CacheSpec = field(repr=False)
    stream: Stream | None = None
    released: bool = False


def validate_config(
    c: ServerConfig,
    *,
    backend: str,
    dtype: str,
    batch_size: int,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int,
    policy: str,
    window: int,
    capacity: int,
    sink_tokens: int,
) -> StreamConfig:
    """An open request's fields checked against the server's limits ``c`` (its defaults filled
    in for an empty backend or dtype); ``InvalidArgument`` names the field."""
    backend = backend or c.backend
    dtype = dtype or c.dtype
    if dtype not in TORCH_DTYPES:
        raise InvalidArgument(f"dtype: {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
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


def build_caches(admission: Admission, prefill: dict, restore: list | None) -> list[LayerCache]:
    """An admitted stream's caches, one per layer, allocated and prefilled (``prefill``: layer ->
    (keys, values)) or restored (``restore``: per layer ``(tokens_seen, state)`` as
    ``LayerCache.export_state`` returns it); ``InvalidArgument`` for input they cannot take."""
    config, backend, spec = admission.config, admission.backend, admission.spec
    for layer in prefill:
        if not 0 <= layer < config.num_layers:
            raise InvalidArgument(f"prefill.layer: {layer} is out of range; num_layers={config.num_layers}")
    if restore is not None and len(restore) != config.num_layers:
        raise InvalidArgument(f"restore: the snapshot has {len(restore)} layers, its configuration {config.num_layers}")
    caches = [backend.create_cache(spec) for _ in range(config.num_layers)]
    for layer, (keys, values) in prefill.items():
        try:
            caches[layer].prefill(keys, values)
        except (CacheFullError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"prefill.layer {layer}: {exc}") from None
    for layer, (tokens_seen, state) in enumerate(restore or []):
        try:
            caches[layer].load_state(tokens_seen, state)
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidArgument(f"restore: layer {layer}: {exc}") from None
    return caches
