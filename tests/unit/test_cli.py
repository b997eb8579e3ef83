"""The command line's shape and its error handling, in process and without a database."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import psycopg
import pytest

from orchestrator import cli
from orchestrator.cli import db as db_group
from orchestrator.db.probe import connection_failure_reason
from orchestrator.errors import DatabaseError
from tests.clitools import cli_env, command


def test_every_group_registers_commands_with_a_func() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["db", "check"])
    assert args.func is db_group.cmd_check
    assert args.database_url is None
    assert parser.parse_args(["--database-url", "postgresql://h/d", "db", "url"]).database_url


@pytest.mark.parametrize("argv", [[], ["db"]])
def test_a_missing_command_prints_help_and_exits_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_an_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["nonsense"])
    assert caught.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_configuration_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--database-url", "mysql://db/x", "db", "check"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "orchestrator: error: CONFIGURATION_ERROR: the database URL has scheme 'mysql'; "
        "use postgresql://\n"
    )


def test_multi_line_messages_are_folded_into_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise DatabaseError("first\nsecond")

    monkeypatch.setattr(db_group, "cmd_url", broken)
    assert cli.main(["db", "url"]) == 2
    assert capsys.readouterr().err == "orchestrator: error: DATABASE_UNAVAILABLE: first second\n"


def test_unexpected_errors_print_one_line_without_their_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise RuntimeError("password=s3cret leaked by a driver")

    monkeypatch.delenv(cli.ENV_DEBUG, raising=False)
    monkeypatch.setattr(db_group, "cmd_url", broken)
    assert cli.main(["db", "url"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "RuntimeError" in err
    assert "s3cret" not in err


def test_debug_mode_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise RuntimeError("boom")

    monkeypatch.setenv(cli.ENV_DEBUG, "1")
    monkeypatch.setattr(db_group, "cmd_url", broken)
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["db", "url"])


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            'connection failed: connection to server at "127.0.0.1", port 1 failed: '
            "Connection refused\n\tIs the server running on that host?",
            "connection refused",
        ),
        ("connection failed: timeout expired", "no answer from the server"),
        ("failed to resolve host 'db.invalid': [Errno -2] Name or service not known",
         "the host name cannot be resolved"),
        ('FATAL:  password authentication failed for user "app"', "authentication failed"),
        ('FATAL:  role "nobody" does not exist', "the user (role) does not exist"),
        ('FATAL:  database "nothing" does not exist', "the database does not exist"),
        ('connection to server on socket "/x/.s.PGSQL.5432" failed: No such file or directory',
         "no server is listening on that Unix socket"),
        ('connection to server at "10.0.0.1", port 5432 failed: received invalid response '
         "to SSL negotiation: H", "what answered there is not a PostgreSQL server"),
        ("something nobody expected, password=s3cret", "the connection failed (OperationalError)"),
        ('connection to server at "127.0.0.1", port 6432 failed: FATAL:  no such database: '
         "orders", "the pooler has no such database"),
    ],
)
def test_connection_failures_get_a_controlled_reason(text: str, reason: str) -> None:
    described = connection_failure_reason(psycopg.OperationalError(text))
    assert described.startswith(reason)
    assert "s3cret" not in described
    assert "\n" not in described


def test_a_missing_database_says_how_to_create_it() -> None:
    described = connection_failure_reason(
        psycopg.OperationalError('FATAL:  database "nothing" does not exist'))
    assert "createdb" in described and "orchestrator db upgrade" in described


def test_url_names_the_embedded_server_when_nothing_is_configured_without_starting_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``db url`` says which database would be used: with no URL configured, the embedded
    server, its data directory and whether it runs, at once. Starting one (an initdb on
    first use) to print a name would be slow and leave a server running."""
    from orchestrator.db import config

    def started(*args: object, **kwargs: object) -> str:
        raise AssertionError("db url started the embedded server")

    data_dir = tmp_path / "pgdata"
    monkeypatch.delenv(config.ENV_URL, raising=False)
    monkeypatch.setenv(config.ENV_EMBEDDED_DIR, str(data_dir))
    monkeypatch.setattr(config, "start_embedded", started)

    assert cli.main(["db", "url"]) == 0
    assert capsys.readouterr().out == (
        f"embedded ({data_dir}), database orchestrator: no database URL is configured "
        "(--database-url, ORCHESTRATOR_DATABASE_URL); the server is not created yet: the first "
        "command that needs it creates and starts it\n")
    assert not data_dir.exists()
    data_dir.mkdir()
    (data_dir / "PG_VERSION").write_text("16\n")
    assert cli.main(["db", "url"]) == 0
    assert capsys.readouterr().out.endswith(
        "the server is stopped: the first command that needs it starts it\n")


