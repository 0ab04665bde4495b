"""Symmetric int8 quantization along the last dimension (absmax / 127), as pure functions.

A KV cache quantizes each (token, KV head) row of D values on its own: ``scale = absmax / 127``
and ``code = round(x / scale)``, so ``x ~= code * scale`` with ``|x - code * scale| <= scale / 2``.
Codes stay in ``[-127, 127]``: ``-128`` is never produced, so negating a code is always exact and
the grid is symmetric around zero.

Defined behaviour at the edges:

- A row of zeros gets scale 0 and codes 0; it dequantizes to exact zeros (no 0/0).
- Outliers: one large value in a row sets that row's scale, so the row's other values are
  resolved to ``absmax / 254`` at worst. Rows do not affect each other (an outlier token or head
  costs precision only in itself).
- Non-finite input (NaN, +-inf) is refused with ``ValueError`` naming the tensor: a code cannot
  hold it, and one inf would turn its row's scale into inf and every other value into NaN.
- ``scale_dtype=float16`` halves the scale bytes. The codes are then computed against the scale
  *as stored* (rounded to float16), so the error bound above holds for what is kept. A row whose
  ``absmax / 127`` exceeds float16's range is refused (``ValueError``); a row so small that its
  scale rounds to zero in float16 (absmax below about 4e-6) is stored as zeros, an absolute error
  below its absmax; between the two, scales in float16's subnormal range (absmax below about
  8e-3) keep fewer than 11 significant bits.

No function here knows about caches or backends.
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = [
    "QMAX",
    "bitsandbytes_quantizer",
    "SCALE_DTYPES",
    "dequantize_int8",
    "dequantize_int8_residual",
    "hadamard_rotation",
    "quantize_int8",
    "quantize_int8_residual",
]

QMAX = 127
SCALE_DTYPES = (torch.float32, torch.float16)
_FLOAT16_MAX = torch.finfo(torch.float16).max
# Below this absmax, 127 / absmax overflows float32.
_TINY = QMAX / torch.finfo(torch.float32).max


@functools.cache
def bitsandbytes_quantizer():
    """bitsandbytes' row-wise absmax quantizer (``int8_vectorwise_quant``: LLM.int8()'s
    "vectorwise"), or None where bitsandbytes cannot load. Imported on the first call, not with
    this module: bitsandbytes' import also imports torch's compiler (~5 s of CPU), which a
    process that never quantizes with float32 scales (the command line, a server whose streams
    keep float16 scales, the default) should not pay."""
    # bitsandbytes is a declared dependency; its CPU kernels are plain torch in 0.50. Its import
    # logs a warning inviting users to `pip install kernels` (a 4-bit GEMM this project never
    # uses): keep its loggers to errors while it loads.
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from bitsandbytes.functional import int8_vectorwise_quant  # noqa: PLC0415
    except ImportError:  # pragma: no cover - kept usable where bitsandbytes cannot load
        return None
    finally:
        log.setLevel(level)
    return int8_vectorwise_quant


def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected at least one value per row, got shape {tuple(x.shape)}")
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"{name}: {bad} non-finite value(s) (NaN or inf) in shape {tuple(x.shape)}; int8 codes cannot hold them"
        )


def quantize_int8(
    x: torch.Tensor, *, scale_dtype: torch.dtype = torch.float32, name: str = "x", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` (..., D) per row of its last dimension.

    Returns ``(codes, scales)``: int8 codes of ``x``'s shape in ``[-127, 127]`` and scales of
    shape ``x.shape[:-1]`` in ``scale_dtype`` (float32 or float16), on ``x``'s device.
    Raises ``ValueError`` (naming ``name``) for non-finite input or a float16 scale overflow.
    ``check=False`` skips the finiteness checks for a caller that has made them (a cache on
    its append path, where each check is a pass of its own); the float16 overflow is always
    checked.
    """
    if check:
        _check_input(x, name)
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be float32 or float16, got {scale_dtype}")
    lead, d = x.shape[:-1], x.shape[-1]
    # float64 input is narrowed first: the scales are float32 at most anyway.
    x2 = x.reshape(-1, d).to(torch.float32)
    if check and x.dtype == torch.float64 and not bool(torch.isfinite(x2).all()):
        raise ValueError(f"{name}: values beyond the float32 range in shape {tuple(x.shape)}")
    codes = None
    bnb_quant = bitsandbytes_quantizer() if scale_dtype == torch.float32 and x2.shape[0] > 0 else None
    if bnb_quant is not None:
        # bitsandbytes' row-wise absmax quantizer (LLM.int8()'s "vectorwise") is exactly this
        # scheme with the absmax kept instead of absmax / 127. It multiplies by 127 / absmax, so
        # an all-zero row comes back as NaN cast to int8 (unspecified): those rows are zeroed
        # here. A row so tiny that 127 / absmax overflows goes the plain way below.
        codes, absmax, _ = bnb_quant(x2)
        if bool((absmax < _TINY).logical_and(absmax > 0).any()):
            codes = None
        else:
            codes = codes.masked_fill((absmax == 0).unsqueeze(-1), 0)
            scales = absmax / QMAX
    if codes is None:
        # float16 scales: the codes must be computed against the rounded scale that is stored,
        # which bitsandbytes cannot do (it only divides by the float32 absmax). Dividing (rather
        # than multiplying by a reciprocal) keeps subnormal scales finite.
        absmax = x2.abs().amax(dim=-1)
        scales32 = absmax / QMAX
        if scale_dtype == torch.float16 and bool((scales32 > _FLOAT16_MAX).any()):
            raise ValueError(
                f"{name}: a row's absmax {float(absmax.max()):.4g} needs a scale beyond float16's range "
                f"(rows up to {_FLOAT16_MAX * QMAX:.4g}); use float32 scales"
            )
        scales = scales32.to(scale_dtype)
        stored = scales.to(torch.float32).unsqueeze(-1)
        # A row whose stored scale is 0 has |x| < 4e-6 (or is zero): divided by 1 it rounds to 0.
        codes = torch.round(x2 / stored.masked_fill(stored == 0, 1.0))
        codes = codes.clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.reshape(x.shape), scales.reshape(lead)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales`` (scales broadcast over the last dimension), computed in float32, in ``dtype``.

    bitsandbytes' ``int8_vectorwise_dequant`` takes the absmax and multiplies by it and by 1/127
    (two roundings); with the scale stored directly one float32 product is exact to one rounding
    and needs no round trip of the scale through ``* 127``, so plain torch is used here.
    float64 ``dtype`` computes in float64 (the product of an int8 and a float32 is exact there).
    """
    if codes.dtype != torch.int8:
        raise TypeError(f"codes: expected int8, got {codes.dtype}")
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise ValueError(
            f"scales: expected shape {tuple(codes.shape[:-1])} for codes {tuple(codes.shape)}, got {tuple(scales.shape)}"
        )
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(work) * scales.to(work).unsqueeze(-1)).to(dtype)


def quantize_int8_residual(
    x: torch.Tensor, pieces: int, *, name: str = "x", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits ``x`` (..., D) into ``pieces`` int8 terms: ``x ~= sum_i codes[i] * scales[i]``.

    Piece 0 is ``quantize_int8``'s absmax / 127 quantization; each later piece quantizes what is
    left with a scale 254 times finer (the residual is at most half a step, so its codes still
    fit in [-127, 127]). The error is at most ``absmax / (254 * 254**(pieces-1))`` per value:
    three pieces reach float32's resolution of the row's absmax. This lets a float operand meet
    int8 codes in exact integer matrix products. Returns codes (pieces, ..., D) int8 and float32
    scales (pieces, ...). ``check=False`` skips the finiteness check for trusted operands.
    """
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    if check:
        _check_input(x, name)
    y = x.to(torch.float32)
    step = y.abs().amax(dim=-1, keepdim=True).div_(QMAX)
    zero = step == 0
    # one division, then every piece is a round and a rescale of the same buffer: few passes
    # over data that a caller can keep cache-sized.
    y = y / step.masked_fill(zero, 1.0)
    codes = torch.empty((pieces,) + tuple(x.shape), dtype=torch.int8, device=x.device)
    rounded = torch.empty_like(y)
    for i in range(pieces):
        torch.round(y, out=rounded)
        codes[i].copy_(rounded)
        if i + 1 < pieces:
            y.sub_(rounded).mul_(2 * QMAX)
    ratios = torch.tensor([(2.0 * QMAX) ** -i for i in range(pieces)], dtype=torch.float32, device=x.device)
    scales = step.squeeze(-1).unsqueeze(0) * ratios.view((pieces,) + (1,) * (x.dim() - 1))
    return codes, scales


def dequantize_int8_residual(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The sum of the pieces of ``quantize_int8_residual``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(work) * scales.to(work).unsqueeze(-1)).sum(0).to(dtype)


def hadamard_rotation(d: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """An orthonormal, symmetric (D, D) matrix that spreads outlier channels over the row.

    Per-row absmax quantization spends its whole range on a row's largest value, so a few
    outlier channels (common in keys) coarsen every other channel of every token. Rotating rows
    by a normalized Hadamard matrix first (QuaRot, SpinQuant) mixes each channel into all the
    others, so the absmax falls to a few times the row's RMS; attention is unchanged because
    ``(q H) . (k H) = q . k`` and ``sum p (v H) = (sum p v) H``. ``H @ H = I``.

    Sylvester's construction needs a power of two; for other D the matrix is block diagonal
    with the largest power-of-two block that divides D (D odd: the identity, no mixing).
    """
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    block = d & -d  # the largest power of two dividing d
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    h = h / block**0.5
    return torch.block_diag(*([h] * (d // block))).to(dtype=dtype, device=device)
