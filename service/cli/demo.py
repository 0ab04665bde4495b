"""``gqa-serve demo``: one stream against a running server, N steps, round trip beside compute."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["run_demo", "percentile"]


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def _capacity(args: argparse.Namespace) -> int:
    if args.capacity:
        return args.capacity
    if args.policy == "none":
        return -(-args.steps // args.layers)  # room for every token of the busiest layer
    if args.policy == "greedy":
        return args.window + args.window // 2
    return 0


def run_demo(client, args: argparse.Namespace, out=sys.stdout) -> dict:
    """Runs the demo on ``client`` (a ``gqa_client.Client``); returns the figures in us."""
    stream = _open(client, args, out)
    import torch  # noqa: PLC0415 (after the open: no server, or a refused open, answers without torch's import)

    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    round_trips, computes = [], []
    evictions = evicted = 0
    last = None
    progress = _Progress(args.steps, out)
    with stream:
        for i in range(args.steps):
            query, key, value = (
                rnd(1, args.heads, args.head_dim),
                rnd(1, args.kv_heads, args.head_dim),
                rnd(1, args.kv_heads, args.head_dim),
            )
            t0 = time.perf_counter()
            last = stream.step(i % args.layers, query, key, value)
            round_trips.append(time.perf_counter() - t0)
            computes.append(last.compute_ns / 1e9)
            evictions += last.evicted
            evicted += last.evicted_tokens
            progress.show(i + 1)
    progress.end()
    print(
        f"{args.steps} steps: layer {last.layer} has seen {last.tokens_seen} tokens, keeps {last.resident} "
        f"(positions {last.first_position}..{last.last_position}); {evictions} steps evicted "
        f"{evicted} tokens in all; exact rollback reach now {last.rollback_reach}",
        file=out,
    )
    stats = _latencies(round_trips, computes, out)
    stats.update(evictions=evictions, evicted_tokens=evicted)
    return stats


def _open(client, args: argparse.Namespace, out):
    """Opens the demo's stream and says what the server made of it."""
    stream = client.open(
        num_query_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_layers=args.layers,
        dtype=args.dtype,
        policy=args.policy,
        window=args.window,
        capacity=_capacity(args),
        sink_tokens=args.sink_tokens if args.policy == "sink" else 0,
        backend=args.backend,
    )
    o = stream.opened
    policy = args.policy + (f" W={o.window}" if args.policy != "none" else "") + f" C={o.capacity}"
    if args.policy == "sink":
        policy += f" sinks={o.sink_tokens}"
    print(
        f"stream {o.stream_id}: backend {o.backend}, {args.dtype}, {policy}, {o.num_layers} layers of "
        f"Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}, {o.bytes_reserved} bytes reserved",
        file=out,
    )
    return stream


class _Progress:
    """A progress bar on a terminal (about 100 updates), nothing elsewhere."""

    WIDTH = 40

    def __init__(self, total: int, out):
        self.total, self.out, self.tty = total, out, out.isatty()

    def show(self, done: int) -> None:
        if self.tty and (done == self.total or done % max(1, self.total // 100) == 0):
            filled = self.WIDTH * done // self.total
            print(
                f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} steps",
                end="",
                file=self.out,
                flush=True,
            )

    def end(self) -> None:
        if self.tty:
            print(file=self.out)


def _latencies(round_trips: list[float], computes: list[float], out) -> dict:
    """p50/p90/p99 of the round trips and the server's compute times (seconds in, us out), printed."""
    stats = {}
    for name, values in (("round_trip", sorted(round_trips)), ("compute", sorted(computes))):
        for q in (50, 90, 99):
            stats[f"{name}_p{q}_us"] = percentile(values, q) * 1e6
    print(
        f"round trip per step      p50 {stats['round_trip_p50_us']:7.0f} us   p90 {stats['round_trip_p90_us']:7.0f} us"
        f"   p99 {stats['round_trip_p99_us']:7.0f} us   (this client's clock)",
        file=out,
    )
    print(
        f"server compute per step  p50 {stats['compute_p50_us']:7.0f} us   p90 {stats['compute_p90_us']:7.0f} us"
        f"   p99 {stats['compute_p99_us']:7.0f} us   (compute_ns of each reply)",
        file=out,
    )
    print("the difference is the network, (de)serialization and queueing at the server", file=out)
    return stats
