"""The CPU backend: dense float32 / bfloat16 / float16 caches in a ring, the embedded default.

Layout: values (B, Hkv, C, D) in the stream dtype; keys in the compiled kernel's blocks of 64
positions (``key_layout.KeyBlocks``: each block one contiguous run of its channels' lines, so
the kernel (``backends.native``, ``backends/csrc/``) reads a block front to back and scores
its 64 positions for the G query heads of a KV head with broadcast multiply-adds and no
horizontal sums). torch's fallback keeps float32 keys transposed (``key_layout.KeyRows``, for a
row-major ``q @ K^T``) and 16-bit keys as rows. Appending writes one key column and one value
row; eviction writes nothing.

Kernels (``kernel=``): "native" (the default where the library builds and loads) computes the
whole step in one call: the new token written into its ring row (after every check, so
nothing can fail once it is written), the attention over the resident runs without copying
them, the output written in the stream dtype, the GIL released. "native-portable" / "native-avx2" /
"native-avx512" / "native-avx512dot" pick one implementation (tests). "torch" is the fallback where no compiler
exists: float32 through ``attention.attend`` (GEMMs), bfloat16/float16 through torch's fused
CPU kernel, which needs keys as rows (B, Hkv, C, D), so those caches keep their keys as rows
when they are created without the native kernel.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from . import native
from .attention import attend, attend_rows, scaled_query
from .base import LayerCache
from .contract import Backend, CacheSpec, Capabilities
from .dense import DenseRingCache

__all__ = ["CPUBackend", "DenseCache", "KERNELS", "default_kernel", "dense_cpu_nbytes"]

log = logging.getLogger(__name__)

_FUSED_DTYPES = (torch.bfloat16, torch.float16)
KERNELS = ("native", "native-portable", "native-avx2", "native-avx512", "native-avx512dot", "torch")


@functools.cache
def default_kernel() -> str:
    """ "native" where the compiled library loads, else "torch" (the reason logged once)."""
    ok, reason = native.available()
    if ok:
        return "native"
    log.warning("cpu: the native kernel is unavailable (%s); using torch's kernels", reason)
    return "torch"


def _key_layout(dtype: torch.dtype, kernel: str) -> str:
    if kernel != "torch":
        return "blocks"
    return "rows" if dtype in _FUSED_DTYPES else "transposed"


def dense_cpu_nbytes(spec: CacheSpec, kernel: str | None = None) -> int:
    """What ``DenseCache(spec, kernel)`` allocates for keys and values: keys with their rows
    padded (``key_row_stride``) unless they are stored as rows. (The native step's saved row,
    one position's bytes, is not counted: the service's reservation is the cache's storage.)"""
    return DenseRingCache.storage_nbytes(spec, _key_layout(spec.dtype, kernel or default_kernel()))


class DenseCache(DenseRingCache):
    def __init__(self, spec: CacheSpec, kernel: str = "auto"):
        if kernel == "auto":
            kernel = default_kernel()
        if kernel not in KERNELS:
            raise ValueError(f"cpu: unknown kernel {kernel!r} (known: auto, {', '.join(KERNELS)})")
        super().__init__(spec, _key_layout(spec.dtype, kernel))
        d = spec.head_dim
        self.kernel = kernel
        if kernel.startswith("native"):
            self._native = native.load()  # NativeUnavailable says why not
            isa = kernel.partition("-")[2] or "auto"
            if isa != "auto" and isa not in self._native.isas(d):
                raise native.NativeUnavailable(
                    f"cpu: kernel {kernel!r} does not run here at head_dim {d} (this CPU: {', '.join(self._native.isas(d))})"
                )
            self._attach_native(self._native, self._make_desc(isa))

    def _make_desc(self, isa: str) -> native.CacheDesc:
        s = self.spec
        n = s.batch_size * s.num_kv_heads
        enc = native.DTYPE_ENC[s.dtype]
        self._saved = torch.empty((2, n, s.head_dim), dtype=s.dtype)
        x = native.CacheDesc()
        x.enc = x.io = enc
        x.flags = native.ISA[isa] << native.FLAG_ISA_SHIFT
        x.n, x.g, x.d, x.c = n, s.group_size, s.head_dim, s.capacity
        x.kstride, x.dk, x.no, x.scale_stride = self._keys.head_stride, s.head_dim, 0, 0
        x.qscale = 1.0 / math.sqrt(s.head_dim)
        x.k, x.v, x.saved = self._k.data_ptr(), self._v.data_ptr(), self._saved.data_ptr()
        return x

    def _attend(self, query, runs):
        s = self.spec
        n = s.batch_size * s.num_kv_heads
        v = self._v.view(n, s.capacity, s.head_dim)
        if self._key_layout == "rows":
            q = query.reshape(n, s.group_size, s.head_dim)
            k = self._k.view(n, s.capacity, s.head_dim)
            out = attend_rows(
                q, [k[:, a:b] for a, b in runs], [v[:, a:b] for a, b in runs], 1.0 / math.sqrt(s.head_dim)
            )
            return out.view(s.batch_size, s.num_query_heads, s.head_dim).to(s.dtype)
        q = scaled_query(query, s.num_kv_heads)
        k = self._k.view(n, s.head_dim, s.capacity)  # "transposed" (the torch kernel's)
        out = attend(q, [k[:, :, a:b] for a, b in runs], [v[:, a:b] for a, b in runs])
        return out.view(s.batch_size, s.num_query_heads, s.head_dim).to(s.dtype)


@functools.cache
def _log_kernel() -> None:
    """Says once which kernel dense caches on the CPU get, and how a bfloat16 cache's blocks run
    on this CPU (``native.Kernel.auto_isa``: vdpbf16ps where it is the faster way, else widened);
    the fallback's warning says why when there is no native kernel."""
    if default_kernel() != "native":
        return
    kernel = native.load()
    bf16 = "vdpbf16ps" if kernel.auto_isa(128, torch.bfloat16) == "avx512dot" else "widened to float32"
    log.info("cpu: native kernel %s (%s; bfloat16 %s)", kernel.path, ", ".join(kernel.isas(128)), bf16)


class CPUBackend(Backend):
    name = "cpu"
    capabilities = Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        devices=("cpu",),
    )

    def __init__(self, kernel: str = "auto"):
        if kernel != "auto" and kernel not in KERNELS:
            raise ValueError(f"cpu: unknown kernel {kernel!r} (known: auto, {', '.join(KERNELS)})")
        self.kernel = kernel

    @classmethod
    def probe(cls) -> list[str]:
        # loads (or builds, once per machine) the native kernel while the server starts, and
        # logs which one serves; without it torch's kernels serve
        _log_kernel()
        return []

    def _kernel(self) -> str:
        return default_kernel() if self.kernel == "auto" else self.kernel

    def cache_nbytes(self, spec: CacheSpec) -> int:
        return dense_cpu_nbytes(spec, self._kernel())

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return DenseCache(spec, self._kernel())
