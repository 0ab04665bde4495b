"""The Node.js client (clients/node) against an in-process server, checked against the oracle.

pytest drives ``node clients/node/run.js``, which prints one JSON object per line: every tensor
it sends and receives, flat and row-major, so the outputs can be recomputed here from the
inputs alone. Skipped with a reason where node or the client's node_modules are missing
(``bash tests/tools/install_client_tools.sh`` installs them; ``make test`` runs it).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from service.config import ServerConfig
from service.server import ServerThread
from service.vocab import TORCH_DTYPES
from tests.conftest import TOLERANCES
from tests.node_support import CLIENT, NEEDS_NODE, NODE, ROOT, array, run_client
from tests.oracle import attended_positions, attention_ref, decode_step_ref, resident_length

EXAMPLES = ROOT / "tests" / "data" / "examples.json"

# float32 outputs against the float64 oracle on the same inputs; half types are bounded by
# rounding the output to 11 / 8 significant bits.

pytestmark = NEEDS_NODE


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as thread:
        yield thread


def test_seed_examples_through_decode_step(server):
    examples = json.loads(EXAMPLES.read_text())
    lines = run_client("--address", server.address, "--mode", "examples", "--examples", str(EXAMPLES))
    results = [line for line in lines if line["kind"] == "example"]
    assert [r["index"] for r in results] == list(range(len(examples)))
    for example, result in zip(examples, results):
        inp, expected = example["input"], example["output"]
        oracle = decode_step_ref(
            inp["query"],
            inp["new_key"],
            inp["new_value"],
            inp["key_cache"],
            inp["value_cache"],
            inp["num_query_heads"],
            inp["num_kv_heads"],
        )
        for name in ("output", "new_key_cache", "new_value_cache"):
            got = array(result[name])
            assert result[name]["dtype"] == "DTYPE_FLOAT32"
            assert got.shape == np.asarray(expected[name]).shape, name
            np.testing.assert_allclose(got, expected[name], atol=1e-5, rtol=1e-5, err_msg=name)
            np.testing.assert_allclose(got, oracle[name], atol=2e-6, rtol=1e-5, err_msg=name)
        assert result["latency_us"] > 0
    # The malformed request the client sends last ends the call with INVALID_ARGUMENT.
    status = lines[-1]
    assert status["kind"] == "status" and status["call"] == "DecodeStep"
    assert (status["code"], status["code_name"]) == (3, "INVALID_ARGUMENT")
    assert "query.data" in status["details"]


def check_stream(lines: list[dict], *, steps: int, window: int, capacity: int, layers: int, dtype: str):
    opened = lines[0]
    assert opened["kind"] == "opened"
    assert opened["opened"]["policy"] == "EVICTION_POLICY_GREEDY"
    assert (opened["opened"]["window"], opened["opened"]["capacity"]) == (window, capacity)
    history: list[list[np.ndarray]] = [[] for _ in range(layers)]  # (B, Hkv, D) per position
    values: list[list[np.ndarray]] = [[] for _ in range(layers)]
    for entry in opened["prefill"]:
        k, v = array(entry["key"]), array(entry["value"])
        history[entry["layer"]] += [k[:, :, i] for i in range(k.shape[2])]
        values[entry["layer"]] += [v[:, :, i] for i in range(v.shape[2])]
    assert opened["opened"]["tokens_seen"] == [len(h) for h in history]

    atol, rtol = TOLERANCES[TORCH_DTYPES[dtype]]
    step_lines = [line for line in lines if line["kind"] == "step"]
    assert [s["step"] for s in step_lines] == list(range(steps))
    evictions = 0
    for s in step_lines:
        layer = s["layer"]
        query = array(s["query"])
        history[layer].append(array(s["new_key"]))
        values[layer].append(array(s["new_value"]))
        t = len(history[layer])
        resident = resident_length("greedy", t, window, capacity)
        assert (s["tokens_seen"], s["resident"]) == (t, resident), s["step"]
        assert (s["first_position"], s["last_position"]) == (t - resident, t - 1), s["step"]
        evictions += s["evicted_tokens"] > 0
        positions = attended_positions("greedy", t, window)
        keys = np.stack([history[layer][p] for p in positions], axis=2)
        vals = np.stack([values[layer][p] for p in positions], axis=2)
        hq, hkv = query.shape[1], keys.shape[1]
        expected = attention_ref(query, keys, vals, hq, hkv)
        assert s["output"]["dtype"] == s["query"]["dtype"]
        np.testing.assert_allclose(
            array(s["output"]), expected, atol=atol, rtol=rtol, err_msg=f"step {s['step']} (layer {layer}, T={t})"
        )
        if "restored_output" in s:  # the same step sent to a stream restored from a snapshot
            assert s["restored_output"] == s["output"], f"step {s['step']}: the restored stream differs"
        else:
            assert s["latency_us"] > 0
    return evictions


def test_stream_of_100_greedy_steps_matches_the_oracle(server):
    """Prefill, 100 steps over two layers, a snapshot restored as a second stream, an in-band
    refusal, and a protocol error that ends the RPC."""
    window, capacity, layers = 8, 12, 2
    lines = run_client(
        "--address",
        server.address,
        "--mode",
        "stream",
        "--steps",
        "100",
        "--policy",
        "greedy",
        "--window",
        str(window),
        "--capacity",
        str(capacity),
        "--layers",
        str(layers),
        "--prefill",
        "5",
        "--batch",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--seed",
        "7",
        "--restore-check",
        "--probe-errors",
    )
    # 100 timed steps, then 4 more sent both to the stream and to a copy restored from its snapshot.
    evictions = check_stream(lines, steps=104, window=window, capacity=capacity, layers=layers, dtype="float32")
    assert evictions > 5  # the window filled and greedy evicted in blocks, on both layers
    (restored,) = [line for line in lines if line["kind"] == "restored"]
    assert restored["opened"]["tokens_seen"] == [5 + 50, 50]
    assert sum("restored_output" in line for line in lines) == 4

    # In-band: a step to a missing layer is refused and the stream stays open ...
    refused = [line for line in lines if line["kind"] == "refused"]
    assert len(refused) == 1
    assert (refused[0]["code"], refused[0]["code_name"]) == (3, "INVALID_ARGUMENT")
    assert "layer" in refused[0]["details"]
    # ... while a broken protocol (a second `open`) ends the RPC with INVALID_ARGUMENT.
    ended = [line for line in lines if line["kind"] == "status"]
    assert len(ended) == 1 and ended[0]["call"] == "Decode"
    assert (ended[0]["code"], ended[0]["code_name"]) == (3, "INVALID_ARGUMENT")

    summary = lines[-1]
    assert summary["kind"] == "summary" and summary["steps"] == 100
    assert 0 < summary["p50_us"] <= summary["p90_us"] <= summary["p99_us"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_stream_encodes_raw_16_bit_words(server, dtype):
    # The client rounds its inputs to the half type itself; the printed inputs are what it sent.
    window, capacity = 4, 6
    lines = run_client(
        "--address",
        server.address,
        "--mode",
        "stream",
        "--dtype",
        dtype,
        "--steps",
        "12",
        "--window",
        str(window),
        "--capacity",
        str(capacity),
        "--layers",
        "1",
        "--prefill",
        "3",
        "--seed",
        "3",
    )
    check_stream(lines, steps=12, window=window, capacity=capacity, layers=1, dtype=dtype)
    assert lines[0]["opened"]["dtype"] == f"DTYPE_{dtype.upper()}"


def test_open_refusal_ends_the_rpc_with_its_status(server):
    # Hq not a multiple of Hkv: the open is refused and the RPC ends with INVALID_ARGUMENT.
    lines = run_client(
        "--address", server.address, "--mode", "stream", "--heads", "3", "--kv-heads", "2", "--steps", "1"
    )
    assert lines[0]["kind"] == "status" and lines[0]["call"] == "Decode/open"
    assert (lines[0]["code"], lines[0]["code_name"]) == (3, "INVALID_ARGUMENT")


def test_half_codecs_round_to_nearest_even_like_numpy_and_torch():
    torch = pytest.importorskip("torch")
    specials = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        65504.0,
        65520.0,
        1e6,
        -1e6,
        6.1e-5,
        5.96e-8,
        2.98e-8,
        1e-9,
        1.00048828125,
        1.00146484375,
        3.14159265,
        float("inf"),
        -float("inf"),
    ]
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            np.asarray(specials, np.float32),
            rng.standard_normal(500).astype(np.float32) * np.float32(100),
            rng.standard_normal(200).astype(np.float32) * np.float32(1e-5),
        ]
    )
    # Sent as float32 bit patterns, so infinities and exact values survive JSON.
    script = (
        "const c = require(process.argv[1]);"
        "const bits = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "const f = new Float32Array(Uint32Array.from(bits).buffer);"
        "process.stdout.write(JSON.stringify({f16: Array.from(f, c.toFloat16Bits), bf16: Array.from(f, c.toBFloat16Bits),"
        " back16: Array.from(new Uint32Array(f.map((x) => c.fromFloat16Bits(c.toFloat16Bits(x))).buffer))}));"
    )
    payload = json.dumps(values.view(np.uint32).tolist())
    proc = subprocess.run(
        [NODE, "-e", script, str(CLIENT / "client.js")], input=payload, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    with np.errstate(over="ignore"):  # values past 65504 are meant to become infinities
        half = values.astype(np.float16)
    np.testing.assert_array_equal(np.asarray(got["f16"], np.uint16), half.view(np.uint16))
    bf16 = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(np.asarray(got["bf16"], np.uint16), bf16)
    np.testing.assert_array_equal(np.asarray(got["back16"], np.uint32), half.astype(np.float32).view(np.uint32))


def test_server_info(server):
    (line,) = run_client("--address", server.address, "--mode", "info")
    info = line["info"]
    assert info["default_backend"] == "cpu" and info["default_dtype"] == "DTYPE_FLOAT32"
    assert any(b["name"] == "cpu" and b["available"] for b in info["backends"])
    assert info["limits"]["max_message_bytes"] > 0


def test_the_documented_node_snippet_runs(server, tmp_path):
    """docs/clients.md's Node example, run as written against the test server."""
    text = (ROOT / "docs" / "clients.md").read_text()
    snippet = text.split("```js\n", 1)[1].split("```", 1)[0]
    snippet = snippet.replace("'127.0.0.1:50051'", repr(server.address)).replace(
        "require('./clients/node/client')", f"require({json.dumps(str(CLIENT / 'client.js'))})"
    )
    script = tmp_path / "snippet.js"
    script.write_text(snippet)
    proc = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Float32Array(32)" in proc.stdout and "refused" not in proc.stdout
