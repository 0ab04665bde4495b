"""backends.host_memory: cache storage advised onto 2 MiB pages (Linux transparent huge pages)."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

from backends import host_memory
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.policy import EvictionPolicy

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_zeros_is_torch_zeros(dtype):
    for shape in ((3, 5), (2, 8, 1 << 18)):  # small, and past MIN_ADVISED
        t = host_memory.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()


def test_small_and_non_cpu_tensors_are_not_advised():
    assert not host_memory.advise_huge_pages(torch.empty(1024))
    assert not host_memory.advise_huge_pages(torch.empty(host_memory.MIN_ADVISED, device="meta", dtype=torch.int8))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or THP_MODE in (None, "never"), reason="no transparent huge pages here"
)
def test_a_long_dense_cache_lies_on_huge_pages():
    """The advice is taken: a 64 MiB cache's storage gets 2 MiB pages (at least one: how many
    the kernel finds free depends on its memory's fragmentation)."""
    cache = DenseCache(CacheSpec(1, 8, 8, 128, torch.float32, EvictionPolicy.none(8192)), "native")
    storage = [cache._k, cache._v]
    assert all(host_memory.advise_huge_pages(t) for t in storage)
    # the advice splits a mapping: the 2 MiB-aligned middle is a mapping of its own
    huge = sum(kb for lo, hi, kb in _vmas() if any(lo < t.data_ptr() + t.nbytes and t.data_ptr() < hi for t in storage))
    assert huge >= host_memory.HUGE_PAGE >> 10, f"{huge} KiB of the cache's 64 MiB in huge pages"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or THP_MODE in (None, "never"), reason="no transparent huge pages here"
)
def test_the_benchmarks_floor_reads_memory_on_the_caches_pages():
    """`make bench`'s read floor lies on 2 MiB pages as a long cache's storage does: on 4 KiB
    pages it read slower than the caches' own bytes (docs/design.md)."""
    from tests.bench.common import floor_buffer

    words = floor_buffer(64 << 20)
    assert words.dtype == torch.float32 and words.numel() == 16 << 20 and bool((words == 1).all())
    lo, hi = words.data_ptr(), words.data_ptr() + words.nbytes
    huge = sum(kb for start, end, kb in _vmas() if start < hi and lo < end)
    assert huge >= host_memory.HUGE_PAGE >> 10, f"{huge} KiB of the floor's 64 MiB in huge pages"


def _vmas():
    """(start, end, AnonHugePages KiB) of each mapping of this process."""
    start = end = None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            start, end = int(m.group(1), 16), int(m.group(2), 16)
        elif line.startswith("AnonHugePages:"):
            yield start, end, int(line.split()[1])
