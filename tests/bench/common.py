"""Shared helpers for the benchmarks: timing (one loop, ``sample_seconds``, under every figure),
tables, raw JSON output, servers in their own processes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import torch

from backends import host_memory
from tests.metrics_load import free_port

RESULTS_DIR = pathlib.Path(os.environ.get("GQA_BENCH_DIR", "bench-results"))


class WallClock:
    """``sample_seconds``' default clock: ``time.perf_counter`` read before and after."""

    now = staticmethod(time.perf_counter)

    @staticmethod
    def elapsed(start: float, end: float) -> float:
        return end - start


class CudaClock:
    """``sample_seconds``' clock on the GPU: CUDA events recorded on the current stream before
    and after, the second waited for; seconds of device time between them."""

    def __init__(self):
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self._next = 0

    def now(self) -> torch.cuda.Event:
        event = self._events[self._next]
        self._next ^= 1
        event.record()
        return event

    @staticmethod
    def elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


WALL = WallClock()


def sample_seconds(
    calls: list[Callable[[], object]],
    samples: int,
    *,
    per_sample: int = 1,
    before: Callable[[], object] | None = None,
    budget_s: float = math.inf,
    min_samples: int = 3,
    clock: WallClock | CudaClock = WALL,
) -> list[float]:
    """Seconds per call, ``samples`` times: each sample times ``per_sample`` calls in a row,
    ``calls[i % len(calls)]`` for i from 0 (copies of an input, each in its own memory, taking
    turns), and is their total over ``per_sample``. ``before`` runs untimed ahead of each sample
    (an ``Evictor``: a cold call). Fewer samples (at least ``min_samples``) once ``budget_s``
    has passed. Every timing in the benchmarks goes through this loop."""
    block = [calls[i % len(calls)] for i in range(per_sample)]
    now, elapsed = clock.now, clock.elapsed
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(samples):
        if before is not None:
            before()
        start = now()
        for fn in block:
            fn()
        end = now()
        out.append(elapsed(start, end) / per_sample)
        if len(out) >= min_samples and time.perf_counter() > deadline:
            break
    return out


def median_seconds(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3, budget_s: float = 5.0) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls (fewer if ``budget_s`` runs out)."""
    for _ in range(warmup):
        fn()
    return statistics.median(sample_seconds([fn], repeat, budget_s=budget_s))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block (a server's count), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


async def round_trips(
    call, requests: list[bytes], count: int, *, deadline: float = math.inf
) -> tuple[list[float], bytes]:
    """Seconds of up to ``count`` round trips on a raw-bytes bidirectional ``call`` (write a
    request, read its reply), ``requests`` in turn; none is started past ``deadline``
    (``time.perf_counter``). Returns the times and the last reply; ``RuntimeError`` when the
    server ends the call. The awaiting counterpart of ``sample_seconds``."""
    times, reply = [], b""
    for i in range(count):
        if time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        await call.write(requests[i % len(requests)])
        reply = await call.read()
        times.append(time.perf_counter() - t0)
        if reply is grpc.aio.EOF:
            raise RuntimeError("the server ended the call")
    return times, reply


_status_hook: Callable[[str], None] | None = None


def status(text: str) -> None:
    """Says what a benchmark is measuring now (e.g. ``status("float16 S=8192")``): shown beside
    the progress spinner of ``python -m tests.bench``; a no-op elsewhere."""
    if _status_hook is not None:
        _status_hook(text)


def set_status_hook(hook: Callable[[str], None] | None) -> None:
    global _status_hook
    _status_hook = hook


def percentile(values: list[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    k = min(len(data) - 1, max(0, round(q / 100 * (len(data) - 1))))
    return data[k]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of per-round figures."""
    return statistics.median(values), percentile(values, 10), percentile(values, 90)


