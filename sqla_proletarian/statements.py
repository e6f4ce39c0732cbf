"""Every statement the worker runs, and the per-dialect facts they depend on.

Statements are SQLAlchemy Core, so they stay portable and no identifier is ever formatted
into SQL text. Dialect differences are data in ``Backend``, chosen once per engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    Connection,
    Engine,
    Executable,
    Select,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite

from sqla_proletarian.models import ArchivedJob, Job, JobRun

JOB = cast(Table, Job.__table__)
ARCHIVE = cast(Table, ArchivedJob.__table__)
RUN = cast(Table, JobRun.__table__)

#: The columns a claimed job is read with, in order.
JOB_COLUMNS = (
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.payload,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
)


Statement = tuple[Executable, dict[str, Any]]


#: How many run records a job has; read with the claim, locking nothing in the ledger.
_RUNS = (
    select(func.count())
    .where(RUN.c.job_id == JOB.c.job_id)
    .correlate(JOB)
    .scalar_subquery()
    .label("runs")
)


@cache
def _poll(limit: int, with_runs: bool) -> Select[Any]:
    columns = (*JOB_COLUMNS, _RUNS) if with_runs else JOB_COLUMNS
    return (
        select(*columns)
        .where(JOB.c.queue == bindparam("queue"), JOB.c.process_at <= bindparam("now"))
        .order_by(JOB.c.process_at, JOB.c.seq)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def poll(queue: str, now: datetime, limit: int = 1, *, with_runs: bool = False) -> Statement:
    """Claim up to ``limit`` due jobs of a queue, oldest first, skipping locked ones.

    ``with_runs`` adds ``runs``: the job's run records, for counting unclean ends.
    """
    return _poll(limit, with_runs), {"queue": queue, "now": now}


_INSERT_JOB = insert(JOB)


def insert_job(values: dict[str, Any]) -> Statement:
    """Enqueue one job (the caller's transaction commits it)."""
    return _INSERT_JOB, values


_RESELECT = select(*JOB_COLUMNS).where(JOB.c.job_id == bindparam("job_id"))


def reselect(job_id: uuid.UUID) -> Statement:
    """Read one job again by id (SQLite, after the run was recorded)."""
    return _RESELECT, {"job_id": job_id}


@cache
def _archive(dialect: str) -> Executable:
    # A job id already in the archive (a job enqueued again with an explicit job_id) must
    # not make the outcome unrecordable: the earlier row is kept, and the caller is told.
    # No conflict target: on PostgreSQL one would need SELECT on the archive.
    statement: Executable
    if dialect == "postgresql":
        statement = postgresql.insert(ARCHIVE).on_conflict_do_nothing()
    elif dialect == "sqlite":
        statement = sqlite.insert(ARCHIVE).on_conflict_do_nothing()
    elif dialect in ("mysql", "mariadb"):
        statement = insert(ARCHIVE).prefix_with("IGNORE")
    else:
        statement = insert(ARCHIVE)
    # rowcount says whether the row went in (0: the archive already had the job id).
    return statement.execution_options(preserve_rowcount=True)


def archive(
    job: dict[str, Any],
    *,
    status: str,
    attempts: int,
    finished_at: datetime,
    error: str | None,
    dialect: str = "",
) -> Statement:
    """Copy a job into the archive with its outcome; a row already there is kept."""
    return _archive(dialect), {
        "job_id": job["job_id"],
        "queue": job["queue"],
        "job_type": job["job_type"],
        "payload": job["payload"],
        "attempts": attempts,
        "enqueued_at": job["enqueued_at"],
        "process_at": job["process_at"],
        "status": status,
        "finished_at": finished_at,
        "error": error,
    }


_DELETE_JOB = delete(JOB).where(JOB.c.job_id == bindparam("job_id"))
_END_RUNS = delete(RUN).where(RUN.c.job_id == bindparam("job_id"))
#: PostgreSQL removes the job and its run records in one statement.
_DELETE_JOB_AND_RUNS = _DELETE_JOB.add_cte(_END_RUNS.cte("ended_runs"))


def delete_job(job_id: uuid.UUID) -> Statement:
    """Remove a finished job from the queue."""
    return _DELETE_JOB, {"job_id": job_id}


def end_runs(job_id: uuid.UUID) -> Statement:
    """Remove every run record of a job that has left the queue."""
    return _END_RUNS, {"job_id": job_id}


def delete_job_and_runs(job_id: uuid.UUID) -> Statement:
    """Remove a finished job and its run records at once (PostgreSQL)."""
    return _DELETE_JOB_AND_RUNS, {"job_id": job_id}


_RETRY = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"))
    .values(attempts=JOB.c.attempts + 1, process_at=bindparam("retry_at"))
)


def retry(job_id: uuid.UUID, retry_at: datetime) -> Statement:
    """Count the failed run and schedule the next one."""
    return _RETRY, {"id": job_id, "retry_at": retry_at}


