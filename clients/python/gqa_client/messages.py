"""The messages of the Decode and DecodeStep calls: requests built from tensors, replies read
into results, shared by the blocking and the asyncio client.

Shapes: a step's ``query`` is (B, Hq, D), ``new_key`` and ``new_value`` (B, Hkv, D). Tensors are
numpy arrays or torch tensors of the stream's dtype (``gqa_client.tensors`` has the rule and its
one exception); results come back of the query's kind. A reply the server refused in-band
raises a ``Refused`` subclass (``InvalidArgument``, ``CacheFull``, ``InexactRollback``,
``ServerFault``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import grpc

from .api import gqa_pb2
from .errors import GqaError, refusal
from .tensors import decode, dtype_name, encode_into, is_torch

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MESSAGE_BYTES",
    "POLICIES",
    "DecodeStepResult",
    "RollbackResult",
    "StepResult",
    "add_prefill",
    "open_message",
    "policy_fields",
]

DEFAULT_MESSAGE_BYTES = 64 << 20
"""The channel's message limit, both ways: the server's default ``--max-message-bytes``."""
DEFAULT_CHUNK_BYTES = 4 << 20
"""Largest snapshot message asked for by default: gRPC's default receive limit everywhere."""
DEFAULT_CAPACITY = 4096
"""Tokens per layer a ``none`` stream (the default policy) keeps when no ``capacity`` is given."""
POLICIES: dict[str, int] = {
    "none": gqa_pb2.EVICTION_POLICY_NONE,
    "strict": gqa_pb2.EVICTION_POLICY_STRICT,
    "greedy": gqa_pb2.EVICTION_POLICY_GREEDY,
    "sink": gqa_pb2.EVICTION_POLICY_SINK,
}
"""Eviction policy name -> wire enum (docs/eviction.md)."""


# -- results -------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepResult:
    """One step's reply. ``output`` is (B, Hq, D), of the query's kind."""

    output: Any
    layer: int
    tokens_seen: int
    resident: int
    first_position: int
    last_position: int
    evicted: bool
    evicted_tokens: int
    compute_ns: int
    """The server's compute time for this step (append plus attention), in nanoseconds."""
    rollback_reach: int


@dataclasses.dataclass
class RollbackResult:
    """Per layer: tokens seen after the rollback, and how far back the next one can still go."""

    tokens_seen: list[int]
    rollback_reach: list[int]


@dataclasses.dataclass
class DecodeStepResult:
    """``output`` (B, Hq, D) and the caches with the new token appended (B, Hkv, S + 1, D)."""

    output: Any
    new_key_cache: Any
    new_value_cache: Any


# -- requests and replies (shared by both flavours) --------------------------------------------
def policy_fields(policy: str, window: int, capacity: int | None, sink_tokens: int) -> dict[str, int]:
    """The policy's wire fields; ``capacity=None`` is ``DEFAULT_CAPACITY`` for ``none`` and the
    server's default (the window) for ``greedy``. ``ValueError`` for an unknown policy name."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if capacity is None:
        capacity = DEFAULT_CAPACITY if policy == "none" else 0
    return dict(policy=POLICIES[policy], window=window, capacity=capacity, sink_tokens=sink_tokens)


def add_prefill(target, prefill: Mapping[int, tuple[Any, Any]] | None, dtype: str) -> None:
    """Adds ``prefill`` (layer -> (keys, values), each (B, Hkv, n, D)) to a message's ``prefill``."""
    for layer, (key, value) in (prefill or {}).items():
        cache = target.prefill.add(layer=layer)
        encode_into(cache.key, key, dtype, f"prefill[{layer}].key")
        encode_into(cache.value, value, dtype, f"prefill[{layer}].value")


def open_message(
    *,
    num_query_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    batch_size: int = 1,
    dtype="float32",
    policy: str = "none",
    window: int = 0,
    capacity: int | None = None,
    sink_tokens: int = 0,
    backend: str = "",
    prefill: Mapping[int, tuple[Any, Any]] | None = None,
) -> gqa_pb2.OpenStream:
    """An ``OpenStream`` (the arguments of ``Client.open``)."""
    name = dtype_name(dtype)
    message = gqa_pb2.OpenStream(
        backend=backend,
        dtype=gqa_pb2.DType.Value(f"DTYPE_{name.upper()}"),
        batch_size=batch_size,
        num_query_heads=num_query_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        **policy_fields(policy, window, capacity, sink_tokens),
    )
    add_prefill(message, prefill, name)
    return message


