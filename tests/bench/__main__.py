"""Runs the benchmark modules: ``python -m tests.bench [name ...]`` (default: all)."""

from __future__ import annotations

import importlib
import pathlib
import sys
import time

from .common import Report

HERE = pathlib.Path(__file__).parent


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    for name in names:
        module = importlib.import_module(f"tests.bench.bench_{name}")
        report = Report(name)
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        module.run(report)
        path = report.write()
        print(f"[{name}: {time.perf_counter() - t0:.0f} s, raw numbers in {path}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
