"""A database upgraded with runs in flight: what an older engine started, this one finishes.

The older engine is a fixed commit exported with ``git archive`` (tests/chaos/engine.py); its
processes import it from that export. It migrates a fresh database and starts runs of
tests/acceptance/upgrade_app.py until each is in flight in one of these states:

- parked on an event after two committed calls;
- parked in a durable sleep after a committed call;
- blocked on a call whose outcome is unknown (listed for reconciliation);
- waiting out a durable back-off before a failed call's second attempt;
- in the middle of a call when its worker is killed (SIGKILL).

Its workers are stopped, this work tree's engine upgrades the schema, its workers take over,
an operator resolves the unknown call from the command line, the event is sent, and every run
must succeed with the receipts it should have, every effect applied once (the call resolved as
applied is not sent again, the retried one is sent exactly twice), and each run's journal one
sequence, 1 to N, that begins with what the old engine wrote.

Only the public API, the command line and plain reads of ``orchestrator.journal`` (a table
today; later perhaps a view with the same columns) see the runs, so the test holds whatever
the engines store underneath.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from orchestrator import Orchestrator, ResultTimeout
from tests.acceptance import upgrade_app
from tests.acceptance.upgrade_app import receipt
from tests.chaos.engine import snapshot

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMIT = "b5df86e184bd0240de85a7f17e56cadb3e4082c5"
APP = "tests.acceptance.upgrade_app:app"
TIMER = 8.0
"""Seconds of the durable sleep and of the back-off: longer than the old engine has them."""


class Engine:
    """Processes of one engine on the test's database, importing it from ``folder`` (their
    working directory and ``PYTHONPATH``)."""

    def __init__(self, name: str, url: str, folder: Path, logs: Path) -> None:
        self.name, self.url, self.folder, self.logs = name, url, folder, logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "ORCHESTRATOR_DATABASE_URL": self.url,
                "PYTHONPATH": str(self.folder), **extra}

    def run(self, module: str, *args: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=self.folder,
                              env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check:
            assert done.returncode == 0, (
                f"{self.name}: {module} {' '.join(args)} exited {done.returncode}\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("orchestrator", *args, check=check)

    def client(self, *args: str) -> Any:
        """``tests.acceptance.upgrade_client`` under this engine; its JSON answer."""
        return json.loads(self.run("tests.acceptance.upgrade_client", *args).stdout or "null")

    def worker(self, name: str, *, concurrency: int = 10,
               **env: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "worker", "--app", APP,
                 "--concurrency", str(concurrency)],
                cwd=self.folder, env=self.env(**env), stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _old_engine(tmp_path: Path) -> tuple[Path, Path]:
    """The old commit's export and a folder that imports it: ``orchestrator`` and
    ``migrations`` link to the export, ``tests`` to this checkout's. (The export is shared by
    every checkout and named by its commit; its own ``tests`` link names the checkout that made
    it first, which may not hold this test's app.)"""
    exported, sha = snapshot(OLD_COMMIT)
    assert sha == OLD_COMMIT
    folder = tmp_path / "old-engine"
    folder.mkdir()
    for part in ("orchestrator", "migrations"):
        (folder / part).symlink_to(exported / part)
    (folder / "tests").symlink_to(ROOT / "tests")
    return exported, folder


@pytest.fixture
def engines(empty_database_url: str, tmp_path: Path) -> Iterator[tuple[Engine, Engine, Path]]:
    exported, folder = _old_engine(tmp_path)
    old = Engine("old engine", empty_database_url, folder, tmp_path)
    new = Engine("new engine", empty_database_url, ROOT, tmp_path)
    try:
        yield old, new, exported
    finally:
        old.close()
        new.close()


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 30.0,
          alive: tuple[subprocess.Popen[bytes], ...] = ()) -> Any:
    give_up = time.monotonic() + timeout
    while not (got := predicate()):
        for proc in alive:
            assert proc.poll() is None, f"a worker exited ({proc.returncode}) before {what}"
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def _entry(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["seq"], e["kind"], e["position"], e["name"], e["payload"])


