"""Queues: run-level flow control (docs/flow.md).

A queue bounds how many of its runs are started and not finished (``concurrency``, across every
worker; parked runs hold their slot unless ``count_parked=False``), how many run on one worker
(``worker_concurrency``), how many of one ``concurrency_key`` (``key_concurrency``, a key's
runs starting in the order they were submitted), and how many start in a sliding window
(``rate``); with ``priority=True`` it starts lower numbers first, FIFO within a priority, a
waiting run gaining one level per ``priority_aging`` so that none starves. A run submitted to
no queue is in the default queue: unlimited, claimed as before.

The limits are enforced by the database: a worker's claim from a queue is one function call
that locks the queue's row, counts and claims (migration 0012). The queue's settings are
stored: the code declares them (``app.queue``) and every worker writes the declaration when it
starts; ``orchestrator queues set`` changes them at run time, and those changes outlive later
declarations until ``queues reset``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from orchestrator.admission import check_queue_name
from orchestrator.db import queues as queues_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.reconciliation import audit_record
from orchestrator.db.xact import answered_once
from orchestrator.errors import InvalidRequest
from orchestrator.flow import MAX_LIMIT, RateLimit
from orchestrator.reconcile import check_evidence

T = TypeVar("T")

DEFAULT_PRIORITY_AGING = timedelta(seconds=60)
"""How long a run waits in a priority queue to gain one level (its starvation bound)."""
@dataclass(frozen=True)
class Queue:
    """A queue as the code declares it (``app.queue``)."""

    name: str
    concurrency: int | None = None
    worker_concurrency: int | None = None
    key_concurrency: int | None = None
    rate: RateLimit | None = None
    priority: bool = False
    count_parked: bool = True
    priority_aging: timedelta = DEFAULT_PRIORITY_AGING

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "concurrency": self.concurrency,
                "worker_concurrency": self.worker_concurrency,
                "key_concurrency": self.key_concurrency,
                "rate_limit": self.rate.limit if self.rate else None,
                "rate_seconds": self.rate.per.total_seconds() if self.rate else None,
                "priority": self.priority, "count_parked": self.count_parked,
                "priority_aging_seconds": self.priority_aging.total_seconds()}


def check_limit(value: Any, path: str) -> int | None:
    """A concurrency limit: None (no limit) or an integer from 1."""
    if value is None:
        return None
    if type(value) is not int or not 0 < value <= MAX_LIMIT:
        raise InvalidRequest(f"{path} must be an integer from 1 to {MAX_LIMIT} (or None: no "
                             f"limit), got {value!r}", path=path)
    return value


def check_rate(value: Any) -> RateLimit | None:
    if value is None or isinstance(value, RateLimit):
        return value
    if isinstance(value, str):
        return RateLimit.parse(value)
    raise InvalidRequest("rate must be a RateLimit or text such as '100/s'", path="rate")


def declare(name: str, *, concurrency: int | None = None, worker_concurrency: int | None = None,
            key_concurrency: int | None = None, rate: RateLimit | str | None = None,
            priority: bool = False, count_parked: bool = True,
            priority_aging: timedelta = DEFAULT_PRIORITY_AGING) -> Queue:
    """A checked :class:`Queue`: ``INVALID_REQUEST`` naming the field for a bad name, a zero,
    negative or non-integer limit, a malformed rate."""
    for flag, value in (("priority", priority), ("count_parked", count_parked)):
        if not isinstance(value, bool):
            raise InvalidRequest(f"{flag} must be True or False", path=flag)
    if not isinstance(priority_aging, timedelta) or priority_aging <= timedelta(0):
        raise InvalidRequest("priority_aging must be a positive timedelta",
                             path="priority_aging")
    return Queue(check_queue_name(name, "name"), check_limit(concurrency, "concurrency"),
                 check_limit(worker_concurrency, "worker_concurrency"),
                 check_limit(key_concurrency, "key_concurrency"), check_rate(rate), priority,
                 count_parked, priority_aging)


@dataclass(frozen=True)
class QueueInfo:
    """A stored queue: its limits in force, its pause, and what it holds now."""

    name: str
    concurrency: int | None
    worker_concurrency: int | None
    key_concurrency: int | None
    rate: RateLimit | None
    priority: bool
    count_parked: bool
    priority_aging: timedelta
    paused: bool
    paused_at: datetime | None
    overridden: tuple[str, ...]
    declared: dict[str, Any]
    held: int
    """Slots held: runs started and not finished (parked ones unless ``count_parked`` is off)."""
    running: int
    ready: int
    """Runs ready to start (or to resume into a slot) that no worker has claimed yet."""
    oldest_seconds: float | None
    recent_starts: int
    """Starts in the current rate window (0 without a rate)."""
    keys: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_row(cls, row: dict[str, Any],
                 keys: Sequence[dict[str, Any]] = ()) -> QueueInfo:
        rate = (RateLimit(row["rate_limit"], timedelta(seconds=row["rate_seconds"]))
                if row["rate_limit"] is not None else None)
        return cls(row["name"], row["concurrency"], row["worker_concurrency"],
                   row["key_concurrency"], rate, row["priority"], row["count_parked"],
                   timedelta(seconds=row["priority_aging_seconds"]), row["paused"],
                   row["paused_at"], tuple(row["overridden"]), dict(row["declared"]),
                   row["held"], row["running"], row["ready"], row["oldest_seconds"],
                   row["recent_starts"], tuple(keys))


def queue_record(info: QueueInfo) -> dict[str, Any]:
    """A queue as ``queues ... --json`` and the console's API show it (docs/cli-json.md)."""
    return {"name": info.name, "concurrency": info.concurrency,
            "worker_concurrency": info.worker_concurrency,
            "key_concurrency": info.key_concurrency,
            "rate": None if info.rate is None else {
                "limit": info.rate.limit, "per_seconds": info.rate.per.total_seconds()},
            "priority": info.priority, "count_parked": info.count_parked,
            "priority_aging_seconds": info.priority_aging.total_seconds(),
            "paused": info.paused, "overridden": list(info.overridden),
            "declared": info.declared, "held": info.held, "running": info.running,
            "ready": info.ready, "oldest_ready_seconds": info.oldest_seconds,
            "recent_starts": info.recent_starts,
            "keys": [dict(k) for k in info.keys]}


