"""Alerting rules and dashboard queries, checked by promtool.

The rules are templated by the chart from its ``alerts`` values (templates/_alerts.tpl);
rules/gqa-serve-alerts.yaml is the same rules rendered with the defaults, and a test here checks
it is current. ``promtool check rules`` on that file, ``promtool test rules`` on its unit tests
(every alert firing and silent), every rule's runbook_url pointing at a section of
docs/runbook.md, and every dashboard panel's PromQL parsed by promtool (as recording rules,
Grafana's interval variables replaced by a duration).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "helm" / "gqa-serve" / "rules" / "gqa-serve-alerts.yaml"
RULE_TESTS = sorted((ROOT / "tests" / "promtool").glob("*.test.yaml"))
DASHBOARD = ROOT / "helm" / "gqa-serve" / "dashboards" / "gqa-serve.json"
RUNBOOK = ROOT / "docs" / "runbook.md"
ALERTS = {
    "GqaQueueWaitHigh",
    "GqaRpcErrorRatioHigh",
    "GqaStepErrorRatioHigh",
    "GqaSaturated",
    "GqaStreamOpensRefused",
    "GqaBudgetNearlyExhausted",
    "GqaTargetDown",
    "GqaTargetAbsent",
}
# Grafana's range variables are not PromQL; any duration stands in for them.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (tests/tools/install_prometheus.sh; `make tools`)"
)


def _promtool(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def _rule_blocks() -> dict[str, str]:
    # The rule file's text per alert (no YAML parser needed: promtool checks the structure).
    parts = re.split(r"^\s*- alert: ", RULES.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def test_rule_file_has_every_alert_with_severity_and_text():
    blocks = _rule_blocks()
    assert set(blocks) == ALERTS
    for name, text in blocks.items():
        assert re.search(r"^\s+severity: (warning|critical)$", text, re.M), name
        for key in ("expr", "for", "summary", "description", "runbook_url"):
            assert re.search(rf"^\s+{key}: \S", text, re.M), (name, key)


def test_no_alert_on_raw_step_latency():
    # Long contexts are slow by nature (float16 at S=32768 takes ~80 ms a step): alert on what
    # users feel and operators can act on (queue wait, errors, saturation), not on compute time.
    text = RULES.read_text()
    assert "gqa_step_duration_seconds" not in text and "gqa_step_compute_seconds" not in text


def test_every_runbook_url_points_at_a_section_of_the_runbook():
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.M)
    }
    for name, text in _rule_blocks().items():
        url = re.search(r"runbook_url: (\S+)", text).group(1)
        assert url.endswith(f"docs/runbook.md#{name.lower()}"), (name, url)
        assert name.lower() in anchors, f"docs/runbook.md has no section {name}"


def test_every_alert_has_unit_tests_firing_and_silent():
    fired, silent = set(), set()
    for path in RULE_TESTS:
        for name, body in re.findall(
            r"alertname: (\w+)\n\s+exp_alerts:(.*?)(?=\n\s+- eval_time|\n  - interval|\n  #|\Z)", path.read_text(), re.S
        ):
            (fired if "exp_labels" in body else silent).add(name)
    assert fired == ALERTS
    assert silent == ALERTS


def test_rule_file_is_the_chart_rendered_with_its_defaults():
    pytest.importorskip("yaml", reason="PyYAML not installed")
    import sys

    sys.path.insert(0, str(ROOT / "helm" / "tools"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    if shutil.which("helm") is None and not (ROOT / ".tools" / "bin" / "helm").exists():
        pytest.skip("helm not installed (run `make tools`)")
    assert RULES.read_text() == generate.render_rules(), "run `python helm/tools/generate.py`"


@needs_promtool
def test_promtool_check_rules():
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


@needs_promtool
@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(path):
    done = _promtool("test", "rules", path.name, cwd=path.parent)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    queries = _panel_queries()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard_query_{i}", "expr": GRAFANA_INTERVALS.sub("5m", expr)}
                    for i, (_, expr) in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(json.dumps(rules, indent=1))  # JSON is YAML
    done = _promtool("check", "rules", str(path))
    names = "\n".join(f"dashboard_query_{i}: {title}" for i, (title, _) in enumerate(queries))
    assert done.returncode == 0, done.stdout + done.stderr + "\n" + names
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout


@needs_promtool
def test_the_query_check_rejects_bad_promql(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        json.dumps(
            {
                "groups": [
                    {
                        "name": "bad",
                        "rules": [{"record": "bad_query", "expr": "sum by (backend (rate(gqa_steps_total[5m]))"}],
                    }
                ]
            }
        )
    )
    assert _promtool("check", "rules", str(path)).returncode != 0


def test_dashboard_and_rules_use_only_exported_metrics():
    # Catches a renamed metric: every gqa_/grpc_server_ name in a query must be one the service
    # declares (service/metrics/*.py), histogram suffixes included.
    source = "".join(p.read_text() for p in (ROOT / "service" / "metrics").glob("*.py"))
    declared = set(re.findall(r'"((?:gqa|grpc_server)_[a-z_]+)"', source))
    used = set()
    for _, expr in _panel_queries():
        used |= set(re.findall(r"\b((?:gqa|grpc_server)_[a-z_]+)", expr))
    used |= set(re.findall(r"\b((?:gqa|grpc_server)_[a-z_]+)\{", RULES.read_text()))
    used |= set(re.findall(r"\b((?:gqa|grpc_server)_[a-z_]+)\[", RULES.read_text()))
    for name in used:
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert name in declared or base in declared, name
