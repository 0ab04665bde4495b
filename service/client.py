"""The Python client of gqa.v1: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from service.client import Client

    with Client("127.0.0.1:50051") as client:
        with client.open(num_query_heads=32, num_kv_heads=8, head_dim=128, num_layers=2,
                         policy="greedy", window=256) as stream:
            result = stream.step(0, query, new_key, new_value)   # torch tensors or numpy arrays
            result.output, result.tokens_seen, result.compute_ns
            snap = stream.snapshot()                              # a Snapshot; .save(path)
        with client.restore(snap) as again:                       # or Snapshot.load(path)
            ...

Shapes: ``query`` (B, Hq, D), ``new_key`` and ``new_value`` (B, Hkv, D); inputs are cast to the
stream's dtype and outputs come back as the query's kind (a numpy array for a numpy query,
float32 where numpy has no such dtype, i.e. bfloat16).

Errors: a step, rollback or snapshot the server refuses in-band raises a ``Refused`` subclass
(``InvalidArgument``, ``CacheFull``, ``InexactRollback``, ``ServerFault``) and the stream stays
open with its caches unchanged. A call the server ends with a gRPC status raises ``CallFailed``
(``.code``, a ``grpc.StatusCode``): UNAVAILABLE means reopen (or restore) the stream elsewhere.

The channel takes messages up to 64 MiB each way (the server's default limit; gRPC's own
default is 4 MiB), and snapshots ask for chunks of at most ``DEFAULT_CHUNK_BYTES`` (4 MiB), so
they fit any client's default limit. Long-lived ``Decode`` streams carry no deadline.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from . import __version__
from .api import gqa_pb2, gqa_pb2_grpc
from .tensors import from_proto, to_proto
from .vocab import DTYPE_TO_TORCH, TORCH_TO_DTYPE
from .vocab import NAME_TO_DTYPE as DTYPES
from .vocab import POLICY_ENUMS as POLICIES

__all__ = [
    "Client",
    "AsyncClient",
    "DecodeStream",
    "AsyncDecodeStream",
    "Snapshot",
    "StepResult",
    "RollbackResult",
    "DecodeStepResult",
    "GqaError",
    "Refused",
    "InvalidArgument",
    "CacheFull",
    "InexactRollback",
    "ServerFault",
    "CallFailed",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MESSAGE_BYTES",
]

DEFAULT_MESSAGE_BYTES = 64 << 20
"""The channel's message limit, both ways: the server's default ``--max-message-bytes``."""
DEFAULT_CHUNK_BYTES = 4 << 20
"""Largest snapshot message asked for by default: gRPC's default receive limit everywhere."""


# -- errors --------------------------------------------------------------------------------------
class GqaError(Exception):
    """Anything this client raises about a call; ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Refused(GqaError):
    """Refused in-band: the stream is still open and its caches are exactly as before."""


class InvalidArgument(Refused):
    """A step's shape, dtype or byte length, or a layer out of range."""


class CacheFull(Refused):
    """No room left under policy ``none`` (RESOURCE_EXHAUSTED)."""


class InexactRollback(Refused):
    """The rollback would need evicted tokens back (FAILED_PRECONDITION); the message says how
    far back an exact rollback is possible."""


class ServerFault(Refused):
    """A fault in the server while computing this request (INTERNAL)."""


class CallFailed(GqaError):
    """The RPC ended with a gRPC status (a refused open, the server draining, a lost connection,
    the idle timeout...). For a ``Decode`` stream, the stream and its caches are gone."""

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "CallFailed":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_REFUSALS = {3: InvalidArgument, 8: CacheFull, 9: InexactRollback, 13: ServerFault}


def _refusal(status: gqa_pb2.Status) -> Refused:
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _REFUSALS.get(status.code, Refused)(code, status.message)


