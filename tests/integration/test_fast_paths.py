"""The two forms of each hot write guard one transition identically (CONTRACT C3, C5, C6).

Every hot write of the engine exists twice: a set-based *fast* form (one row of a batched
statement, sent by the group writer; a row that does not apply raises ``OR001`` and the caller
gets ``FastPathMiss``) and the *general* form the engine falls back to on a miss (Python work
in one fenced transaction). The pairs:

- a call's begin (``operation_begin_fast`` / ``Call.begin``'s work through
  ``Session.write_locked``): ``submitted`` with its ``call.submitted`` entry, optionally
  carrying a riding receipt;
- a lone receipt (``receipt_commit_fast`` / ``Rider.commit_work`` through
  ``Session.write_locked``, as ``Session.settle_locked`` falls back): ``submitted →
  committed`` with its ``call.completed`` entry;
- a run's success (``run_succeed_fast`` / ``Outcome._terminal``'s last write in the
  transaction ``Session.last_write`` opens): ``succeeded`` with its ``run.completed`` entry,
  optionally carrying a riding receipt.

For every state of a matrix (the lease token, the run's status, the revision the caller
expects, a cancellation, and what the ledger holds) the state is built twice, in two copies of
the same runs, committed. The fast form is applied to one copy through a ``GroupWriter`` (so a
fast row that missed but wrote would really be committed), the general form to the other
through the engine's ``Session``. Then:

- the fast form applies exactly where the contract says it may (:func:`fast_applies`), and so
  does the general form (:func:`general_applies`);
- where the fast form applies, the general form applies too and leaves the same rows: the runs
  (status, revision, result, lease, wake-up), the operations (state, receipt, every column the
  ledger keeps) and the journal (seq, kind, position, name, version, payload, lease token);
- where a form does not apply, it wrote nothing: the copy's rows are as they were built.

Operation ids differ between the copies; rows are compared with each operation named by its
run's role, position and attempt, journal payloads included. Timestamps are compared by
whether they are set (and a run's ``available_at`` by whether it is due).

The matrix (:func:`matrix`) is explicit rather than drawn by hypothesis: it is finite, and
every state of it is run. The fence has 36 states (token held or old × running, waiting or
succeeded × revision expected, one behind or one ahead × cancellation or not); every ledger
state meets the open fence and each fence with one defect, and a fence with two or more defects
meets the ledger states that would let the write through (where only the fence can refuse).
That makes 300 states for a begin, 96 for a lone receipt and 732 for a success. The cases are
independent (each has runs of its own), so a few writers apply them side by side.

The matrix found one difference, now closed: a receipt naming an operation of *another* run
that holds the same lease token number (tokens count per run) was refused by every fast form
(``o.run_id = x.run_id``) but committed by the general one, whose guard checked the lease of
the operation's own run; every worker transition of an operation now names the writing run
(``operations._LEASE_HELD``), and
:func:`test_the_general_forms_refuse_a_receipt_of_another_run` holds it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchestrator import Orchestrator, canonical
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db import steps as steps_db
from orchestrator.db.writer import GroupWriter
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.control import Stop
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session
from orchestrator.journal import SCHEMA_VERSION, Entry, EventKind, entry
from orchestrator.metrics import Metrics

TOKEN = 7  # the holder's lease token; the other run holds the same number (tokens count per run)
TOOL, VERSION, EFFECT = "charge", "1", "consequential"
INTENT, OTHER_INTENT, FIXTURE_INTENT = "a" * 64, "b" * 64, "c" * 64
RECEIPT_POSITION, OTHERS_POSITION, BEGIN_POSITION = 1, 2, 3
LIMITS = canonical.DEFAULT_LIMITS
UNEXPECTED = "unexpected"
LANES = 4  # writers applying cases side by side (each case has rows of its own)

# What a riding (or lone) receipt names: an operation of the run in one of these states, or
# one of another run that is running under the same lease token number.
RECEIPT_STATES = ("submitted", "pending", "committed", "failed", "unknown")
OTHER_RUN = "other_run"


@dataclass(frozen=True)
class Fence:
    """What the run's row says against the caller's view of it."""

    token: str  # "held": the caller's token is the run's; "old": an earlier holder's
    status: str  # running | waiting | succeeded
    revision: str  # "expected"; "behind" / "ahead": the caller counts one event less / more
    cancel: bool  # a cancellation was requested

    @property
    def defects(self) -> int:
        """How many of the lease, the status and the revision refuse the caller."""
        return (self.token != "held") + (self.status != "running") + (self.revision != "expected")

    @property
    def open(self) -> bool:
        return self.defects == 0

    def __str__(self) -> str:
        return (f"{self.token}/{self.status}/{self.revision}"
                f"{'/cancel' if self.cancel else ''}")


FENCES = [Fence(*f) for f in itertools.product(
    ("held", "old"), ("running", "waiting", "succeeded"), ("expected", "behind", "ahead"),
    (False, True))]
OPEN = Fence("held", "running", "expected", False)

VALUES: list[Any] = [
    {"id": "ch_1", "ok": True},
    {"b": 1, "a": [1.5, -0.0, 1e22, 2**70, 1e-7], "zero": 0.0},
    {"é": "line\u2028sep", "": None, "zz": {"y": [], "x": {}}, "ab": "\U0001f600"},
    "plain",
    [0.1, -3, False],
]


@dataclass(frozen=True)
class Case:
    """One state of one pair's matrix."""

    pair: str  # begin | receipt | success
    fence: Fence
    receipt: str = "none"  # the riding receipt: none, a state of RECEIPT_STATES, or OTHER_RUN
    existing: str = "none"  # begin: an operation with the call's identity (same_intent, ...)
    others: str = "none"  # success: another operation of the run, in this state
    parent: bool = False  # success: the run is a child of a waiting run
    value: int = 0  # which of VALUES the receipt, the result and the arguments hold

    def __str__(self) -> str:
        parts = [self.pair, str(self.fence), f"receipt={self.receipt}"]
        if self.pair == "begin":
            parts.append(f"existing={self.existing}")
        if self.pair == "success":
            parts += [f"others={self.others}", f"parent={self.parent}"]
        if self.value:
            parts.append(f"value={self.value}")
        return " ".join(parts)


