"""Canonical JSON and digests (CONTRACT C1, C2): properties over generated JSON values."""

from __future__ import annotations

import decimal
import enum
import json
import math
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from orchestrator.canonical import (
    canonical_bytes,
    canonical_json,
    digest,
    intent_digest,
    intent_digest_text,
    request_digest,
    text_digest,
    validate_json,
)
from orchestrator.errors import InvalidRequest, PayloadTooLarge

Path = tuple[str | int, ...]

# Any text PostgreSQL's jsonb can store: everything but U+0000.
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"))
keys = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**100) + 1, max_value=10**100 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(keys, children, max_size=5),
    max_leaves=25,
)
containers = st.one_of(
    st.lists(json_values, min_size=1, max_size=5),
    st.dictionaries(keys, json_values, min_size=1, max_size=5),
)


def _paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every location inside ``value``, the value itself first."""
    found: list[Path] = [prefix]
    if isinstance(value, dict):
        for key, sub in value.items():
            found.extend(_paths(sub, (*prefix, key)))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            found.extend(_paths(sub, (*prefix, index)))
    return found


def _replace(value: Any, path: Path, new: Any) -> Any:
    """A copy of ``value`` with the node at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}
    return [(_replace(v, rest, new) if i == head else v) for i, v in enumerate(value)]


def _reorder_keys(value: Any, draw_order: Any) -> Any:
    """The same value with every object's keys inserted in a drawn order."""
    if isinstance(value, dict):
        keys = draw_order(list(value))
        return {k: _reorder_keys(value[k], draw_order) for k in keys}
    if isinstance(value, list):
        return [_reorder_keys(v, draw_order) for v in value]
    return value


def _spelled(path: Path) -> str:
    """The path as the error reports it: ``$.a[2].b``, with quoted keys when needed."""
    out = "$"
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            out += f"[{json.dumps(part)}]"
    return out


# --- equality: key order never matters ----------------------------------------------------


@given(value=json_values, data=st.data())
def test_key_order_does_not_change_the_digest(value: Any, data: st.DataObject) -> None:
    shuffled = _reorder_keys(value, lambda keys: data.draw(st.permutations(keys)))

    assert canonical_json(shuffled) == canonical_json(value)
    assert digest(shuffled) == digest(value)
    assert request_digest("wf", "1", shuffled, {"b": 1, "a": 2}) == request_digest(
        "wf", "1", value, {"a": 2, "b": 1}
    )


@given(value=json_values)
def test_canonical_form_round_trips_through_json(value: Any) -> None:
    text = canonical_json(value)

    assert json.loads(text) == value
    assert canonical_json(json.loads(text)) == text
    assert canonical_bytes(value) == text.encode("utf-8")


def _awkward(value: Any) -> bool:
    """Whether ``value`` holds a float that Python writes with an exponent, or -0.0."""
    if isinstance(value, dict):
        return any(_awkward(v) for v in value.values())
    if isinstance(value, list):
        return any(_awkward(v) for v in value)
    return type(value) is float and ("e" in repr(value) or repr(value) == "-0.0")


@given(value=json_values)
def test_canonical_form_has_sorted_keys_and_no_whitespace_between_tokens(value: Any) -> None:
    text = canonical_json(value)
    reference = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if not _awkward(value):
        assert text == reference
    else:  # the same but for those floats, written positionally (tested below)
        assert json.loads(text) == value and canonical_json(json.loads(text)) == text


def test_canonical_form_example() -> None:
    assert canonical_json({"b": [1, 2.5, None], "a": {"é": True}}) == (
        '{"a":{"é":true},"b":[1,2.5,null]}'
    )
    assert canonical_bytes({"é": 1}) == '{"é":1}'.encode()


# --- difference: any other change gives a different digest --------------------------------


@given(value=json_values, replacement=json_values, data=st.data())
def test_any_changed_value_changes_the_request_digest(
    value: Any, replacement: Any, data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(_paths(value)))
    changed = _replace(value, path, replacement)
    assume(canonical_json(changed) != canonical_json(value))

    assert request_digest("wf", "1", changed, {}) != request_digest("wf", "1", value, {})


@given(items=st.lists(json_values, min_size=2, max_size=6), data=st.data())
def test_array_order_changes_the_digest(items: list[Any], data: st.DataObject) -> None:
    permuted = data.draw(st.permutations(items))
    assume([canonical_json(x) for x in permuted] != [canonical_json(x) for x in items])

    assert digest({"items": permuted}) != digest({"items": items})


@given(value=containers, key=keys, data=st.data())
def test_an_added_or_removed_member_changes_the_digest(
    value: Any, key: str, data: st.DataObject
) -> None:
    if isinstance(value, dict):
        assume(key not in value)
        bigger: Any = {**value, key: None}
    else:
        bigger = [*value, None]
    assert digest(bigger) != digest(value)


