"""A ``Batch`` stream's replies as bytes: a step message's answer encoded around its output
buffer (``step_reply_bytes``, where the step computed), and the in-band statuses and refusals
every Batch answer carries.

The step reply is written here rather than by upb: the per-sequence fields packed from the
(n, 6) array the step plane wrote (``service.transport.wire.packed_varints``), and the output's bytes
copied once, straight from the tensor into the reply (docs/design.md, "The step reply and its
bytes"). tests/test_batch_rpc.py checks the bytes parse to the message upb builds.
"""

from __future__ import annotations

import functools
import math

from ..api import gqa_pb2
from ..engine.plane import FIELDS, StepResult
from ..errors import ServiceError
from ..vocab import TORCH_TO_DTYPE
from .wire import packed_varints, tensor_field_head, varint

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


# The varints of 0 .. 2^14 - 1 (one and two bytes), built once: a reply's per-sequence fields
# of a session whose counts are below it are joined from this table by a C loop (``map``)
# rather than by a dozen numpy calls, which cost more than the work for a few sequences and
# far more when the step arrives with the caches cold.
_SMALL = 1 << 14
_VARINTS = [varint(i) for i in range(_SMALL)]


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
    the per-sequence fields packed from ``result.fields`` (int64 (n, 6), vectorized), the
    refusals (upb, one message each: only refused sequences cost Python), ``compute_ns``, and
    the output field last, ``output``'s bytes (a contiguous CPU tensor, ``result.output`` when
    not given) copied once, straight from its memory into the reply (protobuf parsers take
    fields in any order). With ``refused`` (a ``ServiceError``) the whole message's refusal:
    status and layer only."""
    if refused is not None:
        body = gqa_pb2.BatchStepResult(status=status(refused), layer=layer).SerializeToString()
        return (b"\x08" + varint(rid) if rid else b"") + _TAG_RESPONSE_STEP + varint(len(body)) + body
    output_data = None
    if output is None:
        output, output_data = result.output, result.data
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
    rest = b"".join(parts)
    output_field, nbytes = _output_head(output.dtype, output.shape)
    step_len = len(rest) + len(output_field) + nbytes
    head = (b"\x08" + varint(rid) if rid else b"") + _TAG_RESPONSE_STEP + varint(step_len) + rest + output_field
    if not nbytes:
        return head
    return b"".join((head, _bytes_of(output) if output_data is None else output_data))


@functools.lru_cache(maxsize=256)
def _output_head(dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    """(the output field's bytes up to its data, the data's byte count) for an output of
    ``dtype`` and ``shape``: the same for every message of a session's size, so built once."""
    nbytes = math.prod(shape) * dtype.itemsize
    return tensor_field_head(_TAG_RESULT_OUTPUT, TORCH_TO_DTYPE[dtype], shape, nbytes), nbytes


def _bytes_of(tensor):
    """A contiguous CPU tensor's memory as a buffer (no copy; ``bytes.join`` copies it once)."""
    import torch  # the tensor's own module; already loaded by whoever made the tensor

    return tensor.reshape(-1).view(torch.uint8).numpy()


class StepReply:
    """Encodes a step message's answer where it computed (``Engine.submit_message``)."""

    __slots__ = ("rid", "layer")

    def __init__(self, rid: int, layer: int):
        self.rid, self.layer = rid, layer

    def __call__(self, result: StepResult, queue_seconds: float) -> bytes:
        return step_reply_bytes(self.rid, self.layer, result)
