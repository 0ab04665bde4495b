"""The batched entry point: the steps of many caches in one call.

``step_many`` takes one step for each of several distinct layer caches (different streams,
lengths, policies) and returns, slot for slot, the ``StepOutcome`` or the exception that step
raised. A step that is refused (bad input, no room) is refused alone: its cache is unchanged and
its batch-mates are computed. Each outcome is bit-identical to ``cache.step(...)`` run alone.

This is the contract the server's batcher and the ``Batch`` RPC build on. Every CPU cache with
the compiled kernel (dense float32 / bfloat16 / float16, and int8 once calibrated; any mix of
encodings, shapes and policies) is computed in one native call (``native.Kernel.step``); a cache
class with its own batched step (``step_group``: the cuda backend's ``step_many_cuda``, one
Triton launch per dtype and head shape) gets its slots; other caches (the torch fallback, int8
during calibration) step one after the other in the same call, with the same contract.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import LayerCache
from .contract import StepOutcome

__all__ = ["BatchStep", "step_many"]


class BatchStep(NamedTuple):
    """One step of a batch: the cache it appends to and attends over, and its tensors
    ((B, Hq, D), (B, Hkv, D), (B, Hkv, D) in the cache's dtype; never written to).

    ``out``, when given, is where the output goes: a contiguous (B, Hq, D) tensor of the
    cache's dtype on its device (checked; a step with another is refused alone), which the
    outcome's ``output`` then is. Rows of one packed tensor let a caller collect a batch's
    outputs without a copy. Written only by a step that succeeds."""

    cache: LayerCache
    query: torch.Tensor
    new_key: torch.Tensor
    new_value: torch.Tensor
    out: torch.Tensor | None = None


def _check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    if not (
        type(out) is torch.Tensor
        and out.shape == query.shape
        and out.dtype is query.dtype
        and out.device == query.device
        and out.is_contiguous()
    ):
        raise ValueError(
            f"out: expected a contiguous {tuple(query.shape)} {str(query.dtype)[6:]} tensor on {query.device}"
        )


def _into(out: torch.Tensor | None, outcome: StepOutcome) -> StepOutcome:
    """A step computed elsewhere: its output copied into ``out`` (when given)."""
    if out is not None:
        out.copy_(outcome.output)
        outcome.output = out
    return outcome


def step_many(steps: Sequence[BatchStep]) -> list[StepOutcome | Exception]:
    """Runs every step; slot ``i`` holds step ``i``'s outcome or the exception it raised.

    The caches must be distinct objects (``ValueError`` for the whole call otherwise, before
    anything is written): two steps of one cache in one batch would have no defined order.

    Caches with a compiled step (``LayerCache._state``) have their tensors checked one by one (a
    refused step is refused alone), then are computed together in one ``gqa_step`` call per
    library, which plans each step from the cache's state, writes its row, attends and writes
    its output; a row it refuses (policy none full, an int8 scale out of range) is refused
    alone, a row it hands back (int8 calibration) steps in Python. The work is split across the
    kernels' pool in items of at most a fixed number of positions, so each output is
    bit-identical to the cache's ``step`` alone. A cache class with a batched step of its own
    (``step_group``: the cuda backend's one Triton launch) gets its slots handed to it. Other
    caches step one after the other. The GIL is released during the native call.
    """
    if len({id(s.cache) for s in steps}) != len(steps):
        raise ValueError("step_many: a cache appears twice in one batch")
    results: list[StepOutcome | Exception | None] = [None] * len(steps)
    native, by_class = _sort(steps, results)
    for kernel, members in native.values():
        _step_native(kernel, members, steps, results)
    for step_group, slots in by_class.items():
        for i, result in zip(slots, step_group([steps[i] for i in slots])):
            results[i] = result if isinstance(result, Exception) else _into(steps[i].out, result)
    return results  # type: ignore[return-value]


def _sort(steps: Sequence[BatchStep], results: list) -> tuple[dict, dict]:
    """Puts each step where it runs: refused now (its exception in ``results``), stepped in
    Python now, or returned: ``native`` (id(kernel) -> (kernel, [(slot, cache, out, q, k, v)]),
    tensors checked and contiguous) and ``by_class`` (a cache class's ``step_group`` -> slots)."""
    native: dict[int, tuple] = {}
    by_class: dict = {}
    for i, s in enumerate(steps):
        cache, q, k, v, out = s
        if out is not None:
            try:
                _check_out(out, q)
            except ValueError as exc:
                results[i] = exc
                continue
        step_group = getattr(type(cache), "step_group", None)
        if step_group is not None:
            by_class.setdefault(step_group, []).append(i)
            continue
        if cache._state is not None:
            try:
                cache.check_tensors(q, k, v)
            except Exception as exc:
                results[i] = exc
                continue
            kernel = cache._native
            if id(kernel) not in native:
                native[id(kernel)] = (kernel, [])
            if out is None:
                out = cache.next_output()
            native[id(kernel)][1].append((i, cache, out, q.contiguous(), k.contiguous(), v.contiguous()))
            continue
        _step_python(cache, s, results, i)
    return native, by_class


def _step_native(kernel, members: list, steps: Sequence[BatchStep], results: list) -> None:
    """One ``gqa_step`` call for ``members`` (``_sort``'s), each row's outcome into its slot."""
    n = len(members)
    addrs = (ctypes.c_void_p * n)(*[ctypes.addressof(m[1]._state) for m in members])
    io = (ctypes.c_void_p * (4 * n))(
        *[p for m in members for p in (m[3].data_ptr(), m[4].data_ptr(), m[5].data_ptr(), m[2].data_ptr())]
    )
    res = (ctypes.c_int64 * (7 * n))()
    status = (ctypes.c_int32 * n)()
    try:
        rc = kernel.step(addrs, n, io, None, None, res, 7, status, 0, 0)
        if rc:
            kernel.raise_for(rc)
    except Exception as exc:  # the whole call refused: nothing was written
        for i, *_ in members:
            results[i] = exc
        return
    for j, (i, cache, out, *_) in enumerate(members):
        st = status[j]
        if st == 0:
            r = res[7 * j : 7 * j + 7]
            results[i] = StepOutcome(out, r[0], r[1], r[2], r[3], r[4], cache._step_bytes, 0, r[6])
        elif st == -errno.EAGAIN:  # this cache's step takes the Python path now
            _step_python(cache, steps[i], results, i)
        else:
            results[i] = cache.step_error(st)


def _step_python(cache: LayerCache, s: BatchStep, results: list, i: int) -> None:
    """A step without the compiled path (torch fallback, int8 calibration), into slot ``i``."""
    try:
        results[i] = _into(s.out, cache._step_python(s.query, s.new_key, s.new_value))
    except Exception as exc:  # refused alone; the cache restored itself
        results[i] = exc
