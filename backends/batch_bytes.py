"""``step_many`` for steps whose tensors are spans of byte buffers: a Decode step's query, new
key and new value as they lie in its request's bytes, many caches in one native call.

A step read from the wire needs no tensor: the library takes a pointer per input and output.
``step_bytes`` gathers the spans' addresses and the caches' descriptors into arrays, calls
``gqa_step`` once per library, and gives back per row the numbers the reply carries and the
output's bytes, with no Python object per row but a list of six ints. Where the C++ module of
``csrc/torch_step.cpp`` is built, its ``step_spans`` does that gathering, the call and the
reading in one call (each cache's ``_span`` names what it needs); else the Python below does. A row the library
refuses or hands back (the Python path of an int8 cache calibrating, a full cache under policy
none), and a cache without the compiled step, go through ``batch.step_many`` with tensors over
the same bytes, so every row keeps ``step_many``'s contract: bit-identical to the cache's
``step`` alone, a refused row refused alone with its cache unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import native
from .base import LayerCache
from .batch import BatchStep
from .batch import step_many as _step_many
from .contract import StepOutcome

__all__ = ["ByteStep", "ByteBatch", "step_bytes"]

# The generic path's tensors view the caller's immutable bytes; a step never writes its inputs
# (``LayerCache.step``'s contract), so torch's once-per-process warning about a read-only
# buffer does not apply: taken here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(4), dtype=torch.float32)

_COLUMNS = len(native.RESULT_COLUMNS)  # tokens_seen, resident, first, last, evicted, rollback_reach
_void_p = ctypes.c_void_p


class ByteStep(NamedTuple):
    """One step: its cache, and ``data`` holding the step's query (B, Hq, D) at byte offset
    ``q_at``, new key and new value (B, Hkv, D) at ``k_at`` and ``v_at``, contiguous and
    little-endian in the cache's dtype (the caller checked the sizes; never written to)."""

    cache: LayerCache
    data: bytes
    q_at: int
    k_at: int
    v_at: int


class ByteBatch(NamedTuple):
    """What ``step_bytes`` did. ``fields[i]``: row i's ``native.RESULT_COLUMNS`` after its step
    (zeros when refused); ``refused``: row -> the exception its step raised (its cache
    unchanged); ``output``: every row's output, row i's at ``offsets[i]`` for the query's byte
    length (left as it was for a refused row)."""

    fields: list[list[int]]
    refused: dict[int, Exception]
    output: memoryview
    offsets: list[int]


def step_bytes(steps: Sequence[ByteStep]) -> ByteBatch:
    """Runs every step (distinct caches, ``ValueError`` for the whole call otherwise); see the
    module docstring. The GIL is released during the native call."""
    spans = _spans_entry()
    if spans is not None:  # the C++ entry: the rows' arguments, the call and their numbers in one
        done = spans(steps if steps.__class__ is list else list(steps))
        if done is not None:
            fields, out, offsets, left = done
            refused: dict[int, Exception] = {}
            for i in left:  # refused or handed back by the library, or another kernel's
                _step_generic(steps[i], out, offsets[i], fields[i], refused, i)
            return ByteBatch(fields, refused, memoryview(out), offsets)
    n = len(steps)
    if len({id(s.cache) for s in steps}) != n:
        raise ValueError("step_bytes: a cache appears twice in one batch")
    offsets, total = [], 0
    for s in steps:
        offsets.append(total)
        total += _query_bytes(s.cache)
    out = np.empty(total, dtype=np.uint8)
    fields = [[0] * _COLUMNS for _ in range(n)]
    refused: dict[int, Exception] = {}
    by_library: dict[int, list[int]] = {}
    generic: list[int] = []
    for i, s in enumerate(steps):
        cache = s.cache
        if cache._state is not None and getattr(type(cache), "step_group", None) is None:
            by_library.setdefault(id(cache._native), []).append(i)
        else:
            generic.append(i)
    base = ctypes.addressof(ctypes.c_char.from_buffer(out)) if total else 0  # out.ctypes.data costs 4x
    for rows in by_library.values():
        generic += _step_native(steps, rows, base, offsets, fields)
    for i in sorted(generic):
        _step_generic(steps[i], out, offsets[i], fields[i], refused, i)
    return ByteBatch(fields, refused, memoryview(out), offsets)


def _spans_entry():
    """The C++ entry's ``step_spans`` (``csrc/torch_step.cpp``): the rows' descriptors, pointers
    and numbers gathered, ``gqa_step`` called and its numbers read in one call, where this
    module's Python did it per row (~6 us of a lone Decode step's ~10 in process); None where
    the module is not built (then the Python below)."""
    module, _ = native._torch_step()  # built for this source: it has step_spans
    return None if module is None else module.step_spans


def _query_bytes(cache: LayerCache) -> int:
    s = cache.spec
    return s.batch_size * s.num_query_heads * s.head_dim * s.dtype.itemsize


