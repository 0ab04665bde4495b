"""The Grafana dashboard (helm/gqa-serve/dashboards/gqa-serve.json), built from code.

Thresholds and the error definitions come from the chart's ``alerts`` values, the same numbers
the PrometheusRule is templated from; the chart's ConfigMap template puts a release's own values
into the same places (``dashboard_panels.THRESHOLD_PANELS`` and the constant variables), so the
lines on the panels and the alerts never disagree. This module lays the panels out and adds the
variables and annotations; the panels are ``dashboard_panels``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from dashboard_panels import DS, errors, latency_and_throughput, process, saturation, stats, streams_and_cache

# Hidden constants holding the error definitions of the alerts (set from values by the chart).
CONSTANTS = {
    "rpc_error_codes": ("rpcErrors", "codes"),
    "step_error_outcomes": ("stepErrors", "outcomes"),
}


def _query_variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-query"},
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "hide": 0,
    }


def _constant(name: str, value: str, description: str) -> dict:
    return {
        "name": name,
        "type": "constant",
        "query": value,
        "hide": 2,
        "description": description,
        "current": {"text": value, "value": value},
        "options": [{"text": value, "value": value, "selected": True}],
    }


def constant_value(value) -> str:
    return "|".join(value) if isinstance(value, list) else str(value)


def _grid(top: list[dict], wide: list[dict]) -> list[dict]:
    """The panels with ids and positions: ``top`` in one row of small stats, ``wide`` two a row."""
    panels = []
    for i, panel in enumerate(top):
        panels.append({"id": i + 1, **panel, "gridPos": {"x": 4 * i, "y": 0, "w": 4, "h": 4}})
    for i, panel in enumerate(wide):
        panels.append(
            {"id": len(top) + i + 1, **panel, "gridPos": {"x": 12 * (i % 2), "y": 4 + 8 * (i // 2), "w": 12, "h": 8}}
        )
    # Keep every panel's keys in one order: id, type, title, description, datasource, gridPos, ...
    order = ("id", "type", "title", "description", "datasource", "gridPos", "fieldConfig", "options", "targets")
    panels = [{k: p[k] for k in order} for p in panels]
    return panels


def _variables(alerts: Mapping) -> list[dict]:
    """The data source and the pickers at the top, then the hidden constants of the alerts."""
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "Prometheus", "value": "prometheus"},
            "hide": 0,
            "refresh": 1,
        },
        _query_variable("cluster", "Cluster", "label_values(gqa_build_info, cluster)"),
        _query_variable("namespace", "Namespace", 'label_values(gqa_build_info{cluster=~"$cluster"}, namespace)'),
        _query_variable("job", "Job", 'label_values(gqa_build_info{cluster=~"$cluster",namespace=~"$namespace"}, job)'),
        _query_variable(
            "instance",
            "Pod",
            'label_values(gqa_build_info{cluster=~"$cluster",namespace=~"$namespace",job=~"$job"}, instance)',
        ),
        _query_variable(
            "backend",
            "Backend",
            'label_values(gqa_streams_opened_total{cluster=~"$cluster",namespace=~"$namespace",job=~"$job"}, backend)',
        ),
        _constant(
            "rpc_error_codes",
            constant_value(alerts["rpcErrors"]["codes"]),
            "gRPC codes counted as errors: the chart's alerts.rpcErrors.codes, shared with GqaRpcErrorRatioHigh.",
        ),
        _constant(
            "step_error_outcomes",
            constant_value(alerts["stepErrors"]["outcomes"]),
            "Step outcomes counted as errors: the chart's alerts.stepErrors.outcomes, shared with "
            "GqaStepErrorRatioHigh.",
        ),
    ]


def _annotations() -> list[dict]:
    """Firing gqa-serve alerts drawn on every panel."""
    return [
        {
            "name": "gqa-serve alerts",
            "datasource": DS,
            "enable": True,
            "iconColor": "red",
            "target": {
                "refId": "alerts",
                "expr": 'ALERTS{alertname=~"Gqa.*",alertstate="firing",namespace=~"$namespace"}',
            },
            "step": "60s",
            "titleFormat": "{{alertname}}",
            "tagKeys": "alertname,severity,instance",
            "textFormat": "{{instance}}",
            "useValueForTime": False,
        }
    ]


def build(alerts: Mapping) -> dict:
    """The dashboard for the chart's ``alerts`` values."""
    wide = errors(alerts) + saturation(alerts) + latency_and_throughput() + streams_and_cache() + process()
    panels = _grid(stats(alerts), wide)
    annotations = _annotations()
    variables = _variables(alerts)
    return {
        "uid": "gqa-serve",
        "title": "gqa-serve",
        "description": "Grouped-query-attention decode service: errors, queue wait and saturation (with the alerts' "
        "thresholds), per pod, then latency, throughput, batches, streams, cache, evictions and the "
        "process. Built by helm/tools/dashboard.py from the chart's alerts values; see "
        "docs/runbook.md.",
        "tags": ["gqa-serve", "grpc"],
        "schemaVersion": 41,
        "version": 2,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": annotations},
        "templating": {"list": variables},
        "panels": panels,
    }
