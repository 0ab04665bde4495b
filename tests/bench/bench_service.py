"""The service over loopback against an echo floor, in one run.

- echo: a minimal grpc.aio bidi server (its own process) that answers each request with a
  pre-built reply of the size of a real ``StepResult``; the floor for transport and framing.
- service: the gqa-serve server (its own process, default settings, metrics on as deployed), CPU backend,
  float32, Hq=32, Hkv=8, D=128, a stream whose layer holds S cached tokens (S=1: empty start;
  S=2048: a strict window of 2049 prefilled with 2048 tokens, so every step attends S+1 keys).
  Each cell's mean batch size is read from its own metrics (``gqa_batch_size``, between cells):
  the server runs nothing of the benchmark's.

Clients are grpc.aio streams in this process, each closed-loop (send, wait, send). Reported:
p50/p99 round trip, steps/s, each server's CPU time a step (all its threads; the clients share
the machine's cores with the server, so where the cores are the limit, steps/s goes as the
inverse of the clients' and the server's CPU a step together) and the mean batch size at 1, 8
and 64 concurrent streams; the
in-process step time of the CPU backend at the same shape with the server's torch threads; the
machine's read floor (a sum over as many bytes as the 64-stream S=2048 cell's steps read, with
as many threads as the server has compute workers).

An ablation in the same run: the service with every step's computation replaced by a stored
result (S=1, 1 and 64 streams), so the servicer's own per-message cost shows beside the echo's.

The two S=1 cells of the targets (1 and 64 streams) run in rounds, echo, service and stub in turn
(``ROUNDS``), so drift hits the three alike; their figures are the medians of the rounds', their
ratios the median [p10-p90] of per-round ratios. The other cells run once.

Targets (issues 15, 23), printed PASS/FAIL: 1 stream at S=1 round trip <= 1.25 x (echo round
trip + the server's reported compute); 64 streams at S=1 >= 0.7 x the echo server's steps/s; 64 streams at S=2048
the server reads cache at >= 0.6 x the read floor.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request

import grpc
import torch

from backends.contract import CacheSpec
from backends.cpu import CPUBackend
from backends.policy import EvictionPolicy
from service.api import gqa_pb2
from service.config import ServerConfig
from service.engine.tensors import to_proto

from .common import (
    fmt_spread,
    median_seconds,
    percentile,
    read_floor_seconds,
    round_trips,
    spread,
    start_server,
    stop_server,
    table,
    torch_threads,
    verdict,
    verdict_spread,
)

HQ, HKV, D = 32, 8, 128
METHOD = "/gqa.v1.AttentionService/Decode"
CONCURRENCY = [1, 8, 64]
SEQ = [1, 2048]
STEPS = {1: 300, 8: 50, 64: 12}  # per stream, bounded
ROUNDS = 7  # the S=1 cells of the targets: echo, service and stub in turn, round after round
TIME_BUDGET_S = 6.0  # per (server, S, concurrency) cell
ROW_BYTES = 2 * HKV * D * 4  # one cached position, keys and values, float32


def reply_bytes() -> bytes:
    out = to_proto(torch.zeros(1, HQ, D))
    return gqa_pb2.DecodeResponse(
        request_id=1,
        step=gqa_pb2.StepResult(
            status=gqa_pb2.Status(),
            output=out,
            tokens_seen=2049,
            resident=2049,
            first_position=0,
            last_position=2048,
            compute_ns=123456,
            rollback_reach=2049,
        ),
    ).SerializeToString()


def open_bytes(s: int) -> bytes:
    g = torch.Generator().manual_seed(0)
    msg = gqa_pb2.OpenStream(
        dtype=gqa_pb2.DTYPE_FLOAT32,
        batch_size=1,
        num_query_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        num_layers=1,
        policy=gqa_pb2.EVICTION_POLICY_STRICT,
        window=s + 1,
    )
    if s > 1:
        msg.prefill.add(
            layer=0,
            key=to_proto(torch.randn(1, HKV, s, D, generator=g)),
            value=to_proto(torch.randn(1, HKV, s, D, generator=g)),
        )
    return gqa_pb2.DecodeRequest(request_id=0, open=msg).SerializeToString()


def step_bytes(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return gqa_pb2.DecodeRequest(
        request_id=1,
        step=gqa_pb2.Step(
            layer=0,
            query=to_proto(torch.randn(1, HQ, D, generator=g)),
            new_key=to_proto(torch.randn(1, HKV, D, generator=g)),
            new_value=to_proto(torch.randn(1, HKV, D, generator=g)),
        ),
    ).SerializeToString()


ECHO_SERVER = r"""
import asyncio, os, sys, grpc
REPLY = open(sys.argv[1], "rb").read()
async def decode(request_iterator, context):
    async for _ in request_iterator:
        yield REPLY
