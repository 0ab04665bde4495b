"""End to end: a real Prometheus on loopback scrapes a running service under a short stream load.

Prometheus scrapes every second; its first samples are queryable after ~6 s and a rate over
them after ~7 s, so every check polls its HTTP API with a bound instead of sleeping.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import grpc
import pytest

from service.config import ServerConfig
from service.server import ServerThread
from tests.metrics_load import Shape, free_port, open_request, run_stream, step_requests

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus not installed (tests/tools/install_prometheus.sh; `make tools`)",
    ),
]

SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, layers=1)
STREAMS = 3
WINDOW = 4
MAX_STEPS = 150  # per stream; paced, so the load spans several scrapes
PACE_S = 0.1
POLL_S = 20.0
SATURATION_FAMILIES = (
    "gqa_steps_waiting",
    "gqa_steps_in_flight",
    "gqa_compute_busy_seconds_total",
    "gqa_compute_workers",
    "gqa_batch_sequences_open",
    "gqa_batch_size_count",
    "gqa_batch_message_sequences_count",
)


@pytest.fixture
def service():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=free_port())) as thread:
        yield thread


@pytest.fixture
def prometheus(service, tmp_path):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "gqa",
                        "scrape_interval": "1s",
                        "scrape_timeout": "900ms",
                        "static_configs": [{"targets": [service.server.metrics_address]}],
                    }
                ],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{api}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(f"prometheus did not become ready: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def query(api: str, promql: str) -> list[dict]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(api: str, promql: str) -> float | None:
    result = query(api, promql)
    return float(result[0]["value"][1]) if result else None


def poll(api: str, promql: str, accept, timeout_s: float = POLL_S) -> float | None:
    """Polls until ``accept(value)``; returns the last value (checked by the caller)."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = scalar(api, promql)
        if value is not None and accept(value):
            return value
        time.sleep(0.25)
    return value


def test_prometheus_scrapes_latency_streams_evictions_and_saturation(service, prometheus):
    api = prometheus
    assert poll(api, 'up{job="gqa"}', lambda v: v == 1) == 1

    hold = threading.Event()
    opened = [threading.Event() for _ in range(STREAMS)]
    results: list = [None] * STREAMS

    def client(i: int) -> None:
        results[i] = run_stream(
            service.address,
            open_request("strict", WINDOW, SHAPE),
            step_requests(SHAPE, MAX_STEPS, seed=i),
            pace_s=PACE_S,
            hold=hold,
            hold_timeout_s=POLL_S,
            opened=opened[i],
        )

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(10) for e in opened)
        # Active streams go up, seen by Prometheus...
        assert poll(api, 'sum(gqa_active_streams{job="gqa"})', lambda v: v == STREAMS) == STREAMS
        # ...and the paced steps make step latency's rate, hence its quantile, defined.
        p99 = poll(
            api,
            'histogram_quantile(0.99, sum by (backend, le) (rate(gqa_step_duration_seconds_bucket{job="gqa"}[5s])))',
            lambda v: not math.isnan(v),
        )
        assert p99 is not None and 0 < p99 <= 10, p99
        # The saturation and batch families (README's metrics table) are scraped under load: every one
        # present, the worker count the engine's, utilisation a fraction (the dashboard's query).
        for family in SATURATION_FAMILIES:
            assert poll(api, f'count({family}{{job="gqa"}})', lambda v: v >= 1) is not None, family
        workers = service.engine.compute_workers
        assert poll(api, 'sum(gqa_compute_workers{job="gqa"})', lambda v: v == workers) == workers
        utilisation = poll(
            api,
            'sum(rate(gqa_compute_busy_seconds_total{job="gqa"}[5s])) / sum(gqa_compute_workers{job="gqa"})',
            lambda v: not math.isnan(v),
        )
        assert utilisation is not None and 0 <= utilisation <= 1, utilisation
        for gauge in ("gqa_steps_waiting", "gqa_steps_in_flight", "gqa_batch_sequences_open"):
            assert scalar(api, f'sum({gauge}{{job="gqa"}})') >= 0, gauge
    finally:
        hold.set()
        for t in threads:
            t.join(30)
    assert all(r is not None and r.code == grpc.StatusCode.OK for r in results), results

    # ...and back to 0.
    assert poll(api, 'sum(gqa_active_streams{job="gqa"})', lambda v: v == 0) == 0

    # Counters equal what the streams did.
    steps = sum(r.ok_steps for r in results)
    evicted = sum(r.evicted_tokens for r in results)
    events = sum(r.eviction_events for r in results)
    assert evicted > 0
    labels = 'job="gqa",backend="cpu",policy="strict"'
    assert poll(api, f'sum(gqa_steps_total{{{labels},outcome="ok"}})', lambda v: v == steps) == steps
    assert scalar(api, f"sum(gqa_evicted_tokens_total{{{labels}}})") == evicted
    assert scalar(api, f"sum(gqa_eviction_events_total{{{labels}}})") == events
    assert scalar(api, f"sum(gqa_step_duration_seconds_count{{{labels}}})") == steps
    assert (
        poll(
            api, 'sum(grpc_server_handled_total{job="gqa",grpc_method="Decode",grpc_code="OK"})', lambda v: v == STREAMS
        )
        == STREAMS
    )
    assert scalar(api, 'sum(gqa_cache_reserved_bytes{job="gqa"})') == 0

    # The exact p99 per backend, labelled: the dashboard's query shape.
    series = query(
        api, 'histogram_quantile(0.99, sum by (backend, le) (rate(gqa_step_duration_seconds_bucket{job="gqa"}[30s])))'
    )
    assert [s["metric"] for s in series] == [{"backend": "cpu"}]


def _dashboard_queries() -> list[tuple[str, str]]:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    dashboard = json.loads((root / "helm" / "gqa-serve" / "dashboards" / "gqa-serve.json").read_text())
    constants = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"}

    def substitute(expr: str) -> str:
        expr = expr.replace("$__rate_interval", "10s")
        for name, value in constants.items():
            expr = expr.replace(f"${name}", value)
        # Everything selected, as the dashboard's "All" does; no cluster/namespace label here.
        return re.sub(r"\$(cluster|namespace|job|instance|backend)\b", ".*", expr)

    return [(p["title"], substitute(t["expr"])) for p in dashboard["panels"] for t in p["targets"]]


def test_every_dashboard_query_runs_against_a_live_scrape(service, prometheus):
    api = prometheus
    assert poll(api, 'up{job="gqa"}', lambda v: v == 1) == 1
    # 60 steps 0.05 s apart: the load spans several 1 s scrapes. With 20 (1 s), the first scrape
    # of the new counter series could come after the last step, every sample then equal, and its
    # rate 0 for good (a CI run failed so).
    run_stream(service.address, open_request("strict", WINDOW, SHAPE), step_requests(SHAPE, 60), pace_s=0.05)
    # Wait until rates over the scrapes are defined, then run every panel's query.
    assert poll(api, 'sum(rate(gqa_steps_total{job="gqa"}[10s]))', lambda v: v > 0) > 0
    answered = {}
    for title, expr in _dashboard_queries():
        answered.setdefault(title, []).append(query(api, expr))
    for title in (
        "Worker utilisation by pod",
        "Steps waiting and in flight by pod",
        "Process CPU by pod",
        "Process memory (RSS) by pod",
        "Pods up",
        "Cache and streams used of limit by pod",
    ):
        assert all(answered[title]), f"{title}: no data"
