"""Every driver of every server, end to end: a worker drains jobs through it, and the errors
each server really raises through it are classified right by ``sqla_proletarian.errors``.

The drivers report the same server error differently (psycopg 3 ``sqlstate``, psycopg2
``pgcode``, PyMySQL ``args[0]``), and some errors arrive with no code at all (a connection
cut by the server, a login the server refuses), so each case is provoked for real.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived, enqueue_committed, running, wait_for

import sqla_proletarian as sp
from sqla_proletarian.errors import is_lock_conflict, is_transient

if TYPE_CHECKING:
    from conftest import Database

servers_only = pytest.mark.backends("postgresql", "mariadb")

ROWS_METADATA = sa.MetaData()
ROWS = sa.Table(
    "contended_rows",
    ROWS_METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("v", sa.Integer, nullable=False),
)


class Boom(Exception):
    """The handler's failure in these tests."""


def rows_engine(database: Database, **kwargs: Any) -> sa.Engine:
    """An engine on the database, with rows 1 and 2 of the contended table committed."""
    engine = database.engine(**kwargs)
    ROWS_METADATA.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(ROWS), [{"id": 1, "v": 0}, {"id": 2, "v": 0}])
    return engine


def bump(row: int) -> sa.Update:
    return sa.update(ROWS).where(ROWS.c.id == row).values(v=ROWS.c.v + 1)


def raised(action: Callable[[], object]) -> sa.exc.DBAPIError:
    """The database error ``action`` raises (the test fails if it raises none)."""
    with pytest.raises(sa.exc.DBAPIError) as info:
        action()
    return info.value


def assert_classified(error: sa.exc.DBAPIError, *, lock_conflict: bool, transient: bool) -> None:
    """Both the SQLAlchemy error and the driver's own exception behind it are classified so
    (the driver's escapes unwrapped from some calls)."""
    for exc in (error, error.orig):
        assert (is_lock_conflict(exc), is_transient(exc)) == (lock_conflict, transient), (
            f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        )


def pg(database: Database) -> bool:
    return database.backend == "postgresql"


# --- the worker, through each driver -------------------------------------------------------


def test_a_worker_archives_successes_and_failures_through_every_driver(
    driver_database: Database,
) -> None:
    engine = driver_database.engine()
    assert engine.dialect.driver == driver_database.driver
    good = {enqueue_committed(engine, "ok", {"n": n}) for n in range(6)}
    bad = {enqueue_committed(engine, "bad", {"n": n}) for n in range(2)}

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "bad":
            raise Boom(f"cannot handle {payload}")

    worker = sp.create_queue_worker(engine, handler, worker_threads=2, polling_interval=0.02)
    with running(worker):
        assert wait_for(lambda: len(archived(engine)) == 8, timeout=20), archived(engine)
    statuses = {job.job_id: job.status for job in archived(engine)}
    assert statuses == {job_id: "success" for job_id in good} | {
        job_id: "failure" for job_id in bad
    }


# --- lock conflicts: the server rolled back, the connection lives ----------------------------


@servers_only
def test_a_real_deadlock_is_a_transient_lock_conflict(driver_database: Database) -> None:
    """Two connections lock rows 1 and 2 in opposite orders: the server kills one."""
    engine = rows_engine(driver_database)
    both_hold_one = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def lock(first: int, second: int) -> None:
        try:
            with engine.connect() as conn:
                if pg(driver_database):
                    conn.exec_driver_sql("SET deadlock_timeout = '50ms'")  # 1 s by default
                conn.execute(bump(first))
                both_hold_one.wait()
                conn.execute(bump(second))
                conn.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lock, args=order) for order in ((1, 2), (2, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert len(errors) == 1, errors
    assert isinstance(errors[0], sa.exc.DBAPIError), errors
    assert_classified(errors[0], lock_conflict=True, transient=True)
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.select(ROWS.c.v))) == [(1,), (1,)], "the other committed"


@contextmanager
def row_one_locked(engine: sa.Engine) -> Iterator[None]:
    """Row 1 locked by another open transaction."""
    with engine.connect() as holder:
        holder.execute(bump(1))
        yield
        holder.rollback()


