"""The Batch stream as a client sees it: bit-identical to Decode streams, equal to the oracle,
per-sequence refusals that touch nothing else, snapshots both ways, the session's lifecycle,
and a fuzz of random interleavings against a model made of plain caches."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.contract import CacheSpec
from backends.cpu import CPUBackend
from backends.policy import EvictionPolicy
from gqa_client import BatchSession, CallFailed, Refused
from gqa_client.batch import prefill_chunks
from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.engine.engine import EngineObserver
from service.engine.tensors import to_proto
from service.server import ServerThread
from service.vocab import POLICY_ENUMS
from tests.client import CHANNEL_OPTIONS, Session, open_message
from tests.conftest import assert_close_to_oracle
from tests.oracle import attended_positions, attention_ref

HQ, HKV, D, LAYERS = 4, 2, 8, 2
NOT_FOUND, INVALID, EXHAUSTED, PRECONDITION = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)

# id -> (policy, prefill length per layer): mixed policies and lengths in one session.
SEQUENCES = {
    11: (dict(policy="none", capacity=40), (0, 3)),
    12: (dict(policy="strict", window=5), (7, 0)),
    13: (dict(policy="greedy", window=4, capacity=7), (2, 9)),
    14: (dict(policy="sink", window=4, sink_tokens=2), (10, 1)),
    15: (dict(policy="strict", window=64), (30, 30)),
}


class Recorder(EngineObserver):
    def __init__(self):
        self.messages: list[tuple[str, str, int]] = []

    def batch_message(self, backend, dtype, sequences):
        self.messages.append((backend, dtype, sequences))

    def batch_done(self, backend, dtype, size):
        self.messages.append(("computed", size))


RECORDER = Recorder()


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0), observer=RECORDER) as thread:
        yield thread


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as ch:
        yield ch


def session(channel, dtype=torch.float32, **kw) -> BatchSession:
    shape = dict(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=LAYERS) | kw
    return BatchSession(channel, dtype=dtype, **shape)


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def packed(g, n, dtype=torch.float32):
    return rand(g, n, HQ, D, dtype=dtype), rand(g, n, HKV, D, dtype=dtype), rand(g, n, HKV, D, dtype=dtype)


def state(s: BatchSession, sid: int) -> list[bytes]:
    """A sequence's complete cache state, comparable across sessions."""
    chunks = s.snapshot(sid)
    return [c.SerializeToString(deterministic=True) for c in chunks]


def sequence_oracle(sid: int, query, keys: list, values: list):
    """The float64 oracle of sequence ``sid``'s step: ``query`` (1, Hq, D) over the positions its
    policy (``SEQUENCES``) attends among ``keys``/``values``, one (1, Hkv, D) per position."""
    policy = SEQUENCES[sid][0]
    positions = attended_positions(policy["policy"], len(keys), policy.get("window", 0), policy.get("sink_tokens", 0))
    kk = torch.stack([keys[p] for p in positions], dim=2)
    vv = torch.stack([values[p] for p in positions], dim=2)
    return attention_ref(query.double().numpy(), kk.double().numpy(), vv.double().numpy(), HQ, HKV)


def prefills(g, lengths, dtype):
    return {
        layer: (rand(g, 1, HKV, n, D, dtype=dtype), rand(g, 1, HKV, n, D, dtype=dtype))
        for layer, n in enumerate(lengths)
        if n
    }


