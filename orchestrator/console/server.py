"""Building the console: :func:`create_console` returns one Starlette ASGI application with the
pages, the JSON API under ``/api/`` and the vendored static files under ``/static/``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.console.api import HEARTBEAT, Api
from orchestrator.console.grants import GrantSource, check_grants
from orchestrator.console.pages import Pages
from orchestrator.console.service import ConsoleService, Host
from orchestrator.console.submitters import AuthenticateOwner, Submitters, Submitting
from orchestrator.console.web import Authenticate, Guard, NonceCookies, internal, public, status_of
from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import (
    ConfigurationError,
    InvalidRequest,
    NotFound,
    OrchestratorError,
    Unauthenticated,
)
from orchestrator.metrics import Metrics

log = logging.getLogger("orchestrator.console")

STATIC = Path(__file__).resolve().parent / "static"
MIN_TOKEN = 16
"""Characters a bearer token has at least."""

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
       "object-src 'none'")
"""Every page's Content-Security-Policy: nothing but the console's own files, no inline
script or style (htmx's own inline style is turned off in its configuration)."""


def create_console(app: Host, *, authenticate: Authenticate | None = None,
                   grants: GrantSource | None = None, tokens: Mapping[str, str] | None = None,
                   secret: bytes | None = None, heartbeat: float = HEARTBEAT,
                   authenticate_owner: AuthenticateOwner | None = None) -> Starlette:
    """The operator console of ``app`` (an :class:`~orchestrator.Orchestrator`), an ASGI
    application to mount in a host's web app or to serve on its own (``orchestrator
    console``); see docs/console.md.

    ``authenticate(request)`` (sync or async) names the operator of a request, or None; the
    host does the authenticating. ``tokens`` maps operator names to bearer tokens (the
    standalone console: API clients send ``Authorization: Bearer <token>``, browsers trade it
    for a session cookie on the login page). At least one of the two is required.

    ``grants``: operator name → grants (:data:`~orchestrator.console.grants.GRANTS`, or
    ``"all"``), or a function of the name; None lets every identified operator read and do
    nothing else. Tenant scopes and incident readers are the application's
    (``operator_scopes``, ``incident_readers``).

    ``secret`` signs sessions and CSRF tokens; give every process of a host the same one
    (random per process otherwise, so a restart signs everyone out).

    ``heartbeat``: seconds of silence after which a run's event stream
    (``GET /api/runs/{id}/events``) sends a comment, so that proxies keep it open.

    ``authenticate_owner(request)`` (sync or async) names the :class:`~orchestrator.Owner` a
    request acts for, or None: given, the console also serves the submitters' API
    (:mod:`orchestrator.console.submitters`, docs/http-api.md); on the paths both APIs
    serve, a request it names an owner for is the owner's. With it alone (no
    ``authenticate``, no ``tokens``) no operator can sign in.
    """
    if type(heartbeat) not in (int, float) or not heartbeat > 0:
        raise ConfigurationError("heartbeat must be a positive number of seconds")
    if authenticate_owner is not None and not callable(authenticate_owner):
        raise ConfigurationError("authenticate_owner must be a function of the request")
    if authenticate is None and not tokens and authenticate_owner is not None:
        authenticate = _nobody  # the submitters' API alone: every operator request is 401
    operators = app.operators
    guard = Guard(authenticate=authenticate, tokens=_tokens(tokens),
                  grants_of=check_grants(grants), known=operators.tenants_of, secret=secret)
    service = ConsoleService(operators)
    pages = Pages(service, guard)
    api = Api(service, guard, heartbeat=heartbeat)

    async def failed(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OrchestratorError)
        return _error_response(request, exc, pages)

    async def not_routed(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        allowed = _allowed(routes, request) if exc.status_code == 405 else ""
        error = _unrouted(request, exc.status_code, allowed)
        response: Response
        if _route_path(request).startswith("/api/"):
            response = JSONResponse(public(error), status_code=exc.status_code)
        else:
            response = pages.render(request, "error.html", None, status=exc.status_code,
                                    error=public(error))
        if allowed:
            response.headers["Allow"] = allowed  # what HTTP requires of a 405
        return response

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await service.streams.close()  # this event loop's poller, if one runs
        await operators.db.close()  # this event loop's pool (a mounted console has none)

    operator_routes = api.routes()
    submitter_routes = ([] if authenticate_owner is None else Submitters(
        _submitting(app), service, authenticate_owner, heartbeat=heartbeat).routes(
            lambda path, method: _endpoint(operator_routes, path, method)))
    scrape = _MetricsPage(app.target, operators.metrics, guard)
    routes = [*submitter_routes, *operator_routes, *pages.routes(),
              Route("/metrics", scrape.scrape, methods=["GET"]),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    return Starlette(
        routes=routes,
        middleware=[Middleware(_Headers), Middleware(_Boundary), Middleware(NonceCookies)],
        exception_handlers={OrchestratorError: failed, HTTPException: not_routed},
        lifespan=lifespan)


class _MetricsPage:
    """``GET /metrics``: the counters of this process (what operators and owners did through
    the console: resolutions, cancellations, submissions) and the gauges read from the
    database (:mod:`orchestrator.telemetry`'s ``DatabaseCollector``: unknown operations, the
    operator queue, queued runs), in the Prometheus text format, or OpenMetrics when asked,
    for an operator with the ``metrics`` grant (a scraper's bearer token). They count every
    tenant's work, so no tenant scope applies: the grant says who may see them. Workers and
    reconcilers serve their own counters (``--metrics-port``)."""

    def __init__(self, target: DatabaseTarget, metrics: Metrics, guard: Guard) -> None:
        self.target = target
        self.metrics = metrics
        self.guard = guard
        self._registry: Any = None

    async def scrape(self, request: Request) -> Response:
        access = await self.guard.identify(request)
        access.need("metrics")
        from prometheus_client.exposition import choose_encoder

        from orchestrator import telemetry

        if self._registry is None:
            self._registry = telemetry.metrics_registry(self.metrics, self.target)
        encoder, media_type = choose_encoder(request.headers.get("accept", ""))
        body = await anyio.to_thread.run_sync(encoder, self._registry)
        return Response(body, media_type=media_type)


def _submitting(app: Host) -> Submitting:
    if not callable(getattr(app, "_submit_async", None)):
        raise ConfigurationError("the submitters' API needs an orchestrator.Orchestrator")
    return cast(Submitting, app)


def _nobody(request: Request) -> None:
    return None


async def _no_route(request: Request) -> Response:
    raise HTTPException(status_code=405)


def _endpoint(routes: list[Route], path: str, method: str
              ) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint ``routes`` serve ``method`` on ``path`` with (405 when none)."""
    for route in routes:
        if route.path == path and route.methods is not None and method in route.methods:
            endpoint: Callable[[Request], Awaitable[Response]] = route.endpoint
            return endpoint
    return _no_route


def _tokens(tokens: Mapping[str, str] | None) -> dict[str, str]:
    """``tokens`` (operator → token) as token → operator, each token checked."""
    if tokens is None:
        return {}
    if not isinstance(tokens, Mapping):
        raise ConfigurationError("tokens must map operator names to bearer tokens")
    found: dict[str, str] = {}
    for operator, token in tokens.items():
        if (not isinstance(token, str) or len(token) < MIN_TOKEN or not token.isascii()
                or not token.isprintable() or " " in token):
            raise ConfigurationError(f"the token of {operator!r} must be at least {MIN_TOKEN} "
                                     "printable ASCII characters without spaces")
        if token in found:
            raise ConfigurationError("two operators have the same token")
        found[token] = operator
    return found


def _allowed(routes: list[BaseRoute], request: Request) -> str:
    """The methods the request's path takes (``Allow``), from every route that serves it
    for other methods (two routes serve a path both APIs share); "" when none does."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods \
                and route.matches(request.scope)[0] == Match.PARTIAL:
            methods |= route.methods
    methods.discard(request.method)
    return ", ".join(sorted(methods))


def _unrouted(request: Request, status: int, allowed: str = "") -> OrchestratorError:
    """The public error of a request no route serves: ``NOT_FOUND`` for a path the console
    does not serve (404), ``INVALID_REQUEST`` for one it serves for other methods (405),
    naming them when they are known (``allowed``)."""
    if status == 404:
        where = "API path" if _route_path(request).startswith("/api/") else "page"
        return NotFound(f"no such {where}: {request.method} {_route_path(request)[:200]!r}")
    return InvalidRequest(f"{request.method} is not allowed here: this path takes "
                          f"{allowed or 'other methods'}")


def _route_path(request: Request) -> str:
    path: str = request.scope["path"]
    root: str = request.scope.get("root_path") or ""
    return path[len(root):] if root and path.startswith(root) else path


def _error_response(request: Request, error: OrchestratorError, pages: Pages) -> Response:
    path = _route_path(request)
    if path.startswith("/api/"):
        return JSONResponse(public(error), status_code=status_of(error))
    if isinstance(error, Unauthenticated) and pages.guard.has_login:
        target = path + (f"?{request.url.query}" if request.url.query else "")
        query = urlencode({"next": target}) if request.method == "GET" and path != "/" else ""
        return RedirectResponse(pages.base(request) + "/login" + (f"?{query}" if query else ""),
                                status_code=303)
    return pages.error_page(request, error)


class _Boundary:
    """ASGI middleware: an unexpected exception becomes the public ``INTERNAL`` error (its
    type and incident reference in the log, its text nowhere)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if scope["type"] != "http" or started:
                raise
            error = internal(exc)
            response = JSONResponse(error.to_dict(), status_code=500)
            await response(scope, receive, send)


class _Headers:
    """ASGI middleware: the security headers on every response; pages and API answers are
    never cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = "/static/" in scope["path"]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []),
                           (b"x-content-type-options", b"nosniff"),
                           (b"x-frame-options", b"DENY"),
                           (b"referrer-policy", b"same-origin"),
                           (b"content-security-policy", CSP.encode())]
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, sending)
