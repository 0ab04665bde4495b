"""The gRPC service as a client sees it: an in-process server on loopback, real stubs."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.engine.tensors import from_proto, to_proto
from service.server import ServerThread
from tests.client import CHANNEL_OPTIONS, Session, open_message, step_request, wait_until
from tests.conftest import assert_close_to_oracle
from tests.oracle import attended_positions, attention_ref, decode_step_ref

BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def server():
    with ServerThread(BASE) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return gqa_pb2_grpc.AttentionServiceStub(channel)


def rnd(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# -- DecodeStep ---------------------------------------------------------------------------
def test_decode_step_seed_examples(stub, seed_examples):
    for ex in seed_examples:
        i = ex["input"]
        t = {
            k: torch.tensor(i[k], dtype=torch.float32)
            for k in ("query", "new_key", "new_value", "key_cache", "value_cache")
        }
        resp = stub.DecodeStep(
            gqa_pb2.DecodeStepRequest(
                **{k: to_proto(v) for k, v in t.items()},
                num_query_heads=i["num_query_heads"],
                num_kv_heads=i["num_kv_heads"],
            )
        )
        for key in ("output", "new_key_cache", "new_value_cache"):
            got = from_proto(getattr(resp, key), key)
            torch.testing.assert_close(got, torch.tensor(ex["output"][key], dtype=torch.float32), atol=1e-6, rtol=1e-6)


GRID = [(1, 4, 1, 8, 0), (3, 32, 8, 128, 97), (2, 40, 8, 80, 17), (1, 8, 8, 2, 1), (1, 32, 8, 64, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("b,hq,hkv,d,s", GRID, ids=lambda v: str(v))
def test_decode_step_grid(stub, b, hq, hkv, d, s, dtype):
    g = torch.Generator().manual_seed(s + d)
    q, k, v = rnd(g, b, hq, d, dtype=dtype), rnd(g, b, hkv, d, dtype=dtype), rnd(g, b, hkv, d, dtype=dtype)
    kc, vc = rnd(g, b, hkv, s, d, dtype=dtype), rnd(g, b, hkv, s, d, dtype=dtype)
    resp = stub.DecodeStep(
        gqa_pb2.DecodeStepRequest(
            query=to_proto(q),
            new_key=to_proto(k),
            new_value=to_proto(v),
            key_cache=to_proto(kc),
            value_cache=to_proto(vc),
            num_query_heads=hq,
            num_kv_heads=hkv,
        )
    )
    out = from_proto(resp.output, "output")
    assert out.dtype == dtype
    ref = decode_step_ref(q.double(), k.double(), v.double(), kc.double(), vc.double(), hq, hkv)
    assert_close_to_oracle(out, ref["output"], dtype)
    assert torch.equal(from_proto(resp.new_key_cache, "k"), torch.cat([kc, k.unsqueeze(2)], 2))


def _bad_stateless():
    ok = dict(
        query=to_proto(torch.zeros(1, 4, 8)),
        new_key=to_proto(torch.zeros(1, 2, 8)),
        new_value=to_proto(torch.zeros(1, 2, 8)),
        key_cache=to_proto(torch.zeros(1, 2, 3, 8)),
        value_cache=to_proto(torch.zeros(1, 2, 3, 8)),
        num_query_heads=4,
        num_kv_heads=2,
    )
    bad_len = to_proto(torch.zeros(1, 4, 8))
    bad_len.data = bad_len.data[:-1]
    bad_dtype = to_proto(torch.zeros(1, 4, 8))
    bad_dtype.dtype = 77
    return [
        ("byte-length", dict(ok, query=bad_len), "query.data"),
        ("unknown-dtype", dict(ok, query=bad_dtype), "query.dtype"),
        ("unspecified-dtype", dict(ok, new_key=gqa_pb2.Tensor(shape=[1, 2, 8])), "new_key.dtype"),
        ("heads", dict(ok, num_query_heads=3), "num_query_heads"),
        ("zero-heads", dict(ok, num_kv_heads=0), "num_kv_heads"),
        ("rank", dict(ok, key_cache=to_proto(torch.zeros(2, 3, 8))), "key_cache"),
        ("mixed-dtype", dict(ok, new_value=to_proto(torch.zeros(1, 2, 8, dtype=torch.float16))), "new_value"),
    ]


@pytest.mark.parametrize("name,fields,word", _bad_stateless(), ids=lambda v: v if isinstance(v, str) else "")
def test_decode_step_invalid_argument(stub, name, fields, word):
    with pytest.raises(grpc.RpcError) as info:
        stub.DecodeStep(gqa_pb2.DecodeStepRequest(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert word in info.value.details()


# -- Decode streams -----------------------------------------------------------------------
POLICY_CASES = {
    "none": dict(policy="none", capacity=64),
    "strict": dict(policy="strict", window=9),
    "greedy": dict(policy="greedy", window=7, capacity=12),
    "sink": dict(policy="sink", window=6, sink_tokens=3),
}


@pytest.mark.parametrize("policy", list(POLICY_CASES))
def test_stream_matches_oracle(channel, policy):
    cfg = POLICY_CASES[policy]
    b, hq, hkv, d, layers = 2, 8, 2, 16, 3
    g = torch.Generator().manual_seed(7)
    prefill = {0: (rnd(g, b, hkv, 5, d), rnd(g, b, hkv, 5, d)), 2: (rnd(g, b, hkv, 15, d), rnd(g, b, hkv, 15, d))}
    if policy == "none":
        prefill[2] = (prefill[2][0][:, :, :10], prefill[2][1][:, :, :10])
    session = Session(channel, open_message(batch=b, hq=hq, hkv=hkv, d=d, layers=layers, prefill=prefill, **cfg))
    history = {layer: ([], []) for layer in range(layers)}
    for layer, (k, v) in prefill.items():
        history[layer][0].extend(k.unbind(2))
        history[layer][1].extend(v.unbind(2))
    assert list(session.opened.tokens_seen) == [len(history[i][0]) for i in range(layers)]
    window = cfg.get("window", 0)
    for i in range(40):
        layer = i % layers
        q, k, v = rnd(g, b, hq, d), rnd(g, b, hkv, d), rnd(g, b, hkv, d)
        history[layer][0].append(k)
        history[layer][1].append(v)
        resp = session.step(layer, q, k, v)
        out = session.output(resp)
        t = len(history[layer][0])
        pos = attended_positions(policy, t, window, cfg.get("sink_tokens", 0))
        keys = torch.stack([history[layer][0][p] for p in pos], 2)
        values = torch.stack([history[layer][1][p] for p in pos], 2)
        assert_close_to_oracle(out, attention_ref(q.double(), keys.double(), values.double(), hq, hkv), torch.float32)
        r = resp.step
        assert r.tokens_seen == t
        policy_obj = _policy(cfg)
        resident = [p for rr in policy_obj.resident(t) for p in rr]
        assert (r.resident, r.first_position, r.last_position) == (len(resident), resident[0], resident[-1])
        assert r.evicted == (policy_obj.evicted_by_step(t - 1) > 0)
        assert r.compute_ns > 0
        assert r.rollback_reach == policy_obj.rollback_reach(t)
    session.close()


def _policy(cfg):
    from backends.policy import EvictionPolicy

    return EvictionPolicy.create(
        cfg["policy"], window=cfg.get("window", 0), capacity=cfg.get("capacity", 0), sinks=cfg.get("sink_tokens", 0)
    )


def test_opened_reply_reports_the_grant(channel):
    session = Session(channel, open_message(hq=4, hkv=2, d=8, layers=2, policy="greedy", window=8, capacity=12))
    o = session.opened
    assert (o.backend, o.capacity, o.window, o.num_layers) == ("cpu", 12, 8, 2)
    assert o.bytes_reserved == 2 * (2 * 1 * 2 * 12 * 8 * 4)
    session.close()


def _bad_steps():
    g = torch.Generator().manual_seed(1)
    good = lambda: (rnd(g, 1, 4, 8), rnd(g, 1, 2, 8), rnd(g, 1, 2, 8))  # noqa: E731
    q, k, v = good()
    short = to_proto(q)
    short.data = short.data[:-4]
    unknown = to_proto(q)
    unknown.dtype = 9
    return [
        ("layer-out-of-range", lambda s: step_request(99, 5, q, k, v), "INVALID_ARGUMENT", "layer"),
        ("query-heads", lambda s: step_request(99, 0, rnd(g, 1, 6, 8), k, v), "INVALID_ARGUMENT", "query"),
        ("key-shape", lambda s: step_request(99, 0, q, rnd(g, 1, 2, 9), v), "INVALID_ARGUMENT", "new_key"),
        ("dtype", lambda s: step_request(99, 0, q.half(), k.half(), v.half()), "INVALID_ARGUMENT", "dtype"),
        (
            "byte-length",
            lambda s: gqa_pb2.DecodeRequest(
                request_id=99, step=gqa_pb2.Step(query=short, new_key=to_proto(k), new_value=to_proto(v))
            ),
            "INVALID_ARGUMENT",
            "step.query.data",
        ),
        (
            "unknown-dtype",
            lambda s: gqa_pb2.DecodeRequest(
                request_id=99, step=gqa_pb2.Step(query=unknown, new_key=to_proto(k), new_value=to_proto(v))
            ),
            "INVALID_ARGUMENT",
            "step.query.dtype",
        ),
        (
            "missing-tensor",
            lambda s: gqa_pb2.DecodeRequest(request_id=99, step=gqa_pb2.Step(query=to_proto(q), new_value=to_proto(v))),
            "INVALID_ARGUMENT",
            "step.new_key",
        ),
    ]


@pytest.mark.parametrize("name,make,code,word", _bad_steps(), ids=lambda v: v if isinstance(v, str) else "")
def test_refused_step_is_in_band_and_stream_goes_on(channel, server, name, make, code, word):
    session = Session(channel, open_message(hq=4, hkv=2, d=8, policy="strict", window=4))
    g = torch.Generator().manual_seed(5)
    ks, vs = [], []
    for _ in range(6):
        q, k, v = rnd(g, 1, 4, 8), rnd(g, 1, 2, 8), rnd(g, 1, 2, 8)
        ks.append(k)
        vs.append(v)  # noqa: E702
        session.step(0, q, k, v)
    stream = next(s for s in server.engine.streams() if s.id == session.opened.stream_id)
    before = stream.caches[0].export(), stream.caches[0].tokens_seen
    session.send(make(session))
    resp = session.recv()
    assert resp.request_id == 99
    assert resp.step.status.code == grpc.StatusCode[code].value[0]
    assert word in resp.step.status.message
    after = stream.caches[0].export(), stream.caches[0].tokens_seen
    assert torch.equal(before[0][0], after[0][0]) and torch.equal(before[0][1], after[0][1]) and before[1] == after[1]
    # The next step is exact.
    q, k, v = rnd(g, 1, 4, 8), rnd(g, 1, 2, 8), rnd(g, 1, 2, 8)
    ks.append(k)
    vs.append(v)  # noqa: E702
    out = session.output(session.step(0, q, k, v))
    ref = attention_ref(q.double(), torch.stack(ks[-4:], 2).double(), torch.stack(vs[-4:], 2).double(), 4, 2)
    assert_close_to_oracle(out, ref, torch.float32)
    session.close()


def test_no_room_under_none_is_resource_exhausted_in_band(channel):
    session = Session(channel, open_message(policy="none", capacity=3))
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        assert session.step(0, rnd(g, 1, 4, 8), rnd(g, 1, 2, 8), rnd(g, 1, 2, 8)).step.status.code == 0
    resp = session.step(0, rnd(g, 1, 4, 8), rnd(g, 1, 2, 8), rnd(g, 1, 2, 8))
    assert resp.step.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "full" in resp.step.status.message
    session.close()


def _fatal_opens():
    return [
        ("zero-heads", open_message(hq=0), grpc.StatusCode.INVALID_ARGUMENT, "num_query_heads"),
        ("heads-not-multiple", open_message(hq=5, hkv=2), grpc.StatusCode.INVALID_ARGUMENT, "multiple"),
        (
            "unknown-policy",
            gqa_pb2.OpenStream(
                batch_size=1, num_query_heads=1, num_kv_heads=1, head_dim=4, num_layers=1, policy=42, window=3
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy",
        ),
        (
            "unspecified-policy",
            gqa_pb2.OpenStream(batch_size=1, num_query_heads=1, num_kv_heads=1, head_dim=4, num_layers=1, window=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy",
        ),
        (
            "unknown-dtype",
            gqa_pb2.OpenStream(
                batch_size=1,
                num_query_heads=1,
                num_kv_heads=1,
                head_dim=4,
                num_layers=1,
                dtype=17,
                policy=gqa_pb2.EVICTION_POLICY_STRICT,
                window=3,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dtype",
        ),
        ("window-zero", open_message(policy="strict", window=0), grpc.StatusCode.INVALID_ARGUMENT, "window"),
        (
            "greedy-capacity",
            open_message(policy="greedy", window=8, capacity=4),
            grpc.StatusCode.INVALID_ARGUMENT,
            "capacity",
        ),
        ("too-many-layers", open_message(layers=100000), grpc.StatusCode.INVALID_ARGUMENT, "num_layers"),
        ("capacity-limit", open_message(policy="none", capacity=1 << 30), grpc.StatusCode.INVALID_ARGUMENT, "capacity"),
        ("unknown-backend", open_message(backend="tpu"), grpc.StatusCode.FAILED_PRECONDITION, "tpu"),
        ("cuda-here", open_message(backend="cuda", dtype=torch.float16), grpc.StatusCode.FAILED_PRECONDITION, "cuda"),
        (
            "prefill-shape",
            open_message(prefill={0: (torch.zeros(1, 2, 3, 9), torch.zeros(1, 2, 3, 9))}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill",
        ),
        (
            "prefill-layer",
            open_message(prefill={4: (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prefill.layer",
        ),
        (
            "prefill-too-long",
            open_message(policy="none", capacity=2, prefill={0: (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "capacity",
        ),
    ]


@pytest.mark.parametrize("name,msg,code,word", _fatal_opens(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_open_ends_the_rpc(channel, server, name, msg, code, word):
    reserved = server.engine.bytes_reserved
    with pytest.raises(grpc.RpcError) as info:
        Session(channel, msg)
    assert info.value.code() == code, info.value.details()
    assert word in info.value.details()
    assert server.engine.bytes_reserved == reserved


def test_protocol_errors_end_the_rpc(stub):
    step = step_request(1, 0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(iter([step])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first message" in info.value.details()
    opening = gqa_pb2.DecodeRequest(open=open_message())
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(iter([opening, opening])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(iter([opening, gqa_pb2.DecodeRequest(request_id=3)])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_empty_stream_is_fine(stub):
    assert list(stub.Decode(iter([]))) == []


def test_concurrent_streams_match_sequential(channel):
    n_streams, steps = 16, 200
    hq, hkv, d = 8, 2, 16

    def inputs(i):
        g = torch.Generator().manual_seed(1000 + i)
        return [(rnd(g, 1, hq, d), rnd(g, 1, hkv, d), rnd(g, 1, hkv, d)) for _ in range(steps)]

    def run(i):
        session = Session(channel, open_message(hq=hq, hkv=hkv, d=d, policy="greedy", window=32, capacity=48))
        outs = [session.output(session.step(0, *x)) for x in inputs(i)]
        session.close()
        return torch.stack(outs)

    sequential = [run(i) for i in range(n_streams)]
    with concurrent.futures.ThreadPoolExecutor(n_streams) as pool:
        concurrent_ = list(pool.map(run, range(n_streams)))
    for a, b in zip(sequential, concurrent_):
        assert torch.equal(a, b)


def test_cancel_frees_the_budget(channel, server):
    base = server.engine.bytes_reserved
    session = Session(channel, open_message(layers=4, policy="greedy", window=64, capacity=128))
    assert server.engine.bytes_reserved == base + session.opened.bytes_reserved
    session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    session.cancel()
    assert wait_until(lambda: server.engine.bytes_reserved == base)


def test_close_frees_the_budget(channel, server):
    base = server.engine.active_streams, server.engine.bytes_reserved
    session = Session(channel, open_message(layers=2))
    session.close()
    assert wait_until(lambda: (server.engine.active_streams, server.engine.bytes_reserved) == base)


def test_budget_and_stream_limits():
    config = dataclasses.replace(BASE, max_cache_bytes=10_000, max_streams=2)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        big = open_message(policy="none", capacity=200)  # 2*1*2*200*8*4 = 25600 bytes
        with pytest.raises(grpc.RpcError) as info:
            Session(ch, big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in info.value.details()
        a = Session(ch, open_message(policy="strict", window=8))
        b = Session(ch, open_message(policy="strict", window=8))
        with pytest.raises(grpc.RpcError) as info:
            Session(ch, open_message(policy="strict", window=8))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams" in info.value.details()
        # Running streams go on.
        assert a.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        a.close()
        b.close()
        assert wait_until(lambda: srv.engine.bytes_reserved == 0)


def test_idle_timeout_frees_a_silent_stream():
    clock = FakeClock()
    config = dataclasses.replace(BASE, idle_timeout_s=30.0)
    with ServerThread(config, clock=clock) as srv, grpc.insecure_channel(srv.address) as ch:
        silent = Session(ch, open_message())
        active = Session(ch, open_message())
        assert srv.engine.active_streams == 2
        clock.now += 20
        active.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
        clock.now += 15  # silent: 35 s idle; active: 15 s
        reaped = srv.call(_reap(srv))
        assert [s.id for s in reaped] == [silent.opened.stream_id]
        assert srv.engine.active_streams == 1
        with pytest.raises(grpc.RpcError) as info:
            silent.recv()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in info.value.details()
        assert active.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        active.close()


async def _reap(srv):
    return srv.engine.reap_idle()


def test_server_info(stub):
    info = stub.GetServerInfo(gqa_pb2.GetServerInfoRequest())
    assert info.version and info.default_backend == "cpu"
    backends = {b.name: b for b in info.backends}
    assert backends["cpu"].available and gqa_pb2.DTYPE_BFLOAT16 in backends["cpu"].dtypes
    assert not backends["cuda"].available and backends["cuda"].reasons
    assert info.limits.max_streams == BASE.max_streams and info.limits.max_cache_bytes == BASE.max_cache_bytes


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "gqa.v1.AttentionService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"gqa.v1.AttentionService", "grpc.health.v1.Health"} <= names


def test_connection_age_never_cuts_an_open_stream():
    """--max-connection-age-s sends GOAWAY so clients reconnect (and re-resolve); a stream that
    is open on the old connection goes on stepping, and new streams open on a fresh one."""
    import time

    config = dataclasses.replace(BASE, max_connection_age_s=0.3)
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        old = Session(ch, open_message())
        deadline = time.monotonic() + 1.5  # several connection ages
        steps = 0
        while time.monotonic() < deadline:
            assert old.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
            steps += 1
            time.sleep(0.05)
        new = Session(ch, open_message())
        assert new.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        assert (
            old.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.tokens_seen == steps + 1
        )
        old.close()
        new.close()


def test_decode_step_reply_short_varints_are_the_wire_encoding():
    """The reply's own varint writer (one, two and three bytes without a loop) writes what
    ``wire.varint`` does, at every width's edges."""
    from service.transport.decode_step import _varint
    from service.transport.wire import varint

    edges = [0, 1, 0x7F, 0x80, 0x3FFF, 0x4000, 0x1FFFFF, 0x200000, 2**63 + 5, 2**64 - 1]
    for n in edges + list(range(0, 0x4100, 7)):
        assert _varint(n) == varint(n), n