# -- the step reply's own encoding -------------------------------------------------------------
@pytest.mark.parametrize("rid", [0, 1, 300, 2**63 + 5])
@pytest.mark.parametrize("n", [0, 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reach", [2**14 - 1, 2**40])  # the fields from the small-varint table, or vectorized
def test_step_reply_bytes_parse_to_the_message_upb_builds(rid, n, dtype, reach):
    import numpy as np

    from service.engine.plane import NotFound, StepResult
    from service.errors import InvalidArgument
    from service.transport.batch_reply import step_reply_bytes

    g = torch.Generator().manual_seed(n)
    output = torch.randn(n, 32, 128, generator=g).to(dtype)
    fields = np.zeros((n, 6), dtype=np.int64)
    fields[:, 0] = np.arange(n)
    fields[:, 1] = np.arange(n) * 200  # one- and two-byte varints
    fields[:, 3] = np.arange(n) * 70000  # beyond the table, of several widths: vectorized
    fields[:, 5] = reach
    refusals = [(n - 1, 7, NotFound("step.ids: sequence 7 ...")), (n, 2**63, InvalidArgument("x"))] if n else []
    want = gqa_pb2.BatchResponse(request_id=rid, step=gqa_pb2.BatchStepResult(layer=3, compute_ns=123456789))
    want.step.status.SetInParent()
    for name, column in zip(
        ("tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach"), fields.T
    ):
        getattr(want.step, name).extend(column.tolist())
    for row, sid, exc in refusals:
        want.step.refusals.add(index=row, id=sid, status=gqa_pb2.Status(code=exc.code_number, message=exc.message))
    want.step.output.CopyFrom(to_proto(output))
    raw = step_reply_bytes(rid, 3, StepResult(fields, refusals, 123456789, output))
    # the set's output buffer hands its bytes as a buffer over the same memory: the same reply
    data = memoryview(output.reshape(-1).view(torch.uint8).numpy())
    assert step_reply_bytes(rid, 3, StepResult(fields, refusals, 123456789, output, data)) == raw
    got = gqa_pb2.BatchResponse.FromString(raw)
    assert got == want
    assert got.step.HasField("status") and got.step.HasField("output")
    assert len(raw) == want.ByteSize()
    # written in place: the rows into the reply's own bytes, then its numbers after them
    placed = _in_place(rid, 3, output, StepResult(fields, refusals, 123456789, None))
    assert gqa_pb2.BatchResponse.FromString(placed) == want and len(placed) == want.ByteSize()


def _in_place(rid, layer, output, result, *, expect_in_place=True) -> bytes:
    """``StepReply``'s bytes with ``output``'s rows written into its draft, as a set's step
    writes them; ``expect_in_place``: the reply is the drafted object itself (no copy)."""
    from service.transport.batch_reply import StepReply
    from service.vocab import TORCH_TO_DTYPE

    reply = StepReply(rid, layer, TORCH_TO_DTYPE[output.dtype], tuple(output.shape))
    if not output.numel():
        assert reply.output is None  # nothing to write in place
        return reply(result._replace(output=output), 0.0)
    rows = reply.output
    rows[:] = output.reshape(-1).view(torch.uint8).numpy().tobytes()
    drafted = rows.obj.owner
    raw = reply(result._replace(data=rows), 0.0)
    assert (raw is drafted) == expect_in_place
    with pytest.raises(ValueError):  # released: nothing writes into the reply once it is out
        rows[0] = 0
    return raw


def test_a_reply_whose_refusals_outgrow_its_room_is_copied_and_still_right():
    """More refusal text than the draft keeps room for: the reply is built by copying the rows,
    and parses to what upb builds all the same."""
    import numpy as np

    from service.engine.plane import StepResult
    from service.errors import InvalidArgument
    from service.transport.batch_reply import step_reply_bytes

    n = 16
    output = torch.randn(n, 32, 128, generator=torch.Generator().manual_seed(0))
    fields = np.zeros((n, 6), dtype=np.int64)
    refusals = [(i, 100 + i, InvalidArgument("step.ids: " + "x" * 300)) for i in range(n)]
    result = StepResult(fields, refusals, 5, None)
    raw = _in_place(9, 1, output, result, expect_in_place=False)
    want = step_reply_bytes(9, 1, result._replace(output=output))
    assert gqa_pb2.BatchResponse.FromString(raw) == gqa_pb2.BatchResponse.FromString(want)
    assert len(gqa_pb2.BatchResponse.FromString(raw).step.refusals) == n


def test_a_reply_whose_rows_the_set_wrote_elsewhere_copies_them():
    """A set that wrote its own buffer (off the CPU, say) gets the copied reply: same message."""
    import numpy as np

    from service.engine.plane import StepResult
    from service.transport.batch_reply import StepReply, step_reply_bytes
    from service.vocab import TORCH_TO_DTYPE

    output = torch.randn(4, 32, 128, generator=torch.Generator().manual_seed(1))
    result = StepResult(np.ones((4, 6), dtype=np.int64), [], 7, output)
    reply = StepReply(3, 0, TORCH_TO_DTYPE[output.dtype], tuple(output.shape))
    assert reply.output is not None
    assert reply(result, 0.0) == step_reply_bytes(3, 0, result)


def test_a_refused_message_reply_is_status_and_layer_only():
    from service.errors import InvalidArgument
    from service.transport.batch_reply import step_reply_bytes

    raw = step_reply_bytes(5, 2, None, refused=InvalidArgument("step.layer: 9 is out of range"))
    want = gqa_pb2.BatchResponse(
        request_id=5,
        step=gqa_pb2.BatchStepResult(
            status=gqa_pb2.Status(code=INVALID.value[0], message="step.layer: 9 is out of range"), layer=2
        ),
    )
    assert gqa_pb2.BatchResponse.FromString(raw) == want


# -- Batch == Decode == oracle ---------------------------------------------------------------
def test_concurrent_sessions_get_the_bits_a_lone_session_gets(channel):
    """Sessions stepping at once (each message computed on the event loop or on a compute
    worker, whichever ``Engine.submit_message`` picks) answer every message with the bits one
    session stepping alone gets for the same inputs."""
    import threading

    g = torch.Generator().manual_seed(11)
    steps = [packed(g, 4) for _ in range(12)]

    def run(results: list, i: int) -> None:
        with session(channel) as s:
            for sid in range(4):
                s.add(sid, policy="strict", window=3)
            results[i] = [s.step(j % LAYERS, [0, 1, 2, 3], *steps[j]).output for j in range(len(steps))]

    alone = [None]
    run(alone, 0)
    together = [None] * 3
    threads = [threading.Thread(target=run, args=(together, i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for outputs in together:
        assert outputs is not None and all(torch.equal(a, b) for a, b in zip(outputs, alone[0], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixed_sequences_match_decode_streams_and_the_oracle(channel, dtype):
    g = torch.Generator().manual_seed(3)
    batch = session(channel, dtype)
    decode: dict[int, Session] = {}
    history: dict[tuple[int, int], tuple[list, list]] = {}  # (id, layer) -> keys, values per position
    for sid, (policy, lengths) in SEQUENCES.items():
        pre = prefills(g, lengths, dtype)
        added = batch.add(sid, prefill=pre, **policy)
        assert list(added.tokens_seen) == list(lengths)
        decode[sid] = Session(
            channel, open_message(hq=HQ, hkv=HKV, d=D, layers=LAYERS, dtype=dtype, prefill=pre, **policy)
        )
        for layer in range(LAYERS):
            k, v = pre.get(layer, (torch.empty(1, HKV, 0, D), torch.empty(1, HKV, 0, D)))
            history[sid, layer] = ([k[:, :, i] for i in range(k.shape[2])], [v[:, :, i] for i in range(v.shape[2])])

    ids_all = list(SEQUENCES)
    for step in range(24):
        layer = step % LAYERS
        # a changing subset in a changing order: lengths drift apart
        ids = [sid for i, sid in enumerate(ids_all) if (step + i) % 3] if step % 4 else ids_all[::-1]
        q, k, v = packed(g, len(ids), dtype)
        result = batch.step(layer, ids, q, k, v)
        assert not result.refusals
        for i, sid in enumerate(ids):
            reply = decode[sid].step(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1])
            expected = decode[sid].output(reply)
            assert torch.equal(result.output[i : i + 1], expected), (step, sid)
            r = reply.step
            assert (
                result.tokens_seen[i],
                result.resident[i],
                result.first_position[i],
                result.last_position[i],
                result.evicted_tokens[i],
                result.rollback_reach[i],
            ) == (r.tokens_seen, r.resident, r.first_position, r.last_position, r.evicted_tokens, r.rollback_reach)
            keys, values = history[sid, layer]
            keys.append(k[i : i + 1])
            values.append(v[i : i + 1])
            oracle = sequence_oracle(sid, q[i : i + 1], keys, values)
            assert_close_to_oracle(result.output[i : i + 1], oracle, dtype, f"step {step} sequence {sid}")
    for stream in decode.values():
        stream.close()
    batch.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by `make gpu-check`)")
def test_cuda_sequences_match_decode_streams_and_the_oracle(channel):
    """The cuda backend behind both front ends: the request's tensors arrive on the CPU and the
    server moves them to the caches' device; a Batch session's rows and the same sequences' Decode
    streams give the same bits, within the oracle's float16 tolerance."""
    d, dtype = 16, torch.float16  # the Triton kernel's smallest tile width
    g = torch.Generator().manual_seed(12)
    batch = session(channel, dtype, head_dim=d, backend="cuda")
    decode: dict[int, Session] = {}
    history: dict[int, tuple[list, list]] = {}  # layer 0's keys, values per position
    for sid, (policy, lengths) in SEQUENCES.items():
        pre = {layer: (rand(g, 1, HKV, n, d, dtype=dtype), rand(g, 1, HKV, n, d, dtype=dtype)) for layer, n in
               enumerate(lengths) if n}  # fmt: skip
        batch.add(sid, prefill=pre, **policy)
        message = open_message(hq=HQ, hkv=HKV, d=d, layers=LAYERS, dtype=dtype, backend="cuda", prefill=pre, **policy)
        decode[sid] = Session(channel, message)
        k, v = pre.get(0, (torch.empty(1, HKV, 0, d), torch.empty(1, HKV, 0, d)))
        history[sid] = ([k[:, :, i] for i in range(k.shape[2])], [v[:, :, i] for i in range(v.shape[2])])
    ids = list(SEQUENCES)
    for step in range(6):
        q, k, v = (rand(g, len(ids), h, d, dtype=dtype) for h in (HQ, HKV, HKV))
        result = batch.step(0, ids, q, k, v)
        assert not result.refusals, result.refusals
        for i, sid in enumerate(ids):
            reply = decode[sid].step(0, q[i : i + 1], k[i : i + 1], v[i : i + 1])
            assert reply.step.status.code == 0, reply.step.status.message
            assert torch.equal(result.output[i : i + 1], decode[sid].output(reply)), (step, sid)
            keys, values = history[sid]
            keys.append(k[i : i + 1])
            values.append(v[i : i + 1])
            oracle = sequence_oracle(sid, q[i : i + 1], keys, values)
            assert_close_to_oracle(result.output[i : i + 1], oracle, dtype, f"step {step} sequence {sid}")
    for stream in decode.values():
        stream.close()
    batch.close()


def test_step_messages_feed_the_observer_and_the_open_count(channel, server):
    RECORDER.messages.clear()
    g = torch.Generator().manual_seed(4)
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)  # BatchSession takes a stub as well as a channel
    with session(stub) as s:
        for sid in (1, 2, 3):
            s.add(sid, policy="strict", window=4)
        assert server.engine.batch_sequences_open == 3
        s.step(0, [1, 2, 3], *packed(g, 3))
        s.step(1, [2, 4], *packed(g, 2))  # 4 is unknown: one step computed, a message of two
        s.remove([2])
        assert server.engine.batch_sequences_open == 2
    assert RECORDER.messages == [("computed", 3), ("cpu", "float32", 3), ("computed", 1), ("cpu", "float32", 2)]
    assert server.engine.batch_sequences_open == 0 and server.engine.bytes_reserved == 0


# -- per-sequence refusals ---------------------------------------------------------------------
def twin_sessions(channel, g):
    """Two sessions holding the same sequences 1, 2 (strict) and 3 (none, one slot left)."""
    pair = []
    pre = {0: (rand(g, 1, HKV, 5, D), rand(g, 1, HKV, 5, D))}
    for _ in range(2):
        s = session(channel)
        s.add(1, policy="strict", window=4, prefill=pre)
        s.add(2, policy="greedy", window=3, capacity=5)
        s.add(3, policy="none", capacity=6, prefill=pre)
        pair.append(s)
    return pair


def assert_same_states(a: BatchSession, b: BatchSession, ids):
    for sid in ids:
        assert state(a, sid) == state(b, sid), f"sequence {sid} differs"


@pytest.mark.parametrize("case", ["unknown", "duplicate", "full"])
def test_refused_sequences_leave_the_others_as_if_not_sent(channel, case):
    g = torch.Generator().manual_seed(5)
    tested, reference = twin_sessions(channel, g)
    q, k, v = packed(g, 3)
    reference.step(0, [3], q[2:], k[2:], v[2:])  # 3 is full after this one ...
    tested.step(0, [3], q[2:], k[2:], v[2:])
    q, k, v = packed(g, 3)
    if case == "unknown":
        ids, refused, code = [1, 99, 2], {99}, NOT_FOUND
    elif case == "duplicate":
        ids, refused, code = [2, 1, 2], {2}, INVALID
    else:
        ids, refused, code = [1, 3, 2], {3}, EXHAUSTED  # ... so this step of 3 has no room
    result = tested.step(0, ids, q, k, v)
    assert set(result.refusals) == refused and {r.code for r in result.refusals.values()} == {code}
    kept = [i for i, sid in enumerate(ids) if sid not in refused]
    alone = reference.step(0, [ids[i] for i in kept], q[kept], k[kept], v[kept])
    assert torch.equal(result.output[kept], alone.output)
    for i, sid in enumerate(ids):
        if sid in refused:
            assert not result.output[i].any() and result.tokens_seen[i] == 0
    assert_same_states(tested, reference, [1, 2, 3])
    # and the next step over everyone agrees too
    q, k, v = packed(g, 2)
    assert torch.equal(tested.step(1, [2, 1], q, k, v).output, reference.step(1, [2, 1], q, k, v).output)
    tested.close()
    reference.close()


@pytest.mark.parametrize("mangle", ["layer", "n", "heads", "dtype", "bytes"])
def test_a_step_message_that_does_not_fit_is_refused_whole(channel, mangle):
    g = torch.Generator().manual_seed(6)
    tested, reference = twin_sessions(channel, g)
    q, k, v = packed(g, 2)
    layer, ids = 0, [1, 2]
    message = gqa_pb2.BatchStep(layer=layer, ids=ids, query=to_proto(q), new_key=to_proto(k), new_value=to_proto(v))
    if mangle == "layer":
        message.layer = LAYERS
    elif mangle == "n":
        message.ids.append(3)
    elif mangle == "heads":
        message.new_key.CopyFrom(to_proto(rand(g, 2, HQ, D)))
    elif mangle == "dtype":
        message.query.CopyFrom(to_proto(q.to(torch.float16)))
    else:
        message.new_value.data = message.new_value.data[:-4]
    rid = tested._send(step=message)
    answer = tested._recv(rid).step
    assert answer.status.code == INVALID.value[0] and not answer.output.data and not answer.tokens_seen
    assert_same_states(tested, reference, [1, 2, 3])
    tested.close()
    reference.close()


def test_add_refusals_are_in_band(channel):
    g = torch.Generator().manual_seed(7)
    s = session(channel)
    s.add(1, policy="strict", window=4)
    with pytest.raises(Refused) as dup:
        s.add(1, policy="strict", window=8)
    assert dup.value.code == INVALID and "already" in dup.value.message
    with pytest.raises(Refused) as bad:
        s.add(2, policy="none", capacity=0)  # no room at all
    assert bad.value.code == INVALID
    with pytest.raises(Refused) as shape:
        s.add(3, policy="strict", window=4, prefill={0: (rand(g, 2, HKV, 3, D), rand(g, 2, HKV, 3, D))})  # batch 2
    assert shape.value.code == INVALID
    out = s.step(0, [1], *packed(g, 1))
    assert not out.refusals and out.tokens_seen == [1]
    s.close()


# -- a prefill in several messages (BatchAdd.more) ----------------------------------------------
@pytest.mark.parametrize("max_bytes", [1, 300, 5000])
def test_prefill_chunks_stay_under_the_limit_and_rebuild_the_prefill(max_bytes):
    g = torch.Generator().manual_seed(max_bytes)
    pre = {layer: (rand(g, 1, HKV, n, D), rand(g, 1, HKV, n, D)) for layer, n in ((0, 37), (1, 0), (2, 5))}
    chunks = prefill_chunks(pre, max_bytes)
    row = 2 * HKV * D * 4
    rebuilt: dict[int, list] = {}
    for chunk in chunks:
        layers = [layer for layer, _, _ in chunk]
        assert len(layers) == len(set(layers)), "a layer at most once per message"
        assert sum(k.numel() + v.numel() for _, k, v in chunk) * 4 <= max(max_bytes, row)
        for layer, k, v in chunk:
            rebuilt.setdefault(layer, []).append((k, v))
    assert sorted(rebuilt) == [0, 1, 2]
    for layer, (k, v) in pre.items():
        assert torch.equal(torch.cat([x for x, _ in rebuilt[layer]], dim=2), k)
        assert torch.equal(torch.cat([y for _, y in rebuilt[layer]], dim=2), v)
    assert len(chunks) >= -(-42 * row // max(max_bytes, row))  # 42 positions in all: no message wasted


@pytest.mark.parametrize("policy", [dict(policy="none", capacity=60), dict(policy="sink", window=8, sink_tokens=2)])
def test_a_prefill_in_many_messages_equals_one_message(channel, policy):
    g = torch.Generator().manual_seed(21)
    pre = prefills(g, (40, 23), torch.float32)
    s = session(channel)
    s.add(1, prefill=pre, **policy)
    added = s.add(2, prefill=pre, max_chunk_bytes=700, **policy)  # 700 bytes: 5 positions a message
    assert len(prefill_chunks(pre, 700)) > 10
    assert list(added.tokens_seen) == [40, 23]
    assert state(s, 1)[1:] == state(s, 2)[1:]  # every layer's chunk; the first holds the config too
    q, k, v = packed(g, 1)
    a, b = s.step(1, [1], q, k, v), s.step(1, [2], q, k, v)
    assert torch.equal(a.output, b.output) and a.tokens_seen == b.tokens_seen == [24]
    s.close()


def _raw_add(s: BatchSession, rid: int, add: gqa_pb2.BatchAdd) -> None:
    s._requests.put(gqa_pb2.BatchRequest(request_id=rid, add=add))


def _entry(add: gqa_pb2.BatchAdd, layer: int, k, v) -> gqa_pb2.BatchAdd:
    add.prefill.add(layer=layer, key=to_proto(k), value=to_proto(v))
    return add


@pytest.mark.parametrize(
    "bad, message",
    [
        ("shape", "add (prefill chunk 1).prefill[0].key.shape"),
        ("dtype", "add (prefill chunk 1).prefill[0].key.dtype"),
        ("config", "first chunk only"),
        ("layer", "add (prefill chunk 1).prefill[0].layer"),
        ("twice", "appears twice in one chunk"),
    ],
)
def test_a_bad_prefill_chunk_refuses_the_sequence_and_leaves_the_session_as_it_was(channel, bad, message):
    g = torch.Generator().manual_seed(22)
    s = session(channel)
    s.add(1, policy="strict", window=6, prefill=prefills(g, (4, 4), torch.float32))
    before = state(s, 1)
    good = lambda n: (rand(g, 1, HKV, n, D), rand(g, 1, HKV, n, D))  # noqa: E731
    _raw_add(s, 9, _entry(gqa_pb2.BatchAdd(id=2, policy=POLICY_ENUMS["none"], capacity=50, more=True), 0, *good(3)))
    middle = gqa_pb2.BatchAdd(id=2, more=True)
    if bad == "shape":
        _entry(middle, 0, rand(g, 1, HKV + 1, 3, D), rand(g, 1, HKV + 1, 3, D))
    elif bad == "dtype":
        _entry(middle, 0, rand(g, 1, HKV, 3, D).to(torch.bfloat16), rand(g, 1, HKV, 3, D).to(torch.bfloat16))
    elif bad == "config":
        middle.window = 4
        _entry(middle, 0, *good(3))
    elif bad == "layer":
        _entry(middle, LAYERS, *good(3))
    else:
        _entry(_entry(middle, 1, *good(3)), 1, *good(3))
    _raw_add(s, 9, middle)
    _raw_add(s, 9, _entry(gqa_pb2.BatchAdd(id=2), 1, *good(3)))  # the last chunk: answered
    with pytest.raises(Refused) as refused:
        s._added(s._recv(9).added, 2)
    assert refused.value.code == INVALID and message in refused.value.message
    assert s.step(0, [2], *packed(g, 1)).refusals[2].code == NOT_FOUND  # nothing of 2 was kept
    assert state(s, 1) == before
    s.add(2, policy="none", capacity=50, prefill={0: good(7)}, max_chunk_bytes=300)  # the id is free again
    assert s.step(0, [1, 2], *packed(g, 2)).tokens_seen == [5, 8]
    s.close()


def test_chunks_larger_than_the_budget_are_refused_and_freed():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, max_cache_bytes=64 << 10)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        g = torch.Generator().manual_seed(23)
        s = session(ch)
        big = {0: (rand(g, 1, HKV, 600, D), rand(g, 1, HKV, 600, D))}  # 76800 bytes in 8 KiB messages
        with pytest.raises(Refused) as refused:
            s.add(1, policy="none", capacity=700, prefill=big, max_chunk_bytes=8 << 10)
        assert refused.value.code == INVALID and "more bytes than this server could ever admit" in refused.value.message
        assert not s.step(0, [], *packed(g, 0)).refusals  # the session serves on
        s.add(
            1,
            policy="strict",
            window=8,
            prefill={0: (big[0][0][:, :, :20], big[0][1][:, :, :20])},
            max_chunk_bytes=1024,
        )
        s.close()
        assert wait_for(lambda: srv.engine.bytes_reserved == 0 and srv.engine.batch_sequences_open == 0)


def test_budget_and_stream_limit_refuse_adds_in_band():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, max_cache_bytes=3 * 4096 + 256, max_streams=4)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        g = torch.Generator().manual_seed(8)
        s = session(ch)
        for sid in (1, 2, 3):
            s.add(sid, policy="strict", window=16)  # 2 layers x (keys, values) x Hkv x 16 x D x 4 = 4096 bytes each
        with pytest.raises(Refused) as full:
            s.add(4, policy="strict", window=16)
        assert full.value.code == EXHAUSTED and "cache bytes" in full.value.message
        s.add(4, policy="strict", window=1)  # 256 bytes: the rest of the budget
        with pytest.raises(Refused) as streams:
            s.add(5, policy="strict", window=1)
        assert streams.value.code == EXHAUSTED and "streams" in streams.value.message
        out = s.step(0, [1, 2, 3, 4], *packed(g, 4))
        assert not out.refusals
        s.remove([1])
        s.add(6, policy="strict", window=16)  # the bytes of 1 came back
        assert srv.engine.batch_sequences_open == 4
        s.close()
        assert wait_for(lambda: srv.engine.bytes_reserved == 0 and srv.engine.batch_sequences_open == 0)


def test_rollback_remove_and_snapshot_refusals(channel):
    g = torch.Generator().manual_seed(9)
    s = session(channel)
    s.add(1, policy="strict", window=4)  # strict: nothing can be rolled back once the window is full
    s.add(2, policy="none", capacity=20)
    for layer in (0, 1, 0, 1, 0, 1, 0, 1, 0, 1):
        s.step(layer, [1, 2], *packed(g, 2))
    before = state(s, 1)
    result = s.rollback([1, 2, 77], [2, 2, 1])
    codes = {sid: r.code for sid, r in result.refusals.items()}
    assert codes == {1: PRECONDITION, 77: NOT_FOUND}
    assert result.tokens_seen == [[0, 0], [3, 3], [0, 0]]  # a row per id, a column per layer
    assert state(s, 1) == before
    one = s.rollback([2], [1], layer=1)
    assert not one.refusals and one.tokens_seen == [[3, 2]]
    removed = s.remove([5, 2])
    assert {sid: (r.code, r.message) for sid, r in removed.items()} == {
        5: (NOT_FOUND, "remove.ids: sequence 5 is not in the session")
    }
    with pytest.raises(Refused) as missing:
        s.snapshot(2)
    assert missing.value.code == NOT_FOUND
    assert s.step(0, [1], *packed(g, 1)).tokens_seen == [6]
    s.close()


# -- snapshots both ways -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["strict", "greedy", "sink", "none"])
def test_snapshot_from_decode_restores_into_batch_and_back(channel, policy):
    cfg = {
        "strict": dict(policy="strict", window=5),
        "greedy": dict(policy="greedy", window=4, capacity=7),
        "sink": dict(policy="sink", window=4, sink_tokens=2),
        "none": dict(policy="none", capacity=30),
    }[policy]
    g = torch.Generator().manual_seed(10)
    dec = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, layers=LAYERS, **cfg))
    for i in range(9):
        dec.step(i % LAYERS, *packed(g, 1))
    batch = session(channel)
    batch.add(1, policy="strict", window=3)
    added = batch.restore(7, dec.snapshot())
    assert list(added.tokens_seen) == [5, 4]
    for i in range(6):  # the restored sequence continues exactly as the original stream
        layer = i % LAYERS
        q, k, v = packed(g, 2)
        out = batch.step(layer, [7, 1], q, k, v)
        assert torch.equal(out.output[:1], dec.output(dec.step(layer, q[:1], k[:1], v[:1])))
    # and back: the Batch sequence's snapshot opens a Decode stream that continues the same
    back = Session(channel, restore=batch.snapshot(7))
    assert list(back.opened.tokens_seen) == [8, 7]
    for i in range(4):
        q, k, v = packed(g, 1)
        out = batch.step(i % LAYERS, [7], q, k, v)
        assert torch.equal(out.output, back.output(back.step(i % LAYERS, q, k, v)))
        dec.step(i % LAYERS, q, k, v)
    assert state(batch, 7) == [c.SerializeToString(deterministic=True) for c in back.snapshot()]
    for closing in (dec, back, batch):
        closing.close()


def test_multi_chunk_snapshot_restores_in_batch_and_mismatches_are_refused():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, max_message_bytes=64 << 10)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        g = torch.Generator().manual_seed(12)
        s = session(ch)
        s.add(1, policy="none", capacity=700, prefill={0: (rand(g, 1, HKV, 400, D), rand(g, 1, HKV, 400, D))})
        chunks = s.snapshot(1)
        assert len(chunks) >= 3  # the configuration, then layer 0 in two slices or more
        s.restore(2, chunks)
        q, k, v = packed(g, 1)
        assert torch.equal(s.step(0, [1], q, k, v).output, s.step(0, [2], q, k, v).output)
        other = session(ch, num_layers=3)
        with pytest.raises(Refused) as mismatch:
            other.restore(1, chunks)
        assert mismatch.value.code == INVALID and "num_layers 2 (session: 3)" in mismatch.value.message
        with pytest.raises(Refused) as in_use:
            s.restore(1, chunks)
        assert in_use.value.code == INVALID
        tampered = [gqa_pb2.SnapshotChunk.FromString(c.SerializeToString()) for c in chunks]
        tampered[2].key.data = bytes(len(tampered[2].key.data))
        with pytest.raises(Refused) as crc:
            s.restore(3, tampered)
        assert crc.value.code == INVALID and "checksum" in crc.value.message
        assert s.step(0, [1, 2], *packed(g, 2)).tokens_seen == [402, 402]
        other.close()
        s.close()