DEFAULT_QUEUE_WORD = "default"
"""What people call the queue of runs submitted to no queue. It has no row (unless an app
declares a queue by that name), so :func:`missing` explains it instead of reporting it
missing."""


def missing(name: str) -> InvalidRequest:
    """``INVALID_REQUEST`` for a queue that is not stored; for ``default``, what the default
    queue is (runs submitted to no queue: no row, no limits) and how to bound such runs."""
    if name == DEFAULT_QUEUE_WORD:
        return InvalidRequest(
            "no queue is named default: runs submitted to no queue are in the default queue, "
            "which has no stored settings and no limits (its runs start as soon as a worker "
            "has a free slot) and cannot be paused or given any. To bound such runs, declare "
            "a queue with limits (app.queue(NAME, concurrency=...), docs/flow.md) and submit "
            "them to it; `orchestrator queues list` shows the stored queues", path="name")
    return InvalidRequest(f"no queue {name}: a queue is stored once a worker of an app that "
                          "declares it (app.queue) has started; `orchestrator queues list` "
                          "shows them", path="name")


class QueueAdmin:
    """What ``orchestrator queues`` and ``app.queues`` do, on a database."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def list(self) -> list[QueueInfo]:
        rows = await self.database.read(queues_db.queue_list)
        return [QueueInfo.from_row(row) for row in rows]

    async def get(self, name: str, *, keys: int = 0) -> QueueInfo:
        check_queue_name(name, "name")

        async def read(conn: Any) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
            row = await queues_db.queue_get(conn, name)
            return row, (await queues_db.queue_keys(conn, name, keys) if row and keys else [])

        row, key_rows = await self.database.read(read)
        if row is None:
            raise missing(name)
        return QueueInfo.from_row(row, key_rows)

    async def set(self, name: str, *, operator: str, evidence: str,
                  **changes: Any) -> QueueInfo:
        """Change limits at run time: ``concurrency``, ``worker_concurrency``,
        ``key_concurrency`` (an integer, or None for no limit), ``rate`` (a
        :class:`RateLimit`, text such as ``"100/s"``, or None), ``priority``,
        ``count_parked``. What is not given stays. Audited as :meth:`change` says."""
        return await self.change(name, "set", operator=operator, evidence=evidence,
                                 changes=changes)

    async def reset(self, name: str, *, operator: str, evidence: str) -> QueueInfo:
        """Drop every limit set at run time: the code's declaration is in force again."""
        return await self.change(name, "reset", operator=operator, evidence=evidence)

    async def set_paused(self, name: str, paused: bool, *, operator: str,
                         evidence: str) -> QueueInfo:
        return await self.change(name, "pause" if paused else "resume", operator=operator,
                                 evidence=evidence)

    async def change(self, name: str, action: str, *, operator: str, evidence: str,
                     changes: Mapping[str, Any] | None = None) -> QueueInfo:
        """``pause``, ``resume``, ``set`` (``changes``: limits by name) or ``reset`` a queue,
        and its audit row (``queue.pause`` …, by ``operator`` with ``evidence``, the queue's
        limits and pause before and after) in the same transaction: the one path of
        ``orchestrator queues``, the console and ``app.queues``. ``INVALID_REQUEST`` naming
        the field, before anything is read, for a bad name, action, limit, operator or
        evidence; for a queue not stored. The queue's row is locked while it is read and
        changed. A change whose COMMIT applied but whose answer was lost with its connection
        answers, when the storage layer runs it again, with the queue as it left it."""
        check_queue_name(name, "name")
        check_evidence(evidence, operator)
        if action not in QUEUE_ACTIONS:
            raise InvalidRequest(f"action must be one of {', '.join(QUEUE_ACTIONS)}",
                                 path="action")
        row = queue_changes(dict(changes or {})) if action == "set" else {}
        if action == "set" and not row:
            raise InvalidRequest("give at least one limit to set", path="limits")

        async def act(conn: Conn) -> dict[str, Any]:
            stored = await queues_db.queue_lock(conn, name)
            before = await queues_db.queue_get(conn, name) if stored else None
            if before is None:
                raise missing(name)
            if action in ("pause", "resume"):
                after = await queues_db.queue_pause(conn, name, action == "pause")
            elif action == "set":
                after = await queues_db.queue_set(conn, name, row)
            else:
                after = await queues_db.queue_reset(conn, name)
            assert after is not None
            await audit_record(conn, operator=operator, action=f"queue.{action}",
                               target_kind="queue", target_id=name, tenant=None,
                               evidence=evidence, before=limits_json(before),
                               after=limits_json(after))
            return after

        # Run again after a lost COMMIT that applied, it answers as then and audits once.
        return QueueInfo.from_row(await self.database.run_in_transaction(answered_once(act)))


