"""An application that accepts records larger than the default cap, with operator scopes, for
`--app` in CLI tests: ``opA`` acts on acme only."""

from __future__ import annotations

from orchestrator import Orchestrator

MAX_RECORD_BYTES = 4 * 1024 * 1024

app = Orchestrator(max_record_bytes=MAX_RECORD_BYTES, operator_scopes={"opA": ["acme"]})
