"""The values typed options take, refused as every other bad input of the command line is.

Each helper returns an argparse ``type=`` that converts an option's text and checks its range
or its choices, raising ``INVALID_REQUEST`` that names the option, what it takes and what was
given (``--limit must be a whole number from 1 to 1000, not 'abc'``). argparse does not catch
the orchestrator's errors, so parsing stops there, before the command reads or writes
anything, and :func:`orchestrator.cli.main` prints the one line it prints for any refusal
(docs/cli-json.md); argparse's own usage text stays for ``--help``, unknown commands and
missing arguments. An option with ``choices=`` keeps them for its help and takes
``type=one_of(...)`` with the same choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from orchestrator.errors import InvalidRequest

MAX_LIMIT = 1000
"""The most rows a list's ``--limit`` asks for (``runs list``, ``ops list``, ``ops audit``),
as the Python API's lists take."""

MAX_PORT = 65535
"""The highest TCP port (``--port``, ``--metrics-port``)."""

SHOWN = 40
"""Characters of a refused value repeated in the message; a longer one is cut."""


def _refuse(option: str, takes: str, text: str) -> InvalidRequest:
    shown = text if len(text) <= SHOWN else text[:SHOWN - 1] + "…"
    return InvalidRequest(f"{option} must be {takes}, not {shown!r}",
                          path=option.lstrip("-").replace("-", "_"))


def whole(option: str, *, low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number from ``low`` (to ``high``, when given)."""
    takes = (f"a whole number from {low} to {high}" if high is not None
             else f"a whole number, {low} or more")

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _refuse(option, takes, text) from None
        if value < low or (high is not None and value > high):
            raise _refuse(option, takes, text)
        return value

    return convert


def whole_or_none(option: str, *, low: int) -> Callable[[str], int | str]:
    """A whole number from ``low``, or the word ``none`` (any case), given back as ``"none"``
    (a limit removed; an option left out stays ``None``)."""
    takes = f"a whole number, {low} or more, or none"
    number = whole(option, low=low)

    def convert(text: str) -> int | str:
        if text.lower() == "none":
            return "none"
        try:
            return number(text)
        except InvalidRequest:
            raise _refuse(option, takes, text) from None

    return convert


def seconds(option: str, *, zero: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, more than 0 (``zero``: 0 or more)."""
    return number(option, "a finite number of seconds, " + ("0 or more" if zero else
                                                             "more than 0"),
                  lambda value: math.isfinite(value) and (value >= 0 if zero else value > 0))


def number(option: str, takes: str, accept: Callable[[float], bool]) -> Callable[[str], float]:
    """A number that ``accept`` takes (``nan`` and the infinities reach it: refuse them there),
    described as ``takes``."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _refuse(option, takes, text) from None
        if not accept(value):
            raise _refuse(option, takes, text)
        return value

    return convert


def one_of(option: str, choices: Sequence[str]) -> Callable[[str], str]:
    """One of ``choices``, as given."""
    takes = "one of " + ", ".join(choices)

    def convert(text: str) -> str:
        if text not in choices:
            raise _refuse(option, takes, text)
        return text

    return convert