# -- what the contract allows -----------------------------------------------------------------

def _ledger_allows(case: Case) -> bool:
    """The ledger side of the transition: the riding receipt's operation is this run's and
    ``submitted``; no operation already holds the call's identity; a run ends with no other
    operation unsettled."""
    receipt_ok = case.receipt in (("submitted",) if case.pair == "receipt"
                                  else ("none", "submitted"))
    return (receipt_ok and case.existing == "none"
            and case.others in ("none", "committed"))


def fast_applies(case: Case) -> bool:
    """The fast form writes only under the caller's lease at its revision, and a call's
    begin only without a cancellation (the general form records that one)."""
    cancel_ok = not (case.pair == "begin" and case.fence.cancel)
    return case.fence.open and cancel_ok and _ledger_allows(case)


def general_applies(case: Case) -> bool:
    """The general form applies wherever the fast one does, and also to a call's begin under a
    cancellation: the intent is recorded ``pending`` and moved to ``cancelled`` (never sent)."""
    return case.fence.open and _ledger_allows(case)


def another_runs_receipt(case: Case) -> bool:
    """A riding receipt that names another run's operation, held under the same token number,
    where nothing else would refuse the write."""
    return (case.receipt == OTHER_RUN and case.fence.open
            and case.existing == "none" and case.others in ("none", "committed"))


def matrix(cases: Iterable[Case]) -> list[Case]:
    """Every ledger state meets the open fence and each fence with one defect (with and
    without a cancellation); a fence with two or more defects (an old token on a waiting run)
    meets only the ledger states that would let the write through, where the fence alone
    decides."""
    return [c for c in cases if c.fence.defects <= 1 or _ledger_allows(c)]


# -- building the states ----------------------------------------------------------------------

@dataclass
class Copy:
    """One copy of a case's runs: the run written for (``R``), the run whose operation a
    receipt may wrongly name (``O``) and the parent (``P``)."""

    case: Case
    ids: dict[str, uuid.UUID]
    revision: int
    ops: dict[tuple[str, int, int], int]  # (role, position, attempt) → operation id
    names: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # the inverse, as read

    @property
    def run_id(self) -> uuid.UUID:
        return self.ids["R"]

    @property
    def expected(self) -> int:
        return self.revision + {"expected": 0, "behind": -1, "ahead": 1}[
            self.case.fence.revision]

    @property
    def token(self) -> int:
        return TOKEN if self.case.fence.token == "held" else TOKEN - 1


