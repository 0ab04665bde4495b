"""The stateless decode step against the seed examples and the float64 oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from backends.reference import gqa_decode_step
from tests.conftest import assert_close_to_oracle
from tests.oracle import decode_step_ref

HEADS = [(1, 1), (4, 1), (8, 8), (32, 8), (40, 8)]
HEAD_DIMS = [1, 2, 64, 80, 128]
SEQ_LENS = [0, 1, 17, 97, 2048]
BATCHES = [1, 3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_seed_examples(seed_examples):
    for ex in seed_examples:
        result = gqa_decode_step(**ex["input"])
        for key, expected in ex["output"].items():
            # The examples are printed to about 6 significant digits.
            torch.testing.assert_close(result[key], torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-6)


def _inputs(b, hq, hkv, d, s, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return mk(b, hq, d), mk(b, hkv, d), mk(b, hkv, d), mk(b, hkv, s, d), mk(b, hkv, s, d)


def _grid():
    # The full product is large: every (heads, D) pair at every S and dtype, batch alternating.
    for (hq, hkv), d, s, dtype in itertools.product(HEADS, HEAD_DIMS, SEQ_LENS, DTYPES):
        b = BATCHES[(hq + d + s) % 2]
        yield pytest.param(b, hq, hkv, d, s, dtype, id=f"B{b}-H{hq}x{hkv}-D{d}-S{s}-{str(dtype)[6:]}")
    for b in BATCHES:  # and both batch sizes everywhere on one shape per dtype
        for dtype in DTYPES:
            yield pytest.param(b, 32, 8, 128, 97, dtype, id=f"B{b}-H32x8-D128-S97-{str(dtype)[6:]}-batch")


@pytest.mark.parametrize("b,hq,hkv,d,s,dtype", list(_grid()))
def test_grid_against_oracle(b, hq, hkv, d, s, dtype):
    q, k, v, kc, vc = _inputs(b, hq, hkv, d, s, dtype)
    result = gqa_decode_step(q, k, v, kc, vc, hq, hkv)
    ref = decode_step_ref(q.double(), k.double(), v.double(), kc.double(), vc.double(), hq, hkv)
    assert result["output"].dtype == dtype and result["output"].shape == (b, hq, d)
    assert_close_to_oracle(result["output"], ref["output"], dtype)
    # The caches are the old positions unchanged, then the new token, exactly.
    assert torch.equal(result["new_key_cache"][:, :, :s], kc)
    assert torch.equal(result["new_key_cache"][:, :, s], k)
    assert torch.equal(result["new_value_cache"][:, :, s], v)


def test_empty_cache_returns_new_value_per_group():
    q, k, v, kc, vc = _inputs(2, 8, 2, 16, 0, torch.float32)
    out = gqa_decode_step(q, k, v, kc, vc, 8, 2)["output"]
    assert torch.equal(out, v.repeat_interleave(4, dim=1))


def test_extreme_scores_do_not_overflow():
    q = torch.full((1, 2, 4), 1e4)
    k = torch.full((1, 1, 4), 1e4)
    kc = torch.full((1, 1, 3, 4), -1e4)
    v = torch.ones(1, 1, 4)
    vc = torch.zeros(1, 1, 3, 4)
    out = gqa_decode_step(q, k, v, kc, vc, 2, 1)["output"]
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.ones(1, 2, 4))


def test_numpy_and_lists_accepted():
    q, k, v, kc, vc = _inputs(1, 4, 2, 8, 5, torch.float32)
    from_np = gqa_decode_step(q.numpy(), k.numpy(), v.numpy(), kc.numpy(), vc.numpy(), 4, 2)
    from_lists = gqa_decode_step(q.tolist(), k.tolist(), v.tolist(), kc.tolist(), vc.tolist(), 4, 2)
    from_torch = gqa_decode_step(q, k, v, kc, vc, 4, 2)
    assert torch.equal(from_np["output"], from_torch["output"])
    assert torch.equal(from_lists["output"], from_torch["output"])
    assert from_lists["output"].dtype == torch.float32


def test_float64_kept():
    q, k, v, kc, vc = _inputs(1, 4, 2, 8, 5, torch.float64)
    out = gqa_decode_step(q, k, v, kc, vc, 4, 2)["output"]
    assert out.dtype == torch.float64
    assert_close_to_oracle(out, decode_step_ref(q, k, v, kc, vc, 4, 2)["output"], torch.float64)


def _valid():
    q, k, v, kc, vc = _inputs(2, 4, 2, 8, 3, torch.float32)
    return dict(query=q, new_key=k, new_value=v, key_cache=kc, value_cache=vc, num_query_heads=4, num_kv_heads=2)


BAD_INPUTS = [
    ("hq-not-multiple", dict(num_query_heads=3, num_kv_heads=2), ValueError, "multiple"),
    ("hq-disagrees", dict(num_query_heads=8, num_kv_heads=2), ValueError, "num_query_heads"),
    ("hkv-disagrees", dict(num_query_heads=4, num_kv_heads=4), ValueError, "new_key"),
    ("batch-disagrees", dict(new_key=torch.zeros(1, 2, 8)), ValueError, "new_key"),
    ("d-disagrees", dict(new_value=torch.zeros(2, 2, 7)), ValueError, "new_value"),
    ("cache-hkv", dict(key_cache=torch.zeros(2, 1, 3, 8)), ValueError, "key_cache"),
    ("cache-d", dict(value_cache=torch.zeros(2, 2, 3, 9)), ValueError, "value_cache"),
    ("cache-s-mismatch", dict(value_cache=torch.zeros(2, 2, 4, 8)), ValueError, "value_cache"),
    ("query-rank", dict(query=torch.zeros(2, 4, 8, 1)), ValueError, "query"),
    ("cache-rank", dict(key_cache=torch.zeros(2, 2, 8)), ValueError, "key_cache"),
    ("mixed-dtype", dict(new_key=torch.zeros(2, 2, 8, dtype=torch.float16)), TypeError, "new_key"),
    ("cache-dtype", dict(key_cache=torch.zeros(2, 2, 3, 8, dtype=torch.bfloat16)), TypeError, "key_cache"),
    ("integer", dict(query=torch.zeros(2, 4, 8, dtype=torch.int32)), TypeError, "query"),
    ("heads-type", dict(num_kv_heads=2.0), TypeError, "num_kv_heads"),
    ("heads-zero", dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    ("not-a-tensor", dict(query="abc"), TypeError, "query"),
]


@pytest.mark.parametrize("name,override,exc,word", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_named(name, override, exc, word):
    args = _valid()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    args.update(override)
    with pytest.raises(exc) as info:
        gqa_decode_step(**args)
    assert word in str(info.value)
    # The inputs are never written to.
    for key, tensor in before.items():
        if key not in override:
            assert torch.equal(args[key], tensor)


def test_shapes_in_message():
    args = _valid()
    args["new_key"] = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match=r"\(2, 3, 8\)"):
        gqa_decode_step(**args)


def test_mixed_devices_refused():
    args = _valid()
    args["new_value"] = torch.zeros(2, 2, 8, device="meta")
    with pytest.raises(ValueError, match="device"):
        gqa_decode_step(**args)