# -- the session's lifecycle -----------------------------------------------------------------------
def raw_call(channel, *requests):
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)
    return list(stub.Batch(iter(requests), timeout=30))


def open_request(**kw):
    fields = dict(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=LAYERS) | kw
    return gqa_pb2.BatchRequest(request_id=0, open=gqa_pb2.BatchOpen(**fields))


@pytest.mark.parametrize(
    "requests, code, words",
    [
        ([gqa_pb2.BatchRequest(request_id=0, add=gqa_pb2.BatchAdd(id=1))], grpc.StatusCode.INVALID_ARGUMENT, "first"),
        ([open_request(), open_request()], grpc.StatusCode.INVALID_ARGUMENT, "only begin"),
        ([open_request(), gqa_pb2.BatchRequest(request_id=1)], grpc.StatusCode.INVALID_ARGUMENT, "must set"),
        ([open_request(num_query_heads=3)], grpc.StatusCode.INVALID_ARGUMENT, "multiple"),
        ([open_request(head_dim=0)], grpc.StatusCode.INVALID_ARGUMENT, "head_dim"),
        ([open_request(backend="cuda")], grpc.StatusCode.FAILED_PRECONDITION, "cuda"),
    ],
    ids=["no-open", "second-open", "empty", "heads", "head-dim", "backend"],
)
def test_protocol_errors_and_refused_opens_end_the_rpc(channel, server, requests, code, words):
    if words == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(grpc.RpcError) as ended:
        raw_call(channel, *requests)
    assert ended.value.code() == code and words in ended.value.details()
    assert wait_for(lambda: server.engine.batch_sequences_open == 0)


