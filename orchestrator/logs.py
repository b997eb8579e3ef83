"""Log lines: the structured fields every line may carry, the two formats of the processes
this package runs (``text``, ``json``), and ``ctx.log``'s replay-silent logger.

A line about a run carries its identity as fields given with ``extra=`` (:func:`fields`):
``run_id``, ``operation_id``, ``workflow`` (``name@version``), ``tool``, ``code`` (a stable
code, CONTRACT C10), ``incident`` (the reference of the protected diagnostics) and ``cause``
(an exception's type name or an error code); and ``trace_id`` / ``span_id`` of the current
OpenTelemetry span when there is one (docs/tracing.md). The text format
(:class:`TextFormatter`) shows the message, which names the same facts in words, and puts
``run <run_id> (<workflow>):`` before a ``ctx.log`` line's, whose words are the workflow's; the
JSON format (:class:`JsonFormatter`) writes one object per line with ``ts``, ``level``,
``logger``, ``message`` and each field that is known.

No line carries tool or upstream text, an exception's message, or a run's input, arguments,
receipts or result: those go to incidents (docs/logging.md).

A step that a process repeats in the background (a worker's heartbeat, claim, lease renewal,
lease sweep and liveness lock check; the schedules' tick) says its failures once per streak
(:class:`FailureStreak`): an outage of a few seconds is one WARNING and one INFO, not a line
per attempt.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
import uuid
from collections.abc import Callable, MutableMapping
from datetime import UTC, datetime
from typing import IO, Any

from opentelemetry import trace

from orchestrator.errors import ConfigurationError

FIELDS = ("run_id", "operation_id", "workflow", "tool", "code", "incident", "cause",
          "trace_id", "span_id")
"""The structured fields a line may carry, in the order a JSON line lists them."""

FORMATS = ("text", "json")
ENV_LOG_FORMAT = "ORCHESTRATOR_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(message)s"
WORKFLOW_LOGGERS = "orchestrator.workflow."
"""The prefix of ``ctx.log``'s loggers (``orchestrator.workflow.<workflow name>``)."""


def fields(**values: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call: the known fields (None left out), ids as text, and the
    current span's ``trace_id`` and ``span_id`` if there is one (taken now, in the caller's
    context: a handler may format the record later, elsewhere)."""
    found = {name: str(value) if isinstance(value, uuid.UUID) else value
             for name, value in values.items() if value is not None}
    _trace_fields(found)
    return found


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, then each of :data:`FIELDS` the record carries, and
    ``exception`` (the formatted traceback) when the call logged one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, Any] = {"ts": ts, "level": record.levelname, "logger": record.name,
                                "message": record.getMessage()}
        attributes = record.__dict__
        spans: dict[str, Any] = {}
        if "trace_id" not in attributes:  # a line logged without fields(): if formatted
            _trace_fields(spans)  # in the logging call's context, its span
        for name in FIELDS:
            value = attributes.get(name, spans.get(name))
            if value is not None:
                line[name] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line)


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, with ``run <run_id> (<workflow>):`` before the message of a line
    of ``ctx.log`` (a logger under :data:`WORKFLOW_LOGGERS` whose record carries a
    ``run_id``): the workflow's own words do not say which run wrote them. The orchestrator's
    own lines name their run in their message already."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        run_id = record.__dict__.get("run_id")
        if run_id is None or not record.name.startswith(WORKFLOW_LOGGERS):
            return super().formatMessage(record)
        workflow = record.__dict__.get("workflow")
        said = f"run {run_id}" + (f" ({workflow})" if workflow is not None else "")
        shown = logging.makeLogRecord(record.__dict__)  # a copy: other handlers see the record
        shown.message = f"{said}: {record.message}"  # as it was logged
        return super().formatMessage(shown)


def traceback_text(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, with those of the exceptions that caused it or
    were being handled (oldest first), except that each exception is named by its type only:
    the frames say where it failed and through what; the messages, which can hold anything (a
    secret, a payload), are left out, as from every log line."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSED
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _DURING
        else:
            current = None
    lines: list[str] = []
    for one, link in reversed(chain):  # link: how it led to the exception printed after it
        if one.__traceback__ is not None:
            lines.append("Traceback (most recent call last):\n")
            lines.extend(traceback.format_tb(one.__traceback__))
        kind = type(one)
        named = (kind.__qualname__ if kind.__module__ == "builtins"
                 else f"{kind.__module__}.{kind.__qualname__}")
        lines.append(f"{named}\n")
        lines.append(link)
    return "".join(lines).rstrip("\n")


_CAUSED = "\nThe above exception was the direct cause of the following exception:\n\n"
_DURING = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _trace_fields(attributes: dict[str, Any]) -> None:
    """Add the current span's trace and span ids (hex, as trace backends show them) when
    there is a valid one: a line written while a run's or a call's span is current names it."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        attributes["trace_id"] = f"{ctx.trace_id:032x}"
        attributes["span_id"] = f"{ctx.span_id:016x}"


