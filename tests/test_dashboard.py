"""The Grafana dashboard type-checks against the official ``@grafana/schema`` model (tsc).

The JSON becomes a TypeScript value of type ``Dashboard`` (unknown keys and wrong types fail),
and each panel's ``options`` and ``fieldConfig.defaults.custom`` are checked against that panel
plugin's own types. Enums are compared by value: a JSON string is not a TS enum member, so the
schema types are mapped to the literal unions of their enums' values first.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (kubernetes-validate brings it: run `make tools`)")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "gqa-serve" / "dashboards" / "gqa-serve.json"
RULES = ROOT / "helm" / "gqa-serve" / "rules" / "gqa-serve-alerts.yaml"
SCHEMA_MODULES = ROOT / ".tools" / "grafana-schema" / "node_modules"
PANELCFG = "@grafana/schema/dist/esm/raw/composable/{plugin}/panelcfg/x/{name}PanelCfg_types.gen"
# Panel plugins the dashboard may use: the module name of their generated config types, and
# whether the plugin declares custom field options (stat has none: its `custom` must be empty).
PLUGINS = {"timeseries": ("TimeSeries", True), "stat": ("Stat", False)}

PRELUDE = """\
import type { Dashboard, AnnotationQuery, DataQuery } from '@grafana/schema';
{imports}

// A Prometheus annotation: the query in `target`, and the fields the Prometheus data source
// reads beside it (grafana/public/app/plugins/datasource/prometheus annotations), which the
// generic AnnotationQuery does not list.
interface PromAnnotationQuery extends DataQuery { expr: string; }
type PromAnnotation = AnnotationQuery<PromAnnotationQuery> & {
  step?: string; titleFormat?: string; textFormat?: string; tagKeys?: string; useValueForTime?: boolean;
};

// Enum types become the literal unions of their values (a JSON string is not an enum member).
type Lit<T> =
  T extends string ? `${T}` :
  T extends number ? (`${T}` extends `${infer N extends number}` ? N : T) :
  T extends boolean ? T :
  T extends ReadonlyArray<infer U> ? Array<Lit<U>> :
  T extends object ? { [K in keyof T]: Lit<T[K]> } :
  T;
