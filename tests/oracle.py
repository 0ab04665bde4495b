"""An independent float64 oracle for the decode step, written from the spec alone.

It shares no code with ``backends/``: K/V repeated per query head, float64 everywhere.
"""

from __future__ import annotations

import numpy as np


def attention_ref(query, keys, values, num_query_heads: int, num_kv_heads: int) -> np.ndarray:
    """query (B, Hq, D); keys/values (B, Hkv, S, D) with S >= 1 -> output (B, Hq, D), float64.

    K/V are expanded to the query heads (``np.repeat``): the oracle favours plainness over
    speed, unlike the backends.
    """
    v = np.repeat(np.asarray(values, dtype=np.float64), num_query_heads // num_kv_heads, axis=1)
    return np.einsum("bhs,bhsd->bhd", attention_weights_ref(query, keys, num_query_heads, num_kv_heads), v)


def attention_weights_ref(query, keys, num_query_heads: int, num_kv_heads: int) -> np.ndarray:
    """query (B, Hq, D); keys (B, Hkv, S, D) -> softmax(q k^T / sqrt(D)) (B, Hq, S), float64.

    Query head ``h*G + g`` (G = Hq / Hkv) reads KV head ``h``; each row sums to 1.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.repeat(np.asarray(keys, dtype=np.float64), num_query_heads // num_kv_heads, axis=1)
    d = q.shape[-1]
    scores = np.einsum("bhd,bhsd->bhs", q, k) / np.sqrt(d)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights


def decode_step_ref(query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads):
    kc = np.concatenate([np.asarray(key_cache, np.float64), np.asarray(new_key, np.float64)[:, :, None]], axis=2)
    vc = np.concatenate([np.asarray(value_cache, np.float64), np.asarray(new_value, np.float64)[:, :, None]], axis=2)
    return {
        "output": attention_ref(query, kc, vc, num_query_heads, num_kv_heads),
        "new_key_cache": kc,
        "new_value_cache": vc,
    }


def attended_positions(policy: str, t: int, window: int = 0, sinks: int = 0) -> list[int]:
    """Positions the token at position t-1 attends to, straight from the table of
    docs/eviction.md ("What each policy keeps and attends")."""
    if policy == "none":
        return list(range(t))
    if policy in ("strict", "greedy"):
        return list(range(max(0, t - window), t))
    if policy == "sink":
        head = list(range(min(t, sinks)))
        tail = [p for p in range(max(0, t - window), t) if p >= sinks]
        return head + tail
    raise ValueError(policy)


def resident_length(policy: str, t: int, window: int = 0, capacity: int = 0, sinks: int = 0) -> int:
    """L(T): rows a layer keeps after ``t`` tokens, straight from docs/eviction.md (greedy's
    capacity 0 means the window)."""
    if policy == "none":
        return t
    if policy == "strict":
        return min(t, window)
    if policy == "sink":
        return min(t, sinks + window)
    if policy == "greedy":
        c = capacity or window
        if t <= c:
            return t
        g = c - window + 1
        return t - g * -(-(t - c) // g)
    raise ValueError(policy)


def resident_positions(policy: str, t: int, window: int = 0, sinks: int = 0, capacity: int = 0) -> list[int]:
    """Positions resident after t tokens, in position order (docs/eviction.md): the last
    ``resident_length`` positions, or under ``sink`` the sinks plus the window."""
    if policy == "sink":
        return attended_positions("sink", t, window, sinks)
    return list(range(t - resident_length(policy, t, window, capacity, sinks), t))
