"""Load: 256 concurrent streams x 300 steps on loopback, every output exact, memory back after.

The client is one grpc.aio event loop (this thread); the server runs in-process on its own.
Each stream's expected outputs come from a local cache of the same backend fed the same steps
(bit-identical is the bar). Memory: the process's resident set after a warm-up round, against
the same after every stream of the measured round closed; within 5%.

``make soak`` runs it longer: ``GQA_SOAK_STREAMS`` / ``GQA_SOAK_STEPS`` (defaults 256 / 300).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import grpc
import torch

from backends import registry
from backends.base import CacheSpec
from backends.policy import EvictionPolicy
from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.server import ServerThread
from service.tensors import from_proto, to_proto
from tests.client import open_message, wait_until

STREAMS = int(os.environ.get("GQA_SOAK_STREAMS", "256"))
STEPS = int(os.environ.get("GQA_SOAK_STEPS", "300"))
HQ, HKV, D, WINDOW = 4, 2, 8, 16


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _local_cache():
    spec = CacheSpec(batch_size=1, num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                     policy=EvictionPolicy.create("strict", window=WINDOW, capacity=0, sinks=0), device="cpu")
    return registry.get_backend("cpu").create_cache(spec)


async def _stream(stub, index: int, steps: int, failures: list) -> int:
    g = torch.Generator().manual_seed(index)
    local = _local_cache()
    call = stub.Decode()
    await call.write(gqa_pb2.DecodeRequest(open=open_message(hq=HQ, hkv=HKV, d=D, policy="strict", window=WINDOW)))
    assert (await call.read()).WhichOneof("kind") == "opened"
    exact = 0
    for i in range(steps):
        q, k, v = torch.randn(1, HQ, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
        await call.write(gqa_pb2.DecodeRequest(request_id=i, step=gqa_pb2.Step(
            layer=0, query=to_proto(q), new_key=to_proto(k), new_value=to_proto(v))))
        reply = await call.read()
        expected = local.step(q, k, v).output
        if reply.request_id != i or reply.step.status.code != 0 or not torch.equal(
                from_proto(reply.step.output, "output"), expected):
            failures.append((index, i, reply.step.status.message))
            break
        exact += 1
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    return exact


async def _round(address: str, streams: int, steps: int, failures: list) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        return sum(await asyncio.gather(*(_stream(stub, i, steps, failures) for i in range(streams))))


def test_concurrent_streams_exact_and_memory_back():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0, max_streams=max(1024, STREAMS))
    with ServerThread(config) as srv:
        failures: list = []
        asyncio.run(_round(srv.address, STREAMS, 5, failures))  # warm-up: buffers, arenas, imports
        assert wait_until(lambda: srv.engine.active_streams == 0, timeout=30)
        gc.collect()
        start = _rss()
        t0 = time.perf_counter()
        exact = asyncio.run(_round(srv.address, STREAMS, STEPS, failures))
        elapsed = time.perf_counter() - t0
        assert not failures, failures[:5]
        assert exact == STREAMS * STEPS
        assert wait_until(lambda: srv.engine.active_streams == 0 and srv.engine.bytes_reserved == 0, timeout=30)
        gc.collect()
        end = _rss()
        print(f"\nload: {STREAMS} streams x {STEPS} steps exact in {elapsed:.1f} s "
              f"({exact / elapsed:.0f} steps/s); RSS {start / 2**20:.1f} -> {end / 2**20:.1f} MiB")
        assert end <= start * 1.05, (start, end)
