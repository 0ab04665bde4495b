"""Metrics in process: counters match the traffic exactly; the live exposition passes promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.engine.tensors import to_proto
from service.metrics.recorder import LATENCY_BUCKETS
from service.metrics.rpc import GRPC_CODE_NAMES
from service.server import ServerThread
from tests.metrics_load import Shape, free_port, open_request, run_stream, step_requests

SERVICE = "gqa.v1.AttentionService"
SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, layers=2)
STEPS = 37  # odd, not a multiple of the window or layer count
WINDOW = 5


def _config(**overrides) -> ServerConfig:
    return ServerConfig(address="127.0.0.1:0", metrics_port=free_port(), **overrides)


@pytest.fixture
def server():
    with ServerThread(_config()) as thread:
        yield thread


def _rpc(method: str, kind: str) -> dict[str, str]:
    return {"grpc_type": kind, "grpc_service": SERVICE, "grpc_method": method}


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    # Handler bookkeeping finishes just after the client sees the status: poll, bounded.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _bad_layer_step(shape: Shape, request_id: int) -> gqa_pb2.DecodeRequest:
    good = step_requests(shape, 1)[0]
    good.request_id = request_id
    good.step.layer = shape.layers  # out of range: refused in-band, INVALID_ARGUMENT
    return good


@pytest.mark.parametrize("policy", ["strict", "greedy"])
def test_counters_match_the_traffic_exactly(server, policy):
    steps = step_requests(SHAPE, STEPS)
    steps.insert(10, _bad_layer_step(SHAPE, 1000))
    seen = run_stream(
        server.address, open_request(policy, WINDOW, SHAPE, capacity=WINDOW + 3 if policy == "greedy" else 0), steps
    )
    assert seen.code == grpc.StatusCode.OK
    assert seen.ok_steps == STEPS and seen.refused == {"INVALID_ARGUMENT": 1}
    assert seen.evicted_tokens > 0

    m = server.server.metrics
    stream = {"backend": "cpu", "dtype": "float32", "policy": policy}
    assert m.value("gqa_steps_total", {**stream, "outcome": "ok"}) == STEPS
    assert m.value("gqa_steps_total", {**stream, "outcome": "invalid_argument"}) == 1
    for histogram in ("gqa_step_duration_seconds", "gqa_step_queue_seconds", "gqa_step_compute_seconds"):
        assert m.value(f"{histogram}_count", stream) == STEPS, histogram
        assert m.value(f"{histogram}_bucket", {**stream, "le": "+Inf"}) == STEPS, histogram
        assert m.value(f"{histogram}_sum", stream) > 0, histogram
    assert m.value("gqa_evicted_tokens_total", stream) == seen.evicted_tokens
    assert m.value("gqa_eviction_events_total", stream) == seen.eviction_events
    row = SHAPE.kv_heads * SHAPE.head_dim * 4 * 2  # keys and values, float32
    assert m.value("gqa_cache_written_bytes_total", stream) == STEPS * row
    assert m.value("gqa_streams_opened_total", stream) == 1

    decode = _rpc("Decode", "bidi_stream")
    assert _wait_for(lambda: m.value("grpc_server_handled_total", {**decode, "grpc_code": "OK"}) == 1)
    assert m.value("grpc_server_started_total", decode) == 1
    assert m.value("grpc_server_msg_received_total", decode) == 1 + STEPS + 1  # open, steps, refused
    assert m.value("grpc_server_msg_sent_total", decode) == 1 + STEPS + 1
    assert m.value("grpc_server_handling_seconds_count", decode) == 1
    assert _wait_for(lambda: m.value("gqa_stream_lifetime_seconds_count", {**stream, "reason": "client"}) == 1)


def test_active_streams_and_cache_bytes_go_up_and_back_to_zero(server):
    m = server.server.metrics
    stream = {"backend": "cpu", "dtype": "float32", "policy": "strict"}
    hold, opened = threading.Event(), [threading.Event() for _ in range(3)]
    results = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                run_stream(
                    server.address,
                    open_request("strict", WINDOW, SHAPE),
                    step_requests(SHAPE, 3),
                    hold=hold,
                    opened=opened[i],
                )
            )
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(10) for e in opened)
        assert _wait_for(lambda: m.value("gqa_active_streams", stream) == 3)
        assert m.value("gqa_cache_reserved_bytes") == server.engine.bytes_reserved > 0
        assert m.value("gqa_cache_budget_bytes") == server.engine.config.max_cache_bytes
        assert _wait_for(lambda: m.value("gqa_cache_in_use_bytes") > 0)
    finally:
        hold.set()
        for t in threads:
            t.join(30)
    assert [r.code for r in results] == [grpc.StatusCode.OK] * 3
    assert _wait_for(lambda: m.value("gqa_active_streams", stream) == 0)
    # A label set seen once stays exported at 0, so "back to 0" is a sample, not a gap.
    assert m.registry.get_sample_value("gqa_active_streams", stream) == 0
    assert m.value("gqa_cache_reserved_bytes") == 0 and m.value("gqa_cache_in_use_bytes") == 0
    assert m.value("gqa_stream_lifetime_seconds_count", {**stream, "reason": "client"}) == 3


def test_refused_open_counts_by_reason_and_grpc_code():
    with ServerThread(_config(max_cache_bytes=1024)) as server:
        seen = run_stream(server.address, open_request("strict", 512, SHAPE), step_requests(SHAPE, 1))
        assert seen.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        m = server.server.metrics
        assert m.value("gqa_stream_open_refusals_total", {"reason": "budget"}) == 1
        assert m.value("gqa_stream_open_refusals_total", {"reason": "streams"}) == 0
        decode = _rpc("Decode", "bidi_stream")
        assert _wait_for(
            lambda: m.value("grpc_server_handled_total", {**decode, "grpc_code": "ResourceExhausted"}) == 1
        )
        assert m.value("grpc_server_msg_sent_total", decode) == 0
        assert m.value("grpc_server_msg_received_total", decode) == 1
        # An open the servicer refuses before the engine (a window of 0) counts as invalid.
        seen = run_stream(server.address, open_request("strict", 0, SHAPE), [])
        assert seen.code == grpc.StatusCode.INVALID_ARGUMENT
        assert m.value("gqa_stream_open_refusals_total", {"reason": "invalid"}) == 1


def test_unary_rpcs_count_messages_and_codes(server):
    m = server.server.metrics
    with grpc.insecure_channel(server.address) as channel:
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        for _ in range(3):
            stub.GetServerInfo(gqa_pb2.GetServerInfoRequest(), timeout=60)  # the first probes every backend
        import torch

        bad = gqa_pb2.DecodeStepRequest(query=to_proto(torch.zeros(1, 4, 8)), num_query_heads=4, num_kv_heads=2)
        with pytest.raises(grpc.RpcError) as info:
            stub.DecodeStep(bad, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info_rpc, step_rpc = _rpc("GetServerInfo", "unary"), _rpc("DecodeStep", "unary")
    assert _wait_for(lambda: m.value("grpc_server_handled_total", {**step_rpc, "grpc_code": "InvalidArgument"}) == 1)
    assert m.value("grpc_server_started_total", info_rpc) == 3
    assert m.value("grpc_server_handled_total", {**info_rpc, "grpc_code": "OK"}) == 3
    assert m.value("grpc_server_msg_received_total", info_rpc) == 3
    assert m.value("grpc_server_msg_sent_total", info_rpc) == 3
    assert m.value("grpc_server_handling_seconds_count", info_rpc) == 3
    assert m.value("grpc_server_msg_received_total", step_rpc) == 1
    assert m.value("grpc_server_msg_sent_total", step_rpc) == 0
    # Every method and code exists from the start (go-grpc-prometheus's InitializeMetrics).
    for code in GRPC_CODE_NAMES.values():
        assert (
            m.registry.get_sample_value(
                "grpc_server_handled_total", {**_rpc("Decode", "bidi_stream"), "grpc_code": code}
            )
            is not None
        )


def test_health_checks_are_counted_under_their_own_service(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    labels = {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
    m = server.server.metrics
    assert _wait_for(lambda: m.value("grpc_server_handled_total", {**labels, "grpc_code": "OK"}) == 1)


def test_metrics_port_zero_turns_everything_off():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as server:
        assert server.server.metrics is None and server.server.metrics_address is None
        seen = run_stream(server.address, open_request("strict", WINDOW, SHAPE), step_requests(SHAPE, 3))
        assert seen.ok_steps == 3


def test_a_busy_metrics_port_fails_start_up_with_the_flag_named():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = ServerConfig(address="127.0.0.1:0", metrics_port=busy.getsockname()[1])
        with pytest.raises(OSError, match="--metrics-port"):
            ServerThread(config).start()


def _scrape(server) -> bytes:
    with urllib.request.urlopen(f"http://{server.server.metrics_address}/metrics", timeout=10) as r:
        return r.read()


def test_exposition_has_units_buckets_and_no_stream_ids(server):
    run_stream(server.address, open_request("sink", WINDOW, SHAPE, sinks=2), step_requests(SHAPE, 12))
    text = _scrape(server).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in ("gqa_step_duration_seconds", "gqa_step_queue_seconds", "gqa_step_compute_seconds"):
        les = [
            x.labels["le"]
            for x in families[family].samples
            if x.name.endswith("_bucket") and x.labels["policy"] == "sink"
        ]
        assert [float(x) for x in les[:-1]] == list(LATENCY_BUCKETS) and les[-1] == "+Inf"
    for name in (
        "process_cpu_seconds_total",
        "python_info",
        "grpc_server_started_total",
        "gqa_cache_budget_bytes",
        "gqa_active_streams",
        "gqa_cache_moved_bytes_total",
    ):
        assert re.search(rf"^{name}[ {{]", text, re.M), name
    stream_ids = {s.id for s in server.engine.streams()} | {"s1", "s2"}
    for value in re.findall(r'="([^"]*)"', text):
        assert value not in stream_ids
    assert "_created" not in text


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (tests/tools/install_prometheus.sh; `make tools`)"
)
def test_live_exposition_passes_promtool_check_metrics(server):
    run_stream(server.address, open_request("greedy", WINDOW, SHAPE, capacity=WINDOW + 2), step_requests(SHAPE, 9))
    body = _scrape(server)
    done = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


# -- saturation, batches, device memory (README, "Metrics, dashboard and alerts") ----------------
def _families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(_scrape(server).decode())}


def _sample(families, family: str, name: str | None = None, **labels) -> float:
    for s in families[family].samples:
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, name, labels))


def test_saturation_gauges_read_the_engine_views_at_scrape_time(server, monkeypatch):
    from service.engine.engine import Engine

    fams = _families(server)
    assert _sample(fams, "gqa_steps_waiting") == server.engine.steps_waiting
    assert _sample(fams, "gqa_compute_workers") == server.engine.compute_workers >= 1
    views = {
        "steps_waiting": 7,
        "steps_in_flight": 3,
        "compute_busy_seconds": 12.5,
        "compute_workers": 4,
        "batch_sequences_open": 9,
    }
    for name, value in views.items():
        monkeypatch.setattr(Engine, name, property(lambda self, v=value: v))
    fams = _families(server)
    assert _sample(fams, "gqa_steps_waiting") == 7
    assert _sample(fams, "gqa_steps_in_flight") == 3
    assert _sample(fams, "gqa_compute_busy_seconds", "gqa_compute_busy_seconds_total") == 12.5
    assert fams["gqa_compute_busy_seconds"].type == "counter"
    assert _sample(fams, "gqa_compute_workers") == 4
    assert _sample(fams, "gqa_batch_sequences_open") == 9


def test_batch_histograms_count_what_the_observer_is_told(server):
    run_stream(server.address, open_request("strict", WINDOW, SHAPE), step_requests(SHAPE, 2))
    fams = _families(server)
    # Created at zero with the first stream of a (backend, dtype), so rate() sees the first batch.
    assert _sample(fams, "gqa_batch_size", "gqa_batch_size_count", backend="cpu", dtype="float32") >= 0
    recorder = server.server.metrics.recorder
    before = server.server.metrics.value("gqa_batch_size_count", {"backend": "cpu", "dtype": "float32"})
    for size in (1, 3, 4, 200):
        recorder.batch_done("cpu", "float32", size)
    recorder.batch_message("int8", "float16", 5)
    m = server.server.metrics
    assert m.value("gqa_batch_size_count", {"backend": "cpu", "dtype": "float32"}) == before + 4
    assert m.value("gqa_batch_size_bucket", {"backend": "cpu", "dtype": "float32", "le": "4.0"}) >= 3
    assert m.value("gqa_batch_message_sequences_count", {"backend": "int8", "dtype": "float16"}) == 1
    assert m.value("gqa_batch_message_sequences_sum", {"backend": "int8", "dtype": "float16"}) == 5


def test_cuda_memory_only_while_cuda_is_initialised(server, monkeypatch):
    import torch

    fams = _families(server)
    if not torch.cuda.is_initialized():
        assert "gqa_cuda_memory_allocated_bytes" not in fams
        assert "gqa_cuda_memory_reserved_bytes" not in fams
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000 * (i + 1))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 4096 * (i + 1))
    fams = _families(server)
    assert _sample(fams, "gqa_cuda_memory_allocated_bytes", device="1") == 2000
    assert _sample(fams, "gqa_cuda_memory_reserved_bytes", device="0") == 4096


# -- the listener is bounded (#17 item 12) -------------------------------------------------------
IDLE_CONNECTIONS = 300
# One thread serves every connection: the count may grow by the handful the test's own
# client needs, never by one per connection (prometheus_client's server: 300 -> 311 threads).
THREAD_GROWTH_BOUND = 4


def test_idle_connections_do_not_pin_threads_and_a_scrape_still_gets_through(server):
    import socket

    from service.metrics.listener import MAX_CONNECTIONS

    host, port = server.server.metrics_address.rsplit(":", 1)
    _scrape(server)
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request head that never ends
            idle.append(s)
        assert _wait_for(lambda: server.server.metrics.http.connections <= MAX_CONNECTIONS)
        grown = threading.active_count() - threads_before
        assert grown <= THREAD_GROWTH_BOUND, f"{grown} threads for {IDLE_CONNECTIONS} idle connections"
        # The idle ones are pushed out oldest first: a scraper is never locked out.
        assert b"gqa_build_info" in _scrape(server)
        assert server.server.metrics.http.connections <= MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()


def test_idle_connection_is_closed_after_the_timeout():
    import socket

    from prometheus_client import CollectorRegistry

    from service.metrics.listener import MetricsHttpServer

    http = MetricsHttpServer(CollectorRegistry(), "127.0.0.1", 0, timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the server, not by our timeout
        assert _wait_for(lambda: http.connections == 0)
    finally:
        http.close()


def test_listener_answers_only_get_and_head_on_metrics(server):
    import gzip
    import urllib.error

    base = f"http://{server.server.metrics_address}"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}/nope", timeout=10)
    assert info.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", data=b"x", method="POST"), timeout=10)
    assert info.value.code == 405
    request = urllib.request.Request(f"{base}/metrics", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert b"gqa_build_info" in gzip.decompress(r.read())
    request = urllib.request.Request(f"{base}/metrics", headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert r.read().rstrip().endswith(b"# EOF")


def test_metrics_host_binds_apart_from_the_grpc_address():
    config = ServerConfig(address="0.0.0.0:0", metrics_port=free_port(), metrics_host="127.0.0.1")
    with ServerThread(config) as thread:
        assert thread.server.metrics_address.startswith("127.0.0.1:")
        assert b"gqa_build_info" in _scrape(thread)


@pytest.mark.gpu
def test_cuda_memory_gauges_follow_a_cuda_stream(server):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    request = open_request("strict", WINDOW, SHAPE, dtype=torch.float16)  # the CUDA backend's dtypes: half
    request.open.backend = "cuda"
    seen = run_stream(server.address, request, step_requests(SHAPE, 5, dtype=torch.float16))
    assert seen.code == grpc.StatusCode.OK and seen.ok_steps == 5
    assert torch.cuda.is_initialized()
    fams = _families(server)
    reserved = _sample(fams, "gqa_cuda_memory_reserved_bytes", device="0")
    assert reserved > 0 and reserved == torch.cuda.memory_reserved(0)
    assert 0 <= _sample(fams, "gqa_cuda_memory_allocated_bytes", device="0") <= reserved


@pytest.mark.parametrize("value", [0.0, 1e-6, 10e-6, 2.5e-4, 0.003, 7.0, 1e9])
def test_pending_observations_leave_the_histograms_as_observe_does(value):
    """The recorder keeps a step's observations as plain numbers until a collect flushes them
    (``MetricsRecorder.flush``); after the collect each latency histogram and the batch
    histogram are what ``observe`` of the same values leaves, bucket edges included, and a
    second collect adds nothing."""
    from prometheus_client import CollectorRegistry, Histogram

    from service.metrics.recorder import BATCH_BUCKETS, LATENCY_BUCKETS, ServiceMetrics

    labels = ("cpu", "float32", "strict")
    for n in (1, 3):
        metrics = ServiceMetrics()
        for _ in range(n):
            metrics.recorder.steps_done(labels, 1, value, 0.0, 0, 0, 0)
            metrics.recorder.batch_done("cpu", "float32", min(value, 2048.0))
        want = {}
        for name, buckets, v in (
            ("gqa_step_queue_seconds", LATENCY_BUCKETS, value),
            ("gqa_step_duration_seconds", LATENCY_BUCKETS, value),
            ("gqa_batch_size", BATCH_BUCKETS, min(value, 2048.0)),
        ):
            reference = Histogram(name, "h", registry=CollectorRegistry(), buckets=buckets)
            for _ in range(n):
                reference.observe(v)
            want[name] = {
                (s.name, s.labels.get("le")): s.value
                for s in reference.collect()[0].samples
                if s.name != name + "_created"
            }
        for _ in range(2):  # the second collect finds nothing pending
            families = {f.name: f for f in metrics.registry.collect()}
            for name, samples in want.items():
                got = {(s.name, s.labels.get("le")): s.value for s in families[name].samples}
                assert got.keys() == samples.keys(), name
                for key, v in samples.items():
                    assert got[key] == pytest.approx(v, rel=1e-12, abs=1e-12), (name, key)


@pytest.mark.parametrize("value", [0.0, 1e-6, 2.5e-4, 0.003, 7.0, 1e9])
def test_bulk_step_counts_equal_as_many_single_observations(value):
    """``steps_done`` of n steps (a Batch message) leaves every series exactly as n steps of one
    each (Decode steps) do: histogram buckets, sums and counts, the ok counter, evictions and
    bytes written."""
    from service.metrics.recorder import ServiceMetrics

    bulk, single = ServiceMetrics(), ServiceMetrics()
    labels = ("cpu", "float32", "strict")
    bulk.recorder.steps_done(labels, 37, value, 2 * value, 37, 37, 37 * 512)
    for _ in range(37):
        single.recorder.steps_done(labels, 1, value, 2 * value, 1, 1, 512)

    def samples(m):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in m.registry.collect()
            if family.name.startswith("gqa_")
            for s in family.samples
        }

    got, want = samples(bulk), samples(single)
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-12, abs=1e-12), key
    assert (
        got[("gqa_steps_total", (("backend", "cpu"), ("dtype", "float32"), ("outcome", "ok"), ("policy", "strict")))]
        == 37
    )
