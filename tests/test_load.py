"""Load: 256 concurrent streams x 300 steps on loopback, every output exact, memory back after.

The client is one grpc.aio event loop (this thread); the server is ``gqa-serve serve`` in a
process of its own, as deployed (in this process the two loops shared one interpreter lock and
ran at less than half the rate). Each stream's expected outputs come from a local cache of the
same backend fed the same steps (bit-identical is the bar). Memory: the server's resident set
after a warm-up round, against the same after every stream of the measured round closed (its
metrics: 0 streams, 0 bytes reserved); within 5%.

``make soak`` runs it longer: ``GQA_SOAK_STREAMS`` / ``GQA_SOAK_STEPS`` (defaults 256 / 300).
The adversaries' test (issue 17) scales with ``GQA_SOAK_STREAMS`` too (a quarter as many).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
import time

import grpc
import torch

from backends import registry
from backends.contract import CacheSpec
from backends.policy import EvictionPolicy
from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.engine.tensors import from_proto, to_proto
from service.server import ServerThread
from tests.client import open_message, wait_until
from tests.metrics_load import ServeProcess, gauge

STREAMS = int(os.environ.get("GQA_SOAK_STREAMS", "256"))
STEPS = int(os.environ.get("GQA_SOAK_STEPS", "300"))
HQ, HKV, D, WINDOW = 4, 2, 8, 16


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class _Server(ServeProcess):
    """``gqa-serve serve`` started and serving, idle when its metrics say so."""

    def __init__(self, log_path: pathlib.Path, *flags: str):
        super().__init__(log_path, *flags)
        try:
            self.wait_serving(time.monotonic() + 120)
        except BaseException:
            self.close(kill=True)
            raise

    def idle(self) -> bool:
        return (
            gauge(self.metrics_port, "gqa_active_streams") == 0 == gauge(self.metrics_port, "gqa_cache_reserved_bytes")
        )


def _local_cache():
    spec = CacheSpec(
        batch_size=1,
        num_query_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
        policy=EvictionPolicy.create("strict", window=WINDOW, capacity=0, sinks=0),
        device="cpu",
    )
    return registry.get_backend("cpu").create_cache(spec)


async def _stream(stub, index: int, steps: int, failures: list) -> int:
    g = torch.Generator().manual_seed(index)
    local = _local_cache()
    call = stub.Decode()
    await call.write(gqa_pb2.DecodeRequest(open=open_message(hq=HQ, hkv=HKV, d=D, policy="strict", window=WINDOW)))
    assert (await call.read()).WhichOneof("kind") == "opened"
    exact = 0
    for i in range(steps):
        q, k, v = (
            torch.randn(1, HQ, D, generator=g),
            torch.randn(1, HKV, D, generator=g),
            torch.randn(1, HKV, D, generator=g),
        )
        await call.write(
            gqa_pb2.DecodeRequest(
                request_id=i, step=gqa_pb2.Step(layer=0, query=to_proto(q), new_key=to_proto(k), new_value=to_proto(v))
            )
        )
        reply = await call.read()
        expected = local.step(q, k, v).output
        if (
            reply.request_id != i
            or reply.step.status.code != 0
            or not torch.equal(from_proto(reply.step.output, "output"), expected)
        ):
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


def test_concurrent_streams_exact_and_memory_back(tmp_path):
    srv = _Server(tmp_path / "server.log", "--idle-timeout-s", "3600", "--max-streams", str(max(1024, STREAMS)))
    try:
        failures: list = []
        asyncio.run(_round(srv.address, STREAMS, 5, failures))  # warm-up: buffers, arenas, imports
        assert wait_until(srv.idle, timeout=30)
        start = _rss(srv.proc.pid)
        t0 = time.perf_counter()
        exact = asyncio.run(_round(srv.address, STREAMS, STEPS, failures))
        elapsed = time.perf_counter() - t0
        assert not failures, failures[:5]
        assert exact == STREAMS * STEPS
        assert wait_until(srv.idle, timeout=30)
        end = _rss(srv.proc.pid)
        print(
            f"\nload: {STREAMS} streams x {STEPS} steps exact in {elapsed:.1f} s "
            f"({exact / elapsed:.0f} steps/s); server RSS {start / 2**20:.1f} -> {end / 2**20:.1f} MiB"
        )
        assert end <= start * 1.05, (start, end)
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log()


# -- adversaries (issue 17): every RPC ends badly, nothing stays held --------------------------------
ADVERSARIES = max(24, STREAMS // 4)  # ``make soak``: GQA_SOAK_STREAMS / 4


async def _adversary(stub, index: int) -> str:
    """One hostile client: an open cancelled while it is built, an open or a restore over the
    budget, a restore that never ends, or a stream dropped with steps in flight."""
    kind = index % 5
    g = torch.Generator().manual_seed(index)
    call = stub.Decode()
    try:
        if kind == 0:  # prefilled open, cancelled at once
            keys = torch.randn(1, HKV, 64, D, generator=g)
            await call.write(
                gqa_pb2.DecodeRequest(
                    open=open_message(hq=HQ, hkv=HKV, d=D, policy="none", capacity=256, prefill={0: (keys, keys)})
                )
            )
            await asyncio.sleep(0.001 * (index % 7))
            call.cancel()
        elif kind == 1:  # open over the budget
            await call.write(
                gqa_pb2.DecodeRequest(open=open_message(hq=HQ, hkv=HKV, d=D, policy="none", capacity=1 << 20))
            )
            await call.read()
        elif kind == 2:  # restore over the budget, then chunks it should never wait for
            big = open_message(hq=HQ, hkv=HKV, d=D, policy="none", capacity=1 << 20)
            await call.write(gqa_pb2.DecodeRequest(restore=gqa_pb2.SnapshotChunk(config=big, tokens_seen=[0])))
            await call.read()
        elif kind == 3:  # a restore that stops sending, then goes away
            small = open_message(hq=HQ, hkv=HKV, d=D, policy="strict", window=WINDOW)
            await call.write(gqa_pb2.DecodeRequest(restore=gqa_pb2.SnapshotChunk(config=small, tokens_seen=[0])))
            await asyncio.sleep(0.01)
            call.cancel()
        else:  # a stream with steps queued, dropped without reading the replies
            await call.write(
                gqa_pb2.DecodeRequest(open=open_message(hq=HQ, hkv=HKV, d=D, policy="strict", window=WINDOW))
            )
            await call.read()
            for i in range(8):
                await call.write(
                    gqa_pb2.DecodeRequest(
                        request_id=i,
                        step=gqa_pb2.Step(
                            layer=0,
                            query=to_proto(torch.randn(1, HQ, D, generator=g)),
                            new_key=to_proto(torch.randn(1, HKV, D, generator=g)),
                            new_value=to_proto(torch.randn(1, HKV, D, generator=g)),
                        ),
                    )
                )
            call.cancel()
        return str(await call.code())
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        return "ended"


def test_adversaries_hold_nothing_and_never_exceed_the_limits():
    """Bounds: --max-streams 8 and the 1 MiB budget are never exceeded (sampled through the
    run); afterwards 0 streams, 0 bytes reserved, 0 bytes read ahead, 0 Decode RPCs running."""
    config = ServerConfig(
        address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0, max_streams=8, max_cache_bytes=1 << 20
    )
    with ServerThread(config) as srv:
        peak = [0, 0]
        stop = False

        def sample():
            while not stop:
                peak[0] = max(peak[0], srv.engine.active_streams)
                peak[1] = max(peak[1], srv.engine.bytes_reserved)
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()

        async def run():
            async with grpc.aio.insecure_channel(srv.address) as channel:
                stub = gqa_pb2_grpc.AttentionServiceStub(channel)
                return await asyncio.gather(*(_adversary(stub, i) for i in range(ADVERSARIES)))

        try:
            asyncio.run(run())
        finally:
            stop = True
            sampler.join()
        assert peak[0] <= config.max_streams and peak[1] <= config.max_cache_bytes, peak
        assert wait_until(
            lambda: (
                (
                    srv.engine.active_streams,
                    srv.engine.bytes_reserved,
                    srv.engine.read_ahead_bytes,
                    srv.server.servicer.sessions,
                )
                == (0, 0, 0, 0)
            ),
            timeout=30,
        ), (
            srv.engine.active_streams,
            srv.engine.bytes_reserved,
            srv.engine.read_ahead_bytes,
            srv.server.servicer.sessions,
        )
