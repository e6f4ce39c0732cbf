"""A web dashboard for the queues: what is queued, running and archived, and the actions to
retry failures, cancel jobs, pause queues and prune the archive.

``create_dashboard(engine)`` returns a plain WSGI application, to mount under any prefix of
a Flask, FastAPI or other app, or to serve with ``sqla-proletarian dashboard``. It needs
Jinja2 (``pip install 'sqla-proletarian[dashboard]'``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from sqla_proletarian.errors import ConfigurationError

__all__ = ["DEFAULT_REFRESH_SECONDS", "DEFAULT_TITLE", "create_dashboard"]

#: The page title unless told otherwise.
DEFAULT_TITLE = "sqla-proletarian"
#: Seconds between the overview's refreshes.
DEFAULT_REFRESH_SECONDS = 5.0


def create_dashboard(
    engine: Engine,
    *,
    read_only: bool = False,
    authorize: Callable[[dict[str, Any]], bool] | None = None,
    title: str = DEFAULT_TITLE,
    secret: bytes | None = None,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    read_engine: Engine | None = None,
) -> Callable[..., Any]:
    """The dashboard of ``engine``'s queues, as a WSGI application.

    ``read_only=True`` hides every action and refuses every POST (403). ``authorize``
    sees each request's WSGI environ and returns whether to serve it (False: 403); put the
    host app's login check there. ``secret`` signs the CSRF tokens: give the same bytes to
    every process that serves the dashboard behind one address (default: random, per
    process). ``refresh_seconds``: how often the overview polls for new figures.

    ``read_engine``: where the pages read from, e.g. a replica (default: ``engine``); the
    actions still write through ``engine``, and every page says how far the replica lags
    (``replica_lag``).
    """
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"create_dashboard() needs a sqlalchemy Engine, not {type(engine).__name__}: it "
            "opens a short connection per request (pass e.g. session.get_bind())"
        )
    if read_engine is not None and not isinstance(read_engine, Engine):
        raise ConfigurationError(
            f"read_engine: give a sqlalchemy Engine on the database to read from (a "
            f"replica), or None to read through engine; not {type(read_engine).__name__}"
        )
    if authorize is not None and not callable(authorize):
        raise ConfigurationError(
            "authorize: give a function that takes the WSGI environ and returns True to "
            "serve the request, or None to serve everyone"
        )
    if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
        raise ConfigurationError("secret: give at least 16 random bytes, e.g. os.urandom(32)")
    if (
        isinstance(refresh_seconds, bool)
        or not isinstance(refresh_seconds, int | float)
        or not 0.1 <= refresh_seconds <= 3600
    ):
        raise ConfigurationError(
            f"refresh_seconds={refresh_seconds!r}: give seconds from 0.1 to 3600 "
            f"(default {DEFAULT_REFRESH_SECONDS})"
        )
    if importlib.util.find_spec("jinja2") is None:
        raise ConfigurationError(
            "the dashboard needs Jinja2: pip install 'sqla-proletarian[dashboard]'"
        )
    from sqla_proletarian.dashboard.app import Dashboard

    return Dashboard(
        engine,
        read_only=bool(read_only),
        authorize=authorize,
        title=str(title),
        secret=secret,
        refresh_seconds=float(refresh_seconds),
        read_engine=read_engine,
    )
