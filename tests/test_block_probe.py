"""tests/bench/block_probe: the probe builds the tree's blocks and another revision's side by
side (the latter's functions renamed), runs both over heads, and reports each side's rates and
the paired ratios; a revision it cannot compare, and bad figures, are refused by name."""

from __future__ import annotations

import re

import pytest

from tests.bench import block_probe

ISA = block_probe.cpu_isa()
needs_the_probe = pytest.mark.skipif(
    block_probe.compiler() is None or not ISA,
    reason="no C compiler ($CC or cc)" if block_probe.compiler() is None else "no AVX2 (with FMA, F16C) on this CPU",
)


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    """One build for the module (the tree against itself), at -O1: its block objects took ~44 s
    on two cores at the library's -O3."""
    return block_probe.build(block_probe.compiler(), ISA, None, tmp_path_factory.mktemp("block-probe"), opt="-O1")


@needs_the_probe
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_the_probe_reports_both_sides(exe, dtype):
    out = block_probe.probe(exe, dtype=dtype, isa=ISA, length=256, heads=2, threads=2, rounds=2, evict_mib=4)
    sides = dict(re.findall(r"^([AB]): cold ([0-9.]+) GB/s, hot [0-9.]+ ns a line$", out, re.M))
    assert set(sides) == {"A", "B"} and all(float(r) > 0 for r in sides.values()), out
    ratios = re.search(r"^B/A time, the median of 2 paired rounds: cold ([0-9.]+), hot ([0-9.]+)$", out, re.M)
    assert ratios and all(float(r) > 0 for r in ratios.groups()), out


@needs_the_probe
@pytest.mark.parametrize("length", [0, 100])
def test_bad_figures_are_refused(exe, length):
    with pytest.raises(RuntimeError, match="bad arguments"):
        block_probe.probe(exe, dtype="float32", isa=ISA, length=length, heads=1, threads=1, rounds=1, evict_mib=1)


def test_a_revision_without_the_files_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"no backends/csrc/block_avx2\.c at 'no-such-revision'"):
        block_probe.write_base("no-such-revision", ("block_avx2.c",), tmp_path / "b")
