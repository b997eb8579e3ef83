"""``orchestrator console``: a real uvicorn process on loopback, its generated token printed
once, tokens and grants from the command line, and the refusal of a non-loopback address
without a token file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from tests.integration.test_ops_bulk import cli

ROOT = Path(__file__).resolve().parents[2]
SCOPED_APP = "tests.integration.scoped_app:app"  # opA: acme, opB: globex, reader: acme


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serving(url: str, *args: str) -> AsyncIterator[tuple[str, list[str]]]:
    """``orchestrator console`` on a free loopback port: its base URL and what it printed
    before it served (stopped with SIGTERM, which it must survive cleanly)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "--database-url", url, "console", "--port",
        str(port), *args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    printed: list[str] = []
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, (await proc.stderr.read()).decode()
            printed.append(line.rstrip("\n"))
            if line.startswith("sign in with"):
                break
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            for _ in range(300):  # until uvicorn listens (a test signal: the port answers)
                try:
                    await client.get(base + "/login")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
        yield base, printed
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()


async def test_a_generated_token_is_printed_once_and_signs_in(
        migrated_database_url):  # type: ignore[no-untyped-def]
    async with serving(migrated_database_url, "--grant", "operator=read,resolve") as (
            base, printed):
        assert printed[0].startswith(f"orchestrator console on {base}/ for operator")
        assert printed[1] == "  operator: read, resolve"
        token = printed[-1].rsplit(" ", 1)[1]
        assert len(token) >= 32
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/api/runs")).status_code == 401
            session = await client.get("/api/session",
                                       headers={"Authorization": f"Bearer {token}"})
            assert session.status_code == 200
            assert session.json()["operator"] == "operator"
            assert session.json()["grants"] == ["read", "resolve"]
            page = await client.get("/")
            assert page.status_code == 303 and page.headers["location"] == "/login"
            htmx = await client.get("/static/htmx.min.js")
            assert htmx.status_code == 200 and b"htmx" in htmx.content


async def test_an_operator_without_grants_is_told_how_to_act(
        migrated_database_url):  # type: ignore[no-untyped-def]
    # Without --grant the token only reads: the banner says so, and how to resolve and cancel.
    async with serving(migrated_database_url) as (_, printed):
        assert printed[1] == ("  operator: read (only reads; to resolve, cancel and more: "
                              "--grant operator=all)")


async def test_tokens_and_grants_from_a_file_under_the_apps_scopes(
        migrated_database_url, tmp_path):  # type: ignore[no-untyped-def]
    tokens = tmp_path / "tokens"
    tokens.write_text("# the console's operators\nopA aaaaaaaaaaaaaaaaaaaaaaaa\n"
                      "reader rrrrrrrrrrrrrrrrrrrrrrrr\n")
    args = ("--app", SCOPED_APP, "--token-file", str(tokens), "--grant", "opA=all",
            "--grant", "reader=incidents")
    async with serving(migrated_database_url, *args) as (base, printed):
        assert printed[1:] == ["  opA: all", "  reader: incidents",
                               f"sign in with a token of {tokens}"]
        assert not any("aaaa" in line or "rrrr" in line for line in printed)
        async with httpx.AsyncClient(base_url=base) as client:
            shown = await client.get("/api/session",
                                     headers={"Authorization": "Bearer " + "r" * 24})
            assert shown.json()["grants"] == ["incidents", "read"]


@pytest.mark.parametrize(("args", "said"), [
    (["--host", "0.0.0.0"], "without --token-file"),
    (["--host", "192.0.2.1"], "not a loopback address"),
    (["--grant", "alice=read"], "--grant names alice, who has no token"),
    (["--grant", "operator=root"], "'root' (for 'operator') is not a grant"),
    (["--app", SCOPED_APP], "the token's operator 'operator'"),
])
async def test_the_command_refuses_what_it_cannot_serve_safely(
        migrated_database_url, args, said):  # type: ignore[no-untyped-def]
    code, out, err = await cli(migrated_database_url, "console", "--port", str(free_port()),
                               *args)
    assert code == 2 and said in err and out == "", err


async def test_a_stop_ends_the_open_event_streams_and_exits_cleanly(
        migrated_database_url, make_app):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.workflow()
    async def idle(ctx, n):  # type: ignore[no-untyped-def]
        return n

    handle = await app.submit_async("idle", 1)  # queued, and no worker runs: it never ends
    client = httpx.AsyncClient(timeout=30)
    try:
        async with serving(migrated_database_url) as (base, printed):
            token = printed[-1].rsplit(" ", 1)[1]
            request = client.build_request("GET", f"{base}/api/runs/{handle.id}/events",
                                           headers={"Authorization": f"Bearer {token}"})
            stream = await client.send(request, stream=True)
            assert stream.status_code == 200
        # serving's end: SIGTERM while the stream is open; the process exits 0 in time,
        # cutting the stream (a client reconnects to another console with Last-Event-ID)
        with contextlib.suppress(httpx.RemoteProtocolError):
            assert await stream.aread() == b""
    finally:
        await client.aclose()
