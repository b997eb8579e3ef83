"""Who sends a request, and whether an action is deliberate: the console's authentication,
sessions and CSRF tokens, and how errors become responses.

Identification, first match wins:

1. ``Authorization: Bearer <token>``, when the console has tokens (the standalone command);
   a wrong token is ``UNAUTHENTICATED``, never a fall-through to the next way.
2. The console's session cookie, which a browser gets on the login page for a valid token.
   It is signed (HMAC-SHA256 with the console's secret), names the operator and the token it
   was given for (a token removed from the file ends its sessions), and lasts
   :data:`SESSION_TTL`.
3. The host's ``authenticate(request)``: the operator's name, or None.

Then the operator needs at least one grant, and, when the application configures operator
scopes, to be one of their operators; otherwise ``FORBIDDEN``.

CSRF. Every action is a POST carrying a token in the form field :data:`CSRF_FIELD` or the
header :data:`CSRF_HEADER`. The token is an HMAC of the operator's name and a binding: for a
browser (a session cookie, or the host's own authentication) a random value the console keeps
in its own cookie (:data:`NONCE_COOKIE`, ``SameSite=Strict``, ``HttpOnly``), so a token is good
for one operator in one browser; for a bearer-token client, the token itself. A POST without
it, or with another's, is ``FORBIDDEN`` before anything is read. ``GET /api/session`` tells a
script its token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.console.grants import Access
from orchestrator.errors import (
    AccessDenied,
    ConfigurationError,
    DatabaseError,
    EventBacklogFull,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    NotFound,
    OperationInProgress,
    OrchestratorError,
    PayloadTooLarge,
    ResolutionConflict,
    RunPruned,
    Unauthenticated,
)
from orchestrator.logs import fields, traceback_text
from orchestrator.text import check_operator

log = logging.getLogger("orchestrator.console")

SESSION_COOKIE = "orchestrator_console_session"
NONCE_COOKIE = "orchestrator_console_nonce"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
SCRIPT_CSRF = ("take csrf_token from GET /api/session (sent with the same bearer token) and "
               f"send it in the {CSRF_HEADER} header of every POST")
"""What a script with a bearer token is told to do when its POST lacks the right CSRF token."""
SESSION_TTL = 12 * 3600.0
"""Seconds a login lasts."""
LOGIN = "\x00login"
"""The name the login form's CSRF token is made for (no operator has it: names hold no NUL)."""

Authenticate = Callable[[Request], "str | None | Awaitable[str | None]"]
T = TypeVar("T")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


