"""The Python client as a distribution of its own: a fresh virtual environment with only
``clients/python`` installed (from the configured index, no torch) imports ``gqa_client``
without torch or any server package, and runs the README's quick start against a real
``gqa-serve serve``.

The environment is built once per test session; pip's cache makes the install quick after the
first run. Skipped (with the reason) only where this Python cannot make a venv with pip.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from tests.metrics_load import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clients" / "python"
SERVER_PACKAGES = ("torch", "service", "backends", "quant")

pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    """This process's environment without anything that would put the repository (or the
    server's venv) on the client venv's import path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="session")
def client_python(tmp_path_factory) -> pathlib.Path:
    if importlib.util.find_spec("venv") is None:
        pytest.skip("this Python has no venv module (Debian: apt-get install python3-venv)")
    # This process's pip installs into the new venv (pip >= 22.3's --python): no ensurepip run,
    # which costs more than the install itself. Without pip here, the venv brings its own.
    host_pip = importlib.util.find_spec("pip") is not None
    if not host_pip and importlib.util.find_spec("ensurepip") is None:
        pytest.skip("neither pip nor ensurepip is available to this Python (Debian: apt-get install python3-venv)")
    base = tmp_path_factory.mktemp("client-venv")
    venv = base / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", *(["--without-pip"] if host_pip else []), str(venv)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if made.returncode:
        pytest.skip(f"python -m venv failed, so no client-only environment can be made: {made.stderr.strip()}")
    python = venv / "bin" / "python"
    # A copy, so the build's own files (build/, *.egg-info) never land in the checkout.
    source = shutil.copytree(PACKAGE, base / "src", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--python", str(python)] if host_pip else [str(python), "-m", "pip"]
    installed = subprocess.run(
        [*pip, "install", "--quiet", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_clean_env(),
        cwd=base,
    )
    assert installed.returncode == 0, f"pip install clients/python failed:\n{installed.stdout}\n{installed.stderr}"
    return python


def run_in(python: pathlib.Path, code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=cwd
    )


def test_the_client_installs_alone_and_imports_no_torch(client_python, tmp_path):
    code = (
        "import importlib.metadata, importlib.util, json, sys\n"
        "import gqa_client\n"
        "print(json.dumps({'file': gqa_client.__file__, 'version': gqa_client.__version__,\n"
        f"    'loaded': sorted(m for m in {SERVER_PACKAGES!r} if m in sys.modules),\n"
        f"    'installed': sorted(m for m in {SERVER_PACKAGES!r} if importlib.util.find_spec(m)),\n"
        "    'requires': sorted(importlib.metadata.requires('gqa-serve-client'))}))\n"
    )
    done = run_in(client_python, code, tmp_path)
    assert done.returncode == 0, done.stderr
    import json

    facts = json.loads(done.stdout)
    assert pathlib.Path(facts["file"]).is_relative_to(client_python.parents[1])  # the venv's copy, not the checkout's
    assert facts["loaded"] == [] and facts["installed"] == []  # not even available to import
    plain = [r for r in facts["requires"] if "extra ==" not in r]
    assert sorted(re.match(r"[a-z]+", r).group(0) for r in plain) == ["grpcio", "numpy", "protobuf"]


def quick_start() -> str:
    """The README's quick start: its Python blocks, in order, as one program."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") : text.index("## The command line")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the quick start has a stream block and a Batch block"
    return "\n".join(blocks)


@pytest.fixture
def serve(tmp_path):
    """A real ``gqa-serve serve`` on a free loopback port; its address."""
    port = free_port()
    env = dict(os.environ, GQA_METRICS_PORT="0", GQA_GRACE_PERIOD_S="1")
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--backend", "cpu", "--address", f"127.0.0.1:{port}"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=60)
            except grpc.FutureTimeoutError:
                pytest.fail(f"gqa-serve serve did not start: {(tmp_path / 'serve.log').read_text()}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_the_readme_quick_start_runs_with_only_the_client(client_python, serve, tmp_path):
    program = quick_start().replace("127.0.0.1:50051", serve)
    assert serve in program
    check = f"\nimport sys\nassert not [m for m in {SERVER_PACKAGES!r} if m in sys.modules], sys.modules.keys()\n"
    t0 = time.monotonic()
    done = run_in(client_python, program + check, tmp_path)
    assert done.returncode == 0, f"the quick start failed:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    tokens_seen, resident, compute_ns = (int(x) for x in lines[0].split())
    assert tokens_seen == 150 and resident <= 384 and compute_ns > 0  # greedy W=256, C=384: nothing evicted yet
    assert lines[1] == "[150, 150]"  # the restored stream's layers
    assert lines[2] == "(2, 32, 128) [1, 1] {}", f"the Batch block printed {lines[2]!r} ({time.monotonic() - t0:.1f} s)"
