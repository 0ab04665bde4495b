"""Round trips and edge cases of ``quant`` (symmetric per-row int8, absmax / 127)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import quant
from quant import (
    QMAX,
    dequantize_int8,
    dequantize_int8_residual,
    quantize_int8,
    quantize_int8_residual,
)

SHAPES = [(1,), (7,), (3, 128), (2, 4, 97, 64)]
SCALE_DTYPES = [torch.float32, torch.float16]
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]
# Slack on the half-step bound: float32 rounding of x / scale and of code * scale.
REL_SLACK = 1e-5


def _ids(values):
    return [str(v).removeprefix("torch.") for v in values]


def _half_step_ok(x, codes, scales):
    err = (dequantize_int8(codes, scales, torch.float64) - x.double()).abs()
    bound = scales.double().unsqueeze(-1) / 2 + REL_SLACK * x.double().abs().amax(dim=-1, keepdim=True)
    return bool((err <= bound).all())


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=_ids(SCALE_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_round_trip_within_half_a_step(shape, scale_dtype):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    codes, scales = quantize_int8(x, scale_dtype=scale_dtype)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == scale_dtype and scales.shape == x.shape[:-1]
    assert _half_step_ok(x, codes, scales)
    # the absmax of every row lands on the end of the grid, and -128 never occurs
    assert bool((codes.abs().amax(dim=-1) == QMAX).all())
    assert int(codes.min()) >= -QMAX


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=_ids(INPUT_DTYPES))
def test_input_dtypes(dtype):
    x = torch.randn(4, 32).to(dtype)
    codes, scales = quantize_int8(x)
    assert scales.dtype == torch.float32
    assert _half_step_ok(x.float(), codes, scales)
    assert dequantize_int8(codes, scales, dtype).dtype == dtype


def test_values_on_the_grid_are_exact():
    k = torch.randint(-QMAX, QMAX + 1, (5, 16), dtype=torch.int32)
    k[:, 0] = QMAX  # fix the absmax so the scale is exactly 0.25 / 127 * 127
    x = k.float() * 0.25
    codes, scales = quantize_int8(x)
    assert torch.equal(codes.int(), k)
    assert torch.equal(dequantize_int8(codes, scales), x)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=_ids(SCALE_DTYPES))
def test_zero_rows_are_zero_and_do_not_touch_other_rows(scale_dtype):
    torch.manual_seed(1)
    x = torch.randn(6, 32)
    x[2] = 0
    x[5] = 0
    codes, scales = quantize_int8(x, scale_dtype=scale_dtype)
    assert bool((codes[[2, 5]] == 0).all()) and bool((scales[[2, 5]] == 0).all())
    y = dequantize_int8(codes, scales)
    assert bool(torch.isfinite(y).all()) and bool((y[[2, 5]] == 0).all())
    alone_codes, alone_scales = quantize_int8(x[[0, 1, 3, 4]], scale_dtype=scale_dtype)
    assert torch.equal(codes[[0, 1, 3, 4]], alone_codes) and torch.equal(scales[[0, 1, 3, 4]], alone_scales)


def test_outlier_costs_precision_only_in_its_own_row():
    torch.manual_seed(2)
    x = torch.randn(4, 128)
    x[1, 17] = 1e4
    codes, scales = quantize_int8(x)
    plain_codes, plain_scales = quantize_int8(x[[0, 2, 3]])
    assert torch.equal(codes[[0, 2, 3]], plain_codes) and torch.equal(scales[[0, 2, 3]], plain_scales)
    assert codes[1, 17] == QMAX
    # the rest of the outlier row is resolved to half a step of the outlier's scale
    assert _half_step_ok(x, codes, scales)
    assert float(scales[1]) == pytest.approx(1e4 / QMAX, rel=1e-6)


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_input_is_refused_naming_the_tensor(bad):
    x = torch.randn(3, 8)
    x[1, 4] = bad
    with pytest.raises(ValueError, match=r"new_key: 1 non-finite"):
        quantize_int8(x, name="new_key")
    with pytest.raises(ValueError, match="weights"):
        quantize_int8_residual(x, 2, name="weights")


def test_float64_beyond_float32_range_is_refused():
    with pytest.raises(ValueError, match="float32 range"):
        quantize_int8(torch.tensor([[1e300, 1.0]], dtype=torch.float64), name="k")


def test_float16_scale_overflow_is_refused_and_float32_takes_it():
    x = torch.tensor([[1e7, -3.0]])
    with pytest.raises(ValueError, match="float16"):
        quantize_int8(x, scale_dtype=torch.float16)
    codes, scales = quantize_int8(x)
    assert _half_step_ok(x, codes, scales)


def test_float16_scale_underflow_stores_zeros():
    x = torch.tensor([[1e-7, -2e-7, 0.0], [1.0, 0.5, -1.0]])
    codes, scales = quantize_int8(x, scale_dtype=torch.float16)
    assert scales[0] == 0 and bool((codes[0] == 0).all())
    assert bool((dequantize_int8(codes, scales)[0] == 0).all())  # error below the row's absmax
    assert _half_step_ok(x[1:], codes[1:], scales[1:])


def test_float16_scales_bound_holds_for_the_rounded_scale():
    torch.manual_seed(3)
    x = torch.randn(64, 128) * torch.logspace(-2, 4, 64).unsqueeze(1)
    codes, scales = quantize_int8(x, scale_dtype=torch.float16)
    assert _half_step_ok(x, codes, scales)
    assert int(codes.abs().max()) <= QMAX


def test_subnormal_float32_rows_quantize_finitely():
    x = torch.tensor([[1e-40, -5e-41, 0.0], [1.0, 2.0, 3.0]])
    codes, scales = quantize_int8(x)
    assert codes[0, 0] == QMAX and bool(torch.isfinite(scales).all())
    assert _half_step_ok(x, codes, scales)


def test_dequantize_refuses_wrong_inputs():
    codes, scales = quantize_int8(torch.randn(3, 8))
    with pytest.raises(TypeError, match="int8"):
        dequantize_int8(codes.int(), scales)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int8(codes, scales[:2])


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_residual_split_error_shrinks_254x_per_piece(pieces):
    torch.manual_seed(4)
    x = torch.randn(8, 4, 300) * 5
    x[0, 0] = 0
    codes, scales = quantize_int8_residual(x, pieces)
    assert codes.shape == (pieces,) + x.shape and scales.shape == (pieces,) + x.shape[:-1]
    assert int(codes.min()) >= -QMAX
    absmax = x.double().abs().amax(dim=-1, keepdim=True)
    bound = absmax / QMAX / 2 / (2 * QMAX) ** (pieces - 1) + 4e-7 * absmax
    err = (dequantize_int8_residual(codes, scales, torch.float64) - x.double()).abs()
    assert bool((err <= bound).all())
    assert bool((dequantize_int8_residual(codes, scales)[0, 0] == 0).all())
    if pieces == 1:
        plain_codes, plain_scales = quantize_int8(x)
        assert torch.equal(codes[0], plain_codes) and torch.equal(scales[0], plain_scales)


def test_residual_split_refuses_zero_pieces():
    with pytest.raises(ValueError, match="pieces"):
        quantize_int8_residual(torch.randn(2, 3), 0)


def test_quant_imports_no_backend_or_transport():
    # read statically: importing in a subprocess would pay torch's start-up again
    for path in pathlib.Path(quant.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else []
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("backends", "grpc", "prometheus_client"), (path.name, name)