# a step's numbers (tokens_seen, resident, first, last, rollback reach, compute_ns): small ones, and
# ones at and past the edges of the varint table (2^14) and of the three-byte writer (2^21)
_REPLY_NUMBERS = [
    (300, 5, 295, 299, 4, 123_456),
    (1, 1, 0, 0, 1, 0),
    (2**14, 2**14 - 1, 1, 2**14 - 1, 2**14, 2**14 - 1),
    (2**21 + 3, 2**21, 3, 2**21 + 2, 2**21 - 1, 2**40 + 9),
]


@pytest.mark.parametrize("rid", [0, 1, 2**14, 2**63 + 5])
@pytest.mark.parametrize("layer", [0, 7, 2**14 + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("evicted", [0, 3, 2**14])
@pytest.mark.parametrize("numbers", _REPLY_NUMBERS, ids=lambda n: f"T{n[0]}")
def test_decode_step_reply_bytes_parse_to_the_message_upb_builds(rid, layer, dtype, evicted, numbers):
    """The step reply the servicer encodes itself (around the output's bytes) is upb's message."""
    from backends.contract import StepOutcome
    from service.engine.report import StepReport
    from service.engine.tensors import NAME_TO_DTYPE
    from service.transport.decode_step import StepReply

    t, resident, first, last, reach, compute_ns = numbers
    out = torch.randn(2, 4, 8).to(dtype)
    outcome = StepOutcome(out, t, resident, first, last, evicted, 512, 0)
    report = StepReport(outcome, compute_ns, reach)
    enum = NAME_TO_DTYPE[str(dtype)[6:]]
    raw = StepReply(rid, layer, (2, 4, 8), enum, out.numel() * out.element_size())(report, 0.0)
    want = gqa_pb2.DecodeResponse(request_id=rid)
    r = want.step
    r.status.SetInParent()
    r.layer = layer
    r.output.CopyFrom(to_proto(out))
    r.tokens_seen, r.resident, r.first_position, r.last_position = t, resident, first, last
    r.evicted, r.evicted_tokens = evicted > 0, evicted
    r.compute_ns, r.rollback_reach = compute_ns, reach
    got = gqa_pb2.DecodeResponse.FromString(raw)
    assert got == want and got.step.HasField("status")
    assert len(raw) == want.ByteSize()
