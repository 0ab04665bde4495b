"""The gqa.v1 servicer: protobuf in, engine calls, protobuf out (sessions and batching delegated, below).

Errors: ``ServiceError`` carries its code; in a stream, a refused step/rollback/snapshot is
answered in-band and the stream goes on; a broken protocol, a refused open, the idle timeout
and shutdown end the RPC with a status (``_abort``, the one place exceptions become statuses).
Any other exception becomes INTERNAL with a fixed message (the traceback goes to the log, never
to the client). Only validation says INVALID_ARGUMENT: what a backend raises while computing
is INTERNAL (``service.engine.batcher.classify_step_error``).

A Decode stream's session (read-ahead, back-pressure, forced close) is ``service.transport.session``;
its steps go to the engine's batcher (``service.engine.batcher``) after integer checks against the
stream's shapes, and come back as reply messages built on the compute worker. Opens and
restores are admitted here (cheap) and built on the pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import grpc
import torch

from .. import __version__
from ..api import gqa_pb2, gqa_pb2_grpc
from ..config import ServerConfig
from ..engine import snapshot
from ..engine.engine import Admission, Engine, Stream
from ..engine.report import StepReport, classify_step_error
from ..engine.tensors import from_proto, to_proto
from ..errors import InvalidArgument, ServiceError
from ..vocab import (
    DTYPE_NAMES,
    NAME_TO_DTYPE,
    POLICY_ENUMS,
    POLICY_NAMES,
    TORCH_DTYPES,
    TORCH_TO_DTYPE,
)
from . import batch_rpc
from .security import malformed_request
from .session import EOF, StreamClosed, StreamSession
from .wire import DecodeStepLayout, read_decode_step, varint

__all__ = ["AttentionServicer", "POLICY_NAMES"]

log = logging.getLogger("gqa.servicer")

_OK = gqa_pb2.Status(code=0)


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code)


async def _abort(context, exc: BaseException, what: str, internal: str = "internal error; the stream was closed"):
    """The one place an exception becomes an RPC's status: a ``ServiceError`` its own code and
    message; anything else INTERNAL with a fixed message, the traceback to the log only."""
    if isinstance(exc, ServiceError):
        await context.abort(_status(exc.code), exc.message)
    log.error("%s: unexpected failure", what, exc_info=(type(exc), exc, exc.__traceback__))
    await context.abort(grpc.StatusCode.INTERNAL, internal)


class _StepShape:
    """What a stream's step tensors must be, as the integers the wire carries: checked with
    integer comparisons, no tensor built on the event loop."""

    __slots__ = ("dtype", "q_shape", "kv_shape", "q_bytes", "kv_bytes", "out_shape", "layers", "layout")

    def __init__(self, stream: Stream):
        c = stream.config
        itemsize = torch.empty((), dtype=TORCH_DTYPES[c.dtype]).element_size()
        self.dtype = NAME_TO_DTYPE[c.dtype]
        self.q_shape = (c.batch_size, c.num_query_heads, c.head_dim)
        self.kv_shape = (c.batch_size, c.num_kv_heads, c.head_dim)
        self.q_bytes = c.batch_size * c.num_query_heads * c.head_dim * itemsize
        self.kv_bytes = c.batch_size * c.num_kv_heads * c.head_dim * itemsize
        self.out_shape = self.q_shape
        self.layers = c.num_layers
        # The stream's step requests as the runtimes encode them: read by checking prefixes
        self.layout = DecodeStepLayout(self.dtype, self.q_shape, self.kv_shape, self.q_bytes, self.kv_bytes)

    def matches(self, step) -> bool:
        q, k, v = step.query, step.new_key, step.new_value
        return (
            q.dtype == self.dtype
            and k.dtype == self.dtype
            and v.dtype == self.dtype
            and len(q.data) == self.q_bytes
            and len(k.data) == self.kv_bytes
            and len(v.data) == self.kv_bytes
            and tuple(q.shape) == self.q_shape
            and tuple(k.shape) == self.kv_shape
            and tuple(v.shape) == self.kv_shape
        )


def _parse(raw: bytes) -> gqa_pb2.DecodeRequest:
    """A Decode request's bytes as a message (every kind but the common step, which
    ``wire.read_decode_step`` reads); ``InvalidArgument`` when they are not one."""
    try:
        return gqa_pb2.DecodeRequest.FromString(raw)
    except Exception:
        raise malformed_request("Decode") from None


class AttentionServicer(gqa_pb2_grpc.AttentionServiceServicer):
    def __init__(self, engine: Engine, config: ServerConfig, pool: concurrent.futures.Executor):
        self.engine = engine
        self.config = config
        self.pool = pool
        self._backend_infos = None
        self.sessions = 0  # Decode RPCs past their open, not yet ended
        self._no_sessions = asyncio.Event()
        self._no_sessions.set()

    async def sessions_ended(self) -> None:
        """Returns once no Decode RPC is running (drain waits for steps in flight)."""
        await self._no_sessions.wait()

    # -- DecodeStep -------------------------------------------------------------------------
    async def DecodeStep(self, request, context):
        try:
            args = _stateless_args(request)
            cost = len(request.key_cache.data) + len(request.value_cache.data)
            result = await self.engine.offload(cost, self.engine.stateless_step, *args)
            return gqa_pb2.DecodeStepResponse(
                output=to_proto(result["output"]),
                new_key_cache=to_proto(result["new_key_cache"]),
                new_value_cache=to_proto(result["new_value_cache"]),
            )
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort(context, exc, "DecodeStep", "internal error")

    # -- GetServerInfo ----------------------------------------------------------------------
    async def backend_infos(self) -> list:
        """Every backend's capabilities or reasons, probed once per process and off the event
        loop: probing imports optional modules (bitsandbytes, triton), which takes seconds."""
        if self._backend_infos is None:
            self._backend_infos = await asyncio.get_running_loop().run_in_executor(
                self.pool, self.engine.describe_backends
            )
        return self._backend_infos

    async def GetServerInfo(self, request, context):
        c = self.config
        backends = []
        for info in await self.backend_infos():
            caps = info.capabilities
            backends.append(
                gqa_pb2.BackendInfo(
                    name=info.name,
                    available=info.available,
                    reasons=info.reasons,
                    dtypes=[TORCH_TO_DTYPE[d] for d in caps.dtypes if d in TORCH_TO_DTYPE] if caps else [],
                    devices=list(caps.devices) if caps else [],
                    max_head_dim=min(caps.max_head_dim, c.max_head_dim) if caps else 0,
                )
            )
        return gqa_pb2.GetServerInfoResponse(
            version=__version__,
            default_backend=c.backend,
            default_dtype=NAME_TO_DTYPE[c.dtype],
            backends=backends,
            limits=gqa_pb2.Limits(
                max_streams=c.max_streams,
                max_cache_bytes=c.max_cache_bytes,
                max_capacity=c.max_capacity,
                max_layers=c.max_layers,
                max_heads=c.max_heads,
                max_head_dim=c.max_head_dim,
                max_batch_size=c.max_batch_size,
                max_message_bytes=c.max_message_bytes,
                idle_timeout_seconds=c.idle_timeout_s,
                max_queued_steps=c.max_queued_steps,
                cache_bytes_in_use=self.engine.bytes_in_use(),
                active_streams=self.engine.active_streams,
            ),
        )

    # -- Batch (service.transport.batch_rpc) -----------------------------------------------------------
    async def Batch(self, request_iterator, context):
        async for reply in batch_rpc.serve(self.engine, self.config, context):
            yield reply

    # Batch reads its requests as bytes (step messages without copying their tensors; see
    # service.transport.wire); the status interceptor gives it no deserializer.
    Batch.raw_requests = True

    # -- Decode -----------------------------------------------------------------------------
    async def Decode(self, request_iterator, context):
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        try:
            first = _parse(first)
        except ServiceError as exc:
            await _abort(context, exc, "Decode open")
        kind = first.WhichOneof("kind")
        if kind not in ("open", "restore"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message of a Decode stream must be `open` or `restore`"
            )
        try:
            if kind == "open":
                stream = await self._open(first.open)
            else:
                stream = await self._restore(first, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort(context, exc, "Decode open")

        session = StreamSession(
            self.engine,
            stream,
            context.read,
            grpc.aio.EOF,
            len,
            max_steps=self.config.max_queued_steps,
            max_bytes=self.config.max_queued_bytes,
        )
        shape = _StepShape(stream)
        self.sessions += 1
        self._no_sessions.clear()
        reason = "client"
        try:
            session.start()
            session.begin_write()
            yield gqa_pb2.DecodeResponse(request_id=first.request_id, opened=self._opened(stream))
            session.end_write()
            while True:
                raw = await session.next()
                if raw is EOF:
                    break
                # the hot path: read from the bytes (the stream's layout, else field by field)
                fast = shape.layout.read(raw) or read_decode_step(raw)
                if fast is not None:
                    response = await self._step(stream, shape, fast[1], fast[0])
                    session.begin_write()
                    yield response
                    session.end_write()
                    continue
                request = _parse(raw)
                if request.HasField("step"):
                    response = await self._step(stream, shape, request.step, request.request_id)
                    session.begin_write()
                    yield response
                    session.end_write()
                    continue
                async for response in self._handle(stream, shape, request, context):
                    session.begin_write()
                    yield response
                    session.end_write()
        except StreamClosed as closed:
            reason = "forced"
            self.engine.close(stream, reason)
            await context.abort(_status(closed.error.code), closed.error.message)
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # a request that does not parse, found by the read-ahead; or a fault
            await _abort(context, exc, f"stream {stream.id}")
        finally:
            session.close()
            self.engine.close(stream, reason)
            self.sessions -= 1
            if not self.sessions:
                self._no_sessions.set()

    # Decode reads its requests as bytes too: a step is read by service.transport.wire (its tensors views
    # of the request), anything else parsed here by the runtime; its step replies are bytes.
    Decode.raw_requests = True

    def _stream_config(self, request: gqa_pb2.OpenStream):
        if request.dtype and request.dtype not in DTYPE_NAMES:
            raise InvalidArgument(f"open.dtype: {request.dtype} is not a known DType")
        if request.policy not in POLICY_NAMES:
            raise InvalidArgument(
                f"open.policy: {request.policy} is not one of EVICTION_POLICY_NONE, _STRICT, _GREEDY, _SINK"
            )
        return self.engine.stream_config(
            backend=request.backend,
            dtype=DTYPE_NAMES.get(request.dtype, ""),
            batch_size=request.batch_size,
            num_query_heads=request.num_query_heads,
            num_kv_heads=request.num_kv_heads,
            head_dim=request.head_dim,
            num_layers=request.num_layers,
            policy=POLICY_NAMES[request.policy],
            window=request.window,
            capacity=request.capacity,
            sink_tokens=request.sink_tokens,
        )

    async def _build(self, admission: Admission, prefill=None, layers_of=None) -> Stream:
        return await self.engine.build_async(admission, prefill, layers_of)

    async def _open(self, request: gqa_pb2.OpenStream) -> Stream:
        with self.engine.counting_open_refusals():
            config = self._stream_config(request)
            prefill = {}
            for i, entry in enumerate(request.prefill):
                if entry.layer in prefill:
                    raise InvalidArgument(f"open.prefill[{i}].layer: layer {entry.layer} appears twice")
                if entry.layer >= config.num_layers:
                    raise InvalidArgument(
                        f"prefill.layer: {entry.layer} is out of range; num_layers={config.num_layers}"
                    )
                prefill[entry.layer] = (
                    from_proto(entry.key, f"open.prefill[{i}].key", rank=4, copy=False),
                    from_proto(entry.value, f"open.prefill[{i}].value", rank=4, copy=False),
                )
        # From here the engine reports its own refusals (budget, streams, backend...).
        admission = self.engine.admit(config)
        return await self._build(admission, prefill)

    async def _restore(self, first, context) -> Stream:
        """Admits the stream from the first chunk's configuration (budget and stream limit
        included), then reads the rest of the snapshot, at most what the admitted stream can
        hold, and builds the stream from it on the pool."""
        with self.engine.counting_open_refusals():
            if not first.restore.HasField("config"):
                raise InvalidArgument("restore: the first chunk must carry the stream's configuration")
            config = self._stream_config(first.restore.config)
        admission = self.engine.admit(config)
        try:
            chunks = [first.restore]
            received = first.restore.ByteSize()
            while not chunks[-1].last:
                snapshot.check_size(admission.need, len(chunks), received)
                request = await context.read()
                if request is grpc.aio.EOF:
                    raise InvalidArgument("restore: the stream ended before the chunk with `last` set")
                request = _parse(request)
                if request.WhichOneof("kind") != "restore":
                    raise InvalidArgument("restore: every message up to the one with `last` set must be `restore`")
                chunks.append(request.restore)
                received += request.restore.ByteSize()
        except BaseException as exc:
            self.engine.abandon(admission)
            if isinstance(exc, ServiceError):
                self.engine.observer.open_refused("invalid")
            raise

        def layers_of():  # on the pool: the checksum and the copies are proportional to the size
            return snapshot.decode(chunks, config, self.engine.snapshot_key)

        return await self._build(admission, None, layers_of)

    def _opened_config(self, stream: Stream) -> gqa_pb2.OpenStream:
        c = stream.config
        return gqa_pb2.OpenStream(
            backend=c.backend,
            dtype=NAME_TO_DTYPE[c.dtype],
            batch_size=c.batch_size,
            num_query_heads=c.num_query_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_layers=c.num_layers,
            policy=POLICY_ENUMS[c.policy.kind.value],
            window=c.policy.window,
            capacity=c.policy.capacity,
            sink_tokens=c.policy.sinks,
        )

    def _opened(self, stream: Stream) -> gqa_pb2.StreamOpened:
        c = stream.config
        return gqa_pb2.StreamOpened(
            stream_id=stream.id,
            backend=c.backend,
            dtype=NAME_TO_DTYPE[c.dtype],
            policy=POLICY_ENUMS[c.policy.kind.value],
            window=c.policy.window,
            capacity=c.policy.capacity,
            sink_tokens=c.policy.sinks,
            num_layers=c.num_layers,
            bytes_reserved=stream.bytes_reserved,
            tokens_seen=[cache.tokens_seen for cache in stream.caches],
        )

    async def _handle(self, stream: Stream, shape: _StepShape, request, context):
        kind = request.WhichOneof("kind")
        rid = request.request_id
        if kind == "step":
            yield await self._step(stream, shape, request.step, rid)
        elif kind == "rollback":
            yield self._rollback(stream, request.rollback, rid)
        elif kind == "snapshot":
            try:
                chunks = await self.engine.offload(
                    stream.bytes_in_use(),
                    snapshot.encode,
                    stream,
                    self._opened_config(stream),
                    self.config.max_message_bytes,
                    request.snapshot.max_chunk_bytes,
                    self.engine.snapshot_key,
                )
            except ServiceError as exc:
                yield gqa_pb2.DecodeResponse(
                    request_id=rid, error=gqa_pb2.Status(code=exc.code_number, message=exc.message)
                )
                return
            for chunk in chunks:
                yield gqa_pb2.DecodeResponse(request_id=rid, snapshot=chunk)
        elif kind in ("open", "restore"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"`{kind}` may only begin a Decode stream")
        else:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "a Decode request must set one of step, rollback or snapshot"
            )

    async def _step(self, stream: Stream, shape: _StepShape, step, rid: int) -> gqa_pb2.DecodeResponse:
        """Integer checks here; tensors, compute and the reply message on a compute worker."""
        received = time.perf_counter()
        layer = step.layer
        try:
            if not shape.matches(step):
                raise _step_input_error(stream, step)
            future = self.engine.submit_step(
                stream,
                layer,
                step.query.data,
                step.new_key.data,
                step.new_value.data,
                received=received,
                reply=_StepReply(rid, layer, shape.out_shape, shape.dtype, shape.q_bytes),
            )
        except ServiceError as exc:
            self.engine.observer.steps_refused(stream.labels, exc.code)
            return _refusal(rid, layer, exc)
        return await future

    def _rollback(self, stream: Stream, request: gqa_pb2.Rollback, rid: int) -> gqa_pb2.DecodeResponse:
        status = _OK
        try:
            stream.rollback(request.count, None if request.all_layers else request.layer)
        except ServiceError as exc:
            status = gqa_pb2.Status(code=exc.code_number, message=exc.message)
        return gqa_pb2.DecodeResponse(
            request_id=rid,
            rollback=gqa_pb2.RollbackResult(
                status=status,
                tokens_seen=[c.tokens_seen for c in stream.caches],
                rollback_reach=[c.policy.rollback_reach(c.tokens_seen) for c in stream.caches],
            ),
        )


_STATUS_OK = b"\x0a\x00"  # StepResult.status = 1, present and empty (OK)


class _StepReply:
    """Builds a step's reply on the compute worker, as bytes: ``DecodeResponse(step=...)`` with
    its fields encoded here and the output's bytes copied once, straight from the tensor into
    the reply (tests/test_service.py checks the bytes parse to what upb builds). A refusal is a
    message (rare: upb builds it)."""

    __slots__ = ("rid", "layer", "head", "tensor_head", "nbytes")

    def __init__(self, rid: int, layer: int, shape: tuple[int, ...], dtype: int, nbytes: int):
        self.rid, self.layer, self.nbytes = rid, layer, nbytes
        self.head = (b"\x08" + varint(rid) if rid else b"") + b"\x1a"  # DecodeResponse.step = 3
        dims = b"".join(varint(x) for x in shape)
        # Tensor: dtype = 1, shape = 2 (packed), data = 3 (proto3 omits empty bytes)
        self.tensor_head = (
            b"\x08" + varint(dtype) + b"\x12" + varint(len(dims)) + dims + (b"\x1a" + varint(nbytes) if nbytes else b"")
        )

    def __call__(self, value: StepReport | ServiceError, queue_seconds: float):
        if isinstance(value, ServiceError):
            return _refusal(self.rid, self.layer, value)
        o = value.outcome
        out = o.output
        if not (out.is_cpu and out.is_contiguous()):
            out = out.cpu().contiguous()
        # StepResult: status = 1 (present, OK), layer = 2, output = 3, tokens_seen = 4,
        # resident = 5, first_position = 6, last_position = 7, evicted = 8, evicted_tokens = 9,
        # compute_ns = 10, rollback_reach = 11; zeros omitted as proto3 does.
        parts = [b"\x0a\x00"]
        if self.layer:
            parts += [b"\x10", varint(self.layer)]
        for tag, v in (
            (b"\x20", o.tokens_seen),
            (b"\x28", o.resident),
            (b"\x30", o.first_position),
            (b"\x38", o.last_position),
            (b"\x40", 1 if o.evicted_tokens > 0 else 0),
            (b"\x48", o.evicted_tokens),
            (b"\x50", value.compute_ns),
            (b"\x58", value.rollback_reach),
        ):
            if v:
                parts += [tag, varint(v)]
        fields = b"".join(parts)
        tensor_len = len(self.tensor_head) + self.nbytes
        output_field = b"\x1a" + varint(tensor_len) + self.tensor_head
        step_len = len(fields) + len(output_field) + self.nbytes
        head = b"".join((self.head, varint(step_len), fields, output_field))
        if not self.nbytes:
            return head
        return b"".join((head, out.reshape(-1).view(torch.uint8).numpy()))


def _refusal(rid: int, layer: int, exc: ServiceError) -> gqa_pb2.DecodeResponse:
    return gqa_pb2.DecodeResponse(
        request_id=rid,
        step=gqa_pb2.StepResult(status=gqa_pb2.Status(code=exc.code_number, message=exc.message), layer=layer),
    )


def _step_input_error(stream: Stream, step) -> ServiceError:
    """The slow path of a step that failed the integer checks: the precise message."""
    if not 0 <= step.layer < stream.config.num_layers:
        return InvalidArgument(
            f"layer: {step.layer} is out of range; the stream has num_layers={stream.config.num_layers}"
        )
    try:
        query = from_proto(step.query, "step.query", rank=3, copy=False)
        new_key = from_proto(step.new_key, "step.new_key", rank=3, copy=False)
        new_value = from_proto(step.new_value, "step.new_value", rank=3, copy=False)
        stream.caches[step.layer].check_step(query, new_key, new_value)
    except ServiceError as exc:
        return exc
    except (TypeError, ValueError) as exc:
        return InvalidArgument(str(exc))
    except Exception as exc:
        return classify_step_error(exc, f"stream {stream.id}: checking a step")
    return InvalidArgument("step: tensors do not match the stream's dtype and shapes")


def _stateless_args(request) -> tuple:
    """Validation of a ``DecodeStep``: every failure here, and only here, is INVALID_ARGUMENT."""
    query = from_proto(request.query, "query", rank=3, copy=False)
    new_key = from_proto(request.new_key, "new_key", rank=3, copy=False)
    new_value = from_proto(request.new_value, "new_value", rank=3, copy=False)
    key_cache = from_proto(request.key_cache, "key_cache", rank=4, copy=False)
    value_cache = from_proto(request.value_cache, "value_cache", rank=4, copy=False)
    for name, t in (("query", query), ("new_key", new_key), ("new_value", new_value)):
        for axis, size in zip(("B", "H", "D"), t.shape):
            if size == 0:
                raise InvalidArgument(f"{name}.shape: {axis} must be positive, got {list(t.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        for axis, size in zip(("B", "Hkv", "S", "D"), t.shape):
            if size == 0 and axis != "S":
                raise InvalidArgument(f"{name}.shape: {axis} must be positive, got {list(t.shape)}")
    hq, hkv = int(request.num_query_heads), int(request.num_kv_heads)
    Engine.check_stateless(query, new_key, new_value, key_cache, value_cache, hq, hkv)
    return query, new_key, new_value, key_cache, value_cache, hq, hkv
