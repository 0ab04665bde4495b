"""Split-KV (flash-decoding) GQA decode attention in Triton, over a ring-layout cache.

Imported only by the ``cuda`` backend, lazily: this module imports ``triton`` at the top, so a
machine without it never loads it. It also runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is first imported) on CPU tensors, which is how
the kernels are tested on machines without a GPU.

Shapes (``N = B * Hkv``, ``G = Hq / Hkv``, ``C`` the cache's capacity in rows):

- ``query``: (B, Hq, D); query head ``h*G + g`` reads KV head ``h`` (README, "The operation"), so the
  G heads of KV head ``h`` are the rows ``g`` of ``query.view(N, G, D)[b*Hkv + h]``.
- ``keys``, ``values``: (N, C, D), rows contiguous in D (the cache's ``(B, Hkv, C, D)`` viewed).
- ``runs``: at most ``MAX_RUNS`` half-open row runs ``[start, stop)`` of the ring that hold the
  attended positions (sinks, then a window that may wrap). Attention does not depend on the
  order of the keys, so the kernel walks a *logical* index ``0 .. n-1`` over the concatenated
  runs and maps it to a physical row itself: a wrapped ring is never copied.

One program handles one KV head and one split (a contiguous chunk of the logical index): it
loads the G queries of that head together as a (G_PAD, D) block, so every key and value row is
read from memory once for all G heads, and keeps an online softmax (running max and sum, in
float32, base 2). Each split writes its normalized partial output and its log-sum-exp; a second
small kernel combines the splits. With a single split the first kernel writes the output itself.

The int8 variant reads symmetric int8 codes (N, C, D) and one float scale per (row, KV head),
(N, C): ``x ~= code * scale``. Codes are widened to the query's dtype (exact: |code| <= 127) for
the matrix products and the scales are applied to the float32 scores and probabilities, so the
result equals attention over the dequantized cache up to float16/bfloat16 rounding of the
probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "DEFAULT_CONFIG",
    "KernelConfig",
    "MAX_RUNS",
    "decode_attention",
    "decode_attention_int8",
    "plan_splits",
]

MAX_RUNS = 3
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
# tl.dot needs every dimension to be at least 16.
_MIN_DOT = 16
# Programs per streaming multiprocessor aimed at when choosing the number of splits, and the SM
# count assumed for CPU tensors (the interpreter), where it only sets how many splits are tested.
_CPU_SMS = 4


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. The defaults are a starting point; ``tests/bench/gpu_bench.py``
    measures a small sweep around them on a real GPU."""

    block_n: int = 64  # rows of K/V per loop iteration
    num_warps: int = 4
    num_stages: int = 3  # software pipelining depth of the K/V loads
    programs_per_sm: int = 2  # splits are chosen so that B*Hkv*splits ~= this many per SM
    min_blocks_per_split: int = 4  # a split streams at least this many blocks of block_n rows


DEFAULT_CONFIG = KernelConfig()


@triton.jit
def _row_of(idx, s0, l0, s1, l1, s2):
    # Logical index over the concatenated runs -> physical ring row.
    e1 = l0 + l1
    return tl.where(idx < l0, s0 + idx, tl.where(idx < e1, s1 + (idx - l0), s2 + (idx - e1)))


@triton.jit
def _mm(a, b, UPCAST: tl.constexpr):
    # Triton's CPU interpreter multiplies bfloat16 operands wrongly (as of 3.9); there, and only
    # there, the operands (already rounded to their GPU dtype) are widened first.
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b)
    return out


