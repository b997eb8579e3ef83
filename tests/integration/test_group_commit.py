"""Group commit (orchestrator.db.writer): one transaction for many runs' writes; when one of
them is rejected the batch is rolled back and every write runs alone, so one rejected write
never fails its neighbours."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.errors import LeaseLost
from tests.integration.conftest import one_turn, refuse_connections_while


async def test_a_rejected_write_rolls_back_alone(app, sql):
    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    writer = GroupWriter(app.database)

    def mark(name, fail=False):  # type: ignore[no-untyped-def]
        async def work(conn):  # type: ignore[no-untyped-def]
            await conn.execute("INSERT INTO public.marks VALUES (%s)", (name,))
            if fail:
                raise LeaseLost("fenced")
            return name

        return work

    results = await asyncio.gather(
        writer.run_in_transaction(mark("a")),
        writer.run_in_transaction(mark("b", fail=True)),
        writer.run_in_transaction(mark("c")),
        writer.run_in_transaction(mark("a")),  # a unique violation: this write alone fails
        return_exceptions=True)
    assert results[0] == "a" and results[2] == "c"
    assert isinstance(results[1], LeaseLost)
    assert results[3].__class__.__name__ == "UniqueViolation"
    assert sorted(r["name"] for r in sql("SELECT name FROM public.marks")) == ["a", "c"]
    assert writer.batches == 1 and writer.writes == 4
    await app.database.close()


async def test_a_cancelled_caller_wakes_only_once_its_write_has_landed(app, sql):
    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    writer = GroupWriter(app.database)
    started = asyncio.Event()
    go_on = asyncio.Event()

    async def slow(conn):  # type: ignore[no-untyped-def]
        started.set()
        await go_on.wait()
        await conn.execute("INSERT INTO public.marks VALUES ('kept')")
        return "kept"

    landing = writer.enqueue(slow)

    async def wait():  # type: ignore[no-untyped-def]
        return await landing

    caller = asyncio.ensure_future(wait())
    await started.wait()
    caller.cancel()
    await one_turn()  # the turn in which a cancellable landing would have woken the caller
    assert not caller.done() and not landing.cancelled()  # still waiting for the commit
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert landing.result() == "kept"  # the outcome is still there for the caller to read
    assert sql("SELECT name FROM public.marks") == [{"name": "kept"}]
    await app.database.close()


async def test_writes_that_arrive_during_a_commit_form_the_next_batch(app, sql):
    from orchestrator.db.writer import GroupWriter

    writer = GroupWriter(app.database)

    async def noop(conn):  # type: ignore[no-untyped-def]
        await conn.execute("SELECT 1")

    await asyncio.gather(*(writer.run_in_transaction(noop) for _ in range(50)))
    assert writer.writes == 50 and writer.batches <= 2
    with pytest.raises(ZeroDivisionError):
        async def broken(conn):  # type: ignore[no-untyped-def]
            return 1 / 0

        await writer.run_in_transaction(broken)
    await app.database.close()


# Like the engine's hot writes: every row leaves a trace (here in public.tries, as a fence
# leaves a revision) and the statement refuses a row that did not apply, so that a batch holding
# a miss can never commit any of it.
_MARK_ROWS = """
WITH x AS (
    SELECT t.i, r.* FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS t(j, i),
                         jsonb_to_record(t.j) AS r(name text)
), tried AS (
    INSERT INTO public.tries SELECT name FROM x
), ins AS (
    INSERT INTO public.marks SELECT name FROM x ON CONFLICT DO NOTHING RETURNING name
)
SELECT x.i, orchestrator.row_applied(ins.name IS NOT NULL, 'mark') AS inserted
FROM x LEFT JOIN ins ON ins.name = x.name
"""


def _marks_tables(sql):  # type: ignore[no-untyped-def]
    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    sql("CREATE TABLE public.tries (name text)")


def _mark_statement(name: str, key: object = None):  # type: ignore[no-untyped-def]
    import json

    from orchestrator.db.writer import Statement

    def check(row):  # type: ignore[no-untyped-def]
        if row is None or not row["inserted"]:
            raise LeaseLost(f"{name} was already marked")
        return name

    return Statement(_MARK_ROWS, json.dumps({"name": name}), key if key is not None else name,
                     check)


async def test_statements_of_one_kind_share_one_statement_and_are_checked_row_by_row(app, sql):
    from orchestrator.db.writer import GroupWriter

    _marks_tables(sql)
    sql("INSERT INTO public.marks VALUES ('taken')")
    writer = GroupWriter(app.database)
    results = await asyncio.gather(*(writer.run_statement(_mark_statement(n))
                                     for n in ("a", "b", "c")))
    assert results == ["a", "b", "c"]
    assert writer.batches == 1 and writer.statements == 1  # three writes, one statement

    # One row that does not apply: the shared statement is rolled back and every write runs
    # alone, so only that write fails and its neighbours still commit.
    results = await asyncio.gather(
        *(writer.run_statement(_mark_statement(n)) for n in ("d", "taken", "e")),
        return_exceptions=True)
    assert results[0] == "d" and results[2] == "e"
    assert isinstance(results[1], LeaseLost)
    assert sorted(r["name"] for r in sql("SELECT name FROM public.marks")) == [
        "a", "b", "c", "d", "e", "taken"]
    # Nothing of the write that missed was committed, neither in the batch nor alone.
    assert sorted(r["name"] for r in sql("SELECT name FROM public.tries")) == [
        "a", "b", "c", "d", "e"]
    await app.database.close()


async def test_two_writes_with_one_key_never_share_a_statement(app, sql):
    from orchestrator.db.writer import GroupWriter

    _marks_tables(sql)
    writer = GroupWriter(app.database)
    results = await asyncio.gather(writer.run_statement(_mark_statement("x", key="run-1")),
                                   writer.run_statement(_mark_statement("y", key="run-1")),
                                   writer.run_statement(_mark_statement("z", key="run-2")))
    assert results == ["x", "y", "z"]
    assert writer.batches == 1 and writer.statements == 2
    await app.database.close()


@pytest.mark.timeout(60)
async def test_a_write_queued_as_the_flusher_finishes_is_still_written(app, sql):
    """Each write here is queued by a coroutine woken by the previous commit, in the same loop
    step in which the flusher finds its queue empty: it must start a flusher of its own."""
    from orchestrator.db.writer import GroupWriter

    _marks_tables(sql)
    writer = GroupWriter(app.database)

    async def one_after_another() -> None:
        for i in range(20):  # awaited directly: woken by the commit itself (no wrapper task)
            assert await writer.run_statement(_mark_statement(f"m{i}")) == f"m{i}"

    await asyncio.wait_for(one_after_another(), 30)
    assert writer.writes == 20
    await app.database.close()


async def _claimed_runs(app, n):  # type: ignore[no-untyped-def]
    """``n`` runs of a trivial workflow, claimed by worker "w" (running, lease token 1)."""
    from orchestrator.db import runs as runs_db

    @app.workflow(name="job")
    async def job(ctx, data):  # type: ignore[no-untyped-def]
        return data

    for i in range(n):
        await app.submit_async(job, {"i": i})
    async with app.database.connection() as conn:
        return await runs_db.run_claim_ready(conn, worker="w", workflows=["job@1"], limit=n,
                                             ttl=30)


def _begin(claim, token=None):  # type: ignore[no-untyped-def]
    """The fast write-ahead ``submitted`` of a call at position 0 of a claimed run."""
    from orchestrator.db import steps as steps_db

    return steps_db.operation_begin_fast({
        "run_id": claim["id"], "position": 0, "attempt": 1, "tool_name": "t",
        "tool_version": "1", "effect_class": "consequential", "tenant": claim["tenant"],
        "principal": claim["principal"], "intent_digest": "0" * 64, "arguments": "{}",
        "idempotency_key": f"{claim['id']}:0:1", "worker_id": "w",
        "token": claim["lease_token"] if token is None else token},
        expected=claim["revision"], v=1)


async def test_a_fenced_row_of_a_shared_statement_writes_nothing_and_fails_alone(app, sql):
    """CONTRACT C6 through the set-based hot path: two runs' write-ahead ``submitted`` rows go
    to the server together; the one whose lease token is stale must leave no operation, no
    journal event and no revision change, and its neighbour must still commit."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    good, stale = await _claimed_runs(app, 2)
    writer = GroupWriter(app.database)
    results = await asyncio.gather(
        writer.run_statement(_begin(good)),
        writer.run_statement(_begin(stale, stale["lease_token"] - 1)),
        return_exceptions=True)
    assert isinstance(results[0], tuple) and isinstance(results[0][0], int)
    assert isinstance(results[1], steps_db.FastPathMiss)
    rows = {r["id"]: r for r in sql(
        "SELECT r.id, r.revision, (SELECT count(*) FROM orchestrator.operations o "
        "WHERE o.run_id = r.id) AS ops, (SELECT count(*) FROM orchestrator.journal j "
        "WHERE j.run_id = r.id) AS events FROM orchestrator.runs r")}
    assert (rows[good["id"]]["revision"], rows[good["id"]]["ops"],
            rows[good["id"]]["events"]) == (good["revision"] + 1, 1, 1)
    assert (rows[stale["id"]]["revision"], rows[stale["id"]]["ops"],
            rows[stale["id"]]["events"]) == (stale["revision"], 0, 0)
    assert writer.statements >= 1
    await app.database.close()