@given(value=json_values)
def test_workflow_name_version_and_options_are_part_of_the_request(value: Any) -> None:
    base = request_digest("wf", "1", value, {"deadline": 10})
    assert request_digest("wf2", "1", value, {"deadline": 10}) != base
    assert request_digest("wf", "2", value, {"deadline": 10}) != base
    assert request_digest("wf", "1", value, {"deadline": 11}) != base
    assert request_digest("wf", "1", value, {}) != base


def test_intent_digest_covers_tool_owner_and_arguments() -> None:
    owner = {"tenant": "t", "principal": "p"}
    base = intent_digest("charge", "1", owner, {"amount": 5})
    assert intent_digest("charge", "1", dict(reversed(owner.items())), {"amount": 5}) == base
    assert intent_digest("refund", "1", owner, {"amount": 5}) != base
    assert intent_digest("charge", "2", owner, {"amount": 5}) != base
    assert intent_digest("charge", "1", {"tenant": "t", "principal": "q"}, {"amount": 5}) != base
    assert intent_digest("charge", "1", owner, {"amount": 6}) != base


@given(json_values, st.text(), st.text(), st.text(), st.text())
def test_digests_from_canonical_texts_equal_the_digests_of_the_values(
        arguments: Any, tool: str, version: str, tenant: str, principal: str) -> None:
    # The worker's hot path digests texts it already has; the ledger must not tell the two
    # apart (a replay compares intents computed either way).
    owner = {"tenant": tenant, "principal": principal}
    assert text_digest(canonical_json(arguments)) == digest(arguments)
    assert intent_digest_text(tool, version, canonical_json(owner),
                              canonical_json(arguments)) == intent_digest(tool, version, owner,
                                                                          arguments)


def test_digest_is_sha256_hex() -> None:
    value = digest({"a": 1})
    assert len(value) == 64
    assert int(value, 16) >= 0


# --- rejection: anything that is not plain JSON, with the path named ----------------------


class _Custom:
    def __json__(self) -> str:  # a custom serialisation hook must not be honoured
        return "{}"


class _Colour(enum.IntEnum):
    RED = 1


class _Str(str):
    pass


NOT_JSON: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    b"bytes",
    bytearray(b"x"),
    {1, 2},
    frozenset(),
    (1, 2),
    _Custom(),
    object(),
    decimal.Decimal("1.5"),
    _Colour.RED,
    _Str("s"),
    1 + 2j,
]


