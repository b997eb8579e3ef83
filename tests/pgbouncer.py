"""PgBouncer in transaction mode in front of the test server (docs/operations.md, "Behind a
connection pooler").

:func:`running` starts Debian's ``pgbouncer`` (``apt-get install pgbouncer``; installed here
when it is missing and this process may) on a free port of 127.0.0.1, with ``pool_mode =
transaction``, a small server pool per database and user (so that the clients' transactions
really take turns on a few server sessions) and ``auth_type = trust``: the user and password
of the server's URL are in its ``auth_file``, the password only for PgBouncer's own login to
the server. Every database of the server is reachable through it (``* = host=… port=…``).
PgBouncer refuses to run as root: under root it is started with ``-u nobody`` (or, for a
server on a Unix socket, ``-u`` the owner of the socket's directory).

:func:`binary` returns None when the program cannot be had; the fixture then skips, saying why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

DEBIAN_PATH = "/usr/sbin/pgbouncer"
POOL_SIZE = 4
"""Server sessions per (database, user): fewer than the clients of a test, so that a client's
next transaction runs on another session than its last."""
START_TIMEOUT = 15.0


def binary() -> str | None:
    """The ``pgbouncer`` program, installed with apt-get when it is missing and this process
    runs as root on a system that has apt-get; None when it cannot be had."""
    found = shutil.which("pgbouncer") or (DEBIAN_PATH if os.path.exists(DEBIAN_PATH) else None)
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (["update", "-qq"], ["install", "-y", "-qq", "pgbouncer"]):
        subprocess.run(["apt-get", *step], env=env, timeout=600, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return shutil.which("pgbouncer") or (DEBIAN_PATH if os.path.exists(DEBIAN_PATH) else None)


@dataclass
class PgBouncer:
    """A running PgBouncer: :meth:`url` is a server URL turned into the same one through it."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes]

    def url(self, direct: str) -> str:
        """``direct`` (a URL of the test server) through PgBouncer: same user, password and
        database; host and port PgBouncer's."""
        parts = urlsplit(direct)
        user = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        query = "&".join(p for p in parts.query.split("&")
                         if p and p.split("=", 1)[0] not in ("host", "port", "hostaddr"))
        return urlunsplit(parts._replace(netloc=netloc, query=query))

    def log(self) -> str:
        return (self.directory / "pgbouncer.log").read_text(errors="replace")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quoted(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def _config(server_url: str, port: int, directory: Path, pool_size: int) -> str:
    info = conninfo_to_dict(server_url)
    host = str(info.get("host") or "127.0.0.1")
    server_port = str(info.get("port") or "5432")
    user = str(info.get("user") or "postgres")
    password = str(info.get("password") or "")
    (directory / "userlist.txt").write_text(f"{_quoted(user)} {_quoted(password)}\n")
    return f"""\
[databases]
* = host={host} port={server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "userlist.txt"}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 1000
server_login_retry = 1
ignore_startup_parameters = extra_float_digits
"""


@contextmanager
def running(server_url: str, *, pool_size: int = POOL_SIZE) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the server of ``server_url`` (a URL with the
    user and password to log in with), until the block ends."""
    program = binary()
    if program is None:
        raise FileNotFoundError("pgbouncer")
    directory = Path(tempfile.mkdtemp(prefix="orch-pgbouncer-"))
    directory.chmod(0o755)  # read by the unprivileged user PgBouncer switches to
    try:
        bouncer = _start(program, server_url, directory, pool_size)
        try:
            yield bouncer
        finally:
            stop(bouncer)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _start(program: str, server_url: str, directory: Path, pool_size: int) -> PgBouncer:
    last = ""
    for _ in range(3):  # another process may take the free port first
        port = _free_port()
        ini = directory / "pgbouncer.ini"
        ini.write_text(_config(server_url, port, directory, pool_size))
        for path in (ini, directory / "userlist.txt"):
            path.chmod(0o644)
        command = [program, *(["-u", _run_as(server_url)] if os.geteuid() == 0 else []),
                   str(ini)]
        with open(directory / "pgbouncer.log", "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        bouncer = PgBouncer(port, directory, process)
        if _ready(bouncer, server_url):
            return bouncer
        last = bouncer.log()
        stop(bouncer)
    raise RuntimeError(f"pgbouncer did not start: {last[-2000:]}")


def _run_as(server_url: str) -> str:
    """The user PgBouncer switches to under root: ``nobody``, or, for a server reached by a
    Unix socket (the embedded one), the owner of the socket's directory, who can reach it."""
    host = str(conninfo_to_dict(server_url).get("host") or "")
    if host.startswith("/") and os.path.isdir(host):
        owner = os.stat(host).st_uid
        if owner != 0:
            return pwd.getpwuid(owner).pw_name
    return "nobody"


def _ready(bouncer: PgBouncer, server_url: str) -> bool:
    url = bouncer.url(server_url)
    give_up = time.monotonic() + START_TIMEOUT
    while time.monotonic() < give_up:
        if bouncer.process.poll() is not None:
            return False
        try:
            with psycopg.connect(url, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            time.sleep(0.1)
    return False


def stop(bouncer: PgBouncer) -> None:
    if bouncer.process.poll() is None:
        bouncer.process.terminate()
        try:
            bouncer.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            bouncer.process.kill()
            bouncer.process.wait()

