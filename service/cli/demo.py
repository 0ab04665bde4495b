"""``gqa-serve demo``: one stream against a running server, N steps, round trip beside compute."""

from __future__ import annotations

import argparse
import sys
import time

import torch

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
    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

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
    round_trips, computes = [], []
    evictions = evicted = 0
    last = None
    tty = out.isatty()
    width = 40
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
            done = i + 1
            if tty and (done == args.steps or done % max(1, args.steps // 100) == 0):
                filled = width * done // args.steps
                print(
                    f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{args.steps} steps",
                    end="",
                    file=out,
                    flush=True,
                )
    if tty:
        print(file=out)
    print(
        f"{args.steps} steps: layer {last.layer} has seen {last.tokens_seen} tokens, keeps {last.resident} "
        f"(positions {last.first_position}..{last.last_position}); {evictions} steps evicted "
        f"{evicted} tokens in all; exact rollback reach now {last.rollback_reach}",
        file=out,
    )
    rt, cp = sorted(round_trips), sorted(computes)
    stats = {}
    for name, values in (("round_trip", rt), ("compute", cp)):
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
    stats.update(evictions=evictions, evicted_tokens=evicted)
    return stats
