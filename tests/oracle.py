"""An independent float64 oracle for the decode step, written from the spec alone.

It shares no code with ``backends/``: plain loops over heads, ``repeat`` of K/V per query
head, float64 everywhere.
"""

from __future__ import annotations

import numpy as np


def attention_ref(query, keys, values, num_query_heads: int, num_kv_heads: int) -> np.ndarray:
    """query (B, Hq, D); keys/values (B, Hkv, S, D) with S >= 1 -> output (B, Hq, D), float64."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    b, hq, d = q.shape
    g = num_query_heads // num_kv_heads
    out = np.empty((b, hq, d))
    for bi in range(b):
        for head in range(hq):
            kv = head // g
            scores = k[bi, kv] @ q[bi, head] / np.sqrt(d)
            scores -= scores.max()
            w = np.exp(scores)
            w /= w.sum()
            out[bi, head] = w @ v[bi, kv]
    return out


def decode_step_ref(query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads):
    kc = np.concatenate([np.asarray(key_cache, np.float64), np.asarray(new_key, np.float64)[:, :, None]], axis=2)
    vc = np.concatenate([np.asarray(value_cache, np.float64), np.asarray(new_value, np.float64)[:, :, None]], axis=2)
    return {
        "output": attention_ref(query, kc, vc, num_query_heads, num_kv_heads),
        "new_key_cache": kc,
        "new_value_cache": vc,
    }


def attended_positions(policy: str, t: int, window: int = 0, sinks: int = 0) -> list[int]:
    """Positions the token at position t-1 attends to, straight from EVICTION.md's table."""
    if policy == "none":
        return list(range(t))
    if policy in ("strict", "greedy"):
        return list(range(max(0, t - window), t))
    if policy == "sink":
        head = list(range(min(t, sinks)))
        tail = [p for p in range(max(0, t - window), t) if p >= sinks]
        return head + tail
    raise ValueError(policy)
