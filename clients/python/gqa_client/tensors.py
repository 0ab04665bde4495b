"""Tensors to gqa.v1 ``Tensor`` messages and back, with numpy; torch only where the caller uses it.

Wire format: little-endian, row-major bytes; float16 and bfloat16 as raw 16-bit words.

The dtype rule. A stream (or ``Batch`` session) has one dtype, ``float32``, ``float16`` or
``bfloat16``, and every tensor sent on it must already have that dtype: anything else raises a
``TypeError`` naming the argument and both dtypes; nothing is converted behind the caller's
back. A torch tensor must have exactly the stream's torch dtype. A numpy array must have the
stream's numpy dtype, with one exception, because numpy has no bfloat16: for a ``bfloat16``
stream a numpy array must be ``float32``, and its values are rounded to bfloat16 (to nearest,
ties to even, as ``torch.Tensor.to(torch.bfloat16)`` does) on the way out.

Results come back of the query's kind, writable copies on the CPU: a torch tensor for a torch
query (torch's dtype, so bfloat16 for a bfloat16 stream; a query on another device gets a CPU
tensor back), a numpy array for a numpy query (``float32`` for a bfloat16 stream; exact, every
bfloat16 is a float32).

torch is never imported here: a torch tensor can only be passed by a caller that has imported
torch, so ``sys.modules`` tells whether a value may be one.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from .api import gqa_pb2

__all__ = ["DTYPES", "dtype_name", "encode", "encode_into", "decode", "is_torch", "bfloat16_bits", "from_bfloat16_bits"]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("gqa_client's tensor codec assumes a little-endian host")

DTYPES: dict[str, int] = {
    "float32": gqa_pb2.DTYPE_FLOAT32,
    "float16": gqa_pb2.DTYPE_FLOAT16,
    "bfloat16": gqa_pb2.DTYPE_BFLOAT16,
}
"""A stream's dtype name -> its wire enum."""
_NAMES = {wire: name for name, wire in DTYPES.items()}
_NUMPY = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _torch():
    return sys.modules.get("torch")


def is_torch(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"float16"`` or ``"bfloat16"`` from a name, a torch dtype, a numpy dtype
    or a wire enum; ``ValueError`` for anything else."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif isinstance(dtype, int) and not isinstance(dtype, bool):
        name = _NAMES.get(dtype, str(dtype))
    elif _torch() is not None and isinstance(dtype, _torch().dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not a stream dtype (float32, float16, bfloat16)")
    return name


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even; NaN to 0x7FC0), as uint16."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 words (uint16) as float32 values: exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _describe(value: Any) -> str:
    if is_torch(value):
        return f"a torch {str(value.dtype).removeprefix('torch.')} tensor"
    return f"a numpy {value.dtype} array"


def encode(value: Any, dtype: str, name: str) -> gqa_pb2.Tensor:
    """``value`` (a numpy array or torch tensor of the stream's ``dtype``, see the module's rule)
    as a ``Tensor`` message; ``TypeError`` naming ``name`` otherwise."""
    message = gqa_pb2.Tensor()
    encode_into(message, value, dtype, name)
    return message


def encode_into(message: gqa_pb2.Tensor, value: Any, dtype: str, name: str) -> None:
    """``encode`` into an (empty) ``Tensor`` field of a message being built: assigning the
    fields of a nested message costs half of building it with keyword arguments (upb), which is
    most of the client's own work per step."""
    if is_torch(value):
        have = str(value.dtype).removeprefix("torch.")
        if have != dtype:
            raise TypeError(
                f"{name}: {_describe(value)}, but the stream's dtype is {dtype}; convert it first "
                f"({name}.to(torch.{dtype}))"
            )
        torch = _torch()
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        shape = tuple(tensor.shape)
        array = (tensor.view(torch.int16) if dtype == "bfloat16" else tensor).numpy()
    elif isinstance(value, np.ndarray):
        shape = value.shape
        if dtype == "bfloat16":
            if value.dtype != np.float32:
                raise TypeError(
                    f"{name}: {_describe(value)}, but the stream's dtype is bfloat16, which numpy "
                    "lacks: give float32 values (rounded to bfloat16 here) or a torch.bfloat16 tensor"
                )
            array = bfloat16_bits(value)
        elif value.dtype != _NUMPY[dtype]:
            raise TypeError(
                f"{name}: {_describe(value)}, but the stream's dtype is {dtype}; convert it first "
                f"({name}.astype(numpy.{dtype}))"
            )
        else:
            array = value
    else:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(value).__name__}")
    message.dtype = DTYPES[dtype]
    message.shape.extend(shape)
    # tobytes() copies in C order whatever the strides: one copy, no contiguity check needed.
    message.data = array.tobytes()


def decode(message: gqa_pb2.Tensor, like: Any, name: str) -> Any:
    """A message's tensor as ``like``'s kind (torch for a torch tensor, numpy otherwise), writable.

    ``ValueError`` naming ``name`` when the server's reply is malformed (dtype or byte length).
    """
    dtype = _NAMES.get(message.dtype)
    if dtype is None:
        raise ValueError(f"{name}.dtype: {message.dtype} is not a stream dtype")
    shape = tuple(message.shape)
    if math.prod(shape) * _ITEMSIZE[dtype] != len(message.data):
        raise ValueError(f"{name}.data: {len(message.data)} bytes do not fill shape {list(shape)} of {dtype}")
    if is_torch(like):
        torch = _torch()
        torch_dtype = getattr(torch, dtype)
        if not message.data:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(bytearray(message.data), dtype=torch_dtype).view(shape)
    array = np.frombuffer(bytearray(message.data), dtype=_NUMPY[dtype]).reshape(shape)
    return from_bfloat16_bits(array) if dtype == "bfloat16" else array
