"""What ``db check`` says for each schema state, without a database."""

from __future__ import annotations

import pytest

from orchestrator.db.migrate import SchemaStatus, head_revision, known_revisions


def test_the_head_is_a_known_revision() -> None:
    assert head_revision() in known_revisions()


@pytest.mark.parametrize(
    ("current", "state", "ok", "fragments"),
    [
        ("0009", "current", True, ["current", "0009"]),
        (None, "empty", False, ["no orchestrator schema", "orchestrator db upgrade"]),
        ("0003", "behind", False, ["0003", "behind", "0009", "orchestrator db upgrade"]),
        ("ffff9999", "ahead", False, ["ffff9999", "newer release", "upgrade the code"]),
    ],
)
def test_each_state_has_a_one_line_explanation(
    current: str | None, state: str, ok: bool, fragments: list[str]
) -> None:
    status = SchemaStatus(current=current, head="0009", state=state)

    assert status.ok is ok
    text = status.describe()
    assert "\n" not in text
    for fragment in fragments:
        assert fragment in text


def test_a_stamp_is_compared_with_the_code_as_db_check_does() -> None:
    """``status_of``: what ``db check``, a worker's start and a statement that met a missing
    table, column or function (the storage layer) each say of a database's stamp."""
    from orchestrator.db.revisions import status_of

    head = head_revision()
    older = sorted(known_revisions() - {head})[0]
    assert [status_of(stamp).state for stamp in (head, None, older, "ffff9999")] == [
        "current", "empty", "behind", "ahead"]
    assert status_of(older).describe().startswith(f"the database schema is at {older}, behind")
