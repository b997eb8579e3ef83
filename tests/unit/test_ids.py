"""Run ids are RFC 9562 version 7 UUIDs: time-ordered, so new runs stay on hot index pages."""

from __future__ import annotations

import time
import uuid

from orchestrator.ids import new_run_id


def test_run_ids_are_version_7_with_the_rfc_variant() -> None:
    rid = new_run_id()
    assert rid.version == 7
    assert rid.variant == uuid.RFC_4122


def test_run_ids_carry_their_creation_time_and_sort_by_it() -> None:
    before = time.time_ns() // 1_000_000
    first = new_run_id()
    time.sleep(0.003)
    second = new_run_id()
    after = time.time_ns() // 1_000_000
    assert before <= first.int >> 80 <= (second.int >> 80) <= after
    assert first < second  # a later millisecond sorts later (as PostgreSQL's uuid order does)


def test_run_ids_are_unique() -> None:
    ids = {new_run_id() for _ in range(20_000)}
    assert len(ids) == 20_000
