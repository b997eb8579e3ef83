"""The invariants the chaos harness checks once the system is quiescent, and the printed table.

Everything here is a pure function of what was loaded from the orchestrator's database, from
the harness's effect sink and from the harness's own fault log, so it can be read (and tested)
on its own. Each check returns the offending items with a one-line explanation.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = ("succeeded", "failed", "cancelled")
TERMINAL_EVENTS = ("run.completed", "run.failed", "run.cancelled", "run.continued")
SETTLING_EVENTS = ("call.completed", "call.failed", "call.abandoned")
UNCERTAIN_FAULTS = ("hang", "late", "error_after", "error_before")
GRACE = 1.0  # seconds around a dispatch window when matching faults to it
TRACEBACK_LINES = 30  # of a failed run's incident, printed under it in the report
# A connection dropped while idle in a pool fails only when it is next used, which can be a
# while later: a database fault explains what goes wrong this long after it.
DB_FAULT_REACH = 10.0


@dataclass
class Interval:
    start: float
    end: float
    kind: str


@dataclass
class ProcRecord:
    """One process the harness started (a worker or the reconciler)."""

    role: str
    pid: int
    started: float
    ended: float | None = None
    faults: list[Interval] = field(default_factory=list)  # things done to this process
    exit_code: int | None = None  # once it ended: its status (negative: the signal)


@dataclass
class Observed:
    """What the harness knows without asking the orchestrator."""

    submitted: dict[str, uuid.UUID | None]  # run idempotency key -> run id (None: not accepted)
    procs: list[ProcRecord]
    db_faults: list[Interval]  # connection terminations, server restarts: every worker
    poison: set[uuid.UUID] = field(default_factory=set)  # runs planted with unreadable input


@dataclass
class Data:
    runs: list[dict[str, Any]]
    journal: list[dict[str, Any]]
    ops: list[dict[str, Any]]
    items: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    effects: list[dict[str, Any]]
    now: float


@dataclass
class Row:
    name: str
    value: int
    required: int | None  # None: informative only
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.required is None or self.value == self.required


@dataclass
class Verdict:
    rows: list[Row]
    stats: dict[str, Any]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _by(rows: list[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r[key]].append(r)
    return out


# -- runs lost ----------------------------------------------------------------------------------


def runs_lost(data: Data, observed: Observed) -> Row:
    """Submitted runs that are neither terminal, nor waiting on a timer/event/child, nor blocked
    on an unknown operation that is listed for operators."""
    details: list[str] = []
    runs = {r["id"]: r for r in data.runs}
    for key, run_id in observed.submitted.items():
        if run_id is None:
            details.append(f"submission {key}: never accepted")
        elif run_id not in runs:
            details.append(f"submission {key}: run {run_id} is missing from the database")
    listed = _listed_groups(data)
    unknown_by_run = _by([o for o in data.ops if o["state"] == "unknown"], "run_id")
    children = _by([r for r in data.runs if r["parent_run_id"] is not None], "parent_run_id")
    for run in data.runs:
        status = run["status"]
        if status in TERMINAL:
            continue
        if status == "needs_reconciliation":
            blocking = unknown_by_run.get(run["id"], [])
            unlisted = [o["id"] for o in blocking if _group(o) not in listed]
            if blocking and not unlisted:
                continue
            if not blocking:
                details.append(f"run {run['id']} ({run['workflow_name']}) is blocked "
                               f"({run['waiting_for']}) but none of its operations is unknown")
            else:
                details.append(f"run {run['id']} ({run['workflow_name']}) is blocked on "
                               f"operations {unlisted} that no operator list shows")
            continue
        if status == "waiting":
            wake = _ts(run["available_at"])
            if wake is not None and wake > data.now - 30:
                continue  # a timer or an event timeout that is still due
            if wake is None and any(c["status"] not in TERMINAL
                                    for c in children.get(run["id"], [])):
                continue  # waits for a child that is itself accounted for
        details.append(f"run {run['id']} ({run['workflow_name']}) is {status}"
                       f" ({run['waiting_for'] or 'no reason given'})")
    return Row("runs lost", len(details), 0, details)


# -- duplicate effects --------------------------------------------------------------------------


def duplicate_consequential(data: Data) -> Row:
    """Applications of a consequential tool per operation (run, position) beyond the first."""
    groups = _by([e for e in data.effects if e["effect"] == "consequential"], "_where")
    details = []
    for (run_id, position), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len(rows) > 1:
            keys = ", ".join(f"{e['key']} (pid {e['pid']})" for e in rows)
            details.append(f"run {run_id} position {position} ({rows[0]['tool']}) applied "
                           f"{len(rows)} times: {keys}")
    extra = sum(len(rows) - 1 for rows in groups.values() if len(rows) > 1)
    return Row("duplicate consequential effects", extra, 0, details)


def idempotent_key_changes(data: Data) -> Row:
    """Idempotent calls sent with a different key for an operation (run, position) whose
    effect had already been applied under another key. A late request (:func:`_late_calls`)
    that the provider refused is left out: its key was voided when a lookup or an operator
    proved it not applied, before the new key was chosen; a worker paused past its lease
    between the dispatch check and the request sent it (the residual window, counted in
    "calls sent after another worker took the run"), and it applied nothing. A refused
    request from the lease's holder still counts."""
    harmless = {id(c) for c in _late_calls(data) if c["outcome"] == "refused"}
    applied = _by([e for e in data.effects if e["effect"] == "idempotent"], "_where")
    calls = _by([c for c in data.calls
                 if c["effect"] == "idempotent" and id(c) not in harmless], "_where")
    details = []
    for where, effects in applied.items():
        first = min(effects, key=lambda e: e["at"])
        for call in calls.get(where, []):
            if call["key"] != first["key"] and call["started_at"] > first["at"]:
                details.append(f"run {where[0]} position {where[1]} ({call['tool']}): applied "
                               f"as {first['key']}, then sent again as {call['key']}")
        keys = {e["key"] for e in effects}
        if len(keys) > 1:
            details.append(f"run {where[0]} position {where[1]}: applied under {len(keys)} "
                           f"keys {sorted(keys)}")
    return Row("idempotent re-sends with a different key", len(details), 0, details)


