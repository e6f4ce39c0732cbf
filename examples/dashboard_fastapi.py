"""The queue dashboard inside a FastAPI app: mounted under ``/admin/queue``, behind a
middleware that lets only the app's logged-in admins through.

Run it on SQLite (no server; ``pip install uvicorn a2wsgi`` first)::

    uvicorn --factory examples.dashboard_fastapi:from_environment

then open http://127.0.0.1:8000/login, log in with the password ``admin``
(``ADMIN_PASSWORD`` changes it), and the dashboard is at
http://127.0.0.1:8000/admin/queue/. Set ``DATABASE_URL`` for another database (a sync
driver: the dashboard is a WSGI app, run in a thread pool).

The pattern:

* ``create_dashboard(engine)`` is a plain WSGI app; ``a2wsgi.WSGIMiddleware`` makes it an
  ASGI app that ``app.mount`` puts on a prefix, and the dashboard writes every link under
  it. (Starlette's own ``starlette.middleware.wsgi`` works too, but is deprecated and
  warns on import.)
* a mounted app is not reached by FastAPI's dependencies, so the login check is an HTTP
  middleware of the FastAPI app: a request under the prefix from a visitor who is not a
  logged-in admin gets a 403 before it reaches the dashboard. Here the login is a signed
  session cookie (Starlette's ``SessionMiddleware``); use your own authentication there.
"""

from __future__ import annotations

import hmac
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs

import sqlalchemy as sa
from a2wsgi import WSGIMiddleware
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from starlette.middleware.sessions import SessionMiddleware

import sqla_proletarian as sp
from sqla_proletarian.dashboard import create_dashboard

PREFIX = "/admin/queue"
LOGIN_FORM = """<!doctype html><title>Log in</title>
<form method="post"><label>Password <input type="password" name="password"></label>
<button>Log in</button></form>"""


def create_app(database_url: str) -> FastAPI:
    """The app, with the dashboard of ``database_url``'s queues under /admin/queue."""
    engine = sa.create_engine(database_url)
    sp.metadata.create_all(engine)  # in production: the migrations (docs/howto/alembic.md)
    password = os.environ.get("ADMIN_PASSWORD", "admin")
    app = FastAPI()

    @app.get("/login", response_class=HTMLResponse)
    def login_form() -> str:
        return LOGIN_FORM

    @app.post("/login")
    async def login(request: Request) -> Response:
        # The form read by hand: FastAPI's Form() would need python-multipart.
        given = parse_qs((await request.body()).decode()).get("password", [""])[0]
        if not hmac.compare_digest(given, password):
            return HTMLResponse(LOGIN_FORM, status_code=401)
        request.session["admin"] = True
        return RedirectResponse(f"{PREFIX}/", status_code=303)

    @app.middleware("http")
    async def admins_only(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        under = request.url.path == PREFIX or request.url.path.startswith(f"{PREFIX}/")
        if under and not request.session.get("admin"):
            return PlainTextResponse("log in at /login first", status_code=403)
        return await call_next(request)

    # Added last, so it runs first: the session is there for the check above.
    app.add_middleware(
        SessionMiddleware, secret_key=os.environ.get("SECRET_KEY") or os.urandom(32).hex()
    )
    app.mount(PREFIX, WSGIMiddleware(create_dashboard(engine, title="Example app · queues")))  # type: ignore[arg-type]
    app.state.engine = engine
    return app


def from_environment() -> FastAPI:
    """The app on ``DATABASE_URL``, or a SQLite file in the temporary directory."""
    default = f"sqlite:///{Path(tempfile.gettempdir()) / 'sqla_proletarian_dashboard_fastapi.db'}"
    return create_app(os.environ.get("DATABASE_URL") or default)
