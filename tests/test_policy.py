"""Eviction policies as pure index arithmetic, checked on integers."""

from __future__ import annotations

import itertools

import pytest

from backends.policy import EvictionPolicy, PolicyError, PolicyKind, greedy_resident_length


def simulate_greedy(t_max: int, window: int, capacity: int) -> list[list[int]]:
    """Resident positions after each T, by appending one token at a time and dropping, on
    overflow, the oldest tokens in one block so that the latest W remain (docs/eviction.md)."""
    resident: list[int] = []
    history = [[]]
    for p in range(t_max):
        if len(resident) == capacity:
            resident = resident[len(resident) - (window - 1) :] if window > 1 else []
        resident.append(p)
        history.append(list(resident))
    return history


def positions(ranges) -> list[int]:
    return [p for r in ranges for p in r]


def test_trace_c6_w4():
    pol = EvictionPolicy.greedy(window=4, capacity=6)
    assert positions(pol.resident(6)) == [0, 1, 2, 3, 4, 5]
    assert positions(pol.resident(7)) == [3, 4, 5, 6]
    assert positions(pol.resident(9)) == [3, 4, 5, 6, 7, 8]
    assert positions(pol.resident(10)) == [6, 7, 8, 9]
    # The slack changes residency, not attention.
    assert positions(pol.attended(9)) == [5, 6, 7, 8]


def test_ort_example_c5_w3():
    # ONNX Runtime 1.32 CPU, sliding_window_cache=1, C=5, W=3: rows hold 3..7 at T=8 while the
    # new token attends to 5, 6, 7.
    pol = EvictionPolicy.greedy(window=3, capacity=5)
    assert positions(pol.resident(8)) == [3, 4, 5, 6, 7]
    assert positions(pol.attended(8)) == [5, 6, 7]


GRID_W = [1, 2, 3, 4, 7]
GRID_SLACK = [0, 1, 2, 5]


@pytest.mark.parametrize("window,slack", list(itertools.product(GRID_W, GRID_SLACK)), ids=lambda v: str(v))
def test_greedy_formula_matches_block_eviction(window, slack):
    capacity = window + slack
    pol = EvictionPolicy.greedy(window, capacity)
    history = simulate_greedy(60, window, capacity)
    for t in range(61):
        assert greedy_resident_length(t, window, capacity) == len(history[t]), t
        assert positions(pol.resident(t)) == history[t], t
        assert min(t, window) <= pol.resident_length(t) <= min(t, capacity)


def test_ort_formula_values():
    # L(T) = T - G*ceil((T-C)/G), G = C-W+1, written out for C=6, W=4 (G=3).
    expected = {0: 0, 5: 5, 6: 6, 7: 4, 8: 5, 9: 6, 10: 4, 11: 5, 12: 6, 13: 4}
    assert {t: greedy_resident_length(t, 4, 6) for t in expected} == expected


@pytest.mark.parametrize("window", [1, 3, 8])
def test_strict_is_greedy_without_slack(window):
    strict = EvictionPolicy.strict(window)
    greedy = EvictionPolicy.greedy(window, window)
    for t in range(40):
        assert strict.resident(t) == greedy.resident(t) == strict.attended(t)
        assert strict.resident_length(t) == min(t, window)


def test_window_counts_the_new_token():
    # W is the number of keys attended including the new token (the W versus W+1 trap).
    pol = EvictionPolicy.strict(4)
    assert positions(pol.attended(10)) == [6, 7, 8, 9]
    assert len(positions(pol.attended(10))) == 4


def test_sink_keeps_sinks_and_window():
    pol = EvictionPolicy.sink(window=3, sinks=2)
    assert pol.capacity == 5
    assert positions(pol.resident(4)) == [0, 1, 2, 3]
    assert positions(pol.resident(5)) == [0, 1, 2, 3, 4]
    assert positions(pol.resident(9)) == [0, 1, 6, 7, 8]
    assert positions(pol.attended(9)) == positions(pol.resident(9))
    assert pol.resident_length(100) == 5


