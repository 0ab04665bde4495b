"""The grouped attention core shared by the stateless operation and the CPU caches.

Shapes use ``N = B * Hkv`` as the batch of the matrix products:

- ``q``: (N, G, D) in the compute dtype (float32, or float64 for float64 inputs), already multiplied by ``1 / sqrt(D)``; the G query heads that share
  a KV head sit together, so each cached key and value is read once for all of them (no
  ``repeat_interleave`` of K/V).
- key segments: (N, D, s) views (keys *transposed*: the product ``q @ K^T`` is then a plain
  row-major GEMM with the long sequence as its N dimension; docs/design.md says why).
- value segments: (N, s, D) views.

``attend_rows`` is the path for half-precision caches, whose keys are stored as rows (N, s, D):
torch's fused CPU attention kernel, which multiplies the half-precision operands with float32
accumulation, without widening the cache to float32 first (docs/design.md).

Several segments stand for the pieces of a ring buffer (a wrapped window, sinks plus window);
attention does not depend on the order of keys, so no segment is ever copied to make them
contiguous. Narrower segments are widened to the compute dtype in blocks of ``_BLOCK`` rows, so a
full-precision copy of the cache is never materialized.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["attend", "attend_rows", "scaled_query"]

_BLOCK = 2048


def _blocks(length: int):
    for start in range(0, length, _BLOCK):
        yield start, min(start + _BLOCK, length)


def attend(
    q: torch.Tensor,
    key_segments: Sequence[torch.Tensor],
    value_segments: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Softmax(q K^T) V over the concatenation of the segments; (N, G, D) in ``q``'s dtype."""
    n, g, d = q.shape
    # Each product gets its own (contiguous) result: a strided ``out=`` slice makes torch
    # split the batched product into per-matrix calls (docs/design.md).
    parts = []
    for keys in key_segments:
        if keys.dtype == q.dtype:
            parts.append(torch.bmm(q, keys))
        else:
            parts.extend(torch.bmm(q, keys[:, :, a:b].to(q.dtype)) for a, b in _blocks(keys.shape[-1]))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    # softmax subtracts the row maximum, so extreme scores do not overflow.
    probs = torch.softmax(scores, dim=-1)
    if len(value_segments) == 1 and value_segments[0].dtype == q.dtype:
        return torch.bmm(probs, value_segments[0])
    out = torch.zeros((n, g, d), dtype=q.dtype, device=q.device)
    offset = 0
    for values in value_segments:
        s = values.shape[1]
        if values.dtype == q.dtype:
            out.baddbmm_(probs[:, :, offset : offset + s], values)
        else:
            for a, b in _blocks(s):
                out.baddbmm_(probs[:, :, offset + a : offset + b], values[:, a:b].to(q.dtype))
        offset += s
    return out


def attend_rows(
    q: torch.Tensor,
    key_segments: Sequence[torch.Tensor],
    value_segments: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Softmax(scale * q K^T) V with keys as rows; (N, G, D) float32.

    ``q`` is (N, G, D) in the cache dtype, *not* pre-scaled (scaling a half-precision query
    would round it); key and value segments are (N, s, D) views in the same dtype. Torch's fused
    kernel (``_scaled_dot_product_flash_attention_for_cpu``) accumulates q.k in float32 and keeps
    the softmax in float32; only the probabilities are rounded to the cache dtype for the value
    product (itself accumulated in float32). Each segment yields its output and log-sum-exp; the
    segments are merged exactly by weighting with exp(lse_i - lse).
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs, lses = [], []
    for keys, values in zip(key_segments, value_segments):
        out, lse = flash(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=scale)
        outs.append(out[0])
        lses.append(lse[0])
    if len(outs) == 1:
        return outs[0].float()
    lse = torch.stack(lses)  # (segments, N, G)
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)
    total = torch.zeros(outs[0].shape, dtype=torch.float32)
    for out, w in zip(outs, weights):
        total.addcmul_(out.float(), w)
    return total


def scaled_query(query: torch.Tensor, num_kv_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, Hq, D) -> (B*Hkv, G, D) in ``dtype``, multiplied by 1/sqrt(D): the ``q`` above."""
    b, hq, d = query.shape
    return query.reshape(b * num_kv_heads, hq // num_kv_heads, d).to(dtype) * (1.0 / math.sqrt(d))
