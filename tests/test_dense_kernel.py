"""The compiled dense step (``backends/csrc/`` through ``backends.cpu.DenseCache``) and the
batched entry (``backends.batch.step_many``).

Each implementation (portable C, AVX-512) against the float64 oracle over head widths, group
sizes around the kernel's tile of 4 query heads, lengths around its 64-position blocks and
splits (``native.SPLIT_T`` positions), and every policy's run shapes; outputs bit-identical alone, in batches of
1, 7 and 64, and on 1 or 2 threads; the batch contract (refusals alone, distinct caches,
read-only inputs, several Python threads at once); and the torch fallback when the library is
unavailable.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from backends import cpu, native
from backends.batch import BatchStep, step_many
from backends.contract import CacheSpec
from backends.cpu import CPUBackend, DenseCache
from backends.errors import CacheFullError
from backends.int8 import Int8Backend
from backends.plane import CacheSet
from backends.policy import EvictionPolicy
from tests.conftest import assert_close_to_oracle
from tests.oracle import attention_ref

KERNEL = native.load()  # this project's machines have a C compiler: failing to build is a failure
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [1, 2, 64, 80, 128, 256]
GROUPS = [1, 3, 4, 5, 8]  # 3: a tile of three query heads (a pair and one in the value sum)
ISAS = ["portable", "avx2", "avx512", "avx512dot"]
HKV = 2


def _dt(d):
    return str(d).removeprefix("torch.")


def _params():
    for isa in ISAS:
        for d in HEAD_DIMS:
            if (isa.startswith("avx512") and d % 16) or (isa == "avx2" and d % 8):
                continue  # by design the vector blocks take D in multiples of 16 (AVX-512) or 8 (AVX2); portable C does the rest
            usable = isa in KERNEL.isas(d)
            for g in GROUPS:
                yield pytest.param(
                    isa,
                    d,
                    g,
                    id=f"{isa}-D{d}-G{g}",
                    marks=pytest.mark.skipif(not usable, reason=f"{isa} does not run at D={d} here"),
                )


def _stream(dtype, d, g, policy, prefill, isa, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    cache = DenseCache(CacheSpec(1, HKV * g, HKV, d, dtype, policy), f"native-{isa}")
    keys, values = rnd(1, HKV, prefill, d), rnd(1, HKV, prefill, d)
    cache.prefill(keys, values)
    return cache, keys, values, rnd


def _full_step(dtype, d, g, s, isa, seed):
    """A cache of policy none holding s - 1 random rows stepped once more: the output and the
    float64 oracle over all s rows."""
    cache, keys, values, rnd = _stream(dtype, d, g, EvictionPolicy.none(s), s - 1, isa, seed=seed)
    q, k, v = rnd(1, HKV * g, d), rnd(1, HKV, d), rnd(1, HKV, d)
    out = cache.step(q, k, v).output
    ref = attention_ref(
        q.double(),
        torch.cat([keys, k[:, :, None]], 2).double(),
        torch.cat([values, v[:, :, None]], 2).double(),
        HKV * g,
        HKV,
    )
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("isa,d,g", list(_params()))
def test_single_run_matches_oracle(isa, d, g, dtype):
    """Policy none: one run from row 0; S (the attended count) around blocks and splits, and
    around the groups of 16 positions a block computes (17, 32: two; 48 and 97 = 64 + 33: three)."""
    lengths = [1, 17, 32, 48, 64, 97, native.SPLIT_T + 1] + ([4096] if d in (64, 128) else [])
    for s in lengths:
        out, ref = _full_step(dtype, d, g, s, isa, seed=s + d)
        assert out.dtype == dtype and out.shape == (1, HKV * g, d)
        assert_close_to_oracle(out, ref, dtype, what=f"S={s}")


@pytest.mark.parametrize(
    "isa", [pytest.param(i, marks=pytest.mark.skipif(i not in KERNEL.isas(128), reason="not here")) for i in ISAS]
)
@pytest.mark.parametrize("d,g", [(64, 3), (128, 4), (128, 5)], ids=["D64-G3", "D128-G4", "D128-G5"])
def test_bfloat16_outputs_are_the_exact_attention_rounded(isa, d, g):
    """Every path sums in float32 (avx512dot's value sum by vdpbf16ps on weights in two bfloat16
    pieces, as its scores' query): the bfloat16 output is the float64 attention rounded to
    bfloat16 in all but the elements float32's error puts across a rounding boundary (0.1% here).
    The dtype's tolerance cannot see a weight rounded to one bfloat16 piece (40% of the elements
    then round differently), nor any other loss of precision short of a bfloat16 step."""
    for s in (97, native.SPLIT_T + 1, 4096):
        out, ref = _full_step(torch.bfloat16, d, g, s, isa, seed=s + g)
        rounded = torch.as_tensor(ref, dtype=torch.float64).to(torch.bfloat16)
        same = float((out == rounded).double().mean())
        assert same >= 0.99, f"S={s}: {same:.4f} of the elements as the exact attention rounds them"


POLICY_SHAPES = {
    "strict-wrapped": (EvictionPolicy.strict(150), 200),  # a window that wraps: two runs
    "greedy-wrapped": (EvictionPolicy.greedy(100, 170), 260),
    "sink-wrapped": (EvictionPolicy.sink(130, 5), 300),  # sinks, then a wrapped window: three runs
    # around the key blocks of 64 rows (key_layout.KeyBlocks): a ring of one block less one, one
    # block, one block and one row (a last block of one row), wrapped, with and without sinks
    "strict-block-1": (EvictionPolicy.strict(63), 90),
    "strict-block": (EvictionPolicy.strict(64), 90),
    "strict-block+1": (EvictionPolicy.strict(65), 90),
    "sink-block+1": (EvictionPolicy.sink(65, 3), 90),
    # whole rings of 1, 2 and 4 rows: key lines of that many positions, several to a register
    # (block_avx2.c, scores_lines_avx2, which the AVX-512 block calls too); 3 rows take the pass
    # of 16 positions (8 on AVX-512)
    "strict-ring-1": (EvictionPolicy.strict(1), 3),
    "strict-ring-2": (EvictionPolicy.strict(2), 3),
    "strict-ring-3": (EvictionPolicy.strict(3), 2),
    "sink-ring-4": (EvictionPolicy.sink(2, 2), 5),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("shape", list(POLICY_SHAPES))
@pytest.mark.parametrize(
    "isa", [pytest.param(i, marks=pytest.mark.skipif(i not in KERNEL.isas(64), reason="not here")) for i in ISAS]
)
def test_policy_run_shapes_match_oracle(isa, shape, dtype):
    policy, prefill = POLICY_SHAPES[shape]
    d, g = 64, 4
    cache, keys, values, rnd = _stream(dtype, d, g, policy, prefill, isa, seed=prefill)
    hist_k, hist_v = list(keys.unbind(2)), list(values.unbind(2))
    for _ in range(70):  # the ring turns past its end
        q, k, v = rnd(1, HKV * g, d), rnd(1, HKV, d), rnd(1, HKV, d)
        hist_k.append(k)
        hist_v.append(v)
        out = cache.step(q, k, v)
        pos = [p for r in policy.attended(out.tokens_seen) for p in r]
        ref = attention_ref(
            q.double(),
            torch.stack([hist_k[p] for p in pos], 2).double(),
            torch.stack([hist_v[p] for p in pos], 2).double(),
            HKV * g,
            HKV,
        )
        assert_close_to_oracle(out.output, ref, dtype, what=f"T={out.tokens_seen}")


def _fleet(seed: int, count: int = 64):
    """``count`` caches of mixed encodings, dtypes, head shapes, policies and lengths (1..1500), and one
    step's tensors for each: the same for the same seed."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for i in range(count):
        dtype = DTYPES[i % 3]
        d = [64, 80, 128, 2][i % 4]
        g = [1, 4, 5][i % 3]
        s = int(rng.integers(1, 1500))
        policy = [
            EvictionPolicy.none(s + 2),
            EvictionPolicy.strict(max(1, s // 2)),
            EvictionPolicy.sink(max(1, s // 3), 3),
        ][i % 3]
        spec = CacheSpec(1, HKV * g, HKV, d, dtype, policy)
        # every fifth an int8 cache (prefilled, so calibrated: its whole step is native too)
        cache = Int8Backend().create_cache(spec) if i % 5 == 4 else DenseCache(spec, "native")
        cache.prefill(
            torch.randn(1, HKV, s, d, generator=gen).to(dtype), torch.randn(1, HKV, s, d, generator=gen).to(dtype)
        )
        steps.append(BatchStep(cache, *(torch.randn(1, h, d, generator=gen).to(dtype) for h in (HKV * g, HKV, HKV))))
    return steps


@pytest.fixture
def pool_size():
    before = native.threads()
    yield native.set_threads
    native.set_threads(before)


def test_outputs_are_bit_identical_alone_batched_and_on_any_thread_count(pool_size):
    pool_size(1)
    alone = [s.cache.step(s.query, s.new_key, s.new_value).output for s in _fleet(7)]
    for threads in (1, 2):
        pool_size(threads)
        for size in (1, 7, 64):
            steps = _fleet(7)
            outs = []
            for start in range(0, len(steps), size):
                for r in step_many(steps[start : start + size]):
                    assert not isinstance(r, Exception), r
                    outs.append(r.output)
            for i, (a, b) in enumerate(zip(alone, outs)):
                assert torch.equal(a, b), (threads, size, i)


def _long_steps(dtype):
    """Two long caches of 8 KV heads and one step for each: policy none over 4001 positions (4
    splits a head), and SPLIT_T sinks then a wrapped window (a split that starts exactly where a
    run starts); the same for the same dtype."""
    gen = torch.Generator().manual_seed(24)
    steps = []
    for policy, prefill in ((EvictionPolicy.none(4001), 4000), (EvictionPolicy.sink(2600, native.SPLIT_T), 4000)):
        cache = DenseCache(CacheSpec(1, 32, 8, 64, dtype, policy), "native")
        kv = [torch.randn(1, 8, prefill, 64, generator=gen).to(dtype) for _ in range(2)]
        cache.prefill(*kv)
        tensors = [torch.randn(1, h, 64, generator=gen).to(dtype) for h in (32, 8, 8)]
        steps.append((BatchStep(cache, *tensors), kv))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt)
def test_long_caches_read_in_runs_of_splits_are_bit_identical(pool_size, dtype):
    """A long cache's splits are claimed in runs of consecutive ones (run.c's claim_chunk: at most
    4, 2 and 1 here on 1, 2 and 3 threads; runs of 1 take its items in another order, the heads'
    short last splits in the middle); every grouping and order gives the same bits, alone or
    batched with a short cache, and the oracle's output."""
    outs = {}
    for threads in (1, 2, 3):
        pool_size(threads)
        steps = _long_steps(dtype)
        outs["alone", threads] = [s.cache.step(s.query, s.new_key, s.new_value).output for s, _ in steps]
        steps = [s for s, _ in _long_steps(dtype)] + [_fleet(3, 1)[0]]
        outs["batched", threads] = [r.output for r in step_many(steps)[:2]]
    first = outs["alone", 1]
    for key, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got)), key
    (step, (keys, values)), _ = _long_steps(dtype)
    ref = attention_ref(
        step.query.double(),
        torch.cat([keys, step.new_key[:, :, None]], 2).double(),
        torch.cat([values, step.new_value[:, :, None]], 2).double(),
        32,
        8,
    )
    assert_close_to_oracle(first[0], ref, dtype, what="S=4001")


def test_batch_equals_steps_and_keeps_bookkeeping():
    steps = _fleet(3, 9)
    results = step_many(steps)
    for s, r in zip(_fleet(3, 9), results):
        want = s.cache.step(s.query, s.new_key, s.new_value)
        assert torch.equal(r.output, want.output)
        assert dataclasses.replace(r, output=None) == dataclasses.replace(want, output=None)


def test_refused_steps_are_refused_alone():
    steps = _fleet(5, 6)
    full = DenseCache(CacheSpec(1, 4, 2, 64, torch.float32, EvictionPolicy.none(3)), "native")
    full.prefill(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    bad = steps[1]
    steps[1] = BatchStep(bad.cache, bad.query.double(), bad.new_key, bad.new_value)  # wrong dtype
    steps.append(BatchStep(full, torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64)))
    before = [(s.cache.tokens_seen, s.cache._k.clone(), s.cache._v.clone()) for s in steps]
    results = step_many(steps)
    assert isinstance(results[1], TypeError) and isinstance(results[-1], CacheFullError)
    for i, (s, r, (t, k, v)) in enumerate(zip(steps, results, before)):
        if i in (1, len(steps) - 1):
            assert s.cache.tokens_seen == t and torch.equal(s.cache._k, k) and torch.equal(s.cache._v, v)
        else:
            assert r.tokens_seen == t + 1


def test_a_failure_after_the_write_restores_that_cache_alone(monkeypatch):
    steps = _fleet(11, 5)
    victim = steps[2].cache
    storage = [bytes(victim._k.untyped_storage()), bytes(victim._v.untyped_storage())]
    monkeypatch.setattr(victim, "_fail_after_write", True)
    results = step_many(steps)
    assert isinstance(results[2], RuntimeError) and "native step failed" in str(results[2])
    assert [bytes(victim._k.untyped_storage()), bytes(victim._v.untyped_storage())] == storage
    assert all(not isinstance(r, Exception) for i, r in enumerate(results) if i != 2)


def test_outputs_go_into_the_given_rows_bit_identical():
    """``BatchStep.out``: rows of one packed tensor receive the outputs (native caches, an int8
    cache still calibrating, which takes the Python path, and a torch-kernel cache alike), bit
    for bit what the steps give without it; a row of the wrong shape is refused alone."""
    want = [r.output for r in step_many(_fleet(13, 12))]
    steps = _fleet(13, 12)
    calibrating = Int8Backend().create_cache(CacheSpec(1, 8, 2, 64, torch.float32, EvictionPolicy.none(8)))
    fallback = DenseCache(CacheSpec(1, 8, 2, 64, torch.bfloat16, EvictionPolicy.strict(4)), "torch")
    extra = [(calibrating, torch.float32), (fallback, torch.bfloat16)]
    gen = torch.Generator().manual_seed(1)
    for cache, dtype in extra:
        x = [torch.randn(1, h, 64, generator=gen).to(dtype) for h in (8, 2, 2)]
        steps.append(BatchStep(cache, *x))
    twins = [  # stepped alone, fed the same tensors
        Int8Backend().create_cache(calibrating.spec),
        DenseCache(fallback.spec, "torch"),
    ]
    want += [twin.step(*steps[-2 + j][1:4]).output for j, twin in enumerate(twins)]
    outs = [torch.full_like(st.query, float("nan")) for st in steps]
    wrong = torch.empty(2, *steps[0].query.shape[1:], dtype=steps[0].query.dtype)
    steps = [BatchStep(*st[:4], out) for st, out in zip(steps, outs)]
    steps[3] = BatchStep(*steps[3][:4], wrong)
    before = steps[3].cache.tokens_seen
    results = step_many(steps)
    assert isinstance(results[3], ValueError) and "out:" in str(results[3])
    assert steps[3].cache.tokens_seen == before and torch.isnan(outs[3]).all()
    for i, (r, out, w) in enumerate(zip(results, outs, want)):
        if i == 3:
            continue
        assert r.output is out and torch.equal(out, w), i


def test_one_cache_twice_is_refused_before_anything_is_written():
    steps = _fleet(2, 2)
    before = steps[0].cache._k.clone()
    with pytest.raises(ValueError, match="twice"):
        step_many([steps[0], steps[1], steps[0]])
    assert torch.equal(steps[0].cache._k, before) and steps[0].cache.tokens_seen == _fleet(2, 2)[0].cache.tokens_seen


def test_read_only_inputs_are_never_written():
    (s,) = _fleet(4, 1)
    frozen = []
    for t in (s.query, s.new_key, s.new_value):
        raw = bytes(t.contiguous().view(torch.uint8).numpy())
        with warnings.catch_warnings():  # torch warns (once) that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            frozen.append((torch.frombuffer(raw, dtype=t.dtype).view(t.shape), raw))
    (r,) = step_many([BatchStep(s.cache, *(f for f, _ in frozen))])
    assert not isinstance(r, Exception), r
    assert all(bytes(f.view(torch.uint8).numpy()) == raw for f, raw in frozen)


def test_several_python_threads_at_once(pool_size):
    pool_size(2)
    want = [[r.output for r in step_many(_fleet(seed, 8))] for seed in range(4)]
    fleets = [_fleet(seed, 8) for seed in range(4)]
    got: list = [None] * 4

    def work(i):
        got[i] = [r.output for r in step_many(fleets[i])]

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for a, b in zip(want, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_back_to_back_calls_with_late_workers_keep_their_bits(pool_size):
    """Steps in quick succession on a pool of 4 threads (on fewer cores its workers often wake
    after the caller has taken every item, or during the next call: pool.c's generation-tagged
    counter) give the bits of the same steps on one thread."""
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn(1, 8, 1100, 64, generator=gen) for _ in range(2)]
    inputs = [[torch.randn(1, h, 64, generator=gen) for h in (32, 8, 8)] for _ in range(150)]
    outs = {}
    for threads in (4, 1):
        pool_size(threads)
        cache = DenseCache(CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.strict(1100)), "native")
        cache.prefill(*kv)
        outs[threads] = [cache.step(*x).output for x in inputs]
    assert all(torch.equal(a, b) for a, b in zip(outs[4], outs[1]))


