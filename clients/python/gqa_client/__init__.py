"""The Python client of gqa-serve (gqa.v1): ``Decode`` streams, the ``Batch`` session,
snapshots, TLS and tokens, typed refusals; blocking (``Client``) and asyncio (``AsyncClient``).

    import numpy as np
    from gqa_client import Client

    with Client("127.0.0.1:50051") as client:
        with client.open(num_query_heads=32, num_kv_heads=8, head_dim=128) as stream:
            result = stream.step(0, query, new_key, new_value)  # (1, 32, 128), (1, 8, 128) x2
            result.output, result.tokens_seen, result.compute_ns

It needs grpcio, protobuf and numpy; torch tensors are accepted and returned where the caller
uses torch (torch is never imported by this package). The dtype rule is in
``gqa_client.tensors``; the generated stubs are ``gqa_client.api.gqa_pb2`` and ``gqa_pb2_grpc``.
"""

from ._version import __version__
from .aio import AsyncClient, AsyncDecodeStream
from .batch import BatchRollbackOutput, BatchSession, BatchStepOutput
from .channel import channel_options
from .client import Client
from .errors import (
    CacheFull,
    CallFailed,
    GqaError,
    InexactRollback,
    InvalidArgument,
    NotFound,
    Refused,
    ServerFault,
)
from .messages import (
    DEFAULT_CAPACITY,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MESSAGE_BYTES,
    POLICIES,
    DecodeStepResult,
    RollbackResult,
    StepResult,
    open_message,
)
from .snapshot import Snapshot
from .stream import DecodeStream
from .tensors import DTYPES

__all__ = [
    "__version__",
    "Client",
    "AsyncClient",
    "DecodeStream",
    "AsyncDecodeStream",
    "BatchSession",
    "BatchStepOutput",
    "BatchRollbackOutput",
    "Snapshot",
    "StepResult",
    "RollbackResult",
    "DecodeStepResult",
    "GqaError",
    "Refused",
    "InvalidArgument",
    "NotFound",
    "CacheFull",
    "InexactRollback",
    "ServerFault",
    "CallFailed",
    "open_message",
    "channel_options",
    "DTYPES",
    "POLICIES",
    "DEFAULT_CAPACITY",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MESSAGE_BYTES",
]
