"""The backend contract: the types a backend shares with its callers.

A backend is a class with its capabilities as class data (``Capabilities``) and one factory,
``create_cache``, for the cache of one layer of one stream, shaped by a ``CacheSpec``. The cache
(``base.LayerCache``) owns B x Hkv x C x D keys and values, allocated once; each of its steps
returns a ``StepOutcome``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from .errors import BackendUnavailable
from .policy import EvictionPolicy
from .validation import dtype_name

if TYPE_CHECKING:
    from .base import LayerCache

__all__ = ["Backend", "Capabilities", "CacheSpec", "StepOutcome"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve: dtypes of the tensors it exchanges, head widths, devices."""

    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    max_head_dim: int = 1 << 16
    head_dim_multiple: int = 1

    def reasons_against(self, name: str, dtype: torch.dtype, head_dim: int, device: str) -> list[str]:
        reasons = []
        if dtype not in self.dtypes:
            reasons.append(
                f"{name}: dtype {dtype_name(dtype)} not supported (supports {', '.join(dtype_name(d) for d in self.dtypes)})"
            )
        if head_dim < 1 or head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            reasons.append(
                f"{name}: head_dim {head_dim} not supported (1..{self.max_head_dim}, multiple of {self.head_dim_multiple})"
            )
        if torch.device(device).type not in self.devices:
            reasons.append(f"{name}: device {device} not supported (supports {', '.join(self.devices)})")
        return reasons


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one layer's cache, fixed for the life of a stream."""

    batch_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    policy: EvictionPolicy
    device: str = "cpu"

    def __post_init__(self):
        for name in ("batch_size", "num_query_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"num_query_heads ({self.num_query_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @property
    def rows_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.num_kv_heads, self.capacity, self.head_dim)


@dataclass(slots=True)
class StepOutcome:
    """What one step did: the output and the cache's bookkeeping after it. A record the step
    hands over and never touches again (not frozen: a frozen dataclass's ``__init__`` is a
    measurable part of a native step at S=1, docs/design.md). The output is the caller's: a
    later step of the cache may write into its memory again only once nothing refers to it any
    more (backends/csrc/torch_step.cpp)."""

    output: torch.Tensor  # (B, Hq, D) in the spec's dtype
    tokens_seen: int  # T after the step
    resident: int  # L after the step
    first_position: int  # oldest resident position
    last_position: int  # newest resident position (the token just appended)
    evicted_tokens: int  # tokens that stopped being resident in this step
    bytes_written: int  # bytes stored for the new token
    bytes_moved: int  # bytes copied inside the cache to evict (0 for a ring layout)
    attended: int = 0  # positions the new token attended to


class Backend(abc.ABC):
    """A named way to store caches and attend. Capabilities are class data."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    default_device: ClassVar[str] = "cpu"

    @classmethod
    def probe(cls) -> list[str]:
        """Reasons this backend cannot run on this machine at all (empty when it can)."""
        return []

    def probe_reasons(self) -> list[str]:
        """``probe()`` computed once for this instance (the registry keeps one instance per
        backend per process), not on every cache created."""
        probed = self.__dict__.get("_probed")
        if probed is None:
            probed = self.__dict__["_probed"] = list(self.probe())
        return list(probed)

    def reasons_against(self, spec: CacheSpec) -> list[str]:
        return self.probe_reasons() + self.capabilities.reasons_against(
            self.name, spec.dtype, spec.head_dim, spec.device
        )

    def check(self, spec: CacheSpec) -> None:
        reasons = self.reasons_against(spec)
        if reasons:
            raise BackendUnavailable(reasons)

    @abc.abstractmethod
    def cache_nbytes(self, spec: CacheSpec) -> int:
        """Bytes ``create_cache(spec)`` will allocate: admission is decided on this, before allocation."""

    @abc.abstractmethod
    def create_cache(self, spec: CacheSpec) -> LayerCache: ...
