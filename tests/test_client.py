"""The Python client (clients/python, ``gqa_client``) against a real in-process server: every
call, a snapshot larger than gRPC's default 4 MiB limit, the typed refusals, token and asyncio,
the defaults, one dtype rule for every call."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest
import torch

from gqa_client import (
    DEFAULT_CAPACITY,
    AsyncClient,
    CacheFull,
    CallFailed,
    Client,
    InexactRollback,
    InvalidArgument,
    NotFound,
    Refused,
    Snapshot,
    open_message,
)
from gqa_client.api import gqa_pb2, gqa_pb2_grpc
from gqa_client.tensors import bfloat16_bits, from_bfloat16_bits
from service.config import ServerConfig
from service.server import ServerThread
from tests.conftest import assert_close_to_oracle
from tests.oracle import attention_ref

BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)
HQ, HKV, D = 4, 2, 8
GRPC_DEFAULT_RECEIVE = 4 << 20


@pytest.fixture(scope="module")
def server():
    with ServerThread(BASE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as c:
        yield c


def rnd(g, *shape):
    return torch.randn(*shape, generator=g)


def test_server_info_health_and_decode_step(client, seed_examples):
    client.wait_ready(10)
    info = client.server_info()
    assert info.version and info.limits.max_message_bytes == BASE.max_message_bytes
    assert client.health() == "SERVING"
    assert client.health("gqa.v1.AttentionService") == "SERVING"
    for ex in seed_examples:
        i = ex["input"]
        result = client.decode_step(
            *(
                np.asarray(i[k], dtype=np.float32)
                for k in ("query", "new_key", "new_value", "key_cache", "value_cache")
            ),
            num_query_heads=i["num_query_heads"],
            num_kv_heads=i["num_kv_heads"],
        )
        assert isinstance(result.output, np.ndarray)  # a numpy query gets numpy back
        for key, expected in ex["output"].items():
            np.testing.assert_allclose(getattr(result, key), expected, atol=1e-6, rtol=1e-6)


def test_decode_step_infers_heads_and_sends_an_empty_cache(client):
    g = torch.Generator().manual_seed(1)
    q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
    empty = torch.empty(1, HKV, 0, D)
    result = client.decode_step(q, k, v, empty, empty)
    assert isinstance(result.output, torch.Tensor)
    as_numpy = client.decode_step(*(t.numpy() for t in (q, k, v, empty, empty)))
    np.testing.assert_array_equal(as_numpy.output, result.output.numpy())
    with pytest.raises(TypeError, match=r"query: a numpy float64 .*float32, float16 or bfloat16"):
        client.decode_step(*(t.double().numpy() for t in (q, k, v, empty, empty)))
    with pytest.raises(TypeError, match=r"new_value: a torch float16 tensor, but the stream's dtype is float32"):
        client.decode_step(q, k, v.half(), empty, empty)
    assert result.new_key_cache.shape == (1, HKV, 1, D)
    assert_close_to_oracle(result.output, attention_ref(q, k[:, :, None], v[:, :, None], HQ, HKV), torch.float32)


def test_stream_steps_match_the_oracle_with_torch_and_numpy(client):
    g = torch.Generator().manual_seed(2)
    keys, values = [], []
    with client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="greedy", window=4, capacity=6) as stream:
        assert stream.opened.capacity == 6 and stream.opened.window == 4
        for t in range(10):
            q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
            keys.append(k)
            values.append(v)
            args = (q, k, v) if t % 2 else (q.numpy(), k.numpy(), v.numpy())
            result = stream.step(0, *args)
            assert isinstance(result.output, type(args[0]))
            assert result.tokens_seen == t + 1 and result.compute_ns > 0
            attended = slice(max(0, t + 1 - 4), t + 1)
            expected = attention_ref(q, torch.stack(keys[attended], 2), torch.stack(values[attended], 2), HQ, HKV)
            assert_close_to_oracle(torch.as_tensor(result.output), expected, torch.float32)
        # greedy, C=6, W=4 (G=3): L(9)=6, L(10)=4, so the tenth step drops 3 positions in one block
        assert result.evicted_tokens == 3 and result.resident == 4 and result.first_position == 6


def test_refusals_are_typed_and_leave_the_stream_usable(client):
    g = torch.Generator().manual_seed(3)
    q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
    with client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=2) as stream:
        with pytest.raises(InvalidArgument) as bad:
            stream.step(0, q[:, :2], k, v)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "query" in bad.value.message
        with pytest.raises(InvalidArgument):
            stream.step(5, q, k, v)  # layer out of range
        first = stream.step(0, q, k, v)
        stream.step(0, q, k, v)
        with pytest.raises(CacheFull) as full:
            stream.step(0, q, k, v)
        assert isinstance(full.value, Refused) and full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stream.rollback(2, layer=0).tokens_seen == [0]
        again = stream.step(0, q, k, v)
        torch.testing.assert_close(again.output, first.output, rtol=0, atol=0)
    with client.open(
        num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=2, policy="strict", window=2
    ) as stream:
        for _ in range(3):
            stream.step(0, q, k, v)
        with pytest.raises(InexactRollback) as inexact:
            stream.rollback(1)
        assert inexact.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert stream.step(1, q, k, v).tokens_seen == 1  # still open


def test_a_refused_open_and_no_server_raise_call_failed(client):
    with pytest.raises(CallFailed) as refused:
        client.open(num_query_heads=3, num_kv_heads=2, head_dim=D, policy="none", capacity=4)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with Client("127.0.0.1:1", timeout=5) as nobody:
        with pytest.raises(CallFailed) as down:
            nobody.server_info()
        assert down.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(CallFailed):
            nobody.wait_ready(0.2)


def test_rollback_all_layers(client):
    g = torch.Generator().manual_seed(4)
    with client.open(
        num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=2, policy="greedy", window=2, capacity=4
    ) as stream:
        for layer in (0, 1, 0, 1):
            stream.step(layer, rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D))
        result = stream.rollback(1)
        assert result.tokens_seen == [1, 1] and len(result.rollback_reach) == 2


def test_snapshot_of_a_layer_over_4_mib_reaches_a_default_grpc_client(server, tmp_path):
    """1024 positions x 8 KV heads x 128 x 4 bytes x (K and V) = 8 MiB in one layer."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 32, 8, 128, 1024
    prefill = {0: (rnd(g, 1, hkv, n, d), rnd(g, 1, hkv, n, d))}
    q, k, v = rnd(g, 1, hq, d), rnd(g, 1, hkv, d), rnd(g, 1, hkv, d)
    # gRPC's default receive limit (4 MiB), set through the client's options...
    with Client(server.address, options=[("grpc.max_receive_message_length", GRPC_DEFAULT_RECEIVE)]) as small:
        with small.open(
            num_query_heads=hq, num_kv_heads=hkv, head_dim=d, policy="none", capacity=n + 8, prefill=prefill
        ) as stream:
            snap = stream.snapshot()
            assert len(snap) > 2 and all(c.ByteSize() < GRPC_DEFAULT_RECEIVE for c in snap.chunks)
            expected = stream.step(0, q, k, v).output
        path = tmp_path / "stream.gqasnap"
        snap.save(path)
        for source in (snap, snap.to_bytes(), path, str(path)):
            with small.restore(source) as again:
                assert list(again.opened.tokens_seen) == [n]
                torch.testing.assert_close(again.step(0, q, k, v).output, expected, rtol=0, atol=0)
    # ...and through a bare channel with no options at all, asking nothing of the chunk size.
    with grpc.insecure_channel(server.address) as channel:
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        requests = [gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in snap.chunks]
        requests.append(gqa_pb2.DecodeRequest(request_id=1, snapshot=gqa_pb2.SnapshotRequest()))
        responses = list(stub.Decode(iter(requests)))
        assert responses[0].WhichOneof("kind") == "opened"
        chunks = [r.snapshot for r in responses[1:]]
        assert chunks[-1].last and len(chunks) == len(snap)


