"""The status page (``/`` of the metrics listener) in a real headless browser, under load.

Debian's chromium (tests/tools/install_browser.sh) driven by Playwright (the test extra). The
page fetches /metrics itself; the test routes those fetches through a recorder, so it knows the
exact texts behind each figure, recomputes every figure from them here (prometheus_client's
parser and an independent quantile), and compares them with the numbers the page shows. The
gauges are also compared with a fresh scrape, the load holding them steady. No console error,
no request leaves the page's origin.

``GQA_STATUS_SCREENSHOT=path.png`` also saves the page as it was checked, after
``GQA_STATUS_SAMPLES`` samples (default 4, every 0.5 s). docs/status-page.png was made so:
``GQA_STATUS_SAMPLES=40 GQA_STATUS_SCREENSHOT=docs/status-page.png pytest tests/test_status_page.py``.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import threading
import urllib.request
from collections import defaultdict

import grpc
import pytest
import torch

from tests.metrics_load import Shape, free_port, open_request, run_stream, step_requests

playwright = pytest.importorskip("playwright.sync_api", reason="playwright not installed (the test extra)")
CHROMIUM = os.environ.get("GQA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (run `bash tests/tools/install_browser.sh` or `make tools`)"
)

SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, layers=1)
STREAMS = 3
BATCH_SEQUENCES = 2
BUDGET = 64 << 20
SAMPLES = int(os.environ.get("GQA_STATUS_SAMPLES", "4"))
PACE_S = 0.004
# Enough paced steps to outlast the page's SAMPLES samples (0.5 s apart) with room to spare.
STEPS = int(SAMPLES * 0.5 / PACE_S) + 2500


# -- the figures, recomputed from the /metrics texts the page read --------------------------------
def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((sample.labels, sample.value))
    return out


def total(s, name, keep=lambda labels: True) -> float:
    return sum(v for labels, v in s.get(name, []) if keep(labels))


def by(s, name, label, keep=lambda labels: True) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, v in s.get(name, []):
        if keep(labels):
            out[labels[label]] += v
    return dict(out)


def delta_buckets(now, before, name) -> list[tuple[float, float]]:
    """The histogram's buckets summed over label sets, increase between two samples."""
    a, b = by(now, name + "_bucket", "le"), by(before, name + "_bucket", "le")
    return sorted((float(le), a[le] - b.get(le, 0.0)) for le in a)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's estimate: linear inside the bucket that holds rank q * count."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = upper, count
    return math.nan


def bucket_bound(q: float, buckets: list[tuple[float, float]]) -> float:
    """The upper bound of the bucket that holds rank q * count: "at most" (whole batch sizes)."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    return next(upper for upper, count in buckets if count >= q * buckets[-1][1])


def expected_figures(now: str, before: str, seconds: float) -> dict[str, float]:
    s, p = parse(now), parse(before)
    f = {
        "streams": total(s, "gqa_active_streams"),
        "streams-limit": total(s, "gqa_streams_limit"),
        "batch-open": total(s, "gqa_batch_sequences_open"),
        "cache-reserved": total(s, "gqa_cache_reserved_bytes"),
        "cache-budget": total(s, "gqa_cache_budget_bytes"),
        "cache-in-use": total(s, "gqa_cache_in_use_bytes"),
        "rss": total(s, "process_resident_memory_bytes"),
        "steps-waiting": total(s, "gqa_steps_waiting"),
        "steps-in-flight": total(s, "gqa_steps_in_flight"),
    }
    f["cache-fraction"] = f["cache-reserved"] / f["cache-budget"]
    ok = lambda labels: labels["outcome"] == "ok"  # noqa: E731
    f["steps-count"] = total(s, "gqa_steps_total", ok) - total(p, "gqa_steps_total", ok)
    busy = total(s, "gqa_compute_busy_seconds_total") - total(p, "gqa_compute_busy_seconds_total")
    f["busy"] = busy / seconds / total(s, "gqa_compute_workers")
    for key, name in (("queue", "gqa_step_queue_seconds"), ("compute", "gqa_step_compute_seconds")):
        buckets = delta_buckets(s, p, name)
        f[f"{key}-p50"] = histogram_quantile(0.5, buckets)
        f[f"{key}-p99"] = histogram_quantile(0.99, buckets)
    batch = delta_buckets(s, p, "gqa_batch_size")
    f["batch-p50"] = bucket_bound(0.5, batch)
    f["batch-p99"] = bucket_bound(0.99, batch)
    f["batch-mean"] = (total(s, "gqa_batch_size_sum") - total(p, "gqa_batch_size_sum")) / (
        total(s, "gqa_batch_size_count") - total(p, "gqa_batch_size_count")
    )
    count = total(s, "gqa_batch_message_sequences_count") - total(p, "gqa_batch_message_sequences_count")
    f["batch-message-mean"] = (
        (total(s, "gqa_batch_message_sequences_sum") - total(p, "gqa_batch_message_sequences_sum")) / count
        if count
        else math.nan
    )
    return f


def expected_refusals(now: str, before: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(what, code) -> (since start, last interval), for every nonzero total."""
    s, p = parse(now), parse(before)
    rows = {}
    kinds = (
        ("step refused in-band", "gqa_steps_total", "outcome", lambda labels: labels["outcome"] != "ok", str.upper),
        ("open refused", "gqa_stream_open_refusals_total", "reason", lambda labels: True, str),
        (
            "RPC ended",
            "grpc_server_handled_total",
            "grpc_code",
            lambda labels: labels["grpc_code"] != "OK" and labels["grpc_service"] == "gqa.v1.AttentionService",
            str,
        ),
    )
    for what, name, label, keep, show in kinds:
        old = by(p, name, label, keep)
        for code, n in by(s, name, label, keep).items():
            if n > 0:
                rows[(what, show(code))] = (n, n - old.get(code, 0.0))
    return rows


