"""A Flask-SQLAlchemy 3.1 app: jobs enqueued with ``db.session``, run with ``db.engine``.

Run it on SQLite (no server) in two terminals::

    flask --app examples/flask_sqlalchemy_app.py run          # the web app, port 5000
    flask --app examples/flask_sqlalchemy_app.py run-jobs     # its worker, until Ctrl-C

or, for the worker, the library's command-line worker (its flags, ``--processes``, exit
statuses), with each job inside the app's context::

    cd examples && sqla-proletarian worker 'flask_sqlalchemy_app:create_handlers()'

then::

    curl -X POST localhost:5000/orders -H 'content-type: application/json' -d '{"item": "tea"}'
    curl localhost:5000/orders/1

``flask ... run-jobs --until-empty`` runs the due jobs one by one and exits (from cron, or a
test). Set ``DATABASE_URL`` for another database, e.g. the one ``make examples.db.install``
creates: ``DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:25432/proletarian``.

What is particular to Flask-SQLAlchemy:

* ``db.session`` is a ``scoped_session``; pass it to ``sp.enqueue`` as it is. The job joins
  the request's session and commits with ``db.session.commit()``. Flask-SQLAlchemy removes
  the session when the request ends, so whatever a view did not commit (a view that aborts
  or raises) is rolled back, the job included;
* the library's tables are on their own MetaData (``sp.metadata``), not on ``db.metadata``,
  so ``db.create_all()`` does not create them: install them with the migrations
  (docs/howto/alembic.md) or ``sp.metadata.create_all(db.engine)``;
* the worker takes ``db.engine`` (inside an app context) and opens its own connections;
  handlers write through ``job.session``, a plain Session in the job's own transaction, with
  the same ``db.Model`` classes;
* a worker's threads run outside Flask's application context, whichever worker it is:
  ``create_handlers()`` gives the command-line worker a handler that runs each job inside
  ``app.app_context()``, so handlers may use ``current_app`` and the app's extensions.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import sqlalchemy as sa
from flask import Flask, abort, current_app, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sqla_proletarian as sp


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "fsa_example_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(255))
    confirmed: Mapped[bool] = mapped_column(default=False)


# --- Jobs ------------------------------------------------------------------------------------

handlers = sp.JobHandlers()


@handlers.register("confirm-order")
def confirm_order(job: sp.JobContext) -> None:
    """Send the confirmation (here: log it, through the app's logger), and mark the order in
    the job's transaction."""
    current_app.logger.info("confirming order %s (job %s)", job.payload["order_id"], job.job_id)
    order = job.session.get(Order, job.payload["order_id"])
    if order is not None:
        order.confirmed = True  # commits with the job's archive row, or not at all


def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    """Three more tries, 1 s, 10 s and 60 s after each failure."""
    return sp.RetryStrategy(retries=3, delays=[1, 10, 60])


#: The create_queue_worker options, which the command-line worker reads from the module.
worker_options: dict[str, Any] = {"handler_mode": "advanced", "retry_strategy": retry_strategy}


def in_app_context(app: Flask) -> Callable[[sp.JobContext], None]:
    """The handlers, each job run inside ``app``'s context: a worker's threads run outside
    any, and ``current_app`` and the app's extensions need one."""

    def run(job: sp.JobContext) -> None:
        with app.app_context():
            handlers(job)

    return run


def create_handlers() -> Callable[[sp.JobContext], None]:
    """The command-line worker's handler (``worker 'flask_sqlalchemy_app:create_handlers()'``):
    the app, built once when the worker starts, around every job."""
    return in_app_context(create_app())


def place_order(item: object) -> tuple[Order, Any]:
    """Add an order and enqueue its confirmation in the request's session; commits nothing."""
    if not isinstance(item, str) or not item.strip():
        abort(422, description=f"{item!r} is not an item")
    order = Order(item=item)
    db.session.add(order)
    db.session.flush()  # the order's id, for the job's payload
    job_id = sp.enqueue(db.session, "confirm-order", {"order_id": order.id})
    return order, job_id


# --- The app ---------------------------------------------------------------------------------


def default_database_url() -> str:
    return os.environ.get("DATABASE_URL") or (
        f"sqlite:///{Path(tempfile.gettempdir()) / 'sqla-proletarian-flask-sqlalchemy.db'}"
    )


def create_app(database_url: str | None = None) -> Flask:
    """The app on ``database_url`` (default: ``DATABASE_URL``, or SQLite in a temp folder)."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url or default_database_url()
    db.init_app(app)
    with app.app_context():
        db.create_all()  # the app's own tables (a real app: its migrations)
        sp.metadata.create_all(db.engine)  # the library's: db.create_all() does not see them

    @app.post("/orders")
    def create_order() -> Any:
        """One order and its confirmation job, committed together."""
        order, job_id = place_order((request.get_json(silent=True) or {}).get("item"))
        db.session.commit()
        return jsonify(order_id=order.id, job_id=str(job_id)), 201

    @app.post("/orders/import")
    def import_orders() -> Any:
        """All the orders of a list, or none: an invalid item aborts the whole import, and
        the orders and jobs written before it roll back with the request's session."""
        items = (request.get_json(silent=True) or {}).get("items")
        if not isinstance(items, list):
            abort(400, description="give a list of items")
        placed = [place_order(item) for item in items]  # aborts (422) at a bad item
        db.session.commit()
        return jsonify(order_ids=[order.id for order, _ in placed]), 201

    @app.get("/orders/<int:order_id>")
    def show_order(order_id: int) -> Any:
        order = db.get_or_404(Order, order_id)
        return jsonify(item=order.item, confirmed=order.confirmed)

    @app.cli.command("run-jobs")
    @click.option("--until-empty", is_flag=True, help="Run the due jobs, then exit.")
    def run_jobs(until_empty: bool) -> None:
        """Work off the job queue on db.engine: a QueueWorker until SIGTERM or Ctrl-C, or
        with --until-empty the jobs that are due, one by one."""
        if until_empty:
            ran = 0
            while sp.process_next_job(db.engine, in_app_context(app), **worker_options):
                ran += 1
            click.echo(f"ran {ran} job(s)")
            return
        worker = sp.create_queue_worker(
            db.engine, in_app_context(app), install_signal_handlers=True, **worker_options
        )
        worker.start()
        click.echo(f"{worker.worker_id} started; stop it with Ctrl-C or SIGTERM", err=True)
        worker.wait()

    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    create_app().run(port=int(os.environ.get("PORT", "5000")))