QUEUE_ACTIONS = ("pause", "resume", "set", "reset")
"""What an operator may do to a queue (each audited as ``queue.<action>``)."""


def limits_json(row: Mapping[str, Any]) -> str:
    """What a queue's audit row keeps of it: its limits and its pause."""
    shown = queue_record(QueueInfo.from_row(dict(row)))
    return json.dumps({k: shown[k] for k in ("concurrency", "worker_concurrency",
                                            "key_concurrency", "rate", "priority",
                                            "count_parked", "paused")}, sort_keys=True)


_SETTABLE = ("concurrency", "worker_concurrency", "key_concurrency", "rate", "priority",
             "count_parked")


def queue_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """Limits given by name (``rate`` as a :class:`RateLimit` or text), checked, as the
    columns that hold them; ``INVALID_REQUEST`` naming a field that is not a limit or a bad
    value."""
    row: dict[str, Any] = {}
    for field, value in changes.items():
        if field not in _SETTABLE:
            raise InvalidRequest(f"{field} is not a queue limit (one of "
                                 f"{', '.join(_SETTABLE)})", path="limits")
        if field == "rate":
            rate = check_rate(value)
            row["rate_limit"] = rate.limit if rate else None
            row["rate_seconds"] = rate.per.total_seconds() if rate else None
        elif field in ("priority", "count_parked"):
            if not isinstance(value, bool):
                raise InvalidRequest(f"{field} must be True or False", path=field)
            row[field] = value
        else:
            row[field] = check_limit(value, field)
    return row


