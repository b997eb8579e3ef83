"""Replay matching (CONTRACT C3, C4). Pure: no I/O.

A run's journal is indexed by command position. When workflow code issues the command at
position *p*, :meth:`JournalIndex.expect` checks that what was recorded there is the same kind
of command with the same name; anything else is nondeterminism and stops the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orchestrator.errors import SchemaUnsupported

SCHEMA_VERSION = 1
"""The journal event schema this code writes and understands."""

# Which event kinds a command of each kind may find first at its position.
_FIRST_KIND = {
    "call": ("call.submitted", "call.pending"),
    "sleep": ("timer",),
    "event": ("event.wait",),
    "value": ("value",),
    "child": ("child.started",),
}


class Nondeterminism(BaseException):  # noqa: N818
    """The workflow issued a command that does not match the journal at that position.

    A BaseException, so that ordinary ``except Exception`` in workflow code cannot swallow it
    and carry on (CONTRACT C4: never silently continued)."""


class JournalIndex:
    """The events of one run, grouped by command position, with schema versions checked."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.by_position: dict[int, list[dict[str, Any]]] = {}
        self.run_events: list[dict[str, Any]] = []
        self.max_position = -1
        for event in events:
            if event["schema_version"] > SCHEMA_VERSION:
                raise SchemaUnsupported(
                    f"journal event {event['seq']} has schema version "
                    f"{event['schema_version']}; this code understands up to {SCHEMA_VERSION}"
                )
            position = event["position"]
            if position is None:
                self.run_events.append(event)
                continue
            self.by_position.setdefault(position, []).append(event)
            self.max_position = max(self.max_position, position)

    def expect(self, position: int, command: str, name: str) -> list[dict[str, Any]]:
        """The events recorded at ``position`` (possibly none), checked against the command."""
        events = self.by_position.get(position)
        if not events:
            return []
        first = events[0]
        if first["kind"] not in _FIRST_KIND[command] or first["name"] != name:
            raise Nondeterminism(
                f"position {position}: the workflow issued {command} {name!r} but the journal "
                f"recorded {first['kind']} {first['name']!r}"
            )
        return events

    def add(self, event: dict[str, Any]) -> None:
        """Keep the index current with an event this process just committed."""
        position = event["position"]
        if position is None:
            self.run_events.append(event)
            return
        self.by_position.setdefault(position, []).append(event)
        self.max_position = max(self.max_position, position)

    def last(self, position: int, kinds: tuple[str, ...]) -> dict[str, Any] | None:
        """The last event at ``position`` whose kind is one of ``kinds``."""
        for event in reversed(self.by_position.get(position, ())):
            if event["kind"] in kinds:
                found: dict[str, Any] = event
                return found
        return None
