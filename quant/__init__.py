"""Pure quantize / dequantize functions for KV caches; no knowledge of backends."""

from .int8 import (
    QMAX,
    SCALE_DTYPES,
    dequantize_int8,
    dequantize_int8_residual,
    hadamard_rotation,
    quantize_int8,
    quantize_int8_residual,
)

__all__ = [
    "QMAX",
    "SCALE_DTYPES",
    "dequantize_int8",
    "dequantize_int8_residual",
    "hadamard_rotation",
    "quantize_int8",
    "quantize_int8_residual",
]
