"""The step batcher (issue 15): many streams' steps in one ``step_many`` call, answered exactly
as if each stream ran alone, in each stream's order; a refusal or an ended stream inside a
batch touches nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import grpc
import pytest
import torch

from backends import batch, batch_bytes
from backends.contract import CacheSpec
from backends.policy import EvictionPolicy
from backends.registry import get_backend
from service.config import ServerConfig
from service.engine import placement
from service.engine.engine import Engine, EngineObserver
from service.engine.tensors import from_proto
from service.errors import ServiceError
from service.server import ServerThread
from tests.client import CHANNEL_OPTIONS, Session, open_message, step_request, wait_until

# Steps always go to the workers here (no inline compute), so that batches form.
BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0, inline_step_bytes=0)
STREAMS = 64
STEPS = 6
POLICIES = [
    dict(policy="none", capacity=40),
    dict(policy="strict", window=5),
    dict(policy="greedy", window=4, capacity=9),
    dict(policy="sink", window=5, sink_tokens=2),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 2, 8), (8, 8, 16), (6, 2, 4)]


class BatchSizes(EngineObserver):
    def __init__(self):
        self.sizes: list[int] = []
        self.threads: set[str] = set()  # where batches were computed

    def batch_done(self, backend, dtype, size):
        self.sizes.append(size)
        self.threads.add(threading.current_thread().name)


def _script(i: int):
    """Stream ``i``'s configuration, prefill and steps (mixed policy, dtype, layers, length)."""
    rng = random.Random(i)
    g = torch.Generator().manual_seed(1000 + i)
    pol = POLICIES[i % len(POLICIES)]
    dtype = DTYPES[(i // 4) % len(DTYPES)]
    hq, hkv, d = HEADS[i % len(HEADS)]
    layers = 1 + i % 3
    batch_size = 1 + i % 2
    prefill = {}
    for layer in range(layers):
        n = rng.randint(0, 12)
        if n:
            prefill[layer] = (
                torch.randn(batch_size, hkv, n, d, generator=g).to(dtype),
                torch.randn(batch_size, hkv, n, d, generator=g).to(dtype),
            )
    steps = [
        (
            s % layers,
            torch.randn(batch_size, hq, d, generator=g).to(dtype),
            torch.randn(batch_size, hkv, d, generator=g).to(dtype),
            torch.randn(batch_size, hkv, d, generator=g).to(dtype),
        )
        for s in range(STEPS)
    ]
    msg = open_message(batch=batch_size, hq=hq, hkv=hkv, d=d, layers=layers, dtype=dtype, prefill=prefill, **pol)
    spec = CacheSpec(
        batch_size,
        hq,
        hkv,
        d,
        dtype,
        EvictionPolicy.create(
            pol["policy"], window=pol.get("window", 0), capacity=pol.get("capacity", 0), sinks=pol.get("sink_tokens", 0)
        ),
    )
    return msg, spec, layers, prefill, steps


def _alone(spec, layers, prefill, steps) -> list[torch.Tensor]:
    """The same stream, one step at a time, in process (``cache.step`` alone, the reference ``step_many`` matches bit for bit)."""
    caches = [get_backend("cpu").create_cache(spec) for _ in range(layers)]
    for layer, (k, v) in prefill.items():
        caches[layer].prefill(k, v)
    return [caches[layer].step(q, k, v).output for layer, q, k, v in steps]


@pytest.mark.parametrize(
    "delay_us, inline", [(0, 0), (1000, 0), (0, 10**6)], ids=["no-delay", "delay-1ms", "on-the-loop"]
)
def test_64_streams_are_bit_identical_to_each_alone(delay_us, inline):
    """On the workers (with and without a batching delay), and with --inline-step-bytes on, where
    these small steps of many streams are batched on the event loop (``Batcher.run_soon``)."""
    observer = BatchSizes()
    config = dataclasses.replace(BASE, batch_max_delay_us=delay_us, inline_step_bytes=inline)
    scripts = [_script(i) for i in range(STREAMS)]
    expected = [_alone(spec, layers, prefill, steps) for _, spec, layers, prefill, steps in scripts]
    with (
        ServerThread(config, observer=observer) as srv,
        grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch,
    ):
        sessions = [Session(ch, msg) for msg, *_ in scripts]
        # Every stream sends all its steps at once: the read-ahead queues them, the batcher
        # takes one per stream per batch.
        for session, (_, _, _, _, steps) in zip(sessions, scripts):
            for rid, (layer, q, k, v) in enumerate(steps, start=1):
                session.send(step_request(rid, layer, q, k, v))
        for i, session in enumerate(sessions):
            replies = [session.recv() for _ in range(STEPS)]
            assert [r.request_id for r in replies] == list(range(1, STEPS + 1)), f"stream {i} out of order"
            for j, reply in enumerate(replies):
                assert reply.step.status.code == 0, reply.step.status.message
                out = from_proto(reply.step.output, "output")
                assert torch.equal(out, expected[i][j]), f"stream {i} step {j} differs from the stream alone"
            session.close()
        assert wait_until(lambda: srv.engine.active_streams == 0 and srv.engine.bytes_reserved == 0)
    assert sum(observer.sizes) == STREAMS * STEPS
    assert max(observer.sizes) > 1, "no two streams' steps were ever computed together"
    on_workers = {name for name in observer.threads if name.startswith("gqa-compute")}
    assert bool(on_workers) == (not inline), f"batches computed on {observer.threads}"


class _Gate:
    """Holds batch call ``i`` until ``release[i]`` is set, recording each call's size: the
    batcher's two entries, ``step_many`` (steps given as tensors) and ``step_bytes`` (steps read
    from the wire)."""

    def __init__(self, monkeypatch):
        self.calls: list[int] = []
        self.entered = [threading.Event() for _ in range(32)]
        self.release = [threading.Event() for _ in range(32)]
        originals = batch.step_many, batch_bytes.step_bytes
        monkeypatch.setattr(batch, "step_many", lambda steps: self._held(originals[0], steps))
        monkeypatch.setattr(batch_bytes, "step_bytes", lambda steps: self._held(originals[1], steps))

    def _held(self, original, steps):
        i = len(self.calls)
        self.calls.append(len(steps))
        self.entered[i].set()
        self.release[i].wait(30)
        return original(steps)


def _tiny_config(engine: Engine, **policy):
    """A one-layer float32 stream of B=1, Hq=4, Hkv=2, D=8 (strict, window 4, unless ``policy``
    says otherwise)."""
    return engine.stream_config(
        backend="cpu", dtype="float32", batch_size=1, num_query_heads=4, num_kv_heads=2, head_dim=8,
        num_layers=1, sink_tokens=0, **{"policy": "strict", "window": 4, "capacity": 0, **policy},
    )  # fmt: skip


def _tiny_step(seed: int) -> list[torch.Tensor]:
    """A step's query, new key and new value for ``_tiny_config``'s streams."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)]


def test_a_refused_step_in_a_batch_leaves_its_batch_mates_alone(monkeypatch):
    """Engine level, no gRPC: a blocker holds the only worker while three steps queue; they run
    as one batch in which the middle one is refused (no room under policy none)."""
    engine = Engine(dataclasses.replace(BASE, workers=1))
    try:

        def config(**policy):
            return engine.stream_config(
                backend="cpu",
                dtype="float32",
                batch_size=1,
                num_query_heads=4,
                num_kv_heads=2,
                head_dim=8,
                num_layers=1,
                sink_tokens=0,
                **{"policy": "strict", "window": 6, "capacity": 0, **policy},
            )

        g = torch.Generator().manual_seed(3)

        def x():
            return (
                torch.randn(1, 4, 8, generator=g),
                torch.randn(1, 2, 8, generator=g),
                torch.randn(1, 2, 8, generator=g),
            )

        blocker, a, c = (engine.open(config()) for _ in range(3))
        full = engine.open(
            config(policy="none", capacity=2),
            prefill={0: (torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 2, 2, 8, generator=g))},
        )
        twins = [engine.open(config()) for _ in range(2)]
        before = full.caches[0].tokens_seen, *full.caches[0].export()
        gate = _Gate(monkeypatch)
        xa, xb, xc = x(), x(), x()

        async def run():
            first = engine.submit_step(blocker, 0, *x())
            await asyncio.get_running_loop().run_in_executor(None, gate.entered[0].wait, 10)
            futures = [engine.submit_step(s, 0, *xs) for s, xs in ((a, xa), (full, xb), (c, xc))]
            gate.release[0].set()
            gate.release[1].set()
            return await first, await asyncio.gather(*futures)

        _, (ra, rb, rc) = asyncio.run(run())
        assert gate.calls == [1, 3]  # the three were one batch
        assert isinstance(rb, ServiceError) and rb.code == "RESOURCE_EXHAUSTED"
        after = full.caches[0].tokens_seen, *full.caches[0].export()
        assert before[0] == after[0] and torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
        alone = [twin.step(0, *xs).outcome.output for twin, xs in zip(twins, (xa, xc))]
        assert torch.equal(ra.outcome.output, alone[0]) and torch.equal(rc.outcome.output, alone[1])
        assert a.caches[0].tokens_seen == c.caches[0].tokens_seen == 1
    finally:
        engine.stop()


def _send_step(session: Session, rid: int):
    session.send(step_request(rid, 0, torch.ones(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8)))


@pytest.mark.parametrize("how", ["cancelled", "idle-reaped", "drained"])
def test_a_stream_ended_while_its_step_is_in_a_batch(monkeypatch, how):
    """Victim and bystander steps are held inside one batch; the victim's RPC ends meanwhile.
    Its bytes return to the budget at once (the batch still held); the batch finishes; the
    bystander gets its result; the victim's client gets its documented status."""
    config = dataclasses.replace(BASE, grace_period_s=0.2, workers=1)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        blocker, victim, bystander = (Session(ch, open_message()) for _ in range(3))
        victim_bytes = victim.opened.bytes_reserved
        reserved = srv.engine.bytes_reserved
        gate = _Gate(monkeypatch)
        _send_step(blocker, 1)
        assert gate.entered[0].wait(10)  # the only worker is held by the blocker's step
        _send_step(victim, 1)
        _send_step(bystander, 1)
        assert wait_until(lambda: srv.engine.steps_waiting == 2)
        gate.release[0].set()
        assert gate.entered[1].wait(10)  # victim and bystander: one batch, held
        assert gate.calls == [1, 2] and srv.engine.steps_in_flight == 2
        assert blocker.recv().step.status.code == 0
        drain = None
        if how == "cancelled":
            victim.cancel()
            assert wait_until(lambda: srv.engine.bytes_reserved == reserved - victim_bytes)
        elif how == "idle-reaped":
            stream = next(s for s in srv.engine.streams() if s.id == victim.opened.stream_id)
            stream.last_active -= 10 * config.idle_timeout_s
            assert [s.id for s in srv.engine.reap_idle()] == [victim.opened.stream_id]
            assert srv.engine.bytes_reserved == reserved - victim_bytes
        else:
            drain = asyncio.run_coroutine_threadsafe(srv.server.drain(), srv.loop)
            assert wait_until(lambda: srv.engine.bytes_reserved == 0)  # past the grace: all closed
        assert srv.engine.steps_in_flight == 2  # the batch is still held
        gate.release[1].set()
        assert bystander.recv().step.status.code == 0  # the batch-mate finishes
        if how == "cancelled":
            with pytest.raises(grpc.RpcError) as info:
                victim.recv()
            assert info.value.code() == grpc.StatusCode.CANCELLED
        else:
            # The step in flight finishes and is answered; then the RPC ends with its status.
            assert victim.recv().step.status.code == 0
            with pytest.raises(grpc.RpcError) as info:
                victim.recv()
            expected = grpc.StatusCode.DEADLINE_EXCEEDED if how == "idle-reaped" else grpc.StatusCode.UNAVAILABLE
            assert info.value.code() == expected
        if drain is not None:
            with pytest.raises(grpc.RpcError) as info:
                bystander.recv()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            drain.result(20)
            return
        bystander.close()
        blocker.close()
        assert wait_until(lambda: srv.engine.active_streams == 0 and srv.engine.bytes_reserved == 0)
        assert srv.engine.steps_waiting == 0 and srv.engine.steps_in_flight == 0


def test_step_errors_map_to_statuses_by_type():
    """The backends' input errors are INVALID_ARGUMENT wherever they are raised; a plain
    ValueError/TypeError out of a computation is a fault of ours (INTERNAL); no room is
    RESOURCE_EXHAUSTED."""
    from backends.errors import CacheFullError, InputTypeError, InputValueError
    from service.engine.batcher import classify_step_error

    def code(exc):
        return classify_step_error(exc, "test").code

    assert code(InputValueError("bad shape")) == "INVALID_ARGUMENT"
    assert code(InputTypeError("bad dtype")) == "INVALID_ARGUMENT"
    assert isinstance(InputValueError("x"), ValueError) and isinstance(InputTypeError("x"), TypeError)
    assert code(CacheFullError("full")) == "RESOURCE_EXHAUSTED"
    assert code(ValueError("an internal shape bug")) == "INTERNAL"
    assert code(TypeError("an internal bug")) == "INTERNAL"


def test_a_step_batched_on_the_loop_after_stop_is_refused_and_changes_nothing(monkeypatch):
    """A small step of a stream stepping with others waits for the loop's next turn
    (``Batcher.run_soon``); the server stopping before then refuses it with UNAVAILABLE, its
    cache untouched, while the step computed before the stop stands."""
    # "with others": another stream's step within the window. The first step below computes
    # before the second is submitted, and a fresh engine's first step may outlast the 1 ms
    # window on a slow CPU (it did on a Zen 1), so the window is widened, not timed.
    monkeypatch.setattr(placement, "CONCURRENT_WINDOW_S", 60.0)
    engine = Engine(dataclasses.replace(BASE, inline_step_bytes=10**6))
    try:
        a, b = engine.open(_tiny_config(engine)), engine.open(_tiny_config(engine))
        x = _tiny_step(5)

        async def run():
            first = engine.submit_step(a, 0, *x)  # alone: computed at once
            second = engine.submit_step(b, 0, *x)  # another stream at once: the loop's batch
            assert first.done() and not second.done()
            engine.batcher.stop()
            return await first, await second

        ra, rb = asyncio.run(run())
        assert a.caches[0].tokens_seen == 1 and ra.outcome.tokens_seen == 1
        assert isinstance(rb, ServiceError) and rb.code == "UNAVAILABLE"
        assert b.caches[0].tokens_seen == 0
    finally:
        engine.stop()


def test_only_a_step_sent_to_the_workers_is_announced_as_queued(monkeypatch):
    """``submit_step``'s ``queued`` (what makes a Decode session read ahead) is called for a
    step that goes to the compute workers, and not for one computed at once or in the loop's
    batch: those are answered by the loop's next turn, with nothing to overlap."""
    monkeypatch.setattr(placement, "CONCURRENT_WINDOW_S", 60.0)  # as above: "with others", untimed
    engine = Engine(dataclasses.replace(BASE, inline_step_bytes=10**6))
    try:
        a, b, c = (engine.open(_tiny_config(engine)) for _ in range(3))
        x = _tiny_step(6)
        announced = []

        async def run():
            here = engine.submit_step(a, 0, *x, queued=lambda: announced.append("a"))  # alone
            soon = engine.submit_step(b, 0, *x, queued=lambda: announced.append("b"))  # the loop's batch
            assert here.done() and not soon.done() and announced == []
            # every step to the workers (the placement reads the option at every step)
            engine.placement.config = dataclasses.replace(engine.config, inline_step_bytes=0)
            queued = engine.submit_step(c, 0, *x, queued=lambda: announced.append("c"))
            assert announced == ["c"]
            return await here, await soon, await queued

        results = asyncio.run(run())
        assert [r.outcome.tokens_seen for r in results] == [1, 1, 1]
        assert announced == ["c"]
    finally:
        engine.stop()


def test_a_lone_raw_step_is_answered_at_once_and_a_busy_batcher_gets_a_future(monkeypatch):
    """``Engine.step_raw`` (a Decode step read from the wire): a lone stream's step comes back
    as its reply, computed on the calling thread with no future (the same bits as the tensor
    step of a twin stream); a step the kernel refuses (no room under policy none) is answered
    with its refusal at once, its cache as it was; while a step computes on a worker, the next
    stream's comes back as a future, answered by the loop's batch."""
    from service.api import gqa_pb2
    from service.transport.decode_step import StepShape

    monkeypatch.setattr(placement, "CONCURRENT_WINDOW_S", 0.0)  # alone unless the batcher is busy
    engine = Engine(dataclasses.replace(BASE, workers=1, inline_step_bytes=10**6))
    try:
        g = torch.Generator().manual_seed(7)
        lone, twin, late, blocker = (engine.open(_tiny_config(engine)) for _ in range(4))
        full = engine.open(
            _tiny_config(engine, policy="none", capacity=2),
            prefill={0: (torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 2, 2, 8, generator=g))},
        )
        before = full.caches[0].tokens_seen, *full.caches[0].export()
        x = _tiny_step(8)
        data = b"".join(t.numpy().tobytes() for t in x)
        spans = (data, 0, x[0].nbytes, x[0].nbytes + x[1].nbytes)
        shape = StepShape(lone)
        want = twin.step(0, *x).outcome.output

        async def alone():
            answered = engine.step_raw(lone, 0, spans, shape.reply(9, 0), received=time.perf_counter())
            refused = engine.step_raw(full, 0, spans, shape.reply(10, 0), received=time.perf_counter())
            return answered, refused

        answered, refused = asyncio.run(alone())
        assert isinstance(answered, bytes)
        got = gqa_pb2.DecodeResponse.FromString(answered)
        assert got.request_id == 9 and got.step.status.code == 0 and got.step.tokens_seen == 1
        assert torch.equal(from_proto(got.step.output, "output"), want)
        assert refused.request_id == 10 and refused.step.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        after = full.caches[0].tokens_seen, *full.caches[0].export()
        assert before[0] == after[0] and torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])

        gate = _Gate(monkeypatch)

        async def busy():
            engine.placement.config = dataclasses.replace(engine.config, inline_step_bytes=0)  # to the worker
            first = engine.submit_step(blocker, 0, *x)
            await asyncio.get_running_loop().run_in_executor(None, gate.entered[0].wait, 10)
            engine.placement.config = engine.config
            later = engine.step_raw(late, 0, spans, shape.reply(11, 0), received=time.perf_counter())
            assert isinstance(later, asyncio.Future) and not later.done()
            gate.release[0].set()
            gate.release[1].set()
            await first
            return await later

        got = gqa_pb2.DecodeResponse.FromString(asyncio.run(busy()))
        assert gate.calls == [1, 1]
        assert got.request_id == 11 and torch.equal(from_proto(got.step.output, "output"), want)
    finally:
        engine.stop()


