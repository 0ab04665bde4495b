"""The batched entry point: the steps of many caches in one call.

``step_many`` takes one step for each of several distinct layer caches (different streams,
lengths, policies) and returns, slot for slot, the ``StepOutcome`` or the exception that step
raised. A step that is refused (bad input, no room) is refused alone: its cache is unchanged and
its batch-mates are computed. Each outcome is bit-identical to ``cache.step(...)`` run alone.

This is the contract the server's batcher and the ``Batch`` RPC build on; backends with a
compiled kernel compute a whole group of same-encoding caches in one native call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import LayerCache, StepOutcome

__all__ = ["BatchStep", "step_many"]


class BatchStep(NamedTuple):
    """One step of a batch: the cache it appends to and attends over, and its tensors
    ((B, Hq, D), (B, Hkv, D), (B, Hkv, D) in the cache's dtype; never written to)."""

    cache: LayerCache
    query: torch.Tensor
    new_key: torch.Tensor
    new_value: torch.Tensor


def step_many(steps: Sequence[BatchStep]) -> list[StepOutcome | Exception]:
    """Runs every step; slot ``i`` holds step ``i``'s outcome or the exception it raised.

    The caches must be distinct objects (``ValueError`` for the whole call otherwise, before
    anything is written): two steps of one cache in one batch would have no defined order.
    """
    if len({id(s.cache) for s in steps}) != len(steps):
        raise ValueError("step_many: a cache appears twice in one batch")
    results: list[StepOutcome | Exception] = []
    for s in steps:
        try:
            results.append(s.cache.step(s.query, s.new_key, s.new_value))
        except Exception as exc:  # refused alone; the cache restored itself
            results.append(exc)
    return results
