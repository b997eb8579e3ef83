"""``orchestrator db …`` run as real processes against real databases."""

from __future__ import annotations

import psycopg
import pytest

from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.schema import SCHEMA
from tests.clitools import run_cli, start_cli

FUTURE_REVISION = "ffff9999"


def _version(url: str) -> str | None:
    return migrate.current_revision(DatabaseTarget(validate_url(url), "argument"))


def _stamp(url: str, revision: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(f"UPDATE {SCHEMA}.{migrate.VERSION_TABLE} SET version_num = %s", (revision,))


def test_upgrade_then_check_on_a_new_database(empty_database_url: str) -> None:
    upgraded = run_cli(["db", "upgrade"], database_url=empty_database_url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert migrate.head_revision() in upgraded.stdout

    checked = run_cli(["db", "check"], database_url=empty_database_url)
    assert checked.returncode == 0, checked.stderr
    assert "current" in checked.stdout
    assert _version(empty_database_url) == migrate.head_revision()


def test_python_dash_m_runs_the_same_command(empty_database_url: str) -> None:
    result = run_cli(["db", "upgrade"], database_url=empty_database_url, module=True)
    assert result.returncode == 0, result.stderr
    assert _version(empty_database_url) == migrate.head_revision()


def test_database_url_option_overrides_the_environment(empty_database_url: str) -> None:
    unreachable = "postgresql://nobody@127.0.0.1:1/nothing"
    result = run_cli(
        ["--database-url", empty_database_url, "db", "upgrade"], database_url=unreachable
    )
    assert result.returncode == 0, result.stderr
    assert _version(empty_database_url) == migrate.head_revision()


def test_check_fails_on_an_empty_database(empty_database_url: str) -> None:
    result = run_cli(["db", "check"], database_url=empty_database_url)

    assert result.returncode == 1
    assert "no orchestrator schema" in result.stderr
    assert "orchestrator db upgrade" in result.stderr
    assert "Traceback" not in result.stderr
    assert _version(empty_database_url) is None


def test_the_api_and_the_cli_on_a_database_without_the_schema_say_to_upgrade(
    empty_database_url: str,
) -> None:
    """A database nobody upgraded yet: a submit raises SCHEMA_MISMATCH naming the command to
    run (not the driver's UndefinedTable), and so does a CLI command that reads runs."""
    from orchestrator import DatabaseError, Orchestrator, Owner

    app = Orchestrator(empty_database_url, default_owner=Owner(tenant="t", principal="p"))

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return data

    try:
        with pytest.raises(DatabaseError) as caught:
            app.submit(wf, {})
    finally:
        app.close()
    assert caught.value.code == "SCHEMA_MISMATCH"
    assert "orchestrator db upgrade" in str(caught.value)
    assert not caught.value.retryable

    listed = run_cli(["runs", "list"], database_url=empty_database_url)
    assert listed.returncode == 2
    assert listed.stderr_lines[0].startswith("orchestrator: error: SCHEMA_MISMATCH:"), listed.stderr
    assert "orchestrator db upgrade" in listed.stderr
    assert "Traceback" not in listed.stderr
    assert _version(empty_database_url) is None


@pytest.mark.parametrize("command", ["worker", "reconciler"])
def test_a_worker_on_a_database_without_the_schema_says_what_the_api_says(
    empty_database_url: str, command: str,
) -> None:
    """One code, one sentence and one next step for a database nobody upgraded, whoever meets
    it first: SCHEMA_MISMATCH, not CONFIGURATION_ERROR from a worker."""
    from orchestrator import DatabaseError, Orchestrator, Owner

    app = Orchestrator(empty_database_url, default_owner=Owner(tenant="t", principal="p"))
    try:
        with pytest.raises(DatabaseError) as api:
            app.list_runs()
    finally:
        app.close()

    started = run_cli([command, "--app", "tests.acceptance.flows:app"],
                      database_url=empty_database_url)
    assert started.returncode == 2
    assert started.stderr_lines[-1] == f"orchestrator: error: {api.value}", started.stderr
    assert str(api.value).startswith("SCHEMA_MISMATCH: the database at postgresql://")
    assert str(api.value).endswith("has no orchestrator schema; run `orchestrator db upgrade`")
    assert _version(empty_database_url) is None


def test_check_and_upgrade_refuse_a_database_from_a_newer_release(
    migrated_database_url: str,
) -> None:
    _stamp(migrated_database_url, FUTURE_REVISION)

    checked = run_cli(["db", "check"], database_url=migrated_database_url)
    assert checked.returncode == 1
    assert FUTURE_REVISION in checked.stderr
    assert "newer release" in checked.stderr

    upgraded = run_cli(["db", "upgrade"], database_url=migrated_database_url)
    assert upgraded.returncode == 2
    assert len(upgraded.stderr_lines) == 1, upgraded.stderr
    assert upgraded.stderr_lines[0].startswith("orchestrator: error: SCHEMA_MISMATCH:")
    assert FUTURE_REVISION in upgraded.stderr
    assert "Traceback" not in upgraded.stderr
    assert _version(migrated_database_url) == FUTURE_REVISION


def test_four_concurrent_upgrades_all_succeed(empty_database_url: str) -> None:
    processes = [start_cli(["db", "upgrade"], database_url=empty_database_url) for _ in range(4)]
    outcomes = [(proc.wait(timeout=90), *proc.communicate()) for proc in processes]

    for returncode, _stdout, stderr in outcomes:
        assert returncode == 0, stderr
    assert _version(empty_database_url) == migrate.head_revision()
    assert run_cli(["db", "check"], database_url=empty_database_url).returncode == 0


def test_url_prints_the_masked_url_and_its_source() -> None:
    url = "postgresql://app:s3cret@db.example:5432/orders"

    from_env = run_cli(["db", "url"], database_url=url)
    assert from_env.returncode == 0, from_env.stderr
    assert from_env.stdout.strip() == (
        "postgresql://app@db.example:5432/orders (from ORCHESTRATOR_DATABASE_URL)"
    )

    from_option = run_cli(["--database-url", url, "db", "url"])
    assert from_option.returncode == 0, from_option.stderr
    assert from_option.stdout.strip() == (
        "postgresql://app@db.example:5432/orders (from --database-url)"
    )
    assert "s3cret" not in from_env.stdout + from_option.stdout


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "postgresql://nobody@127.0.0.1:1/nothing",
            "DATABASE_UNAVAILABLE: cannot connect to postgresql://nobody@127.0.0.1:1/nothing: "
            "connection refused",
            id="unreachable",
        ),
        pytest.param(
            # A non-routable address: either nothing answers (the connect timeout ends it)
            # or the network is unreachable; both must end quickly with the same kind of line.
            "postgresql://nobody@10.255.255.1:5432/nothing",
            "DATABASE_UNAVAILABLE: cannot connect to postgresql://nobody@10.255.255.1:5432/",
            id="no-answer",
        ),
        pytest.param(
            "mysql://app:s3cret@db/orders",
            "CONFIGURATION_ERROR: the database URL has scheme 'mysql'; use postgresql://",
            id="wrong-scheme",
        ),
        pytest.param(
            "postgresql://u@h:notaport/db",
            "CONFIGURATION_ERROR: the database URL is malformed",
            id="malformed-port",
        ),
        pytest.param(
            "db.example:5432/orders",
            "CONFIGURATION_ERROR: the database URL is malformed",
            id="malformed-no-scheme",
        ),
        pytest.param(
            "postgresql://app:s3cret@db.example:5432",
            "CONFIGURATION_ERROR: the database URL names no database",
            id="no-database",
        ),
        pytest.param(
            "postgresql://app:p%zz@127.0.0.1:1/db",
            "CONFIGURATION_ERROR: the database URL is not accepted by libpq",
            id="bad-percent-encoding",
        ),
    ],
)
@pytest.mark.parametrize("command", ["upgrade", "check"])
def test_bad_configuration_fails_fast_with_one_line(url: str, expected: str, command: str) -> None:
    result = run_cli(["db", command], database_url=url, timeout=20)

    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr_lines) == 1, result.stderr
    assert result.stderr_lines[0].startswith(f"orchestrator: error: {expected}")
    assert "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr
    assert "p%zz" not in result.stderr


