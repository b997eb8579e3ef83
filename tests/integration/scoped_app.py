"""An application with operator scopes and incident readers, for `--app` in CLI tests: opA
acts on acme, opB on globex, and only ``reader`` (acme) reads protected diagnostics."""

from __future__ import annotations

from orchestrator import Orchestrator

SCOPES = {"opA": ["acme"], "opB": ["globex"], "reader": ["acme"]}
READERS = ["reader"]

app = Orchestrator(operator_scopes=SCOPES, incident_readers=READERS)
