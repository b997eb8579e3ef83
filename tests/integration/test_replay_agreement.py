"""A worker's replay and the offline check (``orchestrator replay``) read a journal alike: the
same journals go to both, and at every position the verdict the engine acts on is the one the
check reports (orchestrator.matching, CONTRACT C3, C4).

The journals: a real run's, using every command (a patch marker, a call that returns and one
that fails, the three recorded values, a message, a timer, an event received and one timed
out, a child that completes and one that fails); the same cut before each position; the run
as it was while parked on its event; a child not ended; and code or journals that differ at a
position (another tool, other arguments, another value, message, command, event or child).
Each journal is written under a fresh run of the same workflow; a worker replays it, and
:func:`orchestrator.replay.check_run` checks it. (A call recorded without an outcome, or
withdrawn, is left to tests/unit/test_matching.py: a worker resumes it from the operations
ledger, which a journal copied under another run does not have.) Both sides' calls of the
matcher are recorded where they are made (in the engine's modules and in the check's): a side
that stopped asking the matcher, asked it something else, or was handed another verdict fails
the comparison; so does one that acts on a verdict otherwise (stops where the other goes on,
or ends the run otherwise).
"""

from __future__ import annotations

import copy
import uuid
from collections import defaultdict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from orchestrator import EventTimeout, Orchestrator, RunFailed, ToolFailed, WorkflowError
from orchestrator import replay as check
from orchestrator.engine import call as engine_call
from orchestrator.engine import commands as engine_commands
from orchestrator.errors import OrchestratorError
from orchestrator.failures import ToolError
from orchestrator.journal import Entry, Nondeterminism
from orchestrator.matching import Outcome, Verdict
from orchestrator.testing import run_until_idle
from tests.integration.conftest import running, wait_for

RUN: ContextVar[str | None] = ContextVar("RUN", default=None)
"""The run whose workflow code is running in this task (set by the workflow itself)."""

MATCHERS = ("match_call", "match_value", "match_publish", "match_sleep", "match_event",
            "match_child")
SIDES = {
    "engine": [(engine_call, ("match_call",)),
               (engine_commands, tuple(m for m in MATCHERS if m != "match_call"))],
    "check": [(check, MATCHERS)],
}
Log = dict[str, list[tuple[str, int, Any]]]


def said(verdict: Verdict) -> Any:
    """A verdict in comparable terms (an error by its public fields)."""
    error = verdict.error
    words: Any = None
    if isinstance(error, Nondeterminism):
        words = ("NONDETERMINISM", str(error), error.position, error.recorded, error.issued,
                 error.report)
    elif isinstance(error, ToolFailed):
        words = (error.code, error.message, error.tool, error.cause, error.reason)
    elif isinstance(error, OrchestratorError):
        words = (type(error).__name__, error.code, error.message,
                 getattr(error, "run_id", None), getattr(error, "cause", None),
                 getattr(error, "timeout_at", None))
    else:
        assert error is None
    return (verdict.outcome, verdict.value, words, [e["kind"] for e in verdict.recorded])


@pytest.fixture
def verdicts(monkeypatch: pytest.MonkeyPatch) -> dict[str, Log]:
    """Every verdict each side asked the matcher for, per run, in order."""
    seen: dict[str, Log] = {side: defaultdict(list) for side in SIDES}

    def spy(log: Log, name: str, real: Callable[..., Verdict]) -> Callable[..., Verdict]:
        def asked(index: Any, position: int, *rest: Any) -> Verdict:
            verdict = real(index, position, *rest)
            run = RUN.get()
            if run is not None:
                log[run].append((name, position, said(verdict)))
            return verdict
        return asked

    for side, modules in SIDES.items():
        for module, names in modules:
            for name in names:
                # An AttributeError here: that side no longer asks the matcher for this command.
                monkeypatch.setattr(module, name, spy(seen[side], name, getattr(module, name)))
    return seen


