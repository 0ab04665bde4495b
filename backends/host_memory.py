"""Cache storage in host memory backed by 2 MiB pages where the kernel allows it.

A long cache's step streams hundreds of MB; on 4 KiB pages every 4 KiB of that is a TLB miss
and, after a cold start, a page walk (the machine's whole-buffer read measured 19 -> 29 GB/s on
one thread with 2 MiB pages; docs/design.md, "Long caches at the memory's speed"). Linux gives
an anonymous mapping 2 MiB pages when ``transparent_hugepage`` is ``always``, or ``madvise``
and the range is advised ``MADV_HUGEPAGE`` before its pages are first touched.

So ``zeros`` puts a large CPU tensor in a mapping of its own, fresh from the kernel, starting
on a 2 MiB boundary, advises it and then zeroes it (its pages' first touch). A tensor from
``torch.empty`` got 2 MiB pages only over the whole 2 MiB pages inside it, and none at all
where the allocator handed back memory already touched: an int8 cache's 2056 KiB value codes
lay wholly on 4 KiB pages, and in a server most of a model's cache at times (docs/design.md,
"The caches' storage on 2 MiB pages, every time"). Only a tensor's whole 2 MiB pages are
advised: its tail past the last one stays on 4 KiB pages, and a tensor below 2 MiB is torch's,
so that a tensor holds no memory but its own bytes and a cache budget counts what the caches
hold. Advice only: where it means nothing (other systems, THP ``never``, a CUDA tensor) a
tensor is torch's own, on whatever pages the system gives.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import pathlib
import sys

import torch

__all__ = ["HUGE_PAGE", "huge_page_span", "zeros"]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


@functools.cache
def _transparent_huge_pages() -> bool:
    """Whether this kernel gives advised anonymous memory 2 MiB pages (THP ``always`` or
    ``madvise``)."""
    if _madvise is None:
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_span(nbytes: int) -> int:
    """The bytes of an ``nbytes`` tensor that ``zeros`` puts on 2 MiB pages from a 2 MiB
    boundary: its whole 2 MiB pages (0: it gets none)."""
    return nbytes // HUGE_PAGE * HUGE_PAGE


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, one that holds a whole
    2 MiB page (``huge_page_span``) is a view of a mapping of its own, its first byte on a 2 MiB
    boundary, advised onto 2 MiB pages before it is zeroed (its pages' first touch)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    span = huge_page_span(nbytes) if torch.device(device).type == "cpu" else 0
    if not span or not _transparent_huge_pages():
        return torch.zeros(shape, dtype=dtype, device=device)
    # a private anonymous mapping (a shared one is shmem, which THP's `enabled` does not cover),
    # one 2 MiB page longer than the tensor's pages so that one of its 2 MiB boundaries starts it
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE + HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    at = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    # the tensor's storage is its own bytes (what `untyped_storage().nbytes()` counts), and holds
    # the mapping until the last view of it goes
    tensor = torch.frombuffer(region, dtype=torch.uint8, offset=at, count=nbytes)
    _madvise(tensor.data_ptr(), span, _MADV_HUGEPAGE)
    return tensor.view(dtype).view(shape).zero_()
