"""The step plane (issue #23): the plan in C against backends/policy.py, the library's state,
``CacheSet.step`` against the public step, refusals row by row, the layout check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import native
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.errors import CacheFullError, InputValueError, RollbackError
from backends.plane import FIELDS, CacheSet
from backends.policy import EvictionPolicy, PolicyKind
from backends.registry import get_backend
from backends.ring import merge_runs, position_runs, row_of

ok, why = native.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"the native kernel does not load here: {why}")


@st.composite
def policies(draw) -> EvictionPolicy:
    kind = draw(st.sampled_from(list(PolicyKind)))
    window = draw(st.integers(1, 9))
    if kind is PolicyKind.NONE:
        return EvictionPolicy.none(draw(st.integers(1, 12)))
    if kind is PolicyKind.STRICT:
        return EvictionPolicy.strict(window)
    if kind is PolicyKind.GREEDY:
        return EvictionPolicy.greedy(window, window + draw(st.integers(0, 6)))
    return EvictionPolicy.sink(window, draw(st.integers(0, 4)))


def _expected(policy: EvictionPolicy, t: int) -> tuple[list[int], list[tuple[int, int]]]:
    """What policy.py and ring.py say of the step from T = t: its numbers, its row runs."""
    u = t + 1
    attended, resident = policy.attended(u), policy.resident(u)
    numbers = [
        u,
        policy.resident_length(u),
        resident[0].start,
        resident[-1].stop - 1,
        policy.evicted_by_step(t),
        policy.rollback_reach(u),
        sum(len(r) for r in attended),
        row_of(policy, t),
    ]
    return numbers, position_runs(policy, attended)


def _desc(policy: EvictionPolicy, t: int) -> native.CacheDesc:
    x = native.CacheDesc()
    x.policy = native.POLICY[policy.kind.value]
    x.c, x.window, x.sinks, x.t = policy.capacity, policy.window, policy.sinks, t
    return x


@settings(max_examples=300, deadline=None)
@given(policy=policies(), t=st.integers(0, 60))
def test_the_c_plan_is_the_policy(policy, t):
    """gqa_plan (the numbers gqa_step writes, its runs and row) equals policy.py at any T."""
    kernel = native.load()
    rc, numbers, runs = kernel.plan(_desc(policy, t))
    if not policy.has_room(t):
        assert rc == -28 and not numbers  # ENOSPC: policy none, full
        return
    want, want_runs = _expected(policy, t)
    assert rc == 0
    assert numbers == want
    assert runs == merge_runs(want_runs)
    assert kernel.rollback_reach(_desc(policy, t)) == policy.rollback_reach(t)


def _small(policy: EvictionPolicy, dtype=torch.float32, backend="cpu"):
    return get_backend(backend).create_cache(CacheSpec(1, 2, 1, 16, dtype, policy))


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("rollback"), st.integers(0, 5)),
        st.tuples(st.just("restore"), st.just(0)),
        st.tuples(st.just("prefill"), st.integers(0, 25)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), ops=_OPS, seed=st.integers(0, 2**16))
def test_the_library_state_steps_as_the_policy(policy, ops, seed):
    """Random steps, rollbacks, restores (load_state into a fresh cache) and prefills at random
    T: at every step the numbers the library returns are policy.py's, T advances only on a
    step that succeeds, and tokens_seen is the descriptor's T."""
    gen = torch.Generator().manual_seed(seed)
    cache = _small(policy)
    t = 0  # the model's T
    for op, arg in ops:
        if op == "step":
            for _ in range(arg):
                q, k, v = (torch.randn(1, h, 16, generator=gen) for h in (2, 1, 1))
                if not policy.has_room(t):
                    with pytest.raises(CacheFullError):
                        cache.step(q, k, v)
                    continue
                o = cache.step(q, k, v)
                want, _ = _expected(policy, t)
                got = [o.tokens_seen, o.resident, o.first_position, o.last_position, o.evicted_tokens]
                assert got == want[:5]
                assert o.attended == want[6]
                t += 1
        elif op == "rollback":
            if arg > policy.rollback_reach(t):
                with pytest.raises(RollbackError):
                    cache.rollback(arg)
            else:
                cache.rollback(arg)
                t -= arg
        elif op == "restore":
            fresh = _small(policy)
            fresh.load_state(t, cache.export_state())
            cache = fresh
        else:
            if policy.kind is PolicyKind.NONE and arg > policy.capacity:
                continue
            cache = _small(policy)
            cache.prefill(torch.randn(1, 1, arg, 16, generator=gen), torch.randn(1, 1, arg, 16, generator=gen))
            t = arg
        assert cache.tokens_seen == t == cache._state.t
        assert native.load().rollback_reach(cache._state) == policy.rollback_reach(t)