def _threads_on_one_cpu() -> dict[int, set[int]]:
    """This process's threads allowed on exactly one CPU, but the calling one: {tid: {cpu}}."""
    found = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            cpus = os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
        if len(cpus) == 1 and tid != threading.get_native_id():
            found[tid] = cpus
    return found


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to run on"
)
def test_the_pool_worker_runs_on_another_cpu_than_its_caller(pool_size):
    """pool.c places its workers off the caller's CPU (left to the scheduler, a woken worker was
    often queued behind the caller while the other CPU idled), and again when the caller moves."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cpus)  # where threads may not be pinned (a seccomp profile), nor can the pool's
    except OSError as exc:
        pytest.skip(f"this process may not set CPU affinities ({exc})")
    pool_size(2)
    gen = torch.Generator().manual_seed(6)
    cache = DenseCache(CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.none(1200)), "native")
    cache.prefill(*(torch.randn(1, 8, 1100, 64, generator=gen) for _ in range(2)))
    cache.step(*(torch.randn(1, h, 64, generator=gen) for h in (32, 8, 8)))  # the pool started, on every CPU
    before = os.sched_getaffinity(0)
    try:
        for caller in (cpus[0], cpus[1], cpus[0]):
            os.sched_setaffinity(0, {caller})  # this thread only
            cache.step(*(torch.randn(1, h, 64, generator=gen) for h in (32, 8, 8)))
            placed = _threads_on_one_cpu()
            assert len(placed) == 1, placed  # the pool's one worker
            ((cpu,),) = placed.values()
            assert cpu != caller and cpu in cpus
    finally:
        os.sched_setaffinity(0, before)


def _runtime_ns(tid: int) -> int:
    """CPU time a thread of this process has run, from its schedstat (ns)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


