"""What registration refuses at once, with ``INVALID_REQUEST``, because a worker would only
find out mid-run: a plain (not ``async``) function, whose tool would have been called before the
engine noticed (its effect applied, its outcome then unknown), and a tool timeout the engine
cannot use (found after ``submitted``, leaving a call that was never sent uncertain)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import Orchestrator
from orchestrator.errors import ConfigurationError, InvalidRequest


def _app(**options: Any) -> Orchestrator:
    return Orchestrator("postgresql://localhost/unused", **options)


def test_a_plain_function_is_not_registered_as_a_tool_or_a_workflow() -> None:
    app = _app()

    def charge(ctx: Any, *, cents: int) -> dict[str, int]:
        return {"cents": cents}

    def checkout(ctx: Any, data: Any) -> Any:
        return data

    with pytest.raises(InvalidRequest, match="tool charge must be an async function") as tool:
        app.tool()(charge)  # type: ignore[arg-type]
    assert tool.value.code == "INVALID_REQUEST"
    with pytest.raises(InvalidRequest, match="workflow checkout must be an async function"):
        app.workflow()(checkout)  # type: ignore[arg-type]
    assert not app.registry.tools and not app.registry.workflows


def test_a_plain_function_is_not_registered_as_a_lookup_or_a_policy_stage() -> None:
    app = _app()

    @app.tool()
    async def charge(ctx: Any) -> None: ...

    def sync(ctx: Any) -> bool:
        return True

    for register in (charge.lookup, charge.authorize, charge.approve):
        with pytest.raises(InvalidRequest, match="must be an async function"):
            register(sync)
    assert charge.lookup_fn is charge.authorize_fn is charge.approve_fn is None
    with pytest.raises(ConfigurationError, match="policy stage authorize must be an async"):
        _app(authorize=sync)


def test_async_callables_of_every_shape_are_registered() -> None:
    app = _app()

    async def fn(ctx: Any, **arguments: Any) -> Any:
        return arguments

    class Callable_:
        async def __call__(self, ctx: Any, **arguments: Any) -> Any:
            return arguments

    def traced(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Awaitable[Any]:  # returns the coroutine
            return inner(*args, **kwargs)
        return wrapper

    app.tool(name="partial")(functools.partial(fn))
    app.tool(name="instance")(Callable_())
    app.tool(name="wrapped")(traced(fn))
    assert set(app.registry.tools) == {"partial", "instance", "wrapped"}


@pytest.mark.parametrize("timeout", [5, 0.5, "10s", timedelta(0), timedelta(seconds=-1),
                                     timedelta(days=40_000)])
def test_a_tool_timeout_is_a_positive_timedelta(timeout: Any) -> None:
    app = _app()

    async def t(ctx: Any) -> None: ...

    for option in ("timeout", "authorize_timeout", "approve_timeout"):
        with pytest.raises(InvalidRequest, match=f"{option} must be a positive timedelta") as got:
            app.tool(**{option: timeout})(t)
        assert got.value.path == option
    with pytest.raises(ConfigurationError, match="tool_timeout must be a positive timedelta"):
        _app(tool_timeout=timeout)
    with pytest.raises(ConfigurationError, match="stage_timeout must be a positive timedelta"):
        _app(stage_timeout=timeout)
    assert not app.registry.tools
    app.tool(timeout=timedelta(seconds=2))(t)
