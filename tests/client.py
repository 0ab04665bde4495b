"""A small synchronous test client: real stubs over a loopback channel."""

from __future__ import annotations

import queue

import grpc
import torch

from service.api import gqa_pb2, gqa_pb2_grpc
from service.engine.tensors import from_proto, to_proto
from service.vocab import POLICY_ENUMS, TORCH_TO_DTYPE

_END = object()

# Test channels take messages as large as the server's default limit (64 MiB), not gRPC's 4 MiB.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def open_message(
    *,
    batch=1,
    hq=4,
    hkv=2,
    d=8,
    layers=1,
    policy="strict",
    window=8,
    capacity=0,
    sink_tokens=0,
    dtype=torch.float32,
    backend="",
    prefill=None,
) -> gqa_pb2.OpenStream:
    msg = gqa_pb2.OpenStream(
        backend=backend,
        dtype=TORCH_TO_DTYPE[dtype],
        batch_size=batch,
        num_query_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        num_layers=layers,
        policy=POLICY_ENUMS[policy],
        window=window,
        capacity=capacity,
        sink_tokens=sink_tokens,
    )
    for layer, (k, v) in (prefill or {}).items():
        msg.prefill.add(layer=layer, key=to_proto(k), value=to_proto(v))
    return msg


def step_request(rid: int, layer: int, q, k, v) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(
        request_id=rid, step=gqa_pb2.Step(layer=layer, query=to_proto(q), new_key=to_proto(k), new_value=to_proto(v))
    )


class Session:
    """One Decode stream driven request by request: ``send`` then ``recv``.

    Opened with ``open_msg``, or from a snapshot's chunks with ``restore``.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        open_msg: gqa_pb2.OpenStream | None = None,
        metadata=None,
        *,
        restore: list[gqa_pb2.SnapshotChunk] | None = None,
    ):
        self._requests: queue.Queue = queue.Queue()
        if restore is not None:
            for chunk in restore:
                self._requests.put(gqa_pb2.DecodeRequest(request_id=0, restore=chunk))
        else:
            self._requests.put(gqa_pb2.DecodeRequest(request_id=0, open=open_msg))
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        self.call = stub.Decode(iter(self._requests.get, _END), metadata=metadata)
        self._rid = 0
        self.opened = next(self.call).opened

    def send(self, request: gqa_pb2.DecodeRequest) -> None:
        self._requests.put(request)

    def recv(self) -> gqa_pb2.DecodeResponse:
        return next(self.call)

    def step(self, layer, q, k, v) -> gqa_pb2.DecodeResponse:
        self._rid += 1
        self.send(step_request(self._rid, layer, q, k, v))
        response = self.recv()
        assert response.request_id == self._rid
        return response

    def snapshot(self, rid: int = 900) -> list[gqa_pb2.SnapshotChunk]:
        """The stream's snapshot: every chunk of the reply, up to the one with ``last``."""
        self.send(gqa_pb2.DecodeRequest(request_id=rid, snapshot=gqa_pb2.SnapshotRequest()))
        chunks = []
        while True:
            resp = self.recv()
            assert resp.request_id == rid
            assert resp.WhichOneof("kind") == "snapshot", resp
            chunks.append(resp.snapshot)
            if resp.snapshot.last:
                return chunks

    def output(self, response) -> torch.Tensor:
        assert response.step.status.code == 0, response.step.status.message
        return from_proto(response.step.output, "output")

    def close(self) -> None:
        self._requests.put(_END)
        for _ in self.call:  # drain to the end of the RPC
            pass

    def cancel(self) -> None:
        self.call.cancel()


def wait_until(predicate, timeout=10.0, interval=0.01) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
