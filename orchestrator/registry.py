"""Workflow and tool definitions, registered on an :class:`~orchestrator.Orchestrator` instance.

No module-level registry: each ``Orchestrator`` keeps its own, so tests can build many.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Concatenate, Generic, Literal

from typing_extensions import ParamSpec, TypeVar

from orchestrator.errors import InvalidRequest, UnknownTool, UnknownWorkflow
from orchestrator.flow import MAX_DEADLINE, RateLimit
from orchestrator.recovery import RetryPolicy
from orchestrator.text import check_identifier

# The context a tool or workflow function receives is typed ``Any`` here: the contexts
# (orchestrator.context) sit above the registry in the layers, and the decorators that users
# call (``app.tool``, ``app.workflow``) take the precisely typed functions.

EffectClass = Literal["consequential", "idempotent", "read"]
EFFECT_CLASSES: tuple[EffectClass, ...] = ("consequential", "idempotent", "read")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")

# The type parameters of Tool and Workflow. Their defaults (PEP 696) make a bare ``Tool`` mean
# ``Tool[..., Any]``, and give ``ctx.call("name", ...)`` (a tool by name, nothing to infer from)
# an ``Any`` result instead of a type checker's "cannot infer".
P = ParamSpec("P", default=...)
"""A tool's parameters after its :class:`~orchestrator.ToolContext`: what ``ctx.call`` takes."""
I = TypeVar("I", default=Any)  # noqa: E741 - a workflow's input
R = TypeVar("R", default=Any)
"""What a tool returns (its receipt) or a workflow returns (its run's result)."""
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

def version_order(version: str) -> tuple[tuple[int, int, str], ...]:
    """The key that orders versions naturally: runs of digits as numbers, so "10" comes after
    "9" and "1.10" after "1.9"; other text bytewise, after any number at the same place."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in re.findall(r"\d+|\D+", version))


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"{kind} name {name!r} must be 1-200 letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-'",
        )
    return name


def check_async(kind: str, name: str, fn: object) -> None:
    """Refuse a function that is not ``async``: the engine awaits what it returns, so a plain
    one would be found out only in a worker, once it has run (a tool's effect applied, and
    then its outcome unknown). An ``async def``, a partial of one, an object whose
    ``__call__`` is one, and a wrapper made with :func:`functools.wraps` around one are
    accepted."""
    if not callable(fn) or not any(inspect.iscoroutinefunction(candidate) for candidate
                                   in (fn, type(fn).__call__, inspect.unwrap(fn))):
        raise InvalidRequest(f"{kind} {name} must be an async function (async def), got "
                             f"{type(fn).__name__}")


def check_decorator_use(kind: str, decorated: object) -> None:
    """Refuse ``@app.tool`` / ``@app.workflow`` written without ``()`` (``decorated`` is the
    function) or given its name positionally: both take their options by keyword and return
    the decorator, and Python's own error would only speak of positional arguments."""
    if decorated is None:
        return
    if isinstance(decorated, str):
        raise InvalidRequest(f"@app.{kind} takes its options by keyword: write "
                             f"@app.{kind}(name={decorated!r})", path=kind)
    raise InvalidRequest(f"@app.{kind} takes its options by keyword: write @app.{kind}() with "
                         f"parentheses, then the function", path=kind)


def registered_name(kind: str, name: str | None, fn: object) -> str:
    """The name ``fn`` is registered under: ``name``, else the function's own. An object
    with no ``__name__`` (a :func:`functools.partial`, an instance whose ``__call__`` is
    async) needs ``name=``."""
    if name is None:
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str):
            raise InvalidRequest(f"{kind} made from a {type(fn).__name__} has no name of its "
                                 f"own: pass name=", path="name")
    return check_name(kind, name)


