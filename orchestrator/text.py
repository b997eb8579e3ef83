"""Rules for the strings that name things: owners, operators, events, filters, evidence.

Pure functions, no I/O. Every identifier a caller hands the orchestrator is checked here before
anything is written or looked up, so that a NUL byte, a lone surrogate or an invisible
character is an ``INVALID_REQUEST`` naming the field, never a driver error, and the commonest
look-alikes (a trailing space, a zero-width character) cannot pose as another identity.
Names are compared exactly as given: no Unicode normalisation, no case folding, so other
look-alikes (a no-break space inside, homoglyphs) are different names.

Two kinds of text:

- **names** (tenant, principal, operator, event name, filter values): 1 to ``max_length``
  characters (200 unless said otherwise), no control characters (Unicode category ``Cc``), no
  format characters (``Cf``: zero-width spaces and joiners, direction overrides, the BOM), no
  lone surrogates (``Cs``), and no whitespace at either end. Operator names also refuse
  whitespace inside (:func:`check_operator`);
- **prose** (evidence): 1 to ``max_length`` characters, not blank (whitespace and invisible
  format characters alone are blank); newlines and tabs are allowed, other control characters
  and lone surrogates are not.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from orchestrator.errors import InvalidRequest

NAME_MAX = 200
EVIDENCE_MAX = 10_000

_REFUSED_IN_NAMES = frozenset({"Cc", "Cf", "Cs"})
_PROSE_CONTROLS = frozenset("\t\n\r")


def _first_refused(value: str, *, prose: bool, spaces: bool) -> str | None:
    """What makes ``value`` unacceptable, in words, or None. ASCII text is checked without
    the Unicode database (the common case)."""
    if value.isascii():
        for char in value:
            if char < " " or char == "\x7f":
                if prose and char in _PROSE_CONTROLS:
                    continue
                return f"a control character (U+{ord(char):04X})"
            if char == " " and not spaces:
                return "whitespace"
        return None
    for char in value:
        category = unicodedata.category(char)
        if category == "Cs":
            return "a lone surrogate"
        if category == "Cc" and not (prose and char in _PROSE_CONTROLS):
            return f"a control character (U+{ord(char):04X})"
        if category == "Cf" and not prose:
            return f"an invisible format character (U+{ord(char):04X})"
        if not spaces and not prose and char.isspace():
            return "whitespace"
    return None


def check_identifier(field: str, value: Any, *, max_length: int = NAME_MAX,
                     spaces: bool = True) -> str:
    """``value`` if it is an acceptable name (see the module docstring), else
    ``INVALID_REQUEST`` with ``path=field``. ``spaces=False`` refuses whitespace anywhere."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty string", path=field)
    if len(value) > max_length:
        raise InvalidRequest(f"{field} is {len(value)} characters; at most {max_length} are "
                             "allowed", path=field)
    refused = _first_refused(value, prose=False, spaces=spaces)
    if refused is not None:
        raise InvalidRequest(f"{field} holds {refused}, which names may not contain", path=field)
    if value != value.strip():
        raise InvalidRequest(f"{field} may not begin or end with whitespace", path=field)
    return value


def check_operator(value: Any) -> str:
    """An operator's name: a name without whitespace, e.g. ``alice`` or ``ops@example.com``."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest("an operator identity is required (--operator NAME)",
                             path="operator")
    return check_identifier("operator", value, spaces=False)


def check_prose(field: str, value: Any, *, max_length: int = EVIDENCE_MAX) -> str:
    """Free text such as evidence: not blank (something shows: not only whitespace and
    invisible format characters), at most ``max_length`` characters, no control characters
    but newlines and tabs, no lone surrogates."""
    if not isinstance(value, str) or not _shows(value):
        raise InvalidRequest(f"{field} text is required", path=field)
    if len(value) > max_length:
        raise InvalidRequest(f"{field} is {len(value)} characters; at most {max_length} are "
                             "allowed", path=field)
    refused = _first_refused(value, prose=True, spaces=True)
    if refused is not None:
        raise InvalidRequest(f"{field} holds {refused}, which cannot be stored", path=field)
    return value


def _shows(value: str) -> bool:
    """Whether ``value`` has a character that shows: not whitespace, not a format character
    (``Cf``: a zero-width space or joiner, a BOM, a direction mark)."""
    if value.isascii():
        return bool(value.strip())
    return any(not char.isspace() and unicodedata.category(char) != "Cf" for char in value)


def storable(value: str) -> str:
    """``value`` with what PostgreSQL cannot keep in ``text`` or ``jsonb`` spelled out: a NUL
    byte as ``\\x00``, a lone surrogate as ``\\udXXX``. For diagnostics taken from a tool (a
    lookup's reason, an exception's message), which are kept as they came, not refused."""
    return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def is_number(text: str, most: int = 18) -> bool:
    """Whether ``text`` is a whole number ``int()`` reads as written: 1 to ``most`` ASCII
    digits (not ``²`` or another script's digits, which ``str.isdigit`` also accepts, nor
    more digits than ``int()`` takes)."""
    return text.isascii() and text.isdigit() and len(text) <= most