def test_a_request_that_does_not_parse_ends_the_rpc_with_invalid_argument(channel, server):
    """As in Decode (it was INTERNAL here before the statuses were made in one place)."""
    call = channel.stream_stream("/gqa.v1.AttentionService/Batch")  # raw bytes both ways
    with pytest.raises(grpc.RpcError) as ended:
        list(call(iter([open_request().SerializeToString(), b"\xff\xff\xff"]), timeout=30))
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not valid protobuf" in ended.value.details()
    assert wait_for(lambda: server.engine.batch_sequences_open == 0)


def test_a_fault_mid_session_ends_it_internal_with_the_session_s_fixed_message(channel, server, monkeypatch):
    """The Batch method's own INTERNAL message (service.transport.statuses); the session's sequences freed."""
    from service.transport import batch_session

    def broken(self, request):
        raise RuntimeError("/secret/path.py: a fault")

    monkeypatch.setattr(batch_session.Session, "remove", broken)
    remove = gqa_pb2.BatchRequest(request_id=1, remove=gqa_pb2.BatchRemove(ids=[1]))
    with pytest.raises(grpc.RpcError) as ended:
        raw_call(channel, open_request(), remove)
    assert ended.value.code() == grpc.StatusCode.INTERNAL
    assert ended.value.details() == "internal error; the session was closed"
    assert wait_for(lambda: server.engine.batch_sequences_open == 0)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_idle_session_is_ended_and_freed():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=0.3)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        s = session(ch)
        s.add(1, policy="strict", window=4)
        s.add(2, policy="strict", window=4)
        assert srv.engine.bytes_reserved > 0
        assert wait_for(lambda: srv.engine.bytes_reserved == 0 and srv.engine.batch_sequences_open == 0)
        with pytest.raises(CallFailed) as ended:
            s.step(0, [1], *packed(torch.Generator().manual_seed(1), 1))
        assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_busy_session_is_not_reaped():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=0.5)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        g = torch.Generator().manual_seed(2)
        s = session(ch)
        s.add(1, policy="strict", window=4)
        s.add(2, policy="strict", window=4)  # never stepped, but its session is busy
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            s.step(0, [1], *packed(g, 1))
            time.sleep(0.05)
        assert not s.step(1, [2], *packed(g, 1)).refusals
        s.close()


