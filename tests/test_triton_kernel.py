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
stepped through every policy with prefill, wrap-around and a rollback; then the batched step
(``decode_batched`` through ``backends.batch.step_many``): a grid of float16/bfloat16, D in
{64, 128}, G in {1, 4} over one split, several splits, a wrapped window and sinks, against the
oracle and bit-identical to the same steps alone; batches of 1, 7 and 16 bit-identical to alone;
refused steps refused alone; a failure injected after the row writes restoring every row.

bfloat16 note: the interpreter (Triton 3.9) multiplies bfloat16 ``tl.dot`` operands wrongly and
converts int8 to bfloat16 wrongly, so for bfloat16 on CPU tensors the kernel widens the operands
(already rounded to bfloat16; int8 codes directly) to float32 just before each product
(``UPCAST``). Loads, stores, the rounding of probabilities to bfloat16 and everything else run as
on the GPU; the bfloat16 products themselves are checked by the ``gpu`` tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.oracle import attended_positions, attention_ref, resident_positions

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
SPLIT_TOKENS = 32  # the batched kernel's split: several splits per KV head on tiny shapes


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


# The batched step (``triton_decode.decode_batched`` through ``backends.batch.step_many``): a grid
# of dtypes and head shapes (G in {1, 4}, D in {64, 128}), each with caches whose attended rows
# make one split, several splits, a wrapped window and sinks plus a wrapped window
# (SPLIT_TOKENS rows per split), stepped ROUNDS times alone and in one batch. Kept small: each
# interpreted program costs ~30 ms.
BATCH_DTYPES = ["float16", "bfloat16"]
BATCH_HEADS = [(2, 2, 64), (8, 2, 64), (2, 2, 128), (8, 2, 128)]  # (Hq, Hkv, D)
ROUNDS = 1


@dataclass(frozen=True)
class Stream:
    policy: str
    kw: dict
    prefill: int
    batch: int = 1


STREAMS = [
    Stream("greedy", dict(window=6, capacity=9), 0, batch=2),  # 1 row: one split, B = 2
    Stream("none", dict(capacity=80), 70),  # 71 rows: three splits
    Stream("strict", dict(window=40), 55),  # a wrapped window of 40: two splits
    Stream("sink", dict(window=30, sinks=3), 50),  # 3 sinks plus a wrapped window of 30
]
# Bit-identity alone vs batches of 1 (one cache per stream kind), 7 and IDENTITY_CACHES (one
# launch), on one head shape.
IDENTITY_HEADS = (8, 2, 64)
IDENTITY_CACHES = 16


def _stream_inputs(stream: Stream, dtype: str, heads: tuple[int, int, int], seed: int):
    """Prefill keys and values (B, Hkv, S, D) and ROUNDS step tensors (q, k, v)."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    dt, b = DTYPES[dtype], stream.batch

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    prefill = rand(b, hkv, stream.prefill, d), rand(b, hkv, stream.prefill, d)
    return prefill, [(rand(b, hq, d), rand(b, hkv, d), rand(b, hkv, d)) for _ in range(ROUNDS)]


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


def _patch_each_language_once() -> None:
    """The interpreter patches ``triton.language`` again on every call of a ``@triton.jit``
    helper inside a running kernel (Triton 3.9: ``InterpretedFunction.__call__``): a scan of the
    module's members, ~2 ms, which finds nothing to change once the launch (or an earlier helper)
    has patched the modules that helper sees. With ~24,000 helper calls it was half of this
    worker's time (45 s -> 30 s here, every output bit-identical). Skipped here when each
    language module the function sees is patched already (its ``load`` no longer the builtin);
    every other patch, and its undoing, is the interpreter's."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope is None:  # another Triton: its own behaviour, only slower
        return
    import inspect

    import triton.language as tl

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return scope()  # every language module this function sees is patched already
        return patch(fn)

    interpreter._patch_lang = patch_once


