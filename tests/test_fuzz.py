"""Bad input, generated: every field of every request message, over the wire.

Each generated input gets its documented code (in-band INVALID_ARGUMENT for a bad step, the RPC
ended with INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED for a bad open or broken
protocol), never UNKNOWN or INTERNAL, never a traceback, path or class name in a message; the
caches of the stream that sent it and of a bystander stream stay bit-identical, and afterwards
both step exactly like a twin stream that never saw the bad input.

Examples are bounded (``max_examples``) so the file runs in well under a minute on 2 cores;
``pytest --hypothesis-show-statistics`` prints how many inputs each test tried.
"""

from __future__ import annotations

import dataclasses
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import MiB, ServerConfig
from service.server import ServerThread
from tests.client import Session, open_message, step_request, wait_until

CONFIG = ServerConfig(
    address="127.0.0.1:0",
    metrics_port=0,
    idle_timeout_s=3600.0,
    max_capacity=4096,
    max_layers=8,
    max_heads=16,
    max_head_dim=64,
    max_batch_size=4,
    max_cache_bytes=64 * MiB,
    max_message_bytes=1 * MiB,
)
B, HQ, HKV, D, LAYERS = 1, 4, 2, 8, 2
SHAPES = {"query": [B, HQ, D], "new_key": [B, HKV, D], "new_value": [B, HKV, D]}
SETTINGS = settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
UNSAFE = ("Traceback", "<class", ".py", "site-packages", "Error parsing", "Unexpected")
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
UINT32 = st.one_of(
    st.integers(0, 40), st.sampled_from([(1 << 31) - 1, 1 << 31, (1 << 32) - 1]), st.integers(0, (1 << 32) - 1)
)


TRIED: dict[str, int] = {}


def _count(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


def _assert_safe(message: str) -> None:
    assert not any(word in message for word in UNSAFE), message


def _state(server, stream_id):
    stream = next(s for s in server.engine.streams() if s.id == stream_id)
    return [(c.tokens_seen, *c.export()) for c in stream.caches]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) for x, y in zip(a, b)
    )


def _good(g):
    return torch.randn(B, HQ, D, generator=g), torch.randn(B, HKV, D, generator=g), torch.randn(B, HKV, D, generator=g)


class Streams:
    """A victim (receives the bad input), a bystander and a twin (never see it)."""

    def __init__(self, server, channel):
        self.server = server
        g = torch.Generator().manual_seed(3)
        msg = open_message(batch=B, hq=HQ, hkv=HKV, d=D, layers=LAYERS, policy="greedy", window=4, capacity=6)
        self.victim, self.bystander, self.twin = (Session(channel, msg) for _ in range(3))
        for _ in range(7):
            x = _good(g)
            for s in (self.victim, self.bystander, self.twin):
                assert s.step(1, *x).step.status.code == 0
        self.g = g

    def snapshot(self):
        return [_state(self.server, s.opened.stream_id) for s in (self.victim, self.bystander)]

    def check_exact_after(self):
        """One more good step on every stream: outputs and caches bit-identical to the twin."""
        x = _good(self.g)
        outs = [s.output(s.step(1, *x)) for s in (self.victim, self.bystander, self.twin)]
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
        twin = _state(self.server, self.twin.opened.stream_id)
        assert _same(_state(self.server, self.victim.opened.stream_id), twin)
        assert _same(_state(self.server, self.bystander.opened.stream_id), twin)

    def close(self):
        for s in (self.victim, self.bystander, self.twin):
            s.close()


