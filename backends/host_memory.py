"""Cache storage in host memory backed by 2 MiB pages where the kernel allows it.

A long cache's step streams hundreds of MB; on 4 KiB pages every 4 KiB of that is a TLB miss
and, after a cold start, a page walk (the machine's whole-buffer read measured 19 -> 29 GB/s on
one thread with 2 MiB pages; docs/design.md, "Long caches at the memory's speed"). Linux gives
an anonymous mapping 2 MiB pages when ``transparent_hugepage`` is ``always``, or ``madvise``
and the range is advised ``MADV_HUGEPAGE`` before its pages are first touched: ``zeros`` asks
that of a large CPU tensor's storage, then zeroes it. Advice only: where it is refused or
means nothing (other systems, THP ``never``, a CUDA tensor) the tensor is the same, on
whatever pages the system gives.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["HUGE_PAGE", "advise_huge_pages", "zeros"]

HUGE_PAGE = 2 << 20
MIN_ADVISED = 2 * HUGE_PAGE  # smaller tensors hold at most one whole 2 MiB page: not worth a call
_MADV_HUGEPAGE = 14  # linux/mman.h


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


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks for 2 MiB pages over the whole 2 MiB pages inside ``tensor``'s bytes (a contiguous
    CPU tensor); True when the system took the advice. Pages already touched stay as they are."""
    if _madvise is None or tensor.device.type != "cpu" or tensor.nbytes < MIN_ADVISED:
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    return last > first and _madvise(first, last - first, _MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU a large one advised onto
    2 MiB pages before it is zeroed (its pages' first touch)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor.zero_()
