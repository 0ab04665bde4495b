"""The CPU backend's stream caches: every policy against the oracle, atomic refusals, layout."""

from __future__ import annotations

import pytest
import torch

from backends import native, registry
from backends.contract import CacheSpec
from backends.cpu import CPUBackend
from backends.errors import BackendUnavailable, CacheFullError, InvalidInput
from backends.policy import EvictionPolicy
from tests.conftest import assert_close_to_oracle
from tests.oracle import attended_positions, attention_ref

B, HQ, HKV, D = 2, 8, 2, 16
STEPS = 300
# W and C chosen so that eviction happens many times within STEPS, the ring wraps often and,
# for greedy, the attended window straddles the ring's end.
POLICIES = {
    "none": EvictionPolicy.none(STEPS + 40),
    "strict": EvictionPolicy.strict(24),
    "greedy": EvictionPolicy.greedy(19, 31),
    "sink": EvictionPolicy.sink(20, 4),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# every kernel of the backend: the compiled step on each implementation, and torch's fallback
KERNELS = ["native-portable", "native-avx2", "native-avx512", "native-avx512dot", "torch"]


def _kernel_param(kernel: str):
    ok, why = native.available()
    usable = not kernel.startswith("native-") or (ok and kernel.partition("-")[2] in native.load().isas(D))
    return pytest.param(
        kernel, marks=pytest.mark.skipif(not usable, reason=f"{kernel} does not run here {why}".strip())
    )


def make_cache(policy: EvictionPolicy, dtype=torch.float32, kernel="auto"):
    return CPUBackend(kernel).create_cache(CacheSpec(B, HQ, HKV, D, dtype, policy))


class History:
    """Every token a stream has seen, to run the oracle on exactly the attended positions."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self, k, v):
        self.keys.append(k)
        self.values.append(v)

    def stacked(self, positions):
        return torch.stack([self.keys[p] for p in positions], 2), torch.stack([self.values[p] for p in positions], 2)


def run_stream(policy_name: str, dtype, steps=STEPS, prefill=11, seed=0, window_override=None, kernel="auto"):
    policy = POLICIES[policy_name]
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    cache = make_cache(policy, dtype, kernel)
    hist = History()
    pk, pv = rnd(B, HKV, prefill, D), rnd(B, HKV, prefill, D)
    cache.prefill(pk, pv)
    for p in range(prefill):
        hist.add(pk[:, :, p], pv[:, :, p])
    worst = 0.0
    evictions = 0
    for _ in range(steps):
        q, k, v = rnd(B, HQ, D), rnd(B, HKV, D), rnd(B, HKV, D)
        hist.add(k, v)
        out = cache.step(q, k, v)
        t = len(hist.keys)
        window = window_override if window_override is not None else policy.window
        pos = attended_positions(policy_name, t, window, policy.sinks)
        keys, values = hist.stacked(pos)
        ref = attention_ref(q.double(), keys.double(), values.double(), HQ, HKV)
        assert_close_to_oracle(out.output, ref, dtype, what=f"T={t}")
        resident = [p for r in policy.resident(t) for p in r]
        assert (out.tokens_seen, out.resident) == (t, len(resident))
        assert (out.first_position, out.last_position) == (resident[0], resident[-1])
        evictions += out.evicted_tokens > 0
        worst = max(worst, (out.output.double() - torch.as_tensor(ref)).abs().max().item())
    return cache, hist, evictions


@pytest.mark.parametrize("kernel", [_kernel_param(k) for k in KERNELS])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_stream_matches_oracle(policy_name, dtype, kernel):
    cache, hist, evictions = run_stream(policy_name, dtype, kernel=kernel)
    if policy_name != "none":
        assert evictions >= 10, "the test must evict many times"
    # Export: the resident tokens in position order, exactly.
    keys, values = cache.export()
    resident = [p for r in cache.resident_positions() for p in r]
    ek, ev = hist.stacked(resident)
    assert torch.equal(keys, ek) and torch.equal(values, ev)


@pytest.mark.parametrize("policy_name", ["strict", "greedy", "sink"])
def test_window_plus_one_would_fail(policy_name):
    """The conformance check for the W versus W+1 bug: the oracle with W+1 must disagree."""
    with pytest.raises(AssertionError):
        run_stream(policy_name, torch.float32, steps=80, window_override=POLICIES[policy_name].window + 1)


def test_greedy_attends_like_strict():
    strict = make_cache(EvictionPolicy.strict(7))
    greedy = make_cache(EvictionPolicy.greedy(7, 12))
    g = torch.Generator().manual_seed(3)
    for _ in range(60):
        q, k, v = (
            torch.randn(B, HQ, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
            torch.randn(B, HKV, D, generator=g),
        )
        a, b = strict.step(q, k, v), greedy.step(q, k, v)
        torch.testing.assert_close(a.output, b.output, atol=1e-6, rtol=1e-5)
        assert b.resident >= a.resident


def snapshot(cache):
    return cache.tokens_seen, cache._k.clone(), cache._v.clone()


def assert_unchanged(cache, snap):
    t, k, v = snap
    assert cache.tokens_seen == t
    assert torch.equal(cache._k, k) and torch.equal(cache._v, v)


def test_none_full_raises_typed_error_and_keeps_cache():
    cache = make_cache(EvictionPolicy.none(5))
    for _ in range(5):
        cache.step(torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    snap = snapshot(cache)
    with pytest.raises(CacheFullError, match="full"):
        cache.step(torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    assert_unchanged(cache, snap)


BAD_STEPS = [
    ("query-heads", lambda: (torch.zeros(B, HQ + 1, D), torch.zeros(B, HKV, D), torch.zeros(B, HKV, D)), ValueError),
    ("batch", lambda: (torch.zeros(B + 1, HQ, D), torch.zeros(B + 1, HKV, D), torch.zeros(B + 1, HKV, D)), ValueError),
    (
        "head-dim",
        lambda: (torch.zeros(B, HQ, D + 1), torch.zeros(B, HKV, D + 1), torch.zeros(B, HKV, D + 1)),
        ValueError,
    ),
    (
        "dtype",
        lambda: (
            torch.zeros(B, HQ, D, dtype=torch.float16),
            torch.zeros(B, HKV, D, dtype=torch.float16),
            torch.zeros(B, HKV, D, dtype=torch.float16),
        ),
        TypeError,
    ),
    (
        "mixed",
        lambda: (torch.zeros(B, HQ, D), torch.zeros(B, HKV, D, dtype=torch.float64), torch.zeros(B, HKV, D)),
        TypeError,
    ),
    ("rank", lambda: (torch.zeros(B, HQ, D, 1), torch.zeros(B, HKV, D), torch.zeros(B, HKV, D)), ValueError),
]


@pytest.mark.parametrize("name,make,exc", BAD_STEPS, ids=[b[0] for b in BAD_STEPS])
def test_rejected_step_leaves_cache_unchanged(name, make, exc):
    cache = make_cache(POLICIES["greedy"])
    for _ in range(40):
        cache.step(torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    snap = snapshot(cache)
    with pytest.raises(exc) as refused:
        cache.step(*make())
    assert isinstance(refused.value, InvalidInput)  # typed: the service maps it by class
    assert_unchanged(cache, snap)
    cache.step(torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
    assert cache.tokens_seen == 41


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize(
    "kernel",
    [pytest.param("native", marks=pytest.mark.skipif(not native.available()[0], reason="no native kernel")), "torch"],
)
def test_failure_after_the_write_restores_the_row(monkeypatch, kernel, dtype):
    cache = make_cache(POLICIES["strict"], dtype, kernel)
    for _ in range(30):  # wrapped: the next write overwrites a live row
        cache.step(*(torch.randn(B, h, D).to(dtype) for h in (HQ, HKV, HKV)))
    snap = snapshot(cache)
    storage = (cache._k.untyped_storage(), cache._v.untyped_storage())
    before = [bytes(s) for s in storage]
    if kernel == "native":  # the compiled step fails after writing the row and attending
        monkeypatch.setattr(cache, "_fail_after_write", True)
        match = "native step failed"
    else:

        def boom(*a, **k):
            raise RuntimeError("injected")

        monkeypatch.setattr(cache, "_attend", boom)
        match = "injected"
    with pytest.raises(RuntimeError, match=match):
        cache.step(*(torch.randn(B, h, D).to(dtype) for h in (HQ, HKV, HKV)))
    assert_unchanged(cache, snap)
    assert [bytes(s) for s in storage] == before  # byte-identical, padding included


def test_append_is_in_place_and_eviction_moves_nothing():
    cache = make_cache(POLICIES["greedy"])
    ptrs = (cache._k.data_ptr(), cache._v.data_ptr())
    moved = 0
    for _ in range(100):
        out = cache.step(torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D))
        moved += out.bytes_moved
        assert out.bytes_written == 2 * B * HKV * D * 4
    assert (cache._k.data_ptr(), cache._v.data_ptr()) == ptrs
    assert moved == 0
    assert cache.nbytes == 2 * B * HKV * POLICIES["greedy"].capacity * D * 4


def test_prefill_longer_than_window_keeps_what_the_policy_keeps():
    policy = EvictionPolicy.greedy(4, 6)
    cache = make_cache(policy)
    keys, values = torch.randn(B, HKV, 9, D), torch.randn(B, HKV, 9, D)
    cache.prefill(keys, values)
    ek, ev = cache.export()
    assert torch.equal(ek, keys[:, :, 3:9]) and torch.equal(ev, values[:, :, 3:9])


def test_prefill_too_long_for_none():
    cache = make_cache(EvictionPolicy.none(4))
    with pytest.raises(CacheFullError):
        cache.prefill(torch.randn(B, HKV, 5, D), torch.randn(B, HKV, 5, D))
    assert cache.tokens_seen == 0


def test_registry_reports_reasons():
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        registry.get_backend("tpu")
    assert registry.get_backend("cpu").name == "cpu"
    infos = {i.name: i for i in registry.describe()}
    assert infos["cpu"].available and not infos["cpu"].reasons


def test_capabilities_refuse_with_every_reason():
    backend = CPUBackend()
    spec = CacheSpec(1, 2, 1, 8, torch.float64, EvictionPolicy.strict(4), device="meta")
    with pytest.raises(BackendUnavailable) as info:
        backend.create_cache(spec)
    assert len(info.value.reasons) == 2
    assert all(r.startswith("cpu:") for r in info.value.reasons)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_steps_output_is_its_own_and_later_steps_leave_it(dtype):
    """Outputs come from slabs of several (``native_step.OUTPUT_SLAB_BYTES``; ``step_many``) or
    are written again once the caller lets go of them (the public step's C++ entry): across more
    steps than a slab holds, every output kept is its step's, at its own address, whatever came
    after; the public step and ``step_many`` alike."""
    from backends import batch
    from backends.native_step import OUTPUT_SLAB_BYTES

    spec = CacheSpec(2, 8, 2, 64, dtype, EvictionPolicy.strict(8))
    per_slab = OUTPUT_SLAB_BYTES // (2 * 8 * 64 * dtype.itemsize)
    cache, twin = CPUBackend().create_cache(spec), CPUBackend().create_cache(spec)
    g = torch.Generator().manual_seed(3)
    kept, expected = [], []
    for i in range(2 * per_slab + 3):
        q, k, v = (torch.randn(2, h, 64, generator=g).to(dtype) for h in (8, 2, 2))
        if i % 2:
            kept.append(cache.step(q, k, v).output)
        else:
            kept.append(batch.step_many([batch.BatchStep(cache, q, k, v)])[0].output)
        expected.append(twin.step(q, k, v).output.clone())
    assert len({t.data_ptr() for t in kept}) == len(kept)
    for got, want in zip(kept, expected):
        assert torch.equal(got, want)


@pytest.mark.skipif(not native.available()[0], reason="the compiled kernel is not built here")
def test_a_default_cache_runs_the_path_auto_isa_names():
    """A cache made with the default kernel steps with the implementation
    ``native.load().auto_isa`` names for its dtype (a bfloat16 cache: vdpbf16ps or the widening
    block, by CPU), bit for bit; where both AVX-512 paths run, they give different bits on these
    inputs, so the equality says which one ran."""
    kernel = native.load()
    spec = CacheSpec(1, 32, 8, 128, torch.bfloat16, EvictionPolicy.none(160))
    gen = torch.Generator().manual_seed(3)
    kv = [torch.randn(1, 8, 150, 128, generator=gen).to(torch.bfloat16) for _ in range(2)]
    step = [torch.randn(1, h, 128, generator=gen).to(torch.bfloat16) for h in (32, 8, 8)]

    def output(name: str) -> torch.Tensor:
        cache = CPUBackend(name).create_cache(spec)
        cache.prefill(*kv)
        return cache.step(*step).output

    named = kernel.auto_isa(128, torch.bfloat16)
    assert torch.equal(output("native"), output(f"native-{named}"))
    if {"avx512", "avx512dot"} <= set(kernel.isas(128)):
        assert not torch.equal(output("native-avx512"), output("native-avx512dot"))


@pytest.mark.skipif(not native.available()[0], reason="the compiled kernel is not built here")
def test_the_server_log_says_which_kernel_serves_and_how_bfloat16_runs(caplog):
    """The backend's probe (run as the server starts) logs the library it loaded, the paths this
    CPU runs and how a bfloat16 cache's blocks run here, as ``auto_isa`` chooses."""
    from backends import cpu

    kernel = native.load()
    caplog.set_level("INFO", logger="backends.cpu")
    cpu._log_kernel.cache_clear()
    assert CPUBackend.probe() == []
    assert f"cpu: native kernel {kernel.path} ({', '.join(kernel.isas(128))}; bfloat16 " in caplog.text
    dot = kernel.auto_isa(128, torch.bfloat16) == "avx512dot"
    assert ("bfloat16 vdpbf16ps" in caplog.text) == dot
    assert ("bfloat16 widened to float32" in caplog.text) == (not dot)
