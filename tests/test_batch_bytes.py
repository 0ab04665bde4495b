"""``backends.batch_bytes.step_bytes``: steps whose tensors are spans of one byte buffer (a Decode
request's bytes), many caches in one native call. Every row bit-identical to its cache's step
alone, a refused row refused alone with its cache unchanged, caches without the compiled step
(the torch kernel) in the same call; through the C++ entry (``step_spans``) and through the
Python that gathers the rows when that entry is not built, alike."""

from __future__ import annotations

import pytest
import torch

from backends import batch_bytes, native
from backends.batch_bytes import ByteStep, step_bytes
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.errors import CacheFullError
from backends.policy import EvictionPolicy
from backends.registry import get_backend

HQ, HKV, D = 4, 2, 8


def _native_available() -> bool:
    try:
        native.load()
    except native.NativeUnavailable:
        return False
    return True


@pytest.fixture(params=["cpp entry", "python"])
def path(request, monkeypatch):
    """step_bytes through the C++ entry (skipped where it is not built), or through its Python."""
    if request.param == "python":
        monkeypatch.setattr(batch_bytes, "_spans_entry", lambda: None)
    elif batch_bytes._spans_entry() is None:
        pytest.skip(f"the C++ entry is not built here: {native._torch_step()[1]}")
    return request.param


def _pair(dtype, policy, kernel, prefill, g):
    """Two identical caches: one stepped by ``step_bytes``, its twin by ``step`` alone."""
    spec = CacheSpec(1, HQ, HKV, D, dtype, policy)
    if kernel == "int8":
        caches = [get_backend("int8").create_cache(spec) for _ in range(2)]
    else:
        caches = [DenseCache(spec, "native" if kernel == "another kernel" else kernel) for _ in range(2)]
    if kernel == "another kernel":  # the library through a Kernel of its own: not the entry's
        caches[0]._native = native.Kernel(native.load().path)
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


def _check_rows(rows, g) -> None:
    """Three step_bytes calls over caches made from ``rows`` (dtype, policy, kernel, prefill),
    each row against its twin's step alone: the same bytes and numbers, a refused row refused
    with its cache unchanged."""
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


# Caches of the library: through the C++ entry when it is built, rows it leaves to Python among them
LIBRARY_ROWS = [
    (torch.float32, EvictionPolicy.strict(5), "native", 3),
    (torch.bfloat16, EvictionPolicy.sink(6, 2), "native", 9),
    (torch.float16, EvictionPolicy.greedy(3, 6), "native", 0),
    (torch.float32, EvictionPolicy.none(2), "native", 2),  # full: refused
    (torch.float32, EvictionPolicy.strict(40), "int8", 5),  # calibrating: handed back to Python
    (torch.float32, EvictionPolicy.strict(40), "int8", 30),  # calibrated: the library's
    (torch.float32, EvictionPolicy.greedy(4, 9), "another kernel", 6),  # a stand-in's: Python's
]


@pytest.mark.skipif(not _native_available(), reason="the compiled kernel does not build on this machine")
def test_rows_are_bit_identical_to_steps_alone_and_a_refused_row_changes_nothing(path, monkeypatch):
    calls = []
    entry = batch_bytes._spans_entry()
    if entry is not None:  # counts the calls the C++ entry answered
        monkeypatch.setattr(batch_bytes, "_spans_entry", lambda: lambda steps: calls.append(entry(steps)) or calls[-1])
    _check_rows(LIBRARY_ROWS, torch.Generator().manual_seed(7))
    if path == "cpp entry":
        assert len(calls) == 3 and all(c is not None for c in calls)
        assert all(c[3] == [3, 4, 6] for c in calls)  # full, calibrating, another kernel's


@pytest.mark.skipif(not _native_available(), reason="the compiled kernel does not build on this machine")
def test_caches_without_the_compiled_step_in_the_same_call(path):
    """Caches of the torch kernel beside the library's (the whole call then takes the Python
    path): each row its own step's bits, a full one refused alone."""
    torch_rows = [
        (torch.float32, EvictionPolicy.strict(3), "torch", 4),  # no compiled step
        (torch.float32, EvictionPolicy.none(2), "torch", 2),  # full, no compiled step: refused
    ]
    _check_rows(LIBRARY_ROWS[:4] + torch_rows, torch.Generator().manual_seed(8))


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_cache_twice_is_refused_before_anything_is_written(kernel, path):
    if kernel == "native" and not _native_available():
        pytest.skip("the compiled kernel does not build on this machine")
    spec = CacheSpec(1, HQ, HKV, D, torch.float32, EvictionPolicy.strict(4))
    cache, other = DenseCache(spec, kernel), DenseCache(spec, kernel)
    data, *at = _spans(torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), b"")
    with pytest.raises(ValueError, match="twice"):
        step_bytes([ByteStep(cache, data, *at), ByteStep(other, data, *at), ByteStep(cache, data, *at)])
    assert cache.tokens_seen == other.tokens_seen == 0


@pytest.mark.skipif(not _native_available(), reason="the compiled kernel does not build on this machine")
def test_a_bytes_subclass_is_read_where_its_bytes_are(path):
    """A request's data as a ``bytes`` subclass: the same bits as its cache's step alone, both
    ways (the C++ entry reads any ``bytes``; the Python path finds it through ctypes)."""
    g = torch.Generator().manual_seed(3)

    class Tagged(bytes):
        pass

    a, twin = _pair(torch.float32, EvictionPolicy.strict(6), "native", 2, g)
    q = torch.randn(1, HQ, D, generator=g)
    k, v = (torch.randn(1, HKV, D, generator=g) for _ in range(2))
    data, *at = _spans(q, k, v, b"ab")
    done = step_bytes([ByteStep(a, Tagged(data), *at)])
    want = twin.step(q, k, v)
    assert not done.refused and bytes(done.output) == want.output.contiguous().view(torch.uint8).numpy().tobytes()
    assert done.fields == [[3, 3, 0, 2, 0, twin.policy.rollback_reach(3)]]


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
