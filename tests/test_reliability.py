"""Issue 17, items 1, 2, 3, 4, 6, 7 and 9: what an adversarial client found, one test each.

The rules behind them: nothing is allocated before it is admitted and counted; no work
proportional to a stream's size runs on the event loop; every byte a stream can make the server
hold is bounded by a setting; a stream's resources are released whatever ends its RPC; only
validation says INVALID_ARGUMENT. Each test states its figure's bound; none asserts a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

import grpc
import pytest
import torch

from backends import batch, batch_bytes
from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.engine import stateless as stateless_module
from service.engine.engine import Engine
from service.engine.tensors import to_proto
from service.server import ServerThread
from tests.client import CHANNEL_OPTIONS, Session, open_message, step_request, wait_until

BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)
_END = object()


class HeldBuild:
    """Holds every ``Engine.build`` (a stream's allocation) until released; records its thread."""

    def __init__(self, monkeypatch):
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.finished = threading.Event()
        self.threads: list[str] = []
        original = Engine.build

        def build(engine, *args, **kwargs):
            self.threads.append(threading.current_thread().name)
            self.entered.release()
            self.release.wait(30)
            try:
                return original(engine, *args, **kwargs)
            finally:
                self.finished.set()

        monkeypatch.setattr(Engine, "build", build)


class HeldStepMany:
    """Holds every batch call of the batcher (``backends.batch.step_many``, and
    ``backends.batch_bytes.step_bytes`` for steps read from the wire: a step computing on a
    worker) until released; in place from ``install``, so a test's own set-up steps run freely."""

    def __init__(self, monkeypatch):
        self.entered = threading.Event()
        self.release = threading.Event()
        self._monkeypatch = monkeypatch
        self._originals = batch.step_many, batch_bytes.step_bytes

    def install(self) -> None:
        self._monkeypatch.setattr(batch, "step_many", lambda steps: self._held(self._originals[0], steps))
        self._monkeypatch.setattr(batch_bytes, "step_bytes", lambda steps: self._held(self._originals[1], steps))

    def _held(self, original, steps):
        self.entered.set()
        self.release.wait(30)
        return original(steps)


class RawCall:
    """A Decode RPC fed from a queue, so a test can stop sending, cancel, or never read."""

    def __init__(self, channel, first: list[gqa_pb2.DecodeRequest]):
        self.requests: queue.Queue = queue.Queue()
        for request in first:
            self.requests.put(request)
        self.call = gqa_pb2_grpc.AttentionServiceStub(channel).Decode(iter(self.requests.get, _END))

    def send(self, request):
        self.requests.put(request)

    def end(self):
        self.requests.put(_END)


def zeros_step(rid, b=1, hq=4, hkv=2, d=8):
    return step_request(rid, 0, torch.zeros(b, hq, d), torch.zeros(b, hkv, d), torch.zeros(b, hkv, d))


# -- item 1 ---------------------------------------------------------------------------------------
def test_1_a_cancelled_open_releases_its_reservation_at_once(monkeypatch):
    """Before: the build finished later, registered a stream no RPC would close, and its bytes
    stayed reserved until the idle reaper (300 s); while building, active_streams read 0.
    Bound: while the open is admitted, active_streams == 1 and its bytes are reserved; after
    the cancel, 0 bytes and 0 streams, before the held build even resumes, and after it too."""
    held = HeldBuild(monkeypatch)
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:
        rpc = RawCall(ch, [gqa_pb2.DecodeRequest(open=open_message(policy="none", capacity=4096, layers=4))])
        assert held.entered.acquire(timeout=10)
        need = 4 * 2 * 1 * 2 * 4096 * 8 * 4
        assert srv.engine.active_streams == 1 and srv.engine.bytes_reserved == need
        rpc.call.cancel()
        assert wait_until(lambda: srv.engine.bytes_reserved == 0 and srv.engine.active_streams == 0)
        assert not held.finished.is_set()  # released at once, not when the allocation ends
        held.release.set()
        assert held.finished.wait(10)
        time.sleep(0.1)
        assert srv.engine.bytes_reserved == 0 and srv.engine.active_streams == 0 and not srv.engine.streams()


# -- item 2 ---------------------------------------------------------------------------------------
def test_2_a_large_open_never_holds_the_event_loop(monkeypatch):
    """Before: an open without prefill allocated and zero-filled on the event loop (another
    stream's step: 1.2 ms -> 412-594 ms during 1 GiB opens). Bound: the other stream's step
    completes while the open's allocation is held, and the allocation runs off the loop."""
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:
        other = Session(ch, open_message())
        held = HeldBuild(monkeypatch)
        opened: list = []
        opener = threading.Thread(
            target=lambda: opened.append(Session(ch, open_message(policy="none", capacity=1 << 16)))
        )
        opener.start()
        assert held.entered.acquire(timeout=10)
        reply = other.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
        assert reply.step.status.code == 0
        assert not held.finished.is_set() and not opened  # the open is still running
        assert held.threads and all(name != "gqa-server" for name in held.threads)
        held.release.set()
        opener.join(10)
        assert opened and opened[0].opened.bytes_reserved > 0
        opened[0].close(), other.close()


# -- item 3 ---------------------------------------------------------------------------------------
def _restore_head(msg: gqa_pb2.OpenStream) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(restore=gqa_pb2.SnapshotChunk(config=msg, tokens_seen=[0] * msg.num_layers))


@pytest.mark.parametrize("limit", ["budget", "streams"])
def test_3_a_restore_is_admitted_on_its_first_chunk(limit):
    """Before: chunks were buffered (up to --max-cache-bytes per RPC) before the budget or
    --max-streams was checked. Bound: refused after the first chunk alone (the client sends
    no other), with nothing reserved."""
    config = dataclasses.replace(BASE, max_cache_bytes=1 << 20, max_streams=1)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        holder = Session(ch, open_message()) if limit == "streams" else None
        big = open_message(policy="none", capacity=1 << 16) if limit == "budget" else open_message()
        rpc = RawCall(ch, [_restore_head(big)])  # `last` unset: more chunks would follow
        with pytest.raises(grpc.RpcError) as info:
            next(rpc.call)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("bytes" if limit == "budget" else "streams") in info.value.details()
        assert srv.engine.active_streams == (1 if holder else 0)
        if holder:
            holder.close()
        assert wait_until(lambda: srv.engine.bytes_reserved == 0)


def test_3_a_restore_buffers_no_more_than_its_stream_can_hold():
    """Bound: a restore whose chunks exceed 2 x the admitted stream's bytes + 1 MiB (+ 4 KiB a
    chunk) is refused before reading on; its reservation is released."""
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        msg = open_message(policy="strict", window=8)  # 2 * 1 * 2 * 8 * 8 * 4 = 1 KiB reserved
        junk = gqa_pb2.DecodeRequest(
            restore=gqa_pb2.SnapshotChunk(
                layer=0, key=to_proto(torch.zeros(1, 2, 8192, 8)), value=to_proto(torch.zeros(1, 2, 8192, 8))
            )
        )
        sent = []
        rpc = RawCall(ch, [_restore_head(msg)])
        for _ in range(64):  # 64 x 1 MiB offered; the bound is ~1 MiB
            rpc.send(junk)
            sent.append(1)
        with pytest.raises(grpc.RpcError) as info:
            next(rpc.call)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in info.value.details()
        rpc.end()
        assert wait_until(lambda: srv.engine.bytes_reserved == 0 and srv.engine.active_streams == 0)


# -- item 4 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,shape",
    [("query", (0, 4, 8)), ("query", (1, 4, 0)), ("new_key", (1, 2, 0))],
    ids=["B=0", "D=0", "new_key D=0"],
)
def test_4_zero_sized_tensors_are_invalid_argument(field, shape):
    """Before: INTERNAL "internal error" and a logged traceback (ZeroDivisionError)."""
    tensors = {
        "query": torch.zeros(1, 4, 8),
        "new_key": torch.zeros(1, 2, 8),
        "new_value": torch.zeros(1, 2, 8),
        "key_cache": torch.zeros(1, 2, 3, 8),
        "value_cache": torch.zeros(1, 2, 3, 8),
    }
    tensors[field] = torch.zeros(shape)
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:
        request = gqa_pb2.DecodeStepRequest(
            num_query_heads=4, num_kv_heads=2, **{k: to_proto(v) for k, v in tensors.items()}
        )
        with pytest.raises(grpc.RpcError) as info:
            gqa_pb2_grpc.AttentionServiceStub(ch).DecodeStep(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()


def test_4_a_value_error_inside_a_backend_is_internal(monkeypatch):
    """Before: any ValueError/TypeError raised inside a backend became INVALID_ARGUMENT."""
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:
        session = Session(ch, open_message())
        cache = srv.engine.streams()[0].caches[0]

        def broken(*args, **kwargs):
            raise ValueError("an internal shape bug")

        class BrokenKernel:  # the compiled step's library entry
            step = staticmethod(broken)

        # the compute of either path: the compiled step, or torch's attention
        monkeypatch.setattr(cache, "_native", BrokenKernel())
        monkeypatch.setattr(cache, "_attend", broken)
        reply = session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
        assert reply.step.status.code == grpc.StatusCode.INTERNAL.value[0]
        assert "shape bug" not in reply.step.status.message
        # Validation is still INVALID_ARGUMENT, in-band.
        bad = session.step(0, torch.zeros(1, 4, 7), torch.zeros(1, 2, 7), torch.zeros(1, 2, 7))
        assert bad.step.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        session.close()
        monkeypatch.setattr(stateless_module, "gqa_decode_step", broken)
        request = gqa_pb2.DecodeStepRequest(
            num_query_heads=4,
            num_kv_heads=2,
            query=to_proto(torch.zeros(1, 4, 8)),
            new_key=to_proto(torch.zeros(1, 2, 8)),
            new_value=to_proto(torch.zeros(1, 2, 8)),
            key_cache=to_proto(torch.zeros(1, 2, 3, 8)),
            value_cache=to_proto(torch.zeros(1, 2, 3, 8)),
        )
        with pytest.raises(grpc.RpcError) as info:
            gqa_pb2_grpc.AttentionServiceStub(ch).DecodeStep(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "shape bug" not in info.value.details()


# -- item 6 ---------------------------------------------------------------------------------------
def test_6_drain_lets_a_step_in_flight_finish(monkeypatch):
    """Before: a step outlasting the grace period was cut, its client got UNAVAILABLE
    "Cancelling all calls". Bound: the step held 1 s past the grace (0.2 s) and the stop's own
    grace still reaches its client with status OK, then the stream ends UNAVAILABLE."""
    held = HeldStepMany(monkeypatch)
    config = dataclasses.replace(BASE, grace_period_s=0.2, inline_step_bytes=0)  # the step on a worker
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        session = Session(ch, open_message())
        held.install()
        session.send(zeros_step(1))
        assert held.entered.wait(10)
        drain = asyncio.run_coroutine_threadsafe(srv.server.drain(), srv.loop)
        time.sleep(1.2 + config.grace_period_s)  # past the grace and past stop()'s 1 s
        assert not drain.done()
        held.release.set()
        reply = session.recv()
        assert reply.request_id == 1 and reply.step.status.code == 0
        with pytest.raises(grpc.RpcError) as info:
            session.recv()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        drain.result(20)


def test_6_drain_ends_an_open_still_being_built(monkeypatch):
    """An open admitted before the drain and built after every stream was ended does not
    register a stream nobody would end (the drain would wait for it): its client gets
    UNAVAILABLE, and nothing stays reserved."""
    held = HeldBuild(monkeypatch)
    config = dataclasses.replace(BASE, grace_period_s=1.0)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        rpc = RawCall(ch, [gqa_pb2.DecodeRequest(open=open_message())])
        assert held.entered.acquire(timeout=10)
        drain = asyncio.run_coroutine_threadsafe(srv.server.drain(), srv.loop)
        assert wait_until(lambda: srv.engine.closed)
        held.release.set()
        with pytest.raises(grpc.RpcError) as info:
            next(rpc.call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
        drain.result(20)
        assert srv.engine.bytes_reserved == 0 and srv.engine.active_streams == 0


# -- item 7 ---------------------------------------------------------------------------------------
def test_7_max_streams_holds_against_concurrent_opens(monkeypatch):
    """Before: opens still being admitted were not counted (--max-streams 2: 3 streams from
    12 concurrent opens, 5 with 4 workers). Bound: at most 2 admitted, the other 10 refused."""
    held = HeldBuild(monkeypatch)
    config = dataclasses.replace(BASE, max_streams=2, workers=4)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        outcomes: list = []

        def open_one():
            try:
                outcomes.append(
                    Session(ch, open_message(prefill={0: (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))}))
                )
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        threads = [threading.Thread(target=open_one) for _ in range(12)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(outcomes) == 10)  # refused while two are held in build
        assert outcomes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 10
        assert srv.engine.active_streams == 2
        held.release.set()
        for t in threads:
            t.join(10)
        sessions = [o for o in outcomes if isinstance(o, Session)]
        assert len(sessions) == 2 and srv.engine.active_streams == 2
        for s in sessions:
            s.close()


# -- item 9 ---------------------------------------------------------------------------------------
def test_9_read_ahead_is_bounded_in_bytes(monkeypatch):
    """Before: only messages were counted (8 by default, each up to 64 MiB). Bound: with
    --max-queued-bytes 64 KiB and a step held, the server buffers at most 64 KiB plus one
    message of the stream, and counts it (engine.read_ahead_bytes)."""
    held = HeldStepMany(monkeypatch)
    config = dataclasses.replace(BASE, max_queued_bytes=64 << 10, max_queued_steps=1000, inline_step_bytes=0)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        shape = dict(b=1, hq=16, hkv=2, d=256)
        session = Session(ch, open_message(batch=1, hq=16, hkv=2, d=256))
        held.install()
        message = zeros_step(1, **shape).ByteSize()  # about 20 KiB
        for rid in range(1, 41):
            session.send(zeros_step(rid, **shape))
        assert held.entered.wait(10)
        assert wait_until(lambda: srv.engine.read_ahead_bytes >= 64 << 10)
        time.sleep(0.5)  # the reader stays stopped however long we wait
        assert 64 << 10 <= srv.engine.read_ahead_bytes <= (64 << 10) + message
        held.release.set()
        replies = [session.recv() for _ in range(40)]
        assert [r.request_id for r in replies] == list(range(1, 41))
        session.close()
        assert wait_until(lambda: srv.engine.read_ahead_bytes == 0)


def test_9_a_reaped_stream_stuck_writing_to_a_client_that_never_reads_ends_its_rpc():
    """Before: the reaper freed the caches, but the RPC and its buffered requests lived on,
    no longer counted (--max-streams 4: 12 live RPCs, active_streams 0, +2.9 GB RSS).
    Bound: after the reap, 0 Decode RPCs running, 0 streams, 0 bytes reserved or read ahead."""
    config = dataclasses.replace(BASE, idle_timeout_s=0.5)
    b, hq, hkv, d = 64, 16, 1, 256  # 1 MiB replies: a client that never reads fills its window
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        rpc = RawCall(ch, [gqa_pb2.DecodeRequest(open=open_message(batch=b, hq=hq, hkv=hkv, d=d, window=4))])
        assert next(rpc.call).WhichOneof("kind") == "opened"  # and never read again
        for rid in range(1, 49):
            rpc.send(zeros_step(rid, b, hq, hkv, d))
        assert wait_until(lambda: srv.engine.active_streams == 0, timeout=20)  # reaped
        assert wait_until(lambda: srv.server.servicer.sessions == 0, timeout=20)
        assert srv.engine.bytes_reserved == 0 and srv.engine.read_ahead_bytes == 0
        rpc.end()
        rpc.call.cancel()


def test_9_a_reaped_batch_session_stuck_writing_to_a_client_that_never_reads_ends_its_rpc():
    """The Batch front end shares the Decode stream's session (service.transport.session), so a
    forced close cuts a handler stuck in a write there too. Bound: after the reap, 0 sequences
    open in Batch sessions (the handler ended and dropped them), 0 bytes reserved."""
    config = dataclasses.replace(BASE, idle_timeout_s=0.5)
    n, hq, hkv, d = 64, 16, 1, 256  # 1 MiB replies: a client that never reads fills its window
    opening = gqa_pb2.BatchRequest(
        open=gqa_pb2.BatchOpen(num_query_heads=hq, num_kv_heads=hkv, head_dim=d, num_layers=1)
    )
    adds = [
        gqa_pb2.BatchRequest(request_id=i, add=gqa_pb2.BatchAdd(id=i, policy=gqa_pb2.EVICTION_POLICY_STRICT, window=4))
        for i in range(1, n + 1)
    ]
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        requests: queue.Queue = queue.Queue()
        for request in (opening, *adds):
            requests.put(request)
        call = gqa_pb2_grpc.AttentionServiceStub(ch).Batch(iter(requests.get, _END))
        assert next(call).WhichOneof("kind") == "opened"  # and never read again
        assert wait_until(lambda: srv.engine.batch_sequences_open == n)
        for rid in range(n + 1, n + 49):
            step = gqa_pb2.BatchStep(
                layer=0,
                ids=range(1, n + 1),
                query=to_proto(torch.zeros(n, hq, d)),
                new_key=to_proto(torch.zeros(n, hkv, d)),
                new_value=to_proto(torch.zeros(n, hkv, d)),
            )
            requests.put(gqa_pb2.BatchRequest(request_id=rid, step=step))
        assert wait_until(lambda: srv.engine.batch_sequences_open == 0, timeout=20)  # reaped, RPC ended
        assert srv.engine.bytes_reserved == 0 and srv.engine.active_streams == 0
        requests.put(_END)
        call.cancel()
