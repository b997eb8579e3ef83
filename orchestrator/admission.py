"""Where a new run waits, checked, and its row: :func:`new_run`, which every run creator calls.

A run is created by a submission (``app.submit``), by a workflow for its child
(``ctx.run_child``), by a schedule's firing and by an operator's restart. Each goes through
:func:`new_run`, so each is held to the same rules with the same errors before anything is
written (``INVALID_REQUEST`` naming ``queue``, ``priority`` or ``concurrency_key``; the input's
JSON limits). The checks are pure: the caller says which queues exist for it (the application's
declared queues, or the queues stored in the database, read in the caller's transaction).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

from orchestrator.canonical import JsonLimits
from orchestrator.db import runs as runs_db
from orchestrator.errors import InvalidRequest
from orchestrator.flow import Start
from orchestrator.models import Owner, validate_idempotency_key
from orchestrator.registry import check_name

MAX_PRIORITY = 1_000
"""Priorities run from ``-MAX_PRIORITY`` to ``MAX_PRIORITY``; lower numbers start first."""

DECLARE_HINT = "declare it with app.queue({name!r}, ...)"
"""What an unknown queue's error says to do when the known queues are the application's."""
STORED_HINT = ("a queue is stored once a worker of an app that declares it (app.queue) has "
               "started; `orchestrator queues list` shows them")
"""What it says when the known queues are those stored in the database."""


def check_queue_name(name: Any, path: str = "queue") -> str:
    try:
        return check_name("queue", name)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, path=path) from None


def check_priority(value: Any) -> int:
    if type(value) is not int or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an integer from {-MAX_PRIORITY} to "
                             f"{MAX_PRIORITY} (lower starts first)", path="priority")
    return value


def check_concurrency_key(value: Any) -> str:
    """The idempotency key's rules (1-128 ASCII letters, digits, '.', '_', ':', '-')."""
    return validate_idempotency_key(value, "concurrency_key")


def check_queue(name: Any, known: Collection[str] | None, hint: str = STORED_HINT
                ) -> str | None:
    """A run's queue: None (the default queue), else a well-formed name among ``known`` (None:
    the caller cannot tell, and only the name is checked). ``INVALID_REQUEST`` naming
    ``queue``; ``hint`` (formatted with ``name``) says what to do about an unknown one."""
    if name is None:
        return None
    checked = check_queue_name(name)
    if known is not None and checked not in known:
        raise InvalidRequest(f"unknown queue {checked}: {hint.format(name=checked)}",
                             path="queue")
    return checked


def new_run(workflow_name: str, workflow_version: str, input: Any, *, limits: JsonLimits,
            owner: Owner, queues: Collection[str] | None, hint: str = STORED_HINT,
            idempotency_key: str | None = None, deadline: float | None = None,
            run_id: uuid.UUID | None = None, parent: tuple[uuid.UUID, int] | None = None,
            start: Start | None = None, queue: str | None = None, priority: Any = 0,
            concurrency_key: str | None = None) -> dict[str, Any]:
    """A new run's row for :func:`~orchestrator.db.runs.run_insert`, checked: its queue must be
    one of ``queues`` (see :func:`check_queue`), its priority within ``±MAX_PRIORITY``, its
    concurrency key well formed, its input within ``limits``. Raises before anything is
    written, the same error whichever creator calls it."""
    placed = check_queue(queue, queues, hint)
    ranked = check_priority(priority)
    key = check_concurrency_key(concurrency_key) if concurrency_key is not None else None
    return runs_db.run_row(workflow_name, workflow_version, input, limits=limits, owner=owner,
                           idempotency_key=idempotency_key, deadline=deadline, run_id=run_id,
                           parent=parent, start=start, queue=placed, priority=ranked,
                           concurrency_key=key)