def test_drain_ends_sessions_with_unavailable():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, grace_period_s=0.3)
    srv = ServerThread(config).start()
    with grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        s = session(ch)
        s.add(1, policy="strict", window=4)
        # Not waited on: the drain ends with the server's loop, which may close before it answers.
        asyncio.run_coroutine_threadsafe(srv.server.drain(), srv.loop)
        assert wait_for(lambda: srv.engine.bytes_reserved == 0 and srv.engine.batch_sequences_open == 0)
        with pytest.raises(CallFailed) as ended:
            s.step(0, [1], *packed(torch.Generator().manual_seed(1), 1))
        assert ended.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in ended.value.message
    srv._thread.join(15)  # the drained server stops by itself
    assert not srv._thread.is_alive()


# -- fuzz ---------------------------------------------------------------------------------------
IDS = st.integers(0, 5)
FUZZ_POLICIES = [
    dict(policy="none", capacity=6),
    dict(policy="strict", window=3),
    dict(policy="greedy", window=3, capacity=5),
    dict(policy="sink", window=3, sink_tokens=1),
]
OPS = st.one_of(
    st.tuples(st.just("add"), IDS, st.integers(0, len(FUZZ_POLICIES) - 1), st.integers(0, 4)),
    st.tuples(st.just("step"), st.integers(0, LAYERS - 1), st.lists(IDS, max_size=5)),
    st.tuples(st.just("step"), st.integers(0, LAYERS - 1), st.lists(IDS, max_size=5)),
    st.tuples(st.just("remove"), st.lists(IDS, max_size=2)),
    st.tuples(st.just("rollback"), IDS, st.integers(0, 3), st.sampled_from([None, 0, 1])),
    st.tuples(st.just("snapshot"), IDS, IDS),
)


