"""The int8 cache's storage: what it holds per position, its byte counts, and how rows are coded.

Per (batch, KV head) and ring row, with O = ``int8_calibration.key_outlier_count(D)`` outlier
key channels and C = ``spec.capacity`` rows:

- key codes of the D - O coded channels: in blocks of 64 positions (``key_layout.KeyBlocks``,
  the compiled kernel's layout, nothing padded) for the native kernels, or transposed
  (``key_layout.KeyRows``: (B, Hkv, D - O, K), K = ``key_row_stride(C)``, padded to whole
  64-byte lines from C = 4032 on, under 1/64 more) for the torch kernels;
- key outlier channels: (B, Hkv, O, C) float16, kept as they are;
- value codes: (B, Hkv, C, D) int8, of the values rotated by the normalized Hadamard matrix H
  (``quant.hadamard_rotation``; symmetric and orthonormal, so ``x @ H @ H == x`` and the
  attention output is rotated back by the same H) unless the cache was made with
  ``rotate=False``;
- key and value scales: (B, Hkv, C) each, in the scale dtype (float16 or float32).

Codes are ``quant.quantize_int8``'s (absmax / 127 per row, in [-127, 127]): a key row's over
its D - O coded channels in stored order, a value row's over its D rotated channels. The
stored key channel order is (B, Hkv, D) int64, per head the D - O coded channels, then the O
outlier channels (``int8_calibration.choose_key_channels``; identity order until chosen).

One position of one KV head costs ``position_bytes``: D - O + 2 O + D + 2 * scale bytes, 264
at D = 128 with float16 scales against 512 in float16 (0.516x; 0.523x with float32 scales).
Beside the positions each KV head holds ``fixed_bytes``. ``int8_nbytes`` is what a cache
allocates and reserves; ``Int8Storage.nbytes`` counts the same from its tensors.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from quant import dequantize_int8, hadamard_rotation, quantize_int8

from . import host_memory, native
from .base import LayerCache
from .contract import CacheSpec
from .errors import InputValueError
from .int8_calibration import CALIBRATION_TOKENS, KEY_OUTLIERS, calibration_bytes, key_outlier_count
from .key_layout import KeyBlocks, KeyRows

__all__ = [
    "FLOAT16_MAX",
    "Int8Rows",
    "Int8Storage",
    "check_values",
    "fixed_bytes",
    "int8_nbytes",
    "position_bytes",
    "shared_rotation",
]


def position_bytes(head_dim: int, outliers: int, scale_bytes: int) -> int:
    """One position of one KV head: D - O key codes, O float16 key channels, D value codes and
    two scales."""
    return (head_dim - outliers) + 2 * outliers + head_dim + 2 * scale_bytes


def int8_nbytes(
    spec: CacheSpec, scale_dtype: torch.dtype, key_outliers: int = KEY_OUTLIERS, key_blocks: bool = True
) -> int:
    """What ``Int8Cache`` allocates: per position and KV head, D - O key codes, O float16 key
    outlier channels, D value codes and two scales, plus ``fixed_bytes`` per KV head; with
    ``key_blocks`` False (the torch kernels' transposed keys) the key rows' padding to 64 bytes
    once C >= 4032 (under 1/64 more). The Hadamard matrix is shared per D (``shared_rotation``),
    not a layer's."""
    b, h, c, d = spec.rows_shape
    o = key_outlier_count(d, key_outliers)
    scale = torch.empty((), dtype=scale_dtype).element_size()
    store = KeyBlocks if key_blocks else KeyRows
    keys = store.nbytes_for((b, h), c, d - o, torch.int8)
    return keys + b * h * (c * (position_bytes(d, o, scale) - (d - o)) + fixed_bytes(d, o, scale))


def fixed_bytes(d: int, o: int, scale: int) -> int:
    """Per KV head, beside the positions: the calibration rows of the first keys (while they
    are needed), the key channel order (int64) and the step's saved row (a position's bytes:
    a test build's copy of what the write overwrites, csrc/write.c)."""
    return calibration_bytes(d, o) + 8 * d + position_bytes(d, o, scale)


@functools.lru_cache(maxsize=None)
def shared_rotation(d: int, device: str) -> torch.Tensor:
    """``quant.hadamard_rotation(d)`` float32 on ``device``, one per (D, device) in the process,
    shared by every cache (read only): a D x D matrix per layer would cost more than the
    layer's cache at small capacities. Built on first use (the CPU caches use the native
    transform and never build it)."""
    return hadamard_rotation(d, device=device)


class Int8Rows(NamedTuple):
    """Positions as an int8 cache stores them (B, Hkv, n, ...), keys in the cache's channel
    order (``Int8Cache.key_channels``): the coded channels, then the float16 outlier ones."""

    key_codes: torch.Tensor  # (B, Hkv, n, D - O) int8
    value_codes: torch.Tensor  # (B, Hkv, n, D) int8, of the rotated values
    key_scales: torch.Tensor  # (B, Hkv, n) scale dtype
    value_scales: torch.Tensor  # (B, Hkv, n) scale dtype
    key_outliers: torch.Tensor  # (B, Hkv, n, O) float16


FLOAT16_MAX = torch.finfo(torch.float16).max


def check_values(name: str, t: torch.Tensor, limit: float = math.inf) -> None:
    """Refuses non-finite values, and |values| beyond ``limit`` (keys: any key channel may be
    kept in float16), before anything is written. One reduction when all is well (NaN
    propagates through aminmax); the message is worked out only for a refusal."""
    if not t.numel():
        return
    lo, hi = t.detach().aminmax()  # one pass, no |t| written (docs/design.md)
    lo, hi = float(lo), float(hi)
    if math.isfinite(lo) and math.isfinite(hi) and -lo <= limit and hi <= limit:
        return
    m = max(abs(lo), abs(hi))
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        raise InputValueError(
            f"{name}: {int((~finite).sum())} non-finite value(s) (NaN or inf) in shape {tuple(t.shape)}; "
            "the int8 cache cannot store them and nothing was written"
        )
    raise InputValueError(
        f"{name}: |values| up to {m:.4g}, beyond float16's {FLOAT16_MAX:.0f} that the int8 cache's "
        "outlier channels hold; nothing was written"
    )


class Int8Storage(LayerCache):
    """The tensors of one layer's int8 cache (the module docstring's layout) and the coding of
    rows into them and back; ``backends.int8.Int8Cache`` adds the outlier channels' choice, the
    step and the attention. Abstract: ``_save_rows``, ``_restore_rows`` and ``_attend`` are the
    cache's.

    ``_calibration`` (B, Hkv, CALIBRATION_TOKENS, D) float32 holds the first keys exactly while
    the outlier channels are not final, None once they are (or without outlier channels); its
    bytes stay reserved in ``nbytes`` either way.
    """

    def __init__(
        self,
        spec: CacheSpec,
        scale_dtype: torch.dtype,
        rotate: bool,
        key_outliers: int = KEY_OUTLIERS,
        key_blocks: bool = True,
    ):
        super().__init__(spec)
        self.scale_dtype = scale_dtype
        b, h, c, d = spec.rows_shape
        dev = spec.device
        # Values are stored rotated (``quant.hadamard_rotation``): H is symmetric and orthonormal,
        # so the output rotates back with the same H (``rotation``, shared per D).
        self._rotated = rotate
        # On the CPU the native library computes the same product as a fast Walsh-Hadamard
        # transform without torch's thread pool (whose idle spinning would then slow the kernel);
        # for every kernel alike, so that the stored codes never depend on the kernel chosen.
        self._hadamard = None
        if torch.device(dev).type == "cpu" and native.available()[0]:
            self._hadamard = native.load().hadamard
        self.outliers = o = key_outlier_count(d, key_outliers)
        # the key codes: blocks for the compiled kernel, transposed rows for torch's
        self._keys = (KeyBlocks if key_blocks else KeyRows)((b, h), c, d - o, torch.int8, dev)
        self._k = self._keys.data
        self._ko = host_memory.zeros((b, h, o, c), torch.float16, dev)
        self._v = host_memory.zeros((b, h, c, d), torch.int8, dev)
        self._ks = torch.zeros((b, h, c), dtype=scale_dtype, device=dev)
        self._vs = torch.zeros((b, h, c), dtype=scale_dtype, device=dev)
        # what the native step overwrites, kept until it has succeeded
        self._saved_row = torch.empty(
            b * h * position_bytes(d, o, self._ks.element_size()), dtype=torch.uint8, device=dev
        )
        # (B, Hkv, D): the coded key channels (ascending), then the outlier channels (ascending).
        self._set_key_channels(torch.arange(d, device=dev).expand(b, h, d).contiguous())
        # The first CALIBRATION_TOKENS keys, exact, until the outlier channels are final.
        self._calibration = torch.zeros((b, h, CALIBRATION_TOKENS, d), device=dev) if o else None

    # -- storage ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        s = self.spec
        return (
            self._k.untyped_storage().nbytes()
            + self._ko.nbytes
            + self._v.nbytes
            + self._ks.nbytes
            + self._vs.nbytes
            + s.batch_size * s.num_kv_heads * calibration_bytes(s.head_dim, self.outliers)
            + self._key_order.nbytes
            + self._saved_row.nbytes
        )

    @property
    def rotation(self) -> torch.Tensor | None:
        """The (D, D) float32 Hadamard matrix the values are stored rotated by (shared per D,
        read only), or None without rotation."""
        return shared_rotation(self.spec.head_dim, str(self.spec.device)) if self._rotated else None

    @property
    def row_bytes(self) -> int:
        """Bytes one position occupies (codes, outlier channels, scales; the fixed calibration
        rows are not a position's)."""
        s = self.spec
        return s.batch_size * s.num_kv_heads * position_bytes(s.head_dim, self.outliers, self._ks.element_size())

    @property
    def key_channels(self) -> torch.Tensor:
        """(B, Hkv, D) int64: the key channels in stored order, the D - O coded ones, then the
        O outlier channels kept in float16 (a copy)."""
        return self._key_order.clone()

    def _set_key_channels(self, order: torch.Tensor) -> None:
        self._key_order = order
        self._key_index = order.unsqueeze(2)  # (B, Hkv, 1, D), for gathers over positions

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Value rows (..., D) into (or, H being its own inverse, out of) the stored basis, float32."""
        x = x.to(torch.float32)
        if not self._rotated:
            return x
        if self._hadamard is not None and x.numel():
            return self._hadamard(x)
        return x @ self.rotation

    def _write_keys(self, start: int, keys: torch.Tensor) -> None:
        """(B, Hkv, n, D) keys at rows ``start ..``: codes of the coded channels, float16 of the
        outlier ones."""
        b, h, n, d = keys.shape
        o = self.outliers
        ordered = keys.to(torch.float32).gather(3, self._key_index.expand(b, h, n, d))
        kc, ks = quantize_int8(ordered[..., : d - o], scale_dtype=self.scale_dtype, name="key", check=False)
        self._keys.write(start, kc)
        self._ks[:, :, start : start + n] = ks
        self._ko[:, :, :, start : start + n] = ordered[..., d - o :].to(torch.float16).transpose(2, 3)

    def _write_rows(self, start, keys, values):
        vc, vs = quantize_int8(self._rotate(values), scale_dtype=self.scale_dtype, name="value", check=False)
        self._write_keys(start, keys)
        n = vc.shape[2]
        self._v[:, :, start : start + n] = vc
        self._vs[:, :, start : start + n] = vs

    def _write_codes(self, start: int, rows: Int8Rows) -> None:
        n = rows.key_codes.shape[2]
        self._keys.write(start, rows.key_codes)
        self._ko[:, :, :, start : start + n] = rows.key_outliers.transpose(2, 3)
        self._v[:, :, start : start + n] = rows.value_codes
        self._ks[:, :, start : start + n] = rows.key_scales
        self._vs[:, :, start : start + n] = rows.value_scales

    def _codes(self, start: int, stop: int) -> Int8Rows:
        return Int8Rows(
            self._keys.read(start, stop),
            self._v[:, :, start:stop],
            self._ks[:, :, start:stop],
            self._vs[:, :, start:stop],
            self._ko[:, :, :, start:stop].transpose(2, 3),
        )

    def _decode(self, rows: Int8Rows, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ordered = torch.cat(
            [dequantize_int8(rows.key_codes, rows.key_scales), rows.key_outliers.to(torch.float32)], dim=3
        )
        keys = torch.empty_like(ordered).scatter_(3, self._key_index.expand_as(ordered), ordered)
        values = self._rotate(dequantize_int8(rows.value_codes, rows.value_scales))
        return keys.to(dtype), values.to(dtype)

    def _read_rows(self, start, stop):
        return self._decode(self._codes(start, stop), self.spec.dtype)
