"""The dashboard's panels, as Grafana panel dicts, in the groups the dashboard shows them.

Every query selects the cluster, namespace, job and pod picked at the top (``SEL``; ``SELB`` adds
the backend). A panel with a threshold line reads it from the chart's ``alerts`` values through
``THRESHOLD_PANELS`` (templates/dashboard-configmap.yaml reads the same table), so the lines on
the panels and the alerts never disagree. ``dashboard.py`` lays them out.
"""

from __future__ import annotations

from collections.abc import Mapping

DS = {"type": "prometheus", "uid": "${datasource}"}
# Every query's selector: the cluster, namespace, job and pod picked at the top.
SEL = 'cluster=~"$cluster",namespace=~"$namespace",job=~"$job",instance=~"$instance"'
SELB = SEL + ',backend=~"$backend"'
RATE = "$__rate_interval"

# Panel title -> the alerts value its threshold line shows (templates/dashboard-configmap.yaml
# reads the same table).
THRESHOLD_PANELS = {
    "Worker utilisation": ("saturation", "busyFraction"),
    "Cache reserved of budget": ("budget", "fraction"),
    "Error ratio": ("rpcErrors", "ratio"),
    "Step error ratio": ("stepErrors", "ratio"),
    "p99 queue wait by pod": ("queueWait", "p99Seconds"),
    "Worker utilisation by pod": ("saturation", "busyFraction"),
    "Steps waiting and in flight by pod": ("saturation", "stepsWaiting"),
    "Cache and streams used of limit by pod": ("budget", "fraction"),
}


def rpc_error_ratio(by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (
        f'sum{group} (rate(grpc_server_handled_total{{{SEL},grpc_service="gqa.v1.AttentionService",'
        f'grpc_code=~"$rpc_error_codes"}}[{RATE}]))\n/\n'
        f'sum{group} (rate(grpc_server_handled_total{{{SEL},grpc_service="gqa.v1.AttentionService"}}[{RATE}]))'
    )


def step_error_ratio(by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return (
        f'sum{group} (rate(gqa_steps_total{{{SELB},outcome=~"$step_error_outcomes"}}[{RATE}]))\n/\n'
        f"sum{group} (rate(gqa_steps_total{{{SELB}}}[{RATE}]))"
    )


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "range": True, "refId": ref}


def _targets(pairs) -> list[dict]:
    return [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def _thresholds(line: float | None) -> dict:
    steps = [{"color": "green", "value": None}]
    if line is not None:
        steps.append({"color": "red", "value": line})
    return {"mode": "absolute", "steps": steps}


def stat(title: str, description: str, unit: str, expr: str, line: float | None = None) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": _thresholds(line)},
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "auto",
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "wideLayout": True,
            "showPercentChange": False,
            "percentChangeColorMode": "standard",
        },
        "targets": _targets([(expr, title)]),
    }


def series(title: str, description: str, unit: str, pairs, line: float | None = None) -> dict:
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
        "axisSoftMin": 0,
    }
    defaults: dict = {"unit": unit, "color": {"mode": "palette-classic"}, "custom": custom}
    if line is not None:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = _thresholds(line)
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"calcs": ["mean", "max"], "displayMode": "table", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _targets(pairs),
    }


def _line(alerts: Mapping, title: str) -> float:
    """The alerts value a panel's threshold line shows (``THRESHOLD_PANELS``)."""
    group, key = THRESHOLD_PANELS[title]
    return alerts[group][key]


def _quantile(q: float, by: str) -> str:
    """The head of a ``histogram_quantile`` over buckets summed by ``by``."""
    return f"histogram_quantile({q}, sum by ({by}, le) "