@pytest.mark.parametrize("name", ["begin", "commit", "succeed"])
def test_the_hot_statements_cached_plans_probe_by_key_on_a_new_database(name, sql):
    """The worker prepares its set-based statements once per connection and PostgreSQL keeps
    their generic plan, made while the tables were empty. That plan must look runs and
    operations up by key, never scan a table or the partial index of running runs, or every
    batch would cost more as history grows (migration 0005: batch_rows, the unsettled index;
    0039: the receipt's call by its id)."""
    from orchestrator.db import steps as steps_db

    statement = {"begin": steps_db.OPERATION_BEGIN, "commit": steps_db.RECEIPT_COMMIT,
                 "succeed": steps_db.RUN_SUCCEED}[name]
    sql("SET plan_cache_mode = force_generic_plan")
    sql(f"PREPARE hot(jsonb) AS {statement.replace('%s', '$1')}")
    plan = "\n".join(r["QUERY PLAN"] for r in sql("EXPLAIN EXECUTE hot('[]')"))
    sql("DEALLOCATE hot")
    sql("RESET plan_cache_mode")
    assert "Index Scan using pk_runs on runs" in plan, plan
    # The receipt's call by its id, not among its run's calls (migration 0039).
    assert "Index Scan using pk_operations on operations" in plan, plan
    for bad in ("Seq Scan on runs", "Seq Scan on operations", "ix_runs_lease_expiry"):
        assert bad not in plan, plan


