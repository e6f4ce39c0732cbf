"""The dashboard's WSGI application: routing, access checks, and rendering pages.

Every request is authorized first (``authorize(environ)``, when given). Every POST is an
action: refused on a read-only dashboard, and checked against CSRF. Errors become a page
that says what happened, as text; a library error (bad input) is a 400 with its message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from datetime import datetime
from http import HTTPStatus
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from sqlalchemy import Engine

from sqla_proletarian.dashboard import actions, views
from sqla_proletarian.dashboard.security import CSRF_FIELD, CsrfGuard, secured
from sqla_proletarian.dashboard.web import (
    HTTPError,
    Request,
    Response,
    StartResponse,
    html,
)
from sqla_proletarian.errors import ProletarianError, polling_error_hint
from sqla_proletarian.logs import logger
from sqla_proletarian.replicas import replica_lag

Authorize = Callable[[dict[str, Any]], bool]
View = Callable[..., Response]

#: The dashboard's paths: (method, pattern of PATH_INFO, view).
ROUTES: tuple[tuple[str, re.Pattern[str], View], ...] = (
    ("GET", re.compile(r"/"), views.overview),
    ("GET", re.compile(r"/api/overview"), views.overview_json),
    ("GET", re.compile(r"/jobs"), views.jobs),
    ("GET", re.compile(r"/jobs/(?P<job_id>[0-9a-fA-F-]{32,36})"), views.job),
    ("POST", re.compile(r"/actions/(?P<name>[a-z]+)"), views.action),
    ("GET", re.compile(r"/static/(?P<name>[A-Za-z0-9_.-]+)"), views.static),
)


class Dashboard:
    """The WSGI application ``create_dashboard`` returns."""

    def __init__(
        self,
        engine: Engine,
        *,
        read_only: bool,
        authorize: Authorize | None,
        title: str,
        secret: bytes | None,
        refresh_seconds: float,
        read_engine: Engine | None = None,
    ) -> None:
        #: Where the actions write; the pages read through ``read_engine``, this one unless
        #: given another (a replica).
        self.engine = engine
        self.read_engine = read_engine if read_engine is not None else engine
        self.reads_replica = read_engine is not None
        self.read_only = read_only
        self.authorize = authorize
        self.title = title
        self.refresh_seconds = refresh_seconds
        self.csrf = CsrfGuard(secret)
        self.templates = Environment(
            loader=PackageLoader("sqla_proletarian.dashboard", "templates"),
            autoescape=True,
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.templates.filters["when"] = _when
        self.templates.filters["first_line"] = _first_line

    @property
    def job_control(self) -> bool:
        """Whether the cancel, pause and resume actions are offered."""
        return not self.read_only and actions.job_control()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        request = Request(environ)
        response = secured(self.respond(request))
        body = response(start_response)
        return [] if request.method == "HEAD" else body

    def respond(self, request: Request) -> Response:
        try:
            if self.authorize is not None and not self.authorize(request.environ):
                raise HTTPError(HTTPStatus.FORBIDDEN, "you may not see this dashboard")
            view, params = self._route(request)
            if request.method == "POST":
                if self.read_only:
                    raise HTTPError(HTTPStatus.FORBIDDEN, "this dashboard is read-only")
                self.csrf.check(request)
            return view(self, request, **params)
        except HTTPError as exc:
            return self.error_page(request, exc.status, exc.message)
        except ProletarianError as exc:
            return self.error_page(request, HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:
            logger.error(
                "dashboard-failed path=%s error=%s",
                request.path,
                type(exc).__name__,
                exc_info=True,
                extra={"event": "dashboard-failed", "path": request.path},
            )
            hint = polling_error_hint(exc)
            message = f"the dashboard failed to answer: {hint or 'the log has the error'}"
            return self.error_page(request, HTTPStatus.INTERNAL_SERVER_ERROR, message)

    def _route(self, request: Request) -> tuple[View, dict[str, str]]:
        method = "GET" if request.method == "HEAD" else request.method
        allowed = False
        for route_method, pattern, view in ROUTES:
            found = pattern.fullmatch(request.path)
            if found is None:
                continue
            if route_method == method:
                return view, found.groupdict()
            allowed = True
        if allowed:
            raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{request.method} is not allowed here")
        raise HTTPError(HTTPStatus.NOT_FOUND, "there is no such page in this dashboard")

    def replica_lag(self) -> dict[str, Any] | None:
        """How far the read engine's server lags, as the pages show it; None when the pages
        read through ``engine`` itself."""
        return replica_lag(self.read_engine).as_dict() if self.reads_replica else None

    def render(
        self, request: Request, template: str, code: HTTPStatus = HTTPStatus.OK, **context: Any
    ) -> Response:
        """A page from a template, with what every page needs (the replica's lag included,
        unless the view read it already), and the CSRF cookie when the browser has none
        yet."""
        if "replica_lag" not in context:
            context["replica_lag"] = self.replica_lag()
        nonce, new = self.csrf.nonce(request)
        page = self.templates.get_template(template).render(
            title=self.title,
            read_only=self.read_only,
            job_control=self.job_control,
            url=request.url,
            csrf_field=CSRF_FIELD,
            csrf_token=self.csrf.token(nonce),
            here=views.here(request),
            notice=views.notice(request),
            **context,
        )
        response = html(page, code)
        if new:
            response.headers.append(self.csrf.cookie_header(request, nonce))
        return response

    def error_page(self, request: Request, status: HTTPStatus, message: str) -> Response:
        return self.render(request, "error.html", status, status=status, message=message)


def _when(value: datetime | None) -> str:
    """A time as the pages show it: UTC, to the second."""
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "—"


def _first_line(text: str | None) -> str:
    """The first line of an error (its type and message), for a list."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""
