"""The step messages' wire format, by hand: requests (``Batch``, ``Decode``) read straight from
their bytes without copying tensors, the varints (``varint``, ``packed_varints``) with which
``service.transport.batch_reply`` and ``service.transport.decode_step`` write replies.

The protobuf runtime copies a 64-sequence step request twice more than the transport already
has (into its arena when it parses, and again on every read of a ``bytes`` field: 1.5 MiB each
for float32 at Hq=32, Hkv=8, D=128). ``read_step_request`` reads a serialized ``BatchRequest``
whose ``kind`` is ``step`` itself and hands out the tensors' data as ``memoryview`` slices of
the request's bytes (read-only; they keep the bytes alive), and its ids as one numpy array
(decoded vectorized); ``read_decode_step`` does the same for a ``DecodeRequest``'s ``step``.

Contract: for any input it returns either ``None`` or exactly what the protobuf runtime would
parse (``tests/test_wire.py`` checks it against upb, fuzzed). It returns ``None`` for every
other kind, for anything it does not handle (a field given twice, groups, a malformed or
truncated encoding, a step whose message fields are absent), and the caller then parses the
bytes with the runtime, which also reports what is malformed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "StepRequest",
    "DecodeStep",
    "TensorView",
    "read_step_request",
    "read_decode_step",
    "DecodeStepLayout",
    "BatchStepLayout",
    "varint",
    "packed_varints",
    "SMALL_VARINTS",
]

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class TensorView(NamedTuple):
    """``gqa.v1.Tensor``'s fields: ``dtype`` (the enum's number), ``shape``, ``data`` (a view of
    the request's bytes)."""

    dtype: int
    shape: tuple[int, ...]
    data: memoryview


class StepRequest(NamedTuple):
    """``gqa.v1.BatchStep``'s fields, as ``service.transport.batch_session.Session.step`` reads them."""

    layer: int
    ids: np.ndarray  # uint64 (n,)
    query: TensorView
    new_key: TensorView
    new_value: TensorView


class DecodeStep(NamedTuple):
    """``gqa.v1.Step``'s fields (a ``Decode`` stream's step)."""

    layer: int
    query: TensorView
    new_key: TensorView
    new_value: TensorView


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint (a negative ``n`` as its 64-bit two's complement, as
    the runtime writes int32 and int64 fields)."""
    n &= _U64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# The varints of 0 .. 2^14 - 1 (one and two bytes), built once: both reply writers look a
# number below it up instead of encoding it by a call (docs/design.md, "Where a Decode step's
# time goes beside the echo server's").
SMALL_VARINTS = [varint(i) for i in range(1 << 14)]


def tensor_field_head(tag: bytes, dtype: int, shape, nbytes: int) -> bytes:
    """A ``Tensor`` field as the protobuf runtimes write it, all but its data: ``tag``, the
    field's length, then dtype = 1, shape = 2 (packed) and data = 3's tag and length, each left
    out where proto3 leaves it out (0, no dimensions, no bytes)."""
    dims = b"".join(varint(x) for x in shape)
    head = (
        (b"\x08" + varint(dtype) if dtype else b"")
        + (b"\x12" + varint(len(dims)) + dims if dims else b"")
        + (b"\x1a" + varint(nbytes) if nbytes else b"")
    )
    return tag + varint(len(head) + nbytes) + head


_SEVEN = np.uint64(7)
_LOW7 = np.uint64(0x7F)


def packed_varints(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The rows of ``values`` (uint64 or non-negative int64, (k, n)) as protobuf varints,
    vectorized: ``(data, lengths)``, the k rows' encodings one after another and each row's
    byte count (k,). A handful of numpy calls whatever n is; rows whose values all take the
    same number of bytes (the common case: T, L and positions of similar size) need no mask."""
    v = np.ascontiguousarray(values).astype(np.uint64, copy=False)
    k = v.shape[0]
    if v.size == 0:
        return b"", np.zeros(k, dtype=np.int64)
    top = int(v.max())
    if top < 0x80:  # one byte each
        return v.astype(np.uint8).tobytes(), np.full(k, v.shape[1], dtype=np.int64)
    width = (top.bit_length() + 6) // 7
    flat = v.reshape(-1, 1)
    groups = ((flat >> (np.arange(width, dtype=np.uint64) * _SEVEN)) & _LOW7).astype(np.uint8)
    if int(v.min()) >> (7 * (width - 1)):  # every value takes ``width`` bytes
        groups[:, :-1] |= 0x80
        return groups.tobytes(), np.full(k, v.shape[1] * width, dtype=np.int64)
    # bytes per value: 1 + how many 7-bit thresholds it reaches
    nbytes = np.ones(flat.shape[0], dtype=np.int64)
    for i in range(1, width):
        nbytes += flat[:, 0] >= np.uint64(1 << (7 * i))
    column = np.arange(width)
    groups[column[None, :] < (nbytes[:, None] - 1)] |= 0x80
    data = groups[column[None, :] < nbytes[:, None]].tobytes()
    return data, nbytes.reshape(v.shape).sum(axis=1)


class _Unhandled(Exception):
    """Not for this reader: the caller parses with the protobuf runtime."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at ``pos`` (at most 10 bytes, below ``end``)."""
    value = shift = 0
    while True:
        if pos >= end or shift >= 70:
            raise _Unhandled
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >> 64:  # bits past 64: left to the runtime's judgement
                raise _Unhandled
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, value or (start, stop) of a length-delimited field)."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if not 0 < number < 1 << 29:  # field numbers are 1 .. 2^29 - 1
            raise _Unhandled
        if wire == 0:
            value, pos = _read_varint(buf, pos, end)
        elif wire == 2:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise _Unhandled
            value, pos = (pos, pos + length), pos + length
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 5:
            value, pos = None, pos + 4
        else:  # groups (3, 4) and invalid types
            raise _Unhandled
        if pos > end:
            raise _Unhandled
        yield number, wire, value


