"""A Python client of the ``Batch`` stream: many sequences per message (synchronous).

    import grpc
    from service.client_batch import BatchSession

    with BatchSession(grpc.insecure_channel("127.0.0.1:50051"), num_query_heads=32, num_kv_heads=8,
                      head_dim=128, num_layers=32, dtype=torch.bfloat16) as session:
        session.add(7, policy="strict", window=4096)
        session.add(9, policy="sink", window=2048, sinks=4)
        result = session.step(0, [7, 9], query, new_key, new_value)   # (2, Hq, D), (2, Hkv, D) x2
        result.output        # (2, Hq, D) torch tensor, rows in the order of the ids
        result.refusals      # {id: (code, message)} for sequences refused in-band

Each call sends one request and waits for its answer (the server answers in order). A refusal
of one sequence is in-band: ``add`` raises ``Refused`` (the session goes on), ``step``,
``remove`` and ``rollback`` report it in ``refusals``; a status that ends the RPC raises
``grpc.RpcError``. Tensors are torch tensors in the session's dtype.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch

from .api import gqa_pb2, gqa_pb2_grpc
from .tensors import from_proto, to_proto
from .vocab import NAME_TO_DTYPE
from .vocab import POLICY_ENUMS as POLICIES

__all__ = ["BatchSession", "BatchStepOutput", "Refused", "POLICIES"]

_END = object()


class Refused(Exception):
    """An in-band refusal of one request or sequence; the session is unchanged and open."""

    def __init__(self, status: gqa_pb2.Status, sid: int | None = None):
        super().__init__(f"{status.code}: {status.message}")
        self.code = status.code
        self.message = status.message
        self.id = sid


@dataclass
class BatchStepOutput:
    """One step message's answer; per-sequence lists follow the order of the ids sent."""

    layer: int
    output: torch.Tensor  # (N, Hq, D); zero rows for refused sequences
    tokens_seen: list[int]
    resident: list[int]
    first_position: list[int]
    last_position: list[int]
    evicted_tokens: list[int]
    rollback_reach: list[int]
    compute_ns: int
    refusals: dict[int, tuple[int, str]] = field(default_factory=dict)  # id -> (code, message)


