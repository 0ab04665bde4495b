"""The Helm chart, checked offline with the real tools: helm lint/template (the official binary)
and kubernetes-validate against the Kubernetes 1.33 schemas, for the default values and every
file of ci/ (cpu, gpu, everything-on). No cluster is needed.

Each tool missing from the machine skips the tests that need it, with the reason (`make tools`
installs them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from service.config import ServerConfig

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (kubernetes-validate brings it: run `make tools`)")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "gqa-serve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.33.0"
MONITORING_API = "monitoring.coreos.com/v1"


def _which(name: str) -> str | None:
    return (
        shutil.which(name)
        or shutil.which(name, path=str(ROOT / ".tools" / "bin"))
        or shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    )


HELM = _which("helm")
KUBE_VALIDATE = _which("kubernetes-validate")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not installed (run `make tools`)")
needs_validate = pytest.mark.skipif(
    KUBE_VALIDATE is None, reason="kubernetes-validate not installed (run `make tools`)"
)


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("helm")
    env = dict(os.environ, KUBECONFIG=os.devnull)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    return env


def helm(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run([HELM, *args], capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert run.returncode == 0, f"helm {' '.join(args)}:\n{run.stdout}\n{run.stderr}"
    return run


def template(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return helm(
        env,
        "template",
        "gqa",
        str(CHART),
        "--namespace",
        "ml",
        "--kube-version",
        KUBE_VERSION,
        "--api-versions",
        MONITORING_API,
        *args,
        check=check,
    )


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


@pytest.fixture(scope="session")
def rendered(helm_env) -> dict[str, str]:
    """ci file stem (and "default") -> the rendered manifests' text."""
    out = {"default": template(helm_env).stdout}
    for path in CI_VALUES:
        out[path.stem] = template(helm_env, "-f", str(path)).stdout
    return out


def test_ci_values_cover_cpu_and_gpu():
    assert {p.stem for p in CI_VALUES} >= {"cpu-values", "gpu-values"}


@needs_helm
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.stem if p else "default")
def test_lint_strict(helm_env, values):
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    if values:
        args += ["-f", str(values)]
    helm(helm_env, *args)


