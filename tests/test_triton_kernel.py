"""The Triton decode kernels under Triton's interpreter, on CPU tensors, against the oracle.

``TRITON_INTERPRET=1`` only works if it is set before ``triton`` is first imported, and other
modules in this pytest process may import ``triton`` (bitsandbytes does). So the kernels run in
one subprocess (this file run as ``python -m tests.test_triton_kernel WORKER_OUT``) that writes
every case's inputs and outputs to a file; the tests here, in the pytest process, compare them
with the float64 oracle. The subprocess runs once per session (a module fixture).

Covered: each policy's row runs (one run, a wrapped window, sinks plus a wrapped window), odd
lengths, several splits and one split (the direct-write path), G in {1, 3, 4, 8}, B in {1, 2},
a head width that is not a power of two, extreme scores, float16, bfloat16, float32, and the
int8 variant (against the oracle on the dequantized cache, and against the original data within
a documented budget); then the ``cuda`` backend's cache itself (CPU tensors, Triton attention)
stepped through every policy with prefill, wrap-around and a rollback.

bfloat16 note: the interpreter (Triton 3.9) multiplies bfloat16 ``tl.dot`` operands wrongly and
converts int8 to bfloat16 wrongly, so for bfloat16 on CPU tensors the kernel widens the operands
(already rounded to bfloat16; int8 codes directly) to float32 just before each product
(``UPCAST``). Loads, stores, the rounding of probabilities to bfloat16 and everything else run as
on the GPU; the bfloat16 products themselves are checked by the ``gpu`` tests.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.oracle import attended_positions, attention_ref

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# (atol, rtol) against the float64 oracle on the same (rounded or dequantized) inputs. The
# kernel rounds the probabilities to the cache dtype before the P.V product and the output to
# the query's dtype.
TOLERANCES = {
    "float16": (4e-3, 4e-3),
    "bfloat16": (3e-2, 2e-2),
    "float32": (2e-5, 1e-4),
}
# int8 against the *original* (unquantized) data: absmax/127 codes err by at most half a step
# (|x|max/254) per element; through softmax-weighted averages that stays well inside this.
INT8_BUDGET = (6e-2, 6e-2)

BLOCK_N = 16  # the smallest tl.dot block: several blocks per split on tiny shapes


@dataclass(frozen=True)
class KernelCase:
    id: str
    batch: int
    heads: tuple[int, int]  # (Hq, Hkv)
    head_dim: int
    capacity: int
    runs: tuple[tuple[int, int], ...]
    dtype: str
    splits: int | None = None  # None: the planner's choice
    int8: bool = False
    query_scale: float = 1.0  # > 1 makes the scores extreme


KERNEL_CASES = [
    KernelCase("none-one-run-odd", 1, (8, 2), 32, 48, ((0, 37),), "float16"),
    KernelCase("strict-wrapped-g1", 2, (2, 2), 16, 33, ((20, 33), (0, 8)), "float16", splits=3),
    KernelCase("sink-wrapped", 2, (8, 2), 32, 40, ((0, 4), (30, 40), (4, 17)), "float16", splits=2),
    KernelCase("single-row", 1, (8, 2), 16, 8, ((5, 6),), "float16"),
    KernelCase("odd-g3-d24", 1, (6, 2), 24, 30, ((7, 30), (0, 3)), "float16", splits=2),
    KernelCase("mqa-g8-planner", 2, (8, 1), 16, 131, ((0, 129),), "float16"),
    KernelCase("extreme-scores", 1, (8, 2), 32, 40, ((10, 40), (0, 9)), "float16", splits=2, query_scale=40.0),
    KernelCase("bf16-sink-wrapped", 2, (8, 2), 32, 40, ((0, 4), (30, 40), (4, 17)), "bfloat16", splits=3),
    KernelCase("bf16-one-split", 1, (4, 4), 16, 25, ((0, 25),), "bfloat16", splits=1),
    KernelCase("fp32-wrapped", 1, (8, 2), 16, 33, ((20, 33), (0, 8)), "float32", splits=2),
    KernelCase("int8-sink-wrapped", 2, (8, 2), 32, 40, ((0, 4), (30, 40), (4, 17)), "float16", splits=3, int8=True),
    KernelCase("int8-bf16-g1", 2, (2, 2), 16, 41, ((9, 41), (0, 2)), "bfloat16", int8=True),
    KernelCase("int8-one-split-odd", 1, (8, 2), 32, 19, ((0, 19),), "float16", splits=1, int8=True),
]


@dataclass(frozen=True)
class CacheCase:
    id: str
    policy: str
    kw: dict = field(default_factory=dict)
    batch: int = 1
    heads: tuple[int, int] = (8, 2)
    head_dim: int = 16
    dtype: str = "float16"
    prefill: int = 0
    steps: int = 12
    rollback_at: int | None = None  # before this step, drop the last 2 tokens


CACHE_CASES = [
    CacheCase("none-prefill", "none", dict(capacity=24), prefill=5, steps=12, rollback_at=6),
    CacheCase("strict-wraps-twice", "strict", dict(window=7), batch=2, heads=(2, 2), steps=17),
    CacheCase("greedy-blocks-bf16", "greedy", dict(window=5, capacity=8), dtype="bfloat16", steps=16, rollback_at=12),
    CacheCase("sink-prefill-wrapped", "sink", dict(window=6, sinks=3), batch=2, prefill=4, steps=14),
]


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax/127 per row (the last dim): codes int8, scales float32."""
    scales = x.abs().amax(-1).clamp_min(1e-8) / 127
    return torch.round(x / scales[..., None]).clamp(-127, 127).to(torch.int8), scales