def build(app: Orchestrator) -> None:
    @app.tool()
    async def charge(ctx, *, n):  # type: ignore[no-untyped-def]
        return {"charged": n}

    @app.tool()
    async def refund(ctx, *, n):  # type: ignore[no-untyped-def]
        return {"refunded": n}

    @app.tool()
    async def refuse(ctx, *, n):  # type: ignore[no-untyped-def]
        raise ToolError("the provider refused", applied=False, status=422)

    @app.workflow()
    async def kid(ctx, n):  # type: ignore[no-untyped-def]
        return n * 2

    @app.workflow()
    async def bad_kid(ctx, n):  # type: ignore[no-untyped-def]
        raise WorkflowError("the child gave up")

    @app.workflow()
    async def every(ctx, data):  # type: ignore[no-untyped-def]
        RUN.set(str(ctx.run_id))
        v, n = data.get("variant"), data["n"]
        seen: list[Any] = [ctx.patched("first")]
        seen.append(await ctx.call(refund if v == "tool" else charge,  # 0
                                   n=n + 1 if v == "arguments" else n))
        try:
            await ctx.call(refuse, n=n)  # 1
        except ToolFailed as exc:
            seen.append(exc.cause)
        seen.append(str(ctx.uuid() if v == "value" else ctx.now()))  # 2
        seen.append(str(ctx.uuid()))  # 3
        seen.append(ctx.random())  # 4
        ctx.publish({"n": n + 1 if v == "message" else n}, topic="progress")  # 5
        if v == "sleep":
            await ctx.wait_for_event("go", timeout=30)  # 6
        else:
            await ctx.sleep(0.01)
        seen.append(await ctx.wait_for_event("stop" if v == "event" else "go", timeout=60))  # 7
        try:
            await ctx.wait_for_event("late", timeout=0.05)  # 8
        except EventTimeout as exc:
            seen.append(exc.event)
        seen.append(await ctx.run_child(bad_kid if v == "child" else kid, n))  # 9
        try:
            await ctx.run_child(bad_kid, n)  # 10
        except RunFailed as exc:
            seen.append(exc.code)
        return seen


VERSION = "1"
SETTLED = (Outcome.RETURNS, Outcome.RAISES)


def stops(asked: tuple[str, int, Any]) -> bool:
    """Whether a verdict stops a replay there: the history has nothing (more) for that branch
    of the code, or the code differs from it (a recorded timer is over or not by the clock or
    by what the history holds after it)."""
    name, _, (outcome, *_) = asked
    return outcome in (Outcome.NEW, Outcome.DIFFERS, Outcome.WITHDRAWN) or (
        outcome is Outcome.WAITS and name != "match_sleep")


def journal_of(sql: Any, run_id: uuid.UUID) -> list[Entry]:
    """A run's journal as a worker and the check read it."""
    return sql("SELECT seq, kind, position, name, schema_version, payload "
               "FROM orchestrator.journal WHERE run_id = %s ORDER BY seq", (run_id,))


def positions(journal: list[Entry], keep: Callable[[int], bool]) -> list[Entry]:
    return [e for e in journal if keep(e["position"])]