class BatchSession:
    """One ``Batch`` RPC. ``target`` is a ``grpc.Channel`` or an ``AttentionServiceStub``."""

    def __init__(
        self,
        target,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: torch.dtype | str = torch.float32,
        backend: str = "",
        metadata=None,
        timeout=None,
    ):
        stub = (
            target
            if isinstance(target, gqa_pb2_grpc.AttentionServiceStub)
            else gqa_pb2_grpc.AttentionServiceStub(target)
        )
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        self._requests: queue.Queue = queue.Queue()
        self._rid = 0
        self._requests.put(
            gqa_pb2.BatchRequest(
                request_id=0,
                open=gqa_pb2.BatchOpen(
                    backend=backend,
                    dtype=NAME_TO_DTYPE[name],
                    num_query_heads=num_query_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    num_layers=num_layers,
                ),
            )
        )
        self._call = stub.Batch(iter(self._requests.get, _END), metadata=metadata, timeout=timeout)
        self.opened = next(self._call).opened
        self.closed = False

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, **kind) -> int:
        self._rid += 1
        self._requests.put(gqa_pb2.BatchRequest(request_id=self._rid, **kind))
        return self._rid

    def _recv(self, rid: int) -> gqa_pb2.BatchResponse:
        response = next(self._call)
        if response.request_id != rid:
            raise RuntimeError(f"Batch: answer to request {response.request_id}, expected {rid}")
        return response

    # -- sequences ----------------------------------------------------------------------------
    def add(
        self,
        sid: int,
        *,
        policy: str = "strict",
        window: int = 0,
        capacity: int = 0,
        sinks: int = 0,
        prefill: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> gqa_pb2.BatchAdded:
        """Adds sequence ``sid``; ``prefill`` maps a layer to (1, Hkv, n, D) keys and values.
        Raises ``Refused`` (budget, limits, a bad configuration, an id in use)."""
        add = gqa_pb2.BatchAdd(id=sid, policy=POLICIES[policy], window=window, capacity=capacity, sink_tokens=sinks)
        for layer, (k, v) in (prefill or {}).items():
            add.prefill.add(layer=layer, key=to_proto(k), value=to_proto(v))
        return self._added(self._recv(self._send(add=add)).added)

    def restore(self, sid: int, chunks: list[gqa_pb2.SnapshotChunk]) -> gqa_pb2.BatchAdded:
        """Adds sequence ``sid`` from a snapshot (of a Decode stream of batch size 1, or of ``snapshot``)."""
        self._rid += 1
        rid = self._rid
        for chunk in chunks:  # one request id for all chunks; only the last is answered
            self._requests.put(gqa_pb2.BatchRequest(request_id=rid, add=gqa_pb2.BatchAdd(id=sid, restore=chunk)))
        return self._added(self._recv(rid).added)

    @staticmethod
    def _added(added: gqa_pb2.BatchAdded) -> gqa_pb2.BatchAdded:
        if added.status.code:
            raise Refused(added.status, added.id)
        return added

    def step(
        self, layer: int, ids, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor
    ) -> BatchStepOutput:
        """One layer's token for the sequences ``ids``: query (N, Hq, D), new_key and new_value
        (N, Hkv, D), row i for ids[i]. Raises ``Refused`` when the message as a whole is refused."""
        ids = list(ids)
        rid = self._send(
            step=gqa_pb2.BatchStep(
                layer=layer, ids=ids, query=to_proto(query), new_key=to_proto(new_key), new_value=to_proto(new_value)
            )
        )
        r = self._recv(rid).step
        if r.status.code:
            raise Refused(r.status)
        return BatchStepOutput(
            layer=r.layer,
            output=from_proto(r.output, "output", rank=3),
            tokens_seen=list(r.tokens_seen),
            resident=list(r.resident),
            first_position=list(r.first_position),
            last_position=list(r.last_position),
            evicted_tokens=list(r.evicted_tokens),
            rollback_reach=list(r.rollback_reach),
            compute_ns=r.compute_ns,
            refusals={x.id: (x.status.code, x.status.message) for x in r.refusals},
        )

    def remove(self, ids) -> dict[int, tuple[int, str]]:
        """Ends sequences, freeing their bytes; returns the refusals (unknown ids)."""
        r = self._recv(self._send(remove=gqa_pb2.BatchRemove(ids=list(ids)))).removed
        return {x.id: (x.status.code, x.status.message) for x in r.refusals}

    def rollback(self, ids, counts, layer: int | None = None) -> gqa_pb2.BatchRollbackResult:
        """Drops the last counts[i] tokens of ids[i] (of ``layer``, or of every layer)."""
        msg = gqa_pb2.BatchRollback(ids=list(ids), counts=list(counts), layer=layer or 0, all_layers=layer is None)
        return self._recv(self._send(rollback=msg)).rollback

    def snapshot(self, sid: int) -> list[gqa_pb2.SnapshotChunk]:
        """Sequence ``sid``'s complete state as chunks (``restore`` here, or a Decode ``restore``)."""
        rid = self._send(snapshot=gqa_pb2.BatchSnapshot(id=sid))
        chunks = []
        while True:
            piece = self._recv(rid).snapshot
            if piece.status.code:
                raise Refused(piece.status, sid)
            chunks.append(piece.chunk)
            if piece.chunk.last:
                return chunks

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Half-closes the RPC (the server frees every sequence) and waits for its end."""
        if self.closed:
            return
        self.closed = True
        self._requests.put(_END)
        for _ in self._call:
            pass

    def cancel(self) -> None:
        self.closed = True
        self._call.cancel()

    def __enter__(self) -> "BatchSession":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.cancel()
