"""What keeps the dashboard's actions to its own users: CSRF tokens, same-origin checks, and
the headers every response carries.

A form's token is the HMAC of a random value kept in a cookie of the dashboard's own
(``HttpOnly``, ``SameSite=Strict``), under a secret of the process (or the one given to
``create_dashboard``, for several processes behind one address). A POST is refused unless
its token matches its cookie, and unless its ``Origin`` (or, without one, its ``Referer``)
names the host it was sent to.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from http import HTTPStatus
from urllib.parse import urlsplit

from sqla_proletarian.dashboard.web import HTTPError, Request, Response

#: The cookie that holds the random half of the CSRF token.
CSRF_COOKIE = "sp_dashboard_csrf"
#: The form field that carries the token.
CSRF_FIELD = "csrf_token"

#: Sent with every response: scripts and styles only from the dashboard's own files (none
#: inline), no frames, forms only to itself, no MIME sniffing.
SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
)


class CsrfGuard:
    """Issues and checks the CSRF tokens of one dashboard."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def nonce(self, request: Request) -> tuple[str, bool]:
        """The request's cookie value if it is one of ours, else a new one; and whether it
        is new (the response must then set the cookie)."""
        value = request.cookie(CSRF_COOKIE)
        if value is not None and len(value) == 43 and value.isascii():
            return value, False
        return secrets.token_urlsafe(32), True

    def token(self, nonce: str) -> str:
        """The form token that goes with a cookie value."""
        return hmac.new(self._secret, nonce.encode(), hashlib.sha256).hexdigest()

    def cookie_header(self, request: Request, nonce: str) -> tuple[str, str]:
        path = request.root or "/"
        attributes = f"Path={path}; HttpOnly; SameSite=Strict"
        if request.secure:
            attributes += "; Secure"
        return "Set-Cookie", f"{CSRF_COOKIE}={nonce}; {attributes}"

    def check(self, request: Request) -> None:
        """Refuse a POST whose token does not match its cookie, or that came from a page of
        another site."""
        check_same_origin(request)
        nonce = request.cookie(CSRF_COOKIE)
        sent = request.field(CSRF_FIELD) or ""
        if nonce is None or not hmac.compare_digest(self.token(nonce), sent):
            raise HTTPError(
                HTTPStatus.FORBIDDEN,
                "this form has expired or did not come from this dashboard: reload the page "
                "and try again (the dashboard needs its cookie)",
            )


def check_same_origin(request: Request) -> None:
    """A POST must come from a page of the host it is sent to, when the browser says where
    it came from (``Origin``, else ``Referer``)."""
    host = request.environ.get("HTTP_HOST") or request.environ.get("SERVER_NAME", "")
    origin = request.environ.get("HTTP_ORIGIN") or request.environ.get("HTTP_REFERER")
    if not origin:
        return
    if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
        raise HTTPError(
            HTTPStatus.FORBIDDEN,
            "this form was sent from another site; use the dashboard's own pages",
        )


def secured(response: Response) -> Response:
    """The response with the headers every page carries."""
    response.headers.extend(SECURITY_HEADERS)
    if not any(name == "Cache-Control" for name, _ in response.headers):
        response.headers.append(("Cache-Control", "no-store"))
    return response
