"""Every ``orchestrator …`` command that the alert rules and the documentation name in running
text exists, with the options it is shown with: a reader who copies one from an alert's
description or a doc gets the command, not ``invalid choice``."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator import cli

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_SPAN = re.compile(r"`(orchestrator [^`]+)`")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_TEMPLATE = re.compile(r"\{\{.*?\}\}")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions for name in action.option_strings}


def problem(command: str) -> str | None:
    """What is wrong with ``command`` as the CLI would parse it (None: nothing). Placeholders
    (``RUN_ID``, ``{{ $labels.tool }}``) stand for positionals and option values; ``[…]``
    marks optional parts."""
    words = shlex.split(_TEMPLATE.sub("VALUE", command).replace("[", " ").replace("]", " "))
    assert words[0] == "orchestrator"
    parser: argparse.ArgumentParser = cli.build_parser()
    path = ["orchestrator"]
    rest = words[1:]
    while rest:
        word, rest = rest[0], rest[1:]
        if word.startswith("-"):
            name, _, inline = word.partition("=")
            action = _options(parser).get(name)
            if action is None:
                return f"{' '.join(path)} has no option {name}"
            if action.nargs != 0 and not inline and rest:
                value, rest = rest[0], rest[1:]
                if action.choices is not None and value not in action.choices:
                    return f"{' '.join(path)} {name} does not take {value!r}"
            continue
        commands = _subcommands(parser)
        if commands:
            if word not in commands:
                return f"{' '.join(path)} has no command {word!r} (it has {sorted(commands)})"
            parser = commands[word]
            path.append(word)
    return None


def _alert_commands() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    found = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            annotations: dict[str, Any] = rule["annotations"]
            for text in annotations.values():
                found += [(rule["alert"], " ".join(m.split())) for m in _SPAN.findall(text)]
    return found


def _doc_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        prose = _FENCE.sub("", doc.read_text())
        found += [(doc.name, " ".join(m.split())) for m in _SPAN.findall(prose)]
    return found


def test_the_check_finds_what_a_reader_would_trip_on() -> None:
    assert problem("orchestrator runs list --status failed") is None
    assert problem("orchestrator ops list --tool {{ $labels.tool }}") is None
    assert "no command 'list'" in (problem("orchestrator incidents list") or "")
    assert "no option --colour" in (problem("orchestrator runs list --colour") or "")
    assert "does not take 'broken'" in (problem("orchestrator runs list --status broken")
                                        or "")


def test_the_alert_rules_name_commands_that_exist() -> None:
    named = _alert_commands()
    assert len(named) >= 8  # what to run is in every description that names a command
    assert [(alert, command, problem(command)) for alert, command in named
            if problem(command) is not None] == []


@pytest.mark.parametrize("doc", [d.name for d in DOCS])
def test_the_docs_running_text_names_commands_that_exist(doc: str) -> None:
    named = [command for name, command in _doc_commands() if name == doc]
    assert [(command, problem(command)) for command in named
            if problem(command) is not None] == []
