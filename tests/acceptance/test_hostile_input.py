"""Hostile input against real worker processes: a poison run fails alone, values replay exactly,
and no call at any public entry point ends in anything but a stable code (C2, C4, C10)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import Orchestrator, OrchestratorError, Owner, RunFailed
from tests.acceptance import hostile
from tests.acceptance.conftest import ROOT

HOSTILE_APP = "tests.acceptance.hostile:app"


@pytest.fixture
def probe(migrated_database_url: str):  # type: ignore[no-untyped-def]
    """The hostile app as a submitting client in the test process."""
    app = Orchestrator(migrated_database_url, default_owner=hostile.OWNER)
    app.registry = hostile.app.registry
    yield app
    app.close()


def _deep(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


def _nested(levels: int) -> Any:
    """A list nested ``levels`` deep, built without recursion (as a hostile caller would)."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"ORCHESTRATOR_DATABASE_URL": url, "PYTHONPATH": str(ROOT),
                               "PATH": "/usr/bin:/bin"})


# --- finding 1: a poison run kills every worker -----------------------------------------------


def test_the_poison_inputs_of_the_probe_are_refused_at_submission(probe):
    deep = _nested(980)
    with pytest.raises(OrchestratorError) as caught:
        probe.submit(hostile.plain, deep)
    assert caught.value.code == "INVALID_REQUEST" and caught.value.path.startswith("$.input")
    with pytest.raises(OrchestratorError) as caught:
        probe.submit(hostile.plain, {"n": 10**10_000})
    assert caught.value.code == "INVALID_REQUEST" and caught.value.path == "$.input.n"
    assert probe.list_runs() == []


def test_a_stored_poison_run_fails_alone_and_the_worker_goes_on_claiming(
        workers, probe, migrated_database_url):
    # Rows that today's caps would refuse, as an older release or a hand-written INSERT could
    # have left them: their inputs, and the journal of a run that waits mid-way.
    deep = probe.submit(hostile.plain, {"placeholder": 1})
    digits = probe.submit(hostile.plain, {"placeholder": 2})
    workers.sql("UPDATE orchestrator.runs SET input = %s::jsonb WHERE id = %s",
                (_deep(3000), deep.id))
    workers.sql("UPDATE orchestrator.runs SET input = %s::jsonb WHERE id = %s",
                ('{"n": ' + "7" * 10_000 + "}", digits.id))
    worker = workers.start("a", app=HOSTILE_APP)
    for run in (deep, digits):
        with pytest.raises(RunFailed) as caught:
            run.result(timeout=30)
        assert caught.value.code == "RUN_UNREADABLE"
        assert caught.value.incident.startswith("inc_")
        assert run.status() == "failed"  # the owner's reads answer, never a raw ValueError

    replayed = probe.submit(hostile.round_trip, {"texts": ["1"]})
    workers.wait(lambda: replayed.status() == "waiting", "the run to park")
    # The call's call.completed entry is its operation row: its receipt is the entry's result.
    workers.sql("ALTER TABLE orchestrator.operations DISABLE TRIGGER USER")
    changed = workers.sql("UPDATE orchestrator.operations SET receipt = %s::jsonb "
                          "WHERE run_id = %s AND completed_seq IS NOT NULL RETURNING id",
                          (_deep(3000), replayed.id))
    workers.sql("ALTER TABLE orchestrator.operations ENABLE TRIGGER USER")
    assert changed, "no call.completed entry on an operation row"
    probe.send_event(replayed.id, "go", {})
    with pytest.raises(RunFailed) as caught:
        replayed.result(timeout=30)
    assert caught.value.code == "RUN_UNREADABLE"

    fine = probe.submit(hostile.plain, {"ok": [1, 2.5]})
    assert fine.result(timeout=30) == {"ok": [1, 2.5]}
    assert worker.poll() is None, "a run's content stopped the worker"
    assert {r.id for r in probe.list_runs()} >= {deep.id, digits.id, replayed.id, fine.id}
    assert "RUN_UNREADABLE" in workers.log("a")
    incidents = workers.sql("SELECT code, phase FROM orchestrator.incidents WHERE run_id = %s",
                            (deep.id,))
    assert incidents == [{"code": "RUN_UNREADABLE", "phase": "decode"}]
    shown = _cli(migrated_database_url, "runs", "show", str(digits.id))
    assert shown.returncode == 0 and "RUN_UNREADABLE" in shown.stdout, shown.stderr