def _packed_varints(buf: memoryview, span: tuple[int, int]) -> list[int]:
    pos, end = span
    out = []
    while pos < end:
        value, pos = _read_varint(buf, pos, end)
        out.append(value)
    return out


_EMPTY_IDS = np.zeros(0, dtype=np.uint64)


def _packed_uint64(buf: memoryview, span: tuple[int, int]) -> np.ndarray:
    """A packed run of uint64 varints, decoded vectorized (``_Unhandled`` where the scalar
    reader would raise: truncated, over 10 bytes, bits past 64)."""
    b = np.frombuffer(buf[span[0] : span[1]], dtype=np.uint8)
    if not len(b):
        return _EMPTY_IDS
    last = b < 0x80
    if last.all():
        return b.astype(np.uint64)
    if not last[-1]:
        raise _Unhandled
    ends = np.flatnonzero(last)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10 or (b[ends[lengths == 10]] > 1).any():
        raise _Unhandled
    within = np.arange(len(b)) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (within.astype(np.uint64) * np.uint64(7))
    return np.bitwise_or.reduceat(parts, starts)


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _enum32(v: int) -> int:
    v &= _U32
    return v - (1 << 32) if v >> 31 else v


def _tensor(buf: memoryview, span: tuple[int, int]) -> TensorView:
    dtype = 0
    shape: list[int] = []
    data = None
    for number, wire, value in _fields(buf, *span):
        if number == 1 and wire == 0:
            dtype = _enum32(value)
        elif number == 2 and wire == 2:
            shape += [_signed64(x) for x in _packed_varints(buf, value)]
        elif number == 2 and wire == 0:
            shape.append(_signed64(value))
        elif number == 3 and wire == 2:
            if data is not None:
                raise _Unhandled
            data = buf[value[0] : value[1]]
        elif number in (1, 2, 3):  # a known field with another wire type
            raise _Unhandled
    return TensorView(dtype, tuple(shape), data if data is not None else buf[0:0])


