"""The compiled kernel's key layout (``backends.key_layout.KeyBlocks``): rows written and read
back in logical order around its blocks of 64, for every packing; and layer states exported
before the layout existed restore into it, on every kernel, with the same keys and the same
next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import key_layout, native
from backends.int8 import Int8Cache
from backends.key_layout import BLOCK, KeyBlocks
from tests.conftest import TOLERANCES

FIXTURE = Path(__file__).parent / "data" / "layer_states_before_key_blocks.pt"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("capacity", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_rows_come_back_in_logical_order_around_the_blocks(capacity, dtype):
    channels = 5  # odd: bfloat16 pads a zero channel to its pairs
    gen = torch.Generator().manual_seed(capacity)
    blocks = KeyBlocks((2, 3), capacity, channels, dtype)
    full = torch.randint(-100, 100, (2, 3, capacity, channels), generator=gen).to(dtype)
    blocks.write(0, full)
    assert torch.equal(blocks.read(0, capacity), full)
    for a, b in [(0, 1), (BLOCK - 2, BLOCK + 2), (capacity - 1, capacity), (1, capacity)]:
        b = min(b, capacity)
        if a >= b:
            continue
        rows = torch.randint(-100, 100, (2, 3, b - a, channels), generator=gen).to(dtype)
        blocks.write(a, rows)
        full[:, :, a:b] = rows
        assert torch.equal(blocks.read(a, b), rows) and torch.equal(blocks.read(0, capacity), full)
    # the address the C kernel computes (key_cell) holds the row's channel
    p, kp = key_layout.PACK[dtype], blocks.padded
    for j, r in [(0, 0), (channels - 1, capacity - 1), (channels // 2, capacity // 2)]:
        b0 = r - r % BLOCK
        w = min(BLOCK, capacity - b0)
        at = b0 * kp + (j // p) * w * p + (r % BLOCK) * p + j % p
        assert blocks.data[1, 2, at] == full[1, 2, r, j]
    assert blocks.data.numel() == 2 * 3 * capacity * kp  # nothing padded but the channels


def _cases() -> list:
    """(fixture entry, kernel) for every kernel of its backend, skipped where it cannot run."""
    ok, why = native.available()
    isas = native.load().isas(16) if ok else []
    cases = []
    for name in ("cpu-float32", "cpu-bfloat16", "cpu-float16", "int8-float32"):
        kernels = [f"native-{isa}" for isa in ("portable", "avx2", "avx512", "avx512dot")]
        kernels.append("torch" if name.startswith("cpu") else "blocks")
        for k in kernels:
            usable = not k.startswith("native-") or k.partition("-")[2] in isas
            cases.append(
                pytest.param(
                    name,
                    k,
                    id=f"{name}-{k}",
                    marks=pytest.mark.skipif(not usable, reason=f"{k} does not run here {why}"),
                )
            )
    return cases


@pytest.mark.parametrize("name,kernel", _cases())
def test_a_state_exported_before_the_key_blocks_restores_into_them(name, kernel):
    """tests/data/make_layer_states_before_key_blocks.py made the fixture with the code before
    this layout (transposed keys): a sink ring of 100 rows (a last block of 36), turned."""
    saved = torch.load(FIXTURE, weights_only=False)[name]
    spec_dtype = saved["output"].dtype
    from backends.contract import CacheSpec
    from backends.cpu import DenseCache
    from backends.policy import EvictionPolicy

    spec = CacheSpec(1, 4, 2, 16, spec_dtype, EvictionPolicy.sink(97, 3))
    cache = Int8Cache(spec, kernel=kernel) if name.startswith("int8") else DenseCache(spec, kernel)
    cache.load_state(saved["tokens_seen"], saved["state"])
    exported = cache.export()
    assert all(torch.equal(a, b) for a, b in zip(exported, saved["export"]))
    out = cache.step(*saved["step"]).output
    atol, rtol = TOLERANCES[spec_dtype]
    torch.testing.assert_close(out.double(), saved["output"].double(), atol=atol, rtol=rtol)
