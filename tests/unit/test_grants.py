"""The runtime role's grants as data and as statements (docs/security.md), without a database."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.db import grants
from orchestrator.db.schema import SCHEMA, VIEWS, metadata
from orchestrator.errors import InvalidRequest


def _tables(grant_list: tuple[grants.Grant, ...]) -> dict[str, set[str]]:
    held: dict[str, set[str]] = {}
    for grant in grant_list:
        if grant.kind == "table":
            held.setdefault(grant.name, set()).update(grant.privileges)
    return held


def test_every_table_of_the_schema_has_its_grant():
    """A new table is a decision about who may change it: listed, or this fails."""
    tables = {f"{SCHEMA}.{table.name}" for table in metadata.tables.values()} | {
        f"{SCHEMA}.{view}" for view in VIEWS}
    granted = set(_tables(grants.RUNTIME)) - {f"{SCHEMA}.alembic_version"}
    assert granted == tables
    assert set(_tables(grants.REQUIRED)) - {"pg_catalog.pg_locks"} == granted | {
        f"{SCHEMA}.alembic_version"}


@pytest.mark.parametrize("details", [True, False])
def test_the_runtime_role_may_not_rewrite_the_journal_or_the_audit(details):
    held = _tables(grants.runtime_grants(incident_details=details))
    for table in grants.APPEND_ONLY:
        assert held[table] == {"SELECT", "INSERT"}
    # DELETE only where nothing is evidence: dead workers are forgotten, schedules deleted
    # (their runs, which are, stay), a rate-limited tool's dispatches leave its window (the
    # operations, which are, stay).
    assert all("DELETE" not in privileges for table, privileges in held.items()
               if table not in (f"{SCHEMA}.workers", f"{SCHEMA}.schedules",
                                f"{SCHEMA}.tool_dispatches"))
    assert all("TRUNCATE" not in privileges for privileges in held.values())


def test_without_incident_details_the_detail_column_is_not_readable():
    restricted = grants.runtime_grants(incident_details=False)
    incidents = [g for g in restricted if g.name == f"{SCHEMA}.incidents"]
    assert [(g.privileges, g.columns) for g in incidents] == [
        (("INSERT",), ()), (("SELECT",), grants.INCIDENT_SUMMARY)]
    assert "detail" not in grants.INCIDENT_SUMMARY and "ref" in grants.INCIDENT_SUMMARY


def test_the_statements_revoke_first_and_quote_the_role():
    script = grants.render(grants.grant_statements('we"ird Role'))
    lines = script.splitlines()
    who = '"we""ird Role"'
    assert lines[0] == f'REVOKE ALL ON SCHEMA "orchestrator" FROM {who};'
    assert lines[1] == f'GRANT USAGE ON SCHEMA "orchestrator" TO {who};'
    journal = lines.index(f'REVOKE ALL ON TABLE "orchestrator"."journal_entries" FROM {who};')
    assert lines[journal + 1] == (
        f'GRANT SELECT, INSERT ON TABLE "orchestrator"."journal_entries" TO {who};')
    view = lines.index(f'REVOKE ALL ON TABLE "orchestrator"."journal" FROM {who};')
    assert lines[view + 1] == f'GRANT SELECT ON TABLE "orchestrator"."journal" TO {who};'
    assert f"GRANT EXECUTE ON FUNCTION orchestrator.batch_rows(jsonb) TO {who};" in lines
    assert all(line.endswith(f"{who};") for line in lines)


@pytest.mark.parametrize("name", ["", " runtime", "run\ntime", "r\u200bt", "x" * 64, "é" * 32])
def test_a_role_name_that_cannot_be_granted_to_as_given_is_refused(name):
    with pytest.raises(InvalidRequest):
        grants.check_role_name(name)


def test_db_grant_print_connects_to_nothing(capsys, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert main(["db", "grant", "--role", "app_runtime", "--print"]) == 0
    out = capsys.readouterr().out
    assert out == grants.render(grants.grant_statements("app_runtime"))
    assert 'GRANT SELECT, INSERT ON TABLE "orchestrator"."operator_audit" TO "app_runtime";' in out
    assert main(["db", "grant", "--role", "r", "--print", "--no-incident-details"]) == 0
    out = capsys.readouterr().out
    assert 'GRANT INSERT ON TABLE "orchestrator"."incidents" TO "r";' in out
    assert '"upstream_status") ON TABLE "orchestrator"."incidents" TO "r";' in out
    assert main(["db", "grant", "--role", "bad\nname", "--print"]) == 2
    assert "INVALID_REQUEST" in capsys.readouterr().err


def test_the_documented_grants_are_the_code_s():
    """docs/security.md lists the runtime role's grants as SQL: the same objects with the
    same privileges as ``grants.RUNTIME``, so the page cannot drift from what `db grant`
    does."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    block = page.split("(the list itself is\n`orchestrator.db.grants.RUNTIME`):", 1)[1]
    block = block.split("```sql", 1)[1].split("```", 1)[0]
    documented: dict[tuple[str, str], set[str]] = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        match = re.fullmatch(r"GRANT (.+?) ON (SCHEMA|FUNCTION)?\s*(\S.*?)\s+TO "
                             r"orchestrator_runtime;", line.strip())
        assert match, line
        privileges, kind, name = match.groups()
        kind = (kind or "table").lower()
        documented.setdefault((kind, name), set()).update(
            p.strip() for p in privileges.split(","))
    coded: dict[tuple[str, str], set[str]] = {}
    for grant in grants.RUNTIME:
        coded.setdefault((grant.kind, grant.name), set()).update(grant.privileges)
    assert documented == coded
