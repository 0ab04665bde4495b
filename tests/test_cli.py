"""The ``gqa-serve`` command from the shell: ``step`` on the seed examples, bad input, SIGTERM."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import grpc
import pytest
import torch

from tests.client import Session, open_message
from tests.metrics_load import free_port

ENTRY = [sys.executable, "-m", "service.cli"]


def gqa(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY, *args], input=stdin, capture_output=True, text=True, timeout=60)


def gqa_here(*args, stdin: str = "") -> subprocess.CompletedProcess:
    """``gqa`` run by this process's interpreter (``main`` with its standard streams replaced),
    for the commands that compute locally: each subprocess would import torch again (~2.5 s).
    ``test_step_json_flag_prints_short_floats`` runs `step` through the entry point."""
    from service.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch("sys.stdin", io.StringIO(stdin)), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own exits
            code = exc.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_step_seed_examples_from_stdin(seed_examples):
    for ex in seed_examples:
        done = gqa_here("step", stdin=json.dumps(ex["input"]))
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert set(result) == {"output", "new_key_cache", "new_value_cache"}
        for key, expected in ex["output"].items():
            torch.testing.assert_close(
                torch.tensor(result[key]), torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-6
            )


def test_step_json_flag_prints_short_floats(seed_examples):
    done = gqa("step", "--json", json.dumps(seed_examples[0]["input"]))
    assert done.returncode == 0
    assert json.loads(done.stdout)["output"] == [[[0.2, 0.4]]]


@pytest.mark.parametrize(
    "payload,word",
    [
        ("{not json", "JSON"),
        ("[1, 2]", "object"),
        ('{"query": [[[1]]]}', "missing"),
        (
            json.dumps(
                {
                    "query": [[[1.0]]],
                    "new_key": [[[1.0]]],
                    "new_value": [[[1.0]]],
                    "key_cache": [[[[1.0]]]],
                    "value_cache": [[[[1.0]]]],
                    "num_query_heads": 3,
                    "num_kv_heads": 2,
                }
            ),
            "multiple",
        ),
        (
            json.dumps(
                {
                    "query": [[[1.0]]],
                    "new_key": [[[1.0, 2.0]]],
                    "new_value": [[[1.0]]],
                    "key_cache": [[[[1.0]]]],
                    "value_cache": [[[[1.0]]]],
                    "num_query_heads": 1,
                    "num_kv_heads": 1,
                }
            ),
            "new_key",
        ),
        (
            json.dumps(
                {
                    "query": [[[1.0]]],
                    "new_key": [[[1.0]]],
                    "new_value": [[[1.0]]],
                    "key_cache": [[[[1.0]]]],
                    "value_cache": [[[[1.0]]]],
                    "num_query_heads": 1,
                    "num_kv_heads": 1,
                    "extra": 1,
                }
            ),
            "unknown",
        ),
    ],
)
def test_step_bad_input_exits_2_with_one_line(payload, word):
    done = gqa_here("step", stdin=payload)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], done.stderr


def test_serve_bad_flag_exits_2():
    done = gqa("serve", "--address", "nonsense", "--metrics-port", "0")
    assert done.returncode == 2 and "--address" in done.stderr


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
        # The last line says the drain finished and how the open stream ended.
        last = proc.stdout.read().strip().splitlines()[-1]
        assert "gqa-serve stopped: drained in" in last, last
        assert "of 1 streams open at the signal, 0 ended within the grace period and 1 with UNAVAILABLE" in last
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stepping_clients(port: int, streams: int, stop_at: float, answered: list[int]) -> None:
    """``streams`` Decode streams stepping back to back until the server ends them (or
    ``stop_at``), so the compute workers are mid-batch when the signal comes; appends each
    stream's count of answered steps to ``answered``."""
    import asyncio

    from service.api import gqa_pb2, gqa_pb2_grpc
    from tests.client import step_request

    async def one(stub) -> None:
        call = stub.Decode()
        # Built once: the clients' own cost stays small, so steps queue up behind the workers.
        steps = [step_request(0, 0, torch.ones(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8)) for _ in range(2)]
        done = 0
        try:
            await call.write(gqa_pb2.DecodeRequest(request_id=0, open=open_message(capacity=4096, policy="none")))
            for rid in range(1, 4000):
                reply = await call.read()
                if reply is grpc.aio.EOF or time.monotonic() > stop_at:
                    break
                done += reply.HasField("step") and reply.step.status.code == 0
                request = steps[rid % 2]
                request.request_id = rid
                await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the server ended the stream: the drain
        call.cancel()
        answered.append(done)

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            await asyncio.gather(*(one(gqa_pb2_grpc.AttentionServiceStub(channel)) for _ in range(streams)))

    asyncio.run(run())