def _kernel_inputs(case: KernelCase) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    hq, hkv = case.heads
    n, c, d = case.batch * hkv, case.capacity, case.head_dim
    dtype = DTYPES[case.dtype]
    q = (torch.randn(case.batch, hq, d, generator=gen) * case.query_scale).to(dtype)
    k = torch.randn(n, c, d, generator=gen)
    v = torch.randn(n, c, d, generator=gen)
    if case.int8:
        return dict(q=q, k_orig=k, v_orig=v, k=_quantize(k), v=_quantize(v))
    return dict(q=q, k=k.to(dtype), v=v.to(dtype))


# -- the worker (runs under the interpreter) --------------------------------------------------

def _worker(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import triton
    from dataclasses import replace

    from backends import triton_decode as td
    from backends.base import CacheSpec
    from backends.cuda import CUDACache
    from backends.policy import EvictionPolicy

    config = replace(td.DEFAULT_CONFIG, block_n=BLOCK_N)
    results: dict = {"triton": triton.__version__, "kernels": {}, "caches": {}, "errors": {}}
    for case in KERNEL_CASES:
        inp = _kernel_inputs(case)
        kw = dict(num_kv_heads=case.heads[1], config=config, num_splits=case.splits)
        if case.int8:
            (kc, ks), (vc, vs) = inp["k"], inp["v"]
            out = td.decode_attention_int8(inp["q"], kc, ks, vc, vs, case.runs, **kw)
        else:
            out = td.decode_attention(inp["q"], inp["k"], inp["v"], case.runs, **kw)
        total = sum(b - a for a, b in case.runs)
        results["kernels"][case.id] = dict(
            inputs=inp, output=out,
            splits=case.splits or td.plan_splits(total, case.batch * case.heads[1], td._CPU_SMS, config)[0],
        )

    for case in CACHE_CASES:
        hq, hkv = case.heads
        dtype = DTYPES[case.dtype]
        spec = CacheSpec(case.batch, hq, hkv, case.head_dim, dtype,
                         EvictionPolicy.create(case.policy, **case.kw), device="cpu")
        cache = CUDACache(spec, attention="triton", kernel_config=config)
        gen = torch.Generator().manual_seed(7)
        kv_shape = (case.batch, hkv, case.head_dim)
        record = dict(prefill=None, steps=[], export=None)
        if case.prefill:
            pk = torch.randn(case.batch, hkv, case.prefill, case.head_dim, generator=gen).to(dtype)
            pv = torch.randn(case.batch, hkv, case.prefill, case.head_dim, generator=gen).to(dtype)
            cache.prefill(pk, pv)
            record["prefill"] = (pk, pv)
        for i in range(case.steps):
            rolled = case.rollback_at == i
            if rolled:
                cache.rollback(2)
            q = torch.randn(case.batch, hq, case.head_dim, generator=gen).to(dtype)
            k = torch.randn(*kv_shape, generator=gen).to(dtype)
            v = torch.randn(*kv_shape, generator=gen).to(dtype)
            outcome = cache.step(q, k, v)
            record["steps"].append(dict(q=q, k=k, v=v, rolled=rolled, out=outcome.output,
                                        bytes_moved=outcome.bytes_moved))
        record["export"] = cache.export()
        results["caches"][case.id] = record

    q = torch.randn(1, 4, 16, dtype=torch.float16)
    kv = torch.randn(2, 8, 16, dtype=torch.float16)
    bad = {
        "four-runs": lambda: td.decode_attention(q, kv, kv, [(0, 1), (2, 3), (4, 5), (6, 7)], num_kv_heads=2),
        "empty-runs": lambda: td.decode_attention(q, kv, kv, [(3, 3)], num_kv_heads=2),
        "run-outside": lambda: td.decode_attention(q, kv, kv, [(4, 9)], num_kv_heads=2),
        "dtype-mismatch": lambda: td.decode_attention(q, kv.float(), kv.float(), [(0, 8)], num_kv_heads=2),
        "int8-codes-not-int8": lambda: td.decode_attention_int8(q, kv, kv[..., 0].float(), kv, kv[..., 0].float(), [(0, 8)], num_kv_heads=2),
    }
    for name, call in bad.items():
        try:
            call()
            results["errors"][name] = None
        except (ValueError, TypeError) as exc:
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
    torch.save(results, path)


def _aot_worker(path: str) -> None:
    """Compiles the split kernel ahead of time for sm_90 (no GPU needed: Triton bundles ptxas)
    with the alignment the JIT infers for 16-byte aligned tensors, and counts load/MMA forms."""
    import json
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends import triton_decode as td

    fn = td._split_kernel
    names = fn.arg_names
    report = {}
    for dtype, quant in AOT_VARIANTS:
        ptr = "*" + dtype
        sig, const = {}, dict(G=4, D=128, G_PAD=16, D_PAD=128, BLOCK_N=td.DEFAULT_CONFIG.block_n,
                              QUANT=quant, DIRECT=False, UPCAST=False)
        for n in names:
            if n in const:
                sig[n] = "constexpr"
            elif n == "Q":
                sig[n] = ptr
            elif n in ("K", "V"):
                sig[n] = "*i8" if quant else ptr
            elif n in ("KS", "VS"):
                sig[n] = "*fp32" if quant else ptr
            elif n in ("O", "LSE"):
                sig[n] = "*fp32"
            else:
                sig[n] = "fp32" if n == "qk_scale" else "i32"
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                 if sig[n].startswith("*") or n.startswith("stride") or n == "chunk"}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=td.DEFAULT_CONFIG.num_warps, num_stages=td.DEFAULT_CONFIG.num_stages))
        ptx = kernel.asm["ptx"]
        report[f"{dtype}-{'int8' if quant else 'dense'}"] = dict(
            vector_or_async=len(re.findall(r"cp\.async\.cg\.shared\.global|ld\.global\.v4", ptx)),
            scalar_b16=len(re.findall(r"ld\.global\.b16", ptx)),
            mma=len(re.findall(r"\bmma\.sync|wgmma", ptx)),
        )
    with open(path, "w") as f:
        json.dump(report, f)


