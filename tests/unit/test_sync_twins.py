"""Every sync method of the public API takes exactly the parameters of the async code it runs,
so the two cannot drift apart (a keyword added to one only is a test failure, not a
``TypeError`` a user meets later); the same for the constructors that ``create_worker``,
``run_worker``, ``create_reconciler`` and ``run_reconciler`` forward to."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest

from orchestrator import Orchestrator, RunHandle
from orchestrator.reconcile import Reconciler
from orchestrator.worker import Worker


def _parameters(fn: Callable[..., Any], drop: int) -> list[tuple[str, Any, Any, Any]]:
    """Name, kind, default and annotation (as written) of each parameter after the first
    ``drop`` ones (``self``, and ``app`` for a constructor)."""
    params = list(inspect.signature(fn).parameters.values())[drop:]
    return [(p.name, p.kind, p.default, p.annotation) for p in params]


def _twins(cls: type) -> list[str]:
    return sorted(name.removesuffix("_async") for name in vars(cls)
                  if name.endswith("_async") and name.removesuffix("_async") in vars(cls))


def test_the_twins_compared_are_all_there() -> None:
    assert {"submit", "get_run", "list_runs", "send_event", "wait", "as_completed", "cancel",
            "journal", "restart", "prune"} <= set(_twins(Orchestrator))
    assert {"info", "status", "result", "outcome", "cancel", "journal"} <= set(
        _twins(RunHandle))


@pytest.mark.parametrize(("cls", "name"), [(Orchestrator, n) for n in _twins(Orchestrator)]
                         + [(RunHandle, n) for n in _twins(RunHandle)])
def test_a_sync_twin_takes_its_async_twins_parameters(cls: type, name: str) -> None:
    sync, async_ = getattr(cls, name), getattr(cls, f"{name}_async")
    assert not inspect.iscoroutinefunction(sync)
    assert _parameters(sync, 1) == _parameters(async_, 1)
    returns = inspect.signature(async_).return_annotation
    if name == "as_completed":  # an async iterator there, a plain one here
        returns = returns.removeprefix("Async")
    assert inspect.signature(sync).return_annotation == returns
    sync_overloads, async_overloads = typing.get_overloads(sync), typing.get_overloads(async_)
    assert len(sync_overloads) == len(async_overloads)
    for one, other in zip(sync_overloads, async_overloads, strict=True):
        assert _parameters(one, 1) == _parameters(other, 1)
        assert (inspect.signature(one).return_annotation
                == inspect.signature(other).return_annotation)


@pytest.mark.parametrize(("method", "constructor"), [
    (Orchestrator.create_worker, Worker.__init__),
    (Orchestrator.run_worker, Worker.__init__),
    (Orchestrator.create_reconciler, Reconciler.__init__),
    (Orchestrator.run_reconciler, Reconciler.__init__),
])
def test_worker_and_reconciler_factories_take_their_constructors_parameters(
        method: Callable[..., Any], constructor: Callable[..., Any]) -> None:
    # The constructor's first four (config, registry, database, metrics) are the app's own.
    # run_worker and run_reconciler also serve the metrics (docs/metrics.md).
    # A worker's companions are the app's to build: its factories take ``schedules`` (tick
    # the schedules, docs/schedules.md) in their place.
    parameters = _parameters(method, 1)
    expected = _parameters(constructor, 5)
    if method.__name__.startswith("run_"):  # and they pick the process's event loop
        assert parameters[-1] == ("event_loop", inspect.Parameter.KEYWORD_ONLY, None,
                                  "str | None")
        parameters = parameters[:-1]
    if constructor is Worker.__init__:
        # Its queues too: the app passes those it declares (docs/flow.md).
        assert parameters[-1] == ("schedules", inspect.Parameter.KEYWORD_ONLY, True, "bool")
        assert [p[0] for p in expected[-2:]] == ["companions", "queues"]
        parameters, expected = parameters[:-1], expected[:-2]
    else:
        # Its retention is the app's (docs/retention.md).
        expected = [p for p in expected if p[0] != "retention"]
    if method.__name__.startswith("run_"):
        served = [(name, default) for name, _, default, _ in parameters[-2:]]
        assert served == [("metrics_port", None), ("metrics_host", "127.0.0.1")]
        parameters = parameters[:-2]
    assert parameters == expected
    assert all(kind is inspect.Parameter.KEYWORD_ONLY
               for _, kind, _, _ in _parameters(method, 1))


@pytest.mark.parametrize("cls", [Orchestrator, RunHandle])
def test_no_public_method_takes_untyped_catch_all_options(cls: type) -> None:
    for name, member in vars(cls).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        kinds = {p.kind for p in inspect.signature(member).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, name
        assert inspect.Parameter.VAR_POSITIONAL not in kinds, name


def test_run_until_idle_sync_takes_the_parameters_of_run_until_idle() -> None:
    """``run_until_idle_sync(app, scan_limit=...)`` is the async helper's option, not an
    unknown worker option passed on to ``create_worker`` (a ``TypeError``)."""
    from orchestrator import testing

    sync = inspect.signature(testing.run_until_idle_sync)
    async_ = inspect.signature(testing.run_until_idle)
    assert _parameters(testing.run_until_idle_sync, 0) == _parameters(testing.run_until_idle, 0)
    assert sync.return_annotation == async_.return_annotation
