"""A probe, not a target: two or more builds of the service timed against each other over
loopback, for changes to the service's own per-step work.

    .venv/bin/python -m tests.bench.service_ab [--streams 1] [--rounds 30] [--steps N] A B [C ...]

Each variant is a server in its own process (``bench_service``'s, metrics on as deployed,
computing every step), one of:

- ``same``: this checkout as it is;
- ``dir:PATH``: the checkout at PATH (a ``git worktree`` of another revision), run from there;
- ``file:PATH``: this checkout with the Python file at PATH run in the server before it starts
  (a monkeypatch: what an ablation removes or replaces).

Round after round, each server in turn (in a new random order every round) gets ``--streams``
closed-loop Decode streams at S=1 for ``--steps`` steps each (``bench_service.drive``). Printed
per variant: the medians of its server's CPU a step, its steps/s and its p50 round trip, and
the median [p10-p90] of its per-round ratios to the first variant's.

On the 2-vCPU VMs this project runs on, the clients share the server's cores and a ratio moves by
about +-4% from one run to the next even at 40-100 rounds, while an A/A (``same same``) reads
within ~1%: a difference under ~5% needs several runs (docs/design.md, "Where a Decode step's
time goes beside the echo server's").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

from .bench_service import SERVICE_SERVER, drive
from .common import fmt_spread, spread, start_server, stop_server

# bench_service's server, with a file run first when the variant names one
SERVER = SERVICE_SERVER.replace(
    "async def main():",
    "import os\nif os.environ.get('GQA_AB_FILE'):\n    exec(open(os.environ['GQA_AB_FILE']).read())\n\nasync def main():",
    1,
)
FIGURES = ("server_cpu_us", "steps_per_s", "p50_us")


def _start(variant: str):
    kind, _, path = variant.partition(":")
    if kind == "same" and not path:
        return start_server(["-c", SERVER], metrics=True, env={"GQA_AB_FILE": ""})
    if kind == "dir" and os.path.isdir(path):
        return start_server(["-c", SERVER], metrics=True, cwd=path, env={"GQA_AB_FILE": ""})
    if kind == "file" and os.path.isfile(path):
        return start_server(["-c", SERVER], metrics=True, env={"GQA_AB_FILE": os.path.abspath(path)})
    raise SystemExit(f"service_ab: {variant!r} is not same, dir:PATH (a directory) or file:PATH (a file)")


def compare(variants: list[str], *, streams: int = 1, rounds: int = 30, steps: int | None = None) -> list[str]:
    """The report's lines (see the module docstring)."""
    steps = steps or (600 if streams == 1 else max(10, 9600 // streams))
    servers = {}
    loop = asyncio.new_event_loop()
    try:
        for v in variants:
            servers[v] = _start(v)
        figures = {v: [] for v in variants}
        for v in variants:  # a warm-up round each
            proc, address = servers[v]
            loop.run_until_complete(drive(address, 1, streams, proc.pid, steps))
        for _ in range(rounds):
            for v in random.sample(variants, len(variants)):
                proc, address = servers[v]
                figures[v].append(loop.run_until_complete(drive(address, 1, streams, proc.pid, steps)))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
        loop.close()
    first = figures[variants[0]]
    lines = [f"{streams} stream(s) at S=1, {rounds} rounds of {steps} steps a stream, ratios to {variants[0]}"]
    for v in variants:
        medians = [spread([r[k] for r in figures[v]])[0] for k in FIGURES]
        ratios = [fmt_spread([a[k] / b[k] for a, b in zip(figures[v], first)]) for k in FIGURES]
        lines.append(
            f"{v}: server CPU {medians[0]:.1f} us a step ({ratios[0]}), {medians[1]:.0f} steps/s ({ratios[1]}), "
            f"p50 {medians[2]:.0f} us ({ratios[2]})"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.service_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="same, dir:PATH or file:PATH; the first is the reference")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=None, help="steps a stream a round")
    args = parser.parse_args(argv)
    if len(args.variants) < 2:
        parser.error("give at least two variants")
    for line in compare(args.variants, streams=args.streams, rounds=args.rounds, steps=args.steps):
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
