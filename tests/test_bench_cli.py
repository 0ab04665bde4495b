"""``python -m tests.bench`` as a user meets it: --help, a bad name, and the plots it draws from
the modules' JSON records (synthetic records here: the benchmarks themselves take minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENTRY = [sys.executable, "-m", "tests.bench"]


def bench(*args, results=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"GQA_BENCH_DIR": str(results)} if results else {}))
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=120, env=env)


def test_help_lists_the_benchmarks():
    done = bench("--help")
    assert done.returncode == 0, done.stderr
    for name in ("cpu", "int8", "service", "--plots-only", "--no-plots"):
        assert name in done.stdout


def test_unknown_benchmark_is_one_line():
    done = bench("nope")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "cpu" in lines[0]


def write(folder, name, records):
    (folder / f"{name}.json").write_text(json.dumps({"meta": {}, "records": records}))


def test_plots_from_the_records(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra draws the plots")
    from PIL import Image

    cpu = []
    for dtype in ("float32", "bfloat16"):
        for s in (512, 2048, 8192):
            record = {
                "kind": "step",
                "dtype": dtype,
                "S": s,
                "kv_bytes": s * 8192,
                "ours_s": s * 1e-8,
                "naive_s": s * 2e-7,
                "sdpa_s": s * 3e-8,
                "ort_s": None,
                "floor_s": s * 7e-9,
            }
            record.update(ours_p10_s=s * 0.9e-8, ours_p90_s=s * 1.2e-8)
            cpu.append(record)
    cpu.append({"kind": "consecutive", "dtype": "float32", "steps": 64, "ours_s": 0.1, "naive_s": 1.0})
    write(tmp_path, "cpu", cpu)
    write(
        tmp_path,
        "service",
        [
            {"server": kind, "S": 1024, "streams": c, "steps_per_s": 1000.0 * c**0.5}
            for kind in ("echo", "service")
            for c in (1, 4, 16)
        ]
        + [{"S": 1024, "in_process_step_us_all_cores": 9.0}],
    )
    done = bench("--plots-only", results=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("cpu_latency.png", "service_throughput.png"):
        assert name in done.stdout
        with Image.open(tmp_path / name) as image:
            image.load()
            assert image.format == "PNG"


def test_a_plot_without_its_fields_is_skipped_with_a_message(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra draws the plots")
    write(tmp_path, "cpu", [{"something": "else"}])
    done = bench("--plots-only", results=tmp_path)
    assert done.returncode == 0
    assert "no latency plot" in done.stderr and "service.json is missing" in done.stderr.replace(
        str(tmp_path) + "/", ""
    )
    assert not list(tmp_path.glob("*.png"))


def test_latency_series_reads_per_round_samples_as_the_cpu_benchmark_writes_them():
    from tests.bench.__main__ import latency_series

    rounds = [0.004, 0.001, 0.002, 0.003, 0.005]
    record = {"kind": "step", "dtype": "float32", "S": 2048, "kv_bytes": 1, "cold": True, "ours_s": rounds, "ort_s": []}
    series = latency_series([record])
    (point,) = series["float32"]["ours"]
    s, median, lo, hi = point
    assert (s, median) == (2048, 0.003) and lo <= median <= hi
    assert "ort" not in series["float32"]  # no samples, no point


def test_two_benchmarks_run_each_in_a_fresh_process_and_a_failure_stops_the_run(monkeypatch):
    from tests.bench import __main__ as cli

    started = []

    def run(argv, check):
        started.append(argv)
        return subprocess.CompletedProcess(argv, 3 if argv[-1] == "metrics" else 0)

    monkeypatch.setattr(cli.subprocess, "run", run)
    assert cli.main(["--no-plots", "client", "metrics", "model"]) == 3
    assert started == [
        [sys.executable, "-m", "tests.bench", "--no-plots", "--position=1/3", "client"],
        [sys.executable, "-m", "tests.bench", "--no-plots", "--position=2/3", "metrics"],
    ]


def test_the_host_steal_share_is_the_steal_column_over_all_cpu_time(tmp_path):
    from tests.bench.common import HostSteal, steal_note

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 50 0 25 400 5 0 2 18 0 0\n")
    steal = HostSteal(str(stat))
    stat.write_text("cpu  160 0 70 900 10 0 5 65 0 0\ncpu0 80 0 35 450 5 0 2 33 0 0\n")
    share = steal.share()
    assert share == 30 / 210  # 30 jiffies stolen of 210 since the first read
    assert steal_note(share) == ", 14% of the CPU time stolen by the host"
    stat.write_text("intr 0\n")  # a kernel without the line: unknown, and the note says nothing
    assert HostSteal(str(stat)).share() is None and steal_note(None) == ""
    assert HostSteal(str(tmp_path / "absent")).share() is None
