"""A ``Batch`` stream's replies as bytes: a step message's answer built around its output
(``StepReply``: the kernel writes the rows into the reply itself, where the step computed), and
the in-band statuses and refusals every Batch answer carries.

The step reply is written here rather than by upb: the output field first, its rows written in
place (``service.transport.bytes_in_place``; docs/design.md, "The step reply written in place"),
then the per-sequence fields packed from the (n, 6) array the step plane wrote
(``service.transport.wire.packed_varints``). tests/test_batch_rpc.py checks the bytes parse to
the message upb builds.
"""

from __future__ import annotations

import functools
import math

from ..api import gqa_pb2
from ..engine.plane import FIELDS, StepResult
from ..errors import ServiceError
from ..vocab import TORCH_TO_DTYPE
from . import bytes_in_place
from .wire import SMALL_VARINTS, packed_varints, tensor_field_head, varint

__all__ = ["OK", "status", "sequence_refusal", "step_reply_bytes", "StepReply"]

OK = gqa_pb2.Status(code=0)


def status(exc: ServiceError) -> gqa_pb2.Status:
    """A refusal's in-band status: the error's code and message."""
    return gqa_pb2.Status(code=exc.code_number, message=exc.message)


def sequence_refusal(index: int, sid: int, exc: ServiceError) -> gqa_pb2.SequenceRefusal:
    """One sequence's refusal: its row in the message, its id, its status."""
    return gqa_pb2.SequenceRefusal(index=index, id=sid, status=status(exc))


# Wire tags (field number << 3 | wire type) of the step reply's fields, which it encodes itself;
# tests/test_batch_rpc.py checks the bytes parse to the message upb builds.
_TAG_RESULT_OUTPUT = b"\x1a"  # BatchStepResult.output = 3
_TAG_RESPONSE_STEP = b"\x22"  # BatchResponse.step = 4
_STATUS_OK = b"\x0a\x00"  # BatchStepResult.status = 1, present and empty (code OK)
_TAG_LAYER = b"\x10"  # BatchStepResult.layer = 2
# BatchStepResult's packed per-sequence fields 4..9, in FIELDS order
_TAG_FIELDS = tuple(bytes([(4 + i) << 3 | 2]) for i in range(len(FIELDS)))
_TAG_REFUSAL = b"\x52"  # BatchStepResult.refusals = 10
_TAG_COMPUTE = b"\x58"  # BatchStepResult.compute_ns = 11 (varint)


# A reply's per-sequence fields of a session whose counts are below 2^14 are joined from the
# table of their varints by a C loop (``map``) rather than by a dozen numpy calls, which cost
# more than the work for a few sequences and far more when the step arrives with the caches cold.
_VARINTS = SMALL_VARINTS
_SMALL = len(_VARINTS)


def _packed_fields(fields) -> list[bytes]:
    """The six packed per-sequence fields (tag, length, data each) of int64 ``fields`` (n, 6),
    column by column: a column alike in every sequence (a window's resident count, sequences
    stepped in lockstep) is one varint repeated; small counts are joined from the table; any
    other column is encoded vectorized (``packed_varints``)."""
    parts = []
    rows = fields.T.tolist()
    n = len(rows[0])
    for j, (tag, row) in enumerate(zip(_TAG_FIELDS, rows)):
        first = row[0]
        if row.count(first) == n and first >= 0:
            data = (_VARINTS[first] if first < _SMALL else varint(first)) * n
        elif min(row) >= 0 and max(row) < _SMALL:
            data = b"".join(map(_VARINTS.__getitem__, row))
        else:
            data = packed_varints(fields[:, j : j + 1].T)[0]
        parts += [tag, varint(len(data)), data]
    return parts


def step_reply_bytes(rid: int, layer: int, result: StepResult | None, output=None, *, refused=None) -> bytes:
    """``BatchResponse(request_id=rid, step=BatchStepResult(...))`` serialized, written here:
    the output field first, ``output``'s bytes (a contiguous CPU tensor, ``result.output`` when
    not given) copied once, straight from its memory into the reply, then the rest
    (``_result_fields``; protobuf parsers take fields in any order). With ``refused`` (a
    ``ServiceError``) the whole message's refusal: status and layer only. ``StepReply`` writes
    the same bytes without the copy where it can."""
    if refused is not None:
        body = gqa_pb2.BatchStepResult(status=status(refused), layer=layer).SerializeToString()
        return _response_head(rid) + varint(len(body)) + body
    output_data = None
    if output is None:
        output, output_data = result.output, result.data
    output_field, nbytes = _output_head(TORCH_TO_DTYPE[output.dtype], tuple(output.shape))
    rest = _result_fields(layer, result)
    head = _response_head(rid) + varint(len(output_field) + nbytes + len(rest)) + output_field
    if not nbytes:
        return head + rest
    return b"".join((head, _bytes_of(output) if output_data is None else output_data, rest))


