"""A probe, not a target: how fast each core reads a cold buffer under the request patterns a long
step can use, with no arithmetic in the way (``stream_probe.c`` says what each pattern is).

    PYTHONPATH=$PWD .venv/bin/python -m tests.bench.stream_probe [--threads N] [--mib M]

Beside ``step_rate`` (the step's own rate, hot and cold) it separates what the machine's memory
gives one core from what the kernel makes of it (docs/design.md, "What one core's memory gives a
long step"). It builds the C file with ``$CC`` (or ``cc``) into a temporary directory each run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import llc_bytes

SOURCE = Path(__file__).with_name("stream_probe.c")


def compiler() -> str | None:
    """The C compiler the probe is built with: ``$CC``, else ``cc``; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def run(threads: int, mib: int, evict_mib: int, repeats: int) -> str:
    """Builds the probe and returns what it prints (one line per pattern)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("stream_probe needs a C compiler ($CC or cc)")
    with tempfile.TemporaryDirectory(prefix="stream-probe-") as tmp:
        exe = Path(tmp) / "stream_probe"
        build = [cc, "-O2", "-march=native", "-pthread", "-o", str(exe), str(SOURCE)]
        subprocess.run(build, check=True, capture_output=True, text=True)
        out = subprocess.run(
            [str(exe), str(threads), str(mib), str(evict_mib), str(repeats)], check=True, capture_output=True, text=True
        )
    return out.stdout


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores reading at once (default all)")
    parser.add_argument("--mib", type=int, default=32, help="MiB each core reads per pass (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="cold passes per pattern (default 5)")
    args = parser.parse_args(argv)
    evict_mib = int(3 * max(llc_bytes(), 32 << 20)) >> 20  # as much as the benchmarks' Evictor writes
    print(f"{args.threads} cores, {args.mib} MiB each, {evict_mib} MiB written before every pass", flush=True)
    print(run(args.threads, args.mib, evict_mib, args.repeats), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
