"""Generic gRPC tools reach the service through server reflection alone (no local .proto).

grpcurl and ``buf curl`` list the services, describe them, call ``DecodeStep`` with base64
tensors and ``GetServerInfo``. Skipped with a reason where a binary is missing
(``bash tests/tools/install_client_tools.sh`` puts both in .tools/bin; ``make test`` runs it
and puts .tools/bin on PATH).
"""

from __future__ import annotations

import base64
import json
import pathlib
import shutil
import struct
import subprocess

import numpy as np
import pytest

from service.config import ServerConfig
from service.server import ServerThread

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tests" / "data" / "examples.json"
TOOLS_BIN = ROOT / ".tools" / "bin"
SERVICE = "gqa.v1.AttentionService"


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(TOOLS_BIN))


GRPCURL = _which("grpcurl")
BUF = _which("buf")
needs_grpcurl = pytest.mark.skipif(
    GRPCURL is None, reason="grpcurl not found: run `bash tests/tools/install_client_tools.sh` (linux x86-64)"
)
needs_buf = pytest.mark.skipif(
    BUF is None, reason="buf not found: run `bash tests/tools/install_client_tools.sh` (needs npm)"
)


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as thread:
        yield thread


@pytest.fixture(scope="module")
def example() -> dict:
    return json.loads(EXAMPLES.read_text())[2]  # Hq=2, Hkv=1: exercises the grouping


def f32_tensor(nested) -> dict:
    """A Tensor in proto3 JSON: little-endian float32 bytes, base64-encoded."""
    values = np.asarray(nested, dtype=np.float32)
    data = struct.pack(f"<{values.size}f", *values.ravel().tolist())
    return {"dtype": "DTYPE_FLOAT32", "shape": list(values.shape), "data": base64.b64encode(data).decode()}


def decode_f32(tensor: dict) -> np.ndarray:
    assert tensor["dtype"] == "DTYPE_FLOAT32"
    data = base64.b64decode(tensor.get("data", ""))
    shape = [int(d) for d in tensor["shape"]]  # int64 travels as a JSON string
    return np.asarray(struct.unpack(f"<{len(data) // 4}f", data), dtype=np.float64).reshape(shape)


def request_json(example: dict) -> str:
    inp = example["input"]
    return json.dumps(
        {
            "query": f32_tensor(inp["query"]),
            "new_key": f32_tensor(inp["new_key"]),
            "new_value": f32_tensor(inp["new_value"]),
            "key_cache": f32_tensor(inp["key_cache"]),
            "value_cache": f32_tensor(inp["value_cache"]),
            "num_query_heads": inp["num_query_heads"],
            "num_kv_heads": inp["num_kv_heads"],
        }
    )


def bad_request_json(example: dict) -> str:
    request = json.loads(request_json(example))
    request["query"]["shape"] = [1, 2, 2]  # 2 values of bytes for 4 values of shape
    return json.dumps(request)


def assert_reproduces(example: dict, response: dict) -> None:
    for name in ("output", "new_key_cache", "new_value_cache"):
        key = name if name in response else "".join(w.capitalize() if i else w for i, w in enumerate(name.split("_")))
        np.testing.assert_allclose(
            decode_f32(response[key]), example["output"][name], atol=1e-5, rtol=1e-5, err_msg=name
        )


# Generous: the server's first GetServerInfo loads every backend's libraries (seconds).
TIMEOUT_S = 60


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S + 5)


# -- grpcurl ----------------------------------------------------------------------------------


def grpcurl(server, *words: str, flags: tuple[str, ...] = (), stdin: str | None = None) -> subprocess.CompletedProcess:
    """grpcurl [flags] ADDRESS words...: `list`, `describe SYMBOL` or a method name."""
    return run(GRPCURL, "-plaintext", "-max-time", str(TIMEOUT_S), *flags, server.address, *words, stdin=stdin)


@needs_grpcurl
def test_grpcurl_lists_services_and_methods(server):
    listed = grpcurl(server, "list")
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    methods = grpcurl(server, "list", SERVICE)
    assert methods.returncode == 0, methods.stderr
    assert set(methods.stdout.split()) == {f"{SERVICE}.{m}" for m in ("Batch", "Decode", "DecodeStep", "GetServerInfo")}


