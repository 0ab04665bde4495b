"""The ``Batch`` stream: many sequences per message, one batched computation per step message.

A session shares backend, dtype, heads, head width and layer count; each of its sequences is
an engine ``Stream`` of batch size 1, so admission, the byte budget, ``max_streams``, the idle
reaper and the drain apply to it exactly as to a ``Decode`` stream. A step message becomes one
``backends.batch.step_many`` call over ``[seq.caches[layer] for seq in ids]`` on the compute
pool, each step reading its rows of the packed tensors as views over the bytes the protobuf
runtime hands over (no copy of our own, per message or per row). Refusals are per sequence and
in-band; only a broken protocol, a refused ``open``, the idle timeout and shutdown end the RPC.

Translation only, like the servicer: the compute is the backend's, the bookkeeping the
engine's, snapshots ``service.snapshot``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch

from backends import registry
from backends.batch import BatchStep, step_many
from backends.errors import BackendUnavailable, CacheFullError, InvalidInput

from . import snapshot, wire
from .api import gqa_pb2
from .config import ServerConfig
from .engine import Engine, StepReport, Stream, StreamConfig
from .errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from .security import malformed_request
from .tensors import from_proto
from .vocab import DTYPE_NAMES, DTYPE_TO_TORCH, NAME_TO_DTYPE, POLICY_ENUMS, POLICY_NAMES, TORCH_TO_DTYPE
from .wire import varint

__all__ = ["serve", "SessionConfig", "NotFound"]

log = logging.getLogger("gqa.batch")

_OK = gqa_pb2.Status(code=0)
# BatchStepResult's per-sequence fields, in the order the step loop collects them.
_ROW_FIELDS = ("tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach")
_NO_ROW = (0,) * len(_ROW_FIELDS)  # a refused sequence's entries

# Step tensors are views of the request's (immutable) bytes; step_many never writes its inputs
# (Contract 1), so torch's warning about a read-only buffer does not apply. torch gives it once
# per process: take it here, silenced, rather than in a client's first step.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(4), dtype=torch.float32)


class NotFound(ServiceError):
    """A sequence id the session does not hold (in-band only)."""

    code = "NOT_FOUND"


def _status(exc: ServiceError) -> gqa_pb2.Status:
    return gqa_pb2.Status(code=exc.code_number, message=exc.message)


def _refusal(index: int, sid: int, exc: ServiceError) -> gqa_pb2.SequenceRefusal:
    return gqa_pb2.SequenceRefusal(index=index, id=sid, status=_status(exc))


@dataclass(frozen=True)
class SessionConfig:
    """What every sequence of a session shares (server defaults filled in)."""

    backend: str
    dtype: str
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_TO_TORCH[NAME_TO_DTYPE[self.dtype]]


def session_config(engine: Engine, request: gqa_pb2.BatchOpen) -> SessionConfig:
    """Validates ``open``: limits (InvalidArgument), backend (FailedPrecondition), drain."""
    if request.dtype and request.dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"open.dtype: {request.dtype} is not a known DType")
    # The shared fields are checked by the engine's own rules, with a placeholder policy.
    probe = engine.stream_config(
        backend=request.backend,
        dtype=DTYPE_NAMES.get(request.dtype, ""),
        batch_size=1,
        num_query_heads=request.num_query_heads,
        num_kv_heads=request.num_kv_heads,
        head_dim=request.head_dim,
        num_layers=request.num_layers,
        policy="strict",
        window=1,
        capacity=0,
        sink_tokens=0,
    )
    try:
        backend = registry.get_backend(probe.backend)
        backend.check(probe.spec(backend.default_device))
    except BackendUnavailable as exc:
        raise FailedPrecondition(f"backend {probe.backend!r} cannot serve this session: {exc}") from None
    if engine.draining:
        raise Unavailable("the server is shutting down; open the session on another replica")
    return SessionConfig(
        probe.backend, probe.dtype, probe.num_query_heads, probe.num_kv_heads, probe.head_dim, probe.num_layers
    )


def _packed(message: gqa_pb2.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A read-only view of a packed step tensor's bytes, checked against the expected shape."""
    if message.dtype not in DTYPE_TO_TORCH or DTYPE_TO_TORCH[message.dtype] != dtype:
        raise InvalidArgument(f"step.{name}.dtype: {message.dtype}, but the session's dtype is {str(dtype)[6:]}")
    if tuple(message.shape) != shape:
        raise InvalidArgument(f"step.{name}.shape: expected {list(shape)} (N, heads, D), got {list(message.shape)}")
    need = math.prod(shape) * dtype.itemsize
    data = message.data  # the runtime hands over a fresh bytes object per access: take it once
    if len(data) != need:
        raise InvalidArgument(f"step.{name}.data: {len(data)} bytes, but shape {list(shape)} needs {need}")
    if need == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)


