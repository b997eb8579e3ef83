"""The recovery decision, Retry-After parsing and classification (CONTRACT C7): every branch
and boundary, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from orchestrator.errors import InvalidRequest
from orchestrator.failures import ToolError
from orchestrator.recovery import (
    Decision,
    RetryPolicy,
    classify_status,
    classify_transport,
    decide,
    parse_retry_after,
    resend_delay_ms,
)

P = RetryPolicy(max_attempts=5, base_delay_ms=100, max_delay_ms=1000, min_attempt_ms=0)
BASE = {"transient": True, "effects": "none", "visible": False, "attempts": 1, "policy": P,
        "jitter": 0.5}


def d(**changes):  # type: ignore[no-untyped-def]
    return decide(**{**BASE, **changes})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # exponential growth of the window (jitter 0.5 → half of it), then the cap
        ({"attempts": 1}, Decision.retry(50)),
        ({"attempts": 2}, Decision.retry(100)),
        ({"attempts": 3}, Decision.retry(200)),
        ({"attempts": 4}, Decision.retry(400)),
        ({"attempts": 4, "policy": RetryPolicy(max_attempts=10, base_delay_ms=100,
                                               max_delay_ms=1000)}, Decision.retry(400)),
        ({"attempts": 9, "policy": RetryPolicy(max_attempts=10, base_delay_ms=100,
                                               max_delay_ms=1000)}, Decision.retry(500)),
        # full jitter at its ends
        ({"jitter": 0.0}, Decision.retry(0)),
        ({"jitter": 0.999999, "attempts": 2}, Decision.retry(199)),
        # attempts exactly at the limit, and one under
        ({"attempts": 5}, Decision.stop("budget", "attempts")),
        ({"attempts": 4, "jitter": 0.0}, Decision.retry(0)),
        # each stop reason
        ({"transient": False}, Decision.stop("cause")),
        ({"effects": "committed"}, Decision.stop("effects")),
        ({"visible": True}, Decision.stop("visible")),
        # unknown effects take precedence over everything
        ({"effects": "unknown", "transient": False, "visible": True, "attempts": 5,
          "remaining_ms": 0, "upstream_invalid": True}, Decision("reconcile")),
        # the upstream minimum is never shortened: 600 ms against a 200 ms window
        ({"attempts": 2, "upstream_wait_ms": 600}, Decision.retry(600)),
        ({"attempts": 2, "upstream_wait_ms": 600, "remaining_ms": 600}, Decision.retry(600)),
        ({"attempts": 2, "upstream_wait_ms": 600, "remaining_ms": 599},
         Decision.stop("budget", "deadline")),
        # an upstream wait over the maximum delay, or one that did not parse: stop
        ({"upstream_wait_ms": 1001}, Decision.stop("budget", "upstream")),
        ({"upstream_wait_ms": 1000}, Decision.retry(1000)),
        ({"upstream_invalid": True}, Decision.stop("budget", "upstream")),
        # the deadline: exactly fitting with the minimum attempt time, and 1 ms short
        ({"policy": RetryPolicy(max_attempts=5, base_delay_ms=100, max_delay_ms=1000,
                                min_attempt_ms=250), "remaining_ms": 300}, Decision.retry(50)),
        ({"policy": RetryPolicy(max_attempts=5, base_delay_ms=100, max_delay_ms=1000,
                                min_attempt_ms=250), "remaining_ms": 299},
         Decision.stop("budget", "deadline")),
        ({"remaining_ms": 0, "jitter": 0.0}, Decision.retry(0)),
    ],
)
def test_decision(changes, expected):  # type: ignore[no-untyped-def]
    assert d(**changes) == expected


@pytest.mark.parametrize(
    "changes",
    [
        {"attempts": 0}, {"attempts": -1}, {"attempts": 1.5}, {"attempts": True},
        {"jitter": 1.0}, {"jitter": -0.1}, {"jitter": float("nan")}, {"jitter": "0.5"},
        {"remaining_ms": -1}, {"remaining_ms": 1.5}, {"upstream_wait_ms": -5},
        {"effects": "maybe"}, {"transient": "yes"}, {"visible": None},
    ],
)
def test_malformed_inputs_raise_a_clear_error(changes):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest):
        d(**changes)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"max_attempts": 11}, {"base_delay_ms": -1},
     {"base_delay_ms": 10, "max_delay_ms": 5}, {"min_attempt_ms": 0.5}],
)
def test_invalid_policies_are_rejected(kwargs):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest):
        RetryPolicy(**kwargs)


NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (None, False)),
        ("3", (3000, False)),
        (" 0 ", (0, False)),
        (2.5, (2500, False)),
        ("Sun, 29 Nov 2026 12:00:05 GMT", (5000, False)),
        ("Sun, 29 Nov 2026 11:59:00 GMT", (0, False)),  # a date in the past: no wait
        ("-1", (None, True)),
        ("soon", (None, True)),
        ("", (None, True)),
        (-1, (None, True)),
        (float("inf"), (None, True)),
        (True, (None, True)),
        ("\u00b2", (None, True)),  # a digit to str.isdigit, not to int()
        ("\u0663", (None, True)),  # an Arabic-Indic three
        ("9" * 19, (None, True)),
        ("9" * 5000, (None, True)),
        (1e300, (None, True)),
        ("3162240000", (3_162_240_000_000, False)),  # 36,600 days: the longest kept
        ("3162240001", (None, True)),
        ("Fri, 31 Dec 99999 23:59:59 GMT", (None, True)),
        ("Mon, 01 Jan 2000 00:00:00 +9999999999999999999", (None, True)),
    ],
)
def test_retry_after(value, expected):  # type: ignore[no-untyped-def]
    assert parse_retry_after(value, NOW) == expected


def test_parsing_is_separate_from_deciding() -> None:
    hint = (NOW + timedelta(seconds=2)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    wait, invalid = parse_retry_after(hint, NOW)
    assert (wait, invalid) == (2000, False)
    roomy = RetryPolicy(max_attempts=3, base_delay_ms=100, max_delay_ms=5000)
    assert d(policy=roomy, upstream_wait_ms=wait) == Decision.retry(2000)
    assert d(upstream_wait_ms=wait) == Decision.stop("budget", "upstream")  # over 1000 ms


@pytest.mark.parametrize(
    ("status", "not_applied", "cause", "effects", "transient"),
    [
        (401, False, "authentication", "none", False),
        (403, True, "authentication", "none", False),
        (400, False, "invalid_request", "none", False),
        (404, False, "invalid_request", "none", False),
        (422, False, "invalid_request", "none", False),
        (409, True, "conflict", "none", False),
        (429, True, "rate_limited", "none", True),
        (429, False, "rate_limited", "unknown", False),
        (408, True, "request_timeout", "none", True),
        (500, False, "upstream_error", "unknown", False),
        (503, True, "upstream_error", "unknown", False),
        (418, False, "rejected", "none", False),
    ],
)
def test_status_classification(status, not_applied, cause, effects, transient
                               ):  # type: ignore[no-untyped-def]
    got = classify_status(status, proves_not_applied=not_applied)
    assert (got.cause, got.effects, got.transient) == (cause, effects, transient)


def test_transport_classification_and_tool_errors() -> None:
    assert classify_transport("before_send", "connection").effects == "none"
    assert classify_transport("before_send", "connection").transient
    assert classify_transport("after_send", "timeout").effects == "unknown"
    assert ToolError.before_send().classification().transient
    assert ToolError.after_send("partial_response").classification().effects == "unknown"
    assert ToolError.from_status(429, proves_not_applied=True).classification().transient
    assert ToolError("x").classification().effects == "unknown"
    assert not ToolError("x", applied=False).classification().transient
    with pytest.raises(InvalidRequest):
        classify_status(200)


def test_engine_resends_are_capped_and_checked() -> None:
    assert RetryPolicy().max_engine_resends == 10
    assert RetryPolicy(max_engine_resends=0).max_engine_resends == 0  # re-sends off
    for bad in (-1, 101, 2.5, True):
        with pytest.raises(InvalidRequest) as info:
            RetryPolicy(max_engine_resends=bad)  # type: ignore[arg-type]
        assert info.value.path == "max_engine_resends"


@pytest.mark.parametrize(
    ("attempts", "jitter", "remaining_ms", "expected"),
    [
        (1, 0.5, None, 50),  # the window after one attempt is the base
        (2, 0.5, None, 100),
        (4, 0.999, None, 799),
        (5, 0.5, None, 500),  # capped by max_delay_ms
        (60, 0.5, None, 500),
        (10**6, 0.5, None, 500),  # no window is computed past the cap
        (2, 0.0, None, 0),
        (4, 0.5, 150, 150),  # shortened to what the deadline leaves
        (4, 0.5, 0, 0),
    ],
)
def test_a_repetition_after_an_uncertain_outcome_waits_the_policys_backoff(
        attempts, jitter, remaining_ms, expected):  # type: ignore[no-untyped-def]
    assert resend_delay_ms(P, attempts, jitter, remaining_ms) == expected
    # the same window a retry after as many attempts draws from
    if remaining_ms is None and attempts < P.max_attempts:
        assert d(attempts=attempts, jitter=jitter) == Decision.retry(expected)


def test_a_repetition_leaves_room_for_the_minimum_attempt() -> None:
    roomy = RetryPolicy(max_attempts=3, base_delay_ms=1000, max_delay_ms=1000,
                        min_attempt_ms=300)
    assert resend_delay_ms(roomy, 1, 0.9, 1000) == 700
    assert resend_delay_ms(roomy, 1, 0.9, 200) == 0
    for bad in ({"attempts": 0}, {"jitter": 1.0}, {"jitter": float("nan")}):
        with pytest.raises(InvalidRequest):
            resend_delay_ms(roomy, **{"attempts": 1, "jitter": 0.5, **bad})  # type: ignore[arg-type]