AOT_VARIANTS = [("fp16", False), ("bf16", False), ("fp16", True), ("bf16", True)]


if __name__ == "__main__":
    if sys.argv[1] == "--aot":
        _aot_worker(sys.argv[2])
    else:
        _worker(sys.argv[1])
    sys.exit(0)


# -- the tests (in the pytest process) --------------------------------------------------------

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton not installed (the 'triton' extra)")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton-interpret") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_triton_kernel", str(path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(path, weights_only=False)


def _assert_close(got: torch.Tensor, ref: np.ndarray, tol: tuple[float, float], what: str) -> None:
    atol, rtol = tol
    torch.testing.assert_close(got.double(), torch.from_numpy(ref), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _gather(rows_tensor: torch.Tensor, runs, batch: int, hkv: int) -> np.ndarray:
    """(N, C, D) -> (B, Hkv, S, D) float64 over the attended rows, in run order."""
    idx = [r for a, b in runs for r in range(a, b)]
    x = rows_tensor.double()[:, idx]
    return x.view(batch, hkv, len(idx), -1).numpy()


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c.id for c in KERNEL_CASES])
def test_kernel_matches_oracle(interpreted, case):
    res = interpreted["kernels"][case.id]
    inp, out = res["inputs"], res["output"]
    hq, hkv = case.heads
    assert out.shape == (case.batch, hq, case.head_dim) and out.dtype == DTYPES[case.dtype]
    if case.int8:
        (kc, ks), (vc, vs) = inp["k"], inp["v"]
        k, v = kc.double() * ks.double()[..., None], vc.double() * vs.double()[..., None]
    else:
        k, v = inp["k"], inp["v"]
    ref = attention_ref(inp["q"].double().numpy(), _gather(k, case.runs, case.batch, hkv),
                        _gather(v, case.runs, case.batch, hkv), hq, hkv)
    _assert_close(out, ref, TOLERANCES[case.dtype], case.id)


