"""The offline replay check (docs/versioning.md): workflow code run against stored journals,
with nothing dispatched, written or waited for (CONTRACT C3).

Each command the code issues is matched with what its run's journal recorded at that position
by :mod:`orchestrator.matching`, the matcher a worker's replay uses: the same kind of command
with the same name, a tool call with the same intent digest. A recorded outcome is handed back
(a receipt, a tool's failure, an event, a child's result); where the journal ends (a command it
has nothing for, a call without a settled outcome, a timer or an event not yet over), that
branch of the code stops, as a worker's would until the run wakes. So the check answers, per
run: would a worker running this code replay this history? ``ok``, or the first
``NONDETERMINISM`` with its position, the recorded command and the one the code issued.

No I/O here but :func:`load_runs` (two reads through the store) and :func:`export_document`: the CLI
(``orchestrator replay``, ``orchestrator runs export``) and ``orchestrator.testing.replay``
drive it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

from orchestrator import canonical, matching
from orchestrator.canonical import canonical_json
from orchestrator.context import ContinueAsNew, WorkflowContext
from orchestrator.db import journal as journal_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn
from orchestrator.errors import InvalidRequest, RunPruned, UnknownWorkflow
from orchestrator.journal import (
    RUN_ENDS,
    Entry,
    JournalIndex,
    Nondeterminism,
    check_versions,
    shown_payload,
)
from orchestrator.matching import (
    NEW,
    Mismatch,
    Outcome,
    match_call,
    match_child,
    match_event,
    match_publish,
    match_sleep,
    match_value,
)
from orchestrator.models import Owner
from orchestrator.registry import Registry, Tool, Workflow, resolve_tool
from orchestrator.text import check_identifier

EXPORT_FORMAT = "orchestrator.run"
EXPORT_VERSION = 1
QUIET_TURNS = 100
"""Turns of the event loop with no command issued after which every branch of the code is
taken to be waiting where its history ends."""


@dataclass(frozen=True)
class RecordedRun:
    """A run as the check needs it: which code, its input and owner, and its journal."""

    run_id: uuid.UUID
    workflow: str
    version: str
    input: Any
    owner: Owner
    status: str
    journal: list[Entry]

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> RecordedRun:
        """A run from ``orchestrator runs export``'s document (``INVALID_REQUEST`` otherwise)."""
        if not isinstance(doc, Mapping) or doc.get("format") != EXPORT_FORMAT:
            raise InvalidRequest(f"not a run export: its format must be {EXPORT_FORMAT!r}",
                                 path="format")
        if doc.get("v") != EXPORT_VERSION:
            raise InvalidRequest(f"run export version {doc.get('v')!r}: this code reads "
                                 f"version {EXPORT_VERSION}", path="v")
        try:
            run, journal = doc["run"], doc["journal"]
            entries = [{"seq": int(e["seq"]), "kind": str(e["kind"]),
                        "position": None if e["position"] is None else int(e["position"]),
                        "name": e["name"], "schema_version": int(e["schema_version"]),
                        "payload": e["payload"]} for e in journal]
            return cls(run_id=uuid.UUID(str(run["id"])), workflow=str(run["workflow"]),
                       version=str(run["version"]), input=run["input"],
                       owner=Owner.model_construct(tenant=str(run["tenant"]),
                                                   principal=str(run["principal"])),
                       status=str(run["status"]), journal=entries)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"a malformed run export ({type(exc).__name__}: {exc})",
                                 path="run") from None


@dataclass(frozen=True)
class Verdict:
    """What the check found for one run."""

    run_id: uuid.UUID
    workflow: str  # name@version
    verdict: str  # "ok", "nondeterminism" or "error"
    commands: int  # commands the code issued that the journal held
    position: int | None = None  # where it differs (or, for ok, where the history ends)
    recorded: str | None = None  # what the journal holds there
    issued: str | None = None  # what the code issued there
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": str(self.run_id), "workflow": self.workflow, "verdict": self.verdict,
                "commands": self.commands, "position": self.position,
                "recorded": self.recorded, "issued": self.issued, "message": self.message}


