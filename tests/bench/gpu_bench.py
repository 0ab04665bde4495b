"""GPU benchmark of the decode kernels (run by ``tests/gpu_check.sh``; not a ``bench_*`` module,
so ``make bench`` on a CPU machine never runs it).

For B in {1, 8}, Hq=32, Hkv=8, D=128, S in {2048, 32768, 131072}, one decode step's attention
over S cached rows, timed with CUDA events (median of ``REPEATS`` timings, each the mean of
``INNER`` back-to-back calls, so launch overhead counts as it does in a real step):

- ``triton``: our split-KV kernel, float16 cache, default ``KernelConfig``;
- ``int8``: the same kernel reading int8 codes and float32 scales;
- ``sdpa``: PyTorch ``scaled_dot_product_attention(enable_gqa=True)`` on the (B, Hkv, S, D)
  float16 cache (the baseline path of the backend);
- ``copy``: the bandwidth floor, a device-to-device copy moving as many bytes (read plus write)
  as the float16 kernel reads, measured in the same run.

Caches smaller than a few times the L2 are replicated and the calls cycle through the copies,
so every timing reads from HBM, not from L2 (the copy floor is measured the same way).

The batched step (``backends.batch.step_many`` over ``BATCH_CACHES`` cuda caches, one Triton
launch for the rows and one for the attention) against the same caches stepped one by one, the
whole public step timed (append and attend): caches of ``SHORT_LENS`` rows (the fixed cost) and of
``MIXED_LENS`` rows (against the floor of reading all their bytes at the copy bandwidth).

A small sweep of launch configurations is timed at every shape too; the best is printed next to
the default so that the defaults can be updated from one GPU run.

Targets (from the issue; an H200): at S >= 32768 the float16 kernel reaches >= 80% of the copy
bandwidth; at B = 1 it is >= 2x faster than SDPA; at S >= 32768 the int8 kernel is >= 1.7x
faster than float16 (at S = 2048 both are launch-bound, so the ratio is reported, not judged).
The batched step, with issue #14's targets for the CPU's: 64 short caches in one call at least
3x faster than 64 separate steps; 64 caches of mixed lengths within 1.3x of their read floor.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch

from backends.cuda import sdpa_attention
from tests.bench.common import WALL, CudaClock, Report, sample_seconds, table

BATCHES = [1, 8]
SEQ_LENS = [2048, 32768, 131072]
HQ, HKV, D = 32, 8, 128
DTYPE = torch.float16
INNER = 20
REPEATS = 15
L2_FACTOR = 4  # replicate caches until they span this many L2s

# Targets: data, checked at the end.
BANDWIDTH_FRACTION = 0.80
BANDWIDTH_MIN_S = 32768
SDPA_SPEEDUP_B1 = 2.0
INT8_SPEEDUP = 1.7
INT8_MIN_S = 32768

BATCH_CACHES = 64
SHORT_LENS = (1, 64)  # rows attended, spread evenly over the caches
MIXED_LENS = (1, 4096)
BATCH_SPEEDUP = 3.0
BATCH_FLOOR_RATIO = 1.3

SWEEP_BLOCK_N = [32, 64, 128]
SWEEP_WARPS = [4, 8]
SWEEP_STAGES = [2, 4]
SWEEP_PROGRAMS_PER_SM = [1, 4]
SWEEP_BUDGET_S = 150.0  # the sweep stops (and says so) past this much wall time


def time_ms(calls: list, inner: int | None = None, repeats: int | None = None) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` calls, cycling through ``calls``."""
    inner = max(inner or INNER, len(calls))
    repeats = repeats or REPEATS
    for fn in calls:
        fn()
    clock = WALL  # --cpu-smoke: the script's logic, not a measurement
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        clock = CudaClock()
    return statistics.median(sample_seconds(calls, repeats, per_sample=inner, clock=clock)) * 1e3


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(1, math.ceil(L2_FACTOR * l2_bytes / nbytes))


