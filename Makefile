# The two commands in README.md: `make example` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"

example: install
	$(BIN)/python examples/train_tiny_vlm.py

# Two pytest-xdist workers, each with its own local Ray cluster, whole files per worker
# (module fixtures built once): the suite mostly waits on Ray start-up, polls and teardown,
# so two processes overlap their waits on 2 cores. The 15 slowest tests are listed last.
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

.PHONY: install example test
