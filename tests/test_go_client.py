"""The Go client (clients/go): its committed stubs match the proto, it builds offline from
Debian's packages (tests/tools/install_go_tools.sh, run by `make tools`) and its Decode example
runs against a real server: outputs against a float64 reference, an in-band refusal, rollback,
snapshot and a bit-identical restore."""

from __future__ import annotations

import filecmp
import pathlib
import shutil
import subprocess

import pytest

from service.config import ServerConfig
from service.server import ServerThread

GO_DIR = pathlib.Path(__file__).resolve().parent.parent / "clients" / "go"
pytestmark = pytest.mark.skipif(
    shutil.which("go") is None, reason="go not installed (bash tests/tools/install_go_tools.sh, or make tools)"
)


@pytest.fixture(scope="module")
def decode_binary(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("go")
    done = subprocess.run(["bash", str(GO_DIR / "build.sh"), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "decode"


def test_committed_stubs_match_the_proto(tmp_path):
    if not all(shutil.which(t) for t in ("protoc", "protoc-gen-go", "protoc-gen-go-grpc")):
        pytest.skip("protoc, protoc-gen-go or protoc-gen-go-grpc not installed (tests/tools/install_go_tools.sh)")
    done = subprocess.run(
        ["bash", str(GO_DIR / "generate.sh"), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for name in ("gqa.pb.go", "gqa_grpc.pb.go"):
        assert filecmp.cmp(tmp_path / "gqa" / "v1" / name, GO_DIR / "gqa" / "v1" / name, shallow=False), (
            f"clients/go/gqa/v1/{name} drifted from the proto: run clients/go/generate.sh"
        )


def test_decode_example_against_a_real_server(decode_binary):
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as server:
        done = subprocess.run(
            [str(decode_binary), "-address", server.address, "-steps", "12"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "ok"
    assert any(line.startswith("refused in-band (code 3)") for line in lines)
    assert any("bit-identical" in line for line in lines)
    assert any("at most 1 can be rolled back exactly" in line for line in lines)


def test_a_refused_open_is_an_error(decode_binary):
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, max_layers=1)  # the example asks for 2
    with ServerThread(config) as server:
        done = subprocess.run(
            [str(decode_binary), "-address", server.address], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1
    assert "open refused" in done.stderr and "InvalidArgument" in done.stderr
