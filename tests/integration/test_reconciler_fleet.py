"""Reconcilers that do not all register the same tools (several applications on one database,
or reconcilers of different releases): an item goes to the reconciler that has its tool, and
to operators only once no running reconciler took it for ``unserved_grace`` (CONTRACT C8)."""

from __future__ import annotations

import logging

from orchestrator import Committed, ToolFailed
from tests.integration.conftest import running, wait_for


def _item(sql):  # type: ignore[no-untyped-def]
    rows = sql("SELECT state, claimed_by, evidence, lookup_attempts "
               "FROM orchestrator.reconciliation_items")
    assert len(rows) == 1, rows
    return rows[0]


def _parked(sql):  # type: ignore[no-untyped-def]
    return lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'needs_reconciliation'")


def _charging_app(make_app):  # type: ignore[no-untyped-def]
    """The application that has ``charge`` and its lookup (it finds the charge made)."""
    app = make_app()

    @app.tool(max_attempts=1)
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @charge.lookup
    async def find(ctx, *, cents):  # type: ignore[no-untyped-def]
        return Committed({"charge": "original"})

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(charge, cents=7)
        except ToolFailed:
            return "not applied"

    return app, pay


def _other_app(make_app):  # type: ignore[no-untyped-def]
    """Another application on the same database: it does not register ``charge``."""
    other = make_app()

    @other.tool()
    async def ship(ctx):  # type: ignore[no-untyped-def]
        return {"shipped": True}

    return other


async def test_an_item_of_a_tool_it_lacks_is_left_for_the_reconciler_that_has_it(
        make_app, sql, caplog):
    app, pay = _charging_app(make_app)
    other = _other_app(make_app)
    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
        # within the grace, a reconciler without the tool does not even claim the item
        assert await other.create_reconciler().run_once() == 0
        assert _item(sql) == {"state": "open", "claimed_by": None, "evidence": [],
                              "lookup_attempts": 0}
        assert "handed to operators" not in caplog.text
        # the reconciler that has the tool settles it by its lookup
        assert await app.create_reconciler().run_once() == 1
        assert await run.result_async(timeout=10) == {"charge": "original"}
    assert _item(sql)["state"] == "resolved"
    assert other.metrics.snapshot()["reconciliation_unserved"] == 0


async def test_after_the_grace_a_reconciler_without_the_tool_hands_it_to_operators(
        make_app, sql, caplog):
    app, pay = _charging_app(make_app)
    other = _other_app(make_app)
    async with running(app):
        await app.submit_async(pay, {})
        await wait_for(_parked(sql))
    reconciler = other.create_reconciler(unserved_grace=120)
    # due for 100 s: still within the grace
    sql("UPDATE orchestrator.reconciliation_items "
        "SET next_attempt_at = now() - interval '100 seconds'")
    assert await reconciler.run_once() == 0
    # a reconciler that has the tool took it 200 s ago and died: its claim lapsed only 60 s ago
    sql("UPDATE orchestrator.reconciliation_items SET next_attempt_at = now() - interval "
        "'200 seconds', claimed_by = 'reconciler:gone', claimed_until = now() - interval "
        "'60 seconds'")
    assert await reconciler.run_once() == 0
    assert _item(sql)["state"] == "open"
    # due for 130 s, no reconciler having taken it
    sql("UPDATE orchestrator.reconciliation_items SET next_attempt_at = now() - interval "
        "'130 seconds', claimed_by = NULL, claimed_until = NULL")
    caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
    assert await reconciler.run_once() == 1
    item = _item(sql)
    assert item["state"] == "operator" and item["claimed_by"] is None
    assert item["lookup_attempts"] == 0
    (note,) = item["evidence"]
    assert "no running reconciler has tool charge" in note["note"]
    assert "an operator decides" in note["note"]
    assert "handed to operators: no running reconciler has tool charge" in caplog.text
    (record,) = [r for r in caplog.records if "handed to operators" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.tool == "charge"  # type: ignore[attr-defined]
    assert other.metrics.snapshot()["reconciliation_unserved"] == 1
    assert other.metrics.labelled("reconciliation_unserved") == {("charge",): 1}


async def test_a_registered_tool_without_a_lookup_goes_to_operators_at_once(
        make_app, sql, caplog):
    app = make_app()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        await app.submit_async(wf, {})
        await wait_for(_parked(sql))
    caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
    # however long the grace: it has the tool, and knows it has no lookup
    assert await app.create_reconciler(unserved_grace=3600).run_once() == 1
    item = _item(sql)
    assert item["state"] == "operator"
    assert item["evidence"] == [{"note": "tool charge has no lookup here; an operator decides"}]
    assert "handed to operators: tool charge has no lookup here" in caplog.text
    assert app.metrics.snapshot()["reconciliation_unserved"] == 0


async def test_a_zero_grace_hands_an_unserved_item_over_as_soon_as_it_is_due(make_app, sql):
    app, pay = _charging_app(make_app)
    other = _other_app(make_app)
    async with running(app):
        await app.submit_async(pay, {})
        await wait_for(_parked(sql))
    assert await other.create_reconciler(unserved_grace=0).run_once() == 1
    assert _item(sql)["state"] == "operator"


async def test_items_it_lacks_the_tool_of_do_not_crowd_out_its_own(make_app, sql):
    """The claim itself passes over the items of tools the reconciler does not have: older
    ones of another application ahead in the queue do not fill its batch."""
    app, pay = _charging_app(make_app)
    other = make_app()

    @other.tool(max_attempts=1)
    async def ship(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @ship.lookup
    async def track(ctx):  # type: ignore[no-untyped-def]
        return Committed({"parcel": 1})

    @other.workflow()
    async def send(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(ship)

    async with running(app):
        await app.submit_async(pay, {})
        await wait_for(_parked(sql))
    async with running(other):
        run = await other.submit_async(send, {})
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.reconciliation_items")) == 2)
    sql("UPDATE orchestrator.reconciliation_items i SET next_attempt_at = now() - CASE "
        "WHEN o.tool_name = 'charge' THEN interval '60 seconds' ELSE interval '1 second' END "
        "FROM orchestrator.operations o WHERE o.id = i.operation_id")
    assert await other.create_reconciler(batch=1).run_once() == 1
    states = sql("SELECT o.tool_name, i.state FROM orchestrator.reconciliation_items i "
                 "JOIN orchestrator.operations o ON o.id = i.operation_id ORDER BY i.id")
    assert states == [{"tool_name": "charge", "state": "open"},
                      {"tool_name": "ship", "state": "resolved"}]
    async with running(other):
        assert await run.result_async(timeout=10) == {"parcel": 1}