async def test_a_half_applied_row_commits_nothing_and_its_neighbour_still_commits(app, sql):
    """CONTRACT: a run's revision is its last journal seq. A row whose fence passes but whose
    write does not apply (its operation exists already, or is no longer ``submitted``) would
    move the revision without an event; the statement refuses it (row_applied), so nothing of
    it is committed, while a good row beside it commits."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    good, taken, settled = await _claimed_runs(app, 3)
    writer = GroupWriter(app.database)
    # `taken` already has an operation at (0, 1) that its journal does not show; `settled`
    # has a `submitted` one, committed behind the writer's back before the receipt arrives.
    await writer.run_statement(_begin(taken))
    (settled_op, _) = await writer.run_statement(_begin(settled))
    sql("UPDATE orchestrator.runs SET revision = revision - 1 WHERE id = %s", (taken["id"],))
    # (The call's entry is its operation row: taken off the journal behind the guards.)
    sql("ALTER TABLE orchestrator.operations DISABLE TRIGGER USER")
    sql("UPDATE orchestrator.operations SET seq = NULL WHERE run_id = %s", (taken["id"],))
    sql("ALTER TABLE orchestrator.operations ENABLE TRIGGER USER")
    sql("UPDATE orchestrator.operations SET state = 'committed', receipt = '{}', "
        "receipt_digest = 'x' WHERE id = %s", (settled_op,))
    before = {r["id"]: r for r in sql(
        "SELECT r.id, r.revision, (SELECT count(*) FROM orchestrator.journal j "
        "WHERE j.run_id = r.id) AS events FROM orchestrator.runs r")}

    receipt = steps_db.operation_commit_fast(
        run_id=settled["id"], token=settled["lease_token"], expected=settled["revision"] + 1,
        op_id=settled_op, position=0, name="t", receipt='{"ok":true}', digest="d", v=1)
    results = await asyncio.gather(writer.run_statement(_begin(good)),
                                   writer.run_statement(_begin(taken)),
                                   writer.run_statement(receipt), return_exceptions=True)
    assert isinstance(results[0], tuple) and isinstance(results[0][0], int)
    assert isinstance(results[1], steps_db.FastPathMiss)
    assert isinstance(results[2], steps_db.FastPathMiss)
    after = {r["id"]: r for r in sql(
        "SELECT r.id, r.revision, (SELECT count(*) FROM orchestrator.journal j "
        "WHERE j.run_id = r.id) AS events FROM orchestrator.runs r")}
    for claim in (taken, settled):  # the fence passed for both, yet nothing moved
        assert after[claim["id"]] == before[claim["id"]]
    assert after[good["id"]]["revision"] == good["revision"] + 1
    assert after[good["id"]]["events"] == 1
    await app.database.close()


def _riding(op_id, position=0):  # type: ignore[no-untyped-def]
    from orchestrator.db import steps as steps_db

    return steps_db.Receipt(op_id=op_id, position=position, name="t", text='{"ok":true}',
                          digest="d")


def _next_begin(claim, receipt, expected):  # type: ignore[no-untyped-def]
    """The fast ``submitted`` of a call at position 1 carrying the receipt of position 0."""
    from orchestrator.db import steps as steps_db

    return steps_db.operation_begin_fast({
        "run_id": claim["id"], "position": 1, "attempt": 1, "tool_name": "t",
        "tool_version": "1", "effect_class": "consequential", "tenant": claim["tenant"],
        "principal": claim["principal"], "intent_digest": "1" * 64, "arguments": "{}",
        "idempotency_key": f"{claim['id']}:1:1", "worker_id": "w",
        "token": claim["lease_token"]}, expected=expected, v=1, receipt=receipt)


async def test_a_receipt_rides_in_the_next_begin_and_in_the_success(app, sql):
    """One fenced row commits the previous call (its receipt and ``call.completed``) and
    records the next call's ``submitted`` after it; the success row does the same for the
    last call. The journal keeps the order of what happened."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    (claim,) = await _claimed_runs(app, 1)
    writer = GroupWriter(app.database)
    first, _ = await writer.run_statement(_begin(claim))
    second, _ = await writer.run_statement(
        _next_begin(claim, _riding(first), claim["revision"] + 1))
    assert sql("SELECT revision FROM orchestrator.runs")[0]["revision"] == claim["revision"] + 3
    ops = sql("SELECT id, state, receipt, receipt_digest FROM orchestrator.operations "
              "ORDER BY id")
    assert [(o["id"], o["state"]) for o in ops] == [(first, "committed"), (second, "submitted")]
    assert (ops[0]["receipt"], ops[0]["receipt_digest"]) == ({"ok": True}, "d")
    await writer.run_statement(steps_db.run_succeed_fast(
        run_id=claim["id"], token=claim["lease_token"], expected=claim["revision"] + 3,
        result='{"done":1}', v=1, receipt=_riding(second, position=1)))
    events = sql("SELECT seq, kind, position, payload FROM orchestrator.journal ORDER BY seq")
    assert [(e["seq"] - claim["revision"], e["kind"], e["position"]) for e in events] == [
        (1, "call.submitted", 0), (2, "call.completed", 0), (3, "call.submitted", 1),
        (4, "call.completed", 1), (5, "run.completed", None)]
    assert events[1]["payload"] == {"op": first, "result": {"ok": True}}
    run = sql("SELECT status, revision, result FROM orchestrator.runs")[0]
    assert (run["status"], run["revision"], run["result"]) == (
        "succeeded", claim["revision"] + 5, {"done": 1})
    assert {o["state"] for o in sql("SELECT state FROM orchestrator.operations")} == {
        "committed"}
    await app.database.close()