# -- unknown operations -------------------------------------------------------------------------


def _pid(worker_id: str | None) -> int | None:
    try:
        return int(str(worker_id).split(":")[-2])
    except (IndexError, ValueError):
        return None


def _process(observed: Observed, pid: int | None, at: float) -> ProcRecord | None:
    for proc in observed.procs:
        if proc.pid == pid and proc.started - GRACE <= at and (
                proc.ended is None or at <= proc.ended + GRACE):
            return proc
    return None


def _overlaps(interval: Interval, start: float, end: float) -> bool:
    return interval.start <= end + GRACE and interval.end >= start - GRACE


def _listed_groups(data: Data) -> set[tuple[Any, Any, Any]]:
    """(run, position, key) of every operation whose queue item is with operators. An unknown
    operation is listed when its group is: an idempotent re-send shares its key with earlier
    attempts, and resolving one item settles the whole group."""
    ops = {o["id"]: o for o in data.ops}
    return {(ops[i["operation_id"]]["run_id"], ops[i["operation_id"]]["position"],
             ops[i["operation_id"]]["idempotency_key"])
            for i in data.items if i["state"] == "operator" and i["operation_id"] in ops}


def _group(op: dict[str, Any]) -> tuple[Any, Any, Any]:
    return op["run_id"], op["position"], op["idempotency_key"]