_NEEDS_SCHEDSTAT = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
    reason="needs two CPUs and per-thread schedstat",
)


def _the_worker() -> int:
    """The pool's one worker (a pool of two, started): the thread pinned alone to a CPU."""
    workers = list(_threads_on_one_cpu())
    if len(workers) != 1:
        pytest.skip(f"the pool's worker was not found pinned ({len(workers)} pinned threads)")
    return workers[0]


def _alerted_cpu_ns(worker: int, alert) -> int:
    """CPU time the sleeping worker runs after ``alert()`` with no call following: an alerted
    worker waits for the call awake, up to pool.c's PREWAKE_SPIN_NS (0.3 ms), then sleeps."""
    time.sleep(0.01)  # the worker back asleep
    before = _runtime_ns(worker)
    alert()
    time.sleep(0.05)
    return _runtime_ns(worker) - before


def _awake_cpu_ns(worker: int, alert, tries: int = 3) -> int:
    """The most CPU time the worker ran after ``alert()`` in up to ``tries`` alerts: an alerted
    worker yields while it waits, so another process busy on the cores (a CI neighbour, a second
    test run) can leave it under the threshold once; a no-op alert leaves it near 0 every time."""
    most = 0
    for _ in range(tries):
        most = max(most, _alerted_cpu_ns(worker, alert))
        if most > 50_000:
            break
    return most


