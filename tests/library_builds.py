"""The kernel library's test builds (sanitized, AVX-512 emulated), each built in a subprocess
for a test that then runs other test files against it (tests/test_sanitizers.py,
tests/test_avx512_emulated.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# pytest -k: leaves out the tests that compile the library again themselves (each would be
# another full build of the variant, or the production library's under the variant's runtime)
NOT_REBUILDING = (
    "not build and not compiler and not cache_dir and not unwritable and not prebuild and not falls_back"
    " and not production_library"
)


def build_variant(env: dict[str, str], then: str = "") -> str:
    """Builds the library that ``env``'s variables ask for, in a subprocess, and returns what it
    printed: the library's path, then what the Python statements ``then`` print after it."""
    done = subprocess.run(
        [sys.executable, "-c", f"from backends import native; print(native.build()); {then}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_tests(env: dict[str, str], select: str, files: list[str], *options: str) -> tuple[int, str]:
    """pytest over ``files`` (the tests ``select`` keeps, no GPU tests) in a subprocess with
    ``env``, as the repository root; its exit status and its output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", select, *options]
    done = subprocess.run([*cmd, *files], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    return done.returncode, done.stdout + done.stderr
