"""The step plane: the caches of many sequences of one shape, stepped a layer at a time in one
native call with no Python per sequence (issue #23; the contract: ``CacheSet.step`` below).

A ``CacheSet`` keeps, per layer, a numpy array of its caches' native descriptor addresses
indexed by slot. ``CacheSet.step`` gathers the rows' addresses by the slots array, points the
library at the packed query / new key / new value / output tensors (row i at base + i * row
bytes) and calls ``gqa_step`` once: the library plans each row's step from its cache's state
(``backends/policy.py``'s arithmetic in C), writes the new token, attends, writes row i of
``out`` and row i of ``fields`` and sets row i's status. Python then looks only at the rows
the library refused (nonzero status), if any. ``CacheSet.step_buffers`` is the same step with
the rows given as bytes (a Batch message's tensors where they lie in its request, the output
buffer the reply is encoded from): no tensor is made unless a row takes the Python path.
Where the torch step module is built (``native.load_torch_step``), each is one C++ call
(``plane_step``, ``plane_buffers``: the checks, the rows' addresses, ``gqa_step`` and the
``StepBatch``); the Python below is then the path for what that call does not take, and for
the rows it refused.

Caches without the compiled step (the torch fallback, int8 while it calibrates, cuda) are
stepped by ``step`` too, one by one through their public step, with the same contract.
"""

from __future__ import annotations

import ctypes
import errno
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

from . import native
from .base import LayerCache
from .errors import InputValueError

__all__ = ["FIELDS", "CacheSet", "StepBatch"]

FIELDS = ("tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach")


class StepBatch(NamedTuple):
    """What ``CacheSet.step`` did. ``fields``: int64 (n, 6), ``FIELDS`` after each row's step (a
    refused row all 0). ``refused``: row -> the exception that row's step raised (the backends'
    typed errors: ``CacheFullError``, ``InputTypeError``/``InputValueError``, anything else is
    internal); its cache unchanged and its ``out`` row left as it was. ``compute_ns``: wall time
    of the computation (the native call and any Python steps)."""

    fields: np.ndarray
    refused: dict[int, Exception]
    compute_ns: int


