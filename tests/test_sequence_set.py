"""service.engine.plane.SequenceSet without a server: closes from other threads (the drain, the idle
reaper) reach the owner's next message, whatever the owner did with its arrays meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from service.api import gqa_pb2
from service.config import ServerConfig
from service.engine.engine import Engine

HQ, HKV, D = 4, 2, 16


@pytest.fixture
def engine():
    engine = Engine(ServerConfig(metrics_port=0, workers=1))
    yield engine
    engine.stop()


def _open(engine, sequences, sid):
    config = engine.stream_config(
        backend="cpu",
        dtype="float32",
        batch_size=1,
        num_query_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        num_layers=1,
        policy="strict",
        window=8,
        capacity=0,
        sink_tokens=0,
    )
    sequences.add(sid, engine.open(config))


def _plan(sequences, ids):
    n = len(ids)
    q = torch.zeros((n, HQ, D)).numpy().tobytes()
    kv = torch.zeros((n, HKV, D)).numpy().tobytes()
    return sequences.plan(0, np.array(ids, dtype=np.uint64), q, kv, kv)


def test_a_close_while_the_owner_grows_its_arrays_still_refuses_that_sequence(engine):
    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sequences = engine.sequence_set(shape)
    _open(engine, sequences, 1)
    closed = sequences.get(1)
    engine.close(closed, "idle")  # another thread's close, before the owner's next adds
    for sid in range(2, 40):  # the per-slot arrays are replaced (grown) several times
        _open(engine, sequences, sid)
    plan = _plan(sequences, [1, 2, 39])
    assert [(row, sid, type(exc).__name__) for row, sid, exc in plan.refusals] == [(0, 1, "Unavailable")]
    assert plan.live.tolist() == [1, 2]


def test_a_close_landing_while_the_owner_copies_its_arrays_is_not_lost(engine, monkeypatch):
    """The interleaving that lost a mark when closes wrote the per-slot array themselves: the
    owner has copied the array to grow it, the close lands, then the owner keeps the copy."""
    import service.engine.plane

    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sequences = engine.sequence_set(shape)
    for sid in range(1, 17):  # fills the first 16 slots: the next add grows the arrays
        _open(engine, sequences, sid)
    victim = sequences.get(3)
    real = np.concatenate
    landed = []

    def concatenate_then_close(arrays, *args, **kwargs):
        grown = real(arrays, *args, **kwargs)
        if not landed:
            landed.append(True)
            engine.close(victim, "idle")  # the reaper's thread, between the copy and its use
        return grown

    monkeypatch.setattr(service.engine.plane.np, "concatenate", concatenate_then_close)
    _open(engine, sequences, 17)
    monkeypatch.undo()
    assert landed
    plan = _plan(sequences, [3, 17])
    assert [(row, sid) for row, sid, _ in plan.refusals] == [(0, 3)]


def test_a_close_queued_for_a_removed_sequence_does_not_mark_the_slot_s_next_owner(engine):
    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sequences = engine.sequence_set(shape)
    _open(engine, sequences, 1)
    stream = sequences.get(1)
    stream.on_closed(stream)  # a close in flight when the owner removes the sequence
    engine.close(sequences.remove(1), "removed")
    _open(engine, sequences, 2)  # takes the freed slot
    plan = _plan(sequences, [2])
    assert plan.refusals == [] and plan.live is None


def test_a_lone_session_s_messages_run_on_the_event_loop_and_a_shared_one_s_first_on_a_worker(engine):
    """Where ``Engine.submit_message`` runs a message: a lone session's on the calling thread
    (no hop; nobody waits on the loop), its first included; the first message of a session
    while another session steps on a worker (its cost is unknown)."""
    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sets = [engine.sequence_set(shape) for _ in range(2)]
    for sid, sequences in enumerate(sets):
        _open(engine, sequences, sid)

    async def where(sequences, sid) -> str:
        loop_thread = threading.current_thread()

        def reply(result, queue_seconds):
            assert result.fields[0, 0] > 0  # the step was computed
            return "loop" if threading.current_thread() is loop_thread else "worker"

        plan = _plan(sequences, [sid])
        return await engine.submit_message(sequences, plan, received=time.perf_counter(), reply=reply)

    async def main():
        first = await where(sets[0], 0)
        alone = await where(sets[0], 0)
        other = await where(sets[1], 1)  # another session within the window: a worker
        return first, alone, other

    assert asyncio.run(main()) == ("loop", "loop", "worker")


def test_a_repeated_ids_array_is_planned_again_after_the_set_changes(engine):
    """The reader hands the same read-only ids array for a repeated message and the set reuses
    that array's slots: never past a remove, an add or a close under the session."""
    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sequences = engine.sequence_set(shape)
    for sid in (1, 2, 3):
        _open(engine, sequences, sid)
    ids = np.array([3, 1], dtype=np.uint64)
    ids.flags.writeable = False
    kv = bytes(2 * HKV * D * 4)
    first = sequences.plan(0, ids, bytes(2 * HQ * D * 4), kv, kv)
    assert first.live is None and sequences.plan(0, ids, b"", b"", b"").slots is first.slots
    engine.close(sequences.remove(1), "removed")
    for _ in range(2):  # the first plan after the remove re-indexes; the second must not reuse
        after = sequences.plan(0, ids, b"", b"", b"")
        assert [(row, sid) for row, sid, _ in after.refusals] == [(1, 1)]
    _open(engine, sequences, 1)  # back, in a slot of its own
    again = sequences.plan(0, ids, b"", b"", b"")
    assert again.live is None and again.slots.tolist() == [sequences._slot[3], sequences._slot[1]]
    engine.close(sequences.get(3), "idle")  # a close from the reaper
    closed = sequences.plan(0, ids, b"", b"", b"")
    assert [(row, sid, type(exc).__name__) for row, sid, exc in closed.refusals] == [(0, 3, "Unavailable")]


