"""The Python client's own cost: a Decode step through gqa_client beside a bare grpc.aio call.

Both run against one gqa-serve server (its own process, CPU backend, default settings), one
stream each, closed loop, with the same step message: float32, Hq=32, Hkv=8, D=128, layer 0 of a
strict window of 64 tokens (full after the warm-up, so the server's work per step is constant).

- bare: grpc.aio writing the step's pre-serialized bytes and reading the reply's raw bytes, so
  this process does no protobuf or tensor work at all (the floor of any client);
- client: ``gqa_client.AsyncClient``'s ``step(0, query, new_key, new_value)`` with numpy arrays:
  the dtype check, the tensors' bytes, the message and its serialization, the reply's parsing,
  its checks and its output as a numpy array;
- for information: the same with torch tensors, and the blocking ``Client`` (its requests cross
  a queue to gRPC's sending thread).

Each round gives every kind the same number of steps, in slices of 10 taken in turn (the order
alternating between rounds), and a round's figure is the ratio of the kinds' medians: on a
shared machine the load drifts within seconds, so the kinds are compared over the same
seconds. Also shown: the client's own work per step, timed in process (building and
serializing a request; parsing a reply and decoding its output).

Target (issue 25), printed PASS/FAIL: the asyncio client's round trip <= 1.2x the bare call's
(the median of the per-round ratios).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import numpy as np
import torch

from gqa_client import AsyncClient, Client
from gqa_client.api import gqa_pb2
from gqa_client.messages import _step_request, _step_result

from .common import (
    bench_mode,
    fmt_spread,
    median_seconds,
    round_trips,
    start_server,
    status,
    stop_server,
    table,
    verdict_spread,
)

HQ, HKV, D, WINDOW = 32, 8, 128, 64
METHOD = "/gqa.v1.AttentionService/Decode"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
TARGET = 1.2
SLICE = 10  # steps of one kind before the next kind's turn, within a round


def sizes() -> tuple[int, int]:
    """(rounds, steps per block)."""
    return {"smoke": (2, 10), "default": (10, 150), "long": (30, 300)}[bench_mode()]


def inputs(n: int = 8) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((1, HQ, D), dtype=np.float32),
            rng.standard_normal((1, HKV, D), dtype=np.float32),
            rng.standard_normal((1, HKV, D), dtype=np.float32),
        )
        for _ in range(n)
    ]


def open_kwargs() -> dict:
    return dict(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="strict", window=WINDOW)


def bare_bytes(steps) -> tuple[bytes, list[bytes]]:
    """The opening and the step requests as the client would send them, serialized once."""
    from gqa_client.messages import open_message

    opening = gqa_pb2.DecodeRequest(request_id=0, open=open_message(**open_kwargs())).SerializeToString()
    return opening, [_step_request(1, 0, q, k, v, "float32").SerializeToString() for q, k, v in steps]


class Bare:
    def __init__(self, address: str, steps):
        self.address, (self.opening, self.requests) = address, bare_bytes(steps)

    async def start(self):
        self.channel = grpc.aio.insecure_channel(self.address, options=OPTIONS)
        self.call = self.channel.stream_stream(METHOD)()  # raw bytes both ways
        await self.call.write(self.opening)
        if await self.call.read() is grpc.aio.EOF:
            raise RuntimeError("the server refused the stream")

    async def block(self, count: int) -> list[float]:
        times, _ = await round_trips(self.call, self.requests, count)
        return times

    async def stop(self):
        await self.call.done_writing()
        await self.channel.close()


class Async:
    def __init__(self, address: str, steps):
        self.address, self.steps = address, steps

    async def start(self):
        self.client = AsyncClient(self.address)
        self.stream = await self.client.open(**open_kwargs())

    async def block(self, count: int) -> list[float]:
        times = []
        for i in range(count):
            q, k, v = self.steps[i % len(self.steps)]
            t0 = time.perf_counter()
            await self.stream.step(0, q, k, v)
            times.append(time.perf_counter() - t0)
        return times

    async def stop(self):
        await self.stream.close()
        await self.client.close()


class Blocking:
    """The blocking client, driven from the loop's thread while the loop waits on nothing else."""

    def __init__(self, address: str, steps):
        self.address, self.steps = address, steps

    async def start(self):
        self.client = Client(self.address)
        self.stream = self.client.open(**open_kwargs())

    async def block(self, count: int) -> list[float]:
        times = []
        for i in range(count):
            q, k, v = self.steps[i % len(self.steps)]
            t0 = time.perf_counter()
            self.stream.step(0, q, k, v)
            times.append(time.perf_counter() - t0)
        return times

    async def stop(self):
        self.stream.close()
        self.client.close()