def test_snapshot_bytes_round_trip_and_reject_garbage():
    chunks = [
        gqa_pb2.SnapshotChunk(config=gqa_pb2.OpenStream(num_layers=1), tokens_seen=[300]),
        gqa_pb2.SnapshotChunk(layer=0, offset=0, encoding="dense", last=True, checksum=7),
    ]
    snap = Snapshot(chunks)
    back = Snapshot.from_bytes(snap.to_bytes())
    assert back.chunks == chunks and back.tokens_seen == [300]
    with pytest.raises(ValueError):
        Snapshot.from_bytes(b"not a snapshot")
    with pytest.raises(ValueError):
        Snapshot.from_bytes(snap.to_bytes()[:-3])


def test_token_is_sent_on_every_call():
    config = dataclasses.replace(BASE, auth_token="client-test-token-0123456789")
    with ServerThread(config) as srv:
        with Client(srv.address) as anonymous:
            with pytest.raises(CallFailed) as denied:
                anonymous.server_info()
            assert denied.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(CallFailed):
                anonymous.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=2)
        with Client(srv.address, token="client-test-token-0123456789") as c:
            assert c.server_info().version
            with c.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=2) as stream:
                assert (
                    stream.step(0, torch.ones(1, HQ, D), torch.ones(1, HKV, D), torch.ones(1, HKV, D)).tokens_seen == 1
                )


