"""Input coercion and shape checks shared by the stateless operation and the stream caches.

Every error names the argument and the shapes it saw, so that a message can go straight back
to a client; each is an ``errors.InputValueError`` / ``InputTypeError`` (a ``ValueError`` /
``TypeError`` that the service maps to INVALID_ARGUMENT by type).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InputTypeError, InputValueError

__all__ = [
    "FLOAT_DTYPES",
    "as_tensor",
    "check_cache_tensors",
    "check_heads",
    "check_step_tensors",
    "dtype_name",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A torch tensor from a tensor, a numpy array or nested lists (lists become float32).

    Tensors keep their dtype and device. Non-floating data is refused with ``TypeError``.
    """
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, (list, tuple)):
        try:
            tensor = torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise InputTypeError(f"{name}: cannot build a float32 tensor from the nested list ({exc})") from None
    else:
        raise InputTypeError(f"{name}: expected a torch.Tensor, numpy array or nested list, got {type(value).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise InputTypeError(
            f"{name}: expected a floating dtype (float32, float16, bfloat16, float64), got {dtype_name(tensor.dtype)}"
        )
    return tensor


def check_heads(num_query_heads: Any, num_kv_heads: Any) -> tuple[int, int]:
    for label, v in (("num_query_heads", num_query_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InputTypeError(f"{label}: expected an int, got {type(v).__name__}")
        if v <= 0:
            raise InputValueError(f"{label}: must be positive, got {v}")
    if num_query_heads % num_kv_heads:
        raise InputValueError(
            f"num_query_heads ({num_query_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return int(num_query_heads), int(num_kv_heads)


def _rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise InputValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(t.shape)}")


def check_step_tensors(
    query: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    num_query_heads: int,
    num_kv_heads: int,
) -> tuple[int, int]:
    """Checks one step's tensors against each other and the head counts; returns (B, D)."""
    for name, t in (("query", query), ("new_key", new_key), ("new_value", new_value)):
        if t.layout is not torch.strided:
            raise InputTypeError(f"{name}: a {str(t.layout)[6:]} tensor; a step takes dense (strided) tensors")
    _rank(query, "query", 3, "(B, Hq, D)")
    _rank(new_key, "new_key", 3, "(B, Hkv, D)")
    _rank(new_value, "new_value", 3, "(B, Hkv, D)")
    b, hq, d = query.shape
    if hq != num_query_heads:
        raise InputValueError(
            f"query: has {hq} heads (shape {tuple(query.shape)}) but num_query_heads is {num_query_heads}"
        )
    for name, t in (("new_key", new_key), ("new_value", new_value)):
        if tuple(t.shape) != (b, num_kv_heads, d):
            raise InputValueError(
                f"{name}: expected shape (B, Hkv, D) = {(b, num_kv_heads, d)} from query {tuple(query.shape)} "
                f"and num_kv_heads={num_kv_heads}, got {tuple(t.shape)}"
            )
    _same_dtype_device(("query", query), ("new_key", new_key), ("new_value", new_value))
    return b, d


def _same_dtype_device(*named: tuple[str, torch.Tensor]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise InputTypeError(
                f"{name}: dtype {dtype_name(t.dtype)} differs from {first_name}'s {dtype_name(first.dtype)}"
            )
        if t.device != first.device:
            raise InputValueError(f"{name}: device {t.device} differs from {first_name}'s {first.device}")


def check_cache_tensors(
    key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor, num_kv_heads: int
) -> int:
    """Checks (B, Hkv, S, D) caches against a step's query; returns S."""
    _rank(key_cache, "key_cache", 4, "(B, Hkv, S, D)")
    _rank(value_cache, "value_cache", 4, "(B, Hkv, S, D)")
    b, _, d = query.shape
    kb, kh, s, kd = key_cache.shape
    if (kb, kh, kd) != (b, num_kv_heads, d):
        raise InputValueError(
            f"key_cache: expected shape (B, Hkv, S, D) with B={b}, Hkv={num_kv_heads}, D={d}, got {tuple(key_cache.shape)}"
        )
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise InputValueError(
            f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}"
        )
    _same_dtype_device(("query", query), ("key_cache", key_cache), ("value_cache", value_cache))
    return s