def test_a_batch_message_runs_on_the_loop_beside_another_sessions_work():
    """A Batch session's short message runs on the event loop (``Placement.message``) even
    while another session's message computes on a worker: with 4 sessions, one message sent
    to a worker used to send every later one there (1.5-2x the server CPU per message, in
    thread hops), until the sessions paused. Never beside a message of its own session."""
    from service.engine.batcher import PendingJob

    engine = Engine(BASE)
    try:

        async def run():
            loop = asyncio.get_running_loop()
            started, gate = threading.Event(), threading.Event()

            def slow(_started):
                started.set()
                gate.wait(10)
                return "a"

            a, b = object(), object()
            job_a = PendingJob(a, slow, 0.0, loop.create_future())
            engine.batcher.submit(job_a)  # on a worker, held there
            assert started.wait(10)
            here = []
            job_b = PendingJob(b, lambda _s: here.append(threading.get_ident()) or "b", 0.0, loop.create_future())
            assert engine.batcher.run_message_inline(job_b)
            assert job_b.result == "b" and here == [threading.get_ident()]
            job_a2 = PendingJob(a, lambda _s: "a2", 0.0, loop.create_future())
            assert not engine.batcher.run_message_inline(job_a2) and job_a2.result is None
            gate.set()
            return await job_a.future

        assert asyncio.run(run()) == "a"
    finally:
        engine.stop()