def test_none_keeps_everything_until_full():
    pol = EvictionPolicy.none(5)
    assert positions(pol.resident(5)) == [0, 1, 2, 3, 4]
    assert pol.has_room(4) and not pol.has_room(5)
    with pytest.raises(ValueError):
        pol.resident_length(6)


@pytest.mark.parametrize(
    "kind,kwargs,t,reach",
    [
        ("none", dict(capacity=10), 7, 7),
        ("strict", dict(window=4), 3, 3),
        ("strict", dict(window=4), 9, 0),
        ("greedy", dict(window=4, capacity=6), 9, 2),  # resident 3..8: back to T=7 keeps 3..6
        ("greedy", dict(window=4, capacity=6), 7, 0),
        ("sink", dict(window=3, sinks=2), 4, 4),
        ("sink", dict(window=3, sinks=2), 9, 0),
    ],
)
def test_rollback_reach(kind, kwargs, t, reach):
    pol = EvictionPolicy.create(kind, **kwargs)
    assert pol.rollback_reach(t) == reach
    for k in range(reach + 1):
        assert pol.resident_length(t - k) == pol.resident_length(t) - k


def _reach_by_definition(pol: EvictionPolicy, t: int) -> int:
    """The largest k with L(t - j) == L(t) - j for every j <= k, found by walking back."""
    lt, k = pol.resident_length(t), 0
    while k < min(t, lt) and pol.resident_length(t - k - 1) == lt - k - 1:
        k += 1
    return k


def test_rollback_reach_matches_its_definition_on_a_grid():
    policies = [EvictionPolicy.none(c) for c in range(1, 9)]
    policies += [EvictionPolicy.strict(w) for w in range(1, 9)]
    policies += [EvictionPolicy.greedy(w, c) for c in range(1, 12) for w in range(1, c + 1)]
    policies += [EvictionPolicy.sink(w, s) for w in range(1, 7) for s in range(0, 4)]
    for pol in policies:
        top = pol.capacity if pol.kind is PolicyKind.NONE else 60
        for t in range(top + 1):
            assert pol.rollback_reach(t) == _reach_by_definition(pol, t), (pol, t)


def test_rollback_reach_is_arithmetic_not_a_walk(monkeypatch):
    """#17 item 8: one rollback after 10^6 tokens walked back token by token (1.1-1.6 s on the
    event loop). It now evaluates L(T) a bounded number of times, whatever T."""
    t = 10**6
    # none keeps all it has seen: every token can go; this greedy evicted on the last step
    cases = [(EvictionPolicy.none(t), t), (EvictionPolicy.greedy(4096, t - 1), None)]
    for pol, expected in cases:
        if expected is None:
            expected = _reach_by_definition(pol, t)
        calls = []
        original = EvictionPolicy.resident_length
        monkeypatch.setattr(
            EvictionPolicy,
            "resident_length",
            lambda self, t, calls=calls, original=original: calls.append(t) or original(self, t),
        )
        assert pol.rollback_reach(t) == expected
        monkeypatch.undo()
        assert len(calls) <= 2, f"{pol.kind.value}: L(T) evaluated {len(calls)} times"


def test_evicted_by_step():
    pol = EvictionPolicy.greedy(window=4, capacity=6)
    assert [pol.evicted_by_step(t) for t in range(5, 10)] == [0, 3, 0, 0, 3]


@pytest.mark.parametrize(
    "kind,kwargs",
    [
        ("strict", dict(window=0)),
        ("greedy", dict(window=5, capacity=3)),
        ("none", dict(capacity=0)),
        ("sink", dict(window=2, sinks=-1)),
        ("bogus", dict(window=2)),
    ],
)
def test_bad_configurations(kind, kwargs):
    with pytest.raises(PolicyError):
        EvictionPolicy.create(kind, **kwargs)


def test_kinds_are_the_four_of_the_spec():
    assert [k.value for k in PolicyKind] == ["none", "strict", "greedy", "sink"]
