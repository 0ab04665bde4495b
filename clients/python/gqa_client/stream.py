"""The blocking ``Decode`` stream: one request sent, its reply awaited, per call.

Errors: a step, rollback or snapshot the server refuses in-band raises a ``Refused`` subclass
and the stream stays open with its caches unchanged. A call the server ends with a gRPC status
raises ``CallFailed`` (``.code``, a ``grpc.StatusCode``): UNAVAILABLE means reopen (or restore)
the stream elsewhere. Snapshots ask for chunks of at most ``DEFAULT_CHUNK_BYTES`` (4 MiB), so
they fit any client's default limit. The stream carries no deadline.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import grpc

from .api import gqa_pb2, gqa_pb2_grpc
from .errors import CallFailed, GqaError
from .messages import (
    DEFAULT_CHUNK_BYTES,
    RollbackResult,
    StepResult,
    _rollback_request,
    _rollback_result,
    _snapshot_chunk,
    _snapshot_request,
    _step_request,
    _step_result,
)
from .snapshot import Snapshot
from .tensors import dtype_name

__all__ = ["DecodeStream"]

_END = object()


class _QueuedCall:
    """A blocking bidirectional call fed from a request queue (gRPC's sending thread reads it):
    the plumbing ``DecodeStream`` and ``batch.BatchSession`` share. ``closed`` once the call
    ended or was ended; ``_what`` names it in errors ("stream", "session")."""

    _what = "stream"
    closed = False

    def _start(self, method, first: Sequence, **kwargs):
        """Starts ``method`` with ``first`` queued; the first reply (``CallFailed`` if none)."""
        self._requests: queue.Queue = queue.Queue()
        for request in first:
            self._requests.put(request)
        self._call = method(iter(self._requests.get, _END), **kwargs)
        try:
            return self._next()
        except BaseException:
            self._requests.put(_END)
            raise

    def _next(self):
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            self.closed = True
            raise CallFailed.from_rpc(exc) from None
        except StopIteration:
            self.closed = True
            raise CallFailed(grpc.StatusCode.UNKNOWN, f"the server ended the {self._what}") from None

    def close(self) -> None:
        """Half-closes the call and waits for its end; the server frees its caches."""
        if self.closed:
            return
        self.closed = True
        self._requests.put(_END)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise CallFailed.from_rpc(exc) from None

    def cancel(self) -> None:
        """Ends the call at once (the server frees its caches)."""
        self.closed = True
        self._call.cancel()
        self._requests.put(_END)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.cancel()


class DecodeStream(_QueuedCall):
    """One ``Decode`` stream: each call sends one request and waits for its reply.

    ``opened`` is the server's ``StreamOpened`` (stream id, backend, policy, capacity, bytes
    reserved, tokens seen); ``dtype`` the stream's dtype name. Use as a context manager, or call
    ``close`` (which frees the server's caches).
    """

    def __init__(self, stub: gqa_pb2_grpc.AttentionServiceStub, first: Sequence[gqa_pb2.DecodeRequest], metadata=None):
        self._rid = 0
        self.opened: gqa_pb2.StreamOpened = self._start(stub.Decode, first, metadata=metadata).opened
        self.dtype: str = dtype_name(self.opened.dtype)

    def _send(self, request: gqa_pb2.DecodeRequest) -> None:
        if self.closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the stream is closed")
        self._requests.put(request)

    def _reply(self, rid: int) -> gqa_pb2.DecodeResponse:
        response = self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"reply to request {response.request_id}, expected {rid}")
        return response

    def step(self, layer: int, query, new_key, new_value) -> StepResult:
        """Appends one token to ``layer`` and attends: query (B, Hq, D), new key/value (B, Hkv, D).
        ``TypeError`` (nothing sent) for a tensor not of the stream's dtype."""
        rid = self._rid + 1
        request = _step_request(rid, layer, query, new_key, new_value, self.dtype)
        self._send(request)
        self._rid = rid
        return _step_result(self._reply(rid), query)

    def rollback(self, count: int, layer: int | None = None) -> RollbackResult:
        """Drops the last ``count`` tokens of ``layer`` (of every layer when None)."""
        self._rid += 1
        self._send(_rollback_request(self._rid, count, layer))
        return _rollback_result(self._reply(self._rid))

    def snapshot(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        """The stream's state, in messages of at most ``max_chunk_bytes`` each."""
        self._rid += 1
        rid = self._rid
        self._send(_snapshot_request(rid, max_chunk_bytes))
        chunks = [_snapshot_chunk(self._reply(rid))]
        while not chunks[-1].last:
            chunks.append(_snapshot_chunk(self._reply(rid)))
        return Snapshot(chunks)
