"""Retention (docs/retention.md): finished runs pruned after a period, the ledger's evidence
kept for its own longer one, and the evidence exported as JSON lines before it goes.

Pruning a run deletes its journal, its external events, its input and its result in small
batches (one short transaction each, ``orchestrator.prune_runs``), and keeps its row as a
tombstone: its submission key still answers with that run (``RUN_PRUNED`` for its result),
never a second one. A run with an operation without an outcome, an unresolved reconciliation
item, an unfinished child or an unfinished parent is never pruned. Evidence (operations with
their intents, keys and receipts, reconciliation items and lookups, incidents, the operator
audit) is deleted only when ``evidence`` has passed, with the tombstone
(``orchestrator.expire_evidence``, for the migration role alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO, TypeVar

from orchestrator.db import retention as retention_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.xact import answered_once
from orchestrator.errors import InvalidRequest
from orchestrator.text import check_identifier

T = TypeVar("T")

log = logging.getLogger("orchestrator.retention")

BATCH = 500
"""Runs per batch: each batch is one transaction, so locks are held for one batch only."""
MAX_BATCH = 100_000
"""The most runs a batch may take."""
DUTY = 0.25
"""The share of its time a prune spends in batches: after a batch that took t seconds it
rests t × (1 - duty) / duty, so that the database keeps most of its capacity for the runs
(measured in bench/: the 1,000,000-run history pruned in minutes either way)."""
EXPORT_PAGE = 1000
MAX_PERIOD = timedelta(days=36600)
"""The longest period (about a hundred years, as a submission's deadline): a prune counts back
from now by each period, to a time the database must be able to hold."""

_PERIOD = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_period(text: str, path: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` (``INVALID_REQUEST`` naming ``path``)."""
    found = _PERIOD.fullmatch(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise InvalidRequest(f"--{path.replace('_', '-')} must be a period such as 30d, 12h, "
                             f"90m or 45s, not {text!r}", path=path)
    seconds = float(found.group(1)) * _UNITS[found.group(2)]
    if seconds > MAX_PERIOD.total_seconds():
        raise InvalidRequest(f"--{path.replace('_', '-')} must be at most {MAX_PERIOD.days} "
                             f"days, not {text!r}", path=path)
    return timedelta(seconds=seconds)


def _period(value: Any, path: str) -> timedelta:
    if not isinstance(value, timedelta) or not timedelta(0) <= value <= MAX_PERIOD:
        raise InvalidRequest(f"{path} must be a timedelta from zero to {MAX_PERIOD.days} days",
                             path=path)
    return value


@dataclass(frozen=True)
class Retention:
    """How long finished runs and the evidence are kept (docs/retention.md).

    ``finished_runs``: a run finished longer ago is pruned (its journal, events, input and
    result). ``workflows``: a workflow's own period instead (by name). ``evidence``: how long
    the ledger's evidence and the pruned run's row are kept after the run finished; at least
    every run period (``INVALID_REQUEST`` otherwise), None to keep it for ever.
    """

    finished_runs: timedelta = timedelta(days=30)
    evidence: timedelta | None = timedelta(days=400)
    workflows: Mapping[str, timedelta] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _period(self.finished_runs, "finished_runs")
        if not isinstance(self.workflows, Mapping):
            raise InvalidRequest("workflows must map workflow names to timedeltas",
                                 path="workflows")
        for name, period in self.workflows.items():
            check_identifier("workflow", name)
            _period(period, f"workflows.{name}")
        if self.evidence is not None:
            _period(self.evidence, "evidence")
            longest = max([self.finished_runs, *self.workflows.values()])
            if self.evidence < longest:
                raise InvalidRequest(
                    f"evidence ({self.evidence}) must be at least as long as the longest run "
                    f"period ({longest}): a run's evidence outlives its journal", path="evidence")


@dataclass
class PruneReport:
    """What a prune did (or, ``dry_run``, would do)."""

    dry_run: bool
    runs: int = 0
    journal_rows: int = 0
    events: int = 0
    batches: int = 0
    schedule_slots: int = 0  # slot records of schedules (no run, or their run pruned)
    evidence_runs: int = 0
    evidence_operations: int = 0
    evidence_audit: int = 0
    evidence_incidents: int = 0
    evidence_checked: bool = False  # False: evidence was not looked at (no period, no right)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "runs": self.runs, "journal_rows": self.journal_rows,
                "events": self.events, "batches": self.batches,
                "schedule_slots": self.schedule_slots,
                "evidence": None if not self.evidence_checked else {
                    "runs": self.evidence_runs, "operations": self.evidence_operations,
                    "audit": self.evidence_audit, "incidents": self.evidence_incidents},
                "seconds": round(self.seconds, 3)}


Progress = Callable[[PruneReport], None]


class Pruner:
    """Prunes by one :class:`Retention`, in batches, until nothing is left or it is told to
    stop; ``progress`` is called after every batch."""

    def __init__(self, db: Database, retention: Retention, *, batch: int = BATCH,
                 duty: float = DUTY) -> None:
        # A bool is an int to Python, never a batch or a share: True was taken for 1.
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise InvalidRequest(f"batch must be 1 to {MAX_BATCH}", path="batch")
        if isinstance(duty, bool) or not isinstance(duty, int | float) or not 0 < duty <= 1:
            raise InvalidRequest("duty must be more than 0 and at most 1", path="duty")
        self.db = db
        self.retention = retention
        self.batch = batch
        self.duty = float(duty)
        self.stopping = False
        self._woken = asyncio.Event()

    def stop(self) -> None:
        """Stop after the batch under way (a pause is cut short)."""
        self.stopping = True
        self._woken.set()

    async def _rest(self, took: float) -> None:
        """The pause after a batch that took ``took`` seconds (see :data:`DUTY`)."""
        if self.duty < 1 and not self.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), took * (1 - self.duty) / self.duty)

    def _args(self) -> dict[str, Any]:
        names = sorted(self.retention.workflows)
        return {"keep": self.retention.finished_runs.total_seconds(), "names": names,
                "keeps": [self.retention.workflows[n].total_seconds() for n in names]}

    async def prune(self, *, dry_run: bool = False, evidence: bool = True,
                    progress: Progress | None = None, max_batches: int | None = None
                    ) -> PruneReport:
        """Prune finished runs, then (with ``evidence``, a period and the right to) expire the
        evidence past its period. ``dry_run``: count, change nothing. Both flags are True or
        False (else ``INVALID_REQUEST`` naming it, before anything is read): ``dry_run="no"``
        is not taken for a dry run, nor ``evidence="no"`` for expiring the evidence."""
        for flag, value in (("dry_run", dry_run), ("evidence", evidence)):
            if not isinstance(value, bool):
                raise InvalidRequest(f"{flag} must be True or False", path=flag)
        started = datetime.now(UTC)
        report = PruneReport(dry_run=dry_run)
        args = self._args()
        if dry_run:
            async with self.db.connection() as conn:
                counted = await retention_db.prune_batch(conn, **args, limit=1, dry=True)
            report.runs = counted.runs
            async with self.db.connection() as conn:
                report.schedule_slots = await retention_db.prune_slots(
                    conn, keep=args["keep"], limit=1, dry=True)
        else:
            def pruned(done: retention_db.Pruned) -> int:
                report.batches += 1
                report.runs += done.runs
                report.journal_rows += done.journal_rows
                report.events += done.events
                return done.runs

            await self._in_batches(
                lambda conn: retention_db.prune_batch(conn, **args, limit=self.batch), pruned,
                report, progress, max_batches)

            def slots(done: int) -> int:
                report.schedule_slots += done
                return done

            # The slot records of schedules past the period that fired no run or whose run
            # is pruned now (docs/schedules.md, "What is recorded").
            await self._in_batches(
                lambda conn: retention_db.prune_slots(conn, keep=args["keep"],
                                                      limit=self.batch), slots,
                report, progress, max_batches)
        if evidence and self.retention.evidence is not None and not self.stopping:
            await self._expire(report, dry_run, progress, max_batches)
        report.seconds = (datetime.now(UTC) - started).total_seconds()
        return report

    async def _in_batches(self, batch: Callable[[Conn], Awaitable[T]],
                          count: Callable[[T], int], report: PruneReport,
                          progress: Progress | None, max_batches: int | None) -> None:
        """``batch`` in a transaction of its own, again and again, until one finds less than
        a whole batch (``count`` adds what it did to ``report`` and says how many it found),
        or the pruner is stopped, or ``max_batches`` have run; paced by :meth:`_rest`."""
        batches = 0
        while not self.stopping and (max_batches is None or batches < max_batches):
            began = time.monotonic()
            found = count(await self.db.run_in_transaction(answered_once(batch)))
            batches += 1
            if progress is not None:
                progress(report)
            if found < self.batch:
                break
            await self._rest(time.monotonic() - began)

    async def _expire(self, report: PruneReport, dry_run: bool, progress: Progress | None,
                      max_batches: int | None) -> None:
        assert self.retention.evidence is not None
        keep = self.retention.evidence.total_seconds()
        async with self.db.connection() as conn:
            if not await retention_db.may_expire(conn):
                return
        report.evidence_checked = True
        if dry_run:
            async with self.db.connection() as conn:
                counted = await retention_db.expire_batch(conn, keep=keep, limit=1, dry=True)
            _add(report, counted)
            return

        def expired(done: retention_db.Expired) -> int:
            _add(report, done)
            return max(done.runs, done.audit, done.incidents)

        await self._in_batches(
            lambda conn: retention_db.expire_batch(conn, keep=keep, limit=self.batch), expired,
            report, progress, max_batches)

    async def may_expire(self) -> bool:
        async with self.db.connection() as conn:
            return await retention_db.may_expire(conn)