def _int8_set(n: int, s: int, dev, gen) -> tuple[torch.Tensor, ...]:
    """(key codes, key scales, value codes, value scales); the values do not affect the time."""
    out = []
    for _ in range(2):
        out.append(torch.randint(-127, 128, (n, s, D), device=dev, dtype=torch.int8, generator=gen))
        out.append(torch.rand(n, s, device=dev, generator=gen) * 0.02 + 0.005)
    return tuple(out)


def _sdpa_call(q, k, v, shape, runs):
    """SDPA over (N, S, D) cache tensors viewed as ``shape`` (B, Hkv, S, D), the views made in the
    timed call."""
    return sdpa_attention(q, k.view(shape), v.view(shape), runs)


def _one_by_one(steps) -> list:
    """The public step of each of ``steps`` (``BatchStep``s) in turn."""
    return [st.cache.step(st.query, st.new_key, st.new_value) for st in steps]


def run(report: Report, *, sweep: bool = True, device: str = "cuda") -> int:
    from backends import triton_decode as td

    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        l2, sms, name = getattr(props, "L2_cache_size", 50 << 20), props.multi_processor_count, props.name
    else:
        l2, sms, name = 0, td._CPU_SMS, "CPU (interpreter smoke run)"
    print(
        f"device: {name}, {sms} SMs, L2 {l2 >> 10} KiB; "
        f"torch {torch.__version__}, triton {__import__('triton').__version__}",
        flush=True,
    )

    # The reference copy bandwidth on a buffer far larger than L2.
    big = torch.empty(max(1 << 30 if dev.type == "cuda" else 1 << 20, 4 * l2), dtype=torch.uint8, device=dev)
    big_dst = torch.empty_like(big)
    t_big = time_ms([functools.partial(big_dst.copy_, big)], inner=min(5, INNER), repeats=min(9, REPEATS))
    copy_bw = 2 * big.numel() / (t_big * 1e-3) / 1e9
    print(
        f"device-to-device copy of {big.numel() >> 20} MiB: {t_big:.3f} ms = {copy_bw:.0f} GB/s (read + write)",
        flush=True,
    )
    report.add(kind="copy_reference", bytes=big.numel(), ms=t_big, gbps=copy_bw)
    del big, big_dst

    sweep_configs = [
        replace(td.DEFAULT_CONFIG, block_n=b, num_warps=w, num_stages=s, programs_per_sm=p)
        for b, w, s, p in itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES, SWEEP_PROGRAMS_PER_SM)
    ]
    sweep_deadline = time.perf_counter() + SWEEP_BUDGET_S
    rows, checks = [], []
    gen = torch.Generator(device=dev).manual_seed(0)
    for b, s in itertools.product(BATCHES, SEQ_LENS):
        n = b * HKV
        fp16_bytes = 2 * n * s * D * 2
        int8_bytes = 2 * n * s * (D + 4)
        reps = copies_for(fp16_bytes, l2)
        q = torch.randn(b, HQ, D, device=dev, generator=gen).to(DTYPE)
        kv = [
            (
                torch.randn(n, s, D, device=dev, generator=gen).to(DTYPE),
                torch.randn(n, s, D, device=dev, generator=gen).to(DTYPE),
            )
            for _ in range(reps)
        ]
        reps8 = copies_for(int8_bytes, l2)
        kv8 = [_int8_set(n, s, dev, gen) for _ in range(reps8)]
        runs = [(0, s)]

        def ours(config, q=q, kv=kv, runs=runs):
            return [
                functools.partial(td.decode_attention, q, k, v, runs, num_kv_heads=HKV, config=config) for k, v in kv
            ]

        def ours8(config, q=q, kv8=kv8, runs=runs):
            return [
                functools.partial(td.decode_attention_int8, q, *c, runs, num_kv_heads=HKV, config=config) for c in kv8
            ]

        shape = (b, HKV, s, D)
        sdpa = [functools.partial(_sdpa_call, q, k, v, shape, runs) for k, v in kv]
        half = fp16_bytes // 2
        src = [torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(copies_for(half, l2))]
        dst = torch.empty(half, dtype=torch.uint8, device=dev)
        copy = [functools.partial(dst.copy_, x) for x in src]

        t_ours = time_ms(ours(td.DEFAULT_CONFIG))
        t_int8 = time_ms(ours8(td.DEFAULT_CONFIG))
        t_sdpa = time_ms(sdpa)
        t_copy = time_ms(copy)
        diff = (ours(td.DEFAULT_CONFIG)[0]().float() - sdpa[0]().float()).abs().max().item()
        splits = td.plan_splits(s, n, sms)[0]

        best = best8 = None
        if sweep and time.perf_counter() < sweep_deadline:
            for cfg in sweep_configs:
                if time.perf_counter() > sweep_deadline:
                    print("  (sweep budget spent: the remaining configurations were not timed)", flush=True)
                    break
                t, t8 = time_ms(ours(cfg), repeats=min(5, REPEATS)), time_ms(ours8(cfg), repeats=min(5, REPEATS))
                report.add(kind="sweep", B=b, S=s, config=asdict(cfg), triton_ms=t, int8_ms=t8)
                if best is None or t < best[0]:
                    best = (t, cfg)
                if best8 is None or t8 < best8[0]:
                    best8 = (t8, cfg)

        bw = fp16_bytes / (t_ours * 1e-3) / 1e9
        frac = t_copy / t_ours
        rec = dict(
            kind="shape",
            B=b,
            S=s,
            Hq=HQ,
            Hkv=HKV,
            D=D,
            splits=splits,
            copies=reps,
            triton_ms=t_ours,
            int8_ms=t_int8,
            sdpa_ms=t_sdpa,
            copy_ms=t_copy,
            triton_gbps=bw,
            copy_fraction=frac,
            sdpa_speedup=t_sdpa / t_ours,
            int8_speedup=t_ours / t_int8,
            max_abs_diff_vs_sdpa=diff,
            best=None if best is None else dict(ms=best[0], config=asdict(best[1])),
            best_int8=None if best8 is None else dict(ms=best8[0], config=asdict(best8[1])),
        )
        report.add(**rec)
        rows.append(
            [
                b,
                s,
                splits,
                t_ours * 1e3,
                t_int8 * 1e3,
                t_sdpa * 1e3,
                t_copy * 1e3,
                bw,
                frac,
                t_sdpa / t_ours,
                t_ours / t_int8,
                diff,
                "-"
                if best is None
                else f"{best[0] * 1e3:.1f}us b{best[1].block_n}w{best[1].num_warps}"
                f"s{best[1].num_stages}p{best[1].programs_per_sm}",
            ]
        )
        print(
            f"B={b} S={s}: triton {t_ours * 1e3:.1f} us ({bw:.0f} GB/s, {frac:.0%} of copy), "
            f"int8 {t_int8 * 1e3:.1f} us, sdpa {t_sdpa * 1e3:.1f} us, copy {t_copy * 1e3:.1f} us",
            flush=True,
        )

        if s >= BANDWIDTH_MIN_S:
            checks.append(
                (
                    f"B={b} S={s}: triton at >= {BANDWIDTH_FRACTION:.0%} of copy bandwidth",
                    frac >= BANDWIDTH_FRACTION,
                    f"{frac:.0%}",
                )
            )
        if b == 1:
            checks.append(
                (
                    f"B={b} S={s}: triton >= {SDPA_SPEEDUP_B1}x faster than SDPA",
                    t_sdpa / t_ours >= SDPA_SPEEDUP_B1,
                    f"{t_sdpa / t_ours:.2f}x",
                )
            )
        if s >= INT8_MIN_S:
            checks.append(
                (
                    f"B={b} S={s}: int8 >= {INT8_SPEEDUP}x faster than float16",
                    t_ours / t_int8 >= INT8_SPEEDUP,
                    f"{t_ours / t_int8:.2f}x",
                )
            )
        del kv, kv8, src, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    run_batched(report, dev, gen, copy_bw, checks)

    print()
    print(
        table(
            [
                "B",
                "S",
                "splits",
                "triton us",
                "int8 us",
                "sdpa us",
                "copy us",
                "triton GB/s",
                "of copy",
                "vs sdpa",
                "int8 gain",
                "max|diff|",
                "best fp16 config",
            ],
            rows,
        )
    )
    print()
    passed = sum(ok for _, ok, _ in checks)
    for what, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
        report.add(kind="target", what=what, passed=ok, value=value)
    print(f"targets: {passed} passed, {len(checks) - passed} failed")
    return 0 if passed == len(checks) else 1