def stats(alerts: Mapping) -> list[dict]:
    """The row of single figures at the top."""
    return [
        stat(
            "Pods up",
            "Scrape targets of the job that are up (the GqaTargetDown and GqaTargetAbsent alerts).",
            "short",
            f"sum(up{{{SEL}}})",
        ),
        stat("Active streams", "Streams open now, all pods selected.", "short", f"sum(gqa_active_streams{{{SEL}}})"),
        stat(
            "Steps per second",
            "Successful decode steps per second, all pods and backends selected.",
            "ops",
            f'sum(rate(gqa_steps_total{{{SELB},outcome="ok"}}[{RATE}]))',
        ),
        stat(
            "Steps waiting",
            "Steps accepted and waiting for a compute worker, all pods selected.",
            "short",
            f"sum(gqa_steps_waiting{{{SEL}}})",
        ),
        stat(
            "Worker utilisation",
            "Busy fraction of the compute workers, all pods selected.",
            "percentunit",
            f"sum(rate(gqa_compute_busy_seconds_total{{{SEL}}}[{RATE}])) / sum(gqa_compute_workers{{{SEL}}})",
            alerts["saturation"]["busyFraction"],
        ),
        stat(
            "Cache reserved of budget",
            "Largest share of a pod's cache budget (--max-cache-bytes) reserved by "
            "open streams; GqaBudgetNearlyExhausted fires above the red line.",
            "percentunit",
            f"max(gqa_cache_reserved_bytes{{{SEL}}} / gqa_cache_budget_bytes{{{SEL}}})",
            alerts["budget"]["fraction"],
        ),
    ]


def errors(alerts: Mapping) -> list[dict]:
    """Error ratios per pod, with the alerts' thresholds (the symptoms come first)."""
    return [
        series(
            "Error ratio",
            "AttentionService RPCs that ended with one of the codes in $rpc_error_codes (the "
            "GqaRpcErrorRatioHigh alert's definition, set by the chart's alerts.rpcErrors) over all RPCs, per "
            "pod; the dashed line is the alert's threshold.",
            "percentunit",
            [(rpc_error_ratio("instance"), "{{instance}}")],
            _line(alerts, "Error ratio"),
        ),
        series(
            "Step error ratio",
            "Decode steps refused in-band with an outcome in $step_error_outcomes (the "
            "GqaStepErrorRatioHigh alert's definition) over all steps, per pod.",
            "percentunit",
            [(step_error_ratio("instance"), "{{instance}}")],
            _line(alerts, "Step error ratio"),
        ),
    ]


def saturation(alerts: Mapping) -> list[dict]:
    """Queue wait, worker use and limits used, per pod, with the alerts' thresholds."""
    return [
        series(
            "p99 queue wait by pod",
            "p99 of the time steps waited for a compute worker, per pod (the GqaQueueWaitHigh alert).",
            "s",
            [
                (
                    _quantile(0.99, "instance") + f"(rate(gqa_step_queue_seconds_bucket{{{SELB}}}[{RATE}])))",
                    "{{instance}}",
                )
            ],
            _line(alerts, "p99 queue wait by pod"),
        ),
        series(
            "Worker utilisation by pod",
            "Busy fraction of each pod's compute workers: rate of "
            "gqa_compute_busy_seconds_total over gqa_compute_workers (GqaSaturated).",
            "percentunit",
            [
                (
                    f"sum by (instance) (rate(gqa_compute_busy_seconds_total{{{SEL}}}[{RATE}]))\n/\n"
                    f"sum by (instance) (gqa_compute_workers{{{SEL}}})",
                    "{{instance}}",
                )
            ],
            _line(alerts, "Worker utilisation by pod"),
        ),
        series(
            "Steps waiting and in flight by pod",
            "Steps accepted and waiting for a worker, and steps being "
            "computed, per pod; GqaSaturated fires when the 5-minute average of waiting stays above the line.",
            "short",
            [
                (f"sum by (instance) (gqa_steps_waiting{{{SEL}}})", "waiting {{instance}}"),
                (f"sum by (instance) (gqa_steps_in_flight{{{SEL}}})", "in flight {{instance}}"),
            ],
            _line(alerts, "Steps waiting and in flight by pod"),
        ),
        series(
            "Cache and streams used of limit by pod",
            "Cache reserved over the budget and streams open over --max-streams, per pod (GqaBudgetNearlyExhausted).",
            "percentunit",
            [
                (
                    f"max by (instance) (gqa_cache_reserved_bytes{{{SEL}}} / gqa_cache_budget_bytes{{{SEL}}})",
                    "cache {{instance}}",
                ),
                (
                    f"sum by (instance) (gqa_active_streams{{{SEL}}}) / max by (instance) (gqa_streams_limit{{{SEL}}})",
                    "streams {{instance}}",
                ),
            ],
            _line(alerts, "Cache and streams used of limit by pod"),
        ),
        series(
            "Steps per second by pod",
            "Successful decode steps per second, per pod: how evenly clients spread their streams.",
            "ops",
            [(f'sum by (instance) (rate(gqa_steps_total{{{SELB},outcome="ok"}}[{RATE}]))', "{{instance}}")],
        ),
        series(
            "Refused stream opens by reason",
            "Opens the engine refused per second: budget, streams (limit), "
            "draining, backend, invalid, memory (GqaStreamOpensRefused watches budget, streams and memory).",
            "ops",
            [(f"sum by (reason) (rate(gqa_stream_open_refusals_total{{{SEL}}}[{RATE}]))", "{{reason}}")],
        ),
    ]


