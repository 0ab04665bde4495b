"""The batched entry point: the steps of many caches in one call.

``step_many`` takes one step for each of several distinct layer caches (different streams,
lengths, policies) and returns, slot for slot, the ``StepOutcome`` or the exception that step
raised. A step that is refused (bad input, no room) is refused alone: its cache is unchanged and
its batch-mates are computed. Each outcome is bit-identical to ``cache.step(...)`` run alone.

This is the contract the server's batcher and the ``Batch`` RPC build on. Every CPU cache with
the compiled kernel (dense float32 / bfloat16 / float16, and int8 once calibrated; any mix of
encodings, shapes and policies) is computed in one native call (``native.Kernel.run``); a cache
class with its own batched step (``step_group``: the cuda backend's ``step_many_cuda``, one
Triton launch per dtype and head shape) gets its slots; other caches (the torch fallback, int8
during calibration) step one after the other in the same call, with the same contract.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import native
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

    Caches with a compiled step (``LayerCache._prepare_native``) are checked one by one (a
    refused step is refused alone), then computed together in one native call per library
    (``native.Kernel.run`` over their descriptors): the work is split across the kernels' pool
    in items of at most a fixed number of positions, so each output is bit-identical to the
    cache's ``step`` alone. Other caches step one after the other. The GIL is released during
    the native call.
    """
    if len({id(s.cache) for s in steps}) != len(steps):
        raise ValueError("step_many: a cache appears twice in one batch")
    results: list[StepOutcome | Exception | None] = [None] * len(steps)
    groups: dict[int, list] = {}  # id(kernel) -> [(slot, cache, t, desc, output, keep)]
    kernels = {}
    by_class: dict = {}  # a cache class's own batched step (``step_group``, e.g. cuda) -> slots
    for i, s in enumerate(steps):
        cache = s.cache
        step_group = getattr(type(cache), "step_group", None)
        if step_group is not None:
            by_class.setdefault(step_group, []).append(i)
            continue
        if getattr(cache, "_native", None) is None:
            try:
                results[i] = cache.step(s.query, s.new_key, s.new_value)
            except Exception as exc:  # refused alone; the cache restored itself
                results[i] = exc
            continue
        try:
            cache.check_step(s.query, s.new_key, s.new_value)
            prepared = cache._prepare_native(s.query, s.new_key, s.new_value)
        except Exception as exc:
            results[i] = exc
            continue
        if prepared is None:  # this step takes the Python path (e.g. int8 calibration)
            try:
                results[i] = cache.step(s.query, s.new_key, s.new_value)
            except Exception as exc:
                results[i] = exc
            continue
        kernels[id(cache._native)] = cache._native
        groups.setdefault(id(cache._native), []).append((i, cache, cache.tokens_seen, prepared))
    for key, members in groups.items():
        descs = (native.CacheDesc * len(members))()
        size = ctypes.sizeof(native.CacheDesc)
        for j, (_, _, _, prepared) in enumerate(members):
            ctypes.memmove(ctypes.addressof(descs) + j * size, ctypes.addressof(prepared.desc), size)
        try:
            kernels[key].run(descs, len(members))
        except Exception as exc:  # the whole call refused: nothing was written
            for i, *_ in members:
                results[i] = exc
            continue
        for j, (i, cache, t, prepared) in enumerate(members):
            try:
                cache.native_step_done(descs[j].status)
                results[i] = cache._commit(t, prepared.output, prepared.attended)
            except Exception as exc:
                results[i] = exc
    for step_group, slots in by_class.items():
        for i, result in zip(slots, step_group([steps[i] for i in slots])):
            results[i] = result
    return results  # type: ignore[return-value]
