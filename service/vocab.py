"""The service's vocabularies, each defined once: dtypes, eviction policies, backends.

A vocabulary has up to three spellings, and every table here translates between them:

- the name (``"float32"``, ``"greedy"``, ``"cpu"``): flags, ``ServerConfig``, ``StreamConfig``,
  metrics labels, the clients' keyword arguments;
- the wire enum (``gqa_pb2.DTYPE_*``, ``gqa_pb2.EVICTION_POLICY_*``): the proto's integers;
- for dtypes, the torch dtype the caches hold.

Policy names are ``backends.policy.PolicyKind``'s values and backend names
``backends.registry.BACKENDS``' keys (both below ``service/`` so the backends need no proto);
this module adds their wire spellings. Importing it imports no backend module.
"""

from __future__ import annotations

import enum

import torch

from backends.policy import PolicyKind
from backends.registry import BACKENDS, DEFAULT_BACKEND

from .api import gqa_pb2

__all__ = [
    "DType",
    "DTYPE_CHOICES",
    "TORCH_DTYPES",
    "DTYPE_NAMES",
    "NAME_TO_DTYPE",
    "DTYPE_TO_TORCH",
    "TORCH_TO_DTYPE",
    "PolicyKind",
    "POLICY_CHOICES",
    "POLICY_NAMES",
    "POLICY_ENUMS",
    "BACKEND_CHOICES",
    "DEFAULT_BACKEND",
]


class DType(str, enum.Enum):
    """A stream's dtype: what its tensors travel as and what its caches hold (int8 caches
    quantize a stream of one of these; int8 on the wire is snapshot codes only)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        return TORCH_DTYPES[self.value]

    @property
    def wire(self) -> int:
        return NAME_TO_DTYPE[self.value]


_SPELLINGS: tuple[tuple[DType, torch.dtype, int], ...] = (
    (DType.FLOAT32, torch.float32, gqa_pb2.DTYPE_FLOAT32),
    (DType.FLOAT16, torch.float16, gqa_pb2.DTYPE_FLOAT16),
    (DType.BFLOAT16, torch.bfloat16, gqa_pb2.DTYPE_BFLOAT16),
)

# Names, in the proto's order (the flags' choices).
DTYPE_CHOICES: tuple[str, ...] = tuple(d.value for d in DType)
# name -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {d.value: t for d, t, _ in _SPELLINGS}
# wire enum -> name, and back
DTYPE_NAMES: dict[int, str] = {w: d.value for d, _, w in _SPELLINGS}
NAME_TO_DTYPE: dict[str, int] = {v: k for k, v in DTYPE_NAMES.items()}
# wire enum -> torch dtype, and back; torch.int8 travels only as snapshot codes (DTYPE_INT8)
DTYPE_TO_TORCH: dict[int, torch.dtype] = {w: t for _, t, w in _SPELLINGS}
TORCH_TO_DTYPE: dict[torch.dtype, int] = {t: w for _, t, w in _SPELLINGS}
TORCH_TO_DTYPE[torch.int8] = gqa_pb2.DTYPE_INT8

POLICY_CHOICES: tuple[str, ...] = tuple(k.value for k in PolicyKind)
# wire enum -> name, and back (EVICTION_POLICY_UNSPECIFIED has no name: an open must choose)
POLICY_NAMES: dict[int, str] = {
    gqa_pb2.EVICTION_POLICY_NONE: PolicyKind.NONE.value,
    gqa_pb2.EVICTION_POLICY_STRICT: PolicyKind.STRICT.value,
    gqa_pb2.EVICTION_POLICY_GREEDY: PolicyKind.GREEDY.value,
    gqa_pb2.EVICTION_POLICY_SINK: PolicyKind.SINK.value,
}
POLICY_ENUMS: dict[str, int] = {v: k for k, v in POLICY_NAMES.items()}

BACKEND_CHOICES: tuple[str, ...] = tuple(BACKENDS)