# -- CacheSet.step against the public step ------------------------------------------------------
ENCODINGS = [
    ("cpu", torch.float32, "native"),
    ("cpu", torch.bfloat16, "native"),
    ("cpu", torch.float16, "native"),
    ("int8", torch.float32, "native"),
    ("int8", torch.bfloat16, "native"),
    ("cpu", torch.float32, "torch"),
]
POLICIES = [
    EvictionPolicy.none(9),  # fills up mid-test: refused alone
    EvictionPolicy.strict(5),
    EvictionPolicy.greedy(4, 7),
    EvictionPolicy.sink(6, 2),
    EvictionPolicy.none(40),
]
HQ, HKV, D = 4, 2, 32


def _make(backend, dtype, kernel, policy):
    spec = CacheSpec(1, HQ, HKV, D, dtype, policy)
    if backend == "cpu":
        return DenseCache(spec, kernel)
    return get_backend("int8").create_cache(spec)


def _state_bytes(cache) -> list[torch.Tensor]:
    state = cache.export_state()
    return [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize(("backend", "dtype", "kernel"), ENCODINGS, ids=lambda x: str(x).removeprefix("torch."))
def test_cacheset_step_is_the_public_step_row_by_row(backend, dtype, kernel):
    """Every row bit-identical to its twin's public step (outputs, FIELDS), across calibration
    (int8), wrapped rings and a policy none cache that fills up: that row is refused alone
    (CacheFullError), its out row and cache untouched, the others computed."""
    gen = torch.Generator().manual_seed(1)
    layers, n = 2, len(POLICIES)
    cset = CacheSet(layers)
    twins = []
    for p in POLICIES:
        cset.add([_make(backend, dtype, kernel, p) for _ in range(layers)])
        twins.append([_make(backend, dtype, kernel, p) for _ in range(layers)])
    slots = np.array([4, 2, 0, 3, 1], dtype=np.int64)  # any order
    refusals, previous = 0, None
    for step in range(22):
        layer = step % layers
        q = torch.randn(n, HQ, D, generator=gen).to(dtype)
        k = torch.randn(n, HKV, D, generator=gen).to(dtype)
        v = torch.randn(n, HKV, D, generator=gen).to(dtype)
        out = torch.full((n, HQ, D), 7.0, dtype=dtype)
        before = {i: _state_bytes(cset.caches(int(s))[layer]) for i, s in enumerate(slots)}
        result = cset.step(layer, slots, q, k, v, out)
        assert result.fields.shape == (n, len(FIELDS)) and result.fields.dtype == np.int64
        if previous is not None:  # a result's fields are its own: the set's next step leaves them
            assert np.array_equal(previous[0].fields, previous[1])
        previous = (result, result.fields.copy())
        for i, s in enumerate(slots.tolist()):
            twin = twins[s][layer]
            try:
                o = twin.step(q[i : i + 1], k[i : i + 1], v[i : i + 1])
            except Exception as exc:
                refusals += 1
                assert type(result.refused[i]) is type(exc), (step, i)
                assert isinstance(exc, CacheFullError)
                assert torch.equal(out[i], torch.full_like(out[i], 7.0))
                assert not result.fields[i].any()
                mine = cset.caches(s)[layer]
                assert mine.tokens_seen == twin.tokens_seen
                assert all(torch.equal(a, b) for a, b in zip(before[i], _state_bytes(mine)))
                continue
            assert i not in result.refused, (step, i, result.refused.get(i))
            assert torch.equal(out[i], o.output[0]), (step, i)
            t = o.tokens_seen
            want = [t, o.resident, o.first_position, o.last_position, o.evicted_tokens, twin.policy.rollback_reach(t)]
            assert result.fields[i].tolist() == want, (step, i)
            assert cset.caches(s)[layer].tokens_seen == t
    assert refusals >= 1  # the policy none row did fill up


@pytest.mark.parametrize(("backend", "dtype", "kernel"), ENCODINGS, ids=lambda x: str(x).removeprefix("torch."))
def test_cacheset_step_buffers_is_step_from_bytes(backend, dtype, kernel):
    """``step_buffers`` over the rows' bytes gives ``step``'s bits and fields: every row, or some
    rows of the buffers (the others' output bytes untouched), with a row that fills up (policy
    none: refused alone, its output bytes untouched), int8 rows while they calibrate (the Python
    path) and caches without the compiled step."""
    gen = torch.Generator().manual_seed(5)
    sets = [CacheSet(1), CacheSet(1)]
    for p in POLICIES:
        for cset in sets:
            cset.add([_make(backend, dtype, kernel, p)])
    n, refusals = len(POLICIES), 0
    for step in range(12):
        q = torch.randn(n, HQ, D, generator=gen).to(dtype)
        k = torch.randn(n, HKV, D, generator=gen).to(dtype)
        v = torch.randn(n, HKV, D, generator=gen).to(dtype)
        rows = None if step % 3 else np.array([3, 0, 4], dtype=np.int64)
        slots = np.arange(n) if rows is None else rows[::-1].copy()
        stepped = slice(None) if rows is None else rows[::-1].copy()
        out = torch.full((len(slots), HQ, D), 7.0, dtype=dtype)
        want = sets[0].step(0, slots, q[stepped].contiguous(), k[stepped].contiguous(), v[stepped].contiguous(), out)
        raw = bytearray(b"\x55" * (n * HQ * D * dtype.itemsize))
        data = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (q, k, v)]
        got = sets[1].step_buffers(0, slots, *data, memoryview(raw), None if rows is None else slots)
        assert np.array_equal(got.fields, want.fields), step
        assert sorted(got.refused) == sorted(want.refused) and all(
            type(got.refused[i]) is type(want.refused[i]) for i in got.refused
        )
        output = torch.frombuffer(raw, dtype=dtype).view(n, HQ, D)
        untouched = torch.frombuffer(bytearray(b"\x55" * (HQ * D * dtype.itemsize)), dtype=dtype).view(HQ, D)
        for i, row in enumerate(np.arange(n)[stepped].tolist()):
            assert torch.equal(output[row], untouched if i in got.refused else out[i]), (step, i)
        for row in set(range(n)) - set(np.arange(n)[stepped].tolist()):
            assert torch.equal(output[row], untouched), (step, row)
        refusals += len(got.refused)
    assert refusals >= 1  # the policy none row did fill up


