"""The ``cuda`` backend: selection and probing without a device, the SDPA baseline path on CPU
tensors, and (marked ``gpu``) the backend itself on a real GPU against the float64 oracle: each
cache stepped alone, and ``step_many`` over many caches (bit-identical to alone, atomic).

The Triton kernel's own correctness without a GPU is in ``test_triton_kernel.py`` (interpreter).
Nothing here imports ``triton`` in this process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from backends import cuda as cuda_backend
from backends import registry
from backends.contract import CacheSpec
from backends.cuda import CUDABackend, CUDACache, DeviceFacts
from backends.errors import BackendUnavailable
from backends.policy import EvictionPolicy
from tests.oracle import attended_positions, attention_ref, resident_positions

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (run by `make gpu-check`)")

# (atol, rtol) against the float64 oracle on the same rounded inputs. The kernel rounds the
# probabilities to the cache dtype before the P.V product (as flash kernels do), and the output
# to the cache dtype.
TOLERANCES = {
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float32: (2e-5, 1e-4),
}

FACTS = {
    "cpu-build": (DeviceFacts(False, 0, True), ["cuda: torch has no CUDA (CPU build)"]),
    "no-device": (DeviceFacts(True, 0, True), ["cuda: no CUDA device"]),
    "no-triton": (DeviceFacts(True, 1, False), ["cuda: triton not installed"]),
    "cpu-build-no-triton": (
        DeviceFacts(False, 0, False),
        ["cuda: torch has no CUDA (CPU build)", "cuda: triton not installed"],
    ),
    "ready": (DeviceFacts(True, 1, True), []),
}

# (kind, kwargs, prefill, steps): every policy, each past its window so the ring wraps.
POLICIES = {
    "none": ("none", dict(capacity=40), 7, 20),
    "strict": ("strict", dict(window=9), 4, 25),
    "greedy": ("greedy", dict(window=6, capacity=10), 0, 27),
    "sink": ("sink", dict(window=7, sinks=3), 5, 24),
}
# Before this step, drop the last 2 tokens (exact there: the rollback rule of docs/eviction.md).
ROLLBACK_AT = {"none": 10, "strict": None, "greedy": 13, "sink": None}


def _fake(monkeypatch, facts: DeviceFacts) -> None:
    monkeypatch.setattr(cuda_backend, "device_facts", lambda: facts)
    monkeypatch.setattr(registry, "_instances", {})


@pytest.mark.parametrize("case", list(FACTS), ids=list(FACTS))
def test_probe_reports_each_missing_piece(monkeypatch, case):
    facts, expected = FACTS[case]
    _fake(monkeypatch, facts)
    reasons = CUDABackend.probe()
    assert len(reasons) == len(expected)
    for got, want in zip(reasons, expected):
        assert got.startswith(want), (got, want)


def test_probe_on_this_machine_never_raises():
    reasons = CUDABackend.probe()
    assert all(r.startswith("cuda: ") for r in reasons)
    if not HAS_CUDA:
        assert reasons, "no usable CUDA here, so probe must say why"


def test_registry_refuses_cuda_with_reasons(monkeypatch):
    _fake(monkeypatch, FACTS["no-device"][0])
    with pytest.raises(BackendUnavailable) as err:
        registry.get_backend("cuda")
    assert err.value.reasons == ["cuda: no CUDA device"]
    info = {i.name: i for i in registry.describe()}["cuda"]
    assert not info.available and info.reasons == ["cuda: no CUDA device"]
    assert info.capabilities is CUDABackend.capabilities


def test_registry_gives_cuda_when_the_probe_passes(monkeypatch):
    _fake(monkeypatch, FACTS["ready"][0])
    backend = registry.get_backend("cuda")
    assert isinstance(backend, CUDABackend) and backend.attention == "triton"


def test_import_and_probe_do_not_load_triton():
    code = (
        "import sys, backends.cuda as c; c.CUDABackend.probe(); "
        "print('triton' in sys.modules, 'backends.triton_decode' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


@pytest.mark.parametrize(
    "dtype, device, head_dim, needle",
    [
        (torch.float32, "cuda", 64, "cuda: dtype float32 not supported"),
        (torch.float16, "cpu", 64, "cuda: device cpu not supported"),
        (torch.float16, "cuda", 512, "cuda: head_dim 512 not supported"),
    ],
    ids=["float32", "cpu-device", "head-dim-512"],
)
def test_capabilities_refuse_what_the_kernel_cannot_serve(monkeypatch, dtype, device, head_dim, needle):
    _fake(monkeypatch, FACTS["ready"][0])
    spec = CacheSpec(1, 4, 2, head_dim, dtype, EvictionPolicy.strict(8), device=device)
    with pytest.raises(BackendUnavailable) as err:
        CUDABackend().create_cache(spec)
    assert len(err.value.reasons) == 1 and err.value.reasons[0].startswith(needle), err.value.reasons


def test_unknown_attention_path_is_refused():
    with pytest.raises(ValueError, match="attention"):
        CUDABackend(attention="flash")


def test_cache_nbytes_is_dense_keys_plus_values():
    spec = CacheSpec(2, 8, 2, 64, torch.bfloat16, EvictionPolicy.greedy(16, 24), device="cuda")
    assert CUDABackend().cache_nbytes(spec) == 2 * 2 * 2 * 24 * 64 * 2


# -- running a cache step by step against the oracle ---------------------------------------


def run_policy(cache, kind, kw, prefill, steps, *, seed=0, rollback_at=None):
    """Drives ``cache`` through ``prefill`` + ``steps`` tokens; checks each output and the
    final export against the oracle. Returns the largest output error seen."""
    s = cache.spec
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(s.dtype)

    hist_k, hist_v = [], []  # per position, (B, Hkv, D) in the cache dtype, on the CPU
    if prefill:
        pk, pv = (
            rand(s.batch_size, s.num_kv_heads, prefill, s.head_dim),
            rand(s.batch_size, s.num_kv_heads, prefill, s.head_dim),
        )
        cache.prefill(pk.to(s.device), pv.to(s.device))
        hist_k += list(pk.unbind(2))
        hist_v += list(pv.unbind(2))
    atol, rtol = TOLERANCES[s.dtype]
    worst = 0.0
    for i in range(steps):
        if rollback_at is not None and i == rollback_at:
            cache.rollback(2)
            del hist_k[-2:], hist_v[-2:]
        q = rand(s.batch_size, s.num_query_heads, s.head_dim)
        k, v = rand(s.batch_size, s.num_kv_heads, s.head_dim), rand(s.batch_size, s.num_kv_heads, s.head_dim)
        out = cache.step(q.to(s.device), k.to(s.device), v.to(s.device))
        hist_k.append(k)
        hist_v.append(v)
        t = len(hist_k)
        pos = attended_positions(kind, t, kw.get("window", 0), kw.get("sinks", 0))
        K = torch.stack([hist_k[p] for p in pos], 2).double().numpy()
        V = torch.stack([hist_v[p] for p in pos], 2).double().numpy()
        ref = attention_ref(q.double().numpy(), K, V, s.num_query_heads, s.num_kv_heads)
        got = out.output.cpu().double()
        assert out.output.dtype == s.dtype and out.bytes_moved == 0
        assert out.attended == len(pos)
        torch.testing.assert_close(
            got,
            torch.from_numpy(ref),
            atol=atol,
            rtol=rtol,
            msg=lambda m, where=f"{kind} step {i} (T={t})": f"{where}: {m}",
        )
        worst = max(worst, float(np.abs(got.numpy() - ref).max()))
    ek, ev = cache.export()
    resident = resident_positions(kind, len(hist_k), **kw)
    assert torch.equal(ek.cpu(), torch.stack([hist_k[p] for p in resident], 2))
    assert torch.equal(ev.cpu(), torch.stack([hist_v[p] for p in resident], 2))
    return worst


@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
def test_sdpa_baseline_path_on_cpu_tensors(policy):
    """The baseline path's run handling (a wrapped ring is concatenated) checked without a GPU."""
    kind, kw, prefill, steps = POLICIES[policy]
    spec = CacheSpec(2, 8, 2, 16, torch.float32, EvictionPolicy.create(kind, **kw), device="cpu")
    run_policy(CUDACache(spec, attention="sdpa"), kind, kw, prefill, steps, rollback_at=ROLLBACK_AT[policy])


