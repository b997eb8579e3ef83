"""The console's JSON API under ``/api/``: everything the pages show and do, for scripts and
tests, with the same grants (docs/console.md lists the endpoints and their documents).

Reads are GETs and change nothing; actions are POSTs with a JSON body and the CSRF token in
the ``X-CSRF-Token`` header (``GET /api/session`` gives it). Every error answers with the public
error as its body (``code``, ``message``, ``retryable``, ``incident``) and the status of
:data:`orchestrator.console.web.STATUS`: a run, operation or incident outside the operator's
scope answers 404 exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from orchestrator import records
from orchestrator.console import documents
from orchestrator.console.grants import Access
from orchestrator.console.service import ConsoleService
from orchestrator.console.web import CSRF_HEADER, Guard, internal, public
from orchestrator.errors import (
    InvalidRequest,
    OrchestratorError,
    PayloadTooLarge,
    ResolutionConflict,
)
from orchestrator.models import parse_run_id
from orchestrator.operators import MAX_IDS, UNRESOLVED
from orchestrator.reconcile import Resolved, next_step
from orchestrator.stream import check_topics
from orchestrator.text import is_number

MAX_BODY = 4 * 1024 * 1024
"""Bytes an action's body may have (a receipt is held to the application's own cap after)."""
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
RUN_FILTERS = ("status", "workflow", "version", "submission_key", "tenant", "principal",
               "created_from", "created_to", "input")
"""The filters of a page of runs (``GET /api/runs``, the Runs page), as
:meth:`ConsoleService.runs` names them."""
HEARTBEAT = 15.0
"""Seconds of silence after which a run's event stream sends a comment (proxies keep it)."""
STREAM_ERROR = "stream.error"
"""The event that ends a stream that could not go on: its data is the public error."""

Handler = Callable[[Request, Access], Awaitable[Any]]


def text_param(request: Request, name: str) -> str | None:
    """A query parameter, None when absent or empty (an empty filter is no filter)."""
    value = request.query_params.get(name)
    return value if value else None


def int_param(request: Request, name: str) -> int | None:
    value = text_param(request, name)
    if value is None:
        return None
    if not is_number(value):
        raise InvalidRequest(f"{name} must be a positive integer", path=name)
    return int(value)


def parse_age(text: str | None) -> float | None:
    """An age filter: seconds, or a number with s, m, h or d (``90s``, ``10m``, ``2h``)."""
    if text is None:
        return None
    match = _AGE.fullmatch(text.strip())
    if match is None:
        raise InvalidRequest("older_than must be a number of seconds, or a number with s, m, "
                             "h or d (e.g. 10m)", path="older_than")
    return float(match.group(1)) * _UNITS[match.group(2)]


def queue_filter(source: Callable[[str], str | None]) -> dict[str, Any]:
    """The queue's filters (``tool``, ``older_than``, ``key``, ``run``, ``workflow``) as
    :meth:`ConsoleService.queue` keywords; ``source(name)`` reads one (None: not given). A
    malformed ``run`` is refused under that name, not as the keyword ``run_id``."""
    run = source("run")
    return {"tool": source("tool"), "older_than": parse_age(source("older_than")),
            "key": source("key"), "run_id": None if run is None else str(parse_run_id(run, "run")),
            "workflow": source("workflow")}


BULK_PATHS = frozenset({"resolve-many", "abandon-many"})
"""The paths beside ``/api/operations/{id}`` that take POST only."""


def operation_param(request: Request, post_only: frozenset[str]) -> str:
    """The path's ``operation_id`` as given (the service parses it: ``INVALID_REQUEST`` for
    one that is not an id); a path beside it that takes POST only, asked with GET, is 405
    as for any path served for other methods."""
    given: str = request.path_params["operation_id"]
    if given in post_only:
        raise HTTPException(status_code=405)
    return given


def id_list(value: Any) -> list[int]:
    """A bulk action's ``ids``: operation ids as the documents give them (strings of digits)
    or as JSON numbers; :func:`~orchestrator.operators.check_ids` checks the rest."""
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise InvalidRequest(f"ids must be a list of at most {MAX_IDS} operation ids",
                             path="ids")
    return [int(v) if isinstance(v, str) and is_number(v, 19) else v for v in value]


