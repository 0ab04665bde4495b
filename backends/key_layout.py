"""Where a CPU cache keeps its keys: the one definition of the key layouts, which the C kernel
(``csrc/gqa_internal.h``, ``key_block`` / ``key_cell``) reads and writes by the same rules.

``KeyBlocks`` (the compiled kernel's layout): per KV head, the C ring rows in blocks of
``BLOCK`` rows, one block after the other; block b holds rows [64 b, 64 b + w) (w = 64, or
C mod 64 for a shorter last block) as ceil(K / P) lines of w words, a word being the P key
channels of one row (P = ``PACK[dtype]``: 2 for bfloat16, a 32-bit word the operand of the
BF16 dot product ``vdpbf16ps``; else 1. K is the key channel count, padded with zero channels
to Kp, a multiple of P):

    head h: | block 0: line 0 (rows 0..63, channels 0..P-1) | line 1 (channels P..2P-1) | ... |
            | block 1: line 0 (rows 64..127) | ... | ... | block ceil(C/64)-1 (w rows) |

    element (h, channel j, row r) = h * C * Kp + (r // 64) * 64 * Kp
                                    + (j // P) * w * P + (r % 64) * P + j % P      (Kp = K padded)

So a block of 64 positions is one contiguous run of 64 * Kp elements (32 KiB for float32 at
D = 128), read front to back, which the hardware prefetcher follows, where the transposed layout
it replaces had D separate streams a few lines long at a stride of C. Nothing is padded but the
channels (to a multiple of P).

``KeyRows`` (the torch kernels' layout): transposed (B, Hkv, K, stride) with stride =
``key_row_stride(C)``, the first C columns the ring's rows: ``q @ K^T`` is then a
row-major GEMM over the sequence.

Both store (B, Hkv, n, K) rows at ring rows ``start ..`` (``write``) and give them back
(``read``) in logical order: snapshots and exports do not depend on the layout.
"""

from __future__ import annotations

import torch

from . import host_memory

__all__ = ["BLOCK", "PACK", "KeyBlocks", "KeyRows", "key_row_stride"]

BLOCK = 64  # rows per block: the C kernel's TILE_T
# channels per 32-bit word, by storage dtype (the C kernel's kpack)
PACK = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 1, torch.int8: 1}


class KeyBlocks:
    """Keys of (B, Hkv) heads, ``capacity`` ring rows of ``channels`` channels in ``dtype``, in
    blocks (see the module docstring). ``data`` is the storage, (B, Hkv, C * Kp) contiguous;
    ``head_stride`` the elements from one KV head's keys to the next (C * Kp)."""

    def __init__(self, lead: tuple[int, int], capacity: int, channels: int, dtype: torch.dtype, device="cpu"):
        self.lead, self.capacity, self.channels = tuple(lead), capacity, channels
        self.pack = PACK[dtype]
        self.padded = -(-channels // self.pack) * self.pack
        self.head_stride = capacity * self.padded
        self.data = host_memory.zeros((*self.lead, self.head_stride), dtype, device)

    @staticmethod
    def nbytes_for(lead: tuple[int, int], capacity: int, channels: int, dtype: torch.dtype) -> int:
        """What ``KeyBlocks(lead, capacity, channels, dtype)`` allocates."""
        p = PACK[dtype]
        return lead[0] * lead[1] * capacity * (-(-channels // p) * p) * torch.empty((), dtype=dtype).element_size()

    def _pieces(self, start: int, stop: int):
        """(view of the blocks, first row of the piece in them, rows) for [start, stop): a
        partial first block, the whole blocks between, a partial last block."""
        kp, p = self.padded, self.pack
        r = start
        while r < stop:
            b0 = r // BLOCK
            w = min(BLOCK, self.capacity - b0 * BLOCK)
            if r % BLOCK == 0 and w == BLOCK and stop - r >= BLOCK:  # whole blocks in one view
                nb = min((stop - r) // BLOCK, (self.capacity - r) // BLOCK)
                at = b0 * BLOCK * kp
                view = self.data[..., at : at + nb * BLOCK * kp].view(*self.lead, nb, kp // p, BLOCK, p)
                yield view, None, nb * BLOCK
                r += nb * BLOCK
                continue
            at = b0 * BLOCK * kp
            view = self.data[..., at : at + w * kp].view(*self.lead, kp // p, w, p)
            n = min(stop, b0 * BLOCK + w) - r
            yield view, r - b0 * BLOCK, n
            r += n

    def write(self, start: int, rows: torch.Tensor) -> None:
        """(B, Hkv, n, K) rows (any float or int8 dtype the storage takes) at ring rows
        ``start .. start + n - 1`` (within the capacity)."""
        n = rows.shape[2]
        if self.padded != self.channels:
            rows = torch.nn.functional.pad(rows, (0, self.padded - self.channels))
        p, done = self.pack, 0
        for view, first, m in self._pieces(start, start + n):
            part = rows[:, :, done : done + m]
            if first is None:  # (B, H, nb * 64, Kp) -> (B, H, nb, Kp / P, 64, P)
                nb = m // BLOCK
                view.copy_(part.reshape(*self.lead, nb, BLOCK, self.padded // p, p).transpose(3, 4))
            else:
                view[..., first : first + m, :] = part.reshape(*self.lead, m, self.padded // p, p).transpose(2, 3)
            done += m

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start .. stop - 1`` as a new (B, Hkv, stop - start, K) tensor."""
        parts = []
        for view, first, m in self._pieces(start, stop):
            if first is None:
                parts.append(view.transpose(3, 4).reshape(*self.lead, m, self.padded))
            else:
                parts.append(view[..., first : first + m, :].transpose(2, 3).reshape(*self.lead, m, self.padded))
        if not parts:
            return torch.empty((*self.lead, 0, self.channels), dtype=self.data.dtype, device=self.data.device)
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return out[..., : self.channels].contiguous()


def key_row_stride(capacity: int) -> int:
    """Elements between ``KeyRows``' channel rows: the capacity, padded to whole 64-element
    groups once that costs under 1/63 more (C >= 4032), so that the torch kernels' blocks of
    64 positions of one channel are whole cache lines."""
    return capacity if capacity < 64 * 63 else -(-capacity // 64) * 64


class KeyRows:
    """Keys of (B, Hkv) heads transposed for the torch kernels: ``data`` (B, Hkv, K, C), its
    channel rows ``key_row_stride(C)`` apart."""

    def __init__(self, lead: tuple[int, int], capacity: int, channels: int, dtype: torch.dtype, device="cpu"):
        self.lead, self.capacity, self.channels = tuple(lead), capacity, channels
        stride = key_row_stride(capacity)
        self.data = torch.zeros((*self.lead, channels, stride), dtype=dtype, device=device)[..., :capacity]

    @staticmethod
    def nbytes_for(lead: tuple[int, int], capacity: int, channels: int, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        return lead[0] * lead[1] * channels * key_row_stride(capacity) * el

    def write(self, start: int, rows: torch.Tensor) -> None:
        self.data[:, :, :, start : start + rows.shape[2]] = rows.transpose(2, 3)

    def read(self, start: int, stop: int) -> torch.Tensor:
        return self.data[:, :, :, start:stop].transpose(2, 3).contiguous()