def verdict(what: str, value: float, target: float, *, at_most: bool = True, unit: str = "x") -> str:
    """One line ``PASS``/``FAIL`` of a figure against an issue's target, e.g.
    ``verdict("float32 S=8192 / floor", 1.18, 1.25)`` -> ``PASS  float32 S=8192 / floor: 1.18x (target <= 1.25x)``."""
    ok = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    return f"{'PASS' if ok else 'FAIL'}  {what}: {value:.3g}{unit} (target {sign} {target:g}{unit})"


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c != c:
            return "-"
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


class Report:
    """Collects one benchmark module's raw records and writes them as JSON."""

    def __init__(self, name: str):
        self.name = name
        self.records: list[dict] = []

    def add(self, **record) -> None:
        self.records.append(record)

    def write(self) -> pathlib.Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{self.name}.json"
        meta = {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        path.write_text(json.dumps({"meta": meta, "records": self.records}, indent=1))
        return path


class HostSteal:
    """The share of this machine's CPU time its host gave to others while a benchmark ran: the
    ``steal`` column of ``/proc/stat`` (time a virtual CPU was ready to run but the hypervisor ran
    something else), over all the CPUs' time between ``__init__`` and ``share()``. A "quiet
    machine" (docs/benchmarks.md) has next to none; on a shared host it moves from minute to
    minute, and with it every timing, so each benchmark's summary line says it. None where the
    kernel does not report it (not Linux)."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        self._start = self.read()

    def read(self) -> tuple[int, int] | None:
        """(steal, total) jiffies of all CPUs since boot, or None."""
        try:
            with open(self.path) as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu":
            return None
        # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
        ticks = [int(x) for x in fields[1:9]]
        return ticks[7], sum(ticks)

    def share(self) -> float | None:
        end = self.read()
        if self._start is None or end is None or end[1] <= self._start[1]:
            return None
        return (end[0] - self._start[0]) / (end[1] - self._start[1])


def steal_note(share: float | None) -> str:
    """``", 12% of the CPU time stolen by the host"`` for a summary line ("" where unknown)."""
    return "" if share is None else f", {100 * share:.0f}% of the CPU time stolen by the host"


# -- cold-cache timing (docs/benchmarks.md): evict the last-level cache before every timed call ----


def bench_mode() -> str:
    """``GQA_BENCH_MODE``: ``smoke`` (tiny sizes, seconds: for the tests), ``default`` (what
    ``make bench`` runs) or ``long`` (more rounds and cases, for a figure to quote)."""
    mode = os.environ.get("GQA_BENCH_MODE", "default").strip().lower() or "default"
    if mode not in ("smoke", "default", "long"):
        raise ValueError(f"GQA_BENCH_MODE must be smoke, default or long, got {mode!r}")
    return mode


def llc_bytes() -> int:
    """The last-level cache's size (from sysfs; 32 MiB where it cannot be read)."""
    try:
        text = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1].upper()] if text[-1].isalpha() else int(text)
    except (OSError, ValueError, KeyError, IndexError):
        return 32 << 20


