"""Enqueue: add a job to the caller's own transaction, never committing it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Mapper, Session, scoped_session

from sqla_proletarian import wakeups
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import (
    InvalidJobError,
    NotATransactionError,
    ProletarianError,
)
from sqla_proletarian.models import Job
from sqla_proletarian.serialization import Serializer
from sqla_proletarian.statements import insert_job, insert_jobs
from sqla_proletarian.statements.enqueue import (
    DriverInsert,
    driver_insert,
    many_parameters,
    row_parameters,
)
from sqla_proletarian.unique import enqueue_unique
from sqla_proletarian.values import (
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    Clock,
    JobIdStrategy,
    build_job_values,
    build_many_job_values,
)
from sqla_proletarian.workflows import (
    OnDependencyFailure,
    check_depends_on,
    make_waiting,
    read_dependencies,
    write_dependents,
)

#: What enqueue() joins: a Session (or a subclass, such as SQLModel's), a scoped_session
#: (Flask-SQLAlchemy's ``db.session``), or a Connection.
Transaction = Session | scoped_session[Any] | Connection

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session

    #: What enqueue() joins without awaiting: also an AsyncSession's unit of work.
    SessionOrConnection = Transaction | AsyncSession | async_scoped_session[Any]


def enqueue(
    session_or_connection: SessionOrConnection,
    job_type: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    unique_key: str | None = None,
    job_id: uuid.UUID | None = None,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    concurrency_key: str | None = None,
    depends_on: Iterable[uuid.UUID] | None = None,
    on_dependency_failure: OnDependencyFailure = "cancel",
) -> uuid.UUID:
    """Add a job to the caller's transaction and return its id. Never commits.

    With a Session the job joins the unit of work (it is flushed with the rest); with a
    Connection it is inserted at once in the connection's transaction. Commit and the job
    will run; roll back and it never existed. A ``scoped_session`` joins the current
    session of its scope. An AsyncSession (or async_scoped_session) is joined the same way,
    without awaiting: the job is flushed with its next flush or commit. ``priority``
    (``MIN_PRIORITY`` to ``MAX_PRIORITY``, default 0): higher runs first.

    ``unique_key``: while a job of the queue holding that key is queued or running, nothing
    is added and that job's id is returned; the key is free again once the job is archived,
    or when the transaction that took it rolls back. Such a job is inserted at once, also
    with a Session (through its connection, in its transaction; with an AsyncSession use
    ``await sp.enqueue_async(...)``). ``job_id``: the job's id (default: made by
    ``job_id_strategy``, ``uuid4``); ``serializer``: how the payload is stored (JSON);
    ``clock``: the time the job is enqueued at (``utc_now``). ``concurrency_key``: what the
    queue's per-key limits count the job by (``set_queue_limits``); without one, the job
    counts toward the queue's own limits only.

    ``depends_on``: ids of jobs (enqueued earlier in this transaction, or committed: queued,
    running or archived) that must all succeed before this job is due; it waits until then.
    ``on_dependency_failure``: when one of them fails or is cancelled, ``"cancel"`` (the
    default) archives this job as cancelled (its ``error`` names the dependency), and its own
    dependents in turn; ``"run"`` runs it anyway. Such a job is inserted at once, also with a
    Session (which is flushed first, so that jobs added to it can be depended on; with an
    AsyncSession use ``await sp.enqueue_async(...)``). An unknown id raises
    ``InvalidJobError`` naming it, and nothing is written.
    """
    given = session_or_connection
    session_or_connection = _sync_session_of(session_or_connection)
    dependencies = check_depends_on(depends_on, on_dependency_failure)
    fields: dict[str, Any] = {
        "queue": queue,
        "process_at": process_at,
        "process_in": process_in,
        "priority": priority,
        "job_id": job_id,
        "serializer": serializer,
        "job_id_strategy": job_id_strategy,
        "clock": clock,
        "concurrency_key": concurrency_key,
    }
    if dependencies or unique_key is not None:
        # Inserted at once, through the Session's connection (flushed first for dependencies).
        if session_or_connection is not given and not isinstance(given, Session):
            what = "depends_on" if dependencies else "a unique_key"
            raise NotATransactionError(
                f"enqueue() with {what} inserts the job at once, which an AsyncSession "
                "can only do in an awaited call: use `await sp.enqueue_async(session, ..., "
                f"{what.removeprefix('a ')}=...)`"
            )
        values = build_job_values(job_type, payload, unique_key=unique_key, **fields)
        connection = _connection_of(session_or_connection, "enqueue", flush=bool(dependencies))
        if not dependencies:
            return enqueue_unique(connection, values)
        return _enqueue_dependents(connection, [values], dependencies, on_dependency_failure)[0]
    if isinstance(session_or_connection, scoped_session):
        session_or_connection = session_or_connection()
    if isinstance(session_or_connection, Session):
        _check_session(session_or_connection)
        job = Job(job_type=job_type, payload=payload, **fields)
        session_or_connection.add(job)
        return job.job_id
    if isinstance(session_or_connection, Connection):
        _check_connection(session_or_connection)
        values = build_job_values(job_type, payload, **fields)
        insert = driver_insert(session_or_connection.dialect, many=False)
        if insert is None:
            session_or_connection.execute(*insert_job(values))
        else:
            session_or_connection.exec_driver_sql(insert.statement, row_parameters(insert, values))
        wakeups.enqueued(session_or_connection, {queue})
        made: uuid.UUID = values["job_id"]
        return made
    raise _not_a_transaction(session_or_connection, "enqueue")


#: Jobs per INSERT statement of enqueue_many, where it sends more than one (psycopg2's
#: unnest arrays; drivers without a driver-level path).
ENQUEUE_MANY_CHUNK = 1000


def enqueue_many(
    session_or_connection: Transaction,
    jobs: Iterable[tuple[str, Any] | tuple[str, Any, str | None]],
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    job_id: None = None,
    concurrency_key: str | None = None,
    depends_on: Iterable[uuid.UUID] | None = None,
    on_dependency_failure: OnDependencyFailure = "cancel",
) -> list[uuid.UUID]:
    """Add many jobs, ``(job_type, payload)`` pairs or ``(job_type, payload, unique_key)``
    triples, to the caller's transaction; their ids in order. Never commits.

    Every job is validated before anything is written: a bad one raises ``InvalidJobError``
    naming its index, and nothing is written. The rows go in through the driver's fastest
    path (psycopg 3: binary COPY; psycopg2: unnest arrays; PyMySQL and SQLite: executemany;
    other drivers: one statement per 1,000 jobs), through the Session's connection in its
    transaction, or the Connection's. A job with a
    unique key goes in with a statement of its own, as ``enqueue()`` would add it: where a
    job of the queue holds its key (one queued earlier, or one before it in ``jobs``), its id
    is that job's. ``serializer``, ``job_id_strategy`` and ``clock`` apply to every job, as
    for ``enqueue()``; ``job_id`` is refused (each job gets an id of its own);
    ``concurrency_key`` is every job's. ``depends_on`` and ``on_dependency_failure`` (as for
    ``enqueue()``) apply to every job of the call: each waits for all of ``depends_on``.
    """
    dependencies = check_depends_on(depends_on, on_dependency_failure)
    if job_id is not None:
        raise InvalidJobError(
            "job_id", "enqueue_many() makes one id per job; give job_id_strategy instead"
        )
    rows = build_many_job_values(
        jobs,
        queue=queue,
        process_at=process_at,
        process_in=process_in,
        priority=priority,
        serializer=serializer,
        job_id_strategy=job_id_strategy,
        clock=clock,
        concurrency_key=concurrency_key,
    )
    connection = _connection_of(session_or_connection, "enqueue_many", flush=bool(dependencies))
    if dependencies:
        return _enqueue_dependents(connection, rows, dependencies, on_dependency_failure)
    plain = [row for row in rows if row["unique_key"] is None]
    if plain:
        _insert_many(connection, plain)
        wakeups.enqueued(connection, {queue})
    return [
        row["job_id"] if row["unique_key"] is None else enqueue_unique(connection, row)
        for row in rows
    ]


def _enqueue_dependents(
    connection: Connection,
    rows: list[dict[str, Any]],
    depends_on: list[uuid.UUID],
    on_dependency_failure: str,
) -> list[uuid.UUID]:
    """Enqueue jobs that wait for ``depends_on`` (see ``sqla_proletarian.workflows``); their
    ids (a unique key's holder's, where a job of the queue holds it)."""
    dialect = dialect_of(connection)
    found = read_dependencies(
        connection, depends_on, on_dependency_failure, own=[row["job_id"] for row in rows]
    )
    if found.cancels:
        write_dependents(connection, rows, found, dialect)
        return [row["job_id"] for row in rows]
    ids = []
    plain = []
    for row in rows:
        make_waiting(row, found)
        if row["unique_key"] is None:
            plain.append(row)
            ids.append(row["job_id"])
            continue
        holder = enqueue_unique(connection, row)
        if holder == row["job_id"]:
            write_dependents(connection, [row], found, dialect, inserted=True)
        ids.append(holder)
    if plain:
        write_dependents(connection, plain, found, dialect)
    if not found.live:
        wakeups.enqueued(connection, {row["queue"] for row in rows})
    return ids


def _insert_many(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """Write jobs without unique keys through the driver's fastest path (``DriverInsert``),
    or, for drivers without one, the Core statement in chunks of ``ENQUEUE_MANY_CHUNK``."""
    bulk = driver_insert(connection.dialect, many=True)
    if bulk is None:
        unnest = dialect_of(connection).bulk_insert_unnest
        for start in range(0, len(rows), ENQUEUE_MANY_CHUNK):
            chunk = rows[start : start + ENQUEUE_MANY_CHUNK]
            connection.execute(*insert_jobs(chunk, unnest=unnest))
        return
    if bulk.form == "copy":
        _copy(connection, bulk, rows)
        return
    chunk_size = ENQUEUE_MANY_CHUNK if bulk.form == "unnest" else len(rows)
    for start in range(0, len(rows), chunk_size):
        chunk = rows[start : start + chunk_size]
        connection.exec_driver_sql(bulk.statement, many_parameters(bulk, chunk))


def _copy(connection: Connection, bulk: DriverInsert, rows: list[dict[str, Any]]) -> None:
    """psycopg 3's binary COPY of ``rows`` in the connection's transaction (begun here if the
    Connection has not begun one, as an execute would); driver errors come out as
    SQLAlchemy's, as from an execute."""
    if not connection.in_transaction():
        connection.begin()
    dbapi = connection.dialect.loaded_dbapi
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        with cursor.copy(bulk.statement) as copy:
            copy.set_types(bulk.copy_types)
            for row in many_parameters(bulk, rows):
                copy.write_row(row)
    except dbapi.Error as exc:
        raise sa_exc.DBAPIError.instance(
            str(bulk.statement), None, exc, dbapi.Error, dialect=connection.dialect
        ) from exc
    finally:
        cursor.close()


