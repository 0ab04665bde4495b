#!/usr/bin/env bash
# The GPU check (`make gpu-check`, or `bash tests/gpu_check.sh` where nothing can be installed):
# the `gpu`-marked tests, then the CUDA kernel benchmark (tests/bench/gpu_bench.py), then where a
# step's time goes, device against host (tests/bench/gpu_overhead.py, reported only). Logs, the
# tests' JUnit XML and the benchmark's JSON go to $OUT if set, else to bench-results/.
# Python: $PYTHON if set, else the first of .venv/bin/python and python3 whose torch sees a GPU.
# Budget: the tests stop after GPU_TEST_TIMEOUT s (default 240), the benchmark after
# GPU_BENCH_TIMEOUT s (default 240), the overhead probe after GPU_OVERHEAD_TIMEOUT s (default 90),
# so the whole check ends inside 10 minutes.
set -u
cd "$(dirname "$0")/.."

py="${PYTHON:-}"
if [ -z "$py" ]; then
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      py="$candidate"
      break
    fi
  done
fi
if [ -z "$py" ]; then
  echo "gpu-check: no Python here has a torch that sees a CUDA device; nothing run"
  exit 2
fi

out="${OUT:-bench-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GQA_BENCH_DIR="$out"
unset TRITON_INTERPRET

"$py" - <<'PY' 2>&1 | tee "$out/gpu-env.txt"
import sys, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
p = torch.cuda.get_device_properties(0)
print(f"gpu-check: python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"triton {tv}, {p.name}, {p.multi_processor_count} SMs, {p.total_memory >> 30} GiB")
PY

start=$(date +%s)
# The files that hold gpu-marked tests (GPU_TESTS to name others): collecting only those, a GPU
# machine's image without the test extras (cryptography, playwright, ...) runs the check as well.
tests="${GPU_TESTS:-$(grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')}"
echo "== gpu tests ($tests) =="
timeout "${GPU_TEST_TIMEOUT:-240}" "$py" -m pytest -m gpu $tests \
  -q -p no:cacheprovider --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== gpu bench =="
timeout "${GPU_BENCH_TIMEOUT:-240}" "$py" -m tests.bench.gpu_bench 2>&1 | tee "$out/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== gpu overhead (device time against host time per call) =="
timeout "${GPU_OVERHEAD_TIMEOUT:-90}" "$py" -m tests.bench.gpu_overhead 2>&1 | tee "$out/gpu-overhead.log"

echo "gpu-check: tests exit $tests_rc, bench exit $bench_rc (1 = a target missed), $(( $(date +%s) - start )) s; files in $out"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