# -- the load ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from service.config import ServerConfig
    from service.server import ServerThread

    config = ServerConfig(address="127.0.0.1:0", metrics_port=free_port(), max_cache_bytes=BUDGET)
    with ServerThread(config) as srv:
        yield srv


class Load:
    """STREAMS paced Decode streams (one step refused in-band each), an open refused for the
    budget, and a Batch session of BATCH_SEQUENCES sequences stepping: held open until stop()."""

    def __init__(self, address: str):
        self.address = address
        self.release = threading.Event()
        self.opened = [threading.Event() for _ in range(STREAMS)]
        self.threads: list[threading.Thread] = []
        self.results: list = []
        self.batch_error: list[BaseException] = []

    def start(self) -> "Load":
        for i in range(STREAMS):
            steps = step_requests(SHAPE, STEPS, seed=i)
            steps[5].step.layer = SHAPE.layers  # refused in-band: INVALID_ARGUMENT, the stream goes on
            kwargs = dict(pace_s=PACE_S, hold=self.release, opened=self.opened[i], timeout_s=120)
            t = threading.Thread(
                target=lambda s=steps, k=kwargs: self.results.append(
                    run_stream(self.address, open_request("strict", 8, SHAPE), s, **k)
                )
            )
            t.start()
            self.threads.append(t)
        # Far past the budget: refused at open (reason budget, RESOURCE_EXHAUSTED).
        refused = run_stream(self.address, open_request("none", 0, SHAPE, capacity=1 << 20), [])
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        self.batch_ready = threading.Event()
        batch = threading.Thread(target=self._batch)
        batch.start()
        self.threads.append(batch)
        for event in (*self.opened, self.batch_ready):
            assert event.wait(30)
        return self

    def _batch(self) -> None:
        from gqa_client import BatchSession

        try:
            with grpc.insecure_channel(self.address) as channel:
                with BatchSession(
                    channel,
                    num_query_heads=SHAPE.heads,
                    num_kv_heads=SHAPE.kv_heads,
                    head_dim=SHAPE.head_dim,
                    num_layers=SHAPE.layers,
                ) as session:
                    ids = list(range(1, BATCH_SEQUENCES + 1))
                    for sid in ids:
                        session.add(sid, policy="strict", window=8)
                    self.batch_ready.set()
                    g = torch.Generator().manual_seed(9)
                    n = len(ids)
                    q = torch.randn(n, SHAPE.heads, SHAPE.head_dim, generator=g)
                    kv = torch.randn(n, SHAPE.kv_heads, SHAPE.head_dim, generator=g)
                    while not self.release.wait(0.01):
                        refused = session.step(0, ids, q, kv, kv).refusals
                        assert not refused, refused
        except BaseException as exc:  # surfaced by stop()
            self.batch_error.append(exc)
            self.batch_ready.set()

    def stop(self) -> None:
        self.release.set()
        for t in self.threads:
            t.join(60)
        assert not self.batch_error, self.batch_error
        assert [r.code for r in self.results] == [grpc.StatusCode.OK] * STREAMS
        assert all(r.refused == {"INVALID_ARGUMENT": 1} for r in self.results), [r.refused for r in self.results]