def unknown_operations(data: Data, observed: Observed) -> tuple[Row, Row, dict[str, int]]:
    """Every operation that became unknown needs a fault in its dispatch window (from its
    ``submitted`` commit to the moment it was marked unknown) and must end auto-resolved,
    settled by a permitted re-send, or listed for operators."""
    marked: dict[int, dict[str, Any]] = {}  # the event that first marked each one unknown
    for ev in sorted(data.journal, key=lambda e: (str(e["run_id"]), e["seq"])):
        if ev["kind"] == "call.unknown":
            marked.setdefault(int(ev["payload"]["op"]), ev)
    ops = {o["id"]: o for o in data.ops}
    items = {i["operation_id"]: i for i in data.items}
    listed = _listed_groups(data)
    injected: dict[int, str] = {}
    for call in data.calls:
        if call["fault"] in UNCERTAIN_FAULTS:
            injected[call["op_id"]] = call["fault"]
    unexplained, unresolved = [], []
    stats: Counter[str] = Counter()
    for op_id, ev in sorted(marked.items()):
        op = ops.get(op_id)
        if op is None:
            unexplained.append(f"operation {op_id}: marked unknown in the journal of run "
                               f"{ev['run_id']} but missing from the ledger")
            continue
        reason = ev["payload"].get("reason", "?")
        start = _ts(op["submitted_at"]) or 0.0
        end = _ts(ev["created_at"]) or data.now
        why = None
        if op_id in injected:
            why = "tool"
        proc = _process(observed, _pid(op["worker_id"]), start)
        if why is None and proc is not None:
            if any(_overlaps(f, start, end) for f in proc.faults):
                why = "process"
            elif proc.ended is not None and start - GRACE <= proc.ended <= end + GRACE:
                why = "process"
        if why is None and any(f.start <= end + GRACE and f.end >= start - DB_FAULT_REACH
                               for f in observed.db_faults):
            why = "database"
            if reason != "WORKER_LOST":  # worth a look: the fault reached the call's outcome
                stats[f"{reason} explained by a database fault"] += 1
        if why is None:
            where = "unknown process" if proc is None else f"pid {proc.pid}"
            unexplained.append(
                f"operation {op_id} ({op['tool_name']}, run {op['run_id']} position "
                f"{op['position']} attempt {op['attempt']}, {where}): {reason} with no fault "
                f"between {start:.3f} and {end:.3f}")
        else:
            stats[f"explained by {why} fault"] += 1
        item = items.get(op_id)
        if op["state"] == "unknown":
            if _group(op) in listed:
                stats["listed for operators"] += 1
            else:
                state = "no queue item" if item is None else f"queue item {item['state']}"
                unresolved.append(f"operation {op_id} ({op['tool_name']}, run {op['run_id']}) "
                                  f"is unknown with {state}")
        elif item is not None and item["state"] == "resolved":
            stats[f"resolved {item['resolution']}"] += 1
        elif op["state"] in ("committed", "not_applied") and ev["payload"].get("next") in (
                "resend", "new_attempt"):
            stats[f"settled by {ev['payload']['next']}"] += 1
        else:
            unresolved.append(f"operation {op_id} ({op['tool_name']}) left unknown and ended "
                              f"{op['state']} without a resolution")
    stats["unknown operations"] = len(marked)
    return (Row("unexplained unknowns", len(unexplained), 0, unexplained),
            Row("unknowns neither auto-resolved nor listed for operators", len(unresolved), 0,
                unresolved),
            dict(stats))


# -- journal integrity --------------------------------------------------------------------------


def journal_integrity(data: Data) -> Row:
    """Contiguous sequence numbers equal to the revision, lease tokens that never go back,
    one terminal event (last) for a finished run, nothing after a settled call, and the journal
    and the ledger telling the same story about every call."""
    details: list[str] = []
    runs = {r["id"]: r for r in data.runs}
    ops = {o["id"]: o for o in data.ops}
    for run_id, events in _by(data.journal, "run_id").items():
        events.sort(key=lambda e: e["seq"])
        run = runs.get(run_id)
        seqs = [e["seq"] for e in events]
        if seqs != list(range(1, len(events) + 1)):
            details.append(f"run {run_id}: sequence numbers are not 1..{len(events)}")
        if run is not None and run["revision"] != len(events):
            details.append(f"run {run_id}: revision {run['revision']} but {len(events)} events")
        tokens = [e["lease_token"] for e in events]
        if any(b < a for a, b in zip(tokens, tokens[1:], strict=False)):
            details.append(f"run {run_id}: a writer with an older lease wrote after a newer "
                           f"one (tokens {tokens})")
        terminal = [e for e in events if e["kind"] in TERMINAL_EVENTS]
        if len(terminal) > 1 or (terminal and terminal[-1] is not events[-1]):
            details.append(f"run {run_id}: {len(terminal)} terminal events, not exactly one last")
        if run is not None and (run["status"] in TERMINAL) != bool(terminal):
            details.append(f"run {run_id}: status {run['status']} but terminal events "
                           f"{[e['kind'] for e in terminal]}")
        settled: dict[int, str] = {}
        attempts: dict[int, set[int]] = defaultdict(set)
        for ev in events:
            pos = ev["position"]
            if pos is not None and pos in settled and ev["kind"].startswith("call."):
                details.append(f"run {run_id}: {ev['kind']} at position {pos} after "
                               f"{settled[pos]}")
            if ev["kind"] in SETTLING_EVENTS:
                settled[pos] = ev["kind"]
            payload = ev["payload"] or {}
            if ev["kind"] == "call.submitted":
                if payload.get("attempt") in attempts[pos]:
                    details.append(f"run {run_id}: attempt {payload.get('attempt')} at position "
                                   f"{pos} submitted twice")
                attempts[pos].add(payload.get("attempt"))
                op = ops.get(payload.get("op"))
                if op is None or (op["run_id"], op["position"], op["attempt"]) != (
                        run_id, pos, payload.get("attempt")):
                    details.append(f"run {run_id}: call.submitted at position {pos} names "
                                   f"operation {payload.get('op')}, which the ledger does not "
                                   "have there")
            if ev["kind"] == "call.completed":
                op = ops.get(payload.get("op"))
                if op is None or op["state"] != "committed":
                    details.append(f"run {run_id}: call.completed for operation "
                                   f"{payload.get('op')} that the ledger has "
                                   f"{None if op is None else op['state']}")
    with_events = {e["run_id"] for e in data.journal}
    for run in data.runs:
        if run["revision"] and run["id"] not in with_events:
            details.append(f"run {run['id']}: revision {run['revision']} but no events")
    return Row("journal integrity violations", len(details), 0, details)