@pytest.fixture(scope="module")
def server():
    with ServerThread(CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def streams(server, channel):
    s = Streams(server, channel)
    yield s
    s.check_exact_after()
    s.close()
    assert wait_until(lambda: server.engine.active_streams == 0 and server.engine.bytes_reserved == 0)


# -- steps: every field of Step and of its Tensors ------------------------------------------
def _tensor(dtype=gqa_pb2.DTYPE_FLOAT32, shape=None, data=None, name="query"):
    shape = SHAPES[name] if shape is None else shape
    if data is None:
        n = 1
        for d in shape:
            n *= d
        data = b"\0" * (4 * n)
    return gqa_pb2.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def bad_steps(draw):
    """A Step with exactly one thing wrong (so INVALID_ARGUMENT is the only right answer)."""
    fields = {name: _tensor(name=name) for name in SHAPES}
    layer = 0
    kind = draw(st.sampled_from(["dtype", "shape", "data", "missing", "layer", "half"]))
    name = draw(st.sampled_from(list(SHAPES)))
    if kind == "dtype":  # unknown enum values, UNSPECIFIED, INT8 (snapshots only)
        fields[name].dtype = draw(
            st.integers(-(1 << 31), (1 << 31) - 1).filter(
                lambda v: v not in (gqa_pb2.DTYPE_FLOAT32, gqa_pb2.DTYPE_FLOAT16, gqa_pb2.DTYPE_BFLOAT16)
            )
        )
    elif kind == "shape":  # wrong rank, negative, huge, zero or merely different dimensions
        shape = draw(st.lists(st.one_of(INT64, st.integers(-2, 10)), max_size=6).filter(lambda s: s != SHAPES[name]))
        fits = len(shape) <= 4 and all(0 <= d <= 16 for d in shape) and eval("*".join(map(str, shape)) or "1") <= 1024
        data = None if fits else draw(st.binary(max_size=64))
        fields[name] = _tensor(shape=shape, data=data, name=name)
    elif kind == "data":  # byte length off
        good = len(fields[name].data)
        fields[name].data = draw(st.binary(max_size=2 * good).filter(lambda b: len(b) != good))
    elif kind == "missing":
        del fields[name]
    elif kind == "layer":
        layer = draw(st.one_of(st.integers(LAYERS, 64), st.integers(LAYERS, (1 << 32) - 1)))
    else:  # a valid dtype, but not the stream's
        n = len(fields[name].data) // 4
        fields[name] = gqa_pb2.Tensor(
            dtype=draw(st.sampled_from([gqa_pb2.DTYPE_FLOAT16, gqa_pb2.DTYPE_BFLOAT16])),
            shape=SHAPES[name],
            data=b"\0" * (2 * n),
        )
    return kind, gqa_pb2.Step(layer=layer, **fields)


def test_bad_steps_are_refused_in_band_and_change_nothing(streams):
    before = streams.snapshot()

    @SETTINGS
    @given(bad_steps())
    def check(case):
        _count("step")
        kind, step = case
        streams.victim.send(gqa_pb2.DecodeRequest(request_id=7, step=step))
        reply = streams.victim.recv()
        assert reply.request_id == 7
        assert reply.step.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (kind, reply.step.status)
        _assert_safe(reply.step.status.message)
        assert _same(streams.snapshot()[0], before[0]) and _same(streams.snapshot()[1], before[1])

    check()


@st.composite
def bad_rollbacks(draw):
    """Rollbacks that cannot be exact, or name a layer that does not exist."""
    if draw(st.booleans()):
        return gqa_pb2.Rollback(count=draw(UINT32), layer=draw(st.integers(LAYERS, (1 << 32) - 1)))
    return gqa_pb2.Rollback(
        count=draw(st.integers(3, (1 << 32) - 1)),
        layer=draw(st.integers(0, LAYERS - 1)),
        all_layers=draw(st.booleans()),
    )


def test_bad_rollbacks_are_refused_in_band_and_change_nothing(streams):
    before = streams.snapshot()

    @SETTINGS
    @given(bad_rollbacks())
    def check(rollback):
        _count("rollback")
        streams.victim.send(gqa_pb2.DecodeRequest(request_id=8, rollback=rollback))
        reply = streams.victim.recv()
        assert reply.rollback.status.code in (
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.FAILED_PRECONDITION.value[0],
        ), rollback
        _assert_safe(reply.rollback.status.message)
        assert _same(streams.snapshot()[0], before[0]) and _same(streams.snapshot()[1], before[1])

    check()


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


def test_non_finite_values_are_data_and_stay_in_their_stream(server, channel):
    """Values are not inspected: NaN and Inf compute as IEEE arithmetic does, in the sender's
    stream only; the bystander's caches and outputs are untouched."""
    msg = open_message(batch=B, hq=HQ, hkv=HKV, d=D, layers=1, policy="strict", window=4)
    sender, bystander = Session(channel, msg), Session(channel, msg)
    g = torch.Generator().manual_seed(9)
    x = _good(g)
    bystander.step(0, *x)
    before = _state(server, bystander.opened.stream_id)

    @settings(SETTINGS, max_examples=40)
    @given(st.lists(FLOATS, min_size=3, max_size=3), st.integers(0, 2), st.integers(0, B * HQ * D - 1))
    def check(values, which, index):
        _count("non_finite")
        q, k, v = (t.clone() for t in _good(g))
        target = (q, k, v)[which].view(-1)
        target[index % target.numel()] = values[0]
        k.view(-1)[0], v.view(-1)[0] = values[1], values[2]
        reply = sender.step(0, q, k, v)
        assert reply.step.status.code == 0
        assert _same(_state(server, bystander.opened.stream_id), before)

    check()
    sender.close()
    bystander.close()


# -- opens: every field of OpenStream ---------------------------------------------------------
@st.composite
def opens(draw):
    msg = gqa_pb2.OpenStream(
        backend=draw(st.sampled_from(["", "cpu", "int8", "cuda", "tpu", "../../etc/passwd", "\x00"])),
        dtype=draw(st.integers(-3, 10)),
        batch_size=draw(UINT32),
        num_query_heads=draw(UINT32),
        num_kv_heads=draw(UINT32),
        head_dim=draw(UINT32),
        num_layers=draw(UINT32),
        policy=draw(st.integers(-3, 10)),
        window=draw(UINT32),
        capacity=draw(UINT32),
        sink_tokens=draw(UINT32),
    )
    if draw(st.booleans()):
        entry = msg.prefill.add(layer=draw(UINT32))
        entry.key.CopyFrom(
            _tensor(shape=draw(st.lists(st.integers(-1, 4), max_size=5)), data=draw(st.binary(max_size=64)))
        )
        entry.value.CopyFrom(entry.key)
    return msg


ENDING = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_generated_opens_get_a_documented_code_and_hold_nothing(server, channel, streams):
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)
    base = server.engine.active_streams, server.engine.bytes_reserved
    before = streams.snapshot()

    @SETTINGS
    @given(opens())
    def check(msg):
        _count("open")
        try:
            replies = list(stub.Decode(iter([gqa_pb2.DecodeRequest(open=msg)]), timeout=30))
            assert replies[0].WhichOneof("kind") == "opened"  # a valid open: opened, then closed by EOF
        except grpc.RpcError as exc:
            assert exc.code() in ENDING, (exc.code(), exc.details())
            _assert_safe(exc.details())
        assert wait_until(lambda: (server.engine.active_streams, server.engine.bytes_reserved) == base)
        assert _same(streams.snapshot()[1], before[1])

    check()


