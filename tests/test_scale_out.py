"""Scale-out on one machine: what the Kubernetes headless Service plus client-side round_robin
gives, with three `gqa-serve serve` processes standing in for three pods.

One client channel over the three loopback addresses with gRPC's round_robin policy opens 60
Decode streams. Each stream is attributed to the replica whose active-stream count (its
gqa_active_streams gauge) rose when it opened. Checked: the streams spread (15..25 per replica), every step's
output matches the float64 oracle, and when one replica is sent SIGTERM (drain, short grace)
only its streams end, with UNAVAILABLE, while the other replicas' streams keep stepping
exactly, during the drain and after; new streams then land on the survivors.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys
import time

import numpy as np
import pytest
import torch

grpc = pytest.importorskip("grpc")

from service.api import gqa_pb2, gqa_pb2_grpc  # noqa: E402
from tests.conftest import TOLERANCES  # noqa: E402
from tests.metrics_load import ServeProcess, gauge  # noqa: E402
from tests.oracle import attention_ref  # noqa: E402

pytestmark = pytest.mark.slow

REPLICAS = 3
STREAMS = 60
SPREAD = (15, 25)
STEPS_BEFORE = 3
STEPS_AFTER = 3
CAPACITY = 1024  # > the paced drain loop's rounds: (GRACE_S + 15) / DRAIN_PACE_S + steps before and after
DRAIN_PACE_S = 0.05
GRACE_S = 1.0
STARTUP_S = 40.0
HQ, HKV, D = 4, 2, 8
# float32 output against the float64 oracle on the same float32 inputs (tests/conftest.py).
ATOL, RTOL = TOLERANCES[torch.float32]


class Replica(ServeProcess):
    """One `gqa-serve serve` process on a free loopback port."""

    def __init__(self, index: int, log_dir: pathlib.Path):
        self.index = index
        env = {k: v for k, v in os.environ.items() if not k.startswith("GQA_")}
        script = pathlib.Path(sys.executable).parent / "gqa-serve"
        super().__init__(
            log_dir / f"replica-{index}.log",
            *("--grace-period-s", str(GRACE_S), "--workers", "1", "--log-level", "INFO"),
            env=env,
            command=[str(script)] if script.exists() else None,
        )


@pytest.fixture
def replicas(tmp_path):
    started = [Replica(i, tmp_path) for i in range(REPLICAS)]
    try:
        deadline = time.monotonic() + STARTUP_S
        for replica in started:
            replica.wait_serving(deadline)
        yield started
    finally:
        for replica in started:
            replica.close(kill=True)


def tensor(array: np.ndarray) -> gqa_pb2.Tensor:
    array = np.ascontiguousarray(array, dtype="<f4")
    return gqa_pb2.Tensor(dtype=gqa_pb2.DTYPE_FLOAT32, shape=list(array.shape), data=array.tobytes())


class Stream:
    """One Decode stream and the client-side history the oracle needs."""

    def __init__(self, number: int, call):
        self.number = number
        self.call = call
        self.rng = np.random.default_rng(number)
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.request_id = 0
        self.replica: int | None = None
        self.stream_id = ""

    async def open(self) -> None:
        await self.call.write(
            gqa_pb2.DecodeRequest(
                request_id=0,
                open=gqa_pb2.OpenStream(
                    backend="cpu",
                    dtype=gqa_pb2.DTYPE_FLOAT32,
                    batch_size=1,
                    num_query_heads=HQ,
                    num_kv_heads=HKV,
                    head_dim=D,
                    num_layers=1,
                    policy=gqa_pb2.EVICTION_POLICY_NONE,
                    capacity=CAPACITY,
                ),
            )
        )
        response = await self.call.read()
        assert response is not grpc.aio.EOF, f"stream {self.number}: ended at open ({await self.call.code()})"
        self.stream_id = response.opened.stream_id

    async def step(self) -> None:
        """One step, checked against the oracle; raises AioRpcError if the stream has ended."""
        q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
        k = self.rng.standard_normal((1, HKV, D)).astype(np.float32)
        v = self.rng.standard_normal((1, HKV, D)).astype(np.float32)
        self.request_id += 1
        try:
            await self.call.write(
                gqa_pb2.DecodeRequest(
                    request_id=self.request_id,
                    step=gqa_pb2.Step(layer=0, query=tensor(q), new_key=tensor(k), new_value=tensor(v)),
                )
            )
            response = await self.call.read()
        except asyncio.InvalidStateError:  # writing to a call the server has already ended
            response = grpc.aio.EOF
        if response is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(await self.call.code(), None, None, await self.call.details())
        assert response.request_id == self.request_id
        result = response.step
        assert result.status.code == 0, f"stream {self.number}: step refused: {result.status.message}"
        self.keys.append(k)
        self.values.append(v)
        out = np.frombuffer(result.output.data, dtype="<f4").reshape(tuple(result.output.shape))
        expected = attention_ref(q, np.stack(self.keys, axis=2), np.stack(self.values, axis=2), HQ, HKV)
        np.testing.assert_allclose(
            out, expected, atol=ATOL, rtol=RTOL, err_msg=f"stream {self.number} step {self.request_id}"
        )
        assert result.tokens_seen == len(self.keys)


def _scrape_active(port: int) -> int:
    return int(gauge(port, "gqa_active_streams"))


async def active_streams(ports: list[int]) -> list[int]:
    """Streams open on each replica, from its gqa_active_streams gauge (read from the engine at
    scrape time, so exact). GetServerInfo's limits.active_streams says the same; the gauge is what
    an operator's dashboard reads."""
    return list(await asyncio.gather(*(asyncio.to_thread(_scrape_active, p) for p in ports)))