def _torch_step_module():
    try:
        return native.load_torch_step(), ""
    except native.NativeUnavailable as exc:
        return None, str(exc)


class _PythonOnly(CacheSet):
    """A set whose steps take the Python path (``_run``) always: the reference for the C++ entry."""

    def _attach_plane(self, n: int = 0):
        self._plane = False
        return False


@pytest.mark.skipif(_torch_step_module()[0] is None, reason=f"no torch step module: {_torch_step_module()[1]}")
@pytest.mark.parametrize(("backend", "dtype", "kernel"), ENCODINGS[:4], ids=lambda x: str(x).removeprefix("torch."))
def test_cacheset_steps_in_one_call_of_the_torch_step_module(backend, dtype, kernel, monkeypatch):
    """With the torch step module built, ``step`` and ``step_buffers`` are one C++ call each
    (plane_step, plane_buffers): the Python path (``_run``) is never entered, not on the first
    step, not after the set grows, not for a refused row (which Python finishes from the call's
    fields); every row's output, fields and refusal equal the Python path's. Inputs the call does
    not take go to the Python path, whose checks name them, or which steps them."""
    gen = torch.Generator().manual_seed(11)
    fast, slow = CacheSet(1), _PythonOnly(1)

    def entered(*args, **kwargs):
        raise AssertionError("the Python path ran")

    monkeypatch.setattr(fast, "_run", entered)
    policies = [EvictionPolicy.none(3), *POLICIES[1:4]] * 3  # 12 sequences: the set's arrays grow twice
    refusals = 0
    for step, policy in enumerate(policies):
        for cset in (fast, slow):
            cset.add([_make(backend, dtype, kernel, policy)])
        n = step + 1
        q = torch.randn(n, HQ, D, generator=gen).to(dtype)
        k = torch.randn(n, HKV, D, generator=gen).to(dtype)
        v = torch.randn(n, HKV, D, generator=gen).to(dtype)
        slots = np.arange(n)[::-1].copy()
        outs = [torch.full((n, HQ, D), 7.0, dtype=dtype) for _ in range(2)]
        if step % 2:  # step_buffers, every other step with rows (some of the buffers' rows)
            rows = None if step % 4 == 1 else np.arange(n)[::-1].copy()
            data = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (q, k, v)]
            raws = [bytearray(o.view(torch.uint8).numpy().tobytes()) for o in outs]
            got, want = (c.step_buffers(0, slots, *data, memoryview(r), rows) for c, r in zip((fast, slow), raws))
            assert raws[0] == raws[1], step
        else:
            got, want = (c.step(0, slots, q, k, v, o) for c, o in zip((fast, slow), outs))
            assert torch.equal(outs[0], outs[1]), step
        assert np.array_equal(got.fields, want.fields), step
        assert sorted(got.refused) == sorted(want.refused), step
        assert all(type(got.refused[i]) is type(want.refused[i]) for i in got.refused)
        assert got.compute_ns > 0
        refusals += len(got.refused)
    assert refusals >= 1  # a policy none(3) row filled up: refused through the call's own result
    assert fast._plane  # the entry in use, rebuilt after each growth

    n = len(policies)
    tensors = [torch.zeros(n, h, D, dtype=dtype) for h in (HQ, HKV, HKV, HQ)]
    bad = list(tensors)
    bad[2] = torch.zeros(n, HKV, D + 1, dtype=dtype)
    with pytest.raises(InputValueError, match="new_value"):
        fast.step(0, np.arange(n), *bad)
    data = [bytes(t.numel() * t.element_size()) for t in tensors[:3]]
    with pytest.raises(InputValueError, match="new_key"):
        fast.step_buffers(0, np.arange(n), data[0], data[1][1:], data[2], bytearray(len(data[0])))
    monkeypatch.undo()  # slots of another integer type: not the call's, stepped by the Python path
    seen = [c[0].tokens_seen for c in map(fast.caches, range(n))]
    fast.step(0, np.arange(n, dtype=np.int32), *tensors)
    assert [c[0].tokens_seen for c in map(fast.caches, range(n))] == [t + (i % 4 != 0) for i, t in enumerate(seen)]