async def test_a_riding_receipt_that_does_not_apply_takes_its_row_down(app, sql):
    """The receipt is part of its row: if its operation is no longer ``submitted`` (settled
    behind the worker's back), neither the next call's ``submitted`` nor the run's success
    may commit, and nothing of the row is left."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    (claim,) = await _claimed_runs(app, 1)
    writer = GroupWriter(app.database)
    first, _ = await writer.run_statement(_begin(claim))
    sql("UPDATE orchestrator.operations SET state = 'unknown' WHERE id = %s", (first,))
    before = sql("SELECT revision, status FROM orchestrator.runs")
    with pytest.raises(steps_db.FastPathMiss):
        await writer.run_statement(_next_begin(claim, _riding(first), claim["revision"] + 1))
    sql("UPDATE orchestrator.operations SET state = 'committed', receipt = '{}', "
        "receipt_digest = 'x' WHERE id = %s", (first,))  # as a reconciliation would
    with pytest.raises(steps_db.FastPathMiss):
        await writer.run_statement(steps_db.run_succeed_fast(
            run_id=claim["id"], token=claim["lease_token"], expected=claim["revision"] + 1,
            result="1", v=1, receipt=_riding(first)))
    assert sql("SELECT revision, status FROM orchestrator.runs") == before
    assert sql("SELECT count(*) AS n FROM orchestrator.operations")[0]["n"] == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.journal")[0]["n"] == 1
    await app.database.close()


async def test_a_success_carrying_one_receipt_still_refuses_another_unsettled_call(app, sql):
    """CONTRACT C5/C8: a run never ends with an operation dispatched and unsettled. The success
    row's check leaves out only the operation whose receipt it carries, never another one."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    (claim,) = await _claimed_runs(app, 1)
    writer = GroupWriter(app.database)
    await writer.run_statement(_begin(claim))  # position 0: submitted, stays so
    second, _ = await writer.run_statement(_next_begin(claim, None, claim["revision"] + 1))
    before = sql("SELECT revision, status FROM orchestrator.runs")
    with pytest.raises(steps_db.FastPathMiss):
        await writer.run_statement(steps_db.run_succeed_fast(
            run_id=claim["id"], token=claim["lease_token"], expected=claim["revision"] + 2,
            result="1", v=1, receipt=_riding(second, position=1)))
    assert sql("SELECT revision, status FROM orchestrator.runs") == before
    assert sorted(o["state"] for o in sql("SELECT state FROM orchestrator.operations")) == [
        "submitted", "submitted"]
    await app.database.close()


