"""HTTP health and the status page on the metrics listener, beside gRPC health.

/readyz must say what grpc.health.v1 says for gqa.v1.AttentionService at every moment: checked
by sandwiching each HTTP answer between two gRPC checks, from the process's start through a real
drain (SIGTERM with an open stream holding the grace period) to its exit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.metrics.listener import MetricsHttpServer
from tests.client import Session, open_message
from tests.metrics_load import free_port

SERVICE = "gqa.v1.AttentionService"


def http_get(url: str, method: str = "GET") -> tuple[int, str]:
    """(status, body); (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        return 0, str(exc)


@pytest.fixture(scope="module")
def server():
    from service.config import ServerConfig
    from service.server import ServerThread

    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=free_port())) as srv:
        yield srv


def test_health_paths_and_the_status_page(server):
    base = f"http://{server.server.metrics_address}"
    for path in ("/healthz", "/v2/health/live"):
        assert http_get(base + path) == (200, "ok\n")
    for path in ("/readyz", "/v2/health/ready"):
        assert http_get(base + path) == (200, "SERVING\n")
        assert http_get(base + path, "HEAD") == (200, "")
    status, page = http_get(base + "/")
    assert status == 200 and page.startswith("<!doctype html>") and "gqa_active_streams" in page
    assert http_get(base + "/status") == (200, page)
    # Self-contained: no script, style, image or font from anywhere else.
    assert not re.search(r"""(src|href)=["'](https?:)?//""", page) and "@import" not in page and "url(" not in page
    status, body = http_get(base + "/nope")
    assert status == 404
    for path in ("/metrics", "/healthz", "/readyz", "/v2/health/ready", "/"):
        assert f" {path}" in body


def test_a_failing_page_is_a_500_and_the_listener_goes_on():
    from prometheus_client import CollectorRegistry

    def broken():
        raise RuntimeError("boom")

    http = MetricsHttpServer(CollectorRegistry(), "127.0.0.1", 0, routes={"/broken": broken})
    try:
        assert http_get(f"http://127.0.0.1:{http.port}/broken") == (500, "this page failed\n")
        assert http_get(f"http://127.0.0.1:{http.port}/metrics")[0] == 200
    finally:
        http.close()


def grpc_ready(address: str, patient: bool = True) -> bool:
    """Whether gRPC health says SERVING now. A fresh channel each time: a channel that failed
    to connect waits out its reconnect backoff and answers UNAVAILABLE meanwhile, whatever the
    server says by then. ``patient``: a check that times out (a busy machine) is asked again;
    otherwise it counts as not serving (a port bound before its server starts answers nothing)."""
    for _ in range(10 if patient else 1):
        try:
            with grpc.insecure_channel(address) as channel:
                request = health_pb2.HealthCheckRequest(service=SERVICE)
                status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and patient:
                continue  # a busy machine, not an answer: ask again
            # not started yet (UNAVAILABLE), status not set yet (NOT_FOUND), stopped (UNAVAILABLE)
            return False
        return status == health_pb2.HealthCheckResponse.SERVING
    if patient:
        raise AssertionError("grpc health did not answer 10 checks in a row")
    return False


def test_readyz_follows_grpc_health_from_start_through_a_drain():
    port, metrics_port = free_port(), free_port()
    env = dict(
        os.environ,
        GQA_ADDRESS=f"127.0.0.1:{port}",
        GQA_METRICS_PORT=str(metrics_port),
        GQA_GRACE_PERIOD_S="2",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{metrics_port}"
    address = f"127.0.0.1:{port}"
    seen: list[tuple[int, str]] = []

    def poll() -> tuple[int, str]:
        """One HTTP answer between two gRPC checks: it must agree with one of them."""
        before = grpc_ready(address)
        status, body = http_get(base + "/readyz")
        after = grpc_ready(address)
        ready = status == 200
        assert ready in (before, after), (status, body, before, after, seen[-5:])
        assert status in (0, 200, 503), (status, body)
        if status == 200:
            assert body == "SERVING\n"
        elif status == 503:
            assert body.startswith("NOT_SERVING (")
        seen.append((status, body.strip()))
        return status, body

    try:
        deadline = time.monotonic() + 90
        while poll()[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, seen
            time.sleep(0.01)
        assert all(body == "NOT_SERVING (starting)" for status, body in seen if status == 503), seen
        channel = grpc.insecure_channel(address)
        session = Session(channel, open_message())  # holds the drain for the grace period
        assert session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        seen.clear()
        proc.send_signal(signal.SIGTERM)
        live_while_draining = []
        while proc.poll() is None and time.monotonic() < deadline:
            status, body = poll()
            if body.strip() == "NOT_SERVING (draining)":
                live_while_draining.append(http_get(base + "/healthz")[0])
            time.sleep(0.02)
        assert proc.wait(timeout=30) == 0
        answers = [body for status, body in seen if status]
        assert "NOT_SERVING (draining)" in answers, seen
        # Once it stopped being ready it never came back.
        assert "SERVING" not in answers[answers.index("NOT_SERVING (draining)") :], seen
        # Liveness holds while the drain runs: the process still serves.
        assert live_while_draining and set(live_while_draining) <= {200, 0}, live_while_draining
        assert 200 in live_while_draining
        output = proc.stdout.read()
        assert "gqa-serve stopped: drained in" in output.strip().splitlines()[-1], output[-2000:]
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_readyz_waits_for_the_backend_probe(monkeypatch):
    """The listener is up before the backends are probed; /readyz stays 503 until gRPC health
    says SERVING, which happens only after the probe."""
    import asyncio
    import threading

    from service.config import ServerConfig
    from service.server import ServerThread
    from service.transport.servicer import AttentionServicer

    gate, probing = threading.Event(), threading.Event()
    probe = AttentionServicer.backend_infos

    async def held_probe(self):
        probing.set()
        await asyncio.to_thread(gate.wait, 30)
        return await probe(self)

    monkeypatch.setattr(AttentionServicer, "backend_infos", held_probe)
    port, metrics_port = free_port(), free_port()
    srv = ServerThread(ServerConfig(address=f"127.0.0.1:{port}", metrics_port=metrics_port))
    starting = threading.Thread(target=srv.start)
    starting.start()
    try:
        assert probing.wait(30)
        assert http_get(f"http://127.0.0.1:{metrics_port}/readyz") == (503, "NOT_SERVING (starting)\n")
        assert http_get(f"http://127.0.0.1:{metrics_port}/healthz") == (200, "ok\n")
        assert not grpc_ready(f"127.0.0.1:{port}", patient=False)
        gate.set()
        starting.join(30)
        assert grpc_ready(f"127.0.0.1:{port}")
        assert http_get(f"http://127.0.0.1:{metrics_port}/readyz") == (200, "SERVING\n")
    finally:
        gate.set()
        starting.join(30)
        srv.stop()
