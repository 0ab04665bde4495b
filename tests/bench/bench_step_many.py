"""The step plane: 64 caches' steps in one ``backends.plane.CacheSet.step`` call (one native
call), against the same 64 steps as separate public ``cache.step`` calls and against the floor
of moving their bytes (issue #23's in-process targets).

B=1, Hq=32, Hkv=8, D=128 per cache, policy none, for every encoding (cpu float32, bfloat16,
float16; int8 with float32 tensors). Two cases:

- ``short``: 64 caches holding 1 .. 16 tokens: the fixed cost of a step, amortised (int8: 17 ..
  32, past the first 16 keys, which an int8 cache steps in Python while it calibrates).
- ``mixed``: 64 caches of lengths drawn uniformly from 1 to 4096 (seeded): the work split by
  bytes across threads.

Timed, the three in turn round after round, every call after writing a buffer of 3x the
last-level cache (``common.Evictor``): ``plane`` (``CacheSet.step`` of the 64 rows, packed
tensors in, the output written into one packed tensor), ``separate`` (a Python loop of the 64
public ``cache.step`` calls, one eviction before the loop), ``floor`` (the step's bytes moved
once from DRAM: the packed query, new key and new value copied into buffers of their size and
an output-sized buffer copied out, then the caches' resident rows plus the new one, ``row_bytes``
per position, read as float32 words with the same threads, ``common.floor_reader``). Both
batched and separate calls step the same caches, rolled back to their lengths before every call
(untimed).

Targets: short, every encoding: plane / floor <= 3 and separate / plane >= 4; mixed, float32
and bfloat16: plane / floor <= 1.3.

``GQA_BENCH_MODE=long`` runs more rounds; ``smoke`` runs tiny sizes (the tests' import check).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from backends import native
from backends.contract import CacheSpec
from backends.int8_calibration import CALIBRATION_TOKENS
from backends.plane import CacheSet
from backends.policy import EvictionPolicy
from backends.registry import get_backend

from .common import (
    Evictor,
    bench_mode,
    cold_rounds,
    floor_reader,
    fmt_spread,
    per_round_ratio,
    spread,
    table,
    verdict_spread,
)

B, HQ, HKV, D = 1, 32, 8, 128
ENCODINGS = (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float16), ("int8", torch.float32))
SHORT_SPEEDUP = 4.0  # separate / plane, at least
SHORT_FLOOR = 3.0  # plane / floor, at most
MIXED_TARGET = 1.3  # plane / floor, at most
MIXED_DTYPES = ("float32", "bfloat16")  # the mixed target's encodings (the others: figures only)

MODES = {
    # budget_s: seconds after which a case stops at 3 rounds (a loaded machine must not stretch
    # `make bench`)
    "smoke": dict(
        caches=8, short_max=8, mixed_max=256, short_rounds=2, mixed_rounds=2, budget_s=1.0, evict_bytes=1 << 20
    ),
    "default": dict(
        caches=64, short_max=16, mixed_max=4096, short_rounds=25, mixed_rounds=7, budget_s=6.0, evict_bytes=None
    ),
    "long": dict(
        caches=64, short_max=16, mixed_max=4096, short_rounds=81, mixed_rounds=25, budget_s=90.0, evict_bytes=None
    ),
}


def _label(backend: str, dtype: torch.dtype) -> str:
    return f"{backend} {str(dtype).removeprefix('torch.')}"


def _lengths(case: str, cfg: dict, gen, backend: str = "cpu") -> list[int]:
    n = cfg["caches"]
    if case == "short":
        # int8 caches below CALIBRATION_TOKENS keys step in Python while they choose their
        # outlier channels (backends/int8.py): the short int8 caches start just past it
        first = 1 if backend != "int8" else CALIBRATION_TOKENS + 1
        return [first + i * (cfg["short_max"] - 1) // max(1, n - 1) for i in range(n)]
    return torch.randint(1, cfg["mixed_max"] + 1, (n,), generator=gen).tolist()


class _Batch:
    """One cache per length (prefilled from one random block), in a ``CacheSet`` of one layer,
    and a step's packed tensors for all of them."""

    def __init__(self, backend: str, dtype: torch.dtype, lengths: list[int], headroom: int, gen):
        n, top = len(lengths), max(lengths)
        keys = torch.randn((B, HKV, top, D), generator=gen).to(dtype)
        values = torch.randn((B, HKV, top, D), generator=gen).to(dtype)
        self.caches, self.set = [], CacheSet(1)
        for s in lengths:
            cache = get_backend(backend).create_cache(
                CacheSpec(B, HQ, HKV, D, dtype, EvictionPolicy.none(s + headroom))
            )
            cache.prefill(keys[:, :, :s], values[:, :, :s])
            self.caches.append(cache)
            self.set.add([cache])
        self.slots = np.arange(n, dtype=np.int64)
        self.q = torch.randn((n, HQ, D), generator=gen).to(dtype)
        self.k = torch.randn((n, HKV, D), generator=gen).to(dtype)
        self.v = torch.randn((n, HKV, D), generator=gen).to(dtype)
        self.out = torch.empty((n, HQ, D), dtype=dtype)
        self.lengths = lengths

    def reset(self) -> None:
        """Every cache rolled back to its length (untimed, before each call): each timed call
        steps the same lengths."""
        for cache, s in zip(self.caches, self.lengths):
            cache.rollback(cache.tokens_seen - s)

    def plane(self):
        return self.set.step(0, self.slots, self.q, self.k, self.v, self.out)

    def separate(self) -> None:
        q, k, v = self.q, self.k, self.v
        for i, cache in enumerate(self.caches):
            cache.step(q[i : i + 1], k[i : i + 1], v[i : i + 1])

    def floor(self, resident_bytes: int):
        """The step's bytes moved once: q, k, v copied in, an output's worth copied out, the
        resident rows read."""
        q, k, v, o = self.q, self.k, self.v, self.out
        dq, dk, dv, do = (torch.empty_like(t) for t in (q, k, v, o))
        src = torch.empty_like(o)
        read = floor_reader(resident_bytes)

        def run():
            dq.copy_(q)
            dk.copy_(k)
            dv.copy_(v)
            do.copy_(src)
            return read()

        return run


