"""The AVX-512 paths' tests on a CPU without AVX-512: the kernel's AVX-512 blocks, conversions
and int8 coding built with every AVX-512 intrinsic emulated on AVX2 (``csrc/gqa_emu512.h``,
``GQA_KERNEL_EMULATE_AVX512=1``: a test-only library under its own name), then the tests that
name an AVX-512 path, and the plane's (whose "auto" is an AVX-512 path in that library), run
against it in a subprocess.

A CPU with AVX-512 runs those tests natively in the suite itself; one without it (CI's machines
may have none) skipped them, so a change to an AVX-512 block could land untested. Under the
emulation they check the paths' logic (layouts, masks, block edges, lane orders, the int8 and
bfloat16 dot products' sums), not their speed. An emulated intrinsic that is wrong in one lane
fails hundreds of them (a 0.1% error in one lane of the emulated multiply-add failed 273)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.bench import block_probe
from tests.library_builds import NOT_REBUILDING, build_variant, run_tests

ROOT = Path(__file__).resolve().parents[1]
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
TESTS = [
    "tests/test_native_kernel.py",
    "tests/test_dense_kernel.py",
    "tests/test_key_layout.py",
    "tests/test_int8_backend.py",
    "tests/test_cpu_cache.py",
    "tests/test_plane.py",
]
# the tests of an AVX-512 path (their ids name it), of which paths exist (isa), and the plane's
SELECT = f"(avx512 or isa or test_plane) and {NOT_REBUILDING}"
ISA = block_probe.cpu_isa()  # the widest block ISA this CPU runs natively


@pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the emulating library with")
@pytest.mark.skipif(ISA == "", reason="the emulation runs on AVX2 with FMA and F16C, which this CPU lacks")
@pytest.mark.skipif(
    ISA == "avx512", reason="this CPU runs the AVX-512 paths natively: the suite's own tests cover them"
)
def test_the_avx512_paths_pass_their_tests_emulated_on_avx2():
    env = dict(os.environ, GQA_KERNEL_EMULATE_AVX512="1", GQA_KERNEL_TEST_HOOKS="1", PYTHONPATH=str(ROOT))
    built = build_variant(env, then="print(native.load().isas(128))")
    assert "emu512" in built, built
    assert "'avx512', 'avx512dot'" in built, built  # the library offers both paths
    returncode, output = run_tests(env, SELECT, TESTS, "-rs")
    assert returncode == 0, output[-4000:]
    # every AVX-512 case ran: none skipped (-rs lists each skip with its reason)
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED") and "avx512" in line]
    assert not skipped, "\n".join(skipped)
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= 350, output[-2000:]