# -- results -------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepResult:
    """One step's reply. ``output`` is (B, Hq, D), of the query's kind."""

    output: Any
    layer: int
    tokens_seen: int
    resident: int
    first_position: int
    last_position: int
    evicted: bool
    evicted_tokens: int
    compute_ns: int
    """The server's compute time for this step (append plus attention)."""
    rollback_reach: int


@dataclasses.dataclass
class RollbackResult:
    tokens_seen: list[int]
    rollback_reach: list[int]


@dataclasses.dataclass
class DecodeStepResult:
    output: Any
    new_key_cache: Any
    new_value_cache: Any


# -- tensors -------------------------------------------------------------------------------------
def _torch_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, int):
        return DTYPE_TO_TORCH[dtype]
    return DTYPE_TO_TORCH[DTYPES[str(dtype)]]


def _as_torch(value, dtype: torch.dtype | None, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    else:
        try:
            tensor = torch.as_tensor(value, dtype=dtype or torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name}: expected a torch tensor, numpy array or nested list ({exc})") from None
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def _tensor(value, dtype, name: str) -> gqa_pb2.Tensor:
    return to_proto(_as_torch(value, dtype, name))


def _like(message: gqa_pb2.Tensor, template, name: str):
    tensor = from_proto(message, name)
    if isinstance(template, np.ndarray):
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    return tensor


def _read_bytes(value: bytes | str | os.PathLike | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return pathlib.Path(value).read_bytes()


# -- snapshots -----------------------------------------------------------------------------------
_MAGIC = b"GQASNAP1"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Snapshot:
    """A stream's complete state as the server sent it: ``SnapshotChunk`` messages in order.

    ``to_bytes`` / ``save`` write the 8 bytes ``GQASNAP1`` and then every chunk as a
    length-delimited message (a varint length, then the bytes: Java's ``writeDelimitedTo``,
    Go's ``protodelim``), so any language can read it back. Restoring takes the chunks as they
    are; the server checks their CRC-32.
    """

    def __init__(self, chunks: Sequence[gqa_pb2.SnapshotChunk]):
        if not chunks or not chunks[-1].last:
            raise ValueError("a snapshot needs its chunks up to the one with `last` set")
        self.chunks = list(chunks)

    @property
    def config(self) -> gqa_pb2.OpenStream:
        return self.chunks[0].config

    @property
    def tokens_seen(self) -> list[int]:
        return list(self.chunks[0].tokens_seen)

    def to_bytes(self) -> bytes:
        parts = [_MAGIC]
        for chunk in self.chunks:
            data = chunk.SerializeToString()
            parts += [_varint(len(data)), data]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Snapshot":
        view = memoryview(data)
        if bytes(view[:8]) != _MAGIC:
            raise ValueError("not a gqa-serve snapshot (it does not start with GQASNAP1)")
        chunks, pos = [], 8
        while pos < len(view):
            size = shift = 0
            while True:
                if pos >= len(view):
                    raise ValueError("truncated snapshot")
                byte = view[pos]
                pos += 1
                size |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            if pos + size > len(view):
                raise ValueError("truncated snapshot")
            chunks.append(gqa_pb2.SnapshotChunk.FromString(bytes(view[pos : pos + size])))
            pos += size
        return cls(chunks)

    def save(self, path: str | os.PathLike) -> None:
        pathlib.Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Snapshot":
        return cls.from_bytes(pathlib.Path(path).read_bytes())

    def __len__(self) -> int:
        return len(self.chunks)


def _as_snapshot(snapshot) -> Snapshot:
    if isinstance(snapshot, Snapshot):
        return snapshot
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        return Snapshot.from_bytes(bytes(snapshot))
    if isinstance(snapshot, (str, os.PathLike)):
        return Snapshot.load(snapshot)
    return Snapshot(list(snapshot))


# -- requests and replies (shared by both flavours) --------------------------------------------
def open_message(
    *,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    batch_size: int = 1,
    dtype="float32",
    policy="none",
    window: int = 0,
    capacity: int = 0,
    sink_tokens: int = 0,
    backend: str = "",
    prefill: Mapping[int, tuple[Any, Any]] | None = None,
) -> gqa_pb2.OpenStream:
    """An ``OpenStream``; ``prefill`` maps a layer to its (key, value), each (B, Hkv, n, D)."""
    torch_dtype = _torch_dtype(dtype)
    message = gqa_pb2.OpenStream(
        backend=backend,
        dtype=TORCH_TO_DTYPE[torch_dtype],
        batch_size=batch_size,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        policy=POLICIES[policy] if isinstance(policy, str) else policy,
        window=window,
        capacity=capacity,
        sink_tokens=sink_tokens,
    )
    for layer, (key, value) in (prefill or {}).items():
        message.prefill.add(
            layer=layer,
            key=_tensor(key, torch_dtype, f"prefill[{layer}].key"),
            value=_tensor(value, torch_dtype, f"prefill[{layer}].value"),
        )
    return message


def _step_request(rid: int, layer: int, query, new_key, new_value, dtype) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(
        request_id=rid,
        step=gqa_pb2.Step(
            layer=layer,
            query=_tensor(query, dtype, "query"),
            new_key=_tensor(new_key, dtype, "new_key"),
            new_value=_tensor(new_value, dtype, "new_value"),
        ),
    )


def _rollback_request(rid: int, count: int, layer: int | None) -> gqa_pb2.DecodeRequest:
    rollback = gqa_pb2.Rollback(count=count, layer=layer or 0, all_layers=layer is None)
    return gqa_pb2.DecodeRequest(request_id=rid, rollback=rollback)


def _step_result(response: gqa_pb2.DecodeResponse, query) -> StepResult:
    if response.WhichOneof("kind") == "error":
        raise _refusal(response.error)
    step = response.step
    if step.status.code:
        raise _refusal(step.status)
    return StepResult(
        output=_like(step.output, query, "output"),
        layer=step.layer,
        tokens_seen=step.tokens_seen,
        resident=step.resident,
        first_position=step.first_position,
        last_position=step.last_position,
        evicted=step.evicted,
        evicted_tokens=step.evicted_tokens,
        compute_ns=step.compute_ns,
        rollback_reach=step.rollback_reach,
    )


def _rollback_result(response: gqa_pb2.DecodeResponse) -> RollbackResult:
    if response.WhichOneof("kind") == "error":
        raise _refusal(response.error)
    result = response.rollback
    if result.status.code:
        raise _refusal(result.status)
    return RollbackResult(list(result.tokens_seen), list(result.rollback_reach))


def _snapshot_chunk(response: gqa_pb2.DecodeResponse) -> gqa_pb2.SnapshotChunk:
    if response.WhichOneof("kind") == "error":
        raise _refusal(response.error)
    if response.WhichOneof("kind") != "snapshot":
        raise GqaError(grpc.StatusCode.INTERNAL, f"expected a snapshot chunk, got {response.WhichOneof('kind')}")
    return response.snapshot


def _decode_step_request(query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads):
    q = _as_torch(query, None, "query")
    if q.dtype not in TORCH_TO_DTYPE or q.dtype == torch.int8:  # e.g. numpy's float64 default
        q = q.to(torch.float32)
    dtype = q.dtype
    k = _as_torch(new_key, dtype, "new_key")
    return gqa_pb2.DecodeStepRequest(
        query=to_proto(q),
        new_key=to_proto(k),
        new_value=_tensor(new_value, dtype, "new_value"),
        key_cache=_tensor(key_cache, dtype, "key_cache"),
        value_cache=_tensor(value_cache, dtype, "value_cache"),
        num_query_heads=num_query_heads or (q.shape[1] if q.dim() == 3 else 0),
        num_kv_heads=num_kv_heads or (k.shape[1] if k.dim() == 3 else 0),
    )


def _decode_step_result(response: gqa_pb2.DecodeStepResponse, query) -> DecodeStepResult:
    return DecodeStepResult(
        _like(response.output, query, "output"),
        _like(response.new_key_cache, query, "new_key_cache"),
        _like(response.new_value_cache, query, "new_value_cache"),
    )


def _credentials(tls: bool, root_certificates, certificate_chain, private_key):
    if not (tls or root_certificates or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(
        _read_bytes(root_certificates), _read_bytes(private_key), _read_bytes(certificate_chain)
    )


def channel_options(
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES, options: Iterable[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """Message limits both ways, a user agent, then ``options`` (which win)."""
    base = {
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.primary_user_agent": f"gqa-serve-python/{__version__}",
    }
    base.update(dict(options))
    return list(base.items())


class _Base:
    """Connection settings and the channel, shared by both flavours; ``_grpc`` is the flavour's
    channel module (``grpc`` or ``grpc.aio``)."""

    _grpc = grpc

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        tls: bool = False,
        root_certificates=None,
        certificate_chain=None,
        private_key=None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        options: Iterable[tuple[str, Any]] = (),
        timeout: float | None = 30.0,
    ):
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._options = channel_options(max_message_bytes, options)
        self._credentials = _credentials(tls, root_certificates, certificate_chain, private_key)
        if self._credentials is None:
            self.channel = self._grpc.insecure_channel(address, options=self._options)
        else:
            self.channel = self._grpc.secure_channel(address, self._credentials, options=self._options)
        self.stub = gqa_pb2_grpc.AttentionServiceStub(self.channel)


# -- blocking flavour ----------------------------------------------------------------------------
_END = object()


class DecodeStream:
    """One ``Decode`` stream: each call sends one request and waits for its reply.

    Use as a context manager, or call ``close`` (which frees the server's caches).
    """

    def __init__(self, stub: gqa_pb2_grpc.AttentionServiceStub, first: Sequence[gqa_pb2.DecodeRequest], metadata=None):
        self._requests: queue.Queue = queue.Queue()
        for request in first:
            self._requests.put(request)
        self._call = stub.Decode(iter(self._requests.get, _END), metadata=metadata)
        self._rid = 0
        self._closed = False
        try:
            self.opened: gqa_pb2.StreamOpened = self._next().opened
        except BaseException:
            self._requests.put(_END)
            raise
        self.dtype = DTYPE_TO_TORCH[self.opened.dtype]

    def _next(self) -> gqa_pb2.DecodeResponse:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        except StopIteration:
            self._closed = True
            raise CallFailed(grpc.StatusCode.UNKNOWN, "the server ended the stream") from None

    def _send(self, build) -> int:
        if self._closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the stream is closed")
        self._rid += 1
        self._requests.put(build(self._rid))
        return self._rid

    def _reply(self, rid: int) -> gqa_pb2.DecodeResponse:
        response = self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"reply to request {response.request_id}, expected {rid}")
        return response

    def step(self, layer: int, query, new_key, new_value) -> StepResult:
        """Appends one token to ``layer`` and attends: query (B, Hq, D), new key/value (B, Hkv, D)."""
        rid = self._send(lambda rid: _step_request(rid, layer, query, new_key, new_value, self.dtype))
        return _step_result(self._reply(rid), query)

    def rollback(self, count: int, layer: int | None = None) -> RollbackResult:
        """Drops the last ``count`` tokens of ``layer`` (of every layer when None)."""
        rid = self._send(lambda rid: _rollback_request(rid, count, layer))
        return _rollback_result(self._reply(rid))

    def snapshot(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        """The stream's state, in messages of at most ``max_chunk_bytes`` each."""
        rid = self._send(
            lambda rid: gqa_pb2.DecodeRequest(
                request_id=rid, snapshot=gqa_pb2.SnapshotRequest(max_chunk_bytes=max_chunk_bytes)
            )
        )
        chunks = [_snapshot_chunk(self._reply(rid))]
        while not chunks[-1].last:
            chunks.append(_snapshot_chunk(self._reply(rid)))
        return Snapshot(chunks)

    def close(self) -> None:
        """Half-closes the stream and waits for its end; the server frees its caches."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_END)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise CallFailed.from_rpc(exc) from None

    def cancel(self) -> None:
        """Ends the stream at once (the server frees its caches)."""
        self._closed = True
        self._call.cancel()
        self._requests.put(_END)

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.cancel()


class Client(_Base):
    """A blocking client over one channel.

    ``tls`` (or any certificate) selects TLS; ``root_certificates`` (PEM bytes or a path;
    default: the system's roots), ``certificate_chain`` and ``private_key`` for mutual TLS.
    ``token`` is sent as ``authorization: Bearer <token>`` on every call. ``max_message_bytes``
    sets both message limits of the channel; ``options`` adds or overrides channel options
    (e.g. ``("grpc.lb_policy_name", "round_robin")`` with a ``dns:///`` address). ``timeout``
    is the deadline of unary calls (never of ``Decode`` streams).
    """

    def _unary(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise CallFailed.from_rpc(exc) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel connects; ``CallFailed`` (UNAVAILABLE) if it does not in time."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"no server at {self.address} after {timeout:g} s") from None

    def server_info(self) -> gqa_pb2.GetServerInfoResponse:
        return self._unary(self.stub.GetServerInfo, gqa_pb2.GetServerInfoRequest())

    def health(self, service: str = "") -> str:
        """``SERVING`` or ``NOT_SERVING`` (``""``: the server; ``gqa.v1.AttentionService``)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        response = self._unary(
            health_pb2_grpc.HealthStub(self.channel).Check, health_pb2.HealthCheckRequest(service=service)
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def decode_step(
        self, query, new_key, new_value, key_cache, value_cache, *, num_query_heads: int = 0, num_kv_heads: int = 0
    ) -> DecodeStepResult:
        """The stateless operation; head counts default to the shapes' (query and new_key dim 1)."""
        request = _decode_step_request(query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads)
        return _decode_step_result(self._unary(self.stub.DecodeStep, request), query)

    def open(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        batch_size: int = 1,
        dtype="float32",
        policy="none",
        window: int = 0,
        capacity: int = 0,
        sink_tokens: int = 0,
        backend: str = "",
        prefill=None,
    ) -> DecodeStream:
        """Opens a ``Decode`` stream (``CallFailed`` if the server refuses it). ``policy`` is
        ``none`` (needs ``capacity``), ``strict``, ``greedy`` or ``sink`` (need ``window``);
        see docs/eviction.md."""
        message = open_message(
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            batch_size=batch_size,
            dtype=dtype,
            policy=policy,
            window=window,
            capacity=capacity,
            sink_tokens=sink_tokens,
            backend=backend,
            prefill=prefill,
        )
        return self.open_message(message)

    def open_message(self, message: gqa_pb2.OpenStream) -> DecodeStream:
        return DecodeStream(self.stub, [gqa_pb2.DecodeRequest(request_id=0, open=message)], self.metadata)

    def restore(self, snapshot: Snapshot | bytes | str | os.PathLike) -> DecodeStream:
        """Reopens a stream from a ``Snapshot``, its bytes or a file, on this server."""
        chunks = _as_snapshot(snapshot).chunks
        return DecodeStream(self.stub, [gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in chunks], self.metadata)

    def batch(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype="float32",
        backend: str = "",
    ):
        """Opens a ``Batch`` session (many sequences per message) on this client's channel, with
        its token; see ``service.client_batch.BatchSession`` for add, step, remove, rollback and
        snapshot."""
        from .client_batch import BatchSession

        return BatchSession(
            self.stub,
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            dtype=dtype,
            backend=backend,
            metadata=self.metadata,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- asyncio flavour -----------------------------------------------------------------------------
class AsyncDecodeStream:
    """``DecodeStream`` for asyncio: the same methods, awaited."""

    def __init__(self, call, dtype: torch.dtype | None = None):
        self._call = call
        self._rid = 0
        self._closed = False
        self.opened: gqa_pb2.StreamOpened | None = None
        self.dtype = dtype

    async def _start(self, first: Sequence[gqa_pb2.DecodeRequest]) -> "AsyncDecodeStream":
        try:
            for request in first:
                await self._call.write(request)
            self.opened = (await self._next()).opened
        except grpc.RpcError as exc:
            self._call.cancel()
            raise CallFailed.from_rpc(exc) from None
        except BaseException:
            self._call.cancel()
            raise
        self.dtype = DTYPE_TO_TORCH[self.opened.dtype]
        return self

    async def _next(self) -> gqa_pb2.DecodeResponse:
        try:
            response = await self._call.read()
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        if response is grpc.aio.EOF:
            self._closed = True
            code = await self._call.code()
            raise CallFailed(
                code if code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                await self._call.details() or "the server ended the stream",
            )
        return response

    async def _send(self, request_for) -> int:
        if self._closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the stream is closed")
        self._rid += 1
        try:
            await self._call.write(request_for(self._rid))
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        except grpc.aio.UsageError:  # the RPC already ended; its status tells why
            self._closed = True
            raise CallFailed(await self._call.code(), await self._call.details() or "the stream ended") from None
        return self._rid

    async def _reply(self, rid: int) -> gqa_pb2.DecodeResponse:
        response = await self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"reply to request {response.request_id}, expected {rid}")
        return response

    async def step(self, layer: int, query, new_key, new_value) -> StepResult:
        rid = await self._send(lambda rid: _step_request(rid, layer, query, new_key, new_value, self.dtype))
        return _step_result(await self._reply(rid), query)

    async def rollback(self, count: int, layer: int | None = None) -> RollbackResult:
        rid = await self._send(lambda rid: _rollback_request(rid, count, layer))
        return _rollback_result(await self._reply(rid))

    async def snapshot(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        rid = await self._send(
            lambda rid: gqa_pb2.DecodeRequest(
                request_id=rid, snapshot=gqa_pb2.SnapshotRequest(max_chunk_bytes=max_chunk_bytes)
            )
        )
        chunks = [_snapshot_chunk(await self._reply(rid))]
        while not chunks[-1].last:
            chunks.append(_snapshot_chunk(await self._reply(rid)))
        return Snapshot(chunks)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise CallFailed.from_rpc(exc) from None

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncDecodeStream":
        return self

    async def __aexit__(self, *exc) -> None:
        if exc[0] is None:
            await self.close()
        else:
            self.cancel()


class AsyncClient(_Base):
    """``Client`` for asyncio (``grpc.aio``); the same arguments. Create it inside the loop."""

    _grpc = grpc.aio

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise CallFailed.from_rpc(exc) from None

    async def server_info(self) -> gqa_pb2.GetServerInfoResponse:
        return await self._unary(self.stub.GetServerInfo, gqa_pb2.GetServerInfoRequest())

    async def decode_step(
        self, query, new_key, new_value, key_cache, value_cache, *, num_query_heads: int = 0, num_kv_heads: int = 0
    ) -> DecodeStepResult:
        request = _decode_step_request(query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads)
        return _decode_step_result(await self._unary(self.stub.DecodeStep, request), query)

    async def open(self, **kwargs) -> AsyncDecodeStream:
        """As ``Client.open``."""
        return await self.open_message(open_message(**kwargs))

    async def open_message(self, message: gqa_pb2.OpenStream) -> AsyncDecodeStream:
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, open=message)])

    async def restore(self, snapshot: Snapshot | bytes | str | os.PathLike) -> AsyncDecodeStream:
        chunks = _as_snapshot(snapshot).chunks
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in chunks])

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
