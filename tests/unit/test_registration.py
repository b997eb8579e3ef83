"""What registration refuses at once, with ``INVALID_REQUEST``, because a worker would only
find out mid-run: a plain (not ``async``) function, whose tool would have been called before the
engine noticed (its effect applied, its outcome then unknown), and a tool timeout the engine
cannot use (found after ``submitted``, leaving a call that was never sent uncertain), a
function the engine cannot call as it will (its signature), and an object with no name of its
own registered without ``name=``."""

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


@pytest.mark.parametrize("timeout", [0, -1, 0.0, -0.5, 1e-7, float("nan"), float("inf"),
                                     float("-inf"), pytest.param(10**400, id="10**400"),
                                     True, False, "10s", "5", None, timedelta(0),
                                     timedelta(seconds=-1), timedelta(days=40_000),
                                     40_000 * 86_400])
def test_a_tool_timeout_is_a_positive_timedelta_or_number_of_seconds(timeout: Any) -> None:
    app = _app()

    async def t(ctx: Any) -> None: ...

    for option in ("timeout", "authorize_timeout", "approve_timeout"):
        if timeout is None:
            continue  # None is each option's default (the app's), not a bad value
        with pytest.raises(InvalidRequest, match=f"{option} must be a positive timedelta or "
                                                 f"a number of seconds") as got:
            app.tool(**{option: timeout})(t)
        assert got.value.code == "INVALID_REQUEST"
        assert got.value.path == option
    with pytest.raises(ConfigurationError, match="tool_timeout must be a positive timedelta"):
        _app(tool_timeout=timeout)
    with pytest.raises(ConfigurationError, match="stage_timeout must be a positive timedelta"):
        _app(stage_timeout=timeout)
    assert not app.registry.tools
    app.tool(timeout=timedelta(seconds=2))(t)


@pytest.mark.parametrize("seconds", [5, 0.5, 86_400 * 36_600])
def test_a_number_of_seconds_is_the_equal_timedelta(seconds: float) -> None:
    """As ``ctx.sleep(5)`` and ``wait_for_event(..., timeout=5)``: a tool's time budgets (and
    the app's defaults for them) take a number of seconds as well as a timedelta, and the
    number means exactly the timedelta of that many seconds."""
    as_number = _app(tool_timeout=seconds, stage_timeout=seconds)
    as_timedelta = _app(tool_timeout=timedelta(seconds=seconds),
                        stage_timeout=timedelta(seconds=seconds))
    assert as_number.tool_timeout == as_timedelta.tool_timeout == timedelta(seconds=seconds)
    assert isinstance(as_number.tool_timeout, timedelta)
    assert as_number.stage_timeout == as_timedelta.stage_timeout == seconds

    async def t(ctx: Any) -> None: ...

    options = ("timeout", "authorize_timeout", "approve_timeout")
    number = as_number.tool(**dict.fromkeys(options, seconds))(t)
    same = as_timedelta.tool(**dict.fromkeys(options, timedelta(seconds=seconds)))(t)
    assert number.timeout == same.timeout == timedelta(seconds=seconds)
    assert isinstance(number.timeout, timedelta)
    assert number.authorize_timeout == same.authorize_timeout == seconds
    assert number.approve_timeout == same.approve_timeout == seconds
    # The app's defaults, given as numbers, reach the tools that set none as the timedelta would.
    default = as_number.tool(name="default")(t)
    assert default.timeout is None
    assert default.authorize_timeout == default.approve_timeout == seconds


@pytest.mark.parametrize("effect", ["write", "Idempotent", "", None, 1])
def test_an_effect_class_that_is_not_one_of_the_three_is_refused_naming_it(effect: Any) -> None:
    """Like every other refused option of ``@app.tool``, the error names the option (``path``),
    so that a caller (or the HTTP layer's body) can tell which one it was."""
    app = _app()

    async def t(ctx: Any) -> None: ...

    with pytest.raises(InvalidRequest, match="effect must be one of consequential, idempotent, "
                                             "read") as got:
        app.tool(effect=effect)(t)
    assert got.value.path == "effect"
    assert not app.registry.tools


def test_a_partial_or_an_instance_without_a_name_is_asked_for_one() -> None:
    """A workflow or a tool made from an object with no ``__name__`` of its own (a
    ``functools.partial``, an instance with an async ``__call__``) needs ``name=``."""
    app = _app()

    async def checkout(ctx: Any, data: Any, *, region: str) -> Any:
        return data

    class Charge:
        async def __call__(self, ctx: Any, *, cents: int) -> Any:
            return cents

    for register, fn, kind in ((app.workflow(), functools.partial(checkout, region="eu"),
                                "workflow"),
                               (app.tool(), Charge(), "tool"),
                               (app.tool(), functools.partial(Charge()), "tool")):
        with pytest.raises(InvalidRequest, match=f"{kind} .* has no name of its own: pass "
                           f"name=") as refused:
            register(fn)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "name"
    assert not app.registry.tools and not app.registry.workflows
    app.workflow(name="checkout_eu")(functools.partial(checkout, region="eu"))
    app.tool(name="charge")(Charge())
    assert set(app.registry.workflows) == {"checkout_eu@1"} and set(app.registry.tools) == {
        "charge"}