def latency_and_throughput() -> list[dict]:
    """Step latency by backend, steps and batches per second."""
    return [
        series(
            "Step latency percentiles by backend",
            "Server-side latency of successful decode steps (queue wait "
            "+ compute): p50, p90 and p99 per backend. Long contexts are slow by nature: no alert on it.",
            "s",
            [
                (
                    _quantile(q, "backend") + f"(rate(gqa_step_duration_seconds_bucket{{{SELB}}}[{RATE}])))",
                    f"p{round(q * 100)} {{{{backend}}}}",
                )
                for q in (0.5, 0.9, 0.99)
            ],
        ),
        series(
            "p99 queue wait and compute by backend",
            "Where step latency goes: time waiting between arrival and compute, and the compute itself (p99).",
            "s",
            [
                (
                    _quantile(0.99, "backend") + f"(rate(gqa_step_queue_seconds_bucket{{{SELB}}}[{RATE}])))",
                    "queue p99 {{backend}}",
                ),
                (
                    _quantile(0.99, "backend") + f"(rate(gqa_step_compute_seconds_bucket{{{SELB}}}[{RATE}])))",
                    "compute p99 {{backend}}",
                ),
            ],
        ),
        series(
            "Throughput: steps per second by backend and outcome",
            "Decode steps per second; outcome is ok or the status code a step was refused with.",
            "ops",
            [(f"sum by (backend, outcome) (rate(gqa_steps_total{{{SELB}}}[{RATE}]))", "{{backend}} {{outcome}}")],
        ),
        series(
            "Batch size",
            "Steps per batched computation (p50, p99 and mean), and sequences per Batch RPC "
            "message (mean): how much the batcher merges.",
            "short",
            [
                (_quantile(0.5, "backend") + f"(rate(gqa_batch_size_bucket{{{SELB}}}[{RATE}])))", "p50 {{backend}}"),
                (_quantile(0.99, "backend") + f"(rate(gqa_batch_size_bucket{{{SELB}}}[{RATE}])))", "p99 {{backend}}"),
                (
                    f"sum by (backend) (rate(gqa_batch_size_sum{{{SELB}}}[{RATE}]))\n/\n"
                    f"sum by (backend) (rate(gqa_batch_size_count{{{SELB}}}[{RATE}]))",
                    "mean {{backend}}",
                ),
                (
                    f"sum by (backend) (rate(gqa_batch_message_sequences_sum{{{SELB}}}[{RATE}]))\n/\n"
                    f"sum by (backend) (rate(gqa_batch_message_sequences_count{{{SELB}}}[{RATE}]))",
                    "sequences per Batch message {{backend}}",
                ),
            ],
        ),
    ]