def _worker(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dataclasses import replace

    import triton

    _patch_each_language_once()

    from backends import triton_decode as td
    from backends.contract import CacheSpec
    from backends.cuda import CUDACache
    from backends.policy import EvictionPolicy

    config = replace(td.DEFAULT_CONFIG, block_n=BLOCK_N, split_tokens=SPLIT_TOKENS)
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
            inputs=inp,
            output=out,
            splits=case.splits or td.plan_splits(total, case.batch * case.heads[1], td._CPU_SMS, config)[0],
        )

    for case in CACHE_CASES:
        hq, hkv = case.heads
        dtype = DTYPES[case.dtype]
        spec = CacheSpec(
            case.batch, hq, hkv, case.head_dim, dtype, EvictionPolicy.create(case.policy, **case.kw), device="cpu"
        )
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
            record["steps"].append(
                dict(q=q, k=k, v=v, rolled=rolled, out=outcome.output, bytes_moved=outcome.bytes_moved)
            )
        record["export"] = cache.export()
        results["caches"][case.id] = record

    q = torch.randn(1, 4, 16, dtype=torch.float16)
    kv = torch.randn(2, 8, 16, dtype=torch.float16)
    bad = {
        "four-runs": lambda: td.decode_attention(q, kv, kv, [(0, 1), (2, 3), (4, 5), (6, 7)], num_kv_heads=2),
        "empty-runs": lambda: td.decode_attention(q, kv, kv, [(3, 3)], num_kv_heads=2),
        "run-outside": lambda: td.decode_attention(q, kv, kv, [(4, 9)], num_kv_heads=2),
        "dtype-mismatch": lambda: td.decode_attention(q, kv.float(), kv.float(), [(0, 8)], num_kv_heads=2),
        "int8-codes-not-int8": lambda: td.decode_attention_int8(
            q, kv, kv[..., 0].float(), kv, kv[..., 0].float(), [(0, 8)], num_kv_heads=2
        ),
    }
    for name, call in bad.items():
        try:
            call()
            results["errors"][name] = None
        except (ValueError, TypeError) as exc:
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
    results["batched"] = _batched_worker(config)
    torch.save(results, path)


