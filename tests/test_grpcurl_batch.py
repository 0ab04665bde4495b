"""grpcurl drives the Batch stream through server reflection alone: the JSON request stream of
docs/wire-format.md (open, two adds, a step of both, a refusal, a remove), checked against the
float64 oracle. Skipped with a reason where grpcurl is missing (``bash
tests/tools/install_client_tools.sh``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from service.config import ServerConfig
from service.server import ServerThread
from tests.oracle import attention_ref
from tests.test_grpcurl import SERVICE, decode_f32, f32_tensor, grpcurl, needs_grpcurl


@pytest.fixture(scope="module")
def server():
    with ServerThread(ServerConfig(address="127.0.0.1:0", metrics_port=0)) as thread:
        yield thread


def batch_requests(rng) -> tuple[str, dict]:
    """Sequences 7 (strict, window 4, a 3-token prefill) and 9 (none, empty), Hq=2, Hkv=1, D=2."""
    prefill_k, prefill_v = rng.standard_normal((1, 1, 3, 2)), rng.standard_normal((1, 1, 3, 2))
    query, key, value = rng.standard_normal((2, 2, 2)), rng.standard_normal((2, 1, 2)), rng.standard_normal((2, 1, 2))
    requests = [
        {
            "request_id": 0,
            "open": {"dtype": "DTYPE_FLOAT32", "num_query_heads": 2, "num_kv_heads": 1, "head_dim": 2, "num_layers": 1},
        },
        {
            "request_id": 1,
            "add": {
                "id": 7,
                "policy": "EVICTION_POLICY_STRICT",
                "window": 4,
                "prefill": [{"layer": 0, "key": f32_tensor(prefill_k), "value": f32_tensor(prefill_v)}],
            },
        },
        {"request_id": 2, "add": {"id": 9, "policy": "EVICTION_POLICY_NONE", "capacity": 16}},
        {
            "request_id": 3,
            "step": {
                "layer": 0,
                "ids": [7, 9],
                "query": f32_tensor(query),
                "new_key": f32_tensor(key),
                "new_value": f32_tensor(value),
            },
        },
        {
            "request_id": 4,
            "step": {
                "layer": 0,
                "ids": [5],
                "query": f32_tensor(query[:1]),
                "new_key": f32_tensor(key[:1]),
                "new_value": f32_tensor(value[:1]),
            },
        },
        {"request_id": 5, "remove": {"ids": [7, 9]}},
    ]
    data = dict(prefill_k=prefill_k, prefill_v=prefill_v, query=query, key=key, value=value)
    return "\n".join(json.dumps(r) for r in requests), data


@needs_grpcurl
def test_grpcurl_describes_batch(server):
    service = grpcurl(server, "describe", SERVICE)
    assert service.returncode == 0, service.stderr
    assert "rpc Batch ( stream .gqa.v1.BatchRequest ) returns ( stream .gqa.v1.BatchResponse )" in service.stdout


@needs_grpcurl
def test_grpcurl_batch_session(server):
    stdin, x = batch_requests(np.random.default_rng(0))
    done = grpcurl(server, f"{SERVICE}/Batch", flags=("-d", "@"), stdin=stdin)
    assert done.returncode == 0, done.stderr
    responses = [json.loads(chunk) for chunk in done.stdout.replace("}\n{", "}\x00{").split("\x00")]
    kinds = [next(k for k in r if k != "request_id") for r in responses]
    assert kinds == ["opened", "added", "added", "step", "step", "removed"]
    opened, added7, added9, step, refused, removed = responses
    assert opened["opened"]["backend"] == "cpu"
    assert added7["added"]["tokens_seen"] == ["3"] and added9["added"]["tokens_seen"] == ["0"]  # uint64: strings
    out = decode_f32(step["step"]["output"])
    keys7 = np.concatenate([x["prefill_k"], x["key"][:1, :, None]], axis=2)
    values7 = np.concatenate([x["prefill_v"], x["value"][:1, :, None]], axis=2)
    np.testing.assert_allclose(out[:1], attention_ref(x["query"][:1], keys7, values7, 2, 1), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(
        out[1:],
        attention_ref(x["query"][1:], x["key"][1:, :, None], x["value"][1:, :, None], 2, 1),
        atol=2e-6,
        rtol=1e-5,
    )
    assert step["step"]["tokens_seen"] == ["4", "1"]
    (refusal,) = refused["step"]["refusals"]
    assert refusal["id"] == "5" and refusal["status"]["code"] == 5
    assert removed["removed"]["ids"] == ["7", "9"]
    assert server.engine.batch_sequences_open == 0


@needs_grpcurl
def test_the_documented_batch_example_runs(server):
    """docs/wire-format.md's grpcurl example, sent as written; the outputs are the ones it states."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "wire-format.md").read_text()
    requests = text.split("```jsonl\n", 1)[1].split("```", 1)[0]
    done = grpcurl(server, f"{SERVICE}/Batch", flags=("-d", "@"), stdin=requests)
    assert done.returncode == 0, done.stderr
    responses = [json.loads(chunk) for chunk in done.stdout.replace("}\n{", "}\x00{").split("\x00")]
    step, refused = responses[3]["step"], responses[4]["step"]
    np.testing.assert_allclose(
        decode_f32(step["output"]).reshape(4, 2), [[2.0318, 3.0318], [2.0530, 3.0530], [5, 6], [5, 6]], atol=1e-4
    )
    assert [(r.get("index", 0), r["status"]["code"]) for r in refused["refusals"]] == [(0, 3), (1, 3), (2, 5)]
    assert responses[5]["removed"]["ids"] == ["7", "9"]