# -- on a GPU ---------------------------------------------------------------------------------

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_HEADS = [(32, 8, 128), (8, 1, 64), (4, 4, 80)]  # (Hq, Hkv, D): GQA, MQA, MHA with odd D


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("policy", list(POLICIES), ids=list(POLICIES))
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("heads", GPU_HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_gpu_cache_matches_oracle(heads, attention, policy, dtype):
    pytest.importorskip("triton")
    hq, hkv, d = heads
    kind, kw, prefill, steps = POLICIES[policy]
    spec = CacheSpec(2, hq, hkv, d, dtype, EvictionPolicy.create(kind, **kw), device="cuda")
    cache = CUDABackend(attention=attention).create_cache(spec)
    ptr = cache._k.data_ptr(), cache._v.data_ptr()
    run_policy(cache, kind, kw, prefill, steps, rollback_at=ROLLBACK_AT[policy])
    assert (cache._k.data_ptr(), cache._v.data_ptr()) == ptr, "the cache was reallocated"


def _grouped_ref(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
    """float64 attention of ``q`` (B, Hq, D) over ``kk``/``vv`` (B, Hkv, n, D), each query head
    over its group's KV head; (B, Hq, D)."""
    b, hq, d = q.shape
    hkv = kk.shape[1]
    qq = q.double().view(b, hkv, hq // hkv, d)
    return (torch.softmax(qq @ kk.double().transpose(-1, -2) / math.sqrt(d), -1) @ vv.double()).view(b, hq, d)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("total", [1, 63, 4097, 50_001])
def test_gpu_kernel_long_and_wrapped_sequences(dtype, total):
    """Many splits over a wrapped window plus sinks, against float64 on the attended rows."""
    pytest.importorskip("triton")
    from backends.triton_decode import decode_attention

    b, hq, hkv, d = 2, 32, 8, 128
    cap = total + 37
    gen = torch.Generator(device="cuda").manual_seed(total)
    keys = torch.randn(b * hkv, cap, d, device="cuda", generator=gen).to(dtype)
    values = torch.randn(b * hkv, cap, d, device="cuda", generator=gen).to(dtype)
    q = torch.randn(b, hq, d, device="cuda", generator=gen).to(dtype)
    sinks = min(4, total)
    rest = total - sinks
    split = sinks + (cap - sinks) // 2
    tail = min(rest, cap - split)
    runs = [(0, sinks), (split, split + tail), (sinks, sinks + rest - tail)]
    rows = torch.cat([torch.arange(a, z) for a, z in runs]).cuda()
    out = decode_attention(q, keys, values, runs, num_kv_heads=hkv)
    kk = keys[:, rows].double().view(b, hkv, total, d)
    vv = values[:, rows].double().view(b, hkv, total, d)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), _grouped_ref(q, kk, vv), atol=atol, rtol=rtol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_int8_kernel_matches_dequantized_oracle(dtype):
    pytest.importorskip("triton")
    from backends.triton_decode import decode_attention_int8

    b, hq, hkv, d, cap = 2, 32, 8, 128, 3000
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, b * hkv, cap, d, device="cuda", generator=gen)
    scales = x.abs().amax(-1).clamp_min(1e-8) / 127
    codes = torch.round(x / scales[..., None]).clamp(-127, 127).to(torch.int8)
    deq = codes.double() * scales.double()[..., None]
    q = torch.randn(b, hq, d, device="cuda", generator=gen).to(dtype)
    runs = [(0, 4), (2000, 3000), (4, 1500)]
    rows = torch.cat([torch.arange(a, z) for a, z in runs]).cuda()
    out = decode_attention_int8(q, codes[0], scales[0], codes[1], scales[1], runs, num_kv_heads=hkv)
    n = len(rows)
    kk = deq[0][:, rows].view(b, hkv, n, d)
    vv = deq[1][:, rows].view(b, hkv, n, d)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), _grouped_ref(q, kk, vv), atol=atol, rtol=rtol)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rejected_step_leaves_the_cache_unchanged():
    pytest.importorskip("triton")
    spec = CacheSpec(1, 8, 2, 64, torch.float16, EvictionPolicy.strict(5), device="cuda")
    cache = CUDABackend().create_cache(spec)
    for _ in range(7):
        cache.step(*(torch.randn(*s, device="cuda", dtype=torch.float16) for s in ((1, 8, 64), (1, 2, 64), (1, 2, 64))))
    before = cache.export()
    with pytest.raises(ValueError):
        cache.step(
            torch.randn(1, 8, 64, device="cuda", dtype=torch.float16),
            torch.randn(1, 3, 64, device="cuda", dtype=torch.float16),
            torch.randn(1, 3, 64, device="cuda", dtype=torch.float16),
        )
    after = cache.export()
    assert cache.tokens_seen == 7
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the 'triton' extra)")
def test_gpu_bench_script_runs_on_cpu_under_the_interpreter(tmp_path):
    """The GPU run is rare and short: its benchmark script must not fail on a typo. Tiny shapes on
    CPU tensors under TRITON_INTERPRET=1 go through every line of it (timings meaningless)."""
    env = dict(os.environ, TRITON_INTERPRET="1", GQA_BENCH_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.gpu_bench", "--cpu-smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert re.search(r"^targets: \d+ passed, \d+ failed$", proc.stdout, re.M), proc.stdout
    records = json.loads((tmp_path / "gpu.json").read_text())["records"]
    shapes = [r for r in records if r["kind"] == "shape"]
    assert len(shapes) == 2 and all(r["max_abs_diff_vs_sdpa"] < 1e-2 for r in shapes), shapes
    assert any(r["kind"] == "sweep" for r in records) and any(r["kind"] == "target" for r in records)


# -- the batched step on a GPU (its interpreter tests are in test_triton_kernel.py) ----------

# (policy kwargs, prefill): one row, one split, several splits, wrapped windows, sinks.
GPU_BATCH_STREAMS = [
    ("greedy", dict(window=64, capacity=96), 0),
    ("none", dict(capacity=5000), 4095),
    ("strict", dict(window=1000), 2500),
    ("sink", dict(window=700, sinks=4), 1500),
    ("greedy", dict(window=300, capacity=400), 999),
    ("none", dict(capacity=600), 511),
]


def _gpu_caches(count: int, dtype, heads, seed: int):
    """``count`` cuda caches cycling through GPU_BATCH_STREAMS, prefilled, with one step's
    tensors each; the same seed gives the same caches."""
    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for j in range(count):
        kind, kw, prefill = GPU_BATCH_STREAMS[j % len(GPU_BATCH_STREAMS)]
        spec = CacheSpec(1, hq, hkv, d, dtype, EvictionPolicy.create(kind, **kw), device="cuda")
        cache = CUDABackend().create_cache(spec)
        if prefill:
            cache.prefill(*(torch.randn(1, hkv, prefill, d, device="cuda", generator=gen).to(dtype) for _ in range(2)))
        step = tuple(torch.randn(1, h, d, device="cuda", generator=gen).to(dtype) for h in (hq, hkv, hkv))
        out.append((cache, (kind, kw), step))
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_step_many_is_bit_identical_to_alone_and_matches_oracle(dtype):
    """64 caches of mixed policies and lengths (1 to 4096 rows), in two head shapes (two launches
    of one step_many), against the same caches stepped alone and the float64 oracle."""
    pytest.importorskip("triton")
    from backends.batch import BatchStep, step_many

    shapes = [(32, 8, 128), (8, 8, 64)]
    alone = [c for i, h in enumerate(shapes) for c in _gpu_caches(32, dtype, h, seed=i)]
    together = [c for i, h in enumerate(shapes) for c in _gpu_caches(32, dtype, h, seed=i)]
    expected = []
    for cache, _policy, step in alone:
        before_k, before_v = cache.export()
        expected.append((cache.step(*step).output, before_k, before_v))
    outcomes = step_many([BatchStep(c, *step) for c, _, step in together])
    atol, rtol = TOLERANCES[dtype]
    for j, ((cache, (kind, kw), (q, k, v)), outcome, (want, pk, pv)) in enumerate(zip(together, outcomes, expected)):
        assert not isinstance(outcome, Exception), outcome
        assert torch.equal(outcome.output, want), f"cache {j} ({kind}): batched differs from alone"
        t = cache.tokens_seen
        pos = attended_positions(kind, t, kw.get("window", 0), kw.get("sinks", 0))
        resident = resident_positions(kind, t - 1, **kw)
        hist_k = dict(zip(resident, pk.unbind(2)))
        hist_v = dict(zip(resident, pv.unbind(2)))
        hist_k[t - 1], hist_v[t - 1] = k, v
        kk = torch.stack([hist_k[p] for p in pos], 2).double().cpu().numpy()
        vv = torch.stack([hist_v[p] for p in pos], 2).double().cpu().numpy()
        ref = attention_ref(q.double().cpu().numpy(), kk, vv, q.shape[1], k.shape[1])
        torch.testing.assert_close(
            outcome.output.double().cpu(),
            torch.from_numpy(ref),
            atol=atol,
            rtol=rtol,
            msg=lambda m, where=f"cache {j} ({kind}, T={t})": f"{where}: {m}",
        )


@pytest.mark.gpu
@needs_cuda
def test_gpu_step_many_failure_after_the_writes_restores_every_row(monkeypatch):
    pytest.importorskip("triton")
    from backends import triton_decode
    from backends.batch import BatchStep, step_many

    caches = _gpu_caches(12, torch.float16, (32, 8, 128), seed=5)
    before = [(c._k.clone(), c._v.clone(), c.tokens_seen) for c, _, _ in caches]
    real = triton_decode._launch_batched
    written = []

    def failing(*args, **kwargs):
        torch.cuda.synchronize()
        written.append(sum(not torch.equal(b[0], c._k) for b, (c, _, _) in zip(before, caches)))
        raise RuntimeError("injected after the writes")

    monkeypatch.setattr(triton_decode, "_launch_batched", failing)
    outcomes = step_many([BatchStep(c, *step) for c, _, step in caches])
    monkeypatch.setattr(triton_decode, "_launch_batched", real)
    assert written == [12]
    assert all(isinstance(o, RuntimeError) for o in outcomes)
    for (k, v, t), (c, _, _) in zip(before, caches):
        assert c.tokens_seen == t
        assert torch.equal(k.view(torch.int16), c._k.view(torch.int16))
        assert torch.equal(v.view(torch.int16), c._v.view(torch.int16))