CANCEL_FIELDS = frozenset({"evidence"})
ABANDON_FIELDS = frozenset({"evidence"})
RESOLVE_FIELDS = frozenset({"resolution", "receipt", "then", "evidence"})
ABANDON_MANY_FIELDS = frozenset({"evidence", "filter", "ids", "limit", "confirmed",
                                 "confirmed_selection"})
RESOLVE_MANY_FIELDS = ABANDON_MANY_FIELDS | {"resolution", "receipt", "then"}
QUEUE_FIELDS = frozenset({"action", "evidence", "concurrency", "worker_concurrency",
                          "key_concurrency", "rate"})
"""The fields each action's body may hold."""


async def json_body(request: Request, fields: frozenset[str], *,
                    limit: int = MAX_BODY) -> dict[str, Any]:
    """An action's body: a JSON object holding only ``fields`` (``INVALID_REQUEST`` otherwise,
    naming the first other field: a misspelt one is never read as absent;
    ``PAYLOAD_TOO_LARGE`` past ``limit`` bytes, read no further)."""
    declared = request.headers.get("content-length", "")
    if is_number(declared) and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        value = json.loads(body or b"{}", object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at line "
                             f"{exc.lineno}, column {exc.colno}") from None
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8: send JSON as UTF-8") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to be read") from None
    except ValueError:  # JSON, but an integer longer than int() reads
        raise InvalidRequest("the request body has an integer of more digits than can be "
                             "read") from None
    if not isinstance(value, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(value) - fields)
    if unknown:
        takes = (f"fields: {', '.join(sorted(fields))}" if fields
                 else "this request takes none: send {}")
        raise InvalidRequest(f"the body has no field {unknown[0]!r} ({takes})", path="body")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the body; one that names a key twice is refused, not read as its
    last value (the other would be dropped without a word)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise InvalidRequest("the request body has an object that names a key twice")
    return value


