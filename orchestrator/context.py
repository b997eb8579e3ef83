"""What workflow and tool code sees: :class:`WorkflowContext` and :class:`ToolContext`.

Every method of ``WorkflowContext`` is a *command*: it takes the next position in the run's
journal when it is called (not when it is awaited), so ``ctx.gather(ctx.call(a), ctx.call(b))``
numbers its commands the same way on every replay.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from orchestrator.logs import WorkflowLogger
from orchestrator.models import Owner

if TYPE_CHECKING:
    from orchestrator.registry import I, P, R, Tool, Workflow


class Commands(Protocol):
    """What a :class:`WorkflowContext` asks of the engine (``orchestrator.engine.commands``
    implements it); each command is given the journal position it took."""

    @property
    def run_id(self) -> uuid.UUID: ...

    @property
    def owner(self) -> Owner: ...

    @property
    def workflow(self) -> str: ...  # name@version

    @property
    def replaying(self) -> bool: ...  # RunState.replaying

    def next_position(self) -> int: ...

    def patch(self, patch_id: str) -> bool: ...

    def value(self, position: int, name: str) -> Any: ...

    def publish(self, position: int, value: Any, topic: str) -> None: ...

    def call(self, position: int, tool: Tool | str, arguments: dict[str, Any]
             ) -> Awaitable[Any]: ...

    def sleep(self, position: int, duration: timedelta | float) -> Awaitable[None]: ...

    def wait_for_event(self, position: int, name: str, timeout: timedelta | float | None
                       ) -> Awaitable[Any]: ...

    def run_child(self, position: int, workflow: Workflow | str, input: Any
                  ) -> Awaitable[Any]: ...

    def continue_as_new(self, input: Any, version: str | None) -> NoReturn: ...


class ContinueAsNew(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Unwinds workflow code from ``ctx.continue_as_new``: the run ends and goes on as a new
    run of ``version`` with ``input_text`` (its input, checked and serialised). A
    BaseException, so that ``except Exception`` in workflow code does not swallow it."""

    def __init__(self, input_text: str, version: str) -> None:
        super().__init__(version)
        self.input_text = input_text
        self.version = version


