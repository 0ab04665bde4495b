"""Runs the benchmarks, then draws their plots: ``python -m tests.bench [name ...]``.

Each module prints its tables on stdout and writes its raw records to bench-results/NAME.json
(``GQA_BENCH_DIR`` to change); then PNG plots are drawn from those records under the same
folder: latency against S per implementation (cpu.json), service throughput against streams
(service.json) and a model's per-token latency against its context, served and local
(model.json). A plot whose records lack the fields it needs is skipped with a message. Two or
more benchmarks run one after another, each in a fresh process, so none inherits another's state.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import pathlib
import subprocess
import sys
import time

from . import common
from .common import RESULTS_DIR, Report

HERE = pathlib.Path(__file__).parent


def available() -> dict[str, str]:
    """Benchmark names and the first line of each module's docstring (read without importing)."""
    names = {}
    for path in sorted(HERE.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        names[path.stem.removeprefix("bench_")] = doc.strip().splitlines()[0] if doc.strip() else ""
    return names


def build_parser(names: dict[str, str]) -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {line}" for name, line in names.items())
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[1].replace("``", ""),
        epilog=f"benchmarks (default: all, in this order):\n{listing}\n\n"
        "`make bench` installs the bench extras (ONNX Runtime for the cpu comparison; rich for "
        "the progress display, matplotlib for the plots) and runs them all.",
    )
    parser.add_argument("names", nargs="*", metavar="name", help="benchmarks to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    # set by the parent that runs each benchmark in its own process: "i/n" for the progress line
    parser.add_argument("--position", help=argparse.SUPPRESS)
    parser.add_argument(
        "--plots-only",
        action="store_true",
        help="draw the plots from the JSON already in the results folder; run nothing",
    )
    return parser


class _Progress:
    """A spinner on stderr naming the running benchmark, its elapsed time and the latest
    ``common.status`` text; plain start lines where stderr is not a terminal or rich is absent."""

    def __init__(self):
        self._live = None
        try:
            import rich  # noqa: F401
        except ImportError:
            self._rich = False
        else:
            self._rich = sys.stderr.isatty()

    def start(self, position: str, name: str) -> None:
        self.prefix = f"bench {position}: {name}"
        self.t0 = time.perf_counter()
        if not self._rich:
            print(f"[{self.prefix} ...]", file=sys.stderr, flush=True)
            common.set_status_hook(None)
            return
        from rich.console import Console

        self._live = Console(stderr=True).status(self.prefix)
        self._live.start()
        common.set_status_hook(self._update)

    def _update(self, text: str) -> None:
        if self._live is not None:
            self._live.update(f"{self.prefix} ({time.perf_counter() - self.t0:.0f} s): {text}")

    def stop(self) -> None:
        common.set_status_hook(None)
        if self._live is not None:
            self._live.stop()
            self._live = None


def main(argv: list[str]) -> int:
    names = available()
    args = build_parser(names).parse_args(argv)
    if args.list:
        for name, line in names.items():
            print(f"{name:<10} {line}")
        return 0
    unknown = [n for n in args.names if n not in names]
    if unknown:
        print(
            f"python -m tests.bench: error: unknown benchmark {', '.join(unknown)} (known: {', '.join(names)})",
            file=sys.stderr,
        )
        return 2
    selected = args.names or list(names)
    if not args.plots_only:
        if len(selected) > 1:
            failed = run_each_in_its_own_process(selected)
            if failed:
                return failed
        else:
            run_here(selected[0], args.position or "1/1")
    if not args.no_plots:
        draw_plots(RESULTS_DIR)
    return 0


def run_here(name: str, position: str) -> None:
    """Runs benchmark ``name`` in this process: its tables on stdout, its records written."""
    module = importlib.import_module(f"tests.bench.bench_{name}")
    report = Report(name)
    print(f"\n=== {name} ===", flush=True)
    t0 = time.perf_counter()
    steal = common.HostSteal()
    progress = _Progress()
    progress.start(position, name)
    try:
        module.run(report)
    finally:
        progress.stop()
    stolen = steal.share()
    report.add(kind="host", steal_share=stolen)
    path = report.write()
    print(f"[{name}: {time.perf_counter() - t0:.0f} s{common.steal_note(stolen)}, raw numbers in {path}]", flush=True)


def run_each_in_its_own_process(selected: list[str]) -> int:
    """Runs each benchmark in a fresh interpreter, one after another: what one leaves behind
    (the allocator's thresholds after freeing large buffers, thread pools, libraries loaded,
    torch's thread settings) then cannot tilt the next one's figures. The first failure's exit
    status, or 0."""
    for i, name in enumerate(selected, start=1):
        argv = [sys.executable, "-m", "tests.bench", "--no-plots", f"--position={i}/{len(selected)}", name]
        code = subprocess.run(argv, check=False).returncode
        if code:
            print(f"python -m tests.bench: {name} failed (exit status {code})", file=sys.stderr)
            return code
    return 0


# -- plots ---------------------------------------------------------------------------------------
def _records(path: pathlib.Path) -> list[dict] | None:
    if not path.exists():
        return None
    try:
        return list(json.loads(path.read_text()).get("records", []))
    except (ValueError, AttributeError):
        return None


def _number(value) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def _spread_keys(key: str) -> tuple[str, str]:
    stem = key[: -len("_s")]
    return f"{stem}_p10_s", f"{stem}_p90_s"


def latency_series(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float, float | None, float | None]]]]:
    """From cpu.json: per dtype, per implementation, (S, seconds, p10, p90) of the step records
    (``S`` and ``<impl>_s`` fields: a median with ``<impl>_p10_s`` / ``<impl>_p90_s`` when
    present, or the list of per-round seconds, whose median and p10-p90 are taken)."""
    series: dict = {}
    for record in records:
        if record.get("kind", "step") != "step" or _number(record.get("S")) is None:
            continue
        for key, value in record.items():
            if not key.endswith("_s") or key.endswith(("_p10_s", "_p90_s")):
                continue
            if isinstance(value, list) and value and all(_number(v) is not None for v in value):
                value, lo, hi = common.spread(value)
            elif _number(value) is None:
                continue
            else:
                lo, hi = (_number(record.get(k)) for k in _spread_keys(key))
            impl = key[: -len("_s")]
            series.setdefault(str(record.get("dtype", "")), {}).setdefault(impl, []).append(
                (record["S"], value, lo, hi)
            )
    return series


