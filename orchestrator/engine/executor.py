"""Driving one claimed run: a small composition of named parts.

A :class:`RunExecutor` lives as long as its worker holds the run's lease:

- :class:`~orchestrator.engine.run.RunState`: the run's identity, clock, lease, phase and
  cancellation, and the checks before every new step;
- :class:`~orchestrator.engine.session.Session`: every write of the run, fenced by its lease
  and revision, with the receipts that ride with the next write;
- :class:`~orchestrator.engine.commands.Commands`: what ``WorkflowContext`` asks for (calls
  through the gateway, timers, events, children, recorded values);
- :class:`~orchestrator.engine.branches.Branches`: the workflow's coroutine and its branches,
  parked once every branch waits on the database;
- :class:`~orchestrator.engine.outcome.Outcome`: the run's last write in this process.
"""

from __future__ import annotations

from typing import Any

from orchestrator.context import WorkflowContext
from orchestrator.db.database import Database
from orchestrator.db.writer import GroupWriter
from orchestrator.engine.branches import Branches
from orchestrator.engine.commands import Commands
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.outcome import Outcome
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session
from orchestrator.journal import Entry
from orchestrator.metrics import Metrics
from orchestrator.registry import Registry, Workflow


class RunExecutor:
    """One claimed run. See the module docstring."""

    def __init__(self, claim: dict[str, Any], journal: list[Entry], *, config: EngineConfig,
                 registry: Registry, database: Database, writer: GroupWriter,
                 metrics: Metrics, worker_id: str) -> None:
        self.run = RunState(claim, journal, worker_id=worker_id, metrics=metrics)
        # Whether this execution is traced is decided once, here: the tracer provider is
        # looked up per run, not per call (the lookup costs two microseconds).
        self.run.tracer = config.tracing.tracer
        self.session = Session(self.run, claim["revision"], config=config, database=database,
                               writer=writer)
        self.outcome = Outcome(self.run, self.session)
        self.branches = Branches(self.run, self.session, self.outcome)
        self.commands = Commands(self.run, self.session, self.branches, config, registry)

    @property
    def token(self) -> int:
        return self.run.token

    @property
    def workflow_key(self) -> str:
        return self.run.workflow_key

    async def drive(self, workflow: Workflow) -> None:
        """Run the workflow until it finishes or parks; record the outcome."""
        ctx = WorkflowContext(self.commands)
        fn, data = workflow.fn, self.run.input

        async def body() -> Any:
            # Called inside the task: what calling the function raises (a wrapper that checks
            # its input, a signature that does not bind) fails the run as the workflow's own
            # error, instead of escaping the executor with the run left `running`.
            return await fn(ctx, data)

        await self.branches.drive(body())
