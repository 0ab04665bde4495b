"""The backend contract: what a backend declares and the per-layer cache it creates.

A backend is a class with its capabilities as class data and one factory, ``create_cache``,
for the cache of one layer of one stream. The cache owns B x Hkv x C x D keys and values,
allocated once; its layout is a ring (position ``p`` lives at a fixed row, see ``row_of``), so
appending is O(1) and eviction moves no bytes. What is resident and attended comes from the
stream's ``EvictionPolicy``; storage (dense, int8 codes plus scales, GPU) is the subclass's.

The step is atomic: everything is checked before anything is written, and a failure after
the write restores the overwritten row, so a rejected or failed step leaves the cache exactly
as it was.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import BackendUnavailable, CacheFullError, InputTypeError, InputValueError, RollbackError
from .key_layout import KeyBlocks, KeyRows
from .policy import EvictionPolicy, PolicyKind
from .validation import check_step_tensors, dtype_name

__all__ = [
    "Backend",
    "Capabilities",
    "CacheSpec",
    "DenseRingCache",
    "LayerCache",
    "StepOutcome",
    "merge_runs",
    "row_runs",
]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve: dtypes of the tensors it exchanges, head widths, devices."""

    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    max_head_dim: int = 1 << 16
    head_dim_multiple: int = 1

    def reasons_against(self, name: str, dtype: torch.dtype, head_dim: int, device: str) -> list[str]:
        reasons = []
        if dtype not in self.dtypes:
            reasons.append(
                f"{name}: dtype {dtype_name(dtype)} not supported (supports {', '.join(dtype_name(d) for d in self.dtypes)})"
            )
        if head_dim < 1 or head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            reasons.append(
                f"{name}: head_dim {head_dim} not supported (1..{self.max_head_dim}, multiple of {self.head_dim_multiple})"
            )
        if torch.device(device).type not in self.devices:
            reasons.append(f"{name}: device {device} not supported (supports {', '.join(self.devices)})")
        return reasons


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one layer's cache, fixed for the life of a stream."""

    batch_size: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    policy: EvictionPolicy
    device: str = "cpu"

    def __post_init__(self):
        for name in ("batch_size", "num_query_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"num_query_heads ({self.num_query_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @property
    def rows_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.num_kv_heads, self.capacity, self.head_dim)


@dataclass(slots=True)
class StepOutcome:
    """What one step did: the output and the cache's bookkeeping after it. A record the step
    hands over and never touches again (not frozen: a frozen dataclass's ``__init__`` is a
    measurable part of a native step at S=1, docs/design.md)."""

    output: torch.Tensor  # (B, Hq, D) in the spec's dtype
    tokens_seen: int  # T after the step
    resident: int  # L after the step
    first_position: int  # oldest resident position
    last_position: int  # newest resident position (the token just appended)
    evicted_tokens: int  # tokens that stopped being resident in this step
    bytes_written: int  # bytes stored for the new token
    bytes_moved: int  # bytes copied inside the cache to evict (0 for a ring layout)
    attended: int = 0  # positions the new token attended to


def row_runs(positions: range, row_of, capacity_rows: range) -> list[tuple[int, int]]:
    """Contiguous row runs ``[start, stop)`` holding ``positions`` (a consecutive range).

    ``capacity_rows`` is the row region the positions cycle through (for the sink layout, the
    window region after the sinks). A range of consecutive positions is at most two runs.
    """
    if not len(positions):
        return []
    first = row_of(positions.start)
    n = len(positions)
    end = capacity_rows.stop
    if first + n <= end:
        return [(first, first + n)]
    head = end - first
    return [(first, end), (capacity_rows.start, capacity_rows.start + n - head)]


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Row runs sorted and joined where they touch: attention does not depend on the order of
    keys, so a wrapped window that covers the whole ring becomes one run (one product instead
    of two). Not for exports, which keep position order.
    """
    merged: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


class LayerCache(abc.ABC):
    """One layer of one stream: ring-layout bookkeeping over storage the subclass owns."""

    # The ``encoding`` of this cache's ``export_state``, which ``load_state`` accepts.
    state_encoding: ClassVar[str] = "dense"

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.policy = spec.policy
        self._t = 0

    # -- T: the library's state for a cache with the compiled step, else this object's ----------
    # ``_state`` is the cache's ``native.CacheDesc`` (set by ``_attach_native``): its ``t`` is T,
    # which the native step advances; Python writes it for rollback, prefill and restore.
    _state = None

    @property
    def tokens_seen(self) -> int:
        """T: tokens this layer has seen (positions 0 .. T-1)."""
        state = self._state
        return self._t if state is None else state.t

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        state = self._state
        if state is None:
            self._t = value
        else:
            state.t = value

    # -- storage, the subclass's ---------------------------------------------------------
    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this cache holds allocated (keys, values and any scales)."""

    @abc.abstractmethod
    def _write_rows(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores (B, Hkv, n, D) keys and values at rows ``start .. start+n-1``."""

    def _write_token(self, position: int, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores a step's token (B, Hkv, 1, D) at ``row``; a cache whose storage depends on the
        position (the int8 cache's calibration) overrides it. ``_save_rows(row, row + 1)``
        must cover everything it changes."""
        self._write_rows(row, key, value)

    @abc.abstractmethod
    def _read_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` as (B, Hkv, n, D) tensors in the spec's dtype (a copy)."""

    @abc.abstractmethod
    def _save_rows(self, start: int, stop: int) -> object:
        """An opaque copy of the stored rows, exactly as stored, for ``_restore_rows``."""

    @abc.abstractmethod
    def _restore_rows(self, start: int, saved: object) -> None: ...

    @abc.abstractmethod
    def _attend(self, query: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
        """Attention of (B, Hq, D) ``query`` over the stored row runs; (B, Hq, D) out."""

    # -- layout ---------------------------------------------------------------------------
    def row_of(self, position: int) -> int:
        """The row that position ``position`` lives in (a ring; sinks stay put)."""
        p = self.policy
        if p.kind is PolicyKind.SINK:
            if position < p.sinks:
                return position
            return p.sinks + (position - p.sinks) % p.window
        return position % p.capacity

    def _runs(self, positions: tuple[range, ...]) -> list[tuple[int, int]]:
        p = self.policy
        runs: list[tuple[int, int]] = []
        for r in positions:
            if p.kind is PolicyKind.SINK and r.start >= p.sinks:
                region = range(p.sinks, p.capacity)
            else:
                region = range(0, p.capacity)
            runs.extend(row_runs(r, self.row_of, region))
        return runs

    @property
    def row_bytes(self) -> int:
        """Bytes one position occupies for the whole batch (keys and values)."""
        return self.nbytes // self.spec.capacity

    # -- public ---------------------------------------------------------------------------
    @property
    def resident_length(self) -> int:
        return self.policy.resident_length(self.tokens_seen)

    def resident_positions(self) -> tuple[range, ...]:
        return self.policy.resident(self.tokens_seen)

    def check_step(self, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor) -> None:
        """Raises ``InputTypeError``/``InputValueError`` (a ``TypeError``/``ValueError``) for
        tensors this cache cannot take, ``CacheFullError`` when policy none has no room."""
        self.check_tensors(query, new_key, new_value)
        if not self.policy.has_room(self.tokens_seen):
            raise CacheFullError(f"cache full: policy none holds {self.policy.capacity} tokens and all are used")

    def check_tensors(self, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor) -> None:
        """``check_step`` without the room check (the native step checks room itself)."""
        s = self.spec
        shapes = self.__dict__.get("_step_shapes")
        if shapes is None:
            shapes = self._step_shapes = (
                (s.batch_size, s.num_query_heads, s.head_dim),
                (s.batch_size, s.num_kv_heads, s.head_dim),
                s.dtype,
                torch.device(s.device).type == "cpu",
            )
        qs, kvs, dtype, on_cpu = shapes
        # the common case in integer and identity comparisons; anything else gets the full
        # checks below, which name what is wrong
        if not (
            on_cpu
            and type(query) is torch.Tensor
            and type(new_key) is torch.Tensor
            and type(new_value) is torch.Tensor
            and query.shape == qs
            and new_key.shape == kvs
            and new_value.shape == kvs
            and query.dtype is dtype
            and new_key.dtype is dtype
            and new_value.dtype is dtype
            and query.is_cpu
            and new_key.is_cpu
            and new_value.is_cpu
        ):
            self._check_step_slow(query, new_key, new_value)

    def _check_step_slow(self, query, new_key, new_value) -> None:
        s = self.spec
        b, d = check_step_tensors(query, new_key, new_value, s.num_query_heads, s.num_kv_heads)
        if b != s.batch_size:
            raise InputValueError(
                f"query: batch size {b} (shape {tuple(query.shape)}) but the stream has batch_size {s.batch_size}"
            )
        if d != s.head_dim:
            raise InputValueError(
                f"query: head width {d} (shape {tuple(query.shape)}) but the stream has head_dim {s.head_dim}"
            )
        if query.dtype != s.dtype:
            raise InputTypeError(
                f"query: dtype {dtype_name(query.dtype)} but the stream's dtype is {dtype_name(s.dtype)}"
            )
        if query.device.type != torch.device(s.device).type:
            raise InputValueError(f"query: device {query.device} but the stream lives on {s.device}")

    def step(self, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor) -> StepOutcome:
        """Appends one token and attends to what the policy says; atomic."""
        if self._state is not None:  # the compiled step: one native call plans, writes and attends
            outcome = self._step_native(query, new_key, new_value)
            if outcome is not None:
                return outcome
        return self._step_python(query, new_key, new_value)

    def _step_python(self, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor) -> StepOutcome:
        self.check_step(query, new_key, new_value)
        t = self.tokens_seen
        row = self.row_of(t)
        saved = self._save_rows(row, row + 1)
        try:
            self._write_token(t, row, new_key.unsqueeze(2), new_value.unsqueeze(2))
            attended = self.policy.attended(t + 1)
            output = self._attend(query, merge_runs(self._runs(attended)))
        except BaseException:
            self._restore_rows(row, saved)
            raise
        return self._commit(t, output, attended)

    # -- the native step: one ``gqa_step`` call plans, writes the row, attends, writes the output --
    # A cache with a compiled step calls ``_attach_native`` with its descriptor (storage, shape,
    # policy); the public step, ``batch.step_many`` and ``plane.CacheSet.step`` all run it
    # through ``native.Kernel.step``.
    _native = None

    def _attach_native(self, kernel, desc) -> None:
        """Makes ``desc`` (a ``native.CacheDesc`` with storage and shape filled in) this cache's
        state: the policy and T written into it, and the buffers of a one-row ``gqa_step``."""
        from . import native  # noqa: PLC0415 (native imports torch only; base is imported first)

        p = self.policy
        desc.policy = native.POLICY[p.kind.value]
        desc.window, desc.sinks, desc.t = p.window, p.sinks, self._t
        if self.__dict__.get("_fail_flag"):
            desc.flags |= native.FLAG_FAIL_AFTER_WRITE
        self._native = kernel
        self._state = desc
        io = (ctypes.c_void_p * 4)()
        results = (ctypes.c_int64 * len(native.RESULT_COLUMNS_ALL))()
        status = ctypes.c_int32()
        addr = (ctypes.c_void_p * 1)(ctypes.addressof(desc))
        # (kernel.step, the descriptor's address array, io and its address, results and their
        # address, status and its address): what ``_step_native`` passes, computed once
        self._one = (
            kernel.step,
            ctypes.addressof(addr),
            io,
            ctypes.addressof(io),
            results,
            ctypes.addressof(results),
            status,
            ctypes.addressof(status),
            addr,
        )
        s = self.spec
        self._out_like = torch.empty((s.batch_size, s.num_query_heads, s.head_dim), dtype=s.dtype)

    def _step_native(self, query, new_key, new_value, out=None) -> StepOutcome | None:
        """The public step in one ``gqa_step`` call; None when this step takes the Python path
        (``python_below``: the int8 cache's calibration)."""
        self.check_tensors(query, new_key, new_value)
        _, addrs, io, io_at, res, res_at, status, status_at, _ = self._one
        fn = self._native.step  # looked up per step: a test's stand-in kernel takes effect
        q, k, v = query.contiguous(), new_key.contiguous(), new_value.contiguous()
        if out is None:
            out = torch.empty_like(self._out_like)  # a new tensor per step: the caller keeps it
        io[0] = q.data_ptr()
        io[1] = k.data_ptr()
        io[2] = v.data_ptr()
        io[3] = out.data_ptr()
        rc = fn(addrs, 1, io_at, None, None, res_at, 7, status_at, 0, 0)
        if rc:
            self._native.raise_for(rc)
        if status.value:
            if status.value == -errno.EAGAIN:
                return None
            raise self.step_error(status.value)
        r = res[:7]
        return StepOutcome(out, r[0], r[1], r[2], r[3], r[4], self.row_bytes, 0, r[6])

    def step_error(self, status: int) -> Exception:
        """The exception for a row the native step refused with ``status`` (-errno; the cache
        unchanged)."""
        if status == -errno.ENOSPC:
            return CacheFullError(f"cache full: policy none holds {self.policy.capacity} tokens and all are used")
        if status == -errno.EDOM:
            return InputValueError("a non-finite input value (or a key beyond float16's range); nothing was written")
        return RuntimeError(f"native step failed: {os.strerror(-status)}; the cache is unchanged")

    # Tests set it to make the native step fail after its write (the kernel restores the row).
    @property
    def _fail_after_write(self) -> bool:
        return bool(self.__dict__.get("_fail_flag"))

    @_fail_after_write.setter
    def _fail_after_write(self, value: bool) -> None:
        from . import native  # noqa: PLC0415

        self.__dict__["_fail_flag"] = bool(value)
        state = self._state
        if state is not None:
            if value:
                state.flags |= native.FLAG_FAIL_AFTER_WRITE
            else:
                state.flags &= ~native.FLAG_FAIL_AFTER_WRITE

    def _plan(self, t: int) -> tuple:
        """The arithmetic of the step from T = t: ``(runs, write_row, attended, resident,
        first_position, last_position, evicted)``, runs the merged row runs it attends (a
        tuple of (a, b)). Policies none and strict in a few integer operations (the others
        through the policy's ranges; ``tests/test_cpu_cache.py`` checks the two agree)."""
        p = self.policy
        kind = p.kind
        u = t + 1
        if kind is PolicyKind.NONE or (kind is PolicyKind.STRICT and u <= p.window):
            return ((0, u),), t, u, u, 0, t, 0
        if kind is PolicyKind.STRICT:  # the window covers the whole ring: one run
            w = p.window
            return ((0, w),), t % w, w, w, u - w, t, 1
        return self._plan_ranges(t)

    def _plan_ranges(self, t: int) -> tuple:
        p = self.policy
        u = t + 1
        attended = p.attended(u)
        resident = p.resident(u)
        return (
            tuple(merge_runs(self._runs(attended))),
            self.row_of(t),
            sum(len(r) for r in attended),
            p.resident_length(u),
            resident[0].start,
            resident[-1].stop - 1,
            p.evicted_by_step(t),
        )

    def _commit(self, t: int, output: torch.Tensor, attended: tuple[range, ...] | None = None) -> StepOutcome:
        """The bookkeeping of a step from T = t whose row is written and output computed."""
        self.tokens_seen = t + 1
        p = self.policy
        resident = p.resident(t + 1)
        if attended is None:
            attended = p.attended(t + 1)
        return StepOutcome(
            output=output,
            tokens_seen=t + 1,
            resident=p.resident_length(t + 1),
            first_position=resident[0].start,
            last_position=resident[-1].stop - 1,
            evicted_tokens=p.evicted_by_step(t),
            bytes_written=self.row_bytes,
            bytes_moved=0,
            attended=sum(len(r) for r in attended),
        )

    def prefill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Loads S tokens (B, Hkv, S, D), oldest first, into an empty cache.

        The policy applies as if the tokens had arrived one by one: only the positions it
        keeps resident after S tokens are stored.
        """
        s = self.spec
        if self.tokens_seen:
            raise ValueError("prefill: the cache already holds tokens")
        for name, t in (("prefill key", keys), ("prefill value", values)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (s.batch_size, s.num_kv_heads, s.head_dim):
                raise ValueError(
                    f"{name}: expected shape (B, Hkv, S, D) with B={s.batch_size}, Hkv={s.num_kv_heads}, "
                    f"D={s.head_dim}, got {tuple(t.shape)}"
                )
            if t.dtype != s.dtype:
                raise TypeError(f"{name}: dtype {dtype_name(t.dtype)} but the stream's dtype is {dtype_name(s.dtype)}")
        if keys.shape != values.shape:
            raise ValueError(f"prefill value: shape {tuple(values.shape)} differs from prefill key {tuple(keys.shape)}")
        n = keys.shape[2]
        if self.policy.kind is PolicyKind.NONE and n > self.policy.capacity:
            raise CacheFullError(f"prefill of {n} tokens exceeds the capacity {self.policy.capacity} of policy none")
        index = [p for r in self.policy.resident(n) for p in r]
        if len(index) < n:
            keys, values = keys[:, :, index], values[:, :, index]
        self._store_resident(n, keys, values)
        self.tokens_seen = n

    def _store_resident(self, t: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes the ``L(t)`` resident tokens (B, Hkv, L, D), in position order, to their rows."""
        offset = 0
        for a, b in self._runs(self.policy.resident(t)):
            self._write_rows(a, keys[:, :, offset : offset + b - a], values[:, :, offset : offset + b - a])
            offset += b - a

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident keys and values, (B, Hkv, L, D), in position order, oldest first."""
        keys, values = [], []
        for a, b in self._runs(self.resident_positions()):
            k, v = self._read_rows(a, b)
            keys.append(k)
            values.append(v)
        if not keys:
            s = self.spec
            empty = torch.empty((s.batch_size, s.num_kv_heads, 0, s.head_dim), dtype=s.dtype, device=s.device)
            return empty, empty.clone()
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def export_state(self) -> dict:
        """The complete stored state, for a snapshot: ``encoding`` plus tensors in position
        order. Loading it with ``load_state`` into an empty cache of the same spec gives a
        cache whose next outputs are bit-identical (same rows, same values)."""
        keys, values = self.export()
        return {"encoding": "dense", "key": keys, "value": values}

    def load_state(self, tokens_seen: int, state: dict) -> None:
        """Restores ``export_state`` output into an empty cache; ``ValueError`` if inconsistent.

        A layer with nothing resident travels as encoding "empty"; any other encoding must be
        this cache's own (``state_encoding``) and is loaded by ``_load_state``.
        """
        encoding = state.get("encoding")
        if encoding == "empty":
            self._check_empty(tokens_seen)
            return
        if encoding != self.state_encoding:
            raise ValueError(f"snapshot encoding {encoding!r} does not fit a {self.state_encoding!r} cache")
        self._load_state(tokens_seen, state)

    def _load_state(self, tokens_seen: int, state: dict) -> None:
        keys, values = state["key"], state["value"]
        self._check_state(tokens_seen, keys, values, self.spec.dtype)
        self._store_resident(tokens_seen, keys, values)
        self.tokens_seen = tokens_seen

    def _check_empty(self, tokens_seen: int) -> None:
        """Restores a layer with nothing resident (no data in the snapshot)."""
        if self.tokens_seen:
            raise ValueError("restore: the cache already holds tokens")
        if tokens_seen < 0 or self.policy.resident_length(tokens_seen) != 0:
            raise ValueError(f"restore: T={tokens_seen} needs resident tokens but the snapshot has none")
        self.tokens_seen = tokens_seen

    def _check_state(self, tokens_seen: int, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
        s = self.spec
        if self.tokens_seen:
            raise ValueError("restore: the cache already holds tokens")
        if tokens_seen < 0 or (self.policy.kind is PolicyKind.NONE and tokens_seen > self.policy.capacity):
            raise ValueError(f"restore: T={tokens_seen} is impossible for this stream's policy")
        resident = self.policy.resident_length(tokens_seen)
        expected = (s.batch_size, s.num_kv_heads, resident, s.head_dim)
        for name, t in (("key", keys), ("value", values)):
            if tuple(t.shape) != expected:
                raise ValueError(f"restore {name}: expected shape {expected} for T={tokens_seen}, got {tuple(t.shape)}")
            if t.dtype != dtype:
                raise ValueError(f"restore {name}: dtype {dtype_name(t.dtype)}, expected {dtype_name(dtype)}")

    def rollback(self, k: int) -> None:
        """Drops the last ``k`` tokens if that is exact (docs/eviction.md, "Rollback"); else ``RollbackError``."""
        if k < 0:
            raise ValueError(f"rollback: count must be >= 0, got {k}")
        reach = self.policy.rollback_reach(self.tokens_seen)
        if k > reach:
            raise RollbackError(
                f"rollback of {k} tokens is not exact: at T={self.tokens_seen} at most {reach} can be dropped",
                reach,
            )
        self.tokens_seen -= k


_KEY_STORES = {"transposed": KeyRows, "blocks": KeyBlocks}


class DenseRingCache(LayerCache):
    """Dense storage in the stream dtype for a ring: values (B, Hkv, C, D); keys in one of
    ``KEY_LAYOUTS``: "rows" (B, Hkv, C, D) like the values, "transposed"
    (``key_layout.KeyRows``, for torch's GEMMs) or "blocks" (``key_layout.KeyBlocks``, the
    compiled kernel's). The storage methods of the cpu and cuda caches; allocated once on
    ``spec.device``."""

    KEY_LAYOUTS = ("rows", "transposed", "blocks")

    def __init__(self, spec: CacheSpec, key_layout: str):
        super().__init__(spec)
        b, h, c, d = spec.rows_shape
        self._key_layout = key_layout
        self._keys = None
        if key_layout == "rows":
            self._k = torch.zeros((b, h, c, d), dtype=spec.dtype, device=spec.device)
        else:
            self._keys = _KEY_STORES[key_layout]((b, h), c, d, spec.dtype, spec.device)
            self._k = self._keys.data  # the storage tensor, whatever its layout
        self._v = torch.zeros((b, h, c, d), dtype=spec.dtype, device=spec.device)
        self._row_bytes = 2 * b * h * d * self._v.element_size()

    @staticmethod
    def storage_nbytes(spec: CacheSpec, key_layout: str) -> int:
        """What ``DenseRingCache(spec, key_layout)`` allocates."""
        b, h, c, d = spec.rows_shape
        el = torch.empty((), dtype=spec.dtype).element_size()
        keys = (
            b * h * c * d * el if key_layout == "rows" else _KEY_STORES[key_layout].nbytes_for((b, h), c, d, spec.dtype)
        )
        return keys + b * h * c * d * el

    @property
    def nbytes(self) -> int:
        return self._k.untyped_storage().nbytes() + self._v.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes one position occupies: a key and a value per KV head of the batch."""
        return self._row_bytes

    def _write_rows(self, start, keys, values):
        n = keys.shape[2]
        if self._keys is None:
            self._k[:, :, start : start + n] = keys
        else:
            self._keys.write(start, keys)
        self._v[:, :, start : start + n] = values

    def _read_rows(self, start, stop):
        if self._keys is None:
            return self._k[:, :, start:stop].clone(), self._v[:, :, start:stop].clone()
        return self._keys.read(start, stop), self._v[:, :, start:stop].clone()

    def _save_rows(self, start, stop):
        return self._read_rows(start, stop)

    def _restore_rows(self, start, saved):
        self._write_rows(start, *saved)


class Backend(abc.ABC):
    """A named way to store caches and attend. Capabilities are class data."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    default_device: ClassVar[str] = "cpu"

    @classmethod
    def probe(cls) -> list[str]:
        """Reasons this backend cannot run on this machine at all (empty when it can)."""
        return []

    def probe_reasons(self) -> list[str]:
        """``probe()`` computed once for this instance (the registry keeps one instance per
        backend per process), not on every cache created."""
        probed = self.__dict__.get("_probed")
        if probed is None:
            probed = self.__dict__["_probed"] = list(self.probe())
        return list(probed)

    def reasons_against(self, spec: CacheSpec) -> list[str]:
        return self.probe_reasons() + self.capabilities.reasons_against(
            self.name, spec.dtype, spec.head_dim, spec.device
        )

    def check(self, spec: CacheSpec) -> None:
        reasons = self.reasons_against(spec)
        if reasons:
            raise BackendUnavailable(reasons)

    @abc.abstractmethod
    def cache_nbytes(self, spec: CacheSpec) -> int:
        """Bytes ``create_cache(spec)`` will allocate: admission is decided on this, before allocation."""

    @abc.abstractmethod
    def create_cache(self, spec: CacheSpec) -> LayerCache: ...


def dense_nbytes(spec: CacheSpec) -> int:
    """Keys plus values, dense, in the spec's dtype."""
    b, h, c, d = spec.rows_shape
    return 2 * b * h * c * d * torch.empty((), dtype=spec.dtype).element_size()


def scaled_query(query: torch.Tensor, num_kv_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, Hq, D) -> (B*Hkv, G, D) in ``dtype``, multiplied by 1/sqrt(D)."""
    b, hq, d = query.shape
    return query.reshape(b * num_kv_heads, hq // num_kv_heads, d).to(dtype) * (1.0 / math.sqrt(d))
