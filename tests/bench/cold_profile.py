"""A probe, not a target: where a cold public step's time goes, by thread and by function.

    .venv/bin/python -m tests.bench.cold_profile [--backend cpu|int8] [--dtype float32]
        [--length 2048] [--steps 150] [--top 25] [--plane N]

A performance note must say where the time of a failing line goes. A sampling profile of a
benchmark is mostly the benchmark itself: the eviction between two cold calls takes ~25 ms and
the step below 1 ms. This probe keeps only the samples taken while a step ran. It runs ``perf
record`` (cpu-clock samples on the monotonic clock, every thread of the process) over a child
process. The child creates one cache (B=1, Hq=32, Hkv=8, D=128, policy none, prefilled to
``--length``) and makes ``--steps`` public ``cache.step`` calls, each after ``common.Evictor``
as in ``make bench``. With ``--plane N`` it times ``--steps`` cold ``CacheSet.step`` calls of
N short caches instead (issue #23's plane: ``bench_step_many``'s short case, lengths 1 to 16,
int8's past its calibration), rolled back after each. Each call's start and end on that clock
go to a file. Then ``perf script`` gives every sample's thread, time, function and library. Those inside a step are
counted, by thread (the caller, and the kernel pool's workers), by library and by function.
The step's own median time is printed beside them. It is inflated by the sampling, so compare
shares, not times, with ``make bench``.

Needs ``perf`` (Debian: linux-perf) and a ``kernel.perf_event_paranoid`` that lets a user
sample its own processes.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

HQ, HKV, D = 32, 8, 128
# `perf script -F tid,time,ip,sym,dso` without call chains (perf prints no function without
# the address): "  1234 5678.901234:      7f27e02c7f38 fn (/lib/x.so)"
_SAMPLE = re.compile(r"^\s*(\d+)\s+(\d+\.\d+):\s+[0-9a-f]+\s+(.*?)\s*\((.*)\)\s*$")


@dataclass
class Profile:
    """Samples taken inside the timed windows: in all, by thread id, by library and by
    (function, library)."""

    samples: int
    by_thread: collections.Counter
    by_library: collections.Counter
    by_function: collections.Counter


def windowed(lines: Iterable[str], windows: list[tuple[float, float]]) -> Profile:
    """The samples of ``perf script -F tid,time,ip,sym,dso`` output that fall inside one of the
    ``windows`` ((start, end) seconds on perf's clock, sorted, disjoint)."""
    starts = [a for a, _ in windows]
    threads, libraries, functions = collections.Counter(), collections.Counter(), collections.Counter()
    n = 0
    for line in lines:
        m = _SAMPLE.match(line)
        if not m:
            continue
        t = float(m.group(2))
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > windows[i][1]:
            continue
        library = os.path.basename(m.group(4)) or m.group(4)
        n += 1
        threads[int(m.group(1))] += 1
        libraries[library] += 1
        functions[(m.group(3) or "[unknown]", library)] += 1
    return Profile(n, threads, libraries, functions)


def report(profile: Profile, caller: int, top: int) -> str:
    """The three tables, in percent of the samples inside steps."""
    n = max(profile.samples, 1)
    out = [f"{profile.samples} samples inside steps"]
    out.append("by thread:")
    for tid, count in profile.by_thread.most_common():
        name = "the caller" if tid == caller else f"thread {tid} (a pool worker, or another)"
        out.append(f"  {100 * count / n:5.1f}%  {name}")
    out.append("by library:")
    for library, count in profile.by_library.most_common(top):
        out.append(f"  {100 * count / n:5.1f}%  {library}")
    out.append("by function:")
    for (function, library), count in profile.by_function.most_common(top):
        out.append(f"  {100 * count / n:5.1f}%  {function}  ({library})")
    return "\n".join(out)


def _child(args) -> None:
    """The profiled process: cold calls (public steps, or ``--plane``'s), each one's window
    appended to args.windows."""
    import torch  # noqa: PLC0415 (the parent needs neither torch nor the backends)

    from .common import Evictor  # noqa: PLC0415

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    call, undo = _plane_call(args, dtype, gen) if args.plane else _step_call(args, dtype, gen)
    call()  # the pool started, the code loaded
    undo()
    evict = Evictor(nbytes=args.evict_bytes)
    clock = time.CLOCK_MONOTONIC
    rows = []
    for _ in range(args.steps):
        evict()
        start = time.clock_gettime(clock)
        call()
        rows.append((start, time.clock_gettime(clock)))
        undo()
    with open(args.windows, "w") as f:
        f.write(f"{os.getpid()}\n")
        f.writelines(f"{a:.9f} {b:.9f}\n" for a, b in rows)


def _step_call(args, dtype, gen):
    """One cache prefilled to ``--length``: its public step, and the rollback that undoes it."""
    import torch  # noqa: PLC0415

    from backends.contract import CacheSpec  # noqa: PLC0415
    from backends.policy import EvictionPolicy  # noqa: PLC0415
    from backends.registry import get_backend  # noqa: PLC0415

    s = args.length
    keys = torch.randn(1, HKV, s + 1, D, generator=gen).to(dtype)
    values = torch.randn(1, HKV, s + 1, D, generator=gen).to(dtype)
    query = torch.randn(1, HQ, D, generator=gen).to(dtype)
    cache = get_backend(args.backend).create_cache(CacheSpec(1, HQ, HKV, D, dtype, EvictionPolicy.none(s + 8)))
    cache.prefill(keys[:, :, :s], values[:, :, :s])
    new_key, new_value = keys[:, :, s].clone(), values[:, :, s].clone()
    return (lambda: cache.step(query, new_key, new_value)), (lambda: cache.rollback(1))


def _plane_call(args, dtype, gen):
    """``--plane N`` short caches in a ``CacheSet`` (``bench_step_many``'s short case): one
    ``CacheSet.step`` of them all, and the rollback to their lengths."""
    from . import bench_step_many  # noqa: PLC0415 (imports torch and the backends)

    cfg = dict(bench_step_many.MODES["default"], caches=args.plane)
    batch = bench_step_many._Batch(
        args.backend, dtype, bench_step_many._lengths("short", cfg, gen, args.backend), 2, gen
    )
    return batch.plane, batch.reset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.cold_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "int8"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--length", type=int, default=2048, help="tokens in the cache before the step")
    parser.add_argument("--steps", type=int, default=150, help="cold steps sampled")
    parser.add_argument("--top", type=int, default=25, help="rows of the library and function tables")
    parser.add_argument("--frequency", type=int, default=10000, help="samples per second per thread")
    parser.add_argument("--plane", type=int, default=0, metavar="N", help="profile CacheSet.step of N short caches")
    parser.add_argument("--evict-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", metavar="WINDOWS", dest="windows", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows:
        _child(args)
        return 0
    perf = shutil.which("perf")
    if not perf:
        print("cold_profile: needs `perf` (Debian: linux-perf)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gqa-cold-profile-") as tmp:
        data, windows = os.path.join(tmp, "perf.data"), os.path.join(tmp, "windows.txt")
        child = [sys.executable, "-m", "tests.bench.cold_profile", "--child", windows]
        child += ["--backend", args.backend, "--dtype", args.dtype, "--length", str(args.length)]
        child += ["--steps", str(args.steps), "--plane", str(args.plane)]
        if args.evict_bytes is not None:
            child += ["--evict-bytes", str(args.evict_bytes)]
        record = [perf, "record", "-q", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock", "-F", str(args.frequency)]
        done = subprocess.run([*record, "-o", data, "--", *child], capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(windows):
            print(f"cold_profile: perf record failed: {done.stderr.strip()[-2000:]}", file=sys.stderr)
            return 1
        with open(windows) as f:
            caller = int(f.readline())
            spans = [tuple(float(x) for x in line.split()) for line in f if line.strip()]
        script = subprocess.run(
            [perf, "script", "-i", data, "-F", "tid,time,ip,sym,dso"], capture_output=True, text=True, check=True
        )
    profile = windowed(script.stdout.splitlines(), spans)
    step_us = statistics.median(b - a for a, b in spans) * 1e6
    what = (
        f"{args.plane} short caches in CacheSet.step: {len(spans)} cold calls"
        if args.plane
        else f"S={args.length}: {len(spans)} cold public steps"
    )
    print(f"{args.backend} {args.dtype}, {what}, median {step_us:.0f} us while sampled at {args.frequency}/s")
    print(report(profile, caller, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
