"""The step batcher: ready steps of many streams computed together, answered together.

Steps are submitted from the event loop and wait in one queue. A compute worker that is free
takes every queued step it may (at most one per stream, each stream's in the order submitted,
none of a stream whose previous step is still computing), runs them with ONE
``backends.batch.step_many`` call, and hands every result back to the event loop at once (one
``call_soon_threadsafe`` per loop and batch). By default nothing waits for batch-mates: a free
worker takes whatever is queued, so a lone stream pays only the thread hop. With
``max_delay_s`` the oldest queued step may be held that long for others to join (unless the
batch is already ``max_steps`` long). Steps of every backend, dtype and head shape share the
queue: ``step_many`` groups same-encoding caches into one native call (``backends/batch.py``).

A step read from the wire (``PendingStep.raw``: its tensors as spans of the request's bytes)
goes to ``backends.batch_bytes.step_bytes`` with its batch-mates: one native call, no tensor
made, and the caller's ``reply.encode`` builds the reply from the row of numbers and the
output's bytes. Any other step's message bytes become read-only tensors (``torch.frombuffer``,
no copy; the cache copies the token in) for ``step_many``; its outcome becomes a ``StepReport``
or a ``ServiceError`` and the caller's ``reply`` function runs on it. Either way the reply
message is built off the event loop.

No gRPC here. The batcher keeps the saturation views the metrics read (``waiting``,
``in_flight``, ``busy_seconds``; README, "Metrics, dashboard and alerts") and calls
``observer.batch_done`` once per kernel group.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from backends import batch as batch_module
from backends import batch_bytes
from backends.base import LayerCache
from backends.contract import StepOutcome

from ..errors import Internal, InvalidArgument, ServiceError, Unavailable
from .report import EngineObserver, StepReport, classify_step_error

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Stream

__all__ = ["Batcher", "PendingStep", "PendingJob", "classify_step_error"]

log = logging.getLogger("gqa.batcher")


@dataclass(eq=False, slots=True)
class PendingStep:
    """One submitted step. ``query``/``new_key``/``new_value`` are tensors or the raw
    little-endian bytes of tensors of ``shapes`` in the cache's dtype (checked by the caller).
    Or ``raw``: (data, q_at, k_at, v_at), the three as spans of one buffer (a request's bytes,
    ``backends.batch_bytes.ByteStep``), with a ``reply`` that has ``encode(fields, compute_ns,
    output)`` (the numbers ``batch_bytes`` gives, the output's bytes): no tensor is made."""

    stream: "Stream"
    layer: int
    cache: LayerCache
    query: Any
    new_key: Any
    new_value: Any
    received: float
    future: asyncio.Future
    reply: Callable[["StepReport | ServiceError", float], Any] | None = None
    result: Any = field(default=None)
    raw: tuple | None = None


@dataclass(eq=False, slots=True)
class PendingJob:
    """A step message computed as one unit (a ``Batch`` session's: one ``CacheSet.step_buffers``).
    ``run(started)`` is called on a compute worker with the ``time.perf_counter`` at which its
    computation starts and returns the answer (it never raises: its errors are its answer);
    ``owner`` orders an owner's jobs like a stream's steps (one computing at a time)."""

    owner: object
    run: Callable[[float], Any]
    received: float
    future: asyncio.Future
    result: Any = field(default=None)

    @property
    def stream(self) -> object:  # the batcher's ordering key
        return self.owner


def _tensor(data: Any, dtype: torch.dtype, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """A step's tensor from its bytes (or as given), on the cache's device."""
    t = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=dtype).view(shape)
    return t if device == "cpu" else t.to(device)


class Batcher:
    """Compute workers over one queue of steps; see the module docstring."""

    def __init__(
        self,
        workers: int,
        *,
        observer: "EngineObserver",
        max_delay_s: float = 0.0,
        max_steps: int = 0,
        name: str = "gqa-compute",
    ):
        self.workers = max(1, workers)
        self.observer = observer
        self.max_delay_s = max_delay_s
        self.max_steps = max_steps
        # the hot paths take the lock itself (a C context manager); waits and wake-ups go
        # through the condition over it
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[PendingStep] = deque()
        self._running: set[int] = set()  # id() of streams with a step computing
        self._in_flight = 0
        self._busy_ns = 0
        self._stopped = False
        self._name = name
        self._threads: list[threading.Thread] = []  # started with the first queued step
        # the event loop's batch (``run_soon``): its steps, their cost, its loop
        self._soon: list[PendingStep] = []
        self._soon_cost = 0
        self._soon_loop: asyncio.AbstractEventLoop | None = None

    # -- saturation views (read by the metrics) ---------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def busy_seconds(self) -> float:
        return self._busy_ns * 1e-9

    # -- submitting ---------------------------------------------------------------------------
    def submit(self, step: "PendingStep | PendingJob") -> None:
        with self._cond:
            if self._stopped:
                raise Unavailable("the server is shutting down")
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                    for i in range(self.workers)
                ]
                for t in self._threads:
                    t.start()
            self._queue.append(step)
            self._cond.notify()

    def run_inline(self, step: "PendingStep | PendingJob") -> bool:
        """Computes ``step`` on the calling thread if no step is queued or computing (then a
        thread hop would cost more than a small step); False, and nothing done, otherwise."""
        if not self._claim_alone(id(step.stream)):
            return False
        self._run([step], "an inline step")
        return True

    def compute_here(self, stream: "Stream", layer: int, cache: LayerCache, raw: tuple, reply, received: float):
        """A lone stream's step read from the wire (``PendingStep.raw``, ``reply`` with its
        ``encode``) computed on the calling thread now, as ``run_inline`` would, with no
        ``PendingStep``, future or batch around it: its answer, or None (nothing done) when a
        step is queued or computing, or after ``stop``."""
        key = id(stream)
        if not self._claim_alone(key):
            return None
        t0 = time.perf_counter_ns()
        try:
            done = batch_bytes.step_bytes([batch_bytes.ByteStep(cache, *raw)])
            compute_ns = time.perf_counter_ns() - t0
            answer = self._span_answer(
                done, 0, stream, layer, cache, reply, received, t0 * 1e-9, compute_ns, done.output
            )
            if answer.__class__ is not _Refused:
                self.observer.batch_done(stream.config.backend, stream.config.dtype, 1)
                return answer
            return answer.reply
        except BaseException:
            log.exception("an inline step failed as a whole")
            return self._reply_to(reply, Internal(), 0.0)
        finally:
            self._release((key,), time.perf_counter_ns() - t0)

    def _claim_alone(self, key: int) -> bool:
        """Takes the batcher for one step of stream ``key`` on the calling thread: True (the
        step counted in flight, its stream running) when nothing is queued or computing and
        ``stop`` has not come; release with ``_release``."""
        with self._lock:
            if self._queue or self._in_flight or self._stopped:
                return False
            self._in_flight = 1
            self._running.add(key)
        return True

    def _release(self, keys, elapsed_ns: int) -> None:
        """The end of a computation of one step of each stream in ``keys`` (their ``id``s) that
        took ``elapsed_ns``: no longer in flight or running; wakes a worker if steps are queued."""
        with self._lock:
            self._in_flight -= len(keys)
            self._busy_ns += elapsed_ns
            for key in keys:
                self._running.discard(key)
            if self._queue:
                self._cond.notify()

    def run_message_inline(self, job: "PendingJob") -> bool:
        """Computes the message ``job`` on the calling thread (the event loop) beside whatever
        the workers compute, unless its session has a message queued or computing, or after
        ``stop``: False, and nothing done, then."""
        key = id(job.stream)
        with self._lock:
            if self._stopped or key in self._busy_streams():
                return False
            self._in_flight += 1
            self._running.add(key)
        self._run([job], "an inline message")
        return True

    def run_soon(self, step: PendingStep, cost: int, limit: int) -> bool:
        """Call on the event loop of ``step.future``. Adds ``step`` to that loop's batch, which
        the loop computes at its next turn in one call, with no thread hop (``_run_batch``):
        True. False, and nothing done, when the batch's ``cost`` (the steps' cache bytes read)
        would pass ``limit``, or the batch belongs to another loop."""
        loop = step.future.get_loop()
        if self._soon:
            if self._soon_loop is not loop or self._soon_cost + cost > limit:
                return False
        else:
            self._soon_loop = loop
            loop.call_soon(self._run_batch)
        self._soon.append(step)
        self._soon_cost += cost
        return True

    def _run_batch(self) -> None:
        """The loop's batch (``run_soon``), computed here; any step of a stream with a step
        queued or computing elsewhere, or after ``stop``, goes through ``submit`` instead."""
        steps, self._soon, self._soon_cost = self._soon, [], 0
        with self._lock:
            elsewhere = self._busy_streams()
            clear = not self._stopped and not any(id(s.stream) in elsewhere for s in steps)
            if clear:
                self._in_flight += len(steps)
                self._running.update(id(s.stream) for s in steps)
        if not clear:
            for step in steps:
                try:
                    self.submit(step)
                except ServiceError as exc:
                    step.result = self._reply(step, exc, 0.0)
                    _resolve([step])
            return
        self._run(steps, "a batch on the event loop")
        _resolve(steps)

    def _busy_streams(self) -> set[int]:
        """Under the lock: id() of every stream (or session) with a step queued or computing."""
        return self._running | {id(s.stream) for s in self._queue}

    def stop(self, join_timeout_s: float | None = None) -> bool:
        """Workers finish the batch they compute and the queued steps, then exit; with
        ``join_timeout_s``, waits up to that long for them. True when none is left running.

        The server joins them before the interpreter finalizes: a daemon thread still freeing a
        tensor then is ended by CPython through a C++ frame that may not unwind, which aborts the
        whole process ("terminate called without an active exception") instead of exiting 0."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            threads = list(self._threads)
        if join_timeout_s is None:
            return not any(t.is_alive() for t in threads)
        deadline = time.monotonic() + join_timeout_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    # -- the workers ----------------------------------------------------------------------------
    def _take(self) -> list[PendingStep] | None:
        """Under the lock: the next batch, waiting for work (and the delay) as needed."""
        while True:
            if self._stopped and not self._queue:
                return None
            taken: list = []
            seen: set[int] = set()
            limit = self.max_steps or len(self._queue)
            for step in self._queue:
                key = id(step.stream)
                if key in seen or key in self._running:
                    seen.add(key)
                    continue
                seen.add(key)
                if step.__class__ is PendingJob:  # a message of its own: computed alone
                    if taken:
                        continue
                    taken.append(step)
                    break
                taken.append(step)
                if len(taken) >= limit:
                    break
            if not taken:
                self._cond.wait()
                continue
            if (
                taken[0].__class__ is not PendingJob
                and self.max_delay_s > 0
                and not self._stopped
                and (not self.max_steps or len(taken) < self.max_steps)
            ):
                left = taken[0].received + self.max_delay_s - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
            chosen = set(map(id, taken))
            self._queue = deque(s for s in self._queue if id(s) not in chosen)
            for step in taken:
                self._running.add(id(step.stream))
            self._in_flight += len(taken)
            return taken

    def _work(self) -> None:
        while True:
            with self._cond:
                steps = self._take()
            if steps is None:
                return
            self._run(steps, "a batch")
            self._hand_back(steps)

    def _run(self, steps: list, what: str) -> None:
        """Computes ``steps`` (counted in flight, their streams marked running) on this thread,
        then releases them and wakes a worker if steps are queued. A failure of the whole batch
        answers every step not yet answered INTERNAL: no worker is lost, no step unanswered."""
        t0 = time.perf_counter_ns()
        try:
            self._compute(steps, t0)
        except BaseException:
            log.exception("%s failed as a whole", what)
            for step in steps:
                if step.result is None:
                    step.result = self._reply(step, Internal(), 0.0)
        finally:
            self._release([id(step.stream) for step in steps], time.perf_counter_ns() - t0)

    def _compute(self, steps: list, t0: int) -> None:
        started = t0 * 1e-9
        if steps[0].__class__ is PendingJob:
            job = steps[0]
            job.result = job.run(started)
            return
        spans: list[PendingStep] = []
        tensors: list[PendingStep] = []
        for step in steps:
            if step.stream.closed:
                error = Unavailable(f"stream {step.stream.id} is closed ({step.stream.close_reason})")
                step.result = self._reply(step, error, max(0.0, started - step.received))
            elif step.raw is not None:
                spans.append(step)
            else:
                tensors.append(step)
        groups: dict[tuple[str, str], int] = {}
        if spans:
            self._compute_spans(spans, t0, groups)
        if tensors:
            self._compute_tensors(tensors, t0, groups)
        for (backend, dtype), size in groups.items():
            self.observer.batch_done(backend, dtype, size)

    def _compute_spans(self, steps: list[PendingStep], t0: int, groups: dict) -> None:
        """Steps read from the wire: one ``batch_bytes.step_bytes`` call, each reply encoded
        from its row of numbers and its output's bytes."""
        done = batch_bytes.step_bytes([batch_bytes.ByteStep(s.cache, *s.raw) for s in steps])
        compute_ns = time.perf_counter_ns() - t0
        started = t0 * 1e-9
        offsets, output, n = done.offsets, done.output, len(steps)
        for i, step in enumerate(steps):
            end = offsets[i + 1] if i + 1 < n else len(output)
            answer = self._span_answer(
                done, i, step.stream, step.layer, step.cache, step.reply, step.received, started, compute_ns,
                output[offsets[i] : end],
            )  # fmt: skip
            if answer.__class__ is _Refused:
                step.result = answer.reply
                continue
            step.result = answer
            key = (step.stream.config.backend, step.stream.config.dtype)
            groups[key] = groups.get(key, 0) + 1

    def _span_answer(
        self, done, i: int, stream: "Stream", layer: int, cache: LayerCache, reply, received: float,
        started: float, compute_ns: int, output,
    ):  # fmt: skip
        """Row ``i`` of ``step_bytes``' ``done``: its reply (or the exception building it
        raised), counted on the observer; a ``_Refused`` around the refusal's reply when the
        kernel refused the step (nothing written)."""
        queue_seconds = max(0.0, started - received)
        exc = done.refused.get(i)
        if exc is not None:
            error = classify_step_error(exc, f"stream {stream.id}: step on layer {layer}")
            self.observer.steps_refused(stream.labels, error.code)
            return _Refused(self._reply_to(reply, error, queue_seconds))
        fields = done.fields[i]
        evicted = fields[4]
        self.observer.steps_done(
            stream.labels, 1, queue_seconds, compute_ns * 1e-9, evicted, 1 if evicted else 0, cache.row_bytes
        )
        try:
            return reply.encode(fields, compute_ns, output)
        except Exception as exc:  # building the reply failed: the step still gets an answer
            log.exception("building a step reply failed")
            return exc

    def _compute_tensors(self, steps: list[PendingStep], t0: int, groups: dict) -> None:
        """Steps given as tensors (or bytes of whole tensors): one ``step_many`` call."""
        started = t0 * 1e-9
        live: list[PendingStep] = []
        batch: list[batch_module.BatchStep] = []
        for step in steps:
            spec = step.cache.spec
            b, hq, hkv, d = spec.batch_size, spec.num_query_heads, spec.num_kv_heads, spec.head_dim
            try:
                batch.append(
                    batch_module.BatchStep(
                        step.cache,
                        _tensor(step.query, spec.dtype, (b, hq, d), spec.device),
                        _tensor(step.new_key, spec.dtype, (b, hkv, d), spec.device),
                        _tensor(step.new_value, spec.dtype, (b, hkv, d), spec.device),
                    )
                )
            except (TypeError, ValueError, RuntimeError) as exc:
                step.result = self._reply(step, InvalidArgument(f"step: {exc}"), max(0.0, started - step.received))
                continue
            live.append(step)
        if not live:
            return
        outcomes = batch_module.step_many(batch)
        compute_ns = time.perf_counter_ns() - t0
        compute_s = compute_ns * 1e-9
        for step, outcome in zip(live, outcomes):
            queue_seconds = max(0.0, started - step.received)
            stream = step.stream
            if isinstance(outcome, StepOutcome):
                report = StepReport(outcome, compute_ns, step.cache.policy.rollback_reach(outcome.tokens_seen))
                evicted = outcome.evicted_tokens
                self.observer.steps_done(
                    stream.labels, 1, queue_seconds, compute_s, evicted, 1 if evicted else 0, outcome.bytes_written
                )
                step.result = self._reply(step, report, queue_seconds)
                key = (stream.config.backend, stream.config.dtype)
                groups[key] = groups.get(key, 0) + 1
            else:
                error = classify_step_error(outcome, f"stream {stream.id}: step on layer {step.layer}")
                self.observer.steps_refused(stream.labels, error.code)
                step.result = self._reply(step, error, queue_seconds)

    @staticmethod
    def _reply(step, value, queue_seconds: float):
        if step.__class__ is PendingJob:  # failed as a whole before its run answered
            return value
        return Batcher._reply_to(step.reply, value, queue_seconds)

    @staticmethod
    def _reply_to(reply, value, queue_seconds: float):
        """``reply(value, queue_seconds)`` (``value`` itself without ``reply``), or the exception
        building it raised: the step still gets an answer."""
        if reply is None:
            return value
        try:
            return reply(value, queue_seconds)
        except Exception as exc:
            log.exception("building a step reply failed")
            return exc

    @staticmethod
    def _hand_back(steps: list) -> None:
        """One hand-back per event loop for the whole batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[PendingStep]] = {}
        for step in steps:
            by_loop.setdefault(step.future.get_loop(), []).append(step)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, group)
            except RuntimeError:  # the loop is closed: nobody waits for these answers
                pass


class _Refused:
    """A step the kernel refused (``Batcher._span_answer``): its reply, told apart from a
    computed step's (only those count in a batch's size)."""

    __slots__ = ("reply",)

    def __init__(self, reply):
        self.reply = reply


def _resolve(steps: list[PendingStep]) -> None:
    for step in steps:
        if not step.future.done():
            step.future.set_result(step.result)
