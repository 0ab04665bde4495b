"""The int8 cache's torch kernels: attention over int8 codes and scales without dequantizing.

The fallback where the compiled kernel (``backends.native``) does not run, and the path on
devices other than the CPU. Both kernels compute, per flattened (batch, KV head) n and query
head g of its group, with the key scales folded into the scores and the value scales into the
weights::

    score[s] = (q . kcode[s]) * kscale[s] + bias[s]      out = sum_s (p[s] * vscale[s]) * vcode[s]

where p = softmax(score) over the attended rows and bias is the float score of the key
outlier channels (``int8_storage``). Shared arguments, all on one device:

- ``q`` (N, G, Dk) float32: the query already multiplied by 1/sqrt(D) and gathered into the
  cache's stored key channel order, its first Dk = D - O channels (the coded ones).
- ``k`` (N, Dk, C) int8: key codes transposed, one row per channel; the last dimension may be
  strided (padded rows), positions are read through ``runs`` only.
- ``v`` (N, C, D) int8: value codes (of the rotated values; the caller rotates the output back).
- ``ks``, ``vs`` (N, S) float32: the scales of the attended rows in run order
  (``gather_scales``), S = the sum of the runs' lengths.
- ``runs``: ``[(a, b), ...]`` ring rows ``[a, b)`` in attention order, non-empty, S > 0.
- ``bias`` (N, G, S) float32 or None: scores to add before the softmax.

Both return (N, G, D) float32 and write nothing into the cache. ``attend_int_mm`` needs
``torch._int_mm`` (CPU and CUDA builds of recent torch).
"""

from __future__ import annotations

import torch

from quant import quantize_int8_residual

__all__ = ["BLOCK", "PIECES", "attend_blocks", "attend_int_mm", "gather_scales", "has_int_mm"]

# Pieces the float operand of an int8 product is split into: 3 reach float32's resolution of
# the row's absmax (each piece shrinks the error ~254x), 2 would leave ~1e-5 relative.
PIECES = 3
# Positions widened to float32 at a time by ``attend_blocks`` (its workspace: BLOCK * (Dk + D)
# floats per KV head, small enough to stay in cache).
BLOCK = 1024
# int32 sums of int8 products are exact while a product runs over at most this many rows
# (127 * 127 * rows < 2**31); longer runs are cut into chunks accumulated in float32.
_INT32_SAFE_ROWS = 65536


def has_int_mm() -> bool:
    """Whether this torch has ``torch._int_mm`` (int8 x int8 -> int32), which ``attend_int_mm``
    needs."""
    return hasattr(torch, "_int_mm")


def _chunks(a: int, b: int, size: int):
    for start in range(a, b, size):
        yield start, min(start + size, b)


def gather_scales(scales: torch.Tensor, runs) -> torch.Tensor:
    """(N, C) scales -> those of the attended rows in run order, (N, S) float32 (a view when
    there is one run and ``scales`` is already float32)."""
    if len(runs) == 1:
        a, b = runs[0]
        return scales[:, a:b].to(torch.float32)
    return torch.cat([scales[:, a:b] for a, b in runs], dim=1).to(torch.float32)


def _mixer(scales: torch.Tensor) -> torch.Tensor:
    """(P, N, G) piece scales -> (N, G, P*G) matrices that sum the pieces of each row back."""
    p, n, g = scales.shape
    eye = torch.eye(g, dtype=torch.float32, device=scales.device)
    return (scales.permute(1, 2, 0).unsqueeze(-1) * eye.view(1, g, 1, g)).reshape(n, g, p * g)


def attend_int_mm(q, k, v, ks, vs, runs, bias=None):
    """Scores and weighted sums as exact int8 products (arguments: the module docstring).

    The float operand of each product (the query; the weights ``p * vscale``) is split into
    ``PIECES`` int8 pieces, each quantizing what the previous left
    (``quant.quantize_int8_residual``), so it is reproduced to float32 resolution; each product
    is ``torch._int_mm`` read straight from the cache, its int32 sums exact.

    One KV head at a time, so that the int32 products, their float32 sums and the weights'
    pieces (about 26 * G * S bytes) stay in the core's cache between the passes.
    """
    n, g, dk = q.shape
    d = v.shape[2]
    total = ks.shape[1]
    qc, qsc = quantize_int8_residual(q, PIECES, check=False)  # (P, N, G, Dk), (P, N, G)
    qc = qc.transpose(0, 1).reshape(n, PIECES * g, dk)
    qmix = _mixer(qsc)
    scores = torch.empty((n, g, total), dtype=torch.float32, device=q.device)
    for h in range(n):
        if len(runs) == 1:
            a, b = runs[0]
            iscores = torch._int_mm(qc[h], k[h, :, a:b])
        else:  # a product over D: 127 * 127 * D stays far inside int32
            iscores = torch.cat([torch._int_mm(qc[h], k[h, :, a:b]) for a, b in runs], dim=1)
        torch.mm(qmix[h], iscores.to(torch.float32), out=scores[h])
    scores.mul_(ks.unsqueeze(1))
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, dim=-1).mul_(vs.unsqueeze(1))
    out = torch.empty((n, g, d), dtype=torch.float32, device=q.device)
    for h in range(n):
        wc, wsc = quantize_int8_residual(weights[h], PIECES, check=False)  # (P, G, S), (P, G)
        wc = wc.view(PIECES * g, total)
        acc = None
        off = 0
        for a, b in runs:
            for c0, c1 in _chunks(a, b, _INT32_SAFE_ROWS):
                w = c1 - c0
                part = torch._int_mm(wc[:, off : off + w], v[h, c0:c1]).to(torch.float32)
                acc = part if acc is None else acc.add_(part)
                off += w
        torch.mm(_mixer(wsc.unsqueeze(1))[0], acc, out=out[h])
    return out


def attend_blocks(q, k, v, ks, vs, runs, bias=None):
    """The same sums with codes widened to float32 ``BLOCK`` positions at a time in a reused
    workspace, then float matrix products (arguments: the module docstring)."""
    n, g, dk = q.shape
    d = v.shape[2]
    total = ks.shape[1]
    scores = torch.empty((n, g, total), dtype=torch.float32, device=q.device)
    work_k = torch.empty((n, dk, min(BLOCK, total)), dtype=torch.float32, device=q.device)
    work_v = torch.empty((n, min(BLOCK, total), d), dtype=torch.float32, device=q.device)
    off = 0
    for a, b in runs:
        for c0, c1 in _chunks(a, b, BLOCK):
            w = c1 - c0
            wk = work_k[:, :, :w]
            wk.copy_(k[:, :, c0:c1])
            torch.bmm(q, wk, out=scores[:, :, off : off + w])
            off += w
    scores.mul_(ks.unsqueeze(1))
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, dim=-1).mul_(vs.unsqueeze(1))
    out = torch.zeros((n, g, d), dtype=torch.float32, device=q.device)
    off = 0
    for a, b in runs:
        for c0, c1 in _chunks(a, b, BLOCK):
            w = c1 - c0
            wv = work_v[:, :w]
            wv.copy_(v[:, c0:c1])
            out.baddbmm_(weights[:, :, off : off + w], wv)
            off += w
    return out