class _Scratch(threading.local):
    """A thread's arguments of the native call, kept from call to call: the rows' descriptors,
    their four pointers, their numbers and statuses, grown to the largest n, with their
    addresses and byte views. Filled and read by ``struct`` on the views, not by numpy: a Decode
    step is one row, and numpy's per-call machinery cost more than its whole Python part in the
    server (docs/design.md, "A Decode step's Python, cold")."""

    def __init__(self):
        self.capacity = 0
        self.grow(16)

    def grow(self, n: int) -> None:
        self.capacity = max(n, 2 * self.capacity)
        self.descs = np.zeros(self.capacity, dtype=np.uint64)
        self.io = np.zeros((self.capacity, 4), dtype=np.uint64)
        self.res = np.zeros((self.capacity, _COLUMNS), dtype=np.int64)
        self.status = np.zeros(self.capacity, dtype=np.int32)
        self.at = tuple(a.ctypes.data for a in (self.descs, self.io, self.res, self.status))
        self.views = tuple(memoryview(a).cast("B") for a in (self.descs, self.io, self.res, self.status))


_scratch = _Scratch()


@functools.lru_cache(maxsize=64)
def _formats(n: int) -> tuple[struct.Struct, struct.Struct, struct.Struct, struct.Struct]:
    """The layouts of n rows' descriptors, pointers, numbers and statuses (native byte order)."""
    return struct.Struct(f"{n}Q"), struct.Struct(f"{4 * n}Q"), struct.Struct(f"{n * _COLUMNS}q"), struct.Struct(f"{n}i")


def _bytes_address_offset() -> int | None:
    """Where a ``bytes`` object's first byte lies from its ``id`` (CPython: the object's header,
    then the bytes), checked once against ctypes; None where that does not hold."""
    probe = bytes(range(7))
    at = bytes.__basicsize__ - 1
    return at if ctypes.cast(probe, _void_p).value == id(probe) + at else None


_BYTES_AT = _bytes_address_offset()


def _address(data: bytes) -> int:
    """The address of ``data``'s first byte: from its id for a ``bytes`` object (ctypes.cast costs
    ten times more), by ctypes otherwise."""
    if _BYTES_AT is not None and data.__class__ is bytes:
        return id(data) + _BYTES_AT
    return ctypes.cast(data, _void_p).value


def _step_native(steps: Sequence[ByteStep], rows: list[int], base: int, offsets: list[int], fields: list) -> list[int]:
    """One ``gqa_step`` call for ``rows`` of one library; returns the rows it did not step
    (refused or handed back: their caches unchanged), which take the generic path."""
    n = len(rows)
    kernel = steps[rows[0]].cache._native
    scratch = _scratch
    if n > scratch.capacity:
        scratch.grow(n)
    descs_at, io_at, res_at, status_at = scratch.at
    descs_view, io_view, res_view, status_view = scratch.views
    descs, spans = [], []
    for i in rows:
        s = steps[i]
        descs.append(ctypes.addressof(s.cache._state))
        b = _address(s.data)
        spans += (b + s.q_at, b + s.k_at, b + s.v_at, base + offsets[i])
    descs_fmt, io_fmt, res_fmt, status_fmt = _formats(n)
    descs_fmt.pack_into(descs_view, 0, *descs)
    io_fmt.pack_into(io_view, 0, *spans)
    rc = kernel.step(descs_at, n, io_at, None, None, res_at, _COLUMNS, status_at, 0, 0)
    if rc:  # the whole call refused, nothing written: each row meets the refusal on its own path
        return list(rows)
    done = res_fmt.unpack_from(res_view)
    status = status_fmt.unpack_from(status_view)
    left = []
    for j, i in enumerate(rows):
        if status[j]:
            left.append(i)
        else:
            fields[i] = list(done[j * _COLUMNS : (j + 1) * _COLUMNS])
    return left


def _step_generic(s: ByteStep, out: np.ndarray | bytearray, at: int, row: list, refused: dict, i: int) -> None:
    """Row ``i`` through ``batch.step_many`` (bound at import: a test holding ``step_bytes`` holds
    it once) with tensors viewing its bytes; its numbers into
    ``row``, its output into ``out[at:]``, or its exception into ``refused``."""
    spec = s.cache.spec
    b, hq, hkv, d, dtype = spec.batch_size, spec.num_query_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    q = torch.frombuffer(s.data, dtype=dtype, count=b * hq * d, offset=s.q_at).view(b, hq, d)
    k = torch.frombuffer(s.data, dtype=dtype, count=b * hkv * d, offset=s.k_at).view(b, hkv, d)
    v = torch.frombuffer(s.data, dtype=dtype, count=b * hkv * d, offset=s.v_at).view(b, hkv, d)
    if spec.device != "cpu":  # a cache off the CPU (cuda) takes its step's tensors where it lives
        q, k, v = q.to(spec.device), k.to(spec.device), v.to(spec.device)
    (o,) = _step_many([BatchStep(s.cache, q, k, v)])
    if not isinstance(o, StepOutcome):
        refused[i] = o
        return
    output = o.output.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    memoryview(out)[at : at + len(output)] = output  # out: numpy's array, or the C++ entry's bytearray
    t = o.tokens_seen
    row[:] = (t, o.resident, o.first_position, o.last_position, o.evicted_tokens, s.cache.policy.rollback_reach(t))