def test_cacheset_step_buffers_keeps_no_hold_on_the_output_buffer():
    """The caller owns ``out``: once it drops its view, its bytearray can be resized (a view kept
    alive by the set would refuse that with BufferError)."""
    cset = CacheSet(1)
    cset.add([_make("cpu", torch.float32, "native", EvictionPolicy.strict(4))])
    q, kv, out = bytes(HQ * D * 4), bytes(HKV * D * 4), bytearray(HQ * D * 4)
    view = memoryview(out)
    assert not cset.step_buffers(0, np.arange(1), q, kv, kv, view).refused
    del view
    out.extend(bytes(HQ * D * 4))
    assert len(out) == 2 * HQ * D * 4


def test_cacheset_step_buffers_refuses_buffers_of_another_length():
    cset = CacheSet(1)
    cset.add([_make("cpu", torch.float32, "native", EvictionPolicy.strict(4))])
    q, kv, out = bytes(HQ * D * 4), bytes(HKV * D * 4), bytearray(HQ * D * 4)
    for args, name in (
        ((q + b"x", kv, kv, out), "query"),
        ((q, kv, kv[1:], out), "new_value"),
        ((q, kv, kv, bytes(out)), "out"),
    ):
        with pytest.raises(InputValueError, match=name):
            cset.step_buffers(0, np.arange(1), *args)
    with pytest.raises(ValueError, match="rows"):
        cset.step_buffers(0, np.arange(1), q, kv, kv, out, np.array([1]))
    assert cset.caches(0)[0].tokens_seen == 0
    assert not cset.step_buffers(0, np.arange(1), q, kv, kv, out).refused
    assert cset.caches(0)[0].tokens_seen == 1