def _step(buf: memoryview, span: tuple[int, int]) -> StepRequest:
    layer = 0
    ids: list[np.ndarray] = []
    tensors: dict[int, TensorView] = {}
    for number, wire, value in _fields(buf, *span):
        if number == 1 and wire == 0:
            layer = value & _U32
        elif number == 2 and wire == 2:
            ids.append(_packed_uint64(buf, value))
        elif number == 2 and wire == 0:
            ids.append(np.array([value], dtype=np.uint64))
        elif number in (3, 4, 5) and wire == 2:
            if number in tensors:  # the runtime would merge the two messages
                raise _Unhandled
            tensors[number] = _tensor(buf, value)
        elif number in (1, 2, 3, 4, 5):
            raise _Unhandled
    if len(tensors) != 3:  # an absent tensor: the runtime's empty message, and its errors
        raise _Unhandled
    all_ids = ids[0] if len(ids) == 1 else np.concatenate(ids) if ids else _EMPTY_IDS
    return StepRequest(layer, all_ids, tensors[3], tensors[4], tensors[5])


def _decode_step(buf: memoryview, span: tuple[int, int]) -> DecodeStep:
    layer = 0
    tensors: dict[int, TensorView] = {}
    for number, wire, value in _fields(buf, *span):
        if number == 1 and wire == 0:
            layer = value & _U32
        elif number in (2, 3, 4) and wire == 2:
            if number in tensors:
                raise _Unhandled
            tensors[number] = _tensor(buf, value)
        elif number in (1, 2, 3, 4):
            raise _Unhandled
    if len(tensors) != 3:
        raise _Unhandled
    return DecodeStep(layer, tensors[2], tensors[3], tensors[4])


def read_decode_step(raw: bytes) -> tuple[int, DecodeStep] | None:
    """``(request_id, step)`` when ``raw`` is a serialized ``DecodeRequest`` whose kind is
    ``step`` and this reader handles it; ``None`` otherwise (as ``read_step_request``)."""
    return _read_request(raw, 3, 6, _decode_step)


def read_step_request(raw: bytes) -> tuple[int, StepRequest] | None:
    """``(request_id, step)`` when ``raw`` is a serialized ``BatchRequest`` whose kind is
    ``step`` and this reader handles it; ``None`` otherwise (see the module docstring)."""
    return _read_request(raw, 4, 7, _step)


def _read_request(raw: bytes, step_field: int, last_field: int, read_step):
    """A request whose ``request_id`` is field 1 and whose kind is the message field
    ``step_field`` (fields up to ``last_field`` are the request's known ones): ``(request_id,
    read_step(buf, span))``, or ``None`` for any other kind or anything unhandled."""
    buf = memoryview(raw)
    rid = 0
    step_span = None
    try:
        for number, wire, value in _fields(buf, 0, len(buf)):
            if number == 1 and wire == 0:
                rid = value
            elif number == step_field and wire == 2 and step_span is None:
                step_span = value
            elif number <= last_field:  # another kind, the step twice, or a known field mistyped
                return None
        if step_span is None:
            return None
        return rid, read_step(buf, step_span)
    except _Unhandled:
        return None


def _step_envelope(raw: bytes, step_tag: bytes) -> tuple[int, int, int] | None:
    """(request id, layer, the position after the layer) of a request written as the runtimes
    write a step: request_id = 1 (if set), then only the step field at ``step_tag``, its layer =
    1 first (if set); None when it is written otherwise. Raises ``_Unhandled`` where a varint is
    left to the runtime."""
    end = len(raw)
    rid, pos = _read_varint(raw, 1, end) if raw[:1] == b"\x08" else (0, 0)
    if raw[pos : pos + 1] != step_tag:
        return None
    length, pos = _read_varint(raw, pos + 1, end)
    if pos + length != end:
        return None
    layer = 0
    if raw[pos : pos + 1] == b"\x08":  # the step's layer = 1
        layer, pos = _read_varint(raw, pos + 1, end)
        if layer >> 32:  # the runtime truncates; leave that to it
            return None
    return rid, layer, pos