def test_an_unreadable_run_with_an_operation_in_flight_waits_for_its_reconciliation(
        workers, probe):
    first = workers.start("first", app=HOSTILE_APP)
    run = probe.submit(hostile.hanging, None)
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.operations WHERE run_id = %s "
                                     "AND state = 'submitted'", (run.id,)),
                 "the call to be sent", proc=first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # The call's call.submitted entry is its operation row, made of columns that cannot be
    # too deep: it is stored as a row instead (as an older engine wrote it), then spoiled.
    workers.sql("ALTER TABLE orchestrator.operations DISABLE TRIGGER USER")
    [moved] = workers.sql("UPDATE orchestrator.operations o SET seq = NULL FROM "
                          "(SELECT id, seq FROM orchestrator.operations WHERE run_id = %s) s "
                          "WHERE o.id = s.id RETURNING s.seq, o.entry_version, o.lease_token",
                          (run.id,))
    workers.sql("ALTER TABLE orchestrator.operations ENABLE TRIGGER USER")
    workers.sql("INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name, "
                "schema_version, payload, lease_token) "
                "VALUES (%s, %s, 'call.submitted', 0, 'x', %s, %s::jsonb, %s)",
                (run.id, moved["seq"], moved["entry_version"], '{"x": ' + _deep(3000) + "}",
                 moved["lease_token"]))
    second = workers.start("second", app=HOSTILE_APP)
    workers.wait(lambda: run.status() == "needs_reconciliation", "the run to wait", proc=second)
    [op] = workers.sql("SELECT id, state FROM orchestrator.operations WHERE run_id = %s",
                       (run.id,))
    assert op["state"] == "unknown"  # never re-sent, never dropped: reconciled
    assert "RUN_UNREADABLE" in probe.get_run(run.id).info().waiting_for
    probe._portal.call(probe.operators.resolve_not_applied(
        op["id"], evidence="the provider has nothing", operator="alice"))
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=30)
    assert caught.value.code == "RUN_UNREADABLE"
    assert second.poll() is None


# --- finding 2: floats change type in storage and a restart fails the run -------------------


def _restart_between_halves(workers, probe, texts: list[str]) -> list[Any]:  # type: ignore[no-untyped-def]
    """Run ``round_trip`` over ``texts`` with the worker SIGKILLed while the run waits, and a
    new worker replaying it; return the runs' results."""
    runs = [probe.submit(hostile.round_trip, {"texts": chunk})
            for chunk in (texts[i:i + 20] for i in range(0, len(texts), 20))]
    first = workers.start("first", app=HOSTILE_APP)
    for run in runs:
        workers.wait(lambda run=run: run.status() == "waiting", "the run to park", proc=first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = workers.start("second", app=HOSTILE_APP)
    for run in runs:
        probe.send_event(run.id, "go", {})
    results = [run.result(timeout=60) for run in runs]
    assert second.poll() is None
    return results


def test_floats_of_every_notation_keep_their_type_across_a_worker_restart(workers, probe):
    texts = [json.dumps(v) for v in (
        {"f": 1e16}, {"f": 1.5e300}, {"f": -0.0}, {"f": 1e-7}, {"f": 5e-324},
        {"b": 1, "a": 2, "é": 3, "ab": [1e22, {"z": 0.1, "y": 12345678901234567890}]})]
    results = _restart_between_halves(workers, probe, texts)
    assert len(results[0]["seen"]) == len(texts)
    assert "f1e+16" in results[0]["seen"][0]  # a float live, a float after the restart


json_scalars = (
    st.none() | st.booleans()
    | st.integers(min_value=-(10**100) + 1, max_value=10**100 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e16, -0.0, 1.5e300, 5e-324, 1e-5, 0.1, 2.0**53 + 1])
    | st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet=st.characters(codec="utf-8",
                                                     exclude_characters="\x00"), max_size=6),
                      inner, max_size=4),
    max_leaves=12,
)


def test_json_values_are_the_same_live_and_on_replay_after_a_restart(workers, probe):
    texts: list[str] = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(value=json_values)
    def collect(value: Any) -> None:
        texts.append(json.dumps(value))

    collect()
    results = _restart_between_halves(workers, probe, texts)
    assert sum(len(r["seen"]) for r in results) == len(texts)


# --- every public entry point: a stable code or success, and the worker lives ---------------

hostile_text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", " ", "a\x00b", "\ud800", "opA ", "opA\u200b", "x" * 201, "\x07",
                     "ok", "acme", "queued", "1e+16", "a\nb"]),
)
hostile_json = st.one_of(
    json_values,
    st.sampled_from([float("nan"), float("inf"), b"bytes", {1: 2}, (1, 2), {"a": {1, 2}},
                     10**200, "\x00", {"\ud800": 1}]),
    st.builds(_nested, st.integers(min_value=60, max_value=900)),
)


