"""The compiled decode kernels (``backends/csrc/``) bound with ctypes, built on first use.

One C library serves every CPU cache: dense float32 / bfloat16 / float16 caches and the int8
cache's codes, on one online-softmax / split / merge core and one thread pool (see
``csrc/gqa_internal.h``: the overview, and one line per source file). Every ``.c`` file there
is compiled into the one shared library.
torch on the CPU widens half-precision and int8 storage with ops that write a float copy to
memory; the kernel widens in registers instead and reads each key and value once. It is plain C
with no Python or torch headers, so it builds in about a second with the system C compiler and
is loaded with ``ctypes`` (as Triton builds and caches its launcher stubs); ctypes releases the
GIL for each call. The public ``cache.step`` has one more, optional entry: ``load_torch_step``'s
module (``csrc/torch_step.cpp``, C++ against torch's headers) reads its tensors' shapes, dtypes
and pointers inline and calls ``gqa_step`` itself; where it cannot be built, the step goes
through ctypes, with the same results.

How and where the library is built and cached: ``backends.native_build``. Where it cannot be
built or loaded, ``load`` raises ``NativeUnavailable`` with the reason and the caches fall back
to their torch kernels (``GQA_NATIVE=0`` forces that).

Entry points (C): ``gqa_run(gqa_cache_t *caches, int64 n, int threads, int isa)`` computes the
steps or attentions of ``n`` caches in one call (``gqa_run_ptrs``: the same over descriptors
given by address); ``gqa_set_threads`` / ``gqa_threads`` size the pool; ``gqa_prewake(cache)``
(``gqa_prewake_heads(n)`` before a step of many caches) alerts it before a step that will use
it; ``gqa_usable_isas(d)``; ``gqa_hadamard_rows``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .key_layout import KeyBlocks
from .native_build import NativeUnavailable, build, build_torch_step, torch_step_path

__all__ = [
    "ENC",
    "ISA",
    "CacheDesc",
    "Kernel",
    "NativeUnavailable",
    "POLICY",
    "RESULT_COLUMNS",
    "RESULT_COLUMNS_ALL",
    "available",
    "check_layout",
    "layout_mirror",
    "build",
    "load",
    "load_torch_step",
    "set_threads",
    "threads",
]

# implementation choice passed to the kernel (the C enum), in order of speed
# "avx2": AVX2 with FMA and F16C, the x86-64 CPUs without AVX-512 (AMD Zen 1-3, Intel client cores);
# int8 scores and values by vpmaddwd on int16 query and weights
# "avx512dot": AVX-512 with the VNNI dot products (int8 scores and values by vpdpwssd on int16
# query and weights), where the CPU has VNNI; bfloat16 by vdpbf16ps where it has BF16 too ("auto"
# takes it for bfloat16 only where it is the faster way: Kernel.auto_isa)
ISA = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512dot": 4}
# storage / tensor encodings (the C enum)
ENC = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}
DTYPE_ENC = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAG_HALF_SCALES = 1
FLAG_FAIL_AFTER_WRITE = 2  # test builds only: fail after the write (the kernel restores the row)
FLAG_ROTATE = 4  # int8: values stored Hadamard-rotated (the step rotates the new value and the output)
FLAG_RECIPROCAL = 8  # int8, float32 scales: codes = round(x * (127 / absmax)), bitsandbytes' rounding
MAX_RUNS = 4
SPLIT_T = 1024  # positions per split (csrc/gqa_internal.h): a split's partial is merged in split order
FLAG_ISA_SHIFT = 4  # flags bits 4-6: a cache's own ISA (0: the call's)
# a descriptor's policy (the C enum), as backends.policy.PolicyKind values
POLICY = {"none": 0, "strict": 1, "greedy": 2, "sink": 3}
# gqa_step's result columns (the C enum): the numbers after a row's step
RESULT_COLUMNS = ("tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach")
RESULT_COLUMNS_ALL = RESULT_COLUMNS + ("attended", "write_row")


_threads = os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Sizes the process-wide pool the compiled kernels run on (the server's
    ``--kernel-threads``); ``n`` >= 1. The pool's threads are started on first use."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n > 256:
        raise ValueError(f"kernel threads must be an int in 1..256, got {n!r}")
    _threads = n
    if load.cache_info().currsize:
        try:
            load()._lib.gqa_set_threads(n)
        except NativeUnavailable:
            pass


def threads() -> int:
    """The size of the compiled kernels' thread pool."""
    return _threads