@pytest.mark.parametrize("case", [c for c in KERNEL_CASES if c.int8], ids=[c.id for c in KERNEL_CASES if c.int8])
def test_int8_kernel_within_budget_of_full_precision(interpreted, case):
    res = interpreted["kernels"][case.id]
    inp = res["inputs"]
    hq, hkv = case.heads
    ref = attention_ref(inp["q"].double().numpy(), _gather(inp["k_orig"], case.runs, case.batch, hkv),
                        _gather(inp["v_orig"], case.runs, case.batch, hkv), hq, hkv)
    _assert_close(res["output"], ref, INT8_BUDGET, case.id)


def test_the_grid_exercises_split_and_direct_paths(interpreted):
    splits = {c.id: interpreted["kernels"][c.id]["splits"] for c in KERNEL_CASES}
    assert any(s == 1 for s in splits.values()) and any(s > 1 for s in splits.values()), splits
    assert splits["mqa-g8-planner"] > 1, "the planner should split 129 rows (9 blocks) over 2 heads on 4 'SMs'"


def _resident(case: CacheCase, t: int) -> list[int]:
    """docs/eviction.md's table, independent of backends/policy.py."""
    kw = case.kw
    if case.policy == "none":
        return list(range(t))
    if case.policy == "strict":
        return list(range(max(0, t - kw["window"]), t))
    if case.policy == "greedy":
        c, w = kw["capacity"], kw["window"]
        g = c - w + 1
        length = t if t <= c else t - g * math.ceil((t - c) / g)
        return list(range(t - length, t))
    return list(range(min(t, kw["sinks"]))) + [p for p in range(max(0, t - kw["window"]), t) if p >= kw["sinks"]]


def _replay(case: CacheCase, record: dict):
    """The token history kept here, and for each step (index, T, step record, reference)."""
    hist_k, hist_v = [], []
    if record["prefill"] is not None:
        pk, pv = record["prefill"]
        hist_k += list(pk.unbind(2))
        hist_v += list(pv.unbind(2))
    hq, hkv = case.heads
    checks = []
    for i, step in enumerate(record["steps"]):
        if step["rolled"]:
            del hist_k[-2:], hist_v[-2:]
        hist_k.append(step["k"])
        hist_v.append(step["v"])
        t = len(hist_k)
        pos = attended_positions(case.policy, t, case.kw.get("window", 0), case.kw.get("sinks", 0))
        kk = torch.stack([hist_k[p] for p in pos], 2).double().numpy()
        vv = torch.stack([hist_v[p] for p in pos], 2).double().numpy()
        checks.append((i, t, step, attention_ref(step["q"].double().numpy(), kk, vv, hq, hkv)))
    return hist_k, hist_v, checks


@pytest.mark.parametrize("case", CACHE_CASES, ids=[c.id for c in CACHE_CASES])
def test_cache_steps_match_oracle(interpreted, case):
    *_, checks = _replay(case, interpreted["caches"][case.id])
    assert len(checks) == case.steps
    for i, t, step, ref in checks:
        assert step["bytes_moved"] == 0
        _assert_close(step["out"], ref, TOLERANCES[case.dtype], f"{case.id} step {i} (T={t})")


@pytest.mark.parametrize("case", CACHE_CASES, ids=[c.id for c in CACHE_CASES])
def test_cache_export_in_position_order(interpreted, case):
    record = interpreted["caches"][case.id]
    hist_k, hist_v, _ = _replay(case, record)
    resident = _resident(case, len(hist_k))
    ek, ev = record["export"]
    assert torch.equal(ek, torch.stack([hist_k[p] for p in resident], 2))
    assert torch.equal(ev, torch.stack([hist_v[p] for p in resident], 2))


BAD_INPUTS = {
    "four-runs": "ValueError: runs: at most 3",
    "empty-runs": "ValueError: runs: nothing to attend to",
    "run-outside": "ValueError: runs: run [4, 9) lies outside",
    "dtype-mismatch": "TypeError: keys/values dtype",
    "int8-codes-not-int8": "TypeError: key_codes: expected int8",
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_are_refused_with_a_clear_error(interpreted, name):
    got = interpreted["errors"][name]
    assert got is not None and got.startswith(BAD_INPUTS[name]), got


def test_kernel_compiles_for_hopper_with_vector_loads_and_mma(tmp_path):
    """No GPU needed: the compiled (not interpreted) kernel for sm_90 must stream K/V with
    16-byte asynchronous or vector loads and use tensor-core MMAs; scalar 2-byte loads of the
    cache would cap the bandwidth far below the target."""
    import json

    path = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_triton_kernel", "--aot", str(path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ahead-of-time compile failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(path.read_text())
    assert len(report) == len(AOT_VARIANTS)
    for name, counts in report.items():
        assert counts["mma"] > 0, (name, counts)
        assert counts["vector_or_async"] > 0 and counts["scalar_b16"] == 0, (name, counts)