def test_a_lone_sessions_slow_message_runs_on_the_loop_and_a_shared_one_on_a_worker():
    """``Placement.message``: a session's message whose previous one computed past
    ``INLINE_MESSAGE_S`` runs on the event loop while the session steps alone (no other step
    placed within ``CONCURRENT_WINDOW_S``, nothing queued or computing): the thread hops would
    cost it, and nobody waits on the loop. With another session stepping beside it, or with work
    on the workers, it goes to a worker as before."""
    import types

    from service.engine.batcher import PendingJob

    engine = Engine(dataclasses.replace(BASE, inline_step_bytes=1 << 20))
    try:

        async def run():
            loop = asyncio.get_running_loop()
            slow = int(placement.INLINE_MESSAGE_S * 1e9) * 5
            a = types.SimpleNamespace(last_compute_ns=slow)
            b = types.SimpleNamespace(last_compute_ns=slow)
            where = []

            def job(owner, received):
                fn = lambda _s: where.append(threading.get_ident()) or "done"  # noqa: E731
                return PendingJob(owner, fn, received, loop.create_future())

            here = threading.get_ident()
            clock = 100.0  # `received` stamps: far from any earlier step
            first = job(a, clock)
            assert engine.placement.message(first) and first.result == "done" and where == [here]
            again = job(a, clock + 0.5)  # alone still: the last step placed was its own
            assert engine.placement.message(again) and again.result == "done" and where == [here, here]

            other = job(b, clock + 0.5 + placement.CONCURRENT_WINDOW_S / 2)  # b within a's window
            assert not engine.placement.message(other) and other.result is None
            assert await other.future == "done" and where[-1] != here

            started, gate = threading.Event(), threading.Event()
            busy = PendingJob(b, lambda _s: (started.set(), gate.wait(10), "b")[-1], 0.0, loop.create_future())
            engine.batcher.submit(busy)  # held on a worker
            assert started.wait(10)
            late = job(a, clock + 10.0)  # alone by the window, but the workers compute
            assert not engine.placement.message(late) and late.result is None
            gate.set()
            assert await busy.future == "b" and await late.future == "done" and where[-1] != here

            a.last_compute_ns = int(placement.ALONE_MESSAGE_S * 1e9) * 2  # alone, but a long one
            longer = job(a, clock + 20.0)
            assert not engine.placement.message(longer) and longer.result is None
            assert await longer.future == "done" and where[-1] != here

        asyncio.run(run())
    finally:
        engine.stop()