@event.listens_for(Job, "after_insert")
def _job_flushed(mapper: Mapper[Job], connection: Connection, job: Job) -> None:
    """A Session flushed a job (``enqueue()`` or ``session.add(Job(...))``): wake workers
    when its transaction commits."""
    wakeups.enqueued(connection, {job.queue})


def _connection_of(
    session_or_connection: Transaction, caller: str, *, flush: bool = False
) -> Connection:
    """The Connection of the caller's transaction (a Session's, in its transaction; with
    ``flush``, after the Session has flushed what was added to it)."""
    if isinstance(session_or_connection, scoped_session):
        session_or_connection = session_or_connection()
    if isinstance(session_or_connection, Session):
        _check_session(session_or_connection)
        if flush:
            session_or_connection.flush()
        return session_or_connection.connection()
    if isinstance(session_or_connection, Connection):
        _check_connection(session_or_connection)
        return session_or_connection
    raise _not_a_transaction(session_or_connection, caller)


def _asyncio_ext() -> Any:
    """SQLAlchemy's asyncio extension if it is imported, else None: it needs greenlet, and
    until it is imported no object can be an AsyncSession, AsyncConnection or AsyncEngine."""
    return sys.modules.get("sqlalchemy.ext.asyncio")


def _sync_session_of(value: SessionOrConnection) -> Transaction:
    """The sync Session of an AsyncSession (or async_scoped_session); anything else as is."""
    ext = _asyncio_ext()
    if ext is not None:
        if isinstance(value, ext.async_scoped_session):
            value = value()
        if isinstance(value, ext.AsyncSession):
            return cast("Session", value.sync_session)
    return cast("Transaction", value)


