"""Split-KV (flash-decoding) GQA decode attention in Triton, over a ring-layout cache.

Imported only by the ``cuda`` backend, lazily: this module imports ``triton`` at the top, so a
machine without it never loads it. It also runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is first imported) on CPU tensors, which is how
the kernels are tested on machines without a GPU.

Shapes (``N = B * Hkv``, ``G = Hq / Hkv``, ``C`` the cache's capacity in rows):

- ``query``: (B, Hq, D); query head ``h*G + g`` reads KV head ``h`` (README, "The operation"),
  so the G heads of KV head ``h`` are the rows ``g`` of ``query.view(N, G, D)[b*Hkv + h]``.
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

``decode_batched`` is the same loop for the steps of many caches in one launch (the cuda
cache's step and ``step_many``): one packed int64 descriptor per cache (base addresses, runs,
lengths), a fixed split size in rows, and the last split of a KV head to finish merging all of
its splits in split order, so that a step's output does not depend on its batch (see the
comment above it).

The int8 variant reads symmetric int8 codes (N, C, D) and one float scale per (row, KV head),
(N, C): ``x ~= code * scale``. Codes are widened to the query's dtype (exact: |code| <= 127) for
the matrix products and the scales are applied to the float32 scores and probabilities, so the
result equals attention over the dequantized cache up to float16/bfloat16 rounding of the
probabilities.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = [
    "BatchedStep",
    "DEFAULT_CONFIG",
    "KernelConfig",
    "MAX_RUNS",
    "decode_attention",
    "decode_attention_int8",
    "decode_batched",
    "group_key",
    "plan_splits",
    "restore_rows",
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
    # decode_batched (the cuda cache's step): every KV head's attended rows are cut into splits
    # of this many rows, whatever the batch, so a step's output does not depend on its batch.
    split_tokens: int = 512


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
    Q,
    K,
    V,
    KS,
    VS,
    Out,
    LSE,
    s0,
    l0,
    s1,
    l1,
    s2,
    n_total,
    chunk,
    stride_qn,
    stride_qg,
    stride_kn,
    stride_kc,
    stride_vn,
    stride_vc,
    stride_ksn,
    stride_vsn,
    stride_on,
    stride_os,
    stride_og,
    stride_ln,
    stride_ls,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
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
    o_ptrs = Out + pid_n * stride_on + pid_s * stride_os + offs_g[:, None] * stride_og + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if not DIRECT:
        tl.store(LSE + pid_n * stride_ln + pid_s * stride_ls + offs_g, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _combine_kernel(
    O_part,
    LSE,
    Out,
    num_splits,
    stride_on,
    stride_os,
    stride_og,
    stride_ln,
    stride_ls,
    G: tl.constexpr,
    D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
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


def _check_launch(query, keys, values, runs, num_kv_heads) -> tuple[int, int, list[int], int]:
    """Refuses tensors ``_launch`` cannot read; returns N = B*Hkv, G, the run arguments, the total."""
    b, hq, d = query.shape
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"query: {hq} heads is not a multiple of num_kv_heads={num_kv_heads}")
    n = b * num_kv_heads
    _check_kv("keys", keys, n, d, query)
    _check_kv("values", values, n, d, query)
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} differs from keys {tuple(keys.shape)}")
    run_args, total = _normalize_runs(runs, keys.shape[1])
    return n, hq // num_kv_heads, run_args, total


def _launch(query, keys, values, key_scales, value_scales, runs, num_kv_heads, scale, config, num_splits):
    b, hq, d = query.shape
    n, g, run_args, total = _check_launch(query, keys, values, runs, num_kv_heads)
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
        q,
        keys,
        values,
        ks,
        vs,
        o_part,
        lse,
        *run_args,
        total,
        chunk,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        ks.stride(0),
        vs.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        qk_scale,
        G=g,
        D=d,
        G_PAD=g_pad,
        D_PAD=d_pad,
        BLOCK_N=config.block_n,
        QUANT=quant,
        DIRECT=direct,
        UPCAST=query.device.type != "cuda" and query.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct:
        _combine(o_part, lse, out, splits, n, g, d)
    return out


def _combine(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int, n: int, g: int, d: int) -> None:
    """Merges the ``splits`` partial outputs of each of the N*G query rows into ``out`` by
    log-sum-exp."""
    _combine_kernel[(n * g,)](
        o_part,
        lse,
        out,
        splits,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        G=g,
        D=d,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        D_PAD=triton.next_power_of_2(d),
        num_warps=4 if d >= 128 else 1,
    )


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
            raise ValueError(
                f"{name}: expected shape (B*Hkv, C) = {tuple(codes.shape[:2])} with unit stride, got {tuple(s.shape)}"
            )
        if not s.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float dtype, got {s.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"query: dtype {query.dtype} not supported")
    return _launch(
        query, key_codes, value_codes, key_scales, value_scales, runs, num_kv_heads, scale, config, num_splits
    )


# -- the batched step: many caches in one launch ------------------------------------------------
#
# A group of caches with the same dtype, head width D and group size G is described by one packed
# int64 tensor (copied to the device once per call): a row of ``_DESC_W`` fields per cache, then
# a work table of (cache, KV head, split) triples, one per program, then zeroed split counters,
# one per (cache, KV head). Each program attends over one split of ``split_tokens`` logical rows
# of one KV head; a head with one split writes its output directly, the splits of a longer head
# write float32 partials and the last of them to finish (an atomic counter) merges them all by
# log-sum-exp in split order. Neither the number of splits of a cache nor the order of the merge
# depends on the other caches of the launch, so a step's output is bit-identical alone or in any
# batch. Row writes (and the saved copies of the rows they overwrite) are a second small launch.

# Descriptor fields (int64, one row per cache), in this order: the query's, keys' and values'
# base addresses, the capacity C (rows per KV head), the runs (s0, l0, s1, l1, s2) and their
# total, the split size and the number of splits, the output's element offset, the first
# partial's index, the first counter's index, the ring row written, the new key's and value's
# base addresses, the first saved row's index.
_DESC_FIELDS = (
    "q",
    "k",
    "v",
    "cap",
    "s0",
    "l0",
    "s1",
    "l1",
    "s2",
    "total",
    "chunk",
    "splits",
    "out",
    "part",
    "count",
    "row",
    "new_k",
    "new_v",
    "saved",
)
_F_Q, _F_K, _F_V, _F_CAP, _F_S0, _F_L0, _F_S1, _F_L1, _F_S2, _F_TOTAL = (tl.constexpr(i) for i in range(10))
_F_CHUNK, _F_SPLITS, _F_OUT, _F_PART, _F_COUNT, _F_ROW, _F_NEWK, _F_NEWV, _F_SAVED = (
    tl.constexpr(i) for i in range(10, 19)
)
_DESC_W = len(_DESC_FIELDS)


@triton.jit
def _field(d, F: tl.constexpr):
    return tl.load(d + F)


@triton.jit
def _as_ptr(addr, ty):
    # Every address in a descriptor is 16-byte aligned (the host checks or copies); saying so
    # lets the compiler vectorize the loads (a hint on the integer is lost in the cast).
    return tl.multiple_of(addr.to(tl.pointer_type(ty)), 16)


@triton.jit
def _batched_kernel(
    DESC,
    WORK,
    COUNT,
    PART,
    LSE,
    OUT,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DESC_W: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.load(WORK + pid * 3)
    n = tl.load(WORK + pid * 3 + 1)
    s = tl.load(WORK + pid * 3 + 2)
    d = DESC + c * DESC_W
    ty = OUT.dtype.element_ty
    cap = _field(d, _F_CAP)
    q_ptr = _as_ptr(_field(d, _F_Q), ty) + n * (G * D)
    k_ptr = _as_ptr(_field(d, _F_K), ty) + n * cap * D
    v_ptr = _as_ptr(_field(d, _F_V), ty) + n * cap * D
    s0 = _field(d, _F_S0).to(tl.int32)
    l0 = _field(d, _F_L0).to(tl.int32)
    s1 = _field(d, _F_S1).to(tl.int32)
    l1 = _field(d, _F_L1).to(tl.int32)
    s2 = _field(d, _F_S2).to(tl.int32)
    total = _field(d, _F_TOTAL).to(tl.int32)
    chunk = _field(d, _F_CHUNK).to(tl.int32)
    splits = _field(d, _F_SPLITS)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_b = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    q = tl.load(q_ptr + offs_g[:, None] * D + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    lo = s.to(tl.int32) * chunk
    hi = tl.minimum(lo + chunk, total)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for i in range(0, tl.cdiv(hi - lo, BLOCK_N)):
        idx = lo + i * BLOCK_N + offs_b
        n_mask = idx < hi
        row = _row_of(idx, s0, l0, s1, l1, s2)
        if D_PAD == D:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0)
        qk = _mm(q, tl.trans(k), UPCAST) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(ty), v, UPCAST)
        m_i = m_new

    out_ptrs = OUT + _field(d, _F_OUT) + (n * G + offs_g[:, None]) * D + offs_d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if splits == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(ty), mask=out_mask)
    else:
        # Partials hold the G real rows only: (split, G, D) float32 and (split, G) log-sum-exps.
        first = _field(d, _F_PART) + n * splits  # this head's first partial
        part = (first + s) * G
        tl.store(PART + (part + offs_g[:, None]) * D + offs_d[None, :], acc / l_i[:, None], mask=out_mask)
        tl.store(LSE + part + offs_g, m_i + tl.log2(l_i), mask=g_mask)
        # Every thread's partial is stored before the counter moves; the last split to arrive
        # reads them all (acquire), whatever order the splits ran in.
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNT + _field(d, _F_COUNT) + n, 1, sem="acq_rel")
        if arrived == splits - 1:
            # Padding rows read 0 (finite weights, zero partials) and are never stored.
            m = tl.full([G_PAD], float("-inf"), tl.float32)
            for j in range(0, splits):
                lse = tl.load(LSE + (first + j) * G + offs_g, mask=g_mask, other=0.0, cache_modifier=".cg")
                m = tl.maximum(m, lse)
            num = tl.zeros([G_PAD, D_PAD], tl.float32)
            den = tl.zeros([G_PAD], tl.float32)
            for j in range(0, splits):  # in split order, whichever split merges
                lse = tl.load(LSE + (first + j) * G + offs_g, mask=g_mask, other=0.0, cache_modifier=".cg")
                w = tl.exp2(lse - m)
                o = tl.load(
                    PART + ((first + j) * G + offs_g[:, None]) * D + offs_d[None, :],
                    mask=out_mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                num += w[:, None] * o
                den += w
            tl.store(out_ptrs, (num / den[:, None]).to(ty), mask=out_mask)


@triton.jit
def _write_rows_kernel(DESC, WORK, SAVED, D: tl.constexpr, D_PAD: tl.constexpr, DESC_W: tl.constexpr):
    # One program per (cache, KV head): saves the ring row the step overwrites, then writes it.
    pid = tl.program_id(0)
    c = tl.load(WORK + pid * 2)
    n = tl.load(WORK + pid * 2 + 1)
    d = DESC + c * DESC_W
    ty = SAVED.dtype.element_ty
    offs = tl.arange(0, D_PAD)
    mask = offs < D
    at = (n * _field(d, _F_CAP) + _field(d, _F_ROW)) * D + offs
    k_ptr = _as_ptr(_field(d, _F_K), ty) + at
    v_ptr = _as_ptr(_field(d, _F_V), ty) + at
    saved = SAVED + (_field(d, _F_SAVED) + n) * (2 * D) + offs
    tl.store(saved, tl.load(k_ptr, mask=mask), mask=mask)
    tl.store(saved + D, tl.load(v_ptr, mask=mask), mask=mask)
    tl.store(k_ptr, tl.load(_as_ptr(_field(d, _F_NEWK), ty) + n * D + offs, mask=mask), mask=mask)
    tl.store(v_ptr, tl.load(_as_ptr(_field(d, _F_NEWV), ty) + n * D + offs, mask=mask), mask=mask)


class BatchedStep(NamedTuple):
    """One cache's step in ``decode_batched``.

    ``query`` (B, Hq, D); ``keys``/``values`` the cache's storage viewed (B*Hkv, C, D),
    contiguous, 16-byte aligned, in the query's dtype; ``runs`` at most ``MAX_RUNS`` row runs
    holding the attended positions (the new token's row included); ``row``: the ring row the
    step's token goes to, with ``new_key``/``new_value`` (B, Hkv, D), or -1 for a step that
    writes nothing (its rows already stored).
    """

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    runs: Sequence[tuple[int, int]]
    num_kv_heads: int
    row: int = -1
    new_key: torch.Tensor | None = None
    new_value: torch.Tensor | None = None


def group_key(query: torch.Tensor, num_kv_heads: int) -> tuple:
    """Steps with equal keys can share one ``decode_batched`` launch."""
    return (query.device, query.dtype, query.shape[-1], query.shape[1] // num_kv_heads)


def _check_batched(step: BatchedStep, key: tuple) -> tuple[list[int], int]:
    """Refuses a step that does not fit the group (``key``) or whose tensors the kernel cannot
    read; returns its run arguments and total."""
    q, k, v = step.query, step.keys, step.values
    if q.dim() != 3 or step.num_kv_heads < 1 or q.shape[1] % step.num_kv_heads:
        raise ValueError(f"query: shape {tuple(q.shape)} does not split into {step.num_kv_heads} KV heads")
    if group_key(q, step.num_kv_heads) != key:
        raise ValueError(f"step (device, dtype, D, G) {group_key(q, step.num_kv_heads)} differs from the group's {key}")
    n, d = q.shape[0] * step.num_kv_heads, q.shape[2]
    for name, t in (("keys", k), ("values", v)):
        _check_kv(name, t, n, d, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from the query's {q.dtype}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name}: the cache's storage must be contiguous and 16-byte aligned")
    if v.shape != k.shape:
        raise ValueError(f"values: shape {tuple(v.shape)} differs from keys {tuple(k.shape)}")
    if step.row >= 0:
        if step.row >= k.shape[1]:
            raise ValueError(f"row {step.row} lies outside the {k.shape[1]} cache rows")
        for name, t in (("new_key", step.new_key), ("new_value", step.new_value)):
            if t is None or t.numel() != n * d or t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name}: expected {n * d} elements of {q.dtype} on {q.device}")
    return _normalize_runs(step.runs, k.shape[1])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (a copy only where it is not: a request's
    tensors may be views at any offset of its bytes)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)  # a new allocation: aligned


class _Layout(NamedTuple):
    """Per cache of a ``decode_batched`` launch (int64 arrays, one entry a step): its programs'
    sizes and where its slices of the launch's flat buffers start (offsets in those buffers'
    units: output elements, partial-output rows, split counters, saved rows)."""

    heads: np.ndarray  # B*Hkv
    totals: np.ndarray  # attended rows
    splits: np.ndarray  # splits of ``chunk`` rows
    writes: np.ndarray  # bool: the step writes its row
    out_off: np.ndarray
    part_n: np.ndarray  # partial-output rows: 0 for a step in one split (it writes ``out`` directly)
    part_off: np.ndarray
    count_n: np.ndarray  # split counters: 0 for a step in one split
    count_off: np.ndarray
    saved_n: np.ndarray  # saved rows: 0 for a step that writes nothing
    saved_off: np.ndarray


def _layout(steps: Sequence[BatchedStep], runs: list[tuple[list[int], int]], chunk: int, g: int, d: int) -> _Layout:
    heads = np.array([s.query.shape[0] * s.num_kv_heads for s in steps], dtype=np.int64)
    totals = np.array([t for _, t in runs], dtype=np.int64)
    splits = -(-totals // chunk)
    writes = np.array([s.row >= 0 for s in steps])
    many = splits > 1
    part_n = np.where(many, heads * splits, 0)
    count_n = np.where(many, heads, 0)
    saved_n = np.where(writes, heads, 0)

    def starts(sizes: np.ndarray) -> np.ndarray:
        return np.cumsum(sizes) - sizes

    return _Layout(
        heads, totals, splits, writes, starts(heads * g * d), part_n, starts(part_n), count_n, starts(count_n),
        saved_n, starts(saved_n),
    )  # fmt: skip


def _descriptors(steps, runs, lay: _Layout, chunk: int, queries, new_k, new_v) -> np.ndarray:
    """One row of ``_DESC_FIELDS`` a step: the addresses and numbers its programs read."""
    run_args = np.array([r for r, _ in runs], dtype=np.int64).reshape(len(steps), 5)
    columns = dict(
        q=[t.data_ptr() for t in queries],
        k=[st.keys.data_ptr() for st in steps],
        v=[st.values.data_ptr() for st in steps],
        cap=[st.keys.shape[1] for st in steps],
        s0=run_args[:, 0],
        l0=run_args[:, 1],
        s1=run_args[:, 2],
        l1=run_args[:, 3],
        s2=run_args[:, 4],
        total=lay.totals,
        chunk=chunk,
        splits=lay.splits,
        out=lay.out_off,
        part=lay.part_off,
        count=lay.count_off,
        row=[st.row for st in steps],
        new_k=[t.data_ptr() if t is not None else 0 for t in new_k],
        new_v=[t.data_ptr() if t is not None else 0 for t in new_v],
        saved=lay.saved_off,
    )
    desc = np.zeros((len(steps), _DESC_W), dtype=np.int64)
    for name, values in columns.items():
        desc[:, _DESC_FIELDS.index(name)] = values
    return desc


def _work_lists(lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """(cache, head, split) per attention program; (cache, head) per row-writing program."""
    heads, splits, writes = lay.heads, lay.splits, lay.writes
    per = heads * splits
    cache_of = np.repeat(np.arange(len(heads)), per)
    local = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    split_of = np.repeat(splits, per)
    work = np.stack([cache_of, local // split_of, local % split_of], 1)
    w_heads = heads[writes]
    w_cache = np.repeat(np.flatnonzero(writes), w_heads)
    w_local = np.arange(w_heads.sum()) - np.repeat(np.cumsum(w_heads) - w_heads, w_heads)
    return work, np.stack([w_cache, w_local], 1)


def _packed(desc, work, write_work, n_counts: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The launch's int64 tables (descriptors, attention work, write work, zeroed split
    counters) in one host buffer, copied to the device once."""
    packed_np = np.concatenate([desc.ravel(), work.ravel(), write_work.ravel(), np.zeros(n_counts, np.int64)])
    packed = torch.from_numpy(packed_np)
    if device.type != "cpu":
        packed = packed.pin_memory().to(device, non_blocking=True)
    a, b, c = desc.size, desc.size + work.size, desc.size + work.size + write_work.size
    return packed[:a], packed[a:b], packed[b:c], packed[c:]


