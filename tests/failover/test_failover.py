"""Failover: the primary killed mid-load, the standby promoted, the same workers go on.

Real parts only: two private clusters (a primary and a ``pg_basebackup -R`` standby), worker
and reconciler processes started once with the multi-host URL, a SIGKILL of the primary's
every process, ``pg_ctl promote``, and the effects counted in a sink on another server.

- Synchronous standby: nothing acknowledged is lost, so every run acknowledged finishes exactly
  once, every consequential effect happened exactly once, and the workers that were running
  before the kill finish the work.
- Asynchronous standby: made to lose, on purpose and exactly, what an asynchronous standby can
  lose (the commits acknowledged after the standby stopped receiving), and what the ledger does
  then is pinned down: a lost ``submitted`` means the call is sent again with the same
  idempotency key (a deduplicating provider answers with the first receipt); a ``submitted``
  that survived without its receipt is reconciled by a lookup, never sent again; a lost
  submission is gone, its effect with it at the provider under a key the ledger no longer knows;
  a run whose claim was lost while its worker was in the call is claimed again under the same
  lease token (tokens go back with the lost history), its call sent again under the same key,
  and one of the two executors is refused at its first conflicting write.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.chaos import sink
from tests.failover import app as failover_app
from tests.failover.pair import ReplicatedPair, unavailable_reason
from tests.failover.scenario import (
    Scenario,
    effects_by_key,
    environment,
    last_replicated,
    timings,
)

pytestmark = pytest.mark.timeout(300)

_REASON = unavailable_reason()
if _REASON is not None:  # pragma: no cover - the machine cannot run two clusters
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"failover tests: {_REASON}")]

RUNS = 48


def _submit_paced(scenario: Scenario, acked: dict[str, uuid.UUID], errors: list[BaseException],
                  rate: float) -> None:
    try:
        for i in range(RUNS):
            key = f"order-{i}"
            acked[key] = scenario.submit(failover_app.order, {"n": i, "pause": 0.3}, key)
            time.sleep(1 / rate)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _effects_of(sink_url: str, run: uuid.UUID) -> list[dict[str, object]]:
    return [e for e in sink.load(sink_url)["effects"] if e["run_id"] == run]


@pytest.mark.parametrize("cut_first", [False, True], ids=["kill", "cut-replication-then-kill"])
def test_synchronous_standby_failover_finishes_every_run_once_with_the_same_workers(
        pg_admin_url: str, tmp_path: Path, cut_first: bool) -> None:
    """``cut-replication-then-kill``: the standby stops receiving a second before the primary
    dies (the link between them fails first: an asynchronous standby's worst case). The
    primary's commits then wait for the standby and are never acknowledged, so nothing
    acknowledged is lost even so (with an asynchronous standby this case loses the runs
    submitted in that second, and the test fails)."""
    with environment(pg_admin_url, synchronous=True) as (pair, sink_url):
        scenario = Scenario(pair, sink_url, tmp_path)
        try:
            scenario.start(workers=2)
            pids = {name: proc.pid for name, proc in scenario.procs.items()}
            acked: dict[str, uuid.UUID] = {}
            errors: list[BaseException] = []
            submitter = threading.Thread(target=_submit_paced,
                                         args=(scenario, acked, errors, 16.0))
            submitter.start()
            scenario.wait(lambda: len(sink.load(sink_url)["effects"]) >= 12 and len(acked) >= 12,
                          "the load to be under way")
            if cut_first:
                pair.detach_standby()
                time.sleep(1.0)
            before_kill = dict(acked)
            killed_at = pair.kill_primary()
            pair.promote()
            replicated = last_replicated(pair)
            in_flight = [r["id"] for r in ReplicatedPair.query(
                pair.standby, "SELECT id FROM orchestrator.runs WHERE status = 'running'",
                database="orchestrator")]
            submitter.join(120)
            assert not errors, errors
            ids = list(acked.values())
            lost = set(ids) - set(scenario.statuses(ids))
            assert not lost, f"{len(lost)} acknowledged runs are not on the new primary"
            scenario.wait_finished(ids)
            measured = timings(scenario, killed_at, in_flight, replicated)
            print(f"synchronous failover ({'cut, then ' if cut_first else ''}kill): "
                  f"{len(before_kill)} runs acknowledged before the kill, "
                  f"{len(ids)} in all; {measured}")

            # Every run acknowledged (before, during or after the kill) finished, once.
            statuses = scenario.statuses(ids)
            assert Counter(statuses.values()) == {"succeeded": len(ids)}, statuses
            keys = scenario.sql("SELECT idempotency_key, count(*) AS n FROM orchestrator.runs "
                                "GROUP BY idempotency_key HAVING count(*) > 1")
            assert keys == []
            # Every effect exactly once at the provider, under a key the ledger knows.
            per_call = Counter((e["run_id"], e["tool"]) for e in sink.load(sink_url)["effects"])
            assert set(per_call.values()) == {1}, [k for k, n in per_call.items() if n > 1]
            assert set(per_call) == {(run, tool) for run in ids
                                     for tool in ("pay", "ship", "notify")}
            ledger_keys = {r["idempotency_key"] for r in scenario.sql(
                "SELECT idempotency_key FROM orchestrator.operations")}
            assert set(effects_by_key(sink_url)) <= ledger_keys
            # The same processes did the work after the failover: none exited, and the calls
            # dispatched on the new primary were dispatched by them.
            assert scenario.alive() == dict.fromkeys(pids, True), scenario.logs()
            after = scenario.sql(
                "SELECT DISTINCT w.pid FROM orchestrator.operations o JOIN orchestrator.workers "
                "w ON w.id = o.worker_id WHERE o.submitted_at > to_timestamp(%s)", (killed_at,))
            worker_pids = {p for n, p in pids.items() if n.startswith("worker")}
            assert after and {r["pid"] for r in after} <= worker_pids
            assert measured["first_step"] is not None
        finally:
            scenario.stop()


def test_asynchronous_standby_loses_the_unreplicated_commits_and_the_ledger_says_what_then(
        pg_admin_url: str, tmp_path: Path) -> None:
    with environment(pg_admin_url, synchronous=False) as (pair, sink_url):
        scenario = Scenario(pair, sink_url, tmp_path)
        try:
            scenario.start(workers=1)
            # In flight: its call applied at the provider, then held at the gate.
            held = scenario.submit(failover_app.billing, {"step": "held", "gate": True}, "held")
            # Asleep: its call not yet made (6 s: time enough to stop the standby receiving).
            later = scenario.submit(failover_app.billing, {"step": "later", "sleep": 6}, "later")
            # Asleep too; its call will be made, and held, after the standby stops receiving.
            zombie = scenario.submit(failover_app.billing,
                                     {"step": "zombie", "sleep": 6, "gate": True}, "zombie")
            scenario.wait(lambda: _effects_of(sink_url, held), "the held call")
            scenario.wait(lambda: set(scenario.statuses([later, zombie]).values()) == {"waiting"},
                          "the sleeps")
            pair.wait_replayed()
            pair.detach_standby()
            standby_ops = {r["run_id"]: r["state"] for r in ReplicatedPair.query(
                pair.standby, "SELECT run_id, state FROM orchestrator.operations",
                database="orchestrator")}
            assert standby_ops == {held: "submitted"}, "the standby should hold the held call's "\
                "submitted, and nothing of the sleeping runs' calls"

            # Acknowledged by the primary alone from here on.
            failover_app.open_gate(sink_url, "held")
            lost = scenario.submit(failover_app.billing, {"step": "lost"}, "lost")
            scenario.wait_finished([held, later, lost], timeout=60)
            assert set(scenario.statuses([held, later, lost]).values()) == {"succeeded"}
            scenario.wait(lambda: _effects_of(sink_url, zombie), "the zombie's call")
            first = {key: effects[0]["id"] for key, effects in effects_by_key(sink_url).items()}
            held_key, later_key, lost_key, zombie_key = (
                _effects_of(sink_url, run)[0]["key"] for run in (held, later, lost, zombie))
            zombie_token = scenario.sql("SELECT lease_token FROM orchestrator.runs WHERE id = %s",
                                        (zombie,))[0]["lease_token"]

            pair.kill_primary()
            pair.promote()

            # The acknowledged submission made after the standby stopped receiving is gone; the
            # provider's effect for it stays, under a key the ledger no longer knows.
            assert scenario.sql("SELECT id FROM orchestrator.runs WHERE id = %s", (lost,)) == []
            assert lost_key in first
            # The other two finish again on the new primary, each with its first receipt.
            # The zombie's worker is still in its call, under a lease the new primary has lost;
            # the gate opens once the call was sent a second time (below).
            scenario.wait(lambda: sum(1 for c in sink.load(sink_url)["calls"]
                                      if c["key"] == zombie_key) == 2,
                          "the zombie's call to be sent again")
            failover_app.open_gate(sink_url, "zombie")
            scenario.wait_finished([held, later, zombie], timeout=90)
            runs = {r["id"]: r for r in scenario.sql(
                "SELECT id, status, result FROM orchestrator.runs WHERE id = ANY(%s)",
                ([held, later, zombie],))}
            assert {r["status"] for r in runs.values()} == {"succeeded"}
            found = sink.load(sink_url)
            calls = Counter(c["key"] for c in found["calls"])
            lookups = Counter(lk["key"] for lk in found["lookups"])
            effects = effects_by_key(sink_url)
            # The held call's `submitted` survived without its receipt: reconciled by a lookup,
            # never sent again.
            assert calls[held_key] == 1 and lookups[held_key] >= 1
            assert runs[held]["result"]["effect"] == first[held_key]
            ops = scenario.sql("SELECT state FROM orchestrator.operations WHERE run_id = %s",
                               (held,))
            assert [o["state"] for o in ops] == ["committed"]
            items = scenario.sql("SELECT reason, resolution FROM "
                                 "orchestrator.reconciliation_items WHERE run_id = %s", (held,))
            assert len(items) == 1, items
            # The sleeping run's `submitted` was lost with its receipt: the run replayed and sent
            # the call again under the same idempotency key; the deduplicating provider applied
            # nothing the second time and answered with the first receipt.
            assert calls[later_key] == 2 and len(effects[later_key]) == 1
            assert runs[later]["result"]["effect"] == first[later_key]
            # The zombie's claim was lost too, while its worker was still in the call: the run is
            # claimed again on the new primary under the same lease token (tokens went back with
            # the lost history, so the fence cannot tell the two executors apart) and the call
            # is sent again under the same key while the first executor still waits for its
            # answer. The provider deduplicates, whichever executor writes second is refused,
            # and the run finishes once with the first receipt.
            assert calls[zombie_key] == 2 and len(effects[zombie_key]) == 1
            tokens = scenario.sql("SELECT max(lease_token) AS t FROM orchestrator.journal WHERE "
                                  "run_id = %s", (zombie,))
            assert tokens[0]["t"] == zombie_token  # the token the lost history had handed out
            assert runs[zombie]["result"]["effect"] == first[zombie_key]
            ops = scenario.sql("SELECT state FROM orchestrator.operations WHERE run_id = %s",
                               (zombie,))
            assert [o["state"] for o in ops] == ["committed"]
            assert scenario.alive() == dict.fromkeys(scenario.procs, True), scenario.logs()
        finally:
            scenario.stop()
