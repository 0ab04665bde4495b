"""One ``Decode`` stream's step on the wire: a request checked against the stream's shapes with
integer comparisons (``StepShape``), its reply written as bytes on the compute worker
(``StepReply``), and the refusal of a step that does not fit (``step_refusal``, ``step_input_error``).

The reply is encoded here rather than by upb, around the output's bytes (docs/design.md, "The
step reply and its bytes"); tests/test_service.py checks the bytes parse to upb's message.
"""

from __future__ import annotations

import torch

from ..api import gqa_pb2
from ..engine.engine import Stream
from ..engine.report import StepReport, classify_step_error
from ..engine.tensors import from_proto
from ..errors import InvalidArgument, ServiceError
from ..vocab import NAME_TO_DTYPE, TORCH_DTYPES
from .wire import SMALL_VARINTS, DecodeStepLayout, tensor_field_head, varint

__all__ = ["StepShape", "StepReply", "step_refusal", "step_input_error"]


class StepShape:
    """What a stream's step tensors must be, as the integers the wire carries: checked with
    integer comparisons, no tensor built on the event loop. Also the constant parts of the
    stream's step replies (``output_field``), encoded once."""

    __slots__ = ("dtype", "q_shape", "kv_shape", "q_bytes", "kv_bytes", "out_shape", "layout", "output_field")

    def __init__(self, stream: Stream):
        c = stream.config
        itemsize = torch.empty((), dtype=TORCH_DTYPES[c.dtype]).element_size()
        self.dtype = NAME_TO_DTYPE[c.dtype]
        self.q_shape = (c.batch_size, c.num_query_heads, c.head_dim)
        self.kv_shape = (c.batch_size, c.num_kv_heads, c.head_dim)
        self.q_bytes = c.batch_size * c.num_query_heads * c.head_dim * itemsize
        self.kv_bytes = c.batch_size * c.num_kv_heads * c.head_dim * itemsize
        self.out_shape = self.q_shape
        # The stream's step requests as the runtimes encode them: read by checking prefixes
        self.layout = DecodeStepLayout(self.dtype, self.q_shape, self.kv_shape, self.q_bytes, self.kv_bytes)
        self.output_field = output_field(self.out_shape, self.dtype, self.q_bytes)

    def matches(self, step) -> bool:
        q, k, v = step.query, step.new_key, step.new_value
        return (
            q.dtype == self.dtype
            and k.dtype == self.dtype
            and v.dtype == self.dtype
            and len(q.data) == self.q_bytes
            and len(k.data) == self.kv_bytes
            and len(v.data) == self.kv_bytes
            and tuple(q.shape) == self.q_shape
            and tuple(k.shape) == self.kv_shape
            and tuple(v.shape) == self.kv_shape
        )

    def reply(self, rid: int, layer: int) -> "StepReply":
        return StepReply(rid, layer, self.out_shape, self.dtype, self.q_bytes, self.output_field)


def output_field(shape: tuple[int, ...], dtype: int, nbytes: int) -> bytes:
    """StepResult.output = 3's tag, length and Tensor head (dtype = 1, shape = 2 packed, data = 3
    tag and length; proto3 omits empty bytes): everything of the field but the data."""
    return tensor_field_head(b"\x1a", dtype, shape, nbytes)


_VARINTS = SMALL_VARINTS
_SMALL = len(_VARINTS)


def _varint(n: int) -> bytes:
    """``wire.varint`` for the non-negative ints of a step's numbers: the table's below 2^14,
    three bytes without a loop below 2^21 (a reply's length, compute_ns up to 2 ms)."""
    if n < _SMALL:
        return _VARINTS[n]
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    return varint(n)


