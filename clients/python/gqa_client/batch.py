"""``BatchSession``: one ``Batch`` RPC, many sequences per message (blocking).

    from gqa_client import Client

    with Client("127.0.0.1:50051") as client:
        with client.batch(num_query_heads=32, num_kv_heads=8, head_dim=128, num_layers=32,
                          dtype="bfloat16") as session:
            session.add(7, policy="strict", window=4096)
            session.add(9, policy="sink", window=2048, sink_tokens=4)
            result = session.step(0, [7, 9], query, new_key, new_value)  # (2, Hq, D), (2, Hkv, D) x2
            result.output      # (2, Hq, D), rows in the order of the ids, of the query's kind
            result.refusals    # {id: Refused} for sequences refused in-band

Each call sends one request and waits for its answer (the server answers in order). A refusal
of one sequence is in-band and typed (``InvalidArgument``, ``NotFound``, ``CacheFull``,
``InexactRollback``...; its ``id`` names the sequence): ``add``, ``restore`` and ``snapshot``
raise it (the session goes on), ``step``, ``remove`` and ``rollback`` report it in
``refusals``. A status that ends the RPC raises ``CallFailed``. Tensors follow the stream rule
of ``gqa_client.tensors``: the session's dtype, else ``TypeError`` before anything is sent.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from .api import gqa_pb2, gqa_pb2_grpc
from .errors import CallFailed, GqaError, Refused, refusal
from .messages import DEFAULT_CHUNK_BYTES, add_prefill, policy_fields
from .snapshot import Snapshot, as_snapshot
from .stream import _QueuedCall
from .tensors import decode, dtype_name, encode_into

__all__ = ["BatchSession", "BatchStepOutput", "BatchRollbackOutput", "PREFILL_CHUNK_BYTES", "prefill_chunks"]

# The largest prefill message ``add`` sends: 4 MiB, gRPC's default receive limit, less room for
# the message's other fields.
PREFILL_CHUNK_BYTES = (4 << 20) - (64 << 10)


def prefill_chunks(prefill: Mapping[int, tuple[Any, Any]], max_bytes: int) -> list[list[tuple[int, Any, Any]]]:
    """Splits a prefill (layer -> (keys, values), each (1, Hkv, n, D), arrays or tensors) into
    messages' worth of ``(layer, keys, values)`` slices along the positions, each message under
    ``max_bytes`` of tensor data (a single position may exceed it), a layer at most once per
    message, its slices in position order."""
    chunks: list[list] = []
    current: list = []
    size = 0
    for layer, (keys, values) in sorted(prefill.items()):
        shape = keys.shape
        n = shape[2]
        row = max(1, 2 * shape[0] * shape[1] * shape[3] * keys.itemsize)  # a position's keys and values
        start = 0
        while True:
            room = max_bytes - size
            if current and (room < row or any(entry[0] == layer for entry in current)):
                chunks.append(current)
                current, size = [], 0
                room = max_bytes
            take = min(n - start, max(1, room // row))
            current.append((layer, keys[:, :, start : start + take], values[:, :, start : start + take]))
            size += take * row
            start += take
            if start >= n:
                break
    if current:
        chunks.append(current)
    return chunks


@dataclasses.dataclass
class BatchStepOutput:
    """One step message's answer; per-sequence lists follow the order of the ids sent."""

    layer: int
    output: Any
    """(N, Hq, D) of the query's kind; zero rows for refused sequences."""
    tokens_seen: list[int]
    resident: list[int]
    first_position: list[int]
    last_position: list[int]
    evicted_tokens: list[int]
    rollback_reach: list[int]
    compute_ns: int
    """The server's compute time for the whole message, in nanoseconds."""
    refusals: dict[int, Refused] = dataclasses.field(default_factory=dict)
    """id -> its typed refusal; that sequence's caches are unchanged."""


@dataclasses.dataclass
class BatchRollbackOutput:
    """Row i for ids[i], one entry per layer (zeros for a refused id)."""

    tokens_seen: list[list[int]]
    rollback_reach: list[list[int]]
    refusals: dict[int, Refused] = dataclasses.field(default_factory=dict)


def _refusals(items) -> dict[int, Refused]:
    return {x.id: refusal(x.status, x.id) for x in items}