def _add(report: PruneReport, done: retention_db.Expired) -> None:
    report.evidence_runs += done.runs
    report.evidence_operations += done.operations
    report.evidence_audit += done.audit
    report.evidence_incidents += done.incidents


@dataclass(frozen=True)
class EvidenceExport:
    """What :func:`export_evidence` wrote: the period ``[since, until)`` (``until`` is the
    cutoff it chose when none was given: the next period starts there) and how many rows of
    each kind."""

    since: datetime
    until: datetime
    counts: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """The record of ``evidence export --json`` (docs/cli-json.md): its times with
        microseconds, as every ``--json`` document's."""
        return {"since": _iso_micro(self.since), "until": _iso_micro(self.until),
                "counts": dict(self.counts)}


def _iso_micro(when: datetime) -> str:
    """A time as ``--json`` prints it: UTC, ISO 8601, microseconds, ``Z``."""
    return when.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


async def export_evidence(db: Database, out: TextIO, *, since: datetime,
                          until: datetime | None = None,
                          progress: Callable[[str, int], None] | None = None) -> EvidenceExport:
    """Write the evidence created or last changed in ``[since, until)`` to ``out`` as JSON
    lines (one object per row, its kind in ``type``), page by page in one read-only
    snapshot, so that a row changing meanwhile is neither missed nor written twice. An
    operation or an item that changed after an earlier period's export is written again in
    the period of its change, as it is now.

    Without ``until`` the period ends at the snapshot (or at the start of the oldest
    transaction then open, which may still commit rows stamped before it): every row stamped
    before that cutoff is in the snapshot, so a next period starting at the returned
    ``until`` misses nothing."""
    if since.tzinfo is None or (until is not None and until.tzinfo is None):
        raise InvalidRequest("since and until need a time zone", path="since")
    async with db.connection() as conn:
        cutoff = await retention_db.evidence_cutoff(conn)
        async with conn.transaction():
            await retention_db.evidence_snapshot(conn)
            period = EvidenceExport(since=since, until=until or max(since, cutoff), counts={})
            for kind, statement, first in retention_db.EVIDENCE:
                period.counts[kind] = await _export_kind(conn, out, kind, statement, first,
                                                         period, progress)
    return period


async def _export_kind(conn: Conn, out: TextIO, kind: str, statement: str, first: Any,
                       period: EvidenceExport,
                       progress: Callable[[str, int], None] | None) -> int:
    after, written = first, 0
    while True:
        rows = await retention_db.evidence_page(conn, statement, after=after,
                                                since=period.since, until=period.until,
                                                limit=EXPORT_PAGE)
        for row in rows:
            out.write(json.dumps({"type": kind, **_plain(row)}, ensure_ascii=False,
                                 sort_keys=True) + "\n")
        written += len(rows)
        if progress is not None and rows:
            progress(kind, written)
        if len(rows) < EXPORT_PAGE:
            return written
        after = rows[-1]["id"]


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row's values as JSON takes them: times in UTC ISO 8601 with ``Z``, ids as text."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, datetime):
            value = value.astimezone(UTC).isoformat().replace("+00:00", "Z")
        elif not isinstance(value, str | int | float | bool | list | dict | type(None)):
            value = str(value)
        out[key] = value
    return out
