"""Benchmarks (``make bench``): never timed tests. Each ``bench_*.py`` module here exposes
``run(report: Report) -> None``; ``python -m tests.bench [name ...]`` runs them in one process,
prints their tables and writes the raw numbers to ``bench-results/<name>.json``."""