def _response_head(rid: int) -> bytes:
    """A ``BatchResponse``'s request id and its ``step`` field's tag (its length follows)."""
    return (b"\x08" + varint(rid) if rid else b"") + _TAG_RESPONSE_STEP


def _result_fields(layer: int, result: StepResult) -> bytes:
    """A ``BatchStepResult``'s fields but its output: the status (present, OK), the layer, the
    per-sequence fields packed from ``result.fields`` (int64 (n, 6), vectorized), the refusals
    (upb, one message each: only refused sequences cost Python) and ``compute_ns``."""
    parts = [_STATUS_OK]
    if layer:
        parts += [_TAG_LAYER, varint(layer)]
    if len(result.fields):
        parts += _packed_fields(result.fields)
    for row, sid, exc in result.refusals:
        r = sequence_refusal(row, sid, exc).SerializeToString()
        parts += [_TAG_REFUSAL, varint(len(r)), r]
    if result.compute_ns:
        parts += [_TAG_COMPUTE, varint(result.compute_ns)]
    return b"".join(parts)


def _max_result_fields(n: int) -> int:
    """``_result_fields``' length at most for n sequences with no refusal: status, layer and
    compute_ns (a tag and at most 10 bytes each) and six packed fields of n varints."""
    return 2 + 2 * 11 + 6 * (1 + 10 + 10 * n)


# Room for refusals after the largest fields (a few refusals with their messages); more refused
# than fits, and the reply is copied (``StepReply``).
_REFUSAL_ROOM = 1024


@functools.lru_cache(maxsize=256)
def _output_head(dtype: int, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """(the output field's bytes up to its data, the data's byte count) for an output of
    ``dtype`` (the wire's enum) and ``shape``: the same for every message of a session's size,
    so built once."""
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    return tensor_field_head(_TAG_RESULT_OUTPUT, dtype, shape, nbytes), nbytes


_ITEMSIZE = {enum: dtype.itemsize for dtype, enum in TORCH_TO_DTYPE.items()}


def _bytes_of(tensor):
    """A contiguous CPU tensor's memory as a buffer (no copy; ``bytes.join`` copies it once)."""
    import torch  # the tensor's own module; already loaded by whoever made the tensor

    return tensor.reshape(-1).view(torch.uint8).numpy()


class StepReply:
    """A step message's answer, built around its output. Made on the event loop with the
    message's output dtype and shape, it drafts the reply's bytes before the computation
    (``bytes_in_place.Draft``, at their largest): the response's head, the output field's head,
    then ``output``, the rows' place in the reply, which the set's step writes
    (``SequenceSet.run(out=...)``). Called where the message computed, it writes the step's
    numbers after the rows and the step's length before them, and cuts the bytes to their end:
    the rows are never copied. ``output`` is None where that cannot be done (no rows; this
    interpreter's bytes not laid out as ``bytes_in_place`` expects; a step length whose varint
    width is not known before the numbers); then, as when the set wrote rows of its own or the
    numbers outgrow the room kept for them (many refusals), the reply is ``step_reply_bytes``'s
    bytes, the rows copied once."""

    __slots__ = ("rid", "layer", "output", "_draft", "_head", "_field", "_width", "_room")

    def __init__(self, rid: int, layer: int, dtype: int = 0, shape: tuple[int, ...] = ()):
        self.rid, self.layer = rid, layer
        self.output = self._draft = None
        field, nbytes = _output_head(dtype, shape) if dtype else (b"", 0)
        if not (nbytes and bytes_in_place.AVAILABLE):
            return
        head = _response_head(rid)
        room = _max_result_fields(shape[0]) + _REFUSAL_ROOM
        width = len(varint(len(field) + nbytes + len(_STATUS_OK)))
        if len(varint(len(field) + nbytes + room)) != width:  # the step's length may take a byte more
            return
        at = len(head) + width + len(field)  # where the rows start
        self._draft = bytes_in_place.Draft(at + nbytes + room)
        self._draft.write(0, head)
        self._draft.write(at - len(field), field)
        self.output = self._draft.view(at, nbytes)
        self._head, self._field, self._width, self._room = head, field, width, room

    def __call__(self, result: StepResult, queue_seconds: float) -> bytes:
        draft, self._draft = self._draft, None
        if draft is None:
            return step_reply_bytes(self.rid, self.layer, result)
        try:
            if result.data is not self.output:  # the set wrote rows of its own
                return step_reply_bytes(self.rid, self.layer, result)
            rows = self.output
            rest = _result_fields(self.layer, result)
            length = varint(len(self._field) + len(rows) + len(rest))
            if len(rest) > self._room or len(length) != self._width:  # many refusals: copied
                return b"".join((self._head, length, self._field, rows, rest))
            at = len(self._head) + self._width + len(self._field)
            draft.write(len(self._head), length)
            draft.write(at + len(rows), rest)
            return draft.finish(at + len(rows) + len(rest))
        finally:
            draft.discard()  # spent either way (a no-op after ``finish``)
