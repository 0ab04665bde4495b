"""The kernel and plane tests once more against the library built with AddressSanitizer and
UndefinedBehaviorSanitizer (issue #23 item 6): every encoding, every policy, failures mid-step.

In a subprocess with the ASan runtime preloaded (Python itself is not instrumented), leak
detection off (CPython keeps objects to the end by design), every UBSan report fatal; any
sanitizer report fails the test. The build is test-only (``GQA_KERNEL_SANITIZE=1``, its own
name in the kernel cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.library_builds import NOT_REBUILDING, build_variant, run_tests

ROOT = Path(__file__).resolve().parents[1]
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
# the subset that drives the C library through every path: the plane (all encodings, policies,
# refusals and injected failures, the C plan against policy.py) and the kernel's own tests
TESTS = ["tests/test_plane.py", "tests/test_native_kernel.py"]


def _runtime(name: str) -> str | None:
    """The compiler's ``name`` library (an absolute path that exists), or None."""
    if not COMPILER:
        return None
    try:
        done = subprocess.run([COMPILER, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = done.stdout.strip()
    return path if done.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


RUNTIME = _runtime("libasan.so")
# preloaded after ASan too: its __cxa_throw interceptor needs libstdc++ present when it starts
# (torch throws and catches C++ exceptions while it imports)
CXX_RUNTIME = _runtime("libstdc++.so")


@pytest.mark.skipif(RUNTIME is None, reason="no C compiler with an AddressSanitizer runtime (libasan.so) here")
def test_kernel_and_plane_tests_pass_under_asan_and_ubsan(tmp_path):
    env = dict(os.environ, GQA_KERNEL_SANITIZE="1", GQA_KERNEL_CACHE=str(tmp_path / "kernel"), PYTHONPATH=str(ROOT))
    # built first, without the runtime preloaded (the compiler must not run under it)
    built = build_variant(env)
    assert "sanitize" in built, built
    env.update(
        LD_PRELOAD=" ".join(p for p in (RUNTIME, CXX_RUNTIME) if p),
        ASAN_OPTIONS="detect_leaks=0:exitcode=86",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87",
    )
    returncode, output = run_tests(env, NOT_REBUILDING, TESTS, "-x")
    reports = [line for line in output.splitlines() if "Sanitizer" in line or "runtime error:" in line]
    assert not reports, "\n".join(reports[:20]) + "\n" + output[-4000:]
    assert returncode == 0, output[-4000:]
    assert " passed" in output
