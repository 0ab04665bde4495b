"""The CPU benchmarks run in `make bench` only; a typo in one must not wait for that run. Each
module runs here at tiny sizes (GQA_BENCH_MODE=smoke: timings meaningless, never asserted) and
must print its tables and PASS/FAIL lines and record its raw numbers."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.bench.common import Report


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu", "int8", "step_many", "client", "model"])
def test_bench_module_runs_in_smoke_mode(name, monkeypatch, capsys):
    if name == "model":
        pytest.importorskip("transformers", reason="the 'bench' extra (transformers) is not installed")
    if name == "cpu":
        pytest.importorskip("onnxruntime", reason="the 'bench' extra (ONNX Runtime) is not installed")
        pytest.importorskip("onnx", reason="the 'bench' extra (onnx) is not installed")
    monkeypatch.setenv("GQA_BENCH_MODE", "smoke")
    module = importlib.import_module(f"tests.bench.bench_{name}")
    report = Report(name)
    module.run(report)
    out = capsys.readouterr().out
    assert re.search(r"^legend: ", out, re.M), out
    assert re.search(r"^(PASS|FAIL)  ", out, re.M), out
    assert report.records


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_step_rate_probe_measures_each_dtype(dtype, monkeypatch):
    """tests/bench/step_rate.py (a probe for docs/design.md, not in `make bench`): one line per
    dtype with hot and cold medians and their read rates, every figure positive."""
    import torch

    from tests.bench import step_rate
    from tests.bench.common import Evictor

    monkeypatch.setattr(step_rate, "HOT", 3)
    monkeypatch.setattr(step_rate, "COLD", 3)
    line = step_rate.measure(getattr(torch, dtype), 70, "auto", Evictor(nbytes=1 << 20))
    m = re.fullmatch(
        rf"{dtype} +S=70 (\S+): hot ([0-9.]+) ms \(([0-9.]+) GB/s\), cold ([0-9.]+) ms \(([0-9.]+) GB/s\); "
        r"cold deciles ms( [0-9.]+){9}",
        line,
    )
    assert m, line
    assert all(float(x) > 0 for x in m.group(2, 3, 4, 5)), line


def test_the_hot_step_leaves_the_cache_as_it_was_and_its_note_reads_against_the_target():
    """The note under a failed step/floor line (bench_cpu's, bench_int8's): the hot step (stepped
    and rolled back) leaves the cache's length as it was; past the target the note says no cold
    step can meet it, within it how much of the floor's reads the arithmetic must hide."""
    import torch

    from backends.contract import CacheSpec
    from backends.policy import EvictionPolicy
    from backends.registry import get_backend
    from tests.bench.common import arithmetic_note, hot_seconds

    gen = torch.Generator().manual_seed(0)
    cache = get_backend("int8").create_cache(CacheSpec(1, 4, 2, 16, torch.float32, EvictionPolicy.none(64)))
    cache.prefill(torch.randn(1, 2, 40, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen))
    q, k, v = (
        torch.randn(1, 4, 16, generator=gen),
        torch.randn(1, 2, 16, generator=gen),
        torch.randn(1, 2, 16, generator=gen),
    )
    assert hot_seconds(cache, q, k, v, calls=3, warmup=1) > 0
    assert cache.tokens_seen == 40
    (line,) = arithmetic_note(1.6e-3, [1e-3, 2e-3, 0.9e-3], 1.5)
    assert "1.6x the floor" in line and "past 1.5x" in line
    # within the target: the share of the floor's reads the arithmetic must hide
    (line,) = arithmetic_note(0.95e-3, [1e-3, 2e-3, 0.9e-3], 1.25)
    assert "0.95x the floor" in line and "70% of the floor's reads hidden" in line
    (line,) = arithmetic_note(0.2e-3, [1e-3, 2e-3, 0.9e-3], 1.25)
    assert "0% of the floor's reads hidden" in line
    # a longer step's note from a shorter one's hot rate says whose rate it is
    (line,) = arithmetic_note(1.6e-3, [1e-3, 2e-3, 0.9e-3], 1.5, rate_of=2048)
    assert line.strip().startswith("at S=2048's hot rate") and "past 1.5x" in line
    # HotNotes: a step that fits in L3 timed hot and its rate kept; a longer one's note from it
    from tests.bench.common import HotNotes, llc_bytes

    notes = HotNotes(calls=3)
    assert notes.time(2048, 1 << 20, lambda calls: 1e-3 * calls / 3) == 1e-3
    assert notes.rate == (2048, (1 << 20) / 1e-3)
    assert notes.time(8192, 4 * llc_bytes(), lambda calls: 1 / 0) is None  # too long: not timed
    assert notes.under("PASS  x", 1 << 20, 1e-3, [1e-3], 1.5) == []
    (own,) = notes.under("FAIL  x", 1 << 20, 1.6e-3, [1e-3], 1.5)
    assert own.strip().startswith("hot (the cache in L3") and "1.6x the floor" in own
    (scaled,) = notes.under("FAIL  x", 2 << 20, None, [1e-3], 1.5)
    assert scaled.strip().startswith("at S=2048's hot rate") and "2x the floor" in scaled
    assert HotNotes(calls=3).under("FAIL  x", 1 << 20, None, [1e-3], 1.5) == []