async def test_a_stopping_worker_does_not_wait_forever_for_a_database_that_does_not_answer(
        app, sql, monkeypatch):
    """A run cancelled at the end of a drain wakes only once its write in flight has landed;
    when the database does not answer, the worker gives up on that write after a grace
    period (the write's outcome is then unknown: the run is dropped and its lease lapses)."""
    import time

    from orchestrator import worker as worker_module
    from orchestrator.db.writer import GroupWriter
    from tests.integration.conftest import running, wait_for

    never = asyncio.Event()
    sent = asyncio.Event()

    async def no_answer(self, batch):  # type: ignore[no-untyped-def]
        sent.set()
        await never.wait()

    monkeypatch.setattr(GroupWriter, "_together", no_answer)
    monkeypatch.setattr(worker_module, "WRITE_GRACE", 0.3)

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return 1

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    started = time.monotonic()
    async with running(app, drain_timeout=0.2) as worker:
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(sent.wait(), 10)
        assert worker.writer.writes == 0
    assert time.monotonic() - started < 10  # not the writer's attempts of 30 s each
    await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                               (run.id,))[0]["status"] == "running")
    assert sql("SELECT count(*) AS n FROM orchestrator.operations")[0]["n"] == 0


async def test_statements_are_committed_by_the_pipeline_sync_only_in_autocommit(app, sql,
                                                                               migrated_database_url):
    """A batch of statements is committed by its pipeline's Sync, which holds only for a
    connection in autocommit mode (otherwise psycopg opens a transaction that nothing would
    commit): such a connection is refused and nothing is written."""
    import psycopg

    from orchestrator.db.writer import GroupWriter, _group
    from orchestrator.errors import DatabaseError

    _marks_tables(sql)
    writer = GroupWriter(app.database)
    statement = _mark_statement("x")
    future = asyncio.get_running_loop().create_future()
    async with await psycopg.AsyncConnection.connect(migrated_database_url) as conn:
        assert not conn.autocommit
        with pytest.raises(DatabaseError):
            await writer._commit_statements(conn, _group([(statement, future)]), [])
    assert sql("SELECT name FROM public.marks") == []
    assert await writer.run_statement(_mark_statement("y")) == "y"  # the pool's: autocommit
    assert sql("SELECT name FROM public.marks") == [{"name": "y"}]
    await app.database.close()  # this loop's pool, before the loop ends


async def test_a_receipt_is_an_entry_of_its_operation_row_only_under_the_rows_lease(app, sql):
    """CONTRACT C3, C6: a call's entries are its operation row, both carrying the row's lease
    token. A receipt written under that token goes on the row (``completed_seq``); one written
    under a later lease (the call begun, the run claimed again, the call sent by the new
    holder) is a stored entry with the writer's token, so that along ``seq`` the tokens never
    go down."""
    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    same, later = await _claimed_runs(app, 2)
    writer = GroupWriter(app.database)
    ops = {}
    for claim in (same, later):
        (ops[claim["id"]], _) = await writer.run_statement(_begin(claim))
    # `later` is claimed again: a newer token, the same revision.
    sql("UPDATE orchestrator.runs SET lease_token = lease_token + 1 WHERE id = %s",
        (later["id"],))
    for claim, token in ((same, same["lease_token"]), (later, later["lease_token"] + 1)):
        await writer.run_statement(steps_db.operation_commit_fast(
            run_id=claim["id"], token=token, expected=claim["revision"] + 1,
            op_id=ops[claim["id"]], position=0, name="t", receipt='{"ok":true}', digest="d",
            v=1))

    def journal(claim):  # type: ignore[no-untyped-def]
        return sql("SELECT seq, kind, lease_token FROM orchestrator.journal WHERE run_id = %s "
                   "ORDER BY seq", (claim["id"],))

    def stored(claim):  # type: ignore[no-untyped-def]
        return sql("SELECT seq, kind, lease_token FROM orchestrator.journal_entries "
                   "WHERE run_id = %s", (claim["id"],))

    token = same["lease_token"]
    assert journal(same) == [{"seq": 1, "kind": "call.submitted", "lease_token": token},
                             {"seq": 2, "kind": "call.completed", "lease_token": token}]
    assert stored(same) == []
    token = later["lease_token"]
    assert journal(later) == [{"seq": 1, "kind": "call.submitted", "lease_token": token},
                              {"seq": 2, "kind": "call.completed", "lease_token": token + 1}]
    assert stored(later) == [{"seq": 2, "kind": "call.completed", "lease_token": token + 1}]
    assert sql("SELECT completed_seq FROM orchestrator.operations WHERE id = %s",
               (ops[later["id"]],)) == [{"completed_seq": None}]
    await app.database.close()