def check_signature(kind: str, name: str, fn: object, *, takes: tuple[str, ...],
                    keywords: bool = False) -> None:
    """Refuse a function the engine cannot call as it will: ``fn(*takes)`` (the context; a
    workflow's input), and with ``keywords`` the call's arguments after them by keyword.
    Otherwise only the first call would tell, with a message about positional arguments (a
    tool's once its ``submitted`` is written; a workflow's in its first run). An object whose
    signature cannot be read is accepted."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return
    try:
        if keywords:
            bound = signature.bind_partial(*takes)
            after = list(signature.parameters.values())[len(bound.arguments):]
            if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in after):
                raise TypeError("a required positional-only parameter")
        else:
            signature.bind(*takes)
    except TypeError:
        expects = ", ".join(takes) + (", *, ..." if keywords else "")
        raise InvalidRequest(f"{kind} {name} must be async def {_name_of(fn, name)}({expects})"
                             f": the engine calls it so, and it takes {signature}") from None


def _name_of(fn: object, default: str) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else default


def check_timeout(path: str, value: object) -> timedelta:
    """A tool's or a policy stage's time budget: a positive timedelta, or a positive number of
    seconds (an int or a float, not a bool nor a string), of at most
    :data:`~orchestrator.flow.MAX_DEADLINE`, as a submission's deadline (anything else would
    be found out by a worker once the call's ``submitted`` is written). Returned as a
    timedelta: a number means exactly the timedelta of that many seconds."""
    if isinstance(value, timedelta):
        budget: timedelta | None = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:  # NaN and the infinities, and an int too large, are not durations
            budget = timedelta(seconds=value)
        except (OverflowError, ValueError):
            budget = None
    else:
        budget = None
    if budget is None or not timedelta(0) < budget <= MAX_DEADLINE:
        raise InvalidRequest(f"{path} must be a positive timedelta or a number of seconds of "
                             f"at most {MAX_DEADLINE.days} days, got {value!r}", path=path)
    return budget


@dataclass(frozen=True)
class Workflow(Generic[I, R]):
    """A registered workflow: ``name`` and ``version`` identify it in the database.

    Generic over its input ``I`` and its result ``R`` (``fn(ctx, input: I) -> R``), so that
    ``submit`` and ``ctx.run_child`` check the input and type the result; the parameters are
    for type checkers only and cost nothing at run time.
    """

    name: str
    version: str
    fn: Callable[[Any, I], Awaitable[R]]  # fn(ctx: WorkflowContext, input)
    queue: str | None = None
    """The queue its runs wait in unless a submission names another (None: the default
    queue, unlimited); docs/flow.md."""
    default: bool = False
    """The version a submission by name alone starts (docs/versioning.md); without one,
    the highest version in :func:`version_order`."""

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


Hook = Callable[..., Awaitable[Any]]


@dataclass
class Tool(Generic[P, R]):
    """A registered tool: every call goes through the effect gateway as an operation.

    Generic over its parameters ``P`` (those after the :class:`~orchestrator.ToolContext`) and
    its receipt ``R``, so that ``ctx.call(tool, **arguments)`` checks the arguments against the
    tool's signature and types what it returns (for type checkers only: at run time the
    arguments are checked by :meth:`check_arguments`).

    ``authorize`` and ``approve`` are optional policy stages run before dispatch, each bounded
    by its own time budget (seconds); cancellation is checked before and after each.
    """

    name: str
    version: str
    fn: Callable[Concatenate[Any, P], Awaitable[R]]  # fn(ctx: ToolContext, **arguments)
    effect: EffectClass = "consequential"
    timeout: timedelta | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    lookup_fn: Callable[..., Awaitable[Any]] | None = field(default=None)
    authorize_fn: Hook | None = None
    approve_fn: Hook | None = None
    authorize_timeout: float = 30.0
    approve_timeout: float = 30.0
    # Flow control (docs/flow.md): at most ``concurrency`` calls in flight and ``rate``
    # dispatches per window, across every worker; a provider's 429/503 with a Retry-After
    # pauses the tool for every run (``shared_backoff``).
    rate: RateLimit | None = None
    concurrency: int | None = None
    shared_backoff: bool = True
    _accepted_names: set[frozenset[str]] = field(default_factory=set, repr=False,
                                                 compare=False)

    @property
    def max_attempts(self) -> int:
        return self.policy.max_attempts

    @property
    def limited(self) -> bool:
        """Whether its calls are admitted against a limit before dispatch."""
        return self.rate is not None or self.concurrency is not None

    @property
    def holds_place(self) -> bool:
        """Whether a call of it holds a place under its concurrency limit from the write that
        admits it until it settles (``operations.in_flight_tool``, migration 0039), so that
        its end may wake runs parked for its turn."""
        return self.concurrency is not None

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The tool function's signature, to check a call's arguments before dispatch."""
        return inspect.signature(self.fn)

    def check_arguments(self, names: Iterable[str]) -> None:
        """Raise TypeError unless keyword arguments with these names bind to the tool (the
        answer depends on the names alone, so accepted sets are remembered)."""
        key = frozenset(names)
        if key not in self._accepted_names:
            self.signature.bind(None, **dict.fromkeys(key))
            self._accepted_names.add(key)

    def lookup(self, fn: F) -> F:
        """Register the read-only lookup the reconciler uses for uncertain outcomes:
        ``fn(ctx: ToolContext, **arguments)`` with the tool's own arguments, answering
        ``Committed(receipt)``, ``NotApplied(evidence)`` or ``StillUnknown(reason)``.

        ``NotApplied`` must be final at the provider: a request with ``ctx.idempotency_key``
        that the lookup reported absent must never be applied later, since the call is then
        sent again with a new key (see :class:`~orchestrator.lookups.NotApplied`)."""
        check_async("lookup of tool", self.name, fn)
        check_signature("lookup of tool", self.name, fn, takes=("ctx",), keywords=True)
        self.lookup_fn = fn
        return fn

    def authorize(self, fn: F) -> F:
        """Register an authorisation stage: ``fn(ctx: PolicyContext)``; False denies."""
        check_async("authorize of tool", self.name, fn)
        check_signature("authorize of tool", self.name, fn, takes=("ctx",))
        self.authorize_fn = fn
        return fn

    def approve(self, fn: F) -> F:
        """Register an approval stage: ``fn(ctx: PolicyContext)``; False denies."""
        check_async("approve of tool", self.name, fn)
        check_signature("approve of tool", self.name, fn, takes=("ctx",))
        self.approve_fn = fn
        return fn

    async def __call__(self, ctx: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Calling a tool directly runs its function without the ledger (for unit tests)."""
        return await self.fn(ctx, *args, **kwargs)


class Registry:
    """The workflows and tools of one orchestrator instance."""

    def __init__(self) -> None:
        self.workflows: dict[str, Workflow] = {}
        self.tools: dict[str, Tool] = {}

    def add_workflow(self, wf: Workflow) -> None:
        if wf.key in self.workflows:
            raise InvalidRequest(f"workflow {wf.name} version {wf.version} is registered twice")
        # Two versions in the same place of the natural order ("1.0" and "1.00") would make
        # the highest, which a submission by name starts, the one registered first.
        same = next((w for w in self.workflows.values() if w.name == wf.name
                     and version_order(w.version) == version_order(wf.version)), None)
        if same is not None:
            raise InvalidRequest(f"workflow {wf.name}: version {wf.version} orders the same as "
                                 f"version {same.version}, registered already; give versions "
                                 "that differ in number or text", path="version")
        if wf.default:
            other = next((w for w in self.workflows.values()
                          if w.name == wf.name and w.default), None)
            if other is not None:
                raise InvalidRequest(f"workflow {wf.name}: versions {other.version} and "
                                     f"{wf.version} are both marked default=True",
                                     path="default")
        self.workflows[wf.key] = wf

    def choose(self, name: str, version: str | None = None) -> Workflow | None:
        """The workflow ``name`` at ``version``; without a version, the one marked
        ``default=True``, else the highest version by :func:`version_order` ("10" after "9")."""
        if version is not None:
            return self.workflow(name, version)
        versions = [w for w in self.workflows.values() if w.name == name]
        if not versions:
            return None
        marked = [w for w in versions if w.default]
        return marked[0] if marked else max(versions, key=lambda w: version_order(w.version))

    def add_tool(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise InvalidRequest(f"tool {tool.name} is registered twice")
        self.tools[tool.name] = tool

    def workflow(self, name: str, version: str) -> Workflow | None:
        return self.workflows.get(f"{name}@{version}")


def resolve_workflow(registry: Registry, workflow: Workflow | str,
                     version: str | None = None) -> Workflow:
    """The workflow a submission names: the one given, else the registered one of that name
    (``version``, else the default one, else the highest); ``UNKNOWN_WORKFLOW`` for none.
    A workflow given as an object is its own version: another ``version`` with it is
    ``INVALID_REQUEST``, not quietly ignored; and it must be registered here (another
    application's workflow is ``UNKNOWN_WORKFLOW``: no worker of this one would run it)."""
    if version is not None:  # "" is bad input, not "workflow X is not registered"
        check_identifier("version", version)
    if isinstance(workflow, Workflow):
        if version is not None and version != workflow.version:
            raise InvalidRequest(
                f"workflow {workflow.name} is given as its version {workflow.version}, and "
                f"version {version!r} as well: pass that version's workflow, or its name "
                f"({workflow.name!r}, version={version!r})", path="version")
        if registry.workflow(workflow.name, workflow.version) is None:
            raise UnknownWorkflow(f"workflow {workflow.name!r} version {workflow.version!r} "
                                  "is not registered with this orchestrator")
        return workflow
    given: object = workflow  # typed as a workflow or a name; checked as anything
    if not isinstance(given, str):  # the function under the decorator, say
        name = getattr(given, "__name__", None)
        got = (f"function {name}: pass the object @app.workflow() returned when it "
               f"registered it, or the name it registered" if callable(given)
               and isinstance(name, str) else type(given).__name__)
        raise UnknownWorkflow("a workflow is what @app.workflow() returned, or its registered "
                              f"name; got {got}", path="workflow")
    chosen = registry.choose(workflow, version)
    if chosen is None:
        named = f"workflow {workflow!r}" + (f" version {version!r}" if version else "")
        wrong = "version" if version and registry.choose(workflow) is not None else "workflow"
        raise UnknownWorkflow(f"{named} is not registered", path=wrong)
    return chosen


def resolve_tool(registry: Registry, tool: Tool | str) -> Tool:
    """The tool a call names: the registered one of that name, or the one given, which must
    be the one registered here (another application's tool of the same name runs other
    code); ``UNKNOWN_TOOL`` otherwise."""
    if isinstance(tool, str):
        found = registry.tools.get(tool)
        if found is None:
            raise UnknownTool(f"tool {tool!r} is not registered with this orchestrator")
        return found
    if not isinstance(tool, Tool):
        raise InvalidRequest("ctx.call takes a tool registered with @app.tool() or its name, "
                             f"got {type(tool).__name__}", path="tool")
    found = registry.tools.get(tool.name)
    if found is not tool:
        other = " (it registers another tool of that name)" if found is not None else ""
        raise UnknownTool(f"tool {tool.name!r} is given as an object this orchestrator does "
                          f"not register{other}")
    return found
