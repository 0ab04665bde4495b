"""The ``gqa-serve`` command from the shell: ``step`` on the seed examples, bad input, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from tests.client import Session, open_message

ENTRY = [sys.executable, "-m", "service.cli"]


def gqa(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY, *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_step_seed_examples_from_stdin(seed_examples):
    for ex in seed_examples:
        done = gqa("step", stdin=json.dumps(ex["input"]))
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert set(result) == {"output", "new_key_cache", "new_value_cache"}
        for key, expected in ex["output"].items():
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(expected, dtype=torch.float32),
                                       atol=1e-6, rtol=1e-6)


def test_step_json_flag_prints_short_floats(seed_examples):
    done = gqa("step", "--json", json.dumps(seed_examples[0]["input"]))
    assert done.returncode == 0
    assert json.loads(done.stdout)["output"] == [[[0.2, 0.4]]]


@pytest.mark.parametrize("payload,word", [
    ("{not json", "JSON"),
    ("[1, 2]", "object"),
    ('{"query": [[[1]]]}', "missing"),
    (json.dumps({"query": [[[1.0]]], "new_key": [[[1.0]]], "new_value": [[[1.0]]], "key_cache": [[[[1.0]]]],
                 "value_cache": [[[[1.0]]]], "num_query_heads": 3, "num_kv_heads": 2}), "multiple"),
    (json.dumps({"query": [[[1.0]]], "new_key": [[[1.0, 2.0]]], "new_value": [[[1.0]]], "key_cache": [[[[1.0]]]],
                 "value_cache": [[[[1.0]]]], "num_query_heads": 1, "num_kv_heads": 1}), "new_key"),
    (json.dumps({"query": [[[1.0]]], "new_key": [[[1.0]]], "new_value": [[[1.0]]], "key_cache": [[[[1.0]]]],
                 "value_cache": [[[[1.0]]]], "num_query_heads": 1, "num_kv_heads": 1, "extra": 1}), "unknown"),
])
def test_step_bad_input_exits_2_with_one_line(payload, word):
    done = gqa("step", stdin=payload)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], done.stderr


def test_serve_bad_flag_exits_2():
    done = gqa("serve", "--address", "nonsense", "--metrics-port", "0")
    assert done.returncode == 2 and "--address" in done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains(tmp_path):
    port = free_port()
    env = dict(os.environ, GQA_ADDRESS=f"127.0.0.1:{port}", GQA_METRICS_PORT="0", GQA_GRACE_PERIOD_S="1.5")
    proc = subprocess.Popen([*ENTRY, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=max(1, deadline - time.monotonic()))
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel)
        session = Session(channel, open_message())
        assert session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        proc.send_signal(signal.SIGTERM)
        # Health turns NOT_SERVING and new streams are refused, while the open one still steps.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(service="")).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            Session(channel, open_message())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        # After the grace period the open stream ends with UNAVAILABLE and the process exits 0.
        with pytest.raises(grpc.RpcError) as info:
            session.recv()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
        assert proc.wait(timeout=15) == 0
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
