"""The gqa.v1 servicer: protobuf in, engine calls, protobuf out (sessions and batching delegated, below).

Errors: ``ServiceError`` carries its code; in a stream, a refused step/rollback/snapshot is
answered in-band and the stream goes on; a broken protocol, a refused open, the idle timeout
and shutdown end the RPC: the handler raises, and the status interceptor makes the status
(``service.transport.statuses.status_of``, the one place exceptions become statuses; any other exception
becomes INTERNAL with a fixed message, the traceback going to the log, never to the client).
Only validation says INVALID_ARGUMENT: what a backend raises while computing is INTERNAL
(``service.engine.report.classify_step_error``).

A Decode stream's session (read-ahead, back-pressure, forced close) is ``service.transport.session``;
its steps go to the engine's batcher (``service.engine.batcher``) after integer checks against the
stream's shapes (``service.transport.decode_step``), and come back as reply bytes built on the compute
worker. Opens and
restores are admitted here (cheap) and built on the pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc

from .. import __version__
from ..api import gqa_pb2, gqa_pb2_grpc
from ..config import ServerConfig
from ..engine import snapshot
from ..engine.engine import Admission, Engine, Stream
from ..engine.stateless import check_stateless, stateless_step
from ..engine.tensors import from_proto, to_proto
from ..errors import InvalidArgument, ServiceError
from ..vocab import DTYPE_NAMES, NAME_TO_DTYPE, POLICY_ENUMS, POLICY_NAMES, TORCH_TO_DTYPE
from . import batch_rpc
from .decode_step import StepShape, step_input_error, step_refusal
from .session import EOF, StreamClosed, StreamSession
from .statuses import malformed_request
from .wire import read_decode_step

__all__ = ["AttentionServicer", "POLICY_NAMES"]

_OK = gqa_pb2.Status(code=0)


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
        args = _stateless_args(request)
        cost = len(request.key_cache.data) + len(request.value_cache.data)
        result = await self.engine.offload(cost, stateless_step, *args)
        return gqa_pb2.DecodeStepResponse(
            output=to_proto(result["output"]),
            new_key_cache=to_proto(result["new_key_cache"]),
            new_value_cache=to_proto(result["new_value_cache"]),
        )

    # -- GetServerInfo ----------------------------------------------------------------------
    async def backend_infos(self) -> list:
        """Every backend's capabilities or reasons, probed once per process and off the event
        loop: probing imports every backend's module (and triton, where a GPU is), which can take
        seconds."""
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
    Batch.internal_message = "internal error; the session was closed"

    # -- Decode -----------------------------------------------------------------------------
    async def Decode(self, request_iterator, context):
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        first = _parse(first)
        stream = await self._first(first, context)
        clock = self.engine.clock
        session = StreamSession(
            self.engine,
            context.read,
            grpc.aio.EOF,
            len,
            lambda: stream.touch(clock()),
            max_steps=self.config.max_queued_steps,
            max_bytes=self.config.max_queued_bytes,
        )
        stream.on_forced_close = session.on_forced_close
        shape = StepShape(stream)
        self.sessions += 1
        self._no_sessions.clear()
        reason = "client"
        try:
            responses = [gqa_pb2.DecodeResponse(request_id=first.request_id, opened=self._opened(stream))]
            while True:
                for response in responses:
                    session.begin_write()
                    yield response
                    session.end_write()
                raw = await session.next()
                if raw is EOF:
                    break
                responses = await self._answers(session, stream, shape, raw)
        except StreamClosed as closed:
            reason = "forced"
            raise closed.error from None
        finally:
            session.close()
            stream.on_forced_close = None
            self.engine.close(stream, reason)
            self.sessions -= 1
            if not self.sessions:
                self._no_sessions.set()

    # Decode reads its requests as bytes too: a step is read by service.transport.wire (its tensors views
    # of the request), anything else parsed here by the runtime; its step replies are bytes.
    Decode.raw_requests = True
    # What a client reads when the RPC ends on a fault (service.transport.statuses)
    Decode.internal_message = "internal error; the stream was closed"

    async def _first(self, first: gqa_pb2.DecodeRequest, context) -> Stream:
        """The stream a Decode RPC's first message opens or restores."""
        kind = first.WhichOneof("kind")
        if kind == "open":
            return await self._open(first.open)
        if kind == "restore":
            return await self._restore(first, context)
        raise InvalidArgument("the first message of a Decode stream must be `open` or `restore`")

    async def _answers(self, session: StreamSession, stream: Stream, shape: StepShape, raw: bytes) -> list:
        """The replies to one request after the open: the hot path finds a step's tensors in
        its bytes (the stream's layout: computed from the request's bytes, no view made), else
        reads it field by field; anything else is parsed."""
        found = shape.layout.locate(raw)
        if found is not None:
            future = self._step_raw(session, stream, shape, raw, *found)
            if not isinstance(future, asyncio.Future):  # answered: computed at once, or refused here
                return [future]
        else:
            fast = read_decode_step(raw)
            if fast is None:
                return await self._handle(session, stream, shape, _parse(raw))
            future = self._step(session, stream, shape, fast[1], fast[0])
        # a step computed where it was placed is answered without a turn through the session
        return [future.result() if future.done() else await session.computing(future)]

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

    async def _handle(self, session: StreamSession, stream: Stream, shape: StepShape, request) -> list:
        kind = request.WhichOneof("kind")
        rid = request.request_id
        if kind == "step":
            return [await session.computing(self._step(session, stream, shape, request.step, rid))]
        if kind == "rollback":
            return [self._rollback(stream, request.rollback, rid)]
        if kind == "snapshot":
            return await self._snapshot(stream, request.snapshot, rid)
        if kind in ("open", "restore"):
            raise InvalidArgument(f"`{kind}` may only begin a Decode stream")
        raise InvalidArgument("a Decode request must set one of step, rollback or snapshot")

    async def _snapshot(self, stream: Stream, request: gqa_pb2.SnapshotRequest, rid: int) -> list:
        """The stream's snapshot as replies; a refusal in-band."""
        try:
            chunks = await self.engine.offload(
                stream.bytes_in_use(),
                snapshot.encode,
                stream,
                self._opened_config(stream),
                self.config.max_message_bytes,
                request.max_chunk_bytes,
                self.engine.snapshot_key,
            )
        except ServiceError as exc:
            return [
                gqa_pb2.DecodeResponse(request_id=rid, error=gqa_pb2.Status(code=exc.code_number, message=exc.message))
            ]
        return [gqa_pb2.DecodeResponse(request_id=rid, snapshot=chunk) for chunk in chunks]

    def _step(self, session: StreamSession, stream: Stream, shape: StepShape, step, rid: int) -> asyncio.Future:
        """Integer checks here; tensors, compute and the reply message where the step computes.
        The future of the reply (answered already when refused here or computed at once)."""
        received = time.perf_counter()
        layer = step.layer
        try:
            if not shape.matches(step):
                raise step_input_error(stream, step)
            future = self.engine.submit_step(
                stream,
                layer,
                step.query.data,
                step.new_key.data,
                step.new_value.data,
                received=received,
                reply=shape.reply(rid, layer),
                queued=session.step_queued,
            )
        except ServiceError as exc:
            self.engine.observer.steps_refused(stream.labels, exc.code)
            return _answered(step_refusal(rid, layer, exc))
        return future

    def _step_raw(
        self, session: StreamSession, stream: Stream, shape: StepShape, raw: bytes, rid: int, layer: int, q_at: int
    ):
        """A step in the stream's layout (its dtype and shapes checked by the layout): its
        tensors go to the engine as offsets into ``raw``. Its reply when answered at once
        (computed, or refused here), else the future of it."""
        received = time.perf_counter()
        lay = shape.layout
        spans = (raw, q_at, q_at + lay.k_from_q, q_at + lay.v_from_q)
        try:
            return self.engine.step_raw(
                stream, layer, spans, shape.reply(rid, layer), received=received, queued=session.step_queued
            )
        except ServiceError as exc:
            self.engine.observer.steps_refused(stream.labels, exc.code)
            return step_refusal(rid, layer, exc)

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


def _answered(reply) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(reply)
    return future


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
    check_stateless(query, new_key, new_value, key_cache, value_cache, hq, hkv)
    return query, new_key, new_value, key_cache, value_cache, hq, hkv