def test_a_reader_that_closes_the_pipe_early_is_not_an_error() -> None:
    """``orchestrator … | head``: once the reader has gone, the command stops quietly with the
    shell's status for a closed pipe (141), not with an INTERNAL error or a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run(
            [*command(), "--database-url", "postgresql://u@127.0.0.1:1/d", "db", "url"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=60,
            check=False)
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE, proc.stderr
    assert proc.stderr == ""


def test_a_broken_pipe_of_the_commands_own_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a closed standard output is the quiet 141; a pipe the command itself uses that
    breaks is an unexpected error like any other."""
    def broken(args: argparse.Namespace) -> int:
        raise BrokenPipeError("a subprocess of ours went away")

    monkeypatch.setattr(db_group, "cmd_url", broken)
    monkeypatch.delenv(cli.ENV_DEBUG, raising=False)
    assert cli.main(["db", "url"]) == cli.EXIT_INTERNAL
    assert "INTERNAL: unexpected BrokenPipeError" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["list", "show", "audit"])
def test_the_read_only_ops_commands_do_not_say_that_the_operator_is_audited(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`ops list`, `show` and `audit` only read: their `--operator` names whose scopes apply,
    and nothing records it (the help said "recorded in the audit log", as for a resolution)."""
    with pytest.raises(SystemExit):
        cli.main(["ops", command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "recorded in the audit log" not in shown
    assert ("--operator NAME whose operator scopes apply with --app (this command only reads: "
            "nothing is recorded); required with --app (without it: 'operator')") in shown


@pytest.mark.parametrize("command", ["resolve", "abandon", "resolve-many", "abandon-many"])
def test_the_ops_actions_say_that_the_operator_is_audited(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["ops", command, "--help"])
    assert "who acts (recorded in the audit log)" in " ".join(capsys.readouterr().out.split())


RUN = "01a24b26-e4b4-78f7-9630-ca98eb14b475"
WHOLE_1_1000 = "a whole number from 1 to 1000"
BAD_VALUES = [
    # (argv, the option, what it takes, the value given)
    (["runs", "list", "--limit", "abc"], "--limit", WHOLE_1_1000, "abc"),
    (["runs", "list", "--limit", "-3"], "--limit", WHOLE_1_1000, "-3"),
    (["runs", "list", "--json", "--limit", "1001"], "--limit", WHOLE_1_1000, "1001"),
    (["runs", "list", "--status", "done"], "--status",
     "one of queued, running, waiting, needs_reconciliation, succeeded, failed, cancelled",
     "done"),
    (["runs", "watch", RUN, "--after", "next"], "--after", "a whole number, 0 or more",
     "next"),
    (["runs", "restart", RUN, "--operator", "al", "--evidence", "x", "--from-position",
      "2.5"], "--from-position", "a whole number, 0 or more", "2.5"),
    (["ops", "list", "--limit", "all"], "--limit", WHOLE_1_1000, "all"),
    (["ops", "list", "--state", "closed"], "--state",
     "one of open, operator, resolved, unresolved, all", "closed"),
    (["ops", "audit", "--limit", "0"], "--limit", WHOLE_1_1000, "0"),
    (["ops", "resolve", "7", "--not-applied", "--evidence", "x", "--operator", "al",
      "--then", "retry"], "--then", "one of resend, fail", "retry"),
    (["ops", "resolve-many", "--not-applied", "--evidence", "x", "--operator", "al",
      "--limit", "many"], "--limit", "a whole number from 1 to 10000", "many"),
    (["ops", "abandon-many", "--evidence", "x", "--operator", "al", "--state", "resolved"],
     "--state", "one of open, operator, unresolved", "resolved"),
    (["queues", "set", "exports", "--priority", "yes"], "--priority", "one of on, off",
     "yes"),
    (["queues", "set", "exports", "--count-parked", "1"], "--count-parked",
     "one of on, off", "1"),
    (["schedules", "show", "nightly", "--recent", "lots"], "--recent",
     "a whole number from 0 to 1000", "lots"),
    (["schedules", "trigger", "nightly", "--overlap", "queue"], "--overlap",
     "one of skip, buffer_one, buffer_all, cancel_other, allow_all", "queue"),
    (["schedules", "backfill", "nightly", "--from", "2026-01-01T00:00:00Z", "--to",
      "2026-01-02T00:00:00Z", "--overlap", "none"], "--overlap",
     "one of skip, buffer_one, buffer_all, cancel_other, allow_all", "none"),
    (["replay", "--app", "m:a", "--last", "ten"], "--last",
     "a whole number from 1 to 100000", "ten"),
    (["prune", "--older-than", "30d", "--batch", "0"], "--batch",
     "a whole number from 1 to 100000", "0"),
    (["prune", "--older-than", "30d", "--duty", "half"], "--duty",
     "a number more than 0 and at most 1", "half"),
    (["console", "--port", "http"], "--port", "a whole number from 0 to 65535", "http"),
    (["demo", "--runs", "0"], "--runs", "a whole number, 1 or more", "0"),
    (["queues", "set", "work", "--concurrency", "0"], "--concurrency",
     "a whole number, 1 or more, or none", "0"),
    (["queues", "set", "work", "--key-concurrency", "two"], "--key-concurrency",
     "a whole number, 1 or more, or none", "two"),
    (["queues", "set", "work", "--worker-concurrency", "1.5"], "--worker-concurrency",
     "a whole number, 1 or more, or none", "1.5"),
    (["worker", "--app", "m:a", "--concurrency", "abc"], "--concurrency",
     "a whole number, 1 or more", "abc"),
    (["worker", "--app", "m:a", "--lease-ttl", "1m"], "--lease-ttl",
     "a finite number of seconds, more than 0", "1m"),
    (["worker", "--app", "m:a", "--poll-interval", "fast"], "--poll-interval",
     "a finite number of seconds, more than 0", "fast"),
    (["worker", "--app", "m:a", "--drain-timeout", "30s"], "--drain-timeout",
     "a finite number of seconds, 0 or more", "30s"),
    (["worker", "--app", "m:a", "--metrics-port", "70000"], "--metrics-port",
     "a whole number from 0 to 65535", "70000"),
    (["worker", "--app", "m:a", "--log-format", "yaml"], "--log-format", "one of text, json",
     "yaml"),
    (["reconciler", "--app", "m:a", "--max-lookups", "five"], "--max-lookups",
     "a whole number, 1 or more", "five"),
    (["reconciler", "--app", "m:a", "--base-delay", "1s"], "--base-delay",
     "a finite number of seconds, more than 0", "1s"),
    (["reconciler", "--app", "m:a", "--unserved-grace", "x"], "--unserved-grace",
     "a finite number of seconds, 0 or more", "x"),
    (["reconciler", "--app", "m:a", "--metrics-port", "port"], "--metrics-port",
     "a whole number from 0 to 65535", "port"),
    (["--pooler", "session", "runs", "list"], "--pooler", "one of transaction", "session"),
]


@pytest.mark.parametrize(("argv", "option", "takes", "value"), BAD_VALUES,
                         ids=[" ".join(case[0]) for case in BAD_VALUES])
def test_a_bad_option_value_is_invalid_request_naming_the_option(
        argv: list[str], option: str, takes: str, value: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A value a typed option cannot take is refused as every other bad input of the command
    line is (docs/cli-json.md): one ``orchestrator: error: INVALID_REQUEST: …`` line naming
    the option, what it takes and what was given, exit status 2, before anything is read or
    written. It was argparse's usage text and ``invalid int value``, with no stable code."""
    assert cli.main(argv) == cli.EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"orchestrator: error: INVALID_REQUEST: {option} must be {takes}, not {value!r}\n")


def test_every_typed_option_refuses_a_bad_value_with_the_cli_s_own_error() -> None:
    """Every option of every command that converts or restricts its value does so with the
    command line's own refusal (:mod:`orchestrator.cli.options`), so that an option added
    later with a plain ``type=int`` or ``choices=`` shows up here."""
    from orchestrator.cli import options

    def leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found.extend(leaves(sub))
        return found

    plain = [f"{parser.prog} {action.option_strings[0]}"
             for parser in leaves(cli.build_parser()) for action in parser._actions
             if action.option_strings and (action.type in (int, float) or (
                 action.choices is not None
                 and getattr(action.type, "__module__", None) != options.__name__))]
    assert plain == []