def _planned_ops(case: Case) -> list[tuple[str, int, str, str]]:
    """The operations a case starts with: (role, position, state, intent)."""
    planned = []
    if case.receipt in RECEIPT_STATES:
        planned.append(("R", RECEIPT_POSITION, case.receipt, FIXTURE_INTENT))
    if case.receipt == OTHER_RUN:
        planned.append(("O", RECEIPT_POSITION, "submitted", FIXTURE_INTENT))
    if case.others != "none":
        planned.append(("R", OTHERS_POSITION, case.others, FIXTURE_INTENT))
    if case.existing != "none":
        planned.append(("R", BEGIN_POSITION, "submitted",
                        INTENT if case.existing == "same_intent" else OTHER_INTENT))
    return planned


def _entries_for(state: str) -> int:
    """Journal entries an operation in ``state`` has: its begin, and its outcome if any."""
    return 1 + (state in ("committed", "failed", "unknown"))


def _run_row(role: str, run_id: uuid.UUID, case: Case, revision: int,
             parent: uuid.UUID | None) -> dict[str, Any]:
    status = case.fence.status if role == "R" else ("waiting" if role == "P" else "running")
    return {
        "id": run_id, "status": status, "token": TOKEN if role != "P" else 3,
        "owner": "w" if status == "running" else None,
        "cancel": case.fence.cancel and role == "R",
        "finished": status == "succeeded",
        "result": '"earlier"' if status == "succeeded" else None,
        "waiting_for": {"waiting": "timer" if role == "R" else "child run"}.get(status),
        "later": status == "waiting" and role == "R",  # a parent waits for its child only
        "revision": revision, "parent": parent, "parent_position": 0 if parent else None}


_INSERT_RUN = """
INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, workflow_version, input,
    request_digest, status, lease_owner, lease_token, lease_expires_at, revision,
    cancel_requested_at, finished_at, result, waiting_for, available_at, parent_run_id,
    parent_position)
VALUES (%(id)s, 'acme', 'alice', 'wf', '1', '{}', 'r', %(status)s, %(owner)s, %(token)s,
    CASE WHEN %(owner)s::text IS NOT NULL THEN now() + interval '1 hour' END, %(revision)s,
    CASE WHEN %(cancel)s THEN now() END, CASE WHEN %(finished)s THEN now() END,
    %(result)s::jsonb, %(waiting_for)s, CASE WHEN %(later)s THEN now() + interval '1 hour' END,
    %(parent)s, %(parent_position)s)
"""

_INSERT_OP = """
INSERT INTO orchestrator.operations (run_id, position, attempt, tool_name, tool_version,
    effect_class, tenant, principal, intent_digest, arguments, idempotency_key, state,
    worker_id, lease_token, submitted_at)
VALUES (%(run_id)s, %(position)s, 1, 'charge', '1', 'consequential', 'acme', 'alice',
    %(intent)s, '{"amount":1}', %(key)s, %(initial)s, 'w', %(token)s,
    CASE WHEN %(initial)s = 'submitted' THEN now() END)
"""

_SETTLE_OP = """
UPDATE orchestrator.operations SET state = %(state)s,
    receipt = CASE WHEN %(state)s = 'committed' THEN '{"earlier":true}'::jsonb END,
    receipt_digest = CASE WHEN %(state)s = 'committed' THEN 'e' END,
    error = CASE WHEN %(state)s = 'failed' THEN '{"code":"DECLINED"}'::jsonb END,
    finished_at = CASE WHEN %(state)s IN ('committed', 'failed') THEN now() END
WHERE run_id = %(run_id)s AND position = %(position)s AND state = 'submitted'
"""

_INSERT_ENTRY = """
INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name, schema_version,
                                          payload,
                                  lease_token)
VALUES (%(run_id)s, %(seq)s, %(kind)s, %(position)s, %(name)s, 1, %(payload)s::jsonb,
        %(token)s)
"""