_START_RUN = insert(RUN)


def start_run(run_id: uuid.UUID, job_id: uuid.UUID, worker_id: str, now: datetime) -> Statement:
    """Record that a run of a job has started (committed before the handler runs)."""
    return _START_RUN, {
        "run_id": run_id,
        "job_id": job_id,
        "worker_id": worker_id,
        "started_at": now,
    }


_END_RUN = delete(RUN).where(RUN.c.run_id == bindparam("run_id"))


def end_run(run_id: uuid.UUID) -> Statement:
    """Remove one run's record: it ended with a recorded outcome."""
    return _END_RUN, {"run_id": run_id}


# --- dialect facts ------------------------------------------------------------------------

#: PostgreSQL SQLSTATEs after which a retry can succeed: serialization failure, deadlock,
#: lock not available, shutdowns, idle-in-transaction timeout, and connection errors.
PG_TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57P01", "57P02", "57P03", "25P03"})
#: Of those, the ones where the server rolled the transaction back and kept the connection.
PG_LOCK_CONFLICT_SQLSTATES = frozenset({"40001", "40P01", "55P03"})
#: MySQL/MariaDB error numbers of the same kind: lock wait timeout, deadlock, server gone
#: away, lost connection, cannot connect, shutdown in progress, connection killed.
MYSQL_TRANSIENT_ERRNOS = frozenset({1205, 1213, 2003, 2006, 2013, 1053, 1927, 4031})
MYSQL_LOCK_CONFLICT_ERRNOS = frozenset({1205, 1213})


@dataclass(frozen=True)
class Backend:
    """What differs between dialects, decided once per engine."""

    name: str
    #: Isolation level the worker's connections use (None: leave the engine's).
    isolation_level: str | None
    #: Whether a claim must take the database's write lock first (SQLite).
    claim_takes_write_lock: bool
    #: Whether run records go through a second connection (False: the claim's own, SQLite).
    separate_run_connection: bool
    #: Session settings of the run-record connection that make its commits cheap, and
    #: the statements that undo them before it goes back to the pool.
    run_ledger_setup: tuple[str, ...] = ()
    run_ledger_reset: tuple[str, ...] = ()
    #: Whether one statement can delete a job and its run records (a DML CTE).
    deletes_runs_with_job: bool = False

    @contextmanager
    def worker_connection(self, engine: Engine) -> Iterator[Connection]:
        """A connection set up for claiming: isolation level, and SQLite's manual BEGIN."""
        with engine.connect() as conn:
            if self.isolation_level is not None:
                _set_up(conn, isolation_level=self.isolation_level)
            if not self.claim_takes_write_lock:
                yield conn
                return
            driver = conn.connection.driver_connection
            previous = getattr(driver, "isolation_level", "")
            driver.isolation_level = None  # type: ignore[union-attr]
            try:
                yield conn
            finally:
                if not conn.invalidated:
                    driver.isolation_level = previous  # type: ignore[union-attr]

    def idle_timeout(self, conn: Connection) -> float | None:
        """The session's idle-transaction limit in seconds where the server hides it in
        errors (MariaDB closes the connection without saying why); None when there is none.
        """
        if not getattr(conn.dialect, "is_mariadb", False):
            return None
        row = conn.exec_driver_sql(
            "SELECT @@idle_transaction_timeout, @@idle_write_transaction_timeout"
        ).one()
        conn.rollback()
        limits = [float(value) for value in row if value]
        return min(limits) if limits else None

    @contextmanager
    def run_ledger_connection(self, engine: Engine) -> Iterator[Connection]:
        """An autocommit connection for run records: each record commits on its own."""
        with engine.connect() as conn:
            _set_up(conn, isolation_level="AUTOCOMMIT")
            for statement in self.run_ledger_setup:
                conn.exec_driver_sql(statement)
            try:
                yield conn
            finally:
                if not conn.invalidated:
                    for statement in self.run_ledger_reset:
                        conn.exec_driver_sql(statement)

    def begin_claim(self, conn: Connection) -> None:
        """Open the claim's transaction (``conn.begin()`` must already have been called)."""
        if self.claim_takes_write_lock:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def _set_up(conn: Connection, **options: Any) -> None:
    """Set execution options; a connection that fails here (dead in the pool) is discarded.

    Some dialects set the isolation level through a raw cursor, so the driver's error
    arrives unwrapped; ``is_transient`` knows those too.
    """
    try:
        conn.execution_options(**options)
    except Exception:
        conn.invalidate()
        raise