CODE_OPERATOR = "app"
"""Who ``app.queues`` changes a queue as in the audit unless told (``operator=``)."""
CODE_EVIDENCE = "changed by the application's code (app.queues)"
"""The evidence its audit row keeps unless told (``evidence=``)."""


class Queues:
    """``app.queues``: the stored queues, read and changed at run time. Each method has an
    ``_async`` twin for code in an event loop. A change is audited as the CLI's and the
    console's are (``queue.pause`` …), by ``operator`` (default ``"app"``) with
    ``evidence``."""

    def __init__(self, admin: QueueAdmin, call: Callable[[Any], Any]) -> None:
        self.admin = admin
        self._call = call

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return cast(T, self._call(coro))

    async def list_async(self) -> list[QueueInfo]:
        return await self.admin.list()

    def list(self) -> list[QueueInfo]:
        return self._run(self.list_async())

    async def get_async(self, name: str) -> QueueInfo:
        return await self.admin.get(name, keys=20)

    def get(self, name: str) -> QueueInfo:
        return self._run(self.get_async(name))

    async def set_async(self, name: str, *, operator: str = CODE_OPERATOR,
                        evidence: str = CODE_EVIDENCE, **changes: Any) -> QueueInfo:
        return await self.admin.set(name, operator=operator, evidence=evidence, **changes)

    def set(self, name: str, *, operator: str = CODE_OPERATOR, evidence: str = CODE_EVIDENCE,
            **changes: Any) -> QueueInfo:
        """See :meth:`QueueAdmin.set`."""
        return self._run(self.set_async(name, operator=operator, evidence=evidence,
                                        **changes))

    async def reset_async(self, name: str, *, operator: str = CODE_OPERATOR,
                          evidence: str = CODE_EVIDENCE) -> QueueInfo:
        return await self.admin.reset(name, operator=operator, evidence=evidence)

    def reset(self, name: str, *, operator: str = CODE_OPERATOR,
              evidence: str = CODE_EVIDENCE) -> QueueInfo:
        return self._run(self.reset_async(name, operator=operator, evidence=evidence))

    async def pause_async(self, name: str, *, operator: str = CODE_OPERATOR,
                          evidence: str = CODE_EVIDENCE) -> QueueInfo:
        return await self.admin.set_paused(name, True, operator=operator, evidence=evidence)

    def pause(self, name: str, *, operator: str = CODE_OPERATOR,
              evidence: str = CODE_EVIDENCE) -> QueueInfo:
        """Start nothing new from the queue; its running runs go on."""
        return self._run(self.pause_async(name, operator=operator, evidence=evidence))

    async def resume_async(self, name: str, *, operator: str = CODE_OPERATOR,
                           evidence: str = CODE_EVIDENCE) -> QueueInfo:
        return await self.admin.set_paused(name, False, operator=operator, evidence=evidence)

    def resume(self, name: str, *, operator: str = CODE_OPERATOR,
               evidence: str = CODE_EVIDENCE) -> QueueInfo:
        return self._run(self.resume_async(name, operator=operator, evidence=evidence))