def _fixture_journal(copy: Copy, planned: list[tuple[str, int, str, str]]) -> list[dict[str, Any]]:
    """Each run's journal as a worker would have written it: a value, then each operation's
    begin and outcome; a run's revision is its last seq."""
    rows = []
    for role, run_id in copy.ids.items():
        events: list[tuple[str, int, str | None, dict[str, Any]]] = []
        if role != "P":
            events.append((EventKind.VALUE, 0, "now", {"value": 0}))
        for op_role, position, state, intent in planned:
            if op_role != role:
                continue
            op = copy.ops[(role, position, 1)]
            kind = EventKind.CALL_PENDING if state == "pending" else EventKind.CALL_SUBMITTED
            events.append((kind, position, TOOL, {
                "tool_version": VERSION, "intent": intent, "attempt": 1, "op": op,
                "key": f"k-{position}-1", "effect": EFFECT}))
            outcome = {"committed": (EventKind.CALL_COMPLETED, {"result": {"earlier": True},
                                                                "op": op}),
                       "failed": (EventKind.CALL_FAILED, {
                           "op": op, "attempt": 1, "cause": "declined", "reason": "cause",
                           "incident": None}),
                       "unknown": (EventKind.CALL_UNKNOWN, {"op": op, "reason": "WORKER_LOST",
                                                            "next": "reconcile"})}.get(state)
            if outcome is not None:
                events.append((outcome[0], position, TOOL, outcome[1]))
        rows += [{"run_id": run_id, "seq": seq, "kind": str(kind), "position": position,
                  "name": name, "payload": json.dumps(payload), "token": TOKEN}
                 for seq, (kind, position, name, payload) in enumerate(events, start=1)]
    return rows


async def build(app: Orchestrator, cases: list[Case]) -> list[tuple[Copy, Copy]]:
    """Every case's state, twice, committed."""
    copies: list[tuple[Copy, Copy]] = []
    runs, ops, settles = [], [], []
    plans: dict[int, list[tuple[str, int, str, str]]] = {}
    for case in cases:
        pair = []
        planned = _planned_ops(case)
        for _ in range(2):
            roles = ["R"] + (["O"] if case.receipt == OTHER_RUN else []) + (
                ["P"] if case.parent else [])
            ids = {role: uuid.uuid4() for role in roles}
            copy = Copy(case, ids, 0, {})
            plans[id(copy)] = planned
            for role in reversed(roles):  # the parent first
                revision = (0 if role == "P" else 1) + sum(
                    _entries_for(state) for r, _, state, _ in planned if r == role)
                if role == "R":
                    copy.revision = revision
                runs.append(_run_row(role, ids[role], case, revision,
                                     ids.get("P") if role == "R" else None))
            for role, position, state, intent in planned:
                ops.append({"run_id": ids[role], "position": position, "intent": intent,
                            "key": f"k-{position}-1", "token": TOKEN,
                            "initial": "pending" if state == "pending" else "submitted"})
                if state not in ("pending", "submitted"):
                    settles.append({"run_id": ids[role], "position": position, "state": state})
            pair.append(copy)
        copies.append((pair[0], pair[1]))
    async with app.database.connection() as conn, conn.transaction():
        cur = conn.cursor()
        await cur.executemany(_INSERT_RUN, runs)
        await cur.executemany(_INSERT_OP, ops)
        await cur.executemany(_SETTLE_OP, settles)
        by_run = {c.ids[role]: (c, role) for pair in copies for c in pair for role in c.ids}
        found = await (await conn.execute(
            "SELECT id, run_id, position, attempt FROM orchestrator.operations "
            "WHERE run_id = ANY(%s)", (list(by_run),))).fetchall()
        for op in found:
            copy, role = by_run[op["run_id"]]
            copy.ops[(role, op["position"], op["attempt"])] = op["id"]
        journal = [row for pair in copies for c in pair
                   for row in _fixture_journal(c, plans[id(c)])]
        await cur.executemany(_INSERT_ENTRY, journal)
    return copies


# -- the two forms ----------------------------------------------------------------------------

def _receipt(copy: Copy) -> tuple[steps_db.Receipt, Any] | None:
    """The riding receipt of a case (its canonical text, and the value workflow code gets)."""
    if copy.case.receipt == "none":
        return None
    role = "O" if copy.case.receipt == OTHER_RUN else "R"
    value = VALUES[copy.case.value]
    text = LIMITS.text(value, "$.receipt")
    return (steps_db.Receipt(op_id=copy.ops[(role, RECEIPT_POSITION, 1)],
                           position=RECEIPT_POSITION, name=TOOL, text=text,
                           digest=canonical.text_digest(text)), canonical.as_stored(value))


def _begin_row(copy: Copy) -> dict[str, Any]:
    """The row ``Call.begin`` builds for the call at BEGIN_POSITION, first attempt."""
    return {"run_id": copy.run_id, "position": BEGIN_POSITION, "attempt": 1,
            "tool_name": TOOL, "tool_version": VERSION, "effect_class": EFFECT,
            "tenant": "acme", "principal": "alice", "intent_digest": INTENT,
            "arguments": LIMITS.text({"v": VALUES[copy.case.value]}, "$.arguments"),
            "idempotency_key": f"k-{BEGIN_POSITION}-1", "worker_id": "w", "token": copy.token}


