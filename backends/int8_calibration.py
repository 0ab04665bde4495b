"""The int8 cache's key outlier channels: how many, which, and from which first keys.

A cache keeps O = ``key_outlier_count(D)`` key channels per (batch, KV head) in float16 beside
the int8 codes of the other D - O (LLM.int8()'s mixed-precision decomposition), so that the
codes' absmax is that of the ordinary channels. Which channels is chosen once per cache, from
its first keys, by ``choose_key_channels``:

- a prefill chooses from every resident key it stores;
- token by token, the first ``CALIBRATION_TOKENS`` keys are kept exactly (float32, the
  calibration rows) and the channels are chosen again after t = 1, 2, 4, 8 and 16 of them
  (``chooses_again``), each time re-encoding the keys stored so far from their exact values.

After ``CALIBRATION_TOKENS`` keys (or a prefill of at least that many) the choice is final and
the calibration rows are dropped. Pure functions of their arguments; the cache
(``backends.int8.Int8Cache``) holds the state.
"""

from __future__ import annotations

import torch

__all__ = [
    "CALIBRATION_TOKENS",
    "KEY_OUTLIERS",
    "calibration_bytes",
    "choose_key_channels",
    "chooses_again",
    "key_outlier_count",
]

# Key channels per KV head kept in float16 by default (at most one in 8: key_outlier_count),
# and how many first keys choose them.
KEY_OUTLIERS = 4
CALIBRATION_TOKENS = 16


def key_outlier_count(head_dim: int, key_outliers: int = KEY_OUTLIERS) -> int:
    """Key channels a cache keeps in float16: ``key_outliers``, at most one in 8."""
    return max(0, min(key_outliers, head_dim // 8))


def calibration_bytes(head_dim: int, outliers: int) -> int:
    """Bytes of one KV head's calibration rows: ``CALIBRATION_TOKENS`` float32 keys of
    ``head_dim`` channels, or 0 without outlier channels (nothing to choose). A cache reserves
    them for its whole life, also after calibration has dropped them."""
    return CALIBRATION_TOKENS * head_dim * 4 if outliers else 0


def chooses_again(t: int) -> bool:
    """Whether the channels are chosen again once ``t`` (1 <= t <= CALIBRATION_TOKENS) keys
    have been stepped in: at t = 1, 2, 4, 8 and 16."""
    return not t & (t - 1)


def choose_key_channels(keys: torch.Tensor, outliers: int) -> torch.Tensor:
    """The key channel order for (B, Hkv, n, D) keys (any float dtype, n >= 1): (B, Hkv, D)
    int64 on ``keys``' device, per head the D - O coded channels ascending, then the O =
    ``outliers`` channels of largest absmax over the n keys, ascending (ties: ``topk``'s)."""
    b, h, _, d = keys.shape
    o = outliers
    absmax = keys.to(torch.float32).abs().amax(dim=2)  # (B, Hkv, D)
    chosen = absmax.topk(o, dim=-1).indices.sort(dim=-1).values
    coded = torch.ones((b, h, d), dtype=torch.bool, device=keys.device).scatter_(2, chosen, False)
    rest = torch.arange(d, device=keys.device).expand(b, h, d)[coded].view(b, h, d - o)
    return torch.cat([rest, chosen], dim=2)