# Wire tags (field number << 3 | wire type 2, length-delimited) of the fields the step reply
# encodes itself; tests/test_batch_rpc.py checks the bytes parse to the message built by upb.
_TAG_TENSOR_SHAPE = b"\x12"  # Tensor.shape = 2 (packed)
_TAG_TENSOR_DATA = b"\x1a"  # Tensor.data = 3
_TAG_RESULT_OUTPUT = b"\x1a"  # BatchStepResult.output = 3
_TAG_RESPONSE_STEP = b"\x22"  # BatchResponse.step = 4


def step_reply_bytes(rid: int, result: gqa_pb2.BatchStepResult, output: torch.Tensor) -> bytes:
    """``BatchResponse(request_id=rid, step=result)`` with ``result.output`` set to ``output``
    (a contiguous CPU tensor), serialized: ``result`` (its output unset) by the protobuf
    runtime, the output field written here after it, the tensor's bytes copied once, straight
    from its memory into the reply (protobuf parsers take fields in any order)."""
    data = output.view(torch.uint8).reshape(-1).numpy() if output.numel() else b""
    shape = b"".join(varint(x) for x in output.shape)
    tensor_head = (
        b"\x08"  # Tensor.dtype = 1 (varint)
        + varint(TORCH_TO_DTYPE[output.dtype])
        + _TAG_TENSOR_SHAPE
        + varint(len(shape))
        + shape
        + (_TAG_TENSOR_DATA + varint(len(data)) if len(data) else b"")  # proto3 omits empty bytes
    )
    tensor_len = len(tensor_head) + len(data)
    rest = result.SerializeToString()
    output_field = _TAG_RESULT_OUTPUT + varint(tensor_len) + tensor_head
    step_len = len(rest) + len(output_field) + len(data)
    head = (b"\x08" + varint(rid) if rid else b"") + _TAG_RESPONSE_STEP + varint(step_len) + rest + output_field
    return b"".join((head, data))


@dataclass
class _PendingRestore:
    chunks: list = field(default_factory=list)
    received: int = 0
    error: ServiceError | None = None


@dataclass
class _PendingPrefill:
    """A sequence whose prefill arrives in several ``add`` chunks (``BatchAdd.more``)."""

    first: gqa_pb2.BatchAdd  # the first chunk: its policy fields are the sequence's
    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    chunks: int = 0
    received: int = 0
    error: ServiceError | None = None


class _SessionClosed(Exception):
    def __init__(self, error: ServiceError):
        self.error = error


def _parse(raw: bytes) -> gqa_pb2.BatchRequest:
    """A request's bytes as a message; ``InvalidArgument`` (as for every RPC) when they are not one."""
    try:
        return gqa_pb2.BatchRequest.FromString(raw)
    except Exception:
        raise malformed_request("Batch") from None


def _timed_step_many(steps: list[BatchStep], received: float):
    started = time.perf_counter()
    t0 = time.perf_counter_ns()
    outcomes = step_many(steps)
    return outcomes, time.perf_counter_ns() - t0, started - received


