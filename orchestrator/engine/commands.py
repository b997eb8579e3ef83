"""The workflow commands behind :class:`~orchestrator.context.WorkflowContext`: call, sleep,
wait_for_event, run_child, the recorded values and published messages. Each takes the next
journal position when it is issued; on replay it returns what the journal recorded there
(CONTRACT C3, C4)."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from datetime import datetime, timedelta
from typing import Any, NoReturn

from orchestrator import tracing
from orchestrator.admission import DECLARE_HINT, new_run
from orchestrator.context import ContinueAsNew
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn
from orchestrator.db.events import event_take
from orchestrator.engine.branches import Branches
from orchestrator.engine.call import Call
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.control import Wait, as_seconds
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session
from orchestrator.errors import ToolFailed, UnknownWorkflow, new_incident_ref
from orchestrator.journal import Entry, EventKind, entry
from orchestrator.matching import (
    NEW,
    Outcome,
    child_ended,
    decode_value,
    event_timeout,
    match_child,
    match_event,
    match_publish,
    match_sleep,
    match_value,
)
from orchestrator.models import Owner
from orchestrator.registry import Registry, Tool, Workflow, resolve_tool, resolve_workflow
from orchestrator.text import check_identifier

# Timers this short are waited for in memory (the timer is still journaled) rather than
# parking the run and paying for a replay.
IN_MEMORY_SLEEP = 1.0

_TERMINAL = ("succeeded", "failed", "cancelled")


class Commands:
    """What a workflow can ask of the engine, for one run."""

    def __init__(self, run: RunState, session: Session, branches: Branches,
                 config: EngineConfig, registry: Registry) -> None:
        self.run = run
        self.session = session
        self.branches = branches
        self.config = config
        self.registry = registry
        self.patches: set[tuple[int, str]] = set()  # markers buffered by this execution

    @property
    def run_id(self) -> uuid.UUID:
        return self.run.run_id

    @property
    def owner(self) -> Owner:
        return self.run.owner

    @property
    def workflow(self) -> str:
        return self.run.workflow_key

    @property
    def replaying(self) -> bool:
        return self.run.replaying

    def next_position(self) -> int:
        return self.run.next_position()

    def value(self, position: int, name: str) -> Any:
        verdict = match_value(self.run.index, position, name)
        if verdict is not NEW:
            return self.run.settle(verdict)
        self._recording()
        raw: Any
        if name == "now":
            raw = self.run.now().isoformat()
        elif name == "uuid":
            raw = str(uuid.uuid4())
        else:
            raw = random.random()
        self.session.buffer(entry(EventKind.VALUE, position, name, {"value": raw}))
        return decode_value(name, raw)

    def publish(self, position: int, value: Any, topic: str) -> None:
        """A ``message`` entry at ``position``, named by its topic, that rides with the run's
        next write like a recorded value. On replay the recorded message is checked, not
        written again: another topic or another value (compared as canonical JSON, which
        keeps every value's type through the database) is nondeterminism."""
        check_identifier("topic", topic)
        text = self.config.json_limits.text(value, "$.value")
        verdict = match_publish(self.run.index, position, topic, value, text)
        if verdict is not NEW:
            self.run.settle(verdict)
            return
        self._recording()
        # A copy, as it is now: workflow code may change the object before the write.
        self.session.buffer(entry(EventKind.MESSAGE, position, topic,
                                  {"value": json.loads(text)}))

    def patch(self, patch_id: str) -> bool:
        """Whether this run takes patch ``patch_id``'s new code (docs/versioning.md). A marker
        takes no position: it is filed under the next command's, which holds it or not. Found
        there: yes. That position is history without the marker (the run recorded what the
        code before the patch did there): no. Past the history: yes, and the marker rides
        with the run's next write."""
        check_identifier("patch", patch_id)
        run = self.run
        position = run.position
        if run.index.patched(position, patch_id):
            return True
        if position <= run.recorded_until:
            return False
        if (position, patch_id) not in self.patches:  # asked twice here: one marker
            self.patches.add((position, patch_id))
            self.session.buffer(entry(EventKind.PATCH, position, patch_id, {}))
        return True

    async def call(self, position: int, tool: Tool | str, arguments: dict[str, Any]) -> Any:
        resolved = resolve_tool(self.registry, tool)
        try:
            with self.branches.active(position):
                return await Call(self.run, self.session, self.branches, self.config,
                                  position, resolved, arguments).perform()
        except ToolFailed as exc:
            exc.position = position  # where a failed run's incident finds the call's story
            raise

    async def sleep(self, position: int, duration: timedelta | float) -> None:
        run = self.run
        verdict = match_sleep(run.index, position)
        if verdict is not NEW:
            until = run.settle(verdict)
        else:
            seconds = as_seconds(duration, "duration") or 0.0
            run.boundary()
            until = run.now() + timedelta(seconds=seconds)
            self.session.buffer(entry(EventKind.TIMER, position, "sleep",
                                      {"until": until.isoformat()}))
        # Every wait is debited from the run's deadline (C7): a sleep that would end after it
        # lasts until the deadline, and the run stops there.
        ends = until if run.deadline_at is None else min(until, run.deadline_at)
        left = (ends - run.now()).total_seconds()
        if left > IN_MEMORY_SLEEP:
            await self.branches.park(Wait("timer", position, wake_at=ends))
        elif left > 0:
            tracing.event("wait", {"orchestrator.wait": "timer", "orchestrator.position": position,
                                   "orchestrator.in_memory": True})
            with self.branches.active():
                while left > 0:  # a loop may wake it early: never before ``ends`` (_due)
                    await asyncio.sleep(left)
                    left = (ends - run.now()).total_seconds()
        if ends < until:
            run.boundary()  # past the deadline (or lost, cancelled …: what comes first)
            run.stop_deadline()

    async def wait_for_event(self, position: int, name: str,
                             timeout: timedelta | float | None) -> Any:
        # The rules send_event holds the name to: a wait for a name no sender may use could
        # never receive its event (and one that the database cannot store could not be
        # journaled at all).
        check_identifier("name", name)
        run = self.run
        verdict = match_event(run.index, position, name)
        timeout_at: datetime | None
        if verdict is not NEW:
            got = run.settle(verdict)  # the event's payload, its timeout, or nondeterminism
            if verdict.outcome is Outcome.RETURNS:
                return got
            timeout_at = got  # not over yet: it waits until its recorded timeout
        else:
            seconds = as_seconds(timeout, "timeout")
            run.boundary()
            timeout_at = None if seconds is None else run.now() + timedelta(seconds=seconds)
            self.session.buffer(entry(EventKind.EVENT_WAIT, position, name, {
                "timeout_at": None if timeout_at is None else timeout_at.isoformat()}))

        async def take(conn: Conn) -> tuple[Any, list[Entry]]:
            got = await event_take(conn, run_id=run.run_id, name=name, position=position)
            if got is None:
                return None, []
            return got, [entry(EventKind.EVENT_RECEIVED, position, name,
                               {"payload": got["payload"]})]

        # Again when its timeout or news of its event comes while another branch keeps the
        # run here (Branches.park, Branches.event_arrived).
        while True:
            heard = self.branches.heard(name)
            with self.branches.active():
                got = await self.session.write(take)
            if got is not None:
                return got["payload"]
            if self.branches.heard(name) != heard:
                continue  # news came during the look: the event may be stored now
            if timeout_at is not None and run.now() >= timeout_at:
                # The error's reference is kept with it: the same one on every replay (C4).
                ref = new_incident_ref()
                await self._append(entry(EventKind.EVENT_TIMEOUT, position, name,
                                         {"incident": ref}))
                raise event_timeout(name, timeout_at, ref)
            await self.branches.park(Wait("event", position, wake_at=timeout_at, name=name))

    async def run_child(self, position: int, workflow: Workflow | str, input: Any) -> Any:
        run = self.run
        wf = self._workflow(workflow)
        verdict = match_child(run.index, position, wf.name)
        child_id: uuid.UUID
        if verdict is not NEW:
            got = run.settle(verdict)  # the child's result, its failure, or nondeterminism
            if verdict.outcome is Outcome.RETURNS:
                return got
            child_id = got  # not ended yet: its run id
        else:
            run.boundary()
            child_id = uuid.uuid5(run.run_id, f"child:{position}")
            row = new_run(
                wf.name, wf.version, input, limits=self.config.json_limits, owner=run.owner,
                queues=self.config.queues, hint=DECLARE_HINT, deadline=run.remaining(),
                run_id=child_id, parent=(run.run_id, position), queue=wf.queue)
            row["traceparent"] = tracing.current_traceparent()  # the parent run's span

            async def start(conn: Conn) -> tuple[None, list[Entry]]:
                await runs_db.run_insert(conn, row)
                return None, [entry(EventKind.CHILD_STARTED, position, wf.name,
                                    {"run_id": str(child_id), "version": wf.version})]

            with self.branches.active():
                await self.session.write(start, new_work=True)
        with self.branches.active():
            rows = await self.session.read(
                lambda conn: runs_db.run_children_status(conn, run.run_id, [position]))
        if rows and rows[0]["status"] in _TERMINAL:
            child = rows[0]
            if child["status"] == "succeeded":
                outcome = entry(EventKind.CHILD_COMPLETED, position, wf.name,
                                {"result": child["result"]})
            else:
                error = child["error"] or {}
                failed = {"code": child["outcome_code"],
                          "message": error.get("message", "the child run failed")}
                if error.get("cause") is not None:
                    failed["cause"] = error["cause"]
                if error.get("incident") is not None:  # where the child's diagnostics are
                    failed["incident"] = error["incident"]
                outcome = entry(EventKind.CHILD_FAILED, position, wf.name, failed)
            await self._append(outcome)
            return child_ended(child_id, outcome).settle()
        await self.branches.park(Wait("child", position))

    def continue_as_new(self, input: Any, version: str | None) -> NoReturn:
        """``ctx.continue_as_new``: check what the new run takes, then unwind the workflow
        (the run's end writes the continuation: ``Outcome.finish``). A cancellation already
        requested wins: the run ends cancelled."""
        run = self.run
        run.boundary()
        if version is None:
            chosen = self.registry.choose(run.workflow_name)
            version = chosen.version if chosen is not None else run.workflow_key.partition("@")[2]
        else:  # the rules a submission's version is held to: the row must be storable, and
            check_identifier("version", version)  # a worker of this application can run it
            if self.registry.workflow(run.workflow_name, version) is None:
                raise UnknownWorkflow(f"workflow {run.workflow_name!r} version {version!r} is "
                                      "not registered", path="version")
        raise ContinueAsNew(self.config.json_limits.text(input, "$.input"), version)

    def _recording(self) -> None:
        """Before a value or a message is buffered: nothing is recorded while the executor
        lets go of the run (workflow code that caught the cancellation of its parking, or a
        ``finally`` that cancellation runs), nor once the workflow has ended (a branch it never
        awaited). The park would journal it at a position that the next claim's replay, which
        goes on where the wait really ends, gives to another command; the executor's
        :class:`Stop` is raised instead, as for any other command."""
        run = self.run
        if run.letting_go or run.ending:
            run.boundary()

    async def _append(self, ev: Entry) -> None:
        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            return None, [ev]

        with self.branches.active():
            await self.session.write(work)

    def _workflow(self, workflow: Workflow | str) -> Workflow:
        return resolve_workflow(self.registry, workflow)
