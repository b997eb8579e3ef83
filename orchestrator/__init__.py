"""A durable workflow orchestrator for Python on PostgreSQL.

A run never loses work, never repeats an effect whose outcome is uncertain, and always tells
the truth about what it knows. Start with :class:`Orchestrator`.
"""

# First: under ``python -m orchestrator`` a SIGTERM while the rest loads is kept (_early.py).
from orchestrator import _early  # noqa: F401, I001
from orchestrator.app import Orchestrator
from orchestrator.context import PolicyContext, ToolContext, WorkflowContext
from orchestrator.errors import (
    AccessDenied,
    ConfigurationError,
    DatabaseError,
    EventTimeout,
    IdempotencyConflict,
    InvalidRequest,
    OperationInProgress,
    OperationUncertain,
    OrchestratorError,
    ResolutionConflict,
    ResultTimeout,
    RunFailed,
    RunPruned,
    ToolFailed,
    WorkflowError,
)
from orchestrator.failures import ToolError
from orchestrator.flow import RateLimit
from orchestrator.handle import RunHandle
from orchestrator.lookups import Committed, NotApplied, StillUnknown
from orchestrator.models import JournalEntry, Owner, RunInfo
from orchestrator.queues import Queue, QueueInfo
from orchestrator.recovery import RetryPolicy
from orchestrator.registry import Tool, Workflow
from orchestrator.retention import Retention

__all__ = [
    "AccessDenied",
    "Committed",
    "ConfigurationError",
    "DatabaseError",
    "EventTimeout",
    "IdempotencyConflict",
    "InvalidRequest",
    "JournalEntry",
    "NotApplied",
    "OperationInProgress",
    "OperationUncertain",
    "Orchestrator",
    "OrchestratorError",
    "Owner",
    "PolicyContext",
    "Queue",
    "QueueInfo",
    "RateLimit",
    "ResolutionConflict",
    "ResultTimeout",
    "Retention",
    "RetryPolicy",
    "RunFailed",
    "RunPruned",
    "RunHandle",
    "RunInfo",
    "StillUnknown",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolFailed",
    "Workflow",
    "WorkflowContext",
    "WorkflowError",
]