def _text(body: dict[str, Any], name: str, *, required: bool = False) -> Any:
    value = body.get(name)
    if value is None and required:
        raise InvalidRequest(f"{name} is required", path=name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string", path=name)
    return value


def _need_receipt(body: dict[str, Any], resolution: str | None) -> None:
    """A committed resolution records what the tool returned: the body must give it
    (``"receipt": null`` for a tool that returned nothing), as the page's form and
    ``ops resolve --committed --receipt`` require."""
    if resolution == "committed" and "receipt" not in body:
        raise InvalidRequest("a committed resolution needs the receipt (what the tool "
                             "returned)", path="receipt")


LAST_EVENT_ID = "Last-Event-ID"


class Cursor(NamedTuple):
    """Where a stream starts: ``after`` that ``seq``, as the client gave it (``given_as``:
    the header ``Last-Event-ID`` or the parameter ``after``, which a refusal names)."""

    after: int
    given_as: str


def event_cursor(request: Request) -> Cursor:
    """Where a run's event stream starts: after the ``Last-Event-ID`` header (an
    ``EventSource`` reconnecting sends the last ``id`` it received), else after ``?after=``,
    else from the beginning."""
    resumed = request.headers.get(LAST_EVENT_ID, "").strip()
    if resumed:
        if not is_number(resumed):
            raise InvalidRequest(f"{LAST_EVENT_ID} must be the id (seq) of an event of this "
                                 "stream", path=LAST_EVENT_ID)
        return Cursor(int(resumed), LAST_EVENT_ID)
    return Cursor(int_param(request, "after") or 0, "after")


def topics_param(request: Request) -> tuple[str, ...] | None:
    """``?topics=``: the topic names to keep (``topics=a,b`` or ``topics=a&topics=b``), or
    None for every entry (:func:`orchestrator.stream.check_topics`). Empty items are skipped,
    and a value with no name (``topics=``) is no filter, as every empty filter here is."""
    given = [name.strip() for value in request.query_params.getlist("topics")
             for name in value.split(",")]
    names = [name for name in given if name]
    return check_topics(names) if names else None


def sse_response(pages: AsyncGenerator[list[Any], None] | None) -> Response:
    """A run's stream as ``text/event-stream`` (:class:`EventStream`); 204 when ``pages`` is
    None (the run had ended at or before the cursor: an ``EventSource`` stops reconnecting)."""
    if pages is None:
        return Response(status_code=204)
    return EventStream(pages)


def sse_entry(entry: Mapping[str, Any]) -> str:
    """One journal entry as a Server-Sent Event: ``id`` its seq, ``event`` its kind, ``data``
    its JSON record on one line (JSON escapes every line break inside strings)."""
    data = json.dumps(records.journal_entry(entry), separators=(",", ":"))
    return f"id: {entry['seq']}\nevent: {entry['kind']}\ndata: {data}\n\n"


HEARTBEAT_COMMENT = b": heartbeat\n\n"


class EventStream(Response):
    """The events of ``pages`` (a run's stream whose empty pages are its heartbeats), one
    chunk a page, until the pages end (the run's terminal entry), the client leaves
    (``http.disconnect``), or the stream fails (a last :data:`STREAM_ERROR` event with the
    public error).

    Two tasks for the stream's whole life, one writing and one watching for the client to
    leave, whichever ends first ending the other: nothing is created per event (a stream may
    carry thousands of them, beside hundreds of others in the same process)."""

    media_type = "text/event-stream"

    def __init__(self, pages: AsyncGenerator[list[Any], None]) -> None:
        self.pages = pages
        self.status_code = 200
        self.background = None
        self.init_headers({"X-Accel-Buffering": "no"})  # no body: no content-length

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        writing = asyncio.ensure_future(self._write(send))
        watching = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait((writing, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            with anyio.CancelScope(shield=True):
                for task in (writing, watching):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await self.pages.aclose()
        if not writing.cancelled():
            writing.result()  # the write's own failure (the client's socket, say)

    async def _write(self, send: Any) -> None:
        async def chunk(body: bytes) -> None:
            await send({"type": "http.response.body", "body": body, "more_body": True})

        try:
            async for page in self.pages:
                await chunk("".join(sse_entry(entry) for entry in page).encode()
                            if page else HEARTBEAT_COMMENT)
        except OrchestratorError as exc:
            await chunk(f"event: {STREAM_ERROR}\ndata: {json.dumps(public(exc))}\n\n".encode())
        except Exception as exc:  # noqa: BLE001 - the public error only (C10)
            error = json.dumps(public(internal(exc)))
            await chunk(f"event: {STREAM_ERROR}\ndata: {error}\n\n".encode())
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(receive: Any) -> None:
    """Return once the client has gone (``http.disconnect``); what else arrives is dropped
    (a request whose body was read, or that has none, receives nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Api:
    """The ``/api`` routes of one console."""

    def __init__(self, service: ConsoleService, guard: Guard, *,
                 heartbeat: float = HEARTBEAT) -> None:
        self.service = service
        self.guard = guard
        self.heartbeat = heartbeat

    def routes(self) -> list[Route]:
        get, post = self._get, self._post
        return [
            Route("/api/session", get(self.session)),
            Route("/api/overview", get(self.overview)),
            Route("/api/runs", get(self.runs)),
            Route("/api/runs/{run_id}", get(self.run)),
            Route("/api/runs/{run_id}/events", self.events, methods=["GET"]),
            Route("/api/runs/{run_id}/cancel", post(self.cancel), methods=["POST"]),
            Route("/api/operations", get(self.queue)),
            Route("/api/operations/resolve-many", post(self.resolve_many), methods=["POST"]),
            Route("/api/operations/abandon-many", post(self.abandon_many), methods=["POST"]),
            Route("/api/operations/{operation_id}", get(self.operation)),
            Route("/api/operations/{operation_id}/resolve", post(self.resolve),
                  methods=["POST"]),
            Route("/api/operations/{operation_id}/abandon", post(self.abandon),
                  methods=["POST"]),
            Route("/api/workers", get(self.workers)),
            Route("/api/queues", get(self.queues)),
            Route("/api/queues/{name}", post(self.change_queue), methods=["POST"]),
            Route("/api/incidents", get(self.incidents)),
            Route("/api/incidents/{ref}", get(self.incident)),
            Route("/api/audit", get(self.audit)),
        ]

    def _get(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            access = await self.guard.identify(request)
            return JSONResponse(await handler(request, access))

        return endpoint

    def _post(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            access = await self.guard.identify(request)
            self.guard.check_csrf(request, access, request.headers.get(CSRF_HEADER))
            return JSONResponse(await handler(request, access))

        return endpoint

    # -- reads -------------------------------------------------------------------------------

    async def session(self, request: Request, access: Access) -> Any:
        return documents.session(access, self.guard.token_for(request, access))

    async def overview(self, request: Request, access: Access) -> Any:
        return documents.overview(await self.service.overview(access))

    async def runs(self, request: Request, access: Access) -> Any:
        q = text_param
        page = await self.service.runs(
            access, **{name: q(request, name) for name in RUN_FILTERS},
            before=q(request, "before"), limit=int_param(request, "limit"))
        return documents.run_page(page)

    async def run(self, request: Request, access: Access) -> Any:
        return documents.run(await self.service.run(access, request.path_params["run_id"]))

    async def events(self, request: Request) -> Response:
        """``GET /api/runs/{id}/events``: the run's journal as Server-Sent Events, from the
        cursor (:func:`event_cursor`) to the run's terminal entry. Everything is checked
        before the stream starts (401, 403, 404 as a missing run, 400); a run that had ended
        at or before the cursor answers 204 (an ``EventSource`` then stops reconnecting)."""
        access = await self.guard.identify(request)
        cursor = event_cursor(request)
        pages = await self.service.events(access, request.path_params["run_id"],
                                          after=cursor.after, given_as=cursor.given_as,
                                          topics=topics_param(request),
                                          heartbeat=self.heartbeat)
        return sse_response(pages)

    async def queue(self, request: Request, access: Access) -> Any:
        state = text_param(request, "state") or UNRESOLVED
        page = await self.service.queue(
            access, state=None if state == "all" else state,
            limit=int_param(request, "limit"), after=text_param(request, "after"),
            **queue_filter(lambda name: text_param(request, name)))
        return documents.queue(page)

    async def operation(self, request: Request, access: Access) -> Any:
        shown = await self.service.operation(access, operation_param(request, BULK_PATHS))
        return records.item_detail(shown)

    async def workers(self, request: Request, access: Access) -> Any:
        return {"workers": [documents.worker(w) for w in await self.service.workers(access)]}

    async def queues(self, request: Request, access: Access) -> Any:
        shown = await self.service.queues(access)
        return {"queues": [documents.queue_doc(q) for q in shown], "count": len(shown)}

    async def change_queue(self, request: Request, access: Access) -> Any:
        """``{"action": "pause"|"resume"|"set"|"reset", "evidence": ..., "concurrency": ...,
        "worker_concurrency": ..., "key_concurrency": ..., "rate": "100/s"}``: the queue
        after the change."""
        body = await json_body(request, QUEUE_FIELDS)
        limits: tuple[str, ...] = ("concurrency", "worker_concurrency", "key_concurrency",
                                   "rate")
        changes: dict[str, Any] = {k: body[k] for k in limits if k in body}
        info = await self.service.change_queue(
            access, request.path_params["name"], action=_text(body, "action", required=True),
            evidence=_text(body, "evidence", required=True), changes=changes)
        return documents.queue_doc(info)

    async def incidents(self, request: Request, access: Access) -> Any:
        page = await self.service.incidents(access, before=text_param(request, "before"),
                                            limit=int_param(request, "limit"))
        return documents.incident_page(page)

    async def incident(self, request: Request, access: Access) -> Any:
        return records.incident(await self.service.incident(access,
                                                            request.path_params["ref"]))

    async def audit(self, request: Request, access: Access) -> Any:
        q = text_param
        page = await self.service.audit(access, operator=q(request, "operator"),
                                        action=q(request, "action"),
                                        target=q(request, "target"),
                                        kind=q(request, "kind"),
                                        before=q(request, "before"),
                                        limit=int_param(request, "limit"))
        return documents.audit_page(page)

    # -- actions -----------------------------------------------------------------------------

    async def cancel(self, request: Request, access: Access) -> Any:
        body = await json_body(request, CANCEL_FIELDS)
        before, after = await self.service.cancel(
            access, request.path_params["run_id"],
            evidence=_text(body, "evidence", required=True))
        return {"run_id": request.path_params["run_id"], "before": before, "status": after}

    async def resolve(self, request: Request, access: Access) -> Any:
        body = await json_body(request, RESOLVE_FIELDS)
        resolution = _text(body, "resolution", required=True)
        if resolution == "abandoned":
            raise InvalidRequest("abandon with POST .../abandon", path="resolution")
        _need_receipt(body, resolution)
        op = request.path_params["operation_id"]
        then = _text(body, "then")
        done = await self.service.settle(
            access, op, resolution=resolution, evidence=_text(body, "evidence", required=True),
            receipt=body.get("receipt"), then=then)
        return _resolved(op, resolution, then, done)

    async def abandon(self, request: Request, access: Access) -> Any:
        body = await json_body(request, ABANDON_FIELDS)
        op = request.path_params["operation_id"]
        done = await self.service.settle(
            access, op, resolution="abandoned", evidence=_text(body, "evidence", required=True))
        return _resolved(op, "abandoned", None, done)

    async def resolve_many(self, request: Request, access: Access) -> Any:
        body = await json_body(request, RESOLVE_MANY_FIELDS)
        resolution = _text(body, "resolution", required=True)
        if resolution == "abandoned":
            raise InvalidRequest("abandon many with POST .../abandon-many", path="resolution")
        _need_receipt(body, resolution)
        return await self._bulk(access, body, resolution)

    async def abandon_many(self, request: Request, access: Access) -> Any:
        return await self._bulk(access, await json_body(request, ABANDON_MANY_FIELDS),
                                "abandoned")

    async def _bulk(self, access: Access, body: dict[str, Any], resolution: str) -> Any:
        ids = None if body.get("ids") is None else id_list(body["ids"])
        if ids is not None and body.get("filter") is not None:
            raise InvalidRequest("give ids or a filter, not both", path="ids")
        where = body.get("filter") or {}
        if not isinstance(where, dict):
            raise InvalidRequest("filter must be an object", path="filter")
        unknown = set(where) - {"state", "tool", "older_than", "key", "run", "workflow"}
        if unknown:
            raise InvalidRequest(f"filter has no field {sorted(unknown)[0]!r}", path="filter")

        def field(name: str) -> str | None:
            value = where.get(name)
            if value is not None and not isinstance(value, str | int | float):
                raise InvalidRequest(f"filter.{name} must be a string", path=f"filter.{name}")
            return None if value is None or value == "" else str(value)

        confirmed = body.get("confirmed")
        summary = await self.service.bulk(
            access, resolution=resolution, evidence=_text(body, "evidence", required=True),
            receipt=body.get("receipt"), then=_text(body, "then"), confirmed=confirmed,
            state=field("state") or UNRESOLVED, limit=body.get("limit"), ids=ids,
            confirmed_selection=_text(body, "confirmed_selection"), **queue_filter(field))
        if summary.declined:
            now = (f"{len(summary.matched)} operations now" if len(summary.matched) != confirmed
                   else "other operations now")
            raise ResolutionConflict(
                f"the {'ids select' if ids else 'filter selects'} {now}, not the {confirmed} "
                "confirmed; nothing was changed (ask again without confirmed for the new "
                "selection)")
        return documents.bulk(summary)


def _resolved(op: Any, resolution: str, then: str | None, done: Resolved) -> dict[str, Any]:
    """The answer to one resolution: its ``outcome`` and what follows for its run (``then``,
    ``waits_for``), in the words of ``ops resolve --json`` and of the bulk answers' items."""
    if resolution == "not_applied":
        then = then or "resend"
    step = next_step(resolution, then, done)
    return {"operation_id": str(op), "resolution": resolution, "outcome": done.outcome,
            "then": step,
            "waits_for": [str(o) for o in done.waits_for] if step == "waits" else []}
