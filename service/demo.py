"""``gqa-serve demo``: open a stream against a running server, run N steps, print latencies."""

from __future__ import annotations

import sys
import time

import grpc
import torch

from .api import gqa_pb2, gqa_pb2_grpc
from .tensors import to_proto

POLICIES = {
    "none": gqa_pb2.EVICTION_POLICY_NONE,
    "strict": gqa_pb2.EVICTION_POLICY_STRICT,
    "greedy": gqa_pb2.EVICTION_POLICY_GREEDY,
    "sink": gqa_pb2.EVICTION_POLICY_SINK,
}


def _percentile(sorted_values: list[float], q: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def run_demo(address: str, steps: int, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
             layers: int = 2, policy: str = "greedy", window: int = 256, backend: str = "",
             out=sys.stdout) -> dict:
    torch.manual_seed(0)
    open_msg = gqa_pb2.OpenStream(
        backend=backend, dtype=gqa_pb2.DTYPE_FLOAT32, batch_size=1, num_query_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, num_layers=layers, policy=POLICIES[policy],
        window=window, capacity=window * 2 if policy in ("greedy", "none") else 0,
        sink_tokens=4 if policy == "sink" else 0,
    )
    if policy == "none":
        open_msg.capacity = max(steps, 1)
    latencies: list[float] = []
    sent: dict[int, float] = {}

    def requests():
        yield gqa_pb2.DecodeRequest(request_id=0, open=open_msg)
        for i in range(1, steps + 1):
            step = gqa_pb2.Step(
                layer=(i - 1) % layers,
                query=to_proto(torch.randn(1, heads, head_dim)),
                new_key=to_proto(torch.randn(1, kv_heads, head_dim)),
                new_value=to_proto(torch.randn(1, kv_heads, head_dim)),
            )
            ready.acquire()  # one step in flight: we measure the round trip
            sent[i] = time.perf_counter()
            yield gqa_pb2.DecodeRequest(request_id=i, step=step)

    import threading

    ready = threading.Semaphore(0)
    with grpc.insecure_channel(address) as channel:
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        responses = stub.Decode(requests())
        opened = next(responses).opened
        print(f"stream {opened.stream_id}: backend {opened.backend}, {opened.num_layers} layers, "
              f"capacity {opened.capacity}, {opened.bytes_reserved} bytes reserved", file=out)
        ready.release()
        width = 40
        for done, response in enumerate(responses, start=1):
            latencies.append(time.perf_counter() - sent[response.request_id])
            if response.step.status.code:
                raise SystemExit(f"step {response.request_id} refused: {response.step.status.message}")
            if out.isatty() and (done == steps or done % max(1, steps // 100) == 0):
                filled = width * done // steps
                print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{steps} steps", end="", file=out, flush=True)
            if done == steps:
                break
            ready.release()
        responses.cancel()
    if out.isatty():
        print(file=out)
    else:
        print(f"{len(latencies)}/{steps} steps done", file=out)
    ordered = sorted(latencies)
    stats = {q: _percentile(ordered, q) * 1e6 for q in (50, 90, 99)}
    print("round trip per step: p50 {:.0f} us, p90 {:.0f} us, p99 {:.0f} us (over {} steps)".format(
        stats[50], stats[90], stats[99], len(latencies)), file=out)
    return stats
