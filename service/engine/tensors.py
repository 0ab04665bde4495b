"""gqa.v1 ``Tensor`` messages to torch tensors and back, checked once here.

Wire format: little-endian, row-major bytes; float16 and bfloat16 as raw 16-bit words.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
import warnings

import torch

from ..api import gqa_pb2
from ..errors import InvalidArgument
from ..vocab import DTYPE_NAMES, DTYPE_TO_TORCH, NAME_TO_DTYPE, TORCH_TO_DTYPE  # noqa: F401 (re-exported)

__all__ = ["from_proto", "to_proto", "tune_allocator", "DTYPE_TO_TORCH", "TORCH_TO_DTYPE", "DTYPE_NAMES"]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("gqa-serve's tensor codec assumes a little-endian host")

# Larger dimensions could only describe empty tensors, which torch cannot even size.
MAX_DIM = (1 << 31) - 1
_ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int8: 1}
# Tensors over a message's (immutable) bytes are only ever read; torch warns about them anyway.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def from_proto(
    message: gqa_pb2.Tensor, name: str, *, rank: int | None = None, allow_int8: bool = False, copy: bool = True
) -> torch.Tensor:
    """A torch tensor; ``InvalidArgument`` naming ``name`` for anything malformed.

    With ``copy`` it is a writable copy; without, a read-only view of the message's bytes
    (``torch.frombuffer``: no copy; never write to it). ``DTYPE_INT8`` is accepted only where
    ``allow_int8`` says so (snapshot codes).
    """
    if allow_int8 and message.dtype == gqa_pb2.DTYPE_INT8:
        dtype = torch.int8
    elif message.dtype in DTYPE_TO_TORCH:
        dtype = DTYPE_TO_TORCH[message.dtype]
    else:
        raise InvalidArgument(
            f"{name}.dtype: {message.dtype} is not a supported dtype (DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16)"
        )
    shape = tuple(message.shape)
    if rank is not None and len(shape) != rank:
        raise InvalidArgument(f"{name}.shape: expected {rank} dimensions, got {list(shape)}")
    if any(d < 0 or d > MAX_DIM for d in shape):
        raise InvalidArgument(f"{name}.shape: dimensions must be in 0..{MAX_DIM}, got {list(shape)}")
    itemsize = _ITEMSIZE[dtype]
    count = math.prod(shape)
    if count * itemsize != len(message.data):
        raise InvalidArgument(
            f"{name}.data: {len(message.data)} bytes, but shape {list(shape)} of {str(dtype)[6:]} "
            f"needs {count * itemsize}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data) if copy else message.data, dtype=dtype).view(shape)


def to_proto(tensor: torch.Tensor) -> gqa_pb2.Tensor:
    tensor = tensor.detach().to("cpu").contiguous()
    data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return gqa_pb2.Tensor(dtype=TORCH_TO_DTYPE[tensor.dtype], shape=list(tensor.shape), data=data)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 128 << 20
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Serves buffers under 64 MiB from glibc's heap instead of fresh pages (once per process;
    False where the C library is not glibc).

    A step's output, a reply's bytes and a request's tensors are allocated and freed once per
    message; at ~1 MiB (a 64-sequence ``Batch`` step, a long stream's reply) glibc maps each one
    fresh (or, above its mmap threshold, gives the heap's top back to the kernel on free) and
    every page faults on first touch; both thresholds are raised (docs/design.md, "The step
    reply and its bytes", has the measurement). The cost: each heap keeps up to 128 MiB of
    freed memory mapped instead of returning it.
    """
    global _tuned
    if _tuned is None:
        _tuned = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _tuned = bool(
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
    return _tuned