class _HistoryEnds(BaseException):
    """A command the journal has nothing for, issued where the code cannot wait (a recorded
    value, a message): the run would go on live from here."""

    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.position = position


class _Commands:
    """The commands of one run's check: matched against its journal, never carried out."""

    def __init__(self, run: RecordedRun, registry: Registry,
                 arguments_text: Callable[[Any], str]) -> None:
        self.recorded = run
        self.registry = registry
        self.arguments_text = arguments_text
        self.index = JournalIndex(run.journal)
        self.owner_text = canonical_json(run.owner.as_dict())
        self.position = 0
        self.issued = 0  # commands issued, to tell when the code has gone quiet
        self.matched = 0
        self.waiting: list[int] = []  # positions where a branch waits for what is not recorded
        self.never: asyncio.Future[Any] | None = None
        # The first command that differed from the journal, in whichever branch (one the code
        # never waits for included), as a worker's replay keeps it to end the run with.
        self.diverged: Nondeterminism | None = None

    # -- the Commands protocol of orchestrator.context --------------------------------------

    @property
    def run_id(self) -> uuid.UUID:
        return self.recorded.run_id

    @property
    def owner(self) -> Owner:
        return self.recorded.owner

    @property
    def workflow(self) -> str:
        return f"{self.recorded.workflow}@{self.recorded.version}"

    @property
    def replaying(self) -> bool:
        return True

    def next_position(self) -> int:
        self.issued += 1
        position = self.position
        self.position += 1
        return position

    def patch(self, patch_id: str) -> bool:
        check_identifier("patch", patch_id)
        if self.index.patched(self.position, patch_id):
            return True
        return self.position > self.index.max_position  # past the history: a live run's yes

    def value(self, position: int, name: str) -> Any:
        found = self._seen(match_value(self.index, position, name))
        if found is NEW:
            raise _HistoryEnds(position)
        return found.settle()

    def publish(self, position: int, value: Any, topic: str) -> None:
        check_identifier("topic", topic)
        found = self._seen(match_publish(self.index, position, topic, value))
        if found is NEW:
            raise _HistoryEnds(position)
        found.settle()

    async def call(self, position: int, tool: Tool | str, arguments: dict[str, Any]) -> Any:
        found = resolve_tool(self.registry, tool)
        name = found.name
        intent = canonical.intent_digest_text(found.name, found.version, self.owner_text,
                                              self.arguments_text(arguments))
        return await self._outcome(position, match_call(self.index, position, name, intent))

    async def sleep(self, position: int, duration: timedelta | float) -> None:
        found = self._seen(match_sleep(self.index, position))
        if found is NEW:
            await self._wait(position)
        found.settle()
        # A recorded timer is over if the history holds what came after it (a later command,
        # or the run's end); else the run waits on it.
        ended = any(e["kind"] in RUN_ENDS for e in self.index.run_events)
        if self.index.max_position <= position and not ended:
            await self._wait(position)

    async def wait_for_event(self, position: int, name: str,
                             timeout: timedelta | float | None) -> Any:
        return await self._outcome(position, match_event(self.index, position, name))

    async def run_child(self, position: int, workflow: Workflow | str, input: Any) -> Any:
        name = workflow if isinstance(workflow, str) else workflow.name
        return await self._outcome(position, match_child(self.index, position, name))

    def continue_as_new(self, input: Any, version: str | None) -> NoReturn:
        raise ContinueAsNew("", version or self.recorded.version)  # the code ends here

    # -- matching ----------------------------------------------------------------------------

    def _seen(self, found: matching.Verdict) -> matching.Verdict:
        """Count a command the journal held: one it recorded as issued here, even with other
        arguments or another value (not another command)."""
        if found is not NEW and not (found.outcome is Outcome.DIFFERS
                                     and found.value is Mismatch.COMMAND):
            self.matched += 1
        if (found.outcome is Outcome.DIFFERS and self.diverged is None
                and isinstance(found.error, Nondeterminism)):
            self.diverged = found.error
        return found

    async def _outcome(self, position: int, found: matching.Verdict) -> Any:
        """What a command does as the journal says: return, raise, or (where the history has
        no outcome for it) wait."""
        self._seen(found)
        if found.outcome in (Outcome.NEW, Outcome.WAITS, Outcome.WITHDRAWN):
            return await self._wait(position)
        return found.settle()

    async def _wait(self, position: int) -> Any:
        """Where the history ends for this branch: wait for ever (the check stops the code
        once every branch waits)."""
        self.waiting.append(position)
        if self.never is None:
            self.never = asyncio.get_running_loop().create_future()
        return await self.never


