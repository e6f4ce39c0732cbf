"""A Flask app that enqueues jobs in the request's transaction and runs its own worker.

Run it with ``python examples/flask_app.py`` (SQLite, no server), then::

    curl -X POST localhost:5000/signup -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com"}'
    curl localhost:5000/users/ada@example.com

Set ``DATABASE_URL`` to use another database, e.g. the one ``make examples.db.install``
creates: ``DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:25432/proletarian``.

The pattern:

* each request gets one Session (``db_session()``); the view commits it when the work is
  done, and whatever is not committed when the request ends is rolled back. A signup
  writes the user and enqueues the welcome email in that one transaction, so a request
  that fails leaves neither behind;
* ``create_app`` starts the app's QueueWorker and stops it at interpreter exit (atexit);
  the worker is also in ``app.extensions["proletarian_worker"]`` for your own shutdown
  code (and for tests). A web server with several processes starts one worker in each,
  which is safe (workers skip each other's jobs); many deployments prefer one worker
  process of its own instead (``sp.create_queue_worker(...)`` with
  ``install_signal_handlers=True``, then ``worker.wait()``).
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from flask import Flask, abort, current_app, g, jsonify, request
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import sqla_proletarian as sp

log = logging.getLogger("flask_app")


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "flask_example_users"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255), unique=True)
    welcomed: Mapped[bool] = mapped_column(default=False)


# --- Jobs ------------------------------------------------------------------------------------

handlers = sp.JobHandlers()


@handlers.register("send-welcome-email")
def send_welcome_email(job: sp.JobContext) -> None:
    """Send the email (here: log it), and mark the user in the job's own transaction."""
    email = job.payload["email"]
    log.info("sending welcome email to %s (job %s, attempt %d)", email, job.job_id, job.attempts)
    user = job.session.scalar(sa.select(User).where(User.email == email))
    if user is not None:
        user.welcomed = True  # commits with the job's archive row, or not at all


def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    """Three more tries, 1 s, 10 s and 60 s after each failure."""
    return sp.RetryStrategy(retries=3, delays=[1, 10, 60])


# --- The request's transaction ---------------------------------------------------------------


def db_session() -> Session:
    """This request's Session: opened on first use, rolled back and closed when it ends."""
    if "db_session" not in g:
        g.db_session = current_app.extensions["sqlalchemy_sessionmaker"]()
    session: Session = g.db_session
    return session


def close_db_session(exc: BaseException | None) -> None:
    """Teardown: close the request's Session; anything it did not commit is rolled back."""
    session: Session | None = g.pop("db_session", None)
    if session is not None:
        session.close()


# --- The app ---------------------------------------------------------------------------------


def default_database_url() -> str:
    return os.environ.get("DATABASE_URL") or (
        f"sqlite:///{Path(tempfile.gettempdir()) / 'sqla-proletarian-flask-example.db'}"
    )


def create_app(database_url: str | None = None) -> Flask:
    """The app, its database, and a started QueueWorker that is stopped at exit."""
    app = Flask(__name__)
    engine = sa.create_engine(database_url or default_database_url())
    # For the example only; a real application creates its tables with migrations
    # (see docs/howto/alembic.md for the library's own tables).
    Base.metadata.create_all(engine)
    sp.metadata.create_all(engine)

    app.extensions["sqlalchemy_engine"] = engine
    app.extensions["sqlalchemy_sessionmaker"] = sessionmaker(engine)
    app.teardown_appcontext(close_db_session)

    @app.post("/signup")
    def signup() -> Any:
        data = request.get_json(silent=True) or {}
        email = data.get("email")
        if not isinstance(email, str) or "@" not in email:
            abort(400, description="give an email address")
        session = db_session()
        session.add(User(email=email))
        job_id = sp.enqueue(session, "send-welcome-email", {"email": email})
        try:
            session.commit()  # the user and the job, together
        except sa.exc.IntegrityError:
            # The email is taken: the new user row and its job roll back together.
            session.rollback()
            abort(409, description=f"{email} has signed up already")
        return jsonify(email=email, job_id=str(job_id)), 201

    @app.get("/users/<email>")
    def show_user(email: str) -> Any:
        user = db_session().scalar(sa.select(User).where(User.email == email))
        if user is None:
            abort(404)
        return jsonify(email=user.email, welcomed=user.welcomed)

    worker = sp.create_queue_worker(
        engine, handlers, handler_mode="advanced", retry_strategy=retry_strategy
    )
    app.extensions["proletarian_worker"] = worker
    worker.start()
    atexit.register(worker.stop)
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    create_app().run(port=int(os.environ.get("PORT", "5000")))