def model_caches(policy: dict, lengths: int, g) -> tuple[list, dict]:
    pol = EvictionPolicy.create(
        policy["policy"],
        window=policy.get("window", 0),
        capacity=policy.get("capacity", 0),
        sinks=policy.get("sink_tokens", 0),
    )
    caches = [CPUBackend().create_cache(CacheSpec(1, HQ, HKV, D, torch.float32, pol)) for _ in range(LAYERS)]
    pre = {}
    if lengths:
        pre[0] = (rand(g, 1, HKV, lengths, D), rand(g, 1, HKV, lengths, D))
        caches[0].prefill(*pre[0])
    return caches, pre


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=25))
def test_fuzz_interleavings_never_lose_or_mix_sequences(channel, server, ops):
    g = torch.Generator().manual_seed(len(ops))
    model: dict[int, list] = {}  # id -> one plain cache per layer, fed the same tokens
    s = session(channel)
    try:
        for op in ops:
            if op[0] == "add":
                _, sid, which, n = op
                policy = FUZZ_POLICIES[which]
                caches, pre = model_caches(policy, n, g)
                if sid in model:
                    with pytest.raises(Refused):
                        s.add(sid, prefill=pre, **policy)
                else:
                    s.add(sid, prefill=pre, **policy)
                    model[sid] = caches
            elif op[0] == "step":
                _, layer, ids = op
                q, k, v = packed(g, len(ids))
                result = s.step(layer, ids, q, k, v)
                for i, sid in enumerate(ids):
                    if ids.count(sid) > 1:
                        assert result.refusals[sid].code == INVALID
                    elif sid not in model:
                        assert result.refusals[sid].code == NOT_FOUND
                    elif not model[sid][layer].policy.has_room(model[sid][layer].tokens_seen):
                        assert result.refusals[sid].code == EXHAUSTED
                    else:
                        expected = model[sid][layer].step(q[i : i + 1], k[i : i + 1], v[i : i + 1])
                        assert sid not in result.refusals
                        assert torch.equal(result.output[i : i + 1], expected.output)
                        assert result.tokens_seen[i] == expected.tokens_seen
            elif op[0] == "remove":
                refusals = s.remove(op[1])
                for sid in op[1]:
                    if sid in model:
                        del model[sid]
                    else:
                        assert refusals[sid].code == NOT_FOUND
            elif op[0] == "rollback":
                _, sid, count, layer = op
                result = s.rollback([sid], [count], layer=layer)
                codes = [r.code for r in result.refusals.values()]
                if sid not in model:
                    assert codes == [NOT_FOUND]
                    continue
                targets = model[sid] if layer is None else [model[sid][layer]]
                exact = all(count <= c.policy.rollback_reach(c.tokens_seen) for c in targets)
                assert codes == ([] if exact else [PRECONDITION])
                if exact:
                    for c in targets:
                        c.rollback(count)
                    assert result.tokens_seen == [[c.tokens_seen for c in model[sid]]]
            else:
                _, sid, new = op
                if sid not in model:
                    with pytest.raises(Refused):
                        s.snapshot(sid)
                    continue
                chunks = s.snapshot(sid)
                assert chunks.tokens_seen == [c.tokens_seen for c in model[sid]]
                if new not in model:  # the copy is a new, independent sequence
                    s.restore(new, chunks)
                    copies = []
                    for c in model[sid]:
                        copy = CPUBackend().create_cache(c.spec)
                        copy.load_state(c.tokens_seen, c.export_state())
                        copies.append(copy)
                    model[new] = copies
        # every sequence the model holds is still there, with its own history
        ids = sorted(model)
        for layer in range(LAYERS):
            q, k, v = packed(g, len(ids))
            result = s.step(layer, ids, q, k, v)
            for i, sid in enumerate(ids):
                cache = model[sid][layer]
                if cache.policy.has_room(cache.tokens_seen):
                    assert torch.equal(
                        result.output[i : i + 1], cache.step(q[i : i + 1], k[i : i + 1], v[i : i + 1]).output
                    )
        assert server.engine.batch_sequences_open == len(model)
    finally:
        s.close()
    assert wait_for(lambda: server.engine.batch_sequences_open == 0)