async def check_run(run: RecordedRun, registry: Registry,
                    arguments_text: Callable[[Any], str]) -> Verdict:
    """Run ``run``'s workflow code (as ``registry`` has it) against its journal."""
    key = f"{run.workflow}@{run.version}"
    wf = registry.workflow(run.workflow, run.version)
    if wf is None:
        return Verdict(run.run_id, key, "error", 0,
                       message=f"workflow {key} is not registered in this code")
    commands = _Commands(run, registry, arguments_text)

    async def body() -> Any:  # what calling the function raises ends the code, as in a worker
        return await wf.fn(WorkflowContext(commands), run.input)

    task = asyncio.ensure_future(body())
    try:
        await _until_quiet(commands)
    finally:
        waits = not task.done()  # every branch waits where its history ends
        if waits:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if commands.never is not None:  # branches the code left waiting end with the check
            commands.never.cancel()
    # The code's own failure, taken here whatever decides (else the loop reports it as never
    # retrieved once the task is gone).
    raised = task.exception() if not task.cancelled() else None
    # A branch that differed decides, whether or not the code waited for it (as in a worker).
    failure: BaseException | None = commands.diverged
    if failure is None and waits:
        return _ended(run, key, commands, min(commands.waiting, default=commands.position))
    if failure is None:
        failure = _deciding(raised)
    if isinstance(failure, Nondeterminism):
        return Verdict(run.run_id, key, "nondeterminism", commands.matched, failure.position,
                       failure.recorded, failure.issued, f"NONDETERMINISM: {failure}")
    if isinstance(failure, _HistoryEnds):
        return _ended(run, key, commands, failure.position)
    if isinstance(failure, InvalidRequest | UnknownWorkflow):
        return Verdict(run.run_id, key, "error", commands.matched,
                       message=f"{failure.code}: {failure}")
    # The code ended (returned, continued as new, or raised as a failing run does): the
    # journal must not hold commands it did not issue.
    how = "continued as new" if isinstance(failure, ContinueAsNew) else "ended"
    beyond = matching.code_ended(commands.index, commands.position, how)
    if beyond is not None:
        return Verdict(run.run_id, key, "nondeterminism", commands.matched, beyond.position,
                       beyond.recorded, beyond.issued, f"NONDETERMINISM: {beyond}")
    return _ended(run, key, commands, None)


async def _until_quiet(commands: _Commands) -> None:
    """Turn the loop until the code has gone quiet: every branch waits where its history
    ends, or the code ended and the branches it did not wait for have taken the steps they
    had already begun (a worker's replay takes them too before the run's end is written)."""
    quiet, seen = 0, -1
    while quiet < QUIET_TURNS:
        await asyncio.sleep(0)
        quiet = quiet + 1 if commands.issued == seen else 0
        seen = commands.issued


def _deciding(failure: BaseException | None) -> BaseException | None:
    """What the code's failure comes to when a task group (``asyncio.TaskGroup``) collected
    it: a ``NONDETERMINISM`` among its exceptions (nested groups included) first, as a
    worker's end takes it from the group, else where the history ends; else ``failure``."""
    if not isinstance(failure, BaseExceptionGroup):
        return failure
    leaves = list(_leaves(failure))
    for kind in (Nondeterminism, _HistoryEnds):
        found = next((exc for exc in leaves if isinstance(exc, kind)), None)
        if found is not None:
            return found
    return failure


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _ended(run: RecordedRun, key: str, commands: _Commands, at: int | None) -> Verdict:
    where = ("the code ran to its end" if at is None else
             f"the history ends at position {at}: a worker would go on live from there")
    return Verdict(run.run_id, key, "ok", commands.matched, at, message=where)


