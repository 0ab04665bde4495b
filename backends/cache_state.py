"""A layer cache's snapshot state: what ``export_state`` hands over, what ``load_state`` accepts.

The state is an ``encoding`` plus tensors in position order; loading it into an empty cache of
the same spec gives a cache whose next outputs are bit-identical. A layer with nothing resident
travels as encoding "empty". ``base.LayerCache`` inherits this class; a cache with its own
storage encoding (the int8 cache) overrides ``export_state`` and ``_load_state``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .policy import PolicyKind
from .validation import dtype_name

__all__ = ["CacheState"]


class CacheState:
    """The snapshot state of a ``base.LayerCache`` (a mixin: it uses the cache's ``spec``,
    ``policy``, ``tokens_seen``, ``export`` and ``_store_resident``)."""

    # The ``encoding`` of this cache's ``export_state``, which ``load_state`` accepts.
    state_encoding: ClassVar[str] = "dense"

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