def test_a_failure_mid_step_refuses_its_row_alone(monkeypatch):
    """An injected failure after the write (the kernel restores the row), and int8 rows with a
    non-finite value or a scale beyond float16: each refused alone, nothing written for it."""
    gen = torch.Generator().manual_seed(2)
    cset = CacheSet(1)
    caches = [_make("cpu", torch.float32, "native", EvictionPolicy.strict(6)) for _ in range(3)]
    for c in caches:
        cset.add([c])
    q, k, v = torch.randn(3, HQ, D, generator=gen), torch.randn(3, HKV, D, generator=gen), torch.randn(3, HKV, D)
    cset.step(0, np.arange(3), q, k, v, torch.empty(3, HQ, D))
    monkeypatch.setattr(caches[1], "_fail_after_write", True)
    before = _state_bytes(caches[1])
    out = torch.zeros(3, HQ, D)
    result = cset.step(0, np.arange(3), q, k, v, out)
    assert list(result.refused) == [1] and isinstance(result.refused[1], RuntimeError)
    assert all(torch.equal(a, b) for a, b in zip(before, _state_bytes(caches[1])))
    assert [c.tokens_seen for c in caches] == [2, 1, 2]
    assert not out[1].any() and out[0].any() and out[2].any()

    # int8: short caches (each one work item, which writes its row) and long ones (several
    # items: the row written before them), a refused row of each kind beside one that steps
    icset = CacheSet(1)
    lengths = (17, 17, 17, 600, 600)
    icaches = [_make("int8", torch.float32, "native", EvictionPolicy.strict(700)) for _ in lengths]
    for c, s in zip(icaches, lengths):
        icset.add([c])
        c.prefill(torch.randn(1, HKV, s, D, generator=gen), torch.randn(1, HKV, s, D, generator=gen))
    n = len(lengths)
    q, k, v = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D)
    k[0, 1, 3] = float("nan")
    v[2, 0, 5] = 1e9  # its float16 scale would overflow
    q[3, HQ - 1, 0] = float("inf")
    before = [_state_bytes(c) for c in icaches]
    out = torch.zeros(n, HQ, D)
    result = icset.step(0, np.arange(n), q, k, v, out)
    assert sorted(result.refused) == [0, 2, 3]
    assert all(isinstance(e, InputValueError) for e in result.refused.values())
    assert [c.tokens_seen for c in icaches] == [17, 18, 17, 600, 601]
    for i in (0, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(before[i], _state_bytes(icaches[i])))
        assert not out[i].any()
    assert out[1].any() and out[4].any()


def test_tokens_seen_is_the_library_state():
    cache = _make("cpu", torch.float32, "native", EvictionPolicy.greedy(3, 5))
    assert cache._state is not None
    cache.prefill(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D))
    assert cache._state.t == cache.tokens_seen == 4
    cache.step(torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D))
    assert cache._state.t == 5
    cache.rollback(2)
    assert cache._state.t == cache.tokens_seen == 3


def test_cacheset_refuses_tensors_of_another_shape():
    cset = CacheSet(1)
    cset.add([_make("cpu", torch.float32, "native", EvictionPolicy.strict(4))])
    with pytest.raises(InputValueError, match="query"):
        cset.step(0, np.arange(1), torch.zeros(1, HQ, D + 1), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D),
                  torch.zeros(1, HQ, D))  # fmt: skip
    with pytest.raises(ValueError, match="shape"):
        cset.add([_make("cpu", torch.bfloat16, "native", EvictionPolicy.strict(4))])
    assert cset.caches(0)[0].tokens_seen == 0


