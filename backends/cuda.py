"""The CUDA backend: float16 / bfloat16 caches on the GPU, attention by a Triton kernel.

Each layer's keys and values are one (B, Hkv, C, D) tensor each, allocated once on the device;
position ``p`` lives at the ring row ``LayerCache.row_of(p)``, so appending writes one row and
eviction, under every policy, copies nothing. The attended positions reach the kernel as at
most three row runs (sinks, then a window that may wrap) and the kernel maps its logical index
to ring rows itself (``triton_decode.py``). Exports come out in position order through the
base class.

Steps of many caches go together (``step_many_cuda``, which ``backends.batch.step_many`` calls
for these caches): the steps of every cache with the same device, dtype, head width and group
size are one launch that writes their rows and one launch that attends over every cache at once
(``triton_decode.decode_batched``). Each KV head's attended rows are cut into splits of a fixed
number of rows and merged in a fixed order, so a step's output is bit-identical alone
(``step``) or in any batch. The batch keeps the step's contract: a refused step is refused
alone, before anything is written, and a failure after the writes puts the rows back.

``attention="sdpa"`` swaps the kernel for PyTorch's ``scaled_dot_product_attention`` with
``enable_gqa=True`` over a contiguous view of the attended rows (a copy when the runs are
several): the baseline the kernel is measured against.

Importing this module never imports ``triton`` and never touches the device, so it is safe on
any machine; ``CUDABackend.probe()`` says why the backend cannot run here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LayerCache
from .contract import Backend, CacheSpec, Capabilities, StepOutcome
from .dense import DenseRingCache, dense_nbytes
from .ring import merge_runs

__all__ = [
    "ATTENTION_PATHS",
    "CUDABackend",
    "CUDACache",
    "DeviceFacts",
    "device_facts",
    "sdpa_attention",
    "step_many_cuda",
]

ATTENTION_PATHS = ("triton", "sdpa")


@dataclass(frozen=True)
class DeviceFacts:
    """What ``probe`` needs to know about this machine; tests fake it."""

    torch_has_cuda: bool  # torch was built with CUDA
    device_count: int  # CUDA devices torch can see
    triton_installed: bool


def device_facts() -> DeviceFacts:
    has_cuda = torch.version.cuda is not None
    try:
        count = torch.cuda.device_count() if has_cuda else 0
    except RuntimeError:  # a broken driver is reported as "no device", not raised
        count = 0
    return DeviceFacts(has_cuda, count, importlib.util.find_spec("triton") is not None)


def reasons_from(facts: DeviceFacts) -> list[str]:
    reasons = []
    if not facts.torch_has_cuda:
        reasons.append("cuda: torch has no CUDA (CPU build)")
    elif facts.device_count < 1:
        reasons.append("cuda: no CUDA device")
    if not facts.triton_installed:
        reasons.append("cuda: triton not installed (the 'triton' extra)")
    return reasons


def sdpa_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: list[tuple[int, int]]
) -> torch.Tensor:
    """The baseline: SDPA over a contiguous view of the runs of (B, Hkv, C, D) caches."""
    if len(runs) == 1:
        ((a, b),) = runs
        k, v = keys[:, :, a:b], values[:, :, a:b]
    else:
        k = torch.cat([keys[:, :, a:b] for a, b in runs], dim=2)
        v = torch.cat([values[:, :, a:b] for a, b in runs], dim=2)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, enable_gqa=True)
    return out.squeeze(2)


class CUDACache(DenseRingCache):
    """Dense ring cache on one device, keys and values as rows (B, Hkv, C, D). Device-agnostic in
    itself: the kernel tests run it on CPU tensors under Triton's interpreter."""

    def __init__(self, spec: CacheSpec, attention: str = "triton", kernel_config=None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {attention!r}")
        super().__init__(spec, key_layout="rows")
        self.attention = attention
        self.kernel_config = kernel_config
        n = spec.batch_size * spec.num_kv_heads
        # The storage as the kernel reads it, (B*Hkv, C, D); allocated once, so viewed once.
        self._rows = self._k.view(n, spec.capacity, spec.head_dim), self._v.view(n, spec.capacity, spec.head_dim)

    def _attend(self, query, runs):
        if self.attention == "sdpa":
            return sdpa_attention(query, self._k, self._v, runs)
        from . import triton_decode

        (out,), _ = triton_decode.decode_batched([self._batched(query, runs)], config=self._config())
        return out

    def _config(self):
        from . import triton_decode

        return self.kernel_config or triton_decode.DEFAULT_CONFIG

    def _batched(self, query, runs, row=-1, new_key=None, new_value=None):
        """This cache's step as a ``triton_decode.BatchedStep`` (the storage viewed (B*Hkv, C, D))."""
        from . import triton_decode

        return triton_decode.BatchedStep(query, *self._rows, runs, self.spec.num_kv_heads, row, new_key, new_value)

    @classmethod
    def step_group(cls, steps) -> list[StepOutcome | Exception]:
        """``backends.batch.step_many``'s hook for these caches: ``step_many_cuda``."""
        return step_many_cuda(steps)


def step_many_cuda(steps) -> list[StepOutcome | Exception]:
    """``backends.batch.step_many`` for cuda caches: slot ``i`` holds step ``i``'s outcome or the
    exception it raised (``steps``: ``BatchStep``-like, with ``cache``, ``query``, ``new_key``,
    ``new_value``; distinct caches).

    Every step is checked first (``check_step``: a refused step is refused alone, its cache
    untouched). Triton caches that share (device, dtype, head width, group size, kernel config)
    are one ``triton_decode.decode_batched`` call: one launch writes their rows (saving what it
    overwrites), one launch attends. A failure after the writes restores every row of the call
    and fails its steps; outputs are bit-identical to each cache's ``step`` alone. Caches on
    the SDPA path step one by one.
    """
    from . import triton_decode

    results: list[StepOutcome | Exception | None] = [None] * len(steps)
    groups: dict[tuple, list] = {}
    for i, st in enumerate(steps):
        cache = st.cache
        if not isinstance(cache, CUDACache) or cache.attention != "triton":
            try:
                results[i] = cache.step(st.query, st.new_key, st.new_value)
            except Exception as exc:  # refused alone; the cache restored itself
                results[i] = exc
            continue
        try:
            cache.check_step(st.query, st.new_key, st.new_value)
        except Exception as exc:
            results[i] = exc
            continue
        t = cache.tokens_seen
        attended = cache.policy.attended(t + 1)
        item = cache._batched(st.query, merge_runs(cache._runs(attended)), cache.row_of(t), st.new_key, st.new_value)
        key = (triton_decode.group_key(st.query, cache.spec.num_kv_heads), cache._config())
        groups.setdefault(key, []).append((i, cache, t, attended, item))
    for (_, config), members in groups.items():
        items = [m[-1] for m in members]
        try:  # decode_batched puts the rows back itself if its attention launch fails
            outputs, saves = triton_decode.decode_batched(items, config=config)
        except Exception as exc:
            for i, *_ in members:
                results[i] = exc
            continue
        try:
            outcomes = [cache._commit(t, out, attended) for (_, cache, t, attended, _), out in zip(members, outputs)]
        except BaseException as exc:  # nothing is committed unless everything is
            for _, cache, t, *_ in members:
                cache.tokens_seen = t
            triton_decode.restore_rows(items, saves)
            if not isinstance(exc, Exception):
                raise
            for i, *_ in members:
                results[i] = exc
            continue
        for (i, *_), outcome in zip(members, outcomes):
            results[i] = outcome
    return results  # type: ignore[return-value]


class CUDABackend(Backend):
    """``attention``: ``"triton"`` (the service's kernel) or ``"sdpa"`` (the PyTorch baseline)."""

    name = "cuda"
    capabilities = Capabilities(
        dtypes=(torch.float16, torch.bfloat16),
        devices=("cuda",),
        max_head_dim=256,
    )
    default_device = "cuda"

    def __init__(self, attention: str = "triton", kernel_config=None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {attention!r}")
        self.attention = attention
        self.kernel_config = kernel_config

    @classmethod
    def probe(cls) -> list[str]:
        return reasons_from(device_facts())

    def cache_nbytes(self, spec: CacheSpec) -> int:
        return dense_nbytes(spec)

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return CUDACache(spec, self.attention, self.kernel_config)