def _step_request(rid: int, layer: int, query, new_key, new_value, dtype: str) -> gqa_pb2.DecodeRequest:
    request = gqa_pb2.DecodeRequest(request_id=rid)
    step = request.step
    step.layer = layer
    encode_into(step.query, query, dtype, "query")
    encode_into(step.new_key, new_key, dtype, "new_key")
    encode_into(step.new_value, new_value, dtype, "new_value")
    return request


def _rollback_request(rid: int, count: int, layer: int | None) -> gqa_pb2.DecodeRequest:
    rollback = gqa_pb2.Rollback(count=count, layer=layer or 0, all_layers=layer is None)
    return gqa_pb2.DecodeRequest(request_id=rid, rollback=rollback)


def _snapshot_request(rid: int, max_chunk_bytes: int) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(request_id=rid, snapshot=gqa_pb2.SnapshotRequest(max_chunk_bytes=max_chunk_bytes))


def _step_result(response: gqa_pb2.DecodeResponse, query) -> StepResult:
    if response.WhichOneof("kind") == "error":
        raise refusal(response.error)
    step = response.step
    if step.status.code:
        raise refusal(step.status)
    return StepResult(
        output=decode(step.output, query, "output"),
        layer=step.layer,
        tokens_seen=step.tokens_seen,
        resident=step.resident,
        first_position=step.first_position,
        last_position=step.last_position,
        evicted=step.evicted,
        evicted_tokens=step.evicted_tokens,
        compute_ns=step.compute_ns,
        rollback_reach=step.rollback_reach,
    )


def _rollback_result(response: gqa_pb2.DecodeResponse) -> RollbackResult:
    if response.WhichOneof("kind") == "error":
        raise refusal(response.error)
    result = response.rollback
    if result.status.code:
        raise refusal(result.status)
    return RollbackResult(list(result.tokens_seen), list(result.rollback_reach))


def _snapshot_chunk(response: gqa_pb2.DecodeResponse) -> gqa_pb2.SnapshotChunk:
    if response.WhichOneof("kind") == "error":
        raise refusal(response.error)
    if response.WhichOneof("kind") != "snapshot":
        raise GqaError(grpc.StatusCode.INTERNAL, f"expected a snapshot chunk, got {response.WhichOneof('kind')}")
    return response.snapshot


def _query_dtype(query) -> str:
    """The dtype a stateless step travels in: the query's own (float32 for float32 numpy data
    headed for a bfloat16 call must be asked for with ``dtype``)."""
    dtype = query.dtype
    try:
        return dtype_name(dtype)
    except ValueError:
        kind = "torch" if is_torch(query) else "numpy"
        raise TypeError(f"query: a {kind} {dtype} tensor; a step travels as float32, float16 or bfloat16") from None


def _decode_step_request(
    query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
) -> gqa_pb2.DecodeStepRequest:
    if not hasattr(query, "dtype"):
        raise TypeError(f"query: expected a numpy array or a torch tensor, got {type(query).__name__}")
    name = dtype_name(dtype) if dtype is not None else _query_dtype(query)
    request = gqa_pb2.DecodeStepRequest(
        num_query_heads=num_query_heads or (query.shape[1] if len(query.shape) == 3 else 0),
        num_kv_heads=num_kv_heads or (new_key.shape[1] if len(getattr(new_key, "shape", ())) == 3 else 0),
    )
    encode_into(request.query, query, name, "query")
    encode_into(request.new_key, new_key, name, "new_key")
    encode_into(request.new_value, new_value, name, "new_value")
    encode_into(request.key_cache, key_cache, name, "key_cache")
    encode_into(request.value_cache, value_cache, name, "value_cache")
    return request


def _decode_step_result(response: gqa_pb2.DecodeStepResponse, query) -> DecodeStepResult:
    return DecodeStepResult(
        decode(response.output, query, "output"),
        decode(response.new_key_cache, query, "new_key_cache"),
        decode(response.new_value_cache, query, "new_value_cache"),
    )


# grpc.health.v1 by hand (HealthCheckRequest {string service = 1}, HealthCheckResponse {enum
# status = 1}): two fields are not worth a dependency on grpcio-health-checking.
_HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_SERVING_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _health_request(service: str) -> bytes:
    data = service.encode()
    if not data:
        return b""
    size, n = bytearray(), len(data)
    while True:
        byte, n = n & 0x7F, n >> 7
        size.append(byte | (0x80 if n else 0))
        if not n:
            return b"\x0a" + bytes(size) + data


def _health_status(reply: bytes) -> str:
    status = 0
    if reply[:1] == b"\x08":  # field 1, varint; a status under 128 is one byte
        status = reply[1] if len(reply) > 1 else 0
    return _SERVING_STATUS[status] if status < len(_SERVING_STATUS) else str(status)