async def main():
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    handler = grpc.method_handlers_generic_handler("gqa.v1.AttentionService", {
        "Decode": grpc.stream_stream_rpc_method_handler(decode)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(os.environ["GQA_ADDRESS"])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


SERVICE_SERVER = r"""
import asyncio, sys
from service.config import from_args
from service.server import Server

if sys.argv[1:] == ["stub"]:  # the ablation: every step's computation replaced by a stored result
    import backends.batch_bytes  # the batcher's entry for steps read from the wire
    computed = {}
    real = backends.batch_bytes.step_bytes

    def stub(steps):
        if len(steps) not in computed:
            computed[len(steps)] = real(steps)
        return computed[len(steps)]

    backends.batch_bytes.step_bytes = stub

async def main():
    server = Server(from_args(None))
    await server.start()
    print("ready", flush=True)
    await server.wait()

asyncio.run(main())
"""


def start(kind: str, tmpdir: str) -> tuple[subprocess.Popen, str]:
    if kind == "echo":
        reply = os.path.join(tmpdir, "reply.bin")
        with open(reply, "wb") as f:
            f.write(reply_bytes())
        return start_server(["-c", ECHO_SERVER, reply])
    return start_server(
        ["-c", SERVICE_SERVER, *(["stub"] if kind == "stub" else [])],
        metrics=True,  # as deployed
    )


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user and system) of process ``pid`` so far, every thread it ran included, in
    seconds: Linux's CPU clock of another process (clock_getcpuclockid's id, made as the kernel
    makes it), nanoseconds, where ``/proc/PID/stat`` counts 10 ms ticks, too coarse for a round
    of the S=1 cells, and the threads' own counts lose those that ended."""
    return time.clock_gettime(((~pid) << 3) | 2)


async def open_stream(channel, opening: bytes):
    call = channel.stream_stream(METHOD)()  # raw bytes both ways: no client-side protobuf work
    await call.write(opening)
    if await call.read() is grpc.aio.EOF:
        raise RuntimeError("the server refused the stream")
    return call


async def run_steps(
    call, requests: list[bytes], count: int, latencies: list[float], deadline: float, computes: list[float]
) -> int:
    """``count`` timed round trips (``requests`` in turn, none started past ``deadline``), their
    times added to ``latencies`` and the last reply's reported compute to ``computes``; then the
    stream's end. Returns how many were made."""
    times, reply = await round_trips(call, requests, count, deadline=deadline)
    latencies += times
    if reply:
        computes.append(gqa_pb2.DecodeResponse.FromString(reply).step.compute_ns * 1e-9)
    await call.done_writing()
    return len(times)


