"""The gqa.v1 servicer: protobuf in, engine calls, protobuf out. Translation only.

Errors: ``ServiceError`` carries its code; in a stream, a refused step/rollback/snapshot is
answered in-band and the stream goes on; a broken protocol, a refused open, the idle timeout
and shutdown end the RPC with a status. Any other exception becomes INTERNAL with a fixed
message (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time

import grpc
import torch

from backends import registry
from backends.reference import gqa_decode_step

from . import __version__, snapshot
from . import batch_rpc
from .api import gqa_pb2, gqa_pb2_grpc
from .config import ServerConfig
from .engine import Engine, Stream
from .errors import CODE_NUMBERS, Internal, InvalidArgument, ServiceError, Unavailable
from .tensors import DTYPE_NAMES, NAME_TO_DTYPE, TORCH_TO_DTYPE, from_proto, to_proto

__all__ = ["AttentionServicer", "POLICY_NAMES"]

log = logging.getLogger("gqa.servicer")

POLICY_NAMES = {
    gqa_pb2.EVICTION_POLICY_NONE: "none",
    gqa_pb2.EVICTION_POLICY_STRICT: "strict",
    gqa_pb2.EVICTION_POLICY_GREEDY: "greedy",
    gqa_pb2.EVICTION_POLICY_SINK: "sink",
}
POLICY_ENUMS = {v: k for k, v in POLICY_NAMES.items()}
_OK = gqa_pb2.Status(code=0)


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code)


class _StreamClosed(Exception):
    """Raised inside a handler whose stream the server closed (idle, shutdown)."""

    def __init__(self, error: ServiceError):
        self.error = error


class AttentionServicer(gqa_pb2_grpc.AttentionServiceServicer):
    def __init__(self, engine: Engine, config: ServerConfig, pool: concurrent.futures.Executor):
        self.engine = engine
        self.config = config
        self.pool = pool
        self._backend_infos = None

    async def _compute(self, cost_bytes: int, fn, *args):
        """Small work inline (a thread hop costs more); the rest on the compute pool."""
        if cost_bytes < self.config.inline_step_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- DecodeStep -------------------------------------------------------------------------
    async def DecodeStep(self, request, context):
        try:
            args = (
                from_proto(request.query, "query", rank=3),
                from_proto(request.new_key, "new_key", rank=3),
                from_proto(request.new_value, "new_value", rank=3),
                from_proto(request.key_cache, "key_cache", rank=4),
                from_proto(request.value_cache, "value_cache", rank=4),
                int(request.num_query_heads),
                int(request.num_kv_heads),
            )
            cost = len(request.key_cache.data) + len(request.value_cache.data)
            result = await self._compute(cost, _stateless_step, *args)
        except ServiceError as exc:
            await context.abort(_status(exc.code), exc.message)
        return gqa_pb2.DecodeStepResponse(
            output=to_proto(result["output"]),
            new_key_cache=to_proto(result["new_key_cache"]),
            new_value_cache=to_proto(result["new_value_cache"]),
        )

    # -- GetServerInfo ----------------------------------------------------------------------
    async def backend_infos(self) -> list:
        """Every backend's capabilities or reasons, probed once per process and off the event
        loop: probing imports optional modules (bitsandbytes, triton), which takes seconds."""
        if self._backend_infos is None:
            self._backend_infos = await asyncio.get_running_loop().run_in_executor(self.pool, registry.describe)
        return self._backend_infos

    async def GetServerInfo(self, request, context):
        c = self.config
        backends = []
        for info in await self.backend_infos():
            caps = info.capabilities
            backends.append(gqa_pb2.BackendInfo(
                name=info.name,
                available=info.available,
                reasons=info.reasons,
                dtypes=[TORCH_TO_DTYPE[d] for d in caps.dtypes if d in TORCH_TO_DTYPE] if caps else [],
                devices=list(caps.devices) if caps else [],
                max_head_dim=min(caps.max_head_dim, c.max_head_dim) if caps else 0,
            ))
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

    # -- Batch (service.batch_rpc) -----------------------------------------------------------
    async def Batch(self, request_iterator, context):
        await batch_rpc.serve(self.engine, self.config, self.pool, context)

    # -- Decode -----------------------------------------------------------------------------
    async def Decode(self, request_iterator, context):
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        kind = first.WhichOneof("kind")
        if kind not in ("open", "restore"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first message of a Decode stream must be `open` or `restore`")
        try:
            if kind == "open":
                stream = await self._open(first.open)
            else:
                stream = await self._restore(first, context)
        except ServiceError as exc:
            await context.abort(_status(exc.code), exc.message)

        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        forced: list[ServiceError] = []
        state = {"waiting": False}

        def on_forced_close(error: ServiceError) -> None:
            # Called from the reaper or the drain, on any thread: end the handler only while it
            # waits for the client, so a step in flight always finishes.
            def wake():
                forced.append(error)
                if state["waiting"] and task is not None:
                    task.cancel()
            loop.call_soon_threadsafe(wake)

        stream.on_forced_close = on_forced_close
        # Read-ahead: a reader task takes up to max_queued_steps requests off the wire while
        # earlier ones compute; past that it stops reading and HTTP/2 flow control holds the
        # client back. This loop is the only consumer, so responses keep request order.
        slots = asyncio.Semaphore(self.config.max_queued_steps)
        queue: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_ahead(context, stream, slots, queue))
        try:
            yield gqa_pb2.DecodeResponse(request_id=first.request_id, opened=self._opened(stream))
            while True:
                if forced:
                    raise _StreamClosed(forced[0])
                state["waiting"] = True
                try:
                    request = await queue.get()
                except asyncio.CancelledError:
                    if forced:
                        raise _StreamClosed(forced[0]) from None
                    raise
                finally:
                    state["waiting"] = False
                slots.release()
                if isinstance(request, BaseException):
                    raise request
                if request is grpc.aio.EOF:
                    break
                async for response in self._handle(stream, request, context):
                    yield response
        except _StreamClosed as closed:
            self.engine.close(stream, "forced")
            await context.abort(_status(closed.error.code), closed.error.message)
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except ServiceError as exc:  # a request that does not parse, found by the read-ahead
            await context.abort(_status(exc.code), exc.message)
        except Exception:
            log.exception("stream %s: unexpected failure", stream.id)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; the stream was closed")
        finally:
            reader.cancel()
            self.engine.close(stream, "client" if not forced else "forced")

    async def _read_ahead(self, context, stream: Stream, slots: asyncio.Semaphore, queue: asyncio.Queue) -> None:
        """Moves requests from the wire to ``queue``, at most ``max_queued_steps`` not yet
        taken; ends with EOF or the exception the read raised (an abort included)."""
        try:
            while True:
                await slots.acquire()
                request = await context.read()
                stream.touch(self.engine.clock())
                queue.put_nowait(request)
                if request is grpc.aio.EOF:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            queue.put_nowait(exc)

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

    async def _open(self, request: gqa_pb2.OpenStream) -> Stream:
        with self._refusals_counted():
            config = self._stream_config(request)
            prefill = {}
            cost = 0
            for i, entry in enumerate(request.prefill):
                if entry.layer in prefill:
                    raise InvalidArgument(f"open.prefill[{i}].layer: layer {entry.layer} appears twice")
                prefill[entry.layer] = (
                    from_proto(entry.key, f"open.prefill[{i}].key", rank=4),
                    from_proto(entry.value, f"open.prefill[{i}].value", rank=4),
                )
                cost += len(entry.key.data) + len(entry.value.data)
        # From here the engine reports its own refusals (budget, streams, backend...).
        return await self._compute(cost, self.engine.open, config, prefill)

    @contextlib.contextmanager
    def _refusals_counted(self):
        """Opens refused before they reach the engine count as refusals too (reason invalid)."""
        try:
            yield
        except ServiceError:
            self.engine.observer.open_refused("invalid")
            raise

    async def _restore(self, first, context) -> Stream:
        """Reads the snapshot's chunks (the first already read) and opens the stream from them."""
        chunks = [first.restore]
        received = first.restore.ByteSize()
        while not chunks[-1].last:
            if len(chunks) > snapshot.MAX_CHUNKS or received > self.config.max_cache_bytes:
                raise InvalidArgument("restore: the snapshot is larger than this server could ever admit")
            request = await context.read()
            if request is grpc.aio.EOF:
                raise InvalidArgument("restore: the stream ended before the chunk with `last` set")
            if request.WhichOneof("kind") != "restore":
                raise InvalidArgument("restore: every message up to the one with `last` set must be `restore`")
            chunks.append(request.restore)
            received += request.restore.ByteSize()
        with self._refusals_counted():
            if not chunks[0].HasField("config"):
                raise InvalidArgument("restore: the first chunk must carry the stream's configuration")
            config = self._stream_config(chunks[0].config)
            layers = snapshot.decode(chunks, config, self.engine.snapshot_key)
        cost = sum(len(c.key.data) + len(c.value.data) for c in chunks)
        return await self._compute(cost, self.engine.open, config, None, layers)

    def _opened_config(self, stream: Stream) -> gqa_pb2.OpenStream:
        c = stream.config
        return gqa_pb2.OpenStream(
            backend=c.backend, dtype=NAME_TO_DTYPE[c.dtype], batch_size=c.batch_size,
            num_query_heads=c.num_query_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            num_layers=c.num_layers, policy=POLICY_ENUMS[c.policy.kind.value], window=c.policy.window,
            capacity=c.policy.capacity, sink_tokens=c.policy.sinks,
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

    async def _handle(self, stream: Stream, request, context):
        kind = request.WhichOneof("kind")
        rid = request.request_id
        if kind == "step":
            yield await self._step(stream, request, rid)
        elif kind == "rollback":
            yield self._rollback(stream, request.rollback, rid)
        elif kind == "snapshot":
            try:
                chunks = await self._compute(stream.bytes_in_use(), snapshot.encode, stream,
                                             self._opened_config(stream), self.config.max_message_bytes,
                                             request.snapshot.max_chunk_bytes, self.engine.snapshot_key)
            except ServiceError as exc:
                yield gqa_pb2.DecodeResponse(request_id=rid, error=gqa_pb2.Status(
                    code=exc.code_number, message=exc.message))
                return
            for chunk in chunks:
                yield gqa_pb2.DecodeResponse(request_id=rid, snapshot=chunk)
        elif kind in ("open", "restore"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"`{kind}` may only begin a Decode stream")
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a Decode request must set one of step, rollback or snapshot")

    async def _step(self, stream: Stream, request, rid: int) -> gqa_pb2.DecodeResponse:
        step = request.step
        received = time.perf_counter()
        try:
            query = from_proto(step.query, "step.query", rank=3)
            new_key = from_proto(step.new_key, "step.new_key", rank=3)
            new_value = from_proto(step.new_value, "step.new_value", rank=3)
            cost = stream.step_cost_bytes(step.layer)
            report = await self._compute(cost, _timed_step, stream, step.layer, query, new_key, new_value, received)
        except ServiceError as exc:
            self.engine.observer.step_refused(stream, exc.code)
            return gqa_pb2.DecodeResponse(request_id=rid, step=gqa_pb2.StepResult(
                status=gqa_pb2.Status(code=exc.code_number, message=exc.message), layer=step.layer))
        report, queue_seconds = report
        self.engine.observer.step_done(stream, report, queue_seconds)
        o = report.outcome
        return gqa_pb2.DecodeResponse(request_id=rid, step=gqa_pb2.StepResult(
            status=_OK,
            layer=step.layer,
            output=to_proto(o.output),
            tokens_seen=o.tokens_seen,
            resident=o.resident,
            first_position=o.first_position,
            last_position=o.last_position,
            evicted=o.evicted_tokens > 0,
            evicted_tokens=o.evicted_tokens,
            compute_ns=report.compute_ns,
            rollback_reach=report.rollback_reach,
        ))

    def _rollback(self, stream: Stream, request: gqa_pb2.Rollback, rid: int) -> gqa_pb2.DecodeResponse:
        status = _OK
        try:
            stream.rollback(request.count, None if request.all_layers else request.layer)
        except ServiceError as exc:
            status = gqa_pb2.Status(code=exc.code_number, message=exc.message)
        return gqa_pb2.DecodeResponse(request_id=rid, rollback=gqa_pb2.RollbackResult(
            status=status,
            tokens_seen=[c.tokens_seen for c in stream.caches],
            rollback_reach=[c.policy.rollback_reach(c.tokens_seen) for c in stream.caches],
        ))


def _timed_step(stream: Stream, layer: int, query, new_key, new_value, received: float):
    queue_seconds = time.perf_counter() - received
    return stream.step(layer, query, new_key, new_value), queue_seconds


def _stateless_step(*args):
    try:
        return gqa_decode_step(*args)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from None
    except Exception:
        log.exception("DecodeStep failed")
        raise Internal("internal error") from None
