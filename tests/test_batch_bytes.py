"""``backends.batch_bytes.step_bytes``: steps whose tensors are spans of one byte buffer (a Decode
request's bytes), many caches in one native call. Every row bit-identical to its cache's step
alone, a refused row refused alone with its cache unchanged, caches without the compiled step
(the torch kernel) in the same call."""

from __future__ import annotations

import pytest
import torch

from backends import native
from backends.batch_bytes import ByteStep, step_bytes
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.errors import CacheFullError
from backends.policy import EvictionPolicy

HQ, HKV, D = 4, 2, 8


def _native_available() -> bool:
    try:
        native.load()
    except native.NativeUnavailable:
        return False
    return True


def _pair(dtype, policy, kernel, prefill, g):
    """Two identical caches: one stepped by ``step_bytes``, its twin by ``step`` alone."""
    spec = CacheSpec(1, HQ, HKV, D, dtype, policy)
    caches = [DenseCache(spec, kernel) for _ in range(2)]
    if prefill:
        keys = torch.randn(1, HKV, prefill, D, generator=g).to(dtype)
        values = torch.randn(1, HKV, prefill, D, generator=g).to(dtype)
        for c in caches:
            c.prefill(keys, values)
    return caches


def _spans(q, k, v, pad: bytes):
    """q, k, v as spans of one buffer with ``pad`` bytes before each (as a request's field heads)."""
    parts, at, offsets = [], 0, []
    for t in (q, k, v):
        parts.append(pad)
        at += len(pad)
        offsets.append(at)
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        parts.append(data)
        at += len(data)
    return b"".join(parts), *offsets


@pytest.mark.skipif(not _native_available(), reason="the compiled kernel does not build on this machine")
def test_rows_are_bit_identical_to_steps_alone_and_a_refused_row_changes_nothing():
    g = torch.Generator().manual_seed(7)
    rows = [
        (torch.float32, EvictionPolicy.strict(5), "native", 3),
        (torch.bfloat16, EvictionPolicy.sink(6, 2), "native", 9),
        (torch.float16, EvictionPolicy.greedy(3, 6), "native", 0),
        (torch.float32, EvictionPolicy.none(2), "native", 2),  # full: refused
        (torch.float32, EvictionPolicy.strict(3), "torch", 4),  # no compiled step
        (torch.float32, EvictionPolicy.none(2), "torch", 2),  # full, no compiled step: refused
    ]
    pairs = [_pair(dtype, policy, kernel, prefill, g) for dtype, policy, kernel, prefill in rows]
    for step in range(3):
        steps, twins, inputs = [], [], []
        for (dtype, *_), (cache, twin) in zip(rows, pairs):
            q = torch.randn(1, HQ, D, generator=g).to(dtype)
            k, v = (torch.randn(1, HKV, D, generator=g).to(dtype) for _ in range(2))
            steps.append(ByteStep(cache, *_spans(q, k, v, bytes(step + 3))))
            twins.append(twin)
            inputs.append((q, k, v))
        before = [(c.tokens_seen, *c.export()) for c, _ in pairs]
        done = step_bytes(steps)
        for i, (twin, (q, k, v)) in enumerate(zip(twins, inputs)):
            cache = steps[i].cache
            try:
                want = twin.step(q, k, v)
            except CacheFullError:
                assert isinstance(done.refused[i], CacheFullError)
                after = (cache.tokens_seen, *cache.export())
                assert after[0] == before[i][0] and all(torch.equal(a, b) for a, b in zip(after[1:], before[i][1:]))
                continue
            assert i not in done.refused
            end = done.offsets[i] + want.output.numel() * want.output.element_size()
            got = bytes(done.output[done.offsets[i] : end])
            assert got == want.output.contiguous().view(torch.uint8).numpy().tobytes()
            t = want.tokens_seen
            reach = twin.policy.rollback_reach(t)
            assert done.fields[i] == [
                t,
                want.resident,
                want.first_position,
                want.last_position,
                want.evicted_tokens,
                reach,
            ]


def test_a_cache_twice_is_refused_before_anything_is_written():
    spec = CacheSpec(1, HQ, HKV, D, torch.float32, EvictionPolicy.strict(4))
    cache = DenseCache(spec, "torch")
    data, *at = _spans(torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), b"")
    with pytest.raises(ValueError, match="twice"):
        step_bytes([ByteStep(cache, data, *at), ByteStep(cache, data, *at)])
    assert cache.tokens_seen == 0


def test_a_requests_bytes_are_found_where_ctypes_finds_them():
    """``_address`` reads a ``bytes`` object's address from its id (checked once at import
    against ctypes); any other buffer, here a ``bytes`` subclass, goes through ctypes."""
    import ctypes

    from backends import batch_bytes

    class Tagged(bytes):
        pass

    assert batch_bytes._BYTES_AT is not None  # CPython: the fast path is the one taken here
    for data in (bytes(range(40)), b"x" * 4096, Tagged(b"abcdefgh")):
        assert batch_bytes._address(data) == ctypes.cast(data, ctypes.c_void_p).value