@servers_only
def test_a_real_lock_wait_timeout_is_a_transient_lock_conflict(
    driver_database: Database,
) -> None:
    """Waiting longer than the session allows for a row another transaction holds."""
    engine = rows_engine(driver_database)
    with row_one_locked(engine), engine.connect() as waiter:
        if pg(driver_database):
            waiter.exec_driver_sql("SET lock_timeout = '100ms'")  # 55P03
        else:
            waiter.exec_driver_sql("SET innodb_lock_wait_timeout = 1")  # 1205, after 1 s
        error = raised(lambda: waiter.execute(bump(1)))
    assert_classified(error, lock_conflict=True, transient=True)


@pytest.mark.backends("postgresql")
def test_a_real_serialization_failure_is_a_transient_lock_conflict(
    driver_database: Database,
) -> None:
    """REPEATABLE READ: updating a row another transaction changed since the snapshot is
    40001 (MariaDB's REPEATABLE READ updates the newest version instead)."""
    engine = rows_engine(driver_database)
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as reader:
        assert reader.execute(sa.select(ROWS.c.v).where(ROWS.c.id == 1)).scalar_one() == 0
        with engine.begin() as writer:
            writer.execute(bump(1))
        error = raised(lambda: reader.execute(bump(1)))
    assert_classified(error, lock_conflict=True, transient=True)


# --- transient: wait and try again, on a fresh connection if need be ------------------------


@servers_only
def test_a_real_statement_timeout_is_transient_not_a_lock_conflict(
    driver_database: Database,
) -> None:
    engine = driver_database.engine()
    with engine.connect() as conn:
        if pg(driver_database):
            conn.exec_driver_sql("SET statement_timeout = '50ms'")  # 57014
            error = raised(lambda: conn.exec_driver_sql("SELECT pg_sleep(1)"))
        else:
            conn.exec_driver_sql("SET max_statement_time = 0.05")  # 1969
            error = raised(lambda: conn.exec_driver_sql("SELECT SLEEP(1)"))
    assert_classified(error, lock_conflict=False, transient=True)


@servers_only
def test_a_write_in_a_real_read_only_transaction_is_transient(
    driver_database: Database,
) -> None:
    """What a worker meets on a server that became a read-only standby: 25006 / 1792."""
    engine = rows_engine(driver_database)
    with engine.connect() as conn:
        if pg(driver_database):
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        else:
            conn.exec_driver_sql("START TRANSACTION READ ONLY")
        error = raised(lambda: conn.execute(bump(1)))
    assert_classified(error, lock_conflict=False, transient=True)


