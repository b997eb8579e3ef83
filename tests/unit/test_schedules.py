"""Cron expressions in a time zone as instants, daylight-saving changes included, and the
checks a schedule's fields pass (orchestrator.schedules; docs/schedules.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orchestrator.errors import InvalidRequest
from orchestrator.models import validate_idempotency_key
from orchestrator.schedules import (
    Cron,
    check_catchup,
    check_overlap,
    check_schedule_id,
    slot_key,
)

BERLIN = "Europe/Berlin"


def at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def local(cron: Cron, instants: list[datetime]) -> list[str]:
    return [t.astimezone(cron.zone).strftime("%H:%M%z") for t in instants]


def test_a_fixed_time_in_the_spring_gap_fires_once_when_the_clocks_have_jumped() -> None:
    # 2026-03-29 in Berlin: 02:00 CET becomes 03:00 CEST (01:00 UTC); 02:30 never happens.
    cron = Cron("30 2 * * *", BERLIN)
    slots = cron.between(at(2026, 3, 28, 12), at(2026, 3, 30, 12))
    assert slots == [at(2026, 3, 29, 1, 0), at(2026, 3, 30, 0, 30)]
    assert local(cron, slots) == ["03:00+0200", "02:30+0200"]


def test_two_fixed_times_landing_on_one_instant_are_one_slot() -> None:
    cron = Cron("0 2,3 * * *", BERLIN)  # 02:00 does not exist; 03:00 is the jump's instant
    assert cron.between(at(2026, 3, 29, 0), at(2026, 3, 29, 3)) == [at(2026, 3, 29, 1, 0)]


def test_an_every_hour_expression_has_no_slot_in_the_spring_gap() -> None:
    cron = Cron("*/30 * * * *", BERLIN)
    slots = cron.between(at(2026, 3, 29, 0, 0), at(2026, 3, 29, 2, 0))
    assert local(cron, slots) == ["01:30+0100", "03:00+0200", "03:30+0200", "04:00+0200"]
    assert slots == sorted(slots) and len(set(slots)) == len(slots)


def test_a_fixed_time_in_the_autumn_repeat_fires_at_its_first_occurrence_only() -> None:
    # 2026-10-25 in Berlin: 03:00 CEST becomes 02:00 CET; 02:30 happens twice.
    cron = Cron("30 2 * * *", BERLIN)
    slots = cron.between(at(2026, 10, 24, 12), at(2026, 10, 26, 12))
    assert slots == [at(2026, 10, 25, 0, 30), at(2026, 10, 26, 1, 30)]


def test_an_every_hour_expression_fires_through_both_occurrences_of_the_repeat() -> None:
    cron = Cron("*/30 * * * *", BERLIN)
    slots = cron.between(at(2026, 10, 24, 23, 0), at(2026, 10, 25, 2, 30))
    assert local(cron, slots) == ["01:30+0200", "02:00+0200", "02:30+0200", "02:00+0100",
                                  "02:30+0100", "03:00+0100", "03:30+0100"]
    assert all(b - a == timedelta(minutes=30) for a, b in zip(slots, slots[1:], strict=False))


def test_new_york_changes_on_other_days_and_the_rules_are_the_same() -> None:
    cron = Cron("30 2 * * *", "America/New_York")  # 2026-03-08: 02:00 EST -> 03:00 EDT
    assert cron.between(at(2026, 3, 8, 0), at(2026, 3, 8, 12)) == [at(2026, 3, 8, 7, 0)]
    assert cron.after(at(2026, 3, 8, 7, 0)) == at(2026, 3, 9, 6, 30)


def test_seconds_come_first_in_a_six_field_expression() -> None:
    cron = Cron("*/20 * * * * *")
    assert cron.between(at(2026, 1, 1, 0, 0, 0), at(2026, 1, 1, 0, 1, 0)) == [
        at(2026, 1, 1, 0, 0, 20), at(2026, 1, 1, 0, 0, 40), at(2026, 1, 1, 0, 1, 0)]
    every = Cron("* * * * * *")
    assert len(every.between(at(2026, 1, 1), at(2026, 1, 1, 0, 1))) == 60
    assert every.after(at(2026, 1, 1, 0, 0, 0)) == at(2026, 1, 1, 0, 0, 1)
    assert every.before(datetime(2026, 1, 1, 0, 0, 5, 500, tzinfo=UTC)) == at(
        2026, 1, 1, 0, 0, 5)


def test_after_and_before_bracket_an_instant() -> None:
    cron = Cron("0 3 * * *", BERLIN)
    noon = at(2026, 12, 3, 12)
    assert cron.before(noon) == at(2026, 12, 3, 2, 0)
    assert cron.after(noon) == at(2026, 12, 4, 2, 0)
    assert Cron("@daily", "America/New_York").after(at(2026, 1, 1)) == at(2026, 1, 1, 5)
    assert Cron("0 0 30 2 *").after(at(2026, 1, 1)) is None  # 30 February never comes


def test_between_stops_at_its_limit_oldest_first() -> None:
    cron = Cron("* * * * *")
    slots = cron.between(at(2026, 1, 1), at(2026, 1, 2), limit=3)
    assert slots == [at(2026, 1, 1, 0, 1), at(2026, 1, 1, 0, 2), at(2026, 1, 1, 0, 3)]


@pytest.mark.parametrize(("cron", "timezone", "path"), [
    ("61 * * * *", "UTC", "cron"),
    ("* * *", "UTC", "cron"),
    ("0 3 * * * * *", "UTC", "cron"),
    ("", "UTC", "cron"),
    ("every day", "UTC", "cron"),
    (3, "UTC", "cron"),
    ("0 3 * * *", "Mars/Olympus", "timezone"),
    ("0 3 * * *", "../../etc/passwd", "timezone"),
    ("0 3 * * *", "", "timezone"),
])
def test_bad_expressions_and_time_zones_are_invalid_requests(cron: Any, timezone: str,
                                                             path: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        Cron(cron, timezone)
    assert info.value.code == "INVALID_REQUEST" and info.value.path == path


def test_overlap_catchup_and_id_checks() -> None:
    assert check_overlap("buffer_one") == "buffer_one"
    with pytest.raises(InvalidRequest) as info:
        check_overlap("queue_some")
    assert info.value.path == "overlap"
    assert check_catchup(timedelta(minutes=5)) == timedelta(minutes=5)
    for bad in (timedelta(seconds=1), timedelta(days=400), 300):
        with pytest.raises(InvalidRequest) as info:
            check_catchup(bad)
        assert info.value.path == "catchup_window"
    assert check_schedule_id("nightly-report") == "nightly-report"
    for bad in ("", "a b", "x" * 65, "-start"):
        with pytest.raises(InvalidRequest) as info:
            check_schedule_id(bad)
        assert info.value.path == "id"


def test_a_slot_key_is_a_valid_submission_key_for_the_longest_id() -> None:
    key = slot_key("x" * 64, at(2026, 12, 3, 3, 0, 0))
    assert key == f"schedule:{'x' * 64}:20261203T030000Z"
    validate_idempotency_key(key)