async def test_a_connection_out_of_step_is_the_connections_failure_not_the_writes(app, sql):
    """psycopg's own InternalError (no SQLSTATE: "received 2 results from command 'COMMIT'",
    seen through a transaction pooler whose server session was terminated under a
    transaction) says nothing of the write: the writer does not hand it to the write as its
    outcome (a workflow would have seen it and failed, WORKFLOW_FAILED), it closes that
    connection and writes the batch again on another. A server's InternalError (it has a
    SQLSTATE) still belongs to the write."""
    import psycopg

    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    writer = GroupWriter(app.database)
    used: list[psycopg.AsyncConnection] = []  # type: ignore[type-arg]

    async def once_out_of_step(conn):  # type: ignore[no-untyped-def]
        used.append(conn)
        await conn.execute("INSERT INTO public.marks VALUES ('a')")
        if len(used) == 1:
            raise psycopg.InternalError("received 2 results from command 'COMMIT'")
        return "a"

    assert await writer.run_in_transaction(once_out_of_step) == "a"
    assert len(used) == 2 and used[0].closed and used[1] is not used[0]
    assert [r["name"] for r in sql("SELECT name FROM public.marks")] == ["a"]

    async def server_says_internal(conn):  # type: ignore[no-untyped-def]
        await conn.execute("DO $$ BEGIN RAISE EXCEPTION 'broken' USING ERRCODE = 'XX000'; "
                           "END $$")

    with pytest.raises(psycopg.errors.InternalError_):
        await writer.run_in_transaction(server_says_internal)
    await app.database.close()


async def test_writes_committed_alone_are_not_written_again_when_a_later_one_loses_its_connection(
        app, sql):
    """After a rejected write the batch's writes run one by one, each committing on its own.
    When the connection is lost under a later one, only the writes not yet committed go to
    the next batch: one that committed alone is answered with its own outcome, never run a
    second time (a fenced write would then be rejected, as if its lease were gone)."""
    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    writer = GroupWriter(app.database)
    runs = {"a": 0, "b": 0, "c": 0}

    def mark(name, fail=False):  # type: ignore[no-untyped-def]
        async def work(conn):  # type: ignore[no-untyped-def]
            runs[name] += 1
            if name == "c" and runs[name] == 1:  # its first run (alone): the server goes away
                await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            await conn.execute("INSERT INTO public.marks VALUES (%s)", (name,))
            if fail:
                raise LeaseLost("fenced")
            return name

        return work

    results = await asyncio.gather(
        writer.run_in_transaction(mark("a")),
        writer.run_in_transaction(mark("b", fail=True)),
        writer.run_in_transaction(mark("c")),
        return_exceptions=True)
    assert results[0] == "a" and isinstance(results[1], LeaseLost) and results[2] == "c"
    # a and b in the batch (b is rejected: c never runs there), then alone; c alone, twice
    assert runs == {"a": 2, "b": 2, "c": 2}
    assert sorted(r["name"] for r in sql("SELECT name FROM public.marks")) == ["a", "c"]
    await app.database.close()


async def test_a_write_that_cannot_reach_the_database_is_tried_again_for_the_writers_patience(
        app, sql, monkeypatch):
    """Refused connections fail each attempt within microseconds: the write is tried again
    with a growing pause until the database answers, within the writer's patience, not three
    times in a row; once the patience is spent it gets DATABASE_UNAVAILABLE."""
    import time

    from orchestrator.db.writer import GroupWriter
    from orchestrator.errors import DatabaseError

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    await app.database.pool()  # opened while the database answers
    tries: list[float] = []
    back_at = time.monotonic() + 1.0
    refuse_connections_while(monkeypatch, lambda: tries.append(time.monotonic()) or
                   time.monotonic() < back_at)
    writer = GroupWriter(app.database, patience=3.0)

    async def mark(conn):  # type: ignore[no-untyped-def]
        await conn.execute("INSERT INTO public.marks VALUES ('a')")
        return "a"

    assert await writer.run_in_transaction(mark) == "a"
    assert [r["name"] for r in sql("SELECT name FROM public.marks")] == ["a"]
    pauses = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert 4 <= len(tries) <= 12, pauses  # 50 ms, doubling: not a spin, not a second apart
    assert pauses[0] < 0.2 and max(pauses) < 1.1, pauses

    back_at = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(DatabaseError) as down:
        await writer.run_in_transaction(mark)
    assert down.value.code == "DATABASE_UNAVAILABLE"
    assert 2.5 < time.monotonic() - started < 5
    await app.database.close()