def session_id(conn: sa.Connection) -> int:
    """The server's id of a connection's session; its transaction is ended."""
    query = (
        "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    )
    value = int(conn.exec_driver_sql(query).scalar_one())
    conn.commit()
    return value


def end_session(admin: sa.Engine, pid: int) -> None:
    """End a session as an administrator would (pg_terminate_backend, KILL), and wait until
    the server has closed it."""
    postgresql = admin.dialect.name == "postgresql"
    with admin.connect() as conn:
        if postgresql:
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
            alive = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
        else:
            conn.exec_driver_sql(f"KILL {pid}")
            alive = f"SELECT count(*) FROM information_schema.processlist WHERE id = {pid}"
        conn.commit()

        def gone() -> bool:
            found = conn.exec_driver_sql(alive).scalar_one()
            conn.rollback()
            return found == 0

        assert wait_for(gone, timeout=10), f"session {pid} is still there"


@servers_only
def test_a_session_the_server_terminated_is_transient(driver_database: Database) -> None:
    """The next statement on a session another one ended fails, without an error code on
    some drivers (psycopg2 and PyMySQL only see the connection closed)."""
    engine = driver_database.engine()
    with engine.connect() as victim:
        end_session(driver_database.engine(), session_id(victim))
        error = raised(lambda: victim.exec_driver_sql("SELECT 1"))
    assert_classified(error, lock_conflict=False, transient=True)


@servers_only
def test_setting_up_a_dead_pooled_connection_fails_transient_even_unwrapped(
    driver_database: Database,
) -> None:
    """A pooled connection whose session was ended fails when the worker next sets its
    isolation level, which some dialects do on the raw driver connection: the driver's
    own error then reaches the worker unwrapped."""
    engine = driver_database.engine(pool_size=1, max_overflow=0)
    with engine.connect() as conn:
        pid = session_id(conn)
    end_session(driver_database.engine(), pid)
    driver_errors = (sa.exc.DBAPIError, engine.dialect.loaded_dbapi.Error)
    with engine.connect() as conn, pytest.raises(driver_errors) as info:
        conn.execution_options(isolation_level="READ COMMITTED")
        conn.exec_driver_sql("SELECT 1")
    assert is_transient(info.value), repr(info.value)
    assert not is_lock_conflict(info.value)


@contextmanager
def login_limited_to_one_connection(database: Database) -> Iterator[sa.Engine]:
    """An engine logging in as a new role/user that may hold one connection at a time."""
    name = f"sp_one_{uuid.uuid4().hex[:12]}"
    admin = database.engine(isolation_level="AUTOCOMMIT")
    if pg(database):  # roles are cluster-wide: a unique name, dropped after
        create = f"CREATE ROLE {name} LOGIN CONNECTION LIMIT 1"
        drop = f"DROP ROLE IF EXISTS {name}"
    else:
        account = f"'{name}'@'127.0.0.1'"
        create = f"CREATE USER {account} WITH MAX_USER_CONNECTIONS 1"
        drop = f"DROP USER IF EXISTS {account}"
    with admin.connect() as conn:
        conn.exec_driver_sql(create)
        if not pg(database):
            conn.exec_driver_sql(f"GRANT SELECT ON {database.url.database}.* TO {account}")
    limited = sa.create_engine(database.url.set(username=name), poolclass=sa.pool.NullPool)
    try:
        yield limited
    finally:
        limited.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(drop)


@servers_only
def test_too_many_connections_is_transient(driver_database: Database) -> None:
    """The server refuses a second login of a role limited to one connection: a retry
    succeeds once a connection is closed. PostgreSQL's 53300 reaches neither psycopg nor
    psycopg2 as a SQLSTATE (a refused login has none); MariaDB's per-account limit is 1226
    (1203 is the server-wide max_user_connections)."""
    with login_limited_to_one_connection(driver_database) as limited, limited.connect():
        error = raised(limited.connect)
    if pg(driver_database):
        assert "too many connections for role" in str(error.orig)
    else:
        assert error.orig.args[0] == 1226, error.orig
    assert_classified(error, lock_conflict=False, transient=True)


# --- neither: a retry cannot help ---------------------------------------------------------


def test_a_missing_table_is_neither_transient_nor_a_lock_conflict(
    driver_database: Database,
) -> None:
    engine = driver_database.engine()
    with engine.connect() as conn:
        error = raised(lambda: conn.exec_driver_sql("SELECT * FROM no_such_table"))
    assert_classified(error, lock_conflict=False, transient=False)


@servers_only
def test_a_login_to_a_missing_database_is_not_transient(driver_database: Database) -> None:
    """A URL naming no database (PostgreSQL 3D000, MariaDB 1049) stays wrong however long
    the worker waits; PostgreSQL's drivers give it no SQLSTATE, like a lost connection."""
    engine = sa.create_engine(
        driver_database.url.set(database="sp_no_such_database"), poolclass=sa.pool.NullPool
    )
    error = raised(engine.connect)
    assert_classified(error, lock_conflict=False, transient=False)


@pytest.mark.backends("sqlite")
def test_a_real_sqlite_busy_database_is_transient(driver_database: Database) -> None:
    """A second writer on a SQLite file while another holds the write lock: 'database is
    locked' once its busy timeout (here none) runs out."""
    engine = rows_engine(driver_database, connect_args={"timeout": 0})
    with row_one_locked(engine), engine.connect() as writer:
        error = raised(lambda: writer.execute(bump(2)))
    assert "locked" in str(error)
    assert_classified(error, lock_conflict=False, transient=True)
