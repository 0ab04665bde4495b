"""The CUDA backend: float16 / bfloat16 caches on the GPU, attention by a Triton kernel.

Each layer's keys and values are one (B, Hkv, C, D) tensor each, allocated once on the device;
position ``p`` lives at the ring row ``LayerCache.row_of(p)``, so appending writes one row and
eviction, under every policy, copies nothing. The attended positions reach the kernel as at
most three row runs (sinks, then a window that may wrap) and the kernel maps its logical index
to ring rows itself (``triton_decode.py``). Exports come out in position order through the
base class.

``attention="sdpa"`` swaps the kernel for PyTorch's ``scaled_dot_product_attention`` with
``enable_gqa=True`` over a contiguous view of the attended rows (a copy when the runs are
several): the baseline the kernel is measured against.

Importing this module never imports ``triton`` and never touches the device, so it is safe on
any machine; ``CUDABackend.probe()`` says why the backend cannot run here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Backend, Capabilities, CacheSpec, DenseRingCache, LayerCache, dense_nbytes

__all__ = ["ATTENTION_PATHS", "CUDABackend", "CUDACache", "DeviceFacts", "device_facts", "sdpa_attention"]

ATTENTION_PATHS = ("triton", "sdpa")


@dataclass(frozen=True)
class DeviceFacts:
    """What ``probe`` needs to know about this machine; tests fake it."""

    torch_has_cuda: bool  # torch was built with CUDA
    device_count: int  # CUDA devices torch can see
    triton_installed: bool


def device_facts() -> DeviceFacts:
    has_cuda = torch.version.cuda is not None
    try:
        count = torch.cuda.device_count() if has_cuda else 0
    except RuntimeError:  # a broken driver is reported as "no device", not raised
        count = 0
    return DeviceFacts(has_cuda, count, importlib.util.find_spec("triton") is not None)


def reasons_from(facts: DeviceFacts) -> list[str]:
    reasons = []
    if not facts.torch_has_cuda:
        reasons.append("cuda: torch has no CUDA (CPU build)")
    elif facts.device_count < 1:
        reasons.append("cuda: no CUDA device")
    if not facts.triton_installed:
        reasons.append("cuda: triton not installed (the 'triton' extra)")
    return reasons


def sdpa_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   runs: list[tuple[int, int]]) -> torch.Tensor:
    """The baseline: SDPA over a contiguous view of the runs of (B, Hkv, C, D) caches."""
    if len(runs) == 1:
        (a, b), = runs
        k, v = keys[:, :, a:b], values[:, :, a:b]
    else:
        k = torch.cat([keys[:, :, a:b] for a, b in runs], dim=2)
        v = torch.cat([values[:, :, a:b] for a, b in runs], dim=2)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, enable_gqa=True)
    return out.squeeze(2)


class CUDACache(DenseRingCache):
    """Dense ring cache on one device, keys and values as rows (B, Hkv, C, D). Device-agnostic in
    itself: the kernel tests run it on CPU tensors under Triton's interpreter."""

    def __init__(self, spec: CacheSpec, attention: str = "triton", kernel_config=None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {attention!r}")
        super().__init__(spec, keys_as_rows=True)
        self.attention = attention
        self.kernel_config = kernel_config

    def _attend(self, query, runs):
        if self.attention == "sdpa":
            return sdpa_attention(query, self._k, self._v, runs)
        from . import triton_decode

        s = self.spec
        n = s.batch_size * s.num_kv_heads
        config = self.kernel_config or triton_decode.DEFAULT_CONFIG
        return triton_decode.decode_attention(
            query,
            self._k.view(n, s.capacity, s.head_dim),
            self._v.view(n, s.capacity, s.head_dim),
            runs,
            num_kv_heads=s.num_kv_heads,
            config=config,
        )


class CUDABackend(Backend):
    """``attention``: ``"triton"`` (the service's kernel) or ``"sdpa"`` (the PyTorch baseline)."""

    name = "cuda"
    capabilities = Capabilities(
        dtypes=(torch.float16, torch.bfloat16),
        devices=("cuda",),
        max_head_dim=256,
    )
    default_device = "cuda"

    def __init__(self, attention: str = "triton", kernel_config=None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {attention!r}")
        self.attention = attention
        self.kernel_config = kernel_config

    @classmethod
    def probe(cls) -> list[str]:
        return reasons_from(device_facts())

    def cache_nbytes(self, spec: CacheSpec) -> int:
        return dense_nbytes(spec)

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return CUDACache(spec, self.attention, self.kernel_config)
