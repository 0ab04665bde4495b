"""The Helm chart, checked offline with the real tools: helm lint/template (the official binary)
and kubernetes-validate against the Kubernetes 1.33 schemas. No cluster is needed.

Each tool missing from the machine skips the tests that need it, with the reason (`make tools`
installs them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
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
    return (shutil.which(name)
            or shutil.which(name, path=str(ROOT / ".tools" / "bin"))
            or shutil.which(name, path=str(pathlib.Path(sys.executable).parent)))


HELM = _which("helm")
KUBE_VALIDATE = _which("kubernetes-validate")
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not installed (run `make tools`)")
needs_validate = pytest.mark.skipif(KUBE_VALIDATE is None, reason="kubernetes-validate not installed (run `make tools`)")


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
    return helm(env, "template", "gqa", str(CHART), "--namespace", "ml", "--kube-version", KUBE_VERSION,
                "--api-versions", MONITORING_API, *args, check=check)


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
    run = subprocess.run([KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ERROR" not in run.stdout + run.stderr


@needs_validate
def test_kubernetes_validate_rejects_unknown_fields(tmp_path):
    # The pass above means something only if the same check fails a typo'd manifest.
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\n"
                   "spec: {clusterIp: None, ports: [{port: 1}]}\n")
    run = subprocess.run([KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0


def _deployment(text: str) -> dict:
    (dep,) = by_kind(docs(text), "Deployment")
    return dep


def _container(text: str) -> dict:
    (container,) = _deployment(text)["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


@needs_helm
@pytest.mark.parametrize("name", ["default", *(p.stem for p in CI_VALUES)])
def test_deployment_probes_ports_and_security(rendered, name):
    dep = _deployment(rendered[name])
    pod = dep["spec"]["template"]["spec"]
    container = _container(rendered[name])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(ports) == {"grpc", "metrics"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = container[probe]["grpc"]
        assert isinstance(grpc_probe["port"], int) and grpc_probe["port"] == ports["grpc"], probe
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
    # Security settings are opt-in (a token from a Secret through extraEnv, say): not rendered by default.
    expected = {"GQA_" + f.name.upper() for f in dataclasses.fields(ServerConfig) if not f.metadata.get("optional_env")}
    assert {k for k in env if k.startswith("GQA_")} == expected
    # The service's own parser accepts what the chart renders (no 2.1e+09 for an int).
    config = from_args(None, env)
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
    off = docs(template(helm_env, "--set", "serviceMonitor.enabled=false", "--set", "prometheusRule.enabled=false",
                        "--set", "dashboard.enabled=false").stdout)
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
    scraped = [s for s in by_kind(manifests, "Service")
               if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(scraped) == 1, "each pod must be scraped through exactly one Service"
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}
    (rule,) = by_kind(manifests, "PrometheusRule")
    rules_file = yaml.safe_load((CHART / "rules" / "gqa-serve-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == rules_file["groups"]
    (dashboard,) = by_kind(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["gqa-serve.json"]) == json.loads(
        (CHART / "dashboards" / "gqa-serve.json").read_text())


BAD_VALUES = {
    "unknown-backend": (["--set", "server.backend=tpu"], "/server/backend"),
    "unknown-dtype": (["--set", "server.dtype=float64"], "/server/dtype"),
    "zero-streams": (["--set", "server.maxStreams=0"], "/server/maxStreams"),
    "negative-budget": (["--set", "server.maxCacheBytes=-1"], "/server/maxCacheBytes"),
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
    run = template(helm_env, "--set", "server.gracePeriodSeconds=30", "--set", "terminationGracePeriodSeconds=20",
                   check=False)
    assert run.returncode != 0
    assert "terminationGracePeriodSeconds" in run.stderr


TLS_SET = ["--set", "tls.enabled=true", "--set", "tls.secretName=gqa-tls", "--set", "tls.clientAuth=true"]


@needs_helm
@needs_validate
def test_tls_variant_mounts_the_secret_and_probes_the_plaintext_health_port(helm_env, tmp_path):
    text = template(helm_env, *TLS_SET).stdout
    path = tmp_path / "tls.yaml"
    path.write_text(text)
    run = subprocess.run([KUBE_VALIDATE, "--strict", "-k", KUBE_VERSION, str(path)],
                         capture_output=True, text=True, timeout=120)
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
def test_tls_without_a_secret_fails_at_install(helm_env):
    run = template(helm_env, "--set", "tls.enabled=true", check=False)
    assert run.returncode != 0 and "tls.secretName" in run.stderr
