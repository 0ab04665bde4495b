"""A probe, not a target: one ISA's blocks from two revisions, side by side on long heads.

    PYTHONPATH=$PWD .venv/bin/python -m tests.bench.block_probe [--base REV] [--dtype bfloat16]
        [--isa auto|avx2|avx512] [--length 32768] [--heads 1] [--threads 2] [--rounds 9]

Side A is the working tree's ``backends/csrc/block_avx2.c`` and ``block_avx2_int8.c`` (and
``block_avx512.c`` and ``block_avx512_int8.c`` for AVX-512), side B the same files at ``--base``
(default ``HEAD``: what a change in the tree does against the last commit). ``block_probe.c``
says what it runs: the real block functions over ``--heads`` KV heads a thread of ``--length``
positions, laid out as the cache lays them out, cold (the last-level cache evicted before every
pass) and hot, the two sides alternated round by round in one process. It prints each side's
cold GB/s and hot ns a line, and the median of the rounds' B/A time ratios, which is the figure
to read on a machine whose memory speed drifts (docs/design.md, "A block probe"). The two
revisions must share ``gqa_cache_t`` and ``state_t``. It builds with ``$CC`` (or ``cc``) into a
temporary directory each run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from backends.native_build import CFLAGS

from .common import llc_bytes

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "backends" / "csrc"
SOURCE = Path(__file__).with_name("block_probe.c")
HEADERS = ("gqa_internal.h", "gqa_avx2.h", "gqa_avx512.h")
ENCODINGS = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3}
ISAS = {"avx2": 2, "avx512": 3}
# the library's code generation (native_build.CFLAGS), as objects linked into a program; its
# optimization level (LIBRARY_OPT) is build()'s `opt` by default
LIBRARY_OPT = next(f for f in CFLAGS if f.startswith("-O"))
FLAGS = tuple(f for f in CFLAGS if f not in ("-fPIC", "-shared", LIBRARY_OPT))
# a function the block files export: `GQA_INTERNAL <type> name(`
EXPORTED = re.compile(r"GQA_INTERNAL\s+[\w\s\*]*?\b(\w+)\s*\(")
STRUCTS = re.compile(r"typedef struct \{.*?\} (?:gqa_cache_t|state_t);", re.S)


def compiler() -> str | None:
    """The C compiler the probe is built with: ``$CC``, else ``cc``; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def cpu_isa() -> str:
    """The widest block ISA this CPU runs: ``avx512`` (F, BW, VL, DQ), ``avx2`` (with FMA and
    F16C), or ``""``."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return ""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else ""


def block_files(isa: str) -> tuple[str, ...]:
    """The block files one ISA's blocks need (block_avx512.c calls block_avx2.c's short-ring scores)."""
    avx2 = ("block_avx2.c", "block_avx2_int8.c")
    return avx2 if isa == "avx2" else (*avx2, "block_avx512.c", "block_avx512_int8.c")


def write_base(rev: str | None, files: tuple[str, ...], into: Path) -> None:
    """Revision ``rev``'s block files and headers into ``into`` (None: the tree's own, B then the
    same code as A: the noise floor); refuses a revision whose descriptor or state differs from
    the tree's (both sides share one)."""
    into.mkdir()
    for name in (*files, *HEADERS):
        if rev is None:
            shutil.copy(CSRC / name, into / name)
            continue
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:backends/csrc/{name}"], capture_output=True, text=True
        )
        if shown.returncode:
            raise RuntimeError(f"block_probe: no backends/csrc/{name} at {rev!r}: {shown.stderr.strip()}")
        (into / name).write_text(shown.stdout)
    ours = STRUCTS.findall((CSRC / "gqa_internal.h").read_text())
    theirs = STRUCTS.findall((into / "gqa_internal.h").read_text())
    if ours != theirs:
        raise RuntimeError(f"block_probe: gqa_cache_t or state_t differs at {rev!r}; the two sides must share them")


def build(cc: str, isa: str, base: str | None, tmp: Path, opt: str = LIBRARY_OPT) -> Path:
    """The probe linked with side A (the tree's block files) and side B (``base``'s, its exported
    functions renamed B_*), every object compiled at once; ``opt`` in place of the library's level
    (the tests' probe, whose figures mean nothing, builds at -O1 in half the time)."""
    files = block_files(isa)
    write_base(base, files, tmp / "b")
    renames: list[str] = []
    for name in files:
        renames += [f"-D{f}=B_{f}" for f in EXPORTED.findall((tmp / "b" / name).read_text())]
    jobs = []
    objects = []
    for side, src, extra in (("a", CSRC, []), ("b", tmp / "b", sorted(set(renames)))):
        for name in files:
            obj = tmp / f"{side}_{name}.o"
            objects.append(str(obj))
            cmd = [cc, *FLAGS, opt, *extra, "-I", str(src), "-c", str(src / name), "-o", str(obj)]
            jobs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    for job in jobs:
        _, err = job.communicate()
        if job.returncode:
            raise RuntimeError(f"block_probe: a block file did not build:\n{err}")
    exe = tmp / "block_probe"
    link = [cc, *FLAGS, opt, "-I", str(CSRC), str(SOURCE), *objects, "-o", str(exe), "-lm"]
    subprocess.run(link, check=True, capture_output=True, text=True)
    return exe


def probe(
    exe: Path, *, dtype: str, isa: str, length: int, heads: int, threads: int, rounds: int, evict_mib: int
) -> str:
    """Runs a built probe and returns what it prints (each side's figures, then the paired ratios)."""
    if dtype not in ENCODINGS or isa not in ISAS:
        raise ValueError(f"block_probe: dtype one of {sorted(ENCODINGS)}, isa one of {sorted(ISAS)}")
    args = [ENCODINGS[dtype], ISAS[isa], length, heads, threads, rounds, evict_mib]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"block_probe: {out.stderr.strip()}")
    return out.stdout


def run(*, isa: str, base: str | None = "HEAD", **figures) -> str:
    """Builds the probe (``base`` None: the tree against itself) and runs it once (``probe``'s
    arguments)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("block_probe needs a C compiler ($CC or cc)")
    with tempfile.TemporaryDirectory(prefix="block-probe-") as tmp:
        return probe(build(cc, isa, base, Path(tmp)), isa=isa, **figures)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="side B's revision (default HEAD)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(ENCODINGS))
    parser.add_argument("--isa", default="auto", choices=["auto", *sorted(ISAS)])
    parser.add_argument("--length", type=int, default=32768, help="positions a head (a multiple of 64)")
    parser.add_argument("--heads", type=int, default=1, help="KV heads a thread")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), choices=[1, 2])
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds (default 9)")
    args = parser.parse_args(argv)
    isa = cpu_isa() if args.isa == "auto" else args.isa
    if not isa:
        print("block_probe: this CPU runs neither AVX2 (with FMA, F16C) nor AVX-512 blocks", file=sys.stderr)
        return 2
    evict_mib = int(3 * max(llc_bytes(), 32 << 20)) >> 20  # as much as the benchmarks' Evictor writes
    print(
        f"{args.dtype} {isa}: {args.threads} thread(s) x {args.heads} head(s) of {args.length} positions; "
        f"A = the tree, B = {args.base}; {evict_mib} MiB written before every cold pass",
        flush=True,
    )
    out = run(
        dtype=args.dtype,
        isa=isa,
        length=args.length,
        heads=args.heads,
        threads=args.threads,
        rounds=args.rounds,
        evict_mib=evict_mib,
        base=args.base,
    )
    print(out, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