# -- other backends --------------------------------------------------------------------------------
def test_int8_sequences_match_decode_streams_and_move_between_them(channel):
    """int8 caches (codes, scales, outlier channels) through Batch: bit-identical to int8 Decode
    streams, across the calibration of the first 16 tokens, and snapshots both ways."""
    g = torch.Generator().manual_seed(13)
    batch = session(channel, backend="int8")
    decode = {}
    for sid, cfg in ((1, dict(policy="strict", window=6)), (2, dict(policy="sink", window=5, sink_tokens=2))):
        pre = {0: (rand(g, 1, HKV, 3, D), rand(g, 1, HKV, 3, D))}
        batch.add(sid, prefill=pre, **cfg)
        decode[sid] = Session(
            channel, open_message(hq=HQ, hkv=HKV, d=D, layers=LAYERS, backend="int8", prefill=pre, **cfg)
        )
    for step in range(24):
        q, k, v = packed(g, 2)
        out = batch.step(step % LAYERS, [1, 2], q, k, v)
        for i, sid in enumerate((1, 2)):
            expected = decode[sid].output(decode[sid].step(step % LAYERS, q[i : i + 1], k[i : i + 1], v[i : i + 1]))
            assert torch.equal(out.output[i : i + 1], expected), (step, sid)
    batch.restore(3, decode[1].snapshot())
    back = Session(channel, restore=batch.snapshot(2))
    q, k, v = packed(g, 2)
    out = batch.step(0, [3, 2], q, k, v)
    assert torch.equal(out.output[:1], decode[1].output(decode[1].step(0, q[:1], k[:1], v[:1])))
    assert torch.equal(out.output[1:], back.output(back.step(0, q[1:], k[1:], v[1:])))
    for closing in (*decode.values(), back, batch):
        closing.close()