"""


def _tsc() -> str | None:
    found = shutil.which("tsc")
    if found is None or not (SCHEMA_MODULES / "@grafana" / "schema" / "package.json").exists():
        return None
    return found


def _typescript_source(dashboard: dict) -> str:
    imports = "\n".join(
        f"import type {{ Options as {name}Options{f', FieldConfig as {name}FieldConfig' if custom else ''} }} "
        f"from '{PANELCFG.format(plugin=plugin, name=name)}';"
        for plugin, (name, custom) in PLUGINS.items()
    )
    annotations = dashboard.get("annotations", {}).get("list", [])
    bare = {**dashboard, "annotations": {"list": []}}
    lines = [
        PRELUDE.replace("{imports}", imports),
        f"export const dashboard: Lit<Dashboard> = {json.dumps(bare, indent=1)};",
        f"export const annotations: Lit<PromAnnotation>[] = {json.dumps(annotations, indent=1)};",
    ]
    for i, panel in enumerate(dashboard["panels"]):
        name, has_custom = PLUGINS[panel["type"]]
        lines.append(f"export const options{i}: Lit<{name}Options> = {json.dumps(panel.get('options', {}))};")
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
        custom_type = f"Lit<{name}FieldConfig>" if has_custom else "Record<string, never>"
        lines.append(f"export const custom{i}: {custom_type} = {json.dumps(custom)};")
    return "\n".join(lines) + "\n"


def _check(folder: pathlib.Path, dashboards: dict[str, dict]) -> dict[str, list[str]]:
    """Type-checks each dashboard as ``<name>.ts`` in one tsc run; the errors, by file."""
    (folder / "node_modules").symlink_to(SCHEMA_MODULES, target_is_directory=True)
    for name, dashboard in dashboards.items():
        (folder / f"{name}.ts").write_text(_typescript_source(dashboard))
    (folder / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "strict": True,
                    "noEmit": True,
                    "target": "es2022",
                    "module": "esnext",
                    "moduleResolution": "bundler",
                    "skipLibCheck": True,
                    "types": [],
                },
                "files": [f"{name}.ts" for name in dashboards],
            }
        )
    )
    done = subprocess.run(
        [_tsc(), "-p", str(folder / "tsconfig.json")],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_OPTIONS": "--max-old-space-size=1024"},
    )
    errors: dict[str, list[str]] = {name: [] for name in dashboards}
    for line in (done.stdout + done.stderr).splitlines():
        name = line.split(".ts(", 1)[0]
        errors.setdefault(name if name in errors else "other", []).append(line)
    assert done.returncode == 0 or any(errors.values()), f"tsc failed: {done.stdout}{done.stderr}"
    return errors


needs_tsc = pytest.mark.skipif(
    _tsc() is None, reason="tsc and @grafana/schema not installed (tests/tools/install_grafana_schema.sh; `make tools`)"
)


def _load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_panels_have_what_the_readme_promises():
    d = _load()
    assert d["uid"] == "gqa-serve"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in d["panels"]}
    for title in (
        "Step latency percentiles by backend",
        "Throughput: steps per second by backend and outcome",
        "Active streams by backend and policy",
        "Cache use against budget",
        "Evictions by policy",
        "Cache bytes moved and written by policy",
        "Error ratio",
        "Step error ratio",
        "p99 queue wait by pod",
        "Worker utilisation by pod",
        "Steps waiting and in flight by pod",
        "Batch size",
        "CUDA memory by pod",
        "Process CPU by pod",
        "Process memory (RSS) by pod",
        "Steps per second by pod",
        "Pods up",
    ):
        assert title in titles
    for panel in d["panels"]:
        assert panel["type"] in PLUGINS, panel["type"]
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
        assert panel.get("description"), panel["title"]


def _broken() -> dict:
    # tsc reports the first error of each declaration, so each mistake goes into a different
    # one: a bad enum value, an unknown key, a bad option value, a wrong type.
    d = _load()
    d["graphTooltip"] = 7
    stat = next(p for p in d["panels"] if p["type"] == "stat")
    series = [p for p in d["panels"] if p["type"] == "timeseries"]
    series[0]["fieldConfig"]["defaults"]["custom"]["lineWdith"] = 2
    series[1]["options"]["tooltip"]["mode"] = "loud"
    stat["options"]["reduceOptions"]["calcs"] = "lastNotNull"
    d["annotations"]["list"][0]["titleFromat"] = "{{alertname}}"
    return d


@pytest.fixture(scope="module")
def tsc_errors(tmp_path_factory):
    return _check(tmp_path_factory.mktemp("grafana"), {"dashboard": _load(), "broken": _broken()})


@needs_tsc
def test_dashboard_type_checks_against_grafana_schema(tsc_errors):
    assert tsc_errors["dashboard"] == [] and tsc_errors.get("other", []) == [], tsc_errors


@needs_tsc
def test_the_type_check_rejects_a_wrong_dashboard(tsc_errors):
    out = "\n".join(tsc_errors["broken"])
    for needle in (
        "Type '7'",
        "'\"lineWdith\"' does not exist",
        "Type '\"loud\"'",
        "Type 'string' is not assignable to type 'string[]'",
        "'\"titleFromat\"' does not exist",
    ):
        assert needle in out, (needle, out)


def _exprs(d: dict) -> list[str]:
    return [t["expr"] for p in d["panels"] for t in p["targets"]]


def test_every_query_filters_cluster_namespace_job_and_pod():
    d = _load()
    names = [v["name"] for v in d["templating"]["list"]]
    assert names[:6] == ["datasource", "cluster", "namespace", "job", "instance", "backend"]
    for expr in _exprs(d):
        for selector in re.findall(r"\w+\{([^}]*)\}", expr):
            for label in ("cluster", "namespace", "job", "instance"):
                assert f'{label}=~"${label}"' in selector, (label, expr)


def test_panels_use_the_alerts_definitions_and_thresholds():
    # One definition: the error panel's codes are a dashboard constant the chart sets from
    # alerts.rpcErrors.codes, the value the alert's expression is templated from; each alert's
    # threshold is drawn on its panel.
    values = yaml.safe_load((ROOT / "helm" / "gqa-serve" / "values.yaml").read_text())["alerts"]
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    alert = {r["alert"]: r for r in rules}
    d = _load()
    constants = {v["name"]: v["query"] for v in d["templating"]["list"] if v["type"] == "constant"}
    assert constants["rpc_error_codes"] == "|".join(values["rpcErrors"]["codes"])
    assert f'grpc_code=~"{constants["rpc_error_codes"]}"' in alert["GqaRpcErrorRatioHigh"]["expr"]
    assert f'outcome=~"{constants["step_error_outcomes"]}"' in alert["GqaStepErrorRatioHigh"]["expr"]
    panels = {p["title"]: p for p in d["panels"]}
    assert 'grpc_code=~"$rpc_error_codes"' in panels["Error ratio"]["targets"][0]["expr"]
    assert 'outcome=~"$step_error_outcomes"' in panels["Step error ratio"]["targets"][0]["expr"]

    def line(title):
        return panels[title]["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]

    assert line("Error ratio") == values["rpcErrors"]["ratio"]
    assert line("Step error ratio") == values["stepErrors"]["ratio"]
    assert line("p99 queue wait by pod") == values["queueWait"]["p99Seconds"]
    assert line("Worker utilisation by pod") == values["saturation"]["busyFraction"]
    assert line("Steps waiting and in flight by pod") == values["saturation"]["stepsWaiting"]
    assert line("Cache and streams used of limit by pod") == values["budget"]["fraction"]
    for title in ("Error ratio", "p99 queue wait by pod"):
        assert panels[title]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"


def test_alerts_are_annotated():
    (annotation,) = _load()["annotations"]["list"]
    assert annotation["enable"] and 'ALERTS{alertname=~"Gqa.*",alertstate="firing"' in annotation["target"]["expr"]


def test_dashboard_file_is_generated_from_the_chart_values():
    import sys

    sys.path.insert(0, str(ROOT / "helm" / "tools"))
    try:
        import dashboard as builder
    finally:
        sys.path.pop(0)
    values = yaml.safe_load((ROOT / "helm" / "gqa-serve" / "values.yaml").read_text())
    assert _load() == builder.build(values["alerts"]), "run `python helm/tools/generate.py`"