async def test_a_rejected_row_fails_at_once_however_patient_the_writer(app, sql):
    """Patience is for a database that cannot be reached: a row the database refuses (a
    stale lease token: SQLSTATE OR001; a constraint) is answered at once, as always."""
    import time

    from orchestrator.db import steps as steps_db
    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    sql("INSERT INTO public.marks VALUES ('a')")
    (stale,) = await _claimed_runs(app, 1)
    writer = GroupWriter(app.database, patience=30.0)

    async def mark(conn):  # type: ignore[no-untyped-def]
        await conn.execute("INSERT INTO public.marks VALUES ('a')")

    started = time.monotonic()
    results = await asyncio.gather(
        writer.run_statement(_begin(stale, stale["lease_token"] - 1)),
        writer.run_in_transaction(mark), return_exceptions=True)
    assert isinstance(results[0], steps_db.FastPathMiss)
    assert results[1].__class__.__name__ == "UniqueViolation"
    assert time.monotonic() - started < 1
    await app.database.close()


async def test_a_write_waiting_for_the_database_holds_no_stop(app, monkeypatch):
    """A write waiting out an outage (a patience of a minute) is answered with
    DATABASE_UNAVAILABLE at once when its worker hurries (a drain that ran out of time) or
    abandons its writes."""
    from orchestrator.db.writer import GroupWriter
    from orchestrator.errors import DatabaseError

    await app.database.pool()
    refuse_connections_while(monkeypatch, lambda: True)

    async def mark(conn):  # type: ignore[no-untyped-def]
        return "a"

    for stop in ("hurry", "abandon"):
        writer = GroupWriter(app.database, patience=60.0)
        landing = writer.enqueue(mark)
        await asyncio.sleep(0.3)  # failed several times; waiting to be tried again
        assert not landing.done()
        getattr(writer, stop)("the worker stopped")
        await asyncio.sleep(0)
        assert landing.done()
        assert isinstance(landing.exception(), DatabaseError)
    await app.database.close()


async def test_a_drain_that_runs_out_of_time_is_not_held_by_a_write_waiting_out_an_outage(
        make_app, monkeypatch):
    """A worker with a minute's lease (so half a minute of patience for a write that cannot
    reach the database) stops within its drain timeout and the write grace while its run's
    success waits for a database that refuses every connection: the drain that ran out of
    time answers the waiting write at once, and the run is let go."""
    import time

    from tests.integration.conftest import running

    app = make_app(lease_ttl=60.0)
    entered, release = asyncio.Event(), asyncio.Event()
    down = False

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return 1

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    refuse_connections_while(monkeypatch, lambda: down)
    async with running(app, lease_ttl=60.0, drain_timeout=0.5) as worker:
        await app.submit_async(wf, {})
        await asyncio.wait_for(entered.wait(), 10)
        down = True
        release.set()
        await asyncio.sleep(0.3)  # the success is waiting to be tried again
        assert worker.writer.writes >= 1 and worker.writer._queue
        started = time.monotonic()
    assert time.monotonic() - started < 8  # the drain and the grace, not the 30 s patience
    assert worker.metrics.snapshot().get("lease_losses", 0) == 1


async def test_a_write_meeting_an_outage_logs_once_and_once_more_when_it_lands(
        app, sql, monkeypatch, caplog):
    """Writes waiting out an outage are tried again every 50 ms to a second: the writer says
    once that its group commits fail because the database cannot be reached, and once that
    they succeed again, not a WARNING per attempt (a dozen in two seconds, hundreds in a
    long outage on every worker, which buried the line that mattered)."""
    import logging
    import time

    from orchestrator.db.writer import GroupWriter

    sql("CREATE TABLE public.marks (name text PRIMARY KEY)")
    await app.database.pool()
    tries: list[float] = []
    back_at = time.monotonic() + 1.5
    refuse_connections_while(monkeypatch, lambda: tries.append(time.monotonic()) or
                   time.monotonic() < back_at)
    writer = GroupWriter(app.database, patience=5.0)

    def mark(name):  # type: ignore[no-untyped-def]
        async def work(conn):  # type: ignore[no-untyped-def]
            await conn.execute("INSERT INTO public.marks VALUES (%s)", (name,))
            return name

        return work

    caplog.set_level(logging.INFO, logger="orchestrator.worker")
    first = writer.run_in_transaction(mark("a"))
    await asyncio.sleep(0.5)  # a second write joins the outage under way
    assert await asyncio.gather(first, writer.run_in_transaction(mark("b"))) == ["a", "b"]
    assert len(tries) >= 5  # tried again and again
    lines = [r for r in caplog.records if r.name == "orchestrator.worker"]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"], [r.message for r in lines]
    assert lines[0].message.startswith("a group commit failed (DatabaseError)")
    assert "cannot be reached" in lines[0].message
    assert lines[1].message.startswith("group commits succeed again")

    caplog.clear()  # the next outage is said again
    back_at = time.monotonic() + 0.3
    assert await writer.run_in_transaction(mark("c")) == "c"
    assert [r.levelname for r in caplog.records if r.name == "orchestrator.worker"] == [
        "WARNING", "INFO"]
    await app.database.close()


