"""What the Node client's tests share: where node and the client are, the skip marks, and the
runner that parses ``clients/node/run.js``'s JSON lines."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "node"
NODE = shutil.which("node")

# Every test of the Node client needs node and the client's installed packages.
NEEDS_NODE = [
    pytest.mark.skipif(NODE is None, reason="node is not on PATH (Node.js 18+ runs clients/node)"),
    pytest.mark.skipif(
        not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir(),
        reason="clients/node/node_modules is missing: run `bash tests/tools/install_client_tools.sh`",
    ),
]


def run_client(*args: str, timeout: float = 60) -> list[dict]:
    """``node run.js ARGS``: its JSON lines, after checking it exited 0 and printed no line of
    kind ``unexpected``."""
    proc = subprocess.run([NODE, str(CLIENT / "run.js"), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"node exited {proc.returncode}:\n{proc.stderr}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    unexpected = [line for line in lines if line["kind"] == "unexpected"]
    assert not unexpected, unexpected
    return lines


def array(dump: dict) -> np.ndarray:
    """A tensor the client printed as ``{"shape": [...], "data": [...]}``, as float64."""
    return np.asarray(dump["data"], dtype=np.float64).reshape(dump["shape"])
