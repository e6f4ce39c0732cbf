"""Enqueue: add a job to the caller's own transaction, never committing it."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, scoped_session

from sqla_proletarian.errors import NotATransactionError, ProletarianError
from sqla_proletarian.models import Job
from sqla_proletarian.statements import insert_job
from sqla_proletarian.values import DEFAULT_QUEUE, build_job_values

#: What enqueue() joins: a Session (or a subclass, such as SQLModel's), a scoped_session
#: (Flask-SQLAlchemy's ``db.session``), or a Connection.
Transaction = Session | scoped_session[Any] | Connection


def enqueue(
    session_or_connection: Transaction,
    job_type: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    **options: Any,
) -> uuid.UUID:
    """Add a job to the caller's transaction and return its id. Never commits.

    With a Session the job joins the unit of work (it is flushed with the rest); with a
    Connection it is inserted at once in the connection's transaction. Commit and the job
    will run; roll back and it never existed. A ``scoped_session`` joins the current
    session of its scope. Further keyword options: ``job_id``, ``serializer``,
    ``job_id_strategy``, ``clock``.
    """
    if isinstance(session_or_connection, scoped_session):
        session_or_connection = session_or_connection()
    if isinstance(session_or_connection, Session):
        _check_session(session_or_connection)
        job = Job(
            job_type=job_type,
            payload=payload,
            queue=queue,
            process_at=process_at,
            process_in=process_in,
            **options,
        )
        session_or_connection.add(job)
        return job.job_id
    if isinstance(session_or_connection, Connection):
        _check_connection(session_or_connection)
        values = build_job_values(
            job_type,
            payload,
            queue=queue,
            process_at=process_at,
            process_in=process_in,
            **options,
        )
        session_or_connection.execute(*insert_job(values))
        job_id: uuid.UUID = values["job_id"]
        return job_id
    if isinstance(session_or_connection, Engine):
        raise NotATransactionError(
            "enqueue() was given an Engine, which has no transaction to join, so the job "
            "could not commit or roll back with your data. Pass the Session or Connection "
            "of the transaction the job belongs to (e.g. `with engine.begin() as conn: "
            "enqueue(conn, ...)`)."
        )
    raise NotATransactionError(
        f"enqueue() needs a sqlalchemy Session or Connection, not "
        f"{type(session_or_connection).__name__}"
    )


def _check_session(session: Session) -> None:
    if not session.is_active:
        raise ProletarianError(
            "the Session's transaction has failed and must be rolled back first "
            "(call session.rollback()); the job was not added"
        )


def _check_connection(connection: Connection) -> None:
    if connection.closed:
        raise ProletarianError(
            "the Connection is closed; enqueue inside an open transaction "
            "(e.g. `with engine.begin() as conn:`)"
        )
    if connection.invalidated:
        raise ProletarianError(
            "the Connection was invalidated (its database connection was lost); roll back "
            "and enqueue again in a new transaction"
        )
