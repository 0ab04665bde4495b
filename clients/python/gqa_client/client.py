"""``Client`` (blocking) and ``AsyncClient`` (asyncio): ``Decode`` streams, the stateless
``DecodeStep``, server information and health, over one channel with TLS and a token.

Shapes: a step's ``query`` is (B, Hq, D), ``new_key`` and ``new_value`` (B, Hkv, D). Tensors are
numpy arrays or torch tensors of the stream's dtype (``gqa_client.tensors`` has the rule and its
one exception); results come back of the query's kind.

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

from ._version import __version__
from .api import gqa_pb2, gqa_pb2_grpc
from .errors import CallFailed, GqaError, refusal
from .snapshot import Snapshot, as_snapshot
from .tensors import decode, dtype_name, encode_into, is_torch

__all__ = [
    "Client",
    "AsyncClient",
    "DecodeStream",
    "AsyncDecodeStream",
    "StepResult",
    "RollbackResult",
    "DecodeStepResult",
    "open_message",
    "channel_options",
    "POLICIES",
    "DEFAULT_CAPACITY",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MESSAGE_BYTES",
]

DEFAULT_MESSAGE_BYTES = 64 << 20
"""The channel's message limit, both ways: the server's default ``--max-message-bytes``."""
DEFAULT_CHUNK_BYTES = 4 << 20
"""Largest snapshot message asked for by default: gRPC's default receive limit everywhere."""
DEFAULT_CAPACITY = 4096
"""Tokens per layer a ``none`` stream (the default policy) keeps when no ``capacity`` is given."""
POLICIES: dict[str, int] = {
    "none": gqa_pb2.EVICTION_POLICY_NONE,
    "strict": gqa_pb2.EVICTION_POLICY_STRICT,
    "greedy": gqa_pb2.EVICTION_POLICY_GREEDY,
    "sink": gqa_pb2.EVICTION_POLICY_SINK,
}
"""Eviction policy name -> wire enum (docs/eviction.md)."""


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
    """The server's compute time for this step (append plus attention), in nanoseconds."""
    rollback_reach: int


@dataclasses.dataclass
class RollbackResult:
    """Per layer: tokens seen after the rollback, and how far back the next one can still go."""

    tokens_seen: list[int]
    rollback_reach: list[int]


@dataclasses.dataclass
class DecodeStepResult:
    """``output`` (B, Hq, D) and the caches with the new token appended (B, Hkv, S + 1, D)."""

    output: Any
    new_key_cache: Any
    new_value_cache: Any


# -- requests and replies (shared by both flavours) --------------------------------------------
def policy_fields(policy: str, window: int, capacity: int | None, sink_tokens: int) -> dict[str, int]:
    """The policy's wire fields; ``capacity=None`` is ``DEFAULT_CAPACITY`` for ``none`` and the
    server's default (the window) for ``greedy``. ``ValueError`` for an unknown policy name."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if capacity is None:
        capacity = DEFAULT_CAPACITY if policy == "none" else 0
    return dict(policy=POLICIES[policy], window=window, capacity=capacity, sink_tokens=sink_tokens)


def add_prefill(target, prefill: Mapping[int, tuple[Any, Any]] | None, dtype: str) -> None:
    """Adds ``prefill`` (layer -> (keys, values), each (B, Hkv, n, D)) to a message's ``prefill``."""
    for layer, (key, value) in (prefill or {}).items():
        cache = target.prefill.add(layer=layer)
        encode_into(cache.key, key, dtype, f"prefill[{layer}].key")
        encode_into(cache.value, value, dtype, f"prefill[{layer}].value")


def open_message(
    *,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    batch_size: int = 1,
    dtype="float32",
    policy: str = "none",
    window: int = 0,
    capacity: int | None = None,
    sink_tokens: int = 0,
    backend: str = "",
    prefill: Mapping[int, tuple[Any, Any]] | None = None,
) -> gqa_pb2.OpenStream:
    """An ``OpenStream`` (the arguments of ``Client.open``)."""
    name = dtype_name(dtype)
    message = gqa_pb2.OpenStream(
        backend=backend,
        dtype=gqa_pb2.DType.Value(f"DTYPE_{name.upper()}"),
        batch_size=batch_size,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        **policy_fields(policy, window, capacity, sink_tokens),
    )
    add_prefill(message, prefill, name)
    return message


def _step_request(rid: int, layer: int, query, new_key, new_value, dtype: str) -> gqa_pb2.DecodeRequest:
    request = gqa_pb2.DecodeRequest(request_id=rid)
    step = request.step
    step.layer = layer
    encode_into(step.query, query, dtype, "query")
    encode_into(step.new_key, new_key, dtype, "new_key")
    encode_into(step.new_value, new_value, dtype, "new_value")
    return request