def _result(copy: Copy) -> tuple[str, Any]:
    value = VALUES[copy.case.value]
    return LIMITS.text(value, "$.result"), value


def fast_statement(copy: Copy) -> Any:
    riding = _receipt(copy)
    receipt = None if riding is None else riding[0]
    if copy.case.pair == "begin":
        return steps_db.operation_begin_fast(_begin_row(copy), expected=copy.expected,
                                           v=SCHEMA_VERSION, receipt=receipt)
    if copy.case.pair == "receipt":
        assert receipt is not None
        return steps_db.receipt_commit_fast(receipt, run_id=copy.run_id, token=copy.token,
                                          expected=copy.expected, v=SCHEMA_VERSION)
    return steps_db.run_succeed_fast(run_id=copy.run_id, token=copy.token,
                                    expected=copy.expected, result=_result(copy)[0],
                                    v=SCHEMA_VERSION, receipt=receipt)


def _session(app: Orchestrator, writer: GroupWriter, copy: Copy) -> Session:
    """The engine's session of the run as the caller holds it (its token, its revision)."""
    claim = {"id": copy.run_id, "tenant": "acme", "principal": "alice",
             "lease_token": copy.token, "deadline_at": None, "cancel_requested_at": None,
             "input_text": "{}", "workflow_name": "wf", "workflow_version": "1",
             "db_now": datetime.now(UTC)}
    run = RunState(claim, [], worker_id="w", metrics=Metrics())
    return Session(run, copy.expected, config=EngineConfig(), database=app.database,
                   writer=writer)


async def general_form(session: Session, copy: Copy) -> Any:
    """The general form of the case's pair, in one transaction, as the engine writes it."""
    riding = _receipt(copy)
    run = session.run
    if copy.case.pair == "receipt":  # Session.settle_locked, once the fast form missed
        assert riding is not None
        return await session.write_locked(session.rider.commit_work(*riding),
                                          with_buffer=False)
    if copy.case.pair == "begin":
        row = _begin_row(copy)

        async def work(conn: Any) -> tuple[tuple[int, str], list[Entry]]:  # Call.begin's
            op_id, status = await ops_db.operation_begin(conn, row, pending=False)
            kind = EventKind.CALL_SUBMITTED if status == "submitted" else EventKind.CALL_PENDING
            events = [entry(kind, BEGIN_POSITION, TOOL, {
                "tool_version": VERSION, "intent": INTENT, "attempt": 1, "op": op_id,
                "key": row["idempotency_key"], "effect": EFFECT})]
            if status == "cancelled":
                events.append(entry(EventKind.CALL_CANCELLED, BEGIN_POSITION, TOOL,
                                    {"op": op_id, "why": "cancelled"}))
            return (op_id, status), events

        return await session.write_locked(work, new_work=True,
                                          riding=[] if riding is None else [riding])
    text, result = _result(copy)
    ev = entry(EventKind.RUN_COMPLETED, None, None, {"result": result})  # Outcome._succeed's

    async def last(conn: Any, events: list[Entry]) -> None:  # Outcome._terminal's
        await ops_db.operation_enqueue_unlisted(conn, run_id=run.run_id)
        await journal_db.journal_append(conn, run_id=run.run_id, token=run.token,
                                        expected=session.revision, events=[*events, ev])
        await runs_db.run_finish(conn, run_id=run.run_id, token=run.token, status="succeeded",
                                 outcome_code=None, result=text, error=None)

    async def tx(conn: Any) -> None:  # Session.last_write's, with the riding receipts
        riding_events = await session.rider.commit_riding(conn, [] if riding is None
                                                          else [riding])
        await last(conn, riding_events + session.buffered)

    return await session.writer.run_in_transaction(tx)


# -- what the database holds ------------------------------------------------------------------

