"""The int8 backend through the gRPC service: every policy, prefill, refusals, snapshots."""

from __future__ import annotations

import grpc
import pytest
import torch

from backends.contract import CacheSpec
from backends.int8 import Int8Backend
from backends.policy import EvictionPolicy
from service.api import gqa_pb2
from service.config import ServerConfig
from service.server import ServerThread
from tests.client import Session, open_message
from tests.oracle import attended_positions, attention_ref

B, HQ, HKV, D = 1, 8, 2, 32
POLICIES = {
    "none": dict(policy="none", capacity=80),
    "strict": dict(policy="strict", window=9),
    "greedy": dict(policy="greedy", window=7, capacity=12),
    "sink": dict(policy="sink", window=6, sink_tokens=3),
}
# Relative L2 error of the outputs of a stream against float64 on the original data (the
# quantization budget of tests/test_int8_backend.py, here only as a sanity bound).
BUDGET = 1e-2


@pytest.fixture(scope="module")
def channel():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            yield ch


@pytest.mark.parametrize("policy", list(POLICIES))
def test_int8_stream_over_the_wire(channel, policy):
    cfg = POLICIES[policy]
    g = torch.Generator().manual_seed(3)
    pk, pv = torch.randn(B, HKV, 5, D, generator=g), torch.randn(B, HKV, 5, D, generator=g)
    session = Session(channel, open_message(batch=B, hq=HQ, hkv=HKV, d=D, backend="int8", prefill={0: (pk, pv)}, **cfg))
    assert session.opened.backend == "int8"
    pol = EvictionPolicy.create(
        cfg["policy"], window=cfg.get("window", 0), capacity=cfg.get("capacity", 0), sinks=cfg.get("sink_tokens", 0)
    )
    local = Int8Backend().create_cache(CacheSpec(B, HQ, HKV, D, torch.float32, pol))
    assert session.opened.bytes_reserved == local.nbytes
    local.prefill(pk, pv)
    keys, values = list(pk.unbind(2)), list(pv.unbind(2))
    outs, refs = [], []
    for _ in range(40):
        q, k, v = (
            torch.randn(B, HQ, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
        )
        keys.append(k)
        values.append(v)
        resp = session.step(0, q, k, v)
        out = session.output(resp)
        # Exactly what the backend computes in process, and within budget of float64.
        assert torch.equal(out, local.step(q, k, v).output)
        pos = attended_positions(policy, len(keys), cfg.get("window", 0), cfg.get("sink_tokens", 0))
        refs.append(
            torch.as_tensor(
                attention_ref(
                    q.double(),
                    torch.stack([keys[p] for p in pos], 2).double(),
                    torch.stack([values[p] for p in pos], 2).double(),
                    HQ,
                    HKV,
                )
            )
        )
        outs.append(out.double())
        assert resp.step.tokens_seen == len(keys)
    err = (torch.stack(outs) - torch.stack(refs)).norm() / torch.stack(refs).norm()
    assert err < BUDGET
    # Non-finite input is refused in-band and changes nothing.
    bad = torch.full((B, HKV, D), float("nan"))
    resp = session.step(0, torch.zeros(B, HQ, D), bad, torch.zeros(B, HKV, D))
    assert resp.step.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # A snapshot carries codes and scales: the restored stream continues bit-identically.
    chunks = session.snapshot()
    assert any(c.key.dtype == gqa_pb2.DTYPE_INT8 for c in chunks[1:])
    restored = Session(channel, restore=chunks)
    for _ in range(5):
        q, k, v = (
            torch.randn(B, HQ, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
        )
        assert torch.equal(session.output(session.step(0, q, k, v)), restored.output(restored.step(0, q, k, v)))
    restored.close()
    session.close()


def test_snapshot_while_outlier_channels_are_being_chosen(channel):
    """Before 16 tokens the stream's first keys travel in the snapshot (key_calibration), so the
    restored stream chooses its float16 key channels exactly as the original does."""
    g = torch.Generator().manual_seed(5)
    session = Session(channel, open_message(batch=B, hq=HQ, hkv=HKV, d=D, backend="int8", policy="none", capacity=64))

    def step_args():
        k = torch.randn(B, HKV, D, generator=g)
        k[..., 7] *= 30  # an outlier channel
        return torch.randn(B, HQ, D, generator=g), k, torch.randn(B, HKV, D, generator=g)

    for _ in range(5):
        session.step(0, *step_args())
    chunks = session.snapshot()
    layer_chunks = [c for c in chunks[1:] if c.layer == 0]
    assert layer_chunks[0].HasField("key_calibration") and layer_chunks[0].key_calibration.shape == [B, HKV, 5, D]
    assert (
        len(layer_chunks[0].key_channels) == B * HKV * D and layer_chunks[0].key_outliers.dtype == gqa_pb2.DTYPE_FLOAT16
    )
    restored = Session(channel, restore=chunks)
    for _ in range(20):  # through the choices at 8 and 16 keys
        args = step_args()
        assert torch.equal(session.output(session.step(0, *args)), restored.output(restored.step(0, *args)))
    later = restored.snapshot()
    assert not any(c.HasField("key_calibration") for c in later[1:])
    # a tampered calibration row is caught by the checksum
    tampered = [gqa_pb2.SnapshotChunk() for _ in chunks]
    for t, c in zip(tampered, chunks):
        t.CopyFrom(c)
    first = next(t for t in tampered[1:] if t.layer == 0)
    data = bytearray(first.key_calibration.data)
    data[0] ^= 1
    first.key_calibration.data = bytes(data)
    with pytest.raises(grpc.RpcError) as err:
        Session(channel, restore=tampered)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in err.value.details()
    restored.close()
    session.close()