def _rollback_request(rid: int, count: int, layer: int | None) -> gqa_pb2.DecodeRequest:
    rollback = gqa_pb2.Rollback(count=count, layer=layer or 0, all_layers=layer is None)
    return gqa_pb2.DecodeRequest(request_id=rid, rollback=rollback)


def _snapshot_request(rid: int, max_chunk_bytes: int) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(request_id=rid, snapshot=gqa_pb2.SnapshotRequest(max_chunk_bytes=max_chunk_bytes))


def _step_result(response: gqa_pb2.DecodeResponse, query) -> StepResult:
    if response.WhichOneof("kind") == "error":
        raise refusal(response.error)
    step = response.step
    if step.status.code:
        raise refusal(step.status)
    return StepResult(
        output=decode(step.output, query, "output"),
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
        raise refusal(response.error)
    result = response.rollback
    if result.status.code:
        raise refusal(result.status)
    return RollbackResult(list(result.tokens_seen), list(result.rollback_reach))


def _snapshot_chunk(response: gqa_pb2.DecodeResponse) -> gqa_pb2.SnapshotChunk:
    if response.WhichOneof("kind") == "error":
        raise refusal(response.error)
    if response.WhichOneof("kind") != "snapshot":
        raise GqaError(grpc.StatusCode.INTERNAL, f"expected a snapshot chunk, got {response.WhichOneof('kind')}")
    return response.snapshot


def _query_dtype(query) -> str:
    """The dtype a stateless step travels in: the query's own (float32 for float32 numpy data
    headed for a bfloat16 call must be asked for with ``dtype``)."""
    dtype = query.dtype
    try:
        return dtype_name(dtype)
    except ValueError:
        kind = "torch" if is_torch(query) else "numpy"
        raise TypeError(f"query: a {kind} {dtype} tensor; a step travels as float32, float16 or bfloat16") from None


def _decode_step_request(
    query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
) -> gqa_pb2.DecodeStepRequest:
    if not hasattr(query, "dtype"):
        raise TypeError(f"query: expected a numpy array or a torch tensor, got {type(query).__name__}")
    name = dtype_name(dtype) if dtype is not None else _query_dtype(query)
    request = gqa_pb2.DecodeStepRequest(
        num_query_heads=num_query_heads or (query.shape[1] if len(query.shape) == 3 else 0),
        num_kv_heads=num_kv_heads or (new_key.shape[1] if len(getattr(new_key, "shape", ())) == 3 else 0),
    )
    encode_into(request.query, query, name, "query")
    encode_into(request.new_key, new_key, name, "new_key")
    encode_into(request.new_value, new_value, name, "new_value")
    encode_into(request.key_cache, key_cache, name, "key_cache")
    encode_into(request.value_cache, value_cache, name, "value_cache")
    return request


def _decode_step_result(response: gqa_pb2.DecodeStepResponse, query) -> DecodeStepResult:
    return DecodeStepResult(
        decode(response.output, query, "output"),
        decode(response.new_key_cache, query, "new_key_cache"),
        decode(response.new_value_cache, query, "new_value_cache"),
    )


# grpc.health.v1 by hand (HealthCheckRequest {string service = 1}, HealthCheckResponse {enum
# status = 1}): two fields are not worth a dependency on grpcio-health-checking.
_HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_SERVING_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _health_request(service: str) -> bytes:
    data = service.encode()
    if not data:
        return b""
    size, n = bytearray(), len(data)
    while True:
        byte, n = n & 0x7F, n >> 7
        size.append(byte | (0x80 if n else 0))
        if not n:
            return b"\x0a" + bytes(size) + data


def _health_status(reply: bytes) -> str:
    status = 0
    if reply[:1] == b"\x08":  # field 1, varint; a status under 128 is one byte
        status = reply[1] if len(reply) > 1 else 0
    return _SERVING_STATUS[status] if status < len(_SERVING_STATUS) else str(status)


def _read_bytes(value: bytes | str | os.PathLike | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return pathlib.Path(value).read_bytes()


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
        self._health = self.channel.unary_unary(_HEALTH_METHOD)


# -- blocking flavour ----------------------------------------------------------------------------
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


class Client(_Base):
    """A blocking client over one channel.

    ``tls`` (or any certificate) selects TLS; ``root_certificates`` (PEM bytes or a path;
    default: the system's roots), ``certificate_chain`` and ``private_key`` for mutual TLS.
    ``token`` is sent as ``authorization: Bearer <token>`` on every call. ``max_message_bytes``
    sets both message limits of the channel; ``options`` adds or overrides channel options
    (e.g. ``("grpc.lb_policy_name", "round_robin")`` with a ``dns:///`` address). ``timeout``
    is the deadline of unary calls, in seconds (never of ``Decode`` streams or ``Batch`` sessions).
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
        return _health_status(self._unary(self._health, _health_request(service)))

    def decode_step(
        self,
        query,
        new_key,
        new_value,
        key_cache,
        value_cache,
        *,
        num_query_heads: int = 0,
        num_kv_heads: int = 0,
        dtype=None,
    ) -> DecodeStepResult:
        """The stateless operation: query (B, Hq, D), new key/value (B, Hkv, D), caches
        (B, Hkv, S, D). Head counts default to the shapes' (query and new_key dim 1); ``dtype``
        to the query's, and every tensor must have it."""
        request = _decode_step_request(
            query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
        )
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
        policy: str = "none",
        window: int = 0,
        capacity: int | None = None,
        sink_tokens: int = 0,
        backend: str = "",
        prefill: Mapping[int, tuple[Any, Any]] | None = None,
    ) -> DecodeStream:
        """Opens a ``Decode`` stream (``CallFailed`` if the server refuses it).

        ``policy`` (docs/eviction.md): ``none`` keeps every token up to ``capacity`` (default
        ``DEFAULT_CAPACITY``); ``strict`` keeps the last ``window``; ``greedy`` attends the last
        ``window`` and keeps up to ``capacity`` (default: the window); ``sink`` keeps the first
        ``sink_tokens`` and the last ``window``. ``dtype`` is a name, a torch or a numpy dtype;
        ``backend`` ``""`` is the server's default. ``prefill`` maps a layer to its (keys,
        values), each (B, Hkv, n, D) of the stream's dtype.
        """
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
        """Reopens a stream from a ``Snapshot``, its bytes, a file or its chunks, on this server."""
        chunks = as_snapshot(snapshot).chunks
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
        its token: a ``gqa_client.BatchSession``."""
        from .batch import BatchSession

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

    def __init__(self, call):
        self._call = call
        self._rid = 0
        self._closed = False
        self.opened: gqa_pb2.StreamOpened | None = None
        self.dtype: str | None = None

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
        self.dtype = dtype_name(self.opened.dtype)
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

    async def _send(self, request: gqa_pb2.DecodeRequest) -> None:
        if self._closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the stream is closed")
        try:
            await self._call.write(request)
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        except grpc.aio.UsageError:  # the RPC already ended; its status tells why
            self._closed = True
            raise CallFailed(await self._call.code(), await self._call.details() or "the stream ended") from None

    async def _reply(self, rid: int) -> gqa_pb2.DecodeResponse:
        response = await self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"reply to request {response.request_id}, expected {rid}")
        return response

    async def step(self, layer: int, query, new_key, new_value) -> StepResult:
        rid = self._rid + 1
        request = _step_request(rid, layer, query, new_key, new_value, self.dtype)
        await self._send(request)
        self._rid = rid
        return _step_result(await self._reply(rid), query)

    async def rollback(self, count: int, layer: int | None = None) -> RollbackResult:
        self._rid += 1
        await self._send(_rollback_request(self._rid, count, layer))
        return _rollback_result(await self._reply(self._rid))

    async def snapshot(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        self._rid += 1
        rid = self._rid
        await self._send(_snapshot_request(rid, max_chunk_bytes))
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

    async def wait_ready(self, timeout: float = 10.0) -> None:
        import asyncio

        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"no server at {self.address} after {timeout:g} s") from None

    async def server_info(self) -> gqa_pb2.GetServerInfoResponse:
        return await self._unary(self.stub.GetServerInfo, gqa_pb2.GetServerInfoRequest())

    async def health(self, service: str = "") -> str:
        return _health_status(await self._unary(self._health, _health_request(service)))

    async def decode_step(
        self,
        query,
        new_key,
        new_value,
        key_cache,
        value_cache,
        *,
        num_query_heads: int = 0,
        num_kv_heads: int = 0,
        dtype=None,
    ) -> DecodeStepResult:
        request = _decode_step_request(
            query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
        )
        return _decode_step_result(await self._unary(self.stub.DecodeStep, request), query)

    async def open(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        batch_size: int = 1,
        dtype="float32",
        policy: str = "none",
        window: int = 0,
        capacity: int | None = None,
        sink_tokens: int = 0,
        backend: str = "",
        prefill: Mapping[int, tuple[Any, Any]] | None = None,
    ) -> AsyncDecodeStream:
        """As ``Client.open``."""
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
        return await self.open_message(message)

    async def open_message(self, message: gqa_pb2.OpenStream) -> AsyncDecodeStream:
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, open=message)])

    async def restore(self, snapshot: Snapshot | bytes | str | os.PathLike) -> AsyncDecodeStream:
        chunks = as_snapshot(snapshot).chunks
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in chunks])

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
