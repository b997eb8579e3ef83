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
