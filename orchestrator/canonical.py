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

Caps that keep a hostile value from hurting the process that reads it back (C2): containers
nest at most ``max_depth`` deep (default 64) and integers have at most ``max_int_digits``
decimal digits (default 100; never above Python's own 4,300-digit limit for parsing).

Numbers keep their type and value through the database. PostgreSQL's ``jsonb`` stores numbers
as decimals, so ``1e16`` would come back as the integer ``10000000000000000``; the canonical
form therefore writes every float positionally with a fractional part
(``10000000000000000.0``, ``0.00001``), which ``jsonb`` keeps as it is. It has no negative
zero: ``-0.0`` is written ``0.0``. :func:`as_stored` gives the value exactly as the database
will give it back (``-0.0`` as ``0.0``, object keys in ``jsonb``'s order), which is what
workflow code is handed live, so that a value is the same live and on every replay (C4).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

from orchestrator.errors import ConfigurationError, InvalidRequest, PayloadTooLarge

JSONValue = Any
"""A value that :func:`validate_json` accepts. Spelled ``Any`` because recursive aliases do not
help callers; validation is what guarantees the shape."""

DEFAULT_MAX_RECORD_BYTES = 1024 * 1024
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_INT_DIGITS = 100
MAX_DEPTH_LIMIT = 256
"""The highest ``max_depth`` a host may configure: deeper values would come close to the
recursion limit of the JSON decoder in the processes that read them back."""
MAX_INT_DIGITS_LIMIT = 4300
"""The highest ``max_int_digits`` a host may configure: Python's default limit for turning a
decimal string into an int (``sys.get_int_max_str_digits``)."""


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


def _int_bound(max_int_digits: int) -> int:
    return _BOUNDS.get(max_int_digits) or _BOUNDS.setdefault(max_int_digits,
                                                               10 ** max_int_digits)


_BOUNDS: dict[int, int] = {}


def _plain(value: Any, max_depth: int, bound: int) -> bool:
    """True when ``value`` is a plain JSON value within the caps (the common case, checked
    without paths): containers at most ``max_depth`` deep, integers below ``bound``."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is dict:
            if depth >= max_depth:
                return False
            for key in item:
                if type(key) is not str or "\x00" in key or not (key.isascii()
                                                                   or _has_utf8(key)):
                    return False
            children: Any = item.values()
        elif kind is list:
            if depth >= max_depth:
                return False
            children = item
        else:
            children = (item,)
            depth -= 1  # a scalar at the top: no container to count
        depth += 1
        for sub in children:
            sub_kind = type(sub)
            if sub_kind is str:  # _storable, inlined: this runs for every string
                if "\x00" in sub or not (sub.isascii() or _has_utf8(sub)):
                    return False
            elif sub_kind is int:
                if not -bound < sub < bound:
                    return False
            elif sub_kind is float:
                if not math.isfinite(sub):
                    return False
            elif sub_kind is dict or sub_kind is list:
                stack.append((sub, depth))
            elif sub is not None and sub_kind is not bool:
                return False
    return True


def validate_json(value: Any, path: str = "$", *, max_depth: int = DEFAULT_MAX_DEPTH,
                  max_int_digits: int = DEFAULT_MAX_INT_DIGITS) -> None:
    """Raise :class:`InvalidRequest` (with ``path``) unless ``value`` is a plain JSON value
    within the depth and integer caps."""
    if _plain(value, max_depth, _int_bound(max_int_digits)):
        return
    _explain(value, path, max_depth, max_int_digits)
    raise InvalidRequest(f"{path} is not a plain JSON value", path=path)  # pragma: no cover


def _explain(value: Any, path: str, max_depth: int, max_int_digits: int) -> None:
    """Find what makes ``value`` not plain JSON and raise with its path."""
    # Exact type checks on purpose: bool is an int subclass and is fine, but an IntEnum or a
    # str subclass could serialise differently from what the caller sees.
    bound = _int_bound(max_int_digits)
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        kind = type(item)
        if kind is str and not _storable(item):
            raise InvalidRequest(f"{where} holds {_unstorable(item)}, which cannot be stored",
                                 path=where)
        if kind is int and not -bound < item < bound:
            raise InvalidRequest(f"{where} is an integer of more than {max_int_digits} digits; "
                                 f"at most {max_int_digits} are allowed", path=where)
        if item is None or kind in (str, bool, int):
            continue
        if kind is float:
            if not math.isfinite(item):
                raise InvalidRequest(f"{where} is {item!r}, which is not valid JSON", path=where)
            continue
        if kind in (dict, list) and depth >= max_depth:
            raise InvalidRequest(f"{where} is nested more than {max_depth} levels deep; at "
                                 f"most {max_depth} are allowed", path=where)
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
                stack.append((sub, _child(where, key), depth + 1))
            continue
        if kind is list:
            for index, sub in enumerate(item):
                stack.append((sub, _child(where, index), depth + 1))
            continue
        raise InvalidRequest(
            f"{where} is of type {kind.__name__}, which is not a JSON value", path=where
        )


def one_shot(encoder: json.JSONEncoder) -> Callable[[Any], str]:
    """``encoder.encode`` without what it sets up on every call (a C encoder and a float
    formatter, a third of its time for a small value): the C encoder is made once. It has no
    check for circular references, which would need a fresh set of them per call: the
    values given to it are validated first, which bounds their depth, or are flat rows the
    engine builds; a cycle would end in ``RecursionError`` instead of ``ValueError``. Without
    the C accelerator (or with one that takes other arguments) it is ``encoder.encode``."""
    make: Any = getattr(json.encoder, "c_make_encoder", None)  # not in the type stubs
    if make is None or getattr(encoder, "indent", None) is not None:
        return encoder.encode
    try:
        made = make(
            None, encoder.default,
            encode_basestring_ascii if encoder.ensure_ascii else encode_basestring, None,
            encoder.key_separator, encoder.item_separator, encoder.sort_keys,
            encoder.skipkeys, encoder.allow_nan)
    except TypeError:  # a Python whose C encoder takes other arguments
        return encoder.encode
    join = "".join

    def encode(value: Any) -> str:
        return join(made(value, 0))

    return encode


_CANONICAL = one_shot(json.JSONEncoder(sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=False, allow_nan=False))

# What the fast encoder writes for a float that the database would not give back as the
# same float: an exponent (1e+16, 1.5e-07) or a negative zero. Text in strings may match too;
# the slower encoder then writes the same text the fast one would have.
_EXPONENT_OR_NEGATIVE_ZERO = re.compile(r"\de[+-]|-0\.0\b")


def canonical_json(value: Any) -> str:
    """Return the canonical text of an already valid JSON value."""
    text = _CANONICAL(value)
    if not ("e+" in text or "e-" in text or "-0.0" in text):  # cheaper than the pattern
        return text
    if _EXPONENT_OR_NEGATIVE_ZERO.search(text) is None:
        return text
    return "".join(_encode(value))


def _encode(value: Any) -> Any:
    """The canonical text of ``value`` in pieces, floats written positionally (see the
    module docstring). Used only for values that hold such floats; nested at most
    ``MAX_DEPTH_LIMIT`` deep, so recursion is safe."""
    kind = type(value)
    if kind is float:
        yield _float_text(value)
    elif kind is dict:
        yield "{"
        for index, key in enumerate(sorted(value)):
            yield ("," if index else "") + encode_basestring(key) + ":"
            yield from _encode(value[key])
        yield "}"
    elif kind is list:
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from _encode(item)
        yield "]"
    else:
        yield _CANONICAL(value)


def _float_text(value: float) -> str:
    """A finite float as a positional decimal with a fractional part: the shortest digits
    that give the same float back, which ``jsonb`` stores and returns unchanged."""
    if value == 0.0:
        return "0.0"  # jsonb has no negative zero
    text = repr(value)
    if "e" not in text:
        return text
    text = format(Decimal(text), "f")
    return text if "." in text else text + ".0"


def as_stored(value: Any) -> Any:
    """``value`` (valid JSON) exactly as the database gives it back: object keys in ``jsonb``'s
    order (shorter UTF-8 keys first, then bytewise), ``-0.0`` as ``0.0``. Workflow code is
    handed a tool's receipt in this form, so that it sees the same value live and on replay."""
    kind = type(value)
    if kind is dict:
        keys = list(value)
        if len(keys) < 2:
            order = keys
        elif "".join(keys).isascii():  # the common case, in C: by text, then (stably) length
            order = sorted(sorted(keys), key=len)
        else:
            order = sorted(keys, key=_jsonb_key_order)
        values = value.values()
        if _CONTAINERS.isdisjoint(map(type, values)) and 0.0 not in values:
            # Flat, and no zero that could be negative (0 and False compare equal to 0.0
            # too, and take the longer way): a copy only for the order.
            return value if order == keys else {key: value[key] for key in order}
        changed = order != keys
        stored = []
        for key in order:
            sub = value[key]
            if type(sub) in _CONTAINERS_AND_FLOATS:
                new = as_stored(sub)
                changed = changed or new is not sub
                sub = new
            stored.append((key, sub))
        return dict(stored) if changed else value  # unchanged: no copy (the common receipt)
    if kind is list:
        items = [as_stored(item) if type(item) in _CONTAINERS_AND_FLOATS else item
                 for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if kind is float and value == 0.0 and math.copysign(1.0, value) < 0:
        return 0.0
    return value


_CONTAINERS_AND_FLOATS = frozenset({dict, list, float})
_CONTAINERS = frozenset({dict, list})


def _jsonb_key_order(key: str) -> tuple[int, str]:
    # Code point order is UTF-8 byte order (lone surrogates are refused before this).
    return (len(key) if key.isascii() else len(key.encode("utf-8")), key)


def canonical_bytes(value: Any, *, path: str = "$", max_bytes: int | None = None,
                    max_depth: int = DEFAULT_MAX_DEPTH,
                    max_int_digits: int = DEFAULT_MAX_INT_DIGITS) -> bytes:
    """Validate ``value`` and return its canonical UTF-8 bytes, enforcing the caps."""
    validate_json(value, path, max_depth=max_depth, max_int_digits=max_int_digits)
    data = canonical_json(value).encode("utf-8")
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{path} is {len(data)} bytes serialised; the limit is {max_bytes}", path=path
        )
    return data


@dataclass(frozen=True)
class JsonLimits:
    """The caps every JSON value a caller or a tool hands the orchestrator is held to (C2)."""

    max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_int_digits: int = DEFAULT_MAX_INT_DIGITS

    def __post_init__(self) -> None:
        for name, value, top in (("max_record_bytes", self.max_bytes, None),
                                 ("max_json_depth", self.max_depth, MAX_DEPTH_LIMIT),
                                 ("max_int_digits", self.max_int_digits,
                                  MAX_INT_DIGITS_LIMIT)):
            if type(value) is not int or value < 1 or (top is not None and value > top):
                raise ConfigurationError(
                    f"{name} must be a positive integer, got {value!r}" if top is None else
                    f"{name} must be an integer from 1 to {top}, got {value!r}")

    def text(self, value: Any, path: str) -> str:
        """The canonical text of ``value``, or ``INVALID_REQUEST`` / ``PAYLOAD_TOO_LARGE``
        naming the path of what breaks a cap; nothing is written before this passes."""
        validate_json(value, path, max_depth=self.max_depth,
                      max_int_digits=self.max_int_digits)
        text = canonical_json(value)
        # Its UTF-8 size without encoding it (the common text is ASCII): a tool's arguments
        # and its receipt pass here on every step.
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"{path} is {size} bytes serialised; the limit is {self.max_bytes}", path=path)
        return text

    def check(self, value: Any, path: str) -> None:
        """Validate ``value`` against the caps (the size cap too) without keeping its text."""
        self.text(value, path)


DEFAULT_LIMITS = JsonLimits()


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