async def drive(address: str, s: int, concurrency: int, pid: int | None = None, steps: int | None = None) -> dict:
    """One cell's round: ``concurrency`` streams opened (and a warm-up one), then their steps
    timed (``steps`` each, ``STEPS[concurrency]`` unless given); ``server_cpu_us``: the CPU time
    process ``pid`` (the server) spent a step while they ran (NaN without ``pid``)."""
    opening = open_bytes(s)
    requests = [step_bytes(i) for i in range(8)]
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        warm = await open_stream(channel, opening)
        await run_steps(warm, requests, 3 * len(requests), [], time.perf_counter() + 10, [])
        # Open every stream first (prefill included), then time the steps alone.
        calls = [await open_stream(channel, opening) for _ in range(concurrency)]
        latencies: list[float] = []
        computes: list[float] = []
        deadline = time.perf_counter() + TIME_BUDGET_S
        cpu = process_cpu_seconds(pid) if pid else 0.0
        t0 = time.perf_counter()
        counts = await asyncio.gather(
            *(run_steps(call, requests, steps or STEPS[concurrency], latencies, deadline, computes) for call in calls)
        )
        wall = time.perf_counter() - t0
        cpu = process_cpu_seconds(pid) - cpu if pid else float("nan")
        # each stream's end read before the channel closes (a call left pending at the loop's
        # close printed "Task was destroyed but it is pending!")
        await asyncio.wait_for(asyncio.gather(*(c.code() for c in [warm, *calls])), 30)
    return {
        "steps": sum(counts),
        "wall_s": wall,
        "steps_per_s": sum(counts) / wall,
        "p50_us": percentile(latencies, 50) * 1e6,
        "p99_us": percentile(latencies, 99) * 1e6,
        "compute_us": percentile(computes, 50) * 1e6,  # the server's reported compute (echo: its fixed one)
        "server_cpu_us": cpu / sum(counts) * 1e6,
    }


def _medians(rounds: list[dict]) -> dict:
    """One cell's figures over its rounds: the median of each (a single round's own figures)."""
    return {k: spread([r[k] for r in rounds])[0] for k in rounds[0]}


def batch_counts(proc) -> tuple[int, int]:
    """(batches, steps) the service (``start_server``'s process, metrics on) has computed so far:
    its own ``gqa_batch_size`` histogram's count and sum, every series, read from its /metrics
    between cells. Nothing of the benchmark's runs inside the server: an observer of its own
    there (with a thread writing the counts out) cost a lone stream's step 7% of the server's CPU
    and 6% of its round trip (docs/design.md, forty-second session)."""
    batches = steps = 0.0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("gqa_batch_size_count{"):
                    batches += float(line.rsplit(" ", 1)[1])
                elif line.startswith("gqa_batch_size_sum{"):
                    steps += float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError):
        return 0, 0
    return int(batches), int(steps)


def in_process_step_seconds(s: int, threads: int) -> float:
    """The CPU backend's step alone, with ``threads`` torch threads (the server runs with
    ``--torch-threads``, default 1)."""
    with torch_threads(threads):
        return _step_seconds(s)


def _step_seconds(s: int) -> float:
    spec = CacheSpec(1, HQ, HKV, D, torch.float32, EvictionPolicy.strict(s + 1))
    cache = CPUBackend().create_cache(spec)
    g = torch.Generator().manual_seed(1)
    if s > 1:
        cache.prefill(torch.randn(1, HKV, s, D, generator=g), torch.randn(1, HKV, s, D, generator=g))
    q, k, v = (
        torch.randn(1, HQ, D, generator=g),
        torch.randn(1, HKV, D, generator=g),
        torch.randn(1, HKV, D, generator=g),
    )
    return median_seconds(lambda: cache.step(q, k, v), repeat=200, budget_s=3.0)


