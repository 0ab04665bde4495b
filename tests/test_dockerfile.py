"""The container image definition: hadolint clean, and the shape the deployment relies on.

The image is not built here (no Docker engine); hadolint is the real check, the assertions below
pin what the Helm chart assumes of the image (numeric non-root user, exec-form entrypoint, the
CPU torch wheel by default, a cuda target).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str | None:
    venv_bin = pathlib.Path(sys.executable).parent
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(venv_bin))


HADOLINT = _hadolint()
needs_hadolint = pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (run `make tools`)")


def _stages(text: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", text)
    stages: dict[str, list[str]] = {}
    current = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


@needs_hadolint
def test_hadolint_passes():
    run = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


@needs_hadolint
def test_hadolint_is_not_blind(tmp_path):
    # A pass above means something only if the same binary fails an obviously bad file.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nENTRYPOINT gqa-serve serve\n")
    run = subprocess.run([HADOLINT, str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3025"):
        assert rule in run.stdout


def test_runtime_targets_run_as_numeric_non_root_with_exec_entrypoint():
    stages = _stages(DOCKERFILE.read_text())
    last = list(stages)[-1]
    assert last == "cpu", "the default target (last stage) must be the CPU image"
    for target in ("cpu", "cuda"):
        body = stages[target]
        users = [line.split(None, 1)[1] for line in body if line.upper().startswith("USER ")]
        assert users, f"{target}: no USER"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{target}: USER {users[-1]} is not a numeric non-root id"
        entry = [line for line in body if line.upper().startswith("ENTRYPOINT")]
        assert entry and entry[-1].split(None, 1)[1].startswith("["), f"{target}: entrypoint not in exec form"


def test_cpu_target_takes_torch_from_the_cpu_index():
    stages = _stages(DOCKERFILE.read_text())
    assert "download.pytorch.org/whl/cpu" in " ".join(stages["build-cpu"])
    assert any("--index-url" in line and "torch==" in line for line in stages["build-cpu"])
    assert "download.pytorch.org/whl/cu" in " ".join(stages["build-cuda"])
    # The chart sets the address too, but `docker run -p` needs a non-loopback bind by default.
    assert "GQA_ADDRESS=0.0.0.0:50051" in " ".join(stages["runtime-base"])


def test_cpu_image_carries_the_prebuilt_int8_kernel():
    """The runtime stage has no compiler: the kernel is built in build-cpu into the directory
    that GQA_KERNEL_CACHE names in the runtime stage (which copies the whole venv)."""
    stages = _stages(DOCKERFILE.read_text())
    built = re.search(r"python -m backends\.native build (\S+)", " ".join(stages["build-cpu"]))
    assert built and built.group(1).startswith("/opt/venv/")
    assert f"GQA_KERNEL_CACHE={built.group(1)}" in " ".join(stages["cpu"])
    assert any("gcc" in line for line in stages["build-cpu"])
    assert not any("gcc" in line for line in stages["cpu"] + stages["runtime-base"])


def test_dockerignore_keeps_the_context_small():
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    copied = set(re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", DOCKERFILE.read_text(), re.MULTILINE))
    for sources in copied:
        for src in sources.split():
            name = src.rstrip("/")
            assert f"!{name}" in lines or f"!{name}/" in lines, f"{src} is copied but excluded by .dockerignore"


def _healthcheck() -> list[str]:
    """The runtime stages' HEALTHCHECK command, in exec form."""
    import json

    lines = [line for line in _stages(DOCKERFILE.read_text())["runtime-base"] if line.startswith("HEALTHCHECK")]
    assert len(lines) == 1, "runtime-base (both targets) needs one HEALTHCHECK"
    command = json.loads(lines[0].split(" CMD ", 1)[1])
    assert command[0] == "python", command
    return command


def test_healthcheck_asks_readyz_and_fails_unless_serving():
    """The image's HEALTHCHECK command, run here as the image runs it (its python, its
    GQA_METRICS_* variables): 0 against a ready listener, non-zero when /readyz says 503 or
    nothing listens."""
    from prometheus_client import CollectorRegistry

    from service.metrics.listener import MetricsHttpServer
    from tests.metrics_load import free_port

    command = [sys.executable, *_healthcheck()[1:]]
    state = {"now": "SERVING"}

    def readyz():
        return (200 if state["now"] == "SERVING" else 503), state["now"].encode(), "text/plain"

    http = MetricsHttpServer(CollectorRegistry(), "127.0.0.1", 0, routes={"/readyz": readyz})
    try:
        for host in ("0.0.0.0", "127.0.0.1", ""):
            env = {"GQA_METRICS_PORT": str(http.port), "GQA_METRICS_HOST": host, "PATH": "/usr/bin:/bin"}
            assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0, host
        state["now"] = "NOT_SERVING (draining)"
        env = {"GQA_METRICS_PORT": str(http.port), "PATH": "/usr/bin:/bin"}
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        assert run.returncode != 0 and "503" in run.stderr
    finally:
        http.close()
    env = {"GQA_METRICS_PORT": str(free_port()), "PATH": "/usr/bin:/bin"}
    assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode != 0
