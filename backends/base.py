"""The layer cache: one layer of one stream, stepped atomically over ring rows a subclass stores.

The cache owns B x Hkv x C x D keys and values, allocated once; its layout is a ring (position
``p`` lives at a fixed row, ``ring.row_of``), so appending is O(1) and eviction moves no bytes.
What is resident and attended comes from the stream's ``EvictionPolicy``; storage (dense, int8
codes plus scales, GPU) is the subclass's. The compiled step (``native_step``) and the snapshot
state (``cache_state``) are the two halves it inherits.

The step is atomic: everything is checked before anything is written, and a failure after
the write restores the overwritten row, so a rejected or failed step leaves the cache exactly
as it was.
"""

from __future__ import annotations

import abc

import torch

from .cache_state import CacheState
from .contract import CacheSpec, StepOutcome
from .errors import CacheFullError, InputTypeError, InputValueError, RollbackError
from .native_step import NativeStep
from .policy import PolicyKind
from .ring import merge_runs, position_runs, row_of
from .validation import check_step_tensors, dtype_name

__all__ = ["LayerCache"]


class LayerCache(NativeStep, CacheState, abc.ABC):
    """One layer of one stream: ring-layout bookkeeping over storage the subclass owns."""

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
        """The row that position ``position`` lives in (``ring.row_of``)."""
        return row_of(self.policy, position)

    def _runs(self, positions: tuple[range, ...]) -> list[tuple[int, int]]:
        return position_runs(self.policy, positions)

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
            and query.layout is torch.strided
            and new_key.layout is torch.strided
            and new_value.layout is torch.strided
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
