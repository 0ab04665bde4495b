"""tests/bench/cold_profile.py: the samples it keeps are those inside the timed steps, counted
by thread, library and function; and the probe runs end to end where perf can sample."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.bench.cold_profile import report, windowed

SCRIPT = """\
  100 10.000100:      7f0000001000 before (/lib/libpython3.11.so.1.0)
  100 10.001000:      7f0000002000 block_avx512_f32 (/root/.cache/gqa-serve/gqa_decode-1.so)
  101 10.001500:      7f0000002000 block_avx512_f32 (/root/.cache/gqa-serve/gqa_decode-1.so)
  100 10.002000:  ffffffff81000000 clear_page_erms ([kernel.kallsyms])
  101 10.002999:      7f0000003000 [unknown] (/usr/lib/libffi.so.8)
  100 10.003500:      7f0000004000 between (/lib/libnumpy.so)
  100 10.004000:      7f0000005000 _PyEval_EvalFrameDefault (/lib/libpython3.11.so.1.0)
  100 10.009000:      7f0000006000 after (/lib/libpython3.11.so.1.0)
a line that is not a sample
"""


def test_only_samples_inside_a_window_count():
    profile = windowed(SCRIPT.splitlines(), [(10.001, 10.003), (10.004, 10.005)])
    assert profile.samples == 5
    assert profile.by_thread == {100: 3, 101: 2}
    assert profile.by_library["gqa_decode-1.so"] == 2 and "libnumpy.so" not in profile.by_library
    assert profile.by_function[("block_avx512_f32", "gqa_decode-1.so")] == 2
    assert profile.by_function[("[unknown]", "libffi.so.8")] == 1
    text = report(profile, caller=100, top=3)
    assert "5 samples inside steps" in text
    assert "60.0%  the caller" in text and "40.0%  thread 101" in text
    assert "40.0%  block_avx512_f32  (gqa_decode-1.so)" in text


def _perf_can_sample() -> str | None:
    perf = shutil.which("perf")
    if not perf:
        return "perf is not installed"
    probe = subprocess.run(
        [perf, "record", "-q", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"perf cannot sample here: {probe.stderr.strip()[-200:]}"


def _probe(args: str) -> str:
    """The probe's output for ``args`` (the test skipped where perf cannot sample)."""
    why = _perf_can_sample()
    if why:
        pytest.skip(why)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.cold_profile", *args.split()], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_probe_profiles_cold_steps_end_to_end():
    out = _probe("--length 600 --steps 8 --evict-bytes 4194304")
    assert "8 cold public steps" in out
    assert "the caller" in out
    # a step of 600 positions x 8 heads is parallel (the kernel pool's two threads) and its time
    # is the compiled kernel's
    assert "gqa_decode" in out


@pytest.mark.slow
def test_the_probe_profiles_cold_plane_calls_end_to_end():
    """``--plane N``: cold ``CacheSet.step`` calls of N short caches, their samples the kernel's."""
    out = _probe("--plane 8 --steps 6 --evict-bytes 4194304")
    assert "8 short caches in CacheSet.step: 6 cold calls" in out
    assert "the caller" in out and "gqa_decode" in out