# One row of the stream below is 128 bytes and its bound (a full layer and the new row) 2176:
# under 1 << 30 the step's cost is not computed at all; 256 is under the bound, so the step's own
# cost (one row) is computed and is under it; 1 is under any step.
@pytest.mark.parametrize("limit, at_once", [(1 << 30, True), (256, True), (1, False)])
@pytest.mark.parametrize("entry", ["submit_step", "step_raw"])
def test_a_lone_streams_step_past_inline_step_bytes_runs_at_once_below_the_alone_limit(
    monkeypatch, limit, at_once, entry
):
    """``Placement.decide``: a lone Decode stream's step that reads more than
    --inline-step-bytes runs at once on the loop while it reads under ``ALONE_STEP_BYTES``, else
    on a worker; both compute the step, given as tensors or read from the wire."""
    from service.api import gqa_pb2
    from service.transport.decode_step import StepShape

    monkeypatch.setattr(placement, "ALONE_STEP_BYTES", limit)
    engine = Engine(dataclasses.replace(BASE, inline_step_bytes=1))  # every step past it
    try:
        stream = engine.open(_tiny_config(engine, policy="none", window=0, capacity=16))
        assert stream.caches[0].row_bytes == 128 and stream.step_bytes_bound == 17 * 128
        x = _tiny_step(6)
        data = b"".join(t.numpy().tobytes() for t in x)

        async def run():
            if entry == "submit_step":
                step = engine.submit_step(stream, 0, *x)
                done = step.done()
                return done, (await step).outcome.tokens_seen
            spans = (data, 0, x[0].nbytes, x[0].nbytes + x[1].nbytes)
            answer = engine.step_raw(stream, 0, spans, StepShape(stream).reply(1, 0), received=time.perf_counter())
            done = not isinstance(answer, asyncio.Future)
            raw = answer if done else await answer
            return done, gqa_pb2.DecodeResponse.FromString(raw).step.tokens_seen

        done, tokens_seen = asyncio.run(run())
        assert done is at_once
        assert tokens_seen == 1 and stream.caches[0].tokens_seen == 1
    finally:
        engine.stop()