class Guard:
    """Identifies each request's operator (:meth:`identify`) and checks CSRF tokens.

    ``tokens`` maps each bearer token to its operator; ``grants_of`` gives an operator's
    grants; ``known(operator)`` raises ``ACCESS_DENIED`` for a name the application's
    operator scopes do not list. ``secret`` signs sessions and CSRF tokens: random per
    process unless given (then every process of a host that shares it accepts the others'
    sessions and tokens)."""

    def __init__(self, *, authenticate: Authenticate | None, tokens: Mapping[str, str],
                 grants_of: Callable[[str], frozenset[str]], known: Callable[[str], object],
                 secret: bytes | None = None) -> None:
        if authenticate is None and not tokens:
            raise ConfigurationError("the console needs a way to identify operators: "
                                     "authenticate= (the host's) or bearer tokens")
        self.authenticate = authenticate
        self.tokens = dict(tokens)
        self.grants_of = grants_of
        self.known = known
        self.secret = secret if secret is not None else secrets.token_bytes(32)

    @property
    def has_login(self) -> bool:
        """Whether browsers sign in on the console's own login page (it has tokens)."""
        return bool(self.tokens)

    def _mac(self, *parts: str) -> str:
        message = "\x00".join(parts).encode()
        return _b64(hmac.new(self.secret, message, hashlib.sha256).digest())

    # -- identification ----------------------------------------------------------------------

    async def identify(self, request: Request) -> Access:
        """The request's operator and grants, else ``UNAUTHENTICATED`` or ``FORBIDDEN``."""
        operator, via = await self._who(request)
        if operator is None:
            raise Unauthenticated("sign in: no valid token or session came with the request")
        try:
            check_operator(operator)
        except InvalidRequest:
            raise Unauthenticated("the host's authenticate() gave an unusable operator "
                                  "name") from None
        grants = self.grants_of(operator)
        if not grants:
            raise Forbidden(f"operator {operator!r} has no grant in this console")
        try:
            self.known(operator)
        except AccessDenied:
            raise Forbidden(f"operator {operator!r} is not configured in this application's "
                            "operator scopes") from None
        return Access(operator=operator, grants=grants, via=via)

    async def _who(self, request: Request) -> tuple[str | None, str]:
        header = request.headers.get("authorization")
        if header is not None and self.tokens:
            scheme, _, value = header.partition(" ")
            if scheme.lower() != "bearer":
                return None, "bearer"
            return self.operator_of_token(value.strip()), "bearer"
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie and self.tokens:
            operator = self._session_operator(cookie)
            if operator is not None:
                return operator, "session"
        if self.authenticate is not None:
            named = await ask_host(self.authenticate, request, str,
                                   "authenticate(request) must return an operator name (a "
                                   "str) or None")
            return named, "host"
        return None, "session"

    def operator_of_token(self, token: str) -> str | None:
        """The operator a bearer token belongs to (compared in constant time), or None."""
        found = None
        for known, operator in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = operator
        return found

    # -- sessions ----------------------------------------------------------------------------

    def new_session(self, token: str) -> str:
        """The session cookie's value for a browser that presented ``token`` (valid)."""
        operator = self.tokens[token]
        issued = str(int(time.time()))
        name = _b64(operator.encode())
        return ".".join((name, issued, _digest(token),
                         self._mac("session", operator, issued, _digest(token))))

    def _session_operator(self, cookie: str) -> str | None:
        try:
            name, issued, digest, mac = cookie.split(".")
            operator = _unb64(name).decode()
            age = time.time() - int(issued)
        except (ValueError, UnicodeDecodeError):
            return None
        if not 0 <= age <= SESSION_TTL:
            return None
        if not hmac.compare_digest(mac, self._mac("session", operator, issued, digest)):
            return None
        if not any(_digest(t) == digest and o == operator for t, o in self.tokens.items()):
            return None  # its token is no longer one of the console's
        return operator

    # -- CSRF --------------------------------------------------------------------------------

    def csrf_token(self, operator: str, binding: str) -> str:
        return self._mac("csrf", operator, binding)

    def binding(self, request: Request, access: Access | None) -> str | None:
        """What a CSRF token is bound to: a bearer client's token, else the browser's nonce."""
        if access is not None and access.via == "bearer":
            return "bearer:" + request.headers.get("authorization", "")
        nonce = request.scope.get("state", {}).get(NONCE_STATE)
        return None if nonce is None else "nonce:" + nonce

    def token_for(self, request: Request, access: Access | None) -> str:
        """The CSRF token this request's forms carry (``access`` None: the login form's)."""
        binding = self.binding(request, access)
        assert binding is not None  # NonceCookies always provides one
        return self.csrf_token(access.operator if access else LOGIN, binding)

    def check_csrf(self, request: Request, access: Access | None, given: str | None) -> None:
        """``FORBIDDEN`` unless ``given`` is this operator's token for this browser/client."""
        binding = self.binding(request, access)
        browser = access is None or access.via != "bearer"
        if browser and request.cookies.get(NONCE_COOKIE) is None:
            binding = None  # a nonce made for this request is no browser's
        # A browser reloads the page for a fresh token; a script with a bearer token has no
        # page: it is told where its token comes from.
        again = SCRIPT_CSRF if not browser else "reload the page and try again"
        if not given or binding is None:
            raise Forbidden(f"the request carries no CSRF token: {again}")
        expected = self.csrf_token(access.operator if access else LOGIN, binding)
        if not hmac.compare_digest(expected.encode(), given.encode()):
            whose = "bearer token" if not browser else "operator and browser"
            raise Forbidden(f"the request's CSRF token is not valid for this {whose}: {again}")


async def ask_host(hook: Callable[[Request], Any], request: Request, kind: type[T],
                   wrong: str) -> T | None:
    """What the host's ``hook(request)`` (sync or async) answers: a ``kind`` or None;
    ``CONFIGURATION_ERROR`` saying ``wrong`` for anything else."""
    named = hook(request)
    if inspect.isawaitable(named):
        named = await named
    if named is not None and not isinstance(named, kind):
        raise ConfigurationError(wrong)
    return named


NONCE_STATE = "console_nonce"