class StepReply:
    """Builds a step's reply on the compute worker, as bytes: ``DecodeResponse(step=...)`` with
    its fields encoded here and the output's bytes copied once, straight into the reply
    (tests/test_service.py checks the bytes parse to what upb builds). ``encode`` takes the
    step's numbers (``backends.batch_bytes``: tokens_seen, resident, first and last position,
    evicted tokens, rollback reach) and output bytes; calling it takes a ``StepReport`` or a
    refusal. A refusal is a message (rare: upb builds it). One is made per step, so it only
    keeps what it is given; ``encode`` writes every field, the numbers below 2^14 looked up
    rather than encoded by a call."""

    __slots__ = ("rid", "layer", "output_field", "nbytes")

    def __init__(self, rid: int, layer: int, shape: tuple[int, ...], dtype: int, nbytes: int, field: bytes = b""):
        self.rid, self.layer, self.nbytes = rid, layer, nbytes
        self.output_field = field or output_field(shape, dtype, nbytes)

    def __call__(self, value: StepReport | ServiceError, queue_seconds: float):
        if isinstance(value, ServiceError):
            return step_refusal(self.rid, self.layer, value)
        o = value.outcome
        out = o.output
        if not (out.is_cpu and out.is_contiguous()):
            out = out.cpu().contiguous()
        fields = (o.tokens_seen, o.resident, o.first_position, o.last_position, o.evicted_tokens, value.rollback_reach)
        output = out.reshape(-1).view(torch.uint8).numpy() if self.nbytes else b""
        return self.encode(fields, value.compute_ns, output)

    def encode(self, fields, compute_ns: int, output) -> bytes:
        t, resident, first, last, evicted, reach = fields
        v, small, layer = _VARINTS, _SMALL, self.layer
        # StepResult: status = 1 (present, OK), layer = 2, output = 3, tokens_seen = 4,
        # resident = 5, first_position = 6, last_position = 7, evicted = 8, evicted_tokens = 9,
        # compute_ns = 10, rollback_reach = 11; zeros omitted as proto3 does. After a step
        # tokens_seen and resident are at least 1.
        parts = [
            b"\x0a\x00\x10" + (v[layer] if layer < small else _varint(layer)) if layer else b"\x0a\x00",
            b"\x20",
            v[t] if t < small else _varint(t),
            b"\x28",
            v[resident] if resident < small else _varint(resident),
        ]
        if first:
            parts += (b"\x30", v[first] if first < small else _varint(first))
        if last:
            parts += (b"\x38", v[last] if last < small else _varint(last))
        if evicted > 0:
            parts += (b"\x40\x01\x48", v[evicted] if evicted < small else _varint(evicted))
        if compute_ns:
            parts += (b"\x50", v[compute_ns] if compute_ns < small else _varint(compute_ns))
        if reach:
            parts += (b"\x58", v[reach] if reach < small else _varint(reach))
        parts.append(self.output_field)
        body = b"".join(parts)
        # DecodeResponse: request_id = 1 (omitted when 0), step = 3
        rid = self.rid
        head = b"\x1a" + _varint(len(body) + self.nbytes)
        if rid:
            head = b"\x08" + (v[rid] if rid < small else _varint(rid)) + head
        if not self.nbytes:
            return head + body
        return b"".join((head, body, output))


def step_refusal(rid: int, layer: int, exc: ServiceError) -> gqa_pb2.DecodeResponse:
    return gqa_pb2.DecodeResponse(
        request_id=rid,
        step=gqa_pb2.StepResult(status=gqa_pb2.Status(code=exc.code_number, message=exc.message), layer=layer),
    )


def step_input_error(stream: Stream, step) -> ServiceError:
    """The slow path of a step that failed the integer checks: the precise message."""
    if not 0 <= step.layer < stream.config.num_layers:
        return InvalidArgument(
            f"layer: {step.layer} is out of range; the stream has num_layers={stream.config.num_layers}"
        )
    try:
        query = from_proto(step.query, "step.query", rank=3, copy=False)
        new_key = from_proto(step.new_key, "step.new_key", rank=3, copy=False)
        new_value = from_proto(step.new_value, "step.new_value", rank=3, copy=False)
        stream.caches[step.layer].check_step(query, new_key, new_value)
    except ServiceError as exc:
        return exc
    except (TypeError, ValueError) as exc:
        return InvalidArgument(str(exc))
    except Exception as exc:
        return classify_step_error(exc, f"stream {stream.id}: checking a step")
    return InvalidArgument("step: tensors do not match the stream's dtype and shapes")