class WorkflowContext:
    """The handle a workflow uses for everything that must survive a restart.

    Workflow code must be deterministic apart from these commands: no wall clock, randomness or
    I/O of its own. On resume it is re-executed from the top and each command returns what the
    journal recorded.
    """

    def __init__(self, commands: Commands) -> None:
        self._ex = commands
        self._log: WorkflowLogger | None = None

    @property
    def run_id(self) -> uuid.UUID:
        return self._ex.run_id

    @property
    def owner(self) -> Owner:
        return self._ex.owner

    @property
    def log(self) -> WorkflowLogger:
        """A logger for workflow code (``ctx.log.info("charged %s", order_id)``), on the logger
        ``orchestrator.workflow.<workflow name>``; each record carries the ``run_id`` and the
        ``workflow`` (``name@version``) as fields.

        It is silent while the workflow replays recorded history: up to the last command the
        journal held when the run was claimed, lines were written by the execution that first
        ran that code. So a line appears once per run, unless the execution that wrote it
        stopped before its next command was recorded (its worker killed or drained, its lease
        lost): the next execution runs that code again, live, and writes it again.
        ``ctx.log.replaying`` says which it is now. Not a command: it takes no position.
        Like everything a log line holds, what is passed here must not be secret.
        """
        if self._log is None:
            ex = self._ex  # not self: the logger must not keep the context in a cycle
            workflow = ex.workflow
            logger = logging.getLogger(f"orchestrator.workflow.{workflow.partition('@')[0]}")
            self._log = WorkflowLogger(logger, lambda: ex.replaying,
                                       {"run_id": str(ex.run_id), "workflow": workflow})
        return self._log

    def call(self, tool: Tool[P, R] | str, /, *args: P.args, **arguments: P.kwargs
             ) -> Awaitable[R]:
        """Call a tool through the effect gateway; returns its receipt (a JSON value).

        Arguments go by keyword (they are recorded by name). A type checker checks them against
        the tool's signature and types the receipt as the tool's return type; a tool given by
        name is checked at run time only (its receipt is ``Any``).
        """
        if args:
            raise TypeError("ctx.call takes the tool's arguments by keyword only")
        return self._ex.call(self._ex.next_position(), tool, arguments)

    def sleep(self, duration: timedelta | float) -> Awaitable[None]:
        """Sleep durably: the run is rescheduled in the database, not a process sleeping.

        ``duration`` is a timedelta or a number of seconds (an int or a float; not a bool or
        a string), from 0 to about a hundred years; anything else raises ``INVALID_REQUEST``
        (``path`` ``"duration"``) here, before anything is journaled."""
        return self._ex.sleep(self._ex.next_position(), duration)

    def wait_for_event(
        self, name: str, *, timeout: timedelta | float | None = None
    ) -> Awaitable[Any]:
        """Wait for ``send_event(run, name, payload)``; return the payload.

        Raises :class:`~orchestrator.EventTimeout` (``EVENT_TIMEOUT``, with ``event``; also a
        :class:`TimeoutError`) when ``timeout`` passes first; the timeout is journaled, so a
        replay raises it again here. Uncaught, it fails the run with ``WORKFLOW_FAILED`` and
        the cause ``{"code": "EVENT_TIMEOUT", "event": name}``. ``timeout`` is None (no
        limit), a timedelta or a number of seconds, as ``sleep``'s ``duration`` (anything else
        is ``INVALID_REQUEST`` with ``path`` ``"timeout"``).
        """
        return self._ex.wait_for_event(self._ex.next_position(), name, timeout)

    def run_child(self, workflow: Workflow[I, R] | str, input: I, /) -> Awaitable[R]:
        """Start a child run (same owner) and wait for its result (typed as the workflow's;
        ``Any`` for a workflow given by name). A workflow this application does not register
        (by name, or an object registered on another ``Orchestrator``) raises
        ``UNKNOWN_WORKFLOW`` here, before anything is written."""
        return self._ex.run_child(self._ex.next_position(), workflow, input)

    async def gather(self, *commands: Awaitable[Any]) -> list[Any]:
        """Wait for several commands issued concurrently; results in argument order."""
        return list(await asyncio.gather(*commands))

    def now(self) -> datetime:
        """The current time, recorded: a replay sees the same value."""
        value: datetime = self._ex.value(self._ex.next_position(), "now")
        return value

    def uuid(self) -> uuid.UUID:
        """A random UUID, recorded: a replay sees the same value."""
        value: uuid.UUID = self._ex.value(self._ex.next_position(), "uuid")
        return value

    def random(self) -> float:
        """A random float in [0, 1), recorded: a replay sees the same value."""
        value: float = self._ex.value(self._ex.next_position(), "random")
        return value

    def patched(self, patch_id: str) -> bool:
        """Whether this run takes the new code of patch ``patch_id`` (docs/versioning.md)::

            if ctx.patched("fee-before-charge"):
                await ctx.call(fee, order=order)      # the new code
            await ctx.call(charge, order=order)

        A run that reaches this point for the first time takes the new code (True) and its
        journal records a marker. A run whose journal already holds what the code before
        the patch did here (it got this far on the old code, then parked or lost its worker)
        gets False on every replay, and goes on down the old path. Not a command: the marker
        takes no position, so adding or removing a patch does not move the commands after
        it. ``patch_id`` is a name (``INVALID_REQUEST`` otherwise).
        """
        return self._ex.patch(patch_id)

    def deprecate_patch(self, patch_id: str) -> None:
        """Say that the old code of patch ``patch_id`` is gone: the step after
        ``if ctx.patched(...)``, once no run that took the old path is in flight (`orchestrator
        replay` tells). It records the marker as :meth:`patched` would, so workers that still
        run the patched code replay runs started here down the new path; remove it too once
        those workers are gone. A run that recorded the old path fails at its next command with
        ``NONDETERMINISM`` (the replay check finds it first)."""
        self._ex.patch(patch_id)

    def continue_as_new(self, input: Any, /, *, version: str | None = None) -> NoReturn:
        """End this run and go on in a new run of the same workflow with ``input``: for a run
        that loops for ever (a poller, a subscription), whose journal would otherwise reach
        its cap (``JOURNAL_FULL``). Nothing else is carried over: what the next generation
        needs goes in ``input`` (docs/versioning.md, "Long runs")::

            @app.workflow()
            async def poll(ctx, state):
                for _ in range(50):
                    state = await ctx.call(fetch_page, cursor=state["cursor"])
                ctx.continue_as_new(state)

        The new run has the same owner, queue, priority, concurrency key, parent and deadline,
        and takes over the submission's idempotency key (a submission with it answers with
        the newest run); this run ends ``succeeded`` with outcome ``CONTINUED_AS_NEW`` and
        names it (``superseded_by``), and ``handle.result()`` follows the chain to the last
        run's result. ``version``: the new run's workflow version (default: the one this
        worker would start for a new submission, so a loop takes up new code at its next
        generation). It never returns. While an operation of this run has no settled outcome
        the run does not end: it waits for the reconciliation as any run's end does, then
        continues. Bad ``input`` (not a JSON value, over the size cap) is ``INVALID_REQUEST``
        or ``PAYLOAD_TOO_LARGE`` raised here, before anything ends; so is a ``version`` this
        application does not register (``UNKNOWN_WORKFLOW``).
        """
        self._ex.continue_as_new(input, version)

    def publish(self, value: Any, topic: str = "progress") -> None:
        """Publish ``value`` (a JSON value) into the run's stream, for readers of
        ``handle.events()`` (``topics=[topic]`` to read only these) and ``orchestrator runs
        watch``.

        A command, not awaited: it takes the next position and its ``message`` entry (named
        ``topic``) is journaled with the run's next write, which comes before the next tool
        call is sent, when the run waits for an event or a child or parks, and with its end,
        so a reader never sees what followed a message without the message. A replay finds it
        at its position and does not publish it again; another topic or value there is
        ``NONDETERMINISM``. ``value`` is copied as it is now, held to the size cap of every
        record (``PAYLOAD_TOO_LARGE``; ``INVALID_REQUEST`` for a value that is not JSON) and
        counts towards the journal's cap; ``topic`` is a name (``INVALID_REQUEST`` otherwise).
        """
        self._ex.publish(self._ex.next_position(), value, topic)


@dataclass
class ToolContext:
    """What a tool receives besides its arguments.

    Pass ``idempotency_key`` to providers that deduplicate: it is stable across replays and
    across re-sends that CONTRACT C5 allows for the tool's effect class.
    """

    idempotency_key: str
    run_id: uuid.UUID
    position: int
    attempt: int
    operation_id: int
    owner: Owner
    deadline: datetime | None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def remaining(self) -> timedelta | None:
        """Time left before the run's deadline, or None without a deadline."""
        if self.deadline is None:
            return None
        from datetime import UTC

        return max(self.deadline - datetime.now(UTC), timedelta(0))


@dataclass
class PolicyContext:
    """What an ``authorize`` or ``approve`` stage sees before an operation is dispatched.

    Return False (or raise) to refuse; the operation is then ``cancelled`` and the workflow gets
    ``TOOL_DENIED``. ``cancelled`` is set when the stage is abandoned (the run was cancelled or
    the stage ran out of its budget): stop waiting then.
    """

    tool: str
    arguments: dict[str, Any]
    owner: Owner
    run_id: uuid.UUID
    position: int
    attempt: int
    idempotency_key: str
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
