"""Ring arithmetic: which rows of a layer cache hold which positions.

A cache of capacity C keeps position ``p`` at a fixed row, so appending is O(1) and eviction
moves no bytes: row ``p mod C``, except under a sink policy, whose first ``sinks`` positions stay
put while the later ones cycle through the ``window`` rows after them. Runs are half-open row
ranges ``(start, stop)``. The positions themselves come from the policy (``policy.py``).
"""

from __future__ import annotations

from .policy import EvictionPolicy, PolicyKind

__all__ = ["merge_runs", "position_runs", "row_of"]


def row_of(policy: EvictionPolicy, position: int) -> int:
    """The row that position ``position`` lives in (a ring; sinks stay put)."""
    if policy.kind is PolicyKind.SINK:
        if position < policy.sinks:
            return position
        return policy.sinks + (position - policy.sinks) % policy.window
    return position % policy.capacity


def position_runs(policy: EvictionPolicy, positions: tuple[range, ...]) -> list[tuple[int, int]]:
    """The row runs holding ``positions`` (consecutive ranges as the policy returns them), in
    position order: each range is at most two runs, as it wraps at most once around the region
    it cycles through (for a sink policy's later positions, the rows after the sinks)."""
    runs: list[tuple[int, int]] = []
    end = policy.capacity
    for r in positions:
        n = len(r)
        if not n:
            continue
        region_start = policy.sinks if policy.kind is PolicyKind.SINK and r.start >= policy.sinks else 0
        first = row_of(policy, r.start)
        if first + n <= end:
            runs.append((first, first + n))
        else:
            head = end - first
            runs.append((first, end))
            runs.append((region_start, region_start + n - head))
    return runs


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
