"""The CPU backend: dense float32 / bfloat16 / float16 caches in a ring, the embedded default.

Keys are stored transposed, (B, Hkv, D, C), values as (B, Hkv, C, D): the score product
``q @ K^T`` is then a row-major GEMM over the sequence (see ``attention.py``). Appending writes
one column of keys and one row of values; eviction writes nothing.
"""

from __future__ import annotations

import torch

from .attention import attend
from .base import Backend, Capabilities, CacheSpec, LayerCache, dense_nbytes, scaled_query

__all__ = ["CPUBackend", "DenseCache"]


class DenseCache(LayerCache):
    def __init__(self, spec: CacheSpec):
        super().__init__(spec)
        b, h, c, d = spec.rows_shape
        self._k = torch.zeros((b, h, d, c), dtype=spec.dtype, device=spec.device)
        self._v = torch.zeros((b, h, c, d), dtype=spec.dtype, device=spec.device)

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _write_rows(self, start, keys, values):
        n = keys.shape[2]
        self._k[:, :, :, start : start + n] = keys.transpose(2, 3)
        self._v[:, :, start : start + n] = values

    def _read_rows(self, start, stop):
        return self._k[:, :, :, start:stop].transpose(2, 3).clone(), self._v[:, :, start:stop].clone()

    def _save_rows(self, start, stop):
        return self._read_rows(start, stop)

    def _restore_rows(self, start, saved):
        self._write_rows(start, *saved)

    def _attend(self, query, runs):
        s = self.spec
        n = s.batch_size * s.num_kv_heads
        q = scaled_query(query, s.num_kv_heads)
        k = self._k.view(n, s.head_dim, s.capacity)
        v = self._v.view(n, s.capacity, s.head_dim)
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
