# The README's two commands: `make demo` (a local elastic run on an embedded etcd)
# and `make test` (lint + the whole test suite). Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/elastic: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/elastic
	$(BIN)/elastic demo

lint: $(BIN)/elastic
	$(BIN)/ruff check elastic agents tests bench

test: lint
	$(BIN)/python -m pytest

bench: $(BIN)/elastic
	$(BIN)/python bench/rendezvous.py

clean:
	rm -rf $(VENV) runs .pytest_cache
