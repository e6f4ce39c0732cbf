"""The little of HTTP the dashboard needs, on plain WSGI: a request read from the environ,
a response to send, and the package's static files.

The dashboard's own paths come from ``PATH_INFO``, and every link it writes starts with
``SCRIPT_NAME``, so it works mounted under any prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlencode

#: The most bytes of form data a POST may send (a selection of job ids, a few fields).
MAX_FORM_BYTES = 1024 * 1024

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

#: The files under ``static/`` that are served, and their content types.
STATIC_FILES = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}


class HTTPError(Exception):
    """Ends a request with this status and a message the page shows (as text)."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


class Request:
    """One request: its method, its path inside the dashboard, its query and form fields."""

    def __init__(self, environ: dict[str, Any]) -> None:
        self.environ = environ
        self.method: str = environ.get("REQUEST_METHOD", "GET").upper()
        #: Where the dashboard is mounted ("" at the root), without a trailing slash.
        self.root: str = environ.get("SCRIPT_NAME", "").rstrip("/")
        self.path: str = _wsgi_text(environ.get("PATH_INFO", "")) or "/"
        self.query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        self._form: dict[str, list[str]] | None = None

    def url(self, path: str, **query: str | None) -> str:
        """A link to one of the dashboard's own paths, under its mount point."""
        given = {name: value for name, value in query.items() if value}
        return self.root + path + (f"?{urlencode(given)}" if given else "")

    def arg(self, name: str) -> str | None:
        """A query field, None when missing or blank."""
        values = self.query.get(name)
        return values[0].strip() or None if values else None

    @property
    def form(self) -> dict[str, list[str]]:
        """The POST's urlencoded fields (read once)."""
        if self._form is None:
            self._form = parse_qs(self._body(), keep_blank_values=True)
        return self._form

    def field(self, name: str) -> str | None:
        values = self.form.get(name)
        return values[0].strip() or None if values else None

    def fields(self, name: str) -> list[str]:
        return [value.strip() for value in self.form.get(name, []) if value.strip()]

    def cookie(self, name: str) -> str | None:
        cookies: SimpleCookie = SimpleCookie()
        try:
            cookies.load(self.environ.get("HTTP_COOKIE", ""))
        except CookieError:
            return None
        morsel = cookies.get(name)
        return morsel.value if morsel is not None else None

    @property
    def secure(self) -> bool:
        return self.environ.get("wsgi.url_scheme") == "https"

    def _body(self) -> str:
        kind = self.environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
        if kind not in ("", "application/x-www-form-urlencoded"):
            raise HTTPError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "send the form urlencoded")
        try:
            length = int(self.environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise HTTPError(HTTPStatus.BAD_REQUEST, "the Content-Length is not a number") from None
        if length > MAX_FORM_BYTES:
            raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "the form is too large")
        body: bytes = self.environ["wsgi.input"].read(length) if length > 0 else b""
        return body.decode("utf-8", errors="replace")


@dataclass
class Response:
    """What to send back: a status, headers, and the body."""

    body: bytes = b""
    status: HTTPStatus = HTTPStatus.OK
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __call__(self, start_response: StartResponse) -> list[bytes]:
        headers = [
            ("Content-Type", self.content_type),
            ("Content-Length", str(len(self.body))),
            *self.headers,
        ]
        start_response(f"{self.status.value} {self.status.phrase}", headers)
        return [self.body]


def html(text: str, status: HTTPStatus = HTTPStatus.OK) -> Response:
    return Response(text.encode("utf-8"), status)


def json_response(value: Any) -> Response:
    body = json.dumps(value, separators=(",", ":")).encode("utf-8")
    return Response(body, content_type="application/json")


def redirect(location: str) -> Response:
    """See Other: after a POST, the browser GETs ``location``."""
    return Response(status=HTTPStatus.SEE_OTHER, headers=[("Location", location)])


def static_file(name: str) -> Response:
    """One of the package's static files, cacheable for an hour."""
    content_type = STATIC_FILES.get(name)
    if content_type is None:
        raise HTTPError(HTTPStatus.NOT_FOUND, "no such file")
    body = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(body, content_type=content_type, headers=[("Cache-Control", "max-age=3600")])


def _wsgi_text(value: str) -> str:
    """A WSGI path (bytes as latin-1) as the UTF-8 text it is."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value