def backend_for(engine: Engine) -> Backend:
    """The Backend of an engine's dialect."""
    name = engine.dialect.name
    if name == "postgresql":
        return Backend(
            name,
            isolation_level=None,
            claim_takes_write_lock=False,
            separate_run_connection=True,
            # A run record lost in a server crash only forgets an unclean end: no fsync wait.
            run_ledger_setup=("SET synchronous_commit TO OFF",),
            run_ledger_reset=("RESET synchronous_commit",),
            deletes_runs_with_job=True,
        )
    if name in ("mysql", "mariadb"):
        return Backend(
            name,
            isolation_level="READ COMMITTED",
            claim_takes_write_lock=False,
            separate_run_connection=True,
        )
    if name == "sqlite":
        return Backend(
            name,
            isolation_level=None,
            claim_takes_write_lock=True,
            separate_run_connection=False,
        )
    return Backend(
        name, isolation_level=None, claim_takes_write_lock=False, separate_run_connection=True
    )


def _driver_error(exc: BaseException) -> BaseException | None:
    """The driver's own exception behind ``exc`` (SQLAlchemy does not wrap every call)."""
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.orig
    module = type(exc).__module__
    if module.startswith(("psycopg", "pymysql", "MySQLdb", "sqlite3")):
        return exc
    return None


def _is_lock_conflict(orig: BaseException) -> bool:
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in PG_LOCK_CONFLICT_SQLSTATES:
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and isinstance(args[0], int) and args[0] in MYSQL_LOCK_CONFLICT_ERRNOS


def is_lock_conflict(exc: BaseException) -> bool:
    """A deadlock or lock wait timeout: the transaction rolled back, the connection lives."""
    orig = _driver_error(exc)
    return orig is not None and _is_lock_conflict(orig)


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is worth retrying after a pause (lost connection, deadlock...)."""
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.PendingRollbackError):
        # A pool with no free connection; a transaction left broken by an earlier error
        # (the thread's connections are replaced before the next poll).
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    orig = _driver_error(exc)
    if orig is None:
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and (sqlstate in PG_TRANSIENT_SQLSTATES or sqlstate[:2] == "08"):
        return True
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in MYSQL_TRANSIENT_ERRNOS:
        return True
    module = type(orig).__module__
    if module.startswith("sqlite3"):
        message = str(orig).lower()
        return "locked" in message or "busy" in message
    # psycopg reports a broken connection as an OperationalError without a SQLSTATE.
    return (
        module.startswith("psycopg")
        and type(orig).__name__ == "OperationalError"
        and sqlstate is None
    )


def connection_loss_hint(
    exc: BaseException, ran_for: float = 0.0, idle_timeout: float | None = None
) -> str:
    """What to change when a job's transaction was cut off by the server or the network.

    ``idle_timeout`` is the server's idle-transaction limit in seconds, where it has one the
    error does not name (MariaDB just drops the connection).
    """
    if idle_timeout and ran_for >= idle_timeout:
        return (
            f"the job ran {ran_for:.1f} s, longer than the server's idle transaction timeout "
            f"({idle_timeout:g} s: MariaDB's idle_transaction_timeout or "
            "idle_write_transaction_timeout), so the server closed the worker's session; the "
            "job will run again. Raise that timeout for the worker's sessions or make the job "
            "shorter"
        )
    orig = getattr(exc, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    message = str(orig if orig is not None else exc).lower()
    if sqlstate == "25P03" or "idle-in-transaction" in message or "idle_in_transaction" in message:
        return (
            "the job's transaction sat idle longer than PostgreSQL's "
            "idle_in_transaction_session_timeout, so the server ended the worker's session; "
            "the job will run again. Raise the timeout for the worker's role "
            "(ALTER ROLE <worker> SET idle_in_transaction_session_timeout = '<longer>') or "
            "make the job shorter"
        )
    if "idle_transaction_timeout" in message or "idle_write_transaction_timeout" in message:
        return (
            "the job's transaction sat idle longer than MariaDB's idle_transaction_timeout; "
            "the job will run again. Raise it for the worker's sessions or make the job shorter"
        )
    if sqlstate == "57014" or "statement timeout" in message:
        return (
            "a statement ran longer than statement_timeout; raise it for the worker's role "
            "or make the statement faster"
        )
    return (
        "the database connection was lost while the job ran (server restart, network, or the "
        "connection was terminated); the job's transaction rolled back and it will run again"
    )


def polling_error_hint(exc: BaseException) -> str | None:
    """A hint for polling errors a user can fix, such as tables that were never created."""
    message = str(getattr(exc, "orig", exc)).lower()
    if any(t in message for t in ("does not exist", "doesn't exist", "no such table")):
        return (
            "the job tables are missing or not visible: install them with the migrations "
            "(README, 'Migrations') or sqla_proletarian.metadata.create_all(engine)"
        )
    if "permission denied" in message or "command denied" in message:
        return "the worker's database role lacks a grant: see docs/privileges.md"
    return None


def transient_hint(exc: BaseException) -> str | None:
    """A hint for transient errors that a setting can cure."""
    if isinstance(exc, sa_exc.TimeoutError):
        return (
            "no connection was free in the engine's pool: each worker thread holds two "
            "(its claim and its run records; one on SQLite), so give the engine "
            "pool_size + max_overflow >= 2 * worker_threads plus what the app uses"
        )
    return None
