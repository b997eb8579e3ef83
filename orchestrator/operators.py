"""The operator API: list, inspect and resolve operations whose outcome is unknown (C8, C9).

Consoles and the ``orchestrator ops`` command use this. Every action names an operator and
carries evidence; every resolution is audited. A host may restrict named operators to tenants
(``Orchestrator(operator_scopes={"bob": ["acme"]})``); an operator without an entry may act on
every tenant. Acting outside one's tenants gives ``ACCESS_DENIED``, the same answer as for an
operation that does not exist.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator import reconcile
from orchestrator.db import reconciliation as recon_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Database
from orchestrator.db.events import incidents_of_operations
from orchestrator.errors import InvalidRequest
from orchestrator.metrics import Metrics
from orchestrator.text import check_identifier

ITEM_STATES = ("open", "operator", "resolved")
UNRESOLVED = "unresolved"
"""``list_items(state=UNRESOLVED)``: the items still waiting (``open`` or ``operator``)."""


class Operators:
    """Operator actions on one database, with the host's operator scopes."""

    def __init__(self, database: Database,
                 scopes: Mapping[str, Sequence[str]] | None = None,
                 metrics: Metrics | None = None) -> None:
        self.db = database
        self.scopes = {k: list(v) for k, v in (scopes or {}).items()}
        self.metrics = metrics or Metrics()

    def tenants_of(self, operator: str) -> list[str] | None:
        """The tenants ``operator`` may act on; None means all."""
        if not isinstance(operator, str) or not operator.strip():
            raise InvalidRequest("an operator identity is required", path="operator")
        return self.scopes.get(operator)

    async def list_items(self, *, operator: str, state: str | None = None, tool: str | None = None,
                   older_than: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Queue items (one per unknown operation), oldest first; ``state`` one of
        :data:`ITEM_STATES` or :data:`UNRESOLVED` (None: every item)."""
        if state is not None and state not in (*ITEM_STATES, UNRESOLVED):
            raise InvalidRequest(f"state must be one of {', '.join((*ITEM_STATES, UNRESOLVED))}",
                                 path="state")
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be between 1 and 1000", path="limit")
        if tool is not None:
            check_identifier("tool", tool)
        states = (None if state is None else ["open", "operator"] if state == UNRESOLVED
                  else [state])
        async with self.db.connection() as conn:
            return await recon_db.recon_list(conn, states=states, tool=tool,
                                             older_than=older_than,
                                             tenants=self.tenants_of(operator), limit=limit)

    async def show(self, operation_id: int, *, operator: str) -> dict[str, Any]:
        """The item with the operation's intent, arguments, owner, every attempt at its
        position, the lookup history, the evidence and the run's timeline."""
        tenants = self.tenants_of(operator)
        async with self.db.connection() as conn:
            item = await recon_db.recon_get(conn, operation_id)
            if item is None or (tenants is not None and item["tenant"] not in tenants):
                raise await reconcile.not_queued(conn, operation_id, tenants)
            attempts = await recon_db.operation_attempts(conn, item["run_id"], item["position"])
            return {
                **item,
                "attempts": attempts,
                "incidents": await incidents_of_operations(
                    conn, item["run_id"], [a["id"] for a in attempts]),
                "lookups": await recon_db.recon_lookups(conn, item["item_id"]),
                "journal": await runs_db.journal_read(conn, item["run_id"]),
                "audit": await recon_db.audit_list(conn, target_id=str(operation_id)),
            }

    async def resolve_committed(self, operation_id: int, *, receipt: Any, evidence: str,
                                operator: str) -> str:
        """The effect was applied: record ``receipt`` as its outcome; the run resumes."""
        return await self._resolve(operation_id, "committed", evidence, operator, receipt)

    async def resolve_not_applied(self, operation_id: int, *, evidence: str,
                                  operator: str) -> str:
        """Nothing was applied: the run continues under its retry policy as a new attempt."""
        return await self._resolve(operation_id, "not_applied", evidence, operator)

    async def abandon(self, operation_id: int, *, evidence: str, operator: str) -> str:
        """Give up on the operation: the run fails with ``OPERATION_ABANDONED``."""
        return await self._resolve(operation_id, "abandoned", evidence, operator)

    async def _resolve(self, operation_id: int, resolution: str, evidence: str, operator: str,
                       receipt: Any = None) -> str:
        outcome = await reconcile.resolve(
            self.db, operation_id=operation_id, resolution=resolution, receipt=receipt,
            evidence=evidence, operator=operator, tenants=self.tenants_of(operator))
        if outcome == "resolved":
            self.metrics.incr("reconciliation_operator")
        return outcome

    async def audit(self, operation_id: int | None = None) -> list[dict[str, Any]]:
        """The audit log, oldest first (all of it, or one operation's)."""
        async with self.db.connection() as conn:
            return await recon_db.audit_list(
                conn, target_id=None if operation_id is None else str(operation_id))
