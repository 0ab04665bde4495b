"""The CPU backend: dense float32 / bfloat16 / float16 caches in a ring, the embedded default.

float32 keys are stored transposed, (B, Hkv, D, C), values as (B, Hkv, C, D): the score
product ``q @ K^T`` is then a row-major GEMM over the sequence (see ``attention.py``).
bfloat16/float16 keys are stored as rows, (B, Hkv, C, D), the layout torch's fused CPU attention
kernel reads (``attend_rows``): widening half-precision blocks for ``attend`` was measured ~3x
slower. Appending writes one key and one value; eviction writes nothing.
"""

from __future__ import annotations

import math

import torch

from .attention import attend, attend_rows
from .base import Backend, Capabilities, CacheSpec, LayerCache, dense_nbytes, scaled_query

__all__ = ["CPUBackend", "DenseCache"]

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


class DenseCache(LayerCache):
    def __init__(self, spec: CacheSpec):
        super().__init__(spec)
        b, h, c, d = spec.rows_shape
        # Keys as rows for the fused half-precision kernel, transposed for float32's GEMMs.
        self._keys_as_rows = spec.dtype in _FUSED_DTYPES
        k_shape = (b, h, c, d) if self._keys_as_rows else (b, h, d, c)
        self._k = torch.zeros(k_shape, dtype=spec.dtype, device=spec.device)
        self._v = torch.zeros((b, h, c, d), dtype=spec.dtype, device=spec.device)

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _write_rows(self, start, keys, values):
        n = keys.shape[2]
        if self._keys_as_rows:
            self._k[:, :, start : start + n] = keys
        else:
            self._k[:, :, :, start : start + n] = keys.transpose(2, 3)
        self._v[:, :, start : start + n] = values

    def _read_rows(self, start, stop):
        if self._keys_as_rows:
            return self._k[:, :, start:stop].clone(), self._v[:, :, start:stop].clone()
        return self._k[:, :, :, start:stop].transpose(2, 3).clone(), self._v[:, :, start:stop].clone()

    def _save_rows(self, start, stop):
        return self._read_rows(start, stop)

    def _restore_rows(self, start, saved):
        self._write_rows(start, *saved)

    def _attend(self, query, runs):
        s = self.spec
        n = s.batch_size * s.num_kv_heads
        v = self._v.view(n, s.capacity, s.head_dim)
        if self._keys_as_rows:
            q = query.reshape(n, s.group_size, s.head_dim)
            k = self._k.view(n, s.capacity, s.head_dim)
            out = attend_rows(q, [k[:, a:b] for a, b in runs], [v[:, a:b] for a, b in runs], 1.0 / math.sqrt(s.head_dim))
            return out.view(s.batch_size, s.num_query_heads, s.head_dim).to(s.dtype)
        q = scaled_query(query, s.num_kv_heads)
        k = self._k.view(n, s.head_dim, s.capacity)
        out = attend(q, [k[:, :, a:b] for a, b in runs], [v[:, a:b] for a, b in runs])
        return out.view(s.batch_size, s.num_query_heads, s.head_dim).to(s.dtype)


class CPUBackend(Backend):
    name = "cpu"
    capabilities = Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        devices=("cpu",),
    )

    def cache_nbytes(self, spec: CacheSpec) -> int:
        return dense_nbytes(spec)

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return DenseCache(spec)