async def test_a_read_that_cannot_reach_the_database_waits_as_patiently_as_a_write(
        app, sql, monkeypatch):
    """``GroupWriter.patiently`` (a run's reads, ``Session.read``): a read that cannot reach
    the database is tried again with the writer's growing pause until the database answers,
    within the writer's patience; once it is spent, DATABASE_UNAVAILABLE. A query the
    database rejects fails at once, and a writer without patience does not wait."""
    import time

    import psycopg

    from orchestrator.db.writer import GroupWriter
    from orchestrator.errors import DatabaseError

    await app.database.pool()
    tries: list[float] = []
    back_at = time.monotonic() + 1.0
    refuse_connections_while(monkeypatch, lambda: tries.append(time.monotonic()) or
                   time.monotonic() < back_at)
    writer = GroupWriter(app.database, patience=3.0)

    async def one(conn):  # type: ignore[no-untyped-def]
        return (await (await conn.execute("SELECT 1 AS one")).fetchone())["one"]

    def read(work):  # type: ignore[no-untyped-def]
        return writer.patiently(lambda: app.database.run_in_transaction(work))

    assert await read(one) == 1
    assert time.monotonic() >= back_at
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert max(gaps) < 1.1 and len(tries) < 60, gaps  # paused, not spinning, not stalled

    back_at = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(DatabaseError) as down:
        await read(one)
    assert down.value.code == "DATABASE_UNAVAILABLE"
    assert 2.5 < time.monotonic() - started < 5

    back_at = 0.0  # up again: a query the database rejects is not waited on

    async def wrong(conn):  # type: ignore[no-untyped-def]
        await conn.execute("SELECT 1 / 0")

    started = time.monotonic()
    with pytest.raises(psycopg.errors.DivisionByZero):
        await read(wrong)
    assert time.monotonic() - started < 0.5

    back_at = time.monotonic() + 60
    started = time.monotonic()
    with pytest.raises(DatabaseError):
        await GroupWriter(app.database).patiently(
            lambda: app.database.run_in_transaction(one))
    assert time.monotonic() - started < 1
    await app.database.close()


async def test_a_read_waiting_for_the_database_holds_no_stop(app, monkeypatch):
    """A read waiting out an outage (a patience of a minute) gets DATABASE_UNAVAILABLE at
    once when its worker hurries (a drain that ran out of time) or abandons its writes, and
    so does one that starts after that."""
    from orchestrator.db.writer import GroupWriter
    from orchestrator.errors import DatabaseError

    await app.database.pool()
    refuse_connections_while(monkeypatch, lambda: True)

    async def one(conn):  # type: ignore[no-untyped-def]
        return 1

    def read(writer):  # type: ignore[no-untyped-def]
        return asyncio.ensure_future(
            writer.patiently(lambda: app.database.run_in_transaction(one)))

    for stop in ("hurry", "abandon"):
        writer = GroupWriter(app.database, patience=60.0)
        waiting = read(writer)
        await asyncio.sleep(1.5)  # failed several times; waiting to be tried again
        assert not waiting.done()
        getattr(writer, stop)("the worker stopped")
        await asyncio.sleep(0.2)
        assert waiting.done() and isinstance(waiting.exception(), DatabaseError), stop
        later = read(writer)
        await asyncio.sleep(1.0)  # one attempt (the storage layer's few quick tries), no wait
        assert later.done() and isinstance(later.exception(), DatabaseError), stop
    await app.database.close()


async def test_a_drain_that_runs_out_of_time_is_not_held_by_a_read_waiting_out_an_outage(
        make_app, monkeypatch):
    """As for a write: a worker with a minute's lease whose run's read (a parent's look at its
    child) waits for a database that refuses every connection stops within its drain timeout
    and the write grace, not after the read's half minute of patience."""
    import time

    import psycopg

    from orchestrator.db import runs as runs_db
    from tests.integration.conftest import running, wait_for

    app = make_app(lease_ttl=60.0)
    down = False

    @app.workflow()
    async def child(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.run_child(child, data)

    reads: list[object] = []

    async def cut_under_the_read(conn, parent_id, positions):  # type: ignore[no-untyped-def]
        nonlocal down
        reads.append(parent_id)
        down = True
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    refuse_connections_while(monkeypatch, lambda: down)
    monkeypatch.setattr(runs_db, "run_children_status", cut_under_the_read)
    async with running(app, lease_ttl=60.0, drain_timeout=0.5) as worker:
        await app.submit_async(parent, 1)
        await wait_for(lambda: reads)
        await asyncio.sleep(0.5)  # the read is waiting to be tried again
        assert worker._running
        started = time.monotonic()
    assert time.monotonic() - started < 8  # the drain and the grace, not the 30 s patience
    assert worker.metrics.snapshot().get("runs_succeeded", 0) == 0  # let go, not finished
