# gqa-serve: every entry point sets up what it needs on a fresh machine.
#   make run    - install, then start the service on the CPU backend at 127.0.0.1:50051
#   make test   - install, then run the test suite (GPU tests skipped where no GPU)
#   make soak   - install, then the load test for longer (GQA_SOAK_STEPS, GQA_SOAK_STREAMS)
#   make bench  - install, then run the benchmarks (writes bench-results/*.json)
#   make gpu-check - on a machine with a CUDA GPU: the gpu tests, then the CUDA kernel benchmark

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS ?= dev,bench,triton
ADDRESS ?= 127.0.0.1:50051

.PHONY: install tools run test soak bench proto gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	@# the int8 backend's C kernel; without a C compiler int8 streams use torch's slower kernels
	$(BIN)/python -m backends.native build || echo "gqa-serve: the int8 kernel did not build (above); int8 streams will use the torch kernels"
	touch $@

install: $(STAMP)

# External tools the tests drive (promtool, prometheus, helm, hadolint, node packages...).
tools: install
	@for script in tests/tools/install_*.sh; do \
		[ -e "$$script" ] || continue; \
		echo "tools: $$script"; bash "$$script" || exit 1; \
	done

run: install
	@echo "gqa-serve: starting on $(ADDRESS) (CPU backend); try: $(BIN)/gqa-serve demo --address $(ADDRESS)"
	$(BIN)/gqa-serve serve --backend cpu --address $(ADDRESS)

test: install tools
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(BIN)/python -m pytest -m "not gpu"

# The load test, longer: 256 streams x 3000 steps (GQA_SOAK_STREAMS / GQA_SOAK_STEPS to change).
soak: install
	GQA_SOAK_STREAMS=$${GQA_SOAK_STREAMS:-256} GQA_SOAK_STEPS=$${GQA_SOAK_STEPS:-3000} \
		$(BIN)/python -m pytest tests/test_load.py -s -q

bench: install
	$(BIN)/python -m tests.bench

proto: install
	$(BIN)/python proto/generate.py service/api

gpu-check: install
	bash tests/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache bench-results