@_NEEDS_SCHEDSTAT
def test_the_pool_is_alerted_before_a_parallel_step_only(pool_size):
    """gqa_prewake, which the public step calls before its checks: for a cache whose next step
    will run on two threads, the sleeping worker is woken and waits for the call awake (CPU time
    on it although no call comes); for a cache too short for the pool, it stays asleep. The
    pool then stops as usual (the fixture's set_threads joins the alerted worker)."""
    pool_size(2)
    gen = torch.Generator().manual_seed(7)
    big = DenseCache(CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.none(1200)), "native")
    big.prefill(*(torch.randn(1, 8, 1100, 64, generator=gen) for _ in range(2)))
    small = DenseCache(CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.none(16)), "native")
    small.prefill(*(torch.randn(1, 8, 2, 64, generator=gen) for _ in range(2)))
    big.step(*(torch.randn(1, h, 64, generator=gen) for h in (32, 8, 8)))  # the pool started
    worker = _the_worker()

    def alerted_cpu_ns(cache) -> int:
        return _alerted_cpu_ns(worker, lambda: KERNEL.prewake(ctypes.addressof(cache._state)))

    assert alerted_cpu_ns(small) < 20_000
    assert _awake_cpu_ns(worker, lambda: KERNEL.prewake(ctypes.addressof(big._state))) > 50_000
    assert alerted_cpu_ns(small) < 20_000
    # the public step does not even call it for a cache too small ever to use the pool
    assert small._wake is None and big._wake is not None


