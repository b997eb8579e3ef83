# The one task entry point. On a fresh clone `make test` is all it takes: it creates .venv,
# installs the package with its dev extra, then runs the linters, the type checker and the
# tests (against 127.0.0.1:5432 if a server answers there, else an embedded PostgreSQL).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when pyproject.toml changes (or the venv is new).
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=

.PHONY: test lint typecheck pytest demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check orchestrator workers tests

typecheck: $(STAMP)
	$(BIN)/mypy --strict orchestrator

pytest: $(STAMP)
	$(BIN)/pytest -p no:cacheprovider $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/orchestrator demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@