@needs_helm
@needs_validate
@pytest.mark.parametrize("name", ["default", *(p.stem for p in CI_VALUES)])
def test_rendered_manifests_pass_kubernetes_schemas(rendered, tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(rendered[name])
    run = subprocess.run(
        [KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ERROR" not in run.stdout + run.stderr


@needs_validate
def test_kubernetes_validate_rejects_unknown_fields(tmp_path):
    # The pass above means something only if the same check fails a typo'd manifest.
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIp: None, ports: [{port: 1}]}\n")
    run = subprocess.run(
        [KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(bad)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0


def _deployment(text: str) -> dict:
    (dep,) = by_kind(docs(text), "Deployment")
    return dep


def _container(text: str) -> dict:
    (container,) = _deployment(text)["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str]:
    """Plain name: value entries (valueFrom ones, a Secret's token say, are left out)."""
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _tls(container: dict) -> bool:
    return "GQA_TLS_CERT_FILE" in _env(container)


@needs_helm
@pytest.mark.parametrize("name", ["default", *(p.stem for p in CI_VALUES)])
def test_deployment_probes_ports_and_security(rendered, name):
    dep = _deployment(rendered[name])
    pod = dep["spec"]["template"]["spec"]
    container = _container(rendered[name])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    tls = _tls(container)
    assert set(ports) == ({"grpc", "metrics", "health"} if tls else {"grpc", "metrics"})
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = container[probe]["grpc"]
        probed = ports["health"] if tls else ports["grpc"]
        assert isinstance(grpc_probe["port"], int) and grpc_probe["port"] == probed, probe
        assert grpc_probe["service"] in ("", "gqa.v1.AttentionService")
    assert container["readinessProbe"]["grpc"]["service"] == "gqa.v1.AttentionService"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"/tmp"} <= {m["mountPath"] for m in container["volumeMounts"]}
    assert container["resources"]["requests"]["memory"]
    env = _env(container)
    assert env["GQA_ADDRESS"] == f"0.0.0.0:{ports['grpc']}"
    assert env["GQA_METRICS_PORT"] == str(ports["metrics"])
    # Longer than the whole drain, or Kubernetes kills streams mid-grace.
    drain = pod["containers"][0].get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    drain += float(env["GQA_GRACE_PERIOD_S"]) + 1
    assert pod["terminationGracePeriodSeconds"] > drain


@needs_helm
@pytest.mark.parametrize("name", ["default", *(p.stem for p in CI_VALUES)])
def test_every_server_setting_comes_from_values_and_parses(rendered, name):
    from service.config import from_args

    env = _env(_container(rendered[name]))
    fields = {"GQA_" + f.name.upper(): f for f in dataclasses.fields(ServerConfig)}
    # Security settings are opt-in (TLS files, a token from a Secret): not rendered by default.
    expected = {k for k, f in fields.items() if not f.metadata.get("optional_env")}
    rendered_names = {k for k in env if k.startswith("GQA_")}
    assert expected <= rendered_names, expected - rendered_names
    assert rendered_names <= set(fields), rendered_names - set(fields)
    # The service's own parser accepts what the chart renders (no 2.1e+09 for an int, bytes for
    # a quantity); file paths exist only in the pod.
    config = from_args(None, {k: v for k, v in env.items() if not k.endswith("_FILE")})
    assert config.host == "0.0.0.0"


@needs_helm
def test_services_plain_and_headless(rendered):
    services = {s["metadata"]["name"]: s for s in by_kind(docs(rendered["default"]), "Service")}
    headless = services["gqa-gqa-serve-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    plain = services["gqa-gqa-serve"]
    assert plain["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in plain["spec"]["ports"]} == {"grpc", "metrics"}
    pod_labels = _deployment(rendered["default"])["spec"]["template"]["metadata"]["labels"]
    for svc in services.values():
        assert svc["spec"]["selector"].items() <= pod_labels.items()


@needs_helm
def test_pdb_always_and_hpa_only_when_enabled(rendered):
    default = docs(rendered["default"])
    assert by_kind(default, "PodDisruptionBudget")
    assert not by_kind(default, "HorizontalPodAutoscaler")
    assert "replicas" in _deployment(rendered["default"])["spec"]
    cpu = docs(rendered["cpu-values"])
    (hpa,) = by_kind(cpu, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _deployment(rendered["cpu-values"])["metadata"]["name"]
    # The HPA owns the count: a replicas field would fight it on every upgrade.
    assert "replicas" not in _deployment(rendered["cpu-values"])["spec"]


@needs_helm
def test_gpu_variant_asks_for_gpus_and_gpu_nodes(rendered):
    gpu = _deployment(rendered["gpu-values"])["spec"]["template"]["spec"]
    container = gpu["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"])
    assert container["image"].endswith("-cuda")
    assert _env(container)["GQA_BACKEND"] == "cuda"
    cpu = _deployment(rendered["cpu-values"])["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"].get("limits", {})
    assert "nodeSelector" not in cpu
    assert cpu["containers"][0]["image"].endswith("-cpu")


@needs_helm
def test_monitoring_absent_when_disabled(helm_env):
    off = docs(
        template(
            helm_env,
            "--set",
            "serviceMonitor.enabled=false",
            "--set",
            "prometheusRule.enabled=false",
            "--set",
            "dashboard.enabled=false",
        ).stdout
    )
    kinds = {m["kind"] for m in off}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}
    # And each flag on its own.
    only_sm = {m["kind"] for m in docs(template(helm_env, "--set", "serviceMonitor.enabled=true").stdout)}
    assert "ServiceMonitor" in only_sm and not only_sm & {"PrometheusRule", "ConfigMap"}
    only_rule = {m["kind"] for m in docs(template(helm_env, "--set", "prometheusRule.enabled=true").stdout)}
    assert "PrometheusRule" in only_rule and not only_rule & {"ServiceMonitor", "ConfigMap"}


@needs_helm
def test_monitoring_objects_carry_the_chart_files(rendered):
    manifests = docs(rendered["cpu-values"])
    (monitor,) = by_kind(manifests, "ServiceMonitor")
    scraped = [
        s
        for s in by_kind(manifests, "Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert len(scraped) == 1, "each pod must be scraped through exactly one Service"
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}
    (rule,) = by_kind(manifests, "PrometheusRule")
    rules_file = yaml.safe_load((CHART / "rules" / "gqa-serve-alerts.yaml").read_text())
    # The file is the defaults rendered in namespace "default"; this release lives in "ml".
    in_ml = json.dumps(rules_file["groups"]).replace('namespace=\\"default\\"', 'namespace=\\"ml\\"')
    in_ml = in_ml.replace('"namespace": "default"', '"namespace": "ml"').replace(
        "in namespace default", "in namespace ml"
    )
    assert rule["spec"]["groups"] == json.loads(in_ml)
    (dashboard,) = by_kind(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["gqa-serve.json"]) == json.loads(
        (CHART / "dashboards" / "gqa-serve.json").read_text()
    )


BAD_VALUES = {
    "unknown-backend": (["--set", "server.backend=tpu"], "/server/backend"),
    "unknown-dtype": (["--set", "server.dtype=float64"], "/server/dtype"),
    "zero-streams": (["--set", "server.maxStreams=0"], "/server/maxStreams"),
    "negative-budget": (["--set", "server.maxCacheBytes=-1"], "/server/maxCacheBytes"),
    "budget-bad-unit": (["--set", "server.maxCacheBytes=8GB"], "/server/maxCacheBytes"),
    "message-bad-unit": (["--set", "server.maxMessageBytes=lots"], "/server/maxMessageBytes"),
    "bad-zone-spread": (["--set", "zoneSpread=always"], "/zoneSpread"),
    "bad-alert-duration": (["--set", "alerts.queueWait.for=ten minutes"], "/alerts/queueWait/for"),
    "bad-alert-code": (["--set-json", 'alerts.rpcErrors.codes=["Internal","Oops"]'], "/alerts/rpcErrors/codes"),
    "bad-alert-ratio": (["--set", "alerts.rpcErrors.ratio=5"], "/alerts/rpcErrors/ratio"),
    "alert-typo": (["--set", "alerts.queueWait.p99=1"], "p99"),
    "string-limit": (["--set-string", "server.maxLayers=many"], "/server/maxLayers"),
    "typo-in-server": (["--set", "server.maxStream=10"], "maxStream"),
    "port-out-of-range": (["--set", "ports.grpc=70000"], "/ports/grpc"),
    "named-probe-port": (["--set-string", "ports.grpc=grpc"], "/ports/grpc"),
    "unknown-top-level": (["--set", "replicas=3"], "replicas"),
    "negative-replicas": (["--set", "replicaCount=-1"], "/replicaCount"),
    "root-user": (["--set", "podSecurityContext.runAsNonRoot=false"], "/podSecurityContext/runAsNonRoot"),
    "gpu-count-zero": (["--set", "gpu.count=0"], "/gpu/count"),
    "bad-scrape-interval": (["--set", "serviceMonitor.interval=often"], "/serviceMonitor/interval"),
    "env-overrides-setting": (["--set-json", 'extraEnv=[{"name":"GQA_BACKEND","value":"cpu"}]'], "/extraEnv"),
    "unknown-probe-kind": (["--set", "probes.kind=tcp"], "/probes/kind"),
}


@needs_helm
@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_schema_rejects_bad_values(helm_env, case):
    args, where = BAD_VALUES[case]
    run = template(helm_env, *args, check=False)
    assert run.returncode != 0, f"{case}: rendered anyway"
    assert where in run.stderr, run.stderr


@needs_helm
def test_termination_grace_shorter_than_drain_is_refused(helm_env):
    run = template(
        helm_env, "--set", "server.gracePeriodSeconds=30", "--set", "terminationGracePeriodSeconds=20", check=False
    )
    assert run.returncode != 0
    assert "terminationGracePeriodSeconds" in run.stderr


TLS_SET = ["--set", "tls.enabled=true", "--set", "tls.secretName=gqa-tls", "--set", "tls.clientAuth=true"]


@needs_helm
@needs_validate
def test_tls_variant_mounts_the_secret_and_probes_the_plaintext_health_port(helm_env, tmp_path):
    text = template(helm_env, *TLS_SET).stdout
    path = tmp_path / "tls.yaml"
    path.write_text(text)
    run = subprocess.run(
        [KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    pod = _deployment(text)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = _env(container)
    assert env["GQA_TLS_CERT_FILE"] == "/etc/gqa-serve/tls/tls.crt"
    assert env["GQA_TLS_KEY_FILE"] == "/etc/gqa-serve/tls/tls.key"
    assert env["GQA_TLS_CLIENT_CA_FILE"] == "/etc/gqa-serve/tls/ca.crt"
    health = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    assert env["GQA_HEALTH_PORT"] == str(health)
    # kubelet's grpc probes speak plaintext only: with TLS on they go to the health port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tls"]["mountPath"] == "/etc/gqa-serve/tls" and mounts["tls"]["readOnly"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "gqa-tls"
    # Without TLS the probes use the gRPC port and nothing of the above is rendered.
    plain = _container(template(helm_env).stdout)
    assert plain["readinessProbe"]["grpc"]["port"] == 50051
    assert not any(k.startswith("GQA_TLS") or k == "GQA_HEALTH_PORT" for k in _env(plain))


@needs_helm
@needs_validate
def test_http_probes_ask_the_metrics_port(helm_env, tmp_path):
    """probes.kind http: /readyz for startup and readiness, /healthz for liveness, on the metrics
    port (plaintext whatever the gRPC port speaks, so TLS needs no health port for them)."""
    text = template(helm_env, "--set", "probes.kind=http", *TLS_SET).stdout
    path = tmp_path / "http-probes.yaml"
    path.write_text(text)
    run = subprocess.run(
        [KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    container = _container(text)
    metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert _env(container)["GQA_METRICS_PORT"] == str(metrics)
    paths = {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe, route in paths.items():
        assert "grpc" not in container[probe], probe
        assert container[probe]["httpGet"] == {"path": route, "port": metrics}, probe
    # The listener serves exactly these paths (service/metrics/pages.py).
    from service.metrics.pages import health_routes

    assert set(paths.values()) <= set(health_routes(lambda: "SERVING"))


@needs_helm
def test_tls_without_a_secret_fails_at_install(helm_env):
    run = template(helm_env, "--set", "tls.enabled=true", check=False)
    assert run.returncode != 0 and "tls.secretName" in run.stderr


# -- byte sizes and the memory limit -------------------------------------------------------------
@needs_helm
@pytest.mark.parametrize(
    "given, bytes_",
    [("3Gi", 3 << 30), ("1.5Gi", 3 << 29), ("2G", 2_000_000_000), ("1536Mi", 1536 << 20), ("2147483648", 2 << 30)],
)
def test_cache_budget_takes_kubernetes_quantities_and_renders_bytes(helm_env, given, bytes_):
    env = _env(_container(template(helm_env, "--set-string", f"server.maxCacheBytes={given}").stdout))
    assert env["GQA_MAX_CACHE_BYTES"] == str(bytes_)


@needs_helm
def test_other_sizes_take_quantities_too(helm_env):
    env = _env(
        _container(
            template(helm_env, "--set", "server.maxMessageBytes=16Mi", "--set", "server.inlineStepBytes=256Ki").stdout
        )
    )
    assert env["GQA_MAX_MESSAGE_BYTES"] == str(16 << 20) and env["GQA_INLINE_STEP_BYTES"] == str(256 << 10)
    run = template(helm_env, "--set", "server.maxMessageBytes=4Gi", check=False)
    assert run.returncode != 0 and "server.maxMessageBytes" in run.stderr


@needs_helm
def test_a_cache_budget_over_the_memory_limit_fails_with_a_clear_message(helm_env):
    run = template(helm_env, "--set", "server.maxCacheBytes=8Gi", "--set", "resources.limits.memory=4Gi", check=False)
    assert run.returncode != 0
    for words in (
        "server.maxCacheBytes (8Gi = 8589934592 bytes)",
        "memoryHeadroom (1Gi = 1073741824 bytes)",
        "resources.limits.memory (4Gi = 4294967296 bytes)",
        "Lower server.maxCacheBytes",
    ):
        assert words in run.stderr, run.stderr
    # Exactly at the limit renders; one byte more does not.
    template(helm_env, "--set", "server.maxCacheBytes=3Gi", "--set", "resources.limits.memory=4Gi")
    run = template(
        helm_env, "--set", "server.maxCacheBytes=3221225473", "--set", "resources.limits.memory=4Gi", check=False
    )
    assert run.returncode != 0 and "does not fit" in run.stderr
    # The cuda backend's cache lives in device memory: no host-memory check.
    template(helm_env, "-f", str(CHART / "ci" / "gpu-values.yaml"), "--set", "server.maxCacheBytes=64Gi")


# -- values that reach the pod -------------------------------------------------------------------
def _everything(rendered) -> list[dict]:
    return docs(rendered["everything-values"])


@needs_helm
def test_extra_args_env_envfrom_and_volumes_reach_the_container(rendered):
    pod = _deployment(rendered["everything-values"])["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"] == ["--log-level", "DEBUG"]
    env = {e["name"]: e for e in container["env"]}
    assert env["OMP_NUM_THREADS"]["value"] == "4"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["GQA_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "gqa-serve-token", "key": "token"}
    assert container["envFrom"] == [{"configMapRef": {"name": "gqa-serve-extra"}}]
    assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
    assert any(v["name"] == "scratch" and "emptyDir" in v for v in pod["volumes"])
    default = _container(rendered["default"])
    assert "args" not in default and "envFrom" not in default
    assert "GQA_AUTH_TOKEN" not in {e["name"] for e in default["env"]}


@needs_helm
def test_zone_spread_and_extra_topology_constraints(rendered, helm_env):
    spread = _deployment(rendered["everything-values"])["spec"]["template"]["spec"]["topologySpreadConstraints"]
    keys = [(c["topologyKey"], c["whenUnsatisfiable"]) for c in spread]
    assert keys == [
        ("kubernetes.io/hostname", "ScheduleAnyway"),
        ("topology.kubernetes.io/zone", "DoNotSchedule"),
        ("kubernetes.io/hostname", "DoNotSchedule"),
    ]
    assert spread[1]["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "gqa"
    none = template(helm_env, "--set", "spreadAcrossNodes=false").stdout
    assert "topologySpreadConstraints" not in _deployment(none)["spec"]["template"]["spec"]


@needs_helm
def test_network_policy_opens_grpc_to_peers_and_metrics_to_monitoring_only(rendered, helm_env):
    (policy,) = by_kind(_everything(rendered), "NetworkPolicy")
    spec = policy["spec"]
    pod_labels = _deployment(rendered["everything-values"])["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = spec["ingress"]
    assert {p["port"] for p in grpc_rule["ports"]} == {"grpc", "health"}
    peers = grpc_rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-gateway"}}} in peers
    # The `helm test` pod is always let in.
    (test_pod,) = [m for m in _everything(rendered) if m["kind"] == "Pod"]
    assert any(
        p.get("podSelector", {}).get("matchLabels", {}).items() <= test_pod["metadata"]["labels"].items()
        and "podSelector" in p
        and "namespaceSelector" not in p
        for p in peers
    )
    assert [p["port"] for p in metrics_rule["ports"]] == ["metrics"]
    (peer,) = metrics_rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # grpcFrom empty: gRPC from anywhere (no `from`), metrics still from monitoring only.
    open_policy = by_kind(docs(template(helm_env, "--set", "networkPolicy.enabled=true").stdout), "NetworkPolicy")[0]
    assert "from" not in open_policy["spec"]["ingress"][0]
    assert open_policy["spec"]["ingress"][1]["from"]
    assert not by_kind(docs(rendered["default"]), "NetworkPolicy")


@needs_helm
def test_service_monitor_relabelings(rendered):
    (monitor,) = by_kind(_everything(rendered), "ServiceMonitor")
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["relabelings"] == [{"targetLabel": "cluster", "replacement": "ci-cluster"}]
    assert endpoint["metricRelabelings"][0]["action"] == "drop"
    (plain,) = by_kind(docs(rendered["cpu-values"]), "ServiceMonitor")
    assert "relabelings" not in plain["spec"]["endpoints"][0]


# -- alerts and dashboard follow the values ------------------------------------------------------
def _rules(manifests) -> dict[str, dict]:
    (rule,) = by_kind(manifests, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


@needs_helm
def test_alert_thresholds_durations_and_labels_come_from_values(rendered):
    rules = _rules(_everything(rendered))
    queue = rules["GqaQueueWaitHigh"]
    assert queue["expr"].rstrip().endswith("> 0.5") and queue["for"] == "5m"
    assert queue["labels"] == {"severity": "critical", "team": "ml-platform"}
    errors = rules["GqaRpcErrorRatioHigh"]
    assert 'grpc_code=~"Unknown|Internal|DataLoss|Unavailable"' in errors["expr"]
    assert errors["expr"].rstrip().endswith("> 0.02")
    for rule in rules.values():
        assert rule["annotations"]["runbook_url"].endswith("docs/runbook.md#" + rule["alert"].lower())
        assert 'job="gqa-serve",namespace="ml"' in rule["expr"]
    defaults = _rules(docs(rendered["cpu-values"]))
    assert defaults["GqaQueueWaitHigh"]["expr"].rstrip().endswith("> 0.25")


@needs_helm
def test_dashboard_thresholds_and_error_codes_follow_the_alert_values(rendered):
    (configmap,) = by_kind(_everything(rendered), "ConfigMap")
    dashboard = json.loads(configmap["data"]["gqa-serve.json"])
    panels = {p["title"]: p for p in dashboard["panels"]}
    lines = {
        title: p["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]
        for title, p in panels.items()
        if len(p["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])) > 1
    }
    assert lines["p99 queue wait by pod"] == 0.5
    assert lines["Error ratio"] == 0.02
    assert lines["Step error ratio"] == 0.01  # not overridden: the default
    constants = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"}
    assert constants["rpc_error_codes"] == "Unknown|Internal|DataLoss|Unavailable"
    code_regex = re.search(r'grpc_code=~"([^"]+)"', _rules(_everything(rendered))["GqaRpcErrorRatioHigh"]["expr"])
    assert code_regex.group(1) == constants["rpc_error_codes"]


# -- helm test --------------------------------------------------------------------------------
def _test_pod(text: str) -> dict:
    (pod,) = [m for m in docs(text) if m["kind"] == "Pod"]
    return pod


@needs_helm
def test_helm_test_pod_checks_grpc_health_of_the_release(rendered):
    pod = _test_pod(rendered["default"])
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert container["args"][1] == "gqa-gqa-serve.ml.svc:50051"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Not picked by the release's Services or PDB.
    selector = _deployment(rendered["default"])["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items()
    # Under TLS it asks the plaintext health port, which the Service then exposes.
    tls_pod = _test_pod(rendered["everything-values"])
    assert tls_pod["spec"]["containers"][0]["args"][1].endswith(":50052")
    (svc,) = [s for s in by_kind(_everything(rendered), "Service") if s["spec"].get("clusterIP") != "None"]
    assert "health" in {p["name"] for p in svc["spec"]["ports"]}


@needs_helm
def test_helm_test_script_passes_against_a_serving_server_and_fails_without_one(rendered):
    from service.server import ServerThread

    container = _test_pod(rendered["default"])["spec"]["containers"][0]
    script = container["args"][0]
    assert container["command"][-1] == "-c"
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as server:
        run = subprocess.run([sys.executable, "-c", script, server.address], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gqa.v1.AttentionService SERVING" in run.stdout
    from tests.metrics_load import free_port

    run = subprocess.run(
        [sys.executable, "-c", script, f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0


@needs_helm
def test_tests_can_be_turned_off(helm_env):
    assert not [m for m in docs(template(helm_env, "--set", "tests.enabled=false").stdout) if m["kind"] == "Pod"]


# -- generated files -----------------------------------------------------------------------------
@needs_helm
def test_chart_readme_dashboard_and_rules_are_current():
    run = subprocess.run(
        [sys.executable, str(ROOT / "helm" / "tools" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PATH=f"{pathlib.Path(HELM).parent}{os.pathsep}{os.environ['PATH']}"),
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_chart_readme_lists_every_value():
    import re as _re

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    listed = set(_re.findall(r"^\| `([^`]+)` \|", readme, _re.M))

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    assert set(leaves(values)) == listed


def test_chart_readme_values_table_is_current_without_helm():
    # The same check as generate.py --check for the README alone, which needs no helm binary.
    sys.path.insert(0, str(ROOT / "helm" / "tools"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    readme = (CHART / "README.md").read_text()
    assert generate.render_readme(readme) == readme, "run `python helm/tools/generate.py`"