@pytest.mark.parametrize("seed", [0])
def test_hostile_calls_at_every_entry_point_get_stable_codes_and_no_worker_dies(
        workers, probe, migrated_database_url, seed):
    worker = workers.start("a", app=HOSTILE_APP)
    accepted: list[Any] = [probe.submit(hostile.stuck, None) for _ in range(4)]
    for run in accepted:
        workers.wait(lambda run=run: run.status() == "needs_reconciliation",
                     "a run to wait on its unknown operation", proc=worker)
    queued = [row["operation_id"] for row in workers.sql(
        "SELECT operation_id FROM orchestrator.reconciliation_items ORDER BY operation_id")]
    assert len(queued) == 4
    outcomes: dict[str, int] = {}

    def attempt(name: str, call: Any) -> Any:
        try:
            value = call()
        except OrchestratorError as exc:
            assert exc.code.isupper() and exc.code.replace("_", "").isalpha(), exc.code
            outcomes[exc.code] = outcomes.get(exc.code, 0) + 1
            return None
        outcomes["ok"] = outcomes.get("ok", 0) + 1
        return value

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def probe_once(data: st.DataObject) -> None:
        text = data.draw(hostile_text)
        value = data.draw(hostile_json)
        which = data.draw(st.sampled_from(
            ["submit", "owner", "key", "event", "list", "get", "ops", "resolve", "cli"]))
        if which == "submit":
            run = attempt("submit", lambda: probe.submit(hostile.plain, value))
            if run is not None:
                accepted.append(run)
        elif which == "owner":
            run = attempt("owner", lambda: probe.submit(
                hostile.waits, None, owner=Owner(tenant=text, principal=text)))
            if run is not None:
                accepted.append(run)
        elif which == "key":
            run = attempt("key", lambda: probe.submit(hostile.plain, 1, idempotency_key=text))
            if run is not None:
                accepted.append(run)
        elif which == "event":
            target = probe.submit(hostile.waits, None)
            accepted.append(target)
            attempt("event", lambda: probe.send_event(target.id, text, value))
            attempt("event_key", lambda: probe.send_event(target.id, "poke", 1, event_key=text))
        elif which == "list":
            attempt("list", lambda: probe.list_runs(status=text))
            attempt("list", lambda: probe.list_runs(workflow=text))
            attempt("list", lambda: probe.list_runs(limit=data.draw(st.integers(-5, 2000))))
        elif which == "get":
            attempt("get", lambda: probe.get_run(text))
        elif which == "ops":
            ops = probe.operators
            attempt("ops", lambda: probe._portal.call(ops.list_items(operator=text)))
            attempt("ops", lambda: probe._portal.call(ops.list_items(operator="alice",
                                                                     tool=text)))
            attempt("ops", lambda: probe._portal.call(ops.show(1, operator=text)))
        elif which == "resolve":
            ops = probe.operators
            target = data.draw(st.sampled_from([*queued, -1, 0, 10**30]))
            attempt("resolve", lambda: probe._portal.call(ops.resolve_committed(
                target, receipt=value, evidence=text, operator="alice")))
            attempt("resolve", lambda: probe._portal.call(ops.abandon(
                target, evidence="checked by hand", operator=text)))
            attempt("resolve", lambda: probe._portal.call(ops.resolve_not_applied(
                target, evidence=text, operator="alice")))
        else:
            # What argv can carry: bytes (a lone surrogate as its three bytes), no NUL.
            safe = text.encode("utf-8", "surrogatepass").replace(b"\x00", b"")
            arg = safe.decode("utf-8", "surrogateescape")
            command = data.draw(st.sampled_from([
                ["runs", "list", "--status", arg], ["runs", "show", arg],
                ["ops", "list", "--tool", arg], ["ops", "show", arg or "1"],
                ["runs", "list", "--workflow", arg]]))
            done = _cli(migrated_database_url, *command)
            assert done.returncode in (0, 2), (command, done.returncode, done.stderr)
            assert "INTERNAL" not in done.stderr and "Traceback" not in done.stderr

    probe_once()
    for command in (["ops", "list", "--tool", "\udcff"], ["runs", "list", "--status", "\udcff"],
                    ["runs", "list", "--workflow", "a\u200b"], ["ops", "show", "\udcff"],
                    ["runs", "list", "--tenant", "\udcff"], ["runs", "list", "--limit", "0"]):
        done = _cli(migrated_database_url, *command)
        assert done.returncode == 2, (command, done.stderr)
        assert "INVALID_REQUEST" in done.stderr or "usage:" in done.stderr, done.stderr
    ops = probe.operators
    for evidence, operator in (("a\x00b", "alice"), ("\ud800", "alice"), ("checked", "a\x00"),
                               ("checked", "\udcff"), ("checked", "alice "), ("", "alice")):
        with pytest.raises(OrchestratorError) as caught:
            probe._portal.call(ops.resolve_not_applied(queued[0], evidence=evidence,
                                                       operator=operator))
        assert caught.value.code == "INVALID_REQUEST", (evidence, operator, caught.value)
    # Whatever the probe left unsettled, settled now. A `not applied` the probe made re-sends
    # the call (the default), and the tool's next attempt is uncertain again: a new item, so
    # the queue is read again until nothing waits.
    for _ in range(20):
        waiting = [row["operation_id"] for row in workers.sql(
            "SELECT operation_id FROM orchestrator.reconciliation_items "
            "WHERE state <> 'resolved' ORDER BY operation_id")]
        if not waiting and all(run.status() != "needs_reconciliation" for run in accepted):
            break
        for operation_id in waiting:
            attempt("settle", lambda operation_id=operation_id: probe._portal.call(ops.abandon(
                operation_id, evidence="end of the probe", operator="alice")))
        time.sleep(0.5)
    assert worker.poll() is None, "a hostile call stopped the worker"
    for run in accepted:
        status = None
        try:
            run.result(timeout=60)
        except RunFailed:
            pass
        status = run.status()
        assert status in ("succeeded", "failed"), status
    assert outcomes.get("ok", 0) > 0 and outcomes.get("INVALID_REQUEST", 0) > 0, outcomes
