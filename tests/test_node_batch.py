"""The Node client's Batch API (clients/node, ``run.js --mode batch``) against an in-process server.

Every step of every sequence is recomputed here with the float64 oracle from the inputs the
client printed; the restored copy, the in-band refusals and the removal are checked as well.
Skipped with a reason where node or the client's node_modules are missing (``bash
tests/tools/install_client_tools.sh``).
"""

from __future__ import annotations

import numpy as np
import pytest

from service.api import gqa_pb2
from service.config import ServerConfig
from service.server import ServerThread
from service.vocab import POLICY_NAMES, TORCH_DTYPES
from tests.conftest import TOLERANCES
from tests.node_support import NEEDS_NODE, array, run_client
from tests.oracle import attended_positions, attention_ref, resident_length

# the proto enum's JSON names (EVICTION_POLICY_GREEDY) -> the policy names (greedy)
POLICY = {gqa_pb2.EvictionPolicy.Name(wire): name for wire, name in POLICY_NAMES.items()}

pytestmark = NEEDS_NODE


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as thread:
        yield thread


def resident_rows(policy: dict, t: int) -> int:
    """L(T) of a sequence the client printed (``capacity`` absent: the window)."""
    return resident_length(
        POLICY[policy["policy"]], t, policy.get("window", 0), policy.get("capacity", 0), policy.get("sink_tokens", 0)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_session_of_mixed_sequences_matches_the_oracle(server, dtype):
    layers = 2
    lines = run_client(
        "--address",
        server.address,
        "--mode",
        "batch",
        "--sequences",
        "6",
        "--steps",
        "30",
        "--layers",
        str(layers),
        "--window",
        "5",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--dtype",
        dtype,
        "--seed",
        "5",
    )
    assert lines[0]["kind"] == "batch_opened" and lines[0]["opened"]["dtype"] == f"DTYPE_{dtype.upper()}"
    policies, keys, values = {}, {}, {}
    for added in (line for line in lines if line["kind"] == "added"):
        sid = added["id"]
        policies[sid] = added["fields"]
        for layer in range(layers):
            keys[sid, layer], values[sid, layer] = [], []
        for p in added["prefill"]:
            k, v = array(p["key"]), array(p["value"])
            keys[sid, p["layer"]] += [k[:, :, i] for i in range(k.shape[2])]
            values[sid, p["layer"]] += [v[:, :, i] for i in range(v.shape[2])]
        assert added["tokens_seen"] == [len(keys[sid, layer]) for layer in range(layers)]
    assert len(policies) == 6 and {POLICY[p["policy"]] for p in policies.values()} == set(POLICY.values())

    atol, rtol = TOLERANCES[TORCH_DTYPES[dtype]]
    steps = [line for line in lines if line["kind"] == "batch_step"]
    assert len(steps) == 30
    for s in steps:
        assert not s["refusals"]
        layer = s["layer"]
        query, new_key, new_value, output = (array(s[name]) for name in ("query", "new_key", "new_value", "output"))
        assert output.shape == query.shape == (len(s["ids"]), 4, 8)
        for i, sid in enumerate(s["ids"]):
            keys[sid, layer].append(new_key[i : i + 1])
            values[sid, layer].append(new_value[i : i + 1])
            t = len(keys[sid, layer])
            policy = policies[sid]
            resident = resident_rows(policy, t)
            assert (s["tokens_seen"][i], s["resident"][i], s["last_position"][i]) == (t, resident, t - 1)
            positions = attended_positions(
                POLICY[policy["policy"]], t, policy.get("window", 0), policy.get("sink_tokens", 0)
            )
            kk = np.stack([keys[sid, layer][p] for p in positions], axis=2)
            vv = np.stack([values[sid, layer][p] for p in positions], axis=2)
            np.testing.assert_allclose(
                output[i : i + 1],
                attention_ref(query[i : i + 1], kk, vv, 4, 2),
                atol=atol,
                rtol=rtol,
                err_msg=f"step {s['step']} sequence {sid}",
            )

    (restored,) = [line for line in lines if line["kind"] == "batch_restored"]
    assert restored["tokens_seen"] == [len(keys[100, layer]) for layer in range(layers)]
    assert [line["same"] for line in lines if line["kind"] == "batch_restore_check"] == [True]
    (probe,) = [line for line in lines if line["kind"] == "batch_probe"]
    assert [(r["index"], r["code_name"]) for r in probe["refusals"]] == [
        (1, "NOT_FOUND"),
        (2, "INVALID_ARGUMENT"),
        (3, "INVALID_ARGUMENT"),
    ]
    assert probe["tokens_seen"][0] == len(keys[101, 1]) + 1 and probe["tokens_seen"][1:] == [0, 0, 0]
    (removed,) = [line for line in lines if line["kind"] == "batch_removed"]
    assert removed["ids"] == [999] and removed["refusals"] == [{"id": 4242, "code": 5}]
    (refused,) = [line for line in lines if line["kind"] == "refused"]
    assert refused["code_name"] == "INVALID_ARGUMENT" and "already" in refused["details"]
    assert lines[-1]["kind"] == "summary" and lines[-1]["steps"] == 30
    assert server.engine.batch_sequences_open == 0


def test_batch_open_refusal_ends_the_rpc(server):
    lines = run_client("--address", server.address, "--mode", "batch", "--heads", "3", "--kv-heads", "2")
    assert lines[0]["kind"] == "status" and lines[0]["call"] == "Batch/open"
    assert lines[0]["code_name"] == "INVALID_ARGUMENT"