# -- ledger and sink ----------------------------------------------------------------------------


def ledger_sink_agreement(data: Data) -> Row:
    """Every committed operation has exactly one effect with its key (a committed read: one
    completed call); not_applied, cancelled and failed ones applied none; nothing is left in
    flight; and no effect exists whose key the ledger does not know."""
    details: list[str] = []
    effects_by_key = _by(data.effects, "key")
    effects_by_op = _by(data.effects, "op_id")
    reads_by_key = _by([c for c in data.calls if c["effect"] == "read" and c["outcome"] == "ok"],
                       "key")
    runs = {r["id"]: r for r in data.runs}
    known_keys = set()
    for op in data.ops:
        key = op["idempotency_key"]
        known_keys.add(key)
        state = op["state"]
        label = f"operation {op['id']} ({op['tool_name']}, {state}, key {key})"
        if op["effect_class"] == "read":
            if state == "committed" and len(reads_by_key.get(key, [])) != 1:
                details.append(f"{label}: {len(reads_by_key.get(key, []))} completed reads")
            continue
        found = effects_by_key.get(key, [])
        if state == "committed":
            if len(found) != 1:
                details.append(f"{label}: {len(found)} effects with its key")
            elif (op["receipt"] or {}).get("effect") != found[0]["id"]:
                details.append(f"{label}: receipt {op['receipt']} does not name effect "
                               f"{found[0]['id']}")
        elif state in ("not_applied", "cancelled", "failed") and effects_by_op.get(op["id"]):
            # By the operation, not the key: an idempotent re-send shares its key with an
            # earlier attempt that may have applied.
            details.append(f"{label}: {len(effects_by_op[op['id']])} effects applied by it")
        elif state in ("pending", "submitted"):
            run = runs.get(op["run_id"])
            details.append(f"{label}: still in flight at quiescence (run "
                           f"{None if run is None else run['status']})")
    for key, rows in effects_by_key.items():
        if key not in known_keys:
            details.append(f"effect {rows[0]['id']} ({rows[0]['tool']}) with key {key} that "
                           "no operation in the ledger has")
    return Row("ledger/sink disagreements", len(details), 0, details)


# An unexpected exception ends a worker with this status (the CLI's INTERNAL).
EXIT_INTERNAL = 70
# What the harness does to workers: SIGKILL; SIGTERM is handled (a drain, then status 0).
HARNESS_SIGNALS = (-9, -15)


def workers_killed_by_a_run(observed: Observed) -> Row:
    """Worker processes that ended on an unexpected error (status 70) or on a signal the
    harness never sends (a crash in the interpreter): what a poison run did before its
    content was decoded per run."""
    details = [f"worker pid {p.pid} ended with status {p.exit_code}" for p in observed.procs
               if p.role == "worker" and p.exit_code is not None
               and (p.exit_code == EXIT_INTERNAL
                    or (p.exit_code < 0 and p.exit_code not in HARNESS_SIGNALS))]
    return Row("workers killed by a run", len(details), 0, details)


def poison_runs(data: Data, observed: Observed) -> Row:
    """Every run planted with an input no worker can decode fails alone, RUN_UNREADABLE."""
    runs = {r["id"]: r for r in data.runs}
    details = []
    for run_id in sorted(observed.poison, key=str):
        run = runs.get(run_id)
        if run is None or (run["status"], run["outcome_code"]) != ("failed", "RUN_UNREADABLE"):
            details.append(f"poison run {run_id}: "
                           + ("missing" if run is None else
                              f"{run['status']} ({run['outcome_code']})"))
    return Row("poison runs not failed alone", len(details), 0, details)


