"""The database's ceiling: pgbench, one single-row INSERT per transaction (each one commits).

Default durability (the server's ``synchronous_commit`` and ``fsync`` are printed with the
results), a fresh database of its own, prepared statements (pgbench's fastest protocol, so the
denominator is the server's best, not ours).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg  # noqa: TID251 - the ceiling's own table

from bench.common import Server

SCRIPT = "INSERT INTO ceiling (payload) VALUES ('{\"ok\": true}');\n"


def pgbench_once(server: Server, pgbench: str, url: str, clients: int,
                 seconds: float) -> dict[str, Any]:
    parts = urlsplit(url)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(SCRIPT)
    try:
        args = [pgbench, "-n", "-M", "prepared", "-f", script.name, "-c", str(clients),
                "-j", str(min(clients, 2)), "-T", str(max(1, round(seconds))),
                "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432),
                "-U", parts.username or "postgres", parts.path.lstrip("/")]
        env = {"PGPASSWORD": parts.password} if parts.password else None
        done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60,
                              env=None if env is None else {**_environ(), **env})
    finally:
        Path(script.name).unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed: {done.stderr.strip()[-500:]}")
    tps = re.search(r"tps = ([\d.]+)", done.stdout)
    lat = re.search(r"latency average = ([\d.]+) ms", done.stdout)
    if tps is None:
        raise RuntimeError(f"pgbench printed no tps: {done.stdout[-500:]}")
    return {"clients": clients, "tps": float(tps.group(1)),
            "latency_ms": float(lat.group(1)) if lat else None}


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def prepare(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE ceiling (id bigserial PRIMARY KEY, payload jsonb NOT NULL, "
                     "created_at timestamptz NOT NULL DEFAULT now())")


def truncate(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE ceiling")
        try:  # start each repetition without a pending checkpoint, where we may
            conn.execute("CHECKPOINT")
        except psycopg.Error:
            pass
