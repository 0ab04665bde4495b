"""The decode-step operation (README, "The operation"), stateless.

``gqa_decode_step`` takes the caches and returns them extended by one token; the stream caches
of the backends keep the same semantics without copying the cache each step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .attention import attend
from .validation import as_tensor, check_cache_tensors, check_heads, check_step_tensors

__all__ = ["gqa_decode_step", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs accumulate in float32; float32 and float64 in their own dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gqa_decode_step(
    query: Any,
    new_key: Any,
    new_value: Any,
    key_cache: Any,
    value_cache: Any,
    num_query_heads: int,
    num_kv_heads: int,
) -> dict[str, torch.Tensor]:
    """One GQA decode step.

    Args:
        query: (B, Hq, D); query head ``h*G + g`` reads KV head ``h`` (G = Hq / Hkv).
        new_key, new_value: (B, Hkv, D), the new token, placed at position S.
        key_cache, value_cache: (B, Hkv, S, D), oldest first; S may be 0.
        num_query_heads, num_kv_heads: Hq and Hkv.

    Returns:
        ``{"output": (B, Hq, D), "new_key_cache": (B, Hkv, S+1, D), "new_value_cache": ...}``,
        all in the inputs' dtype and on their device. Tensors, numpy arrays and nested lists are
        accepted (lists become float32).

    Raises:
        TypeError: non-floating data, mixed dtypes, a wrong argument type.
        ValueError: ranks, shapes or head counts that disagree (the message names the argument
            and the shapes it saw).
    """
    hq, hkv = check_heads(num_query_heads, num_kv_heads)
    query = as_tensor(query, "query")
    new_key = as_tensor(new_key, "new_key")
    new_value = as_tensor(new_value, "new_value")
    key_cache = as_tensor(key_cache, "key_cache")
    value_cache = as_tensor(value_cache, "value_cache")
    b, d = check_step_tensors(query, new_key, new_value, hq, hkv)
    check_cache_tensors(key_cache, value_cache, query, hkv)

    new_key_cache = torch.cat([key_cache, new_key.unsqueeze(2)], dim=2)
    new_value_cache = torch.cat([value_cache, new_value.unsqueeze(2)], dim=2)

    g = hq // hkv
    n = b * hkv
    cdtype = compute_dtype(query.dtype)
    q = query.reshape(n, g, d).to(cdtype) * (1.0 / math.sqrt(d))
    keys = new_key_cache.reshape(n, -1, d).transpose(1, 2)
    values = new_value_cache.reshape(n, -1, d)
    out = attend(q, [keys], [values])
    return {
        "output": out.reshape(b, hq, d).to(query.dtype),
        "new_key_cache": new_key_cache,
        "new_value_cache": new_value_cache,
    }
