"""Where a CUDA decode step's time goes: the device's work against the host's (run by
``tests/gpu_check.sh`` after the benchmark; not a ``bench_*`` module).

``gpu_bench`` times back-to-back calls with CUDA events; when the host takes longer to issue a
call than the device takes to run it, that figure is the host's. This script separates the two,
B=1, Hq=32, Hkv=8, D=128, float16:

- device: the call captured once in a CUDA graph and replayed (no Python, no launch binding),
  timed with CUDA events per replay;
- host: wall time per call issued back to back without waiting, and a profile by function of
  those calls (``cProfile``, own time), for ``decode_attention``, SDPA and ``step_many`` over 64
  short caches.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys

import torch

from .common import CudaClock, sample_seconds

HQ, HKV, D = 32, 8, 128
DTYPE = torch.float16
CALLS = 200


def device_us(fn) -> float:
    """Per call, from a CUDA graph of ``fn`` replayed ``CALLS`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    (seconds,) = sample_seconds([graph.replay], 1, per_sample=CALLS, clock=CudaClock())
    return seconds * 1e6


def host_us(fn) -> float:
    """Wall time per call issued back to back (the device may still be working when it ends)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    (seconds,) = sample_seconds([fn], 1, per_sample=CALLS)  # the wall clock: no wait on the device
    torch.cuda.synchronize()
    return seconds * 1e6


def profile(name: str, fn, top: int = 14) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"-- {name}: {CALLS} calls, own time by function --", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def section(title: str, body) -> None:
    print(f"== {title} ==", flush=True)
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - one section's failure must not hide the others
        print(f"   failed: {type(exc).__name__}: {exc}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device here; nothing measured")
        return 2
    from backends import triton_decode as td
    from backends.cuda import sdpa_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = {}
    for s in (2048, 32768):
        q = torch.randn(1, HQ, D, device="cuda", generator=gen).to(DTYPE)
        k, v = (torch.randn(HKV, s, D, device="cuda", generator=gen).to(DTYPE) for _ in range(2))
        runs = [(0, s)]
        ours = functools.partial(td.decode_attention, q, k, v, runs, num_kv_heads=HKV)
        sdpa = functools.partial(sdpa_attention, q, k.view(1, HKV, s, D), v.view(1, HKV, s, D), runs)
        calls[s] = ours

        def one(s=s, ours=ours, sdpa=sdpa):
            splits = td.plan_splits(s, HKV, td._num_sms(torch.device("cuda")))[0]
            print(f"S={s}: {splits} splits", flush=True)
            for name, fn in (("triton", ours), ("sdpa", sdpa)):
                section(f"S={s} {name}: host us per call issued", lambda fn=fn: print(f"   {host_us(fn):.1f}"))
                section(
                    f"S={s} {name}: device us per call (graph replay)", lambda fn=fn: print(f"   {device_us(fn):.1f}")
                )

        section(f"B=1 S={s}: device and host time per call", one)
    section("decode_attention, S=2048: host profile", lambda: profile("decode_attention", calls[2048]))

    def batched():
        from backends.batch import BatchStep, step_many
        from backends.contract import CacheSpec
        from backends.cuda import CUDACache
        from backends.policy import EvictionPolicy

        steps = []
        for j in range(64):
            s = 1 + j
            cache = CUDACache(CacheSpec(1, HQ, HKV, D, DTYPE, EvictionPolicy.strict(s), device="cuda"))
            cache.prefill(*(torch.randn(1, HKV, s, D, device="cuda", generator=gen).to(DTYPE) for _ in range(2)))
            steps.append(
                BatchStep(
                    cache, *(torch.randn(1, h, D, device="cuda", generator=gen).to(DTYPE) for h in (HQ, HKV, HKV))
                )
            )
        many = functools.partial(step_many, steps)
        print(f"step_many, 64 caches of 1-64 rows: host {host_us(many):.1f} us per call issued", flush=True)
        profile("step_many (64 short caches)", many, top=20)

    section("step_many over 64 short caches: host profile", batched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