class Evictor:
    """Evicts the last-level cache by writing a buffer of ``factor`` times its size (in place,
    read-modify-write: plain stores, not the non-temporal ones a large ``memset`` may use,
    which would leave the cache as it was). A model's other layers do this between two steps
    of one layer: 32 layers of caches never fit in L3. At least 32 MiB counts as the cache
    (sysfs may list one slice of a larger one).

    The writes are numpy's on plain threads, one part of the buffer per core (every core's own
    L2 evicted too), joined before the timed call: not torch's, whose OpenMP workers spin for
    milliseconds after a parallel op (libgomp's wait policy) and took a core from whatever was
    timed next, unless it was torch's own (docs/design.md, "Long caches at the memory's speed":
    the compiled step ran up to 1.4x slower right after a torch eviction than after this one,
    torch's floor no faster)."""

    def __init__(self, factor: float = 3.0, nbytes: int | None = None):
        n = nbytes if nbytes is not None else int(factor * max(llc_bytes(), 32 << 20))
        self.nbytes = n
        self._buf = np.zeros(max(1, n // 4), dtype=np.int32)
        self._parts = np.array_split(self._buf, min(os.cpu_count() or 1, max(1, n >> 20)))

    @staticmethod
    def _write(part: np.ndarray) -> None:
        np.add(part, 1, out=part)

    def __call__(self) -> None:
        helpers = [threading.Thread(target=self._write, args=(p,)) for p in self._parts[1:]]
        for t in helpers:
            t.start()
        self._write(self._parts[0])
        for t in helpers:
            t.join()


# libgomp's workers spin for about 10 ms after a parallel op here (no OMP_WAIT_POLICY set;
# docs/design.md, "A timed call after torch's spinning workers"): a call timed sooner shares a
# core with them.
TORCH_SPIN_S = 0.02
_TORCH_WAKE = torch.ones(1 << 18)  # 1 MiB: summed on torch's threads, it wakes them
_TORCH_WAKE_SLOW_S = 0.002  # a wake op this long found a worker queued behind the caller
_TORCH_WAKE_TRIES = 8


def wake_torch_threads(
    op: Callable[[], object] = _TORCH_WAKE.sum, clock: Callable[[], float] = time.perf_counter
) -> int:
    """Wakes torch's intra-op workers for a timed torch call; returns the wake ops it took.

    A woken libgomp worker is at times queued on the CPU of the thread that woke it, which spins
    at the op's barrier, and runs only when the scheduler moves it, 4-12 ms later; it stays
    there for the next op too. One op before the timed call left 5-9 in 100 floor reads 8-12 ms
    long (docs/design.md, "torch's workers queued behind the caller"). So the op is repeated
    until one takes less than ``_TORCH_WAKE_SLOW_S`` (at most ``_TORCH_WAKE_TRIES``)."""
    for tries in range(1, _TORCH_WAKE_TRIES + 1):
        t0 = clock()
        op()
        if clock() - t0 < _TORCH_WAKE_SLOW_S:
            return tries
    return _TORCH_WAKE_TRIES


def hot_seconds(cache, q, k, v, *, calls: int, warmup: int = 5) -> float:
    """The median public step of ``cache`` (any backend's) hot: each step rolled back (untimed),
    so that every call steps the same length with the cache's bytes in the last-level cache.
    It waits ``TORCH_SPIN_S`` before the first step: the benchmarks call it right after cold
    rounds whose last call ran on torch's threads, and a step beside their spinning workers
    shares a core with them (docs/design.md, "The hot notes beside torch's workers")."""
    time.sleep(TORCH_SPIN_S)
    times = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        cache.step(q, k, v)
        t1 = time.perf_counter()
        cache.rollback(1)
        if i >= warmup:
            times.append(t1 - t0)
    return statistics.median(times)


def arithmetic_note(hot_s: float, floor_s: list[float], target: float, *, rate_of: int | None = None) -> list[str]:
    """The line under a failed step/floor verdict (bench_cpu's, bench_int8's) that says what the
    step's arithmetic leaves to its memory, from the step timed hot (its cache in the last-level
    cache: no DRAM to wait for) against the cold floor (the median of ``floor_s``). Past
    ``target``: no cold step of this kernel meets it on this machine, whatever its memory access,
    and the arithmetic is what to change. Within it: a cold step takes its hot time plus whatever
    of its reads the arithmetic does not hide, so meeting ``target`` needs at least the printed
    share of the floor's time under the arithmetic. ``rate_of``: ``hot_s`` is not this step's
    own (its cache does not fit in L3) but the hot time of the length ``rate_of``'s step scaled
    to this one's bytes, and the line says so."""
    reach = hot_s / statistics.median(floor_s)
    hot = (
        "hot (the cache in L3, no DRAM to wait for) the step takes"
        if rate_of is None
        else f"at S={rate_of}'s hot rate (its cache in L3) this step's arithmetic would take"
    )
    if reach > target:
        return [f"      {hot} {reach:.3g}x the floor: past {target:g}x before any memory is read, on this machine"]
    hidden = max(0.0, 1.0 - (target - reach))
    return [
        f"      {hot} {reach:.3g}x the floor: {target:g}x cold needs {hidden:.0%} of the floor's reads hidden "
        "under the arithmetic"
    ]


class HotNotes:
    """The notes under one encoding's failed step/floor lines (``arithmetic_note``), lengths in
    ascending order: a step whose bytes fit in three quarters of the last-level cache is timed
    hot (``time``), and a longer one's note reads the longest such step's hot rate, scaled to its
    bytes."""

    def __init__(self, calls: int):
        self.calls = calls
        self.rate: tuple[int, float] | None = None  # (S, bytes a second) of the longest step timed hot

    def time(self, s: int, nbytes: int, hot: Callable[..., float]) -> float | None:
        """``hot(calls=...)``'s seconds (``hot_seconds`` of the step at S) where ``nbytes`` fit
        in L3, its rate kept for the longer steps; None where they do not."""
        if nbytes > llc_bytes() * 3 // 4:
            return None
        hot_s = hot(calls=self.calls)
        self.rate = (s, nbytes / hot_s)
        return hot_s

    def under(self, verdict: str, nbytes: int, hot_s: float | None, floor_s: list[float], target: float) -> list[str]:
        """The note under ``verdict`` (none under a PASS): from the step's own hot time
        ``hot_s``, else from the kept rate, else none."""
        if not verdict.startswith("FAIL"):
            return []
        if hot_s is not None:
            return arithmetic_note(hot_s, floor_s, target)
        if self.rate is not None:
            return arithmetic_note(nbytes / self.rate[1], floor_s, target, rate_of=self.rate[0])
        return []


def cold_rounds(
    fns: dict[str, Callable[[], object]],
    evict: Callable[[], None],
    *,
    rounds: int,
    min_rounds: int = 3,
    budget_s: float = float("inf"),
    warmup: int = 1,
    on_torch_threads: tuple[str, ...] = ("floor", "sdpa"),
) -> dict[str, list[float]]:
    """Per-round seconds of each function, every call made right after ``evict()`` (not timed).
    The functions take turns round after round, so a drift of the machine hits all alike;
    ``rounds`` rounds, fewer (at least ``min_rounds``) once ``budget_s`` has passed.

    No call is slowed by another's threads. The functions named in ``on_torch_threads`` run on
    torch's intra-op threads, whose workers spin for milliseconds after each parallel op: such a
    call starts with them awake (small parallel ops after the eviction, untimed, until one runs
    at full speed: ``wake_torch_threads``; torch at its best, as in a run of its own ops), and
    any other call's eviction starts at least ``TORCH_SPIN_S`` after a torch call ended, when
    they have stopped spinning (else the call runs beside them on 2 cores)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    torch_ended = time.perf_counter()  # the warm-up's last call may have been torch's

    def ready_torch() -> None:
        evict()
        wake_torch_threads()

    def ready_other() -> None:
        wait = torch_ended + TORCH_SPIN_S - time.perf_counter()
        if wait > 0:  # then the eviction, which leaves the cores busy a moment before, as a model would
            time.sleep(wait)
        evict()

    for i in range(rounds):
        for name, fn in fns.items():
            on_torch = name in on_torch_threads
            samples[name] += sample_seconds([fn], 1, before=ready_torch if on_torch else ready_other)
            if on_torch:
                torch_ended = time.perf_counter()
        if i + 1 >= min_rounds and time.perf_counter() > deadline:
            break
    return samples


def per_round_ratio(a: list[float], b: list[float]) -> list[float]:
    """``a[i] / b[i]`` for each round: a ratio's spread is that of the per-round ratios."""
    return [x / y for x, y in zip(a, b)]


def fmt_spread(values: list[float], scale: float = 1.0) -> str:
    """``median [p10-p90]`` of ``values`` times ``scale``, three significant digits."""
    if not values:
        return "-"
    m, lo, hi = spread(values)
    return f"{_fmt(m * scale)} [{_fmt(lo * scale)}-{_fmt(hi * scale)}]"


def verdict_spread(what: str, values: list[float], target: float, *, at_most: bool = True) -> str:
    """``verdict`` of the median of per-round ``values``, with their p10-p90 appended."""
    m, lo, hi = spread(values)
    return f"{verdict(what, m, target, at_most=at_most)}  [p10-p90 {lo:.3g}-{hi:.3g}, {len(values)} rounds]"


def floor_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of float32 ones on the pages a cache's storage gets (``backends.host_memory``:
    2 MiB where the system allows). On 4 KiB pages (a plain ``torch.ones``) the same read ran
    8-60% slower here than the caches' bytes can be read, by an amount that changed from one
    buffer to the next: a floor below the machine's speed, which flattered every step measured
    against it (docs/design.md, "The floor on the caches' pages")."""
    return host_memory.zeros((max(1, nbytes // 4),), torch.float32).fill_(1.0)


def floor_reader(nbytes: int) -> Callable[[], object]:
    """The memory floor: one read of ``nbytes`` bytes (a ``floor_buffer``), a sum over them with
    torch's threads. Reading a buffer of the same size rather than the implementation's own
    storage keeps the floor independent of any cache's private layout: after an eviction both
    come from DRAM."""
    words = floor_buffer(nbytes)
    return lambda: words.sum()


def read_floor_seconds(
    nbytes: int, threads: int, *, repeat: int, budget_s: float, chunk_bytes: int = 256 << 20
) -> float:
    """Reading ``nbytes`` once from DRAM with ``threads`` torch threads, for a figure measured
    without ``cold_rounds``: a ``floor_reader`` of ``min(nbytes, chunk_bytes)`` (256 MiB: 8x any
    L3 here, so every pass comes from DRAM) read as many times as it takes, the median of
    ``repeat`` timings (one warm-up) scaled to ``nbytes``."""
    chunk = min(nbytes, chunk_bytes)
    passes = max(1, round(nbytes / chunk))
    read = floor_reader(chunk)

    def read_all():
        for _ in range(passes):
            read()

    with torch_threads(threads):
        return median_seconds(read_all, repeat=repeat, warmup=1, budget_s=budget_s) * nbytes / (passes * chunk)


def hot_rounds(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    calls: int = 15,
    warmup: int = 3,
    min_rounds: int = 3,
    budget_s: float = float("inf"),
) -> dict[str, list[float]]:
    """Per-round seconds of each function, hot: each round, each function in turn makes
    ``warmup`` calls then ``calls`` calls in a row, and the round's figure is their median (a
    block, so that one implementation's idle threads, still spinning, do not land on the
    next one's single call); fewer rounds (at least ``min_rounds``) once ``budget_s`` has passed."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    for i in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_seconds(fn, repeat=calls, warmup=warmup, budget_s=float("inf")))
        if i + 1 >= min_rounds and time.perf_counter() > deadline:
            break
    return samples


# -- servers in their own processes, on loopback ------------------------------------------------


def start_server(
    args: list[str], *, metrics: bool = False, cwd: str | None = None, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """``python *args`` in its own process (in ``cwd``, with ``env`` added to this one's),
    serving on a free loopback port it reads from ``GQA_ADDRESS`` (warnings only, as gqa-serve
    reads them), and its address once it accepts calls; stop it with ``stop_server``. Metrics
    off, or with ``metrics`` on as deployed (recorded, and served on another free port:
    ``proc.metrics_port``, 0 when off)."""
    address = f"127.0.0.1:{free_port()}"
    metrics_port = str(free_port()) if metrics else "0"
    env = dict(os.environ, **(env or {}), GQA_ADDRESS=address, GQA_METRICS_PORT=metrics_port, GQA_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, cwd=cwd)
    proc.metrics_port = int(metrics_port)
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
    except BaseException:
        stop_server(proc)
        raise
    return proc, address


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(20)
