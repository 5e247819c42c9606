# Set-up and checks. `make demo` and `make test` work on a fresh machine (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test-deps test test-slow test-all lint bench

$(STAMP): pyproject.toml
	# Mooncake's libraries (PD disaggregation): installs them as root, else says what to run
	scripts/install_system_deps.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch that lies on disk; an unpinned torch would pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	BIN=$(BIN) scripts/demo.sh

# the test set-up: the aarch64 cross tools the ARM kernel tests use (as root; else they skip)
test-deps:
	scripts/install_test_deps.sh

test: setup test-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: setup test-deps
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-all: setup test-deps
	$(BIN)/python -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check moeserve tests benchmarks
	$(BIN)/ruff format --check moeserve tests benchmarks

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py
