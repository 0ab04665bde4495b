"""Shared helpers for the benchmarks: timing by medians, tables, raw JSON output."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable

import torch

RESULTS_DIR = pathlib.Path(os.environ.get("GQA_BENCH_DIR", "bench-results"))


def median_seconds(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3,
                   budget_s: float = 5.0) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls (fewer if ``budget_s`` runs out)."""
    for _ in range(warmup):
        fn()
    times = []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times)


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