@pytest.mark.parametrize("bad", NOT_JSON, ids=lambda v: type(v).__name__)
def test_non_json_values_are_rejected_at_the_top(bad: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_json(bad)
    assert caught.value.code == "INVALID_REQUEST"
    assert caught.value.path == "$"


def test_the_path_names_the_offending_location() -> None:
    value = {"a": [0, 1, {"b": math.nan}]}
    with pytest.raises(InvalidRequest) as caught:
        validate_json(value)
    assert caught.value.path == "$.a[2].b"
    assert "$.a[2].b" in caught.value.message


def test_keys_that_are_not_identifiers_are_quoted_in_the_path() -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_json({"order items": [{"unit price": b"1"}]})
    assert caught.value.path == '$["order items"][0]["unit price"]'


@pytest.mark.parametrize("key", [1, 1.5, None, True, (1, 2), b"k"], ids=repr)
def test_non_string_keys_are_rejected_at_their_object(key: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        validate_json({"outer": {"ok": 1, key: "v"}})
    assert caught.value.path == "$.outer"


@given(value=containers, bad=st.sampled_from(NOT_JSON), data=st.data())
def test_a_non_json_value_anywhere_is_found_and_located(
    value: Any, bad: Any, data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(_paths(value)[1:]))

    with pytest.raises(InvalidRequest) as caught:
        canonical_bytes(_replace(value, path, bad))

    assert caught.value.path == _spelled(path)
    assert caught.value.code == "INVALID_REQUEST"


@given(value=json_values)
def test_valid_values_are_accepted(value: Any) -> None:
    validate_json(value)


def test_a_custom_root_path_is_used_in_errors() -> None:
    with pytest.raises(InvalidRequest) as caught:
        canonical_bytes({"x": math.inf}, path="input")
    assert caught.value.path == "input.x"


# --- size caps ----------------------------------------------------------------------------


@given(value=json_values)
def test_the_size_cap_is_inclusive(value: Any) -> None:
    size = len(canonical_bytes(value))

    assert len(canonical_bytes(value, max_bytes=size)) == size
    with pytest.raises(PayloadTooLarge) as caught:
        canonical_bytes(value, max_bytes=size - 1)
    assert caught.value.code == "PAYLOAD_TOO_LARGE"
    assert isinstance(caught.value, InvalidRequest)
    assert caught.value.path == "$"


@given(value=json_values)
def test_limits_text_is_the_canonical_text_under_the_same_size_cap(value: Any) -> None:
    from orchestrator.canonical import JsonLimits

    data = canonical_bytes(value)
    assert JsonLimits(max_bytes=len(data)).text(value, "$") == data.decode()
    with pytest.raises(PayloadTooLarge) as caught:
        JsonLimits(max_bytes=len(data) - 1 or 1).text(["x" * len(data), value], "$")
    assert str(len(canonical_bytes(["x" * len(data), value]))) in caught.value.message


def test_the_size_cap_counts_utf8_bytes_not_characters() -> None:
    value = "é" * 10  # 10 characters, 20 bytes, plus two quotes
    assert len(canonical_bytes(value, max_bytes=22)) == 22
    with pytest.raises(PayloadTooLarge):
        canonical_bytes(value, max_bytes=21)
    from orchestrator.canonical import JsonLimits

    assert JsonLimits(max_bytes=22).text(value, "$") == '"' + value + '"'
    with pytest.raises(PayloadTooLarge, match="22 bytes"):
        JsonLimits(max_bytes=21).text(value, "$")


def test_a_record_over_the_default_cap_names_its_size() -> None:
    from orchestrator.canonical import DEFAULT_MAX_RECORD_BYTES

    big = {"blob": "x" * DEFAULT_MAX_RECORD_BYTES}
    with pytest.raises(PayloadTooLarge) as caught:
        canonical_bytes(big, path="input", max_bytes=DEFAULT_MAX_RECORD_BYTES)
    assert caught.value.path == "input"
    assert str(DEFAULT_MAX_RECORD_BYTES) in caught.value.message


@pytest.mark.parametrize("value, path", [
    ("a\x00b", "$"),
    ({"note": ["ok", "nul \x00 inside"]}, "$.note[1]"),
    ({"outer": {"k\x00": 1}}, "$.outer"),
    ({"a": [1, "lone \ud800 surrogate"]}, "$.a[1]"),
    ({"b": {"\udfff": 1}}, "$.b"),
])
def test_text_that_cannot_be_stored_is_refused_where_it_is(value: Any, path: str) -> None:
    """PostgreSQL's jsonb cannot store U+0000, and UTF-8 has no lone surrogates: refused here
    with its path, never an encoding or database error half-way through a write."""
    with pytest.raises(InvalidRequest) as caught:
        canonical_bytes(value)
    assert caught.value.path == path
    assert "cannot be stored" in caught.value.message


# --- caps and numbers that survive the database (C2, C4) -------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


def test_nesting_is_capped_with_the_path_of_the_first_container_too_deep() -> None:
    validate_json(_nested(64))
    with pytest.raises(InvalidRequest) as caught:
        validate_json(_nested(65), "$.input")
    assert caught.value.code == "INVALID_REQUEST"
    assert caught.value.path is not None and caught.value.path.startswith("$.input")
    assert "64 levels" in caught.value.message
    validate_json(_nested(10), max_depth=10)
    with pytest.raises(InvalidRequest):
        validate_json(_nested(11), max_depth=10)


def test_a_value_deeper_than_the_decoder_could_read_back_is_refused_without_recursion() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidRequest, match="nested more than 64"):
        canonical_bytes({"x": deep}, path="$.input")


def test_integers_are_capped_by_their_digits() -> None:
    validate_json({"n": 10**100 - 1, "m": -(10**100) + 1})
    for huge in (10**100, -(10**100), 10**10_000):
        with pytest.raises(InvalidRequest) as caught:
            validate_json({"n": [huge]}, "$.receipt")
        assert caught.value.path == "$.receipt.n[0]"
    validate_json(10**500, max_int_digits=501)


def test_limits_are_configured_within_what_a_reader_can_decode() -> None:
    from orchestrator.canonical import JsonLimits
    from orchestrator.errors import ConfigurationError

    for bad in ({"max_depth": 0}, {"max_depth": 257}, {"max_int_digits": 4301},
                {"max_bytes": 0}, {"max_depth": 1.5}):
        with pytest.raises(ConfigurationError):
            JsonLimits(**bad)
    limits = JsonLimits(max_bytes=100, max_depth=3, max_int_digits=5)
    with pytest.raises(PayloadTooLarge):
        limits.text("x" * 200, "$.input")
    with pytest.raises(InvalidRequest, match="3 levels"):
        limits.text(_nested(4), "$.input")
    assert limits.text({"a": 99999}, "$") == '{"a":99999}'


@pytest.mark.parametrize(("value", "text"), [
    (1e16, "10000000000000000.0"),
    (1.5e300, "15" + "0" * 299 + ".0"),
    (1e-05, "0.00001"),
    (-1.5e-07, "-0.00000015"),
    (5e-324, "0." + "0" * 323 + "5"),
    (-0.0, "0.0"),
    (0.0, "0.0"),
    (123.45, "123.45"),
    (1e15, "1000000000000000.0"),
])
def test_floats_are_written_positionally_so_the_database_keeps_them_floats(
        value: float, text: str) -> None:
    assert canonical_json(value) == text
    assert canonical_json({"f": [value]}) == '{"f":[' + text + "]}"
    again = json.loads(text)
    assert type(again) is float and again == value


@given(value=st.floats(allow_nan=False, allow_infinity=False))
def test_every_float_comes_back_as_the_same_float(value: float) -> None:
    again = json.loads(canonical_json(value))
    assert type(again) is float
    assert again == value and (value != 0.0 or math.copysign(1, again) == 1)
    assert "e" not in canonical_json(value).lower()


@given(value=json_values)
def test_the_pattern_check_never_changes_the_text_of_strings(value: Any) -> None:
    # Strings that look like exponents send a value down the slower encoder: same text.
    tricky = {"s": "1e+16 -0.0 2e-5", "v": value}
    assert json.loads(canonical_json(tricky))["s"] == "1e+16 -0.0 2e-5"
    if not _awkward(value):
        assert canonical_json(tricky) == json.dumps(
            tricky, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_as_stored_orders_keys_as_jsonb_does_and_drops_negative_zero() -> None:
    from orchestrator.canonical import as_stored

    stored = as_stored({"bb": 1, "a": [{"zz": -0.0, "y": 2}], "ab": 3, "é": 4, "z": 5})
    assert list(stored) == ["a", "z", "ab", "bb", "é"]
    assert list(stored["a"][0]) == ["y", "zz"]
    assert math.copysign(1, stored["a"][0]["zz"]) == 1
    assert as_stored(7) == 7 and as_stored("x") == "x" and as_stored(None) is None


@given(value=json_values)
def test_as_stored_copies_only_what_it_changes(value: Any) -> None:
    from orchestrator.canonical import as_stored

    stored = as_stored(value)
    assert stored == value and canonical_json(stored) == canonical_json(value)
    assert as_stored(stored) is stored  # what is already as stored comes back as it is
    assert json.dumps(stored, ensure_ascii=False) == json.dumps(_jsonb_ordered(value),
                                                                ensure_ascii=False)


def _jsonb_ordered(value: Any) -> Any:
    """The order PostgreSQL's jsonb keeps object keys in, and its zero without a sign."""
    if isinstance(value, dict):
        return {k: _jsonb_ordered(value[k])
                for k in sorted(value, key=lambda k: (len(k.encode("utf-8")), k.encode()))}
    if isinstance(value, list):
        return [_jsonb_ordered(v) for v in value]
    return 0.0 if type(value) is float and value == 0.0 else value


# --- the encoder made once ------------------------------------------------------------------


@given(value=json_values)
def test_one_shot_writes_what_the_encoder_writes(value: Any) -> None:
    from orchestrator.canonical import one_shot

    for encoder in (json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                     allow_nan=False),
                    json.JSONEncoder(separators=(",", ":"))):
        encode = one_shot(encoder)
        assert encode(value) == encoder.encode(value)
        assert encode(value) == encode(value)  # nothing kept from one call to the next


def test_one_shot_refuses_what_the_encoder_refuses_and_goes_on() -> None:
    from orchestrator.canonical import one_shot

    encode = one_shot(json.JSONEncoder(allow_nan=False))
    for bad, error in ((float("nan"), ValueError), ({"a": {1, 2}}, TypeError)):
        with pytest.raises(error):
            encode({"x": [1, bad]})
        assert encode({"x": [1, 2]}) == '{"x": [1, 2]}'


def test_one_shot_falls_back_to_the_encoder_without_a_usable_c_encoder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import json.encoder

    from orchestrator.canonical import one_shot

    def other_arguments(*args: Any) -> None:
        raise TypeError("make_encoder() takes other arguments")

    encoder = json.JSONEncoder(sort_keys=True)
    for stand_in in (None, other_arguments):
        with monkeypatch.context() as patched:
            patched.setattr(json.encoder, "c_make_encoder", stand_in)
            encode = one_shot(encoder)
        assert encode == encoder.encode  # (which reads the module's C encoder when called)
        assert encode({"b": 1, "a": [1.5]}) == '{"a": [1.5], "b": 1}'
