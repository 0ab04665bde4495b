"""The int8 cache's raw codes in and out: the checks on imported codes and the snapshot state.

``Int8Cache.export_quantized`` / ``load_quantized`` move a cache's resident positions as
``Int8Rows`` exactly as stored (bit-exact round trip), and ``export_state`` / ``load_state``
wrap them in the dict that ``service.engine.snapshot`` serialises. This module holds what does not
depend on a cache's ring: joining rows, checking imported ones, and the state's keys.

The state (``encoding`` ``STATE_ENCODING``, "int8"), for a cache of B batch rows, Hkv KV heads, head width D, O
outlier channels after T tokens with L = ``policy.resident_length(T)`` resident positions, in
position order, oldest first:

- ``key`` (B, Hkv, L, D - O) int8 and ``key_scale`` (B, Hkv, L): the coded key channels;
- ``value`` (B, Hkv, L, D) int8 and ``value_scale`` (B, Hkv, L): the rotated values' codes;
- ``key_outliers`` (B, Hkv, L, O) float16: the outlier key channels;
- ``key_channels`` (B, Hkv, D) int64: the stored key channel order (``Int8Storage``);
- ``key_calibration`` (B, Hkv, min(T, CALIBRATION_TOKENS), D) float32, only while the outlier
  channels are not final: the first keys, exactly, so that a restored cache chooses its
  channels as the original would.

Scales are in the cache's scale dtype (float16 or float32); codes lie in [-127, 127].
"""

from __future__ import annotations

import torch

from .contract import CacheSpec
from .int8_calibration import CALIBRATION_TOKENS
from .int8_storage import Int8Rows
from .validation import dtype_name

__all__ = ["STATE_ENCODING", "check_quantized", "join_rows", "rows_from_state", "state_from_rows"]

# The ``encoding`` of an int8 cache's state (``LayerCache.state_encoding``).
STATE_ENCODING = "int8"


def join_rows(parts: list[Int8Rows]) -> Int8Rows:
    """Rows of several runs (each (B, Hkv, n_i, ...)) as one ``Int8Rows`` along the positions
    (a copy); ``parts`` is not empty."""
    return Int8Rows(*(torch.cat([p[i] for p in parts], dim=2) for i in range(len(Int8Rows._fields))))


def check_quantized(
    rows,
    key_channels,
    calibration,
    *,
    spec: CacheSpec,
    outliers: int,
    scale_dtype: torch.dtype,
    n: int,
    tokens_seen: int,
) -> Int8Rows:
    """Checks imported codes for a cache of ``spec`` with ``outliers`` outlier channels and
    ``scale_dtype`` scales that will have seen ``tokens_seen`` tokens, ``n`` of them resident:
    the module docstring's shapes and dtypes, codes in [-127, 127], scales finite and >= 0,
    outlier channels finite, ``key_channels`` a permutation of 0..D-1 per head, and
    ``calibration`` only below ``CALIBRATION_TOKENS`` tokens with outlier channels. Returns
    ``rows`` as an ``Int8Rows``; raises ``TypeError`` (a wrong type or dtype of a row tensor)
    or ``ValueError`` (anything else), prefixed "load_quantized:". Reads only.
    """
    b, h, d, o = spec.batch_size, spec.num_kv_heads, spec.head_dim, outliers
    if not isinstance(rows, tuple) or len(rows) != len(Int8Rows._fields):
        raise TypeError("load_quantized: rows must be an Int8Rows")
    rows = Int8Rows(*rows)
    shapes = {
        "key_codes": ((b, h, n, d - o), torch.int8),
        "value_codes": ((b, h, n, d), torch.int8),
        "key_scales": ((b, h, n), scale_dtype),
        "value_scales": ((b, h, n), scale_dtype),
        "key_outliers": ((b, h, n, o), torch.float16),
    }
    for name, (shape, dtype) in shapes.items():
        t = getattr(rows, name)
        label = name.replace("_", " ")
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(
                f"load_quantized: {label} must be a {dtype_name(dtype)} tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"load_quantized: {label} expected shape {shape} (L={n} at T={tokens_seen}), got {tuple(t.shape)}"
            )
        if not n:
            continue
        if dtype == torch.int8 and int(t.min()) < -127:
            raise ValueError(f"load_quantized: {label} hold -128, outside the symmetric range [-127, 127]")
        if name.endswith("scales") and not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"load_quantized: {label} must be finite and >= 0")
        if name == "key_outliers" and not bool(torch.isfinite(t).all()):
            raise ValueError("load_quantized: key outliers must be finite")
    if (
        not isinstance(key_channels, torch.Tensor)
        or key_channels.dtype != torch.int64
        or tuple(key_channels.shape) != (b, h, d)
    ):
        raise ValueError(f"load_quantized: key_channels must be int64 of shape {(b, h, d)}")
    if not torch.equal(key_channels.sort(dim=-1).values, torch.arange(d, device=key_channels.device).expand(b, h, d)):
        raise ValueError("load_quantized: key_channels must order each head's channels 0..D-1 once each")
    cal_len = min(tokens_seen, CALIBRATION_TOKENS)
    if calibration is not None:
        if not o or tokens_seen >= CALIBRATION_TOKENS:
            raise ValueError(
                f"load_quantized: calibration rows only come with T < {CALIBRATION_TOKENS} and outlier channels"
            )
        if (
            not isinstance(calibration, torch.Tensor)
            or calibration.dtype != torch.float32
            or tuple(calibration.shape) != (b, h, cal_len, d)
            or not bool(torch.isfinite(calibration).all())
        ):
            raise ValueError(f"load_quantized: calibration must be finite float32 of shape {(b, h, cal_len, d)}")
    return rows


def state_from_rows(rows: Int8Rows, key_channels: torch.Tensor, calibration: torch.Tensor | None) -> dict:
    """The snapshot state of the module docstring from exported rows, the channel order and
    the calibration keys (None once the channels are final)."""
    state = {
        "encoding": STATE_ENCODING,
        "key": rows.key_codes,
        "value": rows.value_codes,
        "key_scale": rows.key_scales,
        "value_scale": rows.value_scales,
        "key_outliers": rows.key_outliers,
        "key_channels": key_channels,
    }
    if calibration is not None:
        state["key_calibration"] = calibration
    return state


def rows_from_state(state: dict) -> tuple[Int8Rows, object, object]:
    """``(rows, key_channels, calibration or None)`` from a snapshot state, unchecked (see
    ``check_quantized``); ``KeyError`` names a missing entry."""
    rows = Int8Rows(state["key"], state["value"], state["key_scale"], state["value_scale"], state["key_outliers"])
    return rows, state["key_channels"], state.get("key_calibration")
