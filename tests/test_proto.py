"""The committed stubs match the proto, and the proto follows the project's conventions."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from service.api import gqa_pb2

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools (dev extra) not installed")
def test_generated_stubs_have_not_drifted(tmp_path):
    """Both committed copies, the server's and the Python client's, equal freshly generated ones."""
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [d.relative_to(ROOT).as_posix() for d in module.OUT_DIRS] == ["service/api", "clients/python/gqa_client/api"]
    fresh = module.generate(tmp_path)
    assert fresh
    for out_dir in module.OUT_DIRS:
        for path in fresh:
            committed = out_dir / path.name
            assert committed.read_text() == path.read_text(), f"{committed} differs from the proto: run `make proto`"
        committed_files = {p.name for p in out_dir.iterdir() if p.is_file()}
        assert committed_files == {p.name for p in fresh} | {"__init__.py"}, f"{out_dir}: files no generator writes"


def test_enums_start_with_unspecified():
    for enum in gqa_pb2.DESCRIPTOR.enum_types_by_name.values():
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), zero


def test_package_and_services():
    assert gqa_pb2.DESCRIPTOR.package == "gqa.v1"
    service = gqa_pb2.DESCRIPTOR.services_by_name["AttentionService"]
    assert set(service.methods_by_name) == {"DecodeStep", "Decode", "Batch", "GetServerInfo"}
    decode = service.methods_by_name["Decode"]
    assert decode.client_streaming and decode.server_streaming
    batch = service.methods_by_name["Batch"]
    assert batch.client_streaming and batch.server_streaming
