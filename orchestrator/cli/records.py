"""What ``--json`` prints: one JSON document per command, with the field names documented in
``docs/cli-json.md``. The records are built in :mod:`orchestrator.records`, which the console's
API shares; this module prints them."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from orchestrator.records import (
    audit_row,
    bulk_item,
    bulk_summary,
    error_record,
    ident,
    incident,
    iso,
    item_detail,
    journal_entry,
    lease_record,
    queue_item,
    run_detail,
    run_operation,
    run_summary,
    watch_entry,
    watch_outcome,
    worker_record,
)

__all__ = ["audit_row", "bulk_item", "bulk_summary", "emit", "error_record", "ident", "incident",
           "item_detail", "iso", "journal_entry", "lease_record", "queue_item", "run_detail",
           "run_operation", "run_summary", "watch_entry", "watch_outcome", "worker_record"]


def emit(document: Mapping[str, Any]) -> None:
    """Print one JSON document on stdout, indented (its layout is not promised: parse it)."""
    json.dump(document, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