class Session:
    """One Batch RPC's sequences. Driven by one handler on the event loop, so no lock."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        pool: concurrent.futures.Executor,
        shared: SessionConfig,
        session_id: str,
        on_forced_close,
    ):
        self.engine = engine
        self.config = config
        self.pool = pool
        self.shared = shared
        self.id = session_id
        self.sequences: dict[int, Stream] = {}
        self.restoring: dict[int, _PendingRestore] = {}
        self.prefilling: dict[int, _PendingPrefill] = {}
        self._output: torch.Tensor | None = None  # reused by every step message, see _output_buffer
        self._on_forced_close = on_forced_close

    # -- bookkeeping ------------------------------------------------------------------------
    def touch(self) -> None:
        """The idle timeout is the session's: any request keeps every sequence alive."""
        now = self.engine.clock()
        for stream in self.sequences.values():
            stream.last_active = now

    def _admit(self, sid: int, stream: Stream) -> None:
        stream.on_forced_close = self._on_forced_close
        self.sequences[sid] = stream
        self.engine.batch_sequences += 1

    def _drop(self, sid: int, reason: str) -> None:
        stream = self.sequences.pop(sid)
        self.engine.batch_sequences -= 1
        self.engine.close(stream, reason)

    def close(self, reason: str) -> None:
        for sid in list(self.sequences):
            self._drop(sid, reason)
        self.restoring.clear()
        self.prefilling.clear()

    async def _compute(self, cost_bytes: int, fn, *args):
        if cost_bytes < self.config.inline_step_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _stream_config(self, source, what: str) -> StreamConfig:
        if source.policy not in POLICY_NAMES:
            raise InvalidArgument(
                f"{what}.policy: {source.policy} is not one of EVICTION_POLICY_NONE, _STRICT, _GREEDY, _SINK"
            )
        s = self.shared
        return self.engine.stream_config(
            backend=s.backend,
            dtype=s.dtype,
            batch_size=1,
            num_query_heads=s.num_query_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            num_layers=s.num_layers,
            policy=POLICY_NAMES[source.policy],
            window=source.window,
            capacity=source.capacity,
            sink_tokens=source.sink_tokens,
        )

    def _sequence_config(self, stream: Stream) -> gqa_pb2.OpenStream:
        """A sequence's configuration as a Decode stream's (snapshots restore into either RPC)."""
        c = stream.config
        return gqa_pb2.OpenStream(
            backend=c.backend,
            dtype=NAME_TO_DTYPE[c.dtype],
            batch_size=1,
            num_query_heads=c.num_query_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_layers=c.num_layers,
            policy=POLICY_ENUMS[c.policy.kind.value],
            window=c.policy.window,
            capacity=c.policy.capacity,
            sink_tokens=c.policy.sinks,
        )

    # -- requests ----------------------------------------------------------------------------
    async def add(self, request: gqa_pb2.BatchAdd) -> gqa_pb2.BatchAdded | None:
        """``None`` while a multi-chunk restore is still arriving."""
        sid = request.id
        if request.HasField("restore"):
            return await self._add_restore(request)
        if request.more or sid in self.prefilling:
            return await self._add_prefill_chunk(request)
        try:
            with self.engine.counting_open_refusals():
                if sid in self.sequences or sid in self.restoring:
                    raise InvalidArgument(f"add.id: sequence {sid} is already in the session")
                config = self._stream_config(request, "add")
                prefill, cost = {}, 0
                for i, entry in enumerate(request.prefill):
                    if entry.layer in prefill:
                        raise InvalidArgument(f"add.prefill[{i}].layer: layer {entry.layer} appears twice")
                    prefill[entry.layer] = (
                        from_proto(entry.key, f"add.prefill[{i}].key", rank=4),
                        from_proto(entry.value, f"add.prefill[{i}].value", rank=4),
                    )
                    cost += len(entry.key.data) + len(entry.value.data)
            # From here the engine counts its own refusals (budget, streams, backend...).
            stream = await self._compute(cost, self.engine.open, config, prefill)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=_status(exc), id=sid)
        return self._added(sid, stream)

    async def _add_restore(self, request: gqa_pb2.BatchAdd) -> gqa_pb2.BatchAdded | None:
        sid = request.id
        pending = self.restoring.get(sid)
        if pending is None:
            pending = self.restoring[sid] = _PendingRestore()
            if sid in self.sequences:
                pending.error = InvalidArgument(f"add.id: sequence {sid} is already in the session")
            elif (
                request.policy
                or request.window
                or request.capacity
                or request.sink_tokens
                or request.prefill
                or request.more
            ):
                pending.error = InvalidArgument(
                    "add: with `restore`, policy, window, capacity, sink_tokens, prefill and more must be unset "
                    "(the snapshot carries them)"
                )
        chunk = request.restore
        if pending.error is None:
            pending.chunks.append(chunk)
            pending.received += chunk.ByteSize()
            if len(pending.chunks) > snapshot.MAX_CHUNKS or pending.received > self.config.max_cache_bytes:
                pending.error = InvalidArgument("add.restore: the snapshot is larger than this server could ever admit")
                pending.chunks = []
        if not chunk.last:
            return None
        del self.restoring[sid]
        try:
            with self.engine.counting_open_refusals():
                if pending.error is not None:
                    raise pending.error
                chunks = pending.chunks
                if not chunks[0].HasField("config"):
                    raise InvalidArgument("add.restore: the first chunk must carry the sequence's configuration")
                self._check_snapshot_config(chunks[0].config)
                config = self._stream_config(chunks[0].config, "add.restore.config")
                layers = snapshot.decode(chunks, config, self.engine.snapshot_key)
            cost = sum(len(c.key.data) + len(c.value.data) for c in chunks)
            stream = await self._compute(cost, self.engine.open, config, None, layers)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=_status(exc), id=sid)
        return self._added(sid, stream)

    async def _add_prefill_chunk(self, request: gqa_pb2.BatchAdd) -> gqa_pb2.BatchAdded | None:
        """One chunk of a prefill sent in several ``add`` requests (``BatchAdd.more``): kept
        until the last, which adds the sequence with every chunk's positions or refuses it
        whole. A chunk is checked on arrival (its error is kept for the answer and the bytes
        received so far are dropped), so a bad chunk never costs more memory than it brought."""
        sid = request.id
        pending = self.prefilling.get(sid)
        first = pending is None
        if first:
            pending = self.prefilling[sid] = _PendingPrefill(request)
        index = pending.chunks
        pending.chunks += 1
        if pending.error is None:
            try:
                if first:
                    if sid in self.sequences or sid in self.restoring:
                        raise InvalidArgument(f"add.id: sequence {sid} is already in the session")
                    self._stream_config(request, "add")  # refused at once, not after the upload
                elif request.policy or request.window or request.capacity or request.sink_tokens:
                    raise InvalidArgument(
                        f"add (prefill chunk {index}): policy, window, capacity and sink_tokens belong on the "
                        "first chunk only"
                    )
                self._take_prefill_chunk(pending, request, index)
            except ServiceError as exc:
                pending.error = exc
                pending.layers = {}  # what was received is freed now, not at the last chunk
        if request.more:
            return None
        del self.prefilling[sid]
        try:
            with self.engine.counting_open_refusals():
                if pending.error is not None:
                    raise pending.error
                if sid in self.sequences:
                    raise InvalidArgument(f"add.id: sequence {sid} is already in the session")
                config = self._stream_config(pending.first, "add")
                prefill = {
                    layer: (torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2))
                    for layer, parts in pending.layers.items()
                }
            pending.layers = {}
            stream = await self._compute(pending.received, self.engine.open, config, prefill)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=_status(exc), id=sid)
        return self._added(sid, stream)

    def _take_prefill_chunk(self, pending: _PendingPrefill, request: gqa_pb2.BatchAdd, index: int) -> None:
        """Checks one chunk's entries against the session ((1, Hkv, n, D) in its dtype, a layer
        in range, once per chunk) and keeps them; ``InvalidArgument`` naming the chunk."""
        s = self.shared
        seen: set[int] = set()
        for i, entry in enumerate(request.prefill):
            where = f"add (prefill chunk {index}).prefill[{i}]"
            if entry.layer >= s.num_layers:
                raise InvalidArgument(f"{where}.layer: {entry.layer} is out of range; num_layers={s.num_layers}")
            if entry.layer in seen:
                raise InvalidArgument(f"{where}.layer: layer {entry.layer} appears twice in one chunk")
            seen.add(entry.layer)
            key = from_proto(entry.key, f"{where}.key", rank=4)
            value = from_proto(entry.value, f"{where}.value", rank=4)
            for name, t in (("key", key), ("value", value)):
                if t.dtype != s.torch_dtype:
                    raise InvalidArgument(f"{where}.{name}.dtype: {str(t.dtype)[6:]}, but the session's is {s.dtype}")
                if (t.shape[0], t.shape[1], t.shape[3]) != (1, s.num_kv_heads, s.head_dim):
                    raise InvalidArgument(
                        f"{where}.{name}.shape: expected (1, Hkv={s.num_kv_heads}, n, D={s.head_dim}), "
                        f"got {list(t.shape)}"
                    )
            if key.shape != value.shape:
                raise InvalidArgument(
                    f"{where}.value.shape: {list(value.shape)} differs from the key's {list(key.shape)}"
                )
            pending.received += len(entry.key.data) + len(entry.value.data)
            if pending.received > self.config.max_cache_bytes:
                raise InvalidArgument("add.prefill: the chunks hold more bytes than this server could ever admit")
            pending.layers.setdefault(entry.layer, []).append((key, value))

    def _check_snapshot_config(self, c: gqa_pb2.OpenStream) -> None:
        s = self.shared
        theirs = (
            c.backend or s.backend,
            DTYPE_NAMES.get(c.dtype, "?"),
            c.batch_size,
            c.num_query_heads,
            c.num_kv_heads,
            c.head_dim,
            c.num_layers,
        )
        ours = (s.backend, s.dtype, 1, s.num_query_heads, s.num_kv_heads, s.head_dim, s.num_layers)
        if theirs != ours:
            names = ("backend", "dtype", "batch_size", "num_query_heads", "num_kv_heads", "head_dim", "num_layers")
            diff = ", ".join(f"{n} {a} (session: {b})" for n, a, b in zip(names, theirs, ours) if a != b)
            raise InvalidArgument(f"add.restore: the snapshot does not fit the session: {diff}")

    def _added(self, sid: int, stream: Stream) -> gqa_pb2.BatchAdded:
        self._admit(sid, stream)
        p = stream.config.policy
        return gqa_pb2.BatchAdded(
            status=_OK,
            id=sid,
            policy=POLICY_ENUMS[p.kind.value],
            window=p.window,
            capacity=p.capacity,
            sink_tokens=p.sinks,
            bytes_reserved=stream.bytes_reserved,
            tokens_seen=[c.tokens_seen for c in stream.caches],
        )

    async def step(self, request: gqa_pb2.BatchStep, rid: int) -> bytes:
        """Answers a step message: the ``BatchResponse`` with request id ``rid``, serialized.
        On CPU the kernel writes each sequence's output into its row of one buffer the session
        keeps, and the reply is encoded around that buffer (``step_reply_bytes``): the output
        (1 MiB for 64 float32 sequences at Hq=32, D=128) is copied once, into the reply."""
        received = time.perf_counter()
        result = gqa_pb2.BatchStepResult()
        s = self.shared
        layer = request.layer
        ids = list(request.ids)
        n = len(ids)
        try:
            if layer >= s.num_layers:
                raise InvalidArgument(f"step.layer: {layer} is out of range; the session has num_layers={s.num_layers}")
            dtype = s.torch_dtype
            queries = _packed(request.query, "query", (n, s.num_query_heads, s.head_dim), dtype)
            keys = _packed(request.new_key, "new_key", (n, s.num_kv_heads, s.head_dim), dtype)
            values = _packed(request.new_value, "new_value", (n, s.num_kv_heads, s.head_dim), dtype)
        except ServiceError as exc:
            result.status.CopyFrom(_status(exc))
            result.layer = layer
            return gqa_pb2.BatchResponse(request_id=rid, step=result).SerializeToString()

        refusals: list[gqa_pb2.SequenceRefusal] = []
        refused: set[int] = set()
        duplicated = {sid for sid, k in Counter(ids).items() if k > 1} if len(set(ids)) != n else set()
        batch: list[BatchStep] = []
        slots: list[int] = []  # message row of each batch entry
        streams: list[Stream] = []
        q_rows, k_rows, v_rows = queries.split(1), keys.split(1), values.split(1)
        on_cpu = self._on_cpu(layer)
        packed = self._output_buffer(n) if on_cpu else None
        o_rows = packed.split(1) if packed is not None and n else [None] * n
        for i, sid in enumerate(ids):
            if sid in duplicated:
                exc: ServiceError = InvalidArgument(f"step.ids: sequence {sid} appears more than once in the message")
            elif (stream := self.sequences.get(sid)) is None:
                exc = NotFound(f"step.ids: sequence {sid} is not in the session")
            elif stream.closed:  # closed under the session by the drain; it ends after this message
                exc = Unavailable(f"step.ids: sequence {sid} was closed ({stream.close_reason})")
            else:
                batch.append(BatchStep(stream.caches[layer], q_rows[i], k_rows[i], v_rows[i], o_rows[i]))
                slots.append(i)
                streams.append(stream)
                continue
            refusals.append(_refusal(i, sid, exc))
            refused.add(i)

        observer = self.engine.observer
        compute_ns = 0
        outcomes: list = []
        if batch:
            try:
                outcomes, compute_ns, queue_seconds = await asyncio.get_running_loop().run_in_executor(
                    self.pool, _timed_step_many, batch, received
                )
            except Exception:  # the call as a whole failed: nothing was written (Contract 1)
                log.exception("session %s: batched step on layer %d failed", self.id, layer)
                outcomes = [Internal()] * len(batch)
                queue_seconds = 0.0
            else:
                self.engine.observer.batch_done(s.backend, s.dtype, len(batch))

        out_rows: list[torch.Tensor | None] = [None] * n
        rows: list[tuple[int, ...]] = [_NO_ROW] * n  # the per-sequence fields, row by row
        for i, stream, entry, outcome in zip(slots, streams, batch, outcomes):
            if isinstance(outcome, Exception):
                exc = _as_service_error(outcome, self.id, ids[i], layer)
                refusals.append(_refusal(i, ids[i], exc))
                refused.add(i)
                observer.step_refused(stream, exc.code)
                continue
            reach = entry.cache.policy.rollback_reach(outcome.tokens_seen)
            out_rows[i] = outcome.output
            rows[i] = (
                outcome.tokens_seen,
                outcome.resident,
                outcome.first_position,
                outcome.last_position,
                outcome.evicted_tokens,
                reach,
            )
            observer.step_done(stream, StepReport(outcome, compute_ns, reach), queue_seconds)
        if refused:
            refusals.sort(key=lambda r: r.index)
        if packed is not None:
            for i in refused:  # a refused sequence's row: zeros
                packed[i].zero_()
            output = packed
        else:  # a cuda backend's outputs: gathered on the device, then one copy here
            zero = None
            if refused:
                like = next((r for r in out_rows if r is not None), None)
                zero = torch.zeros(
                    (1, s.num_query_heads, s.head_dim),
                    dtype=s.torch_dtype,
                    device=like.device if like is not None else "cpu",
                )
            rows_ = [zero if r is None else r for r in out_rows]
            output = (
                torch.cat(rows_).cpu() if n else torch.empty((0, s.num_query_heads, s.head_dim), dtype=s.torch_dtype)
            )
        observer.batch_message(s.backend, s.dtype, n)
        result.status.SetInParent()
        result.layer = layer
        if n:
            for name, column in zip(_ROW_FIELDS, zip(*rows)):
                getattr(result, name).extend(column)
        result.refusals.extend(refusals)
        result.compute_ns = compute_ns
        return step_reply_bytes(rid, result, output.contiguous())

    def _on_cpu(self, layer: int) -> bool:
        """Whether the session's caches live in host memory (every backend but cuda)."""
        for stream in self.sequences.values():
            if stream.caches:
                return torch.device(stream.caches[layer].spec.device).type == "cpu"
        return True

    def _output_buffer(self, n: int) -> torch.Tensor:
        """(n, Hq, D) rows the kernel writes the outputs into: one buffer the session keeps (the
        reply copies it before the next message), not a fresh tensor per message (page faults,
        docs/design.md)."""
        s = self.shared
        if self._output is None or self._output.shape[0] < n:
            self._output = torch.empty((n, s.num_query_heads, s.head_dim), dtype=s.torch_dtype)
        return self._output[:n]

    def remove(self, request: gqa_pb2.BatchRemove) -> gqa_pb2.BatchRemoved:
        removed, refusals = [], []
        for i, sid in enumerate(request.ids):
            if sid in self.sequences:
                self._drop(sid, "removed")
                removed.append(sid)
            else:
                refusals.append(_refusal(i, sid, NotFound(f"remove.ids: sequence {sid} is not in the session")))
        return gqa_pb2.BatchRemoved(ids=removed, refusals=refusals)

    def rollback(self, request: gqa_pb2.BatchRollback) -> gqa_pb2.BatchRollbackResult:
        layers = self.shared.num_layers
        ids, counts = list(request.ids), list(request.counts)
        tokens, reach = [0] * (len(ids) * layers), [0] * (len(ids) * layers)
        refusals = []
        layer = None if request.all_layers else request.layer
        for i, sid in enumerate(ids):
            try:
                if len(counts) != len(ids):
                    raise InvalidArgument(f"rollback.counts: {len(counts)} entries for {len(ids)} ids")
                stream = self.sequences.get(sid)
                if stream is None:
                    raise NotFound(f"rollback.ids: sequence {sid} is not in the session")
                if ids.count(sid) > 1:
                    raise InvalidArgument(f"rollback.ids: sequence {sid} appears more than once in the message")
                stream.rollback(counts[i], layer)
            except ServiceError as exc:
                refusals.append(_refusal(i, sid, exc))
                continue
            for j, cache in enumerate(stream.caches):
                tokens[i * layers + j] = cache.tokens_seen
                reach[i * layers + j] = cache.policy.rollback_reach(cache.tokens_seen)
        return gqa_pb2.BatchRollbackResult(tokens_seen=tokens, rollback_reach=reach, refusals=refusals)

    async def snapshot(self, request: gqa_pb2.BatchSnapshot) -> list[gqa_pb2.BatchSnapshotChunk]:
        sid = request.id
        stream = self.sequences.get(sid)
        try:
            if stream is None:
                raise NotFound(f"snapshot.id: sequence {sid} is not in the session")
            chunks = await self._compute(
                stream.bytes_in_use(),
                snapshot.encode,
                stream,
                self._sequence_config(stream),
                self.config.max_message_bytes,
                request.max_chunk_bytes,
                self.engine.snapshot_key,
            )
        except ServiceError as exc:
            return [gqa_pb2.BatchSnapshotChunk(id=sid, status=_status(exc))]
        return [gqa_pb2.BatchSnapshotChunk(id=sid, status=_OK, chunk=c) for c in chunks]


