"""The queue dashboard inside a Flask app: mounted under ``/admin/queue`` next to the app's
own pages, and shown only to a user whom the app's login marked as an admin.

Run it with ``python examples/dashboard_flask.py`` (SQLite, no server), open
http://127.0.0.1:5000/login, log in with the password ``admin`` (``ADMIN_PASSWORD``
changes it), and the dashboard is at http://127.0.0.1:5000/admin/queue/. Set
``DATABASE_URL`` for another database.

The pattern:

* ``create_dashboard(engine, authorize=...)`` is a plain WSGI app; werkzeug's
  ``DispatcherMiddleware`` (Flask's own toolkit) mounts it on a prefix of the Flask app,
  and the dashboard writes every link under that prefix (``SCRIPT_NAME``);
* ``authorize`` gets each request's WSGI environ before the dashboard answers it. Here it
  opens the Flask session from the request's cookie with the app's own session interface,
  so a user logged in to the app is logged in to the dashboard, and anyone else gets a
  403. Put your real login check there (Flask-Login's user id is in the same session);
* the dashboard's actions (retry, prune, ...) are POSTs with a CSRF token of their own;
  ``read_only=True`` takes them away, e.g. for a second mount that support staff see.
"""

from __future__ import annotations

import hmac
import os
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Flask, redirect, request, session
from werkzeug.middleware.dispatcher import DispatcherMiddleware

import sqla_proletarian as sp
from sqla_proletarian.dashboard import create_dashboard

LOGIN_FORM = """<!doctype html><title>Log in</title>
<form method="post"><label>Password <input type="password" name="password"></label>
<button>Log in</button></form>"""


def create_app(database_url: str | None = None) -> Flask:
    """The app, with the dashboard of ``database_url``'s queues under /admin/queue."""
    app = Flask(__name__)
    app.secret_key = os.environ.get("SECRET_KEY") or os.urandom(32)
    url = database_url or os.environ.get("DATABASE_URL") or _sqlite_url()
    engine = sa.create_engine(url)
    sp.metadata.create_all(engine)  # in production: the migrations (docs/howto/alembic.md)
    password = os.environ.get("ADMIN_PASSWORD", "admin")

    @app.route("/login", methods=["GET", "POST"])
    def login() -> Any:
        if request.method == "GET":
            return LOGIN_FORM
        if not hmac.compare_digest(request.form.get("password", ""), password):
            return LOGIN_FORM, 401
        session["admin"] = True
        return redirect("/admin/queue/")

    @app.post("/logout")
    def logout() -> Any:
        session.clear()
        return redirect("/login")

    def is_admin(environ: dict[str, Any]) -> bool:
        """The Flask session of this request, read as Flask reads it."""
        user_session = app.session_interface.open_session(app, app.request_class(environ))
        return bool(user_session is not None and user_session.get("admin"))

    dashboard = create_dashboard(engine, authorize=is_admin, title="Example app · queues")
    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/admin/queue": dashboard})  # type: ignore[method-assign]
    app.extensions["proletarian_engine"] = engine
    return app


def _sqlite_url() -> str:
    return f"sqlite:///{Path(tempfile.gettempdir()) / 'sqla_proletarian_dashboard_flask.db'}"


if __name__ == "__main__":
    create_app().run(port=5000)
