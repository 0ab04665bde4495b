"""The batched step: 64 caches' steps in one ``backends.batch.step_many`` call, against the same
64 steps as separate ``cache.step`` calls and against the floor of all their bytes.

B=1, Hq=32, Hkv=8, D=128 per cache, policy none, for every encoding (cpu float32, bfloat16,
float16; int8 with float32 tensors). Two cases (issue #14):

- ``short``: 64 caches holding 1, 2, ..., 64 tokens: the fixed cost of a step, amortised.
- ``mixed``: 64 caches of lengths drawn uniformly from 1 to 4096 (seeded): the work split by
  bytes across threads.

Timed, the three in turn round after round, every call after writing a buffer of 3x the
last-level cache (``common.Evictor``): ``step_many`` (one call for the 64 steps), ``separate``
(a Python loop of the 64 public ``cache.step`` calls, one eviction before the loop), ``floor``
(reading the bytes the 64 steps attend, ``row_bytes`` per position, once from DRAM: a sum over
them viewed as float32 words with the same threads, ``common.floor_reader``). Both batched and
separate calls append to the same caches (a token per call: two per round, out of thousands).

``GQA_BENCH_MODE=long`` runs more rounds; ``smoke`` runs tiny sizes (the tests' import check).
"""

from __future__ import annotations

import torch

from backends import native
from backends.base import CacheSpec, StepOutcome
from backends.batch import BatchStep, step_many
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
SHORT_TARGET = 3.0  # separate / step_many, at least
MIXED_TARGET = 1.3  # step_many / floor, at most

MODES = {
    # budget_s: seconds after which a case stops at 3 rounds (a loaded machine must not stretch
    # `make bench`)
    "smoke": dict(
        caches=8, short_max=8, mixed_max=256, short_rounds=2, mixed_rounds=2, budget_s=1.0, evict_bytes=1 << 20
    ),
    "default": dict(
        caches=64, short_max=64, mixed_max=4096, short_rounds=25, mixed_rounds=7, budget_s=6.0, evict_bytes=None
    ),
    "long": dict(
        caches=64, short_max=64, mixed_max=4096, short_rounds=81, mixed_rounds=25, budget_s=90.0, evict_bytes=None
    ),
}


def _label(backend: str, dtype: torch.dtype) -> str:
    return f"{backend} {str(dtype).removeprefix('torch.')}"


def _lengths(case: str, cfg: dict, gen) -> list[int]:
    n = cfg["caches"]
    if case == "short":
        return [1 + i * (cfg["short_max"] - 1) // max(1, n - 1) for i in range(n)]
    return torch.randint(1, cfg["mixed_max"] + 1, (n,), generator=gen).tolist()


def _batch(backend: str, dtype: torch.dtype, lengths: list[int], headroom: int, gen) -> list[BatchStep]:
    """One cache per length, prefilled from one random block (prefill copies it), and a step's
    tensors for each."""
    top = max(lengths)
    keys = torch.randn((B, HKV, top, D), generator=gen).to(dtype)
    values = torch.randn((B, HKV, top, D), generator=gen).to(dtype)
    steps = []
    for s in lengths:
        cache = get_backend(backend).create_cache(CacheSpec(B, HQ, HKV, D, dtype, EvictionPolicy.none(s + headroom)))
        cache.prefill(keys[:, :, :s], values[:, :, :s])
        steps.append(
            BatchStep(
                cache,
                torch.randn((B, HQ, D), generator=gen).to(dtype),
                torch.randn((B, HKV, D), generator=gen).to(dtype),
                torch.randn((B, HKV, D), generator=gen).to(dtype),
            )
        )
    return steps


def _separate(batch: list[BatchStep]) -> None:
    for st in batch:
        st.cache.step(st.query, st.new_key, st.new_value)


def measure(backend, dtype, case, cfg, evict, gen, report) -> dict[str, list[float]]:
    rounds = cfg[f"{case}_rounds"]
    lengths = _lengths(case, cfg, gen)
    batch = _batch(backend, dtype, lengths, 2 * (rounds + 2) + 2, gen)
    floor_bytes = sum(st.cache.row_bytes * (s + 1) for st, s in zip(batch, lengths))
    fns = {
        "step_many": lambda: step_many(batch),
        "separate": lambda: _separate(batch),
        "floor": floor_reader(floor_bytes),
    }
    t = cold_rounds(fns, evict, rounds=rounds, budget_s=cfg["budget_s"])
    refused = [r for r in step_many(batch) if not isinstance(r, StepOutcome)]
    assert not refused, f"step_many refused a step of the benchmark: {refused[0]!r}"
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
        for case in ("short", "mixed"):
            t = measure(backend, dtype, case, cfg, evict, gen, report)
            amortised = per_round_ratio(t["separate"], t["step_many"])
            over = per_round_ratio(t["step_many"], t["floor"])
            span = f"1-{cfg['short_max']}" if case == "short" else f"1-{cfg['mixed_max']}"
            rows.append(
                [_label(backend, dtype), case, span]
                + [spread(t[k])[0] * 1e3 for k in t]
                + [fmt_spread(amortised), fmt_spread(over)]
            )
            if case == "short":
                verdicts.append(
                    verdict_spread(
                        f"{_label(backend, dtype)} {n} short caches separate/step_many",
                        amortised,
                        SHORT_TARGET,
                        at_most=False,
                    )
                )
            else:
                verdicts.append(
                    verdict_spread(f"{_label(backend, dtype)} {n} mixed caches step_many/floor", over, MIXED_TARGET)
                )
            print(f"  {_label(backend, dtype)} {case}: {len(t['floor'])} rounds", flush=True)
    print(f"\n{n} steps in one step_many call from a cold L3, against {n} separate cache.step calls and the floor")
    print(
        "legend: 'S' the caches' lengths; 'ms' median milliseconds for all the steps; 'separate/step_many' the "
        "loop's time over the batched call's (>1: batched faster), 'step_many/floor' the batched call's over "
        "reading their bytes once, median [p10-p90] of per-round ratios"
    )
    print(
        table(
            ["cache", "case", "S", "step_many ms", "separate ms", "floor ms", "separate/step_many", "step_many/floor"],
            rows,
        )
    )
    print("\n".join(verdicts))
