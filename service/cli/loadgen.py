"""``gqa-serve bench``: a load generator against any running server.

Opens ``--streams`` Decode streams (each layer prefilled with ``--context`` tokens), then keeps
``--concurrency`` steps in flight, one per stream at a time, for ``--duration`` seconds or
``--steps`` steps in all. Every step's round trip is timed on this side; every reply carries the
server's compute time (``compute_ns``). Prints a summary block; ``--json`` writes the results and
``--plot`` a PNG (round-trip histogram, throughput over time).

The progress bar needs ``rich`` and the plot ``matplotlib``: ``pip install 'gqa-serve[loadgen]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import importlib.util
import json
import math
import pathlib
import sys
import time

__all__ = ["add_command", "LoadConfig", "run_load", "summarize", "plot"]

INSTALL_HINT = "pip install 'gqa-serve[loadgen]'"


@dataclasses.dataclass
class LoadConfig:
    streams: int = 4
    concurrency: int = 0
    """Steps in flight at once (at most one per stream); 0: one per stream."""
    context: int = 1024
    layers: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    policy: str = "strict"
    window: int = 0
    """0: the context plus one (every step attends the whole prefill)."""
    capacity: int = 0
    sink_tokens: int = 4
    dtype: str = "float32"
    backend: str = ""
    duration_s: float = 10.0
    steps: int = 0
    """Total steps; when set it replaces the duration."""
    seed: int = 0

    @property
    def in_flight(self) -> int:
        return min(self.streams, self.concurrency or self.streams)

    def resolved(self) -> dict:
        """The fields as the load runs them: ``concurrency`` steps in flight and the ``window``
        and ``capacity`` each stream opens with (0 where the policy has none, or the server
        chooses: strict and sink take C from W), not the flags' 0 meaning "the default"."""
        kw = self.open_kwargs()
        return {
            **dataclasses.asdict(self),
            "concurrency": self.in_flight,
            "window": kw["window"],
            "capacity": kw["capacity"],
        }

    def open_kwargs(self) -> dict:
        window = self.window or self.context + 1
        capacity = self.capacity
        if not capacity and self.policy == "none":
            per_stream = -(-self.steps // self.streams) if self.steps else 4096
            capacity = self.context + per_stream
        elif not capacity and self.policy == "greedy":
            capacity = window + max(1, window // 2)
        return dict(
            num_query_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_layers=self.layers,
            dtype=self.dtype,
            policy=self.policy,
            window=0 if self.policy == "none" else window,
            capacity=capacity,
            sink_tokens=self.sink_tokens if self.policy == "sink" else 0,
            backend=self.backend,
        )


@dataclasses.dataclass
class LoadResult:
    config: LoadConfig
    started: float
    elapsed_s: float
    ends: list[float]
    """Seconds from the start at which each successful step's reply came."""
    round_trips: list[float]
    computes: list[float]
    errors: collections.Counter


async def run_load(client, config: LoadConfig, *, progress=None) -> LoadResult:
    """Runs the load on an ``AsyncClient``; ``progress(done)`` is called as steps complete."""
    from gqa_client import CallFailed, GqaError

    kw = config.open_kwargs()
    prefill, inputs = _tensors(config)

    async def open_stream():
        return await client.open(**kw, prefill=prefill)

    streams = [await open_stream() for _ in range(config.streams)]
    ends: list[float] = []
    round_trips: list[float] = []
    computes: list[float] = []
    errors: collections.Counter = collections.Counter()
    started = time.perf_counter()
    deadline = started + config.duration_s if not config.steps else math.inf
    budget = [config.steps or math.inf]

    async def worker(mine: list):
        i = 0
        while mine:
            if budget[0] <= 0 or time.perf_counter() >= deadline:
                return
            budget[0] -= 1
            slot = i % len(mine)
            stream = mine[slot]
            query, key, value = inputs[i % len(inputs)]
            i += 1
            t0 = time.perf_counter()
            try:
                result = await stream.step(i % config.layers, query, key, value)
            except CallFailed as exc:  # the stream is gone: count it, reopen once
                errors[exc.code.name] += 1
                try:
                    mine[slot] = await open_stream()
                except GqaError as again:
                    errors[again.code.name] += 1
                    mine.pop(slot)
                continue
            except GqaError as exc:  # refused in-band: the stream goes on
                errors[exc.code.name] += 1
                continue
            t1 = time.perf_counter()
            ends.append(t1 - started)
            round_trips.append(t1 - t0)
            computes.append(result.compute_ns / 1e9)
            if progress is not None:
                progress(len(ends))

    n = config.in_flight
    groups = [streams[w::n] for w in range(n)]
    await asyncio.gather(*(worker(g) for g in groups))
    elapsed = time.perf_counter() - started
    for stream in streams:
        stream.cancel()
    return LoadResult(config, started, elapsed, ends, round_trips, computes, errors)


def _tensors(config: LoadConfig) -> tuple[dict | None, list]:
    """The prefill (``config.context`` tokens, the same for every layer) and 16 step inputs,
    reused: the load measures the service, not this client's RNG."""
    import torch

    dtype = getattr(torch, config.dtype)
    generator = torch.Generator().manual_seed(config.seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    prefill = None
    if config.context:
        kv = (
            rnd(1, config.kv_heads, config.context, config.head_dim),
            rnd(1, config.kv_heads, config.context, config.head_dim),
        )
        prefill = {layer: kv for layer in range(config.layers)}
    inputs = [
        (
            rnd(1, config.heads, config.head_dim),
            rnd(1, config.kv_heads, config.head_dim),
            rnd(1, config.kv_heads, config.head_dim),
        )
        for _ in range(16)
    ]
    return prefill, inputs


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    data = sorted(values)
    return data[min(len(data) - 1, max(0, round(q / 100 * (len(data) - 1))))]


def summarize(result: LoadResult, address: str) -> dict:
    ok = len(result.round_trips)
    summary = {
        "address": address,
        "config": result.config.resolved(),
        "elapsed_s": result.elapsed_s,
        "steps_ok": ok,
        "errors": dict(result.errors),
        "steps_per_s": ok / result.elapsed_s if result.elapsed_s > 0 else 0.0,
    }
    for q in (50, 90, 99):
        summary[f"round_trip_p{q}_ms"] = _pct(result.round_trips, q) * 1e3
    for q in (50, 90, 99):
        summary[f"compute_p{q}_ms"] = _pct(result.computes, q) * 1e3
    # steps per second over time, in full bins of about 1/30 of the run (at least 0.25 s)
    width = max(0.25, result.elapsed_s / 30)
    counts = collections.Counter(int(t / width) for t in result.ends)
    summary["throughput_bin_s"] = width
    summary["throughput_steps_per_s"] = [counts.get(i, 0) / width for i in range(int(result.elapsed_s / width))]
    return summary


def format_summary(summary: dict) -> str:
    c = summary["config"]
    errors = summary["errors"]
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) if errors else "none"
    policy = c["policy"] + ("" if c["policy"] == "none" else f" W={c['window']}")

    def ms(key):
        value = summary[key]
        return "-" if value != value else f"{value:.3f} ms"

    return "\n".join(
        [
            f"gqa-serve bench against {summary['address']}: {c['streams']} streams, {c['concurrency']} "
            f"in flight, context {c['context']}, {policy}, {c['dtype']}, Hq={c['heads']} Hkv={c['kv_heads']} "
            f"D={c['head_dim']}, {c['layers']} layer(s)",
            f"  steps            {summary['steps_ok']} ok in {summary['elapsed_s']:.1f} s; errors: {error_text}",
            f"  throughput       {summary['steps_per_s']:.1f} steps/s",
            f"  round trip       p50 {ms('round_trip_p50_ms')}   p90 {ms('round_trip_p90_ms')}   p99 {ms('round_trip_p99_ms')}",
            f"  server compute   p50 {ms('compute_p50_ms')}   p90 {ms('compute_p90_ms')}   p99 {ms('compute_p99_ms')}"
            "   (compute_ns of the replies)",
        ]
    )


def plot(result: LoadResult, summary: dict, path: str | pathlib.Path) -> None:
    """Two panels: the round-trip and compute histograms, and steps/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, rate) = plt.subplots(1, 2, figsize=(11, 4))
    if result.round_trips:
        rt = [x * 1e3 for x in result.round_trips]
        cp = [x * 1e3 for x in result.computes]
        top = max(_pct(rt, 99.5), 1e-3)
        bins = [top * i / 60 for i in range(61)]
        hist.hist(rt, bins=bins, alpha=0.7, label="round trip")
        hist.hist(cp, bins=bins, alpha=0.7, label="server compute")
        for q, style in ((50, "-"), (99, "--")):
            hist.axvline(
                summary[f"round_trip_p{q}_ms"], color="k", linestyle=style, linewidth=1, label=f"round trip p{q}"
            )
        hist.legend()
    hist.set_xlabel("ms per step")
    hist.set_ylabel("steps")
    hist.set_title("latency")
    series, width = summary["throughput_steps_per_s"], summary["throughput_bin_s"]
    rate.plot([(i + 0.5) * width for i in range(len(series))], series, marker="o")
    rate.set_xlabel("seconds since start")
    rate.set_ylabel("steps/s")
    rate.set_ylim(bottom=0)
    rate.set_title("throughput")
    c = summary["config"]
    fig.suptitle(f"{c['streams']} streams, context {c['context']}, {c['policy']}, {c['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the command ---------------------------------------------------------------------------------
def add_command(sub) -> None:
    from ..vocab import DTYPE_CHOICES, POLICY_CHOICES
    from .common import add_client_arguments, non_negative_int, plain, positive_int

    bench = sub.add_parser(
        "bench",
        help="load a running server: steps/s, round-trip and compute percentiles",
        description=plain(__doc__.split("\n\n")[1].replace("\n", " ")),
        epilog=f"Progress bar and plots: {INSTALL_HINT}.",
    )
    add_client_arguments(bench)
    load = bench.add_argument_group("load")
    load.add_argument("--streams", type=positive_int, default=4, help="streams to open (default %(default)s)")
    load.add_argument(
        "--concurrency",
        type=non_negative_int,
        default=0,
        help="steps in flight at once, at most one per stream (default: one per stream)",
    )
    load.add_argument(
        "--context",
        type=non_negative_int,
        default=1024,
        help="tokens prefilled in each layer of each stream (default %(default)s)",
    )
    load.add_argument("--layers", type=positive_int, default=1, help="layers per stream (default %(default)s)")
    load.add_argument("--heads", type=positive_int, default=32, help="query heads Hq (default %(default)s)")
    load.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads Hkv (default %(default)s)")
    load.add_argument("--head-dim", type=positive_int, default=128, help="head width D (default %(default)s)")
    load.add_argument(
        "--policy", choices=POLICY_CHOICES, default="strict", help="eviction policy (default %(default)s)"
    )
    load.add_argument("--window", type=non_negative_int, default=0, help="W (default: context + 1)")
    load.add_argument(
        "--capacity",
        type=non_negative_int,
        default=0,
        help="rows per layer (none: default context + steps per stream; greedy: 1.5 W)",
    )
    load.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="stream dtype (default %(default)s)")
    load.add_argument("--backend", default="", help="backend (default: the server's)")
    stop = load.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=10.0, help="seconds of load (default %(default)s)")
    stop.add_argument("--steps", type=positive_int, default=0, help="steps in all, instead of --duration")
    out = bench.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the summary and the throughput over time as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="write a PNG: latency histogram, throughput over time")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from gqa_client import GqaError

    from ..config import ConfigError
    from .common import EXIT_FAILURE, fail

    if args.heads % args.kv_heads:
        return fail(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.duration <= 0:
        return fail("--duration: must be positive")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return fail(f"--plot needs matplotlib: {INSTALL_HINT}")
    config = LoadConfig(
        streams=args.streams,
        concurrency=args.concurrency,
        context=args.context,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        policy=args.policy,
        window=args.window,
        capacity=args.capacity,
        dtype=args.dtype,
        backend=args.backend,
        duration_s=args.duration,
        steps=args.steps,
    )
    try:
        result = asyncio.run(_main(args, config))
    except ConfigError as exc:
        return fail(str(exc))
    except GqaError as exc:
        return fail(f"{args.address}: {exc.code.name}: {exc.message}", EXIT_FAILURE)
    summary = summarize(result, args.address)
    print(format_summary(summary))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
        print(f"  results          {args.json}")
    if args.plot:
        plot(result, summary, args.plot)
        print(f"  plot             {args.plot}")
    return 0 if result.round_trips else EXIT_FAILURE


async def _main(args: argparse.Namespace, config: LoadConfig) -> LoadResult:
    from gqa_client import AsyncClient

    from .common import client_from_args

    async with client_from_args(args, client_class=AsyncClient) as client:
        # one small call before the inputs are made (torch, ~2 s of CPU): a wrong address, a
        # server that is down or a refused token answers at once
        await client.server_info()
        bar = _progress(config, quiet=args.quiet)
        try:
            return await run_load(client, config, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()


class _Bar:
    """rich's progress bar on stderr, by time or by steps."""

    def __init__(self, config: LoadConfig):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.config = config
        self.progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            transient=True,
            console=_stderr_console(),
        )
        total = config.steps or config.duration_s
        self.task = self.progress.add_task("bench", total=total, rate="")
        self.start = time.perf_counter()
        self.last = 0.0
        self.progress.start()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < 0.1 and done != self.config.steps:
            return
        self.last = now
        elapsed = now - self.start
        completed = done if self.config.steps else min(elapsed, self.config.duration_s)
        self.progress.update(self.task, completed=completed, rate=f"{done} steps, {done / max(elapsed, 1e-9):.0f}/s")

    def close(self) -> None:
        self.progress.stop()


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _progress(config: LoadConfig, *, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None
    if importlib.util.find_spec("rich") is None:
        print(f"gqa-serve bench: no progress bar without rich ({INSTALL_HINT})", file=sys.stderr)
        return None
    return _Bar(config)