class NonceCookies:
    """ASGI middleware: every request has a CSRF nonce (``scope["state"]``): the browser's
    :data:`NONCE_COOKIE`, or a new one that the response sets."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        nonce = request.cookies.get(NONCE_COOKIE)
        fresh = nonce is None or len(nonce) != 43
        if fresh:
            nonce = _b64(secrets.token_bytes(32))
        scope.setdefault("state", {})[NONCE_STATE] = nonce

        async def sending(message: Message) -> None:
            if fresh and message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                cookie = cookie_header(request, NONCE_COOKIE, nonce or "", max_age=None)
                headers.append((b"set-cookie", cookie.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, sending)


def cookie_path(request: Request) -> str:
    return (request.scope.get("root_path") or "") + "/"


def cookie_header(request: Request, name: str, value: str, *, max_age: int | None) -> str:
    """A ``Set-Cookie`` value for the console's path: ``HttpOnly``, ``SameSite=Strict``,
    ``Secure`` over HTTPS; ``max_age`` None: until the browser closes; 0: delete it."""
    parts = [f"{name}={value}", f"Path={cookie_path(request)}", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if request.url.scheme == "https":
        parts.append("Secure")
    return "; ".join(parts)


def set_cookie(response: Response, request: Request, name: str, value: str, *,
               max_age: int | None) -> None:
    response.raw_headers.append(
        (b"set-cookie", cookie_header(request, name, value, max_age=max_age).encode("latin-1")))


STATUS = [
    (Unauthenticated, 401), (Forbidden, 403), (AccessDenied, 404), (NotFound, 404),
    (PayloadTooLarge, 413),
    (InvalidRequest, 400), (ResolutionConflict, 409), (OperationInProgress, 409),
    (IdempotencyConflict, 409), (RunPruned, 410), (EventBacklogFull, 429), (DatabaseError, 503),
    (ConfigurationError, 500),
]
"""The HTTP status of each public error (the first class that matches); any other is the
console's or the database's trouble, not the request's: 500."""


def status_of(error: OrchestratorError) -> int:
    for kind, status in STATUS:
        if isinstance(error, kind):
            return status
    return 500


UNAVAILABLE = {
    True: "the database is unavailable; try again later",
    False: "the database is unavailable until an operator corrects the cause (the "
           "server's log names it under this incident reference)",
}
"""The message of a 503 (``DatabaseError``: ``DATABASE_UNAVAILABLE``, ``SCHEMA_MISMATCH``) by
``retryable``. The error's own message names the database (its host, port, user and name) for
the operators who read the log, the CLI or the Python API; an HTTP client is told only that it
is unavailable and whether to try again."""
MISCONFIGURED = ("the server is misconfigured (its log names the cause under this incident "
                 "reference)")
"""The message of a 500 ``CONFIGURATION_ERROR``: the deployment's fault (a database role
without its privileges, whose message names the database; a host hook answering the wrong
type), which the log says, not the client."""


def public(error: OrchestratorError) -> dict[str, Any]:
    """The body of an error answer: the public error. A refusal (4xx) records no diagnostics,
    so its ``incident`` is null: a reference that led nowhere would only tell two refusals
    apart (an object out of scope and a missing one answer byte for byte the same). A
    database or configuration error says nothing of where the database lives
    (:data:`UNAVAILABLE`, :data:`MISCONFIGURED`): its own message goes to the log (WARNING),
    under the incident reference the answer shows."""
    shown = error.to_dict()
    if status_of(error) < 500:
        shown["incident"] = None
    elif isinstance(error, (DatabaseError, ConfigurationError)):
        log.warning("console: %s (incident %s): %s", error.code, error.incident, error.message,
                    extra=fields(incident=error.incident, code=error.code))
        shown["message"] = (UNAVAILABLE[error.retryable] if isinstance(error, DatabaseError)
                            else MISCONFIGURED)
    return shown


class Internal(OrchestratorError):
    """An unexpected failure inside the console: its public form says nothing of it."""

    code = "INTERNAL"


def internal(exc: BaseException) -> Internal:
    """The public error for an unexpected exception. The log line (ERROR) names the error's
    incident reference and holds the exception's traceback, for an operator to find the fault
    from the reference a client shows; the exceptions' text is left out of both (it may hold
    anything: :func:`~orchestrator.logs.traceback_text`)."""
    error = Internal("the console failed unexpectedly; the incident reference is in its log")
    log.error("console: unexpected %s (incident %s)\n%s", type(exc).__name__, error.incident,
              traceback_text(exc), extra=fields(incident=error.incident,
                                                cause=type(exc).__name__))
    return error