def throughput_series(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """From service.json: per (server, S), (streams, steps/s)."""
    series: dict = {}
    for record in records:
        streams, rate = _number(record.get("streams")), _number(record.get("steps_per_s"))
        if streams is None or rate is None:
            continue
        label = " ".join(str(x) for x in (record.get("server"), f"S={record['S']}" if "S" in record else None) if x)
        series.setdefault(label or "service", []).append((streams, rate))
    return series


def model_series(records: list[dict]) -> dict[str, list[tuple[float, float, float, float]]]:
    """From model.json: per "served B=1", "local B=8"..., (S, median, p10, p90) seconds per token."""
    series: dict = {}
    for record in records:
        if _number(record.get("S")) is None:
            continue
        for mode in ("served", "local"):
            values = record.get(f"{mode}_s")
            if isinstance(values, list) and values and all(_number(v) is not None for v in values):
                m, lo, hi = common.spread(values)
                series.setdefault(f"{mode} B={record.get('batch', 1)}", []).append((record["S"], m, lo, hi))
    return series


def draw_plots(folder: pathlib.Path) -> list[pathlib.Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib is not installed (pip install -e '.[bench]'); no plots", file=sys.stderr)
        return []
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        written.append(folder / name)

    cpu = _records(folder / "cpu.json")
    series = latency_series(cpu) if cpu is not None else {}
    if not series:
        print(
            f"plots: {folder / 'cpu.json'} {'is missing' if cpu is None else 'has no S and *_s step records'}; "
            "no latency plot",
            file=sys.stderr,
        )
    else:
        fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4.2), squeeze=False)
        every = sorted({impl for impls in series.values() for impl in impls})
        colors = {impl: f"C{i % 10}" for i, impl in enumerate(every)}  # one colour per implementation
        for ax, (dtype, impls) in zip(axes[0], sorted(series.items())):
            for impl, points in sorted(impls.items()):
                points.sort()
                xs, ys = [p[0] for p in points], [p[1] * 1e3 for p in points]
                (line,) = ax.plot(xs, ys, marker="o", label=impl, color=colors[impl])
                if all(p[2] is not None and p[3] is not None for p in points):
                    ax.fill_between(
                        xs,
                        [p[2] * 1e3 for p in points],
                        [p[3] * 1e3 for p in points],
                        color=line.get_color(),
                        alpha=0.2,
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("S (cached positions)")
            ax.set_ylabel("ms per step (median)")
            ax.set_title(f"decode step, {dtype or 'all dtypes'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        save(fig, "cpu_latency.png")

    service = _records(folder / "service.json")
    rates = throughput_series(service) if service is not None else {}
    if not rates:
        print(
            f"plots: {folder / 'service.json'} "
            f"{'is missing' if service is None else 'has no streams and steps_per_s records'}; no throughput plot",
            file=sys.stderr,
        )
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, points in sorted(rates.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("steps/s")
        ax.set_ylim(bottom=0)
        ax.set_title("service throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        save(fig, "service_throughput.png")
    model = _records(folder / "model.json")
    tokens = model_series(model) if model is not None else {}
    if tokens:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, points in sorted(tokens.items()):
            points.sort()
            xs = [p[0] for p in points]
            (line,) = ax.plot(xs, [p[1] * 1e3 for p in points], marker="o", label=label)
            ax.fill_between(
                xs, [p[2] * 1e3 for p in points], [p[3] * 1e3 for p in points], color=line.get_color(), alpha=0.2
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (cached positions per sequence)")
        ax.set_ylabel("ms per token (median)")
        ax.set_title("Llama, 2 layers of Hq=32 Hkv=8 D=128: attention on gqa-serve vs sdpa")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        save(fig, "model_latency.png")
    elif model is not None:
        print(f"plots: {folder / 'model.json'} has no S and served_s/local_s records; no model plot", file=sys.stderr)
    for path in written:
        print(f"[plot: {path}]")
    return written


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