def test_torch_threads_are_woken_until_a_wake_op_runs_at_full_speed():
    """`wake_torch_threads` repeats its op while it takes a slow time (a worker queued behind the
    caller), returns at the first fast one, and gives up after its last try."""
    from tests.bench import common

    def clocked(durations):
        """An op and a clock: each op call advances the clock by the next duration."""
        now, calls = [0.0], []

        def op():
            now[0] += durations[len(calls)]
            calls.append(1)

        return op, (lambda: now[0]), calls

    slow, fast = 10 * common._TORCH_WAKE_SLOW_S, common._TORCH_WAKE_SLOW_S / 10
    op, clock, calls = clocked([slow, slow, fast, fast])
    assert common.wake_torch_threads(op, clock) == 3
    assert len(calls) == 3
    op, clock, calls = clocked([fast])
    assert common.wake_torch_threads(op, clock) == 1
    op, clock, calls = clocked([slow] * (common._TORCH_WAKE_TRIES + 2))
    assert common.wake_torch_threads(op, clock) == common._TORCH_WAKE_TRIES
    assert len(calls) == common._TORCH_WAKE_TRIES


def test_stamp_profile_parts_from_stamps():
    """`stamp_profile.parts`: a step's parts from its stamps, in us (two threads, the worker
    joining 5 us into the items and ending 3 us before the caller)."""
    from tests.bench import stamp_profile as sp

    us = 1000
    stamps = [
        (0, 0, -1, -1, sp.STEP),
        (2 * us, 0, -1, -1, sp.WRITES),
        (3 * us, 0, -1, -1, sp.ITEMS),
        (3 * us, 0, 0, -1, sp.ITEM),
        (4 * us, 0, 0, 0, sp.BLOCK),
        (6 * us, 0, 0, 1, sp.BLOCK),
        (7 * us, 0, 0, -1, sp.ITEM_END),
        (8 * us, 1, 1, -1, sp.ITEM),
        (8 * us, 1, 1, 0, sp.BLOCK),
        (12 * us, 1, 1, -1, sp.ITEM_END),
        (15 * us, 0, -1, -1, sp.ITEMS_END),
        (16 * us, 0, -1, -1, sp.STEP_END),
    ]
    got = sp.parts(stamps[::-1], wall_us=20.0)  # any order
    assert got["outside gqa_step"] == 4.0
    assert (got["plan"], got["row writes before the items"], got["items"]) == (2.0, 1.0, 12.0)
    assert got["thread 0: first item, after the items' start"] == 0.0
    assert got["thread 1: first item, after the items' start"] == 5.0
    assert got["thread 0: items"] == got["thread 1: items"] == 1
    assert got["thread 0: a block, first in its item"] == 2.0
    assert got["thread 0: a block, later in its item"] == 1.0
    assert got["thread 1: a block, first in its item"] == 4.0
    assert got["tail (one thread's end to the other's)"] == 5.0
    assert sp.parts(stamps[3:], wall_us=20.0) == {}  # a step that did not reach the kernel


