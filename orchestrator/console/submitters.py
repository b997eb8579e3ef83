"""The submitters' HTTP API: the owner's Python API (submit, status, result, events, cancel,
the run's stream) over HTTP, for clients in any language (docs/http-api.md).

The host authenticates: ``authenticate_owner(request)`` (sync or async) maps a request to the
:class:`~orchestrator.Owner` it acts for, or None. Every read and action is the owner's, with
the Python API's checks (C1, C9): another owner's run answers 404 exactly as a missing one.

Routes (beside the operators' ``/api/``; the paths they share go to the owner's form when
``authenticate_owner`` names an owner, else to the operator's):

- ``POST /api/runs``: submit; the ``Idempotency-Key`` header is the submission key (C1);
- ``GET /api/runs``: the owner's runs, newest first, a page at a time (shared);
- ``GET /api/runs/{id}``: the run's status (shared);
- ``GET /api/runs/{id}/result?wait=S``: its outcome, waiting up to ``S`` seconds;
- ``POST /api/runs/{id}/events/{name}``: deliver an event (its key: ``event_key`` or the
  ``Idempotency-Key`` header);
- ``POST /api/runs/{id}/cancel``: request cancellation (shared);
- ``GET /api/runs/{id}/events``: the run's stream as Server-Sent Events (shared).

Every POST's body is a JSON object sent as ``Content-Type: application/json``: a browser
cannot send that across sites without asking first, so a host that authenticates owners by a
cookie is not open to forged requests. Every error answers with the public error (``code``,
``message``, ``retryable``, ``incident``) and the status of
:data:`orchestrator.console.web.STATUS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from orchestrator.canonical import JsonLimits
from orchestrator.console.api import (
    MAX_BODY,
    event_cursor,
    json_body,
    sse_response,
    topics_param,
    until_disconnect,
)
from orchestrator.console.service import ConsoleService
from orchestrator.console.web import ask_host
from orchestrator.errors import (
    InvalidRequest,
    ResultTimeout,
    RunFailed,
    Unauthenticated,
)
from orchestrator.flow import MAX_DEADLINE, MAX_HOLD
from orchestrator.handle import RunHandle
from orchestrator.models import Owner, RunInfo, parse_run_id, validate_idempotency_key
from orchestrator.records import error_record, ident, iso
from orchestrator.text import check_identifier, is_number

AuthenticateOwner = Callable[[Request], "Owner | None | Awaitable[Owner | None]"]
Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")

MAX_WAIT = 60
"""Seconds ``GET /api/runs/{id}/result?wait=`` may wait at most."""
SUBMIT_FIELDS = frozenset({"workflow", "version", "input", "deadline", "start_at", "delay",
                           "queue", "priority", "concurrency_key"})
EVENT_FIELDS = frozenset({"payload", "event_key"})
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"


class Submitting(Protocol):
    """What the submitters' API needs of an :class:`~orchestrator.Orchestrator`."""

    json_limits: JsonLimits

    async def _submit_async(self, workflow: Any, input: Any = None, *,
                            version: str | None = None, owner: Owner | None = None,
                            idempotency_key: str | None = None,
                            deadline: timedelta | None = None,
                            start_at: datetime | None = None, delay: timedelta | None = None,
                            queue: str | None = None, priority: int = 0,
                            concurrency_key: str | None = None,
                            connection: Any = None) -> tuple[RunHandle[Any], bool]: ...

    async def get_run_async(self, run_id: Any, *, owner: Owner | None = None
                            ) -> RunHandle[Any]: ...

    async def send_event_async(self, run_id: Any, name: str, payload: Any = None, *,
                               owner: Owner | None = None,
                               event_key: str | None = None) -> bool: ...

    async def cancel_async(self, run_id: Any, *, owner: Owner | None = None) -> str: ...

    async def list_runs_async(self, *, owner: Owner | None = None, status: str | None = None,
                              workflow: str | None = None, limit: int = 50,
                              before: str | None = None) -> list[RunInfo]: ...


