"""Dense ring storage: keys and values in the stream's dtype, allocated once on the spec's device.

The storage half of the cpu and cuda caches (``base.LayerCache`` is the other half).
"""

from __future__ import annotations

import torch

from . import host_memory
from .base import LayerCache
from .contract import CacheSpec
from .key_layout import KeyBlocks, KeyRows

__all__ = ["DenseRingCache", "dense_nbytes"]


_KEY_STORES = {"transposed": KeyRows, "blocks": KeyBlocks}


class DenseRingCache(LayerCache):
    """Dense storage in the stream dtype for a ring: values (B, Hkv, C, D); keys in one of
    ``KEY_LAYOUTS``: "rows" (B, Hkv, C, D) like the values, "transposed"
    (``key_layout.KeyRows``, for torch's GEMMs) or "blocks" (``key_layout.KeyBlocks``, the
    compiled kernel's). The storage methods of the cpu and cuda caches; allocated once on
    ``spec.device``."""

    KEY_LAYOUTS = ("rows", "transposed", "blocks")

    def __init__(self, spec: CacheSpec, key_layout: str):
        super().__init__(spec)
        b, h, c, d = spec.rows_shape
        self._key_layout = key_layout
        self._keys = None
        if key_layout == "rows":
            self._k = host_memory.zeros((b, h, c, d), spec.dtype, spec.device)
        else:
            self._keys = _KEY_STORES[key_layout]((b, h), c, d, spec.dtype, spec.device)
            self._k = self._keys.data  # the storage tensor, whatever its layout
        self._v = host_memory.zeros((b, h, c, d), spec.dtype, spec.device)
        self._row_bytes = 2 * b * h * d * self._v.element_size()

    @staticmethod
    def storage_nbytes(spec: CacheSpec, key_layout: str) -> int:
        """What ``DenseRingCache(spec, key_layout)`` allocates."""
        b, h, c, d = spec.rows_shape
        el = torch.empty((), dtype=spec.dtype).element_size()
        keys = (
            b * h * c * d * el if key_layout == "rows" else _KEY_STORES[key_layout].nbytes_for((b, h), c, d, spec.dtype)
        )
        return keys + b * h * c * d * el

    @property
    def nbytes(self) -> int:
        return self._k.untyped_storage().nbytes() + self._v.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes one position occupies: a key and a value per KV head of the batch."""
        return self._row_bytes

    def _write_rows(self, start, keys, values):
        n = keys.shape[2]
        if self._keys is None:
            self._k[:, :, start : start + n] = keys
        else:
            self._keys.write(start, keys)
        self._v[:, :, start : start + n] = values

    def _read_rows(self, start, stop):
        if self._keys is None:
            return self._k[:, :, start:stop].clone(), self._v[:, :, start:stop].clone()
        return self._keys.read(start, stop), self._v[:, :, start:stop].clone()

    def _save_rows(self, start, stop):
        return self._read_rows(start, stop)

    def _restore_rows(self, start, saved):
        self._write_rows(start, *saved)


def dense_nbytes(spec: CacheSpec) -> int:
    """Keys plus values, dense, in the spec's dtype."""
    b, h, c, d = spec.rows_shape
    return 2 * b * h * c * d * torch.empty((), dtype=spec.dtype).element_size()