class DecodeStepLayout:
    """The encoding of one Decode stream's step requests as the protobuf runtimes write them
    (fields in number order, packed shapes, every field present but a zero request id or
    layer), with this stream's dtype and shapes: everything but the ids, the layer and the
    tensors' bytes is a constant prefix, so ``read`` checks three prefixes and slices, in a
    few microseconds instead of walking the fields. Anything else returns ``None``
    (``read_decode_step`` or the runtime then reads it). Contract as ``read_decode_step``:
    what ``read`` returns is what upb parses (tests/test_wire.py)."""

    __slots__ = (
        "_q", "_k", "_v", "_q_bytes", "_kv_bytes", "_dtype", "_q_shape", "_kv_shape", "_body",
        "_v_prefix_at", "k_from_q", "v_from_q",
    )  # fmt: skip

    def __init__(self, dtype: int, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], q_bytes: int, kv_bytes: int):
        self._q = tensor_field_head(b"\x12", dtype, q_shape, q_bytes)  # Step.query = 2
        self._k = tensor_field_head(b"\x1a", dtype, kv_shape, kv_bytes)  # Step.new_key = 3
        self._v = tensor_field_head(b"\x22", dtype, kv_shape, kv_bytes)  # Step.new_value = 4
        self._q_bytes, self._kv_bytes = q_bytes, kv_bytes
        self._dtype, self._q_shape, self._kv_shape = dtype, tuple(q_shape), tuple(kv_shape)
        self._body = len(self._q) + len(self._k) + len(self._v) + q_bytes + 2 * kv_bytes
        # offsets from the query's first byte: the new key's prefix, data, the new value's
        self._v_prefix_at = q_bytes + len(self._k) + kv_bytes
        self.k_from_q = q_bytes + len(self._k)
        self.v_from_q = self._v_prefix_at + len(self._v)

    def locate(self, raw: bytes) -> tuple[int, int, int] | None:
        """(request id, layer, the query's byte offset) of a step in this layout, else None;
        the new key is at that offset + ``k_from_q``, the new value at + ``v_from_q``."""
        if not (self._q_bytes and self._kv_bytes):
            return None
        end = len(raw)
        try:
            found = _step_envelope(raw, b"\x1a")  # DecodeRequest.step = 3
            if found is None:
                return None
            rid, layer, pos = found
            if end - pos != self._body or not raw.startswith(self._q, pos):
                return None
            q_at = pos + len(self._q)
            if not (
                raw.startswith(self._k, q_at + self._q_bytes) and raw.startswith(self._v, q_at + self._v_prefix_at)
            ):
                return None
        except _Unhandled:
            return None
        return rid, layer, q_at

    def read(self, raw: bytes) -> tuple[int, DecodeStep] | None:
        found = self.locate(raw)
        if found is None:
            return None
        rid, layer, q_at = found
        buf = memoryview(raw)
        k_at, v_at = q_at + self.k_from_q, q_at + self.v_from_q
        return rid, DecodeStep(
            layer,
            TensorView(self._dtype, self._q_shape, buf[q_at : q_at + self._q_bytes]),
            TensorView(self._dtype, self._kv_shape, buf[k_at : k_at + self._kv_bytes]),
            TensorView(self._dtype, self._kv_shape, buf[v_at:]),
        )