def _not_a_transaction(value: object, caller: str) -> NotATransactionError:
    ext = _asyncio_ext()
    if ext is not None and isinstance(value, ext.AsyncEngine):
        awaited = caller.removesuffix("_async") + "_async"
        return NotATransactionError(
            f"{caller}() was given an AsyncEngine, which has no transaction to join, so the "
            "job could not commit or roll back with your data. Pass the AsyncSession or "
            "AsyncConnection of the transaction the job belongs to (e.g. `async with "
            f"engine.begin() as conn: await sp.{awaited}(conn, ...)`)."
        )
    if ext is not None and isinstance(value, ext.AsyncConnection | ext.AsyncSession):
        return NotATransactionError(
            f"{caller}() would have to wait for the database through this "
            f"{type(value).__name__}, which only an awaited call can do: use "
            f"`await sp.{caller}_async(...)`"
        )
    if isinstance(value, Engine):
        return NotATransactionError(
            f"{caller}() was given an Engine, which has no transaction to join, so the job "
            "could not commit or roll back with your data. Pass the Session or Connection "
            f"of the transaction the job belongs to (e.g. `with engine.begin() as conn: "
            f"{caller}(conn, ...)`)."
        )
    return NotATransactionError(
        f"{caller}() needs a sqlalchemy Session or Connection, not {type(value).__name__}"
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