def test_commands_on_a_database_behind_the_code_say_it_is_behind(
    empty_database_url: str,
) -> None:
    """A database upgraded by an older release (the code was deployed first): `db grant`
    refuses before granting anything, and a command that meets a table or a column the old
    schema lacks says SCHEMA_MISMATCH and that the schema is behind, never "has no orchestrator
    schema" nor an INTERNAL error."""
    from psycopg.rows import dict_row

    from tests.roles import create_role, drop_role

    migrate.upgrade(DatabaseTarget(validate_url(empty_database_url), "argument"), "0015")
    admin = psycopg.connect(empty_database_url, autocommit=True, row_factory=dict_row)
    role = create_role(admin, empty_database_url, "rt")
    try:
        granted = run_cli(["db", "grant", "--role", role.name], database_url=empty_database_url)
        assert granted.returncode == 2, granted.stdout
        assert len(granted.stderr_lines) == 1, granted.stderr
        assert granted.stderr_lines[0].startswith("orchestrator: error: SCHEMA_MISMATCH: ")
        assert "is at 0015, behind the code" in granted.stderr
        assert "orchestrator db upgrade" in granted.stderr
        assert role.sql("SELECT has_schema_privilege(%s, 'orchestrator', 'USAGE') AS usage",
                        (role.name,)) == [
            {"usage": False}]  # nothing was granted

        for command in (["workers", "list"], ["schedules", "list"]):
            shown = run_cli(command, database_url=empty_database_url)
            assert shown.returncode == 2, (command, shown.stderr)
            assert shown.stderr_lines[0].startswith(
                "orchestrator: error: SCHEMA_MISMATCH: "), (command, shown.stderr)
            assert "is at 0015, behind the code" in shown.stderr, (command, shown.stderr)
            assert "orchestrator db upgrade" in shown.stderr
    finally:
        drop_role(role)
        admin.close()
    assert _version(empty_database_url) == "0015"


def test_the_api_on_a_database_behind_the_code_says_it_is_behind(
    empty_database_url: str,
) -> None:
    """A database at a revision that lacks a table the code reads: the Python API says the
    schema is behind and names its revision, not that there is no orchestrator schema."""
    from orchestrator import DatabaseError, Orchestrator, Owner

    migrate.upgrade(DatabaseTarget(validate_url(empty_database_url), "argument"), "0011")
    app = Orchestrator(empty_database_url, default_owner=Owner(tenant="t", principal="p"))
    try:
        with pytest.raises(DatabaseError) as caught:
            app.queues.list()  # orchestrator.queues came with 0012
    finally:
        app.close()
    assert caught.value.code == "SCHEMA_MISMATCH" and not caught.value.retryable
    assert "is at 0011, behind the code" in str(caught.value)
    assert "orchestrator db upgrade" in str(caught.value)
    assert "no orchestrator schema" not in str(caught.value)
    assert _version(empty_database_url) == "0011"