@needs_grpcurl
def test_grpcurl_describes_the_service_and_tensor(server):
    service = grpcurl(server, "describe", SERVICE)
    assert service.returncode == 0, service.stderr
    assert "rpc DecodeStep ( .gqa.v1.DecodeStepRequest ) returns ( .gqa.v1.DecodeStepResponse )" in service.stdout
    assert "rpc Decode ( stream .gqa.v1.DecodeRequest ) returns ( stream .gqa.v1.DecodeResponse )" in service.stdout
    tensor = grpcurl(server, "describe", "gqa.v1.Tensor")
    assert tensor.returncode == 0, tensor.stderr
    for field in (".gqa.v1.DType dtype = 1;", "repeated int64 shape = 2;", "bytes data = 3;"):
        assert field in tensor.stdout


@needs_grpcurl
def test_grpcurl_decode_step_reproduces_a_seed_example(server, example):
    done = grpcurl(server, f"{SERVICE}/DecodeStep", flags=("-d", "@"), stdin=request_json(example))
    assert done.returncode == 0, done.stderr
    assert_reproduces(example, json.loads(done.stdout))


@needs_grpcurl
def test_grpcurl_bad_request_gets_invalid_argument(server, example):
    done = grpcurl(server, f"{SERVICE}/DecodeStep", flags=("-format-error", "-d", "@"), stdin=bad_request_json(example))
    assert done.returncode == 64 + 3, (done.returncode, done.stdout, done.stderr)  # grpcurl exits 64 + code
    error = json.loads(done.stderr)
    assert error["code"] == 3
    assert "query.data" in error["message"]


@needs_grpcurl
def test_grpcurl_get_server_info(server):
    done = grpcurl(server, f"{SERVICE}/GetServerInfo")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["default_backend"] == "cpu"
    assert any(b["name"] == "cpu" and b.get("available") for b in info["backends"])
    assert int(info["limits"]["max_message_bytes"]) > 0


# -- buf curl ---------------------------------------------------------------------------------
# buf curl speaks Connect by default; a plaintext gRPC server needs `--protocol grpc` and HTTP/2
# without TLS negotiation (`--http2-prior-knowledge`, implied by --protocol grpc but explicit).


def buf_curl(server, *args: str, path: str = "", stdin: str | None = None) -> subprocess.CompletedProcess:
    return run(
        BUF,
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "--connect-timeout",
        "10",
        "--timeout",
        f"{TIMEOUT_S}s",
        *args,
        f"http://{server.address}{path}",
        stdin=stdin,
    )


@needs_buf
def test_buf_curl_lists_services_and_methods(server):
    services = buf_curl(server, "--list-services")
    assert services.returncode == 0, services.stderr
    assert SERVICE in services.stdout.split()
    methods = buf_curl(server, "--list-methods")
    assert methods.returncode == 0, methods.stderr
    assert {f"{SERVICE}/{m}" for m in ("Decode", "DecodeStep", "GetServerInfo")} <= set(methods.stdout.split())


@needs_buf
def test_buf_curl_decode_step_reproduces_a_seed_example(server, example):
    done = buf_curl(server, "-d", "@-", path=f"/{SERVICE}/DecodeStep", stdin=request_json(example))
    assert done.returncode == 0, done.stderr
    assert_reproduces(example, json.loads(done.stdout))


@needs_buf
def test_buf_curl_bad_request_gets_invalid_argument(server, example):
    done = buf_curl(server, "-d", "@-", path=f"/{SERVICE}/DecodeStep", stdin=bad_request_json(example))
    assert done.returncode != 0
    error = json.loads(done.stderr)
    assert error["code"] == "invalid_argument"
    assert "query.data" in error["message"]


@needs_buf
def test_buf_curl_get_server_info(server):
    done = buf_curl(server, path=f"/{SERVICE}/GetServerInfo")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)  # protojson: lowerCamelCase names
    assert info["defaultBackend"] == "cpu"
    assert info["defaultDtype"] == "DTYPE_FLOAT32"
