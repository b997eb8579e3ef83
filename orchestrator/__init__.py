"""A durable workflow orchestrator for Python on PostgreSQL.

A run never loses work, never repeats an effect whose outcome is uncertain, and always tells
the truth about what it knows. Start with :class:`Orchestrator`.
"""

from orchestrator.app import Orchestrator, RunHandle
from orchestrator.context import ToolContext, WorkflowContext
from orchestrator.errors import (
    AccessDenied,
    IdempotencyConflict,
    InvalidRequest,
    OrchestratorError,
    ResultTimeout,
    RunFailed,
    ToolError,
    ToolFailed,
    WorkflowError,
)
from orchestrator.models import Owner, RunInfo
from orchestrator.registry import Tool, Workflow

__all__ = [
    "AccessDenied",
    "IdempotencyConflict",
    "InvalidRequest",
    "Orchestrator",
    "OrchestratorError",
    "Owner",
    "ResultTimeout",
    "RunFailed",
    "RunHandle",
    "RunInfo",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolFailed",
    "Workflow",
    "WorkflowContext",
    "WorkflowError",
]