def _rows(values, n: int) -> list[list[int]]:
    values = list(values)
    width = len(values) // n if n else 0
    return [values[i * width : (i + 1) * width] for i in range(n)]


class BatchSession(_QueuedCall):
    """One ``Batch`` RPC. ``target`` is a ``grpc.Channel`` or an ``AttentionServiceStub``
    (``Client.batch`` passes its own, with its token). ``opened`` is the server's ``BatchOpened``;
    ``dtype`` the session's dtype name. ``CallFailed`` if the server refuses the open. Use as a
    context manager, or call ``close`` (the server frees every sequence) or ``cancel``."""

    _what = "session"

    def __init__(
        self,
        target,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype="float32",
        backend: str = "",
        metadata=None,
        timeout: float | None = None,
    ):
        # Any AttentionServiceStub (this package's or another copy of the generated code), else a channel.
        stub = target if hasattr(target, "Batch") else gqa_pb2_grpc.AttentionServiceStub(target)
        self.dtype: str = dtype_name(dtype)
        self.num_layers = num_layers
        self._rid = 0
        first = gqa_pb2.BatchRequest(
            request_id=0,
            open=gqa_pb2.BatchOpen(
                backend=backend,
                dtype=gqa_pb2.DType.Value(f"DTYPE_{self.dtype.upper()}"),
                num_query_heads=num_query_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                num_layers=num_layers,
            ),
        )
        self.opened: gqa_pb2.BatchOpened = self._start(stub.Batch, [first], metadata=metadata, timeout=timeout).opened

    # -- plumbing ---------------------------------------------------------------------------

    def _send(self, **kind) -> int:
        """Sends one request (``kind``: the oneof field and its message); its request id."""
        return self._put(gqa_pb2.BatchRequest(request_id=self._rid + 1, **kind))

    def _put(self, request: gqa_pb2.BatchRequest) -> int:
        """Sends ``request``, numbered the next request id; that id."""
        if self.closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the session is closed")
        self._rid = request.request_id
        self._requests.put(request)
        return self._rid

    def _recv(self, rid: int) -> gqa_pb2.BatchResponse:
        response = self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"Batch: answer to request {response.request_id}, expected {rid}")
        return response

    # -- sequences ----------------------------------------------------------------------------
    def add(
        self,
        sid: int,
        *,
        policy: str = "none",
        window: int = 0,
        capacity: int | None = None,
        sink_tokens: int = 0,
        prefill: Mapping[int, tuple[Any, Any]] | None = None,
        max_chunk_bytes: int = PREFILL_CHUNK_BYTES,
    ) -> gqa_pb2.BatchAdded:
        """Adds sequence ``sid`` with its own policy (the arguments and defaults of
        ``Client.open``); ``prefill`` maps a layer to (1, Hkv, n, D) keys and values. A prefill
        of more than ``max_chunk_bytes`` travels in several ``add`` messages of at most that size
        (``BatchAdd.more``), answered once. Raises a ``Refused`` (a budget or limit, a bad
        configuration or prefill, an id in use); then nothing of the sequence is kept."""
        add = gqa_pb2.BatchAdd(id=sid, **policy_fields(policy, window, capacity, sink_tokens))
        chunks = prefill_chunks(prefill or {}, max_chunk_bytes)
        if len(chunks) <= 1:
            add_prefill(add, {layer: (k, v) for layer, k, v in (chunks[0] if chunks else ())}, self.dtype)
            return self._added(self._recv(self._send(add=add)).added, sid)
        for i, chunk in enumerate(chunks):  # one request id for all chunks; only the last is answered
            if i:
                add = gqa_pb2.BatchAdd(id=sid)
            add.more = i < len(chunks) - 1
            add_prefill(add, {layer: (k, v) for layer, k, v in chunk}, self.dtype)
            if i == 0:
                rid = self._send(add=add)
            else:
                self._requests.put(gqa_pb2.BatchRequest(request_id=rid, add=add))
        return self._added(self._recv(rid).added, sid)

    def restore(self, sid: int, snapshot: Snapshot | bytes | str | os.PathLike) -> gqa_pb2.BatchAdded:
        """Adds sequence ``sid`` from a snapshot (a ``Snapshot``, its bytes, a file or its chunks)
        of a sequence or of a Decode stream of batch size 1."""
        chunks = as_snapshot(snapshot).chunks
        rid = self._send(add=gqa_pb2.BatchAdd(id=sid, restore=chunks[0]))
        for chunk in chunks[1:]:  # one request id for all chunks; only the last is answered
            self._requests.put(gqa_pb2.BatchRequest(request_id=rid, add=gqa_pb2.BatchAdd(id=sid, restore=chunk)))
        return self._added(self._recv(rid).added, sid)

    @staticmethod
    def _added(added: gqa_pb2.BatchAdded, sid: int) -> gqa_pb2.BatchAdded:
        if added.status.code:
            raise refusal(added.status, sid)
        return added

    def step(self, layer: int, ids: Iterable[int], query, new_key, new_value) -> BatchStepOutput:
        """One layer's token for the sequences ``ids``: query (N, Hq, D), new_key and new_value
        (N, Hkv, D), row i for ids[i]. Raises a ``Refused`` when the message as a whole is
        refused (a shape, a layer, a repeated id), ``TypeError`` for a tensor of another dtype."""
        r = self.step_reply(layer, ids, query, new_key, new_value)
        return BatchStepOutput(
            layer=r.layer,
            output=decode(r.output, query, "output"),
            tokens_seen=list(r.tokens_seen),
            resident=list(r.resident),
            first_position=list(r.first_position),
            last_position=list(r.last_position),
            evicted_tokens=list(r.evicted_tokens),
            rollback_reach=list(r.rollback_reach),
            compute_ns=r.compute_ns,
            refusals=_refusals(r.refusals),
        )

    def step_reply(self, layer: int, ids: Iterable[int], query, new_key, new_value) -> gqa_pb2.BatchStepResult:
        """``step`` without its ``BatchStepOutput``: the server's ``BatchStepResult`` message as
        received (its ``output`` still a ``Tensor`` message; ``gqa_client.tensors.decode``
        reads it). For a caller that reads only the output and ``compute_ns`` of every layer
        of every token: a model's decode, where each Python object made costs."""
        # Built in place: a keyword-built BatchStep would be copied into the request, tensors and all.
        request = gqa_pb2.BatchRequest(request_id=self._rid + 1)
        step = request.step
        step.layer = layer
        step.ids.extend(ids)
        encode_into(step.query, query, self.dtype, "query")
        encode_into(step.new_key, new_key, self.dtype, "new_key")
        encode_into(step.new_value, new_value, self.dtype, "new_value")
        rid = self._put(request)
        r = self._recv(rid).step
        if r.status.code:
            raise refusal(r.status)
        return r

    def remove(self, ids: Iterable[int]) -> dict[int, Refused]:
        """Ends sequences, freeing their bytes; returns the refusals (``NotFound`` for unknown ids)."""
        return _refusals(self._recv(self._send(remove=gqa_pb2.BatchRemove(ids=list(ids)))).removed.refusals)

    def rollback(self, ids: Iterable[int], counts: Iterable[int], layer: int | None = None) -> BatchRollbackOutput:
        """Drops the last counts[i] tokens of ids[i] (of ``layer``, or of every layer)."""
        ids = list(ids)
        message = gqa_pb2.BatchRollback(ids=ids, counts=list(counts), layer=layer or 0, all_layers=layer is None)
        r = self._recv(self._send(rollback=message)).rollback
        return BatchRollbackOutput(
            tokens_seen=_rows(r.tokens_seen, len(ids)),
            rollback_reach=_rows(r.rollback_reach, len(ids)),
            refusals=_refusals(r.refusals),
        )

    def snapshot(self, sid: int, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        """Sequence ``sid``'s complete state (``restore`` here, or ``Client.restore`` as a
        stream of batch size 1); ``NotFound`` for an unknown id."""
        rid = self._send(snapshot=gqa_pb2.BatchSnapshot(id=sid, max_chunk_bytes=max_chunk_bytes))
        chunks = []
        while True:
            piece = self._recv(rid).snapshot
            if piece.status.code:
                raise refusal(piece.status, sid)
            chunks.append(piece.chunk)
            if piece.chunk.last:
                return Snapshot(chunks)