def _batched_worker(config) -> dict:
    from backends import triton_decode as td
    from backends.batch import BatchStep, step_many
    from backends.contract import CacheSpec
    from backends.cuda import CUDACache
    from backends.errors import CacheFullError
    from backends.policy import EvictionPolicy

    def build(stream: Stream, dtype: str, heads, seed: int):
        hq, hkv, d = heads
        spec = CacheSpec(
            stream.batch, hq, hkv, d, DTYPES[dtype], EvictionPolicy.create(stream.policy, **stream.kw), device="cpu"
        )
        cache = CUDACache(spec, attention="triton", kernel_config=config)
        prefill, steps = _stream_inputs(stream, dtype, heads, seed)
        if stream.prefill:
            cache.prefill(*prefill)
        return cache, steps

    def batched(caches, steps, r):
        outcomes = step_many([BatchStep(c, *st[r]) for c, st in zip(caches, steps)])
        for o in outcomes:
            if isinstance(o, Exception):
                raise o
        return [o.output for o in outcomes]

    def storage(cache):
        return cache._k.clone(), cache._v.clone(), cache.tokens_seen

    def same_storage(a, b):
        return a[2] == b[2] and all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a[:2], b[:2]))

    out: dict = {"grid": {}}
    for dtype in BATCH_DTYPES:
        for heads in BATCH_HEADS:
            alone = [build(st, dtype, heads, seed=j) for j, st in enumerate(STREAMS)]
            together = [build(st, dtype, heads, seed=j) for j, st in enumerate(STREAMS)]
            rec = dict(alone=[], batched=[])
            for r in range(ROUNDS):
                rec["alone"].append([c.step(*st[r]).output for c, st in alone])
                rec["batched"].append(batched([c for c, _ in together], [st for _, st in together], r))
            out["grid"][f"{dtype}-{heads}"] = rec

    # Alone vs batches of 1, 7 and IDENTITY_CACHES.
    streams = [(STREAMS[j % len(STREAMS)], 100 + j) for j in range(IDENTITY_CACHES)]
    copies = {
        name: [build(st, "float16", IDENTITY_HEADS, seed) for st, seed in streams[:size]]
        for name, size in (("alone", IDENTITY_CACHES), ("one", len(STREAMS)), ("seven", 7), ("large", IDENTITY_CACHES))
    }
    ident = dict(alone=[c.step(*st[0]).output for c, st in copies["alone"]])
    ident["one"] = [batched([c], [st], 0)[0] for c, st in copies["one"]]
    for name in ("seven", "large"):
        ident[name] = batched([c for c, _ in copies[name]], [st for _, st in copies[name]], 0)
    out["identity"] = ident

    # A batch of 7 with three refused steps: each refused alone, before anything is written.
    seven = [(STREAMS[j % len(STREAMS)], 200 + j) for j in range(7)]
    alone = [build(st, "float16", IDENTITY_HEADS, seed) for st, seed in seven]
    caches = [build(st, "float16", IDENTITY_HEADS, seed) for st, seed in seven]
    full, full_steps = build(Stream("none", dict(capacity=5), 5), "float16", IDENTITY_HEADS, 300)
    caches[4] = (full, full_steps)
    before = [storage(c) for c, _ in caches]
    step_args = [list(st[0]) for _, st in caches]
    step_args[2][1] = torch.zeros(1, 3, IDENTITY_HEADS[2], dtype=torch.float16)  # 3 KV heads, not 2
    step_args[5][0] = step_args[5][0].float()  # the query's dtype is not the stream's
    outcomes = step_many([BatchStep(c, *a) for (c, _), a in zip(caches, step_args)])
    refused = {}
    for j in (2, 4, 5):
        # the refusal's kind: the standard type a caller catches (input errors subclass these)
        kind = next(
            t.__name__ for t in (CacheFullError, ValueError, TypeError, Exception) if isinstance(outcomes[j], t)
        )
        refused[j] = dict(error=kind, unchanged=same_storage(before[j], storage(caches[j][0])))
    kept = [j for j in range(7) if j not in refused]
    out["refused"] = dict(
        refused=refused,
        kept_equal=[torch.equal(outcomes[j].output, alone[j][0].step(*alone[j][1][0]).output) for j in kept],
    )

    # A failure after the writes (the attention launch raises): every row put back byte for byte.
    caches = [build(st, "float16", IDENTITY_HEADS, seed) for st, seed in seven]
    alone = [build(st, "float16", IDENTITY_HEADS, seed) for st, seed in seven]
    before = [storage(c) for c, _ in caches]
    written = []

    def failing_launch(*args, **kwargs):
        written.append(sum(not same_storage(b, storage(c)) for b, (c, _) in zip(before, caches)))
        raise RuntimeError("injected after the writes")

    real_launch, td._launch_batched = td._launch_batched, failing_launch
    try:
        outcomes = step_many([BatchStep(c, *st[0]) for c, st in caches])
    finally:
        td._launch_batched = real_launch
    failed = dict(
        written_before_failure=written,
        errors=[str(o) if isinstance(o, Exception) else None for o in outcomes],
        unchanged=[same_storage(b, storage(c)) for b, (c, _) in zip(before, caches)],
    )
    # The same steps again, now without the failure: as if the failed call never happened.
    again = batched([c for c, _ in caches], [st for _, st in caches], 0)
    failed["then_equal"] = [torch.equal(o, c.step(*st[0]).output) for o, (c, st) in zip(again, alone)]
    # The single step's path (the base class's save/restore around the attention).
    cache, steps = build(STREAMS[3], "float16", IDENTITY_HEADS, 400)
    before_one = storage(cache)
    cache._attend = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
    try:
        cache.step(*steps[0])
        failed["single_raised"] = False
    except RuntimeError:
        failed["single_raised"] = True
    failed["single_unchanged"] = same_storage(before_one, storage(cache))
    out["failed"] = failed
    return out