def _short_plane(seed: int):
    """A CacheSet of 64 short float32 caches (strict window 2: 64 x 8 heads of pool work a step)
    and a function that steps all 64 with the same random rows (the StepBatch)."""
    gen = torch.Generator().manual_seed(seed)
    plane = CacheSet(1)
    for _ in range(64):
        plane.add([DenseCache(CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.strict(2)), "native")])
    slots = np.arange(64, dtype=np.int64)
    rows = [torch.randn(64, h, 64, generator=gen) for h in (32, 8, 8)]
    out = torch.empty(64, 32, 64)
    return plane, lambda: plane.step(0, slots, *rows, out)


@_NEEDS_SCHEDSTAT
def test_a_plane_step_alerts_the_pool_when_it_will_share_it(pool_size):
    """``CacheSet.expect(n)``, which a Batch session calls when a step message arrives: a step of
    64 caches (64 x 8 heads, each at least one position: pool work) wakes the sleeping worker,
    which then waits awake; a step of one cache of the same shape does not; nor does an empty
    set."""
    pool_size(2)
    plane, step = _short_plane(8)
    step()  # the pool started
    worker = _the_worker()
    assert _alerted_cpu_ns(worker, lambda: plane.expect(1)) < 20_000
    assert _awake_cpu_ns(worker, lambda: plane.expect(64)) > 50_000
    assert _alerted_cpu_ns(worker, lambda: CacheSet(1).expect(64)) < 20_000