def run(report) -> None:
    import tempfile

    rows = []
    results = {}
    ratios = {}  # (S, streams) -> per-round (round trip / (echo + compute), steps/s / echo's)
    workers = ServerConfig().compute_workers
    # One event loop for every cell: grpc.aio's poller outlives a loop closed under it.
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        try:
            for kind in ("echo", "service", "stub"):
                procs[kind] = start(kind, tmp)
            local = {}
            for s in SEQ:
                local[s] = in_process_step_seconds(s, ServerConfig().torch_threads)
                report.add(S=s, in_process_step_us=local[s] * 1e6)
                for c in CONCURRENCY:
                    before = batch_counts(procs["service"][0])
                    if s == 1 and c in (1, 64):
                        kinds, rounds = ("echo", "service", "stub"), ROUNDS
                    else:
                        kinds, rounds = ("echo", "service"), 1
                    per_round = {kind: [] for kind in kinds}
                    for _ in range(rounds):  # in turn, so drift hits every server alike
                        for kind in kinds:
                            proc, address = procs[kind]
                            per_round[kind].append(loop.run_until_complete(drive(address, s, c, proc.pid)))
                    after = batch_counts(procs["service"][0])
                    batches = after[0] - before[0]
                    for kind in kinds:
                        results[(kind, s, c)] = _medians(per_round[kind])
                    results[("service", s, c)]["mean_batch"] = (
                        (after[1] - before[1]) / batches if batches else float("nan")
                    )
                    e, v = per_round["echo"], per_round["service"]
                    latency = [b["p50_us"] / (a["p50_us"] + b["compute_us"]) for a, b in zip(e, v)]
                    rate = [b["steps_per_s"] / a["steps_per_s"] for a, b in zip(e, v)]
                    ratios[(s, c)] = latency, rate
                    for kind in kinds:
                        report.add(server=kind, S=s, streams=c, rounds=rounds, **results[(kind, s, c)])
                    report.add(S=s, streams=c, round_trip_over_echo_compute=latency, steps_per_s_over_echo=rate)
                    e, v = results[("echo", s, c)], results[("service", s, c)]
                    rows.append(
                        [
                            s,
                            c,
                            e["p50_us"],
                            v["p50_us"],
                            f"{local[s] * 1e6:.0f} | {v['compute_us']:.0f}",
                            fmt_spread(latency) if rounds > 1 else latency[0],
                            e["p99_us"],
                            v["p99_us"],
                            e["steps_per_s"],
                            v["steps_per_s"],
                            fmt_spread(rate) if rounds > 1 else rate[0],
                            f"{e['server_cpu_us']:.0f} | {v['server_cpu_us']:.0f}",
                            v["mean_batch"],
                        ]
                    )
        finally:
            for proc, _ in procs.values():
                stop_server(proc)
            loop.close()
    # The 64-stream S=2048 cell's reads: every step attends S+1 cached positions.
    big = results[("service", 2048, 64)]
    step_bytes = (2048 + 1) * ROW_BYTES
    read_bytes = big["steps"] * step_bytes
    floor_s = read_floor_seconds(read_bytes, workers, repeat=5, budget_s=4.0)
    service_gbps = big["steps_per_s"] * step_bytes / 1e9
    floor_gbps = read_bytes / floor_s / 1e9
    report.add(read_floor_gbps=floor_gbps, service_read_gbps=service_gbps, read_bytes=read_bytes, threads=workers)
    print(
        table(
            [
                "S",
                "streams",
                "echo p50 us",
                "svc p50 us",
                "step | compute us",
                "svc/(echo+compute)",
                "echo p99 us",
                "svc p99 us",
                "echo steps/s",
                "svc steps/s",
                "svc/echo",
                "server CPU us/step",
                "mean batch",
            ],
            rows,
        )
    )
    print(
        f"read floor: {floor_gbps:.2f} GB/s ({read_bytes / 1e9:.2f} GB, {workers} threads); "
        f"service at S=2048 x 64 streams: {service_gbps:.2f} GB/s of cache"
    )
    for c in (1, 64):
        e, v, stub = (results[(k, 1, c)] for k in ("echo", "service", "stub"))
        print(
            f"ablation, S=1, {c} stream(s): step computation stubbed out, the service answers "
            f"{stub['steps_per_s'] / e['steps_per_s']:.2f}x the echo server's steps/s at p50 {stub['p50_us']:.0f} us "
            f"(echo {e['p50_us']:.0f} us, service {v['p50_us']:.0f} us); server CPU a step: echo "
            f"{e['server_cpu_us']:.0f} us, stub {stub['server_cpu_us']:.0f}, service {v['server_cpu_us']:.0f}"
        )
    print(verdict_spread("1 stream S=1 round trip / (echo + compute)", ratios[(1, 1)][0], 1.25))
    print(verdict_spread("64 streams S=1 steps/s / echo's", ratios[(1, 64)][1], 0.7, at_most=False))
    print(verdict("64 streams S=2048 cache read rate / read floor", service_gbps / floor_gbps, 0.6, at_most=False))