def test_cacheset_refuses_a_layer_out_of_range():
    """A layer below 0 or past the last is an IndexError naming it, nothing stepped (a negative
    one is not counted from the end), through ``step`` and ``step_buffers`` alike."""
    cset = CacheSet(2)
    cset.add([_make("cpu", torch.float32, "native", EvictionPolicy.strict(4)) for _ in range(2)])
    tensors = [torch.zeros(1, h, D) for h in (HQ, HKV, HKV, HQ)]
    data = [bytes(t.numel() * 4) for t in tensors[:3]]
    for layer in (-1, 2):
        with pytest.raises(IndexError, match=f"layer {layer}"):
            cset.step(layer, np.arange(1), *tensors)
        with pytest.raises(IndexError, match=f"layer {layer}"):
            cset.step_buffers(layer, np.arange(1), *data, bytearray(len(data[0])))
    assert [c.tokens_seen for c in cset.caches(0)] == [0, 0]
    assert not cset.step(1, np.arange(1), *tensors).refused
    assert [c.tokens_seen for c in cset.caches(0)] == [0, 1]


def test_cacheset_refuses_tensors_off_its_caches_device():
    """A set's step tensors live on its caches' device (the service moves a request's tensors
    there first): a tensor elsewhere is refused by name and device, nothing written."""
    cset = CacheSet(1)
    cset.add([_make("cpu", torch.float32, "native", EvictionPolicy.strict(4))])
    tensors = [torch.zeros(1, h, D) for h in (HQ, HKV, HKV, HQ)]
    for i, name in enumerate(("query", "new_key", "new_value", "out")):
        moved = list(tensors)
        moved[i] = torch.zeros(moved[i].shape, device="meta")
        with pytest.raises(InputValueError, match=f"{name}: expected a contiguous cpu tensor .* on meta"):
            cset.step(0, np.arange(1), *moved)
    assert cset.caches(0)[0].tokens_seen == 0


# Windows on either side of a 64-position block and a split (native.SPLIT_T positions: attend.c's
# grid), so that a ring wraps, a run starts and a split ends at every kind of boundary.
_SPLIT = native.SPLIT_T
_EDGES = (1, 2, 63, 64, 65, _SPLIT - 1, _SPLIT, _SPLIT + 1, _SPLIT + 190)


@st.composite
def _boundary_policies(draw) -> EvictionPolicy:
    kind = draw(st.sampled_from(list(PolicyKind)))
    window = draw(st.sampled_from(_EDGES))
    if kind is PolicyKind.NONE:
        return EvictionPolicy.none(window + draw(st.integers(0, 40)))
    if kind is PolicyKind.STRICT:
        return EvictionPolicy.strict(window)
    if kind is PolicyKind.GREEDY:
        return EvictionPolicy.greedy(window, window + draw(st.integers(0, 70)))
    return EvictionPolicy.sink(window + 4, draw(st.integers(0, 4)))


