"""Helpers for the console's tests: an HTTP client for one operator, and applications whose
runs park on unknown operations."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn

from orchestrator import Orchestrator, ToolError
from orchestrator.testing import wait_until

SECRET = "sk_live_SECRET"
OPERATOR_HEADER = "X-Test-Operator"  # what the host's authenticate reads in these tests

SCOPES = {"alice": ["acme"], "viewer": ["acme"], "reader": ["acme"], "bob": ["globex"]}
READERS = ["alice", "reader", "bob"]
GRANTS = {"alice": ["read", "resolve", "bulk", "cancel"], "viewer": ["read"],
          "reader": ["read", "incidents"], "bob": ["all"]}
"""alice acts on acme but reads no incidents (no grant); viewer only reads; reader reads
acme's incidents; bob does everything, on globex."""


def from_header(request: Any) -> str | None:
    """The host's authenticate in these tests: the operator named by a header."""
    named = request.headers.get(OPERATOR_HEADER)
    return named if isinstance(named, str) and named else None


class Client:
    """One operator's requests to a console running in this event loop (no server)."""

    def __init__(self, console: Any, operator: str | None) -> None:
        headers = {OPERATOR_HEADER: operator} if operator else {}
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                      base_url="http://console.test", headers=headers,
                                      follow_redirects=False)
        self.csrf: str | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def get(self, path: str, **params: Any) -> httpx.Response:
        return await self.http.get(path, params={k: v for k, v in params.items()
                                                 if v is not None})

    async def token(self) -> str:
        """This operator's CSRF token (``GET /api/session``; its nonce cookie kept)."""
        if self.csrf is None:
            answer = await self.http.get("/api/session")
            assert answer.status_code == 200, answer.text
            self.csrf = answer.json()["csrf_token"]
        assert self.csrf is not None
        return self.csrf

    async def post(self, path: str, body: dict[str, Any], *, csrf: bool = True
                   ) -> httpx.Response:
        headers = {"X-CSRF-Token": await self.token()} if csrf else {}
        return await self.http.post(path, json=body, headers=headers)

    async def form(self, path: str, fields: dict[str, str], *, csrf: bool = True
                   ) -> httpx.Response:
        data = {**fields, "csrf_token": await self.token()} if csrf else dict(fields)
        return await self.http.post(path, data=data)


def uncertain_app(make_app: Callable[..., Orchestrator], **options: Any) -> Orchestrator:
    """``pay(order)`` calls ``charge``, whose first call per order raises a ToolError with a
    secret in its text after sending (outcome unknown) and whose later calls succeed; the
    run parks in needs_reconciliation until someone resolves the operation."""
    options.setdefault("operator_scopes", SCOPES)
    options.setdefault("incident_readers", READERS)
    app = make_app(**options)
    calls: dict[str, int] = {}

    @app.tool(max_attempts=2)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        key = repr(order)
        calls[key] = calls.get(key, 0) + 1
        if calls[key] == 1:
            raise ToolError.after_send("timeout", f"psp said: key {SECRET} rejected at edge")
        return {"charge": f"ch-{key}", "attempt": calls[key]}

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return app


class Served:
    """A console under uvicorn on a free loopback port, in a thread (its own event loop)."""

    def __init__(self, console: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(console, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30, what="uvicorn started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The Server-Sent Events of a streaming response, as they arrive: ``{"id", "event",
    "data"}`` (data parsed as JSON), or ``{"comment": text}`` for a comment line."""
    event: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            yield {"comment": line[1:].strip()}
        elif not line:
            if event:
                yield {**event, "data": json.loads(event["data"])}
                event = {}
        else:
            field, _, value = line.partition(":")
            event[field] = value[1:] if value.startswith(" ") else value