@_NEEDS_SCHEDSTAT
def test_a_call_answers_every_alert_before_it(pool_size):
    """A step of many caches alerts the pool itself (gqa_step, before its plans), so a Batch
    session's step is alerted twice: by ``CacheSet.expect`` and by the call. The call answers
    every alert made before it: after it the worker goes back to sleep instead of waiting awake
    for one more call (pool.c's PREWAKE_SPIN_NS, 0.3 ms of CPU a message for nothing)."""
    pool_size(2)
    plane, step = _short_plane(9)
    step()  # the pool started
    worker = _the_worker()
    for alerted_first in (False, True, False, True):
        time.sleep(0.01)  # the worker asleep
        if alerted_first:
            plane.expect(64)
        assert not step().refused
        after = _runtime_ns(worker)
        time.sleep(0.02)
        assert _runtime_ns(worker) - after < 100_000, (
            f"the worker ran on after the call (expect first: {alerted_first})"
        )


def test_set_threads_sizes_the_pool(pool_size):
    pool_size(3)
    assert native.threads() == 3 and KERNEL._lib.gqa_threads() == 3
    with pytest.raises(ValueError):
        native.set_threads(0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc's per-thread names")
def test_the_pools_workers_are_named(pool_size):
    """pool.c names its workers gqa-pool-1 .. (top -H, perf, bench_service's CPU by thread)."""
    pool_size(3)
    _pool_order(6, 3)  # a call on the pool: its workers started

    def names():
        found = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    found.add(f.read().strip())
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return found

    assert {"gqa-pool-1", "gqa-pool-2"} <= names()


def _pool_order(n: int, threads: int, chunk: int = 1) -> tuple[list[int], list[int], list[int]]:
    """One pool call of n items (each a 50 us wait) on up to `threads` threads, claimed in runs of
    at most `chunk`: each item's thread, its place in that thread's run, and the next item its
    thread was told of (csrc/test_hooks.c's gqa_test_pool_order)."""
    tid, seq, nxt = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
    assert KERNEL._lib.gqa_test_pool_order(n, threads, chunk, 50_000, tid, seq, nxt) == 0
    return list(tid), list(seq), list(nxt)


def _runs(items: list[int]) -> list[list[int]]:
    """A thread's items, in the order it ran them, cut where one is not the one after the last."""
    runs: list[list[int]] = []
    for item in items:
        if runs and item == runs[-1][-1] + 1:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


@pytest.mark.parametrize("chunk", [1, 8])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pool_hands_out_runs_of_items_from_both_ends(pool_size, threads, chunk):
    """pool.c: the caller takes items ascending from the front, each worker runs of consecutive
    items descending from the back, each run in ascending order, every item exactly once; a run
    is at most `chunk` items and at most a share of what was left when it was claimed (the runs
    shrink as the call ends); each item is told the next one its thread runs when that is the
    one after it (attend.c prefetches it). A worker joins when it wakes, so a call is repeated
    until one has (at most 20 calls)."""
    pool_size(threads)
    n, joined = 48, False
    for _ in range(20):
        tid, seq, nxt = _pool_order(n, threads, chunk)
        assert all(0 <= t < threads for t in tid), tid
        order = {
            t: [item for _, item in sorted((s, item) for item, (tt, s) in enumerate(zip(tid, seq)) if tt == t)]
            for t in set(tid)
        }
        for t, items in order.items():
            assert sorted(seq[x] for x in items) == list(range(len(items))), (t, items)  # each place once
            for x, y in zip(items, items[1:]):
                if y == x + 1:
                    assert nxt[x] == y, (t, x, nxt[x])
            assert -1 <= nxt[items[-1]] < n, (t, items[-1], nxt[items[-1]])
        front = order.get(0, [])
        assert front == list(range(len(front))), front  # the caller: 0, 1, 2, ... ascending
        for t in set(order) - {0}:
            runs = _runs(order[t])
            assert min(order[t]) >= len(front), (t, runs)  # from the back
            assert [r[0] for r in runs] == sorted((r[0] for r in runs), reverse=True), (t, runs)  # runs descend
            for r in runs:
                # claimed while at most r[-1] + 1 items were left: a share of them (pool.c's
                # claim_size), and no more than the chunk
                assert len(r) <= min(chunk, max(1, -(-(r[-1] + 1) // (2 * threads)))), (t, runs)
            assert [len(r) for r in runs] == sorted((len(r) for r in runs), reverse=True), (t, runs)
        joined = len(order) > 1
        if joined or threads == 1:
            break
    assert joined or threads == 1, "no worker took an item in 20 calls"


def test_torch_fallback_when_the_library_is_unavailable(monkeypatch, caplog):
    def unavailable():
        raise native.NativeUnavailable("no C compiler (faked)")

    monkeypatch.setattr(native, "load", unavailable)
    cpu.default_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu.default_kernel() == "torch"
        assert "no C compiler (faked)" in caplog.text
        spec = CacheSpec(1, 8, 2, 64, torch.float16, EvictionPolicy.sink(40, 2))
        cache = CPUBackend().create_cache(spec)
        assert cache.kernel == "torch" and cache._native is None
        assert CPUBackend().cache_nbytes(spec) == cache.nbytes
        gen = torch.Generator().manual_seed(0)
        keys, values = torch.randn(1, 2, 50, 64, generator=gen).half(), torch.randn(1, 2, 50, 64, generator=gen).half()
        cache.prefill(keys, values)
        q, k, v = torch.randn(1, 8, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
        (r,) = step_many([BatchStep(cache, q, k, v)])
        pos = [p for rr in spec.policy.attended(51) for p in rr]
        allk, allv = torch.cat([keys, k[:, :, None]], 2), torch.cat([values, v[:, :, None]], 2)
        ref = attention_ref(q.double(), allk[:, :, pos].double(), allv[:, :, pos].double(), 8, 2)
        assert_close_to_oracle(r.output, ref, torch.float16)
    finally:
        cpu.default_kernel.cache_clear()


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_reserved_bytes_count_the_key_layout(dtype, kernel):
    """The compiled kernel's key blocks pad nothing (a shorter last block); torch's transposed
    float32 keys pad their rows to whole lines from C = 4032 on."""
    spec = CacheSpec(1, 4, 2, 64, dtype, EvictionPolicy.none(5000))
    backend = CPUBackend(kernel)
    cache = backend.create_cache(spec)
    el = cache._v.element_size()
    assert backend.cache_nbytes(spec) == cache.nbytes
    if kernel == "native":
        assert cache.nbytes == 2 * 2 * 64 * 5000 * el
    elif dtype == torch.float32:
        assert cache._k.stride(2) == 5056 and cache.nbytes == 2 * 64 * (5000 + 5056) * el


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_dt)
@pytest.mark.parametrize(
    "isa", [pytest.param(i, marks=pytest.mark.skipif(i not in KERNEL.isas(128), reason="not here")) for i in ISAS[1:]]
)
def test_vector_row_conversions_round_as_the_portable_ones(isa, dtype):
    """The vector paths widen the query and narrow the output with their own instructions; the
    portable scalar conversions are the specification. Two positions with equal keys weigh 1/2
    each, so the float32 output (v1 + v2) / 2 is exact in every path and its 16-bit rounding
    (ties to even, overflow, subnormals, a NaN's sign) must be the same bits."""
    d, g = 128, 4
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(1, HKV, 1, d, generator=gen).to(dtype).expand(1, HKV, 2, d).contiguous()
    values = (torch.randn(1, HKV, 2, d, generator=gen) * torch.logspace(-9, 5, d)).to(dtype)
    values[0, 0, :, :4] = torch.tensor([float("nan"), -float("nan"), 65504.0, -65504.0]).to(dtype)[:, None].T
    q = torch.randn(1, HKV * g, d, generator=gen).to(dtype)
    outs = []
    for kernel in (isa, "portable"):
        cache = DenseCache(CacheSpec(1, HKV * g, HKV, d, dtype, EvictionPolicy.none(4)), f"native-{kernel}")
        cache.prefill(key[:, :, :1], values[:, :, :1])
        outs.append(cache.step(q, key[:, :, 1], values[:, :, 1]).output)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.isnan(outs[0][0, :g, 0]).all() and not torch.isnan(outs[0][0, :, 2:]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dt)
@pytest.mark.parametrize(
    "isa", [pytest.param(i, marks=pytest.mark.skipif(i not in KERNEL.isas(128), reason="not here")) for i in ISAS[1:]]
)
def test_a_head_with_no_finite_score_has_the_portable_bits(isa, dtype):
    """Query heads whose every score is -inf (an infinite query channel against keys all negative
    there): the softmax's exp(-inf - (-inf)) is NaN, as expf's in the portable kernel, so their
    rows are NaN with the portable rows' bits (the vector exp had clamped the NaN to a tiny
    weight and averaged the values instead), and the other heads are the portable ones' to
    rounding."""
    d, g = 128, 4
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(1, HKV, 6, d, generator=gen)
    keys[..., 0] = -keys[..., 0].abs() - 1.0
    values = torch.randn(1, HKV, 6, d, generator=gen)
    q = torch.randn(1, HKV * g, d, generator=gen)
    q[0, :g, 0] = float("inf")  # KV head 0's query heads
    outs = []
    for kernel in (isa, "portable"):
        cache = DenseCache(CacheSpec(1, HKV * g, HKV, d, dtype, EvictionPolicy.none(8)), f"native-{kernel}")
        cache.prefill(keys[:, :, :5].to(dtype), values[:, :, :5].to(dtype))
        outs.append(cache.step(q.to(dtype), keys[:, :, 5].to(dtype), values[:, :, 5].to(dtype)).output)
    assert torch.isnan(outs[0][0, :g]).all() and not torch.isnan(outs[0][0, g:]).any()
    assert torch.equal(outs[0][0, :g].view(torch.uint8), outs[1][0, :g].view(torch.uint8))
    torch.testing.assert_close(outs[0][0, g:], outs[1][0, g:])
