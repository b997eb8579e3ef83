"""Group commit (orchestrator.db.writer): one transaction for many runs' writes, a savepoint
each, so one rejected write never fails its neighbours."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.errors import LeaseLost


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