_SNAPSHOT = {
    "runs": """
        SELECT id AS run_id, status, revision, result::text, outcome_code, error::text,
               waiting_for, lease_owner, lease_token, lease_expires_at IS NOT NULL AS leased,
               finished_at IS NOT NULL AS finished, cancel_requested_at IS NOT NULL AS cancel,
               CASE WHEN available_at IS NULL THEN 'never'
                    WHEN available_at > now() + interval '1 minute' THEN 'later'
                    ELSE 'due' END AS available, parent_run_id IS NOT NULL AS child
        FROM orchestrator.runs WHERE id = ANY(%(ids)s)""",
    "operations": """
        SELECT id, run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
               principal, intent_digest, arguments::text, idempotency_key, state,
               receipt::text, receipt_digest, error::text, worker_id, lease_token,
               submitted_at IS NOT NULL AS submitted, finished_at IS NOT NULL AS finished
        FROM orchestrator.operations WHERE run_id = ANY(%(ids)s)""",
    "journal": """
        SELECT run_id, seq, kind, position, name, schema_version, lease_token,
               (payload - 'op')::text AS payload, payload->>'op' AS op
        FROM orchestrator.journal WHERE run_id = ANY(%(ids)s)""",
    "reconciliation": """
        SELECT run_id, operation_id, reason, state, evidence::text
        FROM orchestrator.reconciliation_items WHERE run_id = ANY(%(ids)s)""",
}


async def snapshot(app: Orchestrator, copies: Iterable[Copy]) -> dict[int, dict[str, Any]]:
    """Each copy's rows (keyed by ``id(copy)``), with runs named by role and operations by
    (role, position, attempt), so that the two copies of a case compare equal."""
    copies = list(copies)
    role_of = {run_id: (c, role) for c in copies for role, run_id in c.ids.items()}
    views: dict[int, dict[str, Any]] = {id(c): {"runs": {}, "operations": {}, "journal": {},
                                                "reconciliation": {}} for c in copies}
    async with app.database.connection() as conn:
        rows = {name: await (await conn.execute(query, {"ids": list(role_of)})).fetchall()
                for name, query in _SNAPSHOT.items()}
    label = {}
    for op in rows["operations"]:
        copy, role = role_of[op["run_id"]]
        label[op["id"]] = copy.names[op["id"]] = (role, op["position"], op["attempt"])

    def name(op: Any) -> Any:
        return None if op is None else label.get(int(op), ("a missing operation", op))

    for table, key in (("runs", lambda r: ()), ("operations", lambda r: (r["position"],
                                                                         r["attempt"])),
                       ("journal", lambda r: (r["seq"],)),
                       ("reconciliation", lambda r: (name(r["operation_id"]),))):
        for row in rows[table]:
            copy, role = role_of[row.pop("run_id")]
            row.pop("id", None)
            if table == "journal":
                row["op"] = name(row["op"])
            if table == "reconciliation":
                row["operation_id"] = name(row["operation_id"])
            views[id(copy)][table][(role, *key(row))] = row
    return views


# -- running a matrix -------------------------------------------------------------------------

@dataclass
class Verdict:
    """How a form ended: applied (with the caller's value), or refused (with the error)."""

    applied: bool
    value: Any = None
    error: str = ""

    def __str__(self) -> str:
        return "applied" if self.applied else f"refused ({self.error})"


async def apply_fast(writer: GroupWriter, copy: Copy) -> Verdict:
    try:
        value = await writer.run_statement(fast_statement(copy))
    except steps_db.FastPathMiss:
        return Verdict(False, error="FastPathMiss")
    except Exception as exc:  # noqa: BLE001 - any other error is a finding, reported below
        return Verdict(False, error=f"{UNEXPECTED} {type(exc).__name__}: {exc}")
    return Verdict(True, value)


async def apply_general(app: Orchestrator, writer: GroupWriter, copy: Copy
                        ) -> tuple[Verdict, Session]:
    session = _session(app, writer, copy)
    try:
        value = await general_form(session, copy)
    except (Exception, Stop) as exc:  # noqa: BLE001 - LeaseLost, Stop, identity reused ...
        return Verdict(False, error=type(exc).__name__), session
    return Verdict(True, value), session


def _diff(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("fast", "general")
          ) -> str:
    lines = []
    for table in a:
        for key in sorted(set(a[table]) | set(b[table]), key=repr):
            left, right = a[table].get(key), b[table].get(key)
            if left != right:
                if left and right:  # the columns that differ
                    left = {k: v for k, v in left.items() if right.get(k) != v}
                    right = {k: v for k, v in right.items() if k in left}
                lines.append(f"      {table} {key}: {names[0]} {left} / {names[1]} {right}")
    return "\n".join(lines)


