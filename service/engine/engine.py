"""The stream engine: opens streams, admits them against the budget, steps, closes, reaps.

No gRPC here: the transport translates protobuf to the calls below and ``ServiceError`` codes
back to statuses (``service.transport.statuses``), and the engine is tested without a server. Stats go to one observer
(``service.metrics`` turns them into Prometheus updates), so nothing here imports
``prometheus_client`` either.

Admission and allocation are separate: ``admit`` checks the limits and reserves the bytes
and the stream slot at once, under the engine lock, on the caller's thread (cheap: integers
only); ``build`` allocates, zero-fills and prefills or restores, on a worker thread (its cost
is proportional to the stream's size, so it never runs on the event loop). An admission
abandoned while it builds (its RPC was cancelled) is released at once by ``abandon``; the
build then drops what it allocated instead of registering the stream. ``active_streams``
counts admissions being built, so ``max_streams`` holds against concurrent opens.

Steps go through the batcher (``service.engine.batcher``): ``submit_step`` queues one and returns an
asyncio future; a compute worker runs the steps of many streams in one ``step_many`` call. A step
read from the wire goes to ``step_raw``, which answers a lone stream's step at once on the calling
thread and places any other as ``submit_step`` does (``service.engine.placement``).
The stream record itself (configuration, caches, step, rollback) is ``service.engine.stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from backends import registry
from backends.errors import BackendUnavailable

from ..config import ServerConfig, load_snapshot_key
from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from ..vocab import TORCH_DTYPES
from .batcher import Batcher, PendingJob, PendingStep
from .placement import HERE, QUEUED, Placement
from .plane import SequenceSet, SetShape
from .report import EngineObserver, StepReport
from .stream import Activity, Admission, Stream, StreamConfig, build_caches, validate_config

__all__ = [
    "Engine",
    "Stream",
    "StreamConfig",
    "StepReport",
    "EngineObserver",
    "Admission",
    "Activity",
    "SequenceSet",
    "SetShape",
]

log = logging.getLogger("gqa.engine")


class Engine:
    """All open streams of one server, with their admission and limits."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: EngineObserver | None = None,
    ):
        self.config = config
        self.clock = clock
        self.observer = observer or EngineObserver()
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._admitting = 0  # admissions counted and reserved, still being built
        self._reserved = 0
        self._ids = itertools.count(1)
        self.draining = False
        # Signs and checks snapshots (service.engine.snapshot); None: snapshots carry a CRC only.
        self.snapshot_key: bytes | None = load_snapshot_key(config)
        # Kept by service.transport.batch_session on the event loop: sequences open in Batch sessions.
        self.batch_sequences = 0
        # Request bytes the stream sessions hold read ahead, all streams together.
        self.read_ahead_bytes = 0
        self._closed_all: ServiceError | None = None  # set by close_all: no stream opens after it
        # Where opens are built (``build_async``); the server sets its pool, None: asyncio's default.
        self.pool = None
        self.batcher = Batcher(
            config.compute_workers,
            observer=self.observer,
            max_delay_s=config.batch_max_delay_us * 1e-6,
            max_steps=config.batch_max_steps,
        )
        self.placement = Placement(config, self.batcher)

    # -- views ----------------------------------------------------------------------------
    @property
    def active_streams(self) -> int:
        """Open streams, and streams admitted and still being allocated."""
        return len(self._streams) + self._admitting

    # Saturation, read at scrape time by ``service.metrics``; the batcher keeps them.
    @property
    def steps_waiting(self) -> int:
        """Steps accepted and waiting for a compute worker."""
        return self.batcher.waiting

    @property
    def steps_in_flight(self) -> int:
        """Steps being computed right now."""
        return self.batcher.in_flight

    @property
    def compute_busy_seconds(self) -> float:
        """Seconds the compute workers have spent computing, summed over workers, since start."""
        return self.batcher.busy_seconds

    @property
    def compute_workers(self) -> int:
        return self.batcher.workers

    @property
    def batch_sequences_open(self) -> int:
        """Sequences open in ``Batch`` sessions."""
        return self.batch_sequences

    @property
    def bytes_reserved(self) -> int:
        return self._reserved

    @property
    def closed(self) -> bool:
        """True once ``close_all`` has run (shutdown): every later open is refused."""
        return self._closed_all is not None

    @contextlib.contextmanager
    def counting_open_refusals(self):
        """Around a request's validation before it reaches ``admit``: a ``ServiceError`` raised
        inside is counted as an open refusal (reason ``invalid``) and re-raised, so opens refused
        by the translation layer (Decode and Batch alike) count like those the engine refuses."""
        try:
            yield
        except ServiceError:
            self.observer.open_refused("invalid")
            raise

    def bytes_in_use(self) -> int:
        with self._lock:
            streams = list(self._streams.values())
        return sum(s.bytes_in_use() for s in streams)

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    # -- configuration ----------------------------------------------------------------------
    def stream_config(self, **fields) -> StreamConfig:
        """Validates an open request's fields (``service.engine.stream.validate_config``'s keywords)
        against this server's limits; ``InvalidArgument`` names the field."""
        return validate_config(self.config, **fields)

    # -- lifecycle ----------------------------------------------------------------------------
    def admit(self, config: StreamConfig, *, restore_layers: int | None = None) -> Admission:
        """Checks the backend and the limits, and reserves the stream's bytes and slot at once.

        Cheap (integer arithmetic), so it runs on the event loop; nothing is allocated. Refusals
        are counted by the observer with their reason.
        """
        if restore_layers is not None and restore_layers != config.num_layers:
            self.observer.open_refused("invalid")
            raise InvalidArgument(
                f"restore: the snapshot has {restore_layers} layers, its configuration {config.num_layers}"
            )
        try:
            backend = registry.get_backend(config.backend)
            spec = config.spec(backend.default_device)
            backend.check(spec)
        except BackendUnavailable as exc:
            self.observer.open_refused("backend")
            raise FailedPrecondition(f"backend {config.backend!r} cannot serve this stream: {exc}") from None
        need = backend.cache_nbytes(spec) * config.num_layers
        with self._lock:
            if self.draining:
                self.observer.open_refused("draining")
                raise Unavailable("the server is shutting down; open the stream on another replica")
            if len(self._streams) + self._admitting >= self.config.max_streams:
                self.observer.open_refused("streams")
                raise ResourceExhausted(f"the server holds its limit of {self.config.max_streams} streams")
            if self._reserved + need > self.config.max_cache_bytes:
                self.observer.open_refused("budget")
                raise ResourceExhausted(
                    f"the stream needs {need} cache bytes but only "
                    f"{self.config.max_cache_bytes - self._reserved} of the server's {self.config.max_cache_bytes} are free"
                )
            self._reserved += need
            self._admitting += 1
            stream_id = f"s{next(self._ids)}"
        return Admission(stream_id, config, need, backend, spec)

    def abandon(self, admission: Admission) -> None:
        """Releases an admission whose RPC ended: at once, whether or not it is still being
        built (a build that finishes later drops its caches). Idempotent."""
        with self._lock:
            stream = admission.stream
            if stream is None and not admission.released:
                admission.released = True
                self._reserved -= admission.need
                self._admitting -= 1
        if stream is not None:
            self.close(stream, "cancelled")

    def build(
        self,
        admission: Admission,
        prefill: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        restore: list[tuple[int, dict]] | None = None,
    ) -> Stream:
        """Allocates and prefills (or restores) an admitted stream and registers it.

        Runs on a worker thread: allocation and zero-fill cost time proportional to the stream.
        On failure, or when the admission was abandoned meanwhile, nothing stays reserved.
        ``restore`` holds, per layer, ``(tokens_seen, state)`` as ``LayerCache.export_state``
        returns it (a snapshot).
        """
        config = admission.config
        try:
            if admission.released:
                raise Unavailable("the open was cancelled")
            caches = build_caches(admission, prefill or {}, restore)
        except BaseException as exc:
            with self._lock:
                if not admission.released:
                    admission.released = True
                    self._reserved -= admission.need
                    self._admitting -= 1
            if isinstance(exc, Unavailable):
                raise
            if isinstance(exc, ServiceError):
                self.observer.open_refused("invalid")
                raise
            if isinstance(exc, MemoryError):
                self.observer.open_refused("memory")
                raise ResourceExhausted("the server could not allocate the stream's caches") from None
            log.exception("opening a stream failed")
            raise Internal("opening the stream failed") from None
        now = self.clock()
        stream = Stream(admission.id, config, caches, admission.need, now, Activity(now))
        with self._lock:
            late = self._closed_all  # shutdown ended every stream while this one was built
            if admission.released:  # abandoned while it was being built; already released
                abandoned = True
            elif late is not None:
                abandoned = True
                admission.released = True
                self._reserved -= admission.need
                self._admitting -= 1
            else:
                abandoned = False
                self._admitting -= 1
                self._streams[stream.id] = stream
                admission.stream = stream
        if abandoned:
            raise late if late is not None else Unavailable("the open was cancelled")
        self.observer.stream_opened(stream)
        return stream

    def open(
        self,
        config: StreamConfig,
        prefill: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        restore: list[tuple[int, dict]] | None = None,
    ) -> Stream:
        """``admit`` then ``build``, on the calling thread (tests and in-process use)."""
        admission = self.admit(config, restore_layers=None if restore is None else len(restore))
        return self.build(admission, prefill, restore)

    # -- Batch sessions ----------------------------------------------------------------------------
    def session_shape(
        self, *, backend: str, dtype: str, num_query_heads: int, num_kv_heads: int, head_dim: int, num_layers: int
    ) -> SetShape:
        """Validates a Batch session's shared fields by the same rules as a stream's (limits:
        ``InvalidArgument``; a backend that cannot serve it: ``FailedPrecondition``; draining:
        ``Unavailable``); every refusal is counted as an open refusal with its reason."""
        try:
            probe = self.stream_config(
                backend=backend,
                dtype=dtype,
                batch_size=1,
                num_query_heads=num_query_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                num_layers=num_layers,
                policy="strict",  # a placeholder: each sequence brings its own
                window=1,
                capacity=0,
                sink_tokens=0,
            )
        except ServiceError:
            self.observer.open_refused("invalid")
            raise
        try:
            impl = registry.get_backend(probe.backend)
            spec = probe.spec(impl.default_device)
            impl.check(spec)
        except BackendUnavailable as exc:
            self.observer.open_refused("backend")
            raise FailedPrecondition(f"backend {probe.backend!r} cannot serve this session: {exc}") from None
        if self.draining:
            self.observer.open_refused("draining")
            raise Unavailable("the server is shutting down; open the session on another replica")
        return SetShape(
            probe.backend,
            probe.dtype,
            probe.num_query_heads,
            probe.num_kv_heads,
            probe.head_dim,
            probe.num_layers,
            TORCH_DTYPES[probe.dtype],
            str(spec.device),
        )

    def sequence_set(self, shape: SetShape) -> SequenceSet:
        """An empty data plane for one Batch session (``service.engine.plane``)."""
        return SequenceSet(shape, self.observer, Activity(self.clock()))

    def touch_set(self, sequences: SequenceSet) -> None:
        """A Batch session's request: every one of its sequences is active now."""
        sequences.activity.last_active = self.clock()

    def submit_message(self, sequences: SequenceSet, plan, *, received: float, reply, out=None) -> "asyncio.Future":
        """Queues a planned Batch step message (``SequenceSet.plan``) on the compute workers,
        with the Decode streams' steps; call on the event loop. Returns a future of
        ``reply(StepResult, queue_seconds)`` computed on the worker (or of the ``ServiceError``
        that refused the whole message); ``out`` (or None) is where the rows go
        (``SequenceSet.run``): the reply's own bytes. Where it computes is
        ``Placement.message``'s choice: a message of a session whose previous one was fast, or
        of a session stepping alone, may run right here."""
        future = asyncio.get_running_loop().create_future()

        def run(started: float):
            result = sequences.run(plan, started, received, out)
            try:
                return reply(result, max(0.0, started - received))
            except Exception as exc:
                log.exception("building a step reply failed")
                return Internal() if not isinstance(exc, ServiceError) else exc

        job = PendingJob(sequences, run, received, future)
        if self.placement.message(job):
            future.set_result(job.result)
        return future

    # -- stateless steps, backend descriptions ------------------------------------------------
    @staticmethod
    def describe_backends() -> list:
        """Every backend's capabilities or reasons (``backends.registry.describe``); slow the
        first time (it imports optional modules): call it off the event loop."""
        return registry.describe()

    async def offload(self, cost_bytes: int, fn, *args):
        """``fn(*args)``: right here when ``cost_bytes`` is under ``--inline-step-bytes`` (a
        thread hop costs more), else on the compute pool (``self.pool``), off the event loop."""
        if cost_bytes < self.config.inline_step_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def build_async(self, admission: Admission, prefill=None, layers_of=None) -> Stream:
        """``build`` on the compute pool (``self.pool``; allocation and zero-fill cost time in
        proportion to the stream), ``layers_of()`` (a snapshot's decoding) there too. Whatever
        ends the wait (the RPC cancelled included) releases the admission at once."""
        loop = asyncio.get_running_loop()

        def build():
            restore = layers_of() if layers_of is not None else None
            return self.build(admission, prefill, restore)

        try:
            return await loop.run_in_executor(self.pool, build)
        except BaseException:
            self.abandon(admission)
            raise

    # -- steps ------------------------------------------------------------------------------------
    def submit_step(
        self,
        stream: Stream,
        layer: int,
        query,
        new_key,
        new_value,
        *,
        received: float | None = None,
        reply=None,
        queued: Callable[[], None] | None = None,
    ) -> "asyncio.Future":
        """Queues one step for the batcher; call on the event loop. Returns a future of
        ``reply(report_or_error, queue_seconds)`` (or of the ``StepReport``/``ServiceError``
        itself without ``reply``). The tensors may be raw bytes of the stream's step shapes
        (checked by the caller); a step read from the wire as spans of its request goes to
        ``step_raw`` instead. A closed stream or a layer out of range raise at once. ``queued``
        is called when the step goes to the compute workers (not computed on the loop, at once
        or at its next turn): what a caller may overlap with it."""
        cache = _open_layer(stream, layer)
        future = asyncio.get_running_loop().create_future()
        pending = PendingStep(
            stream,
            layer,
            cache,
            query,
            new_key,
            new_value,
            time.perf_counter() if received is None else received,
            future,
            reply,
        )
        where = self.placement.step(pending)
        if where == HERE:
            future.set_result(pending.result)
        elif where == QUEUED and queued is not None:
            queued()
        return future

    def step_raw(
        self,
        stream: Stream,
        layer: int,
        raw: tuple,
        reply,
        *,
        received: float,
        queued: Callable[[], None] | None = None,
    ):
        """A Decode step read from the wire (``raw``: ``PendingStep.raw``'s spans of its
        request, checked by the caller; ``reply`` with its ``encode``, which builds the answer
        from the step's numbers and output bytes); call on the event loop. Its answer when it
        computed at once (a lone stream's step, ``Placement.decide``: no future or
        ``PendingStep`` made), else the future of it, ``queued`` called as ``submit_step``
        calls it. Raises as ``submit_step`` does."""
        cache = _open_layer(stream, layer)
        placement = self.placement
        here, cost = placement.decide(stream, cache, received)
        if here:
            answer = self.batcher.compute_here(stream, layer, cache, raw, reply, received)
            if answer is not None:
                return answer
        future = asyncio.get_running_loop().create_future()
        pending = PendingStep(stream, layer, cache, None, None, None, received, future, reply, raw=raw)
        if placement.elsewhere(pending, cost) == QUEUED and queued is not None:
            queued()
        return future

    def close(self, stream: Stream, reason: str = "closed") -> bool:
        """Frees a stream's caches and reservation; idempotent."""
        with self._lock:
            if stream.closed or self._streams.pop(stream.id, None) is None:
                return False
            stream.closed = True
            stream.close_reason = reason
            self._reserved -= stream.bytes_reserved
        stream.caches = []
        if stream.on_closed is not None:
            stream.on_closed(stream)
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
                    stream.on_forced_close(
                        DeadlineExceeded(
                            f"stream idle for more than {self.config.idle_timeout_s:g} s; its caches were freed"
                        )
                    )
        return reaped

    def stop(self, join_timeout_s: float | None = None) -> bool:
        """Stops the compute workers once the queued steps are answered (waiting up to
        ``join_timeout_s`` for them to exit); True when none is left running."""
        return self.batcher.stop(join_timeout_s)

    def start_draining(self) -> None:
        with self._lock:
            self.draining = True

    def close_all(self, error: ServiceError, reason: str) -> int:
        """Ends every stream (shutdown); their handlers get ``error``, and so do opens still
        being built when they finish."""
        with self._lock:
            self._closed_all = error
        closed = 0
        for stream in self.streams():
            if self.close(stream, reason):
                closed += 1
                if stream.on_forced_close is not None:
                    stream.on_forced_close(error)
        return closed


def _open_layer(stream: Stream, layer: int):
    """The cache a step of ``stream`` on ``layer`` goes to; ``Unavailable`` for a closed stream,
    ``InvalidArgument`` for a layer out of range (``submit_step``, ``step_raw``)."""
    if stream.closed:
        raise Unavailable(f"stream {stream.id} is closed ({stream.close_reason})")
    return stream._layer(layer)