@triton.jit(do_not_specialize=["s0", "l0", "s1", "l1", "s2", "n_total"])
def _split_kernel(
    Q, K, V, KS, VS, O, LSE,
    s0, l0, s1, l1, s2, n_total, chunk,
    stride_qn, stride_qg,
    stride_kn, stride_kc,
    stride_vn, stride_vc,
    stride_ksn, stride_vsn,
    stride_on, stride_os, stride_og,
    stride_ln, stride_ls,
    qk_scale,
    G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_b = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D

    q = tl.load(
        Q + pid_n * stride_qn + offs_g[:, None] * stride_qg + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = K + pid_n * stride_kn
    v_base = V + pid_n * stride_vn

    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_total)
    num_blocks = tl.cdiv(hi - lo, BLOCK_N)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for i in range(0, num_blocks):
        idx = lo + i * BLOCK_N + offs_b
        n_mask = idx < hi
        row = _row_of(idx, s0, l0, s1, l1, s2)
        if D_PAD == D:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + row[:, None] * stride_kc + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_base + row[:, None] * stride_vc + offs_d[None, :], mask=kv_mask, other=0)
        if QUANT:
            ks = tl.load(KS + pid_n * stride_ksn + row, mask=n_mask, other=0.0).to(tl.float32)
            vs = tl.load(VS + pid_n * stride_vsn + row, mask=n_mask, other=0.0).to(tl.float32)
            # int8 codes are exact in float16/bfloat16. The interpreter (3.9) converts int8 to
            # bfloat16 wrongly, so there they go straight to float32 (as _mm would widen them).
            if UPCAST:
                kq = k.to(tl.float32)
                vq = v.to(tl.float32)
            else:
                kq = k.to(q.dtype)
                vq = v.to(q.dtype)
            qk = _mm(q, tl.trans(kq), UPCAST) * (ks * qk_scale)[None, :]
        else:
            qk = _mm(q, tl.trans(k), UPCAST) * qk_scale
        # Every block holds at least one valid row (lo < hi), so m_new is finite.
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            pv = _mm((p * vs[None, :]).to(q.dtype), vq, UPCAST)
        else:
            pv = _mm(p.to(v.dtype), v, UPCAST)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = O + pid_n * stride_on + pid_s * stride_os + offs_g[:, None] * stride_og + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if not DIRECT:
        tl.store(LSE + pid_n * stride_ln + pid_s * stride_ls + offs_g, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _combine_kernel(
    O_part, LSE, Out, num_splits,
    stride_on, stride_os, stride_og,
    stride_ln, stride_ls,
    G: tl.constexpr, D: tl.constexpr, SPLITS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    # One program per (KV head, group member) = one query head of the flat (B*Hq, D) output.
    pid = tl.program_id(0)
    n = pid // G
    g = pid % G
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < D
    lse = tl.load(LSE + n * stride_ln + offs_s * stride_ls + g, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = tl.load(
        O_part + n * stride_on + offs_s[:, None] * stride_os + g * stride_og + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    tl.store(Out + pid * D + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


# -- host side ------------------------------------------------------------------------------

_sm_counts: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def plan_splits(n_total: int, num_heads: int, num_sms: int, config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(num_splits, chunk)``: how the ``n_total`` attended rows are cut across programs.

    Aims at ``config.programs_per_sm * num_sms`` programs over the ``num_heads`` (= B*Hkv) KV
    heads, with at least ``config.min_blocks_per_split`` blocks per split; ``chunk`` is a
    multiple of the block size and no split is empty.
    """
    if n_total < 1:
        raise ValueError(f"nothing to attend to: {n_total} rows")
    blocks = triton.cdiv(n_total, config.block_n)
    wanted = triton.cdiv(config.programs_per_sm * num_sms, num_heads)
    splits = max(1, min(wanted, blocks // config.min_blocks_per_split, MAX_SPLITS))
    return _chunked(n_total, splits, config.block_n)


def _chunked(n_total: int, splits: int, block_n: int) -> tuple[int, int]:
    blocks = triton.cdiv(n_total, block_n)
    chunk = triton.cdiv(blocks, max(1, min(splits, blocks))) * block_n
    return triton.cdiv(n_total, chunk), chunk


def _normalize_runs(runs: Sequence[tuple[int, int]], capacity: int) -> tuple[list[int], int]:
    runs = [(int(a), int(b)) for a, b in runs if b > a]
    if len(runs) > MAX_RUNS:
        raise ValueError(f"runs: at most {MAX_RUNS} non-empty row runs, got {len(runs)}: {runs}")
    for a, b in runs:
        if a < 0 or b > capacity:
            raise ValueError(f"runs: run [{a}, {b}) lies outside the {capacity} cache rows")
    total = sum(b - a for a, b in runs)
    if total < 1:
        raise ValueError("runs: nothing to attend to (all runs empty)")
    runs += [(0, 0)] * (MAX_RUNS - len(runs))
    (s0, e0), (s1, e1), (s2, _) = runs
    return [s0, e0 - s0, s1, e1 - s1, s2], total


def _check_kv(name: str, t: torch.Tensor, n: int, d: int, query: torch.Tensor) -> None:
    if t.dim() != 3 or t.shape[0] != n or t.shape[2] != d:
        raise ValueError(f"{name}: expected shape (B*Hkv, C, D) = ({n}, C, {d}), got {tuple(t.shape)}")
    if t.stride(2) != 1:
        raise ValueError(f"{name}: rows must be contiguous in D (strides {t.stride()})")
    if t.device != query.device:
        raise ValueError(f"{name}: device {t.device} differs from query's {query.device}")


def _launch(query, keys, values, key_scales, value_scales, runs, num_kv_heads, scale, config, num_splits):
    b, hq, d = query.shape
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"query: {hq} heads is not a multiple of num_kv_heads={num_kv_heads}")
    g = hq // num_kv_heads
    n = b * num_kv_heads
    _check_kv("keys", keys, n, d, query)
    _check_kv("values", values, n, d, query)
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} differs from keys {tuple(keys.shape)}")
    run_args, total = _normalize_runs(runs, keys.shape[1])

    if num_splits is None:
        splits, chunk = plan_splits(total, n, _num_sms(query.device), config)
    else:
        splits, chunk = _chunked(total, num_splits, config.block_n)

    q = query.contiguous().view(n, g, d)
    out = torch.empty((b, hq, d), dtype=query.dtype, device=query.device)
    g_pad = max(_MIN_DOT, triton.next_power_of_2(g))
    d_pad = max(_MIN_DOT, triton.next_power_of_2(d))
    quant = key_scales is not None
    ks = key_scales if quant else keys
    vs = value_scales if quant else values
    qk_scale = (1.0 / math.sqrt(d) if scale is None else scale) * _LOG2E
    direct = splits == 1
    if direct:
        o_part, lse = out.view(n, 1, g, d), out  # lse is not written when DIRECT
    else:
        o_part = torch.empty((n, splits, g, d), dtype=torch.float32, device=query.device)
        lse = torch.empty((n, splits, g), dtype=torch.float32, device=query.device)
    _split_kernel[(n, splits)](
        q, keys, values, ks, vs, o_part, lse,
        *run_args, total, chunk,
        q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1),
        ks.stride(0), vs.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        qk_scale,
        G=g, D=d, G_PAD=g_pad, D_PAD=d_pad, BLOCK_N=config.block_n, QUANT=quant, DIRECT=direct,
        UPCAST=query.device.type != "cuda" and query.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        _combine_kernel[(n * g,)](
            o_part, lse, out, splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1),
            G=g, D=d, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), D_PAD=triton.next_power_of_2(d),
            num_warps=4 if d >= 128 else 1,
        )
    return out


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    *,
    num_kv_heads: int,
    scale: float | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    num_splits: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V over the rows in ``runs``; (B, Hq, D) in the query's dtype.

    ``query`` (B, Hq, D) float16/bfloat16 (float32 works too, with the GPU's tf32 products);
    ``keys``/``values`` (B*Hkv, C, D) in the query's dtype. ``scale`` defaults to 1/sqrt(D).
    ``num_splits`` overrides the split planner (tests use it to force several splits).
    """
    if keys.dtype != query.dtype or values.dtype != query.dtype:
        raise TypeError(f"keys/values dtype {keys.dtype}/{values.dtype} differs from query's {query.dtype}")
    return _launch(query, keys, values, None, None, runs, num_kv_heads, scale, config, num_splits)


def decode_attention_int8(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scales: torch.Tensor,
    value_codes: torch.Tensor,
    value_scales: torch.Tensor,
    runs: Sequence[tuple[int, int]],
    *,
    num_kv_heads: int,
    scale: float | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Like ``decode_attention`` over int8 caches: ``x[n, c] ~= codes[n, c] * scales[n, c]``.

    ``*_codes`` int8 (B*Hkv, C, D); ``*_scales`` float (B*Hkv, C) with unit stride along C.
    """
    for name, codes in (("key_codes", key_codes), ("value_codes", value_codes)):
        if codes.dtype != torch.int8:
            raise TypeError(f"{name}: expected int8, got {codes.dtype}")
    for name, s, codes in (("key_scales", key_scales, key_codes), ("value_scales", value_scales, value_codes)):
        if s.dim() != 2 or tuple(s.shape) != tuple(codes.shape[:2]) or s.stride(1) != 1:
            raise ValueError(f"{name}: expected shape (B*Hkv, C) = {tuple(codes.shape[:2])} with unit stride, got {tuple(s.shape)}")
        if not s.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float dtype, got {s.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"query: dtype {query.dtype} not supported")
    return _launch(query, key_codes, value_codes, key_scales, value_scales, runs, num_kv_heads, scale, config, num_splits)