def test_a_message_s_rows_are_written_into_its_reply_s_own_bytes(engine):
    """``submit_message(out=reply.output)``: the step writes each row into the reply's draft and
    the answer is that very object (no copy of the rows), with the message an identical set
    answers from its own output buffer (the copying reply); a refused row's place is zeros."""
    from service.transport.batch_reply import StepReply
    from service.vocab import NAME_TO_DTYPE

    shape = engine.session_shape(
        backend="cpu", dtype="float32", num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=1
    )
    sets = [engine.sequence_set(shape) for _ in range(2)]
    for sequences in sets:
        for sid in (1, 2, 3):
            _open(engine, sequences, sid)
    g = torch.Generator().manual_seed(0)
    ids = np.array([3, 9, 1], dtype=np.uint64)  # 9: not in the set, refused alone
    q = torch.randn(3, HQ, D, generator=g).numpy().tobytes()
    k, v = (torch.randn(3, HKV, D, generator=g).numpy().tobytes() for _ in range(2))

    async def answer(sequences, in_place: bool):
        plan = sequences.plan(0, ids, q, k, v)
        if not in_place:
            return await engine.submit_message(sequences, plan, received=time.perf_counter(), reply=StepReply(5, 0))
        reply = StepReply(5, 0, NAME_TO_DTYPE["float32"], (3, HQ, D))
        drafted = reply.output.obj.owner
        got = await engine.submit_message(sequences, plan, received=time.perf_counter(), reply=reply, out=reply.output)
        assert got is drafted
        return got

    async def main():
        return [await answer(sets[0], True), await answer(sets[1], False)]

    placed, copied = asyncio.run(main())
    a, b = (gqa_pb2.BatchResponse.FromString(raw).step for raw in (placed, copied))
    assert a.compute_ns > 0 and b.compute_ns > 0
    a.compute_ns = b.compute_ns = 0  # each its own
    assert a == b and [r.index for r in a.refusals] == [1] and a.tokens_seen == [1, 0, 1]
    rows = torch.frombuffer(bytearray(a.output.data), dtype=torch.float32).view(3, HQ, D)
    assert rows[0].abs().sum() > 0 and not rows[1].any() and rows[2].abs().sum() > 0