def test_async_client_every_call(server):
    async def main():
        g = torch.Generator().manual_seed(6)
        async with AsyncClient(server.address) as client:
            assert (await client.server_info()).version
            q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
            empty = torch.empty(1, HKV, 0, D)
            assert (await client.decode_step(q, k, v, empty, empty)).output.shape == (1, HQ, D)
            stream = await client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=3)
            async with stream:
                await stream.step(0, q, k, v)
                with pytest.raises(InvalidArgument):
                    await stream.step(0, q[:, :1], k, v)
                await stream.step(0, q, k, v)
                assert (await stream.rollback(1)).tokens_seen == [1]
                snap = await stream.snapshot()
                expected = (await stream.step(0, q, k, v)).output
            async with await client.restore(snap.to_bytes()) as again:
                torch.testing.assert_close((await again.step(0, q, k, v)).output, expected, rtol=0, atol=0)
            with pytest.raises(CallFailed):
                await client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=0)

    asyncio.run(main())


def test_open_message_helper_builds_prefill():
    message = open_message(
        num_query_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype="bfloat16",
        policy="sink",
        window=4,
        sink_tokens=2,
        prefill={1: (np.zeros((1, HKV, 3, D), np.float32), np.zeros((1, HKV, 3, D), np.float32))},
    )
    assert message.dtype == gqa_pb2.DTYPE_BFLOAT16 and message.policy == gqa_pb2.EVICTION_POLICY_SINK
    assert message.prefill[0].layer == 1 and list(message.prefill[0].key.shape) == [1, HKV, 3, D]
    assert message.prefill[0].key.dtype == gqa_pb2.DTYPE_BFLOAT16


def test_mutual_tls_with_certificates_as_bytes_or_paths(tmp_path):
    pytest.importorskip("cryptography", reason="the test extra generates the certificates")
    from tests.test_security import _ca, _leaf, _pem, _pem_key

    ca_key, ca = _ca("client-test-ca")
    server_key, server_cert = _leaf("localhost", ca_key, ca, server=True)
    client_key, client_cert = _leaf("gqa-client", ca_key, ca)
    paths = {}
    for name, pem in (
        ("ca", _pem(ca)),
        ("server_cert", _pem(server_cert)),
        ("server_key", _pem_key(server_key)),
        ("client_cert", _pem(client_cert)),
        ("client_key", _pem_key(client_key)),
    ):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_bytes(pem)
    config = dataclasses.replace(
        BASE,
        tls_cert_file=str(paths["server_cert"]),
        tls_key_file=str(paths["server_key"]),
        tls_client_ca_file=str(paths["ca"]),
    )
    with ServerThread(config) as srv:
        with Client(
            srv.address,
            root_certificates=_pem(ca),
            certificate_chain=_pem(client_cert),
            private_key=_pem_key(client_key),
        ) as c:
            with c.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="none", capacity=2) as stream:
                assert (
                    stream.step(0, torch.ones(1, HQ, D), torch.ones(1, HKV, D), torch.ones(1, HKV, D)).tokens_seen == 1
                )
        with Client(
            srv.address,
            root_certificates=paths["ca"],
            certificate_chain=paths["client_cert"],
            private_key=paths["client_key"],
        ) as c:
            assert c.server_info().version
        with Client(srv.address, root_certificates=paths["ca"], timeout=10) as no_client_cert:
            with pytest.raises(CallFailed) as refused:
                no_client_cert.server_info()
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_batch_session_carries_the_token_and_matches_a_decode_stream():
    config = dataclasses.replace(BASE, auth_token="client-test-token-0123456789")
    g = torch.Generator().manual_seed(9)
    steps = [(rnd(g, 2, HQ, D), rnd(g, 2, HKV, D), rnd(g, 2, HKV, D)) for _ in range(3)]
    with ServerThread(config) as srv, Client(srv.address, token="client-test-token-0123456789") as c:
        session = c.batch(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D)
        session.add(7, policy="strict", window=2)
        session.add(8, policy="none", capacity=4)
        outputs = [session.step(0, [7, 8], q, k, v).output for q, k, v in steps]
        session.close()
        for row, (policy, kw) in enumerate((("strict", dict(window=2)), ("none", dict(capacity=4)))):
            with c.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy=policy, **kw) as stream:
                for (q, k, v), out in zip(steps, outputs):
                    alone = stream.step(0, q[row : row + 1], k[row : row + 1], v[row : row + 1]).output
                    assert torch.equal(alone[0], out[row])


