"""One ``Batch`` RPC's session: its sequences' requests (add, step, remove, rollback, snapshot)
as calls on the engine and the session's data plane (``service.engine.plane.SequenceSet``).

A session shares backend, dtype, heads, head width and layer count; each of its sequences is an
engine ``Stream`` of batch size 1, admitted and built like a ``Decode`` stream (the byte budget,
``max_streams``, the idle reaper and the drain apply to it exactly as to a ``Decode`` stream;
the idle timeout is the session's). Refusals are per sequence and in-band (``service.
batch_reply``); the handler (``service.transport.batch_rpc``) owns the RPC itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..api import gqa_pb2
from ..config import ServerConfig
from ..engine import snapshot
from ..engine.engine import Admission, Engine, Stream, StreamConfig
from ..engine.plane import NotFound, SequenceSet, SetShape
from ..engine.tensors import from_proto
from ..errors import InvalidArgument, ServiceError
from ..vocab import DTYPE_NAMES, NAME_TO_DTYPE, POLICY_ENUMS, POLICY_NAMES
from .batch_reply import OK, StepReply, sequence_refusal, status, step_reply_bytes
from .wire import BatchStepLayout

__all__ = ["Session"]


@dataclass
class _PendingRestore:
    chunks: list = field(default_factory=list)
    received: int = 0
    error: ServiceError | None = None
    admission: Admission | None = None
    config: StreamConfig | None = None


@dataclass
class _PendingPrefill:
    """A sequence whose prefill arrives in several ``add`` chunks (``BatchAdd.more``)."""

    first: gqa_pb2.BatchAdd  # the first chunk: its policy fields are the sequence's
    layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    chunks: int = 0
    received: int = 0
    error: ServiceError | None = None


class Session:
    """One Batch RPC's sequences. Driven by one handler on the event loop, so no lock."""

    def __init__(self, engine: Engine, config: ServerConfig, shape: SetShape, session_id: str, on_forced_close):
        self.engine = engine
        self.config = config
        self.shared = shape
        self.id = session_id
        self.sequences: SequenceSet = engine.sequence_set(shape)
        self.restoring: dict[int, _PendingRestore] = {}
        self.prefilling: dict[int, _PendingPrefill] = {}
        self._on_forced_close = on_forced_close
        itemsize = shape.torch_dtype.itemsize
        self._dtype_enum = NAME_TO_DTYPE[shape.dtype]
        self._q_row = shape.num_query_heads * shape.head_dim * itemsize
        self._kv_row = shape.num_kv_heads * shape.head_dim * itemsize
        # the runtimes' encoding of this session's step messages (``wire.BatchStepLayout``)
        self.layout = BatchStepLayout(
            self._dtype_enum, shape.num_query_heads, shape.num_kv_heads, shape.head_dim, itemsize
        )

    # -- bookkeeping ------------------------------------------------------------------------
    def touch(self) -> None:
        """The idle timeout is the session's: any request keeps every sequence alive."""
        self.engine.touch_set(self.sequences)

    def _admit(self, sid: int, stream: Stream) -> None:
        stream.on_forced_close = self._on_forced_close
        self.sequences.add(sid, stream)
        self.engine.batch_sequences += 1

    def _drop(self, sid: int, reason: str) -> None:
        stream = self.sequences.remove(sid)
        self.engine.batch_sequences -= 1
        self.engine.close(stream, reason)

    def close(self, reason: str) -> None:
        for sid in self.sequences.ids():
            self._drop(sid, reason)
        for pending in self.restoring.values():
            if pending.admission is not None:
                self.engine.abandon(pending.admission)
        self.restoring.clear()
        self.prefilling.clear()

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
        """``None`` while a multi-chunk restore is still arriving. Admitted on the event loop
        and built on the compute pool, as a Decode stream's open is."""
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
                prefill = {}
                for i, entry in enumerate(request.prefill):
                    if entry.layer in prefill:
                        raise InvalidArgument(f"add.prefill[{i}].layer: layer {entry.layer} appears twice")
                    prefill[entry.layer] = (
                        from_proto(entry.key, f"add.prefill[{i}].key", rank=4),
                        from_proto(entry.value, f"add.prefill[{i}].value", rank=4),
                    )
            # From here the engine counts its own refusals (budget, streams, backend...).
            admission = self.engine.admit(config)
            stream = await self.engine.build_async(admission, prefill)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=status(exc), id=sid)
        return self._added(sid, stream)

    async def _add_restore(self, request: gqa_pb2.BatchAdd) -> gqa_pb2.BatchAdded | None:
        """The Decode stream's restore protocol, per sequence: the first chunk's configuration
        is admitted (budget and stream limit included) before the rest is buffered, at most
        what the admitted sequence could hold (``snapshot.check_size``)."""
        sid = request.id
        chunk = request.restore
        pending = self.restoring.get(sid)
        if pending is None:
            pending = self.restoring[sid] = _PendingRestore()
            try:
                with self.engine.counting_open_refusals():
                    if sid in self.sequences:
                        raise InvalidArgument(f"add.id: sequence {sid} is already in the session")
                    if (
                        request.policy
                        or request.window
                        or request.capacity
                        or request.sink_tokens
                        or request.prefill
                        or request.more
                    ):
                        raise InvalidArgument(
                            "add: with `restore`, policy, window, capacity, sink_tokens, prefill and more must be unset "
                            "(the snapshot carries them)"
                        )
                    if not chunk.HasField("config"):
                        raise InvalidArgument("add.restore: the first chunk must carry the sequence's configuration")
                    self._check_snapshot_config(chunk.config)
                    pending.config = self._stream_config(chunk.config, "add.restore.config")
                pending.admission = self.engine.admit(pending.config)
            except ServiceError as exc:
                pending.error = exc
        if pending.error is None:
            pending.chunks.append(chunk)
            pending.received += chunk.ByteSize()
            try:
                snapshot.check_size(pending.admission.need, len(pending.chunks), pending.received, "add.restore")
            except ServiceError as exc:
                self.engine.observer.open_refused("invalid")
                pending.error = exc
            if pending.error is not None:
                self.engine.abandon(pending.admission)
                pending.admission = None
                pending.chunks = []
        if not chunk.last:
            return None
        del self.restoring[sid]
        if pending.error is not None:
            return gqa_pb2.BatchAdded(status=status(pending.error), id=sid)
        chunks, config, key = pending.chunks, pending.config, self.engine.snapshot_key

        def layers_of():  # on the pool: the checksum and the copies are proportional to the size
            return snapshot.decode(chunks, config, key)

        try:
            stream = await self.engine.build_async(pending.admission, None, layers_of)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=status(exc), id=sid)
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
            # From here the engine counts its own refusals (budget, streams, backend...).
            admission = self.engine.admit(config)
            stream = await self.engine.build_async(admission, prefill)
        except ServiceError as exc:
            return gqa_pb2.BatchAdded(status=status(exc), id=sid)
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
            status=OK,
            id=sid,
            policy=POLICY_ENUMS[p.kind.value],
            window=p.window,
            capacity=p.capacity,
            sink_tokens=p.sinks,
            bytes_reserved=stream.bytes_reserved,
            tokens_seen=[c.tokens_seen for c in stream.caches],
        )

    def _check_tensor(self, name: str, dtype: int, shape, data, row: int, n: int, heads: int) -> None:
        """Integer checks of a packed step tensor against (n, heads, D) in the session's dtype."""
        if dtype != self._dtype_enum:
            raise InvalidArgument(f"step.{name}.dtype: {dtype}, but the session's dtype is {self.shared.dtype}")
        want = (n, heads, self.shared.head_dim)
        if tuple(shape) != want:
            raise InvalidArgument(f"step.{name}.shape: expected {list(want)} (N, heads, D), got {list(shape)}")
        if len(data) != n * row:
            raise InvalidArgument(f"step.{name}.data: {len(data)} bytes, but shape {list(want)} needs {n * row}")

    async def step(self, request, rid: int) -> bytes:
        """Answers a step message (``wire.StepRequest``, or the runtime's ``BatchStep``): the
        ``BatchResponse`` with request id ``rid``, serialized. Integer checks, the plan and the
        reply's draft here; the computation (its rows written into the draft) and the reply's
        last fields where ``Engine.submit_message`` runs them (the event loop or a compute
        worker)."""
        received = time.perf_counter()
        s = self.shared
        layer = request.layer
        ids = request.ids
        if not isinstance(ids, np.ndarray):
            ids = np.array(ids, dtype=np.uint64)
        n = len(ids)
        self.sequences.expect(n)
        try:
            q, k, v = request.query, request.new_key, request.new_value
            q_data, k_data, v_data = q.data, k.data, v.data  # the runtime copies bytes per access
            self._check_tensor("query", q.dtype, q.shape, q_data, self._q_row, n, s.num_query_heads)
            self._check_tensor("new_key", k.dtype, k.shape, k_data, self._kv_row, n, s.num_kv_heads)
            self._check_tensor("new_value", v.dtype, v.shape, v_data, self._kv_row, n, s.num_kv_heads)
            plan = self.sequences.plan(layer, ids, q_data, k_data, v_data)
        except ServiceError as exc:
            return step_reply_bytes(rid, layer, None, refused=exc)
        # the reply's bytes drafted around the output's rows, which the step writes in place
        reply = StepReply(rid, layer, self._dtype_enum, (n, s.num_query_heads, s.head_dim))
        answer = await self.engine.submit_message(
            self.sequences, plan, received=received, reply=reply, out=reply.output
        )
        if isinstance(answer, ServiceError):  # the message failed as a whole on the worker
            return step_reply_bytes(rid, layer, None, refused=answer)
        return answer

    def remove(self, request: gqa_pb2.BatchRemove) -> gqa_pb2.BatchRemoved:
        removed, refusals = [], []
        for i, sid in enumerate(request.ids):
            if sid in self.sequences:
                self._drop(sid, "removed")
                removed.append(sid)
            else:
                refusals.append(sequence_refusal(i, sid, NotFound(f"remove.ids: sequence {sid} is not in the session")))
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
                refusals.append(sequence_refusal(i, sid, exc))
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
            chunks = await self.engine.offload(
                stream.bytes_in_use(),
                snapshot.encode,
                stream,
                self._sequence_config(stream),
                self.config.max_message_bytes,
                request.max_chunk_bytes,
                self.engine.snapshot_key,
            )
        except ServiceError as exc:
            return [gqa_pb2.BatchSnapshotChunk(id=sid, status=status(exc))]
        return [gqa_pb2.BatchSnapshotChunk(id=sid, status=OK, chunk=c) for c in chunks]
