"""Validating and masking database URLs: no database needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import Orchestrator
from orchestrator.db.config import (
    DatabaseTarget,
    display_url,
    mask_url,
    resolve_database,
    validate_url,
)
from orchestrator.errors import ConfigurationError, InvalidRequest


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://app:pw@db:5432/orders", "postgresql://app:pw@db:5432/orders"),
        ("postgres://app@db/orders", "postgresql://app@db/orders"),
        ("postgresql+psycopg://app@db/orders", "postgresql://app@db/orders"),
        ("  postgresql://db/orders\n", "postgresql://db/orders"),
        (
            "postgresql://postgres:@/orchestrator?host=/tmp/pg",
            "postgresql://postgres:@/orchestrator?host=/tmp/pg",
        ),
        ("postgresql://[::1]:5433/orders", "postgresql://[::1]:5433/orders"),
        (  # libpq's multi-host form: a primary and its standby, the writable one chosen
            "postgresql://app@10.0.0.1:5432,10.0.0.2:5433/orders?target_session_attrs=read-write",
            "postgresql://app@10.0.0.1:5432,10.0.0.2:5433/orders?target_session_attrs=read-write",
        ),
        ("postgres://app@h1,[::1]:5433/orders", "postgresql://app@h1,[::1]:5433/orders"),
    ],
)
def test_valid_urls_are_normalised_to_libpq_form(url: str, expected: str) -> None:
    assert validate_url(url) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("", "the database URL is empty"),
        ("   ", "the database URL is empty"),
        ("mysql://app@db/orders", "has scheme 'mysql'; use postgresql://"),
        ("sqlite:///orders.db", "has scheme 'sqlite'"),
        ("postgresql+asyncpg://db/orders", "has scheme 'postgresql+asyncpg'"),
        ("db:5432/orders", "is malformed: expected postgresql://"),
        ("postgresql://u@h:notaport/db", "is malformed"),
        ("postgresql://u@h:99999/db", "is malformed"),
        ("postgresql://u@h1:5432,h2:nope/db", "is malformed"),
        ("postgresql://u@h1:5432,h2:99999/db", "is malformed"),
        ("postgresql://app@db:5432", "names no database"),
        ("postgresql://app@db:5432/", "names no database"),
    ],
)
def test_bad_urls_name_the_problem(url: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        validate_url(url)

    assert caught.value.code == "CONFIGURATION_ERROR"
    assert fragment in caught.value.message
    assert "\n" not in str(caught.value)


def test_a_bad_port_is_named() -> None:
    with pytest.raises(ConfigurationError) as caught:
        validate_url("postgresql://u@h:notaport/db")
    assert "notaport" in caught.value.message


def test_errors_do_not_repeat_the_password() -> None:
    for url in ("mysql://app:s3cret@db/x", "postgresql://app:s3cret@db:bad/x",
                "postgresql://app:s3cret@db"):
        with pytest.raises(ConfigurationError) as caught:
            validate_url(url)
        assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://app:s3cret@db:5432/x", "postgresql://app:***@db:5432/x"),
        ("postgresql://app:p@ss:w0rd@db/x", "postgresql://app:***@db/x"),
        ("postgresql://app:%40%3A@db/x", "postgresql://app:***@db/x"),
        ("postgresql://:s3cret@db/x", "postgresql://:***@db/x"),
        ("postgresql://app@db:5432/x", "postgresql://app@db:5432/x"),
        ("postgresql://db/x", "postgresql://db/x"),
        ("postgresql://postgres:@/x?host=/tmp/pg", "postgresql://postgres:@/x?host=/tmp/pg"),
        (
            "postgresql://db/x?sslmode=require&password=s3cret",
            "postgresql://db/x?sslmode=require&password=***",
        ),
    ],
)
def test_mask_url_hides_only_the_password(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "s3cret" not in mask_url(url)


def test_target_offers_display_and_sqlalchemy_forms() -> None:
    target = DatabaseTarget("postgresql://app:s3cret@db:5432/x", "argument")
    assert target.display == target.masked == "postgresql://app@db:5432/x"
    assert target.sqlalchemy_url == "postgresql+psycopg://app:s3cret@db:5432/x"


def test_a_multi_host_target_reaches_sqlalchemy_as_one_host_parameter_each() -> None:
    from sqlalchemy import create_engine

    target = DatabaseTarget(validate_url(
        "postgresql://app:s3cret@h1:5432,h2:5433/x?target_session_attrs=read-write"),
        "argument")
    assert target.display == "postgresql://app@h1:5432,h2:5433/x"
    engine = create_engine(target.sqlalchemy_url)
    _, options = engine.dialect.create_connect_args(engine.url)
    assert (options["host"], options["port"]) == ("h1,h2", "5432,5433")
    assert options["target_session_attrs"] == "read-write"
    assert (options["user"], options["password"], options["dbname"]) == ("app", "s3cret", "x")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cret@db:5432/x", "postgresql://app@db:5432/x"),
        ("postgresql://app:%40%3A@db/x", "postgresql://app@db/x"),
        ("postgresql://:s3cret@db/x", "postgresql://db/x"),
        ("postgresql://db/x?sslmode=require&password=s3cret", "postgresql://db/x"),
        ("postgresql://postgres:@/orchestrator?host=/tmp/pg",
         "postgresql://postgres@/orchestrator (socket /tmp/pg)"),
        ("postgresql://%2Frun%2Fpg/x", "postgresql:///x (socket /run/pg)"),
        ("postgresql://db/x?port=6432&user=app&sslpassword=s3cret", "postgresql://app@db:6432/x"),
        ("postgresql://a@h1:5432,h2:5433/x", "postgresql://a@h1:5432,h2:5433/x"),
        ("postgresql://app@[::1]:5432/x", "postgresql://app@[::1]:5432/x"),
    ],
)
def test_the_display_form_is_readable_and_carries_no_secret(url: str, shown: str) -> None:
    assert display_url(url) == shown
    assert DatabaseTarget(url, "environment").display == shown


def test_an_embedded_target_is_shown_by_its_data_directory() -> None:
    target = DatabaseTarget("postgresql://postgres:@/orchestrator?host=/tmp/pg", "embedded",
                            Path("/home/u/.local/share/orchestrator/pgdata"))
    assert target.display == "embedded (/home/u/.local/share/orchestrator/pgdata)"


def test_an_explicit_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_DATABASE_URL", "postgresql://env-host/env")
    assert resolve_database("postgres://arg-host/arg") == DatabaseTarget(
        "postgresql://arg-host/arg", "argument"
    )
    assert resolve_database() == DatabaseTarget("postgresql://env-host/env", "environment")


def test_a_bad_environment_url_is_reported_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_DATABASE_URL", "mysql://db/x")
    with pytest.raises(ConfigurationError, match="scheme 'mysql'"):
        resolve_database()


DIRECT = "postgresql://app@db:5432/orders"
POOLED = "postgresql://app@bouncer:6432/orders"


def test_a_direct_database_prepares_statements_and_keeps_sessions_on_its_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCHESTRATOR_POOLER", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_LISTEN_URL", raising=False)
    target = resolve_database(DIRECT)
    assert (target.pooler, target.listen_url) == (None, None)
    assert target.prepare_threshold == 0
    assert target.session_url == DIRECT


def test_a_transaction_pooler_prepares_nothing_and_keeps_no_session_on_its_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCHESTRATOR_LISTEN_URL", raising=False)
    target = resolve_database(POOLED, pooler="transaction")
    assert target.prepare_threshold is None
    assert target.session_url is None  # polling, and leases for the dead workers' runs
    with_listen = resolve_database(POOLED, pooler="transaction", listen_url=DIRECT)
    assert with_listen.prepare_threshold is None
    assert with_listen.session_url == DIRECT


def test_pooler_options_come_from_the_environment_unless_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_POOLER", "transaction")
    monkeypatch.setenv("ORCHESTRATOR_LISTEN_URL", "postgres://app@db/orders")
    target = resolve_database(POOLED)
    assert (target.pooler, target.listen_url) == ("transaction", "postgresql://app@db/orders")
    given = resolve_database(POOLED, listen_url=DIRECT)
    assert given.listen_url == DIRECT
    monkeypatch.setenv("ORCHESTRATOR_POOLER", "")
    assert resolve_database(POOLED).pooler is None


@pytest.mark.parametrize(("options", "fragment"), [
    ({"pooler": "session"}, "pooler must be one of transaction"),
    ({"pooler": "statement"}, "got 'statement'"),
    ({"listen_url": "mysql://db/orders"}, "has scheme 'mysql'"),
])
def test_bad_pooler_options_name_the_problem(monkeypatch: pytest.MonkeyPatch,
                                             options: dict[str, str], fragment: str) -> None:
    monkeypatch.delenv("ORCHESTRATOR_POOLER", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_LISTEN_URL", raising=False)
    with pytest.raises(ConfigurationError) as caught:
        resolve_database(POOLED, **options)
    assert fragment in caught.value.message


def test_the_cli_options_reach_an_app_built_without_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.cli import _export_pooler_options, build_parser

    monkeypatch.setenv("ORCHESTRATOR_POOLER", "")  # empty is unset; restored after the test
    monkeypatch.setenv("ORCHESTRATOR_LISTEN_URL", "")
    args = build_parser().parse_args(
        ["--pooler", "transaction", "--listen-url", DIRECT, "worker", "--app", "m:a"])
    _export_pooler_options(args)
    target = Orchestrator(POOLED).target
    assert (target.pooler, target.session_url) == ("transaction", DIRECT)


@pytest.mark.parametrize("group", ["worker", "reconciler"])
def test_a_poll_interval_that_is_not_positive_is_refused_before_anything_starts(
        group: str) -> None:
    import subprocess

    from tests.clitools import cli_env, command

    done = subprocess.run([*command(), group, "--app", "m:a", "--poll-interval", "0"],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --poll-interval must be a finite number of "
        "seconds, more than 0, not '0'\n")


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_drain_timeout_that_is_not_a_finite_number_of_seconds_is_refused(value: str) -> None:
    import subprocess

    from tests.clitools import cli_env, command

    done = subprocess.run([*command(), "worker", "--app", "m:a", "--drain-timeout", value],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --drain-timeout must be a finite number of "
        f"seconds, 0 or more, not {value!r}\n")


def test_the_pooler_flag_takes_only_the_modes_that_need_it() -> None:
    from orchestrator.cli import build_parser

    with pytest.raises(InvalidRequest, match="--pooler must be one of transaction, not "
                       "'session'"):
        build_parser().parse_args(["--pooler", "session", "worker", "--app", "m:a"])


def test_the_demo_database_is_named_after_the_configured_one() -> None:
    """``orchestrator demo`` keeps to a database of its own: ``NAME_demo`` beside ``NAME``
    (a URL that names one already is kept; a name PostgreSQL would truncate is refused)."""
    from orchestrator.db import config

    own = config.DatabaseTarget("postgresql://u@h:5432/orders_demo", "environment")
    assert config.demo_target(own) is own
    assert config._with_database("postgresql://u:p@h/orders?dbname=orders&sslmode=require",
                                 "orders_demo") == (
        "postgresql://u:p@h/orders_demo?dbname=orders_demo&sslmode=require")
    assert config._database_of("postgresql://u@/x?host=/tmp&dbname=shop") == "shop"
    long = config.DatabaseTarget("postgresql://u@h/" + "x" * 60, "environment")
    with pytest.raises(ConfigurationError, match="longer than PostgreSQL's 63 bytes"):
        config.demo_target(long)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_lease_ttl_that_is_not_a_positive_finite_number_of_seconds_is_refused(
        value: str) -> None:
    """A worker started with ``--lease-ttl 0`` claimed runs whose leases had run out as they
    were granted: every write was fenced, every call withheld or made unknown, and the run went
    to reconciliation for nothing; ``nan`` failed later as an INTERNAL error."""
    import subprocess

    from tests.clitools import cli_env, command

    done = subprocess.run([*command(), "worker", "--app", "m:a", "--lease-ttl", value],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --lease-ttl must be a finite number of "
        f"seconds, more than 0, not {value!r}\n")


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--base-delay", "0", "--base-delay must be a finite number of seconds, more than 0"),
    ("--base-delay", "-1", "--base-delay must be a finite number of seconds, more than 0"),
    ("--base-delay", "nan", "--base-delay must be a finite number of seconds, more than 0"),
    ("--max-lookups", "0", "--max-lookups must be a whole number, 1 or more"),
    ("--max-lookups", "-5", "--max-lookups must be a whole number, 1 or more"),
    ("--max-lookups", "five", "--max-lookups must be a whole number, 1 or more"),
    ("--unserved-grace", "-1", "--unserved-grace must be a finite number of seconds, 0 or more"),
    ("--unserved-grace", "inf", "--unserved-grace must be a finite number of seconds, 0 or "
                                "more"),
    ("--unserved-grace", "nan", "--unserved-grace must be a finite number of seconds, 0 or "
                                "more"),
    ("--max-delay", "0", "--max-delay must be a finite number of seconds, more than 0"),
    ("--lookup-timeout", "-1", "--lookup-timeout must be a finite number of seconds, more "
                               "than 0"),
    ("--batch", "0", "--batch must be a whole number, 1 or more"),
    ("--prune-interval", "inf", "--prune-interval must be a finite number of seconds, more "
                                "than 0"),
])
def test_a_reconciler_setting_out_of_range_is_refused_before_anything_starts(
        flag: str, value: str, message: str) -> None:
    import subprocess

    from tests.clitools import cli_env, command

    done = subprocess.run([*command(), "reconciler", "--app", "m:a", flag, value],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, f"orchestrator: error: INVALID_REQUEST: {message}, not {value!r}\n")


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan"), float("inf"), "30"])
def test_an_app_or_worker_lease_ttl_that_is_not_a_positive_number_is_a_configuration_error(
        ttl: object) -> None:
    with pytest.raises(ConfigurationError, match="lease_ttl must be a finite number of "
                                                 "seconds, more than 0"):
        Orchestrator(POOLED, lease_ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="lease_ttl must be a finite number of "
                                                 "seconds, more than 0"):
        Orchestrator(POOLED).create_worker(lease_ttl=ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_a_pool_size_that_is_not_a_positive_integer_is_a_configuration_error(
        size: object) -> None:
    """``Orchestrator(pool_size=0)`` was taken, and its first statement failed with psycopg's
    own ValueError ("max_size must be greater or equal than min_size")."""
    with pytest.raises(ConfigurationError, match="pool_size must be a positive integer"):
        Orchestrator(POOLED, pool_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("pooler", ["session", "statement", "", 1])
def test_a_bad_pooler_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch,
                                                 pooler: object) -> None:
    """``Orchestrator(pooler="session")`` was taken, and refused only at the first use of
    the database, unlike the other options."""
    monkeypatch.delenv("ORCHESTRATOR_POOLER", raising=False)
    with pytest.raises(ConfigurationError, match="pooler must be one of transaction"):
        Orchestrator(POOLED, pooler=pooler)  # type: ignore[arg-type]
    assert Orchestrator(POOLED, pooler="transaction").target.pooler == "transaction"


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_a_bad_max_record_bytes_says_what_it_must_be(size: object) -> None:
    """The message read "must be an integer from 1 to any size"."""
    with pytest.raises(ConfigurationError) as caught:
        Orchestrator(POOLED, max_record_bytes=size)  # type: ignore[arg-type]
    assert caught.value.message == f"max_record_bytes must be a positive integer, got {size!r}"


NAN, INF = float("nan"), float("inf")
POSITIVE = "must be a finite number of seconds, more than 0"


@pytest.mark.parametrize(("entry", "setting", "value", "message"), [
    ("reconciler", "base_delay", 0, f"base_delay {POSITIVE}"),
    ("reconciler", "base_delay", -1.0, f"base_delay {POSITIVE}"),
    ("reconciler", "base_delay", NAN, f"base_delay {POSITIVE}"),
    ("reconciler", "max_delay", INF, f"max_delay {POSITIVE}"),
    ("reconciler", "poll_interval", 0, f"poll_interval {POSITIVE}"),
    ("reconciler", "lookup_timeout", NAN, f"lookup_timeout {POSITIVE}"),
    ("reconciler", "prune_interval", -5, f"prune_interval {POSITIVE}"),
    ("reconciler", "max_lookups", 0, "max_lookups must be a positive integer"),
    ("reconciler", "batch", 0, "batch must be a positive integer"),
    ("reconciler", "batch", 2.5, "batch must be a positive integer"),
    ("reconciler", "unserved_grace", -1, "unserved_grace must be a finite number of seconds, 0 "
                                         "or more"),
    ("reconciler", "unserved_grace", INF, "unserved_grace must be a finite number of seconds, "
                                          "0 or more"),
    ("worker", "concurrency", 0, "concurrency must be a positive integer"),
    ("worker", "poll_interval", 0, f"poll_interval {POSITIVE}"),
    ("worker", "poll_interval", NAN, f"poll_interval {POSITIVE}"),
    ("worker", "drain_timeout", -1, "drain_timeout must be a finite number of seconds, 0 or "
                                    "more"),
    ("worker", "drain_timeout", NAN, "drain_timeout must be a finite number of seconds, 0 or "
                                     "more"),
    ("worker", "metrics_port", 70000, "metrics_port must be between 0 and 65535"),
    ("scheduler", "interval", 0, f"interval {POSITIVE}"),
])
def test_a_fleet_setting_out_of_range_given_from_python_is_a_configuration_error(
        entry: str, setting: str, value: object, message: str) -> None:
    """The CLI refuses ``--base-delay 0`` (or nan) before anything starts, but the same value
    given to ``run_reconciler`` from Python was taken: 0 looked an unknown call up again at
    once, in a tight loop, and nan failed at the first lookup as an INTERNAL error. Every
    numeric setting of the worker, the reconciler and the schedules' ticker is checked by the
    Python entry points too, before anything connects: ``CONFIGURATION_ERROR``."""
    app = Orchestrator(POOLED)
    if entry == "scheduler":
        calls = [lambda: app.create_scheduler(**{setting: value})]
    else:
        create = app.create_worker if entry == "worker" else app.create_reconciler
        run = app.run_worker if entry == "worker" else app.run_reconciler
        calls = [lambda: run(**{setting: value})]
        if setting != "metrics_port":
            calls.append(lambda: create(**{setting: value}))
    for call in calls:
        with pytest.raises(ConfigurationError) as caught:
            call()
        assert caught.value.code == "CONFIGURATION_ERROR"
        assert caught.value.message.startswith(message), caught.value.message


@pytest.mark.parametrize("ttl", [0.05, 0.2, 0.49])
def test_a_lease_ttl_below_what_a_heartbeat_can_keep_is_refused_naming_the_minimum(
        ttl: float) -> None:
    """``lease_ttl=0.05`` was taken: the renewals, a beat apart (0.05 s at the shortest),
    came as the lease ran out, so the sweep of any worker re-queued the runs held (calls
    turned unknown, runs sent to reconciliation) over and over. A TTL below
    :data:`~orchestrator.app.MIN_LEASE_TTL` is refused, wherever it is given."""
    import subprocess

    from orchestrator.app import MIN_LEASE_TTL
    from tests.clitools import cli_env, command

    assert MIN_LEASE_TTL == 0.5
    with pytest.raises(ConfigurationError, match=r"lease_ttl must be at least 0\.5 s"):
        Orchestrator(POOLED, lease_ttl=ttl)
    with pytest.raises(ConfigurationError, match=r"lease_ttl must be at least 0\.5 s"):
        Orchestrator(POOLED).create_worker(lease_ttl=ttl)
    done = subprocess.run([*command(), "worker", "--app", "m:a", "--lease-ttl", str(ttl)],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --lease-ttl must be at least 0.5 s (a "
        "heartbeat renews a lease a third of its TTL apart, and must land before it runs "
        "out)\n")


@pytest.mark.parametrize("group", ["worker", "reconciler"])
def test_an_infinite_poll_interval_is_refused_with_the_flags_own_error(group: str) -> None:
    """``--poll-interval inf`` passed the flag's check (only ``nan`` and numbers up to 0 were
    refused) and was refused only later, by the application's, as a CONFIGURATION_ERROR about
    ``poll_interval``, after the application was imported and the database reached."""
    import subprocess

    from tests.clitools import cli_env, command

    for value in ("inf", "0", "nan"):
        done = subprocess.run([*command(), group, "--app", "m:a", "--poll-interval", value],
                              env=cli_env(None), capture_output=True, text=True, timeout=60,
                              check=False)
        assert (done.returncode, done.stderr) == (
            2, "orchestrator: error: INVALID_REQUEST: --poll-interval must be a finite number "
            f"of seconds, more than 0, not {value!r}\n"), value


@pytest.mark.parametrize("ttl", [86400.5, 1e12, 1e308])
def test_a_lease_ttl_longer_than_a_day_is_refused_naming_the_maximum(ttl: float) -> None:
    """``--lease-ttl 1e308`` was taken: the worker started, and died at its first claim with
    ``INTERNAL: unexpected DatetimeFieldOverflow`` (exit 70), the run left queued; any TTL
    whose expiry the database cannot write did the same. A TTL above
    :data:`~orchestrator.app.MAX_LEASE_TTL` is refused, wherever it is given."""
    import subprocess

    from orchestrator.app import MAX_LEASE_TTL
    from tests.clitools import cli_env, command

    assert MAX_LEASE_TTL == 86400
    Orchestrator(POOLED, lease_ttl=86400)  # a day is the longest taken
    with pytest.raises(ConfigurationError, match=r"lease_ttl must be at most 86400 s"):
        Orchestrator(POOLED, lease_ttl=ttl)
    with pytest.raises(ConfigurationError, match=r"lease_ttl must be at most 86400 s"):
        Orchestrator(POOLED).create_worker(lease_ttl=ttl)
    done = subprocess.run([*command(), "worker", "--app", "m:a", "--lease-ttl", str(ttl)],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --lease-ttl must be at most 86400 s (a "
        "day: a dead worker's runs wait that long for their leases where no liveness lock "
        "tells its death)\n")


@pytest.mark.parametrize(("value", "fragment"), [
    ("garbage", "listen_url is malformed"),
    ("mysql://db/orders", "listen_url has scheme 'mysql'"),
    ("postgresql://app@db:5432/", "listen_url names no database"),
    ("postgresql://app@db:99999/orders", "listen_url is malformed"),
])
def test_a_bad_listen_url_is_named_not_taken_for_the_database_url(
        monkeypatch: pytest.MonkeyPatch, value: str, fragment: str) -> None:
    """``ORCHESTRATOR_LISTEN_URL=garbage`` (or ``--listen-url``) stopped a worker with "the
    database URL is malformed" while the database URL was right: the operator looked at the
    wrong setting. The message names ``listen_url``, from the argument or the variable."""
    import subprocess

    from tests.clitools import cli_env, command

    monkeypatch.delenv("ORCHESTRATOR_POOLER", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_LISTEN_URL", raising=False)
    with pytest.raises(ConfigurationError) as given:
        resolve_database(POOLED, pooler="transaction", listen_url=value)
    monkeypatch.setenv("ORCHESTRATOR_LISTEN_URL", value)
    with pytest.raises(ConfigurationError) as from_env:
        resolve_database(POOLED, pooler="transaction")
    for caught in (given, from_env):
        assert fragment in caught.value.message and "database URL" not in caught.value.message
    done = subprocess.run([*command(), "--database-url", POOLED, "--pooler", "transaction",
                           "--listen-url", value, "workers", "list"],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and fragment in done.stderr, done.stderr