def test_every_default_opens_a_valid_stream_and_sequence(client):
    """No policy arguments: a ``none`` stream (and Batch sequence) of ``DEFAULT_CAPACITY`` tokens."""
    g = torch.Generator().manual_seed(10)
    q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
    with client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D) as stream:
        assert stream.opened.policy == gqa_pb2.EVICTION_POLICY_NONE and stream.opened.capacity == DEFAULT_CAPACITY
        assert stream.dtype == "float32" and stream.step(0, q, k, v).tokens_seen == 1
    with client.batch(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D) as session:
        added = session.add(1)
        assert added.policy == gqa_pb2.EVICTION_POLICY_NONE and added.capacity == DEFAULT_CAPACITY
        assert session.step(0, [1], q, k, v).tokens_seen == [1]
    with pytest.raises(ValueError, match="policy: 'lru' is not one of none, strict, greedy, sink"):
        client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, policy="lru")


def test_a_tensor_of_another_dtype_is_refused_before_anything_is_sent(client):
    g = torch.Generator().manual_seed(11)
    q, k, v = rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)
    with client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=2) as stream:
        with pytest.raises(TypeError, match=r"^query: a torch float16 tensor, but the stream's dtype is float32"):
            stream.step(0, q.half(), k, v)
        with pytest.raises(TypeError, match=r"^new_key: a numpy float64 array, but the stream's dtype is float32"):
            stream.step(0, q.numpy(), k.double().numpy(), v.numpy())
        with pytest.raises(TypeError, match=r"^new_value: expected a numpy array or a torch tensor, got list"):
            stream.step(0, q, k, v.tolist())
        assert stream.step(1, q, k, v).tokens_seen == 1  # nothing reached the server
    with client.open(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="bfloat16") as stream:
        with pytest.raises(TypeError, match=r"^query: a torch float32 tensor, but the stream's dtype is bfloat16"):
            stream.step(0, q, k.bfloat16(), v.bfloat16())
        with pytest.raises(TypeError, match=r"^query: a numpy float16 array, .* bfloat16, which numpy lacks"):
            stream.step(0, q.half().numpy(), k.numpy(), v.numpy())
        assert stream.step(0, q.bfloat16(), k.bfloat16(), v.bfloat16()).tokens_seen == 1
    with pytest.raises(TypeError, match=r"^prefill\[0\]\.value: a torch float32 tensor, .* float16"):
        open_message(
            num_query_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            dtype=torch.float16,
            prefill={0: (torch.zeros(1, HKV, 2, D, dtype=torch.float16), torch.zeros(1, HKV, 2, D))},
        )
    with client.batch(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=np.float16) as session:
        assert session.dtype == "float16"
        with pytest.raises(TypeError, match=r"^prefill\[0\]\.key: a numpy float32 array, .* float16"):
            session.add(1, prefill={0: (k[:, :, None].numpy(), v[:, :, None].half().numpy())})
        session.add(1)
        with pytest.raises(TypeError, match=r"^new_value: a torch bfloat16 tensor, .* float16"):
            session.step(0, [1], q.half(), k.half(), v.bfloat16())
        assert session.step(0, [1], q.half(), k.half(), v.half()).tokens_seen == [1]


