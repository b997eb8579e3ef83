"""The log formats, the log-format choice and ``ctx.log``'s adapter, without a database."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import uuid
from collections.abc import Iterator
from datetime import datetime

import pytest

from orchestrator import cli
from orchestrator.db.config import EMBEDDED_LOGGER, quiet_embedded_logs
from orchestrator.errors import ConfigurationError
from orchestrator.logs import (
    ENV_LOG_FORMAT,
    FailureStreak,
    JsonFormatter,
    WorkflowLogger,
    fields,
    formatter,
    log_format,
    traceback_text,
)
from tests.clitools import cli_env, command

RUN = "01a2b3c4-0000-7000-8000-000000000001"


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own that writes JSON lines to a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tests.unit.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_json_line_has_the_known_fields_and_nothing_else(json_log) -> None:  # type: ignore[no-untyped-def]
    logger, out = json_log
    logger.info("run %s failed\nacross lines", RUN, extra=fields(
        run_id=uuid.UUID(RUN), operation_id=7, workflow="pay@1", tool=None, code="X",
        incident="inc_1"))
    logger.warning("plain")
    first, second = _lines(out)
    assert datetime.fromisoformat(str(first.pop("ts"))).utcoffset() is not None
    assert first == {"level": "INFO", "logger": "tests.unit.logs",
                     "message": f"run {RUN} failed\nacross lines", "run_id": RUN,
                     "operation_id": 7, "workflow": "pay@1", "code": "X", "incident": "inc_1"}
    assert list(first)[:3] == ["level", "logger", "message"]
    assert {k for k in second if k != "ts"} == {"level", "logger", "message"}
    assert out.getvalue().count("\n") == 2  # one object per line, newlines escaped


def test_a_logged_exception_goes_in_its_own_field(json_log) -> None:  # type: ignore[no-untyped-def]
    logger, out = json_log
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    (line,) = _lines(out)
    assert line["message"] == "failed"
    assert str(line["exception"]).startswith("Traceback") and "RuntimeError" in str(
        line["exception"])


WORD = "s3cr3t"


class StoreError(Exception):
    pass


def test_a_traceback_without_text_keeps_the_frames_and_types_of_every_link() -> None:
    def fail() -> None:
        try:
            raise KeyError(f"token {WORD}")
        except KeyError as exc:
            try:
                raise ValueError(f"payload {WORD}") from exc
            except ValueError:
                raise StoreError(f"said {WORD}")  # noqa: B904 - the context is what is tested

    with pytest.raises(StoreError) as raised:
        fail()
    text = traceback_text(raised.value)
    assert WORD not in text  # (the source lines name it, not its value)
    assert text.count("Traceback (most recent call last):") == 3 and text.count("in fail") == 3
    assert text.index("\nKeyError\n") < text.index("direct cause") < text.index(
        "\nValueError\n") < text.index("During handling") < text.index(
        "tests.unit.test_logs.StoreError")
    assert text.endswith("tests.unit.test_logs.StoreError")

    looped, other = RuntimeError("a"), RuntimeError("b")  # a chain that loops ends
    looped.__context__, other.__context__ = other, looped
    assert traceback_text(looped) == ("RuntimeError\n" + _DURING_TEXT + "RuntimeError")


_DURING_TEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def test_the_format_comes_from_the_flag_then_the_environment_then_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LOG_FORMAT, raising=False)
    assert log_format(None) == "text"
    monkeypatch.setenv(ENV_LOG_FORMAT, " JSON ")
    assert log_format(None) == "json"
    assert log_format("text") == "text"
    monkeypatch.setenv(ENV_LOG_FORMAT, "yaml")
    with pytest.raises(ConfigurationError, match=f"{ENV_LOG_FORMAT} must be one of text, json"):
        log_format(None)
    assert isinstance(formatter("json"), JsonFormatter)
    assert not isinstance(formatter("text"), JsonFormatter)
    with pytest.raises(ConfigurationError):
        formatter("yaml")


@pytest.mark.parametrize("group", ["worker", "reconciler"])
def test_worker_and_reconciler_take_log_format(group: str) -> None:
    parser = cli.build_parser()
    assert parser.parse_args([group, "--app", "m:a"]).log_format is None
    assert parser.parse_args([group, "--app", "m:a", "--log-format", "json"]).log_format == (
        "json")


def test_a_bad_log_format_is_refused_before_anything_starts() -> None:
    flag = subprocess.run([*command(), "worker", "--app", "m:a", "--log-format", "yaml"],
                          env=cli_env(None), capture_output=True, text=True, timeout=60,
                          check=False)
    assert (flag.returncode, flag.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --log-format must be one of text, json, not "
           "'yaml'\n")
    env = {**cli_env(None), ENV_LOG_FORMAT: "yaml"}
    bad = subprocess.run([*command(), "reconciler", "--app", "m:a"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert (bad.returncode, bad.stderr) == (
        2, f"orchestrator: error: CONFIGURATION_ERROR: {ENV_LOG_FORMAT} must be one of text, "
           "json, not 'yaml'\n")


def test_the_workflow_logger_is_silent_while_replaying(json_log) -> None:  # type: ignore[no-untyped-def]
    logger, out = json_log
    replaying = True
    log = WorkflowLogger(logger, lambda: replaying, {"run_id": RUN, "workflow": "pay@1"})
    assert log.replaying and not log.isEnabledFor(logging.ERROR)
    log.info("replayed")
    log.error("replayed too")
    replaying = False
    assert not log.replaying and log.isEnabledFor(logging.DEBUG)
    log.info("live %d", 1, extra={"step": "a", "run_id": "forged"})
    logger.setLevel(logging.INFO)
    assert not log.isEnabledFor(logging.DEBUG)  # the logger's own level still counts
    log.debug("below the level")
    assert [(line["message"], line["run_id"], line["workflow"]) for line in _lines(out)] == [
        ("live 1", RUN, "pay@1")]


def test_the_embedded_servers_chatter_is_raised_to_warning_unless_the_app_chose() -> None:
    logger = logging.getLogger(EMBEDDED_LOGGER)
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        quiet_embedded_logs()
        assert logger.level == logging.WARNING
        logger.setLevel(logging.DEBUG)  # the application's own choice
        quiet_embedded_logs()
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_a_failure_streak_is_said_once_per_code_and_once_when_it_ends(caplog) -> None:  # type: ignore[no-untyped-def]
    """A step failing again and again says it once (and once more for each other code), and
    once that it succeeds again; a success that ends no streak says nothing."""
    streak = FailureStreak(logging.getLogger("orchestrator.worker"), "heartbeat", "heartbeats")
    caplog.set_level(logging.INFO, logger="orchestrator.worker")
    streak.succeeded()
    for _ in range(3):
        streak.failed("DATABASE_UNAVAILABLE")
    streak.failed("CONFIGURATION_ERROR", "CONFIGURATION_ERROR: permission denied")
    streak.failed("DATABASE_UNAVAILABLE")  # said already in this streak
    streak.succeeded()
    streak.succeeded()
    streak.failed("DATABASE_UNAVAILABLE")  # a new streak is said again
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[:2] == [
        ("WARNING", "heartbeat failed: DATABASE_UNAVAILABLE (said once: a line says when "
                    "heartbeats succeed again)"),
        ("WARNING", "heartbeat failed: CONFIGURATION_ERROR: permission denied (said once: a "
                    "line says when heartbeats succeed again)")]
    assert said[2][0] == "INFO" and said[2][1].startswith("heartbeats succeed again, ")
    assert said[2][1].endswith(" s after the first that failed")
    assert said[3:] == [said[0]]
    assert [r.__dict__.get("code") for r in caplog.records] == [
        "DATABASE_UNAVAILABLE", "CONFIGURATION_ERROR", None, "DATABASE_UNAVAILABLE"]


def test_a_failure_streak_keeps_a_steps_own_first_words(caplog) -> None:  # type: ignore[no-untyped-def]
    """A step whose warning had its own words before it said a streak once (the schedules'
    tick, the liveness lock's check) keeps them, so that a search for the old line finds the
    new one; its prefix starts the INFO line too."""
    streak = FailureStreak(logging.getLogger("orchestrator.worker"), "liveness lock check",
                           "liveness lock checks", prefix="worker w1: ",
                           failure="could not check its liveness lock")
    caplog.set_level(logging.INFO, logger="orchestrator.worker")
    streak.failed("DATABASE_UNAVAILABLE")
    streak.failed("DATABASE_UNAVAILABLE")
    streak.succeeded()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0] == ("WARNING", "worker w1: could not check its liveness lock: "
                                  "DATABASE_UNAVAILABLE (said once: a line says when liveness "
                                  "lock checks succeed again)")
    assert [level for level, _ in said] == ["WARNING", "INFO"]
    assert said[1][1].startswith("worker w1: liveness lock checks succeed again, ")


def test_a_workflow_line_in_text_names_its_run_and_workflow() -> None:
    """``ctx.log`` lines in the text format said the message only: an operator reading text
    logs could not tell which run wrote one (the JSON format has ``run_id``)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter("text"))
    workflow, engine = (logging.getLogger("orchestrator.workflow.pay"),
                        logging.getLogger("tests.unit.logs.text"))
    for logger in (workflow, engine):
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        log = WorkflowLogger(workflow, lambda: False, {"run_id": RUN, "workflow": "pay@1"})
        log.info("charging order %s", 7)
        engine.warning("run %s (pay@1) failed", RUN, extra=fields(run_id=RUN, workflow="pay@1"))
        workflow.info("without a run")
    finally:
        for logger in (workflow, engine):
            logger.removeHandler(handler)
            logger.propagate = True
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 3)[2:] for line in lines] == [
        ["INFO", f"run {RUN} (pay@1): charging order 7"],
        ["WARNING", f"run {RUN} (pay@1) failed"],  # its message names the run already
        ["INFO", "without a run"]], lines
