"""The step plane: the caches of many sequences of one shape, stepped n at a time (issue #23).

STAND-IN: this module implements the interface of /work/wt/PLANE-API.md over today's
``backends.batch.step_many`` (one ``BatchStep`` per row, Python per row) so the service can be
written against it; the real ``CacheSet`` (one native call over an array of handles) replaces
it at merge. Its contract is the real one's.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from .base import LayerCache, StepOutcome
from .batch import BatchStep, step_many

__all__ = ["FIELDS", "StepBatch", "CacheSet"]

FIELDS = ("tokens_seen", "resident", "first_position", "last_position", "evicted_tokens", "rollback_reach")


class StepBatch(NamedTuple):
    """One ``CacheSet.step``'s results: ``fields`` int64 (n, 6), FIELDS after each row's step (a
    refused row all 0); ``refused`` row -> the exception that row's step raised (empty when every
    row succeeded; a refused row's cache is unchanged and its ``out`` row left as it was);
    ``compute_ns`` the computation's wall time."""

    fields: np.ndarray
    refused: dict[int, Exception]
    compute_ns: int


class CacheSet:
    """The caches of many sequences of ONE shape, one column per layer, rows addressed by slot
    (small ints, reused after ``remove``). Not thread-safe: one owner; ``step`` may run on a
    worker thread while the owner does nothing else with the set."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._rows: list[list[LayerCache] | None] = []
        self._free: list[int] = []

    def add(self, caches: list[LayerCache]) -> int:
        """A sequence's caches (``caches[i]`` is layer i's) -> its slot."""
        if len(caches) != self.num_layers:
            raise ValueError(f"add: {len(caches)} caches for a set of {self.num_layers} layers")
        if self._free:
            slot = self._free.pop()
            self._rows[slot] = list(caches)
        else:
            slot = len(self._rows)
            self._rows.append(list(caches))
        return slot

    def remove(self, slot: int) -> None:
        if self._rows[slot] is None:
            raise KeyError(slot)
        self._rows[slot] = None
        self._free.append(slot)

    def caches(self, slot: int) -> list[LayerCache]:
        row = self._rows[slot]
        if row is None:
            raise KeyError(slot)
        return row

    def step(
        self,
        layer: int,
        slots: np.ndarray,
        query: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        out: torch.Tensor,
    ) -> StepBatch:
        """Row i steps ``caches(slots[i])[layer]`` with ``query[i:i+1]``, ``new_key[i:i+1]``,
        ``new_value[i:i+1]`` into ``out[i:i+1]``; bit-identical to that cache's ``step``."""
        n = len(slots)
        fields = np.zeros((n, len(FIELDS)), dtype=np.int64)
        refused: dict[int, Exception] = {}
        if n == 0:
            return StepBatch(fields, refused, 0)
        rows = self._rows
        caches = [rows[s][layer] for s in slots.tolist()]
        q, k, v, o = query.split(1), new_key.split(1), new_value.split(1), out.split(1)
        steps = [BatchStep(c, q[i], k[i], v[i], o[i]) for i, c in enumerate(caches)]
        t0 = time.perf_counter_ns()
        outcomes = step_many(steps)
        compute_ns = time.perf_counter_ns() - t0
        for i, (cache, r) in enumerate(zip(caches, outcomes)):
            if isinstance(r, StepOutcome):
                fields[i] = (
                    r.tokens_seen,
                    r.resident,
                    r.first_position,
                    r.last_position,
                    r.evicted_tokens,
                    cache.policy.rollback_reach(r.tokens_seen),
                )
            else:
                refused[i] = r
        return StepBatch(fields, refused, compute_ns)