# -- broken protocol: missing open, repeated open, empty kind, steps after the end ------------
def test_protocol_sequences(server, channel, streams):
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)
    step = step_request(1, 0, *(_good(torch.Generator().manual_seed(1))))
    opening = gqa_pb2.DecodeRequest(open=open_message(batch=B, hq=HQ, hkv=HKV, d=D))
    before = streams.snapshot()
    for sequence in (
        [step],
        [step, opening],
        [gqa_pb2.DecodeRequest()],
        [opening, opening],
        [opening, gqa_pb2.DecodeRequest()],
        [opening, gqa_pb2.DecodeRequest(restore=gqa_pb2.SnapshotChunk())],
    ):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(iter(sequence), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _assert_safe(info.value.details())
    assert _same(streams.snapshot()[1], before[1])


# -- bytes that are not the message they claim to be ----------------------------------------
def _parses(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except Exception:
        return False


def _truncations():
    valid = step_request(5, 0, *_good(torch.Generator().manual_seed(2))).SerializeToString()
    return st.integers(1, len(valid) - 1).map(lambda n: valid[:n])


GARBAGE = st.one_of(
    st.binary(min_size=1, max_size=200),
    _truncations(),
    st.binary(min_size=1, max_size=8).map(lambda b: b"\x1a" + struct.pack("<B", 0x7F) + b),
)


def test_garbage_bytes_get_invalid_argument(server, channel, streams):
    decode = channel.stream_stream("/gqa.v1.AttentionService/Decode")
    decode_step = channel.unary_unary("/gqa.v1.AttentionService/DecodeStep")
    opening = gqa_pb2.DecodeRequest(open=open_message(batch=B, hq=HQ, hkv=HKV, d=D)).SerializeToString()
    base = server.engine.active_streams, server.engine.bytes_reserved
    before = streams.snapshot()

    @SETTINGS
    @given(GARBAGE)
    def check(data):
        _count("garbage")
        for call in (lambda: decode_step(data, timeout=30), lambda: list(decode(iter([opening, data]), timeout=30))):
            try:
                call()
                assert _parses(gqa_pb2.DecodeStepRequest, data) or _parses(gqa_pb2.DecodeRequest, data)
            except grpc.RpcError as exc:
                assert exc.code() in ENDING, (exc.code(), exc.details())
                _assert_safe(exc.details())
        assert wait_until(lambda: (server.engine.active_streams, server.engine.bytes_reserved) == base)
        assert _same(streams.snapshot()[0], before[0]) and _same(streams.snapshot()[1], before[1])

    check()


# -- the stateless operation ------------------------------------------------------------------
@st.composite
def stateless(draw):
    def tensor(rank):
        shape = draw(
            st.one_of(
                st.lists(st.integers(0, 5), min_size=rank, max_size=rank),
                st.lists(st.one_of(INT64, st.integers(-1, 5)), max_size=6),
            )
        )
        data = draw(st.one_of(st.just(None), st.binary(max_size=256)))
        if data is None and all(0 <= d <= 5 for d in shape):
            n = 1
            for d in shape:
                n *= d
            return gqa_pb2.Tensor(
                dtype=draw(st.integers(-1, 6)), shape=shape, data=draw(st.binary(min_size=4 * n, max_size=4 * n))
            )
        return gqa_pb2.Tensor(dtype=draw(st.integers(-1, 6)), shape=shape, data=data or b"")

    return gqa_pb2.DecodeStepRequest(
        query=tensor(3),
        new_key=tensor(3),
        new_value=tensor(3),
        key_cache=tensor(4),
        value_cache=tensor(4),
        num_query_heads=draw(UINT32),
        num_kv_heads=draw(UINT32),
    )


def test_generated_stateless_requests(channel):
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)

    @SETTINGS
    @given(stateless())
    def check(request):
        _count("stateless")
        try:
            stub.DecodeStep(request, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            _assert_safe(exc.details())

    check()


def test_server_is_still_healthy(server, channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert dataclasses.replace(CONFIG) == CONFIG
    print(f"\nfuzz: inputs tried {sum(TRIED.values())} {TRIED}")
