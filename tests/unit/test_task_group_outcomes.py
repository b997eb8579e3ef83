"""Which exception of a workflow's task group decides the run's end (``_engine_error_in``): the
engine's own signals win over the workflow's errors, as they would without the group."""

from __future__ import annotations

from orchestrator.engine.control import Stop
from orchestrator.engine.control import engine_error_in as _engine_error_in
from orchestrator.errors import DatabaseError
from orchestrator.journal import Nondeterminism


def group(*excs: BaseException) -> BaseExceptionGroup[BaseException]:
    return BaseExceptionGroup("task group", list(excs))


def test_a_stop_wins_and_a_lost_lease_first() -> None:
    drain, lost = Stop("drain"), Stop("lease_lost")
    assert _engine_error_in(group(ValueError("x"), drain)) is drain
    assert _engine_error_in(group(drain, group(ValueError("y"), lost))) is lost
    deadline = Stop("deadline")  # as strong as the drain: the first one met decides
    assert _engine_error_in(group(ValueError("x"), group(deadline), drain)) is deadline


def test_then_the_database_then_nondeterminism() -> None:
    db, nd = DatabaseError("down"), Nondeterminism("differs")
    assert _engine_error_in(group(nd, ValueError("x"), db)) is db
    assert _engine_error_in(group(ValueError("x"), group(nd))) is nd


def test_only_the_workflows_own_errors_leave_the_group() -> None:
    assert _engine_error_in(group(ValueError("x"), group(KeyError("y")))) is None