def scrape(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return r.read().decode()


def close(actual: str | None, expected: float, what: str) -> None:
    assert actual is not None, what
    if math.isnan(expected):
        assert actual == "", f"{what}: shows {actual!r}, expected no figure"
    else:
        assert actual != "" and math.isclose(float(actual), expected, rel_tol=1e-9, abs_tol=1e-12), (
            f"{what}: page {actual}, /metrics {expected}"
        )


def test_status_page_shows_what_metrics_say_under_load(server, tmp_path):
    from playwright.sync_api import sync_playwright

    base = f"http://{server.server.metrics_address}"
    load = Load(server.address).start()
    texts: list[str] = []
    requests: list[str] = []
    problems: list[str] = []

    def record(route):
        answer = route.fetch()
        body = answer.text()
        texts.append(body)
        route.fulfill(response=answer, body=body)

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.on(
                    "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
                )
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
                page.on("request", lambda r: requests.append(r.url))
                page.route("**/metrics", record)
                page.goto(f"{base}/?every=0.5")
                # Enough samples for figures over an interval of steady load, then freeze the page.
                page.wait_for_function(
                    f"Number(document.getElementById('samples').dataset.value) >= {SAMPLES}",
                    timeout=30000 + SAMPLES * 2000,
                )
                page.click("#pause")
                n = int(page.get_attribute("#samples", "data-value"))
                fresh = parse(scrape(base))
                shown = {
                    el: page.get_attribute(f"#{el}", "data-value")
                    for el in (
                        "streams",
                        "streams-limit",
                        "batch-open",
                        "cache-reserved",
                        "cache-budget",
                        "cache-in-use",
                        "cache-fraction",
                        "rss",
                        "steps-waiting",
                        "steps-in-flight",
                        "busy",
                        "queue-p50",
                        "queue-p99",
                        "compute-p50",
                        "compute-p99",
                        "batch-mean",
                        "batch-p50",
                        "batch-p99",
                        "batch-message-mean",
                    )
                }
                rate = page.locator("#steps-rate")
                rate_value, count, seconds = (
                    rate.get_attribute(a) for a in ("data-value", "data-count", "data-seconds")
                )
                rows = page.locator("#refusals tbody tr")
                refusals = {
                    (rows.nth(i).get_attribute("data-what"), rows.nth(i).get_attribute("data-code")): (
                        float(rows.nth(i).get_attribute("data-total")),
                        float(rows.nth(i).get_attribute("data-recent")),
                    )
                    for i in range(rows.count())
                }
                texts_shown = {el: page.inner_text(f"#{el}") for el in ("streams", "cache-budget", "state")}
                by_stream = page.inner_text("#streams-by")
                if os.environ.get("GQA_STATUS_SCREENSHOT"):
                    page.screenshot(path=os.environ["GQA_STATUS_SCREENSHOT"], full_page=True)
                page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            finally:
                browser.close()
    finally:
        load.stop()

    assert not problems, problems
    origin = base + "/"
    assert requests and all(url.startswith(origin) for url in requests), requests
    # The page's sample n is the n-th /metrics answer it read (one request at a time).
    assert len(texts) >= n >= 4
    seconds = float(seconds)
    expected = expected_figures(texts[n - 1], texts[n - 2], seconds)
    for name, value in shown.items():
        close(value, expected[name], name)
    assert float(count) == expected["steps-count"] > 0
    close(rate_value, expected["steps-count"] / seconds, "steps-rate")
    assert refusals == expected_refusals(texts[n - 1], texts[n - 2])
    # The load is what the page saw: its streams, Batch sequences and refusals.
    # A Batch sequence is a stream of the engine too (admitted against the same limits).
    assert expected["streams"] == STREAMS + BATCH_SEQUENCES and expected["batch-open"] == BATCH_SEQUENCES
    assert expected["cache-budget"] == BUDGET and expected["cache-reserved"] > 0
    assert refusals[("step refused in-band", "INVALID_ARGUMENT")][0] == STREAMS
    assert refusals[("open refused", "budget")][0] == 1
    assert refusals[("RPC ended", "ResourceExhausted")][0] == 1
    assert f"cpu\tfloat32\tstrict\t{STREAMS + BATCH_SEQUENCES}" in by_stream, by_stream
    # Held steady by the load, the gauges equal a scrape taken after the page froze.
    for name, metric in (
        ("streams", "gqa_active_streams"),
        ("batch-open", "gqa_batch_sequences_open"),
        ("cache-reserved", "gqa_cache_reserved_bytes"),
        ("cache-budget", "gqa_cache_budget_bytes"),
    ):
        assert float(shown[name]) == total(fresh, metric), name
    # The numbers read as people read them.
    assert texts_shown == {"streams": str(STREAMS + BATCH_SEQUENCES), "cache-budget": "64.0 MiB", "state": "SERVING"}
    assert pathlib.Path(tmp_path / "status.png").stat().st_size > 10_000
    if os.environ.get("GQA_STATUS_SCREENSHOT"):
        assert pathlib.Path(os.environ["GQA_STATUS_SCREENSHOT"]).stat().st_size > 10_000


def test_status_page_says_when_the_server_is_gone(server):
    """The page keeps its last figures and says the listener no longer answers."""
    from playwright.sync_api import sync_playwright

    from service.metrics.listener import MetricsHttpServer
    from service.metrics.pages import pages

    http = MetricsHttpServer(server.server.metrics.registry, "127.0.0.1", 0, routes=pages(lambda: "SERVING"))
    problems: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.goto(f"http://127.0.0.1:{http.port}/?every=0.3")
                page.wait_for_function("Number(document.getElementById('samples').dataset.value) >= 2", timeout=30000)
                http.close()
                page.wait_for_function("document.getElementById('state').textContent === 'unreachable'", timeout=30000)
                assert page.get_attribute("#streams", "data-value") != ""
            finally:
                browser.close()
    finally:
        http.close()
    assert not problems, problems