def streams_and_cache() -> list[dict]:
    """Streams, cache bytes and evictions."""
    return [
        series(
            "Active streams by backend and policy",
            "Streams open now, sequences open in Batch sessions, and the stream limit (--max-streams).",
            "short",
            [
                (f"sum by (backend, policy) (gqa_active_streams{{{SELB}}})", "{{backend}} {{policy}}"),
                (f"sum(gqa_batch_sequences_open{{{SEL}}})", "Batch sequences"),
                (f"sum(gqa_streams_limit{{{SEL}}})", "limit"),
            ],
        ),
        series(
            "Cache use against budget",
            "Bytes reserved by open streams (their full capacity, taken at open), "
            "bytes holding resident tokens, and the budget.",
            "bytes",
            [
                (f"sum(gqa_cache_in_use_bytes{{{SEL}}})", "in use"),
                (f"sum(gqa_cache_reserved_bytes{{{SEL}}})", "reserved"),
                (f"sum(gqa_cache_budget_bytes{{{SEL}}})", "budget"),
            ],
        ),
        series(
            "CUDA memory by pod",
            "Device memory held by tensors (allocated) and by torch's caching allocator "
            "(reserved, what the process takes from the GPU), per pod and device; cuda backend only.",
            "bytes",
            [
                (
                    f"sum by (instance, device) (gqa_cuda_memory_allocated_bytes{{{SEL}}})",
                    "allocated {{instance}} gpu{{device}}",
                ),
                (
                    f"sum by (instance, device) (gqa_cuda_memory_reserved_bytes{{{SEL}}})",
                    "reserved {{instance}} gpu{{device}}",
                ),
            ],
        ),
        series(
            "Evictions by policy",
            "Tokens evicted per second, and steps that evicted at least one token per second.",
            "short",
            [
                (f"sum by (policy) (rate(gqa_evicted_tokens_total{{{SELB}}}[{RATE}]))", "tokens {{policy}}"),
                (f"sum by (policy) (rate(gqa_eviction_events_total{{{SELB}}}[{RATE}]))", "events {{policy}}"),
            ],
        ),
        series(
            "Cache bytes moved and written by policy",
            "Bytes copied inside caches to evict (zero for ring "
            "layouts) against bytes written for new tokens: the cost that decides strict versus greedy.",
            "Bps",
            [
                (f"sum by (policy) (rate(gqa_cache_moved_bytes_total{{{SELB}}}[{RATE}]))", "moved {{policy}}"),
                (f"sum by (policy) (rate(gqa_cache_written_bytes_total{{{SELB}}}[{RATE}]))", "written {{policy}}"),
            ],
        ),
        series(
            "Stream lifetime by policy",
            "p50 and p99 of the time from open to close of streams that closed.",
            "s",
            [
                (
                    _quantile(q, "policy") + f"(rate(gqa_stream_lifetime_seconds_bucket{{{SELB}}}[{RATE}])))",
                    f"p{round(q * 100)} {{{{policy}}}}",
                )
                for q in (0.5, 0.99)
            ],
        ),
    ]


def process() -> list[dict]:
    """The server process's CPU and memory, and its RPCs."""
    return [
        series(
            "Process CPU by pod",
            "CPU seconds per second the server process uses (cores), per pod: compare "
            "with the pod's CPU limit and with --workers.",
            "short",
            [(f"sum by (instance) (rate(process_cpu_seconds_total{{{SEL}}}[{RATE}]))", "{{instance}}")],
        ),
        series(
            "Process memory (RSS) by pod",
            "Resident memory of the server process per pod, against its cache "
            "budget: the gap is what the process needs beyond the cache (the chart's memoryHeadroom).",
            "bytes",
            [
                (f"sum by (instance) (process_resident_memory_bytes{{{SEL}}})", "RSS {{instance}}"),
                (f"sum by (instance) (gqa_cache_budget_bytes{{{SEL}}})", "budget {{instance}}"),
            ],
        ),
        series(
            "RPCs per second by method and code",
            "gRPC calls completed per second (grpc_server_handled_total).",
            "ops",
            [
                (
                    f"sum by (grpc_service, grpc_method, grpc_code) (rate(grpc_server_handled_total{{{SEL}}}[{RATE}]))",
                    "{{grpc_method}} {{grpc_code}}",
                )
            ],
        ),
    ]
