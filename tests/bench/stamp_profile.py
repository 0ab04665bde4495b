"""A probe, not a target: where a cold public step's time goes, part by part and thread by thread.

    .venv/bin/python -m tests.bench.stamp_profile [--backend cpu|int8] [--dtype float32]
        [--length 2048] [--steps 30] [--gap 0.02]

``cold_profile`` says which functions a step's samples fall in. This probe says when each part
of a step ran: it loads the library built with time stamps (``GQA_KERNEL_STAMPS=1``:
``csrc/stamps.c``, its own build, never the production one) and steps one cache (B=1, Hq=32,
Hkv=8, D=128, policy none, prefilled to ``--length``) ``--steps`` times cold, each after
``--gap`` seconds (``make bench`` times its calls 20 ms after the last torch call) and one
``common.Evictor``, then as many times hot. Per step it reads the stamps of ``gqa_step``'s entry
and return, the row writes before the work items, the items' pool call, each item's start and end
and each block's start on each thread, and prints the medians of:

- ``outside gqa_step``: the public step's time less ``gqa_step``'s (Python, the C++ entry, the
  outcome);
- ``plan``, ``row writes before the items``, ``items``: ``gqa_step``'s parts;
- per thread: when its first item started after the items' start, its items, a block's time
  (an item's first block apart from the others: the next stamp on the thread less the block's);
- ``tail``: one thread's last stamp to the other's.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import time

HQ, HKV, D = 32, 8, 128
# csrc/gqa_internal.h's STAMP_* kinds
ITEM, BLOCK, ITEM_END, WRITES, ITEMS, ITEMS_END, STEP, STEP_END = 0, 1, 2, 10, 11, 12, 20, 21


class Stamp(ctypes.Structure):
    _fields_ = [
        ("ns", ctypes.c_int64),
        ("tid", ctypes.c_int32),
        ("item", ctypes.c_int32),
        ("block", ctypes.c_int32),
        ("kind", ctypes.c_int32),
    ]


def parts(stamps: list[tuple[int, int, int, int, int]], wall_us: float) -> dict[str, float]:
    """One step's parts in us from its stamps ((ns, tid, item, block, kind), any order) and its
    wall time; {} when a call's stamps are missing (the step did not reach the kernel)."""
    stamps = sorted(stamps)
    first = {}
    for s in stamps:
        first.setdefault(s[4], s[0])
    if not all(k in first for k in (STEP, WRITES, ITEMS, ITEMS_END, STEP_END)):
        return {}
    us = 1e-3
    out = {
        "outside gqa_step": wall_us - (first[STEP_END] - first[STEP]) * us,
        "plan": (first[WRITES] - first[STEP]) * us,
        "row writes before the items": (first[ITEMS] - first[WRITES]) * us,
        "items": (first[ITEMS_END] - first[ITEMS]) * us,
    }
    by_thread = collections.defaultdict(list)
    for s in stamps:
        if s[4] in (ITEM, BLOCK, ITEM_END):
            by_thread[s[1]].append(s)
    ends = []
    for tid, xs in sorted(by_thread.items()):
        starts = [x for x in xs if x[4] == ITEM]
        out[f"thread {tid}: first item, after the items' start"] = (starts[0][0] - first[ITEMS]) * us
        out[f"thread {tid}: items"] = len(starts)
        blocks = {"first": [], "later": []}
        for prev, x, nxt in zip([None, *xs], xs, xs[1:]):
            if x[4] == BLOCK:
                blocks["first" if prev is not None and prev[4] == ITEM else "later"].append((nxt[0] - x[0]) * us)
        for kind, times in blocks.items():
            if times:
                out[f"thread {tid}: a block, {kind} in its item"] = statistics.median(times)
        ends.append(xs[-1][0])
    if len(ends) > 1:
        out["tail (one thread's end to the other's)"] = (max(ends) - min(ends)) * us
    return out


def profile(backend: str, dtype_name: str, length: int, steps: int, gap: float) -> dict[str, dict[str, float]]:
    """{"cold"|"hot": {part: median us}} of ``steps`` public steps of one cache."""
    import torch  # noqa: PLC0415 (after GQA_KERNEL_STAMPS is set, in main)

    from backends import native  # noqa: PLC0415
    from backends.contract import CacheSpec  # noqa: PLC0415
    from backends.policy import EvictionPolicy  # noqa: PLC0415
    from backends.registry import get_backend  # noqa: PLC0415
    from tests.bench.common import Evictor  # noqa: PLC0415

    kernel = native.load()
    if not kernel.stamps:
        raise SystemExit("the loaded library has no stamps: run with GQA_KERNEL_STAMPS=1 (main sets it)")
    lib = kernel._lib
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    cache = get_backend(backend).create_cache(CacheSpec(1, HQ, HKV, D, dtype, EvictionPolicy.none(length + 4)))
    kv = [torch.randn(1, HKV, length, D, generator=gen).to(dtype) for _ in range(2)]
    cache.prefill(*kv)
    q, k, v = (torch.randn(1, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    evict = Evictor()
    out = {}
    for mode in ("cold", "hot"):
        seen = collections.defaultdict(list)
        for _ in range(steps):
            if mode == "cold":
                time.sleep(gap)
                evict()
            else:
                cache.step(q, k, v)
                cache.rollback(1)
            lib.gqa_stamps_reset()
            t0 = time.perf_counter()
            cache.step(q, k, v)
            wall_us = (time.perf_counter() - t0) * 1e6
            cache.rollback(1)
            first = ctypes.c_void_p()
            n = min(lib.gqa_stamps(ctypes.byref(first)), 1 << 20)
            stamps = [(s.ns, s.tid, s.item, s.block, s.kind) for s in (Stamp * n).from_address(first.value)]
            for name, value in {"public step": wall_us, **parts(stamps, wall_us)}.items():
                seen[name].append(value)
        out[mode] = {name: statistics.median(values) for name, values in seen.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "int8"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--gap", type=float, default=0.02, help="seconds before each cold step's eviction")
    args = ap.parse_args(argv)
    os.environ["GQA_KERNEL_STAMPS"] = "1"  # before the library is loaded: its own build
    got = profile(args.backend, args.dtype, args.length, args.steps, args.gap)
    print(f"{args.backend} {args.dtype} S={args.length}, {args.steps} steps each, cold after {args.gap} s: medians, us")
    names = list(dict.fromkeys([*got["cold"], *got["hot"]]))
    width = max(len(n) for n in names)
    print(f"{'part':{width}}  {'cold':>9}  {'hot':>9}")
    for name in names:
        cells = [f"{got[m][name]:9.1f}" if name in got[m] else f"{'-':>9}" for m in ("cold", "hot")]
        print(f"{name:{width}}  {'  '.join(cells)}")


if __name__ == "__main__":
    main()
