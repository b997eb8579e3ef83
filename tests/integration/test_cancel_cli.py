"""``orchestrator runs cancel``: an operator's action audited as the console's (``run.cancel``,
C17): with ``--operator`` and ``--evidence`` as given, else as the login that ran it."""

from __future__ import annotations

from orchestrator import Orchestrator, admin
from orchestrator.cli.common import login_name
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_bulk import cli, lose_the_next_commit


async def test_an_operators_cancellation_from_the_cli_is_audited(
        app: Orchestrator, sql, migrated_database_url):
    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return order

    plain, audited, halfway = [await app.submit_async(pay, n) for n in range(3)]
    url = migrated_database_url

    code, out, err = await cli(url, "runs", "cancel", str(plain.id))
    assert (code, err) == (0, "") and "is cancelled" in out
    code, out, err = await cli(url, "runs", "cancel", str(audited.id), "--operator", "ann",
                               "--evidence", "the customer withdrew the order")
    assert (code, err) == (0, "") and "is cancelled" in out
    audit = sql("SELECT operator, action, target_id, evidence, before, after "
                "FROM orchestrator.operator_audit ORDER BY id")
    # Without --operator the row names the login that ran the command and says no reason
    # was given: a cancellation from the command line is never without a trace.
    assert [(a["operator"], a["action"], a["target_id"], a["evidence"]) for a in audit] == [
        (login_name(), "run.cancel", str(plain.id), "none given (orchestrator runs cancel)"),
        ("ann", "run.cancel", str(audited.id), "the customer withdrew the order")]
    assert audit[1]["before"]["status"] == "queued"
    assert audit[1]["after"] == {"status": "cancelled", "cancel_requested": True,
                                 "children": 0}

    # One without the other is refused, and nothing changes.
    for half in (["--operator", "ann"], ["--evidence", "why not"]):
        code, out, err = await cli(url, "runs", "cancel", str(halfway.id), *half)
        assert code != 0 and "INVALID_REQUEST" in err and "go together" in err
    # Empty or blank ones are refused as such, naming which, and nothing changes either.
    for given, said in ((["--operator", "", "--evidence", ""], "an operator identity is "
                         "required"),
                        (["--operator", "", "--evidence", "why"], "an operator identity is "
                         "required"),
                        (["--operator", "ann", "--evidence", "  "], "evidence text is required"),
                        (["--operator", "a nn", "--evidence", "why"], "operator holds "
                         "whitespace")):
        code, out, err = await cli(url, "runs", "cancel", str(halfway.id), *given)
        assert (code, out) == (2, "") and f"INVALID_REQUEST: {said}" in err, (given, err)
    assert sql("SELECT status, cancel_requested_at FROM orchestrator.runs WHERE id = %s",
               (halfway.id,)) == [{"status": "queued", "cancel_requested_at": None}]
    assert len(sql("SELECT 1 FROM orchestrator.operator_audit")) == 2


async def test_a_cancellation_from_the_cli_reaches_the_runs_children(
        app: Orchestrator, sql, migrated_database_url):
    """Plain or audited, ``runs cancel`` cancels the run's unfinished child runs with it and
    says how many it reached; so does the audit."""
    @app.workflow()
    async def child(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("never")

    @app.workflow()
    async def parent(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.run_child(child, n)

    plain, audited = [await app.submit_async(parent, n) for n in range(2)]
    async with running(app):
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'waiting'")) == 4)
    url = migrated_database_url
    code, out, err = await cli(url, "runs", "cancel", str(plain.id))
    assert (code, err) == (0, "")
    assert out.strip() == f"run {plain.id} is cancelled, and 1 child run with it"
    code, out, err = await cli(url, "runs", "cancel", str(audited.id), "--operator", "ann",
                               "--evidence", "the customer withdrew the order")
    assert (code, err) == (0, "")
    assert out.strip() == f"run {audited.id} is cancelled, and 1 child run with it"
    assert sql("SELECT status FROM orchestrator.runs WHERE parent_run_id IS NOT NULL") == [
        {"status": "cancelled"}] * 2
    assert [a["after"] for a in sql("SELECT after FROM orchestrator.operator_audit "
                                    "ORDER BY id")] == [
        {"status": "cancelled", "cancel_requested": True, "children": 1}] * 2


async def test_cancelling_a_cancelled_run_says_it_had_finished(
        app: Orchestrator, migrated_database_url):
    """A second ``runs cancel`` changes nothing, and says so, as for a run that succeeded,
    instead of announcing the cancellation again."""
    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return order

    run = await app.submit_async(pay, 1)
    url = migrated_database_url
    code, out, err = await cli(url, "runs", "cancel", str(run.id))
    assert (code, err) == (0, "") and "is cancelled" in out
    for audited in ([], ["--operator", "ann", "--evidence", "asked twice"]):
        code, out, err = await cli(url, "runs", "cancel", str(run.id), *audited)
        assert (code, err) == (0, "")
        assert out.strip() == f"run {run.id} already finished (cancelled); nothing to cancel"


async def test_a_cancellation_whose_commit_was_lost_reports_what_it_did_and_audits_once(
        app: Orchestrator, sql, monkeypatch):
    """The connection goes while a cancellation's COMMIT is under way, and it applied: run
    again by the storage layer, the cancellation finds the run cancelled, by its own hand. It
    answers with the status the run had before it (not "it had finished"), and an operator's
    is audited once."""
    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return order

    plain, audited = [await app.submit_async(pay, n) for n in range(2)]
    lose_the_next_commit(monkeypatch, app.database)
    done = await admin.cancel_run(app.database, plain.id)
    assert (done.before, done.after) == ("queued", "cancelled")
    lose_the_next_commit(monkeypatch, app.database)
    done = await admin.operator_cancel(app.database, audited.id, operator="ann",
                                       evidence="withdrawn", tenants=None)
    assert (done.before, done.after) == ("queued", "cancelled")
    audit = sql("SELECT before, after FROM orchestrator.operator_audit")
    assert [(a["before"]["status"], a["after"]["status"]) for a in audit] == [
        ("queued", "cancelled")]