def test_runs_in_flight_across_an_upgrade_finish_on_the_new_engine(
        engines: tuple[Engine, Engine, Path], empty_database_url: str) -> None:
    old, new, exported = engines
    url = empty_database_url
    db = psycopg.connect(url, autocommit=True, row_factory=dict_row)

    def sql(query: str, params: Any = None) -> list[dict[str, Any]]:
        cur = db.execute(query, params)
        return cur.fetchall() if cur.description else []

    def calls(run_id: str) -> list[dict[str, Any]]:
        return sql("SELECT tool, step, attempt, key, pid FROM public.upgrade_calls "
                   "WHERE run_id = %s ORDER BY id", (run_id,))

    def effects(run_id: str) -> list[dict[str, Any]]:
        return sql("SELECT tool, step, key FROM public.upgrade_effects WHERE run_id = %s "
                   "ORDER BY step", (run_id,))

    def journal_rows(run_id: str) -> list[dict[str, Any]]:
        return sql("SELECT seq, kind, position, name, payload FROM orchestrator.journal "
                   "WHERE run_id = %s ORDER BY seq", (run_id,))

    try:
        # The old processes import the old engine, and this checkout's app.
        where = old.client("engine")
        assert Path(where["orchestrator"]).resolve().is_relative_to(exported), where
        assert Path(where["app"]).resolve() == Path(upgrade_app.__file__).resolve(), where
        here = new.client("engine")
        assert Path(here["orchestrator"]).resolve().is_relative_to(ROOT / "orchestrator"), here

        # A fresh database with the old engine's schema.
        old.cli("db", "upgrade")
        old.cli("db", "check")
        sql(upgrade_app.SINK_DDL)

        # Worker B holds one run (concurrency 1) with its second call in flight for minutes.
        b = old.worker("old-b", concurrency=1, UPGRADE_TOOL_DELAY="600")
        [mid] = old.client("submit", "several_steps={}")
        _wait(lambda: [c for c in calls(mid) if c["tool"] == "slow"],
              "the old worker B to send step 2", alive=(b,))
        # Worker A takes the others until each is parked.
        a = old.worker("old-a")
        timed = json.dumps({"sleep": TIMER, "backoff": TIMER})
        ids = old.client("submit", "parked={}", "uncertain={}", f"sleeper={timed}",
                         f"retried={timed}")
        waiting, unknown, sleeping, retrying = ids
        waited = old.run("tests.acceptance.upgrade_client", "wait", f"{waiting}=waiting",
                         f"{unknown}=needs_reconciliation", f"{sleeping}=waiting",
                         f"{retrying}=waiting", check=False)
        assert waited.returncode == 0, waited.stderr + old.log("old-a")

        # The old workers go: A drains (it holds nothing), B is killed mid-call.
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0, old.log("old-a")
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=30)
        runs = [mid, *ids]
        # Where the old engine left them: no timer was over yet (else the test proves less).
        left = {r: [(c["tool"], c["step"], c["attempt"]) for c in calls(r)] for r in runs}
        assert left == {
            mid: [("record", 1, 1), ("slow", 2, 1)],
            waiting: [("record", 1, 1), ("record", 2, 1)],
            unknown: [("record", 1, 1), ("charge", 2, 1)],
            sleeping: [("record", 1, 1)],
            retrying: [("record", 1, 1), ("flaky", 2, 1)],
        }, "the old engine went further than the test expects (a timer was over?)"
        old_pids = {a.pid, b.pid}
        assert {c["pid"] for r in runs for c in calls(r)} == old_pids

        # Their journals as the old engine's public API reads them.
        before: dict[str, list[dict[str, Any]]] = old.client("journals", *runs)
        for run_id, entries in before.items():
            assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1)), run_id
            assert [_entry(e) for e in journal_rows(run_id)] == [_entry(e) for e in entries]
        kinds = {r: [e["kind"] for e in before[r]] for r in runs}
        assert kinds[mid][-1] == "call.submitted"  # step 2 sent, no outcome
        assert "event.wait" in kinds[waiting] and kinds[waiting].count("call.completed") == 2
        assert "call.unknown" in kinds[unknown]
        assert "timer" in kinds[sleeping]
        assert "call.retrying" in kinds[retrying]

        # The new engine upgrades the schema; its code replays every run in flight.
        new.cli("db", "upgrade")
        new.cli("db", "check")
        replayed = json.loads(new.cli("replay", "--app", APP, "--in-flight", "--json").stdout)
        assert (replayed["count"], replayed["ok"]) == (5, 5), replayed

        # New workers take over; an operator resolves the unknown call as applied.
        news = (new.worker("new-1"), new.worker("new-2"))
        items = json.loads(new.cli("ops", "list", "--run", unknown, "--json").stdout)["items"]
        assert [(i["tool_name"], i["operation_state"], i["reason"]) for i in items] == [
            ("charge", "unknown", "TOOL_OUTCOME_UNCERTAIN")], items
        charged = receipt("charge", 2, calls(unknown)[1]["key"])
        new.cli("ops", "resolve", str(items[0]["operation_id"]), "--committed", "--receipt",
                json.dumps(charged), "--evidence", "the charge is in the provider's ledger",
                "--operator", "alice")

        client = Orchestrator(url, default_owner=upgrade_app.app.default_owner)
        try:
            assert client.send_event(waiting, "go", {"approved": True})
            handles = [client.get_run(r) for r in runs]
            try:
                client.wait(handles, timeout=45)
            except ResultTimeout as exc:
                logs = "\n".join(new.log(f"new-{n}") for n in (1, 2))
                raise AssertionError(f"the runs did not finish: {exc}\n{logs}") from exc
            results = {r: h.result(timeout=1) for r, h in zip(runs, handles, strict=True)}
            after = {r: [e.model_dump(mode="json") for e in h.journal()]
                     for r, h in zip(runs, handles, strict=True)}
        finally:
            client.close()
        for proc in news:
            assert proc.poll() is None, "a new worker exited"

        # Every call, once: what the old engine sent is never sent again, except the
        # idempotent step B was killed in, re-sent under the same key.
        def made(run_id: str) -> list[tuple[str, int, int]]:
            return [(c["tool"], c["step"], c["attempt"]) for c in calls(run_id)]

        assert made(waiting) == [("record", 1, 1), ("record", 2, 1), ("record", 3, 1)]
        assert made(sleeping) == [("record", 1, 1), ("record", 2, 1)]
        assert made(unknown) == [("record", 1, 1), ("charge", 2, 1), ("record", 3, 1)]
        assert made(retrying) == [("record", 1, 1), ("flaky", 2, 1), ("flaky", 2, 2)]
        mid_calls = calls(mid)
        assert [(c["tool"], c["step"]) for c in mid_calls] == [
            ("record", 1), ("slow", 2), ("slow", 2), ("record", 3)]
        assert mid_calls[1]["key"] == mid_calls[2]["key"], "the re-send changed its key"
        new_pids = {p.pid for p in news}
        for run_id in runs:  # the old engine's calls, then the new one's
            pids = [c["pid"] for c in calls(run_id)]
            cut = len(left[run_id])
            assert set(pids[:cut]) <= old_pids and set(pids[cut:]) <= new_pids, run_id

        # One effect per step, and each run returned the receipts of those effects.
        def key(run_id: str, tool: str, step: int) -> str:
            [row] = [e for e in effects(run_id) if (e["tool"], e["step"]) == (tool, step)]
            return str(row["key"])

        for run_id, steps in {waiting: 3, sleeping: 2, unknown: 3, retrying: 2,
                              mid: 3}.items():
            assert len(effects(run_id)) == steps, (run_id, effects(run_id))

        def rec(run_id: str, step: int) -> dict[str, Any]:
            return receipt("record", step, key(run_id, "record", step))

        assert results[waiting] == [rec(waiting, 1), rec(waiting, 2), {"approved": True},
                                    rec(waiting, 3)]
        assert results[sleeping] == [rec(sleeping, 1), rec(sleeping, 2)]
        assert results[unknown] == [rec(unknown, 1), charged, rec(unknown, 3)]
        assert key(unknown, "charge", 2) == charged["key"]
        flaky = receipt("flaky", 2, key(retrying, "flaky", 2))
        assert results[retrying] == [rec(retrying, 1), flaky]
        assert flaky["key"] == calls(retrying)[2]["key"]
        assert results[mid] == [rec(mid, 1), receipt("slow", 2, key(mid, "slow", 2)),
                                rec(mid, 3)]

        # One journal per run, 1 to N, that begins with the old engine's entries; the same
        # through the public API and through orchestrator.journal.
        for run_id in runs:
            entries = after[run_id]
            assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1)), run_id
            kept = [_entry(e) for e in before[run_id]]
            assert [_entry(e) for e in entries[:len(kept)]] == kept, run_id
            assert len(entries) > len(kept)
            assert [e["kind"] for e in entries].count("run.completed") == 1
            assert entries[-1]["kind"] == "run.completed"
            assert [_entry(e) for e in journal_rows(run_id)] == [_entry(e) for e in entries]
        # Where the entries live (migration 0019): the old engine's call entries stay stored
        # rows; the calls the new engine began write theirs on the operation row.
        for run_id in runs:
            stored = {e["seq"] for e in sql(
                "SELECT seq FROM orchestrator.journal_entries WHERE run_id = %s", (run_id,))}
            old_calls = {e["seq"] for e in before[run_id] if e["kind"].startswith("call.")}
            assert old_calls <= stored, run_id
            on_rows = sql("SELECT o.seq FROM orchestrator.operations o WHERE o.run_id = %s "
                          "AND o.seq IS NOT NULL", (run_id,))
            assert on_rows and all(r["seq"] not in stored for r in on_rows), run_id
        kinds = {r: [e["kind"] for e in after[r]] for r in runs}
        assert "event.received" in kinds[waiting]
        assert kinds[retrying].count("call.retrying") == 1
        assert kinds[unknown].count("call.unknown") == 1

        # The finished runs replay on the new code.
        replayed = json.loads(new.cli("replay", "--app", APP, "--last", "10", "--json").stdout)
        assert (replayed["count"], replayed["ok"]) == (5, 5), replayed
    finally:
        db.close()
