"""The ``Batch`` stream: many sequences per message, one batched computation per step message.

Translation only, like the servicer: protobuf in, calls on the engine's data plane for the
session (``service.engine.plane.SequenceSet``, which ``Engine.sequence_set`` makes), bytes out. A
session shares backend, dtype, heads, head width and layer count; each of its sequences is an
engine ``Stream`` of batch size 1, admitted and built like a ``Decode`` stream (the byte
budget, ``max_streams``, the idle reaper and the drain apply to it exactly as to a ``Decode``
stream; the idle timeout is the session's). A step message is read from its bytes
(``service.transport.wire``: the ids one numpy array, the tensors views of the request), planned on the
event loop (ids -> slots, refusals), computed by the engine in one ``CacheSet.step_buffers`` (on the loop
after a fast message, else on its compute workers with the Decode streams' steps), and its reply
encoded where it computed, around the output buffer (``service.transport.batch_reply``). Refusals are per sequence and in-band
(``service.transport.batch_session``); only a broken protocol, a refused ``open``, the idle timeout and
shutdown end the RPC.
"""

from __future__ import annotations

import grpc

from ..api import gqa_pb2
from ..config import ServerConfig
from ..engine.engine import Engine
from ..engine.plane import SetShape
from ..errors import InvalidArgument
from ..vocab import DTYPE_NAMES, NAME_TO_DTYPE
from . import wire
from .batch_session import Session
from .session import EOF, StreamClosed, StreamSession
from .statuses import malformed_request

__all__ = ["serve", "session_shape"]


def session_shape(engine: Engine, request: gqa_pb2.BatchOpen) -> SetShape:
    """Validates ``open``: limits (InvalidArgument), backend (FailedPrecondition), drain; the
    engine counts each refusal with its reason."""
    if request.dtype and request.dtype not in DTYPE_NAMES:
        with engine.counting_open_refusals():
            raise InvalidArgument(f"open.dtype: {request.dtype} is not a known DType")
    return engine.session_shape(
        backend=request.backend,
        dtype=DTYPE_NAMES.get(request.dtype, ""),
        num_query_heads=request.num_query_heads,
        num_kv_heads=request.num_kv_heads,
        head_dim=request.head_dim,
        num_layers=request.num_layers,
    )


def _parse(raw: bytes) -> gqa_pb2.BatchRequest:
    """A request's bytes as a message; ``InvalidArgument`` (as for every RPC) when they are not one."""
    try:
        return gqa_pb2.BatchRequest.FromString(raw)
    except Exception:
        raise malformed_request("Batch") from None


_session_ids = iter(range(1, 1 << 62))


def _opened(request_id: int, session: Session) -> gqa_pb2.BatchResponse:
    shared = session.shared
    return gqa_pb2.BatchResponse(
        request_id=request_id,
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


async def _answers(session: Session, raw: bytes):
    """The replies to a request other than a step message read by ``wire`` (parsed here)."""
    request = _parse(raw)
    rid = request.request_id
    kind = request.WhichOneof("kind")
    if kind == "step":
        yield await session.step(request.step, rid)
    elif kind == "add":
        added = await session.add(request.add)
        if added is not None:
            yield gqa_pb2.BatchResponse(request_id=rid, added=added)
    elif kind == "remove":
        yield gqa_pb2.BatchResponse(request_id=rid, removed=session.remove(request.remove))
    elif kind == "rollback":
        yield gqa_pb2.BatchResponse(request_id=rid, rollback=session.rollback(request.rollback))
    elif kind == "snapshot":
        for chunk in await session.snapshot(request.snapshot):
            yield gqa_pb2.BatchResponse(request_id=rid, snapshot=chunk)
    elif kind == "open":
        raise InvalidArgument("`open` may only begin a Batch stream")
    else:
        raise InvalidArgument("a Batch request must set one of add, step, remove, rollback or snapshot")


async def serve(engine: Engine, config: ServerConfig, context):
    """The handler of one Batch RPC (the servicer's ``Batch`` yields what this yields). Requests
    arrive as their bytes (``AttentionServicer.Batch.raw_requests``): step messages are read by
    ``service.transport.wire`` without copying their tensors, the others parsed here. Replies are yielded
    rather than written through the context: an echo server's round trip of a 64-sequence
    reply was 1.16-1.33 ms yielding and 1.37-4.75 ms writing (bfloat16, 5 interleaved rounds,
    busy VM, docs/design.md). What ends the RPC is raised (a refused ``open``, a broken
    protocol, a forced close's error) and becomes its status in ``service.transport.statuses``."""
    first = await context.read()
    if first is grpc.aio.EOF:
        return
    first = _parse(first)
    if first.WhichOneof("kind") != "open":
        raise InvalidArgument("the first message of a Batch stream must be `open`")
    shared = session_shape(engine, first.open)  # its refusals are counted by the engine
    reads = StreamSession(
        engine,
        context.read,
        grpc.aio.EOF,
        len,
        lambda: session.touch(),
        max_steps=config.max_queued_steps,
        max_bytes=config.max_queued_bytes,
    )
    session = Session(engine, config, shared, f"b{next(_session_ids)}", reads.on_forced_close)
    try:
        replies = [_opened(first.request_id, session)]
        layout = session.layout
        while True:
            for reply in replies:
                reads.begin_write()
                yield reply
                reads.end_write()
            request = await reads.next()
            if request is EOF:
                break
            # a step message read from its bytes is answered here, without a generator of its own
            step = layout.read(request) or wire.read_step_request(request)
            if step is not None:
                replies = [await session.step(step[1], step[0])]
            else:
                replies = [reply async for reply in _answers(session, request)]
    except StreamClosed as closed:
        raise closed.error from None
    finally:
        reads.close()
        session.close("forced" if reads.forced is not None else "client")