def _returns_match(case: Case, fast: Copy, general: Copy, fv: Verdict, gv: Verdict,
                   session: Session) -> str:
    """The callers' values agree: the same new operation, the same cancellation news."""
    if case.pair == "begin":
        new = (fast.names.get(fv.value[0]), general.names.get(gv.value[0]))
        if new != (("R", BEGIN_POSITION, 1),) * 2 or gv.value[1] != "submitted":
            return f"    returned {fv.value} / {gv.value} ({new})"
    if case.pair == "receipt" and (fv.value[1] is not None) != session.run.cancel_requested:
        return (f"    cancellation: fast says {fv.value[1]}, general noted "
                f"{session.run.cancel_requested}")
    return ""


async def run_matrix(app: Orchestrator, cases: list[Case],
                     expect_general: Callable[[Case], bool] = general_applies) -> list[str]:
    """Apply both forms of every case and return what disagrees (empty: all agree)."""
    copies = await build(app, cases)
    every = [c for pair in copies for c in pair]
    before = await snapshot(app, every)
    verdicts: list[Any] = [None] * len(copies)

    async def lane(start: int) -> None:  # the cases are independent: a few lanes at once
        writer = GroupWriter(app.database)
        for i in range(start, len(copies), LANES):
            fast, general = copies[i]
            fv = await apply_fast(writer, fast)
            gv, session = await apply_general(app, writer, general)
            verdicts[i] = (fv, gv, session)

    await asyncio.gather(*(lane(start) for start in range(LANES)))
    after = await snapshot(app, every)
    problems = []
    for (fast, general), (fv, gv, session) in zip(copies, verdicts, strict=True):
        found = _judge(fast, general, fv, gv, session, before, after, expect_general)
        if found:
            problems.append(f"{fast.case} (fast {fv}, general {gv}):\n" + "\n".join(found))
    await app.database.close()
    return problems


def _judge(fast: Copy, general: Copy, fv: Verdict, gv: Verdict, session: Session,
           before: dict[int, Any], after: dict[int, Any],
           expect_general: Callable[[Case], bool]) -> list[str]:
    """What is wrong with one case's outcome (nothing: an empty list)."""
    case, found = fast.case, []
    was_f, was_g, now_f, now_g = (before[id(fast)], before[id(general)], after[id(fast)],
                                  after[id(general)])
    if fv.error.startswith(UNEXPECTED):  # the engine falls back on FastPathMiss only
        found.append(f"    the fast form raised {fv.error[len(UNEXPECTED):]}, not a miss")
    if fv.applied != fast_applies(case):
        found.append(f"    fast form {fv}, the contract says "
                     f"{'applied' if fast_applies(case) else 'refused'}")
    if gv.applied != expect_general(case):
        found.append(f"    general form {gv}, the contract says "
                     f"{'applied' if expect_general(case) else 'refused'}")
        if gv.applied:
            found.append("    it wrote:\n" + _diff(was_g, now_g, ("before", "after")))
    if fv.applied and not gv.applied:
        found.append(f"    the fast form applied, the general form {gv}")
    elif fv.applied and now_f != now_g:
        found.append("    the two forms wrote different rows:\n" + _diff(now_f, now_g))
    elif fv.applied:
        found.append(_returns_match(case, fast, general, fv, gv, session))
    elif now_f != was_f:
        found.append("    the fast form missed but wrote:\n"
                     + _diff(was_f, now_f, ("before", "after")))
    if not gv.applied and now_g != was_g:
        found.append("    the general form was refused but wrote:\n"
                     + _diff(was_g, now_g, ("before", "after")))
    if gv.applied and case.pair == "begin" and (gv.value[1] == "cancelled") != case.fence.cancel:
        found.append(f"    the general begin returned {gv.value} (cancel {case.fence.cancel})")
    return [f for f in found if f]


def _report(problems: list[str]) -> str:
    shown = "\n".join(problems[:15])
    more = f"\n... and {len(problems) - 15} more" if len(problems) > 15 else ""
    return f"{len(problems)} state(s) where the two forms disagree:\n{shown}{more}"


# -- the matrices -----------------------------------------------------------------------------

BEGIN_CASES = matrix(Case("begin", fence, receipt=receipt, existing=existing)
               for fence in FENCES
               for receipt in ("none", *RECEIPT_STATES, OTHER_RUN)
               for existing in ("none", "same_intent", "other_intent"))
RECEIPT_CASES = matrix(Case("receipt", fence, receipt=receipt)
                       for fence in FENCES for receipt in (*RECEIPT_STATES, OTHER_RUN))
