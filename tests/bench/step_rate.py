"""A probe, not a target: the rate at which one long public step reads its cache, hot and cold.

    PYTHONPATH=$PWD:$PWD/clients/python .venv/bin/python -m tests.bench.step_rate \
        [--length S] [--threads N] [--kernel native|native-avx512|...]

For float32, bfloat16 and float16 dense caches (B=1, Hq=32, Hkv=8, D=128, strict window S, so
every step attends S positions) it times ``cache.step``: 60 steps back to back ("hot": the cache
in the last-level cache) and 60 each right after the benchmarks' ``Evictor`` ("cold", as in a
model). It prints the medians and the rate at which the step's keys and values were read, and the
cold steps' deciles. Comparing hot with cold, and one thread with two, says whether a step is
bound by its arithmetic or by memory (docs/design.md, "A Sapphire Rapids machine").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

from backends import native
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.policy import EvictionPolicy

from .common import Evictor, sample_seconds

HQ, HKV, D = 32, 8, 128
HOT, COLD = 60, 60


def measure(dtype: torch.dtype, length: int, kernel: str, evict: Evictor) -> str:
    gen = torch.Generator().manual_seed(0)
    cache = DenseCache(CacheSpec(1, HQ, HKV, D, dtype, EvictionPolicy.strict(length)), kernel)
    cache.prefill(*(torch.randn(1, HKV, length, D, generator=gen).to(dtype) for _ in range(2)))
    q, k, v = (torch.randn(1, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    step = functools.partial(cache.step, q, k, v)
    hot = sample_seconds([step], HOT)
    cold = sample_seconds([step], COLD, before=evict)
    nbytes = 2 * HKV * length * D * dtype.itemsize
    h, c = statistics.median(hot), statistics.median(cold)
    deciles = statistics.quantiles(cold, n=10, method="inclusive")
    return (
        f"{str(dtype)[6:]:9s} S={length} {cache.kernel}: hot {h * 1e3:.3f} ms ({nbytes / h / 1e9:.1f} GB/s), "
        f"cold {c * 1e3:.3f} ms ({nbytes / c / 1e9:.1f} GB/s); cold deciles ms "
        + " ".join(f"{x * 1e3:.2f}" for x in deciles)
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=8192, help="positions attended (default 8192)")
    parser.add_argument("--threads", type=int, default=0, help="the kernel's pool (default: every core)")
    parser.add_argument("--kernel", default="auto", help="the cpu backend's kernel (default auto)")
    args = parser.parse_args(argv)
    if args.threads:
        native.set_threads(args.threads)
    evict = Evictor()
    print(f"kernel threads {native.threads()}, eviction {evict.nbytes >> 20} MiB", flush=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        print(measure(dtype, args.length, args.kernel, evict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
