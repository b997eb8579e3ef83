"""What the engine needs to know of the application's settings, frozen.

The :class:`~orchestrator.app.Orchestrator` builds one :class:`EngineConfig`; the worker, the
run executor, the gateway and the reconciler receive it (with the registry, the database and
the metrics), never the application itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from orchestrator.canonical import DEFAULT_LIMITS, JsonLimits
from orchestrator.tracing import Tracing

Hook = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; see :class:`~orchestrator.app.Orchestrator` for each."""

    json_limits: JsonLimits = DEFAULT_LIMITS
    max_journal_events: int = 10_000
    lease_ttl: float = 30.0
    tool_timeout: timedelta = timedelta(minutes=5)
    receipts_ride: bool = True
    authorize: Hook | None = None  # app-wide policy stages, run before each tool's own
    approve: Hook | None = None
    tracing: Tracing = field(default_factory=Tracing)  # where spans go (docs/tracing.md)
    # The queues the application declares: a child run may wait in these (None: any
    # well-formed name, for an engine built without an application).
    queues: frozenset[str] | None = None
    # Tools whose dispatch is paused (a provider's back-off, docs/flow.md), and until when:
    # kept current by the worker (NOTIFY), read before each dispatch.
    back_offs: dict[str, datetime] = field(default_factory=dict)
