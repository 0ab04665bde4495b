"""The compiled int8 decode kernel (``backends/csrc/int8_decode.c``), built on first use.

torch on the CPU has no product of int8 codes with float operands, and widening the codes with
torch ops writes a float copy to memory; the kernel widens them in registers instead and reads
each code once (see the C file). It is plain C with no Python or torch headers, so it builds in
well under a second with the system C compiler and is loaded with ``ctypes`` (as Triton builds
and caches its launcher stubs).

The shared library is cached under ``GQA_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/gqa-serve``,
else ``~/.cache/gqa-serve``), named by a hash of the source, the flags and the machine type, so
a changed source never loads a stale build. The build takes no ``-march`` flag: the AVX-512
path is chosen at run time, so a library built into a container image runs on any x86-64 node.
``python -m backends.native build`` builds ahead of time (the Dockerfile does, so the runtime
image needs no compiler).

Where no compiler or no writable cache exists, ``load`` raises ``NativeUnavailable`` with the
reason and the int8 backend falls back to its torch kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["ISA", "Int8Kernel", "NativeUnavailable", "available", "build", "cache_dir", "load", "set_threads", "threads"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_decode.c"
CFLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-pthread", "-fno-strict-aliasing")
LIBS = ("-lm",)
# implementation choice passed to the kernel (the C enum)
ISA = {"auto": 0, "portable": 1, "avx512": 2}
# Below this many (position x KV head) pairs a step takes tens of microseconds: starting threads
# would cost more than it saves.
_PARALLEL_MIN_WORK = 1 << 13
# A split of the positions below this many is not worth its partial result.
_MIN_SPLIT = 512


_threads = os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Sizes the process-wide pool the compiled kernels run on (the server's
    ``--kernel-threads``); ``n`` >= 1."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kernel threads must be an int >= 1, got {n!r}")
    _threads = n


def threads() -> int:
    """The size of the compiled kernels' thread pool."""
    return _threads


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
    key.update(SOURCE.read_bytes())
    key.update(" ".join(CFLAGS + LIBS).encode())
    key.update(f"{sys.platform}-{platform.machine()}".encode())
    return f"int8_decode-{key.hexdigest()[:16]}.so"


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
        raise NativeUnavailable(f"no C compiler (set CC, or prebuild into {directory} with `python -m backends.native build`)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # compile to a private name, then rename: concurrent builders never load a partial file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailable(f"kernel cache {directory} not writable ({exc.strerror})") from None
    try:
        cmd = [compiler, *CFLAGS, "-o", tmp, str(SOURCE), *LIBS]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeUnavailable(f"cannot run the C compiler {compiler!r} ({exc})") from None
        if done.returncode != 0:
            raise NativeUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Int8Kernel:
    """The loaded library, with typed entry points."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.gqa_int8_attend.argtypes = [p, p, p, p, p, i32, i64, i64, i64, i64, i64, i64, i64, p, i64, p, i64, i64, p, i32, i32]
        lib.gqa_int8_attend.restype = i32
        lib.gqa_int8_usable_isas.argtypes = [i64]
        lib.gqa_int8_usable_isas.restype = i32
        lib.gqa_hadamard_rows.argtypes = [p, i64, i64, i64]
        lib.gqa_hadamard_rows.restype = i32
        lib.gqa_read_bytes.argtypes = [p, i64, i32]
        lib.gqa_read_bytes.restype = ctypes.c_uint64
        self._lib = lib

    def isas(self, head_dim: int) -> list[str]:
        """The implementations that run on this CPU at ``head_dim``, the fastest last."""
        mask = self._lib.gqa_int8_usable_isas(head_dim)
        return [name for name, bit in ISA.items() if bit and mask & (1 << bit)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
               runs, ko: torch.Tensor | None = None, *, isa: str = "auto", threads: int | None = None) -> torch.Tensor:
        """Attention of ``q`` over the int8 codes, see ``backends/csrc/int8_decode.c``.

        q (N, G, Dk + O) float32 contiguous, already scaled, its channels in the cache's key
        order (the Dk coded channels, then the O outlier channels); k (N, Dk, C) int8 with unit
        position stride (rows may be padded, see ``Int8Cache``); ko (N, O, C) float16 contiguous
        or None (O = 0); v (N, C, D) int8 contiguous; ks, vs (N, C) float32 or float16 scales
        of every row, contiguous; runs the physical (a, b) runs of the attended rows. Returns
        (N, G, D) float32. Releases the GIL while it runs.
        """
        n, g, dq = q.shape
        c, d = v.shape[1], v.shape[2]
        dk = k.shape[1]
        no = 0 if ko is None else ko.shape[1]
        total = sum(b - a for a, b in runs)
        for name, t in (("q", q), ("v", v)) + ((("ko", ko),) if ko is not None else ()):
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"int8 kernel: {name} must be a contiguous CPU tensor")
        if dq != dk + no:
            raise ValueError(f"int8 kernel: q has {dq} channels, the keys {dk} coded + {no} outlier")
        if k.device.type != "cpu" or k.stride(2) != 1 or (n > 1 and k.stride(0) != dk * k.stride(1)) or k.shape != (n, dk, c):
            raise ValueError(f"int8 kernel: k must be ({n}, {dk}, {c}) with unit position stride and rows evenly spaced")
        if ko is not None and (ko.dtype != torch.float16 or ko.shape != (n, no, c)):
            raise ValueError(f"int8 kernel: ko must be float16 ({n}, {no}, {c})")
        if (ks.shape != (n, c) or vs.shape != (n, c) or not ks.is_contiguous() or not vs.is_contiguous()
                or ks.dtype != vs.dtype or ks.dtype not in (torch.float32, torch.float16)):
            raise ValueError(f"int8 kernel: scales must be contiguous float32 or float16 (N, C) = ({n}, {c})")
        if q.dtype != torch.float32:
            raise ValueError("int8 kernel: q must be float32")
        if threads is None:
            threads = torch.get_num_threads() if total * n >= _PARALLEL_MIN_WORK else 1
        nsplit = max(1, min(-(-4 * threads // n), total // _MIN_SPLIT)) if threads > 1 else 1
        flat = (ctypes.c_int64 * (2 * len(runs)))(*(x for run in runs for x in run))
        out = torch.empty((n, g, d), dtype=torch.float32)
        rc = self._lib.gqa_int8_attend(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), ks.data_ptr(), vs.data_ptr(), int(ks.dtype == torch.float16), c,
            n, g, d, dk, c, k.stride(1), None if ko is None else ko.data_ptr(), no,
            flat, len(runs), nsplit, out.data_ptr(), threads, ISA[isa],
        )
        if rc:
            raise RuntimeError(f"int8 kernel failed: {os.strerror(-rc)}")
        return out

    def hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ quant.hadamard_rotation(D)`` for float32 CPU rows (..., D), as a new tensor,
        computed without torch's thread pool (see ``gqa_hadamard_rows``)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("hadamard: expected a float32 CPU tensor")
        y = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
        d = y.shape[-1]
        rc = self._lib.gqa_hadamard_rows(y.data_ptr(), y.numel() // d if d else 0, d, d & -d)
        if rc:
            raise ValueError(f"hadamard: {os.strerror(-rc)} for shape {tuple(x.shape)}")
        return y

    def read_bytes(self, t: torch.Tensor, threads: int | None = None) -> int:
        """Reads a contiguous tensor's bytes once (the benchmark's memory floor)."""
        if not t.is_contiguous():
            raise ValueError("read_bytes: the tensor must be contiguous")
        return self._lib.gqa_read_bytes(t.data_ptr(), t.nbytes, threads or torch.get_num_threads())


@functools.cache
def load() -> Int8Kernel:
    """The kernel, built if needed; ``NativeUnavailable`` says why not (the result is cached)."""
    try:
        return Int8Kernel(build())
    except OSError as exc:  # dlopen failed
        raise NativeUnavailable(f"cannot load the int8 kernel ({exc})") from None


def available() -> tuple[bool, str]:
    """Whether the kernel loads here, and if not why (never raises)."""
    try:
        load()
    except NativeUnavailable as exc:
        return False, str(exc)
    return True, ""


def _main(argv: list[str]) -> int:
    if argv[:1] != ["build"] or len(argv) > 2:
        print("usage: python -m backends.native build [DIRECTORY]", file=sys.stderr)
        return 2
    try:
        path = build(Path(argv[1]) if len(argv) == 2 else None)
    except NativeUnavailable as exc:
        print(f"backends.native: {exc}", file=sys.stderr)
        return 1
    kernel = Int8Kernel(path)
    print(f"{path} (on this CPU at head_dim 128: {', '.join(kernel.isas(128))})")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