SUCCESS_CASES = matrix(Case("success", fence, receipt=receipt, others=others, parent=parent)
                 for fence in FENCES
                 for receipt in ("none", *RECEIPT_STATES, OTHER_RUN)
                 for others in ("none", "pending", "submitted", "unknown", "committed")
                 for parent in (False, True)
                 if parent is False or others in ("none", "submitted"))


def test_the_matrices_cover_every_state_and_both_verdicts() -> None:
    """The matrices are what the module docstring says, and each has states where the fast
    form applies and states where it does not (a matrix that cannot fail is no test)."""
    assert (len(BEGIN_CASES), len(RECEIPT_CASES), len(SUCCESS_CASES)) == (300, 96, 732)
    for cases in (BEGIN_CASES, RECEIPT_CASES, SUCCESS_CASES):
        assert len(set(cases)) == len(cases)
        verdicts = {fast_applies(c) for c in cases}
        assert verdicts == {True, False}


async def test_a_call_begin_is_guarded_alike_by_both_forms(app: Orchestrator) -> None:
    """``call.submitted`` (with or without a riding receipt): the lease, the run's status, the
    revision, a cancellation, an operation already holding the call's identity (same or
    another intent), and the riding receipt's operation in every state."""
    problems = await run_matrix(app, BEGIN_CASES, general_applies)
    assert not problems, _report(problems)


async def test_a_lone_receipt_is_guarded_alike_by_both_forms(app: Orchestrator) -> None:
    """``submitted → committed`` with ``call.completed``: the operation submitted, pending,
    committed, failed or unknown, under every fence state (a cancellation does not stop a
    receipt: the call happened)."""
    problems = await run_matrix(app, RECEIPT_CASES, general_applies)
    assert not problems, _report(problems)


async def test_a_run_success_is_guarded_alike_by_both_forms(app: Orchestrator) -> None:
    """``succeeded`` with ``run.completed`` (with or without a riding receipt): every fence
    state, the riding receipt's operation in every state, another operation of the run left
    pending, submitted, unknown or settled, and a waiting parent that the success wakes."""
    problems = await run_matrix(app, SUCCESS_CASES, general_applies)
    assert not problems, _report(problems)


async def test_both_forms_write_the_same_json_whatever_it_holds(app: Orchestrator) -> None:
    """Where both forms apply, the receipt, the result and the arguments are stored and
    journalled alike for values that canonical JSON treats specially: key order, exponents,
    negative zero, big integers, non-ASCII keys and line separators, nested empties."""
    cases = [Case(pair, OPEN, receipt=receipt, value=value)
             for value in range(len(VALUES))
             for pair, receipt in (("begin", "none"), ("begin", "submitted"),
                                   ("receipt", "submitted"), ("success", "none"),
                                   ("success", "submitted"))]
    assert all(fast_applies(c) for c in cases)
    problems = await run_matrix(app, cases)
    assert not problems, _report(problems)


async def test_the_matrix_sees_a_fast_row_that_misses_and_still_writes(app: Orchestrator) -> None:
    """The check that a missed fast row wrote nothing is not vacuous: with ``row_applied``
    made to return instead of raise, a begin whose fence holds but whose operation exists
    already moves the run's revision without an event and is committed all the same (the
    group writer commits before it reads the rows' results); the matrix says so."""
    async with app.database.connection() as conn:
        await conn.execute("CREATE OR REPLACE FUNCTION orchestrator.row_applied(applied boolean, "
                           "what text) RETURNS boolean LANGUAGE sql AS 'SELECT applied'")
    cases = [Case("begin", OPEN, existing=existing)
             for existing in ("same_intent", "other_intent")]
    problems = await run_matrix(app, cases)
    assert len(problems) == 2 and all("the fast form missed but wrote" in p and
                                      "runs ('R',): before {'revision': 2} / after "
                                      "{'revision': 3}" in p for p in problems), problems


async def test_the_general_forms_refuse_a_receipt_of_another_run(app: Orchestrator) -> None:
    """A receipt is committed only for an operation of the run that writes it. The fast forms
    require ``o.run_id = x.run_id``; the general form must refuse it as well (and so write
    nothing), whichever pair carries it."""
    cases = [c for c in (*BEGIN_CASES, *RECEIPT_CASES, *SUCCESS_CASES) if another_runs_receipt(c)]
    # with and without a cancellation: begin; receipt; success (others none ×
    # parent or not, others committed)
    assert len(cases) == 2 * (1 + 1 + 3)
    problems = await run_matrix(app, cases)
    assert not problems, _report(problems)