def failed_runs(data: Data, expected_cancel: set[uuid.UUID],
                poison: set[uuid.UUID] | None = None) -> Row:
    """Workflows here never fail on purpose: tool failures and timeouts are caught and recorded
    in the result. A failed run (or a cancelled one the harness did not cancel) means the
    engine turned something else, such as an infrastructure fault, into an outcome. (The
    planted poison runs fail on purpose, and are checked by :func:`poison_runs`.)"""
    details = []
    runs = {r["id"]: r for r in data.runs}

    def first(run: dict[str, Any]) -> Any:  # the run a chain of continuations began with
        while run.get("continued_from") in runs:
            run = runs[run["continued_from"]]
        return run["id"]

    def cancelled_by_harness(run: dict[str, Any]) -> bool:
        """The harness cancelled its chain, or an ancestor's (a cancellation reaches the
        unfinished children, at every depth)."""
        while True:
            if first(run) in expected_cancel or run["parent_run_id"] in expected_cancel:
                return True
            if run["parent_run_id"] not in runs:
                return False
            run = runs[run["parent_run_id"]]

    for run in data.runs:
        if poison and run["id"] in poison:
            continue
        if run["status"] == "failed" or (
                run["status"] == "cancelled" and not cancelled_by_harness(run)):
            error = run["error"] or {}
            said = (f"run {run['id']} ({run['workflow_name']}) {run['status']}: "
                    f"{run['outcome_code']} {error.get('message', '')}")
            if run.get("traceback"):  # its incident's, the last lines: where it was raised
                said += "".join("\n      " + line for line in
                                run["traceback"].rstrip().splitlines()[-TRACEBACK_LINES:])
            details.append(said)
    return Row("runs failed without a workflow reason", len(details), 0, details)


def _late_calls(data: Data) -> list[dict[str, Any]]:
    """Tool calls that started after another worker had written the run (an entry with a
    larger lease token than the one the call's operation was submitted under): a worker
    that sent after losing its lease."""
    taken: dict[Any, list[tuple[int, float]]] = {}
    for ev in data.journal:
        at = _ts(ev["created_at"])
        if ev.get("lease_token") is not None and at is not None:
            taken.setdefault(ev["run_id"], []).append((int(ev["lease_token"]), at))
    ops = {o["id"]: o for o in data.ops}
    late = []
    for call in data.calls:
        op = ops.get(call["op_id"])
        started = _ts(call.get("started_at"))
        if op is None or op.get("lease_token") is None or started is None:
            continue
        token = int(op["lease_token"])
        if any(t > token and at < started for t, at in taken.get(op["run_id"], ())):
            late.append(call)
    return late


def late_dispatches(data: Data) -> int:
    """How many calls were late (:func:`_late_calls`). The dispatch check of the lease leaves
    only a pause that begins between that check and the request reaching the provider (a
    statistic, not an invariant: the provider's refusal of voided keys keeps it harmless)."""
    return len(_late_calls(data))


def verdict(data: Data, observed: Observed, expected_cancel: set[uuid.UUID]) -> Verdict:
    for row in data.effects + data.calls:
        row["_where"] = (row["run_id"], row["position"])
    unexplained, unresolved, unknown_stats = unknown_operations(data, observed)
    rows = [
        runs_lost(data, observed),
        duplicate_consequential(data),
        idempotent_key_changes(data),
        unexplained,
        unresolved,
        journal_integrity(data),
        ledger_sink_agreement(data),
        failed_runs(data, expected_cancel, observed.poison),
        workers_killed_by_a_run(observed),
        poison_runs(data, observed),
    ]
    stats: dict[str, Any] = {
        "runs": dict(Counter(r["status"] for r in data.runs)),
        "operations": dict(Counter(o["state"] for o in data.ops)),
        "operations by effect": dict(Counter(o["effect_class"] for o in data.ops)),
        "unknowns": unknown_stats,
        "tool calls": len(data.calls),
        "effects": len(data.effects),
        "deduplicated re-sends": sum(1 for c in data.calls if c["outcome"] == "deduplicated"),
        "refused late requests": sum(1 for c in data.calls if c["outcome"] == "refused"),
        "calls sent after another worker took the run": late_dispatches(data),
    }
    return Verdict(rows, stats)


def format_table(verdict: Verdict, max_details: int = 8) -> str:
    width = max(len(r.name) for r in verdict.rows) + 2
    lines = [f"{'invariant':<{width}}{'value':>8}  required  result"]
    lines.append("-" * (width + 26))
    for row in verdict.rows:
        required = "-" if row.required is None else str(row.required)
        result = "ok" if row.ok else "FAIL"
        lines.append(f"{row.name:<{width}}{row.value:>8}  {required:>8}  {result}")
    for row in verdict.rows:
        if row.details and not row.ok:
            lines.append(f"{row.name}:")
            for detail in row.details[:max_details]:
                lines.append(f"  - {detail}")
            if len(row.details) > max_details:
                lines.append(f"  ... and {len(row.details) - max_details} more")
    return "\n".join(lines)