def run_record(info: RunInfo) -> dict[str, Any]:
    """A run as its owner sees it over HTTP (no lease, no worker: the owner's view)."""
    return {
        "id": ident(info.id),
        "workflow": info.workflow,
        "version": info.version,
        "tenant": info.owner.tenant,
        "principal": info.owner.principal,
        "status": info.status,
        "outcome_code": info.outcome,
        "error": error_record(info.error),
        "waiting_for": info.waiting_for,
        "revision": info.revision,
        "parent_run_id": ident(info.parent_run_id),
        "cancel_requested": info.cancel_requested,
        "deadline_at": iso(info.deadline_at),
        "start_at": iso(info.start_at),
        "queue": info.queue,
        "priority": info.priority,
        "concurrency_key": info.concurrency_key,
        "created_at": iso(info.created_at),
        "updated_at": iso(info.updated_at),
        "finished_at": iso(info.finished_at),
        "continued_from": ident(info.continued_from),
        "superseded_by": ident(info.superseded_by),
        "pruned_at": iso(info.pruned_at),
    }


def _json_request(request: Request) -> None:
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise InvalidRequest("send the body as a JSON object with Content-Type: "
                             "application/json", path="Content-Type")


def _header_key(request: Request) -> str | None:
    """The ``Idempotency-Key`` header, checked by the rules of every key (C1), a malformed
    one refused naming the header: what the client sent, not the field it stands for."""
    keys = request.headers.getlist(IDEMPOTENCY_HEADER)
    if len(keys) > 1:
        raise InvalidRequest(f"the request has {len(keys)} {IDEMPOTENCY_HEADER} headers; send "
                             "one", path=IDEMPOTENCY_HEADER)
    return validate_idempotency_key(keys[0], IDEMPOTENCY_HEADER) if keys else None


def _deadline(value: Any) -> timedelta | None:
    """``deadline``: seconds from now, a positive finite number (None: no deadline)."""
    if value is None:
        return None
    if (type(value) not in (int, float) or not math.isfinite(value) or value <= 0
            or value > MAX_DEADLINE.total_seconds() or not timedelta(seconds=value)):
        raise InvalidRequest(f"deadline must be a positive number of seconds up to "
                             f"{MAX_DEADLINE.total_seconds():.0f}", path="deadline")
    return timedelta(seconds=value)