def measure(backend, dtype, case, cfg, evict, gen, report) -> dict[str, list[float]]:
    rounds = cfg[f"{case}_rounds"]
    lengths = _lengths(case, cfg, gen, backend)
    batch = _Batch(backend, dtype, lengths, 2, gen)
    resident_bytes = sum(c.row_bytes * (s + 1) for c, s in zip(batch.caches, lengths))
    floor_bytes = resident_bytes + sum(t.nbytes for t in (batch.q, batch.k, batch.v, batch.out)) * 2
    fns = {"plane": batch.plane, "separate": batch.separate, "floor": batch.floor(resident_bytes)}

    def before():
        batch.reset()
        evict()

    t = cold_rounds(fns, before, rounds=rounds, budget_s=cfg["budget_s"])
    batch.reset()
    refused = batch.plane().refused
    assert not refused, f"the plane refused a step of the benchmark: {next(iter(refused.values()))!r}"
    report.add(
        kind=case,
        backend=backend,
        dtype=str(dtype).removeprefix("torch."),
        lengths=lengths,
        floor_bytes=floor_bytes,
        cold=True,
        **{f"{k}_s": v for k, v in t.items()},
    )
    return t


def _reach_note(t: dict[str, list[float]]) -> list[str]:
    """A line under a failed separate/plane verdict: how close to its floor the batched call
    would have to run for the line to pass (``SEPARATE / floor / SHORT_SPEEDUP``), against where it
    runs. Below 1 that means faster than moving its bytes once: out of reach as measured."""
    if statistics.median(per_round_ratio(t["separate"], t["plane"])) >= SHORT_SPEEDUP:
        return []
    reach = statistics.median(per_round_ratio(t["separate"], t["floor"]))
    need, now = reach / SHORT_SPEEDUP, statistics.median(per_round_ratio(t["plane"], t["floor"]))
    if need < 1:
        tail = "faster than moving its bytes once, out of reach on this machine as measured"
    else:
        tail = f"plane/floor <= {need:.2f}x (it is {now:.2f}x)"
    return [
        f"      the separate steps cost {reach:.3g}x the floor (separate/floor): >= {SHORT_SPEEDUP:g}x needs "
        f"the batched call {tail}"
    ]


def run(report) -> None:
    cfg = MODES[bench_mode()]
    evict = Evictor(nbytes=cfg["evict_bytes"])
    n = cfg["caches"]
    print(
        f"{n} caches of B={B}, Hq={HQ}, Hkv={HKV}, D={D}; threads: torch {torch.get_num_threads()}, kernel pool "
        f"{native.threads()}; {evict.nbytes >> 20} MiB written before every timed call (mode {bench_mode()})",
        flush=True,
    )
    rows, verdicts = [], []
    for backend, dtype in ENCODINGS:
        gen = torch.Generator().manual_seed(0)  # the same lengths for every encoding
        label = _label(backend, dtype)
        for case in ("short", "mixed"):
            t = measure(backend, dtype, case, cfg, evict, gen, report)
            amortised = per_round_ratio(t["separate"], t["plane"])
            over = per_round_ratio(t["plane"], t["floor"])
            short = _lengths("short", cfg, None, backend)
            span = f"{short[0]}-{short[-1]}" if case == "short" else f"1-{cfg['mixed_max']}"
            rows.append(
                [label, case, span] + [spread(t[k])[0] * 1e3 for k in t] + [fmt_spread(amortised), fmt_spread(over)]
            )
            if case == "short":
                verdicts.append(verdict_spread(f"{label} {n} short caches plane/floor", over, SHORT_FLOOR))
                verdicts.append(
                    verdict_spread(f"{label} {n} short caches separate/plane", amortised, SHORT_SPEEDUP, at_most=False)
                )
                verdicts.extend(_reach_note(t))
            elif str(dtype).removeprefix("torch.") in MIXED_DTYPES and backend == "cpu":
                verdicts.append(verdict_spread(f"{label} {n} mixed caches plane/floor", over, MIXED_TARGET))
            print(f"  {label} {case}: {len(t['floor'])} rounds", flush=True)
    print(f"\n{n} steps in one CacheSet.step call from a cold L3, against {n} separate cache.step calls and the floor")
    print(
        "legend: 'S' the caches' lengths; 'ms' median milliseconds for all the steps; 'separate/plane' the "
        "loop's time over the batched call's (>1: batched faster), 'plane/floor' the batched call's over "
        "moving the step's bytes once (q, k, v in, the output out, the resident rows read), median [p10-p90] "
        "of per-round ratios"
    )
    print(
        table(
            ["cache", "case", "S", "plane ms", "separate ms", "floor ms", "separate/plane", "plane/floor"],
            rows,
        )
    )
    print("\n".join(verdicts))
