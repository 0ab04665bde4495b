"""The int8 backend at two levels:

- kernel correctness: its output against the float64 oracle run on the *dequantized* cache
  (what it stores), to float rounding of the exchanged dtype;
- quantization budget: against the float64 oracle on the *original* data, a relative L2 error
  of at most ``BUDGET``, on N(0, 1) data and on data with a few large outlier channels.

Plus memory accounting, the contract of ``LayerCache`` (atomic steps, prefill, export,
rollback), non-finite refusal and the raw codes' export/load round trip.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import quant.int8 as quant_int8
from backends import native
from backends.contract import CacheSpec
from backends.cpu import CPUBackend
from backends.errors import CacheFullError
from backends.int8 import KERNELS, Int8Backend, Int8Cache, Int8Rows, key_outlier_count
from backends.int8_calibration import CALIBRATION_TOKENS
from backends.policy import EvictionPolicy
from backends.registry import get_backend
from quant import dequantize_int8, quantize_int8
from tests.oracle import attended_positions, attention_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALE_DTYPES = [torch.float32, torch.float16]
HEADS = [(8, 1), (32, 8), (16, 16)]
HEAD_DIMS = [1, 64, 128]
LENGTHS = [0, 1, 17, 97, 2048]
BUDGET_LENGTHS = [1, 97, 2048]
DATA_KINDS = ["normal", "outliers"]
POLICIES = {
    "none": EvictionPolicy.none(400),
    "strict": EvictionPolicy.strict(64),
    "greedy": EvictionPolicy.greedy(64, 80),
    "sink": EvictionPolicy.sink(60, 4),
}
KERNEL_POLICIES = {
    "none": EvictionPolicy.none(100),
    "strict": EvictionPolicy.strict(24),
    "greedy": EvictionPolicy.greedy(24, 32),
    "sink": EvictionPolicy.sink(20, 4),
}
STREAM_STEPS = 300
KERNEL_STEPS = 45  # enough to wrap every ring of KERNEL_POLICIES

# Tolerances are data. Kernel: relative L2 error against the oracle on the dequantized cache;
# float32 is float32 rounding, the halves are dominated by rounding the output to their dtype.
KERNEL_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}
# The two kernels compute the same sums in different orders.
KERNELS_AGREE_RTOL = 1e-5
# The native kernel's integer paths (avx2 and avx512dot: query and block weights in 15 bits,
# integer products) add that rounding, ~1e-5..1e-4, far below the cache's own 5e-3..1e-2
# (docs/design.md, "int8 by integer dot products"); as tests/test_native_kernel.py's bound.
INTEGER_RTOL = 2e-4
INTEGER_ISAS = ("avx2", "avx512dot")

# Quantization budget against full precision on the original data, the 1e-2 for both
# kinds. Measured: 0.70-0.92% on N(0, 1) data (per-token absmax int8: a half-step error of
# absmax / 254 with absmax ~3 sigma), 0.50-0.60% with the outlier channels below.
BUDGET = {"normal": 1e-2, "outliers": 1e-2}
# Outlier channels: this many channels of K and V, this many times larger than the rest.
OUTLIER_CHANNELS = 4
OUTLIER_GAIN = 20.0
# Each of the two outlier defences must at least halve the error it addresses (S = 2048,
# measured: float16 key channels 8.1% -> 2.1%, value rotation 2.1% -> 0.7%).
DEFENCE_GAIN_MIN = 2.0
# bytes per token at D = 128 relative to a float16 cache
BYTES_RATIO_TARGET = 0.52


def _integer_path(kernel: str, d: int = 128) -> bool:
    """Whether an int8 kernel computes by the integer path here at head width d ("native": the
    fastest ISA that runs d)."""
    if kernel == "native":
        return native.load().isas(d)[-1] in INTEGER_ISAS
    return kernel.removeprefix("native-") in INTEGER_ISAS


def _kernel_rtol(kernel: str, dtype: torch.dtype, d: int = 128) -> float:
    return max(KERNEL_RTOL[dtype], INTEGER_RTOL) if _integer_path(kernel, d) else KERNEL_RTOL[dtype]


def _kernel_params():
    """Every kernel; a native implementation this CPU lacks is skipped, saying so."""
    usable = native.load().isas(128)
    for kernel in KERNELS:
        isa = kernel.partition("-")[2] if kernel.startswith("native-") else None
        skip = isa is not None and isa not in usable
        yield pytest.param(kernel, marks=pytest.mark.skipif(skip, reason=f"this CPU cannot run the {isa} path"))


def _ids(values):
    return [str(v).removeprefix("torch.") for v in values]


def _data(kind: str, shape, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":
        d = shape[-1]
        channels = torch.randperm(d, generator=gen)[: min(OUTLIER_CHANNELS, d)]
        x[..., channels] *= OUTLIER_GAIN
    return x


def _rel(out: torch.Tensor, ref: np.ndarray) -> float:
    diff = out.double().numpy() - ref
    return float(np.linalg.norm(diff) / np.linalg.norm(ref))


def _raw(cache: Int8Cache):
    """Every stored tensor, as allocated."""
    return (cache._k, cache._ko, cache._v, cache._ks, cache._vs)


def _spec(hq, hkv, d, dtype=torch.float32, policy=None, b=1):
    return CacheSpec(b, hq, hkv, d, dtype, policy or EvictionPolicy.none(4096))


def _dequantized(cache: Int8Cache):
    """The stored rows in float64, in the original basis: keys in channel order (the codes'
    channels, then the float16 outlier channels, put back by ``key_channels``), values rotated
    back."""
    rows = cache.export_quantized()
    ordered = torch.cat(
        [dequantize_int8(rows.key_codes, rows.key_scales, torch.float64), rows.key_outliers.double()], dim=3
    )
    index = cache.key_channels.unsqueeze(2).expand_as(ordered)
    k = torch.empty_like(ordered).scatter_(3, index, ordered)
    v = dequantize_int8(rows.value_codes, rows.value_scales, torch.float64)
    if cache.rotation is not None:
        v = v @ cache.rotation.double()
    return k.cpu().numpy(), v.cpu().numpy()


def _attended_rows(cache: Int8Cache, policy_name: str):
    """The dequantized rows the newest token attends to, from the position-order export."""
    k, v = _dequantized(cache)
    if policy_name == "greedy":  # resident slack beyond the window is kept but not attended
        w = cache.policy.window
        k, v = k[:, :, -w:], v[:, :, -w:]
    return k, v


# -- kernel correctness -------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", list(_kernel_params()))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("length", LENGTHS, ids=[f"S{s}" for s in LENGTHS])
def test_kernel_matches_oracle_on_dequantized_cache(length, dtype, kernel):
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(length)
    cache = Int8Backend(kernel=kernel).create_cache(_spec(hq, hkv, d, dtype, b=2))
    cache.prefill(
        torch.randn(2, hkv, length, d, generator=gen).to(dtype), torch.randn(2, hkv, length, d, generator=gen).to(dtype)
    )
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    out = cache.step(
        q, torch.randn(2, hkv, d, generator=gen).to(dtype), torch.randn(2, hkv, d, generator=gen).to(dtype)
    ).output
    assert out.dtype == dtype and out.shape == (2, hq, d)
    k, v = _dequantized(cache)
    assert _rel(out, attention_ref(q.double().numpy(), k, v, hq, hkv)) <= _kernel_rtol(kernel, dtype)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=_ids(SCALE_DTYPES))
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("heads", HEADS, ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS])
def test_kernel_heads_widths_and_scale_dtypes(heads, d, scale_dtype):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(d)
    cache = Int8Backend(scale_dtype=scale_dtype).create_cache(_spec(hq, hkv, d, b=3))
    cache.prefill(torch.randn(3, hkv, 33, d, generator=gen), torch.randn(3, hkv, 33, d, generator=gen))
    q = torch.randn(3, hq, d, generator=gen)
    out = cache.step(q, torch.randn(3, hkv, d, generator=gen), torch.randn(3, hkv, d, generator=gen)).output
    k, v = _dequantized(cache)
    assert _rel(out, attention_ref(q.double().numpy(), k, v, hq, hkv)) <= _kernel_rtol("native", torch.float32, d)


@pytest.mark.parametrize("kernel", list(_kernel_params()))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_kernel_matches_oracle_through_wrapped_rings(policy_name, kernel):
    hq, hkv, d = 8, 2, 64
    gen = torch.Generator().manual_seed(7)
    cache = Int8Backend(kernel=kernel).create_cache(_spec(hq, hkv, d, policy=KERNEL_POLICIES[policy_name]))
    worst = 0.0
    for _ in range(KERNEL_STEPS):
        q = torch.randn(1, hq, d, generator=gen)
        out = cache.step(q, torch.randn(1, hkv, d, generator=gen), torch.randn(1, hkv, d, generator=gen)).output
        k, v = _attended_rows(cache, policy_name)
        worst = max(worst, _rel(out, attention_ref(q.double().numpy(), k, v, hq, hkv)))
    assert worst <= _kernel_rtol(kernel, torch.float32, d)


def test_kernels_agree():
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, hkv, 500, d, generator=gen), torch.randn(1, hkv, 500, d, generator=gen)
    q, k, v = (
        torch.randn(1, hq, d, generator=gen),
        torch.randn(1, hkv, d, generator=gen),
        torch.randn(1, hkv, d, generator=gen),
    )
    outs = {}
    usable = native.load().isas(d)
    for kernel in KERNELS:
        if kernel.startswith("native-") and kernel.partition("-")[2] not in usable:
            continue
        cache = Int8Backend(kernel=kernel).create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.greedy(300, 400)))
        cache.prefill(keys, values)
        outs[kernel] = cache.step(q, k, v).output
    assert len(outs) >= 4  # native (and its portable path), int_mm, blocks
    ref = outs["blocks"]
    for kernel, out in outs.items():
        rtol = INTEGER_RTOL if _integer_path(kernel, d) else KERNELS_AGREE_RTOL
        assert torch.linalg.norm(out - ref) <= rtol * torch.linalg.norm(ref), kernel


# -- quantization budget --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DATA_KINDS)
@pytest.mark.parametrize("length", BUDGET_LENGTHS, ids=[f"S{s}" for s in BUDGET_LENGTHS])
def test_budget_against_full_precision(length, kind):
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(11 + length)
    keys, values = _data(kind, (1, hkv, length + 1, d), gen), _data(kind, (1, hkv, length + 1, d), gen)
    q = torch.randn(1, hq, d, generator=gen)
    cache = Int8Backend().create_cache(_spec(hq, hkv, d))
    cache.prefill(keys[:, :, :length], values[:, :, :length])
    out = cache.step(q, keys[:, :, length], values[:, :, length]).output
    ref = attention_ref(q.double().numpy(), keys.double().numpy(), values.double().numpy(), hq, hkv)
    assert _rel(out, ref) <= BUDGET[kind]


def test_key_outlier_channels_and_value_rotation_are_what_keep_outliers_in_budget():
    hq, hkv, d, length = 32, 8, 128, 2048
    gen = torch.Generator().manual_seed(17)
    keys, values = _data("outliers", (1, hkv, length + 1, d), gen), _data("outliers", (1, hkv, length + 1, d), gen)
    q = torch.randn(1, hq, d, generator=gen)
    ref = attention_ref(q.double().numpy(), keys.double().numpy(), values.double().numpy(), hq, hkv)
    errors = {}
    for key_outliers, rotate in ((0, True), (4, False), (4, True)):
        cache = Int8Backend(rotate=rotate, key_outliers=key_outliers).create_cache(_spec(hq, hkv, d))
        cache.prefill(keys[:, :, :length], values[:, :, :length])
        errors[key_outliers, rotate] = _rel(cache.step(q, keys[:, :, length], values[:, :, length]).output, ref)
    assert errors[0, True] >= DEFENCE_GAIN_MIN * errors[4, True]  # keys
    assert errors[4, False] >= DEFENCE_GAIN_MIN * errors[4, True]  # values
    assert errors[4, True] <= BUDGET["outliers"]


@pytest.mark.parametrize("kind", DATA_KINDS)
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_budget_over_a_stream(policy_name, kind):
    hq, hkv, d = 8, 2, 64
    policy = POLICIES[policy_name]
    gen = torch.Generator().manual_seed(5)
    keys, values = _data(kind, (1, hkv, STREAM_STEPS, d), gen), _data(kind, (1, hkv, STREAM_STEPS, d), gen)
    queries = torch.randn(STREAM_STEPS, 1, hq, d, generator=gen)
    k64, v64 = keys.double().numpy(), values.double().numpy()
    cache = Int8Backend().create_cache(_spec(hq, hkv, d, policy=policy))
    outs, refs = [], []
    for t in range(STREAM_STEPS):
        outs.append(cache.step(queries[t], keys[:, :, t], values[:, :, t]).output)
        pos = attended_positions(policy_name, t + 1, policy.window, policy.sinks)
        refs.append(attention_ref(queries[t].double().numpy(), k64[:, :, pos], v64[:, :, pos], hq, hkv))
    # the stream's output as a whole: one step's error alone varies with its few random tokens
    assert _rel(torch.stack(outs), np.stack(refs)) <= BUDGET[kind]


# -- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=_ids(SCALE_DTYPES))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_reserved_bytes_are_codes_outliers_scales_and_calibration(policy_name, scale_dtype):
    b, hq, hkv, d = 2, 32, 8, 128
    backend = Int8Backend(scale_dtype=scale_dtype)
    spec = _spec(hq, hkv, d, torch.bfloat16, POLICIES[policy_name], b=b)
    cache = backend.create_cache(spec)
    scale_bytes = torch.empty((), dtype=scale_dtype).element_size()
    o = cache.outliers
    assert o == 4
    row = (d - o) + 2 * o + d + 2 * scale_bytes  # key codes, float16 key channels, value codes, scales
    # per KV head beside the positions: the calibration keys, the key channel order (int64) and
    # the native step's saved row
    expected = b * hkv * (spec.capacity * row + CALIBRATION_TOKENS * d * 4 + 8 * d + row)
    assert backend.cache_nbytes(spec) == cache.nbytes == expected
    assert cache.row_bytes == b * hkv * row
    float16_row = 2 * b * hkv * d * 2
    # the default (float16 scales) meets the target: 264 / 512 = 0.516; float32 scales: 0.523
    assert cache.row_bytes / float16_row <= (BYTES_RATIO_TARGET if scale_dtype == torch.float16 else 0.524)
    out = cache.step(
        torch.randn(b, hq, d, dtype=torch.bfloat16),
        torch.randn(b, hkv, d, dtype=torch.bfloat16),
        torch.randn(b, hkv, d, dtype=torch.bfloat16),
    )
    assert out.bytes_written == cache.row_bytes


def test_default_scales_are_float16_and_meet_the_ratio():
    cache = Int8Backend().create_cache(_spec(32, 8, 128))
    assert cache.scale_dtype == torch.float16
    assert cache.row_bytes / (2 * 8 * 128 * 2) <= BYTES_RATIO_TARGET


@pytest.mark.parametrize("kernel", ["native", "blocks"])
def test_key_storage_is_counted_padded_only_for_torch_kernels(kernel):
    """The compiled kernel's key blocks (``key_layout.KeyBlocks``) pad nothing; the torch
    kernels' transposed key rows are padded to 64-byte lines from C = 4032 on, under 1/64 more.
    The reservation counts what is allocated, and the ratio target still holds."""
    b, hq, hkv, d, c = 1, 8, 2, 128, 5000
    backend = Int8Backend(kernel=kernel)
    spec = _spec(hq, hkv, d, policy=EvictionPolicy.strict(c))
    cache = backend.create_cache(spec)
    padded, o = (c if kernel == "native" else 5056), cache.outliers
    row = (d - o) + 2 * o + d + 2 * 2
    expected = b * hkv * ((d - o) * padded + 2 * o * c + d * c + 2 * c * 2 + CALIBRATION_TOKENS * d * 4 + 8 * d + row)
    assert backend.cache_nbytes(spec) == cache.nbytes == expected
    assert cache.row_bytes / (2 * b * hkv * d * 2) <= BYTES_RATIO_TARGET
    if kernel == "blocks":
        assert cache._k.stride(-2) == padded and cache._k.shape[-1] == c
        # below the threshold nothing is padded
        small = backend.create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.strict(4000)))
        assert small._k.stride(-2) == 4000


@pytest.mark.parametrize("d,expected", [(128, 4), (64, 4), (16, 2), (8, 1), (7, 0), (1, 0)])
def test_outlier_channel_count_follows_the_head_width(d, expected):
    assert key_outlier_count(d) == expected
    assert Int8Backend().create_cache(_spec(4, 2, d)).outliers == expected
    assert Int8Backend(key_outliers=0).create_cache(_spec(4, 2, d)).outliers == 0


# -- the cache contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_bookkeeping_and_outputs_follow_the_cpu_backend(policy_name):
    hq, hkv, d = 8, 2, 32
    spec = _spec(hq, hkv, d, policy=KERNEL_POLICIES[policy_name])
    int8, dense = Int8Backend().create_cache(spec), CPUBackend().create_cache(spec)
    gen = torch.Generator().manual_seed(9)
    outs, dense_outs = [], []
    for _ in range(KERNEL_STEPS):
        args = (
            torch.randn(1, hq, d, generator=gen),
            torch.randn(1, hkv, d, generator=gen),
            torch.randn(1, hkv, d, generator=gen),
        )
        a, b = int8.step(*args), dense.step(*args)
        assert (a.tokens_seen, a.resident, a.first_position, a.last_position, a.evicted_tokens, a.attended) == (
            b.tokens_seen,
            b.resident,
            b.first_position,
            b.last_position,
            b.evicted_tokens,
            b.attended,
        )
        outs.append(a.output)
        dense_outs.append(b.output)
    diff = torch.linalg.norm(torch.stack(outs) - torch.stack(dense_outs))
    assert diff <= BUDGET["normal"] * torch.linalg.norm(torch.stack(dense_outs))
    ek, ev = int8.export()
    dk, dv = dense.export()
    assert ek.shape == dk.shape and ev.shape == dv.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_prefill_quantizes_on_arrival_and_export_is_in_position_order(policy_name, dtype):
    hkv, d, n = 2, 16, 150
    policy = POLICIES[policy_name]
    gen = torch.Generator().manual_seed(13)
    keys, values = (
        torch.randn(1, hkv, n, d, generator=gen).to(dtype),
        torch.randn(1, hkv, n, d, generator=gen).to(dtype),
    )
    kept = [p for r in policy.resident(n) for p in r]
    # without outlier channels or rotation the stored codes are exactly quant's codes
    plain = Int8Backend(rotate=False, key_outliers=0).create_cache(_spec(4, hkv, d, dtype, policy))
    plain.prefill(keys, values)
    rows = plain.export_quantized()
    want_kc, want_ks = quantize_int8(keys[:, :, kept], scale_dtype=torch.float16)
    want_vc, want_vs = quantize_int8(values[:, :, kept], scale_dtype=torch.float16)
    assert torch.equal(rows.key_codes, want_kc) and torch.equal(rows.key_scales, want_ks)
    assert torch.equal(rows.value_codes, want_vc) and torch.equal(rows.value_scales, want_vs)
    assert torch.equal(plain.key_channels, torch.arange(d).expand(1, hkv, d))
    ek, ev = plain.export()
    assert ek.dtype == dtype and ek.shape == (1, hkv, len(kept), d)
    assert torch.equal(ek, dequantize_int8(want_kc, want_ks, dtype))
    assert torch.equal(ev, dequantize_int8(want_vc, want_vs, dtype))
    # the default: the resident keys' largest channels are kept in float16, values rotated
    cache = Int8Backend().create_cache(_spec(4, hkv, d, dtype, policy))
    cache.prefill(keys, values)
    rows = cache.export_quantized()
    o = cache.outliers
    order = cache.key_channels
    largest = keys[:, :, kept].float().abs().amax(dim=2).topk(o, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(order[..., d - o :], largest)
    ordered = keys[:, :, kept].float().gather(3, order.unsqueeze(2).expand(1, hkv, len(kept), d))
    assert torch.equal(rows.key_outliers, ordered[..., d - o :].half())
    want_kc, want_ks = quantize_int8(ordered[..., : d - o], scale_dtype=torch.float16)
    assert torch.equal(rows.key_codes, want_kc) and torch.equal(rows.key_scales, want_ks)
    ek, ev = cache.export()
    slack = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    want_k, want_v = keys[:, :, kept].double(), values[:, :, kept].double()
    # keys: half a step per coded channel, float16 rounding on the outlier ones
    err = (ek.double() - want_k).abs()
    bound = rows.key_scales.double().unsqueeze(-1) / 2 + (slack + 2**-11) * want_k.abs()
    assert bool((err <= bound).all())
    # values: a rotated error of at most scale/2 per channel is at most scale/2 * sqrt(D) per row
    err = torch.linalg.norm(ev.double() - want_v, dim=-1)
    bound = rows.value_scales.double() / 2 * d**0.5 + slack * torch.linalg.norm(want_v, dim=-1)
    assert bool((err <= bound).all())


def test_outlier_channels_are_found_from_a_prefill_or_the_first_keys():
    hq, hkv, d = 8, 2, 64
    gen = torch.Generator().manual_seed(31)
    keys = torch.randn(1, hkv, 40, d, generator=gen)
    channels = torch.tensor([3, 17, 40, 62])
    keys[..., channels] *= OUTLIER_GAIN
    values = torch.randn(1, hkv, 40, d, generator=gen)
    prefilled = Int8Backend().create_cache(_spec(hq, hkv, d))
    prefilled.prefill(keys, values)
    assert prefilled.calibrated
    assert all(torch.equal(prefilled.key_channels[0, h, -4:], channels) for h in range(hkv))
    # token by token: chosen again at 1, 2, 4, 8 and 16 keys, then final; the early keys are
    # re-encoded from their exact values, so the result is the prefill of the same 16 keys
    stepped = Int8Backend().create_cache(_spec(hq, hkv, d))
    for t in range(CALIBRATION_TOKENS):
        assert not stepped.calibrated
        stepped.step(torch.randn(1, hq, d, generator=gen), keys[:, :, t], values[:, :, t])
    assert stepped.calibrated
    same = Int8Backend().create_cache(_spec(hq, hkv, d))
    same.prefill(keys[:, :, :CALIBRATION_TOKENS], values[:, :, :CALIBRATION_TOKENS])
    assert torch.equal(stepped.key_channels, same.key_channels)
    assert all(torch.equal(a, b) for a, b in zip(stepped.export_quantized(), same.export_quantized()))
    # later keys change nothing
    before = stepped.key_channels
    stepped.step(torch.randn(1, hq, d), torch.randn(1, hkv, d) * 1000, torch.randn(1, hkv, d))
    assert torch.equal(stepped.key_channels, before)


def test_keys_beyond_float16_are_refused_before_writing():
    cache = Int8Backend().create_cache(_spec(4, 2, 8, policy=EvictionPolicy.strict(4)))
    cache.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    raw = [t.clone() for t in (cache._k, cache._ko, cache._v, cache._ks, cache._vs)]
    big = torch.randn(1, 2, 8)
    big[0, 1, 2] = 1e5
    with pytest.raises(ValueError, match="new_key: .*beyond float16"):
        cache.step(torch.randn(1, 4, 8), big, torch.randn(1, 2, 8))
    assert cache.tokens_seen == 1
    assert all(torch.equal(a, b) for a, b in zip(raw, (cache._k, cache._ko, cache._v, cache._ks, cache._vs)))
    empty = Int8Backend().create_cache(_spec(4, 2, 8))
    with pytest.raises(ValueError, match="prefill key"):
        empty.prefill(big.unsqueeze(2), torch.randn(1, 2, 1, 8))
    assert empty.tokens_seen == 0


def test_failed_step_restores_codes_and_scales_bit_exactly(monkeypatch):
    hq, hkv, d = 4, 2, 8
    cache = Int8Backend().create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.strict(5)))
    for _ in range(7):  # the ring has wrapped: the next write overwrites a live row
        cache.step(torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d))
    before = cache.export_quantized()
    raw_before = [t.clone() for t in _raw(cache)]

    def boom(*_):
        raise RuntimeError("attention failed")

    monkeypatch.setattr(cache, "_attend", boom)
    with pytest.raises(RuntimeError, match="attention failed"):
        cache.step(torch.randn(1, hq, d), torch.randn(1, hkv, d) * 100, torch.randn(1, hkv, d) * 100)
    assert cache.tokens_seen == 7
    assert all(torch.equal(a, b) for a, b in zip(before, cache.export_quantized()))
    assert all(torch.equal(a, b) for a, b in zip(raw_before, _raw(cache)))


def test_failed_step_while_choosing_outlier_channels_restores_everything(monkeypatch):
    """At T = 8 a step chooses the outlier channels again and re-encodes the first keys: a
    failure afterwards puts the channels, the calibration keys and every code back."""
    hq, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(8)
    cache = Int8Backend().create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.strict(6)))
    for _ in range(7):
        cache.step(
            torch.randn(1, hq, d, generator=gen),
            torch.randn(1, hkv, d, generator=gen),
            torch.randn(1, hkv, d, generator=gen),
        )
    raw_before = [t.clone() for t in _raw(cache)]
    order, calibration = cache.key_channels, cache._calibration.clone()
    monkeypatch.setattr(cache, "_attend", lambda *_: (_ for _ in ()).throw(RuntimeError("attention failed")))
    key = torch.randn(1, hkv, d, generator=gen)
    key[..., 5] *= 1000  # the 8th key changes the choice
    with pytest.raises(RuntimeError, match="attention failed"):
        cache.step(torch.randn(1, hq, d), key, torch.randn(1, hkv, d))
    assert cache.tokens_seen == 7 and not cache.calibrated
    assert torch.equal(cache.key_channels, order) and torch.equal(cache._calibration, calibration)
    assert all(torch.equal(a, b) for a, b in zip(raw_before, _raw(cache)))
    monkeypatch.undo()
    cache.step(torch.randn(1, hq, d), key, torch.randn(1, hkv, d))
    assert bool((cache.key_channels[..., -cache.outliers :] == 5).any(dim=-1).all())


def test_full_cache_under_none_is_refused_unchanged():
    cache = Int8Backend().create_cache(_spec(4, 2, 8, policy=EvictionPolicy.none(3)))
    for _ in range(3):
        cache.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    before = cache.export_quantized()
    with pytest.raises(CacheFullError):
        cache.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.export_quantized()))


# a step while the outlier channels are chosen (Python), and one after (the library checks the
# values itself; the step then names the tensor)
REFUSAL_STEPS = [4, CALIBRATION_TOKENS + 2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("target", ["query", "new_key", "new_value"])
@pytest.mark.parametrize("steps", REFUSAL_STEPS, ids=[f"T{t}" for t in REFUSAL_STEPS])
def test_non_finite_step_input_is_refused_before_writing(steps, target, bad):
    hq, hkv, d = 4, 2, 16
    cache = Int8Backend().create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.strict(3)))
    for _ in range(steps):
        cache.step(torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d))
    raw_before = [t.clone() for t in _raw(cache)]
    args = {"query": torch.randn(1, hq, d), "new_key": torch.randn(1, hkv, d), "new_value": torch.randn(1, hkv, d)}
    args[target][0, 0, 1] = bad
    with pytest.raises(ValueError, match=rf"^{target}: 1 non-finite"):
        cache.step(args["query"], args["new_key"], args["new_value"])
    assert cache.tokens_seen == steps
    assert all(torch.equal(a, b) for a, b in zip(raw_before, _raw(cache)))
    cache.step(torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d))  # still usable


@pytest.mark.parametrize("target", ["query", "new_key", "new_value"])
@pytest.mark.parametrize("bad", [float("nan"), 7e4], ids=["nan", "beyond-float16"])
def test_the_librarys_value_check_reads_every_element_to_the_last(target, bad):
    """The library's check of a step's values (write.c's ``within``, 16 lanes at a time on
    AVX-512) reaches the last element of a tensor whose size is not a multiple of 16; a key beyond
    float16's range is refused too (its outlier channels are stored as float16), where a query or
    value of that size is a valid one."""
    hq, hkv, d = 4, 2, 20  # 80 query and 40 key elements: the key check ends in a partial vector
    cache = Int8Backend().create_cache(_spec(hq, hkv, d, policy=EvictionPolicy.strict(3)))
    for _ in range(CALIBRATION_TOKENS + 2):  # past the calibration: the library checks the step
        cache.step(torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d))
    raw_before = [t.clone() for t in _raw(cache)]
    args = {"query": torch.randn(1, hq, d), "new_key": torch.randn(1, hkv, d), "new_value": torch.randn(1, hkv, d)}
    args[target][0, -1, -1] = bad
    if bad == 7e4 and target != "new_key":
        cache.step(args["query"], args["new_key"], args["new_value"])
        return
    with pytest.raises(ValueError, match=rf"^{target}: "):
        cache.step(args["query"], args["new_key"], args["new_value"])
    assert all(torch.equal(a, b) for a, b in zip(raw_before, _raw(cache)))


def test_non_finite_prefill_is_refused_and_the_cache_stays_empty():
    cache = Int8Backend().create_cache(_spec(4, 2, 8, policy=EvictionPolicy.sink(4, 2)))
    keys, values = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    values[0, 1, 8, 3] = float("inf")  # in the last run written: the first runs must not land
    with pytest.raises(ValueError, match="prefill value"):
        cache.prefill(keys, values)
    assert cache.tokens_seen == 0
    assert not any(bool(t.any()) for t in _raw(cache))


def test_rollback_is_the_base_contract():
    cache = Int8Backend().create_cache(_spec(4, 2, 8, policy=EvictionPolicy.greedy(4, 8)))
    for _ in range(6):
        cache.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    before = cache.export_quantized()
    cache.rollback(2)
    after = cache.export_quantized()
    assert cache.tokens_seen == 4
    assert all(torch.equal(a, b[:, :, :4]) for a, b in zip(after, before))


# -- raw codes: export / load ------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [KERNEL_STEPS, 5], ids=["calibrated", "calibrating"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=_ids(SCALE_DTYPES))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_export_load_quantized_round_trip_is_bit_exact(policy_name, scale_dtype, steps):
    hq, hkv, d = 8, 2, 16
    backend = Int8Backend(scale_dtype=scale_dtype)
    spec = _spec(hq, hkv, d, torch.bfloat16, KERNEL_POLICIES[policy_name])
    gen = torch.Generator().manual_seed(21)

    def args():
        return tuple(
            torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((1, hq, d), (1, hkv, d), (1, hkv, d))
        )

    source = backend.create_cache(spec)
    for _ in range(steps):
        source.step(*args())
    saved = source.export_quantized()
    state = source.export_state()
    assert ("key_calibration" in state) == (steps < CALIBRATION_TOKENS)
    copy = backend.create_cache(spec)
    copy.load_quantized(saved, source.key_channels, source.tokens_seen, state.get("key_calibration"))
    assert copy.tokens_seen == source.tokens_seen and copy.calibrated == source.calibrated
    assert all(torch.equal(a, b) for a, b in zip(saved, copy.export_quantized()))
    via_state = backend.create_cache(spec)
    via_state.load_state(source.tokens_seen, state)
    assert all(torch.equal(a, b) for a, b in zip(saved, via_state.export_quantized()))
    for _ in range(CALIBRATION_TOKENS):  # through the remaining choices of outlier channels
        step = args()
        a, b, c = source.step(*step), copy.step(*step), via_state.step(*step)
        assert torch.equal(a.output, b.output) and torch.equal(a.output, c.output)
        assert (a.resident, a.first_position) == (b.resident, b.first_position)
    assert torch.equal(source.key_channels, copy.key_channels)


def test_load_quantized_refuses_bad_input_and_stores_nothing():
    backend = Int8Backend()
    spec = _spec(4, 2, 8, policy=EvictionPolicy.strict(4))
    source = backend.create_cache(spec)
    for _ in range(20):
        source.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    rows, order = source.export_quantized(), source.key_channels
    target = backend.create_cache(spec)
    with pytest.raises(ValueError, match="key codes expected shape"):
        target.load_quantized(rows, order, 3)  # L(3) = 3, not 4
    with pytest.raises(TypeError, match="value codes"):
        target.load_quantized(rows._replace(value_codes=rows.value_codes.int()), order, 20)
    with pytest.raises(TypeError, match="key scales"):
        target.load_quantized(rows._replace(key_scales=rows.key_scales.float()), order, 20)
    with pytest.raises(TypeError, match="key outliers"):
        target.load_quantized(rows._replace(key_outliers=rows.key_outliers.float()), order, 20)
    bad = rows.key_codes.clone()
    bad[0, 0, 0, 0] = -128
    with pytest.raises(ValueError, match="-128"):
        target.load_quantized(rows._replace(key_codes=bad), order, 20)
    with pytest.raises(ValueError, match="value scales"):
        target.load_quantized(rows._replace(value_scales=rows.value_scales.neg()), order, 20)
    with pytest.raises(ValueError, match="key outliers must be finite"):
        target.load_quantized(rows._replace(key_outliers=rows.key_outliers.clone().fill_(float("inf"))), order, 20)
    repeated = order.clone()
    repeated[0, 0, 0] = repeated[0, 0, 1]
    with pytest.raises(ValueError, match="key_channels"):
        target.load_quantized(rows, repeated, 20)
    with pytest.raises(ValueError, match="calibration rows only"):
        target.load_quantized(rows, order, 20, torch.zeros(1, 2, 16, 8))
    assert target.tokens_seen == 0 and not any(bool(t.any()) for t in _raw(target))
    target.load_quantized(rows, order, 20)
    with pytest.raises(ValueError, match="already holds"):
        target.load_quantized(rows, order, 20)
    calibrating = backend.create_cache(spec)
    with pytest.raises(ValueError, match="calibration must be"):
        calibrating.load_quantized(rows, order, 4, torch.zeros(1, 2, 3, 8))


def test_empty_export_quantized_has_the_right_shapes():
    cache = Int8Backend(scale_dtype=torch.float32).create_cache(_spec(4, 2, 8, b=3))
    rows = cache.export_quantized()
    assert isinstance(rows, Int8Rows)
    assert rows.key_codes.shape == (3, 2, 0, 7) and rows.value_codes.shape == (3, 2, 0, 8)
    assert rows.key_codes.dtype == torch.int8 and rows.key_outliers.shape == (3, 2, 0, 1)
    assert rows.key_scales.shape == rows.value_scales.shape == (3, 2, 0) and rows.key_scales.dtype == torch.float32


def test_registry_and_capabilities():
    backend = get_backend("int8")
    assert isinstance(backend, Int8Backend)
    assert backend.reasons_against(_spec(4, 2, 8, torch.bfloat16)) == []
    reasons = backend.reasons_against(_spec(4, 2, 8, torch.float64))
    assert len(reasons) == 1 and reasons[0].startswith("int8: dtype float64")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by `make gpu-check`)")
@pytest.mark.parametrize("policy_name", list(KERNEL_POLICIES))
def test_int8_cache_on_a_cuda_device(policy_name):
    """Off the CPU the cache takes the torch "blocks" kernel (float16 key channels as a score
    bias, the rotation as a matrix product); the same oracle on the dequantized cache."""
    hq, hkv, d = 8, 2, 64
    spec = CacheSpec(1, hq, hkv, d, torch.float16, KERNEL_POLICIES[policy_name], device="cuda")
    cache = Int8Backend().create_cache(spec)
    assert cache.kernel == "blocks"
    gen = torch.Generator().manual_seed(9)
    for _ in range(KERNEL_STEPS):
        q, k, v = (torch.randn(shape, generator=gen).half().cuda() for shape in ((1, hq, d), (1, hkv, d), (1, hkv, d)))
        out = cache.step(q, k, v).output
        assert out.device.type == "cuda"
    keys, values = _attended_rows(cache, policy_name)
    ref = attention_ref(q.double().cpu().numpy(), keys, values, hq, hkv)
    assert _rel(out.cpu(), ref) <= KERNEL_RTOL[torch.float16]


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["f16-scales", "f32-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_native_step_stores_and_outputs_what_the_python_step_does(dtype, scale_dtype, monkeypatch):
    """After calibration the whole step is one native call (rotate, quantize, write, attend);
    it stores the same codes bit for bit and gives the same outputs as the Python path."""
    spec = CacheSpec(1, 8, 2, 64, dtype, EvictionPolicy.sink(40, 3))
    native_cache = Int8Backend(scale_dtype=scale_dtype).create_cache(spec)
    python_cache = Int8Backend(scale_dtype=scale_dtype).create_cache(spec)
    monkeypatch.setattr(python_cache, "_step_native", lambda *a: None)  # None: the Python path
    gen = torch.Generator().manual_seed(5)
    for step in range(70):  # past calibration, around the wrapped window
        q, k, v = (torch.randn(1, h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
        k[..., 3] *= 30  # an outlier channel
        if step == 50:
            k[0, 1] = 0.0  # an all-zero row
        a, b = native_cache.step(q, k, v), python_cache.step(q, k, v)
        assert torch.equal(a.output, b.output), step
    for x, y in zip(native_cache.export_quantized(), python_cache.export_quantized()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_native_step_over_several_splits_stores_what_the_python_step_does(dtype, monkeypatch):
    """A step attending more than one split (native.SPLIT_T positions) has its row checked and quantized
    before the work items and each head's codes stored by the item that reads them
    (csrc/run.c, DEFER_CODES): the same codes bit for bit and the same outputs as the Python
    path, through the ring's wrap."""
    cap = native.SPLIT_T + 88  # two splits a head once past SPLIT_T positions
    spec = CacheSpec(1, 8, 2, 64, dtype, EvictionPolicy.sink(cap, 3))
    native_cache = Int8Backend().create_cache(spec)
    python_cache = Int8Backend().create_cache(spec)
    monkeypatch.setattr(python_cache, "_step_native", lambda *a: None)  # None: the Python path
    gen = torch.Generator().manual_seed(8)
    keys, values = (torch.randn(1, 2, cap - 40, 64, generator=gen).to(dtype) for _ in range(2))
    native_cache.prefill(keys, values)
    python_cache.prefill(keys, values)
    for step in range(80):  # cap - 39 to cap + 40 positions seen: the window wraps at cap + 3
        q, k, v = (torch.randn(1, h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
        a, b = native_cache.step(q, k, v), python_cache.step(q, k, v)
        assert torch.equal(a.output, b.output), step
    for x, y in zip(native_cache.export_quantized(), python_cache.export_quantized()):
        assert torch.equal(x, y)


def test_native_step_failure_after_the_write_restores_bytes(monkeypatch):
    cache = Int8Backend().create_cache(CacheSpec(1, 8, 2, 64, torch.float32, EvictionPolicy.strict(20)))
    gen = torch.Generator().manual_seed(6)
    for _ in range(30):
        cache.step(*(torch.randn(1, h, 64, generator=gen) for h in (8, 2, 2)))
    tensors = (cache._k, cache._ko, cache._v, cache._ks, cache._vs)
    before = [bytes(t.untyped_storage()) for t in tensors]
    monkeypatch.setattr(cache, "_fail_after_write", True)
    with pytest.raises(RuntimeError, match="native step failed"):
        cache.step(*(torch.randn(1, h, 64, generator=gen) for h in (8, 2, 2)))
    assert [bytes(t.untyped_storage()) for t in tensors] == before and cache.tokens_seen == 30


RSS_SCRIPT = """
import sys, torch
from backends.contract import CacheSpec
from backends.int8 import Int8Backend
from backends.policy import EvictionPolicy

def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096

backend = Int8Backend()
spec = CacheSpec(1, 32, 8, 1024, torch.float16, EvictionPolicy.strict(int(sys.argv[1])))
backend.create_cache(spec)  # the library loaded, the allocator warmed
before = rss()
caches = [backend.create_cache(spec) for _ in range(int(sys.argv[2]))]
print(rss() - before, sum(c.nbytes for c in caches), sum(backend.cache_nbytes(spec) for _ in caches))
"""


@pytest.mark.parametrize("capacity,layers", [(1, 64), (4096, 2)], ids=["C1x64", "C4096x2"])
def test_opening_int8_caches_grows_rss_by_their_reservation(capacity, layers):
    """#17 item 10: the Hadamard matrix is shared per D and nothing per layer lies outside the
    reservation. Bound: RSS growth <= reserved bytes + 8 MiB (one shared D=1024 matrix, 4 MiB,
    and allocator slack); before, each layer added a 4 MiB matrix and float64 temporaries."""
    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(capacity), str(layers)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr
    grown, held, reserved = map(int, done.stdout.split()[-3:])
    assert held == reserved
    assert grown <= reserved + 8 * 2**20, (grown, reserved)


LAZY_SCRIPT = """
import sys, torch
from backends import registry
from backends.contract import CacheSpec
from backends.int8 import Int8Cache
from backends.policy import EvictionPolicy

loaded = lambda: "bitsandbytes" in sys.modules
registry.describe()
spec = CacheSpec(1, 4, 2, 16, torch.float32, EvictionPolicy.strict(40))
for kernel in ("native", "blocks"):
    cache = Int8Cache(spec, kernel=kernel)  # float16 scales, the default
    for _ in range(40):  # through calibration
        cache.step(torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16))
print(loaded())
"""


def test_bitsandbytes_is_imported_by_the_first_float32_scale_quantization_only():
    """bitsandbytes' import brings torch's compiler (~5 s of CPU): describing the backends and a
    float16-scale cache's steps do without it (in a fresh process); float32 scales still
    quantize with it."""
    done = subprocess.run(
        [sys.executable, "-c", LAZY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"], done.stdout
    # here (this process has quantized with float32 scales already or does now): bitsandbytes'
    # quantizer, and its codes
    assert quant_int8.bitsandbytes_quantizer() is not None
    codes, scales = quantize_int8(torch.tensor([[0.5, -2.0, 1.0]]))
    assert codes.tolist() == [[32, -127, 64]] and scales.tolist() == [float(torch.tensor(2.0) / 127)]