def _start_at(value: Any) -> datetime | None:
    """``start_at``: an ISO 8601 time with its offset (``2026-12-24T09:00:00+01:00``)."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) and len(value) <= 64 \
            else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidRequest("start_at must be an ISO 8601 time with a UTC offset",
                             path="start_at")
    return when


def _delay(value: Any) -> timedelta | None:
    """``delay``: seconds from now, a finite number from 0 (the bound is the engine's)."""
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0 \
            or value > MAX_HOLD.total_seconds():
        raise InvalidRequest(f"delay must be a number of seconds from 0 to "
                             f"{MAX_HOLD.total_seconds():.0f}", path="delay")
    return timedelta(seconds=value)


def _wait(request: Request) -> float:
    text = request.query_params.get("wait") or "0"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_WAIT:
        raise InvalidRequest(f"wait must be a number of seconds from 0 to {MAX_WAIT}",
                             path="wait")
    return seconds


class _ClientLeft(Exception):
    """The client closed the connection before the answer was ready."""


CLIENT_LEFT = 499
"""The status of the answer nobody reads: the client closed its connection first (what
proxies log for a request the client gave up on)."""


async def _while_connected(request: Request, waiting: Awaitable[T]) -> T:
    """``waiting``'s value, unless the client closes the connection first: then it is
    cancelled (a long poll stops waiting, and polling, for nobody) and :class:`_ClientLeft`
    raised. A request without a body has nothing else to receive but the disconnect."""
    task = asyncio.ensure_future(waiting)
    watching = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait((task, watching), return_when=asyncio.FIRST_COMPLETED)
        answered = task.done()
    finally:
        for pending in (task, watching):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if not answered:
        raise _ClientLeft
    return task.result()


class Submitters:
    """The submitters' routes of one console (see the module docstring)."""

    def __init__(self, app: Submitting, service: ConsoleService,
                 authenticate_owner: AuthenticateOwner, *, heartbeat: float) -> None:
        self.app = app
        self.service = service
        self.authenticate_owner = authenticate_owner
        self.heartbeat = heartbeat
        self.max_body = max(MAX_BODY, app.json_limits.max_bytes + 64 * 1024)

    def routes(self, operators: Callable[[str, str], Endpoint]) -> list[Route]:
        """The routes; ``operators(path, method)`` is the operators' endpoint of a path both
        serve, called when the request names no owner."""
        def shared(path: str, method: str, mine: Callable[[Request, Owner], Awaitable[Response]]
                   ) -> Route:
            return Route(path, self._either(mine, operators(path, method)), methods=[method])

        return [
            Route("/api/runs", self._only(self.submit), methods=["POST"]),
            shared("/api/runs", "GET", self.runs),
            shared("/api/runs/{run_id}", "GET", self.run),
            Route("/api/runs/{run_id}/result", self._only(self.result), methods=["GET"]),
            Route("/api/runs/{run_id}/events/{name}", self._only(self.send_event),
                  methods=["POST"]),
            shared("/api/runs/{run_id}/cancel", "POST", self.cancel),
            shared("/api/runs/{run_id}/events", "GET", self.events),
        ]

    async def owner(self, request: Request) -> Owner | None:
        """The owner the host's ``authenticate_owner`` names for ``request``, or None."""
        return await ask_host(self.authenticate_owner, request, Owner,
                              "authenticate_owner(request) must return an orchestrator.Owner "
                              "or None")

    def _only(self, handler: Callable[[Request, Owner], Awaitable[Response]]) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            owner = await self.owner(request)
            if owner is None:
                raise Unauthenticated("no owner: the host did not authenticate the request")
            return await handler(request, owner)

        return endpoint

    def _either(self, handler: Callable[[Request, Owner], Awaitable[Response]],
                operators: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            owner = await self.owner(request)
            if owner is None:
                return await operators(request)
            return await handler(request, owner)

        return endpoint

    async def _body(self, request: Request, allowed: frozenset[str]) -> dict[str, Any]:
        _json_request(request)
        return await json_body(request, allowed, limit=self.max_body)

    async def _handle(self, request: Request, owner: Owner) -> RunHandle[Any]:
        return await self.app.get_run_async(parse_run_id(request.path_params["run_id"]),
                                            owner=owner)

    # -- the routes --------------------------------------------------------------------------

    async def submit(self, request: Request, owner: Owner) -> Response:
        """``POST /api/runs``: 201 and the new run, or 200 (``Idempotent-Replayed: true``)
        and the run the same key and request made before; 409 ``IDEMPOTENCY_CONFLICT`` for
        the key with another request; 400 for a malformed key, before anything is written."""
        key = _header_key(request)
        body = await self._body(request, SUBMIT_FIELDS)
        workflow = check_identifier("workflow", body.get("workflow"))
        version = body.get("version")
        if version is not None:
            check_identifier("version", version)
        handle, created = await self.app._submit_async(
            workflow, body.get("input"), version=version, owner=owner,
            idempotency_key=key, deadline=_deadline(body.get("deadline")),
            start_at=_start_at(body.get("start_at")), delay=_delay(body.get("delay")),
            queue=body.get("queue"),
            priority=0 if body.get("priority") is None else body["priority"],
            concurrency_key=body.get("concurrency_key"))
        info = await handle.info_async()
        headers = {"Location": f"{request.scope.get('root_path') or ''}/api/runs/{handle.id}"}
        if not created:
            headers[REPLAYED_HEADER] = "true"
        return JSONResponse(run_record(info), status_code=201 if created else 200,
                            headers=headers)

    async def runs(self, request: Request, owner: Owner) -> Response:
        """``GET /api/runs``: the owner's runs, newest first (``status``, ``workflow``,
        ``limit`` 1 to 1000, default 50), as ``app.list_runs``, from ``before`` (a page's
        ``next``); ``next`` is the cursor of the page after this one, null on the last."""
        limit = request.query_params.get("limit") or "50"
        if not is_number(limit) or len(limit) > 4:
            raise InvalidRequest("limit must be between 1 and 1000", path="limit")
        status = request.query_params.get("status") or None
        workflow = request.query_params.get("workflow") or None
        shown = await self.app.list_runs_async(
            owner=owner, status=status, workflow=workflow, limit=int(limit),
            before=request.query_params.get("before") or None)
        later = None
        if shown and len(shown) == int(limit):  # a full page: is there a run after it?
            more = await self.app.list_runs_async(owner=owner, status=status,
                                                  workflow=workflow, limit=1,
                                                  before=shown[-1].cursor)
            later = shown[-1].cursor if more else None
        return JSONResponse({"runs": [run_record(info) for info in shown],
                             "count": len(shown), "next": later})

    async def run(self, request: Request, owner: Owner) -> Response:
        """``GET /api/runs/{id}``: the owner's run."""
        handle = await self._handle(request, owner)
        return JSONResponse(run_record(await handle.info_async()))

    async def result(self, request: Request, owner: Owner) -> Response:
        """``GET /api/runs/{id}/result?wait=S``: 200 with ``done`` true and the ``result``
        (succeeded) or the public ``error`` (failed, cancelled: its code is the outcome, C13)
        once the run is terminal; 202 with ``done`` false and the current ``status`` when it
        is not after ``S`` seconds (0, the default, answers at once). Waiting changes
        nothing; a client that leaves (closes the connection) ends the wait."""
        wait = _wait(request)
        handle = await self._handle(request, owner)
        run_id = str(handle.id)
        try:
            value = await _while_connected(request, handle.result_async(timeout=wait))
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)  # nobody reads it
        except ResultTimeout as exc:
            return JSONResponse({"run_id": run_id, "done": False, "status": exc.status},
                                status_code=202)
        except RunFailed as exc:
            latest = await handle.latest_async()  # a chain's: where it ended
            # exc.incident is the run's own reference, or None (a cancelled run has none).
            return JSONResponse({"run_id": run_id, "done": True, "status": latest.status,
                                 "result": None, "error": exc.to_dict()})
        return JSONResponse({"run_id": run_id, "done": True, "status": "succeeded",
                             "result": value, "error": None})

    async def send_event(self, request: Request, owner: Owner) -> Response:
        """``POST /api/runs/{id}/events/{name}``: ``delivered`` false when an event with the
        same key was delivered before (C11)."""
        body = await self._body(request, EVENT_FIELDS)
        key = body.get("event_key")
        header = _header_key(request)
        if header is not None and key is not None and header != key:
            raise InvalidRequest("the Idempotency-Key header and event_key differ; give one",
                                 path="event_key")
        name = request.path_params["name"]
        run_id = parse_run_id(request.path_params["run_id"])
        delivered = await self.app.send_event_async(
            run_id, name, body.get("payload"), owner=owner,
            event_key=key if key is not None else header)
        return JSONResponse({"run_id": str(run_id), "name": name, "delivered": delivered})

    async def cancel(self, request: Request, owner: Owner) -> Response:
        """``POST /api/runs/{id}/cancel``: the run's status afterwards."""
        await self._body(request, frozenset())
        handle = await self._handle(request, owner)
        status = await self.app.cancel_async(handle.id, owner=owner)
        return JSONResponse({"run_id": str(handle.id), "status": status})

    async def events(self, request: Request, owner: Owner) -> Response:
        """``GET /api/runs/{id}/events``: the owner's run's stream, as the operators' (the
        cursor from ``Last-Event-ID`` or ``?after=``, ``?topics=``, 204 past a finished
        run's end)."""
        cursor = event_cursor(request)
        topics = topics_param(request)
        handle = await self._handle(request, owner)
        info = await handle.info_async()
        pages = self.service.follow({"id": info.id, "status": info.status,
                                     "revision": info.revision, "pruned_at": info.pruned_at,
                                     "outcome_code": info.outcome},
                                    after=cursor.after, given_as=cursor.given_as,
                                    topics=topics, heartbeat=self.heartbeat)
        return sse_response(pages)