def _aot_worker(path: str) -> None:
    """Compiles the split kernel ahead of time for sm_90 (no GPU needed: Triton bundles ptxas)
    with the alignment the JIT infers for 16-byte aligned tensors, and counts load/MMA forms."""
    import json
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends import triton_decode as td

    def compile_ptx(fn, sig: dict, const: dict, attrs: dict) -> str:
        names = fn.arg_names
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=td.DEFAULT_CONFIG.num_warps, num_stages=td.DEFAULT_CONFIG.num_stages),
        )
        return kernel.asm["ptx"]

    def load_forms(ptx: str) -> dict:
        return dict(
            vector_or_async=len(re.findall(r"cp\.async\.cg\.shared\.global|ld\.global\.v4", ptx)),
            scalar_b16=len(re.findall(r"ld\.global\.b16", ptx)),
            mma=len(re.findall(r"\bmma\.sync|wgmma", ptx)),
        )

    fn = td._split_kernel
    names = fn.arg_names
    report = {}
    for dtype, quant in AOT_VARIANTS:
        ptr = "*" + dtype
        sig, const = (
            {},
            dict(
                G=4,
                D=128,
                G_PAD=16,
                D_PAD=128,
                BLOCK_N=td.DEFAULT_CONFIG.block_n,
                QUANT=quant,
                DIRECT=False,
                UPCAST=False,
            ),
        )
        for n in names:
            if n in const:
                sig[n] = "constexpr"
            elif n == "Q":
                sig[n] = ptr
            elif n in ("K", "V"):
                sig[n] = "*i8" if quant else ptr
            elif n in ("KS", "VS"):
                sig[n] = "*fp32" if quant else ptr
            elif n in ("Out", "LSE"):
                sig[n] = "*fp32"
            else:
                sig[n] = "fp32" if n == "qk_scale" else "i32"
        attrs = {
            (names.index(n),): [["tt.divisibility", 16]]
            for n in names
            if sig[n].startswith("*") or n.startswith("stride") or n == "chunk"
        }
        ptx = compile_ptx(fn, sig, const, attrs)
        report[f"{dtype}-{'int8' if quant else 'dense'}"] = load_forms(ptx)
    # The batched kernel reads its caches through addresses in a descriptor: the alignment hint
    # on the cast pointers must survive, or every K/V load would be scalar.
    fn = td._batched_kernel
    names = fn.arg_names
    for dtype in ("fp16", "bf16"):
        const = dict(
            G=4, D=128, G_PAD=16, D_PAD=128, BLOCK_N=td.DEFAULT_CONFIG.block_n, UPCAST=False, DESC_W=td._DESC_W
        )
        sig = {
            n: "constexpr"
            if n in const
            else "*i64"
            if n in ("DESC", "WORK", "COUNT")
            else "*fp32"
            if n in ("PART", "LSE")
            else "*" + dtype
            if n == "OUT"
            else "fp32"
            for n in names
        }
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")}
        ptx = compile_ptx(fn, sig, const, attrs)
        report[f"{dtype}-batched"] = dict(
            load_forms(ptx), acq_rel_atomic=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx))
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

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed (the 'triton' extra)"
)