async def check_runs(runs: Iterable[RecordedRun], registry: Registry,
                     arguments_text: Callable[[Any], str]) -> list[Verdict]:
    return [await check_run(run, registry, arguments_text) for run in runs]


# -- reading runs from the database and from files ----------------------------------------------

async def load_runs(conn: Conn, *, run_id: uuid.UUID | None = None,
                    workflow: str | None = None, version: str | None = None,
                    since: datetime | None = None, last: int = 100,
                    finished: bool = True) -> list[RecordedRun]:
    """The newest ``last`` runs the filters select, with their journals (``finished=False``:
    only runs that have not ended, those a deployment's workers will replay). Pruned runs have
    no history to check: the filters leave them out, and ``run_id`` naming one is
    ``RUN_PRUNED``."""
    rows = await runs_db.run_read_for_replay(conn, run_id=run_id, workflow=workflow,
                                             version=version, since=since, last=last,
                                             finished=finished or run_id is not None)
    runs = []
    for row in rows:
        if row["pruned_at"] is not None:
            raise RunPruned(f"run {row['id']} was pruned by retention at "
                            f"{row['pruned_at'].isoformat()}: its journal and input are no "
                            "longer kept, so there is nothing to check (docs/retention.md)",
                            status=row["status"], outcome=row["outcome_code"],
                            pruned_at=row["pruned_at"])
        journal = await journal_db.journal_read_for_replay(conn, row["id"])
        runs.append(RecordedRun(
            run_id=row["id"], workflow=row["workflow_name"], version=row["workflow_version"],
            input=row["input"], status=row["status"], journal=list(journal),
            owner=Owner.model_construct(tenant=row["tenant"], principal=row["principal"])))
    return runs


def export_document(run: RecordedRun) -> dict[str, Any]:
    """``orchestrator runs export``'s document: what ``replay --from-file`` reads. Its payloads
    are those every reader of the journal is shown (:func:`~orchestrator.journal.shown_payload`:
    a field that earlier code wrote and that no reader sees, such as an ``event.received``
    entry's ``event_id``, a number all tenants' events share, is left out; replay reads none
    of them). A journal holding an entry written by newer code is refused
    (``SCHEMA_UNSUPPORTED``, :func:`~orchestrator.journal.check_versions`), as every other
    reader of a journal refuses it: its payload is never read as one of this code's."""
    check_versions(run.journal)
    return {"format": EXPORT_FORMAT, "v": EXPORT_VERSION,
            "run": {"id": str(run.run_id), "workflow": run.workflow, "version": run.version,
                    "status": run.status, "tenant": run.owner.tenant,
                    "principal": run.owner.principal, "input": run.input},
            "journal": [{"seq": e["seq"], "kind": e["kind"], "position": e["position"],
                         "name": e["name"], "schema_version": e["schema_version"],
                         "payload": shown_payload(e["kind"], e["payload"])}
                        for e in run.journal]}


def read_documents(text: str, *, source: str) -> list[RecordedRun]:
    """Runs from a file's text: one export document, a JSON array of them, or JSON lines."""
    stripped = text.strip()
    try:
        if stripped.startswith("["):
            docs = json.loads(stripped)
        elif "\n" in stripped and not _one_document(stripped):
            docs = [json.loads(line) for line in stripped.splitlines() if line.strip()]
        else:
            docs = [json.loads(stripped)]
    except ValueError as exc:
        raise InvalidRequest(f"{source} is not JSON: {exc}", path="from_file") from None
    return [RecordedRun.from_document(doc) for doc in docs]


def _one_document(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