async def test_the_engine_and_the_check_reach_the_same_verdict_at_every_position(
        make_app: Any, sql: Any, verdicts: dict[str, Log]) -> None:
    app = make_app()
    build(app)
    async with running(app):
        original = await app.submit_async("every", {"n": 3})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.journal WHERE kind = "
                                   "'event.wait' AND name = 'go'"), timeout=20,
                       what="the run parked on its event")
        parked = journal_of(sql, original.id)
        await app.send_event_async(original.id, "go", {"ok": True})
        result = await original.result_async(timeout=30)
    assert result[:2] == [True, {"charged": 3}] and result[-3:] == ["late", 6, "WORKFLOW_FAILED"]
    # The run's own entries (its end) are not commands: the journals are of commands alone.
    full = positions(journal_of(sql, original.id), lambda p: p is not None)
    last = max(e["position"] for e in full)
    assert last == 10

    cases: list[tuple[str, dict[str, Any], list[Entry]]] = [("full", {}, full)]
    cases += [(f"cut before {k}", {}, positions(full, lambda p, k=k: p < k))
              for k in range(last + 1)]
    cases.append(("parked on its event", {}, positions(parked, lambda p: p is not None)))
    unended = [e for e in full if not (e["position"] == 9 and e["kind"] != "child.started")]
    cases.append(("a child not ended", {}, positions(unended, lambda p: p <= 9)))
    for variant in ("tool", "arguments", "value", "message", "sleep", "event", "child"):
        cases.append((f"code: another {variant}", {"variant": variant}, full))
    other = copy.deepcopy(full)
    next(e for e in other if e["kind"] == "message")["payload"]["value"] = {"n": 4}
    cases.append(("journal: another message", {}, other))

    # Each journal under a fresh run of the same workflow, for a worker to replay.
    runs: dict[str, tuple[str, uuid.UUID]] = {}
    histories: dict[str, int] = {}  # the last position each journal holds
    found: dict[str, check.Verdict] = {}
    for what, options, entries in cases:
        data = {"n": 3, **options}
        handle = await app.submit_async("every", data)
        journal = [{**e, "seq": seq} for seq, e in enumerate(entries, 1)]
        for e in journal:
            sql("INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name, "
                "schema_version, payload, lease_token) VALUES (%s, %s, %s, %s, %s, %s, %s, 0)",
                (handle.id, e["seq"], e["kind"], e["position"], e["name"], e["schema_version"],
                 Jsonb(e["payload"])))
        sql("UPDATE orchestrator.runs SET revision = %s WHERE id = %s", (len(journal), handle.id))
        key = str(handle.id)
        runs[key] = (what, handle.id)
        histories[key] = max((e["position"] for e in journal), default=-1)
        # The check, offline, on the same journal.
        found[key] = await check.check_run(check.RecordedRun(
            run_id=handle.id, workflow="every", version=VERSION, input=data,
            owner=app.default_owner, status="queued", journal=journal), app.registry,
            app.arguments_text)
        assert verdicts["check"][key], f"{what}: the check asked the matcher nothing"

    # The engine, on the same journals: its first replay asks what the check asked, in order
    # (and then goes on live where the history ends), until each run is idle or has ended.
    checked, engine = verdicts["check"], verdicts["engine"]
    await run_until_idle(app, runs=[run_id for _, run_id in runs.values()], timeout=60)
    await app.database.close()
    for key, (what, run_id) in runs.items():
        assert engine[key][:len(checked[key])] == checked[key], what
        verdict = found[key]
        # The check went on wherever a worker goes on replaying, and stopped where one stops.
        *before, (name, position, (outcome, *_)) = checked[key]
        assert not [b for b in before if stops(b)], what
        if verdict.position is None:  # the code ran to its end, on both sides
            assert engine[key] == checked[key] and outcome in SETTLED, what
        else:
            assert position == verdict.position, what
            assert stops(checked[key][-1]) or (name == "match_sleep"  # where the history ends
                                               and position == histories[key]), what
        row = sql("SELECT status, outcome_code, error FROM orchestrator.runs WHERE id = %s",
                  (run_id,))[0]
        if verdict.verdict == "nondeterminism":
            assert (row["status"], row["outcome_code"]) == ("failed", "NONDETERMINISM"), what
            assert row["error"]["message"].startswith(f"position {verdict.position}: "), what
            _, position, (_, _, words, _) = checked[key][-1]
            assert words[0] == "NONDETERMINISM" and position == verdict.position, what
            assert words[1] == row["error"]["message"], what
            assert f"NONDETERMINISM: {words[5]}" == verdict.message, what
        else:
            assert verdict.ok, (what, verdict)
            assert row["outcome_code"] != "NONDETERMINISM", (
                f"{what}: the check says {verdict.message}; a worker failed the run: "
                f"{row['error']}")

    # What the cases cover: every command, and every verdict but those of a call recorded
    # without an outcome (tests/unit/test_matching.py has them).
    outcomes = {(name, told[0]) for log in checked.values() for name, _, told in log}
    assert {o for _, o in outcomes} == {Outcome.NEW, Outcome.RETURNS, Outcome.RAISES,
                                        Outcome.WAITS, Outcome.DIFFERS}
    assert {name for name, _ in outcomes} == set(MATCHERS)
    differ = {(v.position, v.recorded, v.issued) for v in found.values()
              if v.verdict == "nondeterminism"}
    assert differ == {(0, "call 'charge'", "call 'refund'"), (0, "call 'charge'", "call 'charge'"),
                      (2, "value 'now'", "value 'uuid'"), (5, "publish 'progress'",
                                                           "publish 'progress'"),
                      (6, "sleep", "event 'go'"), (7, "event 'go'", "event 'stop'"),
                      (9, "child 'kid'", "child 'bad_kid'")}

