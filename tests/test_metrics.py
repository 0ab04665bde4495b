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
from service.metrics import GRPC_CODE_NAMES, LATENCY_BUCKETS
from service.server import ServerThread
from service.tensors import to_proto
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
    seen = run_stream(server.address, open_request(policy, WINDOW, SHAPE, capacity=WINDOW + 3 if policy == "greedy" else 0),
                      steps)
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
    threads = [threading.Thread(target=lambda i=i: results.append(run_stream(
        server.address, open_request("strict", WINDOW, SHAPE), step_requests(SHAPE, 3), hold=hold,
        opened=opened[i]))) for i in range(3)]
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
        assert _wait_for(lambda: m.value("grpc_server_handled_total", {**decode, "grpc_code": "ResourceExhausted"}) == 1)
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
        assert m.registry.get_sample_value("grpc_server_handled_total", {**_rpc("Decode", "bidi_stream"),
                                                                          "grpc_code": code}) is not None


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
        les = [x.labels["le"] for x in families[family].samples
               if x.name.endswith("_bucket") and x.labels["policy"] == "sink"]
        assert [float(x) for x in les[:-1]] == list(LATENCY_BUCKETS) and les[-1] == "+Inf"
    for name in ("process_cpu_seconds_total", "python_info", "grpc_server_started_total",
                 "gqa_cache_budget_bytes", "gqa_active_streams", "gqa_cache_moved_bytes_total"):
        assert re.search(rf"^{name}[ {{]", text, re.M), name
    stream_ids = {s.id for s in server.engine.streams()} | {"s1", "s2"}
    for value in re.findall(r'="([^"]*)"', text):
        assert value not in stream_ids
    assert "_created" not in text


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (tests/tools/install_prometheus.sh; `make tools`)")
def test_live_exposition_passes_promtool_check_metrics(server):
    run_stream(server.address, open_request("greedy", WINDOW, SHAPE, capacity=WINDOW + 2), step_requests(SHAPE, 9))
    body = _scrape(server)
    done = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
