# The two commands in README.md: `make example` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)

# pip compiles the installed files one by one; compileall with -j 0 uses every core
# (torch/testing/_internal/py312_intrinsics.py is 3.12-only syntax: its error is expected,
# pip skips it the same way).
install: $(BIN)/python
	$(BIN)/pip install -q --no-compile -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

example: install
	$(BIN)/python examples/train_tiny_vlm.py

# Two pytest-xdist workers, each with its own local Ray cluster, whole files per worker
# (module fixtures built once), handed out in the order tests/conftest.py collects them
# (Ray files alternating with gloo files, unit files last; not xdist's reorder by test
# count, which left every Ray file for the end). The tiers and their time budgets:
# tests/README.md; the 30 slowest tests and each tier's time against its budget are
# listed last.
# Byte-compiling the package and the tests first spares every Ray worker and subprocess
# compiling them again (~1.7 s of CPU a process where PYTHONDONTWRITEBYTECODE is set).
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m compileall -q -j 0 ray_disagg tests examples benchmarks > /dev/null
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

.PHONY: install example test
