# gqa-serve: every entry point sets up what it needs on a fresh machine.
#   make run    - install what serving needs and the loadgen extra (the progress bar and plots of
#                 `gqa-serve bench`, which the README runs next), then start the service on the
#                 CPU backend at 127.0.0.1:50051
#   make lint   - install the test extras, then ruff: the lint rules and the format check
#                 (pyproject.toml [tool.ruff]); `ruff format . && ruff check --fix .` fixes most
#   make test   - install the test extras and tools, then the lint, then the test suite (GPU
#                 tests skipped where no GPU)
#   make soak   - install, then the load test for longer (GQA_SOAK_STEPS, GQA_SOAK_STREAMS)
#   make bench  - install the bench extras, then run the benchmarks (bench-results/*.json, *.png)
#   make gpu-check - on a machine with a CUDA GPU: the gpu tests, then the CUDA kernel benchmark
#
# Installs are layered, one stamp each: serving (the package with the loadgen extra, and the Python
# client it needs for `demo` and `bench`, clients/python; plus triton where an NVIDIA GPU is visible),
# then the test or bench extras on top. TORCH_INDEX_URL=... installs torch from
# that index first (off this project's machines, PyTorch's CPU wheel index keeps pip from
# pulling the multi-GB CUDA build; see README "Install").

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
ADDRESS ?= 127.0.0.1:50051
TORCH_INDEX_URL ?=
# The load generator's progress bar and plots (`gqa-serve bench --plot`), everywhere; the cuda
# backend's Triton kernels, only where a GPU can use them.
RUN_EXTRAS := loadgen$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,triton)
# setuptools prints a 10-line "Editable installation." notice on every editable install (an
# InformationOnly warning, nothing to fix); every other warning of the build still shows.
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: install install-test install-bench tools run lint test soak bench proto gpu-check clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	touch $@

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml | $(VENV)/.created
	@if [ -n "$(TORCH_INDEX_URL)" ]; then echo "torch from $(TORCH_INDEX_URL)"; $(PIP) --index-url "$(TORCH_INDEX_URL)" "torch==2.13.0"; fi
	@# The Python client is a distribution of its own (clients/python, gqa-serve-client), which the
	@# server's demo and bench commands require: one pip call installs both, the client from here.
	$(PIP) -e clients/python -e '.[$(RUN_EXTRAS)]'
	@# the compiled decode kernels; without a C compiler every backend uses torch's slower kernels
	$(BIN)/python -m backends.native build || echo "gqa-serve: the decode kernels did not build (above); every backend will use the torch kernels"
	touch $@

# Tests also run the Triton kernels through its CPU interpreter (the triton extra) and every
# benchmark module in a smoke mode beside ONNX Runtime (the bench extra).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test,triton,bench]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) -e '.[bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-bench: $(VENV)/.installed-bench

# External tools the tests drive (promtool, prometheus, helm, hadolint, node packages, go...).
tools: install-test
	@for script in tests/tools/install_*.sh; do \
		[ -e "$$script" ] || continue; \
		echo "tools: $$script"; bash "$$script" || exit 1; \
	done

run: install
	@echo "gqa-serve: starting on $(ADDRESS) (CPU backend); try: $(BIN)/gqa-serve demo --address $(ADDRESS)"
	$(BIN)/gqa-serve serve --backend cpu --address $(ADDRESS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install-test tools lint
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(BIN)/python -m pytest -m "not gpu"

# The load test, longer: 256 streams x 3000 steps (GQA_SOAK_STREAMS / GQA_SOAK_STEPS to change).
soak: install-test
	GQA_SOAK_STREAMS=$${GQA_SOAK_STREAMS:-256} GQA_SOAK_STEPS=$${GQA_SOAK_STEPS:-3000} \
		$(BIN)/python -m pytest tests/test_load.py -s -q

bench: install-bench
	$(BIN)/python -m tests.bench

proto: install-test
	$(BIN)/python proto/generate.py

gpu-check: install-test
	bash tests/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache bench-results
