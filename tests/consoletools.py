"""Helpers for the console's tests: an HTTP client for one operator, and applications whose
runs park on unknown operations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from orchestrator import Orchestrator, ToolError

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