def test_a_tool_that_does_not_take_its_context_first_is_refused() -> None:
    """The engine calls a tool ``fn(ctx, **arguments)`` (and its lookup the same way), a
    policy stage ``fn(ctx)``: a function that cannot be called so is refused here, not found
    out by the first call with a message about positional arguments."""
    app = _app()

    async def no_ctx(*, cents: int) -> Any: ...

    async def nothing() -> Any: ...

    async def positional_only(ctx: Any, cents: int, /) -> Any: ...

    for fn in (no_ctx, nothing, positional_only):
        with pytest.raises(InvalidRequest, match=rf"tool {fn.__name__} must be async def "
                           rf"{fn.__name__}\(ctx, \*, \.\.\.\)") as refused:
            app.tool()(fn)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST"
    assert not app.registry.tools

    @app.tool()
    async def charge(ctx: Any, *, cents: int) -> Any: ...

    for register in (charge.lookup, charge.authorize, charge.approve):
        with pytest.raises(InvalidRequest, match="of tool charge must be async def"):
            register(no_ctx)
    assert charge.lookup_fn is charge.authorize_fn is charge.approve_fn is None

    async def two(ctx: Any, extra: Any) -> Any: ...

    with pytest.raises(InvalidRequest, match=r"authorize of tool charge must be async def "
                       r"two\(ctx\)"):
        charge.authorize(two)
    with pytest.raises(ConfigurationError, match=r"policy stage approve must be async def "
                       r"two\(ctx\)"):
        _app(approve=two)

    async def anything(*args: Any, **kwargs: Any) -> Any: ...

    async def defaults(ctx: Any, cents: int = 0, /, currency: str = "EUR") -> Any: ...

    app.tool()(anything)
    app.tool()(defaults)
    charge.lookup(anything)
    assert set(app.registry.tools) == {"charge", "anything", "defaults"}


def test_a_workflow_that_does_not_take_ctx_and_input_is_refused() -> None:
    """The engine calls a workflow ``fn(ctx, input)``: anything else is refused here, not
    found out by its first run."""
    app = _app()

    async def no_input(ctx: Any) -> Any: ...

    async def extra(ctx: Any, data: Any, more: Any) -> Any: ...

    async def keywords(*, ctx: Any, data: Any) -> Any: ...

    async def required_option(ctx: Any, data: Any, *, region: str) -> Any: ...

    for fn in (no_input, extra, keywords, required_option):
        with pytest.raises(InvalidRequest, match=rf"workflow {fn.__name__} must be async def "
                           rf"{fn.__name__}\(ctx, input\)"):
            app.workflow()(fn)  # type: ignore[arg-type]
    assert not app.registry.workflows

    async def optional(ctx: Any, data: Any = None, *, region: str = "eu") -> Any: ...

    async def loose(*args: Any) -> Any: ...

    app.workflow()(optional)
    app.workflow()(loose)
    app.workflow(name="partial")(functools.partial(required_option, region="eu"))
    assert set(app.registry.workflows) == {"optional@1", "loose@1", "partial@1"}


def test_a_call_of_something_that_is_not_a_tool_is_refused_by_name() -> None:
    """``ctx.call`` takes a registered :class:`Tool` or a name: a plain function (the one
    under the decorator, say) is ``INVALID_REQUEST`` naming what it takes."""
    from orchestrator.registry import resolve_tool

    app = _app()

    async def charge(ctx: Any, *, cents: int) -> Any: ...

    registered = app.tool()(charge)
    assert resolve_tool(app.registry, "charge") is resolve_tool(app.registry, registered)
    with pytest.raises(InvalidRequest, match="ctx.call takes a tool registered with "
                       r"@app.tool\(\) or its name, got function") as refused:
        resolve_tool(app.registry, charge)  # type: ignore[arg-type]
    assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "tool"


