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
from typing import Any, Literal

from orchestrator.errors import InvalidRequest
from orchestrator.recovery import RetryPolicy

EffectClass = Literal["consequential", "idempotent", "read"]
EFFECT_CLASSES: tuple[EffectClass, ...] = ("consequential", "idempotent", "read")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")



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


@dataclass(frozen=True)
class Workflow:
    """A registered workflow: ``name`` and ``version`` identify it in the database."""

    name: str
    version: str
    fn: Callable[..., Awaitable[Any]]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


Hook = Callable[..., Awaitable[Any]]


@dataclass
class Tool:
    """A registered tool: every call goes through the effect gateway as an operation.

    ``authorize`` and ``approve`` are optional policy stages run before dispatch, each bounded
    by its own time budget (seconds); cancellation is checked before and after each.
    """

    name: str
    version: str
    fn: Callable[..., Awaitable[Any]]
    effect: EffectClass = "consequential"
    timeout: timedelta | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    lookup_fn: Callable[..., Awaitable[Any]] | None = field(default=None)
    authorize_fn: Hook | None = None
    approve_fn: Hook | None = None
    authorize_timeout: float = 30.0
    approve_timeout: float = 30.0
    _accepted_names: set[frozenset[str]] = field(default_factory=set, repr=False,
                                                 compare=False)

    @property
    def max_attempts(self) -> int:
        return self.policy.max_attempts

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

    def lookup(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Register the read-only lookup the reconciler uses for uncertain outcomes."""
        self.lookup_fn = fn
        return fn

    def authorize(self, fn: Hook) -> Hook:
        """Register an authorisation stage: ``fn(ctx: PolicyContext)``; False denies."""
        self.authorize_fn = fn
        return fn

    def approve(self, fn: Hook) -> Hook:
        """Register an approval stage: ``fn(ctx: PolicyContext)``; False denies."""
        self.approve_fn = fn
        return fn

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling a tool directly runs its function without the ledger (for unit tests)."""
        return await self.fn(*args, **kwargs)


class Registry:
    """The workflows and tools of one orchestrator instance."""

    def __init__(self) -> None:
        self.workflows: dict[str, Workflow] = {}
        self.tools: dict[str, Tool] = {}

    def add_workflow(self, wf: Workflow) -> None:
        if wf.key in self.workflows:
            raise InvalidRequest(f"workflow {wf.name} version {wf.version} is registered twice")
        self.workflows[wf.key] = wf

    def add_tool(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise InvalidRequest(f"tool {tool.name} is registered twice")
        self.tools[tool.name] = tool

    def workflow(self, name: str, version: str) -> Workflow | None:
        return self.workflows.get(f"{name}@{version}")
