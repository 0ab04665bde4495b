"""Builds the decode library from ``backends/csrc/`` into the kernel cache, once per source.

The library is cached under ``GQA_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/gqa-serve``, else
``~/.cache/gqa-serve``), named by a hash of every source and header (names and contents), the
flags and the machine type, so a changed source never loads a stale build; its objects are kept
in ``objects/`` there, named by their source, every header, the compiler and their flags, so a
build of another variant compiles only what differs. The build takes no
``-march`` flag: the AVX-512 path is chosen at run time, so a library built into a container
image runs on any x86-64 node. ``python -m backends.native build`` builds ahead of time (the
Dockerfile does, so the runtime image needs no compiler). Where no compiler or no writable cache
exists, ``build`` raises ``NativeUnavailable`` with the reason.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["CSRC", "NativeUnavailable", "build", "build_torch_step", "cache_dir", "sources", "torch_step_path"]

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-pthread", "-fno-strict-aliasing")
# GQA_KERNEL_TEST_HOOKS=1 (tests only: tests/conftest.py sets it): the library with its
# failure injection (csrc/test_hooks.c: FLAG_FAIL_AFTER_WRITE acted on), under its own name;
# the production library has none of it.
TEST_HOOKS_FLAGS = ("-DGQA_TEST_HOOKS",)
# A source (or header) whose preprocessor lines test GQA_TEST_HOOKS: only such sources compile
# with the define (every source, if a header tests it), so the test build's other objects are
# the production build's own and come from the object cache (build(): a first `make test` built
# the blocks twice, ~60 s on two cores).
_TESTS_HOOKS = re.compile(rb"^[ \t]*#[ \t]*(?:if|ifdef|ifndef|elif)\b.*\bGQA_TEST_HOOKS\b", re.M)
# GQA_KERNEL_SANITIZE=1 (tests only: tests/test_sanitizers.py): the library built with
# AddressSanitizer and UndefinedBehaviorSanitizer (and the test hooks), under its own name; a
# process loading it needs the ASan runtime preloaded (LD_PRELOAD=$(cc -print-file-name=libasan.so)).
# -g1: line tables for the reports' stack traces, without -g's variable info (which took the
# AVX2 blocks' file from ~26 s to ~48 s to compile). Without UBSan's pointer-overflow and
# object-size checks, which instrument every address the inlined blocks compute and doubled that
# file's compile (73 s -> 34 s here, the sanitized build ~100 s -> ~50 s on two cores): an
# access that either would have caught past an object's end is ASan's report anyway.
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize=pointer-overflow,object-size",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g1",
)
# GQA_KERNEL_STAMPS=1 (tests/bench/stamp_profile.py only): the library with time stamps of a
# step's parts (csrc/stamps.c), under its own name; with the test hooks too when they are set.
STAMPS_FLAGS = ("-DGQA_STAMPS",)
# GQA_KERNEL_EMULATE_AVX512=1 (tests only: tests/test_avx512_emulated.py): the library whose
# AVX-512 paths run on an AVX2 CPU, each intrinsic a portable function (csrc/gqa_emu512.h), so
# that a machine without AVX-512 tests those paths too; under its own name, never served from.
# -O1: the AVX-512 blocks' file compiled in 15 s instead of 43 s at -O3 (its speed means nothing).
EMULATE_FLAGS = ("-DGQA_EMULATE_AVX512", "-Wno-psabi")


def sources() -> list[Path]:
    """The library's C files, in a fixed order (each is compiled into it)."""
    return sorted(CSRC.glob("*.c"))


def _cflags() -> tuple[str, ...]:
    if os.environ.get("GQA_KERNEL_SANITIZE") == "1":
        return ("-O1",) + CFLAGS[1:] + TEST_HOOKS_FLAGS + SANITIZE_FLAGS
    flags = CFLAGS + (TEST_HOOKS_FLAGS if os.environ.get("GQA_KERNEL_TEST_HOOKS") == "1" else ())
    if os.environ.get("GQA_KERNEL_EMULATE_AVX512") == "1":
        flags = ("-O1",) + flags[1:] + EMULATE_FLAGS
    return flags + (STAMPS_FLAGS if os.environ.get("GQA_KERNEL_STAMPS") == "1" else ())


LIBS = ("-lm",)


class NativeUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    explicit = os.environ.get("GQA_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gqa-serve"


def _library_name() -> str:
    key = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]")):
        key.update(path.name.encode() + b"\0")
        key.update(path.read_bytes())
    flags = _cflags()
    key.update(" ".join(flags + LIBS).encode())
    key.update(f"{sys.platform}-{platform.machine()}".encode())
    kind = "-sanitize" if SANITIZE_FLAGS[0] in flags else "-testhooks" if TEST_HOOKS_FLAGS[0] in flags else ""
    kind += "-emu512" if EMULATE_FLAGS[0] in flags else ""
    kind += "-stamps" if STAMPS_FLAGS[0] in flags else ""
    return f"gqa_decode{kind}-{key.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """The library's path in ``directory`` (default ``cache_dir()``), compiling it if absent.

    Raises ``NativeUnavailable`` when there is no compiler, the cache is not writable or the
    compiler fails (with its output).
    """
    directory = Path(directory) if directory is not None else cache_dir()
    target = directory / _library_name()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable(
            f"no C compiler (set CC, or prebuild into {directory} with `python -m backends.native build`)"
        )
    work = _work_dir(directory)
    try:
        flags = _cflags()
        # one object per source, compiled side by side (16 files: ~4x faster on 4 cores) unless the
        # object cache has it, then linked
        files = sources()
        texts = {path.name: path.read_bytes() for path in sorted(CSRC.glob("*.h"))}
        headers = b"".join(name.encode() + b"\0" + text for name, text in texts.items())
        hooks_in_headers = any(_TESTS_HOOKS.search(text) for text in texts.values())
        objects, jobs = [], []
        for src in files:
            text = src.read_bytes()
            own = flags
            if not hooks_in_headers and not _TESTS_HOOKS.search(text):
                own = tuple(f for f in flags if f not in TEST_HOOKS_FLAGS)
            key = hashlib.sha256("\0".join((compiler, *own, src.name)).encode() + b"\0" + text + b"\0" + headers)
            obj = directory / "objects" / f"{src.stem}-{key.hexdigest()[:16]}.o"
            objects.append(str(obj))
            if not obj.exists():
                jobs.append(([compiler, *own, "-c", "-o", str(work / obj.name), str(src)], work / obj.name, obj))
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_compile_object, jobs))  # the first failure raises
        _compile([compiler, *flags, "-o", str(work / "lib.so"), *objects, *LIBS])
        os.replace(work / "lib.so", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _compile_object(job: tuple[list[str], Path, Path]) -> None:
    """Runs one compile into the work folder (``built``), then renames the object into the
    object cache (``obj``): a concurrent builder finds it whole or not at all."""
    cmd, built, obj = job
    _compile(cmd)
    obj.parent.mkdir(exist_ok=True)
    os.replace(built, obj)


# The public step's optional entry with torch tensors (csrc/torch_step.cpp, the Python module
# _gqa_torch_step): C++ against torch's and Python's headers, linked to torch's libraries, so
# named by torch's version and Python's ABI as well as its source. ~12 s to compile, once.
TORCH_STEP = CSRC / "torch_step.cpp"
CXXFLAGS = ("-O2", "-fPIC", "-shared", "-std=c++17", "-w")


def _torch_step_inputs() -> tuple[Path, tuple[str, ...], str]:
    """(torch's folder, the compile and link flags, the file name) of the torch step module."""
    import sysconfig  # noqa: PLC0415

    import numpy  # noqa: PLC0415
    import torch  # noqa: PLC0415 (this module is imported without torch by `backends.native build`'s users)

    root = Path(torch.__file__).resolve().parent
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    flags = (
        *CXXFLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{numpy.get_include()}",
        f"-L{root / 'lib'}",
        f"-Wl,-rpath,{root / 'lib'}",
    )
    key = hashlib.sha256(TORCH_STEP.read_bytes())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key.update(" ".join(flags).encode() + torch.__version__.encode() + numpy.__version__.encode() + suffix.encode())
    return root, flags, f"_gqa_torch_step-{key.hexdigest()[:16]}{suffix}"


def torch_step_path(directory: Path | None = None) -> Path:
    """Where ``build_torch_step`` puts (or has put) the module for this source and this torch."""
    directory = Path(directory) if directory is not None else cache_dir()
    return directory / _torch_step_inputs()[2]


def build_torch_step(directory: Path | None = None) -> Path:
    """The torch step module's path in ``directory`` (default ``cache_dir()``), compiling it if
    absent; ``NativeUnavailable`` when there is no C++ compiler, no Python or torch headers, no
    writable cache, or the compiler fails."""
    directory = Path(directory) if directory is not None else cache_dir()
    root, flags, name = _torch_step_inputs()
    target = directory / name
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise NativeUnavailable("no C++ compiler for the torch step module (set CXX)")
    header = root / "include" / "torch" / "csrc" / "autograd" / "python_variable.h"
    if not header.exists():
        raise NativeUnavailable(f"torch's headers are not installed ({header} is absent)")
    work = _work_dir(directory)
    try:
        out = work / "module.so"
        _compile([compiler, *flags, "-o", str(out), str(TORCH_STEP), "-ltorch_python", "-ltorch", "-lc10"])
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _work_dir(directory: Path) -> Path:
    """A private folder in ``directory`` to compile into, then rename from: concurrent builders
    never load a partial file. ``NativeUnavailable`` when the cache is not writable."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
    except OSError as exc:
        raise NativeUnavailable(f"kernel cache {directory} not writable ({exc.strerror})") from None


def _compile(cmd: list[str]) -> list[str]:
    """Runs one compiler command; ``NativeUnavailable`` with its output if it fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeUnavailable(f"cannot run the C compiler {cmd[0]!r} ({exc})") from None
    if done.returncode != 0:
        raise NativeUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    return cmd