_PLANE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 2**16)),  # a step of a random subset, in random order
        st.tuples(st.just("rollback"), st.integers(0, 2**16)),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    encoding=st.sampled_from(ENCODINGS[:5]),
    caches=st.lists(
        st.tuples(_boundary_policies(), st.sampled_from((0, 1, 40, 63, 64, 65, _SPLIT, _SPLIT + 1, 2 * _SPLIT + 76))),
        min_size=1,
        max_size=5,
    ),
    ops=_PLANE_OPS,
)
def test_cacheset_step_is_the_public_step_at_block_and_split_boundaries(encoding, caches, ops):
    """Caches whose windows and lengths sit on either side of the kernel's block and split
    boundaries, stepped in one ``CacheSet.step`` (a random subset, in random order, on one thread
    and again on two) and their twins by the public step, rolled back alike between steps: every
    row bit-identical on both thread counts, with the public step's numbers; a refused row
    refused by both with the same error."""
    backend, dtype, kernel = encoding
    gen = torch.Generator().manual_seed(len(caches) * 100 + len(ops))
    sets, twins = [CacheSet(1), CacheSet(1)], []
    for policy, length in caches:
        length = min(length, policy.capacity) if policy.kind is PolicyKind.NONE else length
        keys, values = (torch.randn(1, HKV, length, D, generator=gen).to(dtype) for _ in range(2))
        made = [_make(backend, dtype, kernel, policy) for _ in range(3)]
        for cache in made:
            if length:
                cache.prefill(keys, values)
        sets[0].add([made[0]])
        sets[1].add([made[1]])
        twins.append(made[2])
    n, pool = len(caches), native.threads()
    try:
        for op, seed in ops:
            pick = np.random.default_rng(seed)
            if op == "rollback":
                for i, twin in enumerate(twins):
                    count = int(pick.integers(0, twin.policy.rollback_reach(twin.tokens_seen) + 1))
                    for cache in (sets[0].caches(i)[0], sets[1].caches(i)[0], twin):
                        cache.rollback(count)
                continue
            slots = pick.permutation(n)[: int(pick.integers(1, n + 1))].astype(np.int64)
            m = len(slots)
            q = torch.randn(m, HQ, D, generator=gen).to(dtype)
            k, v = (torch.randn(m, HKV, D, generator=gen).to(dtype) for _ in range(2))
            outs, results = [], []
            for threads, cset in zip((1, 2), sets):
                native.set_threads(threads)
                outs.append(torch.full((m, HQ, D), 7.0, dtype=dtype))
                results.append(cset.step(0, slots, q, k, v, outs[-1]))
            assert torch.equal(outs[0], outs[1]) and np.array_equal(results[0].fields, results[1].fields)
            assert sorted(results[0].refused) == sorted(results[1].refused)
            for i, s in enumerate(slots.tolist()):
                twin = twins[s]
                try:
                    o = twin.step(q[i : i + 1], k[i : i + 1], v[i : i + 1])
                except Exception as exc:
                    assert type(results[0].refused.get(i)) is type(exc), (i, exc)
                    continue
                assert i not in results[0].refused, results[0].refused[i]
                assert torch.equal(outs[0][i], o.output[0]), (s, twin.policy, twin.tokens_seen)
                t = o.tokens_seen
                want = [t, o.resident, o.first_position, o.last_position, o.evicted_tokens]
                assert results[0].fields[i].tolist() == want + [twin.policy.rollback_reach(t)]
    finally:
        native.set_threads(pool)


# -- the C/Python boundary ---------------------------------------------------------------------
def test_the_library_layout_is_the_mirror():
    kernel = native.load()
    assert native.check_layout(native.library_layout(kernel._lib)) == ""


def test_a_library_whose_layout_differs_is_refused(monkeypatch):
    """A mirror that disagrees with the library by one offset, or by the count, is refused with
    the field named; Kernel raises NativeUnavailable."""
    kernel = native.load()
    reported = native.library_layout(kernel._lib)
    mirror = native.layout_mirror()
    name, value = mirror[5]
    shifted = mirror[:5] + [(name, value + 4)] + mirror[6:]
    assert name in native.check_layout(reported, shifted)
    assert "expects" in native.check_layout(reported[:-1])
    monkeypatch.setattr(native, "layout_mirror", lambda: shifted)
    with pytest.raises(native.NativeUnavailable, match=name.replace("(", r"\(").replace(")", r"\)")):
        native.Kernel(kernel.path)


@pytest.mark.parametrize(
    "lengths", [[1500, 3, 700, 1200], [1 + i * 37 % 200 for i in range(64)]], ids=["long", "short"]
)
def test_cacheset_outputs_do_not_depend_on_the_thread_count(lengths):
    """Long and short caches in one call (enough work for the pool, several splits), and many
    one-split ones (the pool shares them out a cache at a time): the same bits on one thread and
    on the whole pool."""
    gen = torch.Generator().manual_seed(4)
    n = len(lengths)
    keys, values = torch.randn(1, HKV, 1500, D, generator=gen), torch.randn(1, HKV, 1500, D, generator=gen)
    q, k, v = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D)
    outs = []
    pool = native.threads()
    try:
        for threads in (1, max(2, pool)):
            native.set_threads(threads)
            cset = CacheSet(1)
            for s in lengths:
                cache = _make("cpu", torch.float32, "native", EvictionPolicy.none(2000))
                cache.prefill(keys[:, :, :s], values[:, :, :s])
                cset.add([cache])
            out = torch.empty(n, HQ, D)
            assert not cset.step(0, np.arange(n), q, k, v, out).refused
            outs.append(out)
    finally:
        native.set_threads(pool)
    assert torch.equal(outs[0], outs[1])