@pytest.mark.slow
def test_stamp_profile_runs_on_its_own_build(tmp_path):
    """`python -m tests.bench.stamp_profile` builds the stamped library under its own name and
    prints every part, cold and hot; the library the tests load has no stamps."""
    import os
    import subprocess
    import sys

    from backends import native

    assert not native.load().stamps
    env = dict(os.environ)
    env.pop("GQA_KERNEL_STAMPS", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.stamp_profile", "--length", "600", "--steps", "3", "--gap", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for part in ("public step", "outside gqa_step", "plan", "items", "thread 0: items"):
        assert re.search(rf"^{re.escape(part)}\s+[0-9.]+\s+[0-9.]+$", done.stdout, re.M), (part, done.stdout)


def test_a_servers_cpu_time_counts_every_thread_of_its_process():
    """bench_service's CPU a step reads a process's CPU clock: here this process's own, against
    ``time.process_time``, over a busy loop on two threads, one of which has ended by then."""
    import os
    import threading
    import time

    from tests.bench.bench_service import process_cpu_seconds

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before, ours = process_cpu_seconds(os.getpid()), time.process_time()
    worker = threading.Thread(target=spin, args=(0.1,))
    worker.start()
    spin(0.1)
    worker.join()
    got, want = process_cpu_seconds(os.getpid()) - before, time.process_time() - ours
    assert want >= 0.2
    assert abs(got - want) < 0.02 + 0.05 * want, (got, want)


def test_the_separate_plane_note_says_how_near_its_floor_the_batched_call_must_run():
    """Under a failed separate/plane verdict, bench_step_many says what plane/floor would pass:
    separate/floor / 4, or that it would take a call faster than its floor; nothing on a pass."""
    from tests.bench.bench_step_many import _reach_note

    def times(plane, separate, floor):
        return {"plane": [plane] * 3, "separate": [separate] * 3, "floor": [floor] * 3}

    assert _reach_note(times(1.0, 5.0, 1.0)) == []  # 5x: passed
    (near,) = _reach_note(times(2.0, 4.4, 1.0))
    assert "4.4x the floor" in near and "plane/floor <= 1.10x (it is 2.00x)" in near, near
    (far,) = _reach_note(times(2.0, 3.0, 1.0))
    assert "faster than moving its bytes once" in far, far


@pytest.mark.slow
def test_the_service_ab_probe_compares_its_variants(tmp_path):
    """tests/bench/service_ab.py (a probe, not in `make bench`): a line per variant, every figure
    positive, the first variant's ratios 1; a file variant's file runs in its server; a variant
    that names nothing is refused before any server starts."""
    from tests.bench import service_ab

    marker = tmp_path / "ran"
    patch = tmp_path / "patch.py"
    patch.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    lines = service_ab.compare(["same", f"file:{patch}"], rounds=2, steps=10)
    assert len(lines) == 3 and lines[0].startswith("1 stream(s) at S=1, 2 rounds of 10 steps"), lines
    assert lines[1].startswith("same: ") and lines[1].count("(1 [1-1])") == 3, lines[1]
    number = r"([0-9.]+(?:e[+-]?[0-9]+)?)"
    m = re.fullmatch(
        rf"file:\S+: server CPU {number} us a step \(.+\), {number} steps/s \(.+\), p50 {number} us \(.+\)", lines[2]
    )
    assert m and all(float(x) > 0 for x in m.groups()), lines[2]
    assert marker.read_text() == "yes"
    with pytest.raises(SystemExit, match="is not same"):
        service_ab.compare([f"dir:{tmp_path / 'absent'}", "same"], rounds=1, steps=1)