def run_batched(report: Report, dev: torch.device, gen: torch.Generator, copy_bw: float, checks: list) -> None:
    """One ``step_many`` over BATCH_CACHES strict-window caches vs their steps one by one."""
    from backends.batch import BatchStep, step_many
    from backends.contract import CacheSpec
    from backends.cuda import CUDACache
    from backends.policy import EvictionPolicy

    n = BATCH_CACHES
    for name, (lo, hi) in (("short", SHORT_LENS), ("mixed", MIXED_LENS)):
        lens = [lo + (hi - lo) * j // (n - 1) for j in range(n)]
        steps = []
        for s in lens:  # a full window of s rows: every step attends s rows
            cache = CUDACache(CacheSpec(1, HQ, HKV, D, DTYPE, EvictionPolicy.strict(s), device=dev.type))
            cache.prefill(*(torch.randn(1, HKV, s, D, device=dev, generator=gen).to(DTYPE) for _ in range(2)))
            steps.append(
                BatchStep(cache, *(torch.randn(1, h, D, device=dev, generator=gen).to(DTYPE) for h in (HQ, HKV, HKV)))
            )
        t_batched = time_ms([functools.partial(step_many, steps)])
        t_separate = time_ms([functools.partial(_one_by_one, steps)])
        kv_bytes = sum(2 * HKV * s * D * DTYPE.itemsize for s in lens)
        t_floor = kv_bytes / (copy_bw * 1e9) * 1e3  # a copy moves copy_bw GB/s read plus written
        report.add(
            kind="batched",
            caches=n,
            rows=[lo, hi],
            kv_bytes=kv_bytes,
            batched_ms=t_batched,
            separate_ms=t_separate,
            floor_ms=t_floor,
        )
        print(
            f"{n} caches of {lo}-{hi} rows: step_many {t_batched * 1e3:.1f} us, one by one "
            f"{t_separate * 1e3:.1f} us ({t_separate / t_batched:.1f}x), read floor {t_floor * 1e3:.1f} us "
            f"({t_batched / t_floor:.2f}x)",
            flush=True,
        )
        if name == "short":
            checks.append(
                (
                    f"{n} caches of {lo}-{hi} rows: step_many >= {BATCH_SPEEDUP}x faster than one by one",
                    t_separate / t_batched >= BATCH_SPEEDUP,
                    f"{t_separate / t_batched:.2f}x",
                )
            )
        else:
            checks.append(
                (
                    f"{n} caches of {lo}-{hi} rows: step_many within {BATCH_FLOOR_RATIO}x of the read floor",
                    t_batched / t_floor <= BATCH_FLOOR_RATIO,
                    f"{t_batched / t_floor:.2f}x",
                )
            )
        del steps
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-sweep", action="store_true", help="time the default configuration only")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU tensors under TRITON_INTERPRET=1: checks the script, measures nothing",
    )
    args = parser.parse_args(argv)
    device = "cuda"
    if args.cpu_smoke:
        global BATCHES, SEQ_LENS, HQ, HKV, D, INNER, REPEATS, BANDWIDTH_MIN_S, INT8_MIN_S
        global SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES, SWEEP_PROGRAMS_PER_SM, BATCH_CACHES, SHORT_LENS, MIXED_LENS
        BATCHES, SEQ_LENS, HQ, HKV, D, INNER, REPEATS = [1], [40, 300], 8, 2, 16, 1, 1
        BATCH_CACHES, SHORT_LENS, MIXED_LENS = 3, (1, 8), (1, 40)
        BANDWIDTH_MIN_S = INT8_MIN_S = 300
        SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES, SWEEP_PROGRAMS_PER_SM = [16], [4], [2], [1]
        device = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        return 2
    report = Report("gpu")
    t0 = time.perf_counter()
    rc = run(report, sweep=not args.no_sweep, device=device)
    path = report.write()
    print(f"[gpu bench: {time.perf_counter() - t0:.0f} s, raw numbers in {path}]")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
