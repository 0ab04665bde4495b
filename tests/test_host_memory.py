"""backends.host_memory: cache storage advised onto 2 MiB pages (Linux transparent huge pages)."""

from __future__ import annotations

import gc
import pathlib
import re
import sys

import pytest
import torch

from backends import host_memory
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.policy import EvictionPolicy
from backends.registry import get_backend

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else None
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or THP_MODE in (None, "never"), reason="no transparent huge pages here"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_zeros_is_torch_zeros(dtype):
    for shape in ((3, 5), (2, 8, 1 << 18)):  # small, and past a 2 MiB page
        t = host_memory.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()


def test_small_and_non_cpu_tensors_are_torchs_own():
    small = host_memory.zeros((1024,), torch.float32)
    assert small.untyped_storage().nbytes() == small.nbytes and not small.any()
    meta = host_memory.zeros((4 * host_memory.HUGE_PAGE,), torch.int8, device="meta")
    assert meta.device.type == "meta" and meta.shape == (4 * host_memory.HUGE_PAGE,)


MIB = 1 << 20


@pytest.mark.parametrize(
    "nbytes, span",
    [
        (0, 0),
        (1991 << 10, 0),  # an int8 S=2048 cache's key codes: no whole 2 MiB page
        (2 * MIB, 2 * MIB),
        (2056 << 10, 2 * MIB),  # its value codes: the 8 KiB past the page stay on 4 KiB pages
        (64 * MIB + 1, 64 * MIB),
    ],
)
def test_huge_page_span_is_the_whole_huge_pages(nbytes, span):
    """No tensor is rounded up: it holds no memory but its own bytes."""
    assert host_memory.huge_page_span(nbytes) == span


@needs_thp
def test_zeros_keeps_its_mapping_alive_and_gives_it_back():
    t = host_memory.zeros((8, 2056, 128), torch.int8)  # past a 2 MiB page: a mapping of its own
    assert t.untyped_storage().nbytes() == t.nbytes  # what a cache counts as held
    at = t.data_ptr()
    view = t.view(-1)[-16:]
    del t
    gc.collect()
    view.fill_(7)  # the view alone holds the mapping
    assert int(view.sum()) == 7 * 16 and _mapping_of(at) is not None
    del view
    gc.collect()
    assert _mapping_of(at) is None


@needs_thp
@pytest.mark.parametrize("nbytes", [2056 << 10, 4 * MIB, 9 * MIB], ids=["2056KiB", "4MiB", "9MiB"])
def test_zeros_starts_on_a_huge_page_boundary_and_gets_huge_pages(nbytes):
    """Also where the allocator hands back memory already touched on 4 KiB pages (a large
    tensor freed just before), where `torch.empty` gave none. At least one 2 MiB page: how many
    the kernel finds free at the first touch depends on its memory's fragmentation."""
    torch.ones(nbytes * 2, dtype=torch.uint8).sum()  # touched and freed
    t = host_memory.zeros((nbytes,), torch.uint8)
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0 and not t.any()
    span = host_memory.huge_page_span(nbytes)
    huge = sum(kb for lo, hi, kb in _vmas() if lo < t.data_ptr() + span and t.data_ptr() < hi)
    assert huge << 10 >= host_memory.HUGE_PAGE, f"{huge} KiB of its {span >> 10} KiB span on huge pages"


@needs_thp
def test_a_caches_tensors_of_a_huge_page_or_more_start_on_huge_page_boundaries():
    """An int8 cache at S=2048 (the benchmarks' shape): its value codes (2056 KiB) lay on 4 KiB
    pages, unaligned; they now start a 2 MiB page of their own. Its key codes (1991 KiB) hold
    no whole 2 MiB page and take the allocator's memory as before."""
    cache = get_backend("int8").create_cache(CacheSpec(1, 32, 8, 128, torch.float32, EvictionPolicy.none(2056)))
    assert cache._v.nbytes == 2056 << 10 and cache._v.data_ptr() % host_memory.HUGE_PAGE == 0
    assert cache._k.nbytes < host_memory.HUGE_PAGE
    dense = DenseCache(CacheSpec(1, 8, 8, 128, torch.float32, EvictionPolicy.none(2056)), "native")
    assert all(t.data_ptr() % host_memory.HUGE_PAGE == 0 for t in (dense._k, dense._v))


@needs_thp
def test_a_long_dense_cache_lies_on_huge_pages():
    """The advice is taken: a 64 MiB cache's storage gets 2 MiB pages (at least one: how many
    the kernel finds free depends on its memory's fragmentation)."""
    cache = DenseCache(CacheSpec(1, 8, 8, 128, torch.float32, EvictionPolicy.none(8192)), "native")
    storage = [cache._k, cache._v]
    huge = sum(kb for lo, hi, kb in _vmas() if any(lo < t.data_ptr() + t.nbytes and t.data_ptr() < hi for t in storage))
    assert huge >= host_memory.HUGE_PAGE >> 10, f"{huge} KiB of the cache's 64 MiB in huge pages"


@needs_thp
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


def _mapping_of(address: int) -> str | None:
    """The /proc/self/maps line of the mapping that holds ``address``, or None."""
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    return None
