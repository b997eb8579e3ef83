"""``new_run``'s checks, without a database: every creator gets the same error for the same
mistake, before a row exists."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.admission import DECLARE_HINT, MAX_PRIORITY, new_run
from orchestrator.canonical import DEFAULT_LIMITS
from orchestrator.errors import InvalidRequest
from orchestrator.models import Owner

OWNER = Owner(tenant="acme", principal="alice")


def _row(**options: Any) -> dict[str, Any]:
    options.setdefault("queues", {"work"})
    return new_run("wf", "1", {"n": 1}, limits=DEFAULT_LIMITS, owner=OWNER, **options)


@pytest.mark.parametrize(("options", "path"), [
    ({"queue": "nowhere"}, "queue"),
    ({"queue": "no spaces"}, "queue"),
    ({"queue": "work", "queues": set()}, "queue"),
    ({"priority": MAX_PRIORITY + 1}, "priority"),
    ({"priority": -MAX_PRIORITY - 1}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"concurrency_key": "a b"}, "concurrency_key"),
])
def test_a_bad_place_is_refused_naming_the_field(options: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        _row(**options)
    assert (refused.value.code, refused.value.path) == ("INVALID_REQUEST", path)


def test_the_unknown_queue_says_what_to_do() -> None:
    with pytest.raises(InvalidRequest, match=r"declare it with app.queue\('nowhere', ...\)"):
        _row(queue="nowhere", hint=DECLARE_HINT)
    with pytest.raises(InvalidRequest, match="orchestrator queues list"):
        _row(queue="nowhere")


def test_a_good_place_is_the_rows() -> None:
    row = _row(queue="work", priority=-MAX_PRIORITY, concurrency_key="customer-1")
    assert (row["queue"], row["priority"], row["concurrency_key"]) == (
        "work", -MAX_PRIORITY, "customer-1")
    assert _row()["queue"] is None  # the default queue needs no declaration
    assert _row(queue="any-name", queues=None)["queue"] == "any-name"  # none known: name only