def client_work_us(steps) -> tuple[float, float]:
    """The client's own work per step, in process: (request built and serialized, reply parsed
    and its output decoded), microseconds."""
    q, k, v = steps[0]
    reply = gqa_pb2.DecodeResponse(
        request_id=1,
        step=gqa_pb2.StepResult(
            status=gqa_pb2.Status(),
            output=gqa_pb2.Tensor(dtype=gqa_pb2.DTYPE_FLOAT32, shape=[1, HQ, D], data=q.tobytes()),
            tokens_seen=65,
            resident=64,
            compute_ns=1,
        ),
    ).SerializeToString()
    encode = median_seconds(lambda: _step_request(1, 0, q, k, v, "float32").SerializeToString(), repeat=300)
    decode = median_seconds(lambda: _step_result(gqa_pb2.DecodeResponse.FromString(reply), q), repeat=300)
    return encode * 1e6, decode * 1e6


def run(report) -> None:
    rounds, steps_per_block = sizes()
    steps = inputs()
    torch_steps = [tuple(torch.from_numpy(a) for a in step) for step in steps]
    proc, address = start_server(["-m", "service.cli", "serve", "--backend", "cpu"])
    loop = asyncio.new_event_loop()
    try:
        kinds = {
            "bare": Bare(address, steps),
            "client": Async(address, steps),
            "client torch": Async(address, torch_steps),
            "blocking client": Blocking(address, steps),
        }
        for kind in kinds.values():
            loop.run_until_complete(kind.start())
            loop.run_until_complete(kind.block(2 * WINDOW))  # the window fills; connections warm
        medians: dict[str, list[float]] = {name: [] for name in kinds}
        for r in range(rounds):
            status(f"round {r + 1}/{rounds}")
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            times: dict[str, list[float]] = {name: [] for name in kinds}
            for _ in range(max(1, steps_per_block // SLICE)):  # the kinds take turns in short slices
                for name in order:
                    times[name] += loop.run_until_complete(kinds[name].block(SLICE))
            for name in kinds:
                medians[name].append(statistics.median(times[name]))
        for kind in kinds.values():
            loop.run_until_complete(kind.stop())
    finally:
        loop.close()
        stop_server(proc)
    encode_us, decode_us = client_work_us(steps)
    ratios = {name: [m / b for m, b in zip(medians[name], medians["bare"])] for name in kinds}
    for name in kinds:
        report.add(kind=name, round_trip_s=medians[name], ratio_to_bare=ratios[name])
    report.add(kind="client work", encode_us=encode_us, decode_us=decode_us)
    print(
        "legend: median round trip per step (median [p10-p90] over rounds), and its ratio to the bare "
        "grpc.aio call's in the same round; one stream, closed loop, float32 Hq=32 Hkv=8 D=128, strict W=64"
    )
    rows = [[name, fmt_spread(medians[name], 1e6), fmt_spread(ratios[name])] for name in kinds]
    print(table(["kind", "round trip us", "/ bare"], rows))
    print(
        f"the client's own work per step, in process: request built and serialized {encode_us:.0f} us, "
        f"reply parsed and its output decoded {decode_us:.0f} us"
    )
    print(verdict_spread("asyncio client step round trip / bare grpc.aio call's", ratios["client"], TARGET))
