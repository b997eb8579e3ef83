"""Canonical JSON and digests (CONTRACT C2). Pure functions, no I/O.

A JSON value here is ``dict`` with ``str`` keys, ``list``, ``str``, ``int``, ``float`` (finite),
``bool`` or ``None``. Everything else (NaN, infinities, bytes, sets, tuples, non-str keys,
objects with custom serialisation, subclasses of the basic types, and strings or keys holding
the NUL character, which PostgreSQL's ``jsonb`` cannot store, or a lone surrogate, which has no
UTF-8 form) is rejected with
``INVALID_REQUEST`` naming the path of the offending value, e.g. ``$.items[3].price``.

The canonical form sorts object keys, has no insignificant whitespace and is UTF-8 encoded, so
two values that differ only in key order have the same digest and any other change gives a
different one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from typing import Any

from orchestrator.errors import InvalidRequest, PayloadTooLarge

JSONValue = Any
"""A value that :func:`validate_json` accepts. Spelled ``Any`` because recursive aliases do not
help callers; validation is what guarantees the shape."""

DEFAULT_MAX_RECORD_BYTES = 1024 * 1024


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key)}]"


def _storable(text: str) -> bool:
    """Whether PostgreSQL can store ``text`` in ``jsonb``: no NUL character, and a UTF-8 form
    (no lone surrogate; looked for only in text that is not ASCII, which is cheap to tell)."""
    return "\x00" not in text and (text.isascii() or _has_utf8(text))


def _has_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unstorable(text: str) -> str:
    return "a NUL character (\\u0000)" if "\x00" in text else "a lone surrogate"


def _plain(value: Any) -> bool:
    """True when ``value`` is a plain JSON value (the common case, checked without paths)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:  # _storable, inlined: this runs for every string of every value
            if "\x00" in item or not (item.isascii() or _has_utf8(item)):
                return False
            continue
        if item is None or kind is bool or kind is int:
            continue
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict:
            for key in item:
                if type(key) is not str or "\x00" in key or not (key.isascii()
                                                                   or _has_utf8(key)):
                    return False
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        else:
            return False
    return True


def validate_json(value: Any, path: str = "$") -> None:
    """Raise :class:`InvalidRequest` (with ``path``) unless ``value`` is a plain JSON value."""
    if _plain(value):
        return
    _explain(value, path)
    raise InvalidRequest(f"{path} is not a plain JSON value", path=path)  # pragma: no cover


def _explain(value: Any, path: str) -> None:
    """Find what makes ``value`` not plain JSON and raise with its path."""
    # Exact type checks on purpose: bool is an int subclass and is fine, but an IntEnum or a
    # str subclass could serialise differently from what the caller sees.
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is str and not _storable(item):
            raise InvalidRequest(f"{where} holds {_unstorable(item)}, which cannot be stored",
                                 path=where)
        if item is None or kind in (str, bool, int):
            continue
        if kind is float:
            if not math.isfinite(item):
                raise InvalidRequest(f"{where} is {item!r}, which is not valid JSON", path=where)
            continue
        if kind is dict:
            for key, sub in item.items():
                if type(key) is not str:
                    raise InvalidRequest(
                        f"{where} has a key of type {type(key).__name__}; keys must be str",
                        path=where,
                    )
                if not _storable(key):
                    raise InvalidRequest(f"{where} has a key holding {_unstorable(key)}, which "
                                         "cannot be stored", path=where)
                stack.append((sub, _child(where, key)))
            continue
        if kind is list:
            for index, sub in enumerate(item):
                stack.append((sub, _child(where, index)))
            continue
        raise InvalidRequest(
            f"{where} is of type {kind.__name__}, which is not a JSON value", path=where
        )


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)  # what json.dumps would build on every call


def canonical_json(value: Any) -> str:
    """Return the canonical text of an already valid JSON value."""
    return _CANONICAL.encode(value)


def canonical_bytes(value: Any, *, path: str = "$", max_bytes: int | None = None) -> bytes:
    """Validate ``value`` and return its canonical UTF-8 bytes, enforcing ``max_bytes``."""
    validate_json(value, path)
    data = canonical_json(value).encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{path} is {len(data)} bytes serialised; the limit is {max_bytes}", path=path
        )
    return data


def digest(value: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of a valid JSON value."""
    return text_digest(canonical_json(value))


def text_digest(text: str) -> str:
    """:func:`digest` of a value whose canonical JSON text is already at hand."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def request_digest(
    workflow_name: str, workflow_version: str, input: Any, options: dict[str, Any]
) -> str:
    """The digest that decides whether two keyed submissions are the same request (C1)."""
    return digest(
        {"workflow": workflow_name, "version": workflow_version, "input": input,
         "options": options}
    )


def intent_digest(tool_name: str, tool_version: str, owner: dict[str, str], arguments: Any) -> str:
    """The digest of what an operation means to do (CONTRACT C5)."""
    return digest(
        {"tool": tool_name, "version": tool_version, "owner": owner, "arguments": arguments}
    )


def intent_digest_text(tool_name: str, tool_version: str, owner_text: str,
                       arguments_text: str) -> str:
    """:func:`intent_digest` from the canonical texts of the owner and the arguments (equal
    to it: the keys of a canonical object are sorted, its values are canonical texts)."""
    return text_digest(f'{{"arguments":{arguments_text},"owner":{owner_text},'
                       f'"tool":{_string(tool_name)},"version":{_string(tool_version)}}}')


@functools.lru_cache(maxsize=4096)
def _string(text: str) -> str:
    """The canonical JSON of a string (tool names and versions: few, and used on every call)."""
    return canonical_json(text)