class BatchStepLayout:
    """The encoding of one Batch session's step messages as the protobuf runtimes write them
    (fields in number order, packed ids and shapes): for n sequences, each tensor's header (its
    field's tag and length, dtype, shape, the data's tag and length) is a constant of the
    session's dtype, heads, head width and n, kept per n. ``read`` decodes the request id, the
    layer and the ids and checks the three headers with ``bytes.startswith``: a handful of
    operations instead of walking some twenty fields (a step message arrives with the caches
    cold behind a model's weights, where every line of Python touched costs). A matched header
    also means the tensors have the session's dtype and shapes. Anything else returns ``None``
    (``read_step_request`` or the runtime then reads it). Contract as ``read_step_request``:
    what ``read`` returns is what upb parses (tests/test_wire.py)."""

    __slots__ = ("_dtype", "_heads", "_row", "_headers", "_ids")

    def __init__(self, dtype: int, num_query_heads: int, num_kv_heads: int, head_dim: int, itemsize: int):
        self._dtype = dtype
        self._heads = (num_query_heads, num_kv_heads, head_dim)
        self._row = (num_query_heads * head_dim * itemsize, num_kv_heads * head_dim * itemsize)
        self._headers: dict[int, tuple] = {}
        # the last message's packed ids and their array (read-only): a runtime sends the same
        # ids for every layer of a token, and the session plans a repeated array at once
        self._ids: tuple[bytes, np.ndarray] = (b"", _EMPTY_IDS)

    def _for(self, n: int) -> tuple:
        """(query header, new_key header, new_value header, query bytes, kv bytes, shapes) for n."""
        hq, hkv, d = self._heads
        q_shape, kv_shape = (n, hq, d), (n, hkv, d)
        q_bytes, kv_bytes = n * self._row[0], n * self._row[1]
        found = (
            tensor_field_head(b"\x1a", self._dtype, q_shape, q_bytes),  # BatchStep.query = 3
            tensor_field_head(b"\x22", self._dtype, kv_shape, kv_bytes),  # BatchStep.new_key = 4
            tensor_field_head(b"\x2a", self._dtype, kv_shape, kv_bytes),  # BatchStep.new_value = 5
            q_bytes,
            kv_bytes,
            q_shape,
            kv_shape,
        )
        if len(self._headers) < 64:  # a session's message sizes are few; never grow unbounded
            self._headers[n] = found
        return found

    def read(self, raw: bytes) -> tuple[int, StepRequest] | None:
        if not self._dtype:
            return None
        buf = memoryview(raw)
        end = len(raw)
        try:
            found = _step_envelope(raw, b"\x22")  # BatchRequest.step = 4
            if found is None:
                return None
            rid, layer, pos = found
            if raw[pos : pos + 1] != b"\x12":  # BatchStep.ids = 2, packed
                return None
            length, pos = _read_varint(buf, pos + 1, end)
            if not length or length > end - pos:
                return None
            packed = raw[pos : pos + length]
            if packed == self._ids[0]:
                ids = self._ids[1]
            else:
                ids = _packed_uint64(buf, (pos, pos + length))
                ids.flags.writeable = False
                self._ids = (packed, ids)
            pos += length
            n = len(ids)
            q_head, k_head, v_head, q_bytes, kv_bytes, q_shape, kv_shape = self._headers.get(n) or self._for(n)
            if end - pos != len(q_head) + len(k_head) + len(v_head) + q_bytes + 2 * kv_bytes:
                return None
            if not raw.startswith(q_head, pos):
                return None
            pos += len(q_head)
            q = buf[pos : pos + q_bytes]
            pos += q_bytes
            if not raw.startswith(k_head, pos):
                return None
            pos += len(k_head)
            k = buf[pos : pos + kv_bytes]
            pos += kv_bytes
            if not raw.startswith(v_head, pos):
                return None
            v = buf[pos + len(v_head) :]
        except _Unhandled:
            return None
        dtype = self._dtype
        return rid, StepRequest(
            layer, ids, TensorView(dtype, q_shape, q), TensorView(dtype, kv_shape, k), TensorView(dtype, kv_shape, v)
        )
