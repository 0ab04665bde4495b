"""``ServedCache``: a transformers ``Cache`` whose keys and values live on gqa-serve. The
process keeps per layer only how many positions it has seen; the prompt's keys and values go
to the service once (``BatchAdd.prefill``), every later token is one step message per layer."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import pending
from .sessions import ServedAttentionError

__all__ = ["FORWARD_HEADROOM", "ServedCache"]

# A cache made for a plain forward call (no ``generate`` to say how long it runs) holds the
# prompt plus this many tokens in its full-attention layers, unless ``max_length`` says more.
FORWARD_HEADROOM = 256


class _ServedLayer(CacheLayerMixin):
    """One model layer of a ``ServedCache``: how many positions (padding included, as
    transformers counts them) it has seen. Its keys and values live on the service."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.seen = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a ServedCache is updated as a whole (ServedCache.update)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a ServedCache cannot be reset; close it and make another")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("gqa_serve: beam search is not supported (its caches would be copied per beam)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("gqa_serve: cropping a served cache is not supported (assisted decoding)")


class ServedCache(Cache):
    """A transformers ``Cache`` whose keys and values are held by gqa-serve: one sequence per
    batch row in each of the handle's sessions, added by the first forward call (the prompt)
    or by ``load``. ``close()`` removes the sequences (``generate`` does it for the caches it
    makes; a cache left to the garbage collector is removed by the handle later)."""

    def __init__(self, handle, max_length: int | None):
        super().__init__(layers=[_ServedLayer(w) for w in handle._sliding])
        self.handle = handle
        self.sessions = handle.sessions
        self.max_length = max_length
        self.ids: list[int] | None = None
        self.closed = False
        self._prompt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._real: torch.Tensor | None = None  # (B, prompt) True for the positions that are not padding
        self._added: set[int] = set()  # groups whose sequences are on the service
        self._finalizer = weakref.finalize(self, handle._orphan, self._added, [])

    def _take_ids(self, batch: int) -> None:
        self.ids = self.handle._new_ids(batch)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, self.handle._orphan, self._added, list(self.ids))

    # -- transformers' Cache interface ---------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.closed:
            raise ServedAttentionError("this ServedCache was closed: its sequences are no longer on the service")
        layer = self.layers[layer_idx]
        batch = key_states.shape[0]
        if self.ids is None:
            self._take_ids(batch)
        elif batch != len(self.ids):
            raise ValueError(f"gqa_serve: the cache holds {len(self.ids)} sequences, this call has a batch of {batch}")
        prompt = layer.seen == 0 and self.sessions.plans[layer_idx].group not in self._added
        layer.seen += key_states.shape[2]
        pending.value = (self, layer_idx, prompt)
        return key_states, value_states

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.ids is not None:
            raise NotImplementedError("gqa_serve: a served cache cannot be repeated along the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("gqa_serve: a served cache cannot select batch rows")

    # -- the prompt ----------------------------------------------------------------------------
    def _prompt_done(self, layer: int, key: torch.Tensor, value: torch.Tensor, mask) -> None:
        """Called by the attention function once the prompt's attention of ``layer`` is
        computed; the keys wait for the last layer of their session, then go in one upload."""
        if self._real is None:
            b, _, n, _ = key.shape
            if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape[-2:] == (n, n):
                # A position is padding exactly when it may not attend to itself.
                self._real = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1).to("cpu")
            else:
                self._real = torch.ones(b, n, dtype=torch.bool)
        self._prompt[layer] = (key, value)
        group = self.sessions.group_of(layer)
        if layer == group.layers[-1]:
            self._upload(group, {i: self._prompt.pop(m) for i, m in enumerate(group.layers)}, self._real)

    def load(self, layers) -> None:
        """Fills an empty cache with a context computed elsewhere: ``layers`` holds, per model
        layer, (keys, values) of shape (B, Hkv, S, D) after the rotary embedding, oldest
        first (a ``DynamicCache`` works: it iterates so). The next forward call continues
        after them at position S."""
        layers = [(k, v) for k, v, *_ in layers]
        if len(layers) != len(self.layers) or self.ids is not None:
            raise ValueError(f"load: expected an empty cache and {len(self.layers)} layers, got {len(layers)}")
        batch, _, n, _ = layers[0][0].shape
        self._take_ids(batch)
        real = torch.ones(batch, n, dtype=torch.bool)
        for group in self.sessions.groups:
            self._upload(group, {i: layers[m] for i, m in enumerate(group.layers)}, real)
        for layer in self.layers:
            layer.seen = n

    def _capacity(self, plan, prompt: int) -> int:
        if plan.policy == "greedy":
            return plan.capacity
        if plan.policy != "none":
            return 0
        capacity = prompt + FORWARD_HEADROOM if self.max_length is None else self.max_length
        if capacity < prompt:
            raise ValueError(f"gqa_serve: max_length={self.max_length} is shorter than the prompt ({prompt} positions)")
        return capacity

    def _upload(self, group, keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]], real) -> None:
        """Adds each row's sequence to ``group``'s session with its real (unpadded) positions."""
        capacity = self._capacity(group.plan, real.shape[1])
        dtype = self.sessions.dtype
        dense = bool(real.all())
        self._added.add(group.plan.group)  # before the adds: close() removes whichever got in
        for row, sid in enumerate(self.ids):
            keep = None if dense else real[row].nonzero().squeeze(1)
            prefill = {}
            for index, (k, v) in keys_values.items():
                k, v = k[row : row + 1], v[row : row + 1]
                if keep is not None:
                    k, v = k[:, :, keep.to(k.device)], v[:, :, keep.to(v.device)]
                prefill[index] = (k.detach().to("cpu", dtype), v.detach().to("cpu", dtype))
            self.sessions.add(group, sid, capacity, prefill)

    # -- decode steps --------------------------------------------------------------------------
    def _decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One step message per new token: (B, Hq, q, D), (B, Hkv, q, D) x2 -> (B, q, Hq, D)."""
        return self.sessions.step(layer, self.ids, query, key, value)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes this cache's sequences from the service (idempotent; never raises for a
        service that is gone: its sequences went with it)."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        self._prompt.clear()
        if self.ids is not None:
            self.sessions.remove(self._added, self.ids)
