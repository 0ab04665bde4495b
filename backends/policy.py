"""Eviction policies as index arithmetic.

A policy answers, for a layer that has seen ``T`` tokens (positions ``0 .. T-1``), which
positions stay resident in the cache and which ones the newest token attends to. It knows
nothing of storage: each backend applies the answer to its own layout (the contract:
``docs/eviction.md``).

The window ``W`` counts the keys a new token attends to **including itself** (the vLLM /
llama.cpp / ONNX Runtime convention). ``C`` is the capacity in rows.

Position sets are returned as tuples of half-open ``range`` objects, oldest first; at most two
ranges (the sinks and the recent window) ever occur.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "PolicyKind",
    "EvictionPolicy",
    "greedy_resident_length",
    "PolicyError",
]


class PolicyError(ValueError):
    """A policy configuration that cannot be served (window 0, capacity below the window...)."""


class PolicyKind(str, enum.Enum):
    NONE = "none"
    STRICT = "strict"
    GREEDY = "greedy"
    SINK = "sink"


def greedy_resident_length(t: int, window: int, capacity: int) -> int:
    """ONNX Runtime's ``sliding_window_cache`` contract: rows resident after ``t`` tokens.

    With ``g = capacity - window + 1``::

        L(t) = t                                if t <= capacity
        L(t) = t - g * ceil((t - capacity) / g)  otherwise

    so that ``min(t, window) <= L(t) <= min(t, capacity)``.
    """
    if t < 0:
        raise ValueError(f"token count must be >= 0, got {t}")
    if t <= capacity:
        return t
    g = capacity - window + 1
    return t - g * (-(-(t - capacity) // g))


@dataclass(frozen=True)
class EvictionPolicy:
    """What a layer cache keeps and attends to.

    Build with the named constructors; ``capacity`` is always the number of rows a backend
    must preallocate.
    """

    kind: PolicyKind
    capacity: int
    window: int = 0
    sinks: int = 0

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def none(cls, capacity: int) -> "EvictionPolicy":
        """Keep everything; ``capacity`` is the maximum sequence length. A full cache refuses."""
        _positive("capacity", capacity)
        return cls(PolicyKind.NONE, capacity=capacity)

    @classmethod
    def strict(cls, window: int) -> "EvictionPolicy":
        """Keep and attend exactly the latest ``min(T, window)`` tokens (capacity = window)."""
        _positive("window", window)
        return cls(PolicyKind.STRICT, capacity=window, window=window)

    @classmethod
    def greedy(cls, window: int, capacity: int) -> "EvictionPolicy":
        """Attend the latest ``window`` tokens; evict in blocks so ``L(T)`` rows stay resident."""
        _positive("window", window)
        _positive("capacity", capacity)
        if capacity < window:
            raise PolicyError(f"greedy: capacity ({capacity}) must be >= window ({window})")
        return cls(PolicyKind.GREEDY, capacity=capacity, window=window)

    @classmethod
    def sink(cls, window: int, sinks: int) -> "EvictionPolicy":
        """Keep the first ``sinks`` tokens plus the latest ``window`` (StreamingLLM)."""
        _positive("window", window)
        if sinks < 0:
            raise PolicyError(f"sink: sinks must be >= 0, got {sinks}")
        return cls(PolicyKind.SINK, capacity=sinks + window, window=window, sinks=sinks)

    @classmethod
    def create(cls, kind: str | PolicyKind, *, window: int = 0, capacity: int = 0, sinks: int = 0) -> "EvictionPolicy":
        """One entry point for configuration: validates the fields the kind needs."""
        try:
            kind = PolicyKind(kind)
        except ValueError:
            raise PolicyError(f"unknown policy {kind!r}; expected one of {[k.value for k in PolicyKind]}") from None
        if kind is PolicyKind.NONE:
            return cls.none(capacity)
        if kind is PolicyKind.STRICT:
            return cls.strict(window)
        if kind is PolicyKind.GREEDY:
            return cls.greedy(window, capacity if capacity else window)
        return cls.sink(window, sinks)

    # -- arithmetic ---------------------------------------------------------------------
    def has_room(self, t: int) -> bool:
        """Whether a layer that has seen ``t`` tokens can take one more."""
        return self.kind is not PolicyKind.NONE or t < self.capacity

    def resident_length(self, t: int) -> int:
        """``L(t)``: rows resident after ``t`` tokens."""
        if t < 0:
            raise ValueError(f"token count must be >= 0, got {t}")
        if self.kind is PolicyKind.NONE:
            if t > self.capacity:
                raise ValueError(f"none: {t} tokens exceed capacity {self.capacity}")
            return t
        if self.kind is PolicyKind.STRICT:
            return min(t, self.window)
        if self.kind is PolicyKind.GREEDY:
            return greedy_resident_length(t, self.window, self.capacity)
        return min(t, self.sinks) + min(max(t - self.sinks, 0), self.window)

    def resident(self, t: int) -> tuple[range, ...]:
        """Positions resident after ``t`` tokens, oldest first."""
        if self.kind is PolicyKind.SINK:
            return self._sink_ranges(t)
        return _nonempty(range(t - self.resident_length(t), t))

    def attended(self, t: int) -> tuple[range, ...]:
        """Positions the token at position ``t - 1`` attends to (itself included)."""
        if self.kind is PolicyKind.NONE:
            return _nonempty(range(0, t))
        if self.kind is PolicyKind.SINK:
            return self._sink_ranges(t)
        return _nonempty(range(t - min(t, self.window), t))

    def evicted_by_step(self, t_before: int) -> int:
        """Tokens dropped from residency by the step that takes ``t_before`` to ``t_before + 1``."""
        return self.resident_length(t_before) + 1 - self.resident_length(t_before + 1)

    def rollback_reach(self, t: int) -> int:
        """The largest ``k`` such that dropping the last ``k`` tokens is exact.

        Exact means ``L(t - j) == L(t) - j`` for every ``j <= k``: the dropped tokens are
        resident and nothing older would have to come back (docs/eviction.md, Rollback).
        Arithmetic, O(1): while nothing has been evicted yet (``L(t) == t``) every token can go;
        once a strict or sink window is full nothing can; greedy can drop the tokens appended
        since its last block eviction.
        """
        lt = self.resident_length(t)
        if lt == t:
            return t
        if self.kind is PolicyKind.GREEDY:
            # evictions happen on the steps reaching t' with t' - C = 1 (mod g), g = C - W + 1
            return (t - self.capacity - 1) % (self.capacity - self.window + 1)
        return 0

    def _sink_ranges(self, t: int) -> tuple[range, ...]:
        head = range(0, min(t, self.sinks))
        tail = range(max(self.sinks, t - self.window), t)
        return _nonempty(head, tail)


def _nonempty(*ranges: range) -> tuple[range, ...]:
    return tuple(r for r in ranges if len(r))


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PolicyError(f"{name} must be a positive integer, got {value!r}")
