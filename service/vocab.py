"""The service's vocabularies, each defined once: dtypes, eviction policies, backends.

A vocabulary has up to three spellings, and every table here translates between them:

- the name (``"float32"``, ``"greedy"``, ``"cpu"``): flags, ``ServerConfig``, ``StreamConfig``,
  metrics labels, the clients' keyword arguments;
- the wire enum (``gqa_pb2.DTYPE_*``, ``gqa_pb2.EVICTION_POLICY_*``): the proto's integers;
- for dtypes, the torch dtype the caches hold.

Policy names are ``backends.policy.PolicyKind``'s values and backend names
``backends.registry.BACKENDS``' keys (both below ``service/`` so the backends need no proto);
this module adds their wire spellings. Importing it imports no backend module, and no torch:
the three tables that hold torch dtypes (``TORCH_DTYPES``, ``DTYPE_TO_TORCH``,
``TORCH_TO_DTYPE``) are built on first use, so the command line's flags, ``--help`` and
``--version`` answer without torch's import (~3 s of CPU).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from backends.policy import PolicyKind
from backends.registry import BACKENDS, DEFAULT_BACKEND

from .api import gqa_pb2

if TYPE_CHECKING:
    import torch

    # built on first use (``__getattr__`` below)
    TORCH_DTYPES: dict[str, torch.dtype]
    DTYPE_TO_TORCH: dict[int, torch.dtype]
    TORCH_TO_DTYPE: dict[torch.dtype, int]

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
        import torch  # noqa: PLC0415 (on first use: see the module's docstring)

        return getattr(torch, self.value)

    @property
    def wire(self) -> int:
        return NAME_TO_DTYPE[self.value]


_WIRE: tuple[tuple[DType, int], ...] = (
    (DType.FLOAT32, gqa_pb2.DTYPE_FLOAT32),
    (DType.FLOAT16, gqa_pb2.DTYPE_FLOAT16),
    (DType.BFLOAT16, gqa_pb2.DTYPE_BFLOAT16),
)

# Names, in the proto's order (the flags' choices).
DTYPE_CHOICES: tuple[str, ...] = tuple(d.value for d in DType)
# wire enum -> name, and back
DTYPE_NAMES: dict[int, str] = {w: d.value for d, w in _WIRE}
NAME_TO_DTYPE: dict[str, int] = {v: k for k, v in DTYPE_NAMES.items()}


def _torch_tables() -> dict[str, dict]:
    import torch  # noqa: PLC0415 (on first use: see the module's docstring)

    spellings = [(d, getattr(torch, d.value), w) for d, w in _WIRE]
    return {
        # name -> torch dtype
        "TORCH_DTYPES": {d.value: t for d, t, _ in spellings},
        # wire enum -> torch dtype, and back; torch.int8 travels only as snapshot codes (DTYPE_INT8)
        "DTYPE_TO_TORCH": {w: t for _, t, w in spellings},
        "TORCH_TO_DTYPE": {t: w for _, t, w in spellings} | {torch.int8: gqa_pb2.DTYPE_INT8},
    }


def __getattr__(name: str):
    """``TORCH_DTYPES``, ``DTYPE_TO_TORCH`` and ``TORCH_TO_DTYPE``, built (and torch imported)
    on first use, then plain module attributes."""
    if name in ("TORCH_DTYPES", "DTYPE_TO_TORCH", "TORCH_TO_DTYPE"):
        globals().update(_torch_tables())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