class CacheDesc(ctypes.Structure):
    """One cache's part of a ``gqa_run`` call (``gqa_cache_t`` in the C file): storage
    pointers and shapes, the attended runs, the step's tensors and where the output goes."""

    _fields_ = [
        ("enc", ctypes.c_int32),
        ("io", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("nruns", ctypes.c_int32),
        ("n", ctypes.c_int64),
        ("g", ctypes.c_int64),
        ("d", ctypes.c_int64),
        ("c", ctypes.c_int64),
        ("kstride", ctypes.c_int64),
        ("dk", ctypes.c_int64),
        ("no", ctypes.c_int64),
        ("scale_stride", ctypes.c_int64),
        ("runs", ctypes.c_int64 * (2 * MAX_RUNS)),
        ("write_row", ctypes.c_int64),
        ("qscale", ctypes.c_float),
        ("status", ctypes.c_int32),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("vs", ctypes.c_void_p),
        ("ko", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("order", ctypes.c_void_p),
        ("new_k", ctypes.c_void_p),
        ("new_v", ctypes.c_void_p),
        ("saved", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        # the cache's state, planned from by gqa_step (the library's once the cache exists)
        ("policy", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("window", ctypes.c_int64),
        ("sinks", ctypes.c_int64),
        ("t", ctypes.c_int64),
        ("python_below", ctypes.c_int64),
    ]

    def set_runs(self, runs) -> None:
        if len(runs) == 1:  # the common case
            r = self.runs
            r[0], r[1] = runs[0]
            self.nruns = 1
            return
        if not 1 <= len(runs) <= MAX_RUNS:
            raise ValueError(f"native kernel: {len(runs)} runs (1..{MAX_RUNS})")
        r = self.runs
        for i, (a, b) in enumerate(runs):
            r[2 * i] = a
            r[2 * i + 1] = b
        self.nruns = len(runs)


class Kernel:
    """The loaded library, with typed entry points."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.gqa_run.argtypes = [p, i64, i32, i32]
        lib.gqa_run.restype = i32
        lib.gqa_run_ptrs.argtypes = [p, i64, i32, i32]
        lib.gqa_run_ptrs.restype = i32
        lib.gqa_usable_isas.argtypes = [i64]
        lib.gqa_usable_isas.restype = i32
        lib.gqa_auto_isa.argtypes = [i64, i32]
        lib.gqa_auto_isa.restype = i32
        lib.gqa_set_threads.argtypes = [i32]
        lib.gqa_set_threads.restype = i32
        lib.gqa_threads.argtypes = []
        lib.gqa_threads.restype = i32
        lib.gqa_prewake.argtypes = [p]
        lib.gqa_prewake.restype = None
        lib.gqa_prewake_heads.argtypes = [ctypes.c_int64]
        lib.gqa_prewake_heads.restype = None
        lib.gqa_may_use_pool.argtypes = [p]
        lib.gqa_may_use_pool.restype = i32
        lib.gqa_hadamard_rows.argtypes = [p, i64, i64, i64]
        lib.gqa_hadamard_rows.restype = i32
        lib.gqa_layout.argtypes = [p, i64]
        lib.gqa_layout.restype = i64
        lib.gqa_step.argtypes = [p, i64, p, p, p, p, i64, p, i32, i32]
        lib.gqa_step.restype = i32
        lib.gqa_plan.argtypes = [p, p]
        lib.gqa_plan.restype = i32
        lib.gqa_rollback_reach.argtypes = [p]
        lib.gqa_rollback_reach.restype = i64
        mismatch = check_layout(library_layout(lib))
        if mismatch:
            raise NativeUnavailable(f"the native kernel at {path} does not match backends/native.py: {mismatch}")
        self._lib = lib
        # a test build's failure injection (csrc/test_hooks.c); the production library has none
        self.test_hooks = hasattr(lib, "gqa_test_hooks")
        if self.test_hooks:  # pool.c's order, recorded (tests/test_dense_kernel.py)
            lib.gqa_test_pool_order.argtypes = [i64, i32, i64, i64, p, p, p]
            lib.gqa_test_pool_order.restype = i32
        # a stamps build's time stamps of a step's parts (csrc/stamps.c, tests/bench/stamp_profile.py)
        self.stamps = hasattr(lib, "gqa_stamps")
        if self.stamps:
            lib.gqa_stamps.argtypes = [ctypes.POINTER(p)]
            lib.gqa_stamps.restype = ctypes.c_longlong
            lib.gqa_stamps_reset.argtypes = []
            lib.gqa_stamps_reset.restype = None
        self._run = lib.gqa_run
        self._run_ptrs = lib.gqa_run_ptrs
        self.step = lib.gqa_step
        # prewake(desc address): the pool's workers alerted when that cache's next step is
        # likely parallel, so that they are running when it starts (csrc/pool.c)
        self.prewake = lib.gqa_prewake
        self.may_use_pool = lib.gqa_may_use_pool
        # prewake_heads(n): the same before a step of many caches with n (cache, KV head) pairs
        self.prewake_heads = lib.gqa_prewake_heads
        lib.gqa_set_threads(_threads)

    # ``step``: the C function ``gqa_step`` itself (ctypes, the GIL released while it runs):
    #   step(caches, n, io, base, stride, results, rcols, status, threads, isa) -> 0 or -errno
    # caches: address of n descriptor addresses (distinct caches); io: address of n x 4 pointers
    # (row i's query, new key, new value, output) or None, then base: address of 4 pointers and
    # stride: address of 4 int64 byte strides (row i's tensor at base[j] + i * stride[j]);
    # results: address of n x rcols int64 (``RESULT_COLUMNS_ALL``, the first rcols >= 6), status:
    # address of n int32. Row i: status 0 and its numbers after the step (T incremented), or a
    # refusal with nothing written and zero numbers: -EAGAIN (the cache's own Python path, e.g.
    # int8 calibration), -ENOSPC (policy none, full), -EDOM (int8: a non-finite input or a key
    # beyond float16's range), -ERANGE (an int8 scale beyond float16),
    # -EIO (an injected failure after the write, restored), -EINVAL (address 0). A nonzero
    # return refuses the whole call (nothing written): ``raise_for``.

    def plan(self, desc: CacheDesc) -> tuple[int, list[int], list[tuple[int, int]]]:
        """The plan of ``desc``'s next step without taking it (tests: the C twin of
        ``backends.policy``): (status, the ``RESULT_COLUMNS_ALL`` numbers, the runs)."""
        out = (ctypes.c_int64 * (len(RESULT_COLUMNS_ALL) + 1 + 2 * MAX_RUNS))()
        rc = self._lib.gqa_plan(ctypes.addressof(desc), ctypes.addressof(out))
        k = len(RESULT_COLUMNS_ALL)
        runs = [(out[k + 1 + 2 * r], out[k + 2 + 2 * r]) for r in range(out[k])] if not rc else []
        return rc, list(out[:k]) if not rc else [], runs

    def rollback_reach(self, desc: CacheDesc) -> int:
        """``policy.rollback_reach(T)`` computed by the library from ``desc``'s state."""
        return self._lib.gqa_rollback_reach(ctypes.addressof(desc))

    def isas(self, head_dim: int) -> list[str]:
        """The implementations that run on this CPU at ``head_dim``, the fastest last."""
        mask = self._lib.gqa_usable_isas(head_dim)
        return [name for name, bit in ISA.items() if bit and mask & (1 << bit)]

    def auto_isa(self, head_dim: int, dtype: torch.dtype) -> str:
        """The implementation ``"auto"`` takes for a cache of ``dtype`` storage (int8: its
        codes' ``torch.int8``) at ``head_dim``: the fastest in ``isas``, except that a bfloat16
        cache takes "avx512" over "avx512dot" where this CPU's ``vdpbf16ps`` is not the faster
        way (isa.c's ``gqa_auto_isa``)."""
        code = self._lib.gqa_auto_isa(head_dim, DTYPE_ENC.get(dtype, ENC["int8"]))
        return next(name for name, bit in ISA.items() if bit == code)

    def run(self, descs, count: int, *, isa: str = "auto", threads: int = 0) -> None:
        """``gqa_run`` over the first ``count`` descriptors of a ``CacheDesc`` array (each one's
        ``status`` then says whether it was computed). ``threads``: at most this many of the pool
        (0: all). Releases the GIL while it runs. ``RuntimeError`` for arguments the kernel
        refuses (a caller's bug: the caches check their input first), ``MemoryError`` when it cannot allocate (nothing written either way)."""
        rc = self._run(ctypes.addressof(descs) if not isinstance(descs, int) else descs, count, threads, ISA[isa])
        if rc:
            self.raise_for(rc)

    def run_each(self, addresses: Sequence[int]) -> None:
        """``run`` over descriptors that live apart, given by address (each cache's own), on the
        whole pool with the best ISA; each one's ``status`` is set as by ``run``."""
        n = len(addresses)
        rc = self._run_ptrs((ctypes.c_void_p * n)(*addresses), n, 0, 0)
        if rc:
            self.raise_for(rc)

    def run_one(self, address: int) -> None:
        """``run`` of the one descriptor at ``address`` on the whole pool, the best ISA (the
        per-step path: no keyword parsing)."""
        rc = self._run(address, 1, 0, 0)
        if rc:
            self.raise_for(rc)

    @staticmethod
    def raise_for(rc: int) -> None:
        if rc == -errno.ENOMEM:
            raise MemoryError("native kernel: out of memory")
        raise RuntimeError(f"native kernel: {os.strerror(-rc)}")

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ks: torch.Tensor,
        vs: torch.Tensor,
        runs,
        ko: torch.Tensor | None = None,
        *,
        isa: str = "auto",
        threads: int | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` over int8 codes (the int8 encoding of ``gqa_run``).

        q (N, G, Dk + O) float32 contiguous, already scaled, its channels in the cache's key
        order (the Dk coded channels, then the O outlier channels); k (N, Dk, C) int8 with unit
        position stride (copied into the kernel's ``key_layout.KeyBlocks``), or a ``KeyBlocks``
        of (1, N) heads, C rows and Dk channels (a cache's own storage, read in place); ko (N, O, C) float16 contiguous
        or None (O = 0); v (N, C, D) int8 contiguous; ks, vs (N, C) float32 or float16 scales
        of every row, contiguous; runs the physical (a, b) runs of the attended rows, at most
        ``MAX_RUNS``. Returns (N, G, D) float32. ``threads``: at most this many of the pool
        (None: all); the result does not depend on it. Releases the GIL while it runs.
        """
        n, g, dq = q.shape
        c, d = v.shape[1], v.shape[2]
        if isinstance(k, KeyBlocks):
            if k.data.dtype != torch.int8 or (k.lead[0] * k.lead[1], k.capacity) != (n, c):
                raise ValueError(f"int8 kernel: key blocks must be int8 of {n} heads and {c} rows")
            blocks, dk = k, k.channels
        else:
            dk = k.shape[1]
        no = 0 if ko is None else ko.shape[1]
        for name, t in (("q", q), ("v", v)) + ((("ko", ko),) if ko is not None else ()):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"int8 kernel: {name} must be a contiguous CPU tensor")
        if dq != dk + no:
            raise ValueError(f"int8 kernel: q has {dq} channels, the keys {dk} coded + {no} outlier")
        if not isinstance(k, KeyBlocks):
            if k.device.type != "cpu" or k.dtype != torch.int8 or k.stride(2) != 1 or k.shape != (n, dk, c):
                raise ValueError(f"int8 kernel: k must be int8 ({n}, {dk}, {c}) with unit position stride")
            blocks = KeyBlocks((1, n), c, dk, torch.int8)
            blocks.write(0, k.unsqueeze(0).transpose(2, 3))
        if ko is not None and (ko.dtype != torch.float16 or ko.shape != (n, no, c)):
            raise ValueError(f"int8 kernel: ko must be float16 ({n}, {no}, {c})")
        if (
            ks.shape != (n, c)
            or vs.shape != (n, c)
            or not ks.is_contiguous()
            or not vs.is_contiguous()
            or ks.dtype != vs.dtype
            or ks.dtype not in (torch.float32, torch.float16)
        ):
            raise ValueError(f"int8 kernel: scales must be contiguous float32 or float16 (N, C) = ({n}, {c})")
        if q.dtype != torch.float32:
            raise ValueError("int8 kernel: q must be float32")
        out = torch.empty((n, g, d), dtype=torch.float32)
        desc = (CacheDesc * 1)()
        x = desc[0]
        x.enc, x.io, x.flags = ENC["int8"], ENC["float32"], FLAG_HALF_SCALES if ks.dtype == torch.float16 else 0
        x.n, x.g, x.d, x.c, x.kstride, x.dk, x.no, x.scale_stride = n, g, d, c, blocks.head_stride, dk, no, c
        x.set_runs(runs)
        x.write_row, x.qscale = -1, 1.0
        x.k, x.v, x.ks, x.vs = blocks.data.data_ptr(), v.data_ptr(), ks.data_ptr(), vs.data_ptr()
        x.ko = None if ko is None else ko.data_ptr()
        x.q, x.out = q.data_ptr(), out.data_ptr()
        self.run(desc, 1, isa=isa, threads=threads or 0)
        return out

    def hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ quant.hadamard_rotation(D)`` for float32 CPU rows (..., D), as a new tensor,
        computed without torch's thread pool (see ``gqa_hadamard_rows``)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("hadamard: expected a float32 CPU tensor")
        y = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
        d = y.shape[-1]
        rc = self._lib.gqa_hadamard_rows(y.data_ptr(), y.numel() // d if d else 0, d, d & -d)
        if rc:
            raise ValueError(f"hadamard: {os.strerror(-rc)} for shape {tuple(x.shape)}")
        return y


def layout_mirror() -> list[tuple[str, int]]:
    """What this module assumes of the library, in ``gqa_layout``'s order: the descriptor's size,
    its fields' offsets, then the enums' values."""
    fields = [("sizeof(gqa_cache_t)", ctypes.sizeof(CacheDesc))]
    fields += [(f"offsetof({name})", getattr(CacheDesc, name).offset) for name, _ in CacheDesc._fields_]
    fields.append(("MAX_RUNS", MAX_RUNS))
    fields.append(("SPLIT_T", SPLIT_T))
    fields += [(f"ISA_{k.upper()}", v) for k, v in ISA.items()]
    fields += [(f"ENC_{k.upper()}", v) for k, v in ENC.items()]
    fields += [
        ("FLAG_HALF_SCALES", FLAG_HALF_SCALES),
        ("FLAG_FAIL_AFTER_WRITE", FLAG_FAIL_AFTER_WRITE),
        ("FLAG_ROTATE", FLAG_ROTATE),
        ("FLAG_RECIPROCAL", FLAG_RECIPROCAL),
        ("FLAG_ISA_SHIFT", FLAG_ISA_SHIFT),
    ]
    fields += [(f"POLICY_{k.upper()}", v) for k, v in POLICY.items()]
    fields += [(f"result column {name}", i) for i, name in enumerate(RESULT_COLUMNS_ALL)]
    fields.append(("result columns", len(RESULT_COLUMNS_ALL)))
    return fields


def library_layout(lib) -> list[int]:
    """The numbers ``gqa_layout`` of a loaded library reports."""
    count = lib.gqa_layout(None, 0)
    out = (ctypes.c_int64 * count)()
    lib.gqa_layout(ctypes.addressof(out), count)
    return list(out)


def check_layout(reported: list[int], mirror: list[tuple[str, int]] | None = None) -> str:
    """'' when the library's layout (``library_layout``) is this module's (``layout_mirror``),
    else what differs first."""
    mirror = layout_mirror() if mirror is None else mirror
    if len(reported) != len(mirror):
        return f"the library reports {len(reported)} layout numbers, backends/native.py expects {len(mirror)}"
    for (name, want), got in zip(mirror, reported):
        if want != got:
            return f"{name} is {got} in the library, {want} in backends/native.py"
    return ""


@functools.cache
def load() -> Kernel:
    """The kernel, built if needed; ``NativeUnavailable`` says why not (the result is cached)."""
    if os.environ.get("GQA_NATIVE", "1") == "0":
        raise NativeUnavailable("disabled by GQA_NATIVE=0")
    try:
        return Kernel(build())
    except AttributeError as exc:  # a library without an entry point this module calls
        raise NativeUnavailable(f"the native kernel lacks an entry point ({exc})") from None
    except OSError as exc:  # dlopen failed
        raise NativeUnavailable(f"cannot load the native kernel ({exc})") from None


def load_torch_step():
    """The public step's entry with torch tensors: the module built from ``csrc/torch_step.cpp``
    by ``python -m backends.native build`` (``make install`` and the Dockerfile run it), loaded
    once. ``NativeUnavailable`` says why not (not built, built for another torch, or
    ``GQA_TORCH_STEP=0``); the caches then step through ctypes. Never compiles: a first cache
    must not wait ~12 s for a compiler (a server's first Open would)."""
    module, reason = _torch_step()
    if module is None:
        raise NativeUnavailable(reason)
    return module


@functools.cache
def _torch_step():
    """(the module, '') or (None, why not), looked up once per process (``cache_clear`` after a build)."""
    if os.environ.get("GQA_TORCH_STEP", "1") == "0":
        return None, "disabled by GQA_TORCH_STEP=0"
    import importlib.util  # noqa: PLC0415

    path = torch_step_path()
    if not path.exists():
        return None, f"not built ({path.name} absent; `python -m backends.native build` builds it)"
    try:
        spec = importlib.util.spec_from_file_location("_gqa_torch_step", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # dlopen failed
        return None, f"cannot load the torch step module {path.name} ({exc})"
    return module, ""


def available() -> tuple[bool, str]:
    """Whether the kernel loads here, and if not why (never raises)."""
    try:
        load()
    except NativeUnavailable as exc:
        return False, str(exc)
    return True, ""


def _main(argv: list[str]) -> int:
    if argv[:1] != ["build"] or len(argv) > 2:
        print("usage: python -m backends.native build [DIRECTORY]", file=sys.stderr)
        return 2
    try:
        path = build(Path(argv[1]) if len(argv) == 2 else None)
    except NativeUnavailable as exc:
        print(f"backends.native: {exc}", file=sys.stderr)
        return 1
    kernel = Kernel(path)
    print(f"{path} (on this CPU at head_dim 128: {', '.join(kernel.isas(128))})")
    try:  # the optional C++ entry of the public step, beside it (ctypes serves without it)
        print(build_torch_step(path.parent))
        _torch_step.cache_clear()
    except NativeUnavailable as exc:
        print(f"backends.native: no torch step module, the public step goes through ctypes ({exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