@pytest.mark.parametrize("retry", [{"max_attempts": 3}, 3, 0, "3", (3, 100)])
def test_a_retry_policy_that_is_not_a_retry_policy_is_refused(retry: Any) -> None:
    """``retry=`` (and the app's ``retry_policy=``) is a :class:`RetryPolicy`. Anything else
    used to be stored as the tool's policy: its calls ran, but the first failure (one that
    proved nothing was sent, even) found no policy to decide by and left the call's outcome
    unknown, for an operator to settle a call that never left."""
    from orchestrator import RetryPolicy

    app = _app()

    async def charge(ctx: Any, *, cents: int) -> Any: ...

    with pytest.raises(InvalidRequest, match="retry must be an orchestrator.RetryPolicy") as got:
        app.tool(retry=retry)(charge)
    assert got.value.code == "INVALID_REQUEST" and got.value.path == "retry"
    with pytest.raises(InvalidRequest, match="retry must be an orchestrator.RetryPolicy"):
        app.tool(retry=retry, max_attempts=2)(charge)
    assert not app.registry.tools
    with pytest.raises(ConfigurationError,
                       match="retry_policy must be an orchestrator.RetryPolicy") as config:
        _app(retry_policy=retry)
    assert config.value.code == "CONFIGURATION_ERROR"
    tool = app.tool(retry=RetryPolicy(max_attempts=2))(charge)
    assert tool.policy == RetryPolicy(max_attempts=2)
    assert _app(retry_policy=RetryPolicy(max_attempts=4)).tool()(charge).max_attempts == 4


@pytest.mark.parametrize("owner", ["acme", ("acme", "alice"), {"tenant": "acme"}])
def test_a_default_owner_that_is_not_an_owner_is_refused(owner: Any) -> None:
    """``default_owner=`` is an :class:`Owner`: anything else used to be kept, and every call
    that acts for it (``submit``, ``list_runs``, ``app.schedules.create`` …) then failed with an
    ``AttributeError`` instead of an error naming the setting."""
    from orchestrator import Owner

    with pytest.raises(ConfigurationError,
                       match="default_owner must be an orchestrator.Owner") as got:
        _app(default_owner=owner)
    assert got.value.code == "CONFIGURATION_ERROR"
    owner_ = Owner(tenant="acme", principal="alice")
    assert _app(default_owner=owner_).default_owner is owner_
    assert _app(default_owner=None).default_owner is None


@pytest.mark.parametrize("flag", ["no", "false", 0, 1, None])
def test_a_yes_or_no_option_that_is_not_a_bool_is_refused(flag: Any) -> None:
    """``default=`` of a workflow version, the app's ``receipts_ride=``, a worker's
    ``schedules=`` and a stream's ``follow=`` are True or False. Anything else was taken for
    its truth value: ``@app.workflow(version="1", default="no")`` made that version the one
    every ``submit("name")`` starts, ``create_worker(schedules="no")`` ticked the schedules.
    Refused naming the option, as ``paused=``, ``shared_backoff=`` and ``dry_run=`` are."""
    import uuid

    from orchestrator import Owner, RunHandle

    app = _app()

    async def report(ctx: Any, data: Any) -> Any:
        return data

    with pytest.raises(InvalidRequest, match="default must be True or False") as default:
        app.workflow(version="2", default=flag)(report)
    assert default.value.path == "default"
    assert not app.registry.workflows
    with pytest.raises(ConfigurationError, match="receipts_ride must be True or False"):
        _app(receipts_ride=flag)
    with pytest.raises(ConfigurationError, match="schedules must be True or False"):
        app.create_worker(schedules=flag)
    with pytest.raises(ConfigurationError, match="schedules must be True or False"):
        app.run_worker(schedules=flag)
    handle: RunHandle[Any] = RunHandle(app, uuid.uuid4(), Owner(tenant="a", principal="b"))
    for read in (handle.events, handle.events_sync):
        with pytest.raises(InvalidRequest, match="follow must be True or False") as follow:
            read(follow=flag)
        assert follow.value.path == "follow"
    assert app.workflow(version="2", default=True)(report).default is True
    assert _app(receipts_ride=False).receipts_ride is False


def test_a_decorator_without_its_parentheses_says_to_add_them() -> None:
    """``@app.tool`` and ``@app.workflow`` take their options by keyword and return the
    decorator: written without ``()`` (or given a name positionally), the function is refused
    with ``INVALID_REQUEST`` saying what to write, not Python's ``TypeError`` about positional
    arguments."""
    app = _app()

    async def charge(ctx: Any, *, cents: int) -> int:
        return cents

    async def checkout(ctx: Any, data: Any) -> Any:
        return data

    for register, fn, kind in ((app.tool, charge, "tool"), (app.workflow, checkout,
                                                             "workflow")):
        with pytest.raises(InvalidRequest, match=rf"@app\.{kind} takes its options by keyword: "
                           rf"write @app\.{kind}\(\) with parentheses") as bare:
            register(fn)  # type: ignore[arg-type]
        assert bare.value.code == "INVALID_REQUEST" and bare.value.path == kind
        with pytest.raises(InvalidRequest, match=rf"@app\.{kind}\(name='pay'\)") as named:
            register("pay")  # type: ignore[arg-type]
        assert named.value.path == kind
    assert not app.registry.tools and not app.registry.workflows
