"""A probe, not a target: what one Batch step costs hot and cold, as a served model sees it.

    PYTHONPATH=$PWD:$PWD/clients/python .venv/bin/python -m tests.bench.cold_step [S]

Between two step messages a model streams a layer's weights (hundreds of MB) through the
last-level cache, so each round trip runs with both processes' code and data evicted. This
times the same float32 step message (one sequence, Hq=32, Hkv=8, D=128, S positions, default
2048) back to back ("hot") and after reading a 400 MB buffer ("cold"), interleaved round by
round:

- echo: a minimal grpc.aio server answering each Batch request with a step reply of the same
  size (the floor of any Python gRPC round trip);
- service: ``gqa-serve serve`` (default configuration), round trip less its ``compute_ns``;
- client work: ``gqa_client.transformers``' step of one layer in process, gRPC replaced by
  serialising the request and parsing a canned reply (the client's own work per step).
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import numpy as np
import torch

from gqa_client import Client
from gqa_client.api import gqa_pb2
from gqa_client.batch import BatchSession
from gqa_client.transformers.plans import LayerPlan
from gqa_client.transformers.sessions import Sessions

from .common import start_server, stop_server

HQ, HKV, D = 32, 8, 128
ROUNDS, STEPS = 8, 20
ECHO = r"""
import asyncio, os, grpc
import numpy as np
from gqa_client.api import gqa_pb2
def reply(rid):
    r = gqa_pb2.BatchResponse(request_id=rid)
    r.step.output.dtype = gqa_pb2.DTYPE_FLOAT32
    r.step.output.shape.extend([1, 32, 128])
    r.step.output.data = bytes(32 * 128 * 4)
    r.step.compute_ns = 1
    return r.SerializeToString()
async def batch(requests, context):
    async for raw in requests:
        request = gqa_pb2.BatchRequest.FromString(raw)
        yield (gqa_pb2.BatchResponse(opened=gqa_pb2.BatchOpened()).SerializeToString()
               if request.HasField("open") else reply(request.request_id))
async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("gqa.v1.AttentionService",
        {"Batch": grpc.stream_stream_rpc_method_handler(batch)}),))
    server.add_insecure_port(os.environ["GQA_ADDRESS"])
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


def stepper(address: str, length: int, q: np.ndarray, k: np.ndarray):
    """A Batch session on ``address`` (sequence 1 of ``length`` positions unless the server is
    the echo, ``length`` 0) and a function stepping it, layers 0 and 1 in turn."""
    s = Client(address).batch(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=2)
    if length:
        g = torch.Generator().manual_seed(0)
        kv = {layer: (torch.randn(1, HKV, length, D, generator=g),) * 2 for layer in range(2)}
        s.add(1, policy="none", capacity=length + 2 * ROUNDS * STEPS + 8, prefill=kv)
    layers = iter(range(1 << 30))
    return lambda: s.step_reply(next(layers) % 2, [1], q, k, k)


def client_work():
    """One layer's step through ``Sessions.step`` with gRPC replaced by a canned reply."""
    reply = gqa_pb2.BatchResponse()
    reply.step.output.dtype = gqa_pb2.DTYPE_FLOAT32
    reply.step.output.shape.extend([1, HQ, D])
    reply.step.output.data = bytes(HQ * D * 4)
    raw = reply.SerializeToString()

    class Canned(BatchSession):
        def __init__(self):
            self.dtype, self._rid, self.closed = "float32", 0, False

        def _put(self, request):
            request.SerializeToString()
            return 0

        def _recv(self, rid):
            return gqa_pb2.BatchResponse.FromString(raw)

    client = types.SimpleNamespace(batch=lambda **kw: Canned())
    plans = [LayerPlan(0, "none", 0, 0, 0, 0, 0)]
    shape = dict(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=torch.float32, backend="")
    sessions = Sessions(client, "in process", plans, shape)
    query = torch.randn(1, 1, HQ * D).view(1, 1, HQ, D).transpose(1, 2)
    key = torch.randn(1, 1, HKV * D).view(1, 1, HKV, D).transpose(1, 2)
    return lambda: sessions.step(0, [1], query, key, key)


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    sweep = np.ones(100 << 20, np.float32)  # 400 MB
    q = np.random.default_rng(0).standard_normal((1, HQ, D), dtype=np.float32)
    k = q[:, :HKV].copy()
    procs = []
    try:
        echo_proc, echo = start_server(["-c", ECHO])
        procs.append(echo_proc)
        svc_proc, svc = start_server(["-m", "service.cli", "serve"])
        procs.append(svc_proc)
        kinds = {"echo": stepper(echo, 0, q, k), "service": stepper(svc, length, q, k), "client work": client_work()}
        times = {(name, cold): [] for name in kinds for cold in (False, True)}
        for r in range(ROUNDS):
            for name, cold in times if r % 2 == 0 else list(times)[::-1]:
                for _ in range(STEPS):
                    if cold:
                        sweep.sum()
                    t0 = time.perf_counter_ns()
                    reply = kinds[name]()
                    elapsed = time.perf_counter_ns() - t0
                    times[name, cold].append(elapsed - getattr(reply, "compute_ns", 0))
        print(f"S={length}, {ROUNDS} rounds of {STEPS} steps per kind; median us (service: round trip less compute)")
        for name in kinds:
            hot, cold = (statistics.median(times[name, c]) / 1e3 for c in (False, True))
            print(f"  {name:12s} hot {hot:7.0f}   cold {cold:7.0f}")
    finally:
        for proc in procs:
            stop_server(proc)


if __name__ == "__main__":
    main()
