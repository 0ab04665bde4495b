"""``service.transport.wire``: whatever it reads from a request's bytes is what upb parses from them.

Step requests (Batch and Decode) built by upb, the same fields re-encoded by hand in shuffled
order with unknown fields and unpacked repeated fields, truncations and byte flips of them, and
other kinds: the readers return ``None`` or exactly upb's values (and ``None`` where upb refuses
the bytes). The vectorized packed-varint encoder against the scalar one.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api import gqa_pb2
from service.transport.wire import (
    BatchStepLayout,
    DecodeStepLayout,
    packed_varints,
    read_decode_step,
    read_step_request,
    varint,
)

U64 = st.integers(0, 2**64 - 1)
TENSOR = st.tuples(
    st.integers(-(2**31), 2**31 - 1),  # dtype: any enum number the wire can carry
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),  # shape
    st.binary(max_size=64),  # data
)


def _step_message(rid, layer, ids, tensors) -> gqa_pb2.BatchRequest:
    step = gqa_pb2.BatchStep(layer=layer, ids=ids)
    for field, (dtype, shape, data) in zip(("query", "new_key", "new_value"), tensors):
        getattr(step, field).CopyFrom(gqa_pb2.Tensor(dtype=dtype, shape=shape, data=data))
    return gqa_pb2.BatchRequest(request_id=rid, step=step)


def _same_as_upb(raw: bytes, read=read_step_request, message=gqa_pb2.BatchRequest) -> None:
    """The reader's answer for ``raw`` (a serialized ``message``) is None, or upb's parse of it."""
    got = read(raw)
    try:
        want = message.FromString(raw)
    except DecodeError:
        assert got is None
        return
    if got is None:
        return
    rid, step = got
    assert want.WhichOneof("kind") == "step"
    assert rid == want.request_id
    assert step.layer == want.step.layer
    if message is gqa_pb2.BatchRequest:
        assert step.ids.dtype == np.uint64 and step.ids.tolist() == list(want.step.ids)
    for name in ("query", "new_key", "new_value"):
        mine, theirs = getattr(step, name), getattr(want.step, name)
        assert (mine.dtype, mine.shape, bytes(mine.data)) == (theirs.dtype, tuple(theirs.shape), theirs.data), name


def _decode_same_as_upb(raw: bytes) -> None:
    _same_as_upb(raw, read_decode_step, gqa_pb2.DecodeRequest)


def _decode_message(rid, layer, tensors) -> gqa_pb2.DecodeRequest:
    step = gqa_pb2.Step(layer=layer)
    for field, (dtype, shape, data) in zip(("query", "new_key", "new_value"), tensors):
        getattr(step, field).CopyFrom(gqa_pb2.Tensor(dtype=dtype, shape=shape, data=data))
    return gqa_pb2.DecodeRequest(request_id=rid, step=step)


# -- the same fields written in other shapes (upb, parsing them, is the judge) ------------------
def _key(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def _len(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + varint(len(payload)) + payload


def _unknown(rng: random.Random) -> bytes:
    number = rng.randint(20, 1000)
    return rng.choice(
        [
            _key(number, 0) + varint(rng.getrandbits(40)),
            _len(number, rng.randbytes(rng.randint(0, 9))),
            _key(number, 1) + rng.randbytes(8),
            _key(number, 5) + rng.randbytes(4),
        ]
    )


def _damaged(raw: bytes, rng: random.Random, times: int = 4):
    """``times`` pairs of ``raw`` truncated at random and ``raw`` with one bit flipped."""
    for _ in range(times):
        yield raw[: rng.randrange(len(raw) + 1)]
        flipped = bytearray(raw)
        flipped[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        yield bytes(flipped)


def _shuffled(rng: random.Random, parts: list[bytes], unknown: bool) -> bytes:
    if unknown:
        parts = parts + [_unknown(rng) for _ in range(rng.randint(1, 3))]
    rng.shuffle(parts)
    return b"".join(parts)


def _hand_encoded(rng: random.Random, rid, layer, ids, tensors) -> bytes:
    tensor_bytes = []
    for dtype, shape, data in tensors:
        if rng.random() < 0.5:
            shape_parts = [_len(2, b"".join(varint(x) for x in shape))] if shape else []
        else:  # unpacked: one field per dimension
            shape_parts = [_key(2, 0) + varint(x) for x in shape]
        tensor_bytes.append(
            _shuffled(rng, [_key(1, 0) + varint(dtype), *shape_parts, _len(3, data)], rng.random() < 0.3)
        )
    if rng.random() < 0.5:
        id_parts = [_len(2, b"".join(varint(x) for x in ids))]
    else:
        id_parts = [_key(2, 0) + varint(x) for x in ids]
    step = _shuffled(
        rng,
        [_key(1, 0) + varint(layer), *id_parts, *(_len(3 + i, t) for i, t in enumerate(tensor_bytes))],
        rng.random() < 0.3,
    )
    return _shuffled(rng, [_key(1, 0) + varint(rid), _len(4, step)], rng.random() < 0.3)


def _hand_encoded_decode(rng: random.Random, rid, layer, tensors) -> bytes:
    """A ``DecodeRequest`` step (``Step``: layer 1, query 2, new_key 3, new_value 4; the
    request's step is field 3) in shuffled order, with unknown and unpacked fields."""
    tensor_bytes = []
    for dtype, shape, data in tensors:
        if rng.random() < 0.5:
            shape_parts = [_len(2, b"".join(varint(x) for x in shape))] if shape else []
        else:
            shape_parts = [_key(2, 0) + varint(x) for x in shape]
        tensor_bytes.append(
            _shuffled(rng, [_key(1, 0) + varint(dtype), *shape_parts, _len(3, data)], rng.random() < 0.3)
        )
    step = _shuffled(
        rng,
        [_key(1, 0) + varint(layer), *(_len(2 + i, t) for i, t in enumerate(tensor_bytes))],
        rng.random() < 0.3,
    )
    return _shuffled(rng, [_key(1, 0) + varint(rid), _len(3, step)], rng.random() < 0.3)


@settings(max_examples=300, deadline=None)
@given(
    rid=U64, layer=st.integers(0, 2**32 - 1), ids=st.lists(U64, max_size=6), tensors=st.tuples(TENSOR, TENSOR, TENSOR)
)
def test_step_requests_read_as_upb_parses_them(rid, layer, ids, tensors):
    raw = _step_message(rid, layer, ids, tensors).SerializeToString()
    got = read_step_request(raw)
    assert got is not None  # the runtime's own encoding is always read here
    _same_as_upb(raw)


@settings(max_examples=300, deadline=None)
@given(
    rid=U64,
    layer=U64,  # a uint32 field given a wider varint: both truncate
    ids=st.lists(U64, max_size=6),
    tensors=st.tuples(TENSOR, TENSOR, TENSOR),
    seed=st.integers(0, 2**32),
)
def test_other_field_orders_unknown_fields_and_damage(rid, layer, ids, tensors, seed):
    rng = random.Random(seed)
    raw = _hand_encoded(rng, rid, layer, ids, tensors)
    _same_as_upb(raw)
    for damaged in _damaged(raw, rng):  # truncated, and a bit changed
        _same_as_upb(damaged)


@given(st.binary(max_size=200))
def test_arbitrary_bytes(raw):
    _same_as_upb(raw)


@pytest.mark.parametrize(
    "request_",
    [
        gqa_pb2.BatchRequest(request_id=3, open=gqa_pb2.BatchOpen(num_query_heads=4)),
        gqa_pb2.BatchRequest(request_id=3, remove=gqa_pb2.BatchRemove(ids=[1, 2])),
        gqa_pb2.BatchRequest(request_id=3),
        gqa_pb2.BatchRequest(request_id=3, step=gqa_pb2.BatchStep(layer=1, ids=[1])),  # tensors absent
    ],
    ids=["open", "remove", "no kind", "step without tensors"],
)
def test_everything_else_goes_to_the_runtime(request_):
    assert read_step_request(request_.SerializeToString()) is None


def test_a_step_given_twice_or_followed_by_another_kind_goes_to_the_runtime():
    step = _step_message(1, 0, [5], [(1, [1, 2], b"ab")] * 3).SerializeToString()
    opened = gqa_pb2.BatchRequest(open=gqa_pb2.BatchOpen(num_query_heads=4)).SerializeToString()
    assert read_step_request(step) is not None
    assert read_step_request(step + step) is None  # the runtime merges the two steps
    assert read_step_request(step + opened) is None  # the last kind wins: open


def test_tensor_data_is_a_view_of_the_request():
    raw = _step_message(9, 2, [7, 8], [(1, [2, 1, 1], b"\x01\x02\x03\x04" * 2)] * 3).SerializeToString()
    rid, step = read_step_request(raw)
    assert rid == 9 and step.layer == 2 and step.ids.tolist() == [7, 8]
    assert isinstance(step.query.data, memoryview) and step.query.data.obj is raw
    assert step.query.data.readonly and bytes(step.query.data) == b"\x01\x02\x03\x04" * 2


# -- Decode step requests -----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(rid=U64, layer=st.integers(0, 2**32 - 1), tensors=st.tuples(TENSOR, TENSOR, TENSOR))
def test_decode_steps_read_as_upb_parses_them(rid, layer, tensors):
    raw = _decode_message(rid, layer, tensors).SerializeToString()
    assert read_decode_step(raw) is not None
    _decode_same_as_upb(raw)


@settings(max_examples=200, deadline=None)
@given(rid=U64, layer=U64, tensors=st.tuples(TENSOR, TENSOR, TENSOR), seed=st.integers(0, 2**32))
def test_decode_steps_in_other_orders_with_unknown_fields_and_damage(rid, layer, tensors, seed):
    rng = random.Random(seed)
    raw = _hand_encoded_decode(rng, rid, layer, tensors)
    _decode_same_as_upb(raw)
    for damaged in _damaged(raw, rng):
        _decode_same_as_upb(damaged)


@given(st.binary(max_size=200))
def test_decode_arbitrary_bytes(raw):
    _decode_same_as_upb(raw)


@pytest.mark.parametrize(
    "request_",
    [
        gqa_pb2.DecodeRequest(request_id=3, open=gqa_pb2.OpenStream(num_query_heads=4)),
        gqa_pb2.DecodeRequest(request_id=3, rollback=gqa_pb2.Rollback(count=1)),
        gqa_pb2.DecodeRequest(request_id=3),
        gqa_pb2.DecodeRequest(request_id=3, step=gqa_pb2.Step(layer=1)),  # tensors absent
    ],
    ids=["open", "rollback", "no kind", "step without tensors"],
)
def test_other_decode_requests_go_to_the_runtime(request_):
    assert read_decode_step(request_.SerializeToString()) is None


# -- the packed varints the step replies are encoded with -----------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(U64, min_size=3, max_size=3), max_size=8))
def test_packed_varints_are_the_scalar_encoding_row_by_row(rows):
    values = np.array(rows, dtype=np.uint64).reshape(-1, 3).T  # (3, n)
    data, lengths = packed_varints(values)
    want = [b"".join(varint(int(x)) for x in row) for row in values]
    assert data == b"".join(want)
    assert lengths.tolist() == [len(w) for w in want]


# -- a Decode stream's step layout (its constant prefixes) ------------------------------------------
SHAPE = st.lists(st.integers(0, 300), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    rid=U64,
    layer=st.integers(0, 2**32 - 1),
    dtype=st.integers(0, 5),
    shapes=st.tuples(SHAPE, SHAPE),
    sizes=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    same=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_a_stream_layout_reads_what_upb_parses(rid, layer, dtype, shapes, sizes, same, seed):
    """Messages built by upb for the layout's own dtype and shapes (``same``) or for others, and
    their truncations, byte flips and unknown fields: ``read`` is None or upb's values."""
    rng = random.Random(seed)
    q_shape, kv_shape = shapes
    q_bytes, kv_bytes = sizes
    layout = DecodeStepLayout(dtype, tuple(q_shape), tuple(kv_shape), q_bytes, kv_bytes)
    if same:
        tensors = ((dtype, q_shape, rng.randbytes(q_bytes)), *[(dtype, kv_shape, rng.randbytes(kv_bytes))] * 2)
    else:
        tensors = tuple((rng.randint(0, 5), rng.choice(shapes), rng.randbytes(rng.randint(0, 40))) for _ in range(3))
    raw = _decode_message(rid, layer, tensors).SerializeToString()
    if same and q_bytes and kv_bytes:
        assert layout.read(raw) is not None  # the runtime's own encoding of this stream's steps
    variants = [raw, raw + _unknown(rng), *_damaged(raw, rng)]
    for data in variants:
        got = layout.read(data)
        if got is None:
            continue
        want = gqa_pb2.DecodeRequest.FromString(data)  # never raises where read answered
        rid_, step = got
        assert want.WhichOneof("kind") == "step" and rid_ == want.request_id and step.layer == want.step.layer
        for name in ("query", "new_key", "new_value"):
            mine, theirs = getattr(step, name), getattr(want.step, name)
            assert (mine.dtype, mine.shape, bytes(mine.data)) == (theirs.dtype, tuple(theirs.shape), theirs.data)


# -- a Batch session's step layout (its tensor headers per n) ------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    rid=U64,
    layer=st.integers(0, 2**32 - 1),
    ids=st.lists(U64, min_size=1, max_size=6),
    heads=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8)),
    itemsize=st.sampled_from([1, 2, 4]),
    dtype=st.integers(1, 5),
    same=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_a_session_layout_reads_what_upb_parses(rid, layer, ids, heads, itemsize, dtype, same, seed):
    """Messages built by upb in the session's dtype and shapes (``same``) or others, and their
    truncations, byte flips and unknown fields: ``read`` is None or upb's values."""
    rng = random.Random(seed)
    hq, hkv, d = heads
    n = len(ids)
    layout = BatchStepLayout(dtype, hq, hkv, d, itemsize)
    if same:
        tensors = [(dtype, [n, h, d], rng.randbytes(n * h * d * itemsize)) for h in (hq, hkv, hkv)]
    else:
        tensors = [(rng.randint(0, 5), [n, rng.randint(1, 4), d], rng.randbytes(rng.randint(1, 40))) for _ in range(3)]
    raw = _step_message(rid, layer, ids, tensors).SerializeToString()
    if same:
        assert layout.read(raw) is not None  # the runtime's own encoding of this session's steps
    variants = [raw, raw + _unknown(rng), *_damaged(raw, rng)]
    for data in variants:
        _same_as_upb(data, layout.read)


def test_a_session_layout_hands_a_repeated_ids_array_again_read_only():
    """The same packed ids (a runtime's next layer of the same token) give the same read-only
    array, which ``SequenceSet.plan`` maps to its slots at once; other ids a new array."""
    layout = BatchStepLayout(1, 2, 1, 2, 4)
    tensors = [(1, [3, h, 2], bytes(3 * h * 2 * 4)) for h in (2, 1, 1)]
    first = layout.read(_step_message(1, 0, [5, 300, 7], tensors).SerializeToString())[1].ids
    again = layout.read(_step_message(2, 1, [5, 300, 7], tensors).SerializeToString())[1].ids
    other = layout.read(_step_message(3, 0, [5, 300, 8], tensors).SerializeToString())[1].ids
    assert again is first and not first.flags.writeable
    assert other.tolist() == [5, 300, 8] and first.tolist() == [5, 300, 7]