@pytest.mark.slow
def test_sigterm_while_steps_compute_exits_zero():
    """SIGTERM while twenty streams step back to back: the drain ends the streams, the compute
    workers are joined before the interpreter finalizes, and the process exits 0. (Unjoined, a
    worker freeing a tensor during finalization aborted the process about one time in two.)"""
    import threading

    for attempt in range(3):
        port = free_port()
        env = dict(os.environ, GQA_ADDRESS=f"127.0.0.1:{port}", GQA_METRICS_PORT="0", GQA_GRACE_PERIOD_S="1")
        proc = subprocess.Popen(
            [*ENTRY, "serve", "--workers", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # serving, signal handlers set
                grpc.channel_ready_future(channel).result(timeout=30)
            answered: list[int] = []
            clients = threading.Thread(
                target=_stepping_clients, args=(port, 20, time.monotonic() + 60, answered), daemon=True
            )
            clients.start()
            time.sleep(0.5 + 0.3 * attempt)  # streams open and step meanwhile
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            output = proc.stdout.read()
            assert code == 0, f"attempt {attempt}: exit {code}\n{output[-2000:]}"
            assert "terminate called" not in output
            clients.join(30)
            assert not clients.is_alive()
            assert len(answered) == 20 and sum(answered) >= 20, answered  # the streams did step
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


# -- first contact: one line per expected failure, --version, units, explicit shapes ---------------
def one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_version():
    from service import __version__

    done = gqa("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"gqa-serve {__version__}"


def _fresh_python(code: str) -> str:
    """``code`` run by a fresh interpreter (nothing imported before it); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_flags_help_and_version_answer_without_importing_torch():
    """--version, --help and a flag error import no torch (~3 s of CPU before the first line):
    the vocabularies' names and the registry's backend names need none."""
    code = (
        "import contextlib, io, sys\n"
        "from service.cli.main import build_parser\n"
        "for argv in (['--version'], ['--help'], ['serve', '--help'], ['serve', '--port', 'x']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        build_parser().parse_args(argv)\n"
        "print(sorted(m for m in ('torch', 'bitsandbytes', 'backends.contract') if m in sys.modules))\n"
    )
    imported = _fresh_python(code).strip()
    assert imported == "[]", imported


def test_bad_input_and_no_server_are_answered_without_importing_torch():
    """What can be answered before the tensors are made is (torch: ~2 s of CPU first): `step`
    input that is not a JSON object of its keys, and `bench` with no server at the address
    (it asks the server for its information before it makes the load's inputs)."""
    cases = [
        (["step", "--json", "{not json"], 2, "JSON"),
        (["step", "--json", "[1, 2]"], 2, "object"),
        (["step", "--json", '{"query": 1}'], 2, "missing"),
        (["bench", "--address", f"127.0.0.1:{free_port()}", "--duration", "1", "--quiet"], 1, "UNAVAILABLE"),
    ]
    code = (
        "import contextlib, io, json, sys\n"
        "from service.cli.main import main\n"
        "answers = []\n"
        f"for argv in {[argv for argv, _, _ in cases]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        answers.append([main(argv), err.getvalue()])\n"
        "print(json.dumps([answers, 'torch' in sys.modules]))\n"
    )
    answers, torch_imported = json.loads(_fresh_python(code))
    for (argv, want, word), (got, err) in zip(cases, answers):
        assert got == want and word in err, (argv, got, err)
    assert not torch_imported


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "case",
    [
        "unknown-backend",
        "bad-size",
        "bad-int",
        "bad-choice",
        "no-subcommand",
        "address-in-use",
        "metrics-port-in-use",
        "demo-no-server",
        "bench-no-server",
        "demo-bad-heads",
        "bench-no-token-file",
    ],
)
def test_expected_failures_are_one_line(case, busy_port, tmp_path):
    free = free_port()
    serve = ["serve", "--address", f"127.0.0.1:{free}"]
    args, code, words = {
        "unknown-backend": ([*serve, "--metrics-port", "0", "--backend", "foo"], 2, ["--backend", "foo", "cpu"]),
        "bad-size": ([*serve, "--max-cache-bytes", "4Q"], 2, ["--max-cache-bytes", "4Q"]),
        "bad-int": ([*serve, "--workers", "x"], 2, ["--workers", "--help"]),
        "bad-choice": (["demo", "--policy", "lru"], 2, ["--policy", "lru"]),
        "no-subcommand": ([], 2, ["required"]),
        "address-in-use": (
            ["serve", "--address", f"127.0.0.1:{busy_port}", "--metrics-port", "0"],
            1,
            ["in use", "--address"],
        ),
        "metrics-port-in-use": ([*serve, "--metrics-port", str(busy_port)], 1, ["in use", "--metrics-port"]),
        "demo-no-server": (["demo", "--address", f"127.0.0.1:{free}"], 1, ["UNAVAILABLE", str(free)]),
        "bench-no-server": (["bench", "--address", f"127.0.0.1:{free}", "--duration", "1"], 1, ["UNAVAILABLE"]),
        "demo-bad-heads": (["demo", "--heads", "6", "--kv-heads", "4"], 2, ["--heads"]),
        "bench-no-token-file": (["bench", "--token-file", str(tmp_path / "absent")], 2, ["--token-file"]),
    }[case]
    done = gqa(*args)
    line = one_line(done)
    assert done.returncode == code, done.stderr
    assert line.startswith("gqa-serve"), line
    for word in words:
        assert word in line, line


def test_sizes_take_units():
    from service.cli.main import build_parser
    from service.config import from_args

    args = build_parser().parse_args(
        ["serve", "--max-cache-bytes", "4Gi", "--max-message-bytes", "512Mi", "--inline-step-bytes", "1M"]
    )
    config = from_args(args, env={})
    assert (config.max_cache_bytes, config.max_message_bytes, config.inline_step_bytes) == (4 << 30, 512 << 20, 10**6)
    assert from_args(None, env={"GQA_MAX_CACHE_BYTES": "2Gi"}).max_cache_bytes == 2 << 30
    # The two families are different numbers, and the help says which is which.
    for text, value in (("4GB", 4 * 10**9), ("4G", 4 * 10**9), ("4GiB", 4 << 30), ("4gi", 4 << 30)):
        args = build_parser().parse_args(["serve", "--max-cache-bytes", text])
        assert from_args(args, env={}).max_cache_bytes == value, text
    help_text = " ".join(gqa("serve", "--help").stdout.split())
    assert "default 4Gi" in help_text
    assert "Ki Mi Gi Ti are powers of 1024, K M G T (B optional) powers of 1000" in help_text
    assert "4Gi is 4294967296 bytes, 4GB 4000000000" in help_text


@pytest.mark.parametrize("command", [[], ["step"], ["serve"], ["demo"], ["bench"]], ids=lambda c: c[0] if c else "top")
def test_help_is_plain_text(command):
    """Descriptions drawn from docstrings show no reStructuredText literals (double backticks)."""
    done = gqa(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout, done.stdout


def test_step_with_explicit_shapes_sends_an_empty_cache():
    empty = {"shape": [1, 1, 0, 2], "values": []}
    payload = {
        "query": [[[0, 1]]],
        "new_key": [[[1, 0]]],
        "new_value": [[[6, 0]]],
        "key_cache": empty,
        "value_cache": empty,
        "num_query_heads": 1,
        "num_kv_heads": 1,
    }
    done = gqa_here("step", "--json", json.dumps(payload))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["output"] == [[[6.0, 0.0]]]  # the first token attends to itself alone
    assert result["new_key_cache"] == [[[[1.0, 0.0]]]]
    bad = dict(payload, key_cache={"shape": [1, 1, 1, 2], "values": []})
    done = gqa_here("step", "--json", json.dumps(bad))
    assert done.returncode == 2 and "key_cache.values" in one_line(done)


def test_demo_help_explains_every_flag():
    text = gqa("demo", "--help").stdout
    for flag in (
        "--address",
        "--steps",
        "--layers",
        "--heads",
        "--kv-heads",
        "--head-dim",
        "--policy",
        "--window",
        "--capacity",
        "--sink-tokens",
        "--backend",
        "--dtype",
        "--seed",
        "--tls",
        "--token-file",
    ):
        assert flag in text
    assert "default 500" in text and "default 64" in text and "evict" in text


@pytest.fixture(scope="module")
def server():
    from service.config import ServerConfig
    from service.server import ServerThread

    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)) as srv:
        yield srv


def test_demo_evicts_and_shows_compute_beside_round_trip(server):
    done = gqa(
        "demo",
        "--address",
        server.address,
        "--steps",
        "40",
        "--window",
        "8",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
    )
    assert done.returncode == 0, done.stderr
    assert "round trip per step" in done.stdout and "server compute per step" in done.stdout
    evicted = int(done.stdout.split(" steps evicted ")[1].split()[0])
    assert evicted > 0, done.stdout


def test_bench_writes_json_and_a_png_that_opens(server, tmp_path):
    pytest.importorskip("matplotlib", reason="the loadgen extra (pip install 'gqa-serve[loadgen]')")
    from PIL import Image

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = gqa(
        "bench",
        "--address",
        server.address,
        "--duration",
        "2",
        "--streams",
        "2",
        "--context",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert done.returncode == 0, done.stderr
    assert "steps/s" in done.stdout and "server compute" in done.stdout
    summary = json.loads(out.read_text())
    assert summary["steps_ok"] > 0 and summary["errors"] == {}
    # The values the load ran with, not the flags' 0 for "the default".
    assert summary["config"]["concurrency"] == 2 and summary["config"]["window"] == 65, summary["config"]
    assert "2 streams, 2 in flight" in done.stdout and "strict W=65" in done.stdout
    assert summary["round_trip_p50_ms"] > 0 and summary["compute_p50_ms"] > 0
    with Image.open(png) as image:
        image.load()
        assert image.format == "PNG" and image.size[0] > 100


def test_second_ctrl_c_stops_at_once():
    port = free_port()
    env = dict(os.environ, GQA_ADDRESS=f"127.0.0.1:{port}", GQA_METRICS_PORT="0", GQA_GRACE_PERIOD_S="600")
    proc = subprocess.Popen([*ENTRY, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        session = Session(channel, open_message())  # an open stream would hold the drain for 600 s
        assert session.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)).step.status.code == 0
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while "draining" not in proc.stdout.readline() and time.monotonic() < deadline:
            pass
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0  # far inside the 600 s grace period
        output = proc.stdout.read()
        assert "again: stopping now" in output and "Traceback" not in output
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_and_bench_send_the_token(tmp_path):
    from service.config import ServerConfig
    from service.server import ServerThread

    token = "cli-test-token-0123456789abcdef"
    (tmp_path / "token").write_text(token + "\n")
    config = ServerConfig(address="127.0.0.1:0", metrics_port=0, auth_token=token)
    small = ["--heads", "4", "--kv-heads", "2", "--head-dim", "8"]
    with ServerThread(config) as srv:
        denied = gqa("demo", "--address", srv.address, "--steps", "4", *small)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in one_line(denied)
        done = gqa("demo", "--address", srv.address, "--steps", "4", "--token-file", str(tmp_path / "token"), *small)
        assert done.returncode == 0, done.stderr
        done = gqa(
            "bench",
            "--address",
            srv.address,
            "--steps",
            "20",
            "--streams",
            "2",
            "--context",
            "8",
            "--token-file",
            str(tmp_path / "token"),
            *small,
        )
        assert done.returncode == 0, done.stderr
        assert "20 ok" in done.stdout
