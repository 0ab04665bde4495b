"""A Batch session's data plane: its sequences' caches in one ``backends.plane.CacheSet``, and a
step message as one index array and one ``CacheSet.step_buffers`` over the request's bytes.

The engine owns it (``Engine.sequence_set``); ``service.transport.batch_session`` only translates protobuf to
the calls below. Each sequence is still an engine ``Stream`` (admission, byte budget,
``max_streams``, snapshots, rollback, the drain and the idle reaper treat it as they treat a
Decode stream); the set adds the slot its caches have in the ``CacheSet``, and shares one
``Activity`` among all of them, so the idle timeout is the session's.

Per step message the Python work does not grow with the sequences beyond numpy over one index
array: ids -> slots by ``searchsorted`` over the sorted ids, duplicates, unknown and closed ids
found vectorized (and only then turned into refusals, one record per refused sequence; a
repeated read-only ids array reuses the slots it was planned to while the set is unchanged),
one ``CacheSet.step_buffers`` from the request's bytes into the caller's buffer (the reply's
own bytes) or else a reused output buffer (no tensor made), the per-sequence fields handed on
as the (n, 6) array the call wrote, the metrics counted per message and policy
(``EngineObserver.steps_done``).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from backends.plane import FIELDS, CacheSet

from ..errors import Internal, InvalidArgument, ServiceError, Unavailable
from .report import EngineObserver, classify_step_error

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Activity, Stream

__all__ = ["SetShape", "SequenceSet", "StepPlan", "StepResult", "NotFound", "FIELDS"]

log = logging.getLogger("gqa.plane")

_NO_REFUSALS: list = []

# Step tensors are views of the request's (immutable) bytes; a step never writes its inputs
# (``LayerCache.step``'s contract, backends/base.py), so torch's warning about a read-only
# buffer does not apply. torch gives it once per process: take it here, silenced, rather than
# in a client's first step.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(4), dtype=torch.float32)


class NotFound(ServiceError):
    """A sequence id the session does not hold (in-band only)."""

    code = "NOT_FOUND"


@dataclass(frozen=True)
class SetShape:
    """What every sequence of a set shares (server defaults filled in)."""

    backend: str
    dtype: str
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    torch_dtype: torch.dtype
    device: str


class StepPlan(NamedTuple):
    """A step message checked on the event loop, ready to compute (``SequenceSet.run``)."""

    layer: int
    ids: np.ndarray  # uint64 (n,), the message's ids
    slots: np.ndarray  # int64 (m,), the live rows' slots
    live: np.ndarray | None  # int64 (m,): the message rows stepped; None when every row is
    refusals: list  # [(row, id, ServiceError)] found before the computation
    query: object  # the rows' bytes: (n, Hq, D), (n, Hkv, D), (n, Hkv, D) in the set's dtype
    new_key: object
    new_value: object


class StepResult(NamedTuple):
    """A step message's answer: ``fields`` int64 (n, 6), ``FIELDS`` per message row (a refused
    row all 0); ``refusals`` ``[(row, id, ServiceError)]`` in row order; ``compute_ns`` the
    batched computation's time; ``output`` (n, Hq, D) contiguous on the CPU (a refused row 0),
    valid until the set's next step, or None when the rows went into the caller's buffer."""

    fields: np.ndarray
    refusals: list
    compute_ns: int
    output: torch.Tensor | None
    # the rows' bytes: the caller's buffer (``run(out=...)``), or ``output``'s memory (the set's
    # output buffer lives in a bytearray, so the reply reads it without a tensor call); None
    # when ``output`` is a copy
    data: memoryview | None = None


class SequenceSet:
    """The sequences of one Batch session. Driven by one handler: ``add``, ``remove``,
    ``plan`` on the event loop, ``run`` on the loop or a compute worker while the handler waits
    for it (``Engine.submit_message`` decides)."""

    def __init__(self, shape: SetShape, observer: EngineObserver, activity: "Activity"):
        self.shape = shape
        self.observer = observer
        self.activity = activity
        self.caches = CacheSet(shape.num_layers)
        self._streams: dict[int, Stream] = {}  # id -> stream
        self._slot: dict[int, int] = {}  # id -> slot
        self._sorted_ids = np.zeros(0, dtype=np.uint64)
        self._sorted_slots = np.zeros(0, dtype=np.int64)
        self._index_stale = False
        self._planned: tuple = (None, None)  # (ids, slots) of the last message planned with no refusal
        self._dead = np.zeros(0, dtype=bool)  # by slot: closed under the session (drain, reaper)
        self._any_dead = False
        # (slot, stream) of closes from other threads, moved into _dead by the owner only, so a
        # close never writes into an array the owner is replacing (deque.append is atomic)
        self._closing: deque = deque()
        self._policy = np.zeros(0, dtype=np.int8)  # by slot: index into _labels
        self._labels: list[tuple[str, str, str]] = []
        self._per_label: list[int] = []  # live sequences per label index
        self._row_bytes = 0
        self._output: torch.Tensor | None = None
        self._output_bytes: bytearray | None = None
        self._output_row = shape.num_query_heads * shape.head_dim * shape.torch_dtype.itemsize
        self._zero_row = bytes(self._output_row)
        self._out_views: dict[int, tuple] = {}  # n -> the output buffer's first n rows (``_rows_out``)
        # nanoseconds the last message's computation took (None before the first): the engine
        # predicts the next message's by it to decide where to run it
        self.last_compute_ns: int | None = None

    # -- membership -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, sid: int) -> bool:
        return sid in self._streams

    def get(self, sid: int) -> "Stream | None":
        return self._streams.get(sid)

    def ids(self) -> list[int]:
        return list(self._streams)

    def add(self, sid: int, stream: "Stream") -> None:
        """Takes an open stream of this set's shape (batch size 1) as sequence ``sid``."""
        slot = self.caches.add(stream.caches)
        self._streams[sid] = stream
        self._slot[sid] = slot
        stream.activity = self.activity
        stream.on_closed = functools.partial(self._closed, slot)
        if slot >= len(self._dead):
            grow = max(16, 2 * len(self._dead))
            self._dead = np.concatenate([self._dead, np.zeros(grow, dtype=bool)])
            self._policy = np.concatenate([self._policy, np.zeros(grow, dtype=np.int8)])
        self._dead[slot] = False
        labels = stream.labels
        if labels not in self._labels:
            self._labels.append(labels)
            self._per_label.append(0)
        code = self._labels.index(labels)
        self._policy[slot] = code
        self._per_label[code] += 1
        if not self._row_bytes and stream.caches:
            self._row_bytes = stream.caches[0].row_bytes
        self._index_stale = True

    def remove(self, sid: int) -> "Stream":
        """Drops sequence ``sid`` from the set (the caller closes its stream)."""
        self._take_closed()
        stream = self._streams.pop(sid)
        slot = self._slot.pop(sid)
        self.caches.remove(slot)
        self._per_label[self._policy[slot]] -= 1
        if self._dead[slot]:
            self._dead[slot] = False
            self._any_dead = bool(self._dead.any())
        stream.on_closed = None
        self._index_stale = True
        return stream

    def _closed(self, slot: int, stream: "Stream") -> None:
        """``Engine.close`` of the set's stream in ``slot`` (the drain, the reaper: any thread).
        Queued for the owner (``_take_closed``), never written into ``_dead`` from here: ``add``
        may be replacing that array meanwhile."""
        self._closing.append((slot, stream))

    def _take_closed(self) -> None:
        """On the owner's thread: the queued closes into ``_dead``, each only while its slot
        still holds the stream that closed (a slot freed and reused meanwhile is not marked)."""
        while self._closing:
            slot, stream = self._closing.popleft()
            sid = next((k for k, v in self._streams.items() if v is stream), None)
            if sid is not None and self._slot.get(sid) == slot:
                self._dead[slot] = True
                self._any_dead = True

    def _reindex(self) -> None:
        ids = np.fromiter(self._slot.keys(), dtype=np.uint64, count=len(self._slot))
        slots = np.fromiter(self._slot.values(), dtype=np.int64, count=len(self._slot))
        order = np.argsort(ids, kind="stable")
        self._sorted_ids, self._sorted_slots = ids[order], slots[order]
        self._index_stale = False
        self._planned = (None, None)  # its slots were found in the old index

    # -- a step message --------------------------------------------------------------------------
    def expect(self, n: int) -> None:
        """A step message of ``n`` rows has arrived: the kernel's workers alerted before its
        checks and plan, when its step will share them (``CacheSet.expect``)."""
        self.caches.expect(n)

    def plan(self, layer: int, ids: np.ndarray, query, new_key, new_value) -> StepPlan:
        """The message's rows as slots, on the event loop. ``ids`` uint64 (n,); the tensors'
        bytes are the caller's, checked against (n, heads, D) in the set's dtype. A layer out of
        range refuses the whole message (``InvalidArgument``); an unknown id (NOT_FOUND), an id
        given twice (INVALID_ARGUMENT, every occurrence) and a sequence closed under the session
        (UNAVAILABLE) are refused alone."""
        s = self.shape
        if layer >= s.num_layers:
            raise InvalidArgument(f"step.layer: {layer} is out of range; the session has num_layers={s.num_layers}")
        if self._closing:
            self._take_closed()
        if ids is self._planned[0] and not self._index_stale and not self._any_dead:
            # the same (read-only) ids array as the last message that planned clean: its slots
            return StepPlan(layer, ids, self._planned[1], None, _NO_REFUSALS, query, new_key, new_value)
        if self._index_stale:
            self._reindex()
        n = len(ids)
        known_ids = self._sorted_ids
        if not len(known_ids):
            bad = np.ones(n, dtype=bool)
            slots = np.zeros(n, dtype=np.int64)
            known = ~bad
        else:
            pos = np.searchsorted(known_ids, ids)
            np.minimum(pos, len(known_ids) - 1, out=pos)
            known = known_ids[pos] == ids
            slots = self._sorted_slots[pos]
            bad = ~known
        dup = None
        if n > 1:
            ordered = np.sort(ids)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if len(repeated):
                dup = np.isin(ids, repeated)
                bad |= dup
        if self._any_dead:
            bad |= known & self._dead[slots]
        if not bad.any():
            if not ids.flags.writeable:  # an array the reader may hand again (``wire.BatchStepLayout``)
                slots.flags.writeable = False
                self._planned = (ids, slots)
            return StepPlan(layer, ids, slots, None, _NO_REFUSALS, query, new_key, new_value)
        refusals = []
        for row in np.flatnonzero(bad).tolist():
            sid = int(ids[row])
            if dup is not None and dup[row]:
                exc: ServiceError = InvalidArgument(f"step.ids: sequence {sid} appears more than once in the message")
            elif not known[row]:
                exc = NotFound(f"step.ids: sequence {sid} is not in the session")
            else:
                stream = self._streams[sid]
                exc = Unavailable(f"step.ids: sequence {sid} was closed ({stream.close_reason})")
            refusals.append((row, sid, exc))
        live = np.flatnonzero(~bad)
        return StepPlan(layer, ids, slots[live], live, refusals, query, new_key, new_value)

    def _output_buffer(self, n: int) -> torch.Tensor:
        """(n, Hq, D) rows the kernel writes into: one buffer the set keeps (the reply copies it
        before the next message), not a fresh tensor per message (page faults, docs/design.md).
        On the CPU its memory is a bytearray the set keeps (``_output_bytes``), so the reply
        takes the bytes as a memoryview slice, with no tensor call per message."""
        s = self.shape
        if self._output is None or self._output.shape[0] < n:
            rows = max(n, 1)
            self._out_views = {}  # views of the buffer replaced here
            if s.device == "cpu":
                row = s.num_query_heads * s.head_dim * s.torch_dtype.itemsize
                self._output_bytes = bytearray(rows * row)
                self._output = torch.frombuffer(self._output_bytes, dtype=s.torch_dtype).view(
                    rows, s.num_query_heads, s.head_dim
                )
            else:
                self._output_bytes = None
                self._output = torch.empty((rows, s.num_query_heads, s.head_dim), dtype=s.torch_dtype, device=s.device)
        return self._output[:n]

    def _output_data(self, n: int) -> memoryview | None:
        """The first ``n`` rows of the output buffer as bytes (None off the CPU)."""
        if self._output_bytes is None:
            return None
        return memoryview(self._output_bytes)[: n * self._output_row]

    def _tensor(self, data, n: int, heads: int) -> torch.Tensor:
        s = self.shape
        if n == 0:
            return torch.empty((0, heads, s.head_dim), dtype=s.torch_dtype)
        t = torch.frombuffer(data, dtype=s.torch_dtype).view(n, heads, s.head_dim)
        return t if s.device == "cpu" else t.to(s.device)

    def _rows_out(self, n: int) -> tuple[torch.Tensor, memoryview | None]:
        """The output buffer's first ``n`` rows as a tensor and (on the CPU) as bytes, kept per n
        (a session's message sizes are few): no tensor call per message."""
        found = self._out_views.get(n)
        if found is None:
            found = (self._output_buffer(n), self._output_data(n))
            if len(self._out_views) < 64:
                self._out_views[n] = found
        return found

    def run(self, plan: StepPlan, started: float, received: float, out=None) -> StepResult:
        """Computes a planned message (on the loop or a compute worker): one ``CacheSet`` step over
        its live rows, read from the request's bytes and written on the CPU into ``out`` (a
        writable buffer of the message's n output rows: the reply's own bytes, so the rows are
        never copied), or without one into the set's output buffer (``CacheSet.step_buffers``).
        Never raises: a failure of the call as a whole refuses every live row (INTERNAL, nothing
        was written)."""
        n = len(plan.ids)
        if out is not None and self.shape.device == "cpu":  # (``step_buffers`` checks its size)
            data, out = (out if out.__class__ is memoryview else memoryview(out)), None  # no tensor made
        else:
            out, data = self._rows_out(n)
        queue_seconds = max(0.0, started - received)
        if plan.live is not None and not len(plan.live):
            _zero(out, data)
            result = StepResult(np.zeros((n, len(FIELDS)), np.int64), plan.refusals, 0, out, data)
            return self._answer(result, 0, queue_seconds)
        if data is None:
            return self._run_tensors(plan, out, queue_seconds)
        live = plan.live
        try:
            batch = self.caches.step_buffers(
                plan.layer, plan.slots, plan.query, plan.new_key, plan.new_value, data, live
            )
        except Exception:  # the call as a whole failed: nothing was written (``backends.plane.CacheSet``)
            return self._failed(plan, out, data, queue_seconds)
        fields, refusals = batch.fields, plan.refusals
        if live is not None or batch.refused:
            refusals = list(refusals)
            for i, exc in batch.refused.items():
                row = int(live[i]) if live is not None else i
                refusals.append(self._refused(plan, i, row, exc))
            if live is not None:
                full = np.zeros((n, len(FIELDS)), np.int64)
                full[live] = fields
                fields = full
            size = self._output_row
            for row, _, _ in refusals:  # the rows not written (a refused row's output is 0)
                data[row * size : (row + 1) * size] = self._zero_row
            refusals.sort(key=_row)
        result = StepResult(fields, refusals, batch.compute_ns, out, data)
        self.last_compute_ns = batch.compute_ns
        return self._answer(
            result, batch.compute_ns, queue_seconds, stepped=len(plan.slots), batch=batch, slots=plan.slots
        )

    def _refused(self, plan: StepPlan, i: int, row: int, exc: Exception) -> tuple:
        """Stepped row ``i`` (message row ``row``) refused by its cache: its refusal, counted."""
        sid = int(plan.ids[row])
        error = classify_step_error(exc, f"sequence {sid}: step on layer {plan.layer}")
        self.observer.steps_refused(self._labels[self._policy[plan.slots[i]]], error.code)
        return (row, sid, error)

    def _failed(self, plan: StepPlan, out, data, queue_seconds: float) -> StepResult:
        """A message whose computation failed as a whole: every live row refused INTERNAL."""
        log.exception("a batched step on layer %d failed", plan.layer)
        n, live = len(plan.ids), plan.live
        rows = live.tolist() if live is not None else range(n)
        failed = [(row, int(plan.ids[row]), Internal()) for row in rows]
        _zero(out, data)
        for j, (_, _, error) in enumerate(failed):
            self.observer.steps_refused(self._labels[self._policy[plan.slots[j]]], error.code)
        refusals = sorted(plan.refusals + failed, key=_row)
        result = StepResult(np.zeros((n, len(FIELDS)), np.int64), refusals, 0, out, data)
        return self._answer(result, 0, queue_seconds)

    def _run_tensors(self, plan: StepPlan, out: torch.Tensor, queue_seconds: float) -> StepResult:
        """``run`` off the CPU: the rows as tensors on the set's device, one ``CacheSet.step``."""
        s = self.shape
        n = len(plan.ids)
        hq, hkv = s.num_query_heads, s.num_kv_heads
        refusals = plan.refusals
        q = self._tensor(plan.query, n, hq)
        k = self._tensor(plan.new_key, n, hkv)
        v = self._tensor(plan.new_value, n, hkv)
        live = plan.live
        if live is not None:
            index = torch.from_numpy(live).to(q.device)
            q, k, v = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
            target = torch.empty((len(live), hq, s.head_dim), dtype=s.torch_dtype, device=s.device)
        else:
            target = out
        try:
            batch = self.caches.step(plan.layer, plan.slots, q, k, v, target)
        except Exception:  # the call as a whole failed: nothing was written (``backends.plane.CacheSet.step``)
            return self._failed(plan, out, None, queue_seconds)
        fields = batch.fields
        if batch.refused:
            refusals = list(refusals)
            for i, exc in batch.refused.items():
                refusals.append(self._refused(plan, i, int(live[i]) if live is not None else i, exc))
                target[i].zero_()
        if live is not None:
            full = np.zeros((n, len(FIELDS)), np.int64)
            full[live] = fields
            fields = full
            out.zero_()
            out[torch.from_numpy(live).to(out.device)] = target
            refusals.sort(key=_row)
        elif batch.refused:
            refusals.sort(key=_row)
        result = StepResult(fields, refusals, batch.compute_ns, out.cpu(), None)
        self.last_compute_ns = batch.compute_ns
        return self._answer(
            result, batch.compute_ns, queue_seconds, stepped=len(plan.slots), batch=batch, slots=plan.slots
        )

    def _answer(self, result, compute_ns, queue_seconds, *, stepped=0, batch=None, slots=None) -> StepResult:
        """Counts the message: once, and its steps once per policy label (``slots``: the slots of
        ``batch``'s rows)."""
        s = self.shape
        observer = self.observer
        if stepped:
            observer.batch_done(s.backend, s.dtype, stepped)
            refused = batch.refused
            ok = stepped - len(refused)
            if ok:
                evicted = batch.fields[:, 4]
                compute_s = compute_ns * 1e-9
                if len(self._labels) == 1:  # one policy in the session (the usual case)
                    evicted_tokens = int(evicted.sum())
                    observer.steps_done(
                        self._labels[0],
                        ok,
                        queue_seconds,
                        compute_s,
                        evicted_tokens,
                        int(np.count_nonzero(evicted)) if evicted_tokens else 0,
                        ok * self._row_bytes,
                    )
                else:  # sequences of several policies: one call per policy
                    codes = self._policy[slots]
                    mask = np.ones(stepped, dtype=bool)
                    if refused:
                        mask[list(refused)] = False
                    for code in np.unique(codes[mask]).tolist():
                        sel = mask & (codes == code)
                        count = int(sel.sum())
                        observer.steps_done(
                            self._labels[code],
                            count,
                            queue_seconds,
                            compute_s,
                            int(evicted[sel].sum()),
                            int(np.count_nonzero(evicted[sel])),
                            count * self._row_bytes,
                        )
        observer.batch_message(s.backend, s.dtype, len(result.fields))
        return result


def _row(refusal) -> int:
    return refusal[0]


def _zero(tensor: torch.Tensor | None, data: memoryview | None) -> None:
    """Every output row 0: the tensor, or without one the bytes."""
    if tensor is not None:
        tensor.zero_()
    else:
        data[:] = bytes(data.nbytes)
