"""Rollback for speculative decoding, and snapshot / restore for migration."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from backends.contract import CacheSpec
from backends.cpu import CPUBackend
from backends.errors import RollbackError
from backends.policy import EvictionPolicy
from service.api import gqa_pb2
from service.config import ServerConfig
from service.server import ServerThread
from tests.client import CHANNEL_OPTIONS, Session, open_message
from tests.conftest import assert_close_to_oracle
from tests.metrics_load import free_port
from tests.oracle import attended_positions, attention_ref

HQ, HKV, D = 4, 2, 8
POLICIES = {
    "none": dict(policy="none", capacity=200),
    "strict": dict(policy="strict", window=6),
    "greedy": dict(policy="greedy", window=6, capacity=11),
    "sink": dict(policy="sink", window=6, sink_tokens=2),
}


def make_policy(cfg) -> EvictionPolicy:
    return EvictionPolicy.create(
        cfg["policy"], window=cfg.get("window", 0), capacity=cfg.get("capacity", 0), sinks=cfg.get("sink_tokens", 0)
    )


def tokens(g, n=1):
    return [
        (torch.randn(1, HQ, D, generator=g), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g))
        for _ in range(n)
    ]


# -- rollback, on the cache ------------------------------------------------------------------
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_random_rollbacks_match_the_oracle(policy_name):
    cfg = POLICIES[policy_name]
    policy = make_policy(cfg)
    cache = CPUBackend().create_cache(CacheSpec(1, HQ, HKV, D, torch.float32, policy))
    rng = random.Random(policy_name)
    g = torch.Generator().manual_seed(11)
    keys, values = [], []
    exact = refused = 0
    for _ in range(150):
        if keys and rng.random() < 0.3:
            reach = policy.rollback_reach(len(keys))
            k = rng.randint(1, reach + 2)  # within reach most of the time, past it sometimes
            before = cache.tokens_seen, cache.export()
            if k <= reach:
                cache.rollback(k)
                del keys[-k:], values[-k:]
                exact += 1
            else:
                with pytest.raises(RollbackError, match=f"at most {reach}"):
                    cache.rollback(k)
                after = cache.tokens_seen, cache.export()
                assert before[0] == after[0] and torch.equal(before[1][0], after[1][0])
                refused += 1
            continue
        ((q, k_, v),) = tokens(g)
        keys.append(k_)
        values.append(v)
        out = cache.step(q, k_, v).output
        pos = attended_positions(policy_name, len(keys), cfg.get("window", 0), cfg.get("sink_tokens", 0))
        ref = attention_ref(
            q.double(),
            torch.stack([keys[p] for p in pos], 2).double(),
            torch.stack([values[p] for p in pos], 2).double(),
            HQ,
            HKV,
        )
        assert_close_to_oracle(out, ref, torch.float32)
    # strict can only roll back before its window fills; the others keep some reach.
    assert exact >= (1 if policy_name == "strict" else 5)
    assert refused >= 1


def test_greedy_slack_allows_what_strict_refuses():
    strict = EvictionPolicy.strict(6)
    greedy = EvictionPolicy.greedy(6, 11)
    t = 40  # both past their windows
    assert strict.rollback_reach(t) == 0
    assert greedy.rollback_reach(t) > 0


# -- over the wire -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, max_message_bytes=64 << 10)
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as ch:
        yield ch


def rollback(session, rid, count, layer=0, all_layers=False):
    session.send(
        gqa_pb2.DecodeRequest(
            request_id=rid, rollback=gqa_pb2.Rollback(count=count, layer=layer, all_layers=all_layers)
        )
    )
    resp = session.recv()
    assert resp.request_id == rid
    return resp.rollback


def test_rollback_over_the_wire(channel):
    session = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, layers=2, **POLICIES["greedy"]))
    g = torch.Generator().manual_seed(2)
    steps = tokens(g, 14)
    for x in steps:
        resp = session.step(0, *x)
    # T=14, W=6, C=11: L(14)=8 (positions 6..13); dropping 2 leaves L(12)=6, dropping 3 would
    # need position 5 back.
    assert (resp.step.resident, resp.step.rollback_reach) == (8, 2)
    # Rolling back more than the reach is refused in-band with the reach in the message.
    assert session.step(1, *steps[0]).step.status.code == 0
    result = rollback(session, 50, 5, all_layers=True)
    assert result.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "at most" in result.status.message
    assert list(result.tokens_seen) == [14, 1]
    result = rollback(session, 51, 2, layer=0)
    assert result.status.code == 0 and list(result.tokens_seen) == [12, 1]
    assert list(result.rollback_reach) == [0, 1]
    # The next output equals that of a stream that never saw the dropped tokens.
    fresh = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, layers=1, **POLICIES["greedy"]))
    for x in steps[:12]:
        fresh.step(0, *x)
    ((q, k, v),) = tokens(g)
    a = session.output(session.step(0, q, k, v))
    b = fresh.output(fresh.step(0, q, k, v))
    assert torch.equal(a, b)
    result = rollback(session, 52, 1, layer=7)
    assert result.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "layer" in result.status.message
    session.close()
    fresh.close()


def start_server_process(**env_overrides):
    port = free_port()
    env = dict(os.environ, GQA_ADDRESS=f"127.0.0.1:{port}", GQA_METRICS_PORT="0", **env_overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=60)
    return proc, channel


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.mark.parametrize("policy_name", ["greedy", "sink"])
def test_snapshot_restore_on_another_process_is_bit_identical(channel, policy_name):
    cfg = POLICIES[policy_name]
    g = torch.Generator().manual_seed(4)
    prefill = {1: (torch.randn(1, HKV, 30, D, generator=g), torch.randn(1, HKV, 30, D, generator=g))}
    session = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, layers=3, prefill=prefill, **cfg))
    for i, x in enumerate(tokens(g, 25)):
        session.step(i % 2, *x)
    chunks = session.snapshot()
    assert len(chunks) >= 2
    proc, other = start_server_process()
    try:
        restored = Session(other, restore=chunks)
        assert list(restored.opened.tokens_seen) == [13, 42, 0]
        for i, x in enumerate(tokens(g, 30)):
            a = session.output(session.step(i % 3, *x))
            b = restored.output(restored.step(i % 3, *x))
            assert torch.equal(a, b)
        restored.close()
    finally:
        other.close()
        stop(proc)
    session.close()


def test_large_snapshot_is_chunked_under_the_message_limit(channel):
    # 64 KiB limit on this server; two layers of 2 x 1 x 2 x 400 x 8 x 4 = 51 KB each must split.
    cfg = dict(policy="none", capacity=700)
    g = torch.Generator().manual_seed(5)
    session = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, layers=2, **cfg))
    for layer in (0, 1):
        prefill = (torch.randn(1, HKV, 400, D, generator=g), torch.randn(1, HKV, 400, D, generator=g))
        for i in range(400):
            session.step(layer, torch.zeros(1, HQ, D), prefill[0][:, :, i], prefill[1][:, :, i])
    chunks = session.snapshot()
    assert len(chunks) >= 5
    assert all(c.ByteSize() < 64 << 10 for c in chunks)
    restored = Session(channel, restore=chunks)
    ((q, k, v),) = tokens(g)
    assert torch.equal(session.output(session.step(0, q, k, v)), restored.output(restored.step(0, q, k, v)))
    session.close()
    restored.close()


def _tampered(chunks):
    out = [type(c).FromString(c.SerializeToString()) for c in chunks]
    data = bytearray(out[1].key.data)
    data[0] ^= 1
    out[1].key.data = bytes(data)
    return out


def _inconsistent(chunks):
    out = [type(c).FromString(c.SerializeToString()) for c in chunks]
    out[0].tokens_seen[0] += 1  # T no longer matches the resident data (the checksum covers data only)
    return out


def _wrong_layers(chunks):
    out = [type(c).FromString(c.SerializeToString()) for c in chunks]
    out[0].config.num_layers = 2
    return out


def _truncated(chunks):
    return chunks[:-1]


@pytest.mark.parametrize(
    "mangle,word",
    [(_tampered, "checksum"), (_inconsistent, "layer 0"), (_wrong_layers, "layers"), (_truncated, "last")],
    ids=["tampered", "inconsistent", "wrong-layers", "truncated"],
)
def test_bad_snapshot_is_refused(channel, server, mangle, word):
    g = torch.Generator().manual_seed(6)
    session = Session(channel, open_message(hq=HQ, hkv=HKV, d=D, **POLICIES["strict"]))
    for x in tokens(g, 4):
        session.step(0, *x)
    chunks = session.snapshot()
    reserved = server.engine.bytes_reserved
    bad = mangle(chunks)
    with pytest.raises(grpc.RpcError) as info:
        if bad[-1].last:
            Session(channel, restore=bad)
        else:  # the client closes before the last chunk
            from service.api import gqa_pb2_grpc

            list(
                gqa_pb2_grpc.AttentionServiceStub(channel).Decode(iter([gqa_pb2.DecodeRequest(restore=c) for c in bad]))
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert word in info.value.details()
    assert server.engine.bytes_reserved == reserved
    session.close()


def test_migration_while_draining_loses_no_step():
    """A client moves a live stream from a draining server to another: no step lost, and the
    outputs equal those of a stream that never moved."""
    g = torch.Generator().manual_seed(8)
    script = tokens(g, 60)
    open_msg = open_message(hq=HQ, hkv=HKV, d=D, layers=2, **POLICIES["greedy"])
    old_proc, old = start_server_process(GQA_GRACE_PERIOD_S="20")
    new_proc, new = start_server_process()
    try:
        reference = Session(new, open_msg)
        expected = [reference.output(reference.step(i % 2, *x)) for i, x in enumerate(script)]
        reference.close()

        session = Session(old, open_msg)
        outputs = [session.output(session.step(i % 2, *x)) for i, x in enumerate(script[:30])]
        old_proc.send_signal(signal.SIGTERM)  # the pod is being drained
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(old)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        moved = Session(new, restore=session.snapshot())
        session.close()
        outputs += [moved.output(moved.step((30 + i) % 2, *x)) for i, x in enumerate(script[30:])]
        moved.close()
        assert len(outputs) == len(expected)
        for a, b in zip(outputs, expected):
            assert torch.equal(a, b)
        assert old_proc.wait(timeout=20) == 0  # the drained server exits once its streams are gone
    finally:
        old.close()
        new.close()
        stop(old_proc)
        stop(new_proc)
