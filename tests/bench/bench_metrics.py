"""What metrics cost: service steps/s with metrics on versus off, in one run.

Two servers in this process, one with metrics (recorder, gRPC interceptor, /metrics served and
scraped once per round) and one with ``--metrics-port 0``; the same pipelined Decode stream is
run against each in alternating rounds, so drift on a shared machine hits both alike. The
ratio of median steps/s (on / off) is the cost; the target is above 0.95.
"""

from __future__ import annotations

import statistics
import time
import urllib.request

from service.config import ServerConfig
from service.server import ServerThread
from tests.metrics_load import Shape, free_port, open_request, run_stream, step_requests

from .common import median_seconds, table

# (name, shape, policy, window): a tiny head, where per-step bookkeeping weighs most, and the
# demo's shape.
CASES = [
    ("tiny 4/2x16", Shape(heads=4, kv_heads=2, head_dim=16, layers=1), "strict", 16),
    ("demo 32/8x128", Shape(heads=32, kv_heads=8, head_dim=128, layers=1), "greedy", 256),
]
STEPS = 300
ROUNDS = 5
BUDGET_S = 25.0  # per case; rounds stop early (at least 2 each) when it runs out


def _steps_per_second(address: str, shape: Shape, policy: str, window: int, steps) -> float:
    capacity = window + window // 2 if policy == "greedy" else 0
    seen = run_stream(address, open_request(policy, window, shape, capacity=capacity), steps, timeout_s=60)
    if seen.ok_steps != len(steps):
        raise RuntimeError(f"{len(steps) - seen.ok_steps} steps failed ({seen.refused}, {seen.code})")
    return seen.ok_steps / seen.seconds


def _recorder_cost_us() -> float:
    """Microseconds the recorder adds to one Decode step (``steps_done`` of one step): the
    noise-free lower bound of the cost, to read next to the end-to-end ratio on a busy machine."""
    from service.metrics.recorder import ServiceMetrics

    metrics = ServiceMetrics()
    labels = ("cpu", "float32", "strict")
    series = metrics.interceptor._series("/gqa.v1.AttentionService/Decode", True, True)
    n = 20_000

    def loop():
        for _ in range(n):
            metrics.recorder.steps_done(labels, 1, 20e-6, 120e-6, 1, 1, 512)
            series.received.inc()  # the interceptor's share: one message each way
            series.sent.inc()

    return median_seconds(loop, repeat=5, warmup=1, budget_s=5) / n * 1e6


def run(report) -> None:
    cost_us = _recorder_cost_us()
    print(f"recorder + message counters: {cost_us:.2f} us per step")
    report.add(case="recorder_cost", us_per_step=cost_us)
    on = ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=free_port())).start()
    off = ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)).start()
    rows = []
    try:
        scrape = f"http://{on.server.metrics_address}/metrics"
        for name, shape, policy, window in CASES:
            steps = step_requests(shape, STEPS)
            _steps_per_second(on.address, shape, policy, window, steps[:50])  # warm both
            _steps_per_second(off.address, shape, policy, window, steps[:50])
            rates = {"on": [], "off": []}
            deadline = time.perf_counter() + BUDGET_S
            for i in range(ROUNDS):
                order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
                for mode, server in order:
                    rates[mode].append(_steps_per_second(server.address, shape, policy, window, steps))
                with urllib.request.urlopen(scrape, timeout=10) as r:  # a scrape per round, as in production
                    r.read()
                if time.perf_counter() > deadline and i >= 1:
                    break
            med_on, med_off = statistics.median(rates["on"]), statistics.median(rates["off"])
            ratio = med_on / med_off
            rows.append([name, len(rates["on"]), med_off, med_on, ratio, (1 - ratio) * 100, cost_us * med_off / 1e4])
            report.add(
                case=name,
                steps_per_round=STEPS,
                rounds=len(rates["on"]),
                policy=policy,
                window=window,
                steps_per_s_off=rates["off"],
                steps_per_s_on=rates["on"],
                median_off=med_off,
                median_on=med_on,
                ratio_on_off=ratio,
            )
    finally:
        on.stop()
        off.stop()
    print(table(["case", "rounds", "steps/s off", "steps/s on", "on/off", "cost %", "recorder %"], rows))
    print("target: on/off above 0.95 (metrics cost under 5%)")
