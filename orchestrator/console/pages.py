"""The console's pages: server-rendered HTML (Jinja2, autoescaped), htmx for the small things
(filters that apply as they change, the overview refreshing itself, forms without a full
reload). Every page works without JavaScript too.

A page shows the documents the API answers (:mod:`orchestrator.console.documents`), through
the same :class:`~orchestrator.console.service.ConsoleService` calls, so it shows and allows
exactly what the API does. A form's action is a POST with the CSRF token in a hidden field;
after it the browser is sent to the page of what changed (``?done=...`` says what happened).
An action button appears only for an operator whose grants allow it, and the POST behind it is
refused without the grant anyway.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from orchestrator import records
from orchestrator.console import documents
from orchestrator.console.api import (
    RUN_FILTERS,
    id_list,
    int_param,
    operation_param,
    queue_filter,
    text_param,
)
from orchestrator.console.grants import Access
from orchestrator.console.service import INPUT_SHOWN, ConsoleService
from orchestrator.console.web import (
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_TTL,
    Guard,
    public,
    set_cookie,
    status_of,
)
from orchestrator.errors import (
    Forbidden,
    InvalidRequest,
    OperationInProgress,
    OrchestratorError,
    ResolutionConflict,
)
from orchestrator.journal import RUN_ENDS, EventKind
from orchestrator.models import RUN_STATUSES
from orchestrator.operators import AUDIT_TARGET_KINDS, ITEM_STATES, UNRESOLVED
from orchestrator.stream import TERMINAL
from orchestrator.text import is_number

TEMPLATES = Path(__file__).resolve().parent / "templates"

DONE = {
    "committed": "The operation was resolved as committed; its run was woken.",
    "not_applied": "The operation was resolved as not applied; its run was woken.",
    "abandoned": "The operation was abandoned; its run failed with OPERATION_ABANDONED.",
    "noop": "It was already resolved that way; nothing changed.",
    "still_waits": "The operation was resolved; its run still waits for its other unknown "
                   "operations to be settled (its page lists them), and goes on after that.",
    "cancelling": "The operation was resolved; its run was woken and ends cancelled, as was "
                  "requested (nothing is sent again).",
    "ended": "The operation was settled in the ledger; its run had already ended, so nothing "
             "else changed (nothing is sent again).",
    "cancelled": "The run is cancelled.",
    "cancel_requested": "Cancellation requested: the run stops at its next step (a run "
                        "blocked on an unknown operation, once that is reconciled).",
    "finished": "The run had already finished; nothing to cancel.",
    "queue_pause": "The queue is paused: nothing new starts from it; its running runs go on.",
    "queue_resume": "The queue is resumed: its runs start again.",
    "queue_set": "The queue's limits are changed; the workers' next claims use them.",
    "queue_reset": "The queue's limits are back to what the code declares.",
}
"""What ``?done=`` says on the page an action led to (only these texts: never the query's)."""


KINDS = " ".join(kind.value for kind in EventKind)
"""The event names of a run's stream (its entries' kinds): the live timeline listens to each."""
ENDS = " ".join(kind.value for kind in RUN_ENDS)


def when(value: Any) -> str:
    """An ISO time of a document as a page shows it: ``2026-01-02 03:04:05Z``."""
    if not isinstance(value, str):
        return "" if value is None else str(value)
    try:
        moment = datetime.fromisoformat(value).astimezone(UTC)
    except ValueError:
        return value
    return f"{moment:%Y-%m-%d %H:%M:%S}Z"


def age(seconds: Any) -> str:
    """Seconds as ``45s``, ``3m 20s``, ``2h 5m``, ``4d 1h``."""
    if not isinstance(seconds, int | float):
        return ""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def pretty(value: Any, limit: int | None = None) -> str:
    """A JSON value as indented text (escaped by the template like any other text)."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    if limit is not None and len(text) > limit:
        return text[:limit] + f"\n… ({len(text) - limit} more characters: see the API)"
    return text


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES),
                      autoescape=select_autoescape(["html"], default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=when, age=age, pretty=pretty, why=records.why)
    return env


Handler = Callable[[Request, Access], Awaitable[Response]]


CHART_HEIGHT = 60
BAR_WIDTH = 10


def throughput_chart(minutes: list[dict[str, Any]]) -> dict[str, Any]:
    """The overview's chart of finished runs per minute, as an inline SVG's bars: each
    minute a stack (succeeded at the bottom, then failed, then cancelled) scaled to the
    busiest minute, with a title a pointer shows."""
    peak = max((m["succeeded"] + m["failed"] + m["cancelled"] for m in minutes), default=0)
    scale = CHART_HEIGHT / peak if peak else 0.0
    bars = []
    for i, m in enumerate(minutes):
        y = float(CHART_HEIGHT)
        parts = []
        for kind in ("succeeded", "failed", "cancelled"):
            height = m[kind] * scale
            if height:
                y -= height
                parts.append({"kind": kind, "y": round(y, 2), "height": round(height, 2)})
        title = (f"{m['minute'][11:16]} UTC: {m['succeeded']} succeeded, {m['failed']} "
                 f"failed, {m['cancelled']} cancelled")
        bars.append({"x": i * BAR_WIDTH, "width": BAR_WIDTH - 1, "parts": parts,
                     "title": title})
    return {"bars": bars, "width": len(minutes) * BAR_WIDTH, "height": CHART_HEIGHT,
            "peak": peak, "total": sum(m["succeeded"] + m["failed"] + m["cancelled"]
                                       for m in minutes),
            "failed": sum(m["failed"] for m in minutes)}


class Pages:
    """The HTML routes of one console."""

    def __init__(self, service: ConsoleService, guard: Guard) -> None:
        self.service = service
        self.guard = guard
        self.env = environment()

    def routes(self) -> list[Route]:
        page, act = self._page, self._action
        return [
            Route("/", page(self.overview), name="overview"),
            Route("/login", self.login, methods=["GET", "POST"], name="login"),
            Route("/logout", act(self.logout), methods=["POST"]),
            Route("/runs", page(self.runs)),
            Route("/runs/{run_id}", page(self.run)),
            Route("/runs/{run_id}/cancel", act(self.cancel), methods=["POST"]),
            Route("/operations", page(self.queue)),
            Route("/operations/bulk", act(self.bulk), methods=["POST"]),
            Route("/operations/{operation_id}", page(self.operation)),
            Route("/operations/{operation_id}/resolve", act(self.resolve),
                  methods=["POST"]),
            Route("/workers", page(self.workers)),
            Route("/queues", page(self.queues)),
            Route("/queues/{name}", act(self.change_queue), methods=["POST"]),
            Route("/incidents", page(self.incidents)),
            Route("/incidents/{ref}", page(self.incident)),
            Route("/audit", page(self.audit)),
        ]

    # -- plumbing ----------------------------------------------------------------------------

    def _page(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(request, await self.guard.identify(request))

        return endpoint

    def _action(self, handler: Callable[[Request, Access, FormData], Awaitable[Response]]
                ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            access = await self.guard.identify(request)
            form = await request.form()
            given = form.get(CSRF_FIELD)
            self.guard.check_csrf(request, access, given if isinstance(given, str) else None)
            return await handler(request, access, form)

        return endpoint

    def base(self, request: Request) -> str:
        return str(request.scope.get("root_path") or "")

    def render(self, request: Request, template: str, access: Access | None,
               status: int = 200, **context: Any) -> HTMLResponse:
        done = request.query_params.get("done")
        html = self.env.get_template(template).render(
            base=self.base(request), access=access, csrf=self.guard.token_for(request, access),
            csrf_field=CSRF_FIELD, done=DONE.get(done or ""), has_login=self.guard.has_login,
            **context)
        return HTMLResponse(html, status_code=status)

    def error_page(self, request: Request, error: OrchestratorError,
                   access: Access | None = None) -> Response:
        return self.render(request, "error.html", access, status=status_of(error),
                           error=public(error))

    def redirect(self, request: Request, path: str, **query: str) -> RedirectResponse:
        suffix = f"?{urlencode(query)}" if query else ""
        return RedirectResponse(self.base(request) + path + suffix, status_code=303)

    # -- signing in --------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        """The token form: a valid token gets the session cookie and goes to ``next``."""
        target = _local(request.query_params.get("next"))
        if request.method == "GET":
            return self.render(request, "login.html", None, next=target)
        form = await request.form()
        given = form.get(CSRF_FIELD)
        self.guard.check_csrf(request, None, given if isinstance(given, str) else None)
        token = form.get("token")
        token = token.strip() if isinstance(token, str) else ""
        if not self.guard.has_login or self.guard.operator_of_token(token) is None:
            return self.render(request, "login.html", None, status=401, next=target,
                               failed=True)
        response = self.redirect(request, target or "/")
        set_cookie(response, request, SESSION_COOKIE, self.guard.new_session(token),
                   max_age=int(SESSION_TTL))
        return response

    async def logout(self, request: Request, access: Access, form: FormData) -> Response:
        response = self.redirect(request, "/login")
        set_cookie(response, request, SESSION_COOKIE, "", max_age=0)
        return response

    # -- pages -------------------------------------------------------------------------------

    async def overview(self, request: Request, access: Access) -> Response:
        shown = documents.overview(await self.service.overview(access))
        return self.render(request, "overview.html", access, nav="overview", o=shown,
                           statuses=RUN_STATUSES, chart=throughput_chart(shown["throughput"]))

    async def runs(self, request: Request, access: Access) -> Response:
        q = text_param
        given = {name: q(request, name) or "" for name in RUN_FILTERS}
        try:
            page = await self.service.runs(
                access, **{name: value or None for name, value in given.items()},
                before=q(request, "before"), limit=int_param(request, "limit"))
        except InvalidRequest as exc:  # a filter typed wrong: the form again, with why
            return self.render(request, "runs.html", access, status=400, nav="runs",
                               page={"runs": [], "next": None}, given=given,
                               statuses=RUN_STATUSES, next_query=None,
                               filter_failure=public(exc))
        later = ({**{k: v for k, v in given.items() if v}, "before": page.next}
                 if page.next else None)
        return self.render(request, "runs.html", access, nav="runs",
                           page=documents.run_page(page), given=given, statuses=RUN_STATUSES,
                           next_query=urlencode(later) if later else None)

    async def run(self, request: Request, access: Access, *, status: int = 200,
                  error: OrchestratorError | None = None) -> Response:
        view = await self.service.run(access, request.path_params["run_id"])
        shown = documents.run(view)
        return self.render(request, "run.html", access, status=status, nav="runs", r=shown,
                           input_text=pretty(view.input, INPUT_SHOWN), kinds=KINDS, ends=ENDS,
                           failure=None if error is None else public(error))

    async def cancel(self, request: Request, access: Access, form: FormData) -> Response:
        run_id = request.path_params["run_id"]
        try:
            _, after = await self.service.cancel(access, run_id,
                                                 evidence=_field(form, "evidence") or "")
        except (InvalidRequest, ResolutionConflict) as exc:
            return await self.run(request, access, status=status_of(exc), error=exc)
        done = {"cancelled": "cancelled", "succeeded": "finished", "failed": "finished"}
        return self.redirect(request, f"/runs/{run_id}",
                             done=done.get(after, "cancel_requested"))

    async def queue(self, request: Request, access: Access) -> Response:
        given = {name: text_param(request, name) or "" for name in (
            "state", "tool", "older_than", "key", "run", "workflow")}
        state = given["state"] or UNRESOLVED
        page = await self.service.queue(
            access, state=None if state == "all" else state, limit=int_param(request, "limit"),
            after=text_param(request, "after"),
            **queue_filter(lambda name: given.get(name) or None))
        later = ({**{k: v for k, v in given.items() if v}, "after": page.next}
                 if page.next else None)
        return self.render(request, "queue.html", access, nav="queue",
                           q=documents.queue(page), given=given,
                           states=(UNRESOLVED, *ITEM_STATES, "all"),
                           next_query=urlencode(later) if later else None)

    async def bulk(self, request: Request, access: Access, form: FormData) -> Response:
        """Step one (no ``confirmed``): the count and the items, with a confirmation form;
        step two: the action, then what it did to each item. ``selection=ids`` acts on the
        ticked rows (``id``, repeated) instead of the filter."""
        where = {name: _field(form, name) or "" for name in (
            "state", "tool", "older_than", "key", "run", "workflow")}
        by_ids = _field(form, "selection") == "ids"
        ticked = [v for v in form.getlist("id") if isinstance(v, str)] if by_ids else []
        resolution = _field(form, "resolution") or ""
        receipt_text = _field(form, "receipt") or ""
        confirmed = _field(form, "confirmed")
        context: dict[str, Any] = {"nav": "queue", "given": where, "resolution": resolution,
                                   "receipt_text": receipt_text,
                                   "then": _field(form, "then") or "resend",
                                   "evidence": _field(form, "evidence") or "",
                                   "selection": "ids" if by_ids else "filter", "ids": ticked}
        try:
            if by_ids and not ticked:
                raise InvalidRequest("tick at least one operation of the queue", path="ids")
            if by_ids:
                where = dict.fromkeys(where, "")
            summary = await self.service.bulk(
                access, resolution=resolution, evidence=context["evidence"],
                receipt=_receipt(receipt_text) if resolution == "committed" else None,
                then=context["then"] if resolution == "not_applied" else None,
                confirmed=int(confirmed) if confirmed and is_number(confirmed) else None,
                state=where["state"] if where["state"] in ("open", "operator") else UNRESOLVED,
                ids=id_list(ticked) if by_ids else None,
                confirmed_selection=_field(form, "confirmed_selection") or None,
                **queue_filter(lambda name: where.get(name) or None))
        except (InvalidRequest, ResolutionConflict) as exc:
            return self.render(request, "bulk.html", access, status=status_of(exc),
                               failure=public(exc), summary=None, **context)
        shown = documents.bulk(summary)
        if summary.declined:
            what = "selection holds" if by_ids else "filter selects"
            now = (f"{len(summary.matched)} operations now" if str(len(summary.matched))
                   != confirmed else "other operations now (below)")
            failure = {"code": "RESOLUTION_CONFLICT",
                       "message": f"the {what} {now}, not the {confirmed} confirmed; nothing "
                                  "was changed"}
            return self.render(request, "bulk.html", access, status=409, failure=failure,
                               summary=shown, **context)
        return self.render(request, "bulk.html", access, failure=None, summary=shown,
                           outcomes=bulk_outcomes(shown), **context)

    async def operation(self, request: Request, access: Access, *, status: int = 200,
                        error: OrchestratorError | None = None,
                        form: Mapping[str, str] | None = None) -> Response:
        shown = records.item_detail(await self.service.operation(
            access, operation_param(request, frozenset({"bulk"}))))
        return self.render(request, "operation.html", access, status=status, nav="queue",
                           d=shown, failure=None if error is None else public(error),
                           form=form or {})

    async def resolve(self, request: Request, access: Access, form: FormData) -> Response:
        op = request.path_params["operation_id"]
        resolution = _field(form, "resolution") or ""
        entered = {name: _field(form, name) or "" for name in ("receipt", "evidence", "then")}
        try:
            receipt = _receipt(entered["receipt"]) if resolution == "committed" else None
            done = await self.service.settle(
                access, op, resolution=resolution, evidence=entered["evidence"],
                receipt=receipt,
                then=(entered["then"] or "resend") if resolution == "not_applied" else None)
        except (InvalidRequest, ResolutionConflict, OperationInProgress) as exc:
            # Its page again, the refusal a notice on it (a call in flight: what to wait for)
            return await self.operation(request, access, status=status_of(exc), error=exc,
                                        form={**entered, "resolution": resolution})
        run = None if done.run_status is None else (done.run_status, done.cancel_requested)
        others = [] if resolution == "abandoned" else list(done.waits_for)
        return self.redirect(request, f"/operations/{op}",
                             done=_led_to(resolution, done.outcome, run, others))

    async def workers(self, request: Request, access: Access) -> Response:
        shown = [documents.worker(w) for w in await self.service.workers(access)]
        return self.render(request, "workers.html", access, nav="workers", workers=shown)

    async def queues(self, request: Request, access: Access, *, status: int = 200,
                     error: OrchestratorError | None = None) -> Response:
        shown = [documents.queue_doc(q) for q in await self.service.queues(access)]
        return self.render(request, "queues.html", access, status=status, nav="queues",
                           queues=shown, failure=None if error is None else public(error))

    async def change_queue(self, request: Request, access: Access, form: FormData) -> Response:
        name = request.path_params["name"]
        action = _field(form, "action") or ""
        changes: dict[str, Any] = {}
        for limit in ("concurrency", "rate"):
            given = (_field(form, limit) or "").strip()
            if given:
                changes[limit] = None if given.lower() == "none" else (
                    int(given) if limit == "concurrency" and is_number(given) else given)
        try:
            await self.service.change_queue(access, name, action=action,
                                            evidence=_field(form, "evidence") or "",
                                            changes=changes)
        except (InvalidRequest, Forbidden) as exc:
            return await self.queues(request, access, status=status_of(exc), error=exc)
        return self.redirect(request, "/queues", done=f"queue_{action}")

    async def incidents(self, request: Request, access: Access) -> Response:
        page = await self.service.incidents(access, before=text_param(request, "before"),
                                            limit=int_param(request, "limit"))
        return self.render(request, "incidents.html", access, nav="incidents",
                           page=documents.incident_page(page))

    async def incident(self, request: Request, access: Access) -> Response:
        row = records.incident(await self.service.incident(access, request.path_params["ref"]))
        return self.render(request, "incident.html", access, nav="incidents", x=row)

    async def audit(self, request: Request, access: Access) -> Response:
        given = {name: text_param(request, name) or "" for name in (
            "operator", "action", "target", "kind")}
        page = await self.service.audit(access, operator=given["operator"] or None,
                                        action=given["action"] or None,
                                        target=given["target"] or None,
                                        kind=given["kind"] or None,
                                        before=text_param(request, "before"),
                                        limit=int_param(request, "limit"))
        later = ({**{k: v for k, v in given.items() if v}, "before": page.next}
                 if page.next else None)
        return self.render(request, "audit.html", access, nav="audit",
                           page=documents.audit_page(page), given=given,
                           kinds=AUDIT_TARGET_KINDS,
                           next_query=urlencode(later) if later else None)


def bulk_outcomes(shown: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each item of a bulk action's document with what happened to it: ``resolved`` or
    ``skipped`` (its code and why), the selected ones oldest first, then the ids it was given
    but did not select."""
    skipped = {s["operation_id"]: s for s in shown["skipped"]}
    rows = [{**i, "result": "skipped" if i["operation_id"] in skipped else "resolved",
             "code": skipped.get(i["operation_id"], {}).get("code"),
             "reason": skipped.get(i["operation_id"], {}).get("reason")}
            for i in shown["matched"]]
    chosen = {i["operation_id"] for i in shown["matched"]}
    return rows + [{"operation_id": s["operation_id"], "run_id": None, "tool_name": None,
                    "result": "skipped", "code": s["code"], "reason": s["reason"]}
                   for s in shown["skipped"] if s["operation_id"] not in chosen]


def _led_to(resolution: str, outcome: str, run: tuple[str, bool] | None,
            others: list[int]) -> str:
    """The :data:`DONE` key of what a resolution led to, as ``ops resolve`` words it: a run
    that had ended changed nothing but the ledger, one with other unknown operations still
    waits, one whose cancellation was requested ends cancelled (an abandonment fails the run
    in the last two cases too)."""
    status, cancel_requested = run or ("", False)
    if outcome == "noop":
        return "noop"
    if status in TERMINAL:
        return "ended"
    if resolution == "abandoned":
        return resolution
    if others:
        return "still_waits"
    return "cancelling" if cancel_requested else resolution


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _receipt(text: str) -> Any:
    """The receipt typed into a form: it must be valid JSON."""
    if not text.strip():
        raise InvalidRequest("a committed resolution needs the receipt (what the tool "
                             "returned), as JSON", path="receipt")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest("the receipt is not valid JSON", path="receipt") from None


def _local(target: str | None) -> str | None:
    """A ``next`` that stays on this console (a path, never another site)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return None
    return target