def log_format(chosen: str | None) -> str:
    """The format a process logs in: ``chosen`` (``--log-format``), else
    ``ORCHESTRATOR_LOG_FORMAT``, else ``text``. An unknown value in the environment is a
    ``CONFIGURATION_ERROR`` (the flag's own values are checked by its parser)."""
    if chosen is not None:
        return chosen
    raw = os.environ.get(ENV_LOG_FORMAT, "")
    value = raw.strip().lower()
    if not value:
        return "text"
    if value not in FORMATS:
        raise ConfigurationError(
            f"{ENV_LOG_FORMAT} must be one of {', '.join(FORMATS)}, not {raw.strip()!r}")
    return value


def formatter(format: str) -> logging.Formatter:
    """The formatter of ``format`` (``text`` or ``json``)."""
    if format == "json":
        return JsonFormatter()
    if format == "text":
        return TextFormatter()
    raise ConfigurationError(f"the log format must be one of {', '.join(FORMATS)}")


class FailureStreak:
    """The failures in a row of a step tried again and again (a worker's heartbeat, its claim):
    a WARNING at the first, ``"<step> failed: <reason> (said once: …)"``, and one INFO when the
    step succeeds again, ``"<steps> succeed again, N s after the first that failed"``; not a
    line per attempt, which an outage of a few seconds turns into dozens on every worker. A
    failure with a code not yet said in the streak is news, and said too. The WARNING carries
    the failure's ``code`` as a field.

    ``prefix`` goes before both lines (``"schedules: "``); ``failure`` replaces the warning's
    ``"<step> failed"`` where the step's lines said it in other words (``"could not check its
    liveness lock"``): a line's first words stay those it had before."""

    def __init__(self, logger: logging.Logger, step: str, steps: str, *, prefix: str = "",
                 failure: str | None = None) -> None:
        self._logger = logger
        self.step = step  # "heartbeat": the warning's first words are "heartbeat failed"
        self.steps = steps  # "heartbeats"
        self._prefix = prefix
        self._failure = failure if failure is not None else f"{step} failed"
        self._since: float | None = None  # monotonic time of the streak's first failure
        self._said: set[str] = set()  # the codes said in this streak

    def failed(self, code: str, reason: str | None = None) -> None:
        """An attempt failed with ``code``; ``reason`` (default: the code) is what is said."""
        if self._since is None:
            self._since = time.monotonic()
        if code not in self._said:
            self._said.add(code)
            self._logger.warning("%s%s: %s (said once: a line says when %s succeed again)",
                                 self._prefix, self._failure, reason or code, self.steps,
                                 extra=fields(code=code),
                                 stacklevel=2)  # the record names the step's own code

    def succeeded(self) -> None:
        """An attempt succeeded: the end of a streak of failures is said."""
        if self._since is not None:
            self._logger.info("%s%s succeed again, %.1f s after the first that failed",
                              self._prefix, self.steps, time.monotonic() - self._since,
                              stacklevel=2)
            self._since = None
            self._said.clear()


def configure(format: str, *, level: int = logging.INFO, stream: IO[str] | None = None
              ) -> None:
    """Log at ``level`` and above to ``stream`` (standard error) in ``format``: what
    ``orchestrator worker`` and ``orchestrator reconciler`` do. Like
    :func:`logging.basicConfig`, it does nothing if the root logger has handlers already."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(format))
    logging.basicConfig(level=level, handlers=[handler])


class WorkflowLogger(logging.LoggerAdapter[logging.Logger]):
    """``ctx.log``: a logger adapter whose records carry the run's ``run_id`` and
    ``workflow`` and are dropped while the workflow replays recorded history, so that a line
    is written by the execution that first got past it, not again by every replay.

    ``replaying()`` says whether the workflow is replaying now (the engine's
    ``RunState.replaying``). Fields given with ``extra=`` are kept; the run's own win."""

    def __init__(self, logger: logging.Logger, replaying: Callable[[], bool],
                 run_fields: dict[str, Any]) -> None:
        super().__init__(logger, run_fields)
        self._replaying = replaying

    @property
    def replaying(self) -> bool:
        """True while the workflow replays recorded history (its lines are dropped)."""
        return self._replaying()

    def isEnabledFor(self, level: int) -> bool:
        # LoggerAdapter.log asks this before anything else: every level method goes here.
        return not self._replaying() and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]
                ) -> tuple[Any, MutableMapping[str, Any]]:
        extra = {**(kwargs.get("extra") or {}), **(self.extra or {})}
        _trace_fields(extra)
        kwargs["extra"] = extra
        return msg, kwargs
