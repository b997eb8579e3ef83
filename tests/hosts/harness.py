"""The chaos harness with its processes placed on hosts (:mod:`tests.hosts.net`).

:class:`HostsHarness` is :class:`tests.chaos.harness.Harness` whose workers and reconciler run
inside network namespaces, each reaching the database and the sink at its own host's
addresses, optionally with a skewed clock. Its fault phase is a script instead of random
faults: with ``partition`` set, one host's database link is cut once that host's worker holds
runs in flight, for ``partition`` seconds, then healed; what happened is measured into
:class:`PartitionReport`. The invariants are the chaos suite's (:mod:`tests.chaos.checks`):
the partition is recorded as a fault of every process on the cut host, so an unknown it
caused is explained and any other is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import dbtools
from tests.chaos import checks
from tests.chaos.environment import Environment, migrate_to_head
from tests.chaos.harness import (
    ENGINE_DIR,
    Config,
    Harness,
    Result,
    Slot,
    process_env,
    reconciler_command,
    worker_command,
)
from tests.hosts.net import Host, Hosts, cluster_for, host_url

# libpq's own timeouts on every host's connections: a connection across a cut link is given
# up in seconds (and a new one tried) instead of after the kernel's 15 minutes of retransmits.
CLIENT_TIMEOUTS = ("keepalives=1&keepalives_idle=2&keepalives_interval=1&keepalives_count=3"
                   "&tcp_user_timeout=8000&connect_timeout=3")
_LEFT_BEFORE_THE_CUT = ("succeeded", "failed", "cancelled", "waiting")


def on_host(url: str, address: str) -> str:
    url = host_url(url, address)
    return url + ("&" if "?" in url else "?") + CLIENT_TIMEOUTS


@contextlib.contextmanager
def environment(hosts: Hosts, *, idle_transaction_timeout: str = "2s"
                ) -> Iterator[Environment]:
    """A private cluster reachable from every host, with a migrated orchestrator database
    and a sink database on it (the harness itself connects on 127.0.0.1)."""
    with cluster_for(hosts, idle_transaction_timeout=idle_transaction_timeout) as cluster:
        db_url = dbtools.create_database(cluster.admin_url, dbtools.unique_name("hosts"))
        migrate_to_head(db_url)
        sink_url = dbtools.create_database(cluster.admin_url, dbtools.unique_name("hostssink"))
        yield Environment(db_url, sink_url, cluster)


@dataclass
class PartitionReport:
    """What the cut of one host showed."""

    host: int
    worker_id: str = ""
    held: dict[str, int] = field(default_factory=dict)  # run -> lease token at the cut
    cut_at: float = 0.0
    healed_at: float = 0.0
    # run -> s from the cut until its lease ended (put back in the queue, or claimed at once)
    released_after: dict[str, float] = field(default_factory=dict)
    resumed_after: dict[str, float] = field(default_factory=dict)  # claimed: a higher token
    finished_meanwhile: list[str] = field(default_factory=list)  # ended before the cut bit
    late_writes: list[str] = field(default_factory=list)  # old-token writes after takeover
    # the most transactions of the cut host the server still held open at once, and the last
    # moment (s from the cut) it held one
    open_transactions: int = 0
    open_transactions_until: float = 0.0
    back_to_work_after: float | None = None  # s from the heal to its first new claim
    lease_losses_logged: int = 0
    said_lost: list[str] = field(default_factory=list)  # held runs its log names as lost
    # held runs its log never names and nothing of which was written under the held lease:
    # the worker never started them (the reply to their claim was lost in the cut)
    never_started: list[str] = field(default_factory=list)
    worker_restarted: bool = False

    def describe(self) -> str:
        worst = max(self.resumed_after.values(), default=0.0)
        freed = max(self.released_after.values(), default=0.0)
        back = ("never" if self.back_to_work_after is None
                else f"after {self.back_to_work_after:.1f} s")
        return (f"host {self.host} ({self.worker_id}) cut for "
                f"{self.healed_at - self.cut_at:.1f} s holding {len(self.held)} runs; "
                f"{len(self.released_after)} released, the last after {freed:.2f} s; "
                f"{len(self.resumed_after)} resumed elsewhere, the last after {worst:.2f} s "
                f"({', '.join(f'{v:.2f}' for v in sorted(self.resumed_after.values()))}); "
                f"{len(self.finished_meanwhile)} ended before the cut bit; "
                f"late writes of the old holder: {len(self.late_writes)}; back to work "
                f"{back} from the heal; lease losses it logged: {self.lease_losses_logged} "
                f"({len(self.said_lost)} of the runs it held; {len(self.never_started)} it "
                f"never started); "
                f"its transactions the server held open: {self.open_transactions}, the last "
                f"until {self.open_transactions_until:.1f} s after the cut")


class HostsHarness(Harness):
    """``placement[i]``: the host of worker ``i``; the reconciler runs on
    ``reconciler_host``; ``skews``: extra environment per host (a skewed clock)."""

    def __init__(self, cfg: Config, *, hosts: Hosts, env: Environment, placement: list[int],
                 reconciler_host: int, log_dir: Path, skews: dict[int, dict[str, str]] | None
                 = None, partition: float | None = None, partition_host: int = 0,
                 out: Callable[[str], None] = print) -> None:
        cfg.workers = len(placement)
        cfg.fault_weights = {}
        super().__init__(cfg, db_url=env.db_url, sink_url=env.sink_url, log_dir=log_dir,
                         cluster=None, out=out)
        self.hosts = hosts
        self.placement = placement
        self.reconciler_host = reconciler_host
        self.skews = skews or {}
        self.partition = partition
        self.report_partition = PartitionReport(partition_host)
        self.logs: dict[str, list[Path]] = {}

    def host_of(self, slot: Slot) -> Host:
        index = self.placement[slot.index] if slot.role == "worker" else self.reconciler_host
        return self.hosts.hosts[index]

    def _spawn(self, slot: Slot) -> None:
        host = self.host_of(slot)
        env = process_env(on_host(self.db_url, host.db_server),
                          on_host(self.sink_url, host.prov_server), self.cfg.lease_ttl,
                          self.skews.get(host.index))
        cmd = (worker_command(self.cfg.concurrency, self.cfg.lease_ttl)
               if slot.role == "worker" else reconciler_command())
        slot.generation += 1
        log = self.log_dir / f"{slot.name}-host{host.index}-{slot.generation}.log"
        self.logs.setdefault(slot.name, []).append(log)
        with open(log, "wb") as handle:
            slot.proc = subprocess.Popen([*host.prefix(), *cmd], cwd=ENGINE_DIR, env=env,
                                         stdout=handle, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        slot.record = checks.ProcRecord(slot.role, slot.proc.pid, time.time())
        self.records.append(slot.record)
        slot.killed = slot.stopped = False

    # -- the scripted fault: one host cut off, then healed -------------------------------

    async def _inject(self) -> None:
        if self.partition is None:
            return
        rep = self.report_partition
        host = self.hosts.hosts[rep.host]
        slots = [s for s in self.slots if self.host_of(s) is host]
        workers = [s for s in slots if s.role == "worker"]
        started = time.monotonic()
        give_up = started + 60
        while True:
            held: list[dict[str, Any]] = []
            while self.faulting and time.monotonic() < give_up:
                pids = [s.proc.pid for s in workers if s.proc is not None]
                held = await self.sql(
                    "SELECT id::text AS id, lease_token, lease_owner FROM orchestrator.runs "
                    "WHERE status = 'running' AND split_part(lease_owner, ':', 2) = ANY(%s)",
                    ([str(p) for p in pids],))
                # Three runs at once if the host gets them within 10 s, else any: three workers
                # race for a stream of a few runs a second, and on a busy machine the cut host
                # may hold no more than one or two at a time for the whole fault phase.
                if len(held) >= 3 or (held and time.monotonic() - started > 10):
                    break
                await asyncio.sleep(0.05)
            if not held:
                self.notes.append("the partitioned host never held a run")
                return
            first_pids = {s.proc.pid for s in workers if s.proc is not None}
            await asyncio.to_thread(self.hosts.cut, host)
            rep.cut_at = time.time()
            intervals = []
            for slot in slots:
                if slot.record is not None:
                    interval = checks.Interval(rep.cut_at, rep.cut_at + self.partition,
                                               "network cut")
                    slot.record.faults.append(interval)
                    intervals.append(interval)
            # The runs it held at the cut (read again: one may have been claimed meanwhile).
            held = await self.sql(
                "SELECT id::text AS id, lease_token, lease_owner FROM orchestrator.runs WHERE "
                "status = 'running' AND id::text = ANY(%s) AND lease_owner = ANY(%s)",
                ([h["id"] for h in held], [h["lease_owner"] for h in held]))
            if held or time.monotonic() >= give_up:
                break
            # Every run it held ended between the look and the cut (a busy machine makes the
            # cut slow): the cut tests nothing. Heal at once and cut again when it holds some.
            await asyncio.to_thread(self.hosts.heal, host)
            for interval in intervals:
                interval.end = time.time()
            self._log_fault("heal", f"host {rep.host}: the cut caught none of its runs")
            self.notes.append("a cut caught none of the host's runs: healed, cut again")
            await asyncio.sleep(1.0)
        rep.held = {h["id"]: int(h["lease_token"]) for h in held}
        rep.worker_id = held[0]["lease_owner"] if held else ""
        self._log_fault("network cut", f"host {rep.host}: {len(held)} runs held")
        until = time.monotonic() + self.partition
        while time.monotonic() < until:
            rows = await self.sql(
                "SELECT id::text AS id, lease_token, status FROM orchestrator.runs "
                "WHERE id::text = ANY(%s)", (list(rep.held),))
            for row in rows:
                run_id, after = row["id"], time.time() - rep.cut_at
                if run_id in rep.resumed_after or run_id in rep.finished_meanwhile:
                    continue
                if row["lease_token"] > rep.held[run_id]:
                    rep.resumed_after[run_id] = after
                    rep.released_after.setdefault(run_id, after)
                elif row["status"] == "queued":  # released at its lease's end, not claimed yet
                    rep.released_after.setdefault(run_id, after)
                elif row["status"] in _LEFT_BEFORE_THE_CUT:  # its last write landed first
                    rep.finished_meanwhile.append(run_id)
            opened = await self.sql(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE client_addr = %s::inet "
                "AND xact_start IS NOT NULL", (host.address,))
            if opened[0]["n"]:
                rep.open_transactions = max(rep.open_transactions, int(opened[0]["n"]))
                rep.open_transactions_until = time.time() - rep.cut_at
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.hosts.heal, host)
        rep.healed_at = time.time()
        for interval in intervals:
            interval.end = rep.healed_at
        self._log_fault("heal", f"host {rep.host}")
        await self._watch_return(rep, workers, first_pids)

    async def _watch_return(self, rep: PartitionReport, workers: list[Slot],
                            first_pids: set[int]) -> None:
        """After the heal: the host's worker writes a call's intent again (an operation it
        submitted after the heal), in the same process unless it died."""
        give_up = time.monotonic() + 90
        while time.monotonic() < give_up:
            pids = [str(s.proc.pid) for s in workers if s.proc is not None]
            rows = await self.sql(
                "SELECT count(*) AS n FROM orchestrator.operations WHERE submitted_at > "
                "to_timestamp(%s) AND split_part(worker_id, ':', 2) = ANY(%s)",
                (rep.healed_at, pids))
            if rows[0]["n"]:
                rep.back_to_work_after = time.time() - rep.healed_at
                break
            await asyncio.sleep(0.2)
        rep.worker_restarted = {s.proc.pid for s in workers if s.proc is not None} != first_pids

    async def fencing_evidence(self) -> None:
        """Writes under a taken-over run's old token that landed after the new holder's
        first write (the journal and the ledger); must be none."""
        rep = self.report_partition
        for run_id, token in rep.held.items():
            rows = await self.sql(
                "SELECT 'journal seq ' || seq || ' ' || kind AS what FROM orchestrator.journal "
                "WHERE run_id = %s::uuid AND lease_token = %s AND seq > (SELECT min(seq) FROM "
                "orchestrator.journal WHERE run_id = %s::uuid AND lease_token > %s) "
                "UNION ALL SELECT 'operation ' || id || ' submitted' FROM "
                "orchestrator.operations WHERE run_id = %s::uuid AND lease_token = %s AND "
                "submitted_at > (SELECT min(created_at) FROM orchestrator.journal WHERE "
                "run_id = %s::uuid AND lease_token > %s)",
                (run_id, token, run_id, token, run_id, token, run_id, token))
            rep.late_writes += [f"run {run_id}: {r['what']}" for r in rows]
        said = ""
        for log in self.logs.get(f"worker{self.placement.index(rep.host)}", []):
            with contextlib.suppress(OSError):
                said += log.read_text(errors="replace")
        rep.lease_losses_logged = said.count(" lost (")
        for run_id, token in rep.held.items():
            if f"run {run_id}: lease {token} lost (" in said:
                rep.said_lost.append(run_id)
                continue
            wrote = await self.sql(
                "SELECT EXISTS (SELECT 1 FROM orchestrator.journal WHERE run_id = %s::uuid AND "
                "lease_token = %s) OR EXISTS (SELECT 1 FROM orchestrator.operations WHERE "
                "run_id = %s::uuid AND lease_token = %s) AS wrote",
                (run_id, token, run_id, token))
            if run_id not in said and not wrote[0]["wrote"]:
                rep.never_started.append(run_id)

    async def run(self) -> Result:
        result = await super().run()
        if self.partition is not None:
            await self.fencing_evidence()
            with contextlib.suppress(Exception):
                if self._conn is not None:
                    await self._conn.close()
            self.out(self.report_partition.describe())
        return result