def _as_service_error(exc: Exception, session: str, sid: int, layer: int) -> ServiceError:
    """A step's exception (Contract 1's types) as the in-band status the client sees."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, CacheFullError):
        return ResourceExhausted(str(exc))
    if isinstance(exc, InvalidInput):  # the backends' input errors, by type (not any ValueError)
        return InvalidArgument(str(exc))
    log.error("session %s: step of sequence %d on layer %d failed", session, sid, layer, exc_info=exc)
    return Internal()


_session_ids = iter(range(1, 1 << 62))


async def serve(engine: Engine, config: ServerConfig, pool: concurrent.futures.Executor, context) -> None:
    """The handler of one Batch RPC (the servicer's ``Batch`` delegates here). Requests arrive
    as their bytes (``AttentionServicer.Batch.raw_requests``): step messages are read by
    ``service.wire`` without copying their tensors, the others parsed here."""
    first = await context.read()
    if first is grpc.aio.EOF:
        return
    first = _parse(first)
    if first.WhichOneof("kind") != "open":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a Batch stream must be `open`")
    try:
        shared = session_config(engine, first.open)
    except ServiceError as exc:
        engine.observer.open_refused(
            "invalid"
            if isinstance(exc, InvalidArgument)
            else "backend"
            if isinstance(exc, FailedPrecondition)
            else "draining"
        )
        await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    forced: list[ServiceError] = []
    state = {"waiting": False}

    def on_forced_close(error: ServiceError) -> None:
        # From the reaper or the drain (any thread): end the handler only while it waits for
        # the client, so a step in flight always finishes and is answered.
        def wake():
            forced.append(error)
            if state["waiting"] and task is not None:
                task.cancel()

        loop.call_soon_threadsafe(wake)

    session = Session(engine, config, pool, shared, f"b{next(_session_ids)}", on_forced_close)
    reason = "client"
    try:
        await context.write(
            gqa_pb2.BatchResponse(
                request_id=first.request_id,
                opened=gqa_pb2.BatchOpened(
                    session_id=session.id,
                    backend=shared.backend,
                    dtype=NAME_TO_DTYPE[shared.dtype],
                    num_query_heads=shared.num_query_heads,
                    num_kv_heads=shared.num_kv_heads,
                    head_dim=shared.head_dim,
                    num_layers=shared.num_layers,
                ),
            )
        )
        while True:
            if forced:
                raise _SessionClosed(forced[0])
            state["waiting"] = True
            try:
                request = await context.read()
            except asyncio.CancelledError:
                if forced:
                    raise _SessionClosed(forced[0]) from None
                raise
            finally:
                state["waiting"] = False
            if request is grpc.aio.EOF:
                break
            session.touch()
            fast = wire.read_step_request(request)
            if fast is not None:
                rid, step = fast
                await context.write(await session.step(step, rid))
                continue
            request = _parse(request)
            rid = request.request_id
            kind = request.WhichOneof("kind")
            if kind == "step":
                await context.write(await session.step(request.step, rid))
            elif kind == "add":
                added = await session.add(request.add)
                if added is not None:
                    await context.write(gqa_pb2.BatchResponse(request_id=rid, added=added))
            elif kind == "remove":
                await context.write(gqa_pb2.BatchResponse(request_id=rid, removed=session.remove(request.remove)))
            elif kind == "rollback":
                await context.write(gqa_pb2.BatchResponse(request_id=rid, rollback=session.rollback(request.rollback)))
            elif kind == "snapshot":
                for chunk in await session.snapshot(request.snapshot):
                    await context.write(gqa_pb2.BatchResponse(request_id=rid, snapshot=chunk))
            elif kind == "open":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "`open` may only begin a Batch stream")
            else:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a Batch request must set one of add, step, remove, rollback or snapshot",
                )
    except _SessionClosed as closed:
        reason = "forced"
        session.close(reason)
        await context.abort(getattr(grpc.StatusCode, closed.error.code), closed.error.message)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("session %s: unexpected failure", session.id)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; the session was closed")
    finally:
        session.close(reason if not forced else "forced")