async def scenario(replicas: list[Replica]) -> dict:
    metrics_ports = [r.metrics_port for r in replicas]
    target = "ipv4:" + ",".join(r.address for r in replicas)
    channel = grpc.aio.insecure_channel(target, options=[("grpc.lb_policy_name", "round_robin")])
    stub = gqa_pb2_grpc.AttentionServiceStub(channel)
    try:
        await asyncio.wait_for(channel.channel_ready(), 20)
        # round_robin picks among READY subchannels only, so streams opened before all three
        # connect crowd onto the first. Probe streams (opened, attributed, cancelled) show when
        # the channel has reached every replica.
        seen: set[int] = set()
        for _ in range(200):
            before = await active_streams(metrics_ports)
            probe = Stream(10_000, stub.Decode())
            await probe.open()
            after = await active_streams(metrics_ports)
            seen |= {i for i in range(REPLICAS) if after[i] > before[i]}
            probe.call.cancel()
            await _until(lambda: active_streams(metrics_ports), lambda n, before=before: n == before, 5)
            if len(seen) == REPLICAS:
                break
        assert len(seen) == REPLICAS, f"round_robin reached only replicas {sorted(seen)}"

        streams: list[Stream] = []
        for number in range(STREAMS):
            before = await active_streams(metrics_ports)
            s = Stream(number, stub.Decode())
            await s.open()
            after = await active_streams(metrics_ports)
            grew = [i for i in range(REPLICAS) if after[i] == before[i] + 1]
            assert len(grew) == 1, f"stream {number}: counts {before} -> {after}"
            s.replica = grew[0]
            streams.append(s)
        per_replica = [sum(s.replica == i for s in streams) for i in range(REPLICAS)]
        assert await active_streams(metrics_ports) == per_replica
        # Stream ids are per-replica counters, so each replica's ids are distinct among its own.
        for i in range(REPLICAS):
            ids = [s.stream_id for s in streams if s.replica == i]
            assert len(set(ids)) == len(ids)

        for _ in range(STEPS_BEFORE):
            await asyncio.gather(*(s.step() for s in streams))

        victim = max(range(REPLICAS), key=lambda i: per_replica[i])
        victims = [s for s in streams if s.replica == victim]
        survivors = [s for s in streams if s.replica != victim]
        replicas[victim].proc.send_signal(signal.SIGTERM)

        # Survivors step on while the victim drains and exits.
        drain_steps = 0
        deadline = time.monotonic() + GRACE_S + 15
        while replicas[victim].proc.poll() is None:
            assert time.monotonic() < deadline, f"replica {victim} did not exit:\n{replicas[victim].log()}"
            await asyncio.gather(*(s.step() for s in survivors))
            drain_steps += 1
            await asyncio.sleep(DRAIN_PACE_S)  # bounded: the streams' capacity is finite
        assert replicas[victim].proc.returncode == 0, replicas[victim].log()

        ended = {}
        for s in victims:
            try:
                await s.step()
            except grpc.aio.AioRpcError as exc:
                ended[s.number] = (exc.code(), exc.details() or "")
            else:
                raise AssertionError(f"stream {s.number} on the stopped replica still steps")
        codes = {code for code, _ in ended.values()}
        assert codes == {grpc.StatusCode.UNAVAILABLE}, ended

        for _ in range(STEPS_AFTER):
            await asyncio.gather(*(s.step() for s in survivors))
        for s in survivors:
            assert s.call.done() is False, f"stream {s.number} on replica {s.replica} ended"

        # Reopening goes to the survivors only.
        reopened = [Stream(1000 + n, stub.Decode()) for n in range(4)]
        for s in reopened:
            await s.open()
            await s.step()
        live = [i for i in range(REPLICAS) if i != victim]
        counts = await active_streams([metrics_ports[i] for i in live])
        assert sum(counts) == len(survivors) + len(reopened)

        for s in survivors + reopened:
            await s.call.done_writing()
        return {
            "per_replica": per_replica,
            "victim": victim,
            "victims_ended": len(ended),
            "drain_messages": sorted({d for _, d in ended.values()}),
            "survivor_steps": STEPS_BEFORE + drain_steps + STEPS_AFTER,
        }
    finally:
        await channel.close()


async def _until(poll, done, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = await poll()
        if done(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def test_round_robin_spreads_streams_and_survives_a_replica_stop(replicas):
    started = time.monotonic()
    result = asyncio.run(asyncio.wait_for(scenario(replicas), 40))
    lo, hi = SPREAD
    assert all(lo <= n <= hi for n in result["per_replica"]), result
    assert sum(result["per_replica"]) == STREAMS
    assert result["victims_ended"] == result["per_replica"][result["victim"]]
    print(
        f"\nscale-out: streams per replica {result['per_replica']}; replica {result['victim']} stopped, "
        f"{result['victims_ended']} streams ended UNAVAILABLE {result['drain_messages']}; survivors stepped "
        f"{result['survivor_steps']} times exactly; {time.monotonic() - started:.1f} s"
    )