class CacheSet:
    """The caches of many sequences of ONE shape (Hq, Hkv, D, dtype, batch size 1, one backend),
    one column per layer, rows addressed by slot (small ints, reused after remove). Keeps, per
    layer, an array of the caches' native descriptor addresses so that a step of n sequences is
    one native call. Not thread-safe: one owner; ``step`` may run on a worker thread while the
    owner does nothing else with the set."""

    def __init__(self, num_layers: int):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.num_layers = num_layers
        self._caches: list[list[LayerCache] | None] = []
        self._free: list[int] = []
        # per layer: (capacity,) uint64 descriptor addresses by slot (0: no compiled step)
        self._addrs = np.zeros((num_layers, 0), dtype=np.uint64)
        self._kernel = None  # the library of the set's native caches
        self._shape = None  # (Hq, Hkv, D, dtype) of the first cache added
        self._device = "cpu"  # its device type: the step's tensors live there
        # the native call's arguments, kept from call to call (a step allocates only the copy of
        # its fields it returns and no object the garbage collector tracks but that result): the
        # rows' descriptor addresses, statuses and fields (grown to the largest n), the four
        # tensors' base pointers, their row strides in bytes (fixed by the shape), and the
        # addresses of these arrays
        self._rows = np.zeros(0, dtype=np.uint64)
        self._status = np.zeros(0, dtype=np.int32)
        self._fields = np.zeros((0, 6), dtype=np.int64)
        self._base = np.zeros(4, dtype=np.uint64)
        self._stride = np.zeros(4, dtype=np.int64)
        self._args = (0, 0, 0, self._base.ctypes.data, self._stride.ctypes.data)  # rows, status, fields, ...
        self._io = np.zeros((0, 4), dtype=np.uint64)  # step_buffers' pointers per row (query, key, value, out)
        self._io_at = 0
        # ``step``'s whole native part in one C++ call (native.load_torch_step's plane_step): its
        # function and context, made on the first step after any of the arrays above moved (None:
        # to make; False: no such entry here, the step goes through ctypes)
        self._plane = None

    # -- membership ---------------------------------------------------------------------------
    def add(self, caches: list[LayerCache]) -> int:
        """Adds one sequence's caches (``caches[i]`` is layer i's); returns its slot.
        ``ValueError`` for a list of the wrong length or a cache of another shape."""
        if len(caches) != self.num_layers:
            raise ValueError(f"add: {len(caches)} caches for a set of {self.num_layers} layers")
        for cache in caches:
            s = cache.spec
            shape = (s.num_query_heads, s.num_kv_heads, s.head_dim, s.dtype)
            if s.batch_size != 1:
                raise ValueError(f"add: batch_size {s.batch_size}; a set's sequences have batch size 1")
            device = torch.device(s.device).type
            if self._shape is None:
                self._shape, self._device = shape, device
                row = s.head_dim * s.dtype.itemsize
                self._stride[:] = (s.num_query_heads * row, s.num_kv_heads * row, s.num_kv_heads * row,
                                   s.num_query_heads * row)  # fmt: skip
            elif shape != self._shape:
                raise ValueError(f"add: a cache of shape {shape}, the set's is {self._shape}")
            elif device != self._device:
                raise ValueError(f"add: a cache on {device}, the set's caches are on {self._device}")
            kernel = cache._native if cache._state is not None else None
            if kernel is not None:
                if self._kernel is None:
                    self._kernel = kernel
                    self._plane = None
                elif kernel is not self._kernel:
                    raise ValueError("add: a cache of another native library")
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._caches)
            self._caches.append(None)
            if slot >= self._addrs.shape[1]:
                grown = np.zeros((self.num_layers, max(8, 2 * self._addrs.shape[1])), dtype=np.uint64)
                grown[:, : self._addrs.shape[1]] = self._addrs
                self._addrs = grown
                self._plane = None
        self._caches[slot] = list(caches)
        for layer, cache in enumerate(caches):
            state = cache._state
            self._addrs[layer, slot] = 0 if state is None else _address(state)
        return slot

    def remove(self, slot: int) -> None:
        """Forgets a slot's caches (the slot is reused by a later ``add``); ``KeyError`` if not live."""
        if not 0 <= slot < len(self._caches) or self._caches[slot] is None:
            raise KeyError(f"slot {slot} is not in the set")
        self._caches[slot] = None
        self._addrs[:, slot] = 0
        self._free.append(slot)

    def caches(self, slot: int) -> list[LayerCache]:
        caches = self._caches[slot] if 0 <= slot < len(self._caches) else None
        if caches is None:
            raise KeyError(f"slot {slot} is not in the set")
        return caches

    # -- the step ---------------------------------------------------------------------------
    def expect(self, n: int) -> None:
        """A hint that a step of ``n`` rows follows soon: the library's workers are alerted now
        when that step will share them, so that they are running when it starts (the caller's
        parsing and checks take about as long as a sleeping worker's wake-up)."""
        if self._kernel is not None and self._shape is not None:
            self._kernel.prewake_heads(n * self._shape[1])

    def step(
        self,
        layer: int,
        slots: np.ndarray,
        query: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        out: torch.Tensor,
    ) -> StepBatch:
        """One step of layer ``layer`` for the sequences at ``slots`` (int64 (n,), distinct, live:
        the caller checked). query (n, Hq, D), new_key and new_value (n, Hkv, D), out (n, Hq, D):
        contiguous tensors of the set's dtype on its caches' device (``ValueError`` otherwise,
        nothing written).
        Row i's step is bit-identical to ``caches(slots[i])[layer].step(query[i:i+1], ...)``;
        its output goes to ``out[i]``."""
        tensors = (query, new_key, new_value, out)
        plane = self._entry(len(slots))
        if plane:  # one C++ call: the checks, the rows' addresses, gqa_step and the StepBatch
            done = plane[0](plane[1], layer, slots, query, new_key, new_value, out)
            if type(done) is StepBatch:
                return done
            if done is not None:
                return self._settle(done, layer, slots, lambda i: tuple(t[i : i + 1] for t in tensors))
        self._check(query, new_key, new_value, out, len(slots))
        return self._run(
            layer,
            slots,
            lambda i: tuple(t[i : i + 1] for t in tensors),
            lambda: [t.data_ptr() for t in tensors],
        )

    def _entry(self, n: int):
        """The C++ entry for a step of ``n`` rows (made again when the set's arrays moved or
        are too small for n), or False."""
        plane = self._plane
        if plane is None or (plane and n > len(self._rows)):
            plane = self._attach_plane(n)
        return plane

    def _settle(self, done, layer: int, slots: np.ndarray, row_io) -> StepBatch:
        """The C++ entry's answer when it was not the StepBatch: gqa_step's own error code
        (raised), or (fields, start) with a row refused, which Python finishes."""
        if type(done) is int:
            self._kernel.raise_for(done)
        return self._outcome(layer, slots, done[0], row_io, done[1])

    def _attach_plane(self, n: int = 0):
        """``step``'s C++ entry and its context, the arrays grown first to hold ``n`` rows (and
        every sequence of the set); False where the set has no native caches, lives off the CPU
        or the module is not built."""
        self._plane = False
        if self._kernel is None or self._device != "cpu" or self._shape is None:
            return False
        try:
            module = native.load_torch_step()
            step_at = ctypes.cast(self._kernel.step, ctypes.c_void_p).value  # a stand-in's is no C function
        except (native.NativeUnavailable, ctypes.ArgumentError):
            return False
        if len(self._rows) < max(n, len(self._caches)):
            self._grow(max(n, len(self._caches)))
        hq, hkv, d, dtype = self._shape
        layers, capacity = self._addrs.shape
        shape = (torch.empty(0, dtype=dtype), hq, hkv, d, StepBatch)
        pctx = (step_at, self._addrs.ctypes.data, layers, capacity, self._rows.ctypes.data, len(self._rows),
                self._status.ctypes.data, self._io_at, self._stride.ctypes.data, shape)  # fmt: skip
        self._plane = (module.plane_step, pctx, module.plane_buffers)
        return self._plane

    def step_buffers(self, layer: int, slots: np.ndarray, query, new_key, new_value, out, rows=None) -> StepBatch:
        """``step`` with the tensors given as their bytes: ``query``, ``new_key``, ``new_value``
        buffers (bytes, memoryview: C-contiguous, never written) of N packed rows, (N, Hq, D),
        (N, Hkv, D), (N, Hkv, D) in the set's dtype, and ``out`` a writable buffer of N rows
        (N, Hq, D) (a bytearray or a view of one). ``rows`` int64 (n,): the buffers' row of each
        slot (distinct); None: row i for ``slots[i]`` (N == n). Row ``rows[i]`` of ``out`` gets
        slot i's output; the other rows of ``out`` are left as they were. A buffer whose length
        is not N rows: ``InputValueError`` naming it, nothing written. Same contract and result
        as ``step`` otherwise (``StepBatch`` row i is slot i). The library reads and writes the
        buffers in place: no tensor is made unless a row takes the Python path."""
        plane = self._entry(len(slots))
        if plane:  # one C++ call: the buffers' checks and pointers, gqa_step and the StepBatch
            done = plane[2](plane[1], layer, slots, query, new_key, new_value, out, rows)
            if type(done) is StepBatch:
                return done
            if done is not None:
                views = _RowViews(self._shape, _nbytes(query) // int(self._stride[0]), query, new_key, new_value, out)
                return self._settle(
                    done, layer, slots, views.rows if rows is None else lambda i: views.rows(int(rows[i]))
                )
        n = len(slots)
        total = self._check_buffers(query, new_key, new_value, out, n if rows is None else None)
        if rows is not None and (len(rows) != n or (n and (int(rows.min()) < 0 or int(rows.max()) >= total))):
            raise ValueError(f"rows: {n} rows, each below the buffers' {total}, expected")
        views = _RowViews(self._shape, total, query, new_key, new_value, out)
        return self._run(
            layer,
            slots,
            views.rows if rows is None else (lambda i: views.rows(int(rows[i]))),
            lambda: [_read_address(query), _read_address(new_key), _read_address(new_value), _write_address(out)],
            rows,
        )

    def _run(self, layer: int, slots: np.ndarray, row_io, addresses, rows=None) -> StepBatch:
        """The step of ``step`` and ``step_buffers`` over checked inputs: ``row_io(i)`` slot i's
        (1, heads, D) query, new key, new value and output tensors (made only for a row the
        library leaves to Python), ``addresses()`` the four packed tensors' base addresses, and
        ``rows`` each slot's row of them (None: row i)."""
        if not 0 <= layer < self.num_layers:  # not numpy's or a list's count from the end
            raise IndexError(f"layer {layer} is out of range: the set has {self.num_layers} layers")
        n = len(slots)
        refused: dict[int, Exception] = {}
        start = time.perf_counter_ns()
        if n == 0:
            return StepBatch(np.zeros((0, 6), dtype=np.int64), refused, 0)
        if self._kernel is None:
            fields = np.zeros((n, 6), dtype=np.int64)
            for i in range(n):
                self._python_row(layer, int(slots[i]), i, row_io(i), fields, refused)
            return StepBatch(fields, refused, time.perf_counter_ns() - start)
        if n > len(self._rows):
            self._grow(n)
        rows_at, status_at, fields_at, base_at, stride_at = self._args
        self._addrs[layer].take(slots, out=self._rows[:n])
        if rows is None:
            self._base[:] = addresses()
            rc = self._kernel.step(rows_at, n, None, base_at, stride_at, fields_at, 6, status_at, 0, 0)
        else:  # a pointer per row and tensor: the rows not stepped are not touched
            io = self._io[:n]
            np.multiply.outer(rows, self._stride, out=io.view(np.int64))
            io += np.array(addresses(), dtype=np.uint64)
            rc = self._kernel.step(rows_at, n, self._io_at, None, None, fields_at, 6, status_at, 0, 0)
        if rc:
            self._kernel.raise_for(rc)
        return self._outcome(layer, slots, self._fields[:n].copy(), row_io, start)

    def _outcome(self, layer: int, slots: np.ndarray, fields: np.ndarray, row_io, start: int) -> StepBatch:
        """The StepBatch of a native call that returned ``fields`` (n, 6): the rows it refused
        (their status in the status array) finished first, by Python or as refusals."""
        refused: dict[int, Exception] = {}
        status = self._status[: len(slots)]
        if status.tobytes() != bytes(status.nbytes):  # a refused row (1.5 us; ``any`` costs 3)
            for i in np.flatnonzero(status).tolist():
                self._refused_row(layer, int(slots[i]), i, int(status[i]), row_io(i), fields, refused)
        return StepBatch(fields, refused, time.perf_counter_ns() - start)

    def _check_buffers(self, query, new_key, new_value, out, n: int | None) -> int:
        """The buffers' row count N (== ``n`` unless None); ``InputValueError`` naming the first
        whose length is not N rows of its heads, or ``out`` when it is read-only."""
        if self._shape is None:
            if n:
                raise ValueError("step: the set is empty")
            return 0
        q_row, kv_row = int(self._stride[0]), int(self._stride[1])
        size = _nbytes(query)
        total = size // q_row if q_row else 0
        if n is not None and total != n:
            raise InputValueError(f"query: {size} bytes, but {n} rows need {n * q_row}")
        for name, b, row in (("query", query, q_row), ("new_key", new_key, kv_row), ("new_value", new_value, kv_row),
                             ("out", out, q_row)):  # fmt: skip
            if _nbytes(b) != total * row:
                raise InputValueError(f"{name}: {_nbytes(b)} bytes, but {total} rows need {total * row}")
        if memoryview(out).readonly:
            raise InputValueError("out: a read-only buffer")
        return total

    def _grow(self, n: int) -> None:
        self._rows = np.zeros(max(n, 2 * len(self._rows)), dtype=np.uint64)
        self._status = np.zeros(len(self._rows), dtype=np.int32)
        self._fields = np.zeros((len(self._rows), 6), dtype=np.int64)
        self._io = np.zeros((len(self._rows), 4), dtype=np.uint64)
        self._io_at = self._io.ctypes.data
        self._args = (self._rows.ctypes.data, self._status.ctypes.data, self._fields.ctypes.data) + self._args[3:]
        self._plane = None

    def _refused_row(self, layer, slot, i, status, io, fields, refused) -> None:
        """Row i (slot ``slot``) the library did not step; ``io``: its (1, heads, D) query, new
        key, new value and output tensors."""
        cache = self._caches[slot][layer]
        # the Python path (-EAGAIN), or a row whose input the cache's checks name (-EDOM: an int8
        # row's non-finite value; -EINVAL)
        if status in (-errno.EAGAIN, -errno.EDOM, -errno.EINVAL):
            self._python_row(layer, slot, i, io, fields, refused)
        else:
            refused[i] = cache.step_error(status)

    def _python_row(self, layer, slot, i, io, fields, refused) -> None:
        cache = self._caches[slot][layer]
        query, new_key, new_value, out = io
        try:
            o = cache._step_python(query, new_key, new_value)
        except Exception as exc:  # refused alone; the cache restored itself
            refused[i] = exc
            return
        out.copy_(o.output)
        t = o.tokens_seen
        fields[i] = (t, o.resident, o.first_position, o.last_position, o.evicted_tokens, cache.policy.rollback_reach(t))

    def _check(self, query, new_key, new_value, out, n) -> None:
        if self._shape is None:
            if n:
                raise ValueError("step: the set is empty")
            return
        hq, hkv, d, dtype = self._shape
        for name, t, heads in (("query", query, hq), ("new_key", new_key, hkv), ("new_value", new_value, hkv),
                               ("out", out, hq)):  # fmt: skip
            if (
                type(t) is not torch.Tensor
                or t.shape != (n, heads, d)
                or t.dtype is not dtype
                or t.device.type != self._device
                or not t.is_contiguous()
            ):
                got = f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputValueError(
                    f"{name}: expected a contiguous {self._device} tensor ({n}, {heads}, {d}) of {str(dtype)[6:]}, "
                    f"got {got}"
                )


class _RowViews:
    """Tensors over ``CacheSet.step_buffers``' buffers, made on first use: only a row that takes
    the Python path needs them."""

    __slots__ = ("_args", "_tensors")

    def __init__(self, shape, total: int, *buffers):
        self._args = (shape, total, buffers)
        self._tensors = None

    def rows(self, r: int) -> tuple:
        """Row ``r`` of the query, new key, new value and output as (1, heads, D) tensors."""
        if self._tensors is None:
            (hq, hkv, d, dtype), total, buffers = self._args
            with warnings.catch_warnings():  # the inputs are read-only bytes; a step never writes them
                warnings.simplefilter("ignore")
                self._tensors = [
                    torch.frombuffer(b, dtype=dtype).view(total, heads, d)
                    for b, heads in zip(buffers, (hq, hkv, hkv, hq))
                ]
        return tuple(t[r : r + 1] for t in self._tensors)


def _read_address(buffer) -> int:
    """The address of a buffer's first byte (a read-only one: numpy's view)."""
    if type(buffer) is bytes:
        return ctypes.cast(buffer, ctypes.c_void_p).value or 0
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _write_address(buffer) -> int:
    """The address of a writable buffer's first byte (ctypes takes it without numpy; its export
    of the buffer ends with this call, so the owner may resize it afterwards)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _nbytes(buffer) -> int:
    return buffer.nbytes if type(buffer) is memoryview else len(buffer)


def _address(state) -> int:
    return ctypes.addressof(state)