def test_numpy_float32_on_a_bfloat16_stream_is_rounded_as_torch_rounds():
    """The dtype rule's one exception: numpy has no bfloat16, so float32 arrays travel rounded to
    nearest (ties to even) and bfloat16 results come back as float32, exactly."""
    g = torch.Generator().manual_seed(12)
    values = torch.cat(
        [
            torch.randn(4096, generator=g) * 10.0 ** torch.randint(-40, 39, (4096,), generator=g),
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45]),
            # exact ties between two bfloat16 neighbours (both parities) and one ulp past them
            torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF], dtype=torch.int32).view(torch.float32),
        ]
    )
    expected = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bfloat16_bits(values.numpy())
    nan = np.isnan(values.numpy())
    assert nan.sum() == 1 and got[nan] == [0x7FC0]  # torch's NaN bits differ by code path; any NaN is one
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    back = from_bfloat16_bits(got)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, values.to(torch.bfloat16).float().numpy())


def test_numpy_and_torch_callers_get_the_same_bfloat16_results(client):
    g = torch.Generator().manual_seed(13)
    steps = [(rnd(g, 1, HQ, D), rnd(g, 1, HKV, D), rnd(g, 1, HKV, D)) for _ in range(3)]
    kw = dict(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype="bfloat16", policy="strict", window=2)
    with client.open(**kw) as as_numpy, client.open(**kw) as as_torch:
        for q, k, v in steps:
            n = as_numpy.step(0, q.numpy(), k.numpy(), v.numpy()).output
            t = as_torch.step(0, q.bfloat16(), k.bfloat16(), v.bfloat16()).output
            assert isinstance(n, np.ndarray) and n.dtype == np.float32 and t.dtype == torch.bfloat16
            np.testing.assert_array_equal(n, t.float().numpy())


def test_batch_session_names_refusals_and_snapshots_like_decode_streams(client, tmp_path):
    g = torch.Generator().manual_seed(14)
    q, k, v = rnd(g, 2, HQ, D), rnd(g, 2, HKV, D), rnd(g, 2, HKV, D)
    with client.batch(num_query_heads=HQ, num_kv_heads=HKV, head_dim=D, num_layers=2) as session:
        added = session.add(1, policy="sink", window=3, sink_tokens=2)
        assert added.sink_tokens == 2 and added.capacity == 5
        with pytest.raises(InvalidArgument) as in_use:
            session.add(1, policy="strict", window=2)
        assert in_use.value.id == 1 and isinstance(in_use.value, Refused)
        with pytest.raises(NotFound) as missing:
            session.snapshot(9)
        assert missing.value.id == 9 and missing.value.code == grpc.StatusCode.NOT_FOUND
        session.add(2, policy="none", capacity=8)
        out = session.step(0, [1, 2], q.numpy(), k.numpy(), v.numpy())
        assert isinstance(out.output, np.ndarray) and out.output.shape == (2, HQ, D)
        out = session.step(0, [1, 3], q, k, v)
        assert list(out.refusals) == [3] and isinstance(out.refusals[3], NotFound) and out.refusals[3].id == 3
        rolled = session.rollback([2, 3], [1, 1], layer=0)
        assert rolled.tokens_seen == [[0, 0], [0, 0]] and list(rolled.refusals) == [3]
        snap = session.snapshot(1)
        assert isinstance(snap, Snapshot) and snap.tokens_seen == [2, 0]
        snap.save(tmp_path / "one.gqasnap")
        for sid, source in ((10, snap), (11, snap.to_bytes()), (12, tmp_path / "one.gqasnap"), (13, snap.chunks)):
            assert list(session.restore(sid, source).tokens_seen) == [2, 0]
        removed = session.remove([10, 11, 99])
        assert list(removed) == [99] and isinstance(removed[99], NotFound)
    with client.restore(snap) as stream:  # a sequence's snapshot opens a Decode stream too
        assert list(stream.opened.tokens_seen) == [2, 0] and stream.opened.sink_tokens == 2


def test_the_client_package_imports_nothing_of_the_server_nor_torch():
    """Statically, every module of gqa_client (the fresh-venv test checks it at run time)."""
    import ast
    import pathlib

    import gqa_client

    package = pathlib.Path(gqa_client.__file__).parent
    sources = sorted(package.rglob("*.py"))
    assert len(sources) > 5
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            # gqa_client.transformers is the `transformers` extra: torch and transformers by design
            extra = "transformers" in path.relative_to(package).parts[:1]
            banned = ("service", "backends", "quant", "tests") + (() if extra else ("torch",))
            for name in names:
                assert name.split(".")[0] not in banned, f"{path}: {name}"
