# The two commands in README.md: `make example` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Bytecode is written as modules are first imported, by whichever process imports them
# first, even where PYTHONDONTWRITEBYTECODE is set (without it every Ray worker and test
# subprocess compiled torch, transformers and ray_disagg again: ~2 s of CPU each); pip's
# own compile step (every installed file, ~22,000, one by one) is skipped: a run imports
# about a fifth of them.
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

install: $(BIN)/python
	$(BIN)/pip install -q --no-compile -e ".[test]"

example: install
	$(WRITE_BYTECODE) $(BIN)/python examples/train_tiny_vlm.py

# Two pytest-xdist workers, each with its own local Ray cluster, whole files per worker
# (module fixtures built once), handed out in the order tests/conftest.py collects them
# (Ray files alternating with gloo files, unit files last; not xdist's reorder by test
# count, which left every Ray file for the end). The tiers and their time budgets:
# tests/README.md; the 30 slowest tests and each tier's time against its budget are
# listed last.
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(WRITE_BYTECODE) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

.PHONY: install example test
