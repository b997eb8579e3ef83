"""Records at the public boundary: owners, run summaries, journal entries."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.errors import InvalidRequest

_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def validate_idempotency_key(key: str) -> str:
    """1–128 ASCII letters, digits, ``.``, ``_``, ``:``, ``-``; first a letter or digit (C1)."""
    if not isinstance(key, str) or not _IDEMPOTENCY_KEY.fullmatch(key) or not key.isascii():
        raise InvalidRequest(
            "idempotency_key must be 1-128 ASCII letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit",
            path="idempotency_key",
        )
    return key


class Owner(BaseModel):
    """Who a run belongs to. The host application authenticates; the orchestrator compares."""

    model_config = ConfigDict(frozen=True)

    tenant: str = Field(min_length=1, max_length=200)
    principal: str = Field(min_length=1, max_length=200)

    def as_dict(self) -> dict[str, str]:
        return {"tenant": self.tenant, "principal": self.principal}


class RunInfo(BaseModel):
    """A run as its owner may see it."""

    id: uuid.UUID
    workflow: str
    version: str
    owner: Owner
    status: str
    outcome: str | None = None
    waiting_for: str | None = None
    revision: int
    deadline_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    cancel_requested: bool = False
    parent_run_id: uuid.UUID | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunInfo:
        return cls(
            id=row["id"],
            workflow=row["workflow_name"],
            version=row["workflow_version"],
            owner=Owner(tenant=row["tenant"], principal=row["principal"]),
            status=row["status"],
            outcome=row["outcome_code"],
            waiting_for=row["waiting_for"],
            revision=row["revision"],
            deadline_at=row["deadline_at"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            finished_at=row["finished_at"],
            cancel_requested=row["cancel_requested_at"] is not None,
            parent_run_id=row["parent_run_id"],
            error=row["error"],
        )


class JournalEntry(BaseModel):
    """One event of a run's journal, for display."""

    seq: int
    kind: str
    position: int | None
    name: str | None
    schema_version: int
    payload: Any
    lease_token: int
    created_at: datetime