def decode_batched(
    steps: Sequence[BatchedStep],
    *,
    config: KernelConfig = DEFAULT_CONFIG,
    scale: float | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The steps of many caches: their rows written, then attention, in two launches.

    Every step must share the device, dtype, head width D and group size G (``group_key``);
    batch sizes, KV heads, capacities, runs and lengths are free. Each KV head is cut along its
    attended rows into splits of ``config.split_tokens`` rows and merged in split order, so a
    step's output is bit-identical whatever else is in the launch. Returns the (B, Hq, D)
    outputs, slot for slot, and for each writing step the saved rows it overwrote, (B*Hkv, 2, D)
    (keys then values), for ``restore`` if anything fails later. Everything is checked before
    anything is written (``ValueError``/``TypeError`` for the whole call).
    """
    if not steps:
        return [], []
    if config.split_tokens < config.block_n or config.split_tokens % config.block_n:
        raise ValueError(f"split_tokens {config.split_tokens} must be a multiple of block_n {config.block_n}")
    first = steps[0]
    key = group_key(first.query, first.num_kv_heads)
    device, dtype, d, g = key
    runs = [_check_batched(s, key) for s in steps]

    chunk = config.split_tokens
    lay = _layout(steps, runs, chunk, g, d)
    # aligned copies where needed, kept alive here until the launches have read them
    queries = [_aligned(s.query) for s in steps]
    new_k = [_aligned(s.new_key) if s.row >= 0 else None for s in steps]
    new_v = [_aligned(s.new_value) if s.row >= 0 else None for s in steps]
    desc = _descriptors(steps, runs, lay, chunk, queries, new_k, new_v)
    work, write_work = _work_lists(lay)
    desc_t, work_t, write_t, count_t = _packed(desc, work, write_work, int(lay.count_n.sum()), device)

    d_pad = max(_MIN_DOT, triton.next_power_of_2(d))
    g_pad = max(_MIN_DOT, triton.next_power_of_2(g))
    saved = torch.empty((max(1, int(lay.saved_n.sum())), 2, d), dtype=dtype, device=device)
    if len(write_work):
        with _on(device):
            _write_rows_kernel[(len(write_work),)](desc_t, write_t, saved, D=d, D_PAD=d_pad, DESC_W=_DESC_W)
    out = torch.empty(int((lay.heads * g * d).sum()), dtype=dtype, device=device)
    n_part = int(lay.part_n.sum())
    part = torch.empty((max(1, n_part) * g, d), dtype=torch.float32, device=device)
    lse = torch.empty(max(1, n_part) * g, dtype=torch.float32, device=device)
    qk_scale = (1.0 / math.sqrt(d) if scale is None else scale) * _LOG2E
    saves = [
        saved[o : o + h] if w else None
        for o, h, w in zip(lay.saved_off.tolist(), lay.heads.tolist(), lay.writes.tolist())
    ]
    try:
        with _on(device):
            _launch_batched(
                (len(work),),
                desc_t,
                work_t,
                count_t,
                part,
                lse,
                out,
                qk_scale,
                G=g,
                D=d,
                G_PAD=g_pad,
                D_PAD=d_pad,
                BLOCK_N=config.block_n,
                UPCAST=device.type != "cuda" and dtype == torch.bfloat16,
                DESC_W=_DESC_W,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
    except BaseException:
        restore_rows(steps, saves)
        raise
    outputs = [
        out[o : o + h * g * d].view(s.query.shape) for o, h, s in zip(lay.out_off.tolist(), lay.heads.tolist(), steps)
    ]
    return outputs, saves


def _on(device: torch.device):
    """Launches go to the tensors' device, whichever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def restore_rows(steps: Sequence[BatchedStep], saves: Sequence[torch.Tensor | None]) -> None:
    """Puts back, byte for byte, the rows ``decode_batched`` overwrote (its ``saves``)."""
    for step, saved in zip(steps, saves):
        if saved is not None:
            step.keys[:, step.row] = saved[:, 0]
            step.values[:, step.row] = saved[:, 1]


def _launch_batched(grid, *args, **kwargs) -> None:
    """The attention launch of ``decode_batched`` (after the row writes; tests make it fail)."""
    _batched_kernel[grid](*args, **kwargs)