def _run_worker(args: list[str], env: dict, what: str) -> None:
    """Runs this module as a script (``__main__`` below) from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_kernel", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton-interpret") / "results.pt"
    _run_worker([str(path)], dict(os.environ, TRITON_INTERPRET="1"), "interpreter worker")
    return torch.load(path, weights_only=False)


def _assert_close(got: torch.Tensor, ref: np.ndarray, tol: tuple[float, float], what: str) -> None:
    atol, rtol = tol
    torch.testing.assert_close(got.double(), torch.from_numpy(ref), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


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
    ref = attention_ref(
        inp["q"].double().numpy(),
        _gather(k, case.runs, case.batch, hkv),
        _gather(v, case.runs, case.batch, hkv),
        hq,
        hkv,
    )
    _assert_close(out, ref, TOLERANCES[case.dtype], case.id)


@pytest.mark.parametrize("case", [c for c in KERNEL_CASES if c.int8], ids=[c.id for c in KERNEL_CASES if c.int8])
def test_int8_kernel_within_budget_of_full_precision(interpreted, case):
    res = interpreted["kernels"][case.id]
    inp = res["inputs"]
    hq, hkv = case.heads
    ref = attention_ref(
        inp["q"].double().numpy(),
        _gather(inp["k_orig"], case.runs, case.batch, hkv),
        _gather(inp["v_orig"], case.runs, case.batch, hkv),
        hq,
        hkv,
    )
    _assert_close(res["output"], ref, INT8_BUDGET, case.id)


def test_the_grid_exercises_split_and_direct_paths(interpreted):
    splits = {c.id: interpreted["kernels"][c.id]["splits"] for c in KERNEL_CASES}
    assert any(s == 1 for s in splits.values()) and any(s > 1 for s in splits.values()), splits
    assert splits["mqa-g8-planner"] > 1, "the planner should split 129 rows (9 blocks) over 2 heads on 4 'SMs'"


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
    resident = resident_positions(case.policy, len(hist_k), **case.kw)
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


# -- the batched step ---------------------------------------------------------------------------

GRID_IDS = [f"{dt}-{h}" for dt in BATCH_DTYPES for h in BATCH_HEADS]


def _stream_refs(stream: Stream, dtype: str, heads, seed: int) -> list[np.ndarray]:
    """The oracle's output for each of the stream's ROUNDS steps."""
    hq, hkv, _ = heads
    (pk, pv), steps = _stream_inputs(stream, dtype, heads, seed)
    hist_k, hist_v = list(pk.unbind(2)), list(pv.unbind(2))
    refs = []
    for q, k, v in steps:
        hist_k.append(k)
        hist_v.append(v)
        pos = attended_positions(stream.policy, len(hist_k), stream.kw.get("window", 0), stream.kw.get("sinks", 0))
        kk = torch.stack([hist_k[p] for p in pos], 2).double().numpy()
        vv = torch.stack([hist_v[p] for p in pos], 2).double().numpy()
        refs.append(attention_ref(q.double().numpy(), kk, vv, hq, hkv))
    return refs


@pytest.mark.parametrize("grid_id", GRID_IDS)
def test_batched_steps_match_oracle_and_equal_alone(interpreted, grid_id):
    dtype, heads = grid_id.split("-", 1)
    heads = next(h for h in BATCH_HEADS if str(h) == heads)
    rec = interpreted["batched"]["grid"][grid_id]
    for j, stream in enumerate(STREAMS):
        for r, ref in enumerate(_stream_refs(stream, dtype, heads, seed=j)):
            alone, together = rec["alone"][r][j], rec["batched"][r][j]
            what = f"{grid_id} {stream.policy} round {r}"
            assert together.shape == (stream.batch, heads[0], heads[2]) and together.dtype == DTYPES[dtype], what
            _assert_close(together, ref, TOLERANCES[dtype], what)
            assert torch.equal(alone, together), f"{what}: batched differs from alone"


def test_the_batched_grid_exercises_one_and_several_splits():
    attended = {
        (s.policy, r): len(attended_positions(s.policy, s.prefill + r + 1, s.kw.get("window", 0), s.kw.get("sinks", 0)))
        for s in STREAMS
        for r in range(ROUNDS)
    }
    splits = {-(-n // SPLIT_TOKENS) for n in attended.values()}
    assert 1 in splits and max(splits) >= 3, attended


@pytest.mark.parametrize("size", ["one", "seven", "large"])
def test_batched_output_is_bit_identical_alone_and_in_batches(interpreted, size):
    """Alone (``step``) vs ``step_many`` in batches of 1, 7 and IDENTITY_CACHES (one launch each)."""
    ident = interpreted["batched"]["identity"]
    got = ident[size]
    assert len(got) == {"one": len(STREAMS), "seven": 7, "large": IDENTITY_CACHES}[size]
    for j, out in enumerate(got):
        assert torch.equal(out, ident["alone"][j]), f"cache {j}: batch {size} differs from alone"
    stream, seed = STREAMS[0], 100  # and the first is right, not only consistent
    _assert_close(got[0], _stream_refs(stream, "float16", IDENTITY_HEADS, seed)[0], TOLERANCES["float16"], size)


def test_batched_refused_steps_are_refused_alone(interpreted):
    rec = interpreted["batched"]["refused"]
    assert {j: r["error"] for j, r in rec["refused"].items()} == {2: "ValueError", 4: "CacheFullError", 5: "TypeError"}
    assert all(r["unchanged"] for r in rec["refused"].values()), rec
    assert rec["kept_equal"] == [True] * 4


def test_batched_failure_after_the_writes_restores_every_row(interpreted):
    rec = interpreted["batched"]["failed"]
    assert rec["written_before_failure"] == [7], "the failure was not injected after the row writes"
    assert rec["errors"] == ["injected after the writes"] * 7
    assert rec["unchanged"] == [True] * 7
    assert rec["then_equal"] == [True] * 7
    assert rec["single_raised"] and rec["single_unchanged"]


def test_kernel_compiles_for_hopper_with_vector_loads_and_mma(tmp_path):
    """No GPU needed: the compiled (not interpreted) kernels for sm_90 must stream K/V with
    16-byte asynchronous or vector loads and use tensor-core MMAs; scalar 2-byte loads of the
    cache would cap the bandwidth far below the target."""
    import json

    path = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run_worker(["--aot", str(path)], env, "ahead-of-time compile")
    report = json.loads(path.read_text())
    assert len(report) == len(AOT_VARIANTS) + 2
    for name, counts in report.items():
        assert counts["mma"] > 0, (name, counts)
        assert counts["vector_or_async"] > 0 and counts["scalar_b16"] == 0, (name, counts)
        if name.endswith("-batched"):  # the merge counter: release of the partials, acquire by the merger
            assert counts["acq_rel_atomic"] == 1, (name, counts)
