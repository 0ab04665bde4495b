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
from .wire import DecodeStepLayout, varint

__all__ = ["StepShape", "StepReply", "step_refusal", "step_input_error"]


class StepShape:
    """What a stream's step tensors must be, as the integers the wire carries: checked with
    integer comparisons, no tensor built on the event loop."""

    __slots__ = ("dtype", "q_shape", "kv_shape", "q_bytes", "kv_bytes", "out_shape", "layout")

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


class StepReply:
    """Builds a step's reply on the compute worker, as bytes: ``DecodeResponse(step=...)`` with
    its fields encoded here and the output's bytes copied once, straight from the tensor into
    the reply (tests/test_service.py checks the bytes parse to what upb builds). A refusal is a
    message (rare: upb builds it)."""

    __slots__ = ("rid", "layer", "head", "tensor_head", "nbytes")

    def __init__(self, rid: int, layer: int, shape: tuple[int, ...], dtype: int, nbytes: int):
        self.rid, self.layer, self.nbytes = rid, layer, nbytes
        self.head = (b"\x08" + varint(rid) if rid else b"") + b"\x1a"  # DecodeResponse.step = 3
        dims = b"".join(varint(x) for x in shape)
        # Tensor: dtype = 1, shape = 2 (packed), data = 3 (proto3 omits empty bytes)
        self.tensor_head = (
            b"\x08" + varint(dtype) + b"\x12" + varint(len(dims)) + dims + (b"\x1a" + varint(nbytes) if nbytes else b"")
        )

    def __call__(self, value: StepReport | ServiceError, queue_seconds: float):
        if isinstance(value, ServiceError):
            return step_refusal(self.rid, self.layer, value)
        o = value.outcome
        out = o.output
        if not (out.is_cpu and out.is_contiguous()):
            out = out.cpu().contiguous()
        # StepResult: status = 1 (present, OK), layer = 2, output = 3, tokens_seen = 4,
        # resident = 5, first_position = 6, last_position = 7, evicted = 8, evicted_tokens = 9,
        # compute_ns = 10, rollback_reach = 11; zeros omitted as proto3 does.
        parts = [b"\x0a\x00"]
        if self.layer:
            parts += [b"\x10", varint(self.layer)]
        for tag, v in (
            (b"\x20", o.tokens_seen),
            (b"\x28", o.resident),
            (b"\x30", o.first_position),
            (b"\x38", o.last_position),
            (b"\x40", 1 if o.evicted_tokens > 0 else 0),
            (b"\x48", o.evicted_tokens),
            (b"\x50", value.compute_ns),
            (b"\x58", value.rollback_reach),
        ):
            if v:
                parts += [tag, varint(v)]
        fields = b"".join(parts)
        tensor_len = len(self.tensor_head) + self.nbytes
        output_field = b"\x1a" + varint(tensor_len) + self.tensor_head
        step_len = len(fields) + len(output_field) + self.nbytes
        head = b"".join((self.head, varint(step_len), fields, output_field))
        if not self.nbytes:
            return head
        return b"".join((head, out.reshape(-1).view(torch.uint8).numpy()))


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
