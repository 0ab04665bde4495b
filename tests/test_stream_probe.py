"""tests/bench/stream_probe: the probe builds, runs every pattern on every core asked for, and
reports a rate for each."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.bench import stream_probe


def _why_not() -> str | None:
    if stream_probe.compiler() is None:
        return "no C compiler ($CC or cc)"
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or not {"avx512f", "avx2"} & set(cpuinfo.read_text().split()):
        return "the probe reads with AVX-512 or AVX2 loads; this CPU has neither"
    return None


WHY_NOT = _why_not()
needs_the_probe = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@needs_the_probe
def test_the_probe_reports_every_pattern():
    out = stream_probe.run(threads=2, mib=1, evict_mib=4, repeats=2)
    rates = dict(re.findall(r"^(\S+)\s+([0-9.]+) GB/s per core .*2 cores at once, 2 passes\)$", out, re.M))
    assert set(rates) == {"read", "read+pf", "kernel", "kernel+near"}, out
    assert all(float(r) > 0 for r in rates.values()), out


@needs_the_probe
def test_bad_arguments_are_refused():
    with pytest.raises(subprocess.CalledProcessError) as err:
        stream_probe.run(threads=0, mib=1, evict_mib=4, repeats=1)
    assert "bad arguments" in err.value.stderr, err.value
